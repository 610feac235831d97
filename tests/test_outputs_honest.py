"""Outputs that never mislead (issue 38, item 5): a committee ODE loss never below 0 and no
cliff on a log axis, no placeholder datasets, nn2pp's lr as the docs define it, every
non-default setting in a title, fig1(a) on a time axis that shows every curve, legends off the
data, theory lines in their curve's colour, ``show`` reporting the statistic the figures draw,
missing theory lines named in their panel's legend, benchmark rates from measurable intervals
and a power-law fit that says why it needs two values of d.

The reproduce figures are rendered from synthetic sweep files (:func:`synthetic_sweep`: each
recipe's own quick cells, their trajectories a logistic rise in log time, later and lower
from cell to cell, the ODE 0.02 below the overlap), so that every figure's layout is checked
in a second, without simulating."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from dynamics.runtime.trajectory import Trajectory, checkpoint_steps  # noqa: E402
from sims.cli import cli  # noqa: E402
from sims.experiments.figures import FIGURES  # noqa: E402
from sims.experiments.reproduce import render  # noqa: E402
from sims.experiments.sweep_spec import parse_sweep  # noqa: E402
from sims.io.sweep import rebuild_sweep_file, write_cell  # noqa: E402
from sims.io.trajectory import read_trajectory  # noqa: E402
from sims.plots.curves import Curve, load_curves, plot_curves  # noqa: E402
from sims.plots.quick import instance_title, run_figure  # noqa: E402


def rise(steps, horizon, runs, where=0.4, level=0.97, slope=3.0):
    """(runs, C) logistic rise in log time from 0.03 to ``level``, its midpoint at
    ``where``·horizon, the runs' midpoints spread ±10 %."""
    t = np.asarray(steps, dtype=float)[None, :]
    mid = where * horizon * (1.0 + 0.1 * np.linspace(-1, 1, runs))[:, None]
    with np.errstate(divide="ignore"):
        frac = 1.0 / (1.0 + np.exp(slope * (np.log(mid) - np.log(t))))
    return 0.03 + (level - 0.03) * frac


def synthetic_trajectory(config, instances, u: float) -> Trajectory:
    """Cell ``u`` ∈ [0, 1] of a sweep: the later the cell, the later (15 % → 90 % of its
    horizon) and the lower (0.97 → 0.37) its rise, so that the curves fill their panel."""
    steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
    runs = config.runs
    overlap = rise(steps, config.steps, runs, where=0.15 + 0.75 * u, level=0.97 - 0.6 * u)
    joint = bool(getattr(config.options, "joint_c", False))
    return Trajectory(
        steps=steps, overlap=overlap, loss=1.0 - overlap ** 2, ode=overlap - 0.02,
        diverged_step=np.full(runs, -1), xi=np.array([i.xi for i in instances]),
        instance_seed=np.array([i.seed for i in instances], dtype=np.int64),
        c_overlap=overlap.copy() if joint else None, m0=overlap[:, 0].copy(),
        instances=list(instances))


def synthetic_sweep(name: str, path):
    """The sweep file of recipe ``name`` (quick) with synthetic trajectories in every cell."""
    spec = parse_sweep(FIGURES[name].sweep(True))
    cells = spec.cells()
    done = {}
    for i, cell in enumerate(cells):
        instances = cell.config.run_instances()
        traj = synthetic_trajectory(cell.config, instances, i / max(len(cells) - 1, 1))
        done[cell.hash] = write_cell(path, cell, traj, instances, {})
    rebuild_sweep_file(path, spec, cells, done)
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """name → the Figure of every reproduce recipe drawn from its synthetic sweep (drawn)."""
    root = tmp_path_factory.mktemp("figures")
    figs = {}
    for name in FIGURES:
        fig = render(FIGURES[name], synthetic_sweep(name, root / f"{name}.h5"), True)
        fig.canvas.draw()
        figs[name] = fig
    yield figs
    for fig in figs.values():
        plt.close(fig)


def medians(ax):
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


