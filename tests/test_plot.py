"""``loradyn plot``: curves, bands, ODE lines, labels, hue/facet, formats, bad inputs."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from dynamics.config import RunConfig  # noqa: E402
from dynamics.engine import simulate  # noqa: E402
from sims.cli import cli  # noqa: E402
from sims.io import write_trajectory  # noqa: E402
from sims.plot import load_curves, plot_curves  # noqa: E402
from sims.sweep import run_sweep  # noqa: E402
from sims.sweep_spec import parse_sweep  # noqa: E402

INSTANCE = {"activation": "relu", "k": 3, "d": 20, "seed": 1}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A sweep file (ξ × joint ĉ, 4 cells) and a single-run file with two ξ values."""
    root = tmp_path_factory.mktemp("plot")
    spec = parse_sweep({"base": {"runs": 3, "eta_times_d": 0.2, "steps_per_d": 10,
                                 "checkpoints": 10, "instance": INSTANCE},
                        "axes": {"xi": [0.5, 1.0], "joint_c": [False, True]}})
    run_sweep(spec, root / "sweep.h5")
    config = RunConfig(instance=INSTANCE, eta=0.01, steps=200, runs=4, xi_values=[1.0, 2.0],
                       checkpoints=10)
    write_trajectory(root / "run.h5", simulate(config), config, config.run_instances())
    return root / "sweep.h5", root / "run.h5"


def lines_with_labels(ax):
    return [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def test_one_median_line_band_and_ode_per_cell(files):
    sweep, _ = files
    fig = plot_curves(load_curves([sweep]), hue="xi")
    ax = fig.axes[0]
    assert lines_with_labels(ax) == ["ξ = 0.5, frozen ĉ", "ξ = 0.5, joint ĉ", "ξ = 1, frozen ĉ",
                                     "ξ = 1, joint ĉ"]
    dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == 2  # the ODE exists for projected, frozen ĉ only
    dashdot = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-."]
    assert len(dashdot) == 2  # so does the noise-corrected ODE
    hatched = [c for c in ax.collections if c.get_hatch()]
    assert len(hatched) == 2  # the linear-noise theory band: projected, frozen ĉ only
    assert len(ax.collections) - len(hatched) == 4  # one 10–90 % band per cell
    assert ax.get_xlabel() == "SGD steps t" and ax.get_ylabel() == "overlap ⟨û_t, u⟩"
    assert ax.get_xscale() == "log"
    title = fig._suptitle.get_text()
    for part in ("σ = relu", "k = 3", "d = 20", "W = orthonormal", "learner = finetune",
                 "η = 0.01"):
        assert part in title
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "population ODE" in legend and "median; 10–90 % of runs (band)" in legend
    assert "noise-corrected (finite-d) ODE" in legend
    # hue: same ξ, same colour
    cols = [ln.get_color() for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert cols[0] == cols[1] and cols[0] != cols[2]
    plt.close(fig)


def test_facets_steps_over_d_and_linear_axis(files):
    sweep, _ = files
    fig = plot_curves(load_curves([sweep]), facet="joint_c", x="steps/d", xscale="linear",
                      quantity="loss", yscale="log")
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["frozen ĉ", "joint ĉ"]
    assert visible[0].get_xlabel() == "SGD steps t / d"
    assert visible[0].get_ylabel() == "population loss E(f* − f̂)²"
    assert max(visible[0].get_lines()[0].get_xdata()) == pytest.approx(10.0)
    plt.close(fig)


def test_c_overlap_only_for_joint_cells(files):
    sweep, _ = files
    curves = load_curves([sweep])
    fig = plot_curves(curves, quantity="c_overlap")
    assert len(lines_with_labels(fig.axes[0])) == 2
    plt.close(fig)
    frozen = [c for c in curves if not c.attrs["joint_c"]]
    with pytest.raises(ValueError, match="no curve has the quantity 'c_overlap'"):
        plot_curves(frozen, quantity="c_overlap")


def test_single_run_file_splits_by_xi_and_mixes_with_sweeps(files):
    sweep, run = files
    curves = load_curves([run])
    assert [c.attrs["xi"] for c in curves] == [1.0, 2.0]
    assert all(c.traj.runs == 2 for c in curves)
    fig = plot_curves(load_curves([run, sweep]))
    labels = lines_with_labels(fig.axes[0])
    assert len(labels) == 6 and "file = run.h5" in labels[0]
    plt.close(fig)


@pytest.mark.parametrize("ext", ["png", "pdf", "svg"])
def test_cli_writes_each_format(files, tmp_path, ext):
    sweep, _ = files
    out = tmp_path / f"f.{ext}"
    res = CliRunner().invoke(cli, ["plot", str(sweep), "--out", str(out), "--hue", "xi",
                                   "--facet", "joint_c", "--style", "runs"])
    assert res.exit_code == 0, res.output
    assert out.stat().st_size > 1000
    if ext == "png":
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--hue", "nope"], "unknown --hue axis 'nope'"),
    (["--facet", "nope"], "unknown --facet axis 'nope'"),
])
def test_cli_bad_axis(files, tmp_path, args, message):
    res = CliRunner().invoke(cli, ["plot", str(files[0]), "--out", str(tmp_path / "f.png"),
                                   *args])
    assert res.exit_code == 1 and message in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_cli_bad_files_and_extension(files, tmp_path):
    bogus = tmp_path / "x.h5"
    bogus.write_text("not hdf5")
    for path, message in ((tmp_path / "missing.h5", "no such file"),
                          (bogus, "is not an HDF5 file")):
        res = CliRunner().invoke(cli, ["plot", str(path), "--out", str(tmp_path / "f.png")])
        assert res.exit_code == 1 and message in res.output
    res = CliRunner().invoke(cli, ["plot", str(files[0]), "--out", str(tmp_path / "f.jpg")])
    assert res.exit_code == 2 and "extension must be .png, .pdf or .svg" in res.output


def test_abs_overlap_is_nonnegative(files):
    fig = plot_curves(load_curves([files[0]]), quantity="abs_overlap", style="runs")
    ys = np.concatenate([ln.get_ydata() for ln in fig.axes[0].get_lines()])
    assert np.nanmin(ys) >= 0
    plt.close(fig)
