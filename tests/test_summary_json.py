"""`--json` of `loradyn run` and `loradyn show` carries the loss and every recorded quantity
(issue 18): the loss equals the file's mean loss, extras are summarised with their shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sims.cli import cli
from sims.io.summary import MAX_TRAILING, quantity_summaries, summarize_array
from sims.io.trajectory import read_trajectory

FAST = ["--eta", "0.002", "--steps", "300", "--runs", "4", "--checkpoints", "8"]


def _json(runner, *args) -> dict:
    res = runner.invoke(cli, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _close(listed, array):
    got = np.array([np.nan if v is None else v for v in listed], dtype=float)
    np.testing.assert_allclose(got, array, rtol=1e-12, atol=0, equal_nan=True)


def test_run_json_loss_equals_file_mean_loss(runner):
    data = _json(runner, "run", "spec.toml", *FAST, "--out", "a.h5", "--json")
    traj, _ = read_trajectory("a.h5")
    ok = ~traj.diverged
    _close(data["loss_mean"], traj.loss[ok].mean(axis=0))
    _close(data["loss_std"], traj.loss[ok].std(axis=0))
    assert data["loss_kind"] == traj.loss_kind == "exact"
    q = data["quantities"]
    assert {"overlap", "loss", "ode", "m0"} <= set(q)
    _close(q["overlap"]["mean"], traj.overlap[ok].mean(axis=0))
    _close(q["overlap"]["median"], np.median(traj.overlap[ok], axis=0))
    assert q["loss"]["final"]["mean"] == pytest.approx(traj.loss[ok, -1].mean(), rel=1e-12)
    assert q["loss"]["shape"] == [4, len(data["steps"])] and q["loss"]["axes"] == "R,C"
    assert q["m0"]["axes"] == "R" and q["m0"]["max"] == pytest.approx(traj.m0.max())


def test_show_json_carries_the_same_summary(runner):
    ran = _json(runner, "run", "spec.toml", *FAST, "--joint-c", "--out", "j.h5", "--json")
    shown = _json(runner, "show", "j.h5", "--json")
    assert shown["curve"]["loss_mean"] == ran["loss_mean"]
    assert shown["curve"]["quantities"] == ran["quantities"]
    assert "c_overlap" in ran["quantities"]  # joint ĉ: ⟨ĉ, c⟩ is recorded
    assert "ode" in ran["quantities"]  # joint ĉ: the plain O(η) ODE is summarised too


def test_lora_extras_are_summarised(runner):
    data = _json(runner, "run", "spec.toml", *FAST, "--learner", "lora", "--rank", "2",
                 "--out", "l.h5", "--json")
    traj, _ = read_trajectory("l.h5")
    sv = data["quantities"]["extra/singular_values"]
    assert sv["shape"] == [4, len(data["steps"]), 2] and sv["axes"] == "R,C,*"
    np.testing.assert_allclose(np.array(sv["mean"]), traj.extra["singular_values"].mean(0),
                               rtol=1e-12)
    assert len(sv["final"]["median"]) == 2


def test_large_and_nan_arrays():
    big = summarize_array(np.zeros((3, 5, MAX_TRAILING + 1)), 5)
    assert big["shape"] == [3, 5, MAX_TRAILING + 1] and "omitted" in big and "mean" not in big
    nan = summarize_array(np.array([[np.nan, 1.0], [np.nan, 3.0]]), 2)
    assert nan["mean"] == [None, 2.0] and nan["final"]["median"] == 2.0


def test_all_diverged_keeps_shapes(runner):
    _json(runner, "run", "spec.toml", *FAST, "--out", "a.h5", "--json")
    traj, _ = read_trajectory("a.h5")
    traj.diverged_step = np.zeros(traj.runs, dtype=np.int64)
    out = quantity_summaries(traj)
    assert len(out["loss_mean"]) == traj.steps.size
