"""Fine-tuning from a pre-trained base (issue 39, first case; docs/theory/pretraining-hurts.md).

Teacher y = σ(⟨u, x⟩), student ŷ = σ(⟨μu + a·v, x⟩) with a fixed base w₀ = μu (0 < μ < 1), a
scalar a and a unit v, both trained by online SGD. With m = ⟨v, u⟩, ν, z independent N(0, 1),
s = mν + √(1−m²)z, λ = μν + a·s and δ = (σ(λ) − σ(ν))σ′(λ), the population flow in t = steps·η is

    da/dt = −E[δs],   dm/dt = −a(E[δν] − m E[δs]) − (η/2)·a²·m·E[δ²]·(d−2)/B,

the last term (v's renormalisation at finite η·d/B) only when η, d and B are given. Its fixed
point (a, m) = (0, 0) has the Jacobian [[−c, −b], [−b, 0]] with

    b = E[(σ(μν) − σ(ν))σ′(μν)ν],   c = (E[σ′(μν)σ′(ν)] + b)/μ   (Stein's lemma: no σ″),

so the search phase escapes at λ₊ = (−c + √(c² + 4b²))/2, in time τ = 1/λ₊.

Expectations, vectorised over a batch of states: closed forms for ReLU (sector integrals of
the pair (ν, λ)) and erf (Gaussian tilts, Stein, the arcsine kernel), the exact tensor
Gauss–Hermite rule for polynomial σ. Any other σ takes the adaptive reference state by state:
b and c are 1-D composite Gauss–Legendre with σ(ν)'s and σ(μν)'s kinks as panel edges; the
drift a 2-D composite Gauss–Legendre rule over (ν, z) on panels scaled to σ(λ) with the kink
lines ν = k and λ = k as panel edges (graded like :mod:`hermite.expansion._pair_quadrature`),
good to ≲ 1e-11 (E[δ²] to ~3e-10 at |a| ~ 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.integrate import solve_ivp

from hermite._activation import resolve_activation
from hermite._quadrature import gauss_hermite, gauss_panels, legendre
from hermite.activations import Activation, get_activation
from hermite.expansion._pair_quadrature import _outer_edges

__all__ = [
    "PretrainedFlow",
    "escape_coefficients",
    "escape_rate",
    "escape_time",
    "flow_crossing_time",
    "pretrained_drift",
    "pretrained_flow",
    "pretrained_loss",
]

_ORDER = 8  # Gauss–Legendre nodes per panel of the plane rule (drift error ≲ 1e-11)
_TAIL = 10.0  # the plane rule's window: φ(10) ≈ 8e-23
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _check_mu(mu) -> float:
    mu = float(mu)
    if not 0.0 < mu < 1.0:
        raise ValueError(f"mu must be in (0, 1): the base w0 = mu·u needs it, got {mu!r}")
    return mu


def _renorm_rate(eta, d, batch) -> float:
    """η(d−2)/B of the renormalisation term, 0 when none of η, d, B is given."""
    given = [x is not None for x in (eta, d, batch)]
    if not any(given):
        return 0.0
    if not all(given):
        raise ValueError("eta, d and batch go together: give all three or none")
    if not (eta > 0 and d >= 2 and batch >= 1):
        raise ValueError(f"need eta > 0, d ≥ 2, batch ≥ 1, got {eta!r}, {d!r}, {batch!r}")
    return float(eta) * (float(d) - 2.0) / float(batch)


# ---------------------------------------------------------------- escape of the search phase
def escape_coefficients(activation, mu) -> tuple[float, float]:
    """(b, c) of the Jacobian [[−c, −b], [−b, 0]] at (a, m) = (0, 0), by 1-D quadrature.

    b = E[(σ(μν) − σ(ν))σ′(μν)ν], c = (E[σ′(μν)σ′(ν)] + b)/μ; composite Gauss–Legendre with
    the kinks k and k/μ of σ(ν), σ(μν) as panel edges (exact for piecewise σ).
    """
    act = resolve_activation(activation)
    mu = _check_mu(mu)
    kinks = tuple(act.breakpoints) + tuple(k / mu for k in act.breakpoints)
    x, w = gauss_panels(width=0.5, order=24, breakpoints=kinks)
    dmu = np.asarray(act.deriv(mu * x), dtype=np.float64)
    b = float(np.dot(w, (act.fn(mu * x) - act.fn(x)) * dmu * x))
    c = (float(np.dot(w, dmu * act.deriv(x))) + b) / mu
    return b, c


def _rate(b: float, c: float) -> float:
    """Largest root of λ² + cλ − b² = 0 (cancellation-free for c > 0)."""
    root = math.sqrt(c * c + 4.0 * b * b)
    return 2.0 * b * b / (c + root) if c > 0 else 0.5 * (root - c)


def escape_rate(activation, mu):
    """λ₊ = (−c + √(c² + 4b²))/2 per unit t = steps·η; a float, or an array for array μ."""
    act = resolve_activation(activation)
    mus = np.asarray(mu, dtype=np.float64)
    out = np.array([_rate(*escape_coefficients(act, x)) for x in mus.ravel()])
    return float(out[0]) if mus.ndim == 0 else out.reshape(mus.shape)


def escape_time(activation, mu):
    """τ = 1/λ₊ (``math.inf`` where λ₊ ≤ 0: b = 0 is a trap); float or array like μ."""
    lam = np.asarray(escape_rate(activation, mu), dtype=np.float64)
    with np.errstate(divide="ignore"):
        tau = np.where(lam > 0, 1.0 / np.where(lam > 0, lam, 1.0), math.inf)
    return float(tau) if tau.ndim == 0 else tau


# ---------------------------------------------------------------- population expectations
def _row_panels(edges: np.ndarray):
    """Composite Gauss–Legendre against φ on the panels between each row's sorted ``edges``."""
    t, wt = legendre(_ORDER)
    mid = 0.5 * (edges[:, 1:] + edges[:, :-1])
    half = 0.5 * (edges[:, 1:] - edges[:, :-1])
    x = (mid[..., None] + half[..., None] * t).reshape(edges.shape[0], -1)
    w = (half[..., None] * wt).reshape(edges.shape[0], -1)
    return x, w * _INV_SQRT_2PI * np.exp(-0.5 * x * x)


