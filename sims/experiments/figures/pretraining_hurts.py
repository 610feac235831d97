"""'When pre-training hurts' (issue 39) as a reproduce target: steps for the adapter's v to reach
|⟨v, u⟩| = μ against μ on the ``pretrained-glm`` exact chain at the paper's setting
(:mod:`sims.experiments.pretraining_hurts`), beside the published tables and the theory."""

from __future__ import annotations

import math

import numpy as np

from sims.experiments.figures.recipe import Recipe, measure_and_draw
from sims.experiments.pretraining_hurts import (
    FORMAT,
    HALF_WIDTH,
    PUBLISHED,
    PUBLISHED_SOURCE,
    HurtsResult,
    HurtsSpec,
    trap_mus,
)

NAME = "pretraining-hurts"
INSTANCE = "the pre-trained single-index model"  # reproduce's refusal of other conventions
MUS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MAIN = ("linear", "relu", "erf", "sigmoid")
HERMITE = ("he2", "he3", "he5")
COLORS = {"linear": "C0", "relu": "C1", "erf": "C2", "sigmoid": "C3", "he2": "C4",
          "he3": "C5", "he5": "C6"}
__all__ = ["NAME", "FORMAT", "RECIPE", "spec", "render", "reproduce"]


def spec(quick: bool) -> HurtsSpec:
    """The full size (linear, ReLU, erf, sigmoid and h₂, h₃, h₅ at μ = 0.1 … 0.9, 64 runs per
    point) or the quick one (linear and ReLU at μ = 0.1, 0.5, 0.9, h₂ at 0.5, h₃ at 0.5 and
    0.7; 16 runs, 50 subsets, horizon ≤ 20 000 steps)."""
    if quick:
        return HurtsSpec(main=tuple((a, m) for a in ("linear", "relu") for m in (0.1, 0.5, 0.9)),
                         hermite=(("he2", 0.5), ("he3", 0.5), ("he3", 0.7)), runs=16,
                         subsets=50, max_horizon=20_000, label="quick")
    return HurtsSpec(main=tuple((a, m) for a in MAIN for m in MUS),
                     hermite=tuple((a, m) for a in HERMITE for m in MUS))


CAPTION = (
    "When pre-training hurts (Nwemadji, Loureiro & Barbier 2026; issue 39): from a pre-trained "
    "base w₀ = μu, the steps until the adapter's direction v reaches |⟨v, u⟩| = μ, against μ, "
    "on the exact chain of the pretrained-glm learner (float64, CPU) at the paper's setting: "
    "d = 1000, B = 500, a₀ = 1/d², v₀ uniform on the sphere (their code normalises V at "
    "initialisation), η = 0.2; for hₙ = Heₙ/√(n!) η = 0.2/n, the same SGD as theirs on Heₙ "
    "with lr 0.2/(n!·n). Dots with bars: median and quartiles over runs of the per-run first "
    "passage (a run that never crosses within the horizon counts as +∞; an open triangle at "
    "the horizon marks a median not reached, a bar to the horizon a quartile not reached, and "
    "the count of such runs is written beside). Open squares: the paper's statistic on the "
    f"same runs (the mean step index at which the mean |m| over runs lies within "
    f"±{HALF_WIDTH} of μ). Crosses: the "
    f"published tables ({PUBLISHED_SOURCE}, data_numerics_paper/*_time_to_overlap*.npz; a "
    "3-seed mean). Solid line: the population flow's crossing of μ from the runs' typical "
    "start (a₀, median |m₀|), with the renormalisation term of η, d, B; dotted: the "
    "asymptote ½·τ(μ)·ln d/η. (a) linear, ReLU, erf, sigmoid; (b) h₂, h₃, h₅, with their "
    "traps (grey verticals: b(μ) = 0, τ = ∞). Full size: 64 runs per point; quick: linear and "
    "ReLU at μ = 0.1, 0.5, 0.9, h₂ at 0.5 and h₃ at 0.5, 0.7, 16 runs.")

RECIPE = Recipe(
    name=NAME,
    summary=("Pre-training hurts (issue 39): steps to |⟨v,u⟩| = μ against μ, chain vs the "
             "paper's tables and τ(μ)"),
    caption=CAPTION,
    sweep=None,
    panels=lambda quick: (),
)


