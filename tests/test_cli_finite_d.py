"""Issue 8 wiring: `loradyn hermite ode --corrected/--target-eps` and the recorded theory."""

import json

import numpy as np
from click.testing import CliRunner

from sims.cli import cli
from sims.io.trajectory import read_trajectory

SPEC = {"activation": "relu", "k": 5, "d": 200, "xi": 1.0, "W": "orthonormal", "seed": 1}


def _spec(tmp_path, **over):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**SPEC, **over}))
    return str(path)


def test_hermite_ode_corrected_and_step_size(tmp_path):
    args = ["hermite", "ode", _spec(tmp_path), "--eta", "1e-3", "--steps", "20000",
            "--checkpoints", "8", "--corrected", "--target-eps", "0.1", "--json"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    corr = out["corrected"]
    plain_end, corr_end = out["m"][0][-1], corr["m"][0][-1]
    # the renormalisation noise pulls the finite-d curve below the plain ODE, onto its floor
    assert 0.9 < corr["noise_floor"] < 0.99 and plain_end > corr_end
    assert abs(corr_end - corr["noise_floor"]) < 1e-3
    lo, hi = np.array(corr["band_lower"]), np.array(corr["band_upper"])
    assert np.all(lo <= hi) and lo[-1] < corr_end < hi[-1]
    assert corr["steps_to_reach"]["0.5"][0] > out["steps_to_reach_discrete"]["0.5"][0]
    step = out["step_size"]
    assert step["eta_max"] > step["eta_theorem"] > 0 and step["theorem"] == "11"


def test_hermite_ode_corrected_bad_inputs(tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["hermite", "ode", _spec(tmp_path), "--eta", "1e-3",
                              "--target-eps", "1.5"])
    assert res.exit_code != 0 and "--target-eps" in res.output
    nod = tmp_path / "nod.json"
    nod.write_text(json.dumps({k: v for k, v in SPEC.items() if k != "d"}))
    res = runner.invoke(cli, ["hermite", "ode", str(nod), "--eta", "1e-3", "--corrected"])
    assert res.exit_code == 1 and "need key 'd'" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_run_records_corrected_ode_and_band(tmp_path):
    out = tmp_path / "r.h5"
    res = CliRunner().invoke(cli, ["run", _spec(tmp_path), "--eta", "1e-3", "--steps", "3000",
                                   "--runs", "16", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    traj, _ = read_trajectory(out)
    assert traj.ode_corrected.shape == traj.overlap.shape
    assert np.all(traj.band_lower <= traj.band_upper)
    assert "ode_corrected" in json.loads(res.output)
    # joint ĉ: the corrected ODE of hermite.finetune.population and its joint band
    res = CliRunner().invoke(cli, ["run", _spec(tmp_path), "--eta", "1e-3", "--steps", "100",
                                   "--runs", "2", "--joint-c", "--out", str(out),
                                   "--force"])  # replacing an existing file needs --force
    assert res.exit_code == 0, res.output
    traj = read_trajectory(out)[0]
    assert np.isfinite(traj.ode_corrected).all() and np.all(traj.band_lower <= traj.band_upper)
    assert "joint_band" in traj.extra_attrs["band_lower"]["note"]
    # not recorded where finite-d theory is off
    res = CliRunner().invoke(cli, ["run", _spec(tmp_path), "--eta", "1e-3", "--steps", "100",
                                   "--runs", "2", "--joint-c", "--no-finite-d-theory",
                                   "--out", str(out), "--force"])
    assert res.exit_code == 0, res.output
    assert read_trajectory(out)[0].ode_corrected is None