def _plane_rule(act: Activation, alpha: float, beta: float):
    """Nodes (ν, z) and weights w with Σ w F(ν, z) ≈ E[F] for F = G(ν, z, σ(ν), σ(λ), σ′(λ)),
    λ = αν + βz. Polynomial σ: exact tensor Gauss–Hermite. Otherwise composite Gauss–Legendre
    with panels ≤ 1/|α| in ν and ≤ 1/|β| in z (σ(λ)'s scale) and, for kinked σ, the kink lines
    ν = k and λ = k as panel edges: graded in ν around k/α (the edges of
    :mod:`hermite.expansion._pair_quadrature`), cut at z = (k − αν)/β for each ν node."""
    deg = act.polynomial_degree
    if deg is not None:
        x, w = gauss_hermite(2 * deg + 2)
        return x[:, None], x[None, :], w[:, None] * w[None, :]
    kinks = np.asarray(act.breakpoints, dtype=np.float64)
    graded = _outer_edges(alpha, abs(beta), kinks, kinks) if kinks.size else ()
    nu, w_nu = gauss_panels(width=1.0 / max(1.0, abs(alpha)), order=_ORDER,
                            breakpoints=tuple(graded), tail=_TAIL)
    base = np.linspace(-_TAIL, _TAIL, int(np.ceil(2 * _TAIL * max(1.0, abs(beta)))) + 1)
    edges = np.broadcast_to(base, (nu.size, base.size))
    if beta != 0.0 and kinks.size:
        cuts = np.clip((kinks[None, :] - alpha * nu[:, None]) / beta, -_TAIL, _TAIL)
        edges = np.sort(np.concatenate([edges, cuts], axis=1), axis=1)
    z, w_z = _row_panels(edges)
    return nu[:, None], z, w_nu[:, None] * w_z


def _moments(act: Activation, mu: float, a: float, m: float):
    """(E[δs], E[δν], E[δ²], E[(σ(λ) − σ(ν))²]) at the state (a, m)."""
    root = math.sqrt(max(0.0, 1.0 - m * m))
    nu, z, w = _plane_rule(act, mu + a * m, a * root)
    s = m * nu + root * z
    lam = mu * nu + a * s
    diff = act.fn(lam) - act.fn(nu)
    delta = diff * act.deriv(lam)
    return (float(np.sum(w * delta * s)), float(np.sum(w * delta * nu)),
            float(np.sum(w * delta * delta)), float(np.sum(w * diff * diff)))


