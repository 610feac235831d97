"""``--scheduler local:2``: cells run on a dask LocalCluster, the client writes them; the
numbers equal the in-process run (same batch plan, same random streams)."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import sweep_toml

from sims.cli import cli
from sims.io.sweep import read_sweep

pytest.importorskip("dask.distributed")

SPEC = sweep_toml(axes={"xi": [0.5, 1.0], "joint_c": [False, True]})


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                            "ignore::ResourceWarning", "ignore::RuntimeWarning",
                            "ignore::pytest.PytestUnraisableExceptionWarning")
def test_local_cluster_matches_in_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.toml").write_text(SPEC)
    runner = CliRunner()
    res = runner.invoke(cli, ["sweep", "s.toml", "--out", "dask.h5", "--scheduler", "local:2"],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "computed 4 cell(s)" in res.output
    runner.invoke(cli, ["sweep", "s.toml", "--out", "local.h5"], catch_exceptions=False)
    _, a = read_sweep("dask.h5")
    _, b = read_sweep("local.h5")
    assert [c.name for c in a] == [c.name for c in b] == [f"cell_000{i}" for i in range(4)]
    for x, y in zip(a, b, strict=True):
        assert x.config == y.config
        np.testing.assert_array_equal(x.traj.overlap, y.traj.overlap)
        np.testing.assert_array_equal(x.traj.loss, y.traj.loss)


def test_unreachable_scheduler_is_one_line(tmp_path, monkeypatch):
    import sims.experiments.sweep

    monkeypatch.setattr(sims.experiments.sweep, "CONNECT_TIMEOUT", "1s")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.toml").write_text(SPEC)
    res = CliRunner().invoke(cli, ["sweep", "s.toml", "--out", "o.h5", "--scheduler",
                                   "tcp://127.0.0.1:9"])
    assert res.exit_code == 1
    assert res.output.startswith("Error: cannot reach dask scheduler tcp://127.0.0.1:9")
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "o.h5").exists()
