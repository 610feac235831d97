"""Nested (sequential-conditioning) Gaussian quadrature: E[Π_j f_j(x_j)] for x ~ N(0, C).

With a lower-triangular L, L Lᵀ = C (semidefinite Cholesky: a zero pivot leaves that
coordinate deterministic given the previous ones, so repeated or parallel fields are exact),
x_j = Σ_{i<j} L_ji z_i + L_jj z_j with z ~ N(0, I). The expectation is the iterated integral
over z_1, z_2, … of 1-D conditional expectations, each by a 1-D rule in z_j for
f_j(m_j + s_j z_j), m_j = Σ_{i<j} L_ji z_i, s_j = L_jj:

* smooth levels: n-point Gauss–Hermite (probabilists', normalised to N(0, 1));
* kinked levels: composite Gauss–Legendre on [−L, L] (L = ``TAIL``), weights times the
  Gaussian density and normalised to sum 1, with panel edges at f_j's kinks
  z = (b − m_j)/s_j and at the *crossings* — the z_j where a later kinked coordinate's
  conditional mean passes its breakpoint; there the inner integral has a smooth transition of
  width w = (remaining conditional deviation)/|L_ij|, and each half panel is mapped by
  z = e ± w sinh(u) to cluster its q nodes at the edge (plain when w = 0 or w ≥ the panel);
  the edges move with the outer nodes, so each outer node has its own rule;
* the last coordinate may carry a closed-form smoothing S(m, s) = E[f(m + s z)] (ReLU, step,
  abs, sign, erf, linear), and an ``inner`` callback may replace the last levels by a closed
  form of the conditional law (:func:`pair_inner`: E[f(c) f(d) | outer]; :func:`e2_inner`:
  E[(Σ c_i f(x_i))² | outer] from the ReLU/abs pair moments :func:`pair_relu`, Owen's T;
  the same rule compiled: :mod:`hermite.committee._fast`);
* :func:`nested_e2_smooth`: E[Π outer factors · (Σ c_i f(x_i))²] for smooth f, tensor
  Gauss–Hermite over every field, the sum carried level by level.

Cost: the product of the levels' node counts per covariance matrix (vectorised over a batch,
chunked to bound memory). Errors: docs/theory/committee.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import erf, ndtr, owens_t

from hermite._quadrature import gauss_hermite, legendre

__all__ = ["Factor", "semidefinite_cholesky", "nested_expectation", "TAIL"]

TAIL = 8.5  # window of the kinked rules: P(|z| > 8.5) = 1.9e-17
_INV_SQRT_2PI = 1.0 / np.sqrt(2.0 * np.pi)
_CHUNK_NODES = 3_000_000  # batch × nodes per chunk
_SHARP = 1e-9  # transitions narrower than this (in z) are treated as kinks (error ≲ 1e-9)
#: crossings wider than this (in z) are not made panel edges. ∞: every crossing of a coordinate
#: that depends on z_j is an edge (pruning at 2 saves ~40% at K = M = 4 but costs 1e-3
#: relative accuracy: a wide transition far from a sinh-graded anchor is poorly resolved)
SPLIT_WIDTH = np.inf


@dataclass(frozen=True)
class Factor:
    """One coordinate's function: ``fn`` (numpy), its ``breaks`` (non-smooth points) and an
    optional closed-form smoothing ``smooth(m, s)`` = E[fn(m + s z)], z ~ N(0, 1)."""

    fn: object
    breaks: tuple = ()
    smooth: object = None


def semidefinite_cholesky(C: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """Lower-triangular L with L Lᵀ = C for a batch (..., n, n) of PSD matrices.

    A pivot ≤ tol·max diag is set to zero with the rest of its column (the coordinate is a
    linear function of the previous ones), so singular C (repeated or parallel rows) is fine.
    """
    C = np.asarray(C, dtype=np.float64)
    n = C.shape[-1]
    L = np.zeros_like(C)
    scale = np.maximum(np.max(np.diagonal(C, axis1=-2, axis2=-1), axis=-1), 1e-300)
    for j in range(n):
        s2 = C[..., j, j] - np.sum(L[..., j, :j] ** 2, axis=-1)
        ok = s2 > tol * scale
        s = np.sqrt(np.where(ok, s2, 0.0))
        L[..., j, j] = s
        safe = np.where(ok, s, 1.0)
        for i in range(j + 1, n):
            num = C[..., i, j] - np.sum(L[..., i, :j] * L[..., j, :j], axis=-1)
            L[..., i, j] = np.where(ok, num / safe, 0.0)
    return L


def _half_panel(anchor, length, h, sign, q):
    """q-point rule for ∫ f(z) φ(z) dz over z = anchor + sign·[0, length], f with a
    transition of width h at the anchor: z = anchor ± h sinh(u) clusters the nodes there
    (plain Gauss–Legendre when h ≥ length)."""
    t, wt = legendre(q)
    mapped = (h > 0) & (h < length)  # h = 0: a true kink at the anchor, no map needed
    hs = np.where(mapped, h, 1.0)
    umax = np.where(mapped, np.arcsinh(length / hs), length)
    u = 0.5 * umax[..., None] * (t + 1.0)
    wu = 0.5 * umax[..., None] * wt
    dz = np.where(mapped[..., None], hs[..., None] * np.sinh(u), u)
    jac = np.where(mapped[..., None], hs[..., None] * np.cosh(u), 1.0)
    z = anchor[..., None] + sign * dz
    return z, wu * jac * _INV_SQRT_2PI * np.exp(-0.5 * z * z)


def _panel_rule(lo, hi, h_lo, h_hi, q):
    """2q-point rule on the panels [lo, hi] (arrays …): each half is mapped towards its end,
    where the integrand may have a transition of width h_lo (h_hi)."""
    half = 0.5 * (hi - lo)
    z1, w1 = _half_panel(lo, half, h_lo, 1.0, q)
    z2, w2 = _half_panel(hi, half, h_hi, -1.0, q)
    return np.concatenate([z1, z2], axis=-1), np.concatenate([w1, w2], axis=-1)


def _kinked_rule(m, s, breaks, crossings, q):
    """Nodes z and weights w (…, P·q) of E[f(m + s z)·F(z)] with f kinked at ``breaks`` and
    the inner integral F sharp at ``crossings`` (list of (point, width) arrays)."""
    pts, wid = [], []
    with np.errstate(divide="ignore", invalid="ignore"):
        for b in breaks:
            pts.append(np.where(s > 0, (b - m) / np.where(s > 0, s, 1.0),
                                np.where(b - m > 0, np.inf, -np.inf)))
            wid.append(np.full(m.shape, np.inf))
    for p, w in crossings:
        pts.append(p)
        wid.append(w)
    pts = np.clip(np.stack(pts, axis=-1), -TAIL, TAIL)
    wid = np.stack(wid, axis=-1)
    order = np.argsort(pts, axis=-1)
    pts = np.take_along_axis(pts, order, -1)
    wid = np.take_along_axis(wid, order, -1)
    inf = np.full((*m.shape, 1), np.inf)
    edges = np.concatenate([np.full((*m.shape, 1), -TAIL), pts, np.full((*m.shape, 1), TAIL)],
                           axis=-1)
    widths = np.concatenate([inf, wid, inf], axis=-1)
    z, w = _panel_rule(edges[..., :-1], edges[..., 1:], widths[..., :-1], widths[..., 1:], q)
    z, w = z.reshape(*m.shape, -1), w.reshape(*m.shape, -1)
    return z, w / np.sum(w, axis=-1, keepdims=True)  # constants exact (Σw = 1 − 2e-17)


def _width(L, j, i):
    """(B,) width in z_j of the transition of x_i's conditional law: (std of x_i given
    z_1..z_j)/|L_ij| (∞ where x_i does not depend on z_j)."""
    lij = np.abs(L[:, i, j])
    rest = np.sqrt(np.sum(L[:, i, j + 1:i + 1] ** 2, axis=-1))
    ok = lij > 1e-14 * np.maximum(rest, 1e-300)
    return np.where(ok, rest / np.where(ok, lij, 1.0), np.inf)


def _signature(L, factors, n_outer):
    """(B, ·) booleans: which crossings (level j, later kinked coordinate i) are sharp enough
    (width < ``SPLIT_WIDTH``) to be panel edges; the others are left to the rule."""
    cols = [_width(L, j, i) < SPLIT_WIDTH for j in range(n_outer)
            for i in range(j + 1, L.shape[-1]) if factors[i].breaks]
    return np.stack(cols, axis=1) if cols else np.zeros((L.shape[0], 0), dtype=bool)


def _need_map(factors, n_outer, n, row):
    keys = [(j, i) for j in range(n_outer) for i in range(j + 1, n) if factors[i].breaks]
    return dict(zip(keys, (bool(x) for x in row), strict=True))


def _crossings(shift, L, j, factors, need):
    """For every later kinked coordinate i > j with a sharp transition (``need``) and each
    breakpoint b: the z_j at which the mean of x_i given z_1..z_j crosses b, and the width
    (std of x_i given z_1..z_j)/|L_ij|."""
    out = []
    n = L.shape[-1]
    for i in range(j + 1, n):
        if not factors[i].breaks or not need[(j, i)]:
            continue
        lij = L[:, i, j][:, None]
        rest = np.sqrt(np.sum(L[:, i, j + 1:i + 1] ** 2, axis=-1))[:, None]
        ok = np.abs(lij) > 1e-14 * np.maximum(rest, 1e-300)
        safe = np.where(ok, lij, 1.0)
        width = rest / np.abs(safe)
        width = np.where(width < _SHARP, 0.0, width)  # rounding-level width: a true kink
        for b in factors[i].breaks:
            p = np.where(ok, (b - shift[..., i]) / safe, np.inf)
            w = np.where(ok, width, np.inf) + np.zeros_like(p)
            out.append((p, w))
    return out


def _expect_chunk(L, factors, n_gh, q, n_outer, inner, args, need):
    B, n, _ = L.shape
    shift = np.zeros((B, 1, n))  # Σ_{i<j} L_ji z_i, per node
    weight = np.ones((B, 1))
    for j in range(n_outer):
        f = factors[j]
        m = shift[..., j]
        s = np.broadcast_to(L[:, j, j][:, None], m.shape)
        if inner is None and j == n - 1 and f.smooth is not None:
            return np.sum(weight * f.smooth(m, s), axis=1)
        cross = _crossings(shift, L, j, factors, need)
        breaks = f.breaks
        if j == 0 and cross and _all_at_zero(factors):
            # first level, every breakpoint at 0: all kinks and crossings are at z = 0;
            # one edge there, anchored with the sharpest width
            width = np.min(np.stack([w for _, w in cross]), axis=0)
            cross, breaks = [(np.zeros_like(width), width)], ()
        if breaks or cross:
            z, w = _kinked_rule(m, s, breaks, cross, q)
        else:
            x0, w0 = gauss_hermite(n_gh)
            z = np.broadcast_to(x0, (*m.shape, n_gh))
            w = np.broadcast_to(w0, (*m.shape, n_gh))
        x = m[..., None] + s[..., None] * z
        weight = (weight[..., None] * w * f.fn(x)).reshape(B, -1)
        if j < n - 1:
            shift = shift[:, :, None, :] + z[..., None] * L[:, None, None, :, j]
            shift = shift.reshape(B, -1, n)
    if inner is None:
        return np.sum(weight, axis=1)
    return np.sum(weight * inner(shift, L, n_outer, args), axis=1)


def _all_at_zero(factors) -> bool:
    return all(b == 0.0 for f in factors for b in f.breaks)


def _nodes_per_level(factors, j, n_gh, q, inner, need):
    f = factors[j]
    n = len(factors)
    if inner is None and j == n - 1 and f.smooth is not None:
        return 1
    kinks = len(f.breaks) + sum(len(factors[i].breaks) for i in range(j + 1, n)
                                if factors[i].breaks and need[(j, i)])
    if j == 0 and kinks and _all_at_zero(factors):
        kinks = 1
    return 2 * q * (kinks + 1) if kinks else n_gh


def nested_expectation(C: np.ndarray, factors, n_gh: int = 48, q: int = 20, inner=None,
                       n_outer: int | None = None, inner_args=None) -> np.ndarray:
    """E[Π_j factors[j].fn(x_j)] for x ~ N(0, C), C a batch (B, n, n) of PSD matrices.

    ``n_gh`` Gauss–Hermite nodes per smooth level, ``q`` Gauss–Legendre nodes per half panel of
    a kinked level. With ``inner``, only the first ``n_outer`` coordinates are integrated by
    rules (their factors multiply the weights) and ``inner(shift, L, n_outer, args)`` returns,
    per outer node, the conditional expectation of the rest (``args``: the rows of
    ``inner_args`` (B, …) of this chunk, or None): ``shift`` (B, nodes, n) holds the
    conditional means of all coordinates, the rest's conditional covariance is
    L[:, :, n_outer:] L[:, :, n_outer:]ᵀ (the later factors only declare breakpoints, whose
    crossings shape the outer rules). Returns (B,).
    """
    C = np.asarray(C, dtype=np.float64)
    if C.ndim == 2:
        args = None if inner_args is None else np.asarray(inner_args)[None]
        return nested_expectation(C[None], factors, n_gh, q, inner, n_outer, args)[0]
    L = semidefinite_cholesky(C)
    n = C.shape[-1]
    n_outer = n if inner is None else int(n_outer)
    sig = _signature(L, factors, n_outer)
    out = np.empty(C.shape[0])
    patterns, group = np.unique(sig, axis=0, return_inverse=True)
    for g, row in enumerate(patterns):  # batch elements with the same sharp crossings
        sel = np.flatnonzero(group.ravel() == g)
        need = _need_map(factors, n_outer, n, row)
        nodes = 1
        for j in range(n_outer):
            nodes *= _nodes_per_level(factors, j, n_gh, q, inner, need)
        chunk = max(1, _CHUNK_NODES // max(nodes, 1))
        for a in range(0, sel.size, chunk):
            idx = sel[a:a + chunk]
            args = None if inner_args is None else inner_args[idx]
            out[idx] = _expect_chunk(L[idx], factors, n_gh, q, n_outer, inner, args, need)
    return out


def conditional_moments(L, n_outer):
    """Conditional deviations (B, n) and correlations (B, n, n) of all coordinates given the
    first ``n_outer`` (zero deviation for those and for determined ones)."""
    Lr = L[:, :, n_outer:]
    cov = Lr @ Lr.transpose(0, 2, 1)
    sd = np.sqrt(np.maximum(np.diagonal(cov, axis1=1, axis2=2), 0.0))
    pos = sd > 0
    safe = np.where(pos, sd, 1.0)
    corr = np.clip(cov / safe[:, :, None] / safe[:, None, :], -1.0, 1.0)
    return sd, corr


def pair_inner(pair):
    """``inner`` for the last two coordinates from a closed-form pair moment
    ``pair(m_c, m_d, s_c, s_d, ρ)`` = E[f(c) f(d)] (conditional means, deviations, ρ)."""
    def inner(shift, L, n_outer, args):
        n = L.shape[-1]
        sd, corr = conditional_moments(L, n_outer)
        return pair(shift[..., n - 2], shift[..., n - 1], sd[:, n - 2, None],
                    sd[:, n - 1, None], corr[:, n - 2, n - 1, None])
    return inner


# ---------------------------------------------------------------- closed-form smoothings
def _phi(x):
    return _INV_SQRT_2PI * np.exp(-0.5 * x * x)


def _ratio(m, s):
    """m/s, and ±∞ (−∞ at m = 0: the step is 1{x > 0}) where s = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s > 0, m / np.where(s > 0, s, 1.0), np.where(m > 0, np.inf, -np.inf))


