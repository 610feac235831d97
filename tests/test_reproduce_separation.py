"""``loradyn reproduce separation``: Claim 2 / Theorem 19 as a reproduce target. On a small
instance (He₃, d = 40, 80, 160, 8 runs,
fine-tuning at η = 0.02/d) the command writes HDF5 (times, medians, CIs, fits,
configs, seeds, dtype/device), a PNG and its README section, and prints the slopes; the stored
first passages are the chains' own; fine-tuning's slope has 1 in its CI and scratch's is
larger; a second run resumes every cell; bad input is a one-line error."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from dynamics.reduced import first_passages_reduced
from dynamics.reduced.network_simulate import NetworkChain
from dynamics.setup.config import RunConfig
from sims.cli import cli
from sims.experiments.figures import separation as target
from sims.experiments.separation import SeparationSpec, spec_for, target_loss
from sims.experiments.separation_record import measure

# fine-tuning at η = 0.02/d: its T/d is nearly flat over d = 40 … 160 (at 0.05/d the
# logarithm of the escape from m₀ ~ d^{-1/2} shows at these d: slope ≈ 1.1)
SMALL = SeparationSpec("he3", (40, 80, 160), 8, c=target.C | {"finetune": 0.02},
                       horizon=target.HORIZON | {"scratch-csq": 2.0})
INTRO = "# results/\n\nCurated outputs; intro kept.\n"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("separation")
    (out / "README.md").write_text(INTRO)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(target, "spec", lambda quick: SMALL)
        args = ["reproduce", "separation", "--quick", "--out-dir", str(out)]
        first = CliRunner().invoke(cli, args, catch_exceptions=False)
        second = CliRunner().invoke(cli, args, catch_exceptions=False)
    return out, first, second


def test_files_hold_the_measurement(made):
    out, first, _ = made
    assert first.exit_code == 0, first.output
    assert (out / "separation_quick.png").stat().st_size > 10_000
    with h5py.File(out / "separation_quick.h5", "r") as f:
        assert f.attrs["format"] == "loradyn-separation" and f.attrs["complete"]
        assert (f.attrs["dtype"], f.attrs["device"], f.attrs["engine"]) == (
            "float64", "cpu", "reduced")
        assert json.loads(f.attrs["config"])["d"] == [40, 80, 160]
        assert sorted(f["series"]) == ["finetune", "scratch", "scratch-csq"]
        for name, g in f["series"].items():
            times = g["times"][:]
            assert times.shape == (3, 8)
            for key in ("d", "median", "median_ci", "never", "horizon_steps", "eta",
                        "target_loss", "seconds"):
                assert key in g, (name, key)
            assert list(g.attrs["seeds"]) == [0, 0, 0]
            configs = [RunConfig.from_dict(c) for c in json.loads(g.attrs["configs"])]
            assert [c.instance["d"] for c in configs] == [40, 80, 160]
            assert all(c.learner == name and c.runs == 8 for c in configs)
            np.testing.assert_array_equal(g["never"][:], np.isnan(times).mean(axis=1))
            t = np.where(np.isnan(times), np.inf, times)
            np.testing.assert_array_equal(g["median"][:], np.median(t, axis=1))
            lo, hi = g["median_ci"][:].T
            assert np.all(lo <= g["median"][:]) and np.all(g["median"][:] <= hi)
        steps = f["series/scratch/horizon_steps"][:]
        np.testing.assert_array_equal(steps, [100 * d * d for d in (40, 80, 160)])


def test_stored_passages_are_the_chains_own(made):
    out, _, _ = made
    with h5py.File(out / "separation_quick.h5", "r") as f:
        ft, sc = f["series/finetune/times"][0], f["series/scratch/times"][0]
    d = 40
    ft_config = RunConfig(instance=spec_for("he3", d), learner="finetune", eta=0.02 / d,
                          steps=400 * d, runs=8, seed=0, engine="reduced",
                          finite_d_theory=False)
    np.testing.assert_array_equal(ft, first_passages_reduced(ft_config, [0.9])[0])
    sc_config = RunConfig(instance=spec_for("he3", d), learner="scratch", eta=0.1 / d ** 1.5,
                          steps=100 * d * d, runs=8, seed=0, engine="reduced",
                          finite_d_theory=False)
    want = NetworkChain().first_passages(sc_config, [target_loss("he3", d)], quantity="loss")
    np.testing.assert_array_equal(sc, want[0])
    assert np.isfinite(sc).all()


def test_slopes_separate(made):
    out, first, _ = made
    with h5py.File(out / "separation_quick.h5", "r") as f:
        ft = json.loads(f["series/finetune"].attrs["fit"])
        sc = json.loads(f["series/scratch"].attrs["fit"])
        csq = json.loads(f["series/scratch-csq"].attrs["fit"])
        csq_never = f["series/scratch-csq/never"][:]
    assert ft["slope_ci"][0] <= 1.0 <= ft["slope_ci"][1]
    assert sc["slope"] > ft["slope_ci"][1]
    assert csq["slope"] is None and np.all(csq_never == 1.0)  # by 2·d²: no run arrives
    lines = first.output.splitlines()
    assert any(ln.strip().startswith(f"finetune    η = 0.02/d, horizon 400·d: slope "
                                     f"{ft['slope']:.2f}") for ln in lines)
    assert any("scratch-csq" in ln and "no fit" in ln and "never arriving 100, 100, 100 %"
               in ln for ln in lines)


def test_readme_section_and_resume(made):
    out, first, second = made
    text = (out / "README.md").read_text()
    assert text.startswith(INTRO) and text.count("## separation (quick)") == 1
    assert "![separation (quick)](separation_quick.png)" in text
    assert f"loradyn reproduce separation --quick --out-dir {out}" in text
    assert second.exit_code == 0, second.output
    assert "resumed: 9 of 9 cells were already computed" in second.output


def test_the_benchmark_records_measure_the_same_runs():
    res = measure("he3", [40, 80], 4, [0.1], 0.05, 100.0, 0, ["scratch"])
    spec = SeparationSpec("he3", (40, 80), 4, learners=("finetune", "scratch"),
                          c={"finetune": 0.05, "scratch": 0.1},
                          horizon={"finetune": 400.0, "scratch": 100.0})
    from sims.experiments.separation import run_separation

    got = run_separation(spec).series
    np.testing.assert_array_equal(np.array(res["times"]["scratch c=0.1"], dtype=float),
                                  got["scratch"].times)
    np.testing.assert_array_equal(np.array(res["times"]["finetune c=0.05"], dtype=float),
                                  got["finetune"].times)
    assert res["fits"]["scratch c=0.1"]["slope"] == pytest.approx(got["scratch"].fit["slope"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(learners=("finetune", "lazy")), "unknown learner 'lazy'; valid: finetune, scratch, "
                                          "scratch-csq"),
    (dict(d=(100, 100)), "a slope in d needs at least two distinct values of d, got [100, 100]"),
    (dict(d=(100,)), "a slope in d needs at least two distinct values of d, got [100]"),
    (dict(runs=1), "runs must be an integer ≥ 2, got 1"),
    (dict(sigma="relu"), "unknown sigma 'relu'; valid: he3, he4"),
])
def test_bad_spec_is_a_one_line_error(kwargs, message):
    base = dict(sigma="he3", d=(40, 80), runs=4, c=dict(target.C), horizon=dict(target.HORIZON))
    with pytest.raises(ValueError) as err:
        SeparationSpec(**(base | kwargs))
    assert str(err.value) == message


def test_missing_constant_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^learner 'scratch': c must be a positive number, "
                                         r"got None$"):
        SeparationSpec("he3", (40, 80), 4, c={"finetune": 0.05}, horizon=dict(target.HORIZON))


def test_cli_refuses_another_convention_and_a_foreign_file(tmp_path):
    res = CliRunner().invoke(cli, ["reproduce", "separation", "--quick", "--out-dir",
                                   str(tmp_path), "--convention", "appB"])
    assert res.exit_code == 1
    assert res.output.strip() == ("Error: separation runs on the Claim 2 instance in the "
                                  "unit-row convention only, not 'appB'")
    (tmp_path / "separation_quick.h5").write_text("not mine")
    res = CliRunner().invoke(cli, ["reproduce", "separation", "--quick", "--out-dir",
                                   str(tmp_path)])
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert "separation_quick.h5 exists" in res.output and "--force" in res.output
    assert (tmp_path / "separation_quick.h5").read_text() == "not mine"


def test_help_lists_the_target():
    res = CliRunner().invoke(cli, ["reproduce", "--help"])
    assert res.exit_code == 0
    assert f"separation  {target.RECIPE.summary}" in res.output
    assert res.output.index("all   every figure above") < res.output.index("separation  ")


def test_show_reads_the_separation_file(made):
    """``loradyn show`` on a separation file: its provenance and the summary lines the
    command printed (slopes with CIs per learner); ``--json`` the series themselves."""
    import json

    out, first, _ = made
    path = str(out / "separation_quick.h5")
    text = CliRunner().invoke(cli, ["show", path])
    assert text.exit_code == 0, text.output
    assert "loradyn_version" in text.output and "slope of median T in d" in text.output
    for name in SMALL.learners:
        assert f"  {name} " in text.output
    data = json.loads(CliRunner().invoke(cli, ["show", path, "--json"]).output)
    assert set(data["series"]) == set(SMALL.learners)
    assert all(len(s["d"]) == len(s["median_steps"]) == len(SMALL.d)
               for s in data["series"].values())
