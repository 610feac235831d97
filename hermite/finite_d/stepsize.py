r"""Step-size calculator: the largest η whose predicted noise floor still gives ⟨û,u⟩² ≥ 1 − ε.

Criterion. The corrected mean-field map (``hermite.finite_d.corrected_ode``) reaches the overlap
m* = √(1 − ε) from m₀ = 0⁺ (in the direction s = sign h(0)) iff its drift keeps the sign s on
the whole path, s·D(s·μ) > 0 for 0 < μ < μ* = m*/u⊥ (it needs ε > u_alpha², since a projected
û has |m| ≤ u⊥). For the second-order drift (μ units, E[S²‖Px‖²] = E[g²(t² + ‖r‖²)])

    s·D = η s h̃(sμ)(1 − μ²) − (η²/2) μ E[S²‖Px‖²](sμ) ≥ 0
      ⇔ η ≤ η_c(μ) = 2 s h̃(sμ)(1 − μ²) / (μ E[S²‖Px‖²](sμ)),

so η_max = min_{0<μ≤μ*} η_c(μ) in closed form from the noise moments (η_max = 0 when s·h̃
changes sign before μ*: then even the population flow stalls). ``method="exact"`` refines it
with the exact one-step drift: Brent on η of s·D_exact(η, s·μ*) = 0 (the binding point when
η_c is decreasing), then checks s·D_exact ≥ 0 on the grid below μ*.

The criterion is on the mean (the root of the drift): individual runs scatter about it with
the stationary sd of :func:`hermite.finite_d.corrected_ode.stationary_moments`. Checked on ReLU, k
= 5, d = 200, frozen ĉ, ε = 0.1 (η_max = 9.66e-4): 4096 runs at 0.9·η_max end at ⟨û,u⟩² = 0.911
(87% of runs ≥ 0.9), at 1.1·η_max at 0.888 (17% of runs ≥ 0.9).

The paper's step sizes for the same instance (``hermite.flows.theorems``): Theorem 11 (orthonormal
W, ξ = 1), 12 (orthonormal, ξ = ξ̄√k), 13 (separated W), each with the unspecified constants at 1
(C_δ = γ = 1: upper ends), and Theorem 16 with the instance's S_k = min(|h(0)|/2, min h) and
V_k = max(1, max_μ max(E‖∇̂L‖²/d, E⟨∇̂L,u⟩²)) measured here (Condition 2 with p = 1, μ₁ = 1).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import scipy.optimize

from hermite.finite_d.corrected_ode import noise_floor
from hermite.finite_d.noise import DEFAULT_SAMPLES, _c_hat, h_tilde, noise_moments, one_step_moments
from hermite.flows.theorems import (
    theorem11_schedule,
    theorem12_schedule,
    theorem13_schedule,
    theorem16_schedule,
)

__all__ = ["StepSizeReport", "max_step_size", "measured_variance_bound"]

_ORTHO_TOL = 1e-10


@dataclass(frozen=True)
class StepSizeReport:
    """η_max from the noise floor next to the theorems' η for the same instance.

    eta_max : largest η with predicted floor m_∞² ≥ 1 − ε. floor_at_eta_max : m_∞(η_max).
    binding_m : the overlap where the constraint binds. eta_theorem, theorem : the paper's η
    for this instance's regime (11, 12 or 13). eta_theorem16 : Theorem 16 with measured
    S_k, V_k. floor_at_theorem : m_∞ at η_theorem. ratio : eta_max/eta_theorem.
    """

    eps: float
    d: int
    method: str
    eta_max: float
    floor_at_eta_max: float
    binding_m: float
    theorem: str
    eta_theorem: float
    eta_theorem16: float
    floor_at_theorem: float
    ratio: float
    S_k: float
    V_k: float
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def measured_variance_bound(instance, d=None, c_hat=None, samples=DEFAULT_SAMPLES, seed=0,
                            grid=33) -> float:
    """max over m of max(E‖∇̂L‖²/d, E⟨∇̂L, u⟩²) (Condition 2, p = 1), by the noise moments."""
    d = instance.d if d is None else int(d)
    m = instance.u_perp * np.cos(np.linspace(0.0, math.pi, grid))
    nm = noise_moments(instance, m, d=d, c_hat=c_hat, samples=samples, seed=seed)
    grad_norm = nm.e_s2_px2 / d
    along_u = instance.u_perp**2 * (1 - nm.mu**2) * nm.e_s2_t2
    return float(np.max(np.maximum(grad_norm, along_u)))


def _theorem(instance, eps, d):
    ortho = np.allclose(instance.gram, np.eye(instance.k), atol=_ORTHO_TOL)
    if ortho and abs(instance.xi - 1.0) < 1e-12:
        return theorem11_schedule(instance, eps, d=d)
    if ortho:
        return theorem12_schedule(instance, eps, d=d)
    return theorem13_schedule(instance, eps, d=d)


def max_step_size(instance, d=None, eps=0.1, *, method="second_order", c_hat=None,
                  label_noise=0.0, grid=64, samples=DEFAULT_SAMPLES, seed=0,
                  refine_samples=2**20) -> StepSizeReport:
    """Largest η whose predicted floor gives ⟨û, u⟩² ≥ 1 − ε, beside the theorems' η.

    See the module docstring. ``method``: ``second_order`` (closed form, default) or ``exact``.
    """
    d = instance.d if d is None else int(d)
    if d is None:
        raise ValueError("d is required")
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must lie in (0, 1), got {eps}")
    ch = _c_hat(instance, c_hat)
    up = instance.u_perp
    m_star = math.sqrt(1.0 - eps)
    if m_star >= up:
        raise ValueError(f"⟨û,u⟩² ≥ 1 − ε is unreachable: u_perp² = {up**2:.6g} ≤ 1 − ε")
    mu_star = m_star / up
    s = 1 if h_tilde(instance, [0.0], ch)[0] >= 0 else -1
    mu = mu_star * (np.arange(1, grid + 1) / grid)
    nm = noise_moments(instance, s * up * mu, d=d, c_hat=ch, label_noise=label_noise,
                       samples=samples, seed=seed)
    ht = s * up * nm.h
    with np.errstate(divide="ignore"):
        eta_c = np.where(ht > 0, 2.0 * ht * (1 - mu**2) / (mu * nm.e_s2_px2), 0.0)
    j = int(np.argmin(eta_c))
    eta_max, binding = float(eta_c[j]), float(mu[j])
    if method == "exact" and eta_max > 0:
        def value(eta):
            mom = one_step_moments(instance, [s * binding], eta, d, c_hat=ch,
                                   label_noise=label_noise, samples=refine_samples,
                                   seed=seed + 1)
            return s * float(mom.drift[0])

        lo, hi = eta_max / 4, eta_max * 4
        if value(lo) > 0 > value(hi):
            eta_max = scipy.optimize.brentq(value, lo, hi, rtol=1e-6)
        check = one_step_moments(instance, s * mu, eta_max, d, c_hat=ch,
                                 label_noise=label_noise, samples=samples, seed=seed)
        if np.any(s * check.drift[:-1] < -3 * check.se_drift[:-1]):
            raise ArithmeticError("exact drift changes sign below the target overlap at η_max;"
                                  " use method='second_order'")
    elif method not in ("second_order", "exact"):
        raise ValueError(f"method must be 'second_order' or 'exact', got {method!r}")
    floor_max = (noise_floor(instance, eta_max, d, c_hat=ch, label_noise=label_noise,
                             method=method, refine_samples=0, samples=samples, seed=seed)[0]
                 if eta_max > 0 else math.nan)
    sched = _theorem(instance, eps, d)
    v_k = max(1.0, measured_variance_bound(instance, d, ch, samples, seed))
    try:
        s16 = theorem16_schedule(instance, eps, V_k=v_k, d=d, c_hat=ch)
        eta16, s_k = s16.eta, s16.constants["S_k"]
    except ValueError:
        eta16, s_k = math.nan, math.nan
    floor_thm = noise_floor(instance, sched.eta, d, c_hat=ch, label_noise=label_noise,
                            method="second_order", refine_samples=0, samples=samples,
                            seed=seed)[0]
    return StepSizeReport(
        eps=float(eps), d=d, method=method, eta_max=eta_max, floor_at_eta_max=floor_max,
        binding_m=s * up * binding, theorem=sched.theorem, eta_theorem=sched.eta,
        eta_theorem16=eta16, floor_at_theorem=floor_thm,
        ratio=eta_max / sched.eta if sched.eta > 0 else math.inf, S_k=s_k, V_k=v_k,
        extra=dict(T_theorem=sched.T, target_overlap=s * m_star))
