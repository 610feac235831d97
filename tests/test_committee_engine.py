"""The committee-machine ODE beside the network learners' curves (issue 17, part 3): recorded
from each run's own start, tracking the SGD mean at large d, drawn dashed, and alone from
the CLI (``loradyn hermite committee``)."""

import json

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from dynamics.engines.engine import simulate
from dynamics.setup.config import RunConfig
from sims.cli import cli
from sims.io.trajectory import write_trajectory

SPEC = {"activation": "erf", "k": 2, "d": 60, "xi": 1.0, "seed": 1}


def _run(learner, spec=SPEC, **kw):
    kw = {"eta": 0.3 / spec["d"], "steps": 300, "runs": 4, "checkpoints": 8, **kw}
    config = RunConfig(instance=spec, learner=learner, **kw).validate()
    return config, simulate(config)


@pytest.mark.parametrize("learner, kw", [
    ("scratch", {}), ("scratch-csq", {}), ("sparse", {"sparse_rows": 1}),
    ("scratch", {"train_second_layer": True, "width": 3, "label_noise": 0.1, "batch": 2}),
])
def test_ode_starts_at_the_runs_own_loss_and_alignment(learner, kw):
    _, traj = _run(learner, **kw)
    ode_loss, ode_align = traj.extra["ode_loss"], traj.extra["ode_alignment"]
    assert ode_loss.shape == traj.loss.shape and np.isfinite(ode_loss).all()
    np.testing.assert_allclose(ode_loss[:, 0], traj.loss[:, 0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(ode_align[:, 0], traj.extra["alignment"][:, 0], rtol=0,
                               atol=1e-12)
    assert traj.extra_attrs["ode_loss"]["order"] == 2  # erf: closed-form η² terms
    assert (np.diff(ode_loss[0]) != 0).any()  # and it moves


def test_relu_with_many_fields_is_first_order_and_the_switch_turns_it_off(capsys):
    """ReLU, K + M = 8: the ODE's η² terms would need a 4-D quadrature, so at small η·d the
    ODE is first order (and says so); at η·d = 0.3 the diffusion samples them (order 2)."""
    spec = dict(SPEC, activation="relu", k=4)
    _, noisy = _run("scratch", spec=spec, steps=1000)
    assert noisy.extra_attrs["ode_loss"]["integrator"] == "diffusion"
    assert noisy.extra_attrs["ode_loss"]["order"] == 2
    capsys.readouterr()
    _, traj = _run("scratch", spec=spec, steps=1000, eta=0.05 / spec["d"])
    assert traj.extra_attrs["ode_loss"]["order"] == 1
    assert "K + M = 8" in traj.extra_attrs["ode_loss"]["order_reason"]
    err = capsys.readouterr().err
    assert err.count("first order") == 1 and len(err.strip().splitlines()) == 1
    _, off = _run("scratch", finite_d_theory=False)
    assert "ode_loss" not in off.extra and "alignment" in off.extra


def test_sparse_runs_with_one_start_share_one_ode(tmp_path):
    config, traj = _run("sparse", runs=3)
    assert traj.extra_attrs["ode_loss"]["distinct_odes"] == 1
    assert np.all(traj.extra["ode_loss"] == traj.extra["ode_loss"][:1])
    path = write_trajectory(tmp_path / "t.h5", traj, config, config.run_instances())
    with h5py.File(path) as f:
        assert f["extra/ode_loss"].attrs["order"] == 2
        assert f["extra/ode_alignment"].attrs["integrator"] == "map"  # 300 steps: the map


def test_sgd_mean_tracks_the_ode_and_the_gap_shrinks_with_d():
    """k = 2 erf, η·d = 0.5 to α = 4, 40 runs per d: SGD − ODE per run (paired), its mean
    within 4 standard errors at every checkpoint and its RMS falling as d doubles."""
    rms = []
    for d in (200, 400, 800):
        spec = {"activation": "erf", "k": 2, "d": d, "xi": 0.0, "seed": 1}
        _, traj = _run("scratch", spec=spec, eta=0.5 / d, steps=4 * d, runs=40,
                       checkpoints=6, spacing="linear", seed=3)
        diff = (traj.loss - traj.extra["ode_loss"])[:, 1:]
        se = diff.std(0, ddof=1) / np.sqrt(diff.shape[0])
        z = diff.mean(0) / se
        assert np.all(np.abs(z) < 4.0), (d, z)
        rms.append(float(np.sqrt((diff ** 2).mean())))
    assert rms[0] > rms[1] > rms[2], rms
    assert rms[2] < 0.7 * rms[0], rms


def test_plot_draws_the_ode_dashed(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sims.plots.curves import load_curves, plot_curves

    config, traj = _run("scratch")
    path = write_trajectory(tmp_path / "s.h5", traj, config, config.run_instances())
    for quantity, name in (("loss", "ode_loss"), ("alignment", "ode_alignment")):
        fig = plot_curves(load_curves([path]), quantity=quantity, xscale="linear")
        ax = fig.axes[0]
        (dashed,) = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        np.testing.assert_allclose(dashed.get_ydata(), np.median(traj.extra[name], axis=0))
        assert "committee-machine ODE / diffusion (median)" in [t.get_text()
                                                    for t in ax.get_legend().get_texts()]
        plt.close(fig)


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(SPEC))
    return str(path)


def test_cli_json_matches_the_recorded_ode_of_run_0(spec_file):
    _, traj = _run("scratch", runs=1, seed=5, steps=300, checkpoints=8)
    res = CliRunner().invoke(cli, ["hermite", "committee", spec_file, "--eta", str(0.3 / 60),
                                   "--steps", "300", "--seed", "5", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["order"] == 2 and out["integrator"] == "map" and out["steps"][0] == 0
    assert out["loss"][0] == pytest.approx(traj.loss[0, 0], abs=1e-12)
    assert out["alignment"][0] == pytest.approx(traj.extra["alignment"][0, 0], abs=1e-12)
    assert out["loss"][-1] == pytest.approx(traj.extra["ode_loss"][0, -1], rel=1e-9)
    res = CliRunner().invoke(cli, ["hermite", "committee", spec_file, "--eta", "0.005",
                                   "--steps", "500", "--learner", "sparse", "--init-overlap",
                                   "0.3", "--checkpoints", "4"])
    assert res.exit_code == 0, res.output
    assert "alignment" in res.output and len(res.output.splitlines()) >= 5


def test_cli_noise_paths_integrates_the_diffusion(spec_file):
    """--noise-paths: the diffusion's mean over the paths from run 0's start (its loss at
    step 0 is the start's), with a standard error that grows from 0, and the same numbers
    as hermite.committee.diffusion called with the same seed."""
    from dynamics.overlays.committee import committee_model, committee_state
    from hermite.committee.diffusion import committee_diffusion
    from sims.commands.hermite import _committee_start

    args = ["hermite", "committee", spec_file, "--eta", str(0.3 / 60), "--steps", "1200",
            "--seed", "5", "--checkpoints", "6", "--json"]
    ode = json.loads(CliRunner().invoke(cli, args).output)
    res = CliRunner().invoke(cli, [*args, "--noise-paths", "16"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["integrator"] == "diffusion" and out["paths"] == 16
    assert out["loss"][0] == pytest.approx(ode["loss"][0], abs=1e-12)
    assert out["loss_se"][0] < 1e-12 and all(se > 1e-6 for se in out["loss_se"][1:])
    config = RunConfig(instance=SPEC, learner="scratch", eta=0.3 / 60, steps=1200, runs=1,
                       seed=5).validate()
    cross, gram, lam_hat, _ = _committee_start(config, None)
    start = committee_state(cross, gram, lam_hat)
    model = committee_model(config.run_instances()[0], loss="squared", eta=0.3 / 60)
    ck = np.asarray(out["steps"])
    tr = committee_diffusion(model, [start], ck / 60, 60.0, paths=16, seed=5)
    np.testing.assert_allclose(out["loss"], tr.loss[0], rtol=1e-12)
    human = CliRunner().invoke(cli, args[:-1] + ["--noise-paths", "16"]).output
    assert human.startswith("committee diffusion, mean of 16 paths")


@pytest.mark.parametrize("args, code, message", [
    (["--eta", "-1", "--steps", "10"], 2, "--eta"),
    (["--eta", "0.01", "--steps", "10", "--init-overlap", "2"], 1, "--init-overlap 2"),
    (["--eta", "0.01", "--steps", "10", "--learner", "sparse", "--width", "3"], 1,
     "--width is not an option of learner 'sparse'"),
    (["--eta", "0.01", "--steps", "10", "--width", "0"], 2, "--width"),
    (["--eta", "0.01", "--steps", "10", "--learner", "glm"], 2, "--learner"),
])
def test_cli_bad_input_is_a_one_line_error(spec_file, args, code, message):
    res = CliRunner().invoke(cli, ["hermite", "committee", spec_file, *args])
    assert res.exit_code == code, res.output
    assert isinstance(res.exception, SystemExit)
    lines = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1 and message in lines[0], res.output
