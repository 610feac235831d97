"""Population dynamics of the overlap m = ⟨u, û⟩ (paper §3.1, eq. 6 without noise).

Discrete map (one population gradient step of eq. 4 before normalisation, projected onto
⟨·, u⟩; u⊥ = ‖Π⊥u‖ = ``instance.u_perp``, 1 when u ⊥ span W):

    m̄_{t+1} = m̄_t + η h(m̄_t) (u⊥² − m̄_t²),

its continuous limit dm/dt = η h(m)(u⊥² − m²), and the hitting time of a level,
T(level) = ∫_{m₀}^{level} dm / (η h(m)(u⊥² − m²)).

The map is iterated in numba on an :class:`~hermite.expansion.table.HTable` (h interpolated to ≤
1e-10 relative of the exact h, checked when the table is built), R runs in parallel blocks. Beyond
``MAP_STEPS_MAX`` steps (d = 10⁶ horizons reach 10⁹) blocks of K steps are one RK4 step of the
continuous flow, with K·η·max|g′| = ``FLOW_RATE`` (g = h(m)(u⊥² − m²)); the flow differs from
the map by O(η), here ≤ 2·10⁻⁸ (the noise-corrected maps of :mod:`hermite.finite_d.corrected_ode` do
the same).
``method="exact"`` iterates with the exact h instead (numpy, for small problems and tests).
Outside [−u⊥, u⊥] (a step that overshoots, possible when 2ηu⊥ max|h| > 1) h is evaluated at
the clipped overlap; the map itself is not clipped.

Blow-up. An overlap is a cosine, |m| ≤ u⊥; a small overshoot is the map's own (above), but an
iterate with |m| > ``BLOWUP``·u⊥ = 2u⊥ (or a non-finite one) approximates nothing: from there
the pull −η h(±u⊥)(m² − u⊥²) is quadratic in m and, for the step sizes that get there, sends
the map to ±∞ within a few steps (η = 10³ on ReLU: −4·10¹⁸⁹, then −inf). The iteration of
such a run stops: it reads NaN from that step on, and ``return_blowup=True`` returns the step
(−1 for runs that never blew up) beside the curve. Euler's map of dm/dt = g(m),
g = h(m)(u⊥² − m²), is stable at its attracting fixed point iff η|g′(m*)| < 2 and monotone
iff η max|g′| ≤ 1 (:func:`hermite.finite_d.stability.ode_step_limit`).

Fixed points. The map is autonomous, so once an iterate is a fixed point *in floating point*
(m̄ + η h(m̄)(u⊥² − m̄²) == m̄, or the RK4 block returns its input) every later iterate equals
it: when all runs of a block are there the remaining steps up to the next checkpoint are
skipped. This is exact (the same numbers as iterating), and makes horizons of 10¹¹ steps cost
what reaching the fixed point costs. ``progress=True`` shows a progress bar (tqdm, on stderr).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import scipy.integrate

from hermite.expansion.gradient import h as h_exact
from hermite.expansion.table import HTable, table_eval

__all__ = ["population_ode", "ode_continuous", "steps_to_reach", "check_steps", "drift_sign",
           "BLOWUP", "blowup_index"]

_BLOCK = 8
MAP_STEPS_MAX = 20_000_000  # longer horizons integrate the flow in blocks (see module doc)
FLOW_RATE = 0.02  # K·(max rate) per RK4 block: local error ~ FLOW_RATE⁵
BLOWUP = 2.0  # |m| > BLOWUP·u⊥ (or non-finite) is a blow-up (module doc)
PIECE_STEPS = 2_000_000  # steps per kernel call when a progress bar is shown


def _check_eta(eta) -> float:
    eta = float(eta)
    if not math.isfinite(eta) or eta <= 0.0:
        raise ValueError(f"eta must be a finite number > 0, got {eta:g}")
    return eta


def _check_m0(instance, m0) -> np.ndarray:
    m0 = np.atleast_1d(np.asarray(m0, dtype=np.float64))
    if m0.ndim != 1:
        raise ValueError(f"m0 must be a scalar or a 1-D array, got shape {m0.shape}")
    u = instance.u_perp
    if not np.all(np.isfinite(m0)) or np.any(np.abs(m0) > u * (1 + 1e-12)):
        raise ValueError(f"m0 must lie in [-u_perp, u_perp] = [{-u:.6g}, {u:.6g}]")
    return m0


def check_steps(steps, integer: bool = True) -> np.ndarray:
    """Checkpoints as a sorted non-negative int64 array (float64 times if not ``integer``)."""
    arr = np.atleast_1d(np.asarray(steps))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("steps must be a non-empty 1-D array of checkpoint steps")
    try:
        as_float = arr.astype(np.float64)
    except (TypeError, ValueError):
        raise ValueError("steps must be numbers") from None
    if not np.all(np.isfinite(as_float)):
        raise ValueError("steps must be finite")
    if integer and np.any(as_float != np.round(as_float)):
        raise ValueError("steps must be integers")
    arr = as_float.astype(np.int64) if integer else as_float
    if arr.min() < 0:
        raise ValueError(f"steps must be ≥ 0, got {arr.min()}")
    if np.any(np.diff(arr) < 0):
        raise ValueError("steps must be sorted in increasing order")
    return arr


@numba.njit(cache=True, inline="always")
def _rate(tab, n, uperp, eta, x):  # pragma: no cover - compiled
    return eta * table_eval(tab, n, uperp, x) * (uperp * uperp - x * x)


@numba.njit(cache=True, inline="always")
def _rk4(tab, n, uperp, eta, x, h):  # pragma: no cover - compiled
    """One RK4 step of length h of the flow dm/dt = _rate(m)."""
    k1 = _rate(tab, n, uperp, eta, x)
    k2 = _rate(tab, n, uperp, eta, x + 0.5 * h * k1)
    k3 = _rate(tab, n, uperp, eta, x + 0.5 * h * k2)
    k4 = _rate(tab, n, uperp, eta, x + h * k3)
    return x + h * (k1 + 2.0 * k2 + 2.0 * k3 + k4) / 6.0


@numba.njit(cache=True, parallel=True)
def _iterate_table(m0, eta, uperp, tab, n, ckpts, K, bound):  # pragma: no cover - compiled
    """(m at ckpts (R, C), blow-up step (R,) or −1); see the module doc (blocks, fixed points,
    blow-up at |m| > bound)."""
    r_total = m0.size
    c_total = ckpts.size
    out = np.empty((r_total, c_total))
    blow = np.full(r_total, -1, dtype=np.int64)
    u2 = uperp * uperp
    h = float(K)
    nblk = (r_total + _BLOCK - 1) // _BLOCK
    for blk in numba.prange(nblk):
        r0 = blk * _BLOCK
        r1 = min(r_total, r0 + _BLOCK)
        nb = r1 - r0
        m = np.empty(_BLOCK)
        for r in range(nb):
            m[r] = m0[r0 + r]
        t = 0
        for c in range(c_total):
            target = ckpts[c]
            while K > 1 and t + K <= target:  # one RK4 step of the flow per K steps
                moving = False
                for r in range(nb):
                    x = m[r]
                    if x != x:  # blown up earlier
                        continue
                    new = _rk4(tab, n, uperp, eta, x, h)
                    if not abs(new) <= bound:
                        new = np.nan
                        blow[r0 + r] = t + K
                    elif new != x:
                        moving = True
                    m[r] = new
                if moving:
                    t += K
                else:  # every run is at a fixed point of the block map (or blown up)
                    t += K * ((target - t) // K)
            while t < target:
                moving = False
                for r in range(nb):
                    x = m[r]
                    if x != x:
                        continue
                    new = x + eta * table_eval(tab, n, uperp, x) * (u2 - x * x)
                    if not abs(new) <= bound:
                        new = np.nan
                        blow[r0 + r] = t + 1
                    elif new != x:
                        moving = True
                    m[r] = new
                t += 1
                if not moving:  # fixed point of the map in floating point: exact skip
                    t = target
            for r in range(nb):
                out[r0 + r, c] = m[r]
    return out, blow


def _flow_block(tab, eta, uperp, ckpts) -> int:
    """1 up to MAP_STEPS_MAX steps; beyond, K with K·η·max|g′| = FLOW_RATE."""
    if int(np.max(ckpts)) <= MAP_STEPS_MAX:
        return 1
    x = np.linspace(-uperp, uperp, 4001)
    g = np.array([table_eval(tab.table, tab.n, uperp, v) * (uperp**2 - v * v) for v in x])
    lip = eta * float(np.max(np.abs(np.diff(g) / np.diff(x))))
    return max(1, int(FLOW_RATE / lip)) if lip > 0 else int(np.max(ckpts))


def population_ode(instance, eta, m0, steps, c_hat=None, method: str = "table",
                   table: HTable | None = None, *, progress: bool = False,
                   return_blowup: bool = False):
    """Iterate m̄_{t+1} = m̄_t + η h(m̄_t)(u⊥² − m̄_t²) from each m₀, record at ``steps``.

    Parameters
    ----------
    instance : :class:`dynamics.instances.instance.Instance`.
    eta : step size η > 0.
    m0 : (R,) initial overlaps in [−u⊥, u⊥] (a scalar gives R = 1).
    steps : (C,) sorted non-negative integer checkpoints (0 records m₀).
    c_hat : student ĉ (default ``instance.c_hat``).
    method : ``"table"`` (numba on an interpolated h, error ≤ 1e-10·max|h|) or ``"exact"``.
    table : a prebuilt :class:`HTable` for this instance and ĉ (``"table"`` only; default
        :meth:`HTable.for_instance`, cached by the instance's values).
    progress : show a progress bar over the steps (the horizon is cut into pieces; the same
        numbers).
    return_blowup : also return the (R,) step at which each run blew up (−1: never).

    Returns
    -------
    (R, C) float64 array of m̄ at the checkpoints, NaN from a run's blow-up on (module doc);
    with ``return_blowup``, (that array, the blow-up steps).
    """
    eta = _check_eta(eta)
    m0 = _check_m0(instance, m0)
    ckpts = check_steps(steps)
    uperp = instance.u_perp
    bound = BLOWUP * uperp
    if method == "table":
        tab = table if table is not None else HTable.for_instance(instance, c_hat)
        K = _flow_block(tab, eta, uperp, ckpts)
        if progress:
            out, blow = _pieces(m0, eta, uperp, tab, ckpts, K, bound)
        else:
            out, blow = _iterate_table(m0, eta, uperp, tab.table, tab.n, ckpts, K, bound)
        return (out, blow) if return_blowup else out
    if method != "exact":
        raise ValueError(f"method must be 'table' or 'exact', got {method!r}")
    out = np.empty((m0.size, ckpts.size))
    blow = np.full(m0.size, -1, dtype=np.int64)
    m, t = m0.copy(), 0
    u2 = uperp * uperp
    for c, target in enumerate(ckpts):
        while t < target:
            live = np.isfinite(m)
            new = m.copy()
            x = m[live]
            new[live] = x + eta * h_exact(instance, np.clip(x, -uperp, uperp),
                                          c_hat=c_hat) * (u2 - x * x)
            bad = live & ~(np.abs(new) <= bound)
            new[bad], blow[bad] = np.nan, t + 1
            moving = np.any(live & ~bad & (new != m))
            m, t = new, t + 1
            if not moving:
                t = int(target)
        out[:, c] = m
    return (out, blow) if return_blowup else out


def _pieces(m0, eta, uperp, tab, ckpts, K, bound):
    """:func:`_iterate_table` cut into pieces of about ``PIECE_STEPS`` steps (multiples of K
    from each checkpoint, so the RK4 blocks fall where they would in one call), with a tqdm
    bar over the steps."""
    from tqdm import tqdm

    piece = K * max(1, PIECE_STEPS // K)
    out = np.empty((m0.size, ckpts.size))
    blow = np.full(m0.size, -1, dtype=np.int64)
    m, t = m0.copy(), 0
    with tqdm(total=int(ckpts[-1]), unit="step", unit_scale=True, desc="population ODE",
              leave=False) as bar:
        for c, target in enumerate(ckpts):
            while t < target:
                nxt = min(int(target), t + piece)
                rec, b = _iterate_table(m, eta, uperp, tab.table, tab.n,
                                        np.array([nxt - t], dtype=np.int64), K, bound)
                new = (b >= 0) & (blow < 0)
                blow[new] = b[new] + t
                m = rec[:, 0].copy()
                bar.update(nxt - t)
                t = nxt
            out[:, c] = m
    return out, blow


def blowup_index(curve) -> np.ndarray:
    """Per row of an (R, C) curve, the first column that is NaN after a finite value (a
    blow-up of :func:`population_ode` and the corrected maps), −1 where there is none."""
    curve = np.asarray(curve, dtype=float)
    if curve.ndim != 2 or curve.shape[1] == 0:
        return np.full(curve.shape[:1], -1, dtype=np.int64)
    finite = np.isfinite(curve)
    seen = np.maximum.accumulate(finite, axis=1)
    after = seen & ~finite
    return np.where(after.any(1), after.argmax(1), -1).astype(np.int64)


def ode_continuous(instance, eta, m0, steps, c_hat=None, rtol: float = 1e-10,
                   atol: float = 1e-13) -> np.ndarray:
    """Solve dm/dt = η h(m)(u⊥² − m²) (exact h, DOP853) and sample at times t = ``steps``.

    Same arguments and (R, C) output as :func:`population_ode`; t is measured in steps and
    may be fractional.
    """
    eta = _check_eta(eta)
    m0 = _check_m0(instance, m0)
    ckpts = check_steps(steps, integer=False)
    u2 = instance.u_perp**2
    uperp = instance.u_perp

    def rhs(_t, m):
        mc = np.clip(m, -uperp, uperp)
        return eta * h_exact(instance, mc, c_hat=c_hat) * (u2 - mc * mc)

    if ckpts[-1] == 0.0:
        return np.repeat(m0[:, None], ckpts.size, axis=1)
    sol = scipy.integrate.solve_ivp(rhs, (0.0, ckpts[-1]), m0, method="DOP853", t_eval=ckpts,
                                    rtol=rtol, atol=atol)
    if not sol.success:
        raise ArithmeticError(f"ode_continuous: solver failed ({sol.message})")
    return sol.y


def drift_sign(instance, m0, c_hat=None) -> int:
    """Direction of motion of the ODE from m₀: sign(h(m₀)) (0 at a fixed point or |m₀| = u⊥)."""
    u = instance.u_perp
    if abs(m0) >= u:
        return 0
    return int(np.sign(float(h_exact(instance, m0, c_hat=c_hat))))


def steps_to_reach(instance, eta, m0, level, c_hat=None, method: str = "continuous",
                   max_steps: int = 10**9, table: HTable | None = None) -> float:
    """Steps for the population dynamics from m₀ to reach the overlap ``level`` (0 < level).

    The 1-D autonomous flow is monotone, moving in the direction s = sign(h(m₀)); the target
    is s·level and the answer is 0 if s·m₀ ≥ level already. ``inf`` if the trajectory never
    gets there (level ≥ u⊥, h(m₀) = 0, or h vanishes between m₀ and the target).

    method : ``"continuous"`` — T = ∫ dm / (η h(m)(u⊥² − m²)) by adaptive quadrature with the
        exact h (a float); ``"discrete"`` — the first t with s·m̄_t ≥ level under the map
        (an integer-valued float, ``inf`` beyond ``max_steps``, at a fixed point short of the
        level or after a blow-up); when ``max_steps`` exceeds ``MAP_STEPS_MAX`` the flow is
        followed in RK4 blocks up to the block that reaches the level (within O(η) of the
        map, as in :func:`population_ode`).
    """
    eta = _check_eta(eta)
    m0 = float(_check_m0(instance, m0)[0])
    level = float(level)
    if not math.isfinite(level) or level <= 0.0:
        raise ValueError(f"level must be a number > 0, got {level:g}")
    s = drift_sign(instance, m0, c_hat)
    if s == 0:
        return 0.0 if abs(m0) >= level else math.inf
    if s * m0 >= level:
        return 0.0
    if level >= instance.u_perp:
        return math.inf
    target = s * level
    grid = np.linspace(m0, target, 2001)
    hv = h_exact(instance, grid, c_hat=c_hat)
    if np.any(np.sign(hv) != s):
        return math.inf
    if method == "continuous":
        u2 = instance.u_perp**2

        def integrand(m):
            return 1.0 / (eta * float(h_exact(instance, m, c_hat=c_hat)) * (u2 - m * m))

        val, _ = scipy.integrate.quad(integrand, m0, target, epsabs=0.0, epsrel=1e-11, limit=500)
        return float(abs(val))
    if method != "discrete":
        raise ValueError(f"method must be 'continuous' or 'discrete', got {method!r}")
    tab = table if table is not None else HTable.for_instance(instance, c_hat)
    uperp = instance.u_perp
    K = _flow_block(tab, eta, uperp, np.array([int(max_steps)]))
    t = _first_crossing(m0, eta, uperp, tab.table, tab.n, target, s, int(max_steps), K,
                        BLOWUP * uperp)
    return math.inf if t < 0 else float(t)


@numba.njit(cache=True)
def _first_crossing(m, eta, uperp, tab, n, target, s, max_steps, K, bound):  # pragma: no cover
    """First t ≤ max_steps with s·m̄_t ≥ s·target, −1 if none. Up to ``MAP_STEPS_MAX`` steps
    (K = 1) the map step by step; beyond, RK4 blocks of K steps of its flow while they stay
    short of the target, then the map from the block that reaches it (as population_ode).
    A fixed point in floating point (the step returns its input) or a blow-up (|m| > bound)
    ends the search: the map never gets there."""
    u2 = uperp * uperp
    hk = float(K)
    t = 0
    while t <= max_steps:
        if s * m >= s * target:
            return t
        if K > 1 and t + K <= max_steps:
            new = _rk4(tab, n, uperp, eta, m, hk)
            if not abs(new) <= bound:
                return -1
            if s * new < s * target:
                if new == m:
                    return -1
                m = new
                t += K
                continue
            for _ in range(K):  # the flow gets there within this block: the map from here
                m = m + eta * table_eval(tab, n, uperp, m) * (u2 - m * m)
                t += 1
                if s * m >= s * target:
                    return t
            continue
        new = m + eta * table_eval(tab, n, uperp, m) * (u2 - m * m)
        if not abs(new) <= bound or new == m:
            return -1
        m = new
        t += 1
    return -1
