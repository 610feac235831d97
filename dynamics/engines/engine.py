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

The reduced engine (issue 38.2) advances its chain in segments of many steps (about half a
second each; :mod:`dynamics.reduced.segments`), each one kernel call, carrying every run's
state and stream between them: the numbers are those of one call over the whole horizon,
and progress lines, signals and resume files come between segments (:func:`drive_chain`).

Interruption (issue 26): inside :func:`interruptible` (``loradyn run``), the first SIGINT or
SIGTERM only sets a flag; the full engine's hot loop polls it at every chunk end, the
reduced engine's driver at every segment end; either stops there and returns the
trajectory of the checkpoints reached so far (``Interruption.step``: the step it stopped
at; None when the signal came after the last step). A second signal raises
:class:`Interrupted` (abort now, keep nothing). ``interruptible(keep=False)``
(``loradyn sweep``) raises :class:`Interrupted` at once instead (between two chunks or
segments at the latest): the caller keeps what it finished.

Resume files (issue 37.3, :mod:`dynamics.runtime.resume`): given a ``checkpointer``, both engines
save their state (:class:`~dynamics.runtime.resume.RunState`) when it is due and when they stop on
a signal; ``resume`` continues from such a state. The full engine's example streams are
drawn a chunk ahead (double buffering), so their state before the next chunk is kept when
the draw of that chunk starts (``NoiseSource.capture``): a save falls due at a chunk end and
is made at the first chunk end whose next chunk was drawn with the state kept (the next, at
the latest; on a signal too, so the stop may come one chunk later).

Test hook: the environment variable ``LORADYN_TEST_INTERRUPT_AFTER_CHUNKS=N`` makes the
process send itself SIGINT (``LORADYN_TEST_INTERRUPT_SIGNAL=TERM``: SIGTERM; ``KILL``:
SIGKILL, a death without a word, as ``kill -9`` or the machine going down) once N chunks
have run in it: checked before the full engine's first chunk and after each, and before the
reduced engine's first segment and after each (a segment counts as a chunk). Tests use it to
interrupt a run at a known point whatever the machine's load; it is never set otherwise.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields

import numpy as np

from dynamics.engines.choice import choose_engine
from dynamics.engines.resolve import ResolvedRun, resolve_run
from dynamics.lazy import lazy_import
from dynamics.learners import Problem, RunResult, get_learner
from dynamics.learners.directions import initial_directions
from dynamics.randomness.sampling import NoiseSource, NoiseStreams, resolve_device, resolve_dtype
from dynamics.runtime.progress import progress_bar
from dynamics.runtime.resume import ResumeError, RunState
from dynamics.runtime.trajectory import Trajectory, checkpoint_steps
from dynamics.setup.config import RunConfig

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["simulate", "simulate_full", "start", "drive_chain", "advance_chain", "FullRun",
           "choose_engine", "initial_directions", "chunk_schedule", "iter_chunk_schedule",
           "Interruption", "Interrupted", "interruptible", "raise_if_signalled",
           "interrupt_signal", "TEST_INTERRUPT_ENV"]

TEST_INTERRUPT_ENV = "LORADYN_TEST_INTERRUPT_AFTER_CHUNKS"  # test hook (module docstring)
TEST_SIGNAL_ENV = "LORADYN_TEST_INTERRUPT_SIGNAL"  # INT (default), TERM or KILL
_TEST_SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "KILL": signal.SIGKILL}


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM turned into an exception (``signum``: which)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


class Interruption:
    """The flag of :func:`interruptible`: ``signum`` (the first signal received, None if
    none) and ``step`` (the step the engine stopped at, None if it did not stop early: no
    signal, or one that came after its last step)."""

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


