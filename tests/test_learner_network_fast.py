"""The compiled chunk steps of the O(k′d) learners (``network_kernel``) and the counter streams.

The fast path (``step_chunk_`` through numba) must equal the plain torch path
(``step_prepared_`` step by step, ``learner.fast = False``) number for number up to rounding on
the same examples; the counter streams (other numbers, same law) are checked by two-sample KS
tests against the default streams. Step sizes are small enough that the dynamics do not
amplify rounding (at η·d ≳ 1 two float64 paths drift apart exponentially, like any two
roundings of a chaotic map).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from scipy import stats

from dynamics.activations import activation_from_callable, torch_activation
from dynamics.engines.engine import FullRun
from dynamics.learners.base import Learner
from dynamics.randomness.counter_stream import fill_normals
from dynamics.randomness.sampling import NoiseSource, NoiseStreams, counter_keys
from dynamics.setup.config import ConfigError, RunConfig
from hermite.activations_numba import compiled_activation

SPEC = {"activation": "tanh", "k": 3, "d": 40, "xi": 1.3, "W": "separated", "c": "gaussian",
        "lam": "random_sign", "u_alpha": 0.3, "seed": 4}
RTOL = 1e-10


def _run(fast: bool, learner="scratch", spec=None, **kw):
    opts = dict(instance=dict(spec or SPEC), learner=learner, eta=0.01, steps=600, runs=3,
                checkpoints=4, seed=3, finite_d_theory=False)
    opts.update(kw)
    run = FullRun(RunConfig(**opts).validate())
    run.learner.fast = fast
    return run, run.run()


def _close(a, b, rtol=RTOL):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    scale = max(float(np.nanmax(np.abs(b))), 1e-300)
    err = float(np.nanmax(np.abs(a - b)))
    assert err <= rtol * scale, f"max error {err:.3g} vs scale {scale:.3g}"
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))


NETWORK_CASES = {
    "scratch": dict(),
    "scratch relu": dict(spec=SPEC | {"activation": "relu"}),
    "scratch he3": dict(spec=SPEC | {"activation": "he3"}, eta=0.002),
    "scratch erf": dict(spec=SPEC | {"activation": "erf"}),
    "scratch-csq": dict(learner="scratch-csq"),
    "sparse": dict(learner="sparse"),
    "sparse random rows": dict(learner="sparse", sparse_rows=2, sparse_select="random"),
    "trained λ̂, k′ ≠ k": dict(width=5, train_second_layer=True, eta_c=0.03),
    "mini-batch": dict(batch=4),
    "sparse mini-batch": dict(learner="sparse", batch=3),
    "label noise, b > 1, trained λ̂": dict(label_noise=0.3, batch=3, width=4,
                                          train_second_layer=True, eta_c=0.02),
    "csq label noise": dict(learner="scratch-csq", label_noise=0.5),
    "per-run instances": dict(instance_seeds="per_run"),
    "k = 9 (rows four at a time)": dict(spec=SPEC | {"k": 9}, eta=0.004),
}


@pytest.mark.parametrize("case", sorted(NETWORK_CASES))
def test_network_fast_path_equals_plain_path(case):
    """Same examples, same update: final rows, λ̂ and every checkpoint record to 1e-10."""
    kw = NETWORK_CASES[case]
    plain, tp = _run(False, **kw)
    fast, tf = _run(True, **kw)
    assert fast.state.step == plain.state.step == 600
    _close(fast.state.rows, plain.state.rows)
    _close(fast.state.lam_hat, plain.state.lam_hat)
    for name in ("cross", "gram", "lam_hat"):
        _close(fast.records.arrays()[name], plain.records.arrays()[name])
    _close(tf.loss, tp.loss)
    _close(tf.overlap, tp.overlap)
    assert fast.learner.fast and compiled_activation(fast.problem.activation) is not None
    assert np.abs(tp.loss[:, -1] - tp.loss[:, 0]).max() > 1e-3  # the runs moved


def test_compiled_activations_only():
    """Registry σ run compiled; a user's numpy σ (even under a registry name) does not."""
    for name in ("relu", "tanh", "erf", "sigmoid", "abs", "quadratic", "linear", "he3", "he6"):
        assert compiled_activation(torch_activation(name)) is not None, name
    user = activation_from_callable(np.tanh, name="tanh")
    assert compiled_activation(torch_activation(user)) is None


