"""Figures never mislead (issue 26): one curve per ξ, a reason for every missing theory line,
α = steps/d for from-scratch runs, short tick labels, theory above the median, facets in the
sweep's order, titles wrapped at their separators."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dynamics.runtime.trajectory import Trajectory  # noqa: E402
from sims.cli import cli  # noqa: E402
from sims.plots.curves import (  # noqa: E402
    Curve,
    compact_formatter,
    load_curves,
    no_theory_reason,
    plot_curves,
    split_runs,
    wrap_title,
)
from sims.plots.quick import plot_run, run_figure  # noqa: E402

INSTANCE = {"activation": "relu", "k": 3, "d": 20, "seed": 1}
FINETUNE = {"learner": "finetune", "instance": INSTANCE, "eta": 0.01, "runs": 8,
            "joint_c": False, "project": True}


def synthetic(xi, seeds=None, steps=(0, 10, 100, 1000), ode=True, **fields) -> Trajectory:
    """R = len(xi) runs whose overlap rises to a level set by the run's ξ block (0.2 + ξ/4 +
    a per-run offset); the ODE 0.01 above the overlap, or NaN."""
    xi = np.asarray(xi, dtype=float)
    runs, steps = xi.size, np.asarray(steps)
    level = 0.2 + xi[:, None] / 4 + 0.01 * np.arange(runs)[:, None]
    overlap = level * (steps[None, :] / steps[-1])
    theory = overlap + 0.01 if ode else np.full_like(overlap, np.nan)
    seeds = np.zeros(runs, dtype=np.int64) if seeds is None else np.asarray(seeds)
    return Trajectory(steps=steps, overlap=overlap, loss=1 - overlap, ode=theory,
                      diverged_step=np.full(runs, -1), xi=xi, instance_seed=seeds, **fields)


def labelled(ax):
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def legend_texts(fig):
    return [t.get_text() for ax in fig.axes if ax.get_legend()
            for t in ax.get_legend().get_texts()]


# ---------------------------------------------------------------- 1. one curve per ξ
def test_plot_run_draws_one_median_and_one_ode_per_xi():
    from dynamics.setup.config import RunConfig

    traj = synthetic([0.5] * 4 + [2.0] * 4)
    config = RunConfig(instance=INSTANCE, eta=0.01, steps=1000, runs=8, xi_values=[0.5, 2.0])
    fig, notes = run_figure(traj, "title", config=config)
    ax = fig.axes[0]
    medians = labelled(ax)
    assert [ln.get_label() for ln in medians] == ["ξ = 0.5, median of 4 runs",
                                                  "ξ = 2, median of 4 runs"]
    for ln, block in zip(medians, (slice(0, 4), slice(4, 8)), strict=True):
        np.testing.assert_allclose(ln.get_ydata(), np.median(traj.overlap[block], axis=0))
    dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == 2  # one ODE per ξ, not one averaged over both
    for ln, block in zip(dashed, (slice(0, 4), slice(4, 8)), strict=True):
        np.testing.assert_allclose(ln.get_ydata(), np.median(traj.ode[block], axis=0))
    assert len(ax.collections) == 2  # one band per ξ
    assert notes == []
    plt.close(fig)


def test_plot_run_without_config_still_splits_by_xi(tmp_path, capsys):
    traj = synthetic([0.5] * 3 + [2.0] * 3)
    fig, _ = run_figure(traj, "title")
    assert [ln.get_label() for ln in labelled(fig.axes[0])] == [
        "ξ = 0.5, median of 3 runs", "ξ = 2, median of 3 runs"]
    plt.close(fig)
    path = plot_run(traj, tmp_path / "f.png", "title")  # the signature run.py calls
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().err == ""


def test_instance_groups_split_and_per_run_instances_pool():
    two = split_runs(Curve(synthetic([1.0] * 6, seeds=[5, 5, 5, 7, 7, 7]), {"xi": 1.0}))
    assert [(c.attrs["instance_seed"], c.traj.runs) for c in two] == [(5, 3), (7, 3)]
    own = split_runs(Curve(synthetic([1.0] * 3 + [2.0] * 3, seeds=range(6)), {"xi": 1.0}))
    assert [(c.attrs["xi"], c.traj.runs) for c in own] == [(1.0, 3), (2.0, 3)]
    assert all("instance_seed" not in c.attrs for c in own)
    mixed = Curve(synthetic([1.0, 2.0, 1.0, 2.0]), {}, "x.h5")
    with pytest.raises(ValueError, match="x.h5: runs of ξ = 1 are not contiguous"):
        split_runs(mixed)


# ---------------------------------------------------------------- 2. why no theory
def test_joint_c_figure_and_stderr_say_why_there_is_no_theory(tmp_path, capsys):
    traj = synthetic([1.0] * 4, ode=False, c_overlap=np.full((4, 4), 0.5))
    config = FINETUNE | {"joint_c": True}
    fig, notes = run_figure(traj, "title", config=config)
    want = ("no theory line: joint ĉ: the file records no population ODE (it predates "
            "hermite.finetune.population; a run made now records it)")
    assert notes == [want]
    assert want in " ".join(t.replace("\n", " ") for t in legend_texts(fig))
    assert not [ln for ln in fig.axes[0].get_lines() if ln.get_linestyle() == "--"]
    plt.close(fig)
    plot_run(traj, tmp_path / "f.png", "title")  # no config: ĉ's record says joint
    assert capsys.readouterr().err.strip() == f"note: {want}"


@pytest.mark.parametrize("config, extra, expected", [
    (FINETUNE | {"instance": INSTANCE | {"convention": "appB"}}, {},
     "App. B convention appB: the file records no population ODE"),
    (FINETUNE | {"project": False}, {}, "unprojected û: the file records no population ODE"),
    (FINETUNE | {"learner": "moment"}, {}, "the moment learner has no population ODE"),
    (FINETUNE, {}, "the file records no finite theory value"),
])
def test_every_missing_theory_has_a_reason(config, extra, expected):
    curve = Curve(synthetic([1.0] * 2, ode=False), {}, "", config)
    assert expected in no_theory_reason(curve, "overlap")
    assert no_theory_reason(Curve(synthetic([1.0] * 2), {}, "", config), "overlap") is None


def test_a_reason_the_file_records_is_used_as_is():
    alignment = np.full((2, 4), 0.5)
    traj = synthetic([1.0] * 2, extra={"alignment": alignment,
                                       "ode_alignment": np.full((2, 4), np.nan)},
                     extra_attrs={"ode_alignment": {"note": "the ODE left the PSD cone"}})
    assert no_theory_reason(Curve(traj), "alignment") == "the ODE left the PSD cone"
    traj.extra_attrs = {}
    assert "committee ODE failed" in no_theory_reason(Curve(traj), "alignment")
    off = Curve(synthetic([1.0] * 2, extra={"alignment": alignment}), {}, "",
                {"learner": "scratch", "finite_d_theory": False})
    assert "--no-finite-d-theory" in no_theory_reason(off, "alignment")


def test_cli_run_and_plot_name_the_missing_theory(runner):
    """A learner without a population ODE (moment: an estimator) says so, from run --plot
    and from loradyn plot of its file (joint ĉ has its ODE now: hermite.finetune.population)."""
    fast = ["--steps", "200", "--runs", "4", "--checkpoints", "8"]
    res = runner.invoke(cli, ["run", "spec.toml", *fast, "--learner", "moment", "--out",
                              "j.h5", "--plot", "j.png"])
    assert res.exit_code == 0, res.output
    assert "note: no theory line: the moment learner has no population ODE" in res.output
    res = runner.invoke(cli, ["plot", "j.h5", "--out", "p.png"])
    assert res.exit_code == 0, res.output
    assert "note: no theory line: the moment learner has no population ODE" in res.output


def test_a_plain_ode_says_what_it_leaves_out_in_the_file_the_legend_and_stderr(runner):
    """A fine-tuning run records the plain O(η) ODE with a note naming the O(η²d) drift it
    drops and the run's η·d; the note is read back and printed beside the drawn line."""
    from sims.io import read_trajectory

    fast = ["--steps", "200", "--runs", "4", "--checkpoints", "8"]
    res = runner.invoke(cli, ["run", "spec.toml", *fast, "--joint-c", "--out", "j.h5",
                              "--plot", "j.png"])
    assert res.exit_code == 0, res.output
    traj, meta = read_trajectory("j.h5")
    assert np.isfinite(traj.ode).all()
    note = traj.extra_attrs["ode"]["note"]
    assert "drops the O(η²d) finite-d drift" in note
    cfg = meta["config"]
    assert note.endswith(f"(here η·d = {cfg['eta'] * cfg['instance']['d']:.3g})")
    assert f"note: theory line: {note}" in res.output
    res = runner.invoke(cli, ["plot", "j.h5", "--out", "p.png"])
    assert res.exit_code == 0, res.output
    assert "note: theory line:" in res.output and "O(η²d)" in res.output


