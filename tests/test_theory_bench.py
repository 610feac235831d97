"""``loradyn bench theory`` runs end to end at small sizes: both rates and their ratio print,
and the fast path agrees with the adaptive reference on the shared states."""

import json

from click.testing import CliRunner

from sims.cli import cli


def test_bench_theory_small():
    args = ["bench", "theory", "--activation", "sigmoid", "--n-fast", "40", "--n-reference",
            "4", "--repeat", "1"]
    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["activation"] == "sigmoid" and out["states"] == {"fast": 40, "reference": 4}
    assert all(v > 0 for v in out["moments_per_s"].values()) and out["ratio"] > 0
    assert out["max_abs_diff"] < 1e-9
    text = CliRunner().invoke(cli, args).output
    assert "fast/reference" in text and "states/s" in text
    bad = CliRunner().invoke(cli, ["bench", "theory", "--activation", "abs"])
    assert bad.exit_code != 0 and "no fast path" in bad.output
