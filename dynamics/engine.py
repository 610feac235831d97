"""The batched online-SGD engine: ``simulate(config) -> Trajectory``.

R runs of one learner (``dynamics.learners``, protocol in ``learners.base``) advance together
as tensors with a leading run axis (canonical frame, so the finetune learner pays O(d + k²)
per example and run). Examples are drawn a chunk of steps at a time (``sampling``); the
learner's in-place step consumes them one step at a time. At each chunk end the learner
retracts exactly onto its manifold, and runs whose step went non-finite (or whose state the
learner calls invalid, e.g. |m| > 1 + tol) are marked diverged at that step, restored to
their (finite) state at the start of the chunk and frozen (their step sizes set to 0), so NaN
never reaches the other runs; their records read NaN from that step on.
``engine = reduced | auto`` dispatches to ``dynamics.reduced``.

Interruption (issue 26): inside :func:`interruptible` (``loradyn run``), the first SIGINT or
SIGTERM only sets a flag; the full engine's hot loop polls it at every chunk end, stops
there, and :meth:`FullRun.run` returns the trajectory of the checkpoints reached so far
(``Interruption.step``: the step it stopped at). A second signal raises :class:`Interrupted`
(abort now, keep nothing). The reduced engine runs in one numba/CUDA kernel call that
cannot stop midway: a signal during it is honoured when it returns, i.e. the run finishes
and its trajectory is complete (``Interruption.step`` stays None). ``interruptible(keep=
False)`` (``loradyn sweep``) raises :class:`Interrupted` at once instead: the caller keeps
what it finished.

Test hook: the environment variable ``LORADYN_TEST_INTERRUPT_AFTER_CHUNKS=N`` makes the
process send itself SIGINT (``LORADYN_TEST_INTERRUPT_SIGNAL=TERM``: SIGTERM) once N chunks
have run in it: checked before the full engine's first chunk and after each, and before
each reduced-engine run (which counts as one chunk). Tests use it to interrupt a run at a
known point whatever the machine's load; it is never set otherwise.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from .config import RunConfig
from .engine_choice import choose_engine
from .lazy import lazy_import
from .learners import Problem, RunResult, get_learner
from .learners.directions import initial_directions
from .progress import progress_bar
from .resolve import ResolvedRun, resolve_run
from .sampling import NoiseSource, resolve_device, resolve_dtype
from .trajectory import Trajectory, checkpoint_steps

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["simulate", "simulate_full", "FullRun", "choose_engine", "initial_directions",
           "chunk_schedule", "iter_chunk_schedule", "Interruption", "Interrupted",
           "interruptible", "raise_if_signalled", "TEST_INTERRUPT_ENV"]

TEST_INTERRUPT_ENV = "LORADYN_TEST_INTERRUPT_AFTER_CHUNKS"  # test hook (module docstring)
TEST_SIGNAL_ENV = "LORADYN_TEST_INTERRUPT_SIGNAL"  # INT (default) or TERM


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM turned into an exception (``signum``: which)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


class Interruption:
    """The flag of :func:`interruptible`: ``signum`` (the first signal received, None if
    none) and ``step`` (the step the full engine stopped at, None if it did not stop
    early: no signal, or one that came outside its hot loop)."""

    def __init__(self):
        self.signum: int | None = None
        self.step: int | None = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


_ACTIVE: Interruption | None = None  # the flag of the innermost interruptible(keep=True)
_CHUNKS = [0]  # chunks run in this process, for the test hook
_RAISED: list = [None]  # the signal the handler last raised Interrupted for (cleared on exit)


@contextmanager
def interruptible(keep: bool = True) -> Iterator[Interruption]:
    """SIGINT/SIGTERM handling for a command (module docstring). ``keep``: the first signal
    sets the yielded flag (the full engine stops at its next chunk end), a second raises
    :class:`Interrupted`; otherwise every signal raises :class:`Interrupted` at once.
    Outside the main thread (where handlers cannot be installed) nothing changes."""
    global _ACTIVE
    flag = Interruption()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, _frame):
        if keep and flag.signum is None:
            flag.signum = signum
            return
        flag.signum = flag.signum or signum
        _RAISED[0] = signum  # raise_if_signalled re-raises it if a callback swallows it
        raise Interrupted(signum)

    sigs = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, handler) for s in sigs}
    outer, _ACTIVE = _ACTIVE, (flag if keep else None)
    try:
        yield flag
    finally:
        _ACTIVE = outer
        _RAISED[0] = None
        for s, h in before.items():
            signal.signal(s, h)


def raise_if_signalled() -> None:
    """Raise :class:`Interrupted` again if :func:`interruptible`'s handler raised it where
    Python swallows exceptions (a weakref callback or ``__del__``: "Exception ignored in …"):
    long loops call this at their safe points, so a signal is never lost."""
    if _RAISED[0] is not None:
        raise Interrupted(_RAISED[0])


def _stop_requested() -> bool:
    return _ACTIVE is not None and _ACTIVE.signum is not None


def _test_hook() -> None:
    """Send the test signal if ``TEST_INTERRUPT_ENV`` chunks have run (module docstring)."""
    want = os.environ.get(TEST_INTERRUPT_ENV)
    if want and want.strip().isdigit() and int(want) == _CHUNKS[0]:
        name = os.environ.get(TEST_SIGNAL_ENV, "INT").upper().removeprefix("SIG")
        os.kill(os.getpid(), signal.SIGTERM if name == "TERM" else signal.SIGINT)


def simulate(config, progress: bool = False) -> Trajectory:
    """Run ``config`` on the engine it names; same config → same numbers.

    ``config``: a :class:`RunConfig` (resolved here: validated, instances built, memory
    checked) or a :class:`~dynamics.resolve.ResolvedRun` a command resolved already (nothing
    is validated or built again). Before anything is allocated,
    :func:`dynamics.budget.check_memory` refuses a request that cannot fit in the available
    memory (MemoryBudgetError, one line: what fits).
    """
    run = config if isinstance(config, ResolvedRun) else resolve_run(config)
    if run.engine == "reduced":
        from .reduced import simulate_resolved

        _test_hook()  # one kernel call: a signal is honoured when it returns
        traj = simulate_resolved(run)
        _CHUNKS[0] += 1
        return traj
    return FullRun(run.config, instances=run.run_instances).run(progress)


class _Records:
    """Checkpoint records (host numpy): whatever ``learner.observe`` returns, stacked."""

    def __init__(self, learner):
        self.learner, self.lists = learner, {}

    def add(self, state) -> None:
        for name, value in self.learner.observe(state).items():
            self.lists.setdefault(name, []).append(value)

    def arrays(self) -> dict:
        """name → (R, C, ...)."""
        return {name: np.stack(xs, axis=1) for name, xs in self.lists.items()}


class _Divergence:
    """Tracks diverged runs: detection at chunk ends, restore-and-freeze (see module doc)."""

    def __init__(self, runs: int, device):
        self.step = np.full(runs, -1, dtype=np.int64)
        self.alive = torch.ones(runs, dtype=torch.bool, device=device)

    def check(self, learner, state, snapshot, norms: torch.Tensor, start: int) -> None:
        # norms: the steps' health values (n, R), finite and > 0 for every valid step
        bad_n = ~(torch.isfinite(norms) & (norms > 0))
        new = (bad_n.any(0) | learner.bad_runs(state)) & self.alive
        if not bool(new.any()):
            return
        first = torch.where(bad_n.any(0), bad_n.int().argmax(0) + 1, norms.shape[0])
        idx = new.nonzero().squeeze(1)
        state.restore_(snapshot, idx)
        learner.freeze_(idx)
        self.alive[idx] = False
        self.step[idx.cpu().numpy()] = start + first[idx].cpu().numpy()


@contextmanager
def _intraop_threads(n: int):
    """Run torch's CPU ops on n threads inside the block (restored after).

    The engine's per-step ops are small; on a shared machine OpenMP teams stall whenever a
    core is taken by another process, so the hot loop runs single-threaded and the cores go
    to the sampler's threads instead.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield before
    finally:
        torch.set_num_threads(before)