# ---------------------------------------------------------------- 3. α = steps/d
SCRATCH = {"learner": "scratch", "instance": INSTANCE | {"d": 50}, "eta": 0.01, "runs": 3}


def scratch_traj(steps=(0, 100, 1000, 5000)):
    base = synthetic([1.0] * 3, steps=steps, ode=False)
    align = np.clip(base.overlap, 0, 1)
    base.extra = {"alignment": align, "ode_loss": 1 - align + 0.01, "ode_alignment": align}
    return base


def test_from_scratch_figure_is_against_alpha_with_steps_on_request():
    traj = scratch_traj()
    fig, notes = run_figure(traj, "title", config=SCRATCH)
    assert notes == []
    for ax in fig.axes:
        assert ax.get_xlabel().startswith("α = t / d")
        np.testing.assert_allclose(labelled(ax)[0].get_xdata(), traj.steps / 50)
    assert fig.axes[0].get_yscale() == "log"
    plt.close(fig)
    fig, _ = run_figure(traj, "title", config=SCRATCH, x="steps")
    assert fig.axes[1].get_xlabel() == "SGD steps t"
    np.testing.assert_allclose(labelled(fig.axes[1])[0].get_xdata(), traj.steps)
    plt.close(fig)
    with pytest.raises(ValueError, match="the dimension d of the run is unknown"):
        run_figure(traj, "title", x="alpha")


