"""Fig. 6 (c): the plateau's length against ξ (issue 25, item 6).

Passage extraction against hand-made trajectories; the theory line is
``hermite.finetune_steps_to_reach`` of each cell's instance and options and lengthens with ξ
at the quick sizes (measured: see test_theory_plateau_lengthens_at_quick_sizes); SGD's passage
agrees with the ODE's on a small sweep (d = 100, 2 ξ) run through ``reproduce``; its figure has
three panels and a panel (c) with both theory lines.
"""

from __future__ import annotations

import dataclasses
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import hermite  # noqa: E402
from dynamics.instances.instance import build_instance  # noqa: E402
from dynamics.runtime.trajectory import Trajectory  # noqa: E402
from sims.experiments.figures import FIGURES, fig6  # noqa: E402
from sims.experiments.figures.recipe import Panel  # noqa: E402
from sims.experiments.reproduce import render, reproduce  # noqa: E402
from sims.io.sweep import read_sweep  # noqa: E402
from sims.plots.curves import Curve, load_curves  # noqa: E402
from sims.plots.passage import (  # noqa: E402
    RTOL,
    censored_quantile,
    draw_passage,
    first_passage,
    passage_of,
    passage_table,
)

LEVEL = fig6.LEVEL
TINY_MULTIPLES = (1, 8)  # ξ/√k of the small sweep


def hand_curve(overlap, ode=None, xi=3.0, k=9, diverged=None) -> Curve:
    overlap = np.asarray(overlap, dtype=float)
    runs, cps = overlap.shape
    traj = Trajectory(
        steps=np.arange(cps, dtype=np.int64) * 10, overlap=overlap,
        loss=np.zeros_like(overlap), ode=np.full_like(overlap, np.nan) if ode is None
        else np.asarray(ode, dtype=float),
        diverged_step=np.full(runs, -1, dtype=np.int64) if diverged is None
        else np.asarray(diverged, dtype=np.int64),
        xi=np.full(runs, xi), instance_seed=np.zeros(runs, dtype=np.int64))
    return Curve(traj, {"xi": xi, "k": k, "d": 100})


# ---------------------------------------------------------------- extraction
def test_first_passage_of_a_hand_made_trajectory():
    values = np.array([[0.1, 0.3, 0.6, 0.4, 0.7],     # first ≥ 0.5 at checkpoint 2
                       [0.1, 0.2, 0.2, 0.3, 0.4],     # never
                       [np.nan] * 5,                  # no data
                       [0.5, 0.1, 0.1, 0.1, 0.1],     # at the level at once (≥ counts)
                       [0.0, 0.2, 0.49, 0.5, np.nan]])  # NaN after a divergence
    steps = np.array([0, 10, 20, 30, 40])
    got = first_passage(values, steps, 0.5)
    np.testing.assert_array_equal(got, [20.0, np.inf, np.nan, 0.0, 30.0])


def test_passage_of_a_curve_uses_the_absolute_overlap_and_censors_at_the_horizon():
    overlap = [[0.0, -0.2, -0.55, -0.9],   # û → −u: |⟨û,u⟩| crosses at step 20
               [0.0, 0.1, 0.2, 0.6],       # step 30
               [0.0, 0.1, 0.1, 0.1],       # never
               [0.0, 0.7, 0.8, 0.9]]       # step 10
    ode = [[0.0, -0.3, -0.6, -0.9], [0.0, 0.2, 0.5, 0.9],
           [0.0, 0.1, 0.2, 0.3], [0.0, 0.6, 0.9, 1.0]]
    p = passage_of(hand_curve(overlap, ode), LEVEL, theory=False)
    np.testing.assert_array_equal(p.sgd, [20.0, 30.0, np.inf, 10.0])
    assert p.never == 1 and p.runs == 4 and p.horizon == 30.0
    assert p.sgd_median == 25.0  # between 20 and 30, as np.median of the finite part
    assert p.sgd_lo == pytest.approx(np.percentile([10, 20, 30, 1e9], 10))
    assert math.isinf(p.sgd_hi)  # the 90 % run never reached it
    np.testing.assert_array_equal(p.ode, [20.0, 20.0, np.inf, 10.0])
    assert p.ode_median == 20.0


