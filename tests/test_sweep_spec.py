"""Sweep files: parsing, the grid of cells, hashes, batching, and every malformed input."""

from __future__ import annotations

import math

import pytest

from sims.experiments.sweep_batch import plan_batches
from sims.experiments.sweep_spec import AXES, SweepSpecError, load_sweep, parse_sweep

BASE = {"runs": 2, "eta_times_d": 0.05, "steps_per_d": 2, "checkpoints": 5,
        "instance": {"activation": "relu", "k": 3, "d": 20, "seed": 1}}


def spec(axes=None, cases=None, **base):
    merged = {k: v for k, v in {**BASE, **base}.items() if v is not None}
    data = {"base": merged, "axes": axes if axes is not None else {"xi": [0.5, 1.0]}}
    if cases is not None:
        data["cases"] = cases
    return data


def test_cells_are_the_cartesian_product_in_file_order():
    s = parse_sweep(spec({"xi": [0.5, 1.0, 2.0], "activation": ["relu", "he3"]}))
    cells = s.cells()
    assert len(cells) == 6
    assert [c.axes for c in cells[:3]] == [{"xi": 0.5, "activation": "relu"},
                                           {"xi": 0.5, "activation": "he3"},
                                           {"xi": 1.0, "activation": "relu"}]
    assert cells[1].config.instance["activation"] == "he3"
    assert cells[1].config.instance["xi"] == 0.5
    assert [c.name for c in cells[:2]] == ["cell_0000", "cell_0001"]
    assert len({c.hash for c in cells}) == 6


def test_derived_step_size_and_horizon_follow_d():
    cells = parse_sweep(spec({"d": [20, 40]})).cells()
    assert [c.config.eta for c in cells] == [0.05 / 20, 0.05 / 40]
    assert [c.config.steps for c in cells] == [40, 80]


def test_cases_multiply_the_axes_and_can_link_settings():
    s = parse_sweep(spec({"xi": [1.0, 2.0]},
                         cases=[{"activation": "relu", "eta_times_d": 0.1},
                                {"activation": "he3", "eta_times_d": 0.01}],
                         eta_times_d=None))
    cells = s.cells()
    assert len(cells) == 4
    assert cells[1].axes == {"xi": 1.0, "activation": "he3", "eta_times_d": 0.01}
    assert math.isclose(cells[1].config.eta, 0.01 / 20)
    assert s.dimensions()["case"] == ["activation=relu, eta_times_d=0.1",
                                      "activation=he3, eta_times_d=0.01"]


def test_config_and_instance_axes_and_instance_seed():
    s = parse_sweep(spec({"joint_c": [True, False], "instance_seed": [1, 4], "seed": [0, 1],
                          "W": ["orthonormal", "separated"], "u_alpha": [0.0, 0.5],
                          "project": [True, False], "eta": [1e-3, 2e-3]},
                         eta_times_d=None))
    cells = s.cells()
    assert len(cells) == 128
    c = cells[-1]
    assert c.config.options.joint_c is False and c.config.options.project is False
    assert c.config.instance["seed"] == 4 and c.config.seed == 1
    assert c.config.instance["W"] == "separated" and c.config.instance["u_alpha"] == 0.5


def test_hash_depends_on_the_config_only():
    a = parse_sweep(spec({"xi": [0.5, 1.0]})).cells()
    b = parse_sweep(spec({"xi": [1.0, 0.5, 2.0]})).cells()
    assert a[0].hash == b[1].hash and a[1].hash == b[0].hash
    c = parse_sweep(spec({"xi": [0.5, 1.0]}, runs=3)).cells()
    assert c[0].hash != a[0].hash


def test_batches_group_cells_that_differ_in_xi_or_instance_seed_only():
    s = parse_sweep(spec({"xi": [0.5, 1.0], "instance_seed": [1, 2], "joint_c": [True, False]}))
    cells = s.cells()
    batches = plan_batches(cells)
    assert len(batches) == 2
    assert all(len(b.cells) == 4 for b in batches)
    assert {c.config.options.joint_c for c in batches[0].cells} == {True}
    assert batches[0].offsets == [0, 2, 4, 6]
    config = batches[0].config
    assert config.runs == 8 and len(config.run_instances()) == 8
    assert [i.xi for i in config.run_instances()] == [0.5, 0.5, 0.5, 0.5, 1, 1, 1, 1]
    assert len(plan_batches(cells, batch=False)) == 8
    assert all(len(b.cells) <= 2 for b in plan_batches(cells, max_runs=4))


def test_instance_may_be_a_path(tmp_path):
    (tmp_path / "inst.toml").write_text('activation = "relu"\nk = 3\nd = 20\n')
    (tmp_path / "s.toml").write_text(
        '[base]\ninstance = "inst.toml"\neta = 0.001\nsteps = 10\n[axes]\nxi = [1.0, 2.0]\n')
    cells = load_sweep(tmp_path / "s.toml").cells()
    assert cells[1].config.instance == {"activation": "relu", "k": 3, "d": 20, "xi": 2.0}


