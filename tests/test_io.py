"""HDF5 trajectory files: round trip, provenance, atomic writes, clear errors."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from dynamics.engines.engine import simulate
from dynamics.setup.config import RunConfig
from sims.io import trajectory as io


@pytest.fixture(scope="module")
def run_and_traj():
    config = RunConfig(instance={"activation": "relu", "k": 3, "d": 20, "xi": 1.0, "seed": 1},
                       eta=0.002, steps=200, runs=4, seed=2, checkpoints=6, joint_c=True,
                       instance_seeds="per_run", xi_values=[1.0, 2.0])
    return config, simulate(config)


def test_round_trip_and_provenance(tmp_path, run_and_traj):
    config, traj = run_and_traj
    path = io.write_trajectory(tmp_path / "a.h5", traj, config, config.run_instances())
    back, meta = io.read_trajectory(path)
    for name in ("steps", "overlap", "loss", "ode", "c_overlap", "diverged_step", "xi",
                 "instance_seed", "m0"):
        np.testing.assert_array_equal(getattr(back, name), getattr(traj, name))
    assert meta["format"] == io.FORMAT and meta["format_version"] == io.FORMAT_VERSION
    assert meta["seed"] == 2 and meta["dtype"] == "float64" and meta["engine"] == "full"
    assert meta["learner"] == "finetune" and meta["loss_kind"] == "exact"
    assert meta["git_commit"] and meta["loradyn_version"] and meta["created"]
    cfg = meta["config"]
    assert cfg["eta"] == 0.002 and cfg["xi_values"] == [1.0, 2.0]
    assert len(cfg["resolved_instances"]) == 4  # per_run seeds × ξ: four distinct instances
    assert {"values", "W", "c_hat"} <= set(cfg["resolved_instances"][0])
    rebuilt = RunConfig.from_dict(cfg)
    assert rebuilt == config
    with h5py.File(path) as f:
        assert f["overlap"].shape == (4, traj.steps.size) and f["overlap"].dtype == np.float64
        assert f["instance_index"][()].tolist() == [0, 1, 2, 3]
        assert "description" in f["loss"].attrs


def test_same_config_same_file_contents(tmp_path, run_and_traj):
    config, _ = run_and_traj
    paths = [tmp_path / f"{i}.h5" for i in range(2)]
    for p in paths:
        io.write_trajectory(p, simulate(config), config, config.run_instances())
    (a, ma), (b, mb) = (io.read_trajectory(p) for p in paths)
    ma.pop("created"), mb.pop("created")
    assert ma == mb
    with h5py.File(paths[0]) as fa, h5py.File(paths[1]) as fb:
        assert sorted(fa) == sorted(fb)
        names = []
        fa.visititems(lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) else None)
        for name in names:
            np.testing.assert_array_equal(fa[name][()], fb[name][()])


def test_failed_write_keeps_the_old_file(tmp_path, run_and_traj, monkeypatch):
    config, traj = run_and_traj
    path = io.write_trajectory(tmp_path / "keep.h5", traj, config, config.run_instances())
    before = path.read_bytes()

    def boom(f, name, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "write_array", boom)
    with pytest.raises(KeyboardInterrupt):
        io.write_trajectory(path, traj, config, config.run_instances())
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["keep.h5"]  # no temporary file left behind


def test_clear_errors(tmp_path, run_and_traj):
    config, traj = run_and_traj
    good = io.write_trajectory(tmp_path / "g.h5", traj, config, config.run_instances())
    cases = {}
    (tmp_path / "text.h5").write_text("not hdf5 at all\n")
    cases["text.h5"] = "not an HDF5 file"
    (tmp_path / "cut.h5").write_bytes(good.read_bytes()[:3000])
    cases["cut.h5"] = "truncated or half-written"
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["x"] = [1, 2]
    cases["foreign.h5"] = "not a loradyn trajectory"
    with h5py.File(tmp_path / "half.h5", "w") as f:
        io.write_info(f, {})
    cases["half.h5"] = "half-written"
    cases["missing.h5"] = "no such file"
    for name, message in cases.items():
        with pytest.raises(io.TrajectoryFileError, match=message) as err:
            io.read_trajectory(tmp_path / name)
        assert "\n" not in str(err.value)


def test_check_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        io.check_writable(tmp_path / "file" / "out.h5")
    with pytest.raises(IsADirectoryError):
        io.check_writable(tmp_path)
    assert io.check_writable(tmp_path / "new" / "out.h5").parent.is_dir()


def test_schema_doc_lists_every_dataset():
    doc = (io.Path(io.__file__).resolve().parents[2] / "docs" / "hdf5-schema.md").read_text()
    for name in io.DATASETS:
        assert f"`{name}`" in doc
    for attr in io.STRING_ATTRS + ("format_version", "seed", "complete"):
        assert f"`{attr}`" in doc
    assert json.dumps(io.FORMAT) in doc or io.FORMAT in doc
