"""Running a sweep: resume, batch, execute in-process or on dask, write cell by cell.

:func:`run_sweep` validates every cell before touching the disk, takes the sweep file's lock,
skips cells whose hash already has a finished file, runs the remaining batches (in-process,
or one batch per dask task with the results written here, by the client) and rebuilds the
combined file after every finished batch. Finished cells that belong to no cell of the sweep
file (the file was edited) make it refuse, unless ``update`` (then they are kept on disk, left
out of the combined file, and the changed cells are computed).

An interruption (KeyboardInterrupt, or :class:`dynamics.engines.engine.Interrupted` for SIGTERM)
drops the batch in flight, rebuilds the combined file from the cells finished so far and is
raised again as :class:`SweepInterrupted` (how many cells are written, of how many; the
signal), which ``loradyn sweep`` turns into one line naming the command that resumes it.
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import h5py

from dynamics.engines.engine import interrupt_signal, raise_if_signalled
from dynamics.runtime.progress import progress_bar
from sims.experiments.sweep_batch import MAX_BATCH_RUNS, plan_batches, run_batch
from sims.experiments.sweep_spec import SweepSpec
from sims.io.sweep import (
    SWEEP_FORMAT,
    cell_dir,
    file_format,
    finished_cells,
    rebuild_sweep_file,
    sweep_lock,
    write_cell,
)
from sims.io.trajectory import TrajectoryFileError, check_writable

__all__ = ["SweepResult", "SweepInterrupted", "run_sweep", "parse_scheduler",
           "adopt_file_defaults"]

OLD_DEFAULT_ENGINE = "full"  # the engine of cells that named none, before default_engine


def adopt_file_defaults(spec: SweepSpec, out) -> str | None:
    """Resume an existing sweep file with the defaults it was written under: a file whose
    stored sweep has no ``default_engine`` (written before it existed) ran its cells that name
    no engine on ``full``, so ``spec.default_engine`` becomes "full" and their hashes (and
    finished cells) hold. Returns a one-line note when it changed anything, else None."""
    out = Path(out)
    if spec.default_engine == OLD_DEFAULT_ENGINE or not out.is_file():
        return None
    try:
        if file_format(out) != SWEEP_FORMAT:
            return None
        with h5py.File(out, "r") as f:
            stored = json.loads(f.attrs.get("sweep", "{}"))
    except (OSError, ValueError, TrajectoryFileError):
        return None
    if "default_engine" in stored:
        spec.default_engine = stored["default_engine"]
        return None
    spec.default_engine = OLD_DEFAULT_ENGINE
    return (f"{out} was written before sweeps defaulted to engine 'auto': its cells that name "
            f"no engine keep engine '{OLD_DEFAULT_ENGINE}' (set engine in [base] to change)")

CONNECT_TIMEOUT = "10s"  # to an existing dask scheduler


@dataclass
class SweepResult:
    """What :func:`run_sweep` did: counts and wall time."""

    out: Path
    cells: int
    reused: int
    computed: int
    stale: int
    batches: int
    seconds: float


class SweepInterrupted(KeyboardInterrupt):
    """A sweep stopped by SIGINT/SIGTERM: ``written`` of ``cells`` cells are finished on disk;
    ``signum`` the signal (SIGINT for a plain KeyboardInterrupt)."""

    def __init__(self, written: int, cells: int, signum: int = signal.SIGINT):
        super().__init__(f"{written} of {cells} cells written")
        self.written, self.cells, self.signum = int(written), int(cells), int(signum)


def parse_scheduler(value: str | None):
    """None (in-process), ("local", N) or ("address", ADDRESS); ValueError if malformed."""
    if value is None or value == "":
        return None
    if value.startswith("local:"):
        try:
            n = int(value.split(":", 1)[1])
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--scheduler {value!r}: expected local:N with N ≥ 1 workers")
        return ("local", n)
    return ("address", value)


def run_sweep(spec: SweepSpec, out, *, scheduler: str | None = None, batch: bool = True,
              max_batch_runs: int = MAX_BATCH_RUNS, update: bool = False,
              progress: bool = False, echo=None) -> SweepResult:
    """Run (or resume) ``spec`` into the sweep file ``out``; see the module docstring."""
    echo = echo or (lambda msg: None)
    start = time.perf_counter()
    note = adopt_file_defaults(spec, out)
    if note:
        echo(note)
    cells = spec.cells()  # validates every cell first: bad input never touches the disk
    target = parse_scheduler(scheduler)
    out = check_writable(out)
    _check_not_foreign(out)
    with sweep_lock(out):
        finished = finished_cells(out)
        current = {c.hash for c in cells}
        stale = [h for h in finished if h not in current]
        if stale and not update:
            raise ValueError(
                f"{out}: {len(stale)} finished cell(s) in {cell_dir(out).name}/ match no cell "
                f"of {spec.source or 'this sweep'} (edited since?); pass --update to keep "
                "them aside and compute the changed cells, or choose another --out")
        finished = {h: p for h, p in finished.items() if h in current}
        batches = [b for b in plan_batches(cells, batch, max_batch_runs)
                   if any(c.hash not in finished for c in b.cells)]
        todo = sum(c.hash not in finished for c in cells)
        with _executor(target if batches else None) as execute:
            echo(f"sweep '{spec.name}': {len(cells)} cells, {len(cells) - todo} finished, "
                 f"{todo} to run in {len(batches)} batch(es)"
                 + (f"; {len(stale)} stale cell file(s) left aside" if stale else ""))
            rebuild_sweep_file(out, spec, cells, finished)
            reused = len(finished)
            try:
                with progress_bar(len(cells), initial=reused, unit="cell",
                                  enabled=progress, desc="cells") as bar:
                    for batch_, trajs in execute(batches, progress):
                        _write_batch(out, batch_, trajs, finished, bar)
                        rebuild_sweep_file(out, spec, cells, finished)
                        raise_if_signalled()  # a signal a callback swallowed
            except (KeyboardInterrupt, SystemError) as exc:  # module docstring
                signum = interrupt_signal(exc)  # a SystemError: a signal inside h5py's writes
                if signum is None:
                    raise
                done = _rebuild_kept(out, spec, cells)
                raise SweepInterrupted(len(done), len(cells), signum) from None
            except OSError:  # a write fault: the combined file gets the cells on disk if it
                with suppress(OSError, ValueError):  # can be written at all
                    _rebuild_kept(out, spec, cells)
                raise
    return SweepResult(out, len(cells), reused, len(finished) - reused, len(stale),
                       len(batches), time.perf_counter() - start)


def _rebuild_kept(out: Path, spec: SweepSpec, cells) -> dict:
    """Rebuild the combined file from the sweep's cells finished on disk; those cells."""
    current = {c.hash for c in cells}
    done = {h: p for h, p in finished_cells(out).items() if h in current}
    rebuild_sweep_file(out, spec, cells, done)
    return done


