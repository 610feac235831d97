"""Summaries of every quantity a trajectory records, as JSON-ready values.

``loradyn run --json`` and ``loradyn show --json`` print them (issue 18): besides the mean
overlap they carry the loss and, for every recorded quantity (``overlap``, ``loss``,
``c_overlap``, the theory curves and each learner extra under ``extra/``), its run statistics.

Statistics are over the runs that did not diverge (all runs when every run diverged, so that
the shapes stay the same). Per checkpoint quantities, shape (R, C, ...), give per checkpoint
``mean``, ``std``, ``q10``, ``median``, ``q90`` (each a list over checkpoints, nested over the
trailing axes), and ``final`` (the same five at the last checkpoint); per run quantities,
shape (R, ...), give ``mean``, ``std``, ``min``, ``median``, ``max``. NaN (a run without a
value there) is left out of a statistic; a statistic with no value is ``null``. Quantities
with more than :data:`MAX_TRAILING` numbers per run and checkpoint (a trained Ĉ, say) give
their shape only.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

__all__ = ["quantity_summaries", "summarize_array", "finite_list", "recorded_quantities",
           "MAX_TRAILING"]

MAX_TRAILING = 64  # numbers per (run, checkpoint) above which only the shape is reported
THEORY = ("ode", "ode_corrected", "band_lower", "band_upper")


def finite_list(a):
    """A (nested) list of floats from an array, None for every non-finite entry."""
    arr = np.asarray(a, dtype=float)
    if arr.ndim == 0:
        v = float(arr)
        return v if math.isfinite(v) else None
    return [finite_list(x) for x in arr]


def recorded_quantities(traj) -> dict:
    """Name → array of everything ``traj`` records with a leading run axis: ``overlap``,
    ``loss``, ``c_overlap`` (when ĉ is trained), the theory curves where present, ``m0``,
    and each learner extra as ``extra/<name>``."""
    out = {"overlap": traj.overlap, "loss": traj.loss}
    if traj.c_overlap is not None:
        out["c_overlap"] = traj.c_overlap
    for name in THEORY:
        arr = getattr(traj, name, None)
        if arr is not None and np.isfinite(arr).any():
            out[name] = arr
    if traj.m0 is not None:
        out["m0"] = traj.m0
    for name, arr in traj.extra.items():
        out[f"extra/{name}"] = arr
    return out


def _stats(arr: np.ndarray, axis: int, names) -> dict:
    funcs = {"mean": np.nanmean, "std": np.nanstd, "min": np.nanmin, "max": np.nanmax,
             "median": np.nanmedian,
             "q10": lambda a, axis: np.nanquantile(a, 0.1, axis=axis),
             "q90": lambda a, axis: np.nanquantile(a, 0.9, axis=axis)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices → NaN → null
        return {n: finite_list(funcs[n](arr, axis=axis)) for n in names}


def summarize_array(arr, checkpoints: int) -> dict:
    """The summary of one (R, ...) array: per checkpoint statistics when its second axis has
    ``checkpoints`` entries, per run statistics otherwise (see the module docstring)."""
    arr = np.asarray(arr)
    out: dict = {"shape": list(arr.shape)}
    if arr.dtype.kind not in "biuf" or arr.ndim == 0 or arr.shape[0] == 0:
        return out
    arr = arr.astype(float)
    per_checkpoint = arr.ndim >= 2 and arr.shape[1] == checkpoints
    trailing = int(np.prod(arr.shape[2 if per_checkpoint else 1:], dtype=np.int64))
    if trailing > MAX_TRAILING:
        out["omitted"] = f"more than {MAX_TRAILING} numbers per run" + (
            " and checkpoint" if per_checkpoint else "")
        return out
    if per_checkpoint:
        out["axes"] = "R,C" + ",*" * (arr.ndim - 2)
        out |= _stats(arr, 0, ("mean", "std", "q10", "median", "q90"))
        out["final"] = _stats(arr[:, -1], 0, ("mean", "std", "q10", "median", "q90"))
    else:
        out["axes"] = "R" + ",*" * (arr.ndim - 1)
        out |= _stats(arr, 0, ("mean", "std", "min", "median", "max"))
    return out


def quantity_summaries(traj) -> dict:
    """``{"loss_kind", "loss_mean", "loss_std", "quantities": {name: summary}}`` for a
    Trajectory, over its non-diverged runs (every run when all diverged).

    ``loss_mean`` is the per-checkpoint mean of the stored ``loss`` over those runs, the
    number a reader of the HDF5 file gets from ``nanmean(loss[ok], axis=0)``.
    """
    ok = ~np.asarray(traj.diverged)
    keep = ok if ok.any() else np.ones_like(ok)
    cps = int(np.asarray(traj.steps).shape[0])
    quantities = {name: summarize_array(np.asarray(arr)[keep], cps)
                  for name, arr in recorded_quantities(traj).items()}
    loss = quantities["loss"]
    return {"loss_kind": traj.loss_kind, "loss_mean": loss.get("mean"),
            "loss_std": loss.get("std"), "quantities": quantities}
