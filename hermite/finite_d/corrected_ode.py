r"""Finite-d corrected population ODE of the overlap, its noise floor and hitting times.

The plain population ODE m̄_{t+1} = m̄_t + η h(m̄_t)(u⊥² − m̄_t²) is the η → 0 limit of the
projected online-SGD overlap. At finite (η, d) the normalisation in eq. 4 adds a drift of
order η²d. In μ = m/u⊥ units one step is exactly (``hermite.finite_d.noise``, eq. ★)

    μ′ = (μ + A)·(1 + B)^{−1/2},  A = −η g √(1−μ²) t,  B = η² g² (t² + ‖r‖²),  ‖r‖² ~ χ²_{d−k−2}.

Expansion. (1 + B)^{−1/2} = 1 − B/2 + 3B²/8 − …, so

    μ′ − μ = A − μB/2 − AB/2 + 3μB²/8 + O(|A|B² + B³),
    E[μ′ − μ] = η h̃(μ)(1−μ²) − (η²/2) μ E[g²(t² + ‖r‖²)]
                + (η³/2)√(1−μ²) E[g³ t (t² + ‖r‖²)] + (3/8) μ η⁴ E[g⁴ (t² + ‖r‖²)²] + …

At fixed d and η → 0 the first two terms are the complete O(η²) drift — the "second_order"
drift, with E[g²(t² + ‖r‖²)] = E[S²‖Px‖²] = (d−k−2)E[S²] + E[S²(a²+b²−s²)] (note
a² + b² − s² = t²). The cross term −E[AB]/2 is O(η³d) and the B² term O(η⁴d²): relative to the
kept noise term they are O(ηd·E[g³t]/E[g²]) and O(ηd·E[g⁴]/E[g²]), so they are *not* negligible
when ηd is O(1) (the η = c/d scaling, docs/conventions.md) and g is heavy-tailed; in that
scaling the two kept terms are O(η) and all four neglected ones O(η²), the same order as E[g²t²].
Measured (ReLU, k = 5, d = 200, frozen ĉ ≠ c): the floors of the truncation and of the exact
drift differ by 3e-5 at ηd = 0.2, 4e-4 at 0.4, 2e-3 at 0.6 and 7e-3 at 0.8. Hence
the default ``method="exact"`` uses the exact conditional mean E[μ′ − μ | μ] of one step (★)
(randomised QMC in (z, s, t), Gauss rule in ‖r‖², exact first-order part), which contains every
order; ``"second_order"`` is the truncation above, ``"plain"`` the η → 0 map. The step is
then iterated as a deterministic map μ̄_{t+1} = μ̄_t + D(μ̄_t) ("mean-field": it neglects the
O(Var·D″) correction E[D(μ_t)] − D(E μ_t); ``closure=True`` / :mod:`hermite.finite_d.lna` add it).
On the issue's ReLU instance (d = 200, η = 1e-3, ĉ = c) the mean-field map sits ≈ 2.3 SE of a
4096-run mean above the SGD mean mid-curve (D is concave); with the closure the gap is < 1.5 SE.

Tabulation: D(μ) and the one-step variance V(μ) are computed at G Chebyshev-like points
μ_j = cos θ_j (θ uniform on [0, π]; functions like √(1−ρ) from K′ of ReLU are smooth in θ but
not in μ), splined in θ, and resampled on a fine uniform θ table (8193 points) read by linear
interpolation in numba, linear in θ² near μ = 1 and in (π − θ)² near μ = −1 (so D ∝ 1 − μ is
exact there; error ≲ 1e-7 relative elsewhere; the sampling error is reported separately).

Noise floor: m_∞(η, d) = u⊥·μ_∞, μ_∞ the first zero of s·D(s·μ) for μ from 0 to 1,
s = sign(h(0)) (the stable fixed point the mean-field map reaches from m₀ = 0⁺); μ_∞ = 1 when
D keeps the sign of s on (0, 1) (e.g. ĉ = c without label noise, small ηd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numba
import numpy as np
import scipy.interpolate
import scipy.optimize

from hermite.finite_d.noise import DEFAULT_SAMPLES, _c_hat, _key, h_tilde, one_step_moments
from hermite.flows.ode import FLOW_RATE, MAP_STEPS_MAX, _check_m0
from hermite.flows.regime import FinetuneRegime

__all__ = [
    "DriftTable",
    "drift_table",
    "regime_table",
    "corrected_ode",
    "corrected_mean",
    "noise_floor",
    "stationary_moments",
    "corrected_steps_to_reach",
    "METHODS",
]

METHODS = ("exact", "second_order", "plain")
VAR_BLOWUP = 1.0  # the LNA variance of μ ∈ [−1, 1] beyond which it is a blow-up (μ units)
_FINE = 8193
_THETA_CUT = 0.02  # below this angle from ±1, D′ and D″ are held at their value there


@dataclass
class DriftTable:
    """One-step drift D(μ), its derivatives and the one-step variance V(μ), in μ units.

    ``theta`` (G,) coarse grid, ``drift``, ``var``, ``se_drift``, ``se_var`` on it; ``fine_*``
    the (F,) tables on a uniform θ grid of step ``dth`` used by the numba loops (D, dD/dμ,
    d²D/dμ², V). ``sign`` = sign h(0) (+1 when h(0) = 0).
    """

    instance: object
    eta: float
    d: int
    method: str
    c_hat: np.ndarray
    label_noise: float
    theta: np.ndarray
    drift: np.ndarray
    var: np.ndarray
    se_drift: np.ndarray
    se_var: np.ndarray
    sign: int
    samples: int
    drift_reps: np.ndarray | None = field(repr=False, default=None)
    fine_drift: np.ndarray = field(repr=False, default=None)
    fine_dprime: np.ndarray = field(repr=False, default=None)
    fine_dsecond: np.ndarray = field(repr=False, default=None)
    fine_var: np.ndarray = field(repr=False, default=None)
    dth: float = 0.0
    _spline: object = field(repr=False, default=None)

    @property
    def u_perp(self) -> float:
        return self.instance.u_perp

    def __post_init__(self):
        th = self.theta
        # D is smooth in θ with D′(0) = D′(π) = 0 (D = D(±1) + O(θ²): even in θ, up to θ³
        # terms from kinks), so clamp the end slopes: keeps D − D(1) ∝ θ² ∝ 1 − μ accurate in
        # *relative* terms as μ → 1, which sets the late-time convergence rate
        clamped = ((1, 0.0), (1, 0.0))
        self._spline = scipy.interpolate.CubicSpline(th, self.drift, bc_type=clamped)
        vspl = scipy.interpolate.CubicSpline(th, np.maximum(self.var, 0.0), bc_type=clamped)
        fine = np.linspace(0.0, math.pi, _FINE)
        self.dth = fine[1] - fine[0]
        d0 = self._spline(fine)
        d1 = self._spline(fine, 1)
        d2 = self._spline(fine, 2)
        sin = np.sin(fine)
        cos = np.cos(fine)
        cut = (fine < _THETA_CUT) | (fine > math.pi - _THETA_CUT)
        safe = np.where(cut, 1.0, sin)
        dp = -d1 / safe
        dpp = (d2 * safe - d1 * cos) / safe**3
        lo = np.searchsorted(fine, _THETA_CUT)
        hi = np.searchsorted(fine, math.pi - _THETA_CUT) - 1
        dp[:lo], dp[hi + 1:] = dp[lo], dp[hi]
        dpp[:lo], dpp[hi + 1:] = dpp[lo], dpp[hi]
        self.fine_drift = np.ascontiguousarray(d0)
        self.fine_dprime = np.ascontiguousarray(dp)
        self.fine_dsecond = np.ascontiguousarray(dpp)
        self.fine_var = np.ascontiguousarray(np.maximum(vspl(fine), 0.0))

    def replicates(self) -> list[DriftTable]:
        """The table rebuilt from each scrambled replicate's drift alone (same variance)."""
        if self.drift_reps is None:
            return []
        return [DriftTable(self.instance, self.eta, self.d, self.method, self.c_hat,
                           self.label_noise, self.theta, self.drift_reps[:, r], self.var,
                           self.se_drift, self.se_var, self.sign, self.samples)
                for r in range(self.drift_reps.shape[1])]

    # -- evaluation (μ units) ------------------------------------------------------
    def D(self, mu):
        """Spline value of the drift at μ (numpy)."""
        return self._spline(np.arccos(np.clip(mu, -1.0, 1.0)))

    def floor(self) -> tuple[float, float]:
        """(μ_∞, its sampling standard error) — see the module docstring."""
        s = self.sign
        th = np.linspace(math.pi / 2, 0.0, 4097) if s > 0 else np.linspace(math.pi / 2,
                                                                            math.pi, 4097)
        vals = s * self._spline(th)
        neg = np.nonzero(vals <= 0.0)[0]
        neg = neg[neg > 0]
        if neg.size == 0 or (neg[0] == th.size - 1 and abs(vals[-1]) <= 1e-15):
            return float(s), 0.0
        j = neg[0]
        if vals[j] == 0.0:
            root = th[j]
        else:
            root = scipy.optimize.brentq(lambda x: float(self._spline(x)), th[j - 1], th[j],
                                         xtol=1e-14)
        mu = math.cos(root)
        slope = abs(float(self._spline(root, 1)) / max(math.sin(root), 1e-12))
        se_d = float(np.interp(root, self.theta, self.se_drift))
        return mu, (se_d / slope if slope > 0 else math.inf)


