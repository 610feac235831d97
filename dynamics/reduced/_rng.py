"""Per-run deterministic random streams for the numba kernels.

Each run owns one 64-bit counter (SplitMix64: a Weyl sequence through a bijective mixer, which
passes BigCrush), seeded from (seed, run index) alone, so a run's draws do not depend on the
thread that advances it. On top: uniforms on (0, 1) with 53-bit resolution, standard normals by
the 128-layer ziggurat (Marsaglia & Tsang 2000, Doornik's ZIGNOR layout; an exact rejection
sampler) and Gamma(α) by Marsaglia & Tsang (2000) (exact rejection; α < 1 via α + 1 and U^{1/α}).

Every function takes the stream state and returns ``(value, new_state)``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from dynamics.randomness.ziggurat import ZIGGURAT_TAIL, ziggurat_tables

__all__ = ["seed_stream", "next_u64", "uniform", "normal", "gamma", "chi2", "chi2_prepare",
           "chi2_prepared"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_RUN_STRIDE = np.uint64(0xD1B54A32D192ED03)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_LOW7 = np.uint64(127)
_S7, _ONE = np.uint64(7), np.uint64(1)
_TWO_M53 = 1.0 / 9007199254740992.0


@njit(cache=True)
def _mix(z):
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True)
def seed_stream(seed, run):
    """Initial state of run ``run``'s stream under master seed ``seed`` (both ≥ 0)."""
    return _mix(_mix(np.uint64(seed) + _GOLDEN) + np.uint64(run) * _RUN_STRIDE)


@njit(cache=True)
def next_u64(state):
    state = state + _GOLDEN
    return _mix(state), state


@njit(cache=True)
def uniform(state):
    """U ~ Uniform(0, 1), never 0 (k + ½)·2⁻⁵³."""
    x, state = next_u64(state)
    return (np.float64(x >> _S11) + 0.5) * _TWO_M53, state


_ZX, _ZR = ziggurat_tables()


@njit(cache=True)
def _normal_slow(u, i, state):
    """Rare ziggurat branches for |Z| = u·x[i] outside box i: (x, accepted, state)."""
    if i == 0:  # base strip: the tail beyond r (Marsaglia 1964)
        while True:
            u1, state = uniform(state)
            u2, state = uniform(state)
            t = math.log(u1) / ZIGGURAT_TAIL
            if -2.0 * math.log(u2) >= t * t:
                return ZIGGURAT_TAIL - t, True, state
    x = u * _ZX[i]
    f0 = math.exp(-0.5 * (_ZX[i] * _ZX[i] - x * x))
    f1 = math.exp(-0.5 * (_ZX[i + 1] * _ZX[i + 1] - x * x))
    w, state = uniform(state)
    return x, f1 + w * (f0 - f1) < 1.0, state


@njit(cache=True)
def normal(state):
    """Z ~ N(0, 1) by the ziggurat: one 64-bit draw (bits 0–6 layer, 7 sign, 11–63 the
    uniform) in ~99% of calls."""
    while True:
        x64, state = next_u64(state)
        i = np.int64(x64 & _LOW7)
        u = np.float64(x64 >> _S11) * _TWO_M53
        sign = 1.0 - 2.0 * np.float64((x64 >> _S7) & _ONE)
        if u < _ZR[i]:
            return sign * u * _ZX[i], state
        x, ok, state = _normal_slow(u, i, state)
        if ok:
            return sign * x, state


@njit(cache=True)
def _gamma_mt(dd, cc, state):
    """Marsaglia–Tsang core for shape α ≥ 1, given dd = α − 1/3 and cc = 1/√(9 dd).

    Accepts x where log w < h(x) = x²/2 + dd(1 − v + log v), v = (1 + cc·x)³, first through
    a squeeze w < 1 − κx⁴ that implies it, so the draws are exactly Marsaglia–Tsang's. With
    y = cc·x, h = 3dd[log(1 + y) − y + y²/2 − y³/3] = −(3/4)dd·y⁴/(1 + ξ)⁴ (Lagrange, ξ
    between 0 and y), so h ≥ −(4/27)x⁴/dd for y ≥ −½, and 1 + h ≤ eʰ: κ = 4/(27 dd) there,
    which for large α (χ² of many degrees) leaves the logarithms to ~3κ of the draws instead
    of Marsaglia–Tsang's 10 % (their κ = 0.0331, kept where it is the smaller)."""
    kappa = min(0.0331, 4.0 / (27.0 * dd))
    while True:
        x, state = normal(state)
        y = cc * x
        v = 1.0 + y
        if v <= 0.0:
            continue
        v = v * v * v
        w, state = uniform(state)
        x2 = x * x
        if (y >= -0.5 and w < 1.0 - kappa * x2 * x2) or \
                math.log(w) < 0.5 * x2 + dd * (1.0 - v + math.log(v)):
            return dd * v, state


@njit(cache=True)
def gamma(alpha, state):
    """G ~ Gamma(alpha, 1), alpha > 0 (Marsaglia & Tsang 2000)."""
    boost = 1.0
    if alpha < 1.0:
        w, state = uniform(state)
        boost = w ** (1.0 / alpha)
        alpha += 1.0
    dd = alpha - 1.0 / 3.0
    g, state = _gamma_mt(dd, 1.0 / math.sqrt(9.0 * dd), state)
    return g * boost, state


@njit(cache=True)
def chi2_prepare(dof):
    """Constants (dof, dd, cc) of :func:`chi2_prepared`: hoists the per-draw set-up."""
    dd = 0.5 * dof - 1.0 / 3.0
    return dof, dd, (1.0 / math.sqrt(9.0 * dd) if dof >= 2 else 0.0)


@njit(cache=True)
def chi2_prepared(prep, state):
    """Q ~ χ²_dof for ``prep = chi2_prepare(dof)`` (same law as :func:`chi2`)."""
    if prep[0] < 2:
        return chi2(prep[0], state)
    g, state = _gamma_mt(prep[1], prep[2], state)
    return 2.0 * g, state


@njit(cache=True)
def chi2(dof, state):
    """Q ~ χ²_dof (dof ≥ 0 integer; χ²₀ = 0)."""
    if dof <= 0:
        return 0.0, state
    g, state = gamma(0.5 * dof, state)
    return 2.0 * g, state
