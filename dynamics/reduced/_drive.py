"""The run loop shared by the reduced chains: checkpoints, divergence and the stop rule.

A chain supplies ``step(ctx, sc, t) -> (sc, status)`` (one step from step t; ``sc`` the
run's scalar state, a tuple; arrays of the state live in ``ctx`` and change in place) and
``record(ctx, sc, c)`` (write checkpoint c). :func:`drive` is inlined into each chain's run
function (numba ``inline="always"``), where ``step`` and ``record`` are globals and are
inlined in turn, so the loop costs what a hand-written one does and also compiles as CUDA
device code.

The run function that inlines :func:`drive` is compiled with ``_nrt=False`` (numba's flag for
code without reference counting, which is how CUDA compiles it anyway): inlined calls copy
their array arguments, and NRT's reference counting of those copies on every step (which
LLVM's refcount pruning does not remove across the step's branches) would halve the speed
of an O(k) step. Such a function must allocate nothing: numba then refuses to compile it.

Only a step's hot pieces are inlined (numba's IR inlining copies the callee's IR at each
site, which is most of a chain's compile time): the network chain's compression, alignment,
loss and record are plain calls, which cut its cold compile from 67 s to 27 s and made its
K = 2 step faster (4.5 → 5.0 M steps/s). The runs go to threads in blocks
(:func:`dynamics.runtime.run_threads.over_runs`), not through a ``prange``, whose gufunc compiled
each run function a second time (its index is uint64 there) and re-optimised its callees.
"""

from __future__ import annotations

import math

from numba import njit

__all__ = ["RUNNING", "DIVERGED", "HIT", "M_TOL", "drive", "overlap_status"]

RUNNING, DIVERGED, HIT = 0, 1, 2  # status of a run after a step
M_TOL = 1e-12  # |m| > 1 + M_TOL counts as divergence (|m| ≤ 1 holds up to rounding)


@njit(inline="always")
def drive(step, record, ctx, sc, n_steps, cp_steps):
    """Advance one run by up to ``n_steps`` steps, recording at ``cp_steps`` (sorted).

    Returns (sc, div_step, hit_step): div_step the first step whose status is DIVERGED (the
    run is frozen there), hit_step the first with status HIT (the run stops there); −1 when
    it did not happen. Checkpoints after the last step repeat the frozen state.
    """
    n_cp = cp_steps.shape[0]
    c = 0
    t = 0
    div_step = -1
    hit_step = -1
    while True:
        while c < n_cp and cp_steps[c] == t:
            record(ctx, sc, c)
            c += 1
        if t == n_steps or div_step >= 0 or hit_step >= 0:
            break
        sc, status = step(ctx, sc, t)
        t += 1
        if status == DIVERGED:
            div_step = t
        elif status == HIT:
            hit_step = t
    while c < n_cp:  # frozen (diverged or stopped) runs keep their last state
        record(ctx, sc, c)
        c += 1
    return sc, div_step, hit_step


@njit(inline="always")
def overlap_status(m, nu, use_stop, stop_level, stop_abs):
    """DIVERGED for a non-finite (m, ν) or |m| > 1 + M_TOL, HIT when ``use_stop`` and
    m ≥ stop_level (|m| if ``stop_abs``), else RUNNING."""
    if not (math.isfinite(m) and math.isfinite(nu)) or abs(m) > 1.0 + M_TOL:
        return DIVERGED
    if use_stop and (abs(m) if stop_abs else m) >= stop_level:
        return HIT
    return RUNNING