def test_finite_xi_and_corrected_lines_give_their_medians_over_the_runs_that_have_them():
    """The finite-ξ line (extra/ode_finite_xi) and the corrected ODE: the median passage over
    the runs where the line was computed (a line from some starts only: NaN in the others);
    a line the audit left out of figures (``not_drawn``) gives none, nor is it drawn."""
    overlap = [[0.0, 0.6, 0.7, 0.8]] * 4
    curve = hand_curve(overlap, ode=[[0.0, 0.1, 0.6, 0.9]] * 4)
    nan = [np.nan] * 4
    curve.traj.extra["ode_finite_xi"] = np.array([[0.0, 0.2, 0.3, 0.6], nan,
                                                  [0.0, 0.6, 0.7, 0.8], nan])
    curve.traj.ode_corrected = np.array([[0.0, 0.1, 0.2, 0.3]] * 4)
    p = passage_of(curve, LEVEL, theory=False)
    assert p.ode_median == 20.0
    assert p.finite_xi_median == 20.0  # the median of 30 and 10 (two runs have the line)
    assert math.isinf(p.corrected_median)  # never reaches the level by the horizon
    fig, ax = plt.subplots()
    draw_passage(ax, [curve], x="xi/sqrt(k)", level=LEVEL)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("finite-ξ line" in lab for lab in labels)
    plt.close(fig)
    curve.traj.extra_attrs = {"ode_finite_xi": {"not_drawn": "outside tolerance"}}
    assert math.isnan(passage_of(curve, LEVEL, theory=False).finite_xi_median)
    fig, ax = plt.subplots()
    draw_passage(ax, [curve], x="xi/sqrt(k)", level=LEVEL)
    assert not any("finite-ξ" in t.get_text() for t in ax.get_legend().get_texts())
    plt.close(fig)


def test_passage_leaves_out_diverged_runs():
    overlap = [[0.0, 0.6, 0.7], [0.0, np.nan, np.nan], [0.0, 0.2, 0.6]]
    p = passage_of(hand_curve(overlap, diverged=[-1, 5, -1]), LEVEL, theory=False)
    np.testing.assert_array_equal(p.sgd, [10.0, 20.0])
    assert p.runs == 2 and p.never == 0


def test_censored_quantile():
    assert censored_quantile([3, 1, 2, np.inf], 50) == 2.5
    assert math.isinf(censored_quantile([1, 2, np.inf, np.inf], 50))
    assert math.isinf(censored_quantile([1, 2, 3, np.inf], 90))
    finite = np.array([5.0, 1.0, 7.0, 2.0, 9.0])
    for q in (10, 50, 90):
        assert censored_quantile(finite, q) == pytest.approx(np.percentile(finite, q))
    assert math.isnan(censored_quantile([np.nan, np.nan], 50))


def test_a_passage_panel_without_theory_marks_the_censored_runs():
    never = hand_curve([[0.0, 0.1, 0.2]] * 3, xi=6.0)
    quick = hand_curve([[0.0, 0.6, 0.9]] * 3, xi=3.0)
    fig, ax = plt.subplots()
    rows = draw_passage(ax, [never, quick], x="xi/sqrt(k)", level=LEVEL)
    assert [p.x for p in rows] == [1.0, 2.0]
    assert "3/3" in [t.get_text() for t in ax.texts]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(lab.startswith("no theory line: the file records no run config")
               for lab in labels)
    assert not any("population ODE from" in lab for lab in labels)
    plt.close(fig)


# ---------------------------------------------------------------- theory at quick sizes
def test_theory_plateau_lengthens_at_quick_sizes():
    """Measured (He₃, d = 300, k = 10, ηd = 5e-4, joint ĉ, unprojected; steps to |m| = 0.5):

    ξ/√k          1        2        4        8        16
    m₀ = +1/√d  173,788  222,915  207,443  404,368  1,129,475
    m₀ = −1/√d  136,744  114,370  186,417  233,519    257,351

    Below the threshold ξ ≈ d^{1/4}√k ≈ 4.2√k the lines are flat (neither is monotone
    there: no plateau, the overlap rises at once); from 4√k on both lengthen, and so does
    their mean over the whole range."""
    spec = fig6.sweep(True)
    base = spec["base"]
    d, k = base["instance"]["d"], base["instance"]["k"]
    eta = base["eta_times_d"] / d
    assert base["joint_c"] and not base["project"]
    times = np.array([hermite.finetune_steps_to_reach(
        build_instance(base["instance"] | {"xi": xi}), eta, LEVEL,
        m0=np.array([1.0, -1.0]) / math.sqrt(d), project=False, joint_c=True, rtol=RTOL)
        for xi in fig6.xis(k)])  # (ξ, sign)
    assert np.isfinite(times).all()
    above = times[list(fig6.MULTIPLES).index(4):]
    assert (np.diff(above, axis=0) > 0).all()  # both signs lengthen from 4√k on
    assert (np.diff(times.mean(axis=1)) > 0).all()  # the mean over the whole range
    assert (times[-1] > 1.5 * times[0]).all()  # 16√k against √k: ×6.5 (+), ×1.9 (−)
    below = times[:list(fig6.MULTIPLES).index(4) + 1]
    assert (below.max(axis=0) < 2 * below.min(axis=0)).all()  # flat below the threshold


