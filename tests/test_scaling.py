"""``loradyn scaling``: hitting-time definitions, the fit, the table, the file and the checks."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from dynamics.runtime.trajectory import Trajectory
from sims.cli import cli
from sims.experiments.scaling import hitting_times, load_scaling, parse_scaling
from sims.experiments.sweep_spec import SweepSpecError

SPEC = """
[scaling]
d = [30, 60, 120]
c = 0.05
horizon = 40
level = 0.5
epsilon = 0.3
checkpoints = 200
n_boot = 200

[base]
runs = 8
engine = "auto"

[base.instance]
activation = "relu"
k = 3
xi = 1.0
c_hat = "teacher"
seed = 1
"""


def traj(overlap, steps=None, diverged=None, extra=None):
    overlap = np.asarray(overlap, dtype=float)
    r, c = overlap.shape
    return Trajectory(steps=np.arange(c) * 10 if steps is None else np.asarray(steps),
                      overlap=overlap, loss=overlap * 0, ode=overlap * np.nan,
                      diverged_step=np.full(r, -1) if diverged is None else np.array(diverged),
                      xi=np.ones(r), instance_seed=np.zeros(r, dtype=int), extra=extra or {})


def test_hitting_time_definitions():
    t = traj([[0.0, 0.6, 0.3, 0.95, 0.92, 0.97],   # first ≥ 0.5 at 10; stays ≥ 0.9 from 30
              [0.0, 0.1, 0.2, 0.3, 0.4, 0.45],     # never
              [0.0, -0.7, -0.95, -0.99, -0.99, -0.98],  # |m|: 10 and 20
              [0.0, 0.6, 0.95, 0.97, 0.5, 0.99]])  # dips below at 40: strong from 50
    weak, strong, source = hitting_times(t, 0.5, 0.9)
    np.testing.assert_array_equal(weak, [10, np.nan, 10, 10])
    np.testing.assert_array_equal(strong, [30, np.nan, 20, 50])
    assert "checkpoint" in source
    weak, strong, _ = hitting_times(t, 0.5, 0.9, absolute=False)
    assert np.isnan(weak[2]) and np.isnan(strong[2])


def test_exact_first_passage_wins_and_diverged_runs_never_reach():
    t = traj([[0.0, 0.6, 0.95], [0.0, 0.6, 0.95]], diverged=[-1, 15],
             extra={"first_passage_0.5": np.array([7.0, 8.0])})
    weak, strong, source = hitting_times(t, 0.5, 0.9)
    np.testing.assert_array_equal(weak, [7.0, np.nan])
    np.testing.assert_array_equal(strong, [20.0, np.nan])
    assert source == "exact first passage"


def test_start_above_the_strong_level_counts_as_zero():
    _, strong, _ = hitting_times(traj([[0.95, 0.96]]), 0.5, 0.9)
    assert strong[0] == 0.0


def test_scaling_cli_table_file_plot_and_expect_slope(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sc.toml").write_text(SPEC)
    res = CliRunner().invoke(cli, ["scaling", "sc.toml", "--out", "sc.h5", "--json",
                                   "--expect-slope", "0.5,1.5"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "η = c/d, c = 0.05" in out and "T_0.5: exact first passage" in out
    assert "reached" in out and "fit T_0.5 ∝ d^b: b = " in out and "95 % CI" in out
    fits = json.loads(out.strip().splitlines()[-2])
    slope = fits["level"]["slope"]
    assert 0.5 < slope < 1.5
    assert (tmp_path / "sc.png").stat().st_size > 1000
    with h5py.File("sc.h5", "r") as f:
        g = f["scaling"]
        assert list(g["d"][()]) == [30, 60, 120]
        assert g["t_level"].shape == (3, 8) and g["t_strong"].shape == (3, 8)
        assert g.attrs["c"] == 0.05
        assert json.loads(g.attrs["settings"])["horizon"] == 40
        assert json.loads(g.attrs["fits"])["level"]["slope"] == pytest.approx(slope)
        assert len(f["cells"]) == 3
    # an interval far away fails, naming the interval; the results stay written
    res = CliRunner().invoke(cli, ["scaling", "sc.toml", "--out", "sc.h5",
                                   "--expect-slope", "2,3"])
    assert res.exit_code == 1
    assert "leaves [2, 3]" in res.output and "3 cells, 3 finished" in res.output
    res = CliRunner().invoke(cli, ["scaling", "sc.toml", "--out", "sc.h5",
                                   "--expect-slope", "x"])
    assert res.exit_code == 2 and "expected LO,HI" in res.output


def base(**scaling):
    table = {"d": [10, 20], "c": 0.05, "horizon": 5} | scaling
    return {"scaling": {k: v for k, v in table.items() if v is not None},
            "base": {"instance": {"activation": "relu", "k": 3}}}


@pytest.mark.parametrize("data, message", [
    (base(d=[10]), "at least two positive integers"),
    (base(d=[10, 10]), "repeats a value"),
    (base(c=None), "c must be a number"),
    (base(level=1.5), "level = 1.5 must lie in (0, 1)"),
    (base(epsilon=0), "epsilon = 0 must lie in (0, 1)"),
    (base(bogus=1), "unknown [scaling] key 'bogus'"),
    ({"base": {}}, "a [scaling] table is required"),
    (base() | {"axes": {"xi": [1.0]}}, "unknown top-level table 'axes'"),
    ({"scaling": base()["scaling"], "base": {"eta": 0.1, "instance": {"activation": "relu"}}},
     "[base] eta is set by [scaling]"),
    ({"scaling": base()["scaling"], "base": {"instance": {"activation": "relu", "d": 5}}},
     "[base.instance] d is set by [scaling] d"),
])
def test_bad_scaling_specs(data, message):
    with pytest.raises(SweepSpecError) as err:
        parse_scaling(data)
    assert message in str(err.value)


def test_scaling_file_errors_are_one_line(tmp_path):
    res = CliRunner().invoke(cli, ["scaling", str(tmp_path / "nope.toml")])
    assert res.exit_code == 1 and res.output.startswith("Error: no such scaling file")
    bad = tmp_path / "bad.toml"
    bad.write_text("[scaling\n")
    with pytest.raises(SweepSpecError, match="not valid TOML"):
        load_scaling(bad)


FP_SPEC = SPEC.replace("n_boot = 200", 'n_boot = 200\nmode = "first_passage"')


def test_first_passage_mode_records_exact_hits_without_a_trajectory(tmp_path, monkeypatch):
    """mode = first_passage: the cells hold the initial state and the exact first passages of
    both levels; T_level equals trajectory mode's (same streams), T_strong is the direct
    first passage of 1 − ε and never after trajectory mode's "stays above" time."""
    from dynamics.reduced import first_passage_reduced
    from sims.io.sweep import read_sweep

    monkeypatch.chdir(tmp_path)
    (tmp_path / "fp.toml").write_text(FP_SPEC)
    (tmp_path / "tr.toml").write_text(SPEC)
    for name in ("fp", "tr"):
        res = CliRunner().invoke(cli, ["scaling", f"{name}.toml", "--out", f"{name}.h5"],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
        if name == "fp":
            assert "T_(1−ε=0.7): exact first passage (no trajectory recorded)" in res.output
    with h5py.File("fp.h5", "r") as f, h5py.File("tr.h5", "r") as g:
        fp_level, tr_level = f["scaling/t_level"][()], g["scaling/t_level"][()]
        fp_strong, tr_strong = f["scaling/t_strong"][()], g["scaling/t_strong"][()]
        assert json.loads(f["scaling"].attrs["settings"])["mode"] == "first_passage"
    np.testing.assert_array_equal(fp_level, tr_level)
    both = np.isfinite(fp_strong) & np.isfinite(tr_strong)
    assert both.mean() > 0.5 and np.all(fp_strong[both] <= tr_strong[both])
    assert np.isfinite(fp_strong[np.isfinite(tr_strong)]).all()  # stays above ⇒ reached
    _meta, cells = read_sweep("fp.h5")
    for i, cell in enumerate(sorted(cells, key=lambda c: c.config["instance"]["d"])):
        assert list(cell.traj.steps) == [0]
        from dynamics.setup.config import RunConfig

        config = RunConfig.from_dict(cell.config)
        np.testing.assert_array_equal(fp_strong[i], first_passage_reduced(config, 0.7))
        np.testing.assert_array_equal(fp_level[i], first_passage_reduced(config, 0.5))


@pytest.mark.parametrize("data, message", [
    (base(mode="fast"), "mode must be one of trajectory, first_passage"),
])
def test_bad_scaling_mode(data, message):
    with pytest.raises(SweepSpecError, match=message):
        parse_scaling(data)


def test_first_passage_mode_needs_a_reduced_chain_that_records_its_start():
    data = base(mode="first_passage")
    data["base"]["engine"] = "full"
    with pytest.raises(SweepSpecError, match="trajectory = false needs the reduced engine"):
        parse_scaling(data).sweep.cells()
    data = base(mode="first_passage")
    data["base"]["learner"] = "moment"
    with pytest.raises(SweepSpecError, match="needs the reduced engine and an exact chain"):
        parse_scaling(data).sweep.cells()
    data["base"]["learner"] = "scratch"  # the network chain records its start too
    assert parse_scaling(data).sweep.cells()


LOSS_SPEC = """
[scaling]
d = [20, 40]
c = 0.5
horizon = 60
level = 0.1
epsilon = 0.01
n_boot = 100
mode = "first_passage"
quantity = "loss"

[base]
runs = 8
learner = "scratch"

[base.instance]
activation = "relu"
k = 2
xi = 1.0
c_hat = "teacher"
seed = 1
"""


def test_loss_levels_time_the_exact_population_loss(tmp_path, monkeypatch):
    """quantity = loss: T_level / T_strong are the chain's exact first passages of the loss to
    level / epsilon (the same numbers as NetworkChain.first_passages on the cell's config),
    with T_level ≤ T_strong, and the table names them as loss levels."""
    from dynamics.reduced.network_simulate import NetworkChain
    from dynamics.setup.config import RunConfig
    from sims.io.sweep import read_sweep

    monkeypatch.chdir(tmp_path)
    (tmp_path / "loss.toml").write_text(LOSS_SPEC)
    res = CliRunner().invoke(cli, ["scaling", "loss.toml", "--out", "loss.h5"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "T_(L≤0.1): exact first passage" in res.output
    assert "the exact population loss, checked after every step" in res.output
    with h5py.File("loss.h5", "r") as f:
        t_level, t_strong = f["scaling/t_level"][()], f["scaling/t_strong"][()]
        assert json.loads(f["scaling"].attrs["settings"])["quantity"] == "loss"
        assert "population loss ≤ 0.01" in f["scaling/t_strong"].attrs["description"]
    assert np.isfinite(t_level).all() and np.isfinite(t_strong).all()
    assert np.all(t_level < t_strong) and np.all(t_level > 0)
    _meta, cells = read_sweep("loss.h5")
    for i, cell in enumerate(sorted(cells, key=lambda c: c.config["instance"]["d"])):
        config = RunConfig.from_dict(cell.config)
        want = NetworkChain().first_passages(config, [0.1, 0.01], quantity="loss")
        np.testing.assert_array_equal(t_level[i], want[0])
        np.testing.assert_array_equal(t_strong[i], want[1])
        # the loss passages are not the overlap's: the cell does not record those
        assert "first_passage_0.1" not in cell.traj.extra


@pytest.mark.parametrize("change, message", [
    ({"mode": "trajectory"}, 'quantity = "loss" needs mode = "first_passage"'),
    ({"epsilon": 0.2}, "epsilon (the strong loss level, 0.2) must lie below level (0.1)"),
    ({"quantity": "energy"}, "quantity must be one of overlap, loss, got 'energy'"),
])
def test_bad_loss_scaling_specs(change, message):
    data = base(mode="first_passage", quantity="loss", level=0.1, epsilon=0.01) | {}
    data["scaling"].update(change)
    data["base"]["learner"] = "scratch"
    with pytest.raises(SweepSpecError) as err:
        parse_scaling(data)
    assert message in str(err.value)


def test_loss_levels_need_a_chain_that_checks_the_loss():
    """finetune's rank-1 chain times overlaps only; scratch with free rows has no exact loss
    check: both are one-line errors naming why, before anything runs."""
    data = base(mode="first_passage", quantity="loss", level=0.1, epsilon=0.01)
    with pytest.raises(SweepSpecError, match="times first passages of overlap only, not 'loss'"):
        parse_scaling(data).sweep.cells()
    data["base"] |= {"learner": "scratch", "rows": "free"}
    with pytest.raises(SweepSpecError, match="first_passage_of = 'loss'") as err:
        parse_scaling(data).sweep.cells()
    assert "\n" not in str(err.value)