def smooth_relu(m, s):
    """E[relu(m + s z)] = m Φ(m/s) + s φ(m/s)."""
    r = _ratio(m, s)
    return m * ndtr(r) + s * _phi(np.where(np.isfinite(r), r, 0.0)) * np.isfinite(r)


def smooth_step(m, s):
    """E[1{m + s z > 0}] = Φ(m/s)."""
    return ndtr(_ratio(m, s))


def smooth_abs(m, s):
    """E|m + s z| = m(2Φ(m/s) − 1) + 2 s φ(m/s)."""
    return 2.0 * smooth_relu(m, s) - m


def smooth_sign(m, s):
    """E[sign(m + s z)] = 2Φ(m/s) − 1."""
    return 2.0 * smooth_step(m, s) - 1.0


def smooth_erf(c):
    """E[erf(c(m + s z))] = erf(c m/√(1 + 2c²s²))."""
    def f(m, s):
        return erf(c * m / np.sqrt(1.0 + 2.0 * c * c * s * s))
    return f


def smooth_erf_deriv(c):
    """E[(2c/√π) exp(−c²(m + s z)²)] = (2c/√π) exp(−c²m²/(1 + 2c²s²))/√(1 + 2c²s²)."""
    def f(m, s):
        den = 1.0 + 2.0 * c * c * s * s
        return 2.0 * c / np.sqrt(np.pi) * np.exp(-c * c * m * m / den) / np.sqrt(den)
    return f


