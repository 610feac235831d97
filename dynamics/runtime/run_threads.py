"""The runs of a chain on threads: a ``nogil`` numba function over blocks of runs, called from
a pool of Python threads.

A chain's runs are independent and each draws from its own stream (seed, run), so any split
of the runs over threads gives the same numbers. numba's ``prange`` would do the same split,
but its parallel gufunc links the run function's whole callee tree into two more LLVM
modules and optimises it again at each: measured cold, 5–13 s more compile per kernel than
this serial block loop (rank-r chain's start: 13.5 s under ``prange``, 4.6 s as a block).

The number of threads is numba's (``NUMBA_NUM_THREADS``, ``numba.set_num_threads``). Blocks
are small (about a quarter of an even share) and taken in order as threads free up: with
early stops the runs' costs differ.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba

__all__ = ["over_runs"]

BLOCKS_PER_THREAD = 4
_POOL: dict[int, ThreadPoolExecutor] = {}  # one pool per thread count, kept between calls


def over_runs(block, n_runs: int, *args) -> None:
    """Call ``block(lo, hi, *args)`` (a ``nogil`` numba function advancing runs lo … hi − 1
    in place) over [0, n_runs) on numba's number of threads."""
    threads = max(1, min(numba.get_num_threads(), n_runs))
    if threads == 1:
        block(0, n_runs, *args)
        return
    pool = _POOL.get(threads)
    if pool is None:
        pool = _POOL[threads] = ThreadPoolExecutor(threads, thread_name_prefix="loradyn-runs")
    size = -(-n_runs // (BLOCKS_PER_THREAD * threads))
    futures = [pool.submit(block, lo, min(lo + size, n_runs), *args)
               for lo in range(0, n_runs, size)]
    for future in futures:
        future.result()