def interrupt_signal(exc: BaseException) -> int | None:
    """The signal of an :class:`Interrupted` (or KeyboardInterrupt: SIGINT) that is ``exc``
    or caused it — the handler's exception comes out of C callbacks (h5py's file-object
    writes) wrapped in a SystemError — else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, KeyboardInterrupt):
            return getattr(exc, "signum", int(signal.SIGINT))
        exc = exc.__cause__ or exc.__context__
    return None


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
        os.kill(os.getpid(), _TEST_SIGNALS.get(name, signal.SIGINT))


def simulate(config, progress: bool = False, *, checkpointer=None,
             resume: RunState | None = None) -> Trajectory:
    """Run ``config`` on the engine it names; same config → same numbers.

    ``config``: a :class:`RunConfig` (resolved here: validated, instances built, memory
    checked) or a :class:`~dynamics.engines.resolve.ResolvedRun` a command resolved already (nothing
    is validated or built again). Before anything is allocated,
    :func:`dynamics.engines.budget.check_memory` refuses a request that cannot fit in the available
    memory (MemoryBudgetError, one line: what fits). ``checkpointer``
    (:class:`dynamics.runtime.resume.Checkpointer`): save the run's state when due; ``resume``: go
    on from a saved state (:func:`start` checks that it fits, ResumeError otherwise).
    """
    runner = start(config, resume=resume)
    if isinstance(runner, FullRun):
        return runner.run(progress, checkpointer=checkpointer)
    return drive_chain(runner, progress, checkpointer)


def start(config, resume: RunState | None = None):
    """The runs of ``config`` at step 0, or where ``resume`` left them: a :class:`FullRun`,
    or a :class:`~dynamics.reduced.segments.ChainRun` (engine ``reduced``). ResumeError (one
    line) when ``resume`` is the state of another engine, chain or run shape."""
    run = config if isinstance(config, ResolvedRun) else resolve_run(config)
    if run.engine == "reduced":
        from dynamics.reduced import start_resolved

        runner = start_resolved(run)
    else:
        runner = FullRun(run.config, instances=run.run_instances)
    if resume is not None:
        if resume.engine != run.engine:
            raise ResumeError(f"the saved state is of the {resume.engine} engine, this run "
                              f"takes the {run.engine} engine")
        runner.load_run_state(resume)
    return runner


def drive_chain(chain, progress: bool = False, checkpointer=None) -> Trajectory:
    """Advance a :class:`~dynamics.reduced.segments.ChainRun` to its horizon
    (:func:`advance_chain`) and return its Trajectory (the checkpoints reached: all of them,
    or those before a signal stopped it)."""
    advance_chain(chain, progress, checkpointer)
    return chain.trajectory()


def advance_chain(chain, progress: bool = False, checkpointer=None) -> None:
    """Advance a :class:`~dynamics.reduced.segments.ChainRun` to its horizon in segments
    (its ``drive``: :func:`dynamics.reduced.segments.run_to_end`): a progress line, the test
    hook, the resume file when due (``checkpointer``) and the interruption flag between two
    segments; stopped by a signal at the checkpoints reached (``Interruption.step`` set), with
    a resume file. The theory lines are not drawn here (``chain.trajectory()`` draws them)."""
    hooked = TEST_INTERRUPT_ENV in os.environ  # test hook (module docstring)

    def after_segment(run) -> bool:
        _CHUNKS[0] += 1
        if hooked:
            _test_hook()
        if run.finished:
            return False
        stopping = _stop_requested()
        if checkpointer is not None and (stopping or checkpointer.due()):
            checkpointer.save(run.run_state())
        if stopping:  # between segments (module docstring)
            _ACTIVE.step = int(run.step)
            return True
        return False

    chain.drive(progress=progress, after_segment=after_segment,
                before=_test_hook if hooked else None)


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


def iter_chunk_schedule(steps: np.ndarray, chunk: int,
                        start: int = 0) -> Iterator[tuple[int, bool]]:
    """(size, ends-at-a-checkpoint) of every chunk from step ``start`` (0, or the end of a
    chunk of this schedule: a resumed run) to steps[-1], lazily: a horizon of 10¹³ steps has
    ~4·10¹⁰ chunks, which must never exist as a list. Each checkpoint interval is cut into
    chunks from its start, so a run resumed at a chunk end gets the chunks it would have."""
    first = max(int(np.searchsorted(steps, start, side="right")) - 1, 0)
    for lo, hi in zip(steps[first:-1], steps[first + 1:], strict=True):
        t, hi = max(int(lo), int(start)), int(hi)
        if (t - int(lo)) % chunk:
            raise ValueError(f"step {start} is not a chunk end of this schedule")
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
        self.chunk_steps: int | None = None  # the example chunks' length (set by advance)
        self._streams: dict | None = None  # the streams' state to go on from (resumed)

    @property
    def step(self) -> int:
        return int(self.state.step)

    @property
    def total(self) -> int:
        return int(self.config.steps)

    @property
    def kind(self) -> str:
        """What a resume file names this state layout by."""
        return f"full/{self.config.learner}"

    def run(self, progress: bool = False, checkpointer=None) -> Trajectory:
        """Advance every run to the last checkpoint, recording at each; the Trajectory.
        ``checkpointer``: save the run's state when due (module docstring)."""
        self.advance(progress, checkpointer)
        return self.trajectory()

    def advance(self, progress: bool = False, checkpointer=None) -> None:
        """The hot loop: all SGD steps (from where a resumed run stopped), with divergence
        checks, checkpoint records and resume files when ``checkpointer`` says they are
        due."""
        cfg, learner, state = self.config, self.learner, self.state
        d, noisy = self.problem.d, learner.needs_label_noise
        if not self.records.lists:  # a fresh start (a resumed run has its records)
            self.records.add(state)
        begun = int(state.step)
        with _intraop_threads(1) as cores, \
                NoiseSource(NoiseStreams(cfg.seed, cfg.streams), cfg.runs, cfg.batch, d,
                            extra=int(noisy), sqnorm_cols=learner.sqnorm_columns,
                            device=self.device, dtype=self.dtype, threads=cores,
                            chunk_steps=self.chunk_steps) as noise, \
                progress_bar(cfg.steps, enabled=progress, unit="step", desc="SGD",
                             initial=begun) as bar:
            self.chunk_steps = noise.chunk_steps
            if self._streams is not None:
                noise.load_state(self._streams)
                self._streams = None
            schedule = iter_chunk_schedule(self.steps, noise.chunk_steps, begun)
            chunked = getattr(learner, "step_chunk_", None)  # all of a chunk's steps at once
            norms = torch.empty((noise.chunk_steps, cfg.runs), dtype=self.dtype,
                                device=self.device)
            chunks = noise.chunks(n for n, _ in iter_chunk_schedule(self.steps,
                                                                    noise.chunk_steps, begun))
            hooked = TEST_INTERRUPT_ENV in os.environ  # test hook (module docstring)
            if hooked:
                _test_hook()
            consumed = 0  # chunks of this source done
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
                consumed += 1
                if hooked:
                    _test_hook()
                if state.step >= cfg.steps:
                    continue
                stopping = _stop_requested()
                if checkpointer is not None and (stopping or checkpointer.due()):
                    streams = noise.snapshot(consumed)
                    if streams is None:  # the next chunk end has it (module docstring)
                        noise.capture = True
                        continue
                    checkpointer.save(self.run_state(streams))
                    noise.capture = checkpointer.interval == 0
                if stopping:  # between chunks (module docstring)
                    _ACTIVE.step = int(state.step)
                    chunks.close()
                    break

    def run_state(self, streams: dict) -> RunState:
        """The runs' :class:`~dynamics.runtime.resume.RunState` at this chunk end, ``streams`` the
        example streams' state before the next chunk (``NoiseSource.snapshot``)."""
        arrays, scalars = {}, {}
        for f in fields(self.state):
            value = getattr(self.state, f.name)
            if isinstance(value, torch.Tensor):
                arrays[f"state/{f.name}"] = value.detach().cpu().numpy().copy()
            else:
                scalars[f.name] = value
        for i, eta in enumerate(self.learner.step_sizes()):
            arrays[f"step_sizes/{i}"] = eta.detach().cpu().numpy().copy()
        arrays |= {f"records/{k}": v for k, v in self.records.arrays().items()}
        arrays["diverged_step"] = self.divergence.step.copy()
        arrays["alive"] = self.divergence.alive.cpu().numpy().copy()
        arrays |= {f"streams/{i}": g for i, g in enumerate(streams["generators"])}
        reached = len(next(iter(self.records.lists.values()))) if self.records.lists else 0
        return RunState(engine="full", kind=self.kind, step=int(self.state.step),
                        total=int(self.config.steps), reached=reached,
                        checkpoints=int(self.steps.size), runs=int(self.config.runs),
                        arrays=arrays,
                        values={"state": scalars, "drawn": int(streams["drawn"]),
                                "generators": len(streams["generators"]),
                                "chunk_steps": int(self.chunk_steps),
                                "records": sorted(self.records.lists)})

    def load_run_state(self, rs: RunState) -> None:
        """Go on from ``rs`` (:meth:`run_state` of a run of the same config): learner state,
        step sizes, records, divergence and the example streams."""
        cfg = self.config
        rs.require(engine="full", kind=self.kind, total=int(cfg.steps),
                   checkpoints=int(self.steps.size), runs=int(cfg.runs))
        for f in fields(self.state):
            value = getattr(self.state, f.name)
            if isinstance(value, torch.Tensor):
                saved = rs.array(f"state/{f.name}", tuple(value.shape))
                setattr(self.state, f.name, torch.as_tensor(
                    np.ascontiguousarray(saved), dtype=value.dtype, device=value.device))
            elif f.name in rs.values.get("state", {}):
                setattr(self.state, f.name, rs.values["state"][f.name])
        for i, eta in enumerate(self.learner.step_sizes()):
            saved = rs.array(f"step_sizes/{i}", tuple(eta.shape))
            eta.copy_(torch.as_tensor(np.ascontiguousarray(saved), dtype=eta.dtype))
        self.records.lists = {
            name: list(np.moveaxis(rs.array(f"records/{name}"), 1, 0))
            for name in rs.values.get("records", [])}
        self.divergence.step[:] = rs.array("diverged_step", self.divergence.step.shape)
        alive = rs.array("alive", tuple(self.divergence.alive.shape))
        self.divergence.alive.copy_(torch.as_tensor(alive, device=self.device))
        self.chunk_steps = int(rs.values["chunk_steps"])
        self._streams = {"drawn": int(rs.values["drawn"]),
                         "generators": [rs.array(f"streams/{i}")
                                        for i in range(int(rs.values["generators"]))]}
        if int(self.state.step) != int(rs.step):
            raise ResumeError(f"the saved state is at step {self.state.step}, its header says "
                              f"{rs.step}")

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
