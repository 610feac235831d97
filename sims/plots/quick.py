"""The figure of one trajectory (``loradyn run --plot``): overlap vs steps, or, for the
from-scratch learners, loss and alignment beside the committee-machine ODE."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from dynamics.trajectory import Trajectory

from .curves import learner_variant, teacher_label

__all__ = ["plot_overlap", "plot_run", "plot_network", "instance_title",
           "draw_finite_d_theory"]


def instance_title(config) -> str:
    """One line naming the instance and the learner settings."""
    spec = config.instance
    xi = (", ".join(f"{x:g}" for x in config.xi_values) if config.xi_values
          else f"{spec.get('xi', 1.0):g}")
    w = spec.get("W", "gram" if "gram" in spec else "orthonormal")
    parts = [f"σ = {spec.get('activation')}", f"k = {spec.get('k')}", f"d = {spec.get('d')}"]
    parts += [teacher_label(spec)] if teacher_label(spec) else [
        f"ξ = {xi}", f"W {w if isinstance(w, str) else 'explicit'}"]
    parts += [f"η = {config.eta:.3g}", f"R = {config.runs}"]
    variant = learner_variant(config.to_dict(), frozen_c="")
    if config.learner != "finetune":
        variant = f"{config.learner}, {variant}"
    return ", ".join(parts) + f" ({variant})"


def plot_run(traj: Trajectory, path, title: str) -> Path:
    """:func:`plot_network` for the from-scratch learners (an ``alignment`` record), else
    :func:`plot_overlap`."""
    if "alignment" in traj.extra:
        return plot_network(traj, path, title)
    return plot_overlap(traj, path, title)


def _band(ax, steps, values, ok) -> None:
    if ok.any():
        lo, med, hi = np.nanpercentile(values[ok], [10, 50, 90], axis=0)
        ax.fill_between(steps, lo, hi, alpha=0.25, label="10–90 % of runs")
        ax.plot(steps, med, lw=2, label=f"median of {int(ok.sum())} runs")


def _ode_mean(ax, steps, values, ok, label: str) -> None:
    if values is None or not np.isfinite(values).any():
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(values[ok] if ok.any() else values, axis=0)
    ax.plot(steps, mean, "k--", lw=1.5, label=label)


def plot_network(traj: Trajectory, path, title: str) -> Path:
    """Loss (log scale) and alignment of a from-scratch run, median and 10–90 % band, with
    the committee-machine ODE from each run's initial overlaps (mean, dashed) where
    recorded (``extra/ode_loss``, ``extra/ode_alignment``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ok = ~traj.diverged
    steps = traj.steps
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(10, 4.2), constrained_layout=True)
    _band(ax_l, steps, traj.loss, ok)
    _ode_mean(ax_l, steps, traj.extra.get("ode_loss"), ok, "committee ODE (mean)")
    ax_l.set_yscale("log")
    ax_l.set_ylabel("population loss E(f* − f̂)²")
    _band(ax_a, steps, np.asarray(traj.extra["alignment"], float), ok)
    _ode_mean(ax_a, steps, traj.extra.get("ode_alignment"), ok, "committee ODE (mean)")
    ax_a.set_ylabel("alignment (mean over teacher rows of max cos)")
    for ax in (ax_l, ax_a):
        ax.set_xlabel("SGD step t")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_finite_d_theory(ax, traj: Trajectory, ok: np.ndarray, color: str = "k") -> None:
    """Noise-corrected ODE (solid thin) and the hatched 10–90% theory band, where recorded."""
    if traj.ode_corrected is None or not np.isfinite(traj.ode_corrected).any():
        return
    rows = ok if ok.any() else np.ones_like(ok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        corr = np.nanmean(traj.ode_corrected[rows], axis=0)
        lo = np.nanmedian(traj.band_lower[rows], axis=0)
        hi = np.nanmedian(traj.band_upper[rows], axis=0)
    ax.plot(traj.steps, corr, color=color, lw=0.9, label="noise-corrected ODE (mean)")
    ax.fill_between(traj.steps, lo, hi, facecolor="none", edgecolor=color, hatch="///",
                    lw=0.0, alpha=0.5, label="theory band 10–90 %")


def plot_overlap(traj: Trajectory, path, title: str) -> Path:
    """Median ⟨û, u⟩ with its 10–90 % band, the mean population ODE (dashed) and, where
    recorded, the noise-corrected ODE (solid thin) and the hatched theory band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ok = ~traj.diverged
    steps = traj.steps
    fig, ax = plt.subplots(figsize=(6.4, 4.2), constrained_layout=True)
    _band(ax, steps, traj.overlap, ok)
    _ode_mean(ax, steps, traj.ode, ok, "population ODE (mean)")
    draw_finite_d_theory(ax, traj, ok)
    ax.set_xlabel("SGD step t")
    ax.set_ylabel("overlap ⟨û_t, u⟩")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
