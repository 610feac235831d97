"""Step sizes η and horizons T prescribed by the paper's convergence theorems (App. A.2, C.2).

All four share the template of Theorem 16: η = δ/(d V_k), T = ⌈α d V_k⌉,
δ = min{S_k ε³/(4 μ₁ (log d V_k)²), 1}, α = 4 log(d V_k)/(ε δ S_k), strong recovery
⟨u_T, u⟩² ≥ 1 − ε, initialisation m₀ sign(h(0)) ≥ β/√d.

Constants the paper leaves unspecified (all keyword arguments):

* ``C_delta`` — "a sufficiently small C_δ = Θ(1)"; default 1.0 (an upper end: the real
  constant is smaller, so η is smaller and T larger).
* ``gamma`` — the anti-concentration level γ in the lower bound |h(0)| ≳ γ(...) (holds with
  probability 1 − O(γ^{1/2})); default 1.0.
* ``mu1`` (Theorem 16) — the moment constant μ₁ of Condition 2 (not the Hermite coefficient
  μ₁(σ)); default 1.0.
* ``C_V`` — C_{p,σ} in the variance bound V_k (Lemma 17); default 1.0.
* ``beta`` — initialisation scale β; it enters only the required |m₀| ≥ β/√d, returned as
  ``m0_min``; default 1.0.
* hidden log factors: the Õ(·) of T is reported as the explicit ⌈α λ_max⁴ d k^a⌉ formula.

Typos handled: Theorem 13 prints η = λ_max⁴ δ/(d k²); the proof (Theorem 16 with
V_k = C λ_max⁴ k²) gives η = δ/(λ_max⁴ d k²), used here. Theorem 12's case factors follow the
printed statement (δ gets √k when μ₁(σ) ≠ 0; α gets 1/√k).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from hermite.expansion.coefficients import hermite_coefficients
from hermite.expansion.gradient import h

__all__ = [
    "Schedule",
    "theorem11_schedule",
    "theorem12_schedule",
    "theorem13_schedule",
    "theorem16_schedule",
    "population_lower_bound",
]

_MU1_ZERO = 1e-12


@dataclass(frozen=True)
class Schedule:
    """A theorem's prescription: step size ``eta``, horizon ``T`` (steps), the scalings
    ``delta``/``alpha``, the required initial overlap ``m0_min`` = β/√d, the theorem name and
    the constants used."""

    theorem: str
    eta: float
    T: int
    delta: float
    alpha: float
    m0_min: float
    constants: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _common(instance, eps, d):
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must lie in (0, 1), got {eps}")
    d = instance.d if d is None else int(d)
    if d is None or d < 1:
        raise ValueError("the instance has no dimension d; pass d=")
    lam = np.abs(np.asarray(instance.lam, dtype=float))
    lmin, lmax = float(lam.min()), float(lam.max())
    if lmin <= 0.0:
        raise ValueError("λ_min = 0: the theorems need every |λᵢ| > 0")
    mu1 = float(hermite_coefficients(instance.activation, 1)[1])
    return d, instance.k, lmin, lmax, abs(mu1) > _MU1_ZERO


def theorem11_schedule(instance, eps: float, gamma: float = 1.0, C_delta: float = 1.0,
                       beta: float = 1.0, d: int | None = None) -> Schedule:
    """Theorem 11 (orthonormal W, ξ = 1): η = δ/(λ_max⁴ d k²), T = ⌈α λ_max⁴ d k²⌉,
    δ = C_δ γ λ_min² ε³/(log λ_max⁴dk²)² · (1 or 1/√k), α = log(λ_max⁴dk²)/(λ_min² γ ε δ) ·
    (1 or √k), the second case when μ₁(σ) = 0."""
    d, k, lmin, lmax, lin = _common(instance, eps, d)
    big = lmax**4 * d * k**2
    lg = math.log(big)
    delta = C_delta * gamma * lmin**2 * eps**3 / lg**2 * (1.0 if lin else 1.0 / math.sqrt(k))
    alpha = lg / (lmin**2 * gamma * eps * delta) * (1.0 if lin else math.sqrt(k))
    return Schedule("11", delta / big, math.ceil(alpha * big), delta, alpha, beta / math.sqrt(d),
                    dict(C_delta=C_delta, gamma=gamma, beta=beta, mu1_nonzero=lin))


def theorem12_schedule(instance, eps: float, gamma: float = 1.0, C_delta: float = 1.0,
                       beta: float = 1.0, xi_bar: float | None = None,
                       d: int | None = None) -> Schedule:
    """Theorem 12 (orthonormal W, ξ = ξ̄√k): η = δ/(ξ̄² λ_max⁴ d k⁴), T = ⌈α λ_max⁴ ξ̄² d k⁴⌉,
    δ = min{C_δ ξ̄² √k γ λ_min² ε³/(log λ_max⁴dk²)² · (√k or 1), 1},
    α = log(λ_max⁴dk²)/(ξ̄² λ_min² √k γ ε δ) · (1/√k or 1). ξ̄ defaults to ξ/√k."""
    d, k, lmin, lmax, lin = _common(instance, eps, d)
    xb = instance.xi / math.sqrt(k) if xi_bar is None else float(xi_bar)
    if xb <= 0.0:
        raise ValueError(f"xi_bar must be > 0, got {xb}")
    lg = math.log(lmax**4 * d * k**2)
    delta = min(C_delta * xb**2 * math.sqrt(k) * gamma * lmin**2 * eps**3 / lg**2
                * (math.sqrt(k) if lin else 1.0), 1.0)
    alpha = lg / (xb**2 * lmin**2 * math.sqrt(k) * gamma * eps * delta) * (
        1.0 / math.sqrt(k) if lin else 1.0)
    big = xb**2 * lmax**4 * d * k**4
    return Schedule("12", delta / big, math.ceil(alpha * big), delta, alpha, beta / math.sqrt(d),
                    dict(C_delta=C_delta, gamma=gamma, beta=beta, xi_bar=xb, mu1_nonzero=lin))


def theorem13_schedule(instance, eps: float, gamma: float = 1.0, C_delta: float = 1.0,
                       beta: float = 1.0, d: int | None = None) -> Schedule:
    """Theorem 13 (angularly separated W, ξ = 1): η = δ/(λ_max⁴ d k²) (printed with λ_max⁴ in
    the numerator: a typo), T = ⌈α λ_max⁴ d k²⌉, δ = C_δ γ λ_min² ε³/((log λ_max⁴dk²)² √k),
    α = √k log(λ_max⁴dk²)/(λ_min² γ ε δ)."""
    d, k, lmin, lmax, _ = _common(instance, eps, d)
    big = lmax**4 * d * k**2
    lg = math.log(big)
    delta = C_delta * gamma * lmin**2 * eps**3 / (lg**2 * math.sqrt(k))
    alpha = lg * math.sqrt(k) / (lmin**2 * gamma * eps * delta)
    return Schedule("13", delta / big, math.ceil(alpha * big), delta, alpha, beta / math.sqrt(d),
                    dict(C_delta=C_delta, gamma=gamma, beta=beta))


def population_lower_bound(instance, c_hat=None, n: int = 2001) -> float:
    """S = min over m ∈ [0, u⊥] of sign(h(0)) h(sign(h(0)) m) (Condition 3's quantity, ≤ |h(0)|);
    ≤ 0 means Condition 3 fails for this instance."""
    m = np.linspace(0.0, instance.u_perp, n)
    s = float(np.sign(h(instance, 0.0, c_hat=c_hat)))
    if s == 0.0:
        return 0.0
    return float(np.min(s * h(instance, s * m, c_hat=c_hat)))


def theorem16_schedule(instance, eps: float, S_k: float | None = None, V_k: float | None = None,
                       mu1: float = 1.0, C_V: float = 1.0, beta: float = 1.0,
                       d: int | None = None, c_hat=None) -> Schedule:
    """Theorem 16 (generic): η = δ/(d V_k), T = ⌈α d V_k⌉, δ = min{S_k ε³/(4μ₁(log dV_k)²), 1},
    α = 4 log(dV_k)/(ε δ S_k).

    S_k defaults to min(|h(0)|/2, :func:`population_lower_bound`) computed on the instance;
    V_k to the Lemma 17 bound C_V λ_max⁴ k³ξ² min{k, 4ξ²}/(k + ξ²) (at least 1).
    """
    d, k, _, lmax, _ = _common(instance, eps, d)
    if S_k is None:
        S_k = min(abs(float(h(instance, 0.0, c_hat=c_hat))) / 2.0,
                  population_lower_bound(instance, c_hat))
    if S_k <= 0.0:
        raise ValueError("S_k ≤ 0: h changes sign on the path, Condition 3 fails")
    xi = instance.xi
    if V_k is None:
        V_k = max(1.0, C_V * lmax**4 * k**3 * xi**2 * min(k, 4 * xi**2) / (k + xi**2))
    lg = math.log(d * V_k)
    delta = min(S_k * eps**3 / (4.0 * mu1 * lg**2), 1.0)
    alpha = 4.0 * lg / (eps * delta * S_k)
    return Schedule("16", delta / (d * V_k), math.ceil(alpha * d * V_k), delta, alpha,
                    beta / math.sqrt(d), dict(S_k=S_k, V_k=V_k, mu1=mu1, C_V=C_V, beta=beta))
