"""Reduced engine: outputs, invariants, determinism, thread count, initial law, divergence."""

import numba
import numpy as np
import pytest
from scipy import stats

import hermite
from dynamics.engines.engine import simulate
from dynamics.reduced import (
    first_passage_reduced,
    first_passages_reduced,
    reduced_supported,
    simulate_reduced,
)
from dynamics.setup.config import RunConfig


def _config(**kw):
    base = dict(instance=dict(activation="relu", k=8, d=200, xi=1.0, seed=3), eta=1.0 / 200,
                steps=300, runs=64, seed=4, checkpoints=8, engine="reduced")
    base.update(kw)
    return RunConfig(**base)


def test_trajectory_fields_and_dispatch():
    config = _config(joint_c=True, instance_seeds="per_run", xi_values=[0.5, 2.0])
    tr = simulate(config)  # the full engine's entry point dispatches to us
    assert tr.engine == "reduced" and tr.dtype == "float64" and tr.device == "cpu"
    runs, cps = config.runs, len(tr.steps)
    for name in ("overlap", "loss", "ode", "c_overlap"):
        assert getattr(tr, name).shape == (runs, cps)
    assert tr.steps[0] == 0 and tr.steps[-1] == config.steps
    np.testing.assert_array_equal(tr.xi, np.repeat([0.5, 2.0], runs // 2))
    np.testing.assert_array_equal(tr.instance_seed, 3 + np.arange(runs))
    np.testing.assert_allclose(tr.overlap[:, 0], tr.m0)
    assert np.isfinite(tr.ode).all()  # joint ĉ: the plain O(η) ODE of fine-tuning
    assert np.isfinite(tr.loss).all() and tr.loss_kind == "exact"
    assert np.all(np.abs(tr.c_overlap) <= 1 + 1e-12)


def test_auto_engine_picks_reduced_and_unknown_learner_is_refused():
    assert simulate(_config(engine="auto", steps=5)).engine == "reduced"
    bad = _config()
    bad.learner = "moment"
    ok, why = reduced_supported(bad)
    assert not ok and "moment" in why
    with pytest.raises(ValueError):
        simulate_reduced(bad)


@pytest.mark.parametrize("project,joint", [(True, False), (False, True)])
def test_overlap_bounded_and_deterministic(project, joint):
    config = _config(project=project, joint_c=joint, eta=20.0 / 200, eval_size=64)
    a, b = simulate_reduced(config), simulate_reduced(config)
    ok = np.isfinite(a.overlap)
    assert np.all(np.abs(a.overlap[ok]) <= 1 + 1e-12)
    np.testing.assert_array_equal(a.overlap, b.overlap)
    np.testing.assert_array_equal(a.loss, b.loss)
    c = simulate_reduced(_config(project=project, joint_c=joint, eta=20.0 / 200, seed=5,
                                 eval_size=64))
    assert not np.array_equal(a.overlap[:, -1], c.overlap[:, -1])


def test_independent_of_thread_count():
    config = _config(project=False, joint_c=True, eval_size=64)
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = simulate_reduced(config)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = simulate_reduced(config)
    finally:
        numba.set_num_threads(old)
    np.testing.assert_array_equal(one.overlap, many.overlap)
    np.testing.assert_array_equal(one.c_overlap, many.c_overlap)


def test_initial_law_is_uniform_on_the_sphere_of_span_w_perp():
    """m₀ = u⊥μ₀ with μ₀² ~ Beta(1/2, (n−1)/2), n = d − k, symmetric sign."""
    d, k = 30, 8
    config = _config(instance=dict(activation="relu", k=k, d=d, xi=1.0, seed=3, u_alpha=0.4),
                     runs=4000, steps=1, checkpoints=2)
    tr = simulate_reduced(config)
    mu0 = tr.m0 / np.sqrt(1 - 0.4**2)
    assert stats.kstest(mu0**2, stats.beta(0.5, (d - k - 1) / 2).cdf).pvalue > 1e-3
    assert stats.binomtest(int((mu0 > 0).sum()), mu0.size).pvalue > 1e-3


def test_aligned_init_has_positive_drift():
    config = _config(init="aligned", runs=256, steps=1, checkpoints=2)
    tr = simulate_reduced(config)
    inst = config.run_instances()[0]
    sign = np.sign(hermite.h(inst, 0.0))
    assert np.all(tr.m0 * sign > 0)


def test_divergence_is_marked_and_frozen():
    """η = 1e160 overflows the normaliser of every run with ξ = 1 (ξ = 0 runs never move):
    they are marked at that step and read NaN from then on; the others go on."""
    config = _config(eta=1e160, xi_values=[0.0, 1.0], runs=32, steps=50, checkpoints=20,
                     spacing="linear")
    for backend in ("numba", "torch"):
        tr = simulate_reduced(config, backend=backend)
        dead = tr.diverged_step >= 0
        np.testing.assert_array_equal(dead, tr.xi > 0)
        for r in np.flatnonzero(dead):
            after = tr.steps >= tr.diverged_step[r]
            assert np.isnan(tr.overlap[r, after]).all()
            assert np.isfinite(tr.overlap[r, ~after]).all()
        np.testing.assert_allclose(tr.overlap[~dead], tr.overlap[~dead, :1] + 0 * tr.steps,
                                   rtol=0, atol=1e-15)


def test_first_passage_matches_the_trajectory():
    """Early stop replays the same streams: the hitting step equals the recorded one."""
    config = _config(runs=32, steps=600, checkpoints=601, spacing="linear", init="aligned")
    tr = simulate_reduced(config)
    level = 0.3
    want = np.abs(tr.overlap) >= level
    expect = np.where(want.any(1), tr.steps[np.argmax(want, 1)].astype(float), np.nan)
    got = first_passage_reduced(config, level)
    np.testing.assert_array_equal(got, expect)
    assert np.isfinite(got).mean() > 0.5
    other = first_passage_reduced(config, level, backend="torch")  # same law, other numbers
    assert np.isfinite(other).mean() > 0.5
    assert abs(np.nanmedian(other) - np.nanmedian(got)) < 0.3 * np.nanmedian(got)


@pytest.mark.parametrize("opts", [
    dict(),
    dict(joint_c=True, instance_seeds="per_run", xi_values=[0.5, 2.0]),
    dict(project=False, joint_c=True, batch=3, label_noise=0.1,
         instance=dict(activation="tanh", k=5, d=60, xi=1.0, seed=2, u_alpha=0.3)),
], ids=["frozen", "joint-per-run-xi", "unprojected-batch"])
def test_first_passages_of_several_levels_in_one_pass_equal_separate_passes(opts):
    """Resuming each run after its hit of a level (its chain and stream state) gives exactly
    the hitting times of separate passes, in any level order, with runs that start above a
    level (0) and runs that never reach one within the horizon (NaN)."""
    config = _config(runs=24, steps=900, init="uniform", **opts)
    levels = [0.6, 0.05, 0.3, 0.85]
    got = first_passages_reduced(config, levels)
    for level, row in zip(levels, got, strict=True):
        np.testing.assert_array_equal(row, first_passage_reduced(config, level))
    assert (got[1] == 0).any() or (got[1] < got[2]).all()
    assert np.isfinite(got[2]).mean() > 0.3
    short = first_passages_reduced(config, levels, max_steps=150)
    for level, row in zip(levels, short, strict=True):
        np.testing.assert_array_equal(row, first_passage_reduced(config, level, max_steps=150))
    with pytest.raises(ValueError, match="levels must be finite"):
        first_passages_reduced(config, [0.5, float("nan")])


def test_torch_backend_float32():
    config = _config(dtype="float32", joint_c=True)
    tr = simulate_reduced(config, backend="torch")
    assert tr.dtype == "float32" and np.isfinite(tr.overlap).all()
    ref = simulate_reduced(config)
    assert abs(tr.overlap[:, -1].mean() - ref.overlap[:, -1].mean()) < 0.1
