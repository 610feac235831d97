"""Slicing a trajectory on its run axis: one cell of a batch, one ξ of a mixed file."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from dynamics.runtime.trajectory import Trajectory

__all__ = ["split_trajectory"]


def split_trajectory(traj: Trajectory, start: int, runs: int) -> Trajectory:
    """Runs [start, start + runs) of a trajectory: every per-run array is sliced (any
    Trajectory field or ``extra`` entry whose leading axis is the run axis), and the per-run
    ``instances`` list where there is one. ``steps`` and the other fields are shared."""
    sl, total = slice(start, start + runs), traj.overlap.shape[0]
    parts = {}
    for f in fields(traj):
        value = getattr(traj, f.name)
        if f.name != "steps" and isinstance(value, np.ndarray) and value.ndim >= 1 \
                and value.shape[0] == total:
            parts[f.name] = value[sl]
    instances = getattr(traj, "instances", None)
    if isinstance(instances, list):
        parts["instances"] = instances[sl]
    extra = {k: np.asarray(v)[sl] for k, v in traj.extra.items()}
    return replace(traj, **parts, extra=extra)