# ---------------------------------------------------------------- 5. fig1(a): every curve seen
def test_fig1a_shows_every_curve_rise_on_its_time_axis(rendered):
    """Each activation's rise (10 % → 90 % of its own range) lies inside panel (a)'s x limits
    and spans at least a tenth of the axis, its midpoint past the axis' first tenth (on the
    linear axis of before, ReLU and quadratic rose within the first 6 %)."""
    ax = rendered["fig1"].axes[0]
    assert ax.get_xscale() == "log"
    lines = medians(ax)
    assert len(lines) == 4
    to_axes = ax.transData + ax.transAxes.inverted()
    for ln in lines:
        x, y = np.asarray(ln.get_xdata(), float), np.asarray(ln.get_ydata(), float)
        lo, hi = np.nanmin(y), np.nanmax(y)
        at = [x[np.argmax(y >= lo + q * (hi - lo))] for q in (0.1, 0.5, 0.9)]
        frac = [to_axes.transform((v, 0.5))[0] for v in at]
        assert 0.0 <= frac[0] and frac[2] <= 1.0, (ln.get_label(), frac)
        assert frac[2] - frac[0] >= 0.1, (ln.get_label(), frac)
        assert frac[1] >= 0.1, (ln.get_label(), frac)


# ---------------------------------------------------------------- 6. legends off the data
def _points(fig):
    """Display coordinates of every drawn data point of every Axes (lines and markers; a
    point outside its Axes is clipped, not drawn)."""
    out = []

    def shown(ax, xy):
        box = ax.bbox
        inside = ((xy[:, 0] >= box.x0) & (xy[:, 0] <= box.x1)
                  & (xy[:, 1] >= box.y0) & (xy[:, 1] <= box.y1))
        return xy[inside]

    for ax in fig.axes:
        for ln in ax.get_lines():
            xy = np.column_stack([np.asarray(ln.get_xdata(), float),
                                  np.asarray(ln.get_ydata(), float)])
            xy = xy[np.isfinite(xy).all(axis=1)]
            if ax.get_xscale() == "log":
                xy = xy[xy[:, 0] > 0]
            if ax.get_yscale() == "log":
                xy = xy[xy[:, 1] > 0]
            if len(xy):
                out.append((ln.get_label(), shown(ax, ln.get_transform().transform(xy))))
        for coll in ax.collections:
            offsets = np.asarray(coll.get_offsets(), float)
            if offsets.size and coll.get_offset_transform() is not None:
                xy = offsets[np.isfinite(offsets).all(axis=1)]
                if len(xy):
                    out.append(("collection",
                                shown(ax, coll.get_offset_transform().transform(xy))))
    return out


@pytest.mark.parametrize("name", list(FIGURES))
def test_no_legend_covers_a_data_point_and_every_legend_is_on_the_figure(rendered, name):
    fig = rendered[name]
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    page = fig.bbox
    for leg in legends:
        box = leg.get_window_extent(renderer)
        assert box.x0 >= page.x0 - 1 and box.x1 <= page.x1 + 1, (name, box, page)
        assert box.y0 >= page.y0 - 1 and box.y1 <= page.y1 + 1, (name, box, page)
        for label, xy in _points(fig):
            inside = ((xy[:, 0] > box.x0) & (xy[:, 0] < box.x1)
                      & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1))
            assert not inside.any(), f"{name}: the legend covers {label}"


# ---------------------------------------------------------------- 7. theory in the curve's hue
@pytest.mark.parametrize("name", ["fig1", "fig2", "fig4", "fig6"])
def test_theory_lines_take_their_curves_colour(rendered, name):
    """Every dashed theory line has the colour of a median line of its panel (the synthetic
    ODE of each cell is drawn: one per median)."""
    for ax in rendered[name].axes:
        if ax.get_ylabel().startswith("steps to"):  # fig6(c): passages, not curves
            continue
        solid = medians(ax)
        dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        if not solid or not dashed:
            continue
        colours = [matplotlib.colors.to_rgba(ln.get_color()) for ln in solid]
        for ln in dashed:
            assert matplotlib.colors.to_rgba(ln.get_color()) in colours, name
        assert len(dashed) >= len(solid)


def test_a_theory_line_has_its_median_line_s_colour_and_a_white_edge():
    traj = Trajectory(steps=np.array([0, 10, 100]), overlap=np.array([[0.1, 0.5, 0.9]] * 2),
                      loss=np.ones((2, 3)), ode=np.array([[0.1, 0.5, 0.9]] * 2),
                      diverged_step=np.full(2, -1), xi=np.ones(2),
                      instance_seed=np.zeros(2, dtype=np.int64))
    fig, _ = run_figure(traj, "t")
    ax = fig.axes[0]
    (median,) = medians(ax)
    (theory,) = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert (matplotlib.colors.to_rgba(theory.get_color())
            == matplotlib.colors.to_rgba(median.get_color()))
    assert theory.get_zorder() > median.get_zorder() and theory.get_path_effects()
    plt.close(fig)


