"""Trajectory and sweep files as xarray Datasets and pandas frames (issue 18,
:mod:`sims.io.xarray`): values equal the HDF5 arrays, sweeps get their axes as dimensions."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

from dynamics.engines.engine import simulate  # noqa: E402
from dynamics.setup.config import RunConfig  # noqa: E402
from sims.experiments.sweep import run_sweep  # noqa: E402
from sims.experiments.sweep_spec import parse_sweep  # noqa: E402
from sims.io.sweep import finished_cells, read_sweep, rebuild_sweep_file  # noqa: E402
from sims.io.trajectory import read_trajectory, write_trajectory  # noqa: E402
from sims.io.xarray import to_dataframe, to_dataset  # noqa: E402

SPEC = {"activation": "relu", "k": 3, "d": 20, "xi": 1.0, "seed": 9}


def _write(path, **options):
    config = RunConfig(instance=dict(SPEC), eta=0.002, steps=200, runs=4, checkpoints=6,
                       finite_d_theory=False, **options).validate()
    traj = simulate(config)
    write_trajectory(path, traj, config, config.run_instances())
    return path


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("xr") / "lora.h5", learner="lora", rank=2)


def test_trajectory_dataset_equals_the_file(lora_file):
    ds = to_dataset(lora_file)
    with h5py.File(lora_file, "r") as f:
        R, C = f["overlap"].shape
        assert dict(ds.sizes) == {"run": R, "checkpoint": C, "r": 2, "r_student": 2}
        np.testing.assert_array_equal(ds["steps"].values, f["steps"][()])
        for name in ("overlap", "loss", "ode", "m0", "diverged_step"):
            np.testing.assert_array_equal(ds[name].values, f[name][()])
        for name in ("xi", "instance_seed", "instance_index"):
            assert ds[name].dims == ("run",)
            np.testing.assert_array_equal(ds.coords[name].values, f[name][()])
        for name in f["extra"]:
            np.testing.assert_array_equal(ds[name].values, f["extra"][name][()])
        assert ds["singular_values"].dims == ("run", "checkpoint", "r")
        assert ds["overlap_matrix"].dims == ("run", "checkpoint", "r", "r_student")
        assert json.loads(ds.attrs["config"]) == json.loads(f.attrs["config"])
        assert ds.attrs["learner"] == "lora" and ds.attrs["format"] == "loradyn-trajectory"
    last = int(ds["steps"][-1])
    np.testing.assert_array_equal(ds.overlap.sel(steps=last).values, ds.overlap[:, -1].values)
    assert "description" in ds["overlap"].attrs


def test_trajectory_object_and_tuple(lora_file):
    traj, meta = read_trajectory(lora_file)
    bare = to_dataset(traj)
    assert bare.attrs == {}
    np.testing.assert_array_equal(bare.overlap.values, traj.overlap)
    with_meta = to_dataset((traj, meta))
    assert json.loads(with_meta.attrs["config"])["learner"] == "lora"


def test_trajectory_dataframe_is_tidy(lora_file):
    traj, _ = read_trajectory(lora_file)
    df = to_dataframe(lora_file)
    R, C = traj.overlap.shape
    assert len(df) == R * C
    assert list(df.columns[:3]) == ["run", "checkpoint", "steps"]
    row = df[(df.run == 2) & (df.checkpoint == C - 1)].iloc[0]
    assert row.overlap == traj.overlap[2, -1] and row.steps == traj.steps[-1]
    assert row.singular_values_1 == traj.extra["singular_values"][2, -1, 1]
    assert row.overlap_matrix_0_1 == traj.extra["overlap_matrix"][2, -1, 0, 1]
    assert row.m0 == traj.m0[2] and row.xi == 1.0  # per-run values repeated
    small = to_dataframe(lora_file, variables=["loss"])
    assert "loss" in small and "overlap" not in small and "steps" in small


SWEEP = {
    "sweep": {"name": "xr"},
    "base": {"runs": 3, "eta_times_d": 0.05, "steps_per_d": 5, "checkpoints": 5,
             "finite_d_theory": False, "instance": {"activation": "relu", "k": 3, "seed": 1}},
    "axes": {"d": [20, 30], "xi": [0.5, 1.0, 2.0]},
}


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("xr") / "sweep.h5"
    run_sweep(parse_sweep(json.loads(json.dumps(SWEEP))), out)
    return out


def test_sweep_dataset_has_the_axes_as_dimensions(sweep_file):
    ds = to_dataset(sweep_file)
    meta, cells = read_sweep(sweep_file)
    assert ds["overlap"].dims == ("d", "xi", "run", "checkpoint")
    assert dict(ds.sizes) == {"d": 2, "xi": 3, "run": 3, "checkpoint": ds.sizes["checkpoint"]}
    assert list(ds["d"].values) == [20, 30] and list(ds["xi"].values) == [0.5, 1.0, 2.0]
    assert bool(ds["finished"].all())
    # steps = 5·d differ between the d cells: steps is a variable over the axes
    assert ds["steps"].dims == ("d", "xi", "checkpoint")
    for cell in cells:
        sel = ds.sel(d=cell.axes["d"], xi=cell.axes["xi"])
        np.testing.assert_array_equal(sel["overlap"].values, cell.traj.overlap)
        np.testing.assert_array_equal(sel["steps"].values, cell.traj.steps)
        np.testing.assert_array_equal(sel["run_xi"].values, cell.traj.xi)  # renamed: axis xi
        assert json.loads(str(sel["config"].values)) == cell.config
    assert json.loads(ds.attrs["dimensions"]) == meta["dimensions"]


def test_sweep_dataframe_rows(sweep_file):
    df = to_dataframe(sweep_file)
    ds = to_dataset(sweep_file)
    assert len(df) == 2 * 3 * 3 * ds.sizes["checkpoint"]
    assert list(df.columns[:5]) == ["d", "xi", "run", "checkpoint", "steps"]
    assert df["steps"].dtype == np.int64
    medians = df[df.steps == df.groupby("d").steps.transform("max")].groupby(
        ["d", "xi"]).overlap.median()
    assert medians.loc[(20, 1.0)] == pytest.approx(
        float(ds.overlap.sel(d=20, xi=1.0).isel(checkpoint=-1).median()))


def test_unfinished_cells_are_nan_and_dropped(sweep_file, tmp_path):
    spec = parse_sweep(json.loads(json.dumps(SWEEP)))
    cells = spec.cells()
    done = {h: p for h, p in finished_cells(sweep_file).items() if h != cells[0].hash}
    partial = rebuild_sweep_file(tmp_path / "partial.h5", spec, cells, done)
    ds = to_dataset(partial)
    assert not bool(ds["finished"].isel(d=0, xi=0)) and int(ds["finished"].sum()) == 5
    assert np.isnan(ds["overlap"].isel(d=0, xi=0).values).all()
    df = to_dataframe(partial)
    assert len(df) == 5 * 3 * ds.sizes["checkpoint"]
    assert not ((df.d == 20) & (df.xi == 0.5)).any()


def test_not_a_loradyn_file(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(ValueError, match="neither a loradyn trajectory nor a sweep"):
        to_dataset(path)
