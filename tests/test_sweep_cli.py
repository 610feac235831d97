"""``loradyn sweep``: output layout, resume, edited files, bad inputs never touch results."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import sweep_toml

from sims.cli import cli
from sims.io.sweep import cell_dir, read_sweep
from sims.io.trajectory import read_trajectory

SPEC = sweep_toml(name="tiny", axes={"xi": [0.5, 1.0], "joint_c": [False, True]}, runs=3,
                  checkpoints=8)


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def sweep_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.toml").write_text(SPEC)
    return tmp_path


def snapshot(path) -> dict:
    """Every cell's arrays and config, by cell name."""
    _, cells = read_sweep(path)
    return {c.name: (c.config, c.axes, c.traj.overlap.copy(), c.traj.loss.copy())
            for c in cells}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][0] == b[name][0] and a[name][1] == b[name][1]
        np.testing.assert_array_equal(a[name][2], b[name][2])
        np.testing.assert_array_equal(a[name][3], b[name][3])


def test_sweep_writes_one_group_per_cell_with_config_and_axes(sweep_dir):
    res = invoke("sweep", "s.toml", "--out", "o.h5")
    assert res.exit_code == 0, res.output
    assert "4 cells, 0 finished, 4 to run in 2 batch(es)" in res.output
    meta, cells = read_sweep("o.h5")
    assert meta["format"] == "loradyn-sweep" and meta["complete"]
    assert meta["n_cells"] == meta["n_finished"] == 4
    assert meta["dimensions"] == {"xi": [0.5, 1.0], "joint_c": [False, True]}
    assert [c.name for c in cells] == ["cell_0000", "cell_0001", "cell_0002", "cell_0003"]
    assert cells[3].axes == {"xi": 1.0, "joint_c": True}
    assert cells[3].config["instance"]["xi"] == 1.0 and cells[3].config["joint_c"] is True
    assert cells[3].traj.overlap.shape == (3, cells[3].traj.steps.size)
    assert cells[3].traj.c_overlap is not None and cells[0].traj.c_overlap is None
    assert np.all(cells[2].traj.xi == 1.0)
    # each finished cell is also a plain trajectory file
    files = sorted(cell_dir("o.h5").glob("*.h5"))
    assert len(files) == 4
    traj, cmeta = read_trajectory(files[0])
    assert cmeta["sweep_cell_hash"].startswith(files[0].stem)


def test_rerun_skips_finished_cells_and_reads_back_identical(sweep_dir):
    invoke("sweep", "s.toml", "--out", "o.h5")
    before = snapshot("o.h5")
    res = invoke("sweep", "s.toml", "--out", "o.h5")
    assert "4 finished, 0 to run" in res.output and "computed 0 cell(s), reused 4" in res.output
    assert_same(before, snapshot("o.h5"))


def test_batched_and_unbatched_runs_agree_in_law_and_shape(sweep_dir):
    invoke("sweep", "s.toml", "--out", "a.h5", "--no-batch")
    a = snapshot("a.h5")
    invoke("sweep", "s.toml", "--out", "b.h5")
    b = snapshot("b.h5")
    assert a.keys() == b.keys()
    # the first cell of each batch sits at run offset 0: same random streams
    np.testing.assert_array_equal(a["cell_0000"][2], b["cell_0000"][2])
    assert all(a[n][2].shape == b[n][2].shape for n in a)


def test_extending_the_grid_keeps_finished_cells(sweep_dir):
    invoke("sweep", "s.toml", "--out", "o.h5")
    before = snapshot("o.h5")
    (sweep_dir / "s.toml").write_text(SPEC.replace("xi = [0.5, 1.0]", "xi = [0.5, 1.0, 2.0]"))
    res = invoke("sweep", "s.toml", "--out", "o.h5")
    assert res.exit_code == 0 and "6 cells, 4 finished, 2 to run" in res.output
    after = snapshot("o.h5")
    assert len(after) == 6
    assert_same(before, {k: after[k] for k in before})


def test_an_edited_sweep_file_is_refused_unless_update(sweep_dir):
    invoke("sweep", "s.toml", "--out", "o.h5")
    before = snapshot("o.h5")
    (sweep_dir / "s.toml").write_text(SPEC.replace("runs = 3", "runs = 4"))
    res = CliRunner().invoke(cli, ["sweep", "s.toml", "--out", "o.h5"])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert lines[-1].startswith("Error: ") and "match no cell" in lines[-1]
    assert "--update" in lines[-1]
    assert_same(before, snapshot("o.h5"))
    res = invoke("sweep", "s.toml", "--out", "o.h5", "--update")
    assert res.exit_code == 0 and "4 stale cell file(s) left aside" in res.output
    after = snapshot("o.h5")
    assert all(v[2].shape[0] == 4 for v in after.values())
    assert len(list(cell_dir("o.h5").glob("*.h5"))) == 8  # the old cells are kept


