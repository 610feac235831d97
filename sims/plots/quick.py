"""The figure of one trajectory (``loradyn run --plot``): overlap vs steps, or, for the
from-scratch learners, loss and alignment against α = steps/d beside the committee-machine
ODE; one curve per ξ and instance group, drawn by :mod:`sims.plots.curves` as ``loradyn
plot`` draws them (theory above the medians, a note where a run has none)."""

from __future__ import annotations

from pathlib import Path

import click

from dynamics.runtime.trajectory import Trajectory

from .curves import (
    Curve,
    PanelAxes,
    PanelLook,
    curve_attributes,
    draw_panel,
    legend,
    legend_keys,
    legend_notes,
    save_figure,
    split_runs,
    teacher_label,
    theory_notes,
    wrap_title,
)

__all__ = ["plot_overlap", "plot_run", "plot_network", "instance_title", "run_curves",
           "run_figure"]


def instance_title(config) -> str:
    """One line naming the instance and the learner settings: every one that is not the
    default, the batch size b (≠ 1) and the label noise's variance (≠ 0) among them."""
    spec = config.instance
    xi = (", ".join(f"{x:g}" for x in config.xi_values) if config.xi_values
          else f"{spec.get('xi', 1.0):g}")
    w = spec.get("W", "gram" if "gram" in spec else "orthonormal")
    parts = [f"σ = {spec.get('activation')}", f"k = {spec.get('k')}", f"d = {spec.get('d')}"]
    parts += [teacher_label(spec)] if teacher_label(spec) else [
        f"ξ = {xi}", f"W {w if isinstance(w, str) else 'explicit'}"]
    parts += [f"η = {config.eta:.3g}"]
    if int(getattr(config, "batch", 1)) != 1:
        parts.append(f"b = {int(config.batch)}")
    if float(getattr(config, "label_noise", 0.0)) != 0.0:
        parts.append(f"label noise σ² = {float(config.label_noise):.3g}")
    parts.append(f"R = {config.runs}")
    from dynamics.learners import get_learner

    label = get_learner(config.learner).label(config.to_dict(), frozen_c="")
    return ", ".join(parts) + f" ({label})"


def run_curves(traj: Trajectory, config=None) -> list[Curve]:
    """``traj`` as curves, one per ξ and instance group (:func:`split_runs`), named by the
    attributes of ``config`` (a RunConfig or its dict; None: ξ and instance only) and by the
    number of runs each median is over."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    attrs = curve_attributes(cfg) if cfg else {}
    curves = split_runs(Curve(traj, attrs, "", cfg))
    for c in curves:
        ok = int((~c.traj.diverged).sum())
        c.attrs["runs"] = ok or c.traj.runs  # all diverged: the median is over all of them
    return curves


def plot_run(traj: Trajectory, path, title: str, *, config=None, x: str = "auto") -> Path:
    """:func:`plot_network` for the from-scratch learners (an ``alignment`` record), else
    :func:`plot_overlap`. ``config``: the run's RunConfig (names the curves, gives d for
    α = steps/d and says why a theory line is missing); ``x``: ``auto`` (α for the
    from-scratch learners where d is known, else steps), ``alpha`` or ``steps``."""
    return _save(*run_figure(traj, title, config=config, x=x), path)


def plot_network(traj: Trajectory, path, title: str, *, config=None, x: str = "auto") -> Path:
    """Loss (log scale) and alignment of a from-scratch run against α = steps/d (or steps),
    median and 10–90 % band per ξ and instance group, with the committee-machine ODE from
    each run's initial overlaps (median, dashed) where recorded (``extra/ode_loss``,
    ``extra/ode_alignment``)."""
    return _save(*run_figure(traj, title, config=config, x=x,
                             quantities=("loss", "alignment")), path)


def plot_overlap(traj: Trajectory, path, title: str, *, config=None, x: str = "auto") -> Path:
    """Median ⟨û, u⟩ with its 10–90 % band per ξ and instance group, the population ODE
    (dashed) and, where recorded, the noise-corrected ODE (dash-dotted) and the hatched
    theory band; a run without theory says why on the figure and on stderr."""
    return _save(*run_figure(traj, title, config=config, x=x, quantities=("overlap",)), path)


def run_figure(traj: Trajectory, title: str, *, config=None, x: str = "auto",
               quantities=None):
    """(Figure, notes): one panel per quantity (default: loss and alignment for the
    from-scratch learners, else overlap) on a linear x axis, drawn by
    :func:`sims.plots.curves.draw_panel`; ``notes``: why curves have no theory line (also in
    the legend). Nothing is saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if quantities is None:
        quantities = ("loss", "alignment") if "alignment" in traj.extra else ("overlap",)
    curves = run_curves(traj, config)
    keys = legend_keys(curves)
    width = 5.2 * len(quantities) + 1.2
    fig, axes = plt.subplots(1, len(quantities), figsize=(width, 4.4), squeeze=False,
                             constrained_layout=True)
    notes = []
    for ax, quantity in zip(axes.flat, quantities, strict=True):
        _, theory = draw_panel(ax, curves, quantity=quantity,
                               axes=PanelAxes(x, "linear", "log" if quantity == "loss"
                                              else "linear"),
                               look=PanelLook(label_keys=[*keys, "runs"]))
        lines = legend_notes(ax, theory_notes(curves, quantity, keys))
        legend(ax, theory=theory, notes=lines, fontsize=8)
        notes += lines
    fig.suptitle(wrap_title(title, width, 9), fontsize=9)
    return fig, list(dict.fromkeys(notes))


def _save(fig, notes, path) -> Path:
    """Write ``fig`` (closed after; :func:`save_figure`) and each note on stderr."""
    path = save_figure(fig, path, dpi=120)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    return path
