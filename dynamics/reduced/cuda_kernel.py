"""CUDA backend of the reduced chain: one thread per run, every step of a call in ONE launch.

The kernel calls the same compiled step loop as the CPU driver (:func:`._chain.run_index`,
which allocates nothing: its scratch rows are slices of device arrays here), with the same
per-run SplitMix64 streams, so a run's numbers are those of the CPU ``numba`` backend up to
floating-point contraction (FMA) on the device. Checkpoints are written by the threads
themselves, so nothing returns to the host until the call ends (or every run has stopped or
diverged): the launch overhead is paid once per call (a segment of about half a second,
:mod:`.segments`) instead of once per step, as it is in the vectorised torch backend
(:mod:`.torch_chain`).

Tested on CPU with numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), which executes the
same kernel source thread by thread.
"""

from __future__ import annotations

import warnings

import numpy as np
from numba import cuda

from dynamics.reduced._chain import (
    FLAT_ARGS,
    N_WORK_B,
    N_WORK_K,
    Hyper,
    Inst,
    Records,
    Runs,
    run_index,
    typed_hyper,
)
from dynamics.reduced.params import split_flat

__all__ = ["advance_runs", "advance", "THREADS_PER_BLOCK"]

THREADS_PER_BLOCK = 64


@cuda.jit
def _advance_kernel(hyp, inst, runs, rec, work, given):
    r = cuda.grid(1)
    if r >= runs.mu.shape[0]:
        return
    run_index(r, hyp, inst, runs, rec, given, (work[0][r], work[1][r], work[2][r]))


def _to_device(group):
    """A named tuple of host arrays → the same named tuple of device copies."""
    return type(group)(*(cuda.to_device(np.ascontiguousarray(a)) for a in group))


def advance_runs(hyp, inst, runs, rec) -> None:
    """Same arguments and in-place results as :func:`._kernel.advance_runs` (host numpy
    arrays); the state is copied to the device, advanced in one launch and copied back."""
    n_runs, k = runs.chat.shape
    d_inst, d_runs, d_rec = _to_device(inst), _to_device(runs), _to_device(rec)
    work = (cuda.device_array((n_runs, N_WORK_K, k)), cuda.device_array((n_runs, N_WORK_B,
                                                                          hyp.batch)),
            cuda.device_array((n_runs, hyp.batch, k)))
    no3, no2 = cuda.device_array((0, 0, 0)), cuda.device_array((0, 0))
    blocks = (n_runs + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    with warnings.catch_warnings():  # few runs → few blocks, by the caller's choice
        warnings.filterwarnings("ignore", message=".*Grid size .* under-utilization")
        _advance_kernel[blocks, THREADS_PER_BLOCK](hyp, d_inst, d_runs, d_rec, work,
                                                   (no3, no2, no2, no2, no3))
    for host, dev in zip(runs + rec[1:], d_runs + d_rec[1:], strict=True):
        host[...] = dev.copy_to_host()


def advance(*args) -> None:
    """:func:`advance_runs` on flat arguments, in the order of ``_chain.FLAT_ARGS``."""
    hyp, inst, runs, rec = split_flat(FLAT_ARGS, args, Hyper, Inst, Runs, Records)
    advance_runs(typed_hyper(hyp), inst, runs, rec)