def test_network_fast_path_float32():
    plain, _ = _run(False, dtype="float32", steps=200)
    fast, _ = _run(True, dtype="float32", steps=200)
    _close(fast.state.rows, plain.state.rows, 1e-4)


def test_sparse_frozen_rows_bit_for_bit():
    run, _ = _run(True, learner="sparse", spec=SPEC | {"k": 4, "d": 20, "activation": "relu"},
                  sparse_rows=2, sparse_select="random", eta=0.02, steps=700)
    start = FullRun(run.config).state.rows
    moving = run.learner.mask
    assert torch.equal(run.state.rows[~moving], start[~moving])
    assert float((run.state.rows[moving] - start[moving]).abs().amax()) > 1e-3


def test_network_divergence_detected_at_the_same_step():
    """A trained second layer with a huge η_c blows up: both paths see the same first bad
    step (the health value), restore the run and freeze it; the healthy run is unaffected."""
    kw = dict(width=4, train_second_layer=True, eta_c=40.0, eta=0.01, steps=300, runs=2,
              spec=SPEC | {"activation": "quadratic"})
    plain, tp = _run(False, **kw)
    fast, tf = _run(True, **kw)
    assert tp.diverged.any()
    np.testing.assert_array_equal(fast.divergence.step, plain.divergence.step)
    _close(tf.loss, tp.loss)


@pytest.mark.parametrize("learner", ["scratch", "linearized"])
def test_bad_runs_equals_the_element_mask(learner):
    """The learners' one-reduction bad_runs flags exactly the runs with a non-finite entry."""
    kw = dict(full_rank=True) if learner == "linearized" else dict(width=4,
                                                                   train_second_layer=True)
    run, _ = _run(True, learner=learner, runs=6, steps=20, **kw)
    state, lrn = run.state, run.learner
    tensors = state.tensors()  # rows / Δ first; λ̂ for scratch
    tensors[0][1].view(-1)[-1] = float("nan")
    tensors[0][4].view(-1)[0] = -float("inf")
    tensors[-1][2].view(-1)[-1] = float("inf")  # λ̂ (scratch) or Δ again
    expect = Learner.bad_runs(lrn, state)
    assert expect.any() and not expect.all()
    assert torch.equal(lrn.bad_runs(state), expect)


LINEAR_CASES = {
    "projected": dict(),
    "unprojected": dict(project=False),
    "prox": dict(prox=0.05),
    "b > 1, unprojected, prox, label noise": dict(batch=3, project=False, prox=0.02,
                                                  label_noise=0.3),
    "per-run W": dict(instance_seeds="per_run", project=False),
    "k = 9 (rows four at a time)": dict(spec=SPEC | {"k": 9}),
    "k = 9 unprojected, prox": dict(spec=SPEC | {"k": 9}, project=False, prox=0.05),
}