# ---------------------------------------------------------------- 1. loss never below 0
ERF = "erf(x/sqrt2)"


def erf_model():
    from hermite.committee import CommitteeModel

    return CommitteeModel(ERF, np.eye(2), np.ones(2), lr=0.25, rows="free")


def near_optimum():
    from hermite.committee import CommitteeState

    return CommitteeState.from_arrays(np.eye(2), [[0.99, 0.01], [0.01, 0.99]], np.ones(2))


def test_committee_loss_of_a_state_just_outside_the_psd_cone_is_zero_not_negative():
    """R = (1 + δ)·T with Q = T: the joint covariance has the eigenvalue −δ; the plain sum
    Σ c_a c_b I2 is ≈ −1.5δ, the loss (PSD part of the feature Gram) 0. A valid state's loss
    is the plain sum to rounding."""
    from hermite.committee import CommitteeState, committee_loss
    from hermite.committee.ode import committee_loss_terms

    model = erf_model()
    for delta in (1e-7, 1e-6):
        st = CommitteeState.from_arrays(np.eye(2), (1 + delta) * np.eye(2), np.ones(2))
        psd, plain = committee_loss_terms(model, st.Q[None], st.R[None], st.v[None])
        assert plain[0] < -delta and psd[0] == pytest.approx(0.0, abs=1e-15)
        assert committee_loss(model, st, check=False) >= 0.0
    st = CommitteeState.from_arrays(0.9 * np.eye(2), 0.8 * np.eye(2) + 0.05, np.ones(2))
    psd, plain = committee_loss_terms(model, st.Q[None], st.R[None], st.v[None])
    assert psd[0] == pytest.approx(plain[0], rel=1e-12) and psd[0] > 0.05


def test_integrated_loss_near_zero_stays_nonnegative_and_the_overlay_counts_it():
    """From near the optimum to α = 600 at rtol 10⁻⁶ (the overlay's tolerances) the plain sum
    goes below 0 at several checkpoints (the integration tolerance): the ODE's loss stays
    ≥ 0, and committee_records puts their number on ``ode_loss`` as ``clamped_below_zero``
    and says so in its note."""
    from dynamics.overlays.committee import CommitteeRegime, CommitteeStarts, committee_records
    from dynamics.setup.config import RunConfig
    from hermite.committee import committee_ode

    tr = committee_ode(erf_model(), near_optimum(), np.linspace(0, 600, 21),
                       integrator="solve_ivp", rtol=1e-6, atol=1e-9)
    assert tr.below_zero > 0 and tr.loss.min() >= 0.0
    spec = {"activation": ERF, "teacher": "committee", "k": 2, "d": 2000, "W": "orthonormal",
            "lam": "ones"}
    config = RunConfig(spec, learner="scratch", eta=0.25 / 2000, steps=600 * 2000, runs=1,
                       rows="free").validate()
    inst = config.run_instances()
    st = near_optimum()
    starts = CommitteeStarts(st.R.T[None], st.Q[None], st.v[None])
    regime = CommitteeRegime.of_learner(config, inst[0], starts, loss="squared", rows="free",
                                        diagonal=False, train_second_layer=False)
    out, attrs = committee_records(config, inst, np.linspace(0, 600 * 2000, 21).astype(int),
                                   starts, regime, quiet=True, noise=None)
    assert np.nanmin(out["ode_loss"]) >= 0.0
    assert attrs["ode_loss"]["clamped_below_zero"] == tr.below_zero
    assert "below 0" in attrs["ode_loss"]["note"]
    assert "clamped_below_zero" not in attrs["ode_alignment"]


