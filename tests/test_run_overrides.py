"""`loradyn run --set KEY=VALUE` overrides any instance-spec key before anything is built,
and a missing SPEC file is one line naming its path (issue 26); a spec's ``[run]`` table gives
the run's options, which ``--set`` and the flags override (issue 39)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sims.cli import cli
from sims.commands.run import RUN_KEYS, RunRequest, parse_overrides
from sims.io.trajectory import read_trajectory

FAST = ["--eta", "0.002", "--steps", "60", "--runs", "2", "--checkpoints", "4"]


def _error_line(result) -> str:
    text = result.output.strip()
    assert result.exit_code in (1, 2), text
    assert len(text.splitlines()) == 1, text
    return text


def test_overrides_change_the_run_and_the_stored_config(runner):
    res = runner.invoke(cli, ["run", "spec.toml", *FAST, "--out", "o.h5",
                              "--set", "activation=tanh", "--set", "d=40",
                              "--set", "lam=[1, 2, 3]", "--set", "xi=0.5",
                              "--set", "W=orthonormal", "--set", 'c="gaussian"'])
    assert res.exit_code == 0, res.output
    traj, meta = read_trajectory("o.h5")
    spec = meta["config"]["instance"]
    assert spec["activation"] == "tanh" and spec["d"] == 40 and spec["xi"] == 0.5
    assert spec["lam"] == [1, 2, 3] and spec["W"] == "orthonormal"
    assert spec["c"] == "gaussian" and spec["k"] == 3 and spec["seed"] == 9  # the rest: SPEC
    assert np.isfinite(traj.overlap).all() and set(traj.xi) == {0.5}


def test_an_override_changes_the_numbers(runner):
    quick = [*FAST, "--no-finite-d-theory"]
    assert runner.invoke(cli, ["run", "spec.toml", *quick, "--out", "a.h5"]).exit_code == 0
    assert runner.invoke(cli, ["run", "spec.toml", *quick, "--out", "b.h5", "--set",
                               "xi=2"]).exit_code == 0
    a, _ = read_trajectory("a.h5")
    b, meta = read_trajectory("b.h5")
    assert meta["config"]["instance"]["xi"] == 2 and set(b.xi) == {2.0}
    assert not np.array_equal(a.loss, b.loss)


@pytest.mark.parametrize(("pair", "message"), [
    ("bogus=1", "instance spec: key 'bogus' (--set bogus): unknown key; valid keys: "
                "activation, k, d"),
    ("d", "--set 'd': expected KEY=VALUE"),
    ("=3", "--set '=3': expected KEY=VALUE"),
    ("lam=[1, 2", "--set lam=[1, 2: the value is not a TOML/JSON scalar or array"),
    ("xi=", "--set xi=: the value is not a TOML/JSON scalar or array"),
    ("d=abc", "instance spec: key 'd' (--set d): must be an integer, got 'abc'"),
    ("d=4", "instance spec: key 'd' (--set d): must be ≥ k + 2"),
    ("activation=nope", "key 'activation' (--set activation): unknown activation 'nope'"),
    ("lam=[1, 2]", "key 'lam' (--set lam):"),
    ("xi=-1", "key 'xi' (--set xi):"),
])
def test_bad_overrides_are_one_line_and_write_nothing(runner, pair, message):
    res = runner.invoke(cli, ["run", "spec.toml", *FAST, "--out", "x.h5", "--set", pair])
    line = _error_line(res)
    assert line.startswith("Error: ") and message in line, line
    assert sorted(os.listdir(".")) == ["spec.toml"]


def test_parse_overrides_values():
    got = parse_overrides(["k=4", "xi=0.25", "W=claim2", "lam=[1,-1.5]", "seed=7",
                           "teacher = committee ", "c_hat=\"teacher\"",
                           "convention=appB-sqrt", "activation=erf(x/sqrt2)", "u_alpha=1e-1",
                           "W=[[1, 0, 0], [0, 1, 0]]"])
    assert got == ({"k": 4, "xi": 0.25, "W": [[1, 0, 0], [0, 1, 0]], "lam": [1, -1.5],
                    "seed": 7, "teacher": "committee", "c_hat": "teacher", "u_alpha": 0.1,
                    "convention": "appB-sqrt", "activation": "erf(x/sqrt2)"}, {})
    # run keys: bare where no instance key has the name, run.KEY always
    assert parse_overrides(["mu=0.7", "eta=0.2", "run.seed=3", "seed=1", "run.batch=8"]) == (
        {"seed": 1}, {"mu": 0.7, "eta": 0.2, "seed": 3, "batch": 8})


def test_run_keys_are_the_commands_config_fields():
    """The [run] table takes exactly what the command's flags set (and the learner)."""
    fields = set(RunRequest.config_fields.__code__.co_names) & set(RUN_KEYS)
    assert set(RUN_KEYS) == {"learner"} | fields


RUN_SPEC = """activation = "relu"
k = 1
d = 60
seed = 0

[run]
learner = "pretrained-glm"
mu = 0.5
eta = 0.2
batch = 30
steps = 40
runs = 3
checkpoints = 4
spacing = "linear"
engine = "full"
"""


