"""Activations σ and σ′ as numba scalar functions, selected by an integer code.

The codes mirror the names of :mod:`hermite.activations`; ``he<p>`` carries p separately
(hₚ = Heₚ/√(p!) by the three-term recurrence, closed forms for p ≤ 4).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["ACT_CODES", "act_code", "compiled_activation", "sigma", "sigma_and_deriv"]

ACT_CODES = {"relu": 0, "abs": 1, "sigmoid": 2, "tanh": 3, "erf": 4, "quadratic": 5,
             "linear": 6}
HERMITE_CODE = 7
# multiplications by these constants, not divisions (a division costs several multiplies)
_INV_SQRT6, _INV_SQRT24 = 1.0 / math.sqrt(6.0), 1.0 / math.sqrt(24.0)
_SQRT3_OVER_SQRT2 = math.sqrt(1.5)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def act_code(name: str) -> tuple[int, int] | None:
    """(code, p) for a registry name, or None when there is no compiled version."""
    if name in ACT_CODES:
        return ACT_CODES[name], 0
    if name.startswith("he") and name[2:].isdigit():
        return HERMITE_CODE, int(name[2:])
    return None


def compiled_activation(activation) -> tuple[int, int, float] | None:
    """(code, p, a) of a registry activation σ(a·x) (or a torch activation whose ``theory``
    is one) for the compiled σ, σ′ here; None for a user's σ, also under a registry name."""
    from hermite.activations import get_activation

    theory = getattr(activation, "theory", activation)
    base, scale = theory.base_and_scale
    code = act_code(base)
    if code is None:
        return None
    if code[0] == HERMITE_CODE:  # hₚ is built on request: the registry's has degree p
        ok = theory.polynomial_degree == code[1]
    else:
        try:
            registry = get_activation(theory.name)
        except (KeyError, ValueError):
            return None
        ok = registry.fn is theory.fn
    return (code[0], code[1], scale) if ok else None


@njit(cache=True)
def _hermite(p, x):
    """(hₚ(x), hₚ₋₁(x)) with hₙ = Heₙ/√(n!)."""
    if p == 0:
        return 1.0, 0.0
    h_prev, h = 1.0, x
    for n in range(1, p):
        h_prev, h = h, (x * h - math.sqrt(n) * h_prev) / math.sqrt(n + 1.0)
    return h, h_prev


@njit(cache=True, inline="always")
def sigma_and_deriv(x, code, p):
    """(σ(x), σ′(x)) for activation ``code`` (p: Hermite degree)."""
    if code == 0:  # branch-free: the sign of x is a coin flip
        d = np.float64(x > 0.0)
        return x * d, d
    if code == 7:
        x2 = x * x
        if p == 3:
            return x * (x2 - 3.0) * _INV_SQRT6, (x2 - 1.0) * _SQRT3_OVER_SQRT2
        if p == 4:
            return (x2 * (x2 - 6.0) + 3.0) * _INV_SQRT24, x * (x2 - 3.0) * (2.0 * _INV_SQRT6)
        h, h_prev = _hermite(p, x)
        return h, math.sqrt(p) * h_prev
    if code == 2:
        s = 1.0 / (1.0 + math.exp(-x))
        return s, s * (1.0 - s)
    if code == 1:
        return abs(x), (1.0 if x > 0.0 else (-1.0 if x < 0.0 else 0.0))
    if code == 3:
        t = math.tanh(x)
        return t, 1.0 - t * t
    if code == 4:
        return math.erf(x), _TWO_OVER_SQRT_PI * math.exp(-x * x)
    if code == 5:
        return x * x, 2.0 * x
    return x, 1.0


@njit(cache=True, inline="always")
def sigma(x, code, p):
    """σ(x) alone (the teacher never needs σ′)."""
    if code == 0:
        return max(x, 0.0)
    if code == 2:
        return 1.0 / (1.0 + math.exp(-x))
    if code == 7 and p == 4:
        x2 = x * x
        return (x2 * (x2 - 6.0) + 3.0) * _INV_SQRT24
    if code == 7 and p == 3:
        return x * (x * x - 3.0) * _INV_SQRT6
    return sigma_and_deriv(x, code, p)[0]