def _scratch_traj(ode_loss, loss):
    runs, cps = np.shape(loss)
    steps = np.linspace(0, 1000, cps).astype(int)
    return Trajectory(steps=steps, overlap=np.full((runs, cps), 0.9), loss=np.asarray(loss),
                      ode=np.full((runs, cps), np.nan), diverged_step=np.full(runs, -1),
                      xi=np.zeros(runs), instance_seed=np.zeros(runs, dtype=np.int64),
                      extra={"alignment": np.full((runs, cps), 0.9),
                             "ode_loss": np.asarray(ode_loss),
                             "ode_alignment": np.full((runs, cps), 0.9)})


def test_a_log_loss_axis_draws_no_cliff_and_says_what_it_left_out():
    """An old file's committee ODE loss below 0 (−1.6·10⁻⁸) and an SGD loss at 0 by rounding:
    on the log axis neither is drawn (no line drops to the axis' floor), the y axis stays
    within the positive data, and the legend says how many values it left out."""
    decay = 10.0 ** -np.arange(6.0)
    ode = np.tile(np.r_[decay, -1.6e-8, -1.6e-8], (3, 1))
    sgd = np.tile(np.r_[decay, 1e-7, 0.0], (3, 1))
    fig, notes = run_figure(_scratch_traj(ode, sgd), "t")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    for ln in ax.get_lines():
        y = np.asarray(ln.get_ydata(), float)
        assert not (np.isfinite(y) & (y <= 0)).any(), ln.get_label()
    assert ax.get_ylim()[0] > 1e-9  # nothing pulled the axis down to a clipped floor
    said = [n for n in notes if "not drawn on the log axis" in n]
    assert len(said) == 1 and "median at 1 checkpoint" in said[0]
    assert "committee-machine ODE" in said[0] and "at 2 checkpoints" in said[0]
    texts = " ".join(t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts())
    assert "not drawn on the log axis" in texts
    plt.close(fig)


# ---------------------------------------------------------------- 2. no placeholder datasets
@pytest.fixture(scope="module")
def committee_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("committee") / "c.h5"
    spec = tmp_path_factory.getbasetemp() / "committee_spec.json"
    spec.write_text(json.dumps({"activation": "relu", "teacher": "committee", "k": 2, "d": 20,
                                "W": "gaussian"}))
    res = CliRunner().invoke(cli, ["run", str(spec), "--learner", "scratch", "--eta", "0.005",
                                   "--steps", "200", "--runs", "2", "--checkpoints", "5",
                                   "--out", str(path)])
    assert res.exit_code == 0, res.output
    return path


def test_a_committee_run_file_has_no_all_nan_or_placeholder_dataset(committee_file):
    import h5py

    with h5py.File(committee_file, "r") as f:
        assert "ode" not in f  # no population ODE of ⟨û, u⟩: nothing stored, not NaNs
        assert "xi" not in f  # a committee teacher has no ξ
        assert "extra/ode_alignment" in f  # its theory is stored where it exists
    traj, meta = read_trajectory(committee_file)  # the reader fills what was left out
    assert traj.ode.shape == traj.overlap.shape and np.isnan(traj.ode).all()
    assert traj.xi.shape == (2,) and (traj.xi == 0.0).all()
    assert "ode" not in meta["datasets"] and "xi" not in meta["datasets"]
    info = json.loads(CliRunner().invoke(cli, ["show", str(committee_file), "--json"]).output)
    assert info["placeholders"] == {}  # nothing stored that needs a warning


@pytest.fixture
def older_committee_file(committee_file, tmp_path):
    """The committee file as writers before this change stored it: with the all-NaN ``ode``
    and ``xi`` = 0.0 (files on disk keep them; show must still mark them)."""
    import shutil

    import h5py

    path = tmp_path / "older.h5"
    shutil.copy(committee_file, path)
    with h5py.File(path, "a") as f:
        runs, checkpoints = f["overlap"].shape
        f.create_dataset("ode", data=np.full((runs, checkpoints), np.nan))
        f.create_dataset("xi", data=np.zeros(runs))
    return path


def test_show_marks_the_all_nan_and_placeholder_datasets(older_committee_file):
    committee_file = older_committee_file
    res = CliRunner().invoke(cli, ["show", str(committee_file)])
    assert res.exit_code == 0, res.output
    lines = {ln.split()[1]: ln for ln in res.output.splitlines() if ln.startswith("dataset")}
    assert "all NaN: no population ODE of ⟨û, u⟩" in lines["ode"]
    assert "extra/ode_alignment" in lines["ode"]
    assert "a placeholder: a committee teacher has no ξ" in lines["xi"]
    info = json.loads(CliRunner().invoke(cli, ["show", str(committee_file), "--json"]).output)
    assert set(info["placeholders"]) == {"ode", "xi"}


