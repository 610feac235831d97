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
seeded from (seed, r), all runs in a ``prange``. Mini-batches are not reduced here (b = 1).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from hermite.activations_numba import sigma, sigma_and_deriv

from . import _rng

__all__ = ["RETRACTIONS", "init_runs", "advance", "step_given", "scratch"]

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


@njit(parallel=True, cache=True)
def init_runs(seed, n_perp, states, m_out, b_out):
    """Initial (M₀, B₀) of every run (Q5) and its seeded stream; n_perp = d − k."""
    r = m_out.shape[1]
    for run in prange(m_out.shape[0]):
        st = _rng.seed_stream(seed, run)
        m, b, st = _initial(st, n_perp, r)
        m_out[run] = m
        b_out[run] = b
        states[run] = st


N_SCRATCH_R = 4  # (r,)-vectors in the scratch: s, g and spares
NEWTON_MAX = 40  # Newton–Schulz iterations of the polar factor before falling back to eigh


@njit(cache=True)
def scratch(k, r):
    """Per-run work arrays of :func:`_step` (the hot loop allocates nothing)."""
    n = 2 * r + 1
    return (np.empty((N_SCRATCH_R, r)), np.empty((3, k)), np.empty((k, r)), np.empty(n),
            np.empty((n, r)), np.empty((4, r, r)), np.empty((r + 1, r)))


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


@njit(cache=True)
def _step(L, ident, lam, tc, tnorm, xi, chat, joint, code, hp, eta, eta_c, retraction,
          m, b, z, a, bv, rho, eps, vr, vk, gc, xv, y, rr, vv):
    """One step (Q1)–(Q4) in place: M, B and (joint) Ĉ are updated. Scratch from
    :func:`scratch`. z (k,) standard normals (Wx = Lz); a, bv (r,); rho = ‖rest of Πx‖;
    eps the label noise; ``tc`` = C (k×r); ``tnorm`` (k,) the teacher norms Nᵢ."""
    k, r = chat.shape
    n = 2 * r + 1
    s, g = vr[0], vr[1]
    nh, ahat, sd = vk[0], vk[1], vk[2]
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
            if joint:
                gc[j, q] = delta * (xi * s[q] / nh[j] - ahat[j] * xi * xi * chat[j, q]
                                    / (nh[j] * nh[j]))
    # (Q3): Y = X − η(ξₓgᵀ − X sym(s gᵀ)), X = [M; B; 0] in the basis (U, Q, r̂)
    sym = rr[0]
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
    # (Q4): retraction in coefficient space
    if retraction == 0:
        _r_factor(y, rr[3])  # y ← Q factor with diag(R) > 0
    else:
        gram = rr[3]
        for p in range(r):
            for q in range(r):
                acc = 0.0
                for l_ in range(n):
                    acc += y[l_, p] * y[l_, q]
                gram[p, q] = acc
        if _inv_sqrt_newton(gram, rr):
            inv = rr[1]
        else:
            inv = _sym_sqrt(gram, True)
        for p in range(n):
            for q in range(r):
                acc = 0.0
                for l_ in range(r):
                    acc += y[p, l_] * inv[l_, q]
                vr[2, q] = acc  # row p of Y S^{−1/2}, staged
            for q in range(r):
                y[p, q] = vr[2, q]
    for p in range(r):
        for q in range(r):
            m[p, q] = y[p, q]
    for p in range(r + 1):
        for q in range(r):
            vv[p, q] = y[r + p, q]
    _r_factor(vv, b)
    if joint:
        for j in range(k):
            for q in range(r):
                chat[j, q] -= eta_c * gc[j, q]


def step_given(L, ident, lam, tc, tnorm, xi, chat, joint, code, hp, eta, eta_c, retraction,
               m, b, z, a, bv, rho, eps):
    """One step (Q1)–(Q4) on given variates (tests): new (M′, B′, Ĉ′), inputs untouched."""
    m, b = np.array(m, dtype=np.float64), np.array(b, dtype=np.float64)
    chat = np.array(chat, dtype=np.float64)
    k, r = chat.shape
    _step(L, ident, lam, tc, tnorm, xi, chat, joint, code, hp, eta, eta_c, retraction, m, b,
          np.asarray(z, np.float64), np.asarray(a, np.float64), np.asarray(bv, np.float64),
          float(rho), float(eps), *scratch(k, r))
    return m, b, chat


