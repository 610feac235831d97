"""The linearized learner's exact theory beside its runs (issue 25, item 4): the recorded
mean ODE and floors are those of :mod:`hermite.flows.linearized` for each run's start, they are
labelled, the full-rank mean ODE tracks the SGD mean, and ``loradyn plot`` draws them."""

from __future__ import annotations

import numpy as np
import pytest

from dynamics.engines.engine import simulate
from dynamics.setup.config import RunConfig
from hermite.flows.linearized import linear_model_floor, linear_model_ode, linear_model_rank1_ode

SPEC = dict(activation="relu", k=2, d=40, xi=1.4, seed=3)


def _run(**kw):
    config = RunConfig(SPEC, learner="linearized", eta=0.01, steps=1500, runs=64,
                       checkpoints=8, seed=1, **kw)
    return config, simulate(config)


def test_full_rank_records_the_exact_mean_and_floor():
    config, traj = _run(full_rank=True)
    inst = traj.instances[0]
    mean = linear_model_ode(inst, None, config.eta, traj.steps, project=True)
    np.testing.assert_allclose(traj.extra["ode_loss_linear"][0], mean.loss_linear, rtol=1e-12)
    np.testing.assert_allclose(traj.extra["ode_loss_true"][5], mean.loss_true, rtol=1e-12)
    floor = linear_model_floor(inst, rank="full", project=True)
    assert np.all(traj.extra["floor_linear"] == floor.loss_linear)
    assert np.all(traj.extra["floor_true"] == floor.loss_true)
    assert "exact mean" in traj.extra_attrs["ode_loss_linear"]["note"]
    # the SGD mean of the linear loss sits above L(E Δ) (Jensen: L is convex; the gap is the
    # SGD noise tr(A Cov Δ), large at η·d = 0.4; both losses exact)
    sgd = traj.extra["loss_linear"].mean(0)
    se = traj.extra["loss_linear"].std(0) / np.sqrt(traj.runs)
    assert sgd[0] == pytest.approx(mean.loss_linear[0], rel=1e-12)  # Δ = 0 for both
    assert np.all(sgd[1:] - mean.loss_linear[1:] > -4 * se[1:])
    assert floor.loss_linear <= mean.loss_linear[-1] + 1e-12


def test_rank_one_records_the_mean_drift_ode_from_each_start():
    config, traj = _run(joint_c=True)
    inst = traj.instances[0]
    runs = [0, 7]
    coords = None  # the ODE starts from each run's own û₀ (its reduced coordinates)
    from dynamics.engines.engine import FullRun

    run = FullRun(config)
    from dynamics.measures.observables import reduced_coordinates

    coords = reduced_coordinates(run.state.u_hat, inst.k)[runs]
    ode = linear_model_rank1_ode(inst, coords, config.eta, traj.steps, c0=inst.c_hat,
                                 joint_c=True)
    np.testing.assert_allclose(traj.ode[runs], ode.overlap, rtol=1e-5, atol=1e-6)
    assert "first order in η" in traj.extra_attrs["ode_loss_linear"]["note"]
    floor = linear_model_floor(inst, rank=1, joint_c=True)
    assert traj.extra["floor_linear"][0, 0] == pytest.approx(floor.loss_linear, rel=1e-12)


def test_plot_draws_the_linear_theory(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from sims.io.trajectory import write_trajectory
    from sims.plots.curves import load_curves, plot_curves

    config, traj = _run(full_rank=True)
    path = write_trajectory(tmp_path / "lin.h5", traj, config)
    from sims.io.trajectory import read_trajectory

    back, _ = read_trajectory(path)  # the notes come back with the datasets
    assert back.extra_attrs["ode_loss_linear"]["note"] == traj.extra_attrs[
        "ode_loss_linear"]["note"]
    fig = plot_curves(load_curves([path]), "loss_linear")
    labels = [t.get_text() for ax in fig.axes if ax.get_legend()
              for t in ax.get_legend().get_texts()]
    assert any("floor" in t for t in labels) and any("mean ODE" in t for t in labels)