def iter_chunk_schedule(steps: np.ndarray, chunk: int) -> Iterator[tuple[int, bool]]:
    """(size, ends-at-a-checkpoint) of every chunk from step 0 to steps[-1], lazily: a
    horizon of 10¹³ steps has ~4·10¹⁰ chunks, which must never exist as a list."""
    for lo, hi in zip(steps[:-1], steps[1:], strict=True):
        t, hi = int(lo), int(hi)
        while t < hi:
            n = min(chunk, hi - t)
            t += n
            yield n, t == hi


def chunk_schedule(steps: np.ndarray, chunk: int) -> list[tuple[int, bool]]:
    """:func:`iter_chunk_schedule` as a list (small horizons, tests)."""
    return list(iter_chunk_schedule(steps, chunk))


class FullRun:
    """One batch of R runs on the full engine: built from a config, advanced by :meth:`run`.

    ``instances``: the runs' resolved instances (default: built from the config). Fields:
    ``config``, ``instances`` (per run), ``problem``, ``learner``, ``state``
    (the learner state, final after :meth:`run`), ``m0`` (R,), ``steps`` (checkpoints).
    """

    def __init__(self, config: RunConfig, instances: list | None = None):
        self.config = config
        self.device, self.dtype = resolve_device(config.device), resolve_dtype(config.dtype)
        self.instances = config.run_instances() if instances is None else list(instances)
        self.problem = Problem.from_instances(self.instances, self.device, self.dtype)
        self.learner = get_learner(config.learner).from_config(config, self.problem)
        self.state, self.m0 = self.learner.initial_state(config, self.instances)
        self.steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
        self.records = _Records(self.learner)
        self.divergence = _Divergence(config.runs, self.device)

    def run(self, progress: bool = False) -> Trajectory:
        """Advance every run to the last checkpoint, recording at each; the Trajectory."""
        self.advance(progress)
        return self.trajectory()

    def advance(self, progress: bool = False) -> None:
        """The hot loop: all SGD steps, with divergence checks and checkpoint records."""
        cfg, learner, state = self.config, self.learner, self.state
        d, noisy = self.problem.d, learner.needs_label_noise
        self.records.add(state)
        with _intraop_threads(1) as cores, \
                NoiseSource(cfg.seed, cfg.runs, cfg.batch, d, extra=int(noisy),
                            sqnorm_cols=learner.sqnorm_columns, device=self.device,
                            dtype=self.dtype, threads=cores,
                            per_run={"auto": None, "per_run": True, "shared": False,
                                     "counter": True}[cfg.streams],
                            counter=cfg.streams == "counter") as noise, \
                progress_bar(cfg.steps, enabled=progress, unit="step", desc="SGD") as bar:
            schedule = iter_chunk_schedule(self.steps, noise.chunk_steps)
            chunked = getattr(learner, "step_chunk_", None)  # all of a chunk's steps at once
            norms = torch.empty((noise.chunk_steps, cfg.runs), dtype=self.dtype,
                                device=self.device)
            chunks = noise.chunks(n for n, _ in iter_chunk_schedule(self.steps,
                                                                    noise.chunk_steps))
            hooked = TEST_INTERRUPT_ENV in os.environ  # test hook (module docstring)
            if hooked:
                _test_hook()
            for (n, at_checkpoint), (buf, sqnorm) in zip(schedule, chunks, strict=True):
                start, snapshot = state.step, state.clone()
                x = buf[..., :d]
                pre = learner.prepare(state, x, buf[..., d] if noisy else None, sqnorm)
                if chunked is not None:  # the learner steps through the chunk itself
                    chunked(state, x, pre, norms[:n])
                else:
                    for i in range(n):
                        norms[i] = learner.step_prepared_(state, x[:, i], pre, i)
                learner.renormalize_(state)
                self.divergence.check(learner, state, snapshot, norms[:n], start)
                bar.update(n)
                if at_checkpoint:
                    self.records.add(state)
                _CHUNKS[0] += 1
                if hooked:
                    _test_hook()
                if _stop_requested() and state.step < cfg.steps:  # between chunks (doc)
                    _ACTIVE.step = int(state.step)
                    chunks.close()
                    break

    def trajectory(self) -> Trajectory:
        """Observables at the checkpoints (loss, theory) as a :class:`Trajectory`."""
        records = self.records.arrays()
        reached = next(iter(records.values())).shape[1] if records else len(self.steps)
        # interrupted (module docstring): the checkpoints recorded so far
        result = RunResult(self.config, self.instances, self.steps[:reached], records,
                           self.divergence.step, self.m0, self.device)
        return self.learner.trajectory(result)


def simulate_full(config: RunConfig, progress: bool = False) -> Trajectory:
    """The full engine: û ∈ R^d explicitly, x ~ N(0, I_d) drawn for every step and run."""
    return FullRun(config).run(progress)