_TABLE_CACHE: dict = {}


def drift_table(instance, eta, d=None, *, method="exact", c_hat=None, label_noise=0.0,
                grid=129, samples=DEFAULT_SAMPLES, seed=0) -> DriftTable:
    """Build (or fetch from a small cache) the :class:`DriftTable` for (instance, η, d)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    eta = float(eta)
    if not math.isfinite(eta) or eta <= 0:
        raise ValueError(f"eta must be a finite number > 0, got {eta!r}")
    d = instance.d if d is None else int(d)
    if d is None or d < instance.k + 2:
        raise ValueError(f"d must be ≥ k + 2 = {instance.k + 2}")
    ch = _c_hat(instance, c_hat)
    key = _key(instance, ch) + (eta, d, method, float(label_noise), grid, samples, seed)
    tab = _TABLE_CACHE.get(key)
    if tab is not None:
        return tab
    theta = np.linspace(0.0, math.pi, grid)
    mu = np.cos(theta)
    mom = one_step_moments(instance, mu, eta, d, c_hat=ch, label_noise=label_noise,
                           samples=samples, seed=seed, exact=(method == "exact"))
    if method == "exact":
        drift, var, se_d, se_v = mom.drift, mom.var, mom.se_drift, mom.se_var
        reps = mom.drift_reps
    elif method == "second_order":
        drift, var, se_d, se_v = mom.drift2, mom.var1, mom.se_drift2, np.zeros(grid)
        reps = mom.drift2_reps
    else:
        drift = eta * mom.h_tilde * (1 - mu**2)
        var, se_d, se_v, reps = mom.var1, np.zeros(grid), np.zeros(grid), None
    h0 = float(h_tilde(instance, [0.0], ch)[0])
    sign = 1 if h0 >= 0 else -1
    tab = DriftTable(instance, eta, d, method, ch, float(label_noise), theta, drift, var, se_d,
                     se_v, sign, samples, reps)
    if len(_TABLE_CACHE) > 32:
        _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
    _TABLE_CACHE[key] = tab
    return tab


def regime_table(instance, regime: FinetuneRegime, c_hat=None, **table_kw) -> DriftTable:
    """The :class:`DriftTable` of the learner's ``regime`` (projected, frozen ĉ, b = 1: the
    finite-d map's; its η, d (None: the instance's) and label noise), ``c_hat`` the frozen ĉ
    (default the instance's), ``table_kw`` :func:`drift_table`'s method, grid, samples, seed."""
    if not regime.project or regime.joint_c or regime.batch != 1:
        raise ValueError("the finite-d map is derived for projected û, frozen ĉ and b = 1")
    return drift_table(instance, regime.eta, regime.d, c_hat=c_hat,
                       label_noise=regime.label_noise, **table_kw)


def _table(instance, eta, d, table: DriftTable | None, table_kw: dict) -> DriftTable:
    """``table``, or the one :func:`drift_table` builds for (instance, η, d) from its
    keywords ``table_kw`` (method, c_hat, label_noise, grid, samples, seed); both is a
    TypeError."""
    if table is None:
        return drift_table(instance, eta, d, **table_kw)
    if table_kw:
        raise TypeError(f"got a drift table and drift_table's keyword(s) "
                        f"{', '.join(table_kw)}: give one or the other")
    return table


# ---------------------------------------------------------------- numba kernels
@numba.njit(cache=True, inline="always")
def _lookup(tab, dth, mu):  # pragma: no cover - compiled
    if mu >= 1.0:
        return tab[0]
    if mu <= -1.0:
        return tab[tab.size - 1]
    th = math.acos(mu)
    i = int(th / dth)
    if i >= tab.size - 1:
        return tab[tab.size - 1]
    # linear in θ² on the half near θ = 0 and in (π − θ)² on the other: exact for the
    # D0 + c·(1 − μ) behaviour at μ → ±1, where 1 − μ ≈ θ²/2 spans many decades in one cell
    a = i * dth
    b = a + dth
    if th < 0.5 * math.pi:
        f = (th * th - a * a) / (b * b - a * a)
    else:
        pa, pb, pt = math.pi - a, math.pi - b, math.pi - th
        f = (pa * pa - pt * pt) / (pa * pa - pb * pb)
    return tab[i] * (1.0 - f) + tab[i + 1] * f


@numba.njit(cache=True, inline="always")
def _rates(m, v, drift, dprime, dsecond, var, dth, closure):  # pragma: no cover - compiled
    """Flow of the map per step: dm/dt = D(m) (+ ½D″(m)v), dv/dt = log((1 + D′)²)v + Var(m)."""
    dm = _lookup(drift, dth, m)
    if closure:
        dm += 0.5 * _lookup(dsecond, dth, m) * v
    dp = _lookup(dprime, dth, m)
    return dm, math.log((1.0 + dp) ** 2) * v + _lookup(var, dth, m)


@numba.njit(cache=True)
def _flow(m, v, K, drift, dprime, dsecond, var, dth, closure):  # pragma: no cover - compiled
    """One RK4 step of length K (steps) of :func:`_rates`, m clipped to [−1, 1]."""
    h = float(K)
    a1, b1 = _rates(m, v, drift, dprime, dsecond, var, dth, closure)
    a2, b2 = _rates(m + 0.5 * h * a1, v + 0.5 * h * b1, drift, dprime, dsecond, var, dth,
                    closure)
    a3, b3 = _rates(m + 0.5 * h * a2, v + 0.5 * h * b2, drift, dprime, dsecond, var, dth,
                    closure)
    a4, b4 = _rates(m + h * a3, v + h * b3, drift, dprime, dsecond, var, dth, closure)
    m = m + h * (a1 + 2.0 * a2 + 2.0 * a3 + a4) / 6.0
    v = v + h * (b1 + 2.0 * b2 + 2.0 * b3 + b4) / 6.0
    return min(1.0, max(-1.0, m)), v


@numba.njit(cache=True)
def _iterate(mu0, ckpts, drift, dth, dprime, K):  # pragma: no cover - compiled
    """The map from each μ₀, recorded at ckpts; with K > 1, whole blocks of K steps are one
    RK4 step of its flow (the remainder before each checkpoint is iterated exactly). A fixed
    point in floating point skips to the checkpoint (exact); a non-finite value is a blow-up:
    NaN from there, its step in the second output (−1: none)."""
    r_total = mu0.size
    out = np.empty((r_total, ckpts.size))
    blow = np.full(r_total, -1, dtype=np.int64)
    for r in range(r_total):
        m = mu0[r]
        t = 0
        for c in range(ckpts.size):
            while m == m and K > 1 and t + K <= ckpts[c]:
                new, _ = _flow(m, 0.0, K, drift, dprime, drift, drift, dth, False)
                if not math.isfinite(new):
                    m = np.nan
                    blow[r] = t + K
                    break
                if new == m:
                    t += K * ((ckpts[c] - t) // K)
                else:
                    t += K
                m = new
            while m == m and t < ckpts[c]:
                new = m + _lookup(drift, dth, m)
                if new > 1.0:
                    new = 1.0
                elif new < -1.0:
                    new = -1.0
                t += 1
                if not math.isfinite(new):
                    m = np.nan
                    blow[r] = t
                    break
                if new == m:
                    t = ckpts[c]
                m = new
            out[r, c] = m
    return out, blow


@numba.njit(cache=True)
def _lna(mu0, v0, ckpts, drift, dprime, dsecond, var, dth, closure, K):  # pragma: no cover
    """Mean and LNA variance along each path; the variance of μ ∈ [−1, 1] is at most 1, so a
    non-finite mean or a variance above ``VAR_BLOWUP`` is a blow-up: NaN from that step (its
    step in the third output, −1: none). A fixed point of (m, v) in floating point skips to
    the checkpoint (exact)."""
    r_total = mu0.size
    mean = np.empty((r_total, ckpts.size))
    vout = np.empty((r_total, ckpts.size))
    blow = np.full(r_total, -1, dtype=np.int64)
    for r in range(r_total):
        m = mu0[r]
        v = v0[r]
        t = 0
        for c in range(ckpts.size):
            while m == m and K > 1 and t + K <= ckpts[c]:
                mn, vn = _flow(m, v, K, drift, dprime, dsecond, var, dth, closure)
                if not (math.isfinite(mn) and vn <= VAR_BLOWUP):
                    m = v = np.nan
                    blow[r] = t + K
                    break
                if mn == m and vn == v:
                    t += K * ((ckpts[c] - t) // K)
                else:
                    t += K
                m, v = mn, vn
            while m == m and t < ckpts[c]:
                dp = _lookup(dprime, dth, m)
                vn = (1.0 + dp) ** 2 * v + _lookup(var, dth, m)
                step = _lookup(drift, dth, m)
                if closure:
                    step += 0.5 * _lookup(dsecond, dth, m) * v
                mn = m + step
                if mn > 1.0:
                    mn = 1.0
                elif mn < -1.0:
                    mn = -1.0
                t += 1
                if not (math.isfinite(mn) and vn <= VAR_BLOWUP):
                    m = v = np.nan
                    blow[r] = t
                    break
                if mn == m and vn == v:
                    t = ckpts[c]
                m, v = mn, vn
            mean[r, c] = m
            vout[r, c] = v
    return mean, vout, blow


@numba.njit(cache=True)
def _hit(mu0, target, sign, max_steps, drift, dth):  # pragma: no cover - compiled
    out = np.empty(mu0.size)
    for r in range(mu0.size):
        m = mu0[r]
        t = 0
        while sign * m < target and t < max_steps:
            step = _lookup(drift, dth, m)
            if not sign * step > 0.0 or m + step == m:  # stalls (or a fixed point in floats)
                t = max_steps
                break
            m = m + step
            t += 1
        out[r] = t if sign * m >= target else np.inf
    return out


# ---------------------------------------------------------------- public API
def flow_block(tab: DriftTable, ckpts) -> int:
    """Steps per RK4 block of the maps' flow: 1 (the exact map, step by step) up to
    ``MAP_STEPS_MAX`` steps, beyond that K with K·max|D′| = ``FLOW_RATE`` (RK4 error per
    block ~ FLOW_RATE⁵; the flow differs from the map by O(η))."""
    if int(np.max(ckpts)) <= MAP_STEPS_MAX:
        return 1
    lip = float(np.max(np.abs(tab.fine_dprime)))
    return max(1, int(FLOW_RATE / lip)) if lip > 0 else int(np.max(ckpts))


def _mu0(instance, m0):
    """m₀ validated by :func:`hermite.flows.ode._check_m0`, in μ = m/u_perp units."""
    return np.clip(_check_m0(instance, m0) / instance.u_perp, -1.0, 1.0)


def _ckpts(steps):
    arr = np.atleast_1d(np.asarray(steps))
    if arr.ndim != 1 or arr.size == 0 or np.any(arr != np.round(arr)) or np.any(arr < 0):
        raise ValueError("steps must be a non-empty 1-D array of non-negative integers")
    arr = arr.astype(np.int64)
    if np.any(np.diff(arr) < 0):
        raise ValueError("steps must be sorted in increasing order")
    return arr


def corrected_ode(instance, eta, d, m0, steps, *, closure=False, table: DriftTable | None = None,
                  return_blowup: bool = False, **table_kw) -> np.ndarray:
    """Iterate the finite-d mean-field map m̄_{t+1} = m̄_t + u⊥·D(m̄_t/u⊥) from each m₀.

    ``closure=True`` adds the Gaussian-closure term ½D″(μ̄)Var_t with the LNA variance of the
    SGD noise accumulated along each path (:mod:`hermite.finite_d.lna`): E[D(μ_t)] instead of D(E
    μ_t). It is the better predictor of the *mean* overlap (the mean-field map sits O(η) above it
    where D is concave), at the cost of the LNA's validity conditions.

    ``method="second_order"`` is m̄_{t+1} = m̄_t + η h(m̄)(u⊥² − m̄²) − (η²/2) u⊥ μ̄
    E[S²‖Px‖²](μ̄) (μ̄ = m̄/u⊥; for u⊥ = 1 exactly the formula of issue 8); ``"exact"`` uses
    the exact one-step mean (default); ``"plain"`` is the η → 0 map. Same call shape as
    :func:`hermite.flows.ode.population_ode` plus ``d``: m0 (R,), steps (C,) sorted checkpoints;
    returns (R, C). Cost: table build once (~G × 20 ms), then numba, ~5 ns per step per run.
    The map keeps m̄ in [−u⊥, u⊥]; a non-finite value (or, with ``closure``, an LNA variance
    of μ above ``VAR_BLOWUP`` = 1, the most a quantity in [−1, 1] can have) is a blow-up: the
    run reads NaN from there, and ``return_blowup=True`` also returns the (R,) blow-up steps
    (−1: none). A fixed point in floating point skips to the next checkpoint (exact).
    The map's drift is ``table`` (e.g. :func:`regime_table`'s), or the one :func:`drift_table`
    builds from its keywords ``table_kw`` (method, c_hat, label_noise, grid, samples, seed).
    """
    tab = _table(instance, eta, d, table, table_kw)
    mu0, ck = _mu0(instance, m0), _ckpts(steps)
    if closure:
        mu, _, blow = _lna(mu0, np.zeros(mu0.size), ck, tab.fine_drift, tab.fine_dprime,
                           tab.fine_dsecond, tab.fine_var, tab.dth, True, flow_block(tab, ck))
    else:
        mu, blow = _iterate(mu0, ck, tab.fine_drift, tab.dth, tab.fine_dprime,
                            flow_block(tab, ck))
    return (instance.u_perp * mu, blow) if return_blowup else instance.u_perp * mu


def corrected_mean(instance, eta, d, m0, steps, *, closure=False,
                   table: DriftTable | None = None,
                   **table_kw) -> tuple[np.ndarray, np.ndarray]:
    """Run-averaged prediction (C,) of :func:`corrected_ode` from the runs' m₀, and its
    sampling standard error (C,): the spread of the predictions of the 8 single-replicate
    tables /√8 (first-order propagation of the drift's sampling error to the curve). Use it in
    z-scores next to the simulation's SE; raise ``samples`` when it is not small. ``table``
    and ``table_kw`` as in :func:`corrected_ode`."""
    tab = _table(instance, eta, d, table, table_kw)
    mean = corrected_ode(instance, eta, d, m0, steps, closure=closure, table=tab).mean(axis=0)
    m0 = np.atleast_1d(np.asarray(m0, dtype=float))
    sub = m0[:: max(1, m0.size // 512)]  # the replicate spread needs no more initial values
    reps = [corrected_ode(instance, eta, d, sub, steps, closure=closure, table=r).mean(axis=0)
            for r in tab.replicates()]
    if not reps:
        return mean, np.zeros_like(mean)
    reps = np.array(reps)
    return mean, reps.std(axis=0, ddof=1) / math.sqrt(len(reps))


def noise_floor(instance, eta, d=None, *, c_hat=None, label_noise=0.0, method="exact",
                refine_samples=2**20, table: DriftTable | None = None,
                **table_kw) -> tuple[float, float]:
    """Predicted noise floor m_∞(η, d) (the root of the drift) and its sampling SE.

    The root is located on the drift table, then (``refine_samples`` > 0, methods ``exact``
    and ``second_order``) re-solved by Brent's method on single-point drift evaluations with
    ``refine_samples`` fresh common random numbers, SE = SE(D)/|D′| at the root.
    """
    tab = table or drift_table(instance, eta, d, method=method, c_hat=c_hat,
                               label_noise=label_noise, **table_kw)
    mu, se = tab.floor()
    if refine_samples and tab.method != "plain" and abs(mu) < 1.0:
        exact = tab.method == "exact"
        seed = table_kw.get("seed", 0) + 1

        def moments(x):
            return one_step_moments(instance, [x], tab.eta, tab.d, c_hat=tab.c_hat,
                                    label_noise=tab.label_noise, samples=refine_samples,
                                    seed=seed, exact=exact)

        def value(x):
            mom = moments(x)
            return float(mom.drift[0] if exact else mom.drift2[0])

        s = tab.sign
        width = min(max(8 * se, 1e-3), 0.05) if math.isfinite(se) else 0.05
        lo = mu - s * width
        hi = mu + s * min(width, 0.5 * (1.0 - abs(mu)))   # stays strictly inside (−1, 1)
        flo, fhi = s * value(lo), s * value(hi)
        if flo > 0 > fhi:
            mu = scipy.optimize.brentq(value, lo, hi, xtol=1e-8)
            mom = moments(mu)
            se_d = float(mom.se_drift[0] if exact else mom.se_drift2[0])
            slope = abs(_dprime(tab, mu))
            se = se_d / slope if slope > 0 else math.inf
    return instance.u_perp * mu, instance.u_perp * se


def _dprime(tab, mu):
    th = math.acos(min(1.0, max(-1.0, mu)))
    return float(np.interp(th, np.arange(tab.fine_dprime.size) * tab.dth, tab.fine_dprime))


def _fine(tab, arr, mu):
    th = np.arccos(np.clip(mu, -1.0, 1.0))
    return np.interp(th, np.arange(arr.size) * tab.dth, arr)


def stationary_moments(instance, eta, d=None, *, c_hat=None, label_noise=0.0,
                       method="exact", refine_samples=2**20, table: DriftTable | None = None,
                       **table_kw) -> tuple[float, float]:
    """(mean, sd) of the stationary law of m near the noise floor, Gaussian closure of the LNA.

    Fixed point of μ̄ ← μ̄ + D(μ̄) + ½D″(μ̄)v, v ← (1 + D′(μ̄))²v + V(μ̄):
    v = V/(−2D′ − D′²) and D(μ̄) + ½D″(μ̄) v(μ̄) = 0, solved near the drift root. The shift
    from the root, ≈ −D″V/(4D′²), is O(η) relative to 1 − m_∞. Returns (u⊥·μ̄, u⊥·√v);
    (floor, 0) when the floor is ±1 (law degenerate at the boundary). With ``refine_samples``
    the closure shift (computed on the table) is added to the refined root of
    :func:`noise_floor`, so both share its sampling error.
    """
    tab = table or drift_table(instance, eta, d, method=method, c_hat=c_hat,
                               label_noise=label_noise, **table_kw)
    mu0, _ = tab.floor()
    up = instance.u_perp
    if abs(mu0) >= 1.0:
        return up * mu0, 0.0

    def parts(x):
        dp = _fine(tab, tab.fine_dprime, x)
        v = _fine(tab, tab.fine_var, x) / np.maximum(-2 * dp - dp * dp, 1e-300)
        return _fine(tab, tab.fine_drift, x) + 0.5 * _fine(tab, tab.fine_dsecond, x) * v, v

    s = tab.sign
    grid = mu0 - s * np.linspace(0.0, min(0.5, abs(mu0)), 2001)
    f = s * parts(grid)[0]
    pos = np.nonzero(f > 0)[0]
    if pos.size == 0:
        return up * mu0, math.nan
    j = pos[0]
    if j == 0:
        root = grid[0]
    else:
        root = scipy.optimize.brentq(lambda x: float(parts(x)[0]), grid[j], grid[j - 1])
    sd = up * math.sqrt(float(parts(root)[1]))
    if refine_samples:
        refined, _ = noise_floor(instance, eta, tab.d, refine_samples=refine_samples, table=tab,
                                 seed=table_kw.get("seed", 0))
        return refined + up * (root - mu0), sd
    return up * root, sd


def corrected_steps_to_reach(instance, eta, d, level, m0, *, max_steps=10**9,
                             table: DriftTable | None = None, **table_kw) -> np.ndarray:
    """First t with sign(h(0))·m̄_t ≥ level under the corrected map, from each m₀ (R,).

    ``inf`` when the map stalls (its drift changes sign first, i.e. level is beyond the noise
    floor) or after ``max_steps``. ``table`` and ``table_kw`` as in :func:`corrected_ode`.
    """
    tab = _table(instance, eta, d, table, table_kw)
    up = instance.u_perp
    level = float(level)
    if not 0 < level:
        raise ValueError("level must be > 0")
    if level > up:
        return np.full(np.atleast_1d(m0).size, np.inf)
    mu0 = _mu0(instance, m0)
    target = level / up
    # the map reaches the target iff s·D > 0 on the whole path (else it stalls at the root)
    th = np.arange(tab.fine_drift.size) * tab.dth
    path_mu = np.cos(th)
    sgn = tab.sign
    bad = sgn * tab.fine_drift <= 0.0
    out = np.full(mu0.size, np.inf)
    for r, x in enumerate(mu0):
        start = sgn * x
        if start >= target:
            out[r] = 0.0
            continue
        on_path = (sgn * path_mu >= start) & (sgn * path_mu <= target)
        if np.any(bad & on_path):
            continue
        out[r] = _hit(np.array([x]), target, float(sgn), int(max_steps), tab.fine_drift,
                      tab.dth)[0]
    return out