BAD = {
    "unknown axis": ("[axes]\nxi", "[axes]\nfoo", "unknown axis 'foo'"),
    "empty grid": ("xi = [0.5, 1.0]", "xi = []", "empty grid"),
    "contradiction": ("seed = 1\n[axes]", "seed = 1\nxi = 3.0\n[axes]",
                      "axis 'xi' is also fixed in [base.instance] as 3.0"),
    "invalid value": ("xi = [0.5, 1.0]", "xi = [0.5, -1.0]", "xi"),
    "malformed": ("[axes]", "[axes", "is not valid TOML"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_fail_in_one_line_and_keep_results(sweep_dir, case):
    invoke("sweep", "s.toml", "--out", "o.h5")
    before = snapshot("o.h5")
    stamp = os.stat("o.h5").st_mtime_ns
    old, new, message = BAD[case]
    assert old in SPEC
    (sweep_dir / "bad.toml").write_text(SPEC.replace(old, new, 1))
    res = CliRunner().invoke(cli, ["sweep", "bad.toml", "--out", "o.h5"])
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]
    assert os.stat("o.h5").st_mtime_ns == stamp
    assert_same(before, snapshot("o.h5"))


def test_missing_sweep_file(sweep_dir):
    res = CliRunner().invoke(cli, ["sweep", "nope.toml", "--out", "o.h5"])
    assert res.exit_code == 1 and res.output.startswith("Error: no such sweep file")
    assert not (sweep_dir / "o.h5").exists()


def test_bad_scheduler_is_one_line(sweep_dir):
    res = CliRunner().invoke(cli, ["sweep", "s.toml", "--out", "o.h5", "--scheduler",
                                   "local:0"])
    assert res.exit_code == 1 and "expected local:N" in res.output


def test_dry_run_lists_cells(sweep_dir):
    res = invoke("sweep", "s.toml", "--dry-run")
    assert res.exit_code == 0
    assert res.output.splitlines()[3].startswith("cell_0003")
    assert "xi=1, joint_c=True" in res.output
    assert not (sweep_dir / "results").exists()


def test_default_out_is_under_results(sweep_dir):
    res = invoke("sweep", "s.toml")
    assert res.exit_code == 0 and (sweep_dir / "results" / "s.h5").exists()


def test_a_crash_while_writing_a_cell_leaves_finished_cells_intact(sweep_dir, monkeypatch):
    import sims.io.atomic as sio  # every output is moved into place there

    calls = {"n": 0}
    real = sio.os.replace

    def flaky(src, dst):
        calls["n"] += 1
        if calls["n"] == 4:  # the combined file after cell 1, or the second cell
            raise OSError("disk full (simulated)")
        return real(src, dst)

    monkeypatch.setattr(sio.os, "replace", flaky)
    res = CliRunner().invoke(cli, ["sweep", "s.toml", "--out", "o.h5", "--no-batch"])
    assert res.exit_code == 1 and "disk full" in res.output
    monkeypatch.setattr(sio.os, "replace", real)
    leftovers = [p.name for p in sweep_dir.rglob(".*.h5")]
    assert leftovers == []
    done = sorted(p for p in cell_dir("o.h5").glob("*.h5"))
    assert 1 <= len(done) <= 2
    for p in done:
        with h5py.File(p, "r") as f:
            assert f.attrs["complete"]
    res = invoke("sweep", "s.toml", "--out", "o.h5", "--no-batch")
    assert res.exit_code == 0 and f"{len(done)} finished" in res.output
    invoke("sweep", "s.toml", "--out", "ref.h5", "--no-batch")
    assert_same(snapshot("ref.h5"), snapshot("o.h5"))


def test_exact_first_passage_is_split_per_cell_of_a_batch(tmp_path):
    from sims.experiments.sweep import run_sweep
    from sims.experiments.sweep_spec import parse_sweep

    spec = parse_sweep({
        "sweep": {"first_passage": [0.3]},
        "base": {"runs": 3, "eta_times_d": 0.1, "steps_per_d": 40, "checkpoints": 20,
                 "spacing": "linear", "engine": "auto",
                 "instance": {"activation": "relu", "k": 3, "d": 30, "c_hat": "teacher"}},
        "axes": {"xi": [1.0, 2.0]}})
    result = run_sweep(spec, tmp_path / "o.h5")
    assert result.batches == 1 and result.computed == 2
    _, cells = read_sweep(tmp_path / "o.h5")
    for cell in cells:
        t = cell.traj
        exact = t.extra["first_passage_0.3"]
        assert exact.shape == (3,) and t.engine == "reduced"
        if t.ode_corrected is not None:  # per-run theory arrays are split with the runs
            assert t.ode_corrected.shape == t.overlap.shape == t.band_lower.shape
        hit = np.abs(t.overlap) >= 0.3
        from_checkpoints = np.where(hit.any(1), t.steps[np.argmax(hit, 1)], np.inf)
        assert np.all(exact[np.isfinite(exact)] <= from_checkpoints[np.isfinite(exact)])
        assert np.all(np.isfinite(exact) | ~np.isfinite(from_checkpoints))


def test_refuses_to_overwrite_a_file_that_is_not_a_sweep(sweep_dir):
    (sweep_dir / "i.toml").write_text('activation = "relu"\nk = 3\nd = 20\n')
    res = invoke("run", "i.toml", "--out", "run.h5", "--runs", "2", "--steps", "20")
    assert res.exit_code == 0, res.output
    before = (sweep_dir / "run.h5").read_bytes()
    (sweep_dir / "text.h5").write_text("precious notes")
    for name, fmt in (("run.h5", "loradyn-trajectory"), ("text.h5", "not a readable HDF5")):
        res = CliRunner().invoke(cli, ["sweep", "s.toml", "--out", name])
        assert res.exit_code == 1 and "is not a loradyn sweep file" in res.output
        assert fmt in res.output
    assert (sweep_dir / "run.h5").read_bytes() == before
    assert (sweep_dir / "text.h5").read_text() == "precious notes"
