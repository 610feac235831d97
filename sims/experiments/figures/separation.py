"""The separation of Claim 2 / Theorem 19 as a reproduce target: fine-tuning, ``scratch`` and
``scratch-csq`` on the Claim 2 instance (He₃) over a grid of d (:mod:`sims.experiments.separation`),
drawn as median steps to L* against d with the reference laws, and the runs that never arrive."""

from __future__ import annotations

import numpy as np

from sims.experiments.figures.recipe import Recipe, measure_and_draw
from sims.experiments.separation import (
    FORMAT,
    LEVEL,
    SeparationResult,
    SeparationSpec,
    fine_tuning,
)

NAME = "separation"
#: per learner: η = c/d (finetune) or c/d^{p/2}, horizon H·d or H·d^{p−1} (the values of
#: docs/theory/theorem19.md's He₃ measurement)
C = {"finetune": 0.05, "scratch": 0.1, "scratch-csq": 0.05}
HORIZON = {"finetune": 400.0, "scratch": 100.0, "scratch-csq": 40.0}
FULL_D = (100, 141, 200, 283, 400, 566, 800, 1131, 1600, 2263, 3200)
QUICK_D = (71, 100, 141, 200, 283)
__all__ = ["NAME", "FORMAT", "RECIPE", "spec", "render", "reproduce"]
COLORS = {"finetune": "C0", "scratch": "C3", "scratch-csq": "C2"}
MARKERS = {"finetune": "o", "scratch": "s", "scratch-csq": "D"}


def spec(quick: bool) -> SeparationSpec:
    """The full size (the paper-size He₃ measurement: d = 100 … 3200, 16 runs) or the quick
    one (d = 71 … 283, 8 runs, ``scratch-csq``'s horizon 20·d²)."""
    if quick:
        return SeparationSpec("he3", QUICK_D, 8, c=dict(C),
                              horizon=HORIZON | {"scratch-csq": 20.0})
    return SeparationSpec("he3", FULL_D, 16, c=dict(C), horizon=dict(HORIZON))


CAPTION = (
    "Claim 2 / Theorem 19 on the Claim 2 instance (σ = He₃, k = 4, W = claim2: teacher "
    "neurons orthonormal, ξ = 1, ĉ = c, λ = 1): steps to the target loss L* (fine-tuning's "
    f"exact population loss at overlap {LEVEL}) against d, on the exact chains (float64, CPU). "
    "(a) Median over runs with its bootstrap 95 % CI, fitted slope of log median T on log d "
    "with its bootstrap CI in the legend: finetune (rank-1 chain, ĉ frozen, projected, "
    "η = 0.05/d), scratch (squared loss, k′ = 4 random unit rows, λ̂ = λ, η = 0.1/d^{3/2}) and "
    "scratch-csq (correlation loss, η = 0.05/d^{3/2}); an open triangle at the horizon marks "
    "a median the runs never reached (censored: left out of the fit). Grey: the reference "
    "laws d (dotted), d^{p/2} (the CSQ lower bound, dashed) and d^{p−1} (online SGD on "
    "information exponent p = 3, dash-dotted), anchored at the first point of fine-tuning "
    "and of scratch. (b) The fraction of runs that never reach L* within the horizon "
    "(400·d for finetune, 100·d² scratch, 40·d² scratch-csq). Full size: d = 100 … 3200, "
    "16 runs per d (docs/theory/theorem19.md); quick: d = 71 … 283, 8 runs, scratch-csq's "
    "horizon 20·d².")

RECIPE = Recipe(
    name=NAME,
    summary=("Claim 2 / Thm 19: steps to L* against d, finetune (∝ d) against scratch, "
             "scratch-csq"),
    caption=CAPTION,
    sweep=None,
    panels=lambda quick: (),
)


def _power(x: float) -> str:
    return "d" if x == 1 else f"d^{x:g}"