def _check_not_foreign(out: Path) -> None:
    """Refuse to replace an existing file that is not a sweep file (e.g. a `loradyn run` one)."""
    if not out.exists():
        return
    try:
        fmt = file_format(out)
    except TrajectoryFileError:
        fmt = "not a readable HDF5 file"
    if fmt != SWEEP_FORMAT:
        raise ValueError(f"{out} exists and is not a loradyn sweep file ({fmt or 'no format'})"
                         "; choose another --out")


def _write_batch(out, batch, trajs, finished: dict, bar) -> None:
    """Write the batch's cells that are not finished yet (each atomically)."""
    for i, (cell, traj) in enumerate(zip(batch.cells, trajs, strict=True)):
        if cell.hash in finished:
            continue
        finished[cell.hash] = write_cell(out, cell, traj, cell.config.run_instances(),
                                         batch.info(i))
        bar.update(1)


def _in_process(batches, progress):
    for b in batches:
        yield b, run_batch(b, progress=progress)


@contextmanager
def _executor(target):
    """A function (batches, progress) → iterator of (batch, trajectories) as they finish."""
    if target is None:
        yield _in_process
        return
    with _dask_client(target) as client:
        from dask.distributed import as_completed

        def on_dask(batches, _progress):
            futures = {client.submit(run_batch, b, pure=False): b for b in batches}
            for fut in as_completed(futures):
                yield futures[fut], fut.result()

        yield on_dask


@contextmanager
def _dask_client(target):
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise ValueError("--scheduler needs dask.distributed (pip install 'loradyn[dask]')"
                         ) from None
    kind, value = target
    with ExitStack() as stack:
        if kind == "local":
            cluster = stack.enter_context(LocalCluster(
                n_workers=value, processes=True, threads_per_worker=1,
                dashboard_address=None))
            client = stack.enter_context(Client(cluster))
        else:
            try:
                client = stack.enter_context(Client(value, timeout=CONNECT_TIMEOUT))
            except (OSError, TimeoutError) as exc:
                raise OSError(f"cannot reach dask scheduler {value}: {exc}") from None
        yield client
