r"""Step sizes beyond which the dynamics mean nothing: the warning of ``loradyn run`` and
``loradyn hermite ode`` for an η far above them (issue 16: ``--eta 1e3``, a typo for 1e-3,
ran to the end with "0 diverged", overlaps of pure noise and an ODE at −4·10¹⁸⁹).

SGD on the sphere (the ``finetune`` learner, eq. 4)
---------------------------------------------------
One projected step is exactly (``hermite.finite_d.noise``, ★)

    μ′ = (μ − η g √(1−μ²) t) / √(1 + η² g² ‖Px‖²),   ‖Px‖² = t² + ‖r‖²,  ‖r‖² ~ χ²_{d−k−2},

with g the scalar of the per-example gradient ∇_û L = g x (projected: g·Px, Px ⊥ û). The step
û′ ∝ û − η g Px turns û by the angle θ with tan θ = η |g| ‖Px‖. Everything the project predicts
about a run — the population ODE (first order in η), its finite-d correction
−(η²/2) μ E[g²‖Px‖²] (``hermite.finite_d.corrected_ode``), the LNA band, the noise floor and
``hermite.finite_d.stepsize`` — expands the normaliser (1 + B)^{−1/2} = 1 − B/2 + 3B²/8 − … in
B = tan²θ = η² g² ‖Px‖², a series that converges only for B < 1. Hence the criterion

    E[tan²θ] = η² E[g² ‖Px‖²] ≤ 1   ⇔   η ≤ η_sgd = E[g² ‖Px‖²]^{−1/2},

E[g²‖Px‖²] = (d − k − 2) E[g²] + E[g² t²] ≈ d·E[g²] (``noise_moments(...).e_s2_px2``, label
noise included), taken where every run starts, m = 0 (û₀ uniform: |m₀| ~ 1/√d). Beyond it
the step is mostly a rotation towards a fresh random direction: at η = 10 η_sgd the typical
step turns û by ≈ 84°, û′ ≈ −sign(g) Px/‖Px‖, whose overlap with u is t/‖Px‖ ~ 1/√d whatever
the past, so the runs stay at the noise level for ever without ever diverging (the quickstart
instance at η = 10³: η/η_sgd ≈ 3·10⁴, final overlaps ±0.1 ≈ ±1.4/√d). η_sgd scales as 1/√d
while the step sizes that learn scale as 1/d (η = c/d, c ≤ 0.05: ``dynamics.setup.defaults``), so
η_sgd/η_default ≈ √d/(c √E[g²]) (≈ 120 on the quickstart instance, d = 200): a warning at η_sgd
never fires on a sensible η, which is why it is a warning and the threshold η_sgd itself.

The population ODE map
----------------------
m̄′ = m̄ + η g(m̄), g(m) = h(m)(u⊥² − m²) (``hermite.flows.ode``) is forward Euler for dm/dt = g(m):
stable at its attracting fixed point m* iff |1 + η g′(m*)| < 1, i.e. η < 2/|g′(m*)|, and free
of overshoot anywhere iff η·max|g′| ≤ 1. So η_ode = 2/max|g′| over [−u⊥, u⊥] (g′ from the h
table): above it the map may oscillate and blow up (NaN and a flag: ``hermite.flows.ode``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["StepLimit", "sgd_step_limit", "ode_step_limit", "step_limit", "SAMPLES"]

SAMPLES = 2**12  # QMC points for E[g²‖Px‖²]: ~1 % error, ample for a warning threshold


@dataclass(frozen=True)
class StepLimit:
    """The binding step-size limit for η: ``limit`` from ``kind`` (``sgd`` or ``ode``);
    ``ratio`` = η/limit; ``angle`` the rms step angle atan(η √E[g²‖Px‖²]) in degrees (sgd)."""

    eta: float
    limit: float
    kind: str
    ratio: float
    angle: float | None = None

    @property
    def exceeded(self) -> bool:
        return self.ratio > 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    def message(self, option: str = "--eta") -> str:
        """One line for a warning."""
        if self.kind == "sgd":
            why = (f"the SGD stability limit η_sgd = E[g²‖Px‖²]^(-1/2) = {self.limit:.3g}: "
                   f"each step turns û by about {self.angle:.0f}°, the overlaps stay noise")
        else:
            why = (f"the ODE map's stability limit η_ode = 2/max|g′| = {self.limit:.3g}: the "
                   "population ODE oscillates and may blow up")
        flipped = 1.0 / self.eta if self.eta > 1 else math.inf
        hint = (f"; did you mean {flipped:g}?" if flipped < self.limit
                else f"; use η below {self.limit:.2g}")
        return f"{option} {self.eta:g} is {self.ratio:.3g}× {why}{hint}"


def sgd_step_limit(instance, d=None, *, c_hat=None, label_noise: float = 0.0,
                   samples: int = SAMPLES) -> float:
    """η_sgd = E[g²‖Px‖²]^{−1/2} at m = 0 (module docstring); NaN where the moment is 0."""
    from hermite.finite_d.noise import noise_moments

    d = instance.d if d is None else int(d)
    if d is None:
        raise ValueError("d is required for the SGD step-size limit")
    nm = noise_moments(instance, [0.0], d=d, c_hat=c_hat, label_noise=label_noise,
                       samples=samples)
    second = float(nm.e_s2_px2[0])
    return 1.0 / math.sqrt(second) if second > 0 else math.inf


def ode_step_limit(instance, *, c_hat=None, table=None, grid: int = 4001) -> float:
    """η_ode = 2/max|g′| for the population ODE map (module docstring); inf if g′ ≡ 0."""
    from hermite.expansion.table import HTable, table_eval

    tab = table if table is not None else HTable.for_instance(instance, c_hat)
    up = instance.u_perp
    x = np.linspace(-up, up, grid)
    g = np.array([table_eval(tab.table, tab.n, up, v) * (up**2 - v * v) for v in x])
    lip = float(np.max(np.abs(np.diff(g) / np.diff(x))))
    return 2.0 / lip if lip > 0 else math.inf


def step_limit(instance, eta: float, d=None, *, sgd: bool = True, ode: bool = True,
               c_hat=None, label_noise: float = 0.0, table=None) -> StepLimit | None:
    """The smaller of the SGD limit (``sgd``, needs d) and the ODE limit (``ode``) as a
    :class:`StepLimit` for ``eta``; None when neither applies (no theory for the instance)."""
    eta = float(eta)
    found = []
    d = instance.d if d is None else d
    if sgd and d is not None:
        try:
            s_lim = sgd_step_limit(instance, d, c_hat=c_hat, label_noise=label_noise)
        except (ValueError, ArithmeticError, NotImplementedError):
            s_lim = math.nan
        if math.isfinite(s_lim) and s_lim > 0:
            angle = math.degrees(math.atan(eta / s_lim))
            found.append(StepLimit(eta, s_lim, "sgd", eta / s_lim, angle))
    if ode:
        try:
            o_lim = ode_step_limit(instance, c_hat=c_hat, table=table)
        except (ValueError, ArithmeticError, NotImplementedError):
            o_lim = math.nan
        if math.isfinite(o_lim) and o_lim > 0:
            found.append(StepLimit(eta, o_lim, "ode", eta / o_lim))
    return max(found, key=lambda s: s.ratio) if found else None
