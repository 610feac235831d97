"""``over_runs``: every run advanced exactly once, in blocks on numba's threads, and a chain's
numbers do not depend on the number of threads."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit

from dynamics.runtime.run_threads import BLOCKS_PER_THREAD, over_runs


@njit(nogil=True)
def _mark(lo, hi, count, owner):
    for r in range(lo, hi):
        count[r] += 1
        owner[r] = lo


@pytest.mark.parametrize("n_runs", [1, 2, 7, 64, 1001])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_run_once_in_contiguous_blocks(n_runs, threads):
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        count, owner = np.zeros(n_runs, np.int64), np.full(n_runs, -1, np.int64)
        over_runs(_mark, n_runs, count, owner)
    finally:
        numba.set_num_threads(before)
    assert np.all(count == 1)
    starts = np.unique(owner)
    assert len(starts) <= BLOCKS_PER_THREAD * threads  # a few blocks per thread, not one a run
    assert np.all(np.diff(owner) >= 0)  # each block a contiguous range


def test_a_chain_gives_the_same_numbers_on_one_or_two_threads():
    from dynamics.reduced import simulate_reduced
    from dynamics.setup.config import RunConfig

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here")
    config = RunConfig(instance={"activation": "relu", "k": 3, "d": 200, "xi": 1.0, "seed": 1},
                       eta=0.5 / 200, steps=400, runs=9, seed=4, checkpoints=5,
                       engine="reduced", finite_d_theory=False).validate()
    before = numba.get_num_threads()
    out = []
    for n in (1, 2):
        numba.set_num_threads(n)
        try:
            out.append(simulate_reduced(config, backend="numba").overlap)
        finally:
            numba.set_num_threads(before)
    np.testing.assert_array_equal(out[0], out[1])
