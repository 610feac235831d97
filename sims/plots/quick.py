"""A plain overlap-vs-steps figure of one trajectory (``loradyn run --plot``)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from dynamics.trajectory import Trajectory

__all__ = ["plot_overlap", "instance_title", "draw_finite_d_theory"]


def instance_title(config) -> str:
    """One line naming the instance and the learner settings."""
    spec = config.instance
    xi = (", ".join(f"{x:g}" for x in config.xi_values) if config.xi_values
          else f"{spec.get('xi', 1.0):g}")
    w = spec.get("W", "gram" if "gram" in spec else "orthonormal")
    parts = [f"σ = {spec.get('activation')}", f"k = {spec.get('k')}", f"d = {spec.get('d')}",
             f"ξ = {xi}", f"W {w if isinstance(w, str) else 'explicit'}",
             f"η = {config.eta:.3g}", f"R = {config.runs}"]
    variant = ("projected" if config.project else "unprojected") + (
        ", joint ĉ" if config.joint_c else "")
    return ", ".join(parts) + f" ({variant})"


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
    if ok.any():
        ov = traj.overlap[ok]
        lo, med, hi = np.nanpercentile(ov, [10, 50, 90], axis=0)
        ax.fill_between(steps, lo, hi, alpha=0.25, label="10–90 % of runs")
        ax.plot(steps, med, lw=2, label=f"median of {int(ok.sum())} runs")
    if np.isfinite(traj.ode).any():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ode = np.nanmean(traj.ode[ok] if ok.any() else traj.ode, axis=0)
        ax.plot(steps, ode, "k--", lw=1.5, label="population ODE (mean)")
    draw_finite_d_theory(ax, traj, ok)
    ax.set_xlabel("SGD step t")
    ax.set_ylabel("overlap ⟨û_t, u⟩")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
