"""`loradyn run` and `loradyn show` through click's CliRunner (isolated filesystem)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from dynamics import learners
from sims.cli import cli

FAST = ["--eta", "0.002", "--steps", "300", "--runs", "4", "--checkpoints", "8"]


def _run(runner, *args):
    return runner.invoke(cli, list(args), catch_exceptions=False)


def _error_line(result) -> str:
    text = result.output.strip()
    assert result.exit_code != 0, text
    assert len(text.splitlines()) == 1, text
    return text


def test_run_writes_file_summary_and_plot(runner):
    res = _run(runner, "run", "spec.toml", *FAST, "--out", "r/a.h5", "--plot", "r/a.png")
    assert res.exit_code == 0, res.output
    assert "median overlap at step 300" in res.output and "past 0.9" in res.output
    assert "median steps to 0.5" in res.output
    assert Path("r/a.h5").stat().st_size > 0 and Path("r/a.png").read_bytes()[:4] == b"\x89PNG"


def test_run_json(runner):
    res = _run(runner, "run", "spec.toml", *FAST, "--joint-c", "--out", "a.h5", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert set(data) == {"steps", "overlap_mean", "overlap_std", "ode", "ode_corrected",
                         "loss_kind", "loss_mean", "loss_std", "quantities", "audit"}
    assert data["steps"][0] == 0 and data["steps"][-1] == 300
    # joint ĉ: the plain O(η) ODE of fine-tuning (hermite.finetune.population) and its
    # finite-d corrected form, finite
    assert all(v is not None and math.isfinite(v) for v in data["ode"] + data["ode_corrected"])
    assert len(data["overlap_mean"]) == len(data["steps"])


def test_run_options_reach_the_config(runner):
    args = ["run", "spec.toml", *FAST, "--no-project", "--batch", "2", "--label-noise", "0.1",
            "--init", "aligned", "--spacing", "linear", "--xi", "0.5", "--xi", "2",
            "--instance-seeds", "per_run", "--dtype", "float32", "--seed", "4",
            "--eta-c", "0.01", "--joint-c", "--engine", "full", "--out", "o.h5"]
    assert _run(runner, *args).exit_code == 0
    res = _run(runner, "show", "o.h5", "--json")
    info = json.loads(res.output)
    cfg = info["config"]
    assert (cfg["project"], cfg["batch"], cfg["label_noise"], cfg["init"]) == (False, 2, 0.1,
                                                                              "aligned")
    assert cfg["xi_values"] == [0.5, 2.0] and cfg["instance_seeds"] == "per_run"
    # unprojected: the exact loss from û's reduced coordinates
    # (dynamics.measures.losses.coordinate_loss)
    assert (info["dtype"], info["seed"], info["loss_kind"]) == ("float32", 4, "exact")
    assert cfg["eta_c"] == 0.01 and cfg["joint_c"] is True


def test_default_eta_and_steps(runner):
    res = _run(runner, "run", "spec.toml", "--runs", "2", "--out", "d.h5")
    assert res.exit_code == 0, res.output
    assert "(default)" in res.output and "steps = " in res.output


def test_the_default_engine_is_auto_and_the_summary_names_it(runner):
    """No --engine: the exact chain where the learner has one, the full engine (with the
    reason) where not; the file records the engine that ran."""
    res = _run(runner, "run", "spec.toml", *FAST, "--out", "a.h5")
    assert res.exit_code == 0, res.output
    assert "engine reduced;" in res.output
    assert json.loads(_run(runner, "show", "a.h5", "--json").output)["engine"] == "reduced"
    res = _run(runner, "run", "spec.toml", *FAST, "--learner", "moment", "--out", "m.h5")
    assert res.exit_code == 0, res.output
    assert "engine full (auto: " in res.output and "'moment' has no exact" in res.output
    assert json.loads(_run(runner, "show", "m.h5", "--json").output)["engine"] == "full"


@pytest.mark.parametrize(("args", "message"), [
    (["--eta", "0"], "'eta': must be a finite number > 0"),
    (["--eta", "-1"], "'eta': must be a finite number > 0"),
    (["--steps", "0"], "'steps': must be a positive integer"),
    (["--runs", "0"], "'runs': must be a positive integer"),
    (["--learner", "nope"], "unknown learner 'nope'"),
    (["--out", "spec.toml/x.h5"], "not a directory"),
    (["--out", "."], "is a directory"),
])
def test_bad_inputs_give_one_line_errors(runner, args, message):
    base = {"--eta": "0.002", "--steps": "50", "--runs": "2", "--out": "x.h5"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    flat = [item for pair in base.items() for item in pair]
    res = runner.invoke(cli, ["run", "spec.toml", *flat, *args[len(args):]])
    assert message in _error_line(res)
    assert not Path("x.h5").exists()


@pytest.mark.parametrize(("content", "message"), [
    ('activation = "relu"\nk = 3\nd = 20\nbogus = 1\n', "key 'bogus': unknown key"),
    ('activation = "relu"\nk = [\n', "not valid JSON/TOML"),
    ('activation = "nope"\nk = 3\nd = 20\n', "unknown activation"),
    ('activation = "relu"\nk = 3\n', "'d' is required"),
])
def test_malformed_spec(runner, content, message):
    Path("bad.toml").write_text(content)
    res = runner.invoke(cli, ["run", "bad.toml", *FAST, "--out", "x.h5"])
    assert message in _error_line(res)
    res = runner.invoke(cli, ["run", "missing.toml", *FAST, "--out", "x.h5"])
    assert "instance spec missing.toml: no such file" in _error_line(res)


def test_interrupted_run_keeps_the_old_file(runner, monkeypatch):
    assert _run(runner, "run", "spec.toml", *FAST, "--out", "keep.h5").exit_code == 0
    before = Path("keep.h5").read_bytes()
    original = learners.Finetune.step_prepared_

    def interrupt(self, state, x, pre, i):
        if state.step == 150:
            raise KeyboardInterrupt
        return original(self, state, x, pre, i)

    monkeypatch.setattr(learners.Finetune, "step_prepared_", interrupt)
    res = runner.invoke(cli, ["run", "spec.toml", *FAST, "--seed", "7", "--out", "keep.h5"])
    assert res.exit_code != 0
    assert Path("keep.h5").read_bytes() == before
    assert sorted(os.listdir(".")) == ["keep.h5", "spec.toml"]


def test_all_runs_diverged_exits_nonzero(runner):
    res = runner.invoke(cli, ["run", "spec.toml", "--eta", "1e300", "--steps", "20", "--runs",
                              "3", "--out", "div.h5"])
    assert res.exit_code == 1
    assert "all 3 runs diverged" in res.output.strip().splitlines()[-1]


def test_show_good_truncated_and_foreign_files(runner):
    assert _run(runner, "run", "spec.toml", *FAST, "--out", "g.h5").exit_code == 0
    res = _run(runner, "show", "g.h5")
    assert res.exit_code == 0
    for key in ("format", "git_commit", "dtype", "engine", "loss_kind", "overlap (4, ",
                "median_final_overlap"):
        assert key in res.output
    info = json.loads(_run(runner, "show", "g.h5", "--json").output)
    assert info["datasets"]["overlap"][0] == 4 and "curve" in info
    Path("cut.h5").write_bytes(Path("g.h5").read_bytes()[:2048])
    assert "truncated or half-written" in _error_line(runner.invoke(cli, ["show", "cut.h5"]))
    Path("notes.h5").write_text("hello")
    assert "not an HDF5 file" in _error_line(runner.invoke(cli, ["show", "notes.h5"]))


def test_bench_engine_smoke(runner):
    res = _run(runner, "bench", "engine", "--quick", "--d", "64", "--k", "4", "--runs", "8",
               "--steps", "32", "--autograd-steps", "20", "--reduced-steps", "2000", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    red = data["reduced"]
    assert set(red["run_steps_per_s"]) == {"64", "100", "10000", "10000000"}
    assert all(v > 0 for v in red["run_steps_per_s"].values()) and red["ratio_to_full_at_d"] > 0
    assert {"engine", "autograd_loop", "sampling_bound", "engine_sampler",
            "autograd_loop_1_threads"} <= set(data["run_steps_per_s"])
    assert all(v > 0 for v in data["run_steps_per_s"].values())
    assert data["ratios"]["engine_over_autograd"] > 0