def smooth_linear(m, s):
    """E[m + s z] = m."""
    return m + 0.0 * s


def smooth_one(m, s):
    """E[1] = 1."""
    return np.ones(np.broadcast(m, s).shape)


# ---------------------------------------------------------------- closed-form pair moments
def _bvn_upper(h, k, rho):
    """P(U > h, V > k) for standard normals of correlation ρ (|ρ| < 1), by Owen's T:
    Φ₂(x, y; ρ) = ½(Φ(x) + Φ(y)) − T(x, a_x) − T(y, a_y) − β at x = −h, y = −k."""
    x = np.where(h == 0, -1e-300, -h)
    y = np.where(k == 0, -1e-300, -k)
    r = np.sqrt(1.0 - rho * rho)
    ax = (y - rho * x) / (x * r)
    ay = (x - rho * y) / (y * r)
    beta = np.where((x > 0) == (y > 0), 0.0, 0.5)
    return 0.5 * (ndtr(x) + ndtr(y)) - owens_t(x, ax) - owens_t(y, ay) - beta


def pair_relu(mx, my, sx, sy, rho):
    """E[relu(X) relu(Y)] for (X, Y) Gaussian with means m, deviations s, correlation ρ.

    With h = −m_x/s_x, k = −m_y/s_y, r = √(1 − ρ²), L = P(U > h, V > k),
    A = φ(h)Φ̄((k − ρh)/r), B = φ(k)Φ̄((h − ρk)/r) (truncated bivariate moments):
    E[U;·] = A + ρB, E[V;·] = B + ρA, E[UV;·] = ρL + ρhA + ρkB + r φ(√q)/√(2π),
    q = (h² − 2ρhk + k²)/r²; result m_x m_y L + m_x s_y E[V;·] + s_x m_y E[U;·] + s_x s_y E[UV;·].
    s = 0 on either side reduces to relu(m)·E[relu(·)].
    """
    mx, my, sx, sy, rho = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64)
                                                for a in (mx, my, sx, sy, rho)))
    both = (sx > 0) & (sy > 0)
    sxs, sys = np.where(both, sx, 1.0), np.where(both, sy, 1.0)
    rc = np.clip(rho, -1.0 + 1e-15, 1.0 - 1e-15)
    h, k = -mx / sxs, -my / sys
    r = np.sqrt(1.0 - rc * rc)
    L = _bvn_upper(h, k, rc)
    A = _phi(h) * ndtr(-(k - rc * h) / r)
    B = _phi(k) * ndtr(-(h - rc * k) / r)
    q = (h * h - 2.0 * rc * h * k + k * k) / (r * r)
    euv = rc * L + rc * h * A + rc * k * B + r * np.exp(-0.5 * q) / (2.0 * np.pi)
    full = mx * my * L + mx * sys * (B + rc * A) + sxs * my * (A + rc * B) + sxs * sys * euv
    degen = np.where(sx > 0, smooth_relu(mx, sx) * np.maximum(my, 0.0),
                     np.maximum(mx, 0.0) * smooth_relu(my, sy))
    return np.where(both, full, degen)


