"""The numba drivers: initial law and all R runs on numba's threads
(:mod:`dynamics.runtime.run_threads`).

Each run draws from its own stream (:mod:`._rng`, seeded from (seed, r)), so results do not
depend on the number of threads.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from dynamics.reduced import _rng
from dynamics.reduced._chain import (
    FLAT_ARGS,
    ChainState,
    Hyper,
    Inst,
    RankOneSettings,
    Records,
    Runs,
    make_hyper,
    run_index,
    run_one,
    scratch,
    typed_hyper,
)
from dynamics.reduced.params import split_flat
from dynamics.runtime.run_threads import over_runs
from hermite.activations_numba import act_code

__all__ = ["init_runs", "advance_runs", "advance", "replay"]

_NO_GIVEN3 = np.zeros((0, 0, 0))
_NO_GIVEN2 = np.zeros((0, 0))


@njit(cache=True, nogil=True)
def _init_block(lo, hi, seed, n_perp, states, mu, nu):
    for r in range(lo, hi):
        st = _rng.seed_stream(seed, r)
        g, st = _rng.normal(st)
        q, st = _rng.chi2(n_perp - 1, st)
        nrm = math.sqrt(g * g + q)
        mu[r] = g / nrm
        nu[r] = math.sqrt(q) / nrm
        states[r] = st


def init_runs(seed, n_perp, states, mu, nu) -> None:
    """μ₀ = g/√(g² + χ²_{n−1}), ν₀ = √(1 − μ₀²) (R0): the first coordinate of a uniform unit
    vector of Rⁿ, n = n_perp = d − k (û₀ uniform on the sphere of span(W)^⊥). Seeds streams."""
    over_runs(_init_block, mu.shape[0], seed, n_perp, states, mu, nu)


@njit(cache=True, nogil=True)
def _advance_block(lo, hi, hyp, inst, runs, rec):
    given = (_NO_GIVEN3, _NO_GIVEN2, _NO_GIVEN2, _NO_GIVEN2, _NO_GIVEN3)
    k = runs.chat.shape[1]
    for r in range(lo, hi):
        run_index(r, hyp, inst, runs, rec, given, scratch(k, hyp.batch))


def advance_runs(hyp, inst, runs, rec) -> None:
    """Advance every run of ``runs`` (:class:`._chain.Runs`, in place) by ``hyp.n_steps`` on
    numba's threads (:func:`dynamics.runtime.run_threads.over_runs`). See :func:`._chain.run_one`
    for the checkpoint, divergence and stop conventions."""
    over_runs(_advance_block, runs.mu.shape[0], hyp, inst, runs, rec)


def advance(*args) -> None:
    """:func:`advance_runs` on flat arguments, in the order of ``_chain.FLAT_ARGS``."""
    hyp, inst, runs, rec = split_flat(FLAT_ARGS, args, Hyper, Inst, Runs, Records)
    advance_runs(typed_hyper(hyp), inst, runs, rec)


def replay(params, run, act_name, start: ChainState, *, project, joint, eta, eta_c, **given):
    """Test hook: run ``run``'s chain (same code as :func:`advance`) from ``start`` (μ, ν, p,
    ĉ) on given variates ``Zg`` z (T, b, k); ``Ag``, ``Bg``, ``Eg`` a, b, ε (T, b); ``Gg``
    the Gram of the parts rₙ ⊥ span(W, e, ê) (T, b, b). Returns the final (μ, ν, p, ĉ)."""
    i = params.inst_idx[run]
    pw, chat = np.array(start.pw, dtype=np.float64), np.array(start.chat, dtype=np.float64)
    Zg, Ag, Bg, Eg, Gg = (np.ascontiguousarray(given[n], dtype=np.float64)
                          for n in ("Zg", "Ag", "Bg", "Eg", "Gg"))
    steps, batch = Zg.shape[:2]
    none3, none2 = np.zeros((1, 0, 0)), np.zeros((1, 0))
    settings = RankOneSettings(project, joint, 0, eta, eta_c, batch, 0.0)
    hyp = make_hyper(settings, act_code(act_name), steps)
    rec = Records(np.zeros(0, np.int64), none2, none2, none2, none3, none3)
    (_, mu, nu), _, _ = run_one(
        0, hyp, (params.L[i], params.ident[i], params.prm[i]),
        (np.uint64(0), float(start.mu), float(start.nu)), pw, chat, rec, (Zg, Ag, Bg, Eg, Gg),
        scratch(chat.shape[0], batch))
    return mu, nu, pw, chat