# ---------------------------------------------------------------- 3. nn2pp's lr
def test_hermite_committee_prints_nn2pp_lr_as_the_docs_define_it(tmp_path):
    """docs/theory/committee-engine.md: nn2pp's --lr lr is --eta lr/(2N); --eta 0.000125 at
    N = 2000 is nn2pp's lr 0.5 (and the ODE's η̄ = η·d = 0.25)."""
    spec = tmp_path / "nn2pp.json"
    spec.write_text(json.dumps({"activation": ERF, "teacher": "committee", "k": 2, "d": 2000,
                                "W": "gaussian"}))
    args = ["hermite", "committee", str(spec), "--rows", "free", "--eta", "0.000125",
            "--steps", "20", "--checkpoints", "2"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    head = res.output.splitlines()[0]
    assert "nn2pp lr = 2·η·d = 0.5" in head and "η̄ = η·d = 0.25" in head
    assert "lr = eta·d" not in res.output
    out = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
    assert out["nn2pp_lr"] == pytest.approx(0.5) and out["eta_d"] == pytest.approx(0.25)
    assert "lr" not in out
    csq = CliRunner().invoke(cli, [*args[:3], "--learner", "scratch-csq", *args[5:],
                                   "--json"])
    assert csq.exit_code == 0, csq.output
    assert json.loads(csq.output)["nn2pp_lr"] is None  # nn2pp has no correlation loss
    assert "nn2pp" in CliRunner().invoke(cli, ["hermite", "committee", "--help"]).output


# ---------------------------------------------------------------- 4. titles
def test_titles_name_batch_and_label_noise_where_not_the_default():
    from dynamics.setup.config import RunConfig
    from sims.plots.curves import curve_attributes, describe

    inst = {"activation": "relu", "k": 3, "d": 20, "seed": 1}
    plain = RunConfig(instance=inst, eta=0.01, steps=100, runs=2)
    other = RunConfig(instance=inst, eta=0.01, steps=100, runs=2, batch=8, label_noise=0.01)
    assert "b = " not in instance_title(plain) and "label noise" not in instance_title(plain)
    title = instance_title(other)
    assert "b = 8" in title and "label noise σ² = 0.01" in title
    traj = Trajectory(steps=np.array([0, 10]), overlap=np.zeros((2, 2)), loss=np.ones((2, 2)),
                      ode=np.zeros((2, 2)), diverged_step=np.full(2, -1), xi=np.ones(2),
                      instance_seed=np.zeros(2, dtype=np.int64))

    def curve(cfg):
        return Curve(traj, curve_attributes(cfg.to_dict()), "", cfg.to_dict())

    assert "b = " not in describe([curve(plain)]) and "label noise" not in describe(
        [curve(plain)])
    shared = describe([curve(other)])
    assert "b = 8" in shared and "label noise σ² = 0.01" in shared
    fig = plot_curves([curve(plain), curve(other)], xscale="linear")
    labels = [ln.get_label() for ln in medians(fig.axes[0])]
    assert any("b = 8" in lab for lab in labels) and any("b = 1" in lab for lab in labels)
    plt.close(fig)


# ---------------------------------------------------------------- 8. show = the figures
def test_show_reports_the_median_of_abs_overlap_the_figure_draws(tmp_path):
    """Half the runs end near −u: the signed median (what ``loradyn plot`` draws by default)
    and the median of |⟨û,u⟩| (what reproduce draws) differ; show gives both, named, and the
    |⟨û,u⟩| one is the end of the abs_overlap figure's median line."""
    from dynamics.setup.config import RunConfig
    from sims.io.trajectory import write_trajectory

    config = RunConfig(instance={"activation": "relu", "k": 3, "d": 20, "seed": 1}, eta=0.01,
                       steps=100, runs=4, checkpoints=3)
    instances = config.run_instances()
    sign = np.array([1.0, 1.0, -1.0, -1.0])[:, None]
    overlap = sign * np.array([[0.1, 0.5, 0.9], [0.1, 0.5, 0.92], [0.1, 0.5, 0.94],
                               [0.1, 0.5, 0.96]])
    traj = Trajectory(steps=np.array([0, 10, 100]), overlap=overlap, loss=1 - overlap ** 2,
                      ode=overlap.copy(), diverged_step=np.full(4, -1),
                      xi=np.ones(4), instance_seed=np.zeros(4, dtype=np.int64),
                      instances=instances)
    path = write_trajectory(tmp_path / "t.h5", traj, config)
    res = CliRunner().invoke(cli, ["show", str(path)])
    assert res.exit_code == 0, res.output
    final = next(ln for ln in res.output.splitlines() if ln.startswith("final"))
    assert "median final |⟨û,u⟩| 0.93 (signed ⟨û,u⟩ -0.02)" in final
    fig = plot_curves(load_curves([path]), quantity="abs_overlap", xscale="linear")
    (line,) = [ln for ln in fig.axes[0].get_lines()
               if ln.get_linestyle() == "-" and ln.get_linewidth() == 2]  # the median
    assert line.get_ydata()[-1] == pytest.approx(0.93)
    plt.close(fig)
    info = json.loads(CliRunner().invoke(cli, ["show", str(path), "--json"]).output)
    assert info["summary"]["median_final_abs_overlap"] == pytest.approx(0.93)
    assert info["summary"]["median_final_overlap"] == pytest.approx(-0.02)


# ---------------------------------------------------------------- 9. missing theory named
def test_a_theory_line_missing_for_some_curves_is_named_in_the_panel_legend():
    """A theory line its file left out for one of two curves (the committee ODE failed from
    some starts: ``partial``; one over its budget: ``corrected``) is named in the legend of
    the panel, with that curve's label."""
    from sims.experiments.reproduce import render  # noqa: F401  (the same legend())

    def traj(attrs):
        t = Trajectory(steps=np.array([0, 10, 100]), overlap=np.full((2, 3), 0.5),
                       loss=np.ones((2, 3)), ode=np.full((2, 3), 0.4),
                       diverged_step=np.full(2, -1), xi=np.ones(2),
                       instance_seed=np.zeros(2, dtype=np.int64))
        t.extra_attrs["ode"] = attrs
        return t

    why = "finite-d corrected ODE not recorded: ≈ 99 s for 2 runs > 20 s"
    curves = [Curve(traj({}), {"eta": 0.01}), Curve(traj({"corrected": why}), {"eta": 0.02})]
    fig = plot_curves(curves, xscale="linear")
    texts = " ".join(t.get_text().replace("\n", " ") for ax in fig.axes if ax.get_legend()
                     for t in ax.get_legend().get_texts())
    assert f"for η = 0.02: {why}" in texts
    plt.close(fig)


def test_a_failed_committee_ode_is_recorded_and_named_in_the_legend(monkeypatch):
    """The committee ODE failing from every start is no longer only a stderr note: the file
    records why (``no_theory``) and the figure's legend names it."""
    import dynamics.overlays.committee as overlay
    from dynamics.engines.engine import simulate
    from dynamics.setup.config import RunConfig

    def fail(*args, **kwargs):
        raise RuntimeError("the ODE diverged (test)")

    monkeypatch.setattr(overlay, "integrate", fail)
    monkeypatch.setattr(overlay, "integrate_batch", fail)
    config = RunConfig(instance={"activation": "relu", "teacher": "committee", "k": 2, "d": 20,
                                 "W": "gaussian"}, learner="scratch", eta=0.005, steps=50,
                       runs=2, checkpoints=3).validate()
    traj = simulate(config)
    why = traj.extra_attrs["ode_loss"]["no_theory"]
    assert "failed from every run's initial state" in why and "(test)" in why
    fig, notes = run_figure(traj, "t", config=config)
    assert any(why in n for n in notes)
    texts = " ".join(t.get_text().replace("\n", " ") for t in fig.axes[0].get_legend().get_texts())
    assert "committee ODE left out" in texts
    plt.close(fig)


def test_a_diffusion_skipped_for_its_cost_says_so():
    from dynamics.overlays.committee import CommitteeRegime, plan_diffusion

    why = {}
    regime = CommitteeRegime("tanh", 10_000, 4, 4, "squared", 0.5 / 10_000)
    assert plan_diffusion(regime, 10**7, 16, 50, why=why) is None
    assert why["skipped"].startswith("the diffusion with SGD's step noise was skipped")


# ---------------------------------------------------------------- 10. bench and fit
def test_a_rate_from_an_interval_below_the_clock_is_enlarged_or_refused(monkeypatch):
    """On a fake clock (a run of n steps takes n·2 µs): the horizon doubles until the timed
    difference reaches MIN_INTERVAL_S; a run that takes no time is refused."""
    import types

    from sims.bench import reduced
    from sims.bench.reduced import MIN_INTERVAL_S, ShortInterval, _rate

    clock = [0.0]
    monkeypatch.setattr(reduced, "time", types.SimpleNamespace(
        perf_counter=lambda: clock[0], process_time=lambda: clock[0]))
    with pytest.raises(ShortInterval, match="no rate reported"):
        _rate(lambda n: None, 8, 500, 1)

    def run(n):
        clock[0] += n * 2e-6

    used = []
    wall, _ = _rate(run, 8, 500, 1, used)
    assert used == [8000] and 4000 * 2e-6 < MIN_INTERVAL_S <= 8000 * 2e-6
    assert wall == pytest.approx(8 / 2e-6, rel=1e-9)  # 8 runs × 1 step per 2 µs


def test_a_power_law_fit_with_one_value_of_d_says_it_needs_two():
    from sims.experiments.fit import fit_power_law

    with pytest.raises(ValueError, match="at least two values of d") as exc:
        fit_power_law([100], [np.array([10.0, 12.0, 11.0])])
    assert "never reached" not in str(exc.value)
    with pytest.raises(ValueError, match="at least two values of d"):
        fit_power_law([100, 100], [np.array([10.0]), np.array([12.0])])
    with pytest.raises(ValueError, match=r"at d = 1000 half or more"):
        fit_power_law([100, 1000], [np.array([10.0]), np.array([np.nan])])


def test_the_summary_median_counts_runs_that_never_arrive():
    """A run that never reaches 0.5 is later than every run that does: with 1 of 4 arriving
    (at step 20) the median is not 20 but 'not reached' (NaN), and the fraction says 25 %."""
    from dynamics.runtime.trajectory import Trajectory

    steps = np.array([0, 10, 20])
    overlap = np.array([[0.1, 0.3, 0.6], [0.1, 0.2, 0.3], [0.1, 0.2, 0.4], [0.1, 0.1, 0.2]])
    nan = np.full_like(overlap, np.nan)

    def summary(rows):
        traj = Trajectory(steps, overlap[rows], nan[rows], nan[rows],
                          np.full(len(rows), -1), np.ones(len(rows)), np.zeros(len(rows)))
        return traj.summary()

    s = summary([0, 1, 2, 3])
    assert np.isnan(s["median_steps_to_0.5"]) and s["fraction_reached_0.5"] == 0.25
    s = summary([0, 0, 1])  # 2 of 3 arrive at step 20: the median is theirs
    assert s["median_steps_to_0.5"] == 20 and s["fraction_reached_0.5"] == 2 / 3


def test_show_counts_runs_that_never_arrive_as_the_run_summary_does():
    """``loradyn show``'s |⟨û,u⟩| median: 1 of 2 runs arriving is 'not reached', not the one
    arrival's step (np.nanmedian had dropped the other run)."""
    from dynamics.runtime.trajectory import Trajectory
    from sims.commands.show import _final, summary

    steps = np.array([0, 10, 20])
    overlap = np.array([[0.1, -0.3, -0.6], [0.1, 0.2, 0.3], [0.1, 0.6, 0.7]])
    nan = np.full_like(overlap, np.nan)

    def show(rows):
        traj = Trajectory(steps, overlap[rows], nan[rows], nan[rows],
                          np.full(len(rows), -1), np.ones(len(rows)), np.zeros(len(rows)))
        return summary(traj)

    s = show([0, 1])
    assert np.isnan(s["median_steps_to_abs_0.5"]) and s["fraction_reached_abs_0.5"] == 0.5
    assert "not reached (50% of the runs did)" in _final(s, network=False)
    s = show([0, 1, 2])  # |⟨û,u⟩| of run 0 reaches 0.5 at 20, run 2 at 10: median 20
    assert s["median_steps_to_abs_0.5"] == 20 and s["fraction_reached_abs_0.5"] == 2 / 3