def render(result: SeparationResult, quick: bool):
    """Panel (a): medians with CIs, fits and reference laws; (b): fraction never arriving."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    spec_, p = result.spec, result.spec.p
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12.4, 5.0), width_ratios=(1.6, 1),
                                 constrained_layout=True)
    anchors = {}
    for name, s in result.series.items():
        color, marker = COLORS.get(name), MARKERS.get(name, "o")
        ok = np.isfinite(s.median)
        lo, hi = s.median_ci[:, 0], s.median_ci[:, 1]
        hi_drawn = np.where(np.isfinite(hi), hi, s.horizon_steps)
        fit = s.fit
        if fit["slope"] is not None:
            label = (f"{name}: slope {fit['slope']:.2f} [{fit['slope_ci'][0]:.2f}, "
                     f"{fit['slope_ci'][1]:.2f}]")
            yerr = (s.median[ok] - lo[ok], hi_drawn[ok] - s.median[ok])
            ax.errorbar(s.d[ok], s.median[ok], yerr=yerr, fmt=marker, color=color, capsize=3,
                        label=label)
            dd = np.array(fit["d_fitted"])
            ax.plot(dd, np.exp(fit["intercept"]) * dd ** fit["slope"], "-", color=color, lw=1.2)
            anchors.setdefault("ft" if fine_tuning(name) else "scratch",
                               (s.d[ok][0], s.median[ok][0]))
        elif ok.any():
            ax.plot(s.d[ok], s.median[ok], marker, color=color,
                    label=f"{name}: no fit ({fit['why'].split(' (')[0]})")
        if (~ok).any():
            ax.plot(s.d[~ok], s.horizon_steps[~ok], "^", mfc="none", color=color, ms=8,
                    label=f"{name}: median not reached by the horizon "
                          f"{result.spec.horizon_law(name)} (drawn at the horizon)")
        bx.plot(s.d, 100 * s.never, marker + "-", color=color, label=name,
                mfc="none" if fine_tuning(name) else color, ms=9 if fine_tuning(name) else 6)
    dref = np.geomspace(min(spec_.d), max(spec_.d), 20)
    for expo, anchor, note, ls in ((1.0, "ft", "", ":"), (p / 2, "scratch", " (CSQ bound)", "--"),
                                   (p - 1.0, "scratch", f" (online SGD, info. exponent {p})",
                                    "-.")):
        if anchor in anchors:
            d0, t0 = anchors[anchor]
            ax.plot(dref, t0 * (dref / d0) ** expo, ls, color="0.45", lw=1.1,
                    label=f"∝ {_power(expo)}{note}")
    for axis in (ax, bx):
        axis.set_xscale("log")
        axis.xaxis.set_major_locator(FixedLocator(list(spec_.d)))
        axis.xaxis.set_minor_locator(NullLocator())
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.set_xlabel("d")
        axis.grid(alpha=0.3, which="both")
    ax.set_yscale("log")
    ax.set_ylabel("steps to L* (median over runs, 95 % CI)")
    ax.set_title("(a) first passage of L* against d", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper left")
    bx.set_ylim(-3, 103)
    bx.set_ylabel("runs that never reach L* within the horizon (%)")
    bx.set_title("(b) never arriving (censored runs)", fontsize=10)
    bx.legend(fontsize=7.5)
    fig.suptitle(f"separation{' (quick)' if quick else ''}: σ = He{p}, k = 4 (claim2), ξ = 1, "
                 f"ĉ = c, {spec_.runs} runs per d; η = "
                 + ", ".join(f"{spec_.eta_law(n)} ({n})" for n in result.series), fontsize=9)
    return fig


def reproduce(quick: bool, h5, png, echo=None) -> SeparationResult:
    """Measure (resuming the cells of an earlier ``h5``), write ``h5``, draw ``png`` and, with
    ``echo``, print the summary (:func:`sims.experiments.separation.summary_lines`)."""
    from sims.experiments.separation import run_separation, summary_lines

    return measure_and_draw(run_separation, lambda result: render(result, quick), summary_lines,
                            spec(quick), (h5, png), echo)
