"""``loradyn bench hermite`` runs end to end at small sizes; the three evaluations agree."""

import json

from click.testing import CliRunner

from sims.cli import cli


def test_bench_hermite_small():
    args = ["bench", "hermite", "--k", "6", "--pmax", "12", "--n-series", "2000",
            "--n-direct", "200", "--n-numpy", "50", "--repeat", "1", "--ode-runs", "8",
            "--ode-steps", "1000", "--json"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out["evals_per_s"]) == {"series", "direct_numba", "numpy_direct"}
    assert all(v > 0 for v in out["evals_per_s"].values())
    assert out["max_rel_diff_vs_numpy"]["series"] < 1e-12
    assert out["max_rel_diff_vs_numpy"]["direct_numba"] < 1e-12
    assert out["ode"]["table_max_error"] < 1e-8
    text = CliRunner().invoke(cli, args[:-1]).output
    assert "series/numpy" in text