@pytest.fixture(scope="module")
def scratch_file(tmp_path_factory):
    from dynamics.engines.engine import simulate
    from dynamics.setup.config import RunConfig
    from sims.io.trajectory import write_trajectory

    config = RunConfig(instance=INSTANCE, learner="scratch", eta=0.01, steps=200, runs=3,
                       checkpoints=6)
    path = tmp_path_factory.mktemp("scratch") / "s.h5"
    return write_trajectory(path, simulate(config), config, config.run_instances())


def test_loradyn_plot_of_a_scratch_file_uses_alpha_and_x_steps(scratch_file, tmp_path):
    from click.testing import CliRunner

    fig = plot_curves(load_curves([scratch_file]), quantity="alignment", xscale="linear")
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("α")
    median = next(ln for ln in ax.get_lines() if ln.get_linestyle() == "-")
    assert max(median.get_xdata()) == pytest.approx(200 / 20)
    plt.close(fig)
    for x, top in (("steps", 200), ("alpha", 10)):
        fig = plot_curves(load_curves([scratch_file]), quantity="loss", x=x)
        assert max(fig.axes[0].get_lines()[0].get_xdata()) == pytest.approx(top)
        plt.close(fig)
    res = CliRunner().invoke(cli, ["plot", str(scratch_file), "--quantity", "alignment",
                                   "--x", "steps", "--out", str(tmp_path / "a.png")])
    assert res.exit_code == 0, res.output


# ---------------------------------------------------------------- 4. readable ticks
def tick_labels(ax):
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ticks = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    lo, hi = sorted(ax.get_xlim())
    ticks = [t for t in ticks if lo <= t.get_position()[0] <= hi]
    return [t.get_text() for t in ticks], [t.get_window_extent(renderer) for t in ticks]


def overlapping(boxes) -> bool:
    boxes = sorted(boxes, key=lambda b: b.x0)
    return any(a.x1 > b.x0 for a, b in zip(boxes, boxes[1:], strict=False))


def test_tick_labels_of_a_long_linear_run_are_short_and_apart():
    steps = np.linspace(0, 200_000, 41).astype(np.int64)
    fig, _ = run_figure(synthetic([1.0] * 3, steps=steps), "t", config=FINETUNE)
    ax = fig.axes[0]
    texts, boxes = tick_labels(ax)
    assert len(texts) >= 3 and all(len(t) <= 6 for t in texts), texts
    assert "200k" in texts and not overlapping(boxes), texts
    ytexts = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert all(len(t) <= 6 for t in ytexts), ytexts
    plt.close(fig)
    # the check itself: the default formatter on the same axis with dense ticks overlaps
    from matplotlib.ticker import MultipleLocator, ScalarFormatter

    fig, ax = plt.subplots(figsize=(5.2, 3))
    ax.plot(steps, steps)
    ax.xaxis.set_major_locator(MultipleLocator(25_000))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    assert overlapping(tick_labels(ax)[1])
    plt.close(fig)


@pytest.mark.parametrize("locs, want", [
    ([0, 50_000, 100_000, 150_000, 200_000], ["0", "50k", "100k", "150k", "200k"]),
    ([0, 2500, 5000, 7500], ["0", "2.5k", "5.0k", "7.5k"]),
    ([0, 0.25, 0.5, 0.75, 1.0], ["0", "0.25", "0.50", "0.75", "1.00"]),
    ([1e6, 1.5e6, 2e6], ["1.0M", "1.5M", "2.0M"]),
    ([0, 1e-4, 2e-4, 3e-4], ["0", "1e-4", "2e-4", "3e-4"]),
    ([-0.5, 0, 0.5], ["-0.5", "0", "0.5"]),
])
def test_compact_tick_labels(locs, want):
    assert compact_formatter().format_ticks(locs) == want


