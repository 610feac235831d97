"""benchmarks/network_chain.py's floor (the variates and σ evaluations of a chain step, no
rows): it must draw exactly what the chain draws, or it bounds nothing."""

from __future__ import annotations

import os
import runpy
import sys
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def u64(x):
    """A stream state as np.uint64 (numba may hand a uint64 back as a signed int)."""
    return np.uint64(int(x) % 2**64)


@pytest.fixture(scope="module")
def bench():
    with mock.patch.dict(os.environ), mock.patch.object(sys, "path", list(sys.path)):
        return types.SimpleNamespace(**runpy.run_path(str(BENCH / "network_chain.py"),
                                                      run_name="network_chain"))


@pytest.mark.parametrize("width", [2, 5])
def test_floor_draws_what_the_chain_draws(bench, width):
    """After n steps (compressions included: the width cycles k′ … 2k′) the floor's stream is
    the chain's: the same normals and χ² draws, in the same order."""
    from dynamics.randomness.sampling import run_seed
    from dynamics.reduced.network_simulate import ChainStart, NetworkChain

    config = bench.committee_config(60, width, 10)
    stream = np.uint64(run_seed(config.seed, 0, "data"))
    for n in (1, 7, 100):
        start = ChainStart(config, config.run_instances())
        runs, _ = NetworkChain()._advance(start, np.zeros(1, np.int64), n)
        assert runs.div_step[0] == -1
        acc, st = bench._floor_steps(n, *bench.floor_args(config, stream))
        assert np.isfinite(acc)
        assert u64(st) == u64(runs.states[0])
    _, st = bench._floor_steps(99, *bench.floor_args(config, stream))
    assert u64(st) != u64(runs.states[0])  # a step fewer draws less: the test has power


def test_least_floor_holds_the_width_at_k_prime(bench):
    """``least``: t + k′ normals and one χ² a step (a stream of exactly that many draws)."""
    from dynamics.reduced import _rng

    config = bench.committee_config(60, 3, 10)
    args = bench.floor_args(config, np.uint64(5), least=True)
    k, kp, t, cap, rest = args[:5]
    assert cap == kp + 1
    _, st = bench._floor_steps(4, *args)
    ref = np.uint64(5)
    for _ in range(4):  # the same primitives called one by one
        for _ in range(t + kp):
            ref = u64(_rng.normal(ref)[1])
        ref = u64(_rng.chi2_prepared(_rng.chi2_prepare(rest - kp), ref)[1])
    assert u64(st) == ref