@njit(cache=True)
def _run_one(L, ident, lam, tc, tnorm, xi, chat, joint, code, hp, dof, eta, eta_c,
             noise_sd, retraction, st, m, b, n_steps, cp_steps, cp_m, cp_chat, run,
             stop_level):
    k, r = chat.shape
    n_cp = cp_steps.shape[0]
    chi2_prep = _rng.chi2_prepare(dof)
    z = np.empty(k)
    a = np.empty(r)
    bv = np.empty(r)
    vr, vk, gc, xv, y, rr, vv = scratch(k, r)
    m_old = np.empty((r, r))
    b_old = np.empty((r, r))
    c_old = np.empty((k, r))
    use_stop = math.isfinite(stop_level)
    bound = r * (1.0 + SV_TOL)  # ‖M‖_F² ≤ r: M is a block of an orthonormal frame
    c = 0
    t = 0
    div_step = -1
    hit_step = -1
    while True:
        while c < n_cp and cp_steps[c] == t:
            cp_m[run, c] = m
            if joint:
                cp_chat[run, c] = chat
            c += 1
        if t == n_steps or div_step >= 0 or hit_step >= 0:
            break
        for i in range(k):
            z[i], st = _rng.normal(st)
        for q in range(r):
            a[q], st = _rng.normal(st)
        for q in range(r):
            bv[q], st = _rng.normal(st)
        eps = 0.0
        if noise_sd > 0.0:
            e, st = _rng.normal(st)
            eps = noise_sd * e
        q2, st = _rng.chi2_prepared(chi2_prep, st)
        m_old[:] = m
        b_old[:] = b
        if joint:
            c_old[:] = chat
        _step(L, ident, lam, tc, tnorm, xi, chat, joint, code, hp, eta, eta_c, retraction, m,
              b, z, a, bv, math.sqrt(q2), eps, vr, vk, gc, xv, y, rr, vv)
        t += 1
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
            div_step = t  # frozen at the last valid state
            m[:] = m_old
            b[:] = b_old
            if joint:
                chat[:] = c_old
            continue
        if use_stop and fro >= r * stop_level * stop_level and _min_sv_at_least(
                m, stop_level, rr):
            hit_step = t
    while c < n_cp:  # frozen (diverged or stopped) runs keep their last state
        cp_m[run, c] = m
        if joint:
            cp_chat[run, c] = chat
        c += 1
    return st, m, b, chat, div_step, hit_step


@njit(parallel=True, cache=True)
def advance(L_all, ident_all, lam_all, tc_all, tnorm_all, xi_all, inst_idx, chat_all, joint,
            code, hp, dof, eta, eta_c, noise_sd, retraction, states, m_all, b_all, n_steps,
            cp_steps, cp_m, cp_chat, div_step, stop_level, hit_step):
    """Advance every run ``n_steps`` (in place: states, M, B, Ĉ); checkpoints into cp_m
    (R, C, r, r) and cp_chat (R, C, k, r). div_step / hit_step: first step with a non-finite
    state or a singular value > 1 + SV_TOL (the run is frozen before it) / with the smallest
    singular value ≥ stop_level (the run stops); −1 if never."""
    for run in prange(m_all.shape[0]):
        i = inst_idx[run]
        st, m, b, ch, dv, ht = _run_one(
            L_all[i], ident_all[i], lam_all[i], tc_all[i], tnorm_all[i], xi_all[i],
            chat_all[run].copy(), joint, code, hp, dof, eta, eta_c, noise_sd, retraction,
            states[run], m_all[run].copy(), b_all[run].copy(), n_steps, cp_steps, cp_m,
            cp_chat, run, stop_level)
        states[run] = st
        m_all[run] = m
        b_all[run] = b
        chat_all[run] = ch
        div_step[run] = dv
        hit_step[run] = ht