def _relu_times_linear(mx, my, sx, sy, rho):
    """E[relu(X) Y] = m_x m_y Φ̄(h) + (m_x s_y ρ + s_x m_y) φ(h) + s_x s_y ρ (Φ̄(h) + hφ(h)),
    h = −m_x/s_x (s_x = 0: relu(m_x) m_y)."""
    ok = sx > 0
    sxs = np.where(ok, sx, 1.0)
    h = -mx / sxs
    up, ph = ndtr(-h), _phi(h)
    full = mx * my * up + (mx * sy * rho + sxs * my) * ph + sxs * sy * rho * (up + h * ph)
    return np.where(ok, full, np.maximum(mx, 0.0) * my)


def pair_abs(mx, my, sx, sy, rho):
    """E|X||Y| = 4E[relu relu] − 2E[relu(X)Y] − 2E[X relu(Y)] + E[XY] (|x| = 2relu(x) − x)."""
    mx, my, sx, sy, rho = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64)
                                                for a in (mx, my, sx, sy, rho)))
    return (4.0 * pair_relu(mx, my, sx, sy, rho) - 2.0 * _relu_times_linear(mx, my, sx, sy, rho)
            - 2.0 * _relu_times_linear(my, mx, sy, sx, rho) + mx * my + rho * sx * sy)