def _config(path):
    traj, meta = read_trajectory(path)
    return traj, meta["config"]


def test_the_run_table_is_the_default_and_set_and_flags_win(runner):
    Path("pt.toml").write_text(RUN_SPEC)
    assert runner.invoke(cli, ["run", "pt.toml", "--out", "a.h5"]).exit_code == 0
    traj, config = _config("a.h5")
    assert config["learner"] == "pretrained-glm" and config["mu"] == 0.5
    assert (config["eta"], config["batch"], config["steps"], config["runs"]) == (0.2, 30, 40, 3)
    assert config["spacing"] == "linear" and traj.overlap.shape == (3, 4)
    assert "run" not in config["instance"]  # the instance is the instance keys alone
    res = runner.invoke(cli, ["run", "pt.toml", "--out", "b.h5", "--set", "mu=0.8",
                              "--set", "run.seed=5", "--runs", "2", "--set", "d=80"])
    assert res.exit_code == 0, res.output
    traj, config = _config("b.h5")
    assert (config["mu"], config["seed"], config["runs"]) == (0.8, 5, 2)
    assert config["instance"]["d"] == 80 and config["instance"]["seed"] == 0
    assert config["eta"] == 0.2 and traj.overlap.shape == (2, 4)  # the rest: the table
    res = runner.invoke(cli, ["run", "pt.toml", "--out", "c.h5", "--mu", "0.3"])
    assert res.exit_code == 0 and _config("c.h5")[1]["mu"] == 0.3


def test_a_learner_option_named_like_a_helper_argument_reaches_the_learner(runner):
    """pretrained-glm's ``base`` (and the others) through --set and as a flag: it once
    collided with a keyword of the command's own config builder (a TypeError)."""
    Path("pt.toml").write_text(RUN_SPEC)
    res = runner.invoke(cli, ["run", "pt.toml", "--out", "m.h5", "--set", "base=mixed",
                              "--set", "teacher_activation=erf", "--labels", "y2"])
    assert res.exit_code == 0, res.output
    traj, config = _config("m.h5")
    assert (config["base"], config["teacher_activation"], config["labels"]) == \
        ("mixed", "erf", "y2")
    assert "q" in traj.extra and "rho" in traj.extra


def test_other_commands_read_a_spec_with_a_run_table(runner):
    Path("pt.toml").write_text(RUN_SPEC)
    res = runner.invoke(cli, ["hermite", "h", "pt.toml", "--m", "0.3"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(("line", "args", "message"), [
    ("bogus = 1", [], "instance spec pt.toml: [run] key 'bogus': unknown key; valid keys: "
                      "learner, eta"),
    ("mu = 2.0", [], "'mu': must be a finite number in (0, 1), got 2"),
    ("steps = 0", [], "'steps': must be a positive integer, got 0"),
    ("", ["--set", "mu=0.3", "--mu", "0.4"], "--set mu=… and --mu both given: keep one"),
    ("", ["--learner", "finetune"], "learner 'finetune' takes no option 'mu'"),
])
def test_a_bad_run_table_is_one_line_and_writes_nothing(runner, line, args, message):
    """``line`` replaces the table's line of the same key (or is added)."""
    key = line.partition(" ")[0]
    kept = [ln for ln in RUN_SPEC.splitlines() if not key or not ln.startswith(key + " ")]
    Path("pt.toml").write_text("\n".join([*kept, line]) + "\n")
    text = _error_line(runner.invoke(cli, ["run", "pt.toml", "--out", "x.h5", *args]))
    assert text.startswith("Error: ") and message in text, text
    assert not Path("x.h5").exists()
    Path("nt.toml").write_text('activation = "relu"\nk = 1\nd = 60\nrun = 3\n')
    text = _error_line(runner.invoke(cli, ["run", "nt.toml", "--out", "x.h5"]))
    assert "nt.toml: must be a table of run options ([run])" in text, text


def test_a_missing_spec_is_one_line_naming_it(runner):
    for args in (["run", "nope.toml", *FAST, "--out", "x.h5"],
                 ["hermite", "h", "nope.toml", "--m", "0.3"],
                 ["hermite", "ode", "nope.toml", "--eta", "0.1"],
                 ["hermite", "committee", "nope.toml", "--eta", "0.1", "--steps", "10"]):
        line = _error_line(runner.invoke(cli, args))
        assert line == "Error: instance spec nope.toml: no such file", (args, line)
    Path("folder.toml").mkdir()
    assert "instance spec folder.toml: is a directory" in _error_line(
        runner.invoke(cli, ["run", "folder.toml", *FAST, "--out", "x.h5"]))
    assert _error_line(runner.invoke(cli, ["sweep", "nope.toml", "--out", "s.h5"])) == (
        "Error: no such sweep file: nope.toml")  # a sweep's own SPEC (sweep_spec.load_sweep)
    Path("sw.toml").write_text('[base]\ninstance = "gone.toml"\n[axes]\nxi = [1.0]\n')
    line = _error_line(runner.invoke(cli, ["sweep", "sw.toml", "--out", "s.h5"]))
    assert "instance spec" in line and "gone.toml: no such file" in line, line
    assert sorted(os.listdir(".")) == ["folder.toml", "spec.toml", "sw.toml"]