@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_linearized_full_rank_fast_path_equals_plain_path(case):
    kw = dict(learner="linearized", full_rank=True, eval_size=2000) | LINEAR_CASES[case]
    plain, tp = _run(False, **kw)
    fast, tf = _run(True, **kw)
    _close(fast.state.delta, plain.state.delta)
    _close(tf.loss, tp.loss)
    _close(tf.extra["loss_linear"], tp.extra["loss_linear"])


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
@pytest.mark.parametrize("learner", ["scratch", "linearized"])
def test_parallel_runs_equal_serial_runs(learner):
    """Runs in blocks over numba's threads give the one-thread numbers bit for bit."""
    kw = dict(full_rank=True, eval_size=500) if learner == "linearized" else {}
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one, _ = _run(True, learner=learner, runs=5, steps=300, **kw)
        numba.set_num_threads(2)
        two, _ = _run(True, learner=learner, runs=5, steps=300, **kw)
    finally:
        numba.set_num_threads(before)
    for a, b in zip(one.state.tensors(), two.state.tensors(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- counter streams
def test_counter_normals_law_and_chunking():
    keys = counter_keys(7, 2)
    n = 2_000_000
    out = np.empty((2, n))
    fill_normals(out, n, keys, 0, range(2))
    for z in out:
        assert stats.kstest(z, "norm").pvalue > 1e-3
        assert abs(z.mean()) < 5 / np.sqrt(n) and abs(z.var() - 1) < 5 * np.sqrt(2 / n)
        for t in (2.0, 3.0, 3.5):  # the ziggurat's tail and wedges
            p = 2 * stats.norm.sf(t)
            assert abs((np.abs(z) > t).mean() - p) < 5 * np.sqrt(p / n)
    assert abs(np.corrcoef(out[0], out[1])[0, 1]) < 5 / np.sqrt(n)
    assert abs(np.corrcoef(out[0, 1:], out[0, :-1])[0, 1]) < 5 / np.sqrt(n)
    # number m depends on (key, m) only: any split of the stream gives the same numbers
    whole = np.empty((1, 1000))
    fill_normals(whole, 1000, keys, 0, range(1))
    parts = np.empty((1, 1000))
    fill_normals(parts, 400, keys, 0, range(1))
    rest = np.empty((1, 600))
    fill_normals(rest, 600, keys, 400, range(1))
    parts[0, 400:] = rest[0]
    np.testing.assert_array_equal(whole, parts)
    single = np.empty((1, 1000), dtype=np.float32)
    fill_normals(single, 1000, keys, 0, range(1))
    np.testing.assert_allclose(single[0], whole[0], rtol=1e-6)


def test_counter_stream_is_pinned():
    """The stream's definition (key, SplitMix64, ZIGNOR tables) fixes its numbers: a change
    of any of them changes every run's examples, so it is pinned here."""
    out = np.empty((2, 1000))
    fill_normals(out, 1000, counter_keys(0, 2), 10**9, range(2))
    np.testing.assert_allclose(out[0, :3], [-0.6012457159750316, 1.1223960071918904,
                                            0.5215701722145402], rtol=1e-14)
    np.testing.assert_allclose(out[1, -3:], [-1.4598374583643996, -0.027182399038788354,
                                             -0.5710441881142841], rtol=1e-14)


def test_counter_streams_in_the_engine():
    """Run r's examples depend on (seed, r) only: not on R, the chunk length or threads."""
    kw = dict(d=24, device=torch.device("cpu"), dtype=torch.float64)
    counter = NoiseStreams(5, "counter")
    with NoiseSource(counter, 3, 2, threads=2, chunk_steps=7, **kw) as a, \
            NoiseSource(counter, 1, 2, threads=1, chunk_steps=5, **kw) as b:
        xa = torch.cat([x[0, :, :, :24].clone() for x, _ in a.chunks([7, 7, 6])])
        xb = torch.cat([x[0, :, :, :24].clone() for x, _ in b.chunks([5, 5, 5, 5])])
    assert torch.equal(xa, xb)
    three, _ = _run(True, streams="counter", runs=3, steps=200)
    one, _ = _run(True, streams="counter", runs=1, steps=200)
    assert torch.equal(three.state.rows[:1], one.state.rows)
    other, _ = _run(True, streams="per_run", runs=1, steps=200)
    assert not torch.equal(other.state.rows, one.state.rows)
    with pytest.raises(ValueError, match="CPU only"):
        NoiseSource(NoiseStreams(0, "counter"), 1, 1, 8, device=torch.device("meta"),
                    dtype=torch.float64)
    with pytest.raises(ConfigError, match="CPU only"):
        RunConfig(instance=dict(SPEC), learner="scratch", streams="counter",
                  device="cuda").validate()


@pytest.mark.slow
def test_counter_streams_same_law_ks():
    """Two-sample KS, 400 runs each: final loss and alignment of scratch, the fast path on
    counter streams against the plain path on the default streams (different numbers, same
    law); the same test tells a 30% larger step size apart."""
    spec = {"activation": "relu", "k": 2, "d": 20, "xi": 1.0, "seed": 1}
    kw = dict(spec=spec, runs=400, steps=1000, eta=0.05, checkpoints=2)
    _, ref = _run(False, **kw)
    _, new = _run(True, streams="counter", seed=11, **kw)
    _, off = _run(True, streams="counter", seed=12, **(kw | {"eta": 0.065}))
    for field in ("loss", "overlap"):
        a, b, c = (getattr(t, field)[:, -1] for t in (ref, new, off))
        assert stats.ks_2samp(a, b).pvalue > 1e-3, field
        assert stats.ks_2samp(a, c).pvalue < 1e-6, field  # the test has power