@pytest.mark.parametrize("data, message", [
    (spec({"foo": [1]}), "unknown axis 'foo'"),
    (spec({"xi": []}), "empty grid: axis 'xi' has no values"),
    (spec({}), "empty grid"),
    (spec({"xi": 1.0}), "must be a list"),
    (spec({"xi": [1.0, 1.0]}), "repeats a value"),
    (spec({"d": [20, 40]}, instance={"activation": "relu", "k": 3, "d": 30}),
     "axis 'd' is also fixed in [base.instance]"),
    (spec({"runs": [2, 4]}, runs=3), "axis 'runs' is also fixed in [base]"),
    (spec({"eta": [0.1]}), "'eta' and 'eta_times_d' are both given"),
    (spec({"xi": [1.0]}, cases=[{"xi": 2.0}]), "both an axis and a [[cases]] key"),
    (spec({"xi": [1.0]}, cases=[{"runs": 3}]), "also fixed in [base] as 2, which no case"),
    (spec({"xi": [1.0]}, cases=[{"bogus": 2}]), "case 0: unknown key 'bogus'"),
    (spec({"xi": [1.0]}, cases=[{}]), "case 0 is empty"),
    (spec({"xi": [1.0]}, xi_values=[1.0]), "'xi_values' is not allowed"),
    (spec({"xi": [1.0]}, bogus=1), "unknown [base] key 'bogus'"),
    ({"base": BASE, "axes": {"xi": [1.0]}, "extra": {}}, "unknown top-level table 'extra'"),
    ({"base": {"runs": 2}, "axes": {"xi": [1.0]}}, "[base.instance] is required"),
    ({"base": BASE, "axes": {"xi": [1.0]}, "sweep": {"first_passage": "x"}},
     "first_passage must be a list"),
    ({"base": BASE, "axes": {"xi": [1.0]}, "sweep": {"trajectory": False}},
     "trajectory = false records only first passages: give first_passage levels"),
    ({"base": BASE, "axes": {"xi": [1.0]}, "sweep": {"trajectory": "no"}},
     "trajectory must be true or false"),
    ({"base": BASE | {"engine": "full"}, "axes": {"xi": [1.0]},
      "sweep": {"trajectory": False, "first_passage": [0.5]}},
     "trajectory = false needs the reduced engine"),
])
def test_malformed_sweep_files_name_the_problem(data, message):
    with pytest.raises(SweepSpecError, match="^sweep") as err:
        parse_sweep(data).cells()
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("axes, message", [
    ({"xi": [-1.0]}, "sweep cell 0 (xi=-1)"),
    ({"W": ["nope"]}, "key 'W': unknown generator 'nope'"),
    ({"joint_c": ["yes"]}, "'joint_c' must be true or false"),
    ({"steps_per_d": [0, 2]}, "'steps_per_d' must be a number > 0"),
    ({"learner": ["nope"]}, "unknown learner 'nope'"),
])
def test_invalid_values_fail_naming_the_cell(axes, message):
    with pytest.raises(SweepSpecError) as err:
        parse_sweep(spec(axes)).cells()
    assert message in str(err.value)


def test_missing_step_size_is_an_error():
    data = spec({"xi": [1.0]})
    del data["base"]["eta_times_d"]
    with pytest.raises(SweepSpecError, match="give 'eta' or 'eta_times_d'"):
        parse_sweep(data).cells()


def test_file_errors(tmp_path):
    with pytest.raises(SweepSpecError, match="no such sweep file"):
        load_sweep(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[base\nruns = 2")
    with pytest.raises(SweepSpecError, match="is not valid TOML"):
        load_sweep(bad)


def test_axis_names_cover_the_issue():
    for name in ("d", "k", "xi", "activation", "W", "c", "u_alpha", "learner", "joint_c",
                 "project", "eta", "seed", "instance_seed"):
        assert name in AXES


def test_example_files_parse():
    from pathlib import Path

    from sims.experiments.scaling import load_scaling

    root = Path(__file__).resolve().parent.parent / "examples"
    sweeps = sorted(root.glob("sweep_*.toml"))
    scalings = sorted(root.glob("scaling_*.toml"))
    assert sweeps and scalings
    for path in sweeps:
        assert load_sweep(path).cells()
    for path in scalings:
        spec = load_scaling(path)
        cells = spec.sweep.cells()
        assert [c.config.instance["d"] for c in cells] == spec.d
        assert all(c.config.eta * c.config.instance["d"] ** spec.eta_exponent
                   == pytest.approx(spec.c) for c in cells)


def test_first_passage_only_cells_hash_apart_and_batch_apart():
    traj = parse_sweep({"base": BASE | {"engine": "reduced"}, "axes": {"xi": [1.0]},
                        "sweep": {"first_passage": [0.5]}}).cells()
    fp = parse_sweep({"base": BASE | {"engine": "reduced"}, "axes": {"xi": [1.0]},
                      "sweep": {"first_passage": [0.5], "trajectory": False}}).cells()
    assert traj[0].trajectory and not fp[0].trajectory
    assert traj[0].hash != fp[0].hash
    assert len(plan_batches(traj + fp)) == 2
