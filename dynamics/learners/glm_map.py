"""The glm learner's population map m̄ ← m̄ + η·2K′(m̄)(1 − m̄²) iterated step by step in
numba (``GLM``'s ODE, :func:`dynamics.learners.glm.glm_ode`), in a module of its own so that
importing the learner compiles and loads nothing."""

from __future__ import annotations

import numba
import numpy as np

from hermite.expansion.table import table_eval

__all__ = ["iterate_map"]


@numba.njit(cache=False)  # not cached: it inlines hermite's table_eval (a stale-cache risk)
def iterate_map(m0, eta, tab, n, ckpts):  # pragma: no cover - compiled
    out = np.empty((m0.size, ckpts.size))
    for r in range(m0.size):
        m = m0[r]
        t = 0
        for c in range(ckpts.size):
            while t < ckpts[c]:
                m = m + eta * table_eval(tab, n, 1.0, m) * (1.0 - m * m)
                t += 1
            out[r, c] = m
    return out
