"""``loradyn plot``: curves, bands, ODE lines, labels, hue/facet, formats, bad inputs."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from dynamics.engines.engine import simulate  # noqa: E402
from dynamics.setup.config import RunConfig  # noqa: E402
from sims.cli import cli  # noqa: E402
from sims.experiments.sweep import run_sweep  # noqa: E402
from sims.experiments.sweep_spec import parse_sweep  # noqa: E402
from sims.io.trajectory import write_trajectory  # noqa: E402
from sims.plots.curves import load_curves, plot_curves  # noqa: E402

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
    assert len(dashed) == 4  # the ODE of every cell (joint ĉ: hermite.finetune.population)
    dashdot = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-."]
    assert len(dashdot) == 4  # and its noise-corrected form (joint ĉ: finetune_population)
    hatched = [c for c in ax.collections if c.get_hatch()]
    assert len(hatched) == 4  # the linear-noise theory band (frozen and joint ĉ, projected)
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


# ---------------------------------------------------------------- quantities of other learners
LORA = {"activation": "relu", "k": 4, "d": 30, "xi": 1.0, "C": "spectrum", "spectrum": [2.0, 1.0]}


@pytest.fixture(scope="module")
def learner_files(tmp_path_factory):
    """Small files of the lora (rank 2, frozen and joint Ĉ), linearized, scratch learners and
    a finetune run with joint ĉ and the second-layer refit."""
    root = tmp_path_factory.mktemp("learners")
    configs = {
        "lora": RunConfig(instance=LORA, learner="lora", rank=2, eta=0.005, steps=300, runs=4,
                          checkpoints=12),
        "lora_eta": RunConfig(instance=LORA, learner="lora", rank=2, eta=0.01, steps=300,
                              runs=4, checkpoints=12),
        "lora_joint": RunConfig(instance=LORA, learner="lora", rank=2, eta=0.005, steps=300,
                                runs=4, checkpoints=12, joint_c=True),
        "linearized": RunConfig(instance=INSTANCE, learner="linearized", eta=0.01, steps=200,
                                runs=4, checkpoints=10, eval_size=2000),
        "scratch": RunConfig(instance=INSTANCE, learner="scratch", eta=0.01, steps=200, runs=4,
                             checkpoints=10),
        "refit": RunConfig(instance=INSTANCE, eta=0.02, steps=400, runs=6, checkpoints=10,
                           joint_c=True, refit=True, refit_samples=500),
    }
    out = {}
    for name, config in configs.items():
        out[name] = write_trajectory(root / f"{name}.h5", simulate(config), config,
                                     config.run_instances())
    return out


def labelled(ax, prefix=""):
    return [ln for ln in ax.get_lines()
            if not ln.get_label().startswith("_") and ln.get_label().startswith(prefix)]


def trajectory(path):
    from sims.io.trajectory import read_trajectory

    traj, _ = read_trajectory(path)
    assert not traj.diverged.any()
    return traj


@pytest.mark.parametrize("quantity, name", [
    ("singular_values", "lora"), ("singular_values", "lora_joint"), ("update_overlap", "lora"),
    ("aligned_c_overlap", "lora_joint"),
    ("loss_linear", "linearized"), ("alignment", "scratch"), ("refit_loss", "refit"),
    ("aligned_c_overlap", "refit"),
])
def test_cli_writes_png_for_each_new_quantity(learner_files, tmp_path, quantity, name):
    out = tmp_path / f"{quantity}.png"
    res = CliRunner().invoke(cli, ["plot", str(learner_files[name]), "--quantity", quantity,
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
    assert "skipped" not in res.output


def test_singular_values_one_median_per_index_and_the_matrix_ode(learner_files):
    traj = trajectory(learner_files["lora"])
    fig = plot_curves(load_curves([learner_files["lora"]]), quantity="singular_values")
    ax = fig.axes[0]
    lines = labelled(ax, "σ")
    assert [ln.get_label() for ln in lines] == ["σ₁", "σ₂"]
    assert lines[0].get_marker() != lines[1].get_marker()
    assert ax.get_ylabel().startswith("singular values σ_a(UᵀÛ_t)")
    # independent truth: the singular values of the stored overlap matrices M = UᵀÛ
    sv = np.linalg.svd(traj.extra["overlap_matrix"], compute_uv=False)[:, 1:]  # log x: t > 0
    for a, ln in enumerate(lines):
        np.testing.assert_array_equal(ln.get_xdata(), traj.steps[1:])
        np.testing.assert_allclose(ln.get_ydata(), np.nanmedian(sv[..., a], axis=0),
                                   rtol=1e-12)
    dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == 2  # the matrix ODE: one line per index
    ode = traj.extra["ode_singular_values"][:, 1:]
    for a, ln in enumerate(dashed):
        np.testing.assert_allclose(ln.get_ydata(), np.nanmedian(ode[..., a], axis=0),
                                   rtol=1e-12)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "matrix ODE (σ_a of its M_t) (median)" in legend and "σ₁" in legend
    assert "learner = lora" in fig._suptitle.get_text()
    plt.close(fig)
    # joint Ĉ: no ODE, so no dashed line
    fig = plot_curves(load_curves([learner_files["lora_joint"]]), quantity="singular_values",
                      xscale="linear")
    assert not [ln for ln in fig.axes[0].get_lines() if ln.get_linestyle() == "--"]
    assert len(labelled(fig.axes[0], "σ")) == 2
    plt.close(fig)


def test_singular_values_hue_and_facet(learner_files):
    curves = load_curves([learner_files["lora"], learner_files["lora_eta"]])
    fig = plot_curves(curves, quantity="singular_values", hue="eta", facet="eta",
                      x="eta*steps")
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["η = 0.005", "η = 0.01"]
    assert visible[0].get_xlabel() == "SGD time η·t (steps × step size)"
    labels = [h.get_label() for h in visible[0].get_legend().legend_handles]
    assert "σ₁: ηd = 0.15, file = lora.h5" in labels  # η varies, d does not: ηd names it
    assert "σ₂: ηd = 0.3, file = lora_eta.h5" in labels
    c0, c1 = (labelled(ax, "σ₁")[0].get_color() for ax in visible)
    assert c0 != c1
    assert max(labelled(visible[1])[0].get_xdata()) == pytest.approx(0.01 * 300)
    plt.close(fig)


def test_loss_linear_with_the_true_loss_dotted(learner_files):
    traj = trajectory(learner_files["linearized"])
    fig = plot_curves(load_curves([learner_files["linearized"]]), quantity="loss_linear",
                      yscale="log")
    ax = fig.axes[0]
    solid = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-"]
    dotted = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
    assert len(solid) == 1 and len(dotted) == 1
    np.testing.assert_allclose(solid[0].get_ydata(),
                               np.nanmedian(traj.extra["loss_linear"][:, 1:], axis=0))
    np.testing.assert_allclose(dotted[0].get_ydata(), np.nanmedian(traj.loss[:, 1:], axis=0))
    assert ax.get_ylabel() == "linear-model loss E(f* − f̂_lin)²"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "true loss of the learned weights (median)" in legend
    plt.close(fig)


def test_alignment_is_the_scratch_overlap(learner_files):
    traj = trajectory(learner_files["scratch"])
    fig = plot_curves(load_curves([learner_files["scratch"]]), quantity="alignment",
                      xscale="linear")
    (line,) = ax_lines = [ln for ln in fig.axes[0].get_lines() if ln.get_linestyle() == "-"]
    assert len(ax_lines) == 1
    np.testing.assert_allclose(line.get_ydata(), np.nanmedian(traj.overlap, axis=0))
    assert np.all((line.get_ydata() > 0) & (line.get_ydata() <= 1))
    plt.close(fig)


def test_refit_loss_with_population_refit_and_base_loss(learner_files):
    traj = trajectory(learner_files["refit"])
    fit, pop = traj.extra["refit_loss"], traj.extra["refit_loss_population"]
    assert np.all(fit >= pop - 1e-12)  # the population-optimal a minimises the loss
    fig = plot_curves(load_curves([learner_files["refit"]]), quantity="refit_loss")
    ax = fig.axes[0]
    by_style = {ls: [ln for ln in ax.get_lines() if ln.get_linestyle() == ls]
                for ls in ("-", "--", ":")}
    assert [len(v) for v in by_style.values()] == [1, 1, 1]
    np.testing.assert_allclose(by_style["-"][0].get_ydata(), np.nanmedian(fit[:, 1:], axis=0))
    np.testing.assert_allclose(by_style["--"][0].get_ydata(), np.nanmedian(pop[:, 1:], axis=0))
    np.testing.assert_allclose(by_style[":"][0].get_ydata(),
                               np.median(traj.extra["base_loss"]))
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "population-optimal refit a = A⁺b (median)" in legend
    assert "base network f₀ (median)" in legend
    plt.close(fig)


def test_aligned_c_overlap_counts_sign_flipped_runs_as_aligned():
    from dynamics.runtime.trajectory import Trajectory
    from sims.plots.curves import Curve, aligned_c_overlap

    steps = np.array([0, 10, 100])
    m = np.array([[0.1, 0.5, 0.9], [-0.1, -0.5, -0.9], [0.2, -0.4, -0.8], [0.1, 0.6, 0.95]])
    c = np.array([[0.3, 0.6, 0.8], [-0.3, -0.6, -0.8], [0.2, -0.5, -0.7], [0.1, 0.7, 0.9]])
    zeros = np.zeros_like(m)
    traj = Trajectory(steps=steps, overlap=m, loss=zeros, ode=zeros * np.nan,
                      diverged_step=np.full(4, -1), xi=np.ones(4), instance_seed=np.zeros(4),
                      c_overlap=c)
    expected = np.abs(c)  # every run: ĉ on the same side as û
    np.testing.assert_allclose(aligned_c_overlap(traj), expected)
    curve = Curve(traj, {"file": "synthetic.h5"}, "synthetic.h5")
    fig = plot_curves([curve], quantity="aligned_c_overlap", xscale="linear")
    (line,) = labelled(fig.axes[0]) or [fig.axes[0].get_lines()[0]]
    np.testing.assert_allclose(line.get_ydata(), np.median(expected, axis=0))
    plt.close(fig)
    fig = plot_curves([curve], quantity="c_overlap", xscale="linear")
    assert abs(fig.axes[0].get_lines()[0].get_ydata()[-1]) < 0.5  # the signed median is not
    plt.close(fig)


def test_aligned_c_overlap_of_a_joint_run(learner_files):
    traj = trajectory(learner_files["refit"])
    fig = plot_curves(load_curves([learner_files["refit"]]), quantity="aligned_c_overlap")
    line = fig.axes[0].get_lines()[0]
    want = traj.c_overlap * np.sign(traj.overlap)
    np.testing.assert_allclose(line.get_ydata(), np.nanmedian(want[:, 1:], axis=0))
    assert fig.axes[0].get_ylabel() == "⟨ĉ_t, c⟩·sign⟨û_t, u⟩ / (‖ĉ_t‖‖c‖)"
    plt.close(fig)


@pytest.mark.parametrize("quantity, name, message", [
    ("singular_values", None, "no curve has the quantity 'singular_values' (needs a lora "
                              "learner file): run.h5"),
    ("loss_linear", "lora", "no curve has the quantity 'loss_linear' (needs a linearized "
                            "learner file): lora.h5"),
    ("alignment", "refit", "no curve has the quantity 'alignment'"),
    ("refit_loss", "scratch", "no curve has the quantity 'refit_loss' (needs a finetune run "
                              "with --refit): scratch.h5"),
    ("aligned_c_overlap", "lora", "no curve has the quantity 'aligned_c_overlap' (needs joint "
                                  "ĉ): lora.h5"),
])
def test_cli_missing_quantity_is_a_one_line_error(files, learner_files, tmp_path, quantity,
                                                  name, message):
    path = files[1] if name is None else learner_files[name]
    out = tmp_path / "f.png"
    res = CliRunner().invoke(cli, ["plot", str(path), "--quantity", quantity, "--out",
                                   str(out)])
    assert res.exit_code == 1 and message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_mixed_files_skip_the_ones_without_the_quantity(files, learner_files, tmp_path):
    out = tmp_path / "f.png"
    res = CliRunner().invoke(cli, ["plot", str(learner_files["lora"]), str(files[1]),
                                   "--quantity", "singular_values", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "(1 curve(s))" in res.output
    assert "skipped 2 curve(s) without singular_values: run.h5" in res.output


def test_empty_facet_says_so(files, learner_files):
    curves = load_curves([learner_files["lora"], files[1]])
    fig = plot_curves(curves, quantity="singular_values", facet="learner")
    finetune, lora = (ax for ax in fig.axes if ax.get_visible())
    assert finetune.get_title() == "learner = finetune" and not finetune.get_lines()
    assert [t.get_text() for t in finetune.texts] == ["no singular_values here"]
    assert not lora.texts and len(labelled(lora, "σ")) == 2
    plt.close(fig)
