"""CUDA backend of the network chain: one thread per run, every step of a call in ONE launch.

The kernel calls the same compiled run loop as the CPU driver (:func:`.network_chain._run_one`,
which allocates nothing: its work arrays are rows of device arrays here), with the same
per-run SplitMix64 streams, so a run's numbers are those of the CPU ``numba`` backend up to
floating-point contraction on the device. Tested on CPU with numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``), which executes the same kernel source thread by thread.
"""

from __future__ import annotations

import warnings

import numpy as np
from numba import cuda

from dynamics.reduced.network_chain import NetWork, _run_one, work_arrays

__all__ = ["advance_network", "THREADS_PER_BLOCK"]

THREADS_PER_BLOCK = 64


@cuda.jit
def _kernel(hyp, V, ident, lam, runs, rec, teacher_term, coef, work):
    r = cuda.grid(1)
    if r >= runs.P.shape[0]:
        return
    i = runs.inst_idx[r]
    w = NetWork(work[0][r], work[1][r], work[2][r], work[3][r], work[4][r], work[5][r],
                work[6][r], work[7][r], work[8][r], work[9][r], work[10][r], work[11][r],
                work[12][r], work[13][r], work[14][r], work[15][r], work[16][r], work[17][r],
                work[18][r], work[19][r], work[20][r], work[21][r])
    st, m, slot, ready, div, hit = _run_one(r, hyp, V[i], ident[i], lam[i], runs.P[r],
                                            runs.Z[r], runs.lam_hat[r], runs.mask[r],
                                            runs.states[r], runs.m[r], rec, w,
                                            teacher_term[i], coef, runs.slot[r],
                                            runs.ready[r])
    runs.states[r] = st
    runs.m[r] = m
    runs.slot[r] = slot
    runs.ready[r] = ready
    runs.div_step[r] = div
    runs.hit_step[r] = hit


def _to_device(group):
    """A named tuple of host arrays → the same named tuple of device copies."""
    return type(group)(*(cuda.to_device(np.ascontiguousarray(a)) for a in group))


def advance_network(hyp, V, ident, lam, runs, rec, teacher_term, coef, work=None) -> None:
    """Same arguments and in-place results as :func:`.network_chain.advance_network` (host
    numpy arrays); the state (and ``work``, the runs' :func:`.network_chain.work_arrays`,
    kept between the calls of a run in segments) is copied to the device, advanced in one
    launch, copied back."""
    n_runs, kp, t = runs.P.shape
    host_work = work if work is not None else work_arrays(n_runs, hyp.batch, V.shape[1], kp, t,
                                                          runs.Z.shape[2])
    d_work = tuple(cuda.to_device(np.ascontiguousarray(a)) for a in host_work)
    d_runs, d_rec = _to_device(runs), _to_device(rec)
    args = [cuda.to_device(np.ascontiguousarray(a)) for a in (V, ident, lam, teacher_term,
                                                               coef)]
    blocks = (n_runs + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    with warnings.catch_warnings():  # few runs → few blocks, by the caller's choice
        warnings.filterwarnings("ignore", message=".*Grid size .* under-utilization")
        _kernel[blocks, THREADS_PER_BLOCK](hyp, args[0], args[1], args[2], d_runs, d_rec,
                                           args[3], args[4], d_work)
    for host, dev in zip(runs + rec[1:], d_runs + d_rec[1:], strict=True):
        host[...] = dev.copy_to_host()
    if work is not None:
        for host, dev in zip(work, d_work, strict=True):
            host[...] = dev.copy_to_host()
