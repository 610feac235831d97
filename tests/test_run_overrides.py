"""`loradyn run --set KEY=VALUE` overrides any instance-spec key before anything is built,
and a missing SPEC file is one line naming its path (issue 26)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sims.cli import cli
from sims.commands.run import parse_overrides
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
    assert got == {"k": 4, "xi": 0.25, "W": [[1, 0, 0], [0, 1, 0]], "lam": [1, -1.5],
                   "seed": 7, "teacher": "committee", "c_hat": "teacher", "u_alpha": 0.1,
                   "convention": "appB-sqrt", "activation": "erf(x/sqrt2)"}


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
