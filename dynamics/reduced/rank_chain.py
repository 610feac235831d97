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

from ..activations_numba import sigma, sigma_and_deriv
from . import _rng

__all__ = ["RETRACTIONS", "init_runs", "advance", "singular_values", "step_given"]

RETRACTIONS = {"qr": 0, "polar": 1}
SV_TOL = 1e-9  # a singular value of M above 1 + SV_TOL counts as divergence


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
def _mgs(y):
    """Q factor of y (n×r, full column rank) with positive diag(R), by modified Gram–Schmidt."""
    q = y.copy()
    n, r = y.shape
    for j in range(r):
        for i in range(j):
            dot = 0.0
            for p in range(n):
                dot += q[p, i] * q[p, j]
            for p in range(n):
                q[p, j] -= dot * q[p, i]
        nrm = 0.0
        for p in range(n):
            nrm += q[p, j] * q[p, j]
        nrm = math.sqrt(nrm)
        for p in range(n):
            q[p, j] /= nrm
    return q


@njit(cache=True)
def singular_values(m):
    """Singular values of M (descending), from the eigenvalues of MᵀM."""
    w = np.linalg.eigvalsh(m.T @ m)
    r = w.shape[0]
    out = np.empty(r)
    for i in range(r):
        out[i] = math.sqrt(max(w[r - 1 - i], 0.0))
    return out


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


@njit(cache=True)
def step_given(L, ident, lam, tc, tnorm, xi, chat, joint, code, hp, eta, eta_c, retraction,
               m, b, z, a, bv, rho, eps):
    """One step (Q1)–(Q4) on given variates; returns (M′, B′, Ĉ′) (Ĉ′ = Ĉ when frozen).

    z (k,) = Wx; a, bv (r,); rho = ‖rest of Πx‖; eps label noise. ``tc`` = C (k×r) and
    ``tnorm`` (k,) = teacher norms Nᵢ.
    """
    k, r = chat.shape
    s = m.T @ a + b.T @ bv
    nh = np.empty(k)
    for j in range(k):
        acc = 0.0
        for q in range(r):
            acc += chat[j, q] * chat[j, q]
        nh[j] = math.sqrt(1.0 + xi * xi * acc)
    if ident:
        wz = z
    else:
        wz = L @ z
    resid = eps
    ahat = np.empty(k)
    sd = np.empty(k)
    for i in range(k):
        ta = 0.0
        sa = 0.0
        for q in range(r):
            ta += tc[i, q] * a[q]
            sa += chat[i, q] * s[q]
        resid += lam[i] * sigma((wz[i] + xi * ta) / tnorm[i], code, hp)
        ahat[i] = (wz[i] + xi * sa) / nh[i]
        sv, sd[i] = sigma_and_deriv(ahat[i], code, hp)
        resid -= lam[i] * sv
    g = np.zeros(r)
    gc = np.zeros((k, r))
    for j in range(k):
        delta = -2.0 * resid * lam[j] * sd[j]
        for q in range(r):
            g[q] += delta * xi * chat[j, q] / nh[j]
            if joint:
                gc[j, q] = delta * (xi * s[q] / nh[j] - ahat[j] * xi * xi * chat[j, q]
                                    / (nh[j] * nh[j]))
    # (Q3): Y = X − η(ξₓgᵀ − X sym(s gᵀ)) in the basis (U, Q, r̂)
    n = 2 * r + 1
    x = np.zeros((n, r))
    xv = np.empty(n)
    for p in range(r):
        xv[p] = a[p]
        xv[r + p] = bv[p]
        for q in range(r):
            x[p, q] = m[p, q]
            x[r + p, q] = b[p, q]
    xv[2 * r] = rho
    sym = np.empty((r, r))
    for p in range(r):
        for q in range(r):
            sym[p, q] = 0.5 * (s[p] * g[q] + g[p] * s[q])
    y = x - eta * (np.outer(xv, g) - x @ sym)
    if retraction == 0:
        xn = _mgs(y)
    else:
        xn = y @ _sym_sqrt(_gram(y), True)
    m_new = np.ascontiguousarray(xn[:r])
    v = np.ascontiguousarray(xn[r:])
    b_new = _sym_sqrt(_gram(v), False)
    c_new = chat - eta_c * gc if joint else chat
    return m_new, b_new, c_new


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
    use_stop = math.isfinite(stop_level)
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
        m2, b2, c2 = step_given(L, ident, lam, tc, tnorm, xi, chat, joint, code, hp, eta, eta_c,
                                retraction, m, b, z, a, bv, math.sqrt(q2), eps)
        t += 1
        sv = singular_values(m2)
        ok = np.all(np.isfinite(m2)) and np.all(np.isfinite(b2)) and np.all(np.isfinite(c2))
        if not ok or sv[0] > 1.0 + SV_TOL:
            div_step = t
            continue
        m, b, chat = m2, b2, c2
        if use_stop and sv[r - 1] >= stop_level:
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
