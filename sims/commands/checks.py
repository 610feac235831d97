"""Checks every simulating command makes before it computes, and the health of what it got
(issue 16: nothing lost, nothing absurd).

Before any compute (:func:`preflight`): the output paths (:mod:`sims.io.outputs`; each locked
against a second writer, :mod:`sims.io.lock`; where its size is known, checked against the
free space of its filesystem, :func:`check_run_space`, :func:`check_sweep_space`), the seeds
(the master seed is checked by ``RunConfig.validate``; the instance seeds of every run are
stored as int64, so spec seed (+ R − 1 with per-run instance seeds) must stay below 2⁶³), the
memory estimate (:mod:`dynamics.engines.budget`, a one-line refusal saying what fits) and the step
size (:mod:`hermite.finite_d.stability`: a one-line warning when η is above the SGD or ODE stability
limit). After it (:func:`health`): how many runs left the sphere (diverged: non-finite, or
|m| > 1), how many went flat (stopped moving short of the teacher), and which theory curves
blew up (NaN after a finite value, ``hermite.flows.ode``).
"""

from __future__ import annotations

from contextlib import contextmanager

import click
import numpy as np

from dynamics.engines.budget import check_memory
from sims.io.lock import claim_outputs
from sims.io.outputs import Input, Output, check_free_space

__all__ = ["RUN_NAMES", "preflight", "claim_run_outputs", "check_run_space", "check_sweep_space",
           "trajectory_size", "check_instance_seeds", "eta_warning",
           "health", "health_text", "blowup_lines", "warn", "memory_guard", "check_sweep",
           "FLAT_TOL"]

RUN_NAMES = {"runs": "--runs", "checkpoints": "--checkpoints"}
FLAT_TOL = 1e-12  # a run whose overlap moves less than this over its last half is flat
INT64_MAX = 2**63 - 1


def warn(message: str) -> None:
    """One warning line on stderr."""
    click.echo(f"warning: {message}", err=True)


def check_instance_seeds(config, where: str = "instance spec") -> None:
    """The instance seed of every run fits the file's int64 ``instance_seed`` dataset."""
    seed = config.instance.get("seed", 0) or 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        return  # the spec parser names it
    top = seed + (config.runs - 1 if config.instance_seeds == "per_run" else 0)
    if seed < 0 or top > INT64_MAX:
        extra = (f" (with --instance-seeds per_run, seed + runs − 1 = {top})"
                 if config.instance_seeds == "per_run" else "")
        raise ValueError(f"{where}: key 'seed': must be an integer in 0 … 2**63 − 1, got "
                         f"{seed}{extra}")


def eta_warning(config, instances, option: str = "--eta") -> str | None:
    """The one-line warning for an η above the stability limit of the runs' distinct resolved
    ``instances`` (``Learner.step_limit``: finetune on unit-row instances, where the theory
    applies; every ξ of ``xi_values``), or None."""
    try:
        from dynamics.learners import get_learner

        learner = get_learner(config.learner)
        worst = None
        for inst in instances:
            lim = learner.step_limit(config, inst)
            if lim is not None and (worst is None or lim.ratio > worst.ratio):
                worst = lim
    except (ImportError, ValueError, ArithmeticError):
        return None
    return worst.message(option) if worst is not None and worst.exceeded else None


def claim_run_outputs(spec, out, plot=None, force: bool = False):
    """``loradyn run``'s --out and --plot, checked (writable, not an input, not replacing a
    file without --force: one-line OutputError) and locked against a second writer for the
    block (:func:`sims.io.lock.claim_outputs`); cheap, so claimed before any compute."""
    return claim_outputs([Output("--out", out, "hdf5"),
                          Output("--plot", plot, "figure") if plot else None],
                         [Input("SPEC", spec)], force=force)


def trajectory_size(config, trajectory: bool = True) -> int:
    """At least how many bytes the trajectory file of ``config`` takes
    (:func:`sims.io.trajectory.trajectory_bytes` of its runs and checkpoints; a sweep cell
    with ``trajectory = false`` records the start only)."""
    from dynamics.runtime.trajectory import checkpoint_steps
    from sims.io.trajectory import trajectory_bytes

    count = (checkpoint_steps(int(config.steps), int(config.checkpoints), config.spacing).size
             if trajectory else 1)
    return trajectory_bytes(int(config.runs), int(count))


def check_run_space(config, out, option: str = "--out") -> None:
    """The trajectory file of ``config`` fits on the filesystem of ``out`` (one line)."""
    check_free_space(option, out, trajectory_size(config))


def check_sweep_space(cells, out, option: str = "--out") -> None:
    """The cell files still to write and the combined file fit on the filesystem of ``out``
    (one line otherwise)."""
    from sims.io.sweep import cell_path

    sizes = [(trajectory_size(c.config, c.trajectory), cell_path(out, c.hash).exists())
             for c in cells]
    need = sum(n for n, done in sizes if not done) + sum(n for n, _ in sizes)
    check_free_space(option, out, need)


