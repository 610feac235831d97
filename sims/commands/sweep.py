"""``loradyn sweep SPEC.toml``: run a grid of cells into one resumable HDF5 sweep file.

On SIGINT (Ctrl-C) or SIGTERM the sweep stops at once (:func:`dynamics.engines.engine.interruptible`
with ``keep=False``): the batch in flight is dropped, the finished cells stay (each written
atomically, the sweep file rebuilt from them), one line gives the count and the exact command
that resumes it (``interrupted: 3 of 8 cells written; resume with: loradyn sweep SPEC.toml
--out F.h5``), and the command exits 130 (SIGINT) or 143 (SIGTERM).

A fault while writing (no space, permission, read-only filesystem, quota, I/O error; issue 37)
is one line naming the file and the cause, how many cells are kept and the command that
resumes; --out is locked for the whole command (a second writer is refused at once).
"""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import click

from dynamics.engines.engine import interruptible
from sims.commands.checks import check_sweep
from sims.experiments.sweep import SweepInterrupted, adopt_file_defaults, run_sweep
from sims.experiments.sweep_batch import MAX_BATCH_RUNS
from sims.experiments.sweep_spec import load_sweep
from sims.io.atomic import WriteFault
from sims.io.lock import claim_outputs
from sims.io.outputs import Input, Output
from sims.io.sweep import finished_cells

__all__ = ["sweep", "default_out", "resume_command"]


def default_out(spec_path) -> Path:
    """results/<spec stem>.h5."""
    return Path("results") / f"{Path(spec_path).stem}.h5"


def resume_command(spec, out, *, scheduler=None, no_batch=False,
                   max_batch_runs=MAX_BATCH_RUNS, update=False) -> str:
    """The command line that resumes this sweep: same SPEC, --out and batching options."""
    words = ["loradyn", "sweep", str(spec), "--out", str(out)]
    if scheduler:
        words += ["--scheduler", scheduler]
    if no_batch:
        words.append("--no-batch")
    if max_batch_runs != MAX_BATCH_RUNS:
        words += ["--max-batch-runs", str(max_batch_runs)]
    if update:
        words.append("--update")
    return shlex.join(words)


@click.command("sweep")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Sweep HDF5 file [default: results/<SPEC stem>.h5]; finished cells also "
                   "live in <out>.cells/.")
@click.option("--scheduler", default=None, metavar="ADDRESS|local:N",
              help="Send cells to a dask.distributed scheduler at ADDRESS, or start a local "
                   "cluster of N worker processes [default: in-process].")
@click.option("--no-batch", is_flag=True,
              help="Run every cell alone instead of batching cells that differ only in ξ or "
                   "instance seed on the run axis.")
@click.option("--max-batch-runs", type=click.IntRange(min=1), default=MAX_BATCH_RUNS,
              help="Largest number of runs in one batch.")
@click.option("--update", is_flag=True,
              help="Resume even if finished cells no longer match the sweep file (they stay "
                   "in <out>.cells/ but leave the sweep file; the changed cells are computed).")
@click.option("--dry-run", is_flag=True, help="List the cells and exit.")
@click.option("--force", is_flag=True,
              help="Replace an existing --out file that is not a sweep file (refused "
                   "otherwise; a sweep file is always resumed, never replaced).")
def sweep(spec, out, scheduler, no_batch, max_batch_runs, update, dry_run, force):
    """Run (or resume) the sweep described by SPEC (TOML; see docs/sweeps.md)."""
    parsed = load_sweep(spec)
    out = Path(out) if out else default_out(spec)
    note = adopt_file_defaults(parsed, out)  # an older file resumes with its own default
    if note:
        click.echo(note, err=True)
    if dry_run:
        for cell in parsed.cells():
            click.echo(f"{cell.name}  {cell.hash[:12]}  {cell.label}")
        return
    with claim_outputs([Output("--out", out, "hdf5", "sweep")], [Input("SPEC", spec)],
                       force=force):
        check_sweep(parsed, out, batch=not no_batch, max_batch_runs=max_batch_runs,
                    force=force)
        again = resume_command(spec, out, scheduler=scheduler, no_batch=no_batch,
                               max_batch_runs=max_batch_runs, update=update)
        try:
            with interruptible(keep=False):  # module docstring
                result = run_sweep(parsed, out, scheduler=scheduler, batch=not no_batch,
                                   max_batch_runs=max_batch_runs, update=update,
                                   progress=True, echo=click.echo)
        except KeyboardInterrupt as stop:  # SweepInterrupted, or one before its loop began
            if not isinstance(stop, SweepInterrupted):
                stop = SweepInterrupted(_written(parsed, out), len(parsed.cells()),
                                        getattr(stop, "signum", signal.SIGINT))
            click.echo(f"interrupted: {stop.written} of {stop.cells} cells written; resume "
                       f"with: {again}", err=True)
            click.get_current_context().exit(128 + stop.signum)
        except WriteFault as exc:  # sims.io.atomic: the finished cells stay
            raise click.ClickException(f"{exc}; {_written(parsed, out)} of "
                                       f"{len(parsed.cells())} cells kept; resume with: "
                                       f"{again}") from None
    click.echo(f"computed {result.computed} cell(s), reused {result.reused}, "
               f"in {result.seconds:.1f} s; wrote {result.out}")


def _written(parsed, out) -> int:
    """How many cells of the sweep have a finished file (0 if the folder cannot be read)."""
    current = {c.hash for c in parsed.cells()}
    try:
        return sum(h in current for h in finished_cells(out))
    except (OSError, ValueError):
        return 0
