r"""The exact reduced chain of rank-r LoRA fine-tuning (projected Û, any d, cost independent of d).

Derivation (from the full rank-r step; no approximation)
--------------------------------------------------------
Canonical frame: x ~ N(0, I_d); span W = the first k coordinates (wᵢ = row i of L); the
teacher's U ∈ R^{d×r} has orthonormal columns ⊥ span W; the student Û ∈ St(d, r) stays
⊥ span W (projected variant). Teacher tᵢ = (zᵢ + ξcᵢᵀa)/Nᵢ with z = Wx, a = Uᵀx,
Nᵢ = √(1 + ξ²‖cᵢ‖²); student âⱼ = (zⱼ + ξĉⱼᵀs)/N̂ⱼ with s = Ûᵀx, N̂ⱼ = √(1 + ξ²‖ĉⱼ‖²)
(cᵢ, ĉⱼ ∈ R^r are rows of C, Ĉ). y = Σλᵢσ(tᵢ) + ε, f̂ = Σλⱼσ(âⱼ), L = (y − f̂)².

(Q1) Sample gradient. δⱼ = −2(y − f̂)λⱼσ′(âⱼ). The Euclidean gradient of L in Û is
     Πx gᵀ + (terms Σⱼ wⱼ(…)ᵀ) + Û·S with S symmetric (from N̂ⱼ's dependence on ÛᵀÛ), with
     g = Σⱼ δⱼ ξĉⱼ/N̂ⱼ ∈ R^r. Π kills the wⱼ terms and the tangent projection
     P_Û(Z) = Z − Û sym(ÛᵀZ) kills Û·S, so the Riemannian gradient is P_Û(Πx gᵀ).
     ∂L/∂ĉⱼ = δⱼ(ξs/N̂ⱼ − âⱼξ²ĉⱼ/N̂ⱼ²) (joint Ĉ, plain SGD with η_c).
(Q2) State. Write Û = U M + Q B with M = UᵀÛ (r×r), Q ∈ R^{d×r} orthonormal ⊥ span(W, U),
     BᵀB = I − MᵀM. Every rotation fixing span(W, U) pointwise leaves x's law, f*, Π and
     the step map invariant, so the law of the next (M, Ĉ) given Û depends only on the orbit
     of Û, i.e. on (M, BᵀB) = (M, I − MᵀM): (M_t, Ĉ_t) is a Markov chain, and any B with the
     right Gram, e.g. B = (I − MᵀM)^{1/2}, represents the orbit.
(Q3) One example in the orthonormal frame (U, Q, r̂, rest): z = L g, g ~ N(0, I_k); a, b ~
     N(0, I_r) (a = Uᵀx, b = Qᵀx) and ρ² = ‖rest of Πx‖² ~ χ²_{d−k−2r}, all independent;
     Πx = U a + Q b + ρ r̂ with r̂ ⊥ span(W, U, Q). So s = Mᵀa + Bᵀb, and in the basis
     (U, Q, r̂) Û has coefficients X = [M; B; 0] and Πx has ξₓ = [a; b; ρ]:
     Z = ξₓ gᵀ, XᵀZ = s gᵀ, T = Z − X sym(s gᵀ), Y = X − ηT ((2r+1)×r).
(Q4) Retraction in coefficient space (exact: both retractions commute with left multiplication
     by an orthonormal basis): ``qr`` — X′ = the Q factor of Y with positive diag(R) (modified
     Gram–Schmidt), ``polar`` — X′ = Y(YᵀY)^{−1/2}. Then M′ = X′[:r] and B′ = (VᵀV)^{1/2} with
     V = X′[r:] (its Gram; computed from V, not as I − M′ᵀM′, for accuracy as M′ → O(r)).
(Q5) Initial law: Û₀ uniform on St(span(W)^⊥, r), i.e. Û₀ = G(GᵀG)^{−1/2}, G ~ N(0, I)
     ((d−k)×r). Split G = [G_U; G_rest]: G_restᵀG_rest ~ Wishart_r(d−k−r, I), so G_rest may be
     replaced by its Bartlett factor T (upper triangular, Tᵢᵢ² ~ χ²_{d−k−r−i+1}, Tᵢⱼ ~ N(0,1)
     above the diagonal): M₀ = G_U(G_UᵀG_U + TᵀT)^{−1/2}.
For r = 1 this is the chain of ``dynamics.reduced`` (projected): M = μ u⊥-free overlap, B = ν.

Cost per step: k + 2r normals, one χ², O(kr + r³) flops; numba, per-run SplitMix64 streams
seeded from (seed, r), runs in blocks on numba's threads. Mini-batches are not reduced here (b = 1).
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
from numba import njit

from dynamics.reduced import _rng
from dynamics.reduced._drive import DIVERGED, HIT, RUNNING, drive
from dynamics.reduced.params import split_flat
from dynamics.runtime.run_threads import over_runs
from hermite.activations_numba import sigma, sigma_and_deriv

__all__ = ["RETRACTIONS", "RankHyper", "RankInst", "RankRuns", "RankRecords", "FLAT_ARGS",
           "make_rank_hyper", "init_runs", "advance_runs", "advance", "step_given", "scratch"]

RETRACTIONS = {"qr": 0, "polar": 1}
SV_TOL = 1e-9  # ‖M‖_F² > r(1 + SV_TOL) counts as divergence (σ(M) ≤ 1 on the manifold)


@njit(cache=True)
def _sym_sqrt(h, inverse):
    """(H)^{±1/2} of a symmetric PSD r×r matrix (eigenvalues clipped at 0)."""
    w, v = np.linalg.eigh(h)
    r = h.shape[0]
    out = np.zeros((r, r))
    for i in range(r):
        lam = max(w[i], 0.0)
        f = 1.0 / math.sqrt(lam) if inverse else math.sqrt(lam)
        for p in range(r):
            for q in range(r):
                out[p, q] += v[p, i] * f * v[q, i]
    return out


@njit(cache=True)
def _gram(a):
    return a.T @ a


@njit(cache=True)
def _initial(st, n_perp, r):
    """(M₀, B₀, stream) by (Q5)."""
    gu = np.empty((r, r))
    for i in range(r):
        for j in range(r):
            gu[i, j], st = _rng.normal(st)
    t = np.zeros((r, r))
    for i in range(r):
        q, st = _rng.chi2(n_perp - r - i, st)
        t[i, i] = math.sqrt(q)
        for j in range(i + 1, r):
            t[i, j], st = _rng.normal(st)
    inv = _sym_sqrt(gu.T @ gu + t.T @ t, True)
    m = gu @ inv
    b = t @ inv
    return m, _sym_sqrt(_gram(b), False), st


@njit(cache=True, nogil=True)
def _init_block(lo, hi, seed, n_perp, states, m_out, b_out):
    r = m_out.shape[1]
    for run in range(lo, hi):
        st = _rng.seed_stream(seed, run)
        m, b, st = _initial(st, n_perp, r)
        m_out[run] = m
        b_out[run] = b
        states[run] = st


def init_runs(seed, n_perp, states, m_out, b_out) -> None:
    """Initial (M₀, B₀) of every run (Q5) and its seeded stream; n_perp = d − k."""
    over_runs(_init_block, m_out.shape[0], seed, n_perp, states, m_out, b_out)


N_SCRATCH_R = 4  # (r,)-vectors in the scratch: s, g and spares
NEWTON_MAX = 40  # Newton–Schulz iterations of the polar factor before falling back to eigh

RankHyper = namedtuple("RankHyper", ["joint", "code", "hp", "dof", "eta", "eta_c", "noise_sd",
                                     "retraction", "n_steps", "stop_level"])
RankHyper.__doc__ = """Settings of one call: joint Ĉ, σ's (code, p), χ² dof d − k − 2r, η, η_c,
label-noise sd, retraction code (:data:`RETRACTIONS`), horizon and stop level (inf: none)."""
RankInst = namedtuple("RankInst", ["L", "ident", "lam", "C", "tnorm", "xi", "inst_idx"])
RankInst.__doc__ = """Per-instance L (I, k, k), ident (I,), λ (I, k), C (I, k, r), teacher
norms (I, k), ξ (I,); instance of each run (R,)."""
RankRuns = namedtuple("RankRuns", ["states", "m", "b", "chat", "div_step", "hit_step"])
RankRuns.__doc__ = "The runs' streams, M, B (R, r, r), Ĉ (R, k, r) (in place), div/hit steps."
RankRecords = namedtuple("RankRecords", ["cp_steps", "cp_m", "cp_chat"])
RankRecords.__doc__ = "Checkpoint steps (C,), M (R, C, r, r) and Ĉ (R, C, k, r) or (R, 0, k, r)."
RankWork = namedtuple("RankWork", ["vr", "vk", "gc", "xv", "y", "rr", "vv"])
RankWork.__doc__ = """Scratch of :func:`_step`: (r,)-vectors s, g, …; (k,)-vectors N̂, â, σ′(â);
∂L/∂Ĉ (k, r); ξₓ (2r+1); Y (2r+1, r); four r×r matrices; V (r+1, r)."""
# the flat positional orders of :func:`advance` and :func:`step_given` (tests use them)
FLAT_ARGS = ("L", "ident", "lam", "C", "tnorm", "xi", "inst_idx", "chat", "joint", "code", "hp",
             "dof", "eta", "eta_c", "noise_sd", "retraction", "states", "m", "b", "n_steps",
             "cp_steps", "cp_m", "cp_chat", "div_step", "stop_level", "hit_step")
STEP_GIVEN_ARGS = ("L", "ident", "lam", "C", "tnorm", "xi", "chat", "joint", "code", "hp",
                   "eta", "eta_c", "retraction", "m", "b", "z", "a", "bv", "rho", "eps")


def make_rank_hyper(joint, code, hp, dof, eta, eta_c, noise_sd, retraction, n_steps,
                    stop_level=math.inf) -> RankHyper:
    """:class:`RankHyper` with the field types the kernels are compiled for."""
    return RankHyper(bool(joint), int(code), int(hp), int(dof), float(eta), float(eta_c),
                     float(noise_sd), int(retraction), int(n_steps), float(stop_level))


@njit(cache=True)
def scratch(k, r):
    """Per-run work arrays of :func:`_step` (:class:`RankWork`; the step allocates nothing)."""
    n = 2 * r + 1
    return RankWork(np.empty((N_SCRATCH_R, r)), np.empty((3, k)), np.empty((k, r)),
                    np.empty(n), np.empty((n, r)), np.empty((4, r, r)), np.empty((r + 1, r)))


@njit(cache=True, _nrt=True)  # explicit: a callee compiled first from a ``_nrt=False``
def _sym_sqrt_into(h, inverse, out):  # caller would inherit that, and eigh needs NRT
    """out ← :func:`_sym_sqrt` (h, inverse): callable from code compiled without NRT."""
    res = _sym_sqrt(h, inverse)
    for p in range(h.shape[0]):
        for q in range(h.shape[0]):
            out[p, q] = res[p, q]


@njit(cache=True, inline="always")
def _copy2(dst, src):
    """dst[…] = src for 2-d arrays (element loop: no slicing without NRT)."""
    for p in range(src.shape[0]):
        for q in range(src.shape[1]):
            dst[p, q] = src[p, q]


@njit(cache=True)
def _matmul_into(a, b, out):
    n, m = a.shape
    p = b.shape[1]
    for i in range(n):
        for j in range(p):
            acc = 0.0
            for q in range(m):
                acc += a[i, q] * b[q, j]
            out[i, j] = acc


@njit(cache=True)
def _inv_sqrt_newton(s_mat, work):
    """S^{−1/2} of an SPD r×r matrix near I by the coupled Newton–Schulz iteration, written
    into work[1]; False if it does not converge (the caller then uses eigh)."""
    r = s_mat.shape[0]
    y, z, t, u = work[0], work[1], work[2], work[3]
    for i in range(r):
        for j in range(r):
            y[i, j] = s_mat[i, j]
            z[i, j] = 1.0 if i == j else 0.0
    for _ in range(NEWTON_MAX):
        _matmul_into(z, y, t)  # T = Z Y → I
        err = 0.0
        for i in range(r):
            for j in range(r):
                e = t[i, j] - (1.0 if i == j else 0.0)
                err = max(err, abs(e))
                t[i, j] = (3.0 if i == j else 0.0) - t[i, j]  # 3I − ZY
        if err < 4e-16 * r:
            return True
        if not err < 0.5:  # outside the basin (or NaN): give up
            return False
        _matmul_into(y, t, u)  # Y ← Y(3I − ZY)/2
        for i in range(r):
            for j in range(r):
                y[i, j] = 0.5 * u[i, j]
        _matmul_into(t, z, u)  # Z ← (3I − ZY)Z/2
        for i in range(r):
            for j in range(r):
                z[i, j] = 0.5 * u[i, j]
    return False


@njit(cache=True)
def _r_factor(v, b_out):
    """R of v = QR by modified Gram–Schmidt (v is overwritten by Q, diag(R) ≥ 0): RᵀR = vᵀv,
    and any B with that Gram represents the orbit (Q2). A degenerate column gives a zero
    diagonal entry and a zero column of Q."""
    n, r = v.shape
    for i in range(r):
        for j in range(r):
            b_out[i, j] = 0.0
    for j in range(r):
        for i in range(j):
            dot = 0.0
            for p in range(n):
                dot += v[p, i] * v[p, j]
            b_out[i, j] = dot
            for p in range(n):
                v[p, j] -= dot * v[p, i]
        nrm = 0.0
        for p in range(n):
            nrm += v[p, j] * v[p, j]
        nrm = math.sqrt(nrm)
        b_out[j, j] = nrm
        inv = 1.0 / nrm if nrm > 1e-300 else 0.0
        for p in range(n):
            v[p, j] *= inv


@njit(cache=True)
def _min_sv_at_least(m, level, work):
    """Whether σ_min(M) ≥ level, i.e. MᵀM − level²·I is positive semi-definite (Cholesky)."""
    r = m.shape[0]
    a = work[0]
    for i in range(r):
        for j in range(r):
            acc = 0.0
            for p in range(r):
                acc += m[p, i] * m[p, j]
            a[i, j] = acc - (level * level if i == j else 0.0)
    for j in range(r):
        d = a[j, j]
        for p in range(j):
            d -= a[j, p] * a[j, p]
        if d < 0.0:
            return False
        d = math.sqrt(d)
        a[j, j] = d
        for i in range(j + 1, r):
            acc = a[i, j]
            for p in range(j):
                acc -= a[i, p] * a[j, p]
            a[i, j] = acc / d if d > 0.0 else 0.0
    return True


@njit(cache=True, inline="always")
def _forward(inst, hyp, chat, m, b, draws, w):
    """(Q1): s = Ûᵀx into w.vr[0], g into w.vr[1] and (joint) ∂L/∂Ĉ into w.gc."""
    L, ident, lam, tc, tnorm, xi = inst
    z, a, bv, _rho, eps = draws
    code, hp = hyp.code, hyp.hp
    k, r = chat.shape
    s, g = w.vr[0], w.vr[1]
    nh, ahat, sd = w.vk[0], w.vk[1], w.vk[2]
    gc = w.gc
    for q in range(r):
        acc = 0.0
        for p in range(r):
            acc += m[p, q] * a[p] + b[p, q] * bv[p]
        s[q] = acc  # s = Mᵀa + Bᵀb = Ûᵀx
        g[q] = 0.0
    resid = eps
    for i in range(k):
        acc = 0.0
        for q in range(r):
            acc += chat[i, q] * chat[i, q]
        nh[i] = math.sqrt(1.0 + xi * xi * acc)
        if ident:
            wzi = z[i]
        else:
            wzi = 0.0
            for j in range(k):
                wzi += L[i, j] * z[j]
        ta = 0.0
        sa = 0.0
        for q in range(r):
            ta += tc[i, q] * a[q]
            sa += chat[i, q] * s[q]
        resid += lam[i] * sigma((wzi + xi * ta) / tnorm[i], code, hp)
        ahat[i] = (wzi + xi * sa) / nh[i]
        sv, sd[i] = sigma_and_deriv(ahat[i], code, hp)
        resid -= lam[i] * sv
    for j in range(k):
        delta = -2.0 * resid * lam[j] * sd[j]
        for q in range(r):
            g[q] += delta * xi * chat[j, q] / nh[j]
            if hyp.joint:
                gc[j, q] = delta * (xi * s[q] / nh[j] - ahat[j] * xi * xi * chat[j, q]
                                    / (nh[j] * nh[j]))


@njit(cache=True, inline="always")
def _tangent(eta, m, b, draws, w):
    """(Q3): Y = X − η(ξₓgᵀ − X sym(s gᵀ)) into w.y, X = [M; B; 0] in the basis (U, Q, r̂)."""
    a, bv, rho = draws[1], draws[2], draws[3]
    r = m.shape[0]
    n = 2 * r + 1
    s, g, xv, y = w.vr[0], w.vr[1], w.xv, w.y
    sym = w.rr[0]
    for p in range(r):
        xv[p] = a[p]
        xv[r + p] = bv[p]
        for q in range(r):
            sym[p, q] = 0.5 * (s[p] * g[q] + g[p] * s[q])
    xv[2 * r] = rho
    for p in range(n):
        for q in range(r):
            acc = 0.0
            xpq = 0.0
            if p < r:
                xpq = m[p, q]
                for l_ in range(r):
                    acc += m[p, l_] * sym[l_, q]
            elif p < 2 * r:
                xpq = b[p - r, q]
                for l_ in range(r):
                    acc += b[p - r, l_] * sym[l_, q]
            y[p, q] = xpq - eta * (xv[p] * g[q] - acc)


@njit(cache=True, inline="always")
def _retract(retraction, w):
    """(Q4): w.y ← its Q factor (``qr``) or Y(YᵀY)^{−1/2} (``polar``), in coefficient space."""
    y, rr, vr = w.y, w.rr, w.vr
    n, r = y.shape
    if retraction == 0:
        _r_factor(y, rr[3])  # y ← Q factor with diag(R) > 0
        return
    gram = rr[3]
    for p in range(r):
        for q in range(r):
            acc = 0.0
            for l_ in range(n):
                acc += y[l_, p] * y[l_, q]
            gram[p, q] = acc
    if not _inv_sqrt_newton(gram, rr):  # S^{−1/2} into rr[1], else by eigh
        _sym_sqrt_into(gram, True, rr[1])
    inv = rr[1]
    for p in range(n):
        for q in range(r):
            acc = 0.0
            for l_ in range(r):
                acc += y[p, l_] * inv[l_, q]
            vr[2, q] = acc  # row p of Y S^{−1/2}, staged
        for q in range(r):
            y[p, q] = vr[2, q]


@njit(cache=True, inline="always")
def _step(inst, hyp, chat, m, b, draws, w):
    """One step (Q1)–(Q4) in place: M, B and (joint) Ĉ are updated. ``inst`` = (L, ident, λ,
    C, teacher norms Nᵢ, ξ) of the instance; ``draws`` = (z (k,) standard normals (Wx = Lz),
    a, bv (r,), ρ = ‖rest of Πx‖, ε the label noise); ``w`` = :func:`scratch`."""
    k, r = chat.shape
    _forward(inst, hyp, chat, m, b, draws, w)
    _tangent(hyp.eta, m, b, draws, w)
    _retract(hyp.retraction, w)
    y, vv = w.y, w.vv
    for p in range(r):
        for q in range(r):
            m[p, q] = y[p, q]
    for p in range(r + 1):
        for q in range(r):
            vv[p, q] = y[r + p, q]
    _r_factor(vv, b)
    if hyp.joint:
        for j in range(k):
            for q in range(r):
                chat[j, q] -= hyp.eta_c * w.gc[j, q]


def step_given(*args):
    """One step (Q1)–(Q4) on given variates (tests), arguments in the order of
    :data:`STEP_GIVEN_ARGS`: new (M′, B′, Ĉ′), inputs untouched."""
    a = dict(zip(STEP_GIVEN_ARGS, args, strict=True))
    m, b = np.array(a["m"], dtype=np.float64), np.array(a["b"], dtype=np.float64)
    chat = np.array(a["chat"], dtype=np.float64)
    hyp = make_rank_hyper(a["joint"], a["code"], a["hp"], 0, a["eta"], a["eta_c"], 0.0,
                          a["retraction"], 0)
    draws = (*(np.asarray(a[n], np.float64) for n in ("z", "a", "bv")), float(a["rho"]),
             float(a["eps"]))
    _step(tuple(a[f] for f in RankInst._fields[:6]), hyp, chat, m, b, draws,
          scratch(*chat.shape))
    return m, b, chat


@njit(cache=True, inline="always")
def _draw(hyp, prep, st, z, a, bv):
    """z (k), a, b (r) standard normals, ε and ρ = √χ²_{d−k−2r} from the stream:
    (ρ, ε, stream)."""
    for i in range(z.shape[0]):
        z[i], st = _rng.normal(st)
    for q in range(a.shape[0]):
        a[q], st = _rng.normal(st)
    for q in range(bv.shape[0]):
        bv[q], st = _rng.normal(st)
    eps = 0.0
    if hyp.noise_sd > 0.0:
        e, st = _rng.normal(st)
        eps = hyp.noise_sd * e
    q2, st = _rng.chi2_prepared(prep, st)
    return math.sqrt(q2), eps, st


@njit(cache=True, inline="always")
def _status(m, b, chat, joint, bound, use_stop, stop_level, w):
    """DIVERGED for a non-finite state or ‖M‖_F² > bound, HIT when ``use_stop`` and every
    singular value of M is ≥ stop_level, else RUNNING."""
    k, r = chat.shape
    fro = 0.0
    ok = True
    for p in range(r):
        for q in range(r):
            fro += m[p, q] * m[p, q]
            ok = ok and math.isfinite(b[p, q])
    if joint:
        for j in range(k):
            for q in range(r):
                ok = ok and math.isfinite(chat[j, q])
    if not (ok and fro <= bound):  # a NaN fails the comparison too
        return DIVERGED
    if use_stop and fro >= r * stop_level * stop_level and _min_sv_at_least(
            m, stop_level, w.rr):
        return HIT
    return RUNNING


@njit(cache=True, inline="always")
def _rank_step(ctx, sc, _t):
    """One step of the run: ((stream,), status); a diverged run is frozen at its last valid
    state (:func:`._drive.drive`)."""
    _run, hyp, inst, prep, use_stop, bound, state, _rec, work = ctx
    m, b, chat = state
    w, (z, a, bv), old = work
    rho, eps, st = _draw(hyp, prep, sc[0], z, a, bv)
    _copy2(old[0], m)
    _copy2(old[1], b)
    if hyp.joint:
        _copy2(old[2], chat)
    _step(inst, hyp, chat, m, b, (z, a, bv, rho, eps), w)
    status = _status(m, b, chat, hyp.joint, bound, use_stop, hyp.stop_level, w)
    if status == DIVERGED:
        _copy2(m, old[0])
        _copy2(b, old[1])
        if hyp.joint:
            _copy2(chat, old[2])
    return (st,), status


@njit(cache=True, inline="always")
def _rank_record(ctx, sc, c):
    """Checkpoint c of the run: M (and Ĉ if trained) into its row of the records."""
    run, hyp, _inst, _prep, _use, _bound, state, rec, _work = ctx
    m, _b, chat = state
    _copy2(rec.cp_m[run, c], m)
    if hyp.joint:
        _copy2(rec.cp_chat[run, c], chat)


@njit(cache=True, _nrt=False)  # allocates nothing; see _drive on reference counting
def _run_one(run, hyp, inst, st, state, rec, work):
    """Advance run ``run`` from its stream ``st`` and state = (M, B, Ĉ) (in place) by up to
    ``hyp.n_steps`` steps; ``inst`` its instance's (L, ident, λ, C, N, ξ); ``work`` =
    (:func:`scratch`, (z, a, b), copies (M, B, Ĉ)). Returns (stream, div_step, hit_step)."""
    r = state[0].shape[0]
    ctx = (run, hyp, inst, _rng.chi2_prepare(hyp.dof), math.isfinite(hyp.stop_level),
           r * (1.0 + SV_TOL), state, rec, work)  # ‖M‖_F² ≤ r: M is a block of a frame
    sc, div_step, hit_step = drive(_rank_step, _rank_record, ctx, (st,), hyp.n_steps,
                                   rec.cp_steps)
    return sc[0], div_step, hit_step


@njit(cache=True, nogil=True)
def _advance_block(lo, hi, hyp, inst, runs, rec):
    """Runs lo … hi − 1 of ``runs`` (in place), each with its scratch."""
    k, r = runs.chat.shape[1:]
    for run in range(lo, hi):
        i = inst.inst_idx[run]
        work = (scratch(k, r), (np.empty(k), np.empty(r), np.empty(r)),
                (np.empty((r, r)), np.empty((r, r)), np.empty((k, r))))
        runs.states[run], runs.div_step[run], runs.hit_step[run] = _run_one(
            run, hyp, (inst.L[i], inst.ident[i], inst.lam[i], inst.C[i], inst.tnorm[i],
                       inst.xi[i]),
            runs.states[run], (runs.m[run], runs.b[run], runs.chat[run]), rec, work)


def advance_runs(hyp, inst, runs, rec) -> None:
    """Advance every run of ``runs`` (:class:`RankRuns`, in place) by ``hyp.n_steps``;
    checkpoints into ``rec`` (:class:`RankRecords`). div_step / hit_step: first step with a
    non-finite state or a singular value > 1 + SV_TOL (the run is frozen before it) / with
    the smallest singular value ≥ stop_level (the run stops); −1 if never."""
    over_runs(_advance_block, runs.m.shape[0], hyp, inst, runs, rec)


def advance(*args) -> None:
    """:func:`advance_runs` on flat arguments, in the order of :data:`FLAT_ARGS` (kept flat:
    a test replaces one of them)."""
    hyp, inst, runs, rec = split_flat(FLAT_ARGS, args, RankHyper, RankInst, RankRuns,
                                      RankRecords)
    advance_runs(make_rank_hyper(*hyp), inst, runs, rec)