# ---------------------------------------------------------------- a small sweep end to end
def tiny_fig6(quick: bool) -> dict:
    spec = fig6.sweep(quick)
    spec["sweep"]["name"] = "fig6-tiny"
    spec["base"] |= {"runs": 6, "steps_per_d": 3000, "checkpoints": 60}
    spec["base"]["instance"] |= {"d": 100}
    k = spec["base"]["instance"]["k"]
    spec["axes"] = {"xi": [round(m * math.sqrt(k), 4) for m in TINY_MULTIPLES]}
    return spec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("fig6")
    recipe = dataclasses.replace(FIGURES["fig6"], sweep=tiny_fig6)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FIGURES, "fig6", recipe)
        res = reproduce("fig6", quick=True, out_dir=out)
    curves = load_curves([res.h5])
    return res, curves, passage_table(curves, "xi/sqrt(k)", LEVEL)


def test_theory_line_is_finetune_steps_to_reach_of_each_cell(tiny):
    res, _, rows = tiny
    _, cells = read_sweep(res.h5)
    assert len(cells) == len(rows) == 2
    for cell, row in zip(sorted(cells, key=lambda c: c.config["instance"]["xi"]), rows,
                         strict=True):
        cfg = cell.config
        inst = build_instance(cfg["instance"])
        assert row.x == pytest.approx(inst.xi / math.sqrt(inst.k))
        assert cfg["joint_c"] and not cfg["project"] and cfg["learner"] == "finetune"
        eta_c = cfg["eta"] if cfg.get("eta_c") is None else cfg["eta_c"]
        want = hermite.finetune_steps_to_reach(
            inst, cfg["eta"], LEVEL, m0=np.array([1.0, -1.0]) / math.sqrt(inst.d),
            project=False, joint_c=True, eta_c=eta_c, prox=cfg.get("prox", 0.0), rtol=RTOL)
        assert [row.theory[1], row.theory[-1]] == pytest.approx(want, rel=1e-12)
        # the runs start at the uniform law's |⟨û₀,u⟩| ~ d^{-1/2}
        assert np.sqrt(np.mean(row.m0**2)) < 3 / math.sqrt(inst.d)


def test_sgd_passage_agrees_with_the_ode_and_lengthens_with_xi(tiny):
    """Measured (d = 100, k = 10, 6 runs, horizon 300,000 steps, checkpoints every 5,085):
    ξ = √k: SGD median 53,390 (10–90 %: 25,424–106,780), per-run ODE median 48,305, ODE from
    ±1/√d 42,426 / 33,939; ξ = 8√k: SGD median 111,864 (88,983–231,356), per-run ODE median
    116,949, ODE from ±1/√d 102,705 / 55,217."""
    _, _, rows = tiny
    for p in rows:
        assert p.never == 0 and p.runs == 6
        assert 1 / 3 < p.sgd_median / p.ode_median < 3
        lo, hi = min(p.theory.values()), max(p.theory.values())
        assert lo / 3 < p.sgd_median < 3 * hi
    first, last = rows
    assert last.sgd_median > 1.5 * first.sgd_median  # SGD's plateau lengthens (×2.1)
    assert last.ode_median > first.ode_median
    assert all(last.theory[s] > first.theory[s] for s in (1, -1))


def test_rendered_figure_has_three_panels_and_both_theory_lines(tiny):
    res, _, rows = tiny
    assert res.png.stat().st_size > 1000
    fig = render(FIGURES["fig6"], res.h5, True)
    assert len(fig.axes) == 3
    ax = fig.axes[2]
    assert ax.get_title().startswith("(c) plateau length")
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    for sign in ("+", "−"):
        line = lines[f"population ODE from m₀ = {sign}1/√d"]
        assert line.get_linestyle() == "-"
        np.testing.assert_allclose(line.get_xdata(), [p.x for p in rows])
        np.testing.assert_allclose(line.get_ydata(),
                                   [p.theory[1 if sign == "+" else -1] for p in rows])
    dashed = lines["median of the ODE beside each run (its own start)"]
    assert dashed.get_linestyle() == "--"
    np.testing.assert_allclose(dashed.get_ydata(), [p.ode_median for p in rows])
    assert ax.containers  # the SGD error bars
    plt.close(fig)


def test_unknown_panel_kind_is_an_error(tiny):
    res, _, _ = tiny
    recipe = dataclasses.replace(FIGURES["fig6"], panels=lambda quick: (
        Panel("(x)", {}, kind="histogram"),))
    with pytest.raises(ValueError, match="unknown kind 'histogram'"):
        render(recipe, res.h5, True)
    bad = dataclasses.replace(FIGURES["fig6"], panels=lambda quick: (
        Panel("(x)", {}, x="xi/sqrt(k)", kind="passage"),))
    with pytest.raises(ValueError, match="needs a level"):
        render(bad, res.h5, True)
    plt.close("all")