def _draw(ax, points: list, horizon_note: bool) -> None:
    """One activation per colour: quartile bars, paper statistic, published, flow, asymptote."""
    from sims.experiments.pretraining_hurts import run_quantiles

    by_act: dict = {}
    for p in points:
        by_act.setdefault(p["activation"], []).append(p)
    for act, pts in by_act.items():
        color = COLORS.get(act)
        mu = np.array([p["mu"] for p in pts])
        q = np.array([run_quantiles(p) for p in pts])
        horizon = np.array([p["horizon"] for p in pts], dtype=float)
        med = q[:, 1]
        ok = np.isfinite(med)
        with np.errstate(invalid="ignore"):  # ∞ − ∞ where the median is not reached
            lo = med - np.where(np.isfinite(q[:, 0]), q[:, 0], med)
            hi = np.where(np.isfinite(q[:, 2]), q[:, 2], horizon) - med
        ax.errorbar(mu[ok], med[ok], yerr=(lo[ok], hi[ok]), fmt="o", color=color, capsize=3,
                    label=f"{act}: median [quartiles]")
        if (~ok).any():
            ax.plot(mu[~ok], horizon[~ok], "^", mfc="none", color=color, ms=8)
        for p in pts:
            if p["never"]:
                ax.annotate(f"{p['never']}/{len(p['m0'])} never", (p["mu"], p["horizon"]),
                            fontsize=6.5, color=color, xytext=(-3, 8), rotation=90,
                            textcoords="offset points", va="bottom")
        stat = np.array([p["window_stat"] for p in pts])
        ax.plot(mu, stat, "s", mfc="none", color=color, ms=7)
        pub = PUBLISHED.get(act, {})
        if pub:
            ax.plot(list(pub), list(pub.values()), "x", color=color, ms=8, mew=1.6)
        flow = np.array([p["flow_steps"] for p in pts])
        ax.plot(mu[np.isfinite(flow)], flow[np.isfinite(flow)], "-", color=color, lw=1.2)
        asym = np.array([p["asymptote_steps"] for p in pts])
        ax.plot(mu[np.isfinite(asym)], asym[np.isfinite(asym)], ":", color=color, lw=1.2)
    from matplotlib.lines import Line2D

    keys = [Line2D([], [], ls="none", marker="s", mfc="none", color="0.3",
                   label=f"paper's statistic (mean |m| within ±{HALF_WIDTH} of μ)"),
            Line2D([], [], ls="none", marker="x", color="0.3", label="published (3 seeds)"),
            Line2D([], [], color="0.3", label="flow from the typical start"),
            Line2D([], [], color="0.3", ls=":", label="½τ(μ) ln d/η")]
    if horizon_note:
        keys.append(Line2D([], [], ls="none", marker="^", mfc="none", color="0.3",
                           label="median not reached: drawn at the horizon"))
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + keys, fontsize=6.5, loc="best")
    ax.set_yscale("log")
    ax.set_xlabel("μ (alignment of the pre-trained base)")
    ax.set_ylabel("steps to |⟨v, u⟩| = μ")
    ax.grid(alpha=0.3, which="both")


def render(result: HurtsResult, quick: bool):
    """Panel (a): the monotone activations; (b): h₂, h₃, h₅ with their traps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec_ = result.spec
    main_acts = {a for a, _ in spec_.main}
    panels = [("(a) linear, ReLU, erf, sigmoid", [p for p in result.points
                                                  if p["activation"] in main_acts]),
              ("(b) hₙ = Heₙ/√(n!), η = 0.2/n", [p for p in result.points
                                                 if p["activation"] not in main_acts])]
    panels = [(t, pts) for t, pts in panels if pts]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 5.2), squeeze=False,
                             constrained_layout=True)
    for ax, (title, pts) in zip(axes.flat, panels, strict=True):
        never = any(not math.isfinite(np.median(np.where(np.isnan(p["passages"]), np.inf,
                                                          p["passages"]))) for p in pts)
        _draw(ax, pts, never)
        if title.startswith("(b)"):
            for act in dict.fromkeys(p["activation"] for p in pts):
                for mu_star in trap_mus(act):
                    ax.axvline(mu_star, color=COLORS.get(act, "0.5"), ls="--", lw=0.9,
                               alpha=0.6)
                    ax.annotate(f"{act} trap μ* = {mu_star:.3f}", (mu_star, 0.02),
                                xycoords=("data", "axes fraction"), rotation=90, fontsize=6.5,
                                color=COLORS.get(act, "0.5"), xytext=(2, 0),
                                textcoords="offset points")
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0.0, 1.0)
    fig.suptitle(f"pretraining-hurts{' (quick)' if quick else ''}: d = {spec_.d}, "
                 f"B = {spec_.batch}, a₀ = 1/d², v₀ on the sphere, {spec_.runs} runs per point "
                 "(exact chain); the paper's convention", fontsize=9)
    return fig


def reproduce(quick: bool, h5, png, echo=None) -> HurtsResult:
    """Measure (resuming the points of an earlier ``h5``), write ``h5``, draw ``png`` and, with
    ``echo``, print the table (:func:`sims.experiments.pretraining_hurts.summary_lines`)."""
    from sims.experiments.pretraining_hurts import run_hurts, summary_lines

    return measure_and_draw(run_hurts, lambda result: render(result, quick), summary_lines,
                            spec(quick), (h5, png), echo)
