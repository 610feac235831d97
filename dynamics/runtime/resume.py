"""A run's durable state between two processes (issue 37.3): what ``loradyn run`` saves every
few minutes beside its output (the *resume file*), so that a run killed midway goes on with
``--resume`` to the very numbers of an uninterrupted run.

:class:`RunState` is everything an engine needs to go on, as plain arrays and JSON values: the
full engine's learner state, per-run step sizes, divergence, records so far and its example
streams' state before the next chunk (:meth:`dynamics.engines.engine.FullRun.run_state`); a chain's
per-run state, records so far and divergence
(:meth:`dynamics.reduced.segments.ChainRun.run_state`). What the engine rebuilds from the config
(instances, the learner, initial overlaps) is not in it, and neither is any theory line:
those are computed from the records at the end. The file format, the config and the
fingerprint of the command's inputs are the writer's (``sims.io.resume``).

:class:`Checkpointer` says when to save (every :data:`INTERVAL_S` seconds of wall time, or
``LORADYN_RESUME_SECONDS``; 0 saves at every chunk or segment end, as tests do) and hands the
state to its ``write``. The engines ask it between chunks (full engine) or segments (chains).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RunState", "ResumeError", "Checkpointer", "INTERVAL_S", "INTERVAL_ENV"]

INTERVAL_S = 300.0  # seconds of wall time between two saves
INTERVAL_ENV = "LORADYN_RESUME_SECONDS"


class ResumeError(ValueError):
    """A saved state that does not fit the run it should continue (one line)."""


@dataclass
class RunState:
    """A run's state between two chunks or segments (module docstring).

    ``engine``: full or reduced; ``kind``: which state layout (``full/<learner>``,
    ``reduced/<chain>/<backend>``); ``step`` of ``total`` steps taken; ``reached`` of
    ``checkpoints`` checkpoints recorded; ``runs`` R; ``arrays``: name → array (names may
    hold ``/``); ``values``: name → JSON value.
    """

    engine: str
    kind: str
    step: int
    total: int
    reached: int
    checkpoints: int
    runs: int
    arrays: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)

    def require(self, **expected) -> None:
        """ResumeError naming the first field that differs from ``expected``."""
        for name, want in expected.items():
            have = getattr(self, name)
            if have != want:
                raise ResumeError(f"the saved state has {name} {have!r}, this run "
                                  f"{want!r}")

    def array(self, name: str, shape=None, dtype=None) -> np.ndarray:
        """``arrays[name]`` (ResumeError if missing or of another shape), as ``dtype``."""
        if name not in self.arrays:
            raise ResumeError(f"the saved state has no {name!r}")
        value = np.asarray(self.arrays[name])
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise ResumeError(f"the saved state's {name!r} has shape {tuple(value.shape)}, "
                              f"this run needs {tuple(shape)}")
        return value.astype(dtype, copy=False) if dtype is not None else value


class Checkpointer:
    """When to save a :class:`RunState` and what to do with it: ``write(state)`` (the
    command's; it writes the resume file). ``interval``: seconds of wall time between saves
    (default ``LORADYN_RESUME_SECONDS`` or :data:`INTERVAL_S`; 0: at every chunk or segment
    end); counted from construction and from each save."""

    def __init__(self, write, interval: float | None = None):
        if interval is None:
            text = os.environ.get(INTERVAL_ENV, "").strip()
            try:
                interval = float(text) if text else INTERVAL_S
            except ValueError:
                interval = INTERVAL_S
        self.write, self.interval = write, max(float(interval), 0.0)
        self.last, self.saved = time.monotonic(), 0

    def due(self) -> bool:
        """Whether a save is due now."""
        return time.monotonic() - self.last >= self.interval

    def save(self, state: RunState) -> None:
        self.write(state)
        self.last, self.saved = time.monotonic(), self.saved + 1
