"""Dual kernels K(ρ) = E[σ(z₁)σ(z₂)] and K′(ρ) = E[σ′(z₁)σ′(z₂)] (Price's theorem).

For unit vectors v, v̂ with ⟨v, v̂⟩ = ρ: E_x[σ(⟨v,x⟩)σ(⟨v̂,x⟩)] = K(ρ) = Σₚ μₚ² ρᵖ (paper §1.4)
and K′(ρ) = Σₚ p μₚ² ρ^{p−1} = E[σ′(z₁)σ′(z₂)].

``method``:

* ``"auto"`` (default): the activation's closed form when it has one (ReLU, abs, erf,
  polynomials, hₚ); otherwise a cached, certified Chebyshev interpolant in θ = arccos ρ built
  from the 2-D quadrature (see :mod:`hermite.expansion._chebyshev`; error ≲ 1e-14·max|K| for the
  registry's activations, reported by :func:`kernel_interpolant`).
* ``"closed"``: closed form only (ValueError if none).
* ``"quadrature"``: the 2-D quadrature at every ρ (no cache; slow, the reference).
* ``"interpolant"``: the cached Chebyshev interpolant even when a closed form exists.
"""

from __future__ import annotations

import numpy as np

from hermite._activation import resolve_activation
from hermite.expansion._chebyshev import ChebyshevInTheta
from hermite.expansion._pair_quadrature import pair_expectation

__all__ = ["dual_kernel", "dual_kernel_derivative", "kernel_interpolant", "KERNEL_METHODS"]

KERNEL_METHODS = ("auto", "closed", "quadrature", "interpolant")
_CACHE: dict = {}
_CACHE_SIZE = 64  # interpolants kept (oldest dropped first); one per (activation, K or K′)


def _quadrature(act, which: str):
    if which == "kernel":
        def func(rho):
            return pair_expectation(act.fn, act.fn, rho, act.breakpoints, act.breakpoints)
    else:
        def func(rho):
            return pair_expectation(act.deriv, act.deriv, rho, act.breakpoints, act.breakpoints)
    return func


def kernel_interpolant(activation, which: str = "kprime") -> ChebyshevInTheta:
    """The cached Chebyshev interpolant of K (``which="kernel"``) or K′ (``"kprime"``).

    Its ``error_bound`` attribute bounds |interpolant − quadrature| (plus ~1e-15 quadrature
    error); ``converged`` says whether the degree cap (2048) was enough.
    """
    if which not in ("kernel", "kprime"):
        raise ValueError(f"which must be 'kernel' or 'kprime', got {which!r}")
    act = resolve_activation(activation)
    key = (act, which)
    interp = _CACHE.get(key)
    if interp is None:
        interp = ChebyshevInTheta(_quadrature(act, which))
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = interp
    return interp


def _evaluate(activation, rho, method: str, which: str) -> np.ndarray:
    if method not in KERNEL_METHODS:
        raise ValueError(f"method must be one of {', '.join(KERNEL_METHODS)}, got {method!r}")
    act = resolve_activation(activation)
    rho = np.asarray(rho, dtype=np.float64)
    if not np.all(np.isfinite(rho)):
        raise ValueError("rho contains NaN or Inf")
    closed = act.kernel if which == "kernel" else act.kprime
    if method in ("auto", "closed") and closed is not None:
        return np.asarray(closed(rho), dtype=np.float64) + np.zeros(rho.shape)
    if method == "closed":
        raise ValueError(f"activation {act.name!r} has no closed-form {which}")
    if method == "quadrature":
        return _quadrature(act, which)(rho)
    return kernel_interpolant(act, which)(rho)


def dual_kernel(activation, rho, method: str = "auto") -> np.ndarray:
    """K(ρ) = E[σ(z₁)σ(z₂)] = Σₚ μₚ² ρᵖ for standard Gaussians of correlation ρ ∈ [−1, 1]."""
    return _evaluate(activation, rho, method, "kernel")


def dual_kernel_derivative(activation, rho, method: str = "auto") -> np.ndarray:
    """K′(ρ) = E[σ′(z₁)σ′(z₂)] = Σₚ p μₚ² ρ^{p−1} (Price's theorem), ρ ∈ [−1, 1]."""
    return _evaluate(activation, rho, method, "kprime")
