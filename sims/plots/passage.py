"""Passage-time panels: the step at which |⟨û, u⟩| first reaches a level, against a sweep axis.

A ``Panel(kind="passage", level=…, x=…)`` (:mod:`sims.experiments.figures.recipe`) is drawn by
:func:`draw_passage` from the curves of a sweep file (:func:`sims.plots.curves.load_curves`),
one point per curve (cell, ξ and instance group):

* SGD: each run's first checkpoint step with |⟨û, u⟩| ≥ level (:func:`first_passage`), the
  median over the runs that did not diverge and its 10–90 % range (error bars). Runs that never
  reach the level by the horizon (the last checkpoint) are censored: a quantile that needs one
  of them is "beyond the horizon" (:func:`censored_quantile`), drawn as an open marker at the
  horizon with an arrow up, and every point says how many runs never reached it (``n/R``).
* theory, solid: the population ODE of fine-tuning (``hermite.finetune_steps_to_reach``) from
  m₀ = +d^{-1/2} and from m₀ = −d^{-1/2} (the typical |⟨û₀, u⟩| of a uniform start on
  S^{d−1}), with p₀ = 0 (no span-W part), the instance's ĉ₀ and the cell's learner options
  (project, joint ĉ, η, η_c, prox): two lines, since with ĉ₀ fixed the flow is not symmetric
  under m → −m. ``inf`` (the flow settles short of the level) draws no point.
* theory, dashed: the median over runs of the passage of the ODE recorded beside each run
  (the trajectory's ``ode``, from each run's own start), censored like SGD; dash-dotted, the
  same of the finite-d corrected ODE (``ode_corrected``) where the file records it; dotted,
  the same of the finite-ξ line (``extra/ode_finite_xi``, E|⟨û, u⟩| of its paths from each
  run's start) where the file records it. A line the audit left out of figures (its
  ``not_drawn`` attribute) is left out here too, and a line recorded for some runs only is
  the median over those runs.

:func:`passage_table` computes the same numbers (:class:`Passage`, one per curve) for reports
and tests; :func:`format_table` prints them.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field

import numpy as np

from sims.plots.curves import SYMBOL, Curve, _run_mask, _source, quantity_values, widen_for

__all__ = ["Passage", "X_AXES", "first_passage", "censored_quantile", "x_value",
           "theory_passages", "passage_of", "passage_table", "draw_passage", "format_table",
           "THEORY_SIGNS"]

# derived x axes of a passage panel: name → (axis label, value from a curve's attributes)
X_AXES = {
    "xi/sqrt(k)": ("ξ/√k", lambda a: float(a["xi"]) / math.sqrt(float(a["k"]))),
}
THEORY_SIGNS = (1, -1)  # m₀ = +d^{-1/2}, −d^{-1/2}
RTOL = 1e-7  # of the passage times (DOP853; a step count to 7 digits)
THEORY_STYLE = {1: {"color": "#b2182b", "marker": "o"}, -1: {"color": "#2166ac", "marker": "s"}}
SGD_COLOR = "black"
NUDGE = 1.06  # an ODE median beyond the horizon: its open marker beside SGD's (x × or ÷)
ODE_COLOR = "#4d4d4d"
FINITE_XI_COLOR = "#1b7837"


def first_passage(values, steps, level: float) -> np.ndarray:
    """(R,) the first checkpoint step at which ``values`` (R, C) ≥ ``level``, per row; ``inf``
    where a row never reaches it, NaN where a row has no finite value (no data)."""
    values = np.atleast_2d(np.asarray(values, dtype=float))
    steps = np.asarray(steps, dtype=float)
    if values.shape[1] != steps.size:
        raise ValueError(f"first_passage: {values.shape[1]} checkpoints of values, "
                         f"{steps.size} steps")
    with np.errstate(invalid="ignore"):
        hit = values >= level
    first = np.argmax(hit, axis=1)
    out = np.where(hit.any(axis=1), steps[first], np.inf)
    out[~np.isfinite(values).any(axis=1)] = np.nan
    return out


def censored_quantile(values, q: float) -> float:
    """The ``q``-th percentile (linear interpolation, as ``np.percentile``) of ``values`` that
    may hold ``inf`` (never reached by the horizon): ``inf`` where the interpolation needs an
    ``inf`` value (the quantile lies beyond the horizon); NaN values are left out (NaN if none
    is left)."""
    v = np.sort(np.asarray(values, dtype=float).ravel())
    v = v[~np.isnan(v)]
    if not v.size:
        return math.nan
    pos = q / 100.0 * (v.size - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    if math.isinf(v[hi]) or math.isinf(v[lo]):
        return math.inf
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def x_value(curve: Curve, x: str) -> float:
    """The curve's position on the panel's x axis: a derived axis (``X_AXES``) or one of its
    attributes (a sweep axis)."""
    if x in X_AXES:
        return X_AXES[x][1](curve.attrs)
    if curve.attrs.get(x) is None:
        known = sorted([*X_AXES, *(k for k, v in curve.attrs.items() if v is not None)])
        raise ValueError(f"passage panel: unknown x axis {x!r}; available: {', '.join(known)}")
    return float(curve.attrs[x])


def x_label(x: str) -> str:
    return X_AXES[x][0] if x in X_AXES else SYMBOL.get(x, x)


@dataclass
class Passage:
    """The passage times of one curve (steps; ``inf``: beyond the horizon or never)."""

    x: float
    runs: int  # runs that did not diverge (the SGD passages' count)
    horizon: float  # the last checkpoint step
    sgd: np.ndarray  # (R,) each run's first checkpoint step with |⟨û,u⟩| ≥ level
    sgd_median: float
    sgd_lo: float  # 10 %
    sgd_hi: float  # 90 %
    never: int  # runs that never reached the level by the horizon
    ode: np.ndarray  # (R,) the same of the ODE recorded beside each run (NaN: none)
    ode_median: float  # NaN where no run has an ODE
    corrected_median: float = math.nan  # the same of the finite-d corrected ODE, if recorded
    finite_xi_median: float = math.nan  # the same of the finite-ξ line, if recorded
    theory: dict = field(default_factory=dict)  # sign of m₀ → steps (inf: never)
    theory_note: str | None = None  # why there is no theory line
    m0: np.ndarray | None = None  # the runs' recorded ⟨û₀, u⟩


def _finetune_setting(curve: Curve):
    """(instance, RunConfig) of a fine-tuning curve, or (None, reason)."""
    from dynamics.instances.instance import build_instance
    from dynamics.learners import get_learner
    from dynamics.setup.config import RunConfig

    cfg = curve.config or {}
    if not cfg:
        return None, "the file records no run config"
    learner = get_learner(cfg.get("learner", "finetune"))
    if not learner.finetune_ode:
        return None, f"the {learner.name} learner has no population ODE of fine-tuning"
    spec = dict(cfg.get("instance") or {})
    if spec.get("teacher", "finetune") != "finetune":
        return None, "a committee teacher has no population ODE of fine-tuning"
    if cfg.get("instance_seeds", "shared") == "per_run" and len(set(
            np.asarray(curve.traj.instance_seed).tolist())) > 1:
        return None, "the runs have an instance each (no single instance's ODE)"
    spec["xi"] = float(curve.attrs.get("xi", spec.get("xi", 1.0)))
    spec["seed"] = int(curve.attrs.get("instance_seed", spec.get("seed", 0)) or 0)
    config = RunConfig.from_dict(cfg)
    return build_instance(spec), config


def theory_passages(curve: Curve, level: float, signs=THEORY_SIGNS, model=None
                    ) -> tuple[dict, str | None]:
    """({sign: steps of the population ODE to |m| = level from m₀ = sign·d^{-1/2}}, None), or
    ({}, reason) where the curve has no such ODE. p₀ = 0, ĉ₀ = the instance's ĉ, the cell's
    learner options (module docstring); ``inf`` where the flow settles short of the level."""
    import hermite

    inst, config = _finetune_setting(curve)
    if inst is None:
        return {}, config
    if not inst.d:
        return {}, "the instance has no dimension d (m₀ = d^{-1/2} is undefined)"
    from dynamics.overlays.finetune import finetune_regime

    m0 = np.array([s / math.sqrt(inst.d) for s in signs])
    steps = hermite.finetune_steps_to_reach(inst, finetune_regime(config, inst), level,
                                            hermite.FinetuneStart(m0=m0), model=model, rtol=RTOL)
    return dict(zip(signs, (float(v) for v in steps), strict=True)), None


def passage_of(curve: Curve, level: float, theory: bool = True) -> Passage:
    """The :class:`Passage` of one curve (SGD over its runs that did not diverge)."""
    traj = curve.traj
    steps = np.asarray(traj.steps, dtype=float)
    data = quantity_values(curve, "abs_overlap")
    sgd = first_passage(data, steps, level)
    ode = _line_passages(curve, "ode", steps, level)
    corrected, finite_xi = (censored_quantile(_line_passages(curve, name, steps, level), 50)
                            for name in ("ode_corrected", "extra:ode_finite_xi"))
    th, note = theory_passages(curve, level) if theory else ({}, "not computed")
    return Passage(
        x=math.nan, runs=int(sgd.size), horizon=float(steps[-1]), sgd=sgd,
        sgd_median=censored_quantile(sgd, 50), sgd_lo=censored_quantile(sgd, 10),
        sgd_hi=censored_quantile(sgd, 90), never=int(np.isinf(sgd).sum()), ode=ode,
        ode_median=censored_quantile(ode, 50), corrected_median=corrected,
        finite_xi_median=finite_xi, theory=th,
        theory_note=note,
        m0=np.asarray(traj.overlap, dtype=float)[_run_mask(curve)][:, 0])


def _line_passages(curve: Curve, source: str, steps, level: float) -> np.ndarray:
    """(R,) first passages of a theory line's |·| per run (NaN: no line for that run, or the
    whole line absent or left out of figures)."""
    line = _source(curve.traj, source)
    if line is None:
        return np.full(int(_run_mask(curve).sum()), np.nan)
    return first_passage(np.abs(np.asarray(line, dtype=float)[_run_mask(curve)]), steps, level)


def passage_table(curves, x: str, level: float, theory: bool = True) -> list[Passage]:
    """One :class:`Passage` per curve, sorted by its x value."""
    out = []
    for c in curves:
        p = passage_of(c, level, theory)
        p.x = x_value(c, x)
        out.append(p)
    return sorted(out, key=lambda p: p.x)


def _steps(v: float) -> str:
    return "never" if math.isinf(v) else ("—" if math.isnan(v) else f"{v:,.0f}")


def format_table(rows, x: str = "xi/sqrt(k)") -> str:
    """A plain-text table of :func:`passage_table`'s rows."""
    head = (f"{x_label(x):>8}  {'SGD median (10–90 %)':>34}  {'never':>6}  "
            f"{'ODE m₀=+d^-½':>13}  {'ODE m₀=−d^-½':>13}  {'per-run ODE med':>15}  "
            f"{'corrected med':>13}  {'finite-ξ med':>12}")
    lines = [head]
    for p in rows:
        band = f"{_steps(p.sgd_median)} ({_steps(p.sgd_lo)}–{_steps(p.sgd_hi)})"
        lines.append(f"{p.x:8.3g}  {band:>34}  {p.never:>3}/{p.runs:<2}  "
                     f"{_steps(p.theory.get(1, math.nan)):>13}  "
                     f"{_steps(p.theory.get(-1, math.nan)):>13}  {_steps(p.ode_median):>15}  "
                     f"{_steps(p.corrected_median):>13}  {_steps(p.finite_xi_median):>12}")
    return "\n".join(lines)


