"""The exact chains' runs advanced in segments (issue 38.2): many kernel calls whose
concatenation is bit-identical to one call over the whole horizon.

A chain's kernel advances each run from its state (its stream, and the chain's coordinates)
by ``n_steps`` steps in place, recording at the checkpoints of the call
(:func:`._drive.drive`). :class:`ChainRun` keeps the runs' state, their records (R, C, ...)
and their divergence between calls: :meth:`ChainRun.advance` advances the live runs by n steps
in one kernel call, recording the checkpoints that fall in (t, t + n] (and step 0 at the
start), and records the runs that stopped earlier (diverged: frozen) at those checkpoints from
their frozen state, as one call over the whole horizon does. A run's numbers come from its
own stream, and its step reads nothing but its state and the step's draws, so where the
segments end does not change them (``tests/test_chain_segments.py`` checks it for every
chain). The one piece of a step that looks past the step — the network chain's fused b = 1
pass, which draws the next step's example while it updates the rows — is told whether steps
follow the call (``more``) and carries its prefetched example in per-run work arrays.

:func:`run_to_end` drives a :class:`ChainRun` to its horizon in segments of about
:data:`SEGMENT_SECONDS` each (their length adapts to the measured rate, from
:data:`FIRST_SEGMENT` steps on), with progress lines between segments; ``after_segment``
(the engine's: interruption, durable checkpoints) is called after each. The environment
variable ``LORADYN_SEGMENT_STEPS=N`` fixes the length at N steps (tests).

:meth:`ChainRun.run_state` / :meth:`ChainRun.load_run_state` give and take everything the
runs need to go on (``dynamics.runtime.resume.RunState``: state arrays, records so far, divergence,
step); the chain's start (instances, constants, initial overlaps) is rebuilt from the config.
"""

from __future__ import annotations

import os
import time

import numpy as np

from dynamics.runtime.progress import progress_bar, warmed_up

__all__ = ["ChainRun", "run_to_end", "Pace", "SEGMENT_SECONDS", "FIRST_SEGMENT",
           "SEGMENT_ENV"]

SEGMENT_SECONDS = 0.5  # target wall time of one segment
FIRST_SEGMENT = 64  # steps of the first segment (the rate is unknown until it ends)
MAX_GROWTH = 16  # a segment is at most this many times longer than the one before
SEGMENT_ENV = "LORADYN_SEGMENT_STEPS"  # fixed segment length (tests)