# ---------------------------------------------------------------- 5. theory above the median
def test_theory_line_is_drawn_above_the_median_in_its_colour_white_edged():
    """Issue 38: the theory line takes its curve's colour (it was a darker shade, near black);
    a white edge keeps it visible where it lies on the median."""
    traj = synthetic([1.0] * 4)
    traj.ode = traj.overlap.copy()  # the theory coincides with the median
    fig, _ = run_figure(traj, "t", config=FINETUNE)
    ax = fig.axes[0]
    (median,) = labelled(ax)
    (theory,) = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    np.testing.assert_allclose(theory.get_ydata(), median.get_ydata())
    assert theory.get_zorder() > median.get_zorder()
    assert np.allclose(matplotlib.colors.to_rgba(theory.get_color()),
                       matplotlib.colors.to_rgba(median.get_color()))
    assert theory.get_path_effects()  # the white edge
    assert "population ODE" in legend_texts(fig)
    plt.close(fig)


# ---------------------------------------------------------------- 6. facets in axis order
@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory):
    from sims.experiments.sweep import run_sweep
    from sims.experiments.sweep_spec import parse_sweep

    spec = parse_sweep({"base": {"runs": 2, "eta_times_d": 0.2, "steps_per_d": 5,
                                 "checkpoints": 5, "instance": INSTANCE},
                        "axes": {"xi": [2.0, 0.5], "activation": ["relu", "erf"]}})
    path = tmp_path_factory.mktemp("sweep") / "order.h5"
    run_sweep(spec, path)
    return path


@pytest.mark.parametrize("facet, titles", [
    ("xi", ["ξ = 2", "ξ = 0.5"]), ("activation", ["σ = relu", "σ = erf"])])
def test_facets_follow_the_sweep_axis_order(sweep_file, facet, titles):
    fig = plot_curves(load_curves([sweep_file]), facet=facet)
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == titles
    plt.close(fig)


def test_facets_of_plain_attributes_stay_sorted():
    curves = [Curve(synthetic([1.0] * 2), {"eta": eta}) for eta in (0.02, 0.01)]
    fig = plot_curves(curves, facet="eta", xscale="linear")
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["η = 0.01", "η = 0.02"]
    plt.close(fig)


# ---------------------------------------------------------------- 7. titles
TITLE = ("σ = relu, k = 5, d = 200, ξ = 0.5, 2, W orthonormal, η = 0.00025, R = 32 "
         "(lora, projected, frozen Ĉ)")


@pytest.mark.parametrize("width", [4.0, 5.0, 6.4, 8.0])
def test_titles_wrap_at_separators_not_inside_a_group(width):
    chars = int(width * 72 / (0.55 * 10))
    lines = wrap_title(TITLE, width).split("\n")
    assert " ".join(lines) == TITLE
    assert all(len(line) <= chars for line in lines), lines
    for line in lines:
        assert line.count("(") == line.count(")"), lines  # the group is never cut
    for line in lines[:-1]:
        assert line.endswith(",") or line.endswith("R = 32"), lines  # cut at separators


def test_a_group_longer_than_a_line_is_cut_at_its_own_separators():
    text = "a = 1, b = 2 (" + ", ".join(f"option{i}" for i in range(12)) + ")"
    lines = wrap_title(text, 3.0).split("\n")  # 39 characters a line
    assert " ".join(lines) == text
    assert len(lines) > 2 and all(len(line) <= 39 for line in lines), lines
    assert all(line.endswith(",") for line in lines[:-1]), lines  # cut at separators only
    assert wrap_title("x, y", 6.4) == "x, y"


def test_one_left_out_reason_shared_by_several_curves_names_them_once_each():
    """Several curves of one figure with the same reason (a batch's cells share the corrected
    line's ``partial`` note): one legend note naming those curves (curves are told apart by
    identity; comparing them compared their arrays, an error)."""
    from sims.plots.curves import left_out_notes

    why = "finite-d corrected ODE from some runs' starts only"
    curves = []
    for xi in (0.5, 1.0, 2.0):
        traj = synthetic([xi, xi], ode_corrected=np.full((2, 4), 0.3),
                         extra_attrs={"ode_corrected": {"partial": why}} if xi < 2 else {})
        curves.append(Curve(traj, {"xi": xi}))
    notes = left_out_notes(curves, "overlap", ["xi"])
    assert len(notes) == 1 and notes[0].endswith(why)
    assert "ξ = 0.5" in notes[0] and "ξ = 1" in notes[0] and "ξ = 2" not in notes[0]