def square_relu(m, s):
    """E[relu(m + s z)²] = (m² + s²)Φ(m/s) + m s φ(m/s)."""
    r = _ratio(m, s)
    fin = np.isfinite(r)
    return (m * m + s * s) * ndtr(r) + m * s * _phi(np.where(fin, r, 0.0)) * fin


def square_abs(m, s):
    """E[(m + s z)²] = m² + s²."""
    return m * m + s * s


def e2_inner(pair, square):
    """``inner`` returning E[(Σ_i c_i f(x_i))² | outer] from the closed-form pair moment
    (``pair`` for i ≠ j, ``square`` for i = j) of the conditional law; the coefficients c
    (B, n) come as ``args``, in the coordinate order (zero outside the sum). The sum is taken
    inside the outer quadrature, so when the error e is small (a student close to the
    teacher) the result keeps its relative accuracy instead of cancelling between 4-D
    integrals."""
    def inner(shift, L, n_outer, coef):
        sd, corr = conditional_moments(L, n_outer)
        nz = np.flatnonzero(np.any(coef != 0, axis=0))
        out = np.zeros(shift.shape[:2])
        for a, i in enumerate(nz):
            mi, si, ci = shift[..., i], sd[:, i, None], coef[:, i, None]
            out += ci * ci * square(mi, si)
            for j in nz[a + 1:]:
                out += 2.0 * ci * coef[:, j, None] * pair(mi, shift[..., j], si, sd[:, j, None],
                                                          corr[:, i, j, None])
        return out
    return inner


