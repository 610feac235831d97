"""Compiled second-order (η²) term of the ReLU/abs committee ODE: E[g′(λ_k)g′(λ_l)e²].

The same integral, with the same rule, as the numpy nested quadrature of
:meth:`~hermite.committee.integrals.CommitteeIntegrals.gprime_e2` (``_nested``'s
``nested_expectation`` with the ``e2_inner`` closed form): per outer node the same
composite Gauss–Legendre panels with edges at the kinks and crossings and the same
``sinh`` grading, E[e² | outer fields] from the same truncated-bivariate moments. What
changed is where the time goes (issue 25, item 5; docs/theory/committee.md, "Cost"):

* one compiled loop per (state, pair) instead of numpy arrays of every outer node × every
  inner node (whose temporaries, not the arithmetic, took ≈ 90 % of the time);
* nodes where g′ vanishes (ReLU: λ < 0, three quarters of the (λ_k, λ_l) plane) are
  skipped instead of multiplied by 0 — before their inner closed forms are evaluated; for
  abs the integrand is even and the first level's rule symmetric, so only z₀ > 0 is
  visited, with twice the weight;
* the fields fixed by the outer node (λ_k, λ_l themselves, and any field parallel to
  them) enter E[e² | ·] as constants, E[(a + B)²] = a² + 2a E[B] + E[B²], so only the
  pairs of fields that are still random need a bivariate normal probability, and Φ(m/s),
  φ(m/s) are computed once per field and node;
* the bivariate normal probability is Genz's (2004) double-precision form of Drezner &
  Wesolowsky's method (6, 12 or 20 Gauss–Legendre points by |ρ|, a separate expansion
  for |ρ| ≥ 0.925; its ρ-only sines tabulated once per pair of fields), not two calls of
  scipy's Owen's T.

The results equal the numpy path to rounding, 1e-8 where fields coincide
(tests/test_committee_second_order.py). ``_nested``'s constants (``TAIL``, ``_SHARP``) are
passed as arguments, not read as globals, so numba's cache of this file stays valid when
they change.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from hermite._quadrature import legendre
from hermite.committee._nested import _SHARP, TAIL

__all__ = ["FAMILIES", "gprime_e2_compiled", "bvn_upper", "pair_moment"]

FAMILIES = {"relu": 0, "abs": 1}
THREAD_MIN_BATCH = 8  # integrals per thread below which a batch runs on the calling thread
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT2 = math.sqrt(2.0)
_TWO_PI = 2.0 * math.pi
_INF = np.inf

# Gauss–Legendre half rules of Genz's BVNU (nodes x_i > 0 of the n-point rule on [−1, 1],
# weights), n = 6, 12, 20
_GL_X = np.zeros((3, 10))
_GL_W = np.zeros((3, 10))
_GL_N = np.array([3, 6, 10])
for _row, _n in enumerate((6, 12, 20)):
    _x, _w = np.polynomial.legendre.leggauss(_n)
    _GL_X[_row, :_n // 2] = -_x[:_n // 2]  # the negative half, negated: positive nodes
    _GL_W[_row, :_n // 2] = _w[:_n // 2]


@numba.njit(cache=True)
def _phi(x):
    return _INV_SQRT_2PI * math.exp(-0.5 * x * x)


@numba.njit(cache=True)
def _Phi(x):
    return 0.5 * math.erfc(-x / _SQRT2)


@numba.njit(cache=True)
def _bvnu(h, k, r, glx, glw, gln):
    """P(X > h, Y > k) for standard normals of correlation r (Genz 2004, BVNU)."""
    if h == _INF or k == _INF:
        return 0.0
    if h == -_INF:
        return 1.0 if k == -_INF else _Phi(-k)
    if k == -_INF:
        return _Phi(-h)
    ar = abs(r)
    row = 0 if ar < 0.3 else (1 if ar < 0.75 else 2)
    lg = gln[row]
    hk = h * k
    bvn = 0.0
    if ar < 0.925:
        hs = 0.5 * (h * h + k * k)
        asr = math.asin(r)
        for i in range(lg):
            x = glx[row, i]
            w = glw[row, i]
            sn = math.sin(0.5 * asr * (1.0 - x))
            bvn += w * math.exp((sn * hk - hs) / (1.0 - sn * sn))
            sn = math.sin(0.5 * asr * (1.0 + x))
            bvn += w * math.exp((sn * hk - hs) / (1.0 - sn * sn))
        return bvn * asr / (4.0 * math.pi) + _Phi(-h) * _Phi(-k)
    if r < 0.0:
        k = -k
        hk = -hk
    if ar < 1.0:
        as_ = (1.0 - r) * (1.0 + r)
        a = math.sqrt(as_)
        bs = (h - k) * (h - k)
        c = (4.0 - hk) / 8.0
        d = (12.0 - hk) / 16.0
        asr = -0.5 * (bs / as_ + hk)
        if asr > -100.0:
            bvn = a * math.exp(asr) * (1.0 - c * (bs - as_) * (1.0 - d * bs / 5.0) / 3.0
                                       + c * d * as_ * as_ / 5.0)
        if hk > -100.0:
            b = math.sqrt(bs)
            sp = math.sqrt(_TWO_PI) * _Phi(-b / a)
            bvn -= math.exp(-0.5 * hk) * sp * b * (1.0 - c * bs * (1.0 - d * bs / 5.0) / 3.0)
        a *= 0.5
        for i in range(lg):
            for side in range(2):
                sgn = 2.0 * side - 1.0
                xs = (a + a * sgn * glx[row, i]) ** 2
                rs = math.sqrt(1.0 - xs)
                asr = -0.5 * (bs / xs + hk)
                if asr > -100.0:
                    sp = 1.0 + c * xs * (1.0 + d * xs)
                    ep = math.exp(-hk * (1.0 - rs) / (2.0 * (1.0 + rs))) / rs
                    bvn += a * glw[row, i] * math.exp(asr) * (ep - sp)
        bvn = -bvn / _TWO_PI
    if r > 0.0:
        bvn += _Phi(-max(h, k))
    else:
        bvn = -bvn + max(0.0, _Phi(-h) - _Phi(-k))
    return max(0.0, min(1.0, bvn))


@numba.njit(cache=True)
def _pair_relu(mx, my, sx, sy, rho, glx, glw, gln):
    """E[relu(X) relu(Y)], s_x, s_y > 0 (``_nested.pair_relu``'s formula)."""
    rc = min(max(rho, -1.0 + 1e-15), 1.0 - 1e-15)
    h = -mx / sx
    k = -my / sy
    r = math.sqrt(1.0 - rc * rc)
    L = _bvnu(h, k, rc, glx, glw, gln)
    A = _phi(h) * _Phi(-(k - rc * h) / r)
    B = _phi(k) * _Phi(-(h - rc * k) / r)
    q = (h * h - 2.0 * rc * h * k + k * k) / (r * r)
    euv = rc * L + rc * h * A + rc * k * B + r * math.exp(-0.5 * q) / _TWO_PI
    return mx * my * L + mx * sy * (B + rc * A) + sx * my * (A + rc * B) + sx * sy * euv


@numba.njit(cache=True)
def _smooth_relu(m, s):
    r = m / s
    return m * _Phi(r) + s * _phi(r)


@numba.njit(cache=True)
def _square_relu(m, s):
    r = m / s
    return (m * m + s * s) * _Phi(r) + m * s * _phi(r)


@numba.njit(cache=True)
def _relu_times_linear(mx, my, sx, sy, rho):
    h = -mx / sx
    up = _Phi(-h)
    ph = _phi(h)
    return mx * my * up + (mx * sy * rho + sx * my) * ph + sx * sy * rho * (up + h * ph)


@numba.njit(cache=True)
def _pair(fam, mx, my, sx, sy, rho, glx, glw, gln):
    p = _pair_relu(mx, my, sx, sy, rho, glx, glw, gln)
    if fam == 0:
        return p
    return (4.0 * p - 2.0 * _relu_times_linear(mx, my, sx, sy, rho)
            - 2.0 * _relu_times_linear(my, mx, sy, sx, rho) + mx * my + rho * sx * sy)


@numba.njit(cache=True)
def _g(fam, x):
    return max(x, 0.0) if fam == 0 else abs(x)


@numba.njit(cache=True)
def _dg(fam, x):
    if fam == 0:
        return 1.0 if x > 0.0 else 0.0
    return 1.0 if x > 0.0 else (-1.0 if x < 0.0 else 0.0)


@numba.njit(cache=True)
def _rule(pts, wid, npts, q, t, wt, z, w, tail):
    """Fill z, w (2q(npts + 1)) with ``_nested._kinked_rule``'s nodes and normalised
    weights for the points ``pts[:npts]`` (clipped to ±``tail``, sorted stably) of widths
    ``wid``; returns the node count."""
    for i in range(npts):  # clip, then insertion sort (stable, as numpy's on short rows)
        pts[i] = min(max(pts[i], -tail), tail)
    for i in range(1, npts):
        p, v = pts[i], wid[i]
        j = i - 1
        while j >= 0 and pts[j] > p:
            pts[j + 1] = pts[j]
            wid[j + 1] = wid[j]
            j -= 1
        pts[j + 1] = p
        wid[j + 1] = v
    cnt = 0
    total = 0.0
    for e in range(npts + 1):
        lo = -tail if e == 0 else pts[e - 1]
        hi = tail if e == npts else pts[e]
        hlo = _INF if e == 0 else wid[e - 1]
        hhi = _INF if e == npts else wid[e]
        half = 0.5 * (hi - lo)
        for side in range(2):
            anchor = lo if side == 0 else hi
            h = hlo if side == 0 else hhi
            sign = 1.0 if side == 0 else -1.0
            mapped = h > 0.0 and h < half
            umax = math.asinh(half / h) if mapped else half
            for i in range(q):
                u = 0.5 * umax * (t[i] + 1.0)
                wu = 0.5 * umax * wt[i]
                if mapped:
                    sh = math.sinh(u)
                    dz = h * sh
                    jac = h * math.sqrt(1.0 + sh * sh)  # h cosh u
                else:
                    dz = u
                    jac = 1.0
                zz = anchor + sign * dz
                ww = wu * jac * _phi(zz)
                z[cnt] = zz
                w[cnt] = ww
                total += ww
                cnt += 1
    for i in range(cnt):
        w[i] /= total
    return cnt


@numba.njit(cache=True)
def _pair_tables(sd, corr, coef, n, glx, glw, gln):
    """Per pair (i, j) of random fields, the r-only parts of Genz's |ρ| < 0.925 branch:
    sin values s_m, 1/(1 − s_m²) and weights·asin(ρ)/(4π) (``ntab[i, j]`` = 0: use
    :func:`_bvnu` itself)."""
    sn = np.zeros((n, n, 20))
    inv = np.zeros((n, n, 20))
    wf = np.zeros((n, n, 20))
    ntab = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        for j in range(i + 1, n):
            if coef[i] == 0.0 or coef[j] == 0.0 or sd[i] == 0.0 or sd[j] == 0.0:
                continue
            r = min(max(corr[i, j], -1.0 + 1e-15), 1.0 - 1e-15)
            ar = abs(r)
            if ar >= 0.925:
                continue
            row = 0 if ar < 0.3 else (1 if ar < 0.75 else 2)
            asr = math.asin(r)
            cnt = 0
            for m in range(gln[row]):
                for side in range(2):
                    sgn = 2.0 * side - 1.0
                    v = math.sin(0.5 * asr * (1.0 + sgn * glx[row, m]))
                    sn[i, j, cnt] = v
                    inv[i, j, cnt] = 1.0 / (1.0 - v * v)
                    wf[i, j, cnt] = glw[row, m] * asr / (4.0 * math.pi)
                    cnt += 1
            ntab[i, j] = cnt
    return sn, inv, wf, ntab


@numba.njit(cache=True)
def _e2(fam, shift, sd, corr, coef, n, tabs, cache, glx, glw, gln):
    """E[(Σ_i coef_i g(x_i))² | outer] for conditional means ``shift``, deviations ``sd``
    and correlations ``corr``: fields with sd = 0 are constants, E[(a + B)²] =
    a² + 2a E[B] + E[B²]; per random field Φ(m/s), φ(m/s) are computed once (``cache``)."""
    sn, inv, wf, ntab = tabs
    a = 0.0
    e1 = 0.0
    e2 = 0.0
    for i in range(n):
        ci = coef[i]
        if ci == 0.0:
            continue
        mi = shift[i]
        si = sd[i]
        if si == 0.0:
            a += ci * _g(fam, mi)
            continue
        r = mi / si
        cdf = _Phi(r)
        pdf = _phi(r)
        cache[i, 0] = cdf
        cache[i, 1] = pdf
        relu1 = mi * cdf + si * pdf  # E relu(x_i)
        if fam == 0:
            e1 += ci * relu1
            e2 += ci * ci * ((mi * mi + si * si) * cdf + mi * si * pdf)
        else:
            e1 += ci * (2.0 * relu1 - mi)
            e2 += ci * ci * (mi * mi + si * si)
    for i in range(n):
        ci = coef[i]
        if ci == 0.0 or sd[i] == 0.0:
            continue
        for j in range(i + 1, n):
            cj = coef[j]
            if cj == 0.0 or sd[j] == 0.0:
                continue
            mx, my, sx, sy = shift[i], shift[j], sd[i], sd[j]
            nt = ntab[i, j]
            if nt == 0:
                p = _pair(fam, mx, my, sx, sy, corr[i, j], glx, glw, gln)
            else:  # _pair_relu with the cached Φ, φ and the tabulated Genz sum
                rc = min(max(corr[i, j], -1.0 + 1e-15), 1.0 - 1e-15)
                h = -mx / sx
                k = -my / sy
                hk = h * k
                hs = 0.5 * (h * h + k * k)
                L = 0.0
                for m in range(nt):
                    v = sn[i, j, m]
                    L += wf[i, j, m] * math.exp((v * hk - hs) * inv[i, j, m])
                L = max(0.0, min(1.0, L + cache[i, 0] * cache[j, 0]))
                r = math.sqrt(1.0 - rc * rc)
                A = cache[i, 1] * _Phi(-(k - rc * h) / r)
                B = cache[j, 1] * _Phi(-(h - rc * k) / r)
                q = (h * h - 2.0 * rc * hk + k * k) / (r * r)
                euv = rc * L + rc * h * A + rc * k * B + r * math.exp(-0.5 * q) / _TWO_PI
                p = mx * my * L + mx * sy * (B + rc * A) + sx * my * (A + rc * B) + sx * sy * euv
                if fam == 1:  # |x| = 2 relu(x) − x; E[relu(X)Y] from the cached Φ, φ
                    rho = corr[i, j]
                    rxy = (mx * my * cache[i, 0] + (mx * sy * rho + sx * my) * cache[i, 1]
                           + sx * sy * rho * (cache[i, 0] + h * cache[i, 1]))
                    ryx = (mx * my * cache[j, 0] + (my * sx * rho + sy * mx) * cache[j, 1]
                           + sx * sy * rho * (cache[j, 0] + k * cache[j, 1]))
                    p = 4.0 * p - 2.0 * rxy - 2.0 * ryx + mx * my + rho * sx * sy
            e2 += 2.0 * ci * cj * p
    return a * a + 2.0 * a * e1 + e2


@numba.njit(cache=True)
def _crossing(L, j, i, sharp):
    """(ok, width) of the crossing of level j by coordinate i (``_nested._crossings``)."""
    lij = L[i, j]
    rest = 0.0
    for c in range(j + 1, i + 1):
        rest += L[i, c] * L[i, c]
    rest = math.sqrt(rest)
    if not abs(lij) > 1e-14 * max(rest, 1e-300):
        return False, _INF
    width = rest / abs(lij)
    return True, (0.0 if width < sharp else width)


@numba.njit(cache=True)
def _one(fam, L, coef, n_outer, q, t, wt, glx, glw, gln, tail, sharp):
    n = L.shape[0]
    # conditional deviations and correlations of every field given the outer ones
    sd = np.zeros(n)
    corr = np.zeros((n, n))
    for i in range(n):
        acc = 0.0
        for c in range(n_outer, n):
            acc += L[i, c] * L[i, c]
        sd[i] = math.sqrt(max(acc, 0.0))
    for i in range(n):
        si = sd[i] if sd[i] > 0.0 else 1.0
        for j in range(n):
            sj = sd[j] if sd[j] > 0.0 else 1.0
            acc = 0.0
            for c in range(n_outer, n):
                acc += L[i, c] * L[j, c]
            corr[i, j] = min(max(acc / si / sj, -1.0), 1.0)
    tabs = _pair_tables(sd, corr, coef, n, glx, glw, gln)
    cache = np.zeros((n, 2))
    nmax = 2 * q * (n + 1)
    pts = np.empty(n + 1)
    wid = np.empty(n + 1)
    z0 = np.empty(nmax)
    w0 = np.empty(nmax)
    z1 = np.empty(nmax)
    w1 = np.empty(nmax)
    shift = np.zeros(n)
    # level 0: every breakpoint is 0, so the kink of x_0 and all crossings sit at z = 0
    wmin = _INF
    anycross = False
    for i in range(1, n):
        ok, width = _crossing(L, 0, i, sharp)
        if ok:
            anycross = True
            wmin = min(wmin, width)
    pts[0] = 0.0
    wid[0] = wmin if anycross else _INF
    n0 = _rule(pts, wid, 1, q, t, wt, z0, w0, tail)
    s0 = L[0, 0]
    total = 0.0
    for a in range(n0):
        x0 = s0 * z0[a]
        f0 = _dg(fam, x0)
        if n_outer == 1:
            f0 = f0 * f0
        wa = w0[a] * f0
        if fam == 1:  # abs: the integrand is even in x and the level-0 rule symmetric
            wa = 2.0 * wa if z0[a] > 0.0 else 0.0
        if wa == 0.0:
            continue
        for i in range(n):
            shift[i] = z0[a] * L[i, 0]
        if n_outer == 1:
            total += wa * _e2(fam, shift, sd, corr, coef, n, tabs, cache, glx, glw, gln)
            continue
        # level 1: the kink of x_1 and the crossings of the later fields
        m1 = shift[1]
        s1 = L[1, 1]
        if s1 > 0.0:
            pts[0] = (0.0 - m1) / s1
        else:
            pts[0] = _INF if 0.0 - m1 > 0.0 else -_INF
        wid[0] = _INF
        npts = 1
        for i in range(2, n):
            ok, width = _crossing(L, 1, i, sharp)
            if ok:
                pts[npts] = (0.0 - shift[i]) / L[i, 1]
                wid[npts] = width
                npts += 1
        n1 = _rule(pts, wid, npts, q, t, wt, z1, w1, tail)
        inner = 0.0
        base = shift.copy()
        for b in range(n1):
            f1 = _dg(fam, m1 + s1 * z1[b])
            if f1 == 0.0:
                continue
            for i in range(n):
                shift[i] = base[i] + z1[b] * L[i, 1]
            inner += w1[b] * f1 * _e2(fam, shift, sd, corr, coef, n, tabs, cache, glx, glw, gln)
        total += wa * inner
    return total


@numba.njit(cache=True)
def _cholesky(C, tol):
    """``_nested.semidefinite_cholesky`` of one matrix: a pivot ≤ tol·max diag is zero with
    the rest of its column."""
    n = C.shape[0]
    L = np.zeros((n, n))
    scale = 1e-300
    for j in range(n):
        scale = max(scale, C[j, j])
    for j in range(n):  # sums first, then the difference: numpy's rounding
        acc = 0.0
        for c in range(j):
            acc += L[j, c] * L[j, c]
        s2 = C[j, j] - acc
        if s2 > tol * scale:
            s = math.sqrt(s2)
            L[j, j] = s
            for i in range(j + 1, n):
                acc = 0.0
                for c in range(j):
                    acc += L[i, c] * L[j, c]
                L[i, j] = (C[i, j] - acc) / s
    return L


@numba.njit(cache=True, nogil=True)
def _batch(fam, C, coef, n_outer, q, t, wt, glx, glw, gln, tail, sharp):
    out = np.empty(C.shape[0])
    for b in range(C.shape[0]):
        out[b] = _one(fam, _cholesky(C[b], 1e-12), coef[b], n_outer, q, t, wt,
                      glx, glw, gln, tail, sharp)
    return out


def gprime_e2_compiled(family: str, C, coef, n_outer: int, q: int) -> np.ndarray:
    """E[g′(x_0)g′(x_1)e²] (``n_outer`` = 2) or E[g′(x_0)²e²] (1), e = Σ_i coef_i g(x_i),
    for a batch C (B, n, n) of field covariances (outer fields first), coef (B, n);
    ``q`` Gauss–Legendre nodes per half panel. ``family``: ``relu`` or ``abs``."""
    C = np.ascontiguousarray(C, dtype=np.float64)
    coef = np.ascontiguousarray(coef, dtype=np.float64)
    if C.shape[0] == 0:
        return np.zeros(0)
    t, wt = legendre(int(q))
    args = (int(n_outer), int(q), np.asarray(t), np.asarray(wt), _GL_X, _GL_W, _GL_N,
            float(TAIL), float(_SHARP))
    fam = FAMILIES[family]
    threads = min(numba.get_num_threads(), C.shape[0] // THREAD_MIN_BATCH)
    if threads < 2:
        return _batch(fam, C, coef, *args)
    cuts = np.linspace(0, C.shape[0], threads + 1).astype(int)
    parts = _pool(threads).map(lambda ab: _batch(fam, C[ab[0]:ab[1]], coef[ab[0]:ab[1]], *args),
                               zip(cuts[:-1], cuts[1:], strict=True))
    return np.concatenate(list(parts))


_POOLS: dict = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """A cached pool of ``threads`` threads (the compiled batch releases the GIL)."""
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="committee-e2")
    return _POOLS[threads]


@numba.njit(cache=True)
def _bvn_batch(h, k, r, glx, glw, gln):
    out = np.empty(h.size)
    for i in range(h.size):
        out[i] = _bvnu(h[i], k[i], r[i], glx, glw, gln)
    return out


@numba.njit(cache=True)
def _pair_batch(fam, mx, my, sx, sy, rho, glx, glw, gln):
    out = np.empty(mx.size)
    for i in range(mx.size):
        out[i] = _pair(fam, mx[i], my[i], sx[i], sy[i], rho[i], glx, glw, gln)
    return out


def bvn_upper(h, k, rho) -> np.ndarray:
    """P(U > h, V > k) for standard normals of correlation ρ (the compiled Genz form; for
    tests against ``_nested._bvn_upper``)."""
    h, k, rho = (np.ascontiguousarray(a, dtype=np.float64).ravel()
                 for a in np.broadcast_arrays(h, k, rho))
    return _bvn_batch(h, k, rho, _GL_X, _GL_W, _GL_N)


def pair_moment(family: str, mx, my, sx, sy, rho) -> np.ndarray:
    """E[g(X) g(Y)] (deviations > 0) by the compiled closed form (for tests against
    ``_nested.pair_relu`` / ``pair_abs``)."""
    arrs = [np.ascontiguousarray(a, dtype=np.float64).ravel()
            for a in np.broadcast_arrays(mx, my, sx, sy, rho)]
    return _pair_batch(FAMILIES[family], *arrs, _GL_X, _GL_W, _GL_N)
