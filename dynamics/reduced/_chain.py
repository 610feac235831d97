"""One run of the reduced chain (numba): the exact step (R3)–(R6) of the package docstring.

The whole step loop of a run lives in one function; on the hot path (projected, ĉ frozen)
it calls only scalar helpers, since passing arrays to a helper costs reference counting on
every call, which would dominate an O(k) step. Variates come from the run's stream, or, in
*given* mode (tests), from arrays: z, a, b, ε per step and example, and the Gram matrix of
the examples' parts rₙ ⊥ span(W, e, ê), from which ρ² = ‖Σₙ ḡₙ rₙ‖² = ḡᵀ Gram ḡ. In stream
mode ρ² = ‖ḡ‖² χ²_{d−k−2} (same law, see (R5)).

Per-instance parameters are one row ``prm`` = [λ (k), c (k), N (k), u_w (k), u⊥, ξ] and the
k×k factor ``L`` (rows wᵢ in an orthonormal basis of span W; ``ident`` skips L z).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from hermite.activations_numba import sigma, sigma_and_deriv

from . import _rng

__all__ = ["run_one", "scratch", "M_TOL", "N_WORK_K", "N_WORK_B"]

M_TOL = 1e-12  # |m| > 1 + M_TOL counts as divergence (|m| ≤ 1 holds up to rounding)


@njit(cache=True)
def _student_coeffs(L, ident, xi, pw, chat, project, wu, sc1, sc2, vu):
    """1/N̂ⱼ, ξĉⱼ/N̂ⱼ and ⟨v̂ⱼ, û⟩ with N̂ⱼ = √(1 + 2ξĉⱼ⟨wⱼ,û⟩ + ξ²ĉⱼ²) (R2)."""
    k = chat.shape[0]
    for j in range(k):
        acc = 0.0
        if not project:
            if ident:
                acc = pw[j]
            else:
                for i in range(k):
                    acc += L[j, i] * pw[i]
        wu[j] = acc
        xc = xi * chat[j]
        nh = math.sqrt(1.0 + 2.0 * xc * acc + xc * xc)
        sc1[j] = 1.0 / nh
        sc2[j] = xc / nh
        vu[j] = (acc + xc) / nh


@njit(cache=True, inline="always")
def _neuron(w, t1, t2, ux, s1, s2, s, lam, code, hp):
    """Neuron i of one example (R2): (λ(σ(tᵢ) − σ(âᵢ)), λσ′(âᵢ)ξĉᵢ/N̂ᵢ, âᵢ, σ′(âᵢ)) with
    tᵢ = w t1 + t2⟨u,x⟩ (t1 = 1/Nᵢ, t2 = ξcᵢ/Nᵢ), âᵢ = w s1 + s2 s (s1 = 1/N̂ᵢ, s2 = ξĉᵢ/N̂ᵢ),
    w = ⟨wᵢ, x⟩."""
    ah = w * s1 + s2 * s
    sv, sd = sigma_and_deriv(ah, code, hp)
    return lam * (sigma(w * t1 + t2 * ux, code, hp) - sv), lam * sd * s2, ah, sd


@njit(cache=True, inline="always")
def _dot(x, y):
    acc0 = 0.0
    acc1 = 0.0
    for i in range(0, x.shape[0] - 1, 2):
        acc0 += x[i] * y[i]
        acc1 += x[i + 1] * y[i + 1]
    if x.shape[0] % 2:
        acc0 += x[-1] * y[-1]
    return acc0 + acc1


@njit(cache=True)
def _overlap(prm, pw, mu, project):
    """m = ⟨û, u⟩ = ⟨p, u_w⟩ + μ u⊥ (R1)."""
    k = pw.shape[0]
    m = mu * prm[4 * k]
    if not project:
        for i in range(k):
            m += pw[i] * prm[3 * k + i]
    return m


@njit(cache=True)
def _record(c, r, prm, pw, mu, nu, chat, project, cp_m, cp_mu, cp_nu, cp_pw, cp_chat):
    cp_m[r, c] = _overlap(prm, pw, mu, project)
    cp_mu[r, c] = mu
    cp_nu[r, c] = nu
    for i in range(cp_pw.shape[2]):  # element loops: a slice assignment needs NRT on CUDA
        cp_pw[r, c, i] = pw[i]
    for i in range(cp_chat.shape[2]):
        cp_chat[r, c, i] = chat[i]


N_WORK_K = 11  # rows of the per-run scratch ``wk`` (length k each), see :func:`run_one`
N_WORK_B = 4  # rows of the per-run scratch ``wb`` (length b each)


@njit(cache=True)
def scratch(k, batch):
    """Per-run scratch arrays (wk, wb, Z) of :func:`run_one`."""
    return np.empty((N_WORK_K, k)), np.empty((N_WORK_B, batch)), np.empty((batch, k))


@njit(cache=True)
def run_one(r, project, joint, L, ident, prm, code, hp, dof, eta, eta_c, batch, noise_sd,
            st, mu, nu, pw, chat, n_steps, cp_steps, cp_m, cp_mu, cp_nu, cp_pw, cp_chat,
            stop_level, stop_abs, Zg, Ag, Bg, Eg, Gg, wk, wb, Z):
    """Advance run ``r`` from (μ, ν, p, ĉ, stream ``st``) by ``n_steps`` steps.

    ``pw`` and ``chat`` are updated in place; checkpoints go to row ``r`` of the cp arrays.
    Returns (st, μ, ν, div_step, hit_step): div_step is the first step with a non-finite
    state or |m| > 1 (the run is frozen there), hit_step the first step with m ≥ stop_level
    (|m| if ``stop_abs``; the run stops there); −1 when it did not happen. ``wk``, ``wb``
    and ``Z`` are scratch (:func:`scratch`): the function allocates nothing, so the same
    code runs as a CUDA device function (:mod:`.cuda_kernel`).
    """
    k = chat.shape[0]
    u_perp, xi = prm[4 * k], prm[4 * k + 1]
    given = Zg.shape[0] > 0
    use_stop = math.isfinite(stop_level)
    lam = prm[:k]
    uw = prm[3 * k:4 * k]
    tc1, tc2, wz, ahat, sdv = wk[0], wk[1], wk[2], wk[3], wk[4]
    gw, gc, wu, sc1, sc2, vu = wk[5], wk[6], wk[7], wk[8], wk[9], wk[10]
    A, Bv, eps, gvec = wb[0], wb[1], wb[2], wb[3]
    has_uw = False
    for i in range(k):
        tc1[i] = 1.0 / prm[2 * k + i]
        tc2[i] = xi * prm[k + i] / prm[2 * k + i]
        has_uw = has_uw or uw[i] != 0.0
        gw[i] = 0.0
        gc[i] = 0.0
    for n in range(batch):
        eps[n] = 0.0
    refresh = joint or not project
    chi2_prep = _rng.chi2_prepare(dof)
    res_scale = -2.0 / batch
    _student_coeffs(L, ident, xi, pw, chat, project, wu, sc1, sc2, vu)
    n_cp = cp_steps.shape[0]
    c = 0
    t = 0
    div_step = -1
    hit_step = -1
    while True:
        while c < n_cp and cp_steps[c] == t:
            _record(c, r, prm, pw, mu, nu, chat, project, cp_m, cp_mu, cp_nu, cp_pw, cp_chat)
            c += 1
        if t == n_steps or div_step >= 0 or hit_step >= 0:
            break
        # ---- variates of the batch: z ~ N(0, I_k), a = ⟨e,x⟩, b = ⟨ê,x⟩, label noise ε
        for n in range(batch):
            if given:
                for i in range(k):
                    Z[n, i] = Zg[t, n, i]
                A[n] = Ag[t, n]
                Bv[n] = Bg[t, n]
                eps[n] = Eg[t, n]
            else:
                for i in range(k):
                    Z[n, i], st = _rng.normal(st)
                A[n], st = _rng.normal(st)
                Bv[n], st = _rng.normal(st)
                if noise_sd > 0.0:
                    e, st = _rng.normal(st)
                    eps[n] = noise_sd * e
        # ---- batch-mean gradient (R3, R4)
        if refresh:
            _student_coeffs(L, ident, xi, pw, chat, project, wu, sc1, sc2, vu)
        ge = 0.0
        geh = 0.0
        for i in range(k):
            gw[i] = 0.0
            gc[i] = 0.0
        for n in range(batch):
            a = A[n]
            b = Bv[n]
            ux = u_perp * a
            s = mu * a + nu * b
            for i in range(k):
                if ident:
                    wz[i] = Z[n, i]
                else:
                    acc = 0.0
                    for j in range(k):
                        acc += L[i, j] * Z[n, j]
                    wz[i] = acc
            if has_uw:
                ux += _dot(uw, Z[n])
            if not project:
                s += _dot(pw, Z[n])
            # two accumulators each (even/odd neurons) halve the dependency chains
            f0 = eps[n]
            f1 = 0.0
            q0 = 0.0
            q1 = 0.0
            for i in range(k):
                df, dq, ah, sd = _neuron(wz[i], tc1[i], tc2[i], ux, sc1[i], sc2[i], s, lam[i],
                                         code, hp)
                ahat[i] = ah
                sdv[i] = sd
                if i % 2 == 0:
                    f0 += df
                    q0 += dq
                else:
                    f1 += df
                    q1 += dq
            res = res_scale * (f0 + f1)  # −2(y − f̂)/b
            g = res * (q0 + q1)  # Σⱼ δⱼξĉⱼ/N̂ⱼ, δⱼ = res λⱼσ′(âⱼ)
            if joint or not project:
                for j in range(k):
                    beta = res * lam[j] * sdv[j]
                    if not project:  # −Σⱼ γⱼwⱼ, γⱼ = δⱼâⱼξĉⱼ/N̂ⱼ² (R3)
                        kap = beta * ahat[j] * sc2[j] * sc1[j]
                        if ident:
                            gw[j] -= kap
                        else:
                            for i in range(k):
                                gw[i] -= kap * L[j, i]
                    if joint:  # (R4)
                        gc[j] += beta * xi * sc1[j] * (s - ahat[j] * vu[j])
            gvec[n] = g
            ge += g * a
            geh += g * b
            if not project:
                for i in range(k):
                    gw[i] += g * Z[n, i]
        # ---- ρ² = ‖Σₙ ḡₙ rₙ‖² (R5)
        rho2 = 0.0
        if given:
            for n in range(batch):
                for n2 in range(batch):
                    rho2 += gvec[n] * Gg[t, n, n2] * gvec[n2]
        else:
            q, st = _rng.chi2_prepared(chi2_prep, st)
            for n in range(batch):
                rho2 += gvec[n] * gvec[n]
            rho2 *= q
        # ---- spherical step for û and plain step for ĉ (R5, R6)
        tang = mu * ge + nu * geh
        if not project:
            for i in range(k):
                tang += pw[i] * gw[i]
        ne = mu - eta * (ge - tang * mu)
        nt = nu - eta * (geh - tang * nu)
        er = eta * math.sqrt(rho2)
        sq_rest = nt * nt + er * er
        norm2 = ne * ne + sq_rest
        if not project:
            for i in range(k):
                pw[i] = pw[i] - eta * (gw[i] - tang * pw[i])
                norm2 += pw[i] * pw[i]
        inv = 1.0 / math.sqrt(norm2)
        if not project:
            for i in range(k):
                pw[i] *= inv
        if joint:
            for j in range(k):
                chat[j] -= eta_c * gc[j]
        mu = ne * inv
        nu = math.sqrt(sq_rest) * inv
        t += 1
        m = mu * u_perp
        if not project:
            for i in range(k):
                m += pw[i] * prm[3 * k + i]
        if not (math.isfinite(m) and math.isfinite(nu)) or abs(m) > 1.0 + M_TOL:
            div_step = t
        elif use_stop and (abs(m) if stop_abs else m) >= stop_level:
            hit_step = t
    while c < n_cp:  # frozen (diverged or stopped) runs keep their last state
        _record(c, r, prm, pw, mu, nu, chat, project, cp_m, cp_mu, cp_nu, cp_pw, cp_chat)
        c += 1
    return st, mu, nu, div_step, hit_step