# ---------------------------------------------------------------- drawing
def _draw_median(ax, xs, medians, horizon: float, nudge: float, label: str, style: dict):
    """A line of per-curve medians of a theory line's passages (where finite, ``style``) and,
    beside the horizon (x × ``nudge``), an open marker where that median lies beyond it."""
    med = np.asarray(medians, dtype=float)
    ok = np.isfinite(med)
    if ok.any():
        ax.plot(xs[ok], med[ok], zorder=3, label=label, **style)
    beyond = np.isposinf(med)
    if beyond.any():
        ax.plot(xs[beyond] * nudge, np.full(beyond.sum(), horizon), ls="none",
                marker=style["marker"], ms=5, mfc="white", color=style["color"], zorder=3)


def draw_passage(ax, curves, x: str, level: float, xscale: str = "log", yscale: str = "log",
                 legend: bool = True) -> list[Passage]:
    """Draw a passage panel (module docstring) on ``ax``; returns the table it drew."""
    from matplotlib.lines import Line2D

    if level is None or not (math.isfinite(level) and level > 0):
        raise ValueError(f"a passage panel needs a level > 0, got {level!r}")
    rows = passage_table(curves, x, level)
    xs = np.array([p.x for p in rows])
    horizon = max(p.horizon for p in rows)
    runs = sorted({p.runs for p in rows})
    n_runs = "/".join(str(r) for r in runs)
    # theory: the ODE from ±d^{-1/2} (solid), the band between them shaded
    drawn_theory = []
    for sign in THEORY_SIGNS:
        ys = np.array([p.theory.get(sign, math.nan) for p in rows])
        ok = np.isfinite(ys)
        if not ok.any():
            continue
        text = "+" if sign > 0 else "−"
        ax.plot(xs[ok], ys[ok], ls="-", lw=1.6, ms=4, mfc="white", zorder=3,
                label=f"population ODE from m₀ = {text}1/√d", **THEORY_STYLE[sign])
        drawn_theory.append(sign)
    if len(drawn_theory) == 2:
        lo = np.array([min(p.theory[1], p.theory[-1]) for p in rows])
        hi = np.array([max(p.theory[1], p.theory[-1]) for p in rows])
        ok = np.isfinite(lo) & np.isfinite(hi)
        if ok.sum() > 1:
            ax.fill_between(xs[ok], lo[ok], hi[ok], color="#999999", alpha=0.15, lw=0, zorder=1)
    # the ODE recorded beside each run: median of its passages (dashed)
    ode = np.array([p.ode_median for p in rows])
    if np.isfinite(ode).any():
        ok = np.isfinite(ode)
        ax.plot(xs[ok], ode[ok], ls="--", lw=1.4, color=ODE_COLOR, marker="D", ms=3.5,
                zorder=3, label="median of the ODE beside each run (its own start)")
    beyond = np.isposinf(ode)
    if beyond.any():
        ax.plot(xs[beyond] / NUDGE, np.full(beyond.sum(), horizon), ls="none", marker="D",
                ms=5, mfc="white", color=ODE_COLOR, zorder=3)
    _draw_median(ax, xs, [p.corrected_median for p in rows], horizon, NUDGE,
                 "median of the finite-d corrected ODE beside each run",
                 dict(ls="-.", lw=1.3, color=ODE_COLOR, marker="v", ms=3.5))
    _draw_median(ax, xs, [p.finite_xi_median for p in rows], horizon, NUDGE**2,
                 "median of the finite-ξ line beside each run",
                 dict(ls=":", lw=1.6, color=FINITE_XI_COLOR, marker="^", ms=4))
    # SGD: median and 10–90 % (censored at the horizon)
    med = np.array([p.sgd_median for p in rows])
    lo = np.array([p.sgd_lo for p in rows])
    hi = np.array([p.sgd_hi for p in rows])
    fin = np.isfinite(med)
    if fin.any():
        top = np.where(np.isfinite(hi), hi, horizon)
        ax.errorbar(xs[fin], med[fin], yerr=[med[fin] - lo[fin], top[fin] - med[fin]],
                    ls="none", marker="o", ms=6, color=SGD_COLOR, capsize=3, zorder=4,
                    label=f"SGD: median of {n_runs} runs, 10–90 %")
    cens = ~fin & ~np.isnan(med)
    if cens.any():
        if np.isfinite(lo[cens]).any():
            ok = cens & np.isfinite(lo)
            ax.vlines(xs[ok], lo[ok], horizon, color=SGD_COLOR, lw=1.2, zorder=4)
        ax.plot(xs[cens], np.full(cens.sum(), horizon), ls="none", marker="o", ms=7,
                mfc="white", color=SGD_COLOR, zorder=5)
    for p in rows:  # a 90 % (or median) beyond the horizon: an arrow up from it
        if math.isinf(p.sgd_hi):
            ax.annotate("", xy=(p.x, horizon * 1.9), xytext=(p.x, horizon),
                        arrowprops={"arrowstyle": "->", "color": SGD_COLOR, "lw": 1.2},
                        zorder=5)
        if p.never:
            ax.annotate(f"{p.never}/{p.runs}", xy=(p.x, horizon), xytext=(5, -11),
                        textcoords="offset points", fontsize=7.5, color=SGD_COLOR)
    ax.axhline(horizon, color="grey", ls=":", lw=1)
    ax.set_xscale(xscale)
    ax.set_yscale(yscale)
    if xscale == "log":
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:.3g}"))
    finite = [v for p in rows for v in (p.sgd_lo, p.sgd_median, p.ode_median,
                                        p.corrected_median, p.finite_xi_median,
                                        *p.theory.values())
              if math.isfinite(v) and v > 0]
    if yscale == "log" and finite:
        ax.set_ylim(min(finite) / 1.6, max(max(finite), horizon) * 2.6)
    ax.set_xlabel(x_label(x))
    ax.set_ylabel(f"steps to |⟨û, u⟩| ≥ {level:g}")
    ax.grid(True, which="major", alpha=0.3)
    if legend:
        extra = [Line2D([], [], color="grey", ls=":", lw=1, label="horizon (last checkpoint)")]
        if cens.any() or any(p.never for p in rows):
            extra.append(Line2D([], [], ls="none", marker="o", mfc="white", color=SGD_COLOR,
                                label="median beyond the horizon (↑); n/R: runs never "
                                      "reaching it"))
        notes = sorted({p.theory_note for p in rows if p.theory_note})
        never = [p.x for p in rows if any(math.isinf(v) for v in p.theory.values())]
        if never:
            notes.append("ODE settles short of the level at " + ", ".join(
                f"{x_label(x)} = {v:.3g}" for v in never))
        extra += [Line2D([], [], ls="none", label=f"no theory line: {n}"
                         if not n.startswith("ODE") else n) for n in notes]
        handles = ax.get_legend_handles_labels()[0]
        for h in extra:  # long notes wrapped as the curves' legends wrap them
            h.set_label(textwrap.fill(h.get_label(), 48))
        leg = ax.legend(handles=handles + extra, fontsize=7, loc="upper left",
                        bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # off the points
        widen_for(ax.figure, leg)
    return rows