def _reference_moments(act: Activation, mu: float, a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(4, N) moments of :func:`_moments` state by state: the adaptive reference."""
    return np.array([_moments(act, mu, float(x), float(y)) for x, y in zip(a, m, strict=True)]
                    ).reshape(-1, 4).T


def _pair(mu: float, a: np.ndarray, m: np.ndarray):
    """(√(1−m²), α, β, q) of λ = αν + βz = μν + a(mν + √(1−m²)z), q = Var λ = α² + β²."""
    root = np.sqrt(np.maximum(0.0, 1.0 - m * m))
    alpha, beta = mu + a * m, a * root
    return root, alpha, beta, alpha * alpha + beta * beta


def _relu_moments(mu: float, a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Closed form for ReLU: δ = λ1{λ>0} − ν1{ν>0, λ>0}. The one-indicator terms are
    E[λU1{λ>0}] = E[λU]/2 (symmetry); the two-indicator ones are sector integrals in polar
    coordinates of (ν, z): ν > 0, λ > 0 is θ ∈ (lo, hi), E[R²] = 2, so
    E[ν²1] = ∫cos²θ dθ/π and E[νz1] = ∫cosθ sinθ dθ/π (empty sector when λ ≡ 0)."""
    root, alpha, beta, q = _pair(mu, a, m)
    phi = np.arctan2(beta, alpha)
    lo = np.maximum(-0.5 * math.pi, phi - 0.5 * math.pi)
    hi = np.where(q > 0, np.minimum(0.5 * math.pi, phi + 0.5 * math.pi), lo)
    j_nn = (0.5 * (hi - lo) + 0.25 * (np.sin(2 * hi) - np.sin(2 * lo))) / math.pi
    j_nz = (np.sin(hi) ** 2 - np.sin(lo) ** 2) / (2.0 * math.pi)
    cross = alpha * j_nn + beta * j_nz  # E[relu(λ)relu(ν)] = E[λν1{ν>0, λ>0}]
    return np.array([0.5 * (mu * m + a) - (m * j_nn + root * j_nz), 0.5 * alpha - j_nn,
                     0.5 * q - 2.0 * cross + j_nn, 0.5 * (q + 1.0) - 2.0 * cross])


def _erf_pair(var_x, var_y, cov):
    """E[erf(X)erf(Y)] = (2/π)arcsin(2C/√((1+2Vx)(1+2Vy))) for a centred Gaussian pair."""
    return (2.0 / math.pi) * np.arcsin(2.0 * cov / np.sqrt((1 + 2 * var_x) * (1 + 2 * var_y)))


def _erf_moments(mu: float, a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Closed form for erf, σ′(λ) = (2/√π)e^{−λ²}. The weight e^{−cλ²} tilts (ν, z) ~ N(0, I)
    to N(0, I − k eeᵀ), e = (α, β), k = 2c/(1 + 2cq), with mass 1/√(1 + 2cq); then
    E[U erf(X)] = Cov(U, X)(2/√π)/√(1 + 2Var X) (Stein) and :func:`_erf_pair`."""
    root, alpha, beta, q = _pair(mu, a, m)
    e_s = mu * m + a  # ⟨s, e⟩ = Cov(s, λ)

    def stein(cov_ux, var_x):
        return cov_ux * (2.0 / math.sqrt(math.pi)) / np.sqrt(1.0 + 2.0 * var_x)

    g1 = 1.0 + 2.0 * q
    k1 = 2.0 / g1
    v_lam, v_nu = q / g1, 1.0 - k1 * alpha * alpha
    weight = (2.0 / math.sqrt(math.pi)) / np.sqrt(g1)
    ds = weight * (stein(e_s / g1, v_lam) - stein(m - k1 * e_s * alpha, v_nu))
    dnu = weight * (stein(alpha / g1, v_lam) - stein(v_nu, v_nu))
    g2 = 1.0 + 4.0 * q
    v_lam2, v_nu2, c_2 = q / g2, 1.0 - (4.0 / g2) * alpha * alpha, alpha / g2
    d2 = (4.0 / math.pi) / np.sqrt(g2) * (_erf_pair(v_lam2, v_lam2, v_lam2)
                                          + _erf_pair(v_nu2, v_nu2, v_nu2)
                                          - 2.0 * _erf_pair(v_lam2, v_nu2, c_2))
    gap = _erf_pair(q, q, q) + _erf_pair(1.0, 1.0, 1.0) - 2.0 * _erf_pair(q, 1.0, alpha)
    return np.array([ds, dnu, d2, gap])


_CHUNK = 1 << 20  # states × nodes per block of the polynomial rule


def _polynomial_moments(act: Activation, mu: float, a: np.ndarray, m: np.ndarray):
    """Polynomial σ: the exact tensor Gauss–Hermite rule of :func:`_plane_rule`, one array of
    states × nodes per block."""
    nu, z, w = (x.ravel() for x in np.broadcast_arrays(*_plane_rule(act, 0.0, 0.0)))
    out = np.empty((4, a.size))
    step = max(1, _CHUNK // w.size)
    for lo in range(0, a.size, step):
        ab, mb = a[lo:lo + step, None], m[lo:lo + step, None]
        s = mb * nu + np.sqrt(np.maximum(0.0, 1.0 - mb * mb)) * z
        lam = mu * nu + ab * s
        diff = act.fn(lam) - act.fn(nu)
        delta = diff * act.deriv(lam)
        out[:, lo:lo + step] = [(delta * s) @ w, (delta * nu) @ w, (delta * delta) @ w,
                                (diff * diff) @ w]
    return out


_CLOSED_FORMS = {"relu": _relu_moments, "erf": _erf_moments}


def _fast_moments(act: Activation):
    """(mu, a, m) ↦ (4, N) moments (E[δs], E[δν], E[δ²], E[(σ(λ) − σ(ν))²]) of flat states,
    vectorised over states: closed forms for the registry's ReLU and erf, the exact rule for
    polynomial σ; ``None`` for any other σ."""
    closed = _CLOSED_FORMS.get(act.name)
    if closed is not None and act is get_activation(act.name):
        return closed
    if act.polynomial_degree is not None:
        return lambda mu, a, m: _polynomial_moments(act, mu, a, m)
    return None


def _batch_moments(act: Activation):
    """The fast moments of σ where there are some, else the adaptive reference."""
    return _fast_moments(act) or (lambda mu, a, m: _reference_moments(act, mu, a, m))


def _check_state(a, m) -> tuple[np.ndarray, np.ndarray]:
    a, m = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(m, dtype=np.float64))
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(m))):
        raise ValueError("a and m must be finite")
    if np.any(np.abs(m) > 1.0):
        raise ValueError(f"|m| must be ≤ 1 (m = ⟨v, u⟩ with v, u unit), got {m[np.abs(m) > 1]}")
    return a, m


def _drift(moments, mu: float, a: np.ndarray, m: np.ndarray, renorm: float) -> np.ndarray:
    """(2, N) drift at flat states from a :func:`_batch_moments` function."""
    ds, dnu, d2, _ = moments(mu, a, np.clip(m, -1.0, 1.0))
    return np.array([-ds, -a * (dnu - m * ds) - 0.5 * renorm * a * a * m * d2])


def pretrained_drift(activation, mu, a, m, *, eta=None, d=None, batch=None):
    """(da/dt, dm/dt) of the population flow at (a, m) (scalars or broadcastable arrays);
    with η, d and B, dm/dt carries the renormalisation term −(η/2)a²m E[δ²](d−2)/B."""
    act = resolve_activation(activation)
    mu = _check_mu(mu)
    renorm = _renorm_rate(eta, d, batch)
    a, m = _check_state(a, m)
    out = _drift(_batch_moments(act), mu, a.ravel(), m.ravel(), renorm).reshape(2, *a.shape)
    return (float(out[0]), float(out[1])) if a.ndim == 0 else (out[0], out[1])


def pretrained_loss(activation, mu, a, m):
    """Population loss ½E[(σ(ν) − σ(λ))²], λ = μν + a(mν + √(1−m²)z); float or array."""
    act = resolve_activation(activation)
    mu = _check_mu(mu)
    a, m = _check_state(a, m)
    out = 0.5 * _batch_moments(act)(mu, a.ravel(), m.ravel())[3].reshape(a.shape)
    return float(out) if out.ndim == 0 else out


# ---------------------------------------------------------------- the flow
@dataclass(frozen=True)
class PretrainedFlow:
    """Solution of the population flow: ``a``, ``m`` of shape (runs, times) at ``times``
    (t = steps·η); ``overlap`` = |m| is what the learner records."""

    activation: str
    mu: float
    times: np.ndarray
    a: np.ndarray
    m: np.ndarray

    @property
    def overlap(self) -> np.ndarray:
        return np.abs(self.m)


def pretrained_flow(activation, mu, a0, m0, times, *, eta=None, d=None, batch=None
                    ) -> PretrainedFlow:
    """Integrate the flow from each start (a0[r], m0[r]) (a0 scalar or (R,), m0 (R,)) to the
    sorted ``times`` ≥ 0 (DOP853, rtol 1e-9, atol 1e-15: the drift's roundoff, so a₀ ≳ 1e-6
    keeps ≲ 1e-9 relative accuracy); η, d and B add the renormalisation term. With a fast
    drift (:func:`_fast_moments`) all runs are one system, else each run is solved alone."""
    act = resolve_activation(activation)
    mu = _check_mu(mu)
    renorm = _renorm_rate(eta, d, batch)
    a0, m0 = _check_state(a0, np.atleast_1d(np.asarray(m0, dtype=np.float64)))
    a0, m0 = np.atleast_1d(a0), np.atleast_1d(m0)
    times = np.atleast_1d(np.asarray(times, dtype=np.float64))
    if times.ndim != 1 or not np.all(np.isfinite(times)) or np.any(times < 0) \
            or np.any(np.diff(times) < 0):
        raise ValueError("times must be a 1-D sorted array of finite t ≥ 0")
    fast = _fast_moments(act)
    moments = fast or (lambda mu, a, m: _reference_moments(act, mu, a, m))
    a, m = _integrate(moments, mu, np.stack([a0, m0]), times, renorm, joint=fast is not None)
    return PretrainedFlow(act.name, mu, times, a, m)


def _integrate(moments, mu: float, starts: np.ndarray, times: np.ndarray, renorm: float, *,
               joint: bool) -> tuple[np.ndarray, np.ndarray]:
    """(a, m) of shape (runs, times) from ``starts`` (2, runs), all runs in one DOP853 system
    when ``joint`` (a vectorised drift), else run by run (rtol 1e-9, atol 1e-15 either way)."""
    runs = starts.shape[1]
    groups = [np.arange(runs)] if joint else [np.array([r]) for r in range(runs)]
    a_out = np.empty((runs, times.size))
    m_out = np.empty_like(a_out)
    for idx in groups:
        k = idx.size

        def rhs(_t, y, k=k):
            return _drift(moments, mu, y[:k], y[k:], renorm).ravel()

        sol = solve_ivp(rhs, (0.0, float(times[-1])), starts[:, idx].ravel(), method="DOP853",
                        t_eval=times, rtol=1e-9, atol=1e-15)
        if not sol.success:
            raise RuntimeError(f"pretrained_flow: the solver failed from {starts[:, idx].T}: "
                               f"{sol.message}")
        a_out[idx], m_out[idx] = sol.y[:k], np.clip(sol.y[k:], -1.0, 1.0)  # m = ±1 invariant
    return a_out, m_out


def flow_crossing_time(activation, mu, a0, m0, level, t_max, *, eta=None, d=None,
                       batch=None) -> float:
    """First t ∈ (0, t_max] with |m(t)| = ``level`` on the population flow from (a0, m0) (an
    event of the DOP853 solve, rtol 1e-9, atol 1e-15; η, d and B add the renormalisation
    term); 0 if |m0| ≥ level already, ``math.inf`` if not by t_max."""
    act = resolve_activation(activation)
    mu = _check_mu(mu)
    renorm = _renorm_rate(eta, d, batch)
    a0, m0 = (float(x) for x in _check_state(a0, m0))
    if not (0.0 < level <= 1.0 and t_max > 0):
        raise ValueError(f"need 0 < level ≤ 1 and t_max > 0, got {level!r}, {t_max!r}")
    if abs(m0) >= level:
        return 0.0
    moments = _batch_moments(act)

    def rhs(_t, y):
        return _drift(moments, mu, y[:1], y[1:], renorm).ravel()

    def hit(_t, y):
        return abs(y[1]) - level

    hit.terminal, hit.direction = True, 1
    sol = solve_ivp(rhs, (0.0, float(t_max)), [a0, m0], method="DOP853", events=hit,
                    rtol=1e-9, atol=1e-15)
    if not sol.success:
        raise RuntimeError(f"flow_crossing_time: the solver failed from ({a0}, {m0}): "
                           f"{sol.message}")
    return float(sol.t_events[0][0]) if sol.t_events[0].size else math.inf
