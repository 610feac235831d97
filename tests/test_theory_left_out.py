"""A theory line that fails numerically never takes the runs down (issue 40, item 1): the
corrected ODE's integrator is made to return NaN (or the plain ODE to fail), and the run,
its file and its figure are still written, exit status 0, the line left out with its reason
in the HDF5 attribute the budget skip uses, one note on stderr and an entry in the legend."""

from __future__ import annotations

import dataclasses

import h5py
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import hermite  # noqa: E402
import hermite.finetune.population as fp  # noqa: E402
from dynamics.engines.engine import simulate  # noqa: E402
from dynamics.setup.config import RunConfig  # noqa: E402
from sims.cli import cli  # noqa: E402
from sims.experiments.figures import FIGURES, fig3  # noqa: E402
from sims.experiments.reproduce import render  # noqa: E402
from sims.plots.curves import Curve, load_curves, no_theory_reason, theory_notes  # noqa: E402

LEFT_OUT = "finite-d corrected ODE left out: its integration failed"


@pytest.fixture
def nan_integrator(monkeypatch):
    """The corrected flow's RK4 step returns NaN (every corrected ODE and joint band)."""
    def nan_step(fun, t, y, dt):
        return np.full_like(y, np.nan), fun(t, y)

    monkeypatch.setattr(fp, "rk4_step", nan_step)


def _left_out(output: str) -> str:
    """The one stderr note of the corrected ODE left out (its band, on the same flow, has its
    own), with the note of every other line left out."""
    notes = dict.fromkeys(ln.removeprefix("note: ") for ln in output.splitlines()
                          if "left out" in ln)
    assert all(n.startswith(("finite-d corrected ODE", "linear-noise band")) for n in notes)
    corrected = [n for n in notes if n.startswith(LEFT_OUT)]
    assert len(corrected) == 1, notes
    return corrected[0]


def test_run_with_a_failing_corrected_ode_keeps_the_run_and_says_why(runner, nan_integrator):
    args = ["run", "spec.toml", "--steps", "200", "--runs", "4", "--checkpoints", "8",
            "--joint-c", "--out", "j.h5", "--plot", "j.png"]
    res = runner.invoke(cli, args)
    assert res.exit_code == 0, res.output
    why = _left_out(res.output)
    assert why.startswith(f"{LEFT_OUT} (runs 0…3: the corrected ODE left the finite numbers")
    assert res.output.count(f"note: {why}") == 2  # the run's, and the plot's legend note
    with h5py.File("j.h5", "r") as f:
        assert "ode_corrected" not in f and "ode_corrected_c_overlap" not in f["extra"]
        assert f["ode"].attrs["corrected"] == why
        assert f["extra/ode_c_overlap"].attrs["corrected"] == f["ode"].attrs["corrected"]
        assert np.isfinite(f["ode"][()]).all() and np.isfinite(f["overlap"][()]).all()
    curves = load_curves(["j.h5"])
    for quantity in ("overlap", "c_overlap"):
        assert any(n.startswith(LEFT_OUT) for n in theory_notes(curves, quantity))
    res = runner.invoke(cli, ["plot", "j.h5", "--out", "p.png"])
    assert res.exit_code == 0 and f"note: {LEFT_OUT}" in res.output


def test_a_failing_plain_ode_is_no_theory_with_its_reason(monkeypatch, capsys):
    def plain_fails(*args, corrected=False, **kwargs):
        if not corrected:
            raise ArithmeticError("finetune_ode: the solver failed (injected)")
        return fp.finetune_ode(*args, corrected=corrected, **kwargs)

    monkeypatch.setattr(hermite, "finetune_ode", plain_fails)
    spec = dict(activation="relu", k=3, d=20, xi=1.0, seed=9)
    tr = simulate(RunConfig(instance=spec, eta=0.002, steps=200, runs=4, seed=3,
                            checkpoints=5, joint_c=True))
    assert np.isnan(tr.ode).all() and np.isfinite(tr.overlap).all()
    assert np.isfinite(tr.ode_corrected).all()  # the other lines are kept
    why = tr.extra_attrs["ode"]["no_theory"]
    assert why.startswith("population ODE left out: its integration failed (runs 0…3")
    assert no_theory_reason(Curve(tr), "overlap") is None  # the corrected line is drawn
    assert why in theory_notes([Curve(tr)], "overlap")
    tr.ode_corrected = None  # without it, the reason is the curve's
    assert no_theory_reason(Curve(tr), "overlap") == why
    assert theory_notes([Curve(tr)], "overlap")[0] == f"no theory line: {why}"
    assert f"note: {why}" in capsys.readouterr().err


def test_a_failing_band_of_the_frozen_map_is_left_out(monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise ValueError("rho contains NaN or Inf")

    monkeypatch.setattr(hermite, "theory_band", fail)
    spec = dict(activation="relu", k=3, d=20, xi=1.0, seed=9)
    tr = simulate(RunConfig(instance=spec, eta=0.002, steps=200, runs=4, seed=3,
                            checkpoints=5))
    assert np.isfinite(tr.ode).all() and np.isfinite(tr.ode_corrected).all()
    assert np.isnan(tr.band_lower).all() and np.isfinite(tr.overlap).all()
    why = ("linear-noise band left out: its integration failed (runs 0…3: rho contains NaN "
           "or Inf)")
    assert tr.extra_attrs["ode"] == {"band": why}
    assert capsys.readouterr().err.strip() == f"note: {why}"
    assert why in theory_notes([Curve(tr)], "overlap")


def tiny_fig3(quick: bool) -> dict:
    spec = fig3.sweep(quick)
    spec["base"] |= {"runs": 3, "steps_per_d": 20, "checkpoints": 8, "eta_times_d": 0.05}
    spec["base"]["instance"] |= {"d": 20, "k": 4, "xi": 2.0}
    return spec


def test_reproduce_with_a_failing_theory_line_draws_the_figure(tmp_path, monkeypatch,
                                                                nan_integrator):
    monkeypatch.setitem(FIGURES, "fig3", dataclasses.replace(FIGURES["fig3"], sweep=tiny_fig3))
    args = ["reproduce", "fig3", "--quick", "--out-dir", str(tmp_path), "--no-readme"]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "fig3_quick.png").stat().st_size > 1000
    why = _left_out(res.output)
    assert res.output.count(f"note: {why}") == 1
    with h5py.File(tmp_path / "fig3_quick.h5", "r") as f:
        cells = [f["cells"][n] for n in f["cells"] if "ode_c_overlap" in f["cells"][n]["extra"]]
        assert len(cells) == 1 and cells[0]["ode"].attrs["corrected"] == why
    fig = render(FIGURES["fig3"], tmp_path / "fig3_quick.h5", True)
    texts = [t.get_text().replace("\n", " ") for t in fig.axes[1].get_legend().get_texts()]
    assert why[:120] in " ".join(texts)
    assert any(ln.get_linestyle() == "--" for ln in fig.axes[1].get_lines())  # plain ODE
    plt.close(fig)