class ChainRun:
    """R runs of one exact chain between kernel calls (module docstring).

    Subclasses set ``name`` and implement :meth:`_kernel` (one call on a group of runs) and
    :meth:`trajectory`. ``per_run``: name → (R, ...) arrays the kernel reads, the state
    among them advanced in place; ``records``: name → (R, C, ...) checkpoint records (a
    record the chain does not keep has C = 0 and stays empty). ``t``: the step every live
    run has reached; ``c``: checkpoints recorded; ``div``/``hit`` (R,): the global step a run
    diverged / hit its stop level at, −1 if not.
    """

    name = "?"
    backend = "numba"

    def __init__(self, cp_steps, per_run: dict, records: dict):
        self.cp_steps = np.asarray(cp_steps, dtype=np.int64)
        self.total = int(self.cp_steps[-1])
        self.per_run, self.records = per_run, records
        runs = len(next(iter(per_run.values())))
        self.div = np.full(runs, -1, dtype=np.int64)
        self.hit = np.full(runs, -1, dtype=np.int64)
        self.t, self.c = 0, 0

    # ------------------------------------------------------------------ progress
    @property
    def runs(self) -> int:
        return self.div.shape[0]

    @property
    def step(self) -> int:
        """Steps taken by every live run."""
        return self.t

    @property
    def finished(self) -> bool:
        """Every checkpoint recorded (the horizon reached)."""
        return self.c == self.cp_steps.size

    # ------------------------------------------------------------------ the segments
    def advance(self, n: int) -> None:
        """Advance the live runs by ``n`` steps (at most to the horizon) in one kernel call,
        recording the checkpoints in (t, t + n] (step 0 too at the start); the runs that
        stopped earlier are recorded at them from their frozen state."""
        t0 = self.t
        t1 = min(t0 + max(int(n), 0), self.total)
        c0 = self.c
        c1 = int(np.searchsorted(self.cp_steps, t1, side="right"))
        cp = np.ascontiguousarray(self.cp_steps[c0:c1] - t0)
        done = (self.div >= 0) | (self.hit >= 0)
        for group, steps in ((~done, t1 - t0), (done, 0)):
            if not group.any() or (steps == 0 and cp.size == 0):
                continue
            idx = None if group.all() else np.flatnonzero(group)
            self._call(idx, steps, cp, c0, c1, t0, more=t1 < self.total)
        self.t, self.c = t1, c1

    def _call(self, idx, steps, cp, c0, c1, t0, more) -> None:
        """One kernel call on runs ``idx`` (None: all), scattering state and records back."""
        state = (self.per_run if idx is None else
                 {k: np.ascontiguousarray(v[idx]) for k, v in self.per_run.items()})
        n = self.runs if idx is None else idx.size
        rec = {k: np.empty((n, cp.size if v.shape[1] else 0, *v.shape[2:]), dtype=v.dtype)
               for k, v in self.records.items()}
        div, hit = self._kernel(state, rec, steps, cp, more)
        if idx is not None:
            for k, v in state.items():
                self.per_run[k][idx] = v
        for k, v in rec.items():
            if v.shape[1]:
                if idx is None:
                    self.records[k][:, c0:c1] = v
                else:
                    self.records[k][idx, c0:c1] = v
        sel = np.arange(self.runs) if idx is None else idx
        self.div[sel] = np.where(div >= 0, t0 + div, self.div[sel])
        self.hit[sel] = np.where(hit >= 0, t0 + hit, self.hit[sel])

    def _kernel(self, state: dict, rec: dict, n_steps: int, cp: np.ndarray,
                more: bool) -> tuple[np.ndarray, np.ndarray]:
        """Advance the runs of ``state`` (a group's per-run arrays, in place) by ``n_steps``,
        recording at the call's checkpoints ``cp`` into ``rec``; (div, hit) steps of the
        call (−1: not). ``more``: steps follow this call."""
        raise NotImplementedError

    def drive(self, *, progress: bool = False, after_segment=None, before=None) -> ChainRun:
        """:func:`run_to_end` on this run (the engine's driver calls it)."""
        return run_to_end(self, progress=progress, after_segment=after_segment, before=before)

    # ------------------------------------------------------------------ results
    def recorded(self) -> tuple[np.ndarray, dict]:
        """(the checkpoint steps recorded, name → records (R, c, ...) at them)."""
        return (self.cp_steps[: self.c],
                {k: (v[:, : self.c] if v.shape[1] else v) for k, v in self.records.items()})

    def trajectory(self):
        """The :class:`~dynamics.runtime.trajectory.Trajectory` of the checkpoints recorded so
        far."""
        raise NotImplementedError

    # ------------------------------------------------------------------ durable state
    @property
    def kind(self) -> str:
        """What a checkpoint file names the engine state by (chain and backend)."""
        return f"reduced/{self.name}/{self.backend}"

    def run_state(self):
        """The runs' :class:`~dynamics.runtime.resume.RunState` now (between segments)."""
        from dynamics.runtime.resume import RunState

        # copies: the kernel advances the arrays in place after this
        arrays = {f"per_run/{k}": v.copy() for k, v in self.per_run.items()}
        steps, recs = self.recorded()
        arrays |= {f"records/{k}": v.copy() for k, v in recs.items()}
        arrays |= {"div": self.div.copy(), "hit": self.hit.copy()}
        arrays |= {f"extra/{k}": np.array(v) for k, v in self._extra_state().items()}
        return RunState(engine="reduced", kind=self.kind, step=self.t, total=self.total,
                        reached=self.c, checkpoints=int(self.cp_steps.size), runs=self.runs,
                        arrays=arrays, values={})

    def load_run_state(self, rs) -> None:
        """Continue from ``rs`` (:meth:`run_state` of a run of the same config and kind)."""
        rs.require(kind=self.kind, total=self.total, checkpoints=int(self.cp_steps.size),
                   runs=self.runs)
        for k, v in self.per_run.items():
            v[...] = rs.array(f"per_run/{k}", v.shape, v.dtype)
        self.c, self.t = int(rs.reached), int(rs.step)
        for k, v in self.records.items():
            if v.shape[1]:
                v[:, : self.c] = rs.array(f"records/{k}", (v.shape[0], self.c, *v.shape[2:]),
                                          v.dtype)
        self.div[:] = rs.array("div", self.div.shape, self.div.dtype)
        self.hit[:] = rs.array("hit", self.hit.shape, self.hit.dtype)
        self._load_extra({k.removeprefix("extra/"): v for k, v in rs.arrays.items()
                          if k.startswith("extra/")})

    def _extra_state(self) -> dict:
        """Further arrays a subclass keeps between segments (saved with the state)."""
        return {}

    def _load_extra(self, arrays: dict) -> None:
        """Take back what :meth:`_extra_state` gave."""


class Pace:
    """Segment lengths: about :data:`SEGMENT_SECONDS` of wall time each, from the rate the
    last segment measured (at most :data:`MAX_GROWTH` times longer than it), or a fixed
    length (``LORADYN_SEGMENT_STEPS``, or ``fixed``)."""

    def __init__(self, fixed: int | None = None, seconds: float = SEGMENT_SECONDS):
        env = os.environ.get(SEGMENT_ENV, "").strip()
        if fixed is None and env.isdigit() and int(env) > 0:
            fixed = int(env)
        self.fixed, self.seconds, self.n = fixed, seconds, FIRST_SEGMENT

    def next(self) -> int:
        return self.fixed or self.n

    def took(self, n: int, seconds: float) -> None:
        """The last segment took ``seconds`` for ``n`` steps."""
        if self.fixed or n <= 0:
            return
        rate = n / max(seconds, 1e-6)
        self.n = int(min(max(rate * self.seconds, 1), MAX_GROWTH * max(n, 1)))


def run_to_end(run: ChainRun, *, progress: bool = False, after_segment=None,
               pace: Pace | None = None, before=None):
    """Advance ``run`` to its horizon in segments (module docstring), a progress line
    between them (``progress``: :func:`dynamics.runtime.progress.progress_bar`); ``after_segment
    (run)`` after each segment that leaves steps to go returns True to stop there;
    ``before()`` is called once before the first segment. Returns ``run``."""
    pace = pace or Pace()
    with progress_bar(run.total, enabled=progress, unit="step", desc="SGD (exact chain)",
                      initial=run.step) as bar:
        if before is not None:
            before()
        first = True
        while not run.finished:
            n, start, t0 = pace.next(), time.perf_counter(), run.step
            run.advance(n)
            pace.took(run.step - t0, time.perf_counter() - start)
            if first:  # its kernel's compile (or cache load) is no measure of the rate
                warmed_up(bar, run.step - t0)
                first = False
            else:
                bar.update(run.step - t0)
            if not run.finished and after_segment is not None and after_segment(run):
                break
    return run
