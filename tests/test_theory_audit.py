"""The theory audit (issue 40, item 2): every theory line against the SGD mean of the same
runs — the statistic by hand, its power, the attributes in run and sweep files, the summaries
of ``loradyn run`` and ``loradyn reproduce``."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace

import h5py
import numpy as np
import pytest
from helpers import shrunk_sweep

from dynamics.overlays.audit import (
    ATTRS,
    LINES,
    NOT_AUDITED,
    Line,
    audit_line,
    audit_trajectory,
    passage_ratio,
    stored_audits,
)
from sims.cli import cli
from sims.experiments.figures import FIGURES, fig2
from sims.experiments.reproduce import audit_table
from sims.io.sweep import read_sweep
from sims.io.trajectory import read_trajectory

OVERLAP, LOSS = Line("overlap", "overlap"), Line("loss", "loss")
STEPS = np.array([0, 10, 20, 40, 80])
FAST = ["--eta", "0.002", "--steps", "300", "--runs", "4", "--checkpoints", "8"]


def _noisy(offset: float, runs: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(SGD, theory): theory a smooth curve, SGD = theory + offset + N(0, 0.05²) noise."""
    rng = np.random.default_rng(seed)
    theory = np.tile(np.linspace(0.1, 0.9, STEPS.size), (runs, 1))
    return theory + offset + 0.05 * rng.standard_normal(theory.shape), theory


# ---------------------------------------------------------------- the statistic
def test_statistic_matches_a_hand_computation():
    theory = np.zeros((4, 3))
    x = np.array([[0.0, 0.1, 0.3], [0.0, 0.3, 0.1], [0.0, 0.1, 0.3], [0.0, 0.3, 0.1]])
    a = audit_line("ode", OVERLAP, [0, 5, 9], x, theory)
    se = math.sqrt(4 * 0.1**2 / 3) / 2  # sd (ddof 1) of ±0.1 about 0.2, over √4
    assert a.max_abs == pytest.approx(0.2, rel=1e-12)
    assert a.max_se == pytest.approx(0.2 / se, rel=1e-12)
    assert a.at_step == 5  # the first checkpoint of the largest |mean D|
    assert a.runs == a.total == 4
    assert a.passed and a.fail_step == -1  # 0.2 ≤ 4 SE = 0.23
    assert a.passage_ratio != a.passage_ratio  # theory never reaches ½: NaN


def test_planted_offset_fails_and_zero_offset_passes():
    for offset, passed in ((0.0, True), (0.1, False)):
        x, theory = _noisy(offset)
        a = audit_line("ode", OVERLAP, STEPS, x, theory)
        assert a.passed is passed
        assert a.max_abs == pytest.approx(np.abs((x - theory).mean(0)).max(), rel=1e-12)
    assert a.fail_step == 0 and a.max_se > 10


def test_loss_tolerance_is_relative_to_the_sgd_mean():
    theory = np.full((8, 3), 2.0)
    x = theory + 0.05  # no noise: SE = 0, the floor 0.03·|mean SGD| = 0.0615 decides
    assert audit_line("extra/ode_loss", LOSS, [0, 1, 2], x, theory).passed
    assert not audit_line("ode", OVERLAP, [0, 1, 2], x, theory).passed  # floor 0.03


def test_nan_runs_are_left_out_and_counted():
    x, theory = _noisy(0.0, runs=10)
    theory[0] = np.nan  # a line that failed from this start
    x[1, 3:] = np.nan  # a run that diverged
    a = audit_line("ode", OVERLAP, STEPS, x, theory)
    b = audit_line("ode", OVERLAP, STEPS, x[2:], theory[2:])
    assert (a.runs, a.total) == (8, 10)
    assert (a.max_abs, a.max_se, a.at_step) == (b.max_abs, b.max_se, b.at_step)
    none = audit_line("ode", OVERLAP, STEPS, x, np.full_like(theory, np.nan))
    assert none.runs == 0 and not none.passed and "not audited" in none.text()


def test_a_checkpoint_where_no_run_has_the_quantity_is_not_audited():
    """lora-ba's overlap at B₀ = 0 is undefined (NaN) in every run at step 0: that checkpoint
    is left out, not every run; a run NaN at a checkpoint others have still drops out."""
    x, theory = _noisy(0.0, runs=10)
    x[:, 0] = np.nan
    a = audit_line("ode", OVERLAP, STEPS, x, theory)
    b = audit_line("ode", OVERLAP, STEPS[1:], x[:, 1:], theory[:, 1:])
    assert a.runs == 10 and (a.max_abs, a.max_se, a.at_step) == (b.max_abs, b.max_se, b.at_step)
    x[:, 0], x[0, 2] = 0.1, np.nan
    assert audit_line("ode", OVERLAP, STEPS, x, theory).runs == 9
    x, theory = _noisy(0.1, runs=10)
    x[:, 0] = np.nan
    assert not audit_line("ode", OVERLAP, STEPS, x, theory).passed  # an offset still fails


