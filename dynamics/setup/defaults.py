"""Default η and horizon of a run, read off the instance (docs/conventions.md, "Choosing η").

With η = c/d the one-step drift of m is η h(m)(u_perp² − m²) (Prop. 4) minus the
renormalisation term ≈ (η²d/2) m E[g²](m), g the scalar of the sample gradient; their ratio
ρ(m) = c m E[g²] / (2 h(m)(u_perp² − m²)) sets the noise floor, whatever d. The default c
is the largest c ≤ 0.05 with ρ ≤ 1/2 at m = 0.9 u_perp, so the mean overlap passes 0.9 u_perp.
The default horizon integrates the corrected drift from m = 1/√d to 0.9 u_perp (along the
sign of h), with a 25 % margin. E[g²](m) is a Monte Carlo average in û's reduced
coordinates (independent of d). Without the theory (``hermite``) or where h changes sign on
the path, c = 0.05 and T = 100 d.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import hermite
from dynamics.instances.instance import Instance
from dynamics.lazy import lazy_import
from dynamics.learners import Finetune, Problem

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["ETA_C", "choose_c", "has_population_ode", "default_eta", "default_steps",
           "gradient_second_moment"]

ETA_C = 0.05  # upper bound on c = ηd
TARGET = 0.9  # fraction of u_perp the defaults aim past
RHO_MAX = 0.5  # allowed noise/drift ratio at the target
MARGIN = 1.25
FALLBACK_PER_D = 100
MAX_PER_D = 5000
_GRID = 24  # m values for E[g²]
_SAMPLES = 20_000


def gradient_second_moment(instance: Instance, m, samples: int = _SAMPLES,
                           seed: int = 0) -> np.ndarray:
    """E[g²] at overlaps m for û ⊥ span W (projected learner, frozen ĉ), by Monte Carlo."""
    k = instance.k
    small = dataclasses.replace(instance, d=k + 2)
    m = np.atleast_1d(np.asarray(m, dtype=float))
    problem = Problem.from_instances([small] * m.size, torch.device("cpu"), torch.float64)
    learner = Finetune(problem, eta=1.0, eta_c=1.0)
    alpha = np.clip(m / instance.u_perp, -1.0, 1.0)
    u = np.zeros((m.size, k + 2))
    u[:, k], u[:, k + 1] = alpha, np.sqrt(1.0 - alpha**2)
    state = learner.init_state(u)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((1, samples, k + 2), generator=gen, dtype=torch.float64)
    x = x.expand(m.size, samples, k + 2)  # common random numbers across m
    terms = learner.terms(state, x, learner.prepare(state, x[:, None]))
    return (terms.g**2).mean(-1).numpy()


def has_population_ode(instance: Instance) -> bool:
    """Whether the instance has an overlap m and its population ODE: unit rows and a
    fine-tuned teacher (not the App. B conventions, not a committee teacher)."""
    return instance.unit_rows and not instance.committee


def _theory(instance: Instance):
    """(sign of h(0), grid m (along that sign), |h|, E[g²]) or None without the theory
    (e.g. the App. B conventions, whose rows are not unit vectors, or a committee teacher,
    which has no overlap m)."""
    if not has_population_ode(instance):
        return None
    try:

        sign = float(np.sign(np.asarray(hermite.h(instance, 0.0), dtype=float).reshape(-1)[0]))
        lo, hi = 1.0 / math.sqrt(instance.d), TARGET * instance.u_perp
        m = np.linspace(lo, hi, _GRID)
        hv = sign * np.asarray(hermite.h(instance, sign * m), dtype=float).reshape(-1)
    except (ImportError, AttributeError):
        return None
    if sign == 0 or not np.all(np.isfinite(hv)) or np.any(hv <= 0):
        return None
    return sign, m, hv, gradient_second_moment(instance, sign * m)


def choose_c(instance: Instance, theory=None) -> float:
    """Largest c ≤ ETA_C with noise/drift ratio ρ ≤ RHO_MAX at m = TARGET·u_perp."""
    theory = theory or _theory(instance)
    if theory is None:
        return ETA_C
    _, m, hv, s2 = theory
    gap = instance.u_perp**2 - m[-1] ** 2
    return float(min(ETA_C, 2.0 * RHO_MAX * hv[-1] * gap / (m[-1] * s2[-1])))


def default_eta(instance: Instance) -> float:
    """η = c/d with c from :func:`choose_c`."""
    return choose_c(instance) / instance.d


def default_steps(instance: Instance, eta: float) -> int:
    """Steps for the (noise-corrected) mean overlap to reach TARGET·u_perp, with margin."""
    d, theory = instance.d, _theory(instance)
    t = FALLBACK_PER_D * d
    if theory is not None:
        _, m, hv, s2 = theory
        drift = hv * (instance.u_perp**2 - m**2) - 0.5 * eta * d * m * s2
        if np.all(drift > 0):
            f = 1.0 / (eta * drift)
            t = MARGIN * float(np.sum((f[1:] + f[:-1]) * np.diff(m)) / 2)
    return int(min(max(t, d), MAX_PER_D * d))