def nested_e2_smooth(C, outer, g, coef, n_gh):
    """E[Π_{j<len(outer)} outer[j](x_j) · (Σ_i coef_i g(x_i))²] for x ~ N(0, C), C (B, n, n),
    coef (B, n), smooth functions: tensor Gauss–Hermite with ``n_gh`` nodes per level
    (the nested rule without kinks). The partial sum Σ_{i≤j} coef_i g(x_i) is carried level
    by level (x_i is fixed once its level is integrated), so each level evaluates g once
    per node, as an I4 evaluates its factor. Returns (B,)."""
    C = np.asarray(C, dtype=np.float64)
    coef = np.asarray(coef, dtype=np.float64)
    B, n, _ = C.shape
    out = np.empty(B)
    x0, w0 = gauss_hermite(n_gh)
    chunk = max(1, _CHUNK_NODES // n_gh ** n)
    for a in range(0, B, chunk):
        L = semidefinite_cholesky(C[a:a + chunk])
        b = L.shape[0]
        shift = np.zeros((b, 1, n))
        weight = np.ones((b, 1))
        part = np.zeros((b, 1))
        for j in range(n):
            x = shift[..., j, None] + L[:, j, j, None, None] * x0  # (b, nodes, n_gh)
            w = weight[..., None] * w0
            if j < len(outer):
                w = w * outer[j](x)
            c = coef[a:a + chunk, j, None, None]
            e = part[..., None] + (c * g(x) if np.any(c != 0) else 0.0)
            weight, part = w.reshape(b, -1), np.broadcast_to(e, w.shape).reshape(b, -1)
            if j < n - 1:
                shift = (shift[:, :, None, :] + x0[None, None, :, None]
                         * L[:, None, None, :, j]).reshape(b, -1, n)
        out[a:a + chunk] = np.sum(weight * part * part, axis=1)
    return out
