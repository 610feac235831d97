"""Power-law fits of hitting times against dimension, with bootstrap intervals.

Model: log T(d) = a + b log d, fitted by least squares to the per-d *median* hitting time.
Runs that never reach the target are right-censored: they enter the median as +∞ (so the
median is still exact while fewer than half the runs are censored) and are reported as a
fraction. The 95% interval for b is a percentile bootstrap that resamples runs within each d.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PowerLawFit", "fit_power_law", "censored_median"]


@dataclass(frozen=True)
class PowerLawFit:
    """Result of :func:`fit_power_law`.

    slope, intercept : b and a of log T = a + b log d (natural logs).
    slope_ci : (low, high) percentile-bootstrap interval for b at ``level``.
    d : (n,) dimensions; median_T : (n,) median hitting time per d (inf if ≥ half censored);
    reached : (n,) fraction of runs that reached the target per d.
    """

    slope: float
    intercept: float
    slope_ci: tuple[float, float]
    level: float
    d: np.ndarray
    median_T: np.ndarray
    reached: np.ndarray
    n_boot: int

    def predict(self, d) -> np.ndarray:
        return np.exp(self.intercept) * np.asarray(d, dtype=float) ** self.slope

    def as_dict(self) -> dict:
        return {
            "slope": self.slope, "intercept": self.intercept,
            "slope_ci": list(self.slope_ci), "level": self.level, "n_boot": self.n_boot,
            "d": self.d.tolist(), "median_T": [None if not np.isfinite(t) else float(t)
                                               for t in self.median_T],
            "reached": self.reached.tolist(),
        }


def censored_median(times: np.ndarray) -> float:
    """Median with NaN (never reached) treated as +∞."""
    t = np.where(np.isnan(times), np.inf, np.asarray(times, dtype=float))
    return float(np.median(t)) if t.size else float("nan")


def _ls_slope(logd: np.ndarray, logt: np.ndarray) -> tuple[float, float]:
    b, a = np.polyfit(logd, logt, 1)
    return float(b), float(a)


def fit_power_law(d_values, times_per_d, n_boot: int = 2000, level: float = 0.95,
                  seed: int = 0) -> PowerLawFit:
    """Fit log T = a + b log d to per-d medians; bootstrap runs within each d for b's CI.

    ``times_per_d[i]`` holds the hitting times of the runs at ``d_values[i]`` (NaN = never).
    Needs at least two dimensions whose median is finite.
    """
    d = np.asarray(d_values, dtype=float)
    samples = [np.asarray(t, dtype=float) for t in times_per_d]
    if len(samples) != d.size:
        raise ValueError("fit_power_law: one array of times per dimension is required")
    if any(s.size == 0 for s in samples):
        raise ValueError("fit_power_law: a dimension has no runs")
    distinct = np.unique(d)
    if distinct.size < 2:
        which = f"one: d = {distinct[0]:g}" if distinct.size else "none"
        raise ValueError(f"fit_power_law: a power-law fit in d needs at least two values of d "
                         f"(got {which})")
    med = np.array([censored_median(s) for s in samples])
    reached = np.array([np.mean(np.isfinite(s)) for s in samples])
    ok = np.isfinite(med)
    if np.unique(d[ok]).size < 2:
        short = ", ".join(f"{v:g}" for v in d[~ok])
        raise ValueError(f"fit_power_law: fewer than two values of d have a finite median "
                         f"hitting time (at d = {short} half or more of the runs never reached "
                         "the target)")
    logd = np.log(d[ok])
    b, a = _ls_slope(logd, np.log(med[ok]))
    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)
    kept = [s for s, o in zip(samples, ok, strict=True) if o]
    for i in range(n_boot):
        meds = np.array([censored_median(rng.choice(s, size=s.size)) for s in kept])
        good = np.isfinite(meds)
        boot[i] = _ls_slope(logd[good], np.log(meds[good]))[0] if good.sum() >= 2 else np.nan
    boot = boot[np.isfinite(boot)]
    alpha = (1.0 - level) / 2.0
    ci = (float(np.quantile(boot, alpha)), float(np.quantile(boot, 1.0 - alpha)))
    return PowerLawFit(b, a, ci, level, d, med, reached, n_boot)
