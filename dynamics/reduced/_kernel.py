"""The numba drivers: initial law and all R runs in parallel (``prange`` over runs).

Each run draws from its own stream (:mod:`._rng`, seeded from (seed, r)), so results do not
depend on the number of threads.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from hermite.activations_numba import act_code

from . import _rng
from ._chain import run_one, scratch

__all__ = ["init_runs", "advance", "replay"]

_NO_GIVEN3 = np.zeros((0, 0, 0))
_NO_GIVEN2 = np.zeros((0, 0))


@njit(parallel=True, cache=True)
def init_runs(seed, n_perp, states, mu, nu):
    """μ₀ = g/√(g² + χ²_{n−1}), ν₀ = √(1 − μ₀²) (R0): the first coordinate of a uniform unit
    vector of Rⁿ, n = n_perp = d − k (û₀ uniform on the sphere of span(W)^⊥). Seeds streams."""
    for r in prange(mu.shape[0]):
        st = _rng.seed_stream(seed, r)
        g, st = _rng.normal(st)
        q, st = _rng.chi2(n_perp - 1, st)
        nrm = math.sqrt(g * g + q)
        mu[r] = g / nrm
        nu[r] = math.sqrt(q) / nrm
        states[r] = st


@njit(parallel=True, cache=True)
def advance(project, joint, L_all, ident_all, prm_all, inst_idx, code, hp, dof, eta, eta_c,
            batch, noise_sd, states, mu, nu, pw, chat, n_steps, cp_steps,
            cp_m, cp_mu, cp_nu, cp_pw, cp_chat, div_step, stop_level, stop_abs, hit_step):
    """Advance every run by ``n_steps`` from its state (``states``, μ, ν, p, ĉ; in place).

    See :func:`._chain.run_one` for the checkpoint, divergence and stop conventions. Call
    it under ``numba.parallel_chunksize(1)``: with early stops the runs' costs differ.
    """
    k = chat.shape[1]
    for r in prange(mu.shape[0]):
        i = inst_idx[r]
        wk, wb, zs = scratch(k, batch)
        st, m_r, n_r, dv, ht = run_one(
            r, project, joint, L_all[i], ident_all[i], prm_all[i], code, hp, dof, eta, eta_c,
            batch, noise_sd, states[r], mu[r], nu[r], pw[r], chat[r], n_steps, cp_steps,
            cp_m, cp_mu, cp_nu, cp_pw, cp_chat, stop_level, stop_abs,
            _NO_GIVEN3, _NO_GIVEN2, _NO_GIVEN2, _NO_GIVEN2, _NO_GIVEN3, wk, wb, zs)
        states[r] = st
        mu[r] = m_r
        nu[r] = n_r
        div_step[r] = dv
        hit_step[r] = ht



def replay(params, run, act_name, *, project, joint, eta, eta_c, mu, nu, pw, chat,
           Zg, Ag, Bg, Eg, Gg):
    """Test hook: run ``run``'s chain (same code as :func:`advance`) on given variates:
    z (T, b, k); a, b, ε (T, b); Gram of the parts rₙ ⊥ span(W, e, ê) (T, b, b).
    Returns the final (μ, ν, p, ĉ)."""
    i = params.inst_idx[run]
    code, hp = act_code(act_name)
    pw, chat = np.array(pw, dtype=np.float64), np.array(chat, dtype=np.float64)
    none3, none2 = np.zeros((1, 0, 0)), np.zeros((1, 0))
    given = (np.ascontiguousarray(a, dtype=np.float64) for a in (Zg, Ag, Bg, Eg, Gg))
    _, mu, nu, _, _ = run_one(
        0, project, joint, params.L[i], params.ident[i], params.prm[i], code, hp, 0,
        float(eta), float(eta_c), Zg.shape[1], 0.0, np.uint64(0), float(mu), float(nu), pw,
        chat, Zg.shape[0], np.zeros(0, np.int64), none2, none2, none2, none3, none3,
        math.inf, True, *given, *scratch(chat.shape[0], Zg.shape[1]))
    return mu, nu, pw, chat
