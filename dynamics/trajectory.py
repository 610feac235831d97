"""The result of a batch of runs: what every engine returns and what HDF5 files store."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Trajectory", "checkpoint_steps"]


def checkpoint_steps(steps: int, count: int, spacing: str = "log") -> np.ndarray:
    """Sorted unique checkpoint steps in [0, steps], always containing 0 and ``steps``.

    ``log``: geometrically spaced from 1 to ``steps`` (plus 0); ``linear``: evenly spaced.
    """
    if spacing == "linear":
        pts = np.linspace(0, steps, max(count, 2))
    else:
        pts = np.concatenate([[0.0], np.geomspace(1, steps, max(count - 1, 1))])
    return np.unique(np.concatenate([np.round(pts).astype(np.int64), [0, steps]]))


@dataclass
class Trajectory:
    """Checkpointed observables of R runs (leading run axis everywhere).

    Fields
    ------
    steps : (C,) int64 checkpoint steps.
    overlap : (R, C) ⟨û, u⟩ at each checkpoint.
    loss : (R, C) population loss of the student (exact where the theory applies,
        otherwise a Monte Carlo estimate; ``loss_kind`` says which).
    ode : (R, C) population-ODE prediction m̄_t from the run's own m₀ (NaN where none).
    c_overlap : (R, C) ⟨ĉ, c⟩/‖ĉ‖ when ĉ is trained, else None.
    diverged_step : (R,) int64, first step with NaN/Inf or |m| > 1, −1 if never.
    xi : (R,) ξ of each run. instance_seed : (R,) instance seed of each run.
    loss_kind : ``exact`` or ``monte_carlo``. dtype, device, engine : how it was computed.
    extra : further per-run arrays (name → array with leading R axis).
    m0 : (R,) initial overlaps.
    ode_corrected : (R, C) finite-d (noise-corrected) overlap map from the run's m₀
        (``hermite.corrected_ode``), or None where it does not apply.
    band_lower, band_upper : (R, C) 10% and 90% quantiles of the linear-noise theory band of
        the run's instance group (``hermite.theory_band``), or None.
    m0 : (R,) initial overlap ⟨û₀, u⟩ of each run (the ODE's starting point), if known.
    """

    steps: np.ndarray
    overlap: np.ndarray
    loss: np.ndarray
    ode: np.ndarray
    diverged_step: np.ndarray
    xi: np.ndarray
    instance_seed: np.ndarray
    c_overlap: np.ndarray | None = None
    loss_kind: str = "exact"
    dtype: str = "float64"
    device: str = "cpu"
    engine: str = "full"
    extra: dict = field(default_factory=dict)
    m0: np.ndarray | None = None
    ode_corrected: np.ndarray | None = None
    band_lower: np.ndarray | None = None
    band_upper: np.ndarray | None = None

    @property
    def runs(self) -> int:
        return self.overlap.shape[0]

    @property
    def diverged(self) -> np.ndarray:
        return self.diverged_step >= 0

    def first_passage(self, level: float) -> np.ndarray:
        """Per run, the first checkpoint step with overlap ≥ level (NaN if never)."""
        hit = self.overlap >= level
        idx = np.argmax(hit, axis=1)
        out = self.steps[idx].astype(float)
        out[~hit.any(axis=1)] = np.nan
        return out

    def summary(self) -> dict:
        """Median final overlap, fraction of runs past 0.9, median steps to 0.5."""
        ok = ~self.diverged
        final = self.overlap[ok, -1]
        t05 = self.first_passage(0.5)[ok]
        return {
            "runs": int(self.runs),
            "diverged": int((~ok).sum()),
            "median_final_overlap": float(np.median(final)) if final.size else float("nan"),
            "fraction_past_0.9": float(np.mean(final >= 0.9)) if final.size else 0.0,
            "median_steps_to_0.5": float(np.nanmedian(t05)) if np.isfinite(t05).any()
            else float("nan"),
        }
