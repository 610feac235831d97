"""``loradyn hermite coeffs|h|ode`` through click's CliRunner, including every bad input."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dynamics.instances.instance import load_instance
from hermite import h, hermite_coefficients, population_ode, truncation_bound
from sims.cli import cli


@pytest.fixture
def runner():
    return CliRunner()


def _spec(tmp_path, name="spec.json", **kw):
    spec = {"activation": "relu", "k": 5, "d": 100, "xi": 1.0, "seed": 2}
    spec.update(kw)
    path = tmp_path / name
    path.write_text(json.dumps(spec))
    return str(path)


def _ok(result):
    assert result.exit_code == 0, result.output
    return result.output


def _one_line_error(result, code=1):
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    lines = [ln for ln in result.output.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1
    return lines[0]


def test_coeffs_json_and_table(runner):
    out = json.loads(_ok(runner.invoke(cli, ["hermite", "coeffs", "--activation", "relu",
                                             "--pmax", "10", "--json"])))
    assert out["activation"] == "relu"
    np.testing.assert_allclose(out["mu"], hermite_coefficients("relu", 10), rtol=1e-15)
    assert -0.01 < out["parseval_residual"] < 0
    text = _ok(runner.invoke(cli, ["hermite", "coeffs", "-a", "tanh", "--pmax", "3"]))
    assert "quadrature" in text and "parseval" in text and len(text.splitlines()) == 7


def test_h_json_matches_library(runner, tmp_path):
    path = _spec(tmp_path)
    inst = load_instance(path)
    out = json.loads(_ok(runner.invoke(cli, ["hermite", "h", path, "--m", "-0.5", "--m", "0.3",
                                             "--json"])))
    assert out["m"] == [-0.5, 0.3]
    np.testing.assert_allclose(out["h"], h(inst, [-0.5, 0.3]), rtol=1e-15)
    out = json.loads(_ok(runner.invoke(cli, ["hermite", "h", path, "--m", "0.2", "--method",
                                             "series", "--pmax", "20", "--json"])))
    assert out["truncation_bound"] == pytest.approx(truncation_bound(inst, 20))
    assert abs(out["h"][0] - float(h(inst, 0.2))) <= out["truncation_bound"]
    text = _ok(runner.invoke(cli, ["hermite", "h", path, "--m", "0.1", "--method", "direct"]))
    assert "direct" in text


def test_h_toml_spec(runner, tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text('activation = "he3"\nk = 5\nxi = 2.0\nseed = 1\n')  # odd k: Σcĉ ≠ 0
    out = json.loads(_ok(runner.invoke(cli, ["hermite", "h", str(path), "--m", "0", "--json"])))
    assert out["h0_sign"] in (-1, 1)


def test_ode_json(runner, tmp_path):
    path = _spec(tmp_path, u_alpha=0.5)  # u⊥ ≈ 0.866 < 0.9: that level is never reached
    inst = load_instance(path)
    s = out_sign = 1 if float(h(inst, 0.0)) > 0 else -1
    res = runner.invoke(cli, ["hermite", "ode", path, "--eta", "1e-2", "--steps", "20000",
                              "--m0", str(0.05 * s), "--json"])
    out = json.loads(_ok(res))
    steps = np.array(out["steps"])
    assert steps[0] == 0 and steps[-1] == 20000 and np.all(np.diff(steps) > 0)
    np.testing.assert_allclose(out["m"], population_ode(inst, 1e-2, [0.05 * s], steps),
                               rtol=1e-14)
    assert out["steps_to_reach"]["0.9"] == [None]
    assert out["steps_to_reach_discrete"]["0.9"] == [None]
    t5 = out["steps_to_reach"]["0.5"][0]
    assert t5 > 0 and abs(out["steps_to_reach_discrete"]["0.5"][0] - t5) < 0.05 * t5 + 2
    assert out["h0_sign"] == out_sign
    text = _ok(runner.invoke(cli, ["hermite", "ode", path, "--eta", "1e-2", "--steps", "100"]))
    assert "steps to reach |m| = 0.9: continuous never" in text


@pytest.mark.parametrize(("args", "needle"), [
    (["hermite", "coeffs", "--activation", "swish"], "valid names: relu"),
    (["hermite", "coeffs", "--activation", "he", "--json"], "valid names"),
])
def test_coeffs_errors(runner, args, needle):
    assert needle in _one_line_error(runner.invoke(cli, args))


def test_pmax_negative(runner, tmp_path):
    res = runner.invoke(cli, ["hermite", "coeffs", "--pmax", "-1"])
    assert res.exit_code == 2 and "--pmax" in res.output
    res = runner.invoke(cli, ["hermite", "h", _spec(tmp_path), "--m", "0", "--pmax", "-3"])
    assert res.exit_code == 2 and "--pmax" in res.output


@pytest.mark.parametrize(("spec", "needle"), [
    (dict(activation="softsign"), "valid names"),
    (dict(k=8, d=6, W="orthonormal"), "key 'd'"),  # k > d (caught as d < k + 2)
    (dict(xi=-1.0), "'xi'"),
    (dict(u_alpha=1.0), "u_alpha"),
])
def test_bad_specs(runner, tmp_path, spec, needle):
    path = _spec(tmp_path, **spec)
    line = _one_line_error(runner.invoke(cli, ["hermite", "h", path, "--m", "0.1"]))
    assert needle in line
    line = _one_line_error(runner.invoke(cli, ["hermite", "ode", path, "--eta", "0.1"]))
    assert needle in line


def test_malformed_and_missing_spec(runner, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"activation": "relu", "k": 3,')
    assert "not valid JSON" in _one_line_error(runner.invoke(cli, ["hermite", "h", str(bad),
                                                                   "--m", "0"]))
    missing = str(tmp_path / "missing.json")
    assert "no such file" in _one_line_error(runner.invoke(cli, ["hermite", "h", missing,
                                                                "--m", "0"]))
    assert "no such file" in _one_line_error(runner.invoke(cli, ["hermite", "ode", missing,
                                                                "--eta", "0.1"]))


def test_bad_numbers(runner, tmp_path):
    path = _spec(tmp_path)
    line = _one_line_error(runner.invoke(cli, ["hermite", "h", path, "--m", "1.5"]))
    assert "[-1, 1]" in line
    line = _one_line_error(runner.invoke(cli, ["hermite", "h", path, "--m", "-2"]))
    assert "[-1, 1]" in line
    for eta in ("0", "-1e-3"):
        res = runner.invoke(cli, ["hermite", "ode", path, "--eta", eta])
        assert _one_line_error(res, code=2).startswith("Error: Invalid value for '--eta'")
    line = _one_line_error(runner.invoke(cli, ["hermite", "ode", path, "--eta", "0.1",
                                               "--m0", "1.2"]))
    assert "m0" in line
    res = runner.invoke(cli, ["hermite", "h", path])
    assert res.exit_code == 2 and "--m" in res.output