def preflight(config, *, names: dict | None = None, instance=None):
    """The checks of ``loradyn run`` on its config before it simulates (module docstring;
    the outputs are claimed first, :func:`claim_run_outputs`), on the run resolved once here
    (:func:`dynamics.engines.resolve.resolve_run`: validation, instances, engine, memory;
    ``instance``: the spec's, if built already), which it returns for the engine. Warnings
    are printed; problems raise a one-line ValueError naming the option."""
    from dynamics.engines.resolve import resolve_run

    check_instance_seeds(config)
    resolved = resolve_run(config, instance=instance, names=names or RUN_NAMES)
    message = eta_warning(config, resolved.instances)
    if message:
        warn(message)
    return resolved


def health(traj) -> dict:
    """{"left_sphere": runs that diverged (non-finite or |m| > 1: they left the sphere and
    were frozen), "flat": runs that stopped moving short of the teacher (overlap constant to
    ``FLAT_TOL`` over the last half of the checkpoints, |m| < 0.999), "ode_blowup":
    {curve: [runs, first step]} of the theory curves that blew up}."""
    from sims.io.trajectory import blowups

    ok = ~traj.diverged
    ov = np.asarray(traj.overlap, dtype=float)
    flat = 0
    if ov.ndim == 2 and ov.shape[1] >= 3 and ok.any():
        tail = ov[ok][:, ov.shape[1] // 2:]
        finite = np.isfinite(tail).all(1)
        span = np.where(finite, np.ptp(np.where(np.isfinite(tail), tail, 0.0), axis=1), 0.0)
        flat = int(np.sum(finite & (span <= FLAT_TOL) & (np.abs(tail[:, -1]) < 0.999)))
    return {"left_sphere": int((~ok).sum()), "flat": flat,
            "ode_blowup": {k: list(v) for k, v in blowups(traj).items()}}


def health_text(traj, report: dict | None = None, sphere: bool = True) -> str:
    """'0 left the sphere, 0 went flat' for the summary line (left the sphere = diverged;
    ``sphere=False``: '0 diverged', for students that are not a point of a sphere)."""
    report = report or health(traj)
    gone = "left the sphere" if sphere else "diverged"
    return f"{report['left_sphere']} {gone}, {report['flat']} went flat"


def blowup_lines(report: dict) -> list[str]:
    """One warning line per theory curve that blew up."""
    names = {"ode": "population ODE", "ode_corrected": "noise-corrected ODE",
             "band_lower": "theory band", "band_upper": "theory band"}
    out, seen = [], set()
    for key, (runs, step) in report["ode_blowup"].items():
        name = names.get(key, key)
        if name in seen:
            continue
        seen.add(name)
        out.append(f"the {name} blew up in {runs} run(s) (first by step {step}); it reads NaN "
                   "from there (η is beyond its stability limit)")
    return out


def check_sweep(spec, out=None, *, batch: bool = True, max_batch_runs: int | None = None,
                force: bool = False) -> None:
    """Before a sweep computes: every batch's memory estimate (one line naming the cells
    whose batch does not fit), the sidecar folder of ``out`` is not a file, the files to
    write fit on its filesystem (:func:`check_sweep_space`), and with
    ``force`` a foreign file at ``out`` is removed (the caller checked it with
    :func:`sims.io.outputs.check_outputs`; a sweep file is resumed, never removed)."""
    from pathlib import Path

    from dynamics.engines.budget import MemoryBudgetError
    from sims.experiments.sweep_batch import MAX_BATCH_RUNS, plan_batches
    from sims.io.outputs import OutputError, hdf5_format
    from sims.io.sweep import cell_dir

    cells = spec.cells()
    for b in plan_batches(cells, batch, max_batch_runs or MAX_BATCH_RUNS):
        try:
            check_memory(b.config)
        except MemoryBudgetError as exc:
            names = ", ".join(c.name for c in b.cells[:3]) + (" …" if len(b.cells) > 3 else "")
            raise MemoryBudgetError(f"sweep cell(s) {names}: {exc}") from None
    if out is None:
        return
    out = Path(out)
    side = cell_dir(out)
    if side.exists() and not side.is_dir():
        raise OutputError(f"--out {out}: its cell folder {side} exists and is not a folder")
    check_sweep_space(cells, out)
    if force and out.is_file() and hdf5_format(out) != "loradyn-sweep":
        out.unlink()


@contextmanager
def memory_guard(runs_option: str = "--runs"):
    """Turn an allocation failure the estimate did not foresee (numpy's MemoryError, torch's
    allocator RuntimeError, CUDA out of memory) into one line instead of a traceback."""
    try:
        yield
    except MemoryError as exc:
        raise click.ClickException(f"out of memory ({str(exc).splitlines()[0] or 'MemoryError'}"
                                   f"); lower {runs_option}") from None
    except RuntimeError as exc:
        text = str(exc).splitlines()[0] if str(exc) else ""
        if "out of memory" in text.lower() or "can't allocate" in text.lower():
            raise click.ClickException(f"out of memory ({text}); lower {runs_option}") from None
        raise
