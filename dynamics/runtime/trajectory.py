"""The result of a batch of runs: what every engine returns and what HDF5 files store.

:class:`Trajectory` holds the checkpointed curves; :class:`RunResult` the raw checkpoint
records an engine hands over; :func:`make_trajectory` is the one factory from the latter to
the former (divergence masking, shared run metadata), used by every learner and reduced engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Trajectory", "RunResult", "checkpoint_steps", "mask_dead", "make_trajectory"]


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
    loss : (R, C) population loss of the student (exact where a Gaussian kernel gives it,
        otherwise a Monte Carlo estimate; ``loss_kind`` says which).
    ode : (R, C) population-ODE prediction m̄_t from the run's own m₀ (NaN where none).
    c_overlap : (R, C) ⟨ĉ, c⟩/‖ĉ‖ when ĉ is trained, else None.
    diverged_step : (R,) int64, first step with NaN/Inf or |m| > 1, −1 if never.
    xi : (R,) ξ of each run. instance_seed : (R,) instance seed of each run.
    loss_kind : ``exact`` or ``monte_carlo``. dtype, device, engine : how it was computed.
    extra : further per-run arrays (name → array with leading R axis).
    m0 : (R,) initial overlaps.
    ode_corrected : (R, C) finite-d (noise-corrected) overlap map from the run's m₀
        (``hermite.finite_d.corrected_ode``), or None where it does not apply.
    band_lower, band_upper : (R, C) 10% and 90% quantiles of the linear-noise theory band of
        the run's instance group (``hermite.theory_band``), or None.
    m0 : (R,) initial overlap ⟨û₀, u⟩ of each run (the ODE's starting point), if known.
    extra_attrs : ``extra`` name (or a theory field's, e.g. ``ode``) → attributes written on
        that HDF5 dataset (how a theory curve was computed: the committee ODE's ``order``,
        a ``note`` saying which ODE it is and what it leaves out).
    instances : the resolved instance of every run (length R) when the trajectory comes
        from an engine (the writer stores them with the config; not read back from files).
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
    extra_attrs: dict = field(default_factory=dict)
    instances: list | None = field(default=None, repr=False, compare=False)

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
        """Median final overlap, fraction of runs past 0.9, median steps to 0.5 over every
        run that did not diverge, a run that never reached 0.5 counting as later than all
        (NaN where half or more never did), and the fraction that reached it."""
        ok = ~self.diverged
        final = self.overlap[ok, -1]
        t05 = np.nan_to_num(self.first_passage(0.5)[ok], nan=np.inf)
        median = float(np.median(t05)) if t05.size else float("inf")
        return {
            "runs": int(self.runs),
            "diverged": int((~ok).sum()),
            "median_final_overlap": float(np.median(final)) if final.size else float("nan"),
            "fraction_past_0.9": float(np.mean(final >= 0.9)) if final.size else 0.0,
            "median_steps_to_0.5": median if math.isfinite(median) else float("nan"),
            "fraction_reached_0.5": float(np.mean(np.isfinite(t05))) if t05.size else 0.0,
        }


@dataclass
class RunResult:
    """Raw checkpoint records of R runs, what ``Learner.trajectory`` turns into a Trajectory.

    ``dtype``: the precision the records were computed in, when not ``config.dtype``.
    """

    config: object
    instances: list
    steps: np.ndarray  # (C,) checkpoint steps
    records: dict  # name → (R, C, ...) stacked observations
    diverged_step: np.ndarray  # (R,) int64, −1 if never
    m0: np.ndarray  # (R,)
    device: object
    engine: str = "full"
    dtype: str | None = None

    @property
    def dead(self) -> np.ndarray:
        """(R, C) True from the checkpoint a run diverged at on."""
        ds = self.diverged_step
        return (ds[:, None] >= 0) & (self.steps[None, :] >= ds[:, None])


def mask_dead(result: RunResult, array: np.ndarray) -> np.ndarray:
    """``array`` (R, C, ...) with NaN at a run's checkpoints from its divergence on."""
    dead = result.dead.reshape(result.dead.shape + (1,) * (array.ndim - 2))
    return np.where(dead, np.nan, array)


def make_trajectory(result: RunResult, overlap: np.ndarray, loss: np.ndarray, *,
                    loss_kind: str, ode: np.ndarray | None = None,
                    c_overlap: np.ndarray | None = None, extra: dict | None = None,
                    theory: dict | None = None, extra_attrs: dict | None = None
                    ) -> Trajectory:
    """The :class:`Trajectory` of ``result`` from its (R, C) curves.

    Divergence masking is applied here to ``overlap``, ``loss``, ``ode``, ``c_overlap`` and
    every ``extra`` array (run axis first, checkpoint axis second where it has one).
    ``theory``: Trajectory keyword arguments (``ode``, ``ode_corrected``, ``band_lower``,
    ``band_upper``) kept unmasked, predictions from m₀ rather than records of the run.
    Without an ``ode`` the ODE curve is NaN (no theory). ``extra_attrs``: HDF5 attributes of
    ``extra`` datasets (:attr:`Trajectory.extra_attrs`).
    """
    runs, cps = result.diverged_step.shape[0], result.steps.shape[0]
    theory = dict(theory or {})
    if ode is not None and "ode" in theory:
        raise ValueError("make_trajectory: ode given both masked and in theory")

    def masked(a):
        a = np.asarray(a, dtype=float)
        return mask_dead(result, a) if a.ndim >= 2 and a.shape[1] == cps else a

    if ode is not None:
        theory["ode"] = masked(ode)
    theory.setdefault("ode", np.full((runs, cps), np.nan))
    inst = result.instances
    return Trajectory(
        steps=result.steps, overlap=masked(overlap), loss=masked(loss), **theory,
        diverged_step=result.diverged_step, xi=np.array([i.xi for i in inst]),
        instance_seed=np.array([i.seed for i in inst], dtype=np.int64),
        c_overlap=None if c_overlap is None else masked(c_overlap), loss_kind=loss_kind,
        dtype=result.dtype or result.config.dtype, device=str(result.device),
        engine=result.engine, extra={n: masked(a) for n, a in (extra or {}).items()},
        m0=result.m0, extra_attrs=dict(extra_attrs or {}), instances=list(inst),
    )