def test_passage_ratio_on_a_constructed_example():
    # first steps at |·| ≥ ½: SGD 40, 20, 80, never, 10; theory 20, 20, 40, 20, 0
    x = np.array([[0, 0, 0.4, 0.6, 1], [0, 0.3, -0.5, 1, 1], [0, 0, 0, 0, 0.7],
                  [0, 0, 0, 0, 0.1], [0, 0.9, 1, 1, 1]], dtype=float)
    theory = np.array([[0, 0, 0.6, 1, 1], [0, 0, 0.5, 1, 1], [0, 0, 0, 0.5, 1],
                       [0, 0, 0.5, 1, 1], [0.5, 1, 1, 1, 1]], dtype=float)
    assert passage_ratio(x, theory, STEPS) == pytest.approx(2.0)  # median of 2, 1, 2
    assert math.isnan(passage_ratio(x[3:4], theory[3:4], STEPS))


def test_overlap_lines_compare_absolute_values_like_the_figures():
    x, theory = _noisy(0.0)
    x[::4] = -x[::4]  # a quarter of the runs end at −u, their theory line at +u
    assert audit_line("ode", LINES["ode"], STEPS, x, theory).passed
    assert not audit_line("ode", OVERLAP, STEPS, x, theory).passed  # signed: fails


def test_singular_values_audit_every_index():
    x, theory = _noisy(0.0)
    sv = np.stack([x, x], axis=-1)
    sv[:, :, 1] += 0.1  # the second singular value is off
    a = audit_line("extra/ode_singular_values", LINES["extra/ode_singular_values"], STEPS,
                   sv, np.stack([theory, theory], axis=-1))
    assert not a.passed and a.max_abs == pytest.approx(
        np.abs((sv[:, :, 1] - theory).mean(0)).max(), rel=1e-12)
    assert math.isnan(a.passage_ratio)


def test_pairs_are_those_of_the_plots():
    """Every audited line is a theory source of the plot quantity that draws its SGD
    quantity (absolute values: ``abs_overlap``); every plot theory source is audited or
    said why not."""
    from sims.plots.curves import QUANTITIES, THEORY

    def source(path):
        return path.replace("extra/", "extra:")

    for name, line in LINES.items():
        quantity = "abs_overlap" if line.absolute else next(
            q for q, (_, src) in QUANTITIES.items() if src == source(line.against))
        assert source(name) in THEORY[quantity], name
        assert QUANTITIES[quantity][1] == source(line.against), name
    plotted = {s.replace("extra:", "extra/") for sources in THEORY.values() for s in sources}
    assert plotted == set(LINES) | set(NOT_AUDITED)


# ---------------------------------------------------------------- files and summaries
def _run(runner, *args) -> str:
    res = runner.invoke(cli, ["run", "spec.toml", *FAST, *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def test_run_stores_reads_back_and_prints_the_audit(runner):
    out = _run(runner, "--out", "a.h5")
    traj, _ = read_trajectory("a.h5")
    fresh = audit_trajectory(traj)
    assert set(fresh) == {"ode", "ode_corrected"}
    with h5py.File("a.h5", "r") as f:
        for name in fresh:
            assert set(ATTRS) <= set(f[name].attrs)
            assert f[name].attrs["audit_runs"] == 4
    assert stored_audits(traj) == fresh  # read back: the same numbers
    for name, audit in fresh.items():
        assert audit.text() in out
        assert f"theory {name} vs |overlap|: max |Δ| " in out
    data = json.loads(_run(runner, "--out", "b.h5", "--json"))
    assert data["audit"]["ode"] == fresh["ode"].as_json()


def test_a_shifted_theory_line_fails_the_audit(runner):
    """Power: the run's own ODE passes at this size; shifted by 0.1 (in |·|) it fails."""
    _run(runner, "--out", "a.h5")
    traj, _ = read_trajectory("a.h5")
    assert audit_trajectory(traj)["ode"].passed
    shifted = replace(traj, ode=np.sign(traj.ode) * (np.abs(traj.ode) + 0.1))
    audit = audit_trajectory(shifted)["ode"]
    assert not audit.passed and audit.max_abs == pytest.approx(0.1, abs=0.035)
    assert "OUTSIDE tolerance from step 0" in audit.text()


SWEEP = """
[base]
runs = 4
eta_times_d = 0.04
steps = 300
checkpoints = 8
[base.instance]
activation = "relu"
k = 3
d = 20
seed = 9
[axes]
xi = [0.5, 1.0]
"""


def test_sweep_cells_store_the_audit_and_reproduce_tabulates_it(runner):
    with open("s.toml", "w") as fh:
        fh.write(SWEEP)
    res = runner.invoke(cli, ["sweep", "s.toml", "--out", "s.h5"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    _, cells = read_sweep("s.h5")
    for cell in cells:
        stored = stored_audits(cell.traj)
        assert set(stored) == {"ode", "ode_corrected"}
        computed = audit_trajectory(cell.traj)  # as stored, as computed (NaN == NaN here)
        np.testing.assert_equal({n: a.attrs() for n, a in stored.items()},
                                {n: a.attrs() for n, a in computed.items()})
        assert all(set(ATTRS) <= set(cell.traj.extra_attrs[n]) for n in stored)
    lines = audit_table("s.h5", "tiny")
    assert lines[0].startswith("tiny: theory audit")
    assert lines[1].split()[:3] == ["cell", "theory", "line"]
    assert any(line.lstrip().startswith("xi=0.5  ode ") for line in lines)
    passed = sum(a.passed for c in cells for a in stored_audits(c.traj).values())
    assert lines[-1] == f"tiny: {passed} of 4 theory lines within tolerance"


_tiny_fig2 = shrunk_sweep(fig2.sweep, runs=3, steps_per_d=15, checkpoints=8, eta_times_d=0.2)


def test_reproduce_prints_the_audit_table(tmp_path, monkeypatch):
    monkeypatch.setitem(FIGURES, "fig2", dataclasses.replace(FIGURES["fig2"], sweep=_tiny_fig2))
    from click.testing import CliRunner

    args = ["reproduce", "fig2", "--quick", "--out-dir", str(tmp_path), "--no-readme"]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    table = audit_table(tmp_path / "fig2_quick.h5", "fig2")
    assert "\n".join(table) in res.output
    # joint ĉ: ode, ode_corrected, ⟨ĉ, c⟩ and its corrected line; frozen ĉ: ode, ode_corrected
    assert table[-1].startswith("fig2: ") and table[-1].endswith(
        " of 6 theory lines within tolerance")
    assert ["joint_c=True", "ode_c_overlap", "c_overlap"] in [ln.split()[:3] for ln in table]


def test_a_line_outside_beside_one_within_is_not_drawn(tmp_path):
    """dynamics.overlays.audit.not_drawn: of two lines of one quantity, the one outside
    tolerance (on ≥ MIN_RUNS runs) is marked when the other is within; not on 3 runs, not
    where both fail, never across quantities. The writer stores the mark (``not_drawn``), the
    figures' sources skip it and name why, the data stay."""
    from dynamics.overlays.audit import MIN_RUNS, mark_not_drawn, not_drawn
    from dynamics.runtime.trajectory import Trajectory
    from sims.plots.curves import _source, left_out_notes, load_curves

    sgd, theory = _noisy(0.0, runs=16)
    good = audit_line("ode_corrected", LINES["ode_corrected"], STEPS, sgd, theory)
    bad = audit_line("ode", LINES["ode"], STEPS, sgd, theory - 0.2)
    c_bad = audit_line("extra/ode_c_overlap", LINES["extra/ode_c_overlap"], STEPS, sgd,
                       theory - 0.2)
    assert good.passed and not bad.passed and not c_bad.passed
    marks = not_drawn({"ode": bad, "ode_corrected": good, "extra/ode_c_overlap": c_bad})
    assert list(marks) == ["ode"] and "`ode_corrected` is within" in marks["ode"]
    assert not_drawn({"ode": bad, "extra/ode_c_overlap": c_bad}) == {}  # none within
    few = audit_line("ode", LINES["ode"], STEPS, sgd[:MIN_RUNS - 1], theory[:MIN_RUNS - 1] - 0.2)
    assert not few.passed and not_drawn({"ode": few, "ode_corrected": good}) == {}

    runs = sgd.shape[0]
    shared = {"ode": {"note": "plain"}}  # the cells of a sweep batch share their attributes
    traj = Trajectory(STEPS, sgd, np.ones_like(sgd), theory - 0.2, np.full(runs, -1),
                      np.ones(runs), np.zeros(runs), ode_corrected=theory, extra_attrs=shared)
    other = Trajectory(STEPS, sgd, np.ones_like(sgd), theory, np.full(runs, -1),
                       np.ones(runs), np.zeros(runs), ode_corrected=theory, extra_attrs=shared)
    assert list(mark_not_drawn(traj)) == ["ode"]
    assert shared == {"ode": {"note": "plain"}} and mark_not_drawn(other) == {}
    assert "not_drawn" not in other.extra_attrs["ode"]  # no mark leaks to another cell
    assert _source(traj, "ode") is None and _source(traj, "ode_corrected") is not None
    assert np.array_equal(traj.ode, theory - 0.2)  # the values stay
    path = _write(tmp_path / "t.h5", traj)
    assert "not_drawn" in read_trajectory(path)[0].extra_attrs["ode"]  # the readers keep it
    curve = load_curves([path])[0]
    assert "not_drawn" in curve.traj.extra_attrs["ode"]
    assert _source(curve.traj, "ode") is None and np.isfinite(curve.traj.ode).all()
    assert any("`ode` not drawn" in note for note in left_out_notes([curve], "abs_overlap"))


def _write(path, traj):
    """A trajectory file of ``traj`` (a finetune config of its size)."""
    from dynamics.setup.config import RunConfig
    from sims.io.trajectory import write_trajectory

    runs, cps = traj.overlap.shape
    config = RunConfig(instance={"activation": "relu", "k": 2, "d": 20, "xi": 1.0},
                       runs=runs, steps=int(traj.steps[-1]), checkpoints=cps)
    write_trajectory(path, traj, config, config.run_instances())
    return path
