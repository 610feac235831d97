"""``loradyn show FILE.h5``: what a trajectory file or a sweep file holds (provenance, config,
summary; for a sweep: its axes, how many of its cells are finished, one line per cell). A run
stopped by SIGINT/SIGTERM says so: ``interrupted   at step 12000 of 50000 (checkpoints up to
step 10000)``.

The summary gives the statistics the figures draw, each named (issue 38): the median final
|⟨û, u⟩| (what ``loradyn reproduce`` and ``loradyn plot --quantity abs_overlap`` draw; runs
that end near −u count as recovered) beside the signed median ⟨û, u⟩ (``loradyn run --plot``,
``loradyn plot``'s default); a from-scratch learner's overlap is its alignment, ≥ 0. A dataset
that holds nothing (all NaN: no population ODE of ⟨û, u⟩ for this learner) or a placeholder
(``xi`` of a committee teacher, which has no ξ) is marked as such.

An unfinished run (issue 37.3): ``loradyn show OUT.resume``, or ``loradyn show OUT`` where
only the resume file exists (a run killed before it wrote OUT), describes it — steps reached
of the total, checkpoints recorded, runs, engine, config and the command that continues it;
on a trajectory file whose resume file is there too (a run stopped by a signal), one more
line names it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
import h5py
import numpy as np

from dynamics.learners.options import all_options
from sims.commands.run import summary_json
from sims.io.resume import describe_resume, is_resume_file, resume_path
from sims.io.sweep import SWEEP_FORMAT, file_format, read_sweep
from sims.io.trajectory import FORMAT as TRAJECTORY_FORMAT
from sims.io.trajectory import open_hdf5, plain_attrs, read_trajectory

__all__ = ["show", "describe", "describe_sweep", "describe_unfinished"]

HEADER = ("format", "format_version", "loradyn_version", "git_commit", "created", "engine",
          "learner", "dtype", "device", "loss_kind", "seed")


def describe(path) -> dict:
    """Provenance, config, dataset shapes and summary of a trajectory file."""
    traj, meta = read_trajectory(path)
    out = {key: meta.get(key) for key in HEADER}
    out["config"] = meta.get("config")
    out["datasets"] = meta["datasets"]
    out["extra"] = {name: list(np.shape(a)) for name, a in traj.extra.items()}
    with h5py.File(path, "r") as f:
        given = dict(f["extra/alignment"].attrs) if "extra/alignment" in f else {}
        why = f["ode"].attrs.get("no_theory") if "ode" in f else None
    if "init_rows_sha256" in given:
        out["init_rows"] = {k: _plain(given[k]) for k in ("init_rows", "init_rows_sha256",
                                                          "init_rows_shape", "init_frame")}
    out["interrupted"] = _interruption(meta, traj)
    out["summary"] = summary(traj)
    marks = placeholders(traj, meta.get("config") or {},
                         why.decode() if isinstance(why, bytes) else why)
    out["placeholders"] = {n: w for n, w in marks.items() if n in out["datasets"]}  # older
    # files store them; the writer now leaves both out (sims.io.trajectory._dataset_value)
    return out


def summary(traj) -> dict:
    """``Trajectory.summary()`` (signed ⟨û, u⟩) plus the same of |⟨û, u⟩| (what the
    reproduce figures draw): ``median_final_abs_overlap``, ``fraction_abs_past_0.9``,
    ``median_steps_to_abs_0.5`` (a run that never reached 0.5 counting as later than all, as
    in the run's own summary: NaN where half or more never did) and
    ``fraction_reached_abs_0.5``."""
    out = traj.summary()
    ok = ~traj.diverged
    final = np.abs(np.asarray(traj.overlap, float)[ok, -1])
    hit = np.abs(np.asarray(traj.overlap, float)[ok]) >= 0.5
    steps = np.where(hit.any(axis=1), np.asarray(traj.steps)[np.argmax(hit, axis=1)], np.inf)
    median = float(np.median(steps)) if steps.size else math.inf
    out["median_final_abs_overlap"] = float(np.median(final)) if final.size else math.nan
    out["fraction_abs_past_0.9"] = float(np.mean(final >= 0.9)) if final.size else 0.0
    out["median_steps_to_abs_0.5"] = median if math.isfinite(median) else math.nan
    out["fraction_reached_abs_0.5"] = float(np.mean(hit.any(axis=1))) if steps.size else 0.0
    return out


def placeholders(traj, config: dict, why: str | None = None) -> dict:
    """Dataset name → why it holds no information: ``ode`` all NaN (no population ODE of
    ⟨û, u⟩ recorded; ``why``: the file's reason, its ``no_theory`` attribute), ``xi`` of a
    committee teacher (no ξ: the value is a placeholder)."""
    out = {}
    if not np.isfinite(np.asarray(traj.ode, dtype=float)).any():
        out["ode"] = "all NaN: " + (why or ("no population ODE of ⟨û, u⟩ is recorded for this "
                                            "run" + (" (its theory is extra/ode_loss, "
                                                     "extra/ode_alignment)"
                                                     if "ode_alignment" in traj.extra else "")))
    if (config.get("instance") or {}).get("teacher") == "committee":
        out["xi"] = "a placeholder: a committee teacher has no ξ"
    return out


def _interruption(meta: dict, traj) -> dict | None:
    """{"at_step", "of_steps", "last_checkpoint", "signal"} of an interrupted run's file
    (``sims.io.trajectory``), None for a finished run."""
    if not meta.get("interrupted", False):
        return None
    return {"at_step": meta.get("interrupted_at_step"),
            "of_steps": (meta.get("config") or {}).get("steps"),
            "last_checkpoint": int(traj.steps[-1]) if np.size(traj.steps) else None,
            "signal": meta.get("interrupted_by")}


def _plain(value):
    """An HDF5 attribute as a JSON-ready value."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def _brief(value, most: int = 16):
    """A spec value for one line: arrays of more than ``most`` numbers as their shape."""
    arr = np.asarray(value, dtype=object)
    if isinstance(value, list) and arr.size > most:
        return f"<{'×'.join(map(str, arr.shape))} array>"
    return value


SWEEP_HEADER = ("format", "format_version", "loradyn_version", "git_commit", "created")


def describe_sweep(path) -> dict:
    """Provenance, axes, completeness and one entry per finished cell of a sweep file."""
    meta, cells = read_sweep(path)
    sweep = meta.get("sweep") or {}
    total = int(meta.get("n_cells", len(cells)))
    out = {key: meta.get(key) for key in SWEEP_HEADER}
    out.update(name=sweep.get("name"), axes=meta.get("dimensions") or {}, cells=total,
               finished=len(cells), missing=total - len(cells),
               complete=bool(meta.get("complete", False)), cell_dir=meta.get("cell_dir"),
               first_passage=sweep.get("first_passage") or [],
               trajectory=sweep.get("trajectory", True),
               first_passage_of=sweep.get("first_passage_of", "overlap"))
    with h5py.File(path, "r") as f:
        if "scaling" in f:
            fits = f["scaling"].attrs.get("fits")
            out["scaling"] = json.loads(fits) if fits else {}
    out["cell_list"] = [{
        "name": c.name, "index": int(c.meta.get("cell_index", -1)), "axes": c.axes,
        "learner": c.config.get("learner"), "engine": c.meta.get("engine"),
        "runs": int(c.traj.runs), "steps": int(c.traj.steps[-1]),
        "network": "alignment" in c.traj.extra, "summary": summary(c.traj)} for c in cells]
    return out


def _final(s: dict, network: bool) -> str:
    """The median final overlap, named: |⟨û,u⟩| and the signed one (a from-scratch learner:
    its alignment), and the median steps to 0.5 of the same."""
    t05 = s["median_steps_to_abs_0.5"]
    reach = (f"{t05:.0f}" if t05 == t05 else "not reached "
             f"({s.get('fraction_reached_abs_0.5', 0.0):.0%} of the runs did)")
    if network:
        return (f"median final alignment {s['median_final_overlap']:.4g}, median steps to "
                f"alignment 0.5 {reach}")
    return (f"median final |⟨û,u⟩| {s['median_final_abs_overlap']:.4g} (signed ⟨û,u⟩ "
            f"{s['median_final_overlap']:.4g}), median steps to |⟨û,u⟩| = 0.5 {reach}")


def _show_sweep(file, as_json) -> None:
    info = describe_sweep(file)
    if as_json:
        click.echo(json.dumps(info, default=str))
        return
    for key in SWEEP_HEADER:
        click.echo(f"{key:16s} {info[key]}")
    click.echo(f"{'sweep':16s} {info['name']}")
    axes = "; ".join(f"{k} = {v}" for k, v in info["axes"].items()) or "(none)"
    click.echo(f"{'axes':16s} {axes}")
    state = ("complete" if info["complete"] else
             f"incomplete: {info['missing']} to run (rerun loradyn sweep on its spec to resume)")
    click.echo(f"{'cells':16s} {info['finished']} of {info['cells']} finished ({state}); "
               f"cell files in {info['cell_dir']}/")
    if "scaling" in info:
        click.echo(f"{'scaling':16s} " + json.dumps(info["scaling"], default=str))
    for cell in info["cell_list"]:
        s = cell["summary"]
        axes = " ".join(f"{k}={v}" for k, v in cell["axes"].items())
        click.echo(f"{cell['name']:16s} {axes}  {cell['learner']}/{cell['engine']}, "
                   f"runs {cell['runs']} ({s['diverged']} diverged), steps {cell['steps']}, "
                   + _final(s, cell["network"]))


def describe_separation(path) -> dict:
    """Header and, per learner, d, censored median steps, fraction never arriving and the
    power-law fit of a ``reproduce separation`` file."""
    from sims.experiments.separation import read_separation

    with open_hdf5(path) as f:
        meta = plain_attrs(f)
    result = read_separation(path)
    series = {name: {"d": [int(x) for x in s.d], "median_steps": [float(x) for x in s.median],
                     "never": [float(x) for x in s.never], "fit": s.fit}
              for name, s in result.series.items()}
    return {key: meta.get(key) for key in SWEEP_HEADER + ("runs", "seed", "complete")} | {
        "settings": json.loads(meta.get("config") or "{}"), "series": series}


def _separation_format() -> str:
    from sims.experiments.separation import FORMAT

    return FORMAT


def _show_separation(file, as_json) -> None:
    from sims.experiments.separation import read_separation, summary_lines

    info = describe_separation(file)
    if as_json:
        click.echo(json.dumps(info, default=_plain))
        return
    for key in SWEEP_HEADER + ("runs", "seed", "complete"):
        click.echo(f"{key:16s} {info[key]}")
    for line in summary_lines(read_separation(file)):
        click.echo(line)


def _pretraining_format() -> str:
    from sims.experiments.pretraining_hurts import FORMAT

    return FORMAT


def _show_pretraining(file, as_json) -> None:
    """A ``reproduce pretraining-hurts`` file: its provenance and the table of its points."""
    from sims.experiments.pretraining_hurts import (
        TABLE_HEAD,
        read_hurts,
        summary_lines,
        table_rows,
    )

    with open_hdf5(file) as f:
        meta = plain_attrs(f)
    keys = SWEEP_HEADER + ("runs", "seed", "complete", "published_source")
    result = read_hurts(file)
    if as_json:
        click.echo(json.dumps({key: meta.get(key) for key in keys} | {
            "settings": json.loads(meta.get("config") or "{}"),
            "table": [dict(zip(TABLE_HEAD, row, strict=True)) for row in table_rows(result)]},
            default=_plain, ensure_ascii=False))
        return
    for key in keys:
        click.echo(f"{key:16s} {meta.get(key)}")
    for line in summary_lines(result):
        click.echo(line)


def describe_unfinished(path) -> dict:
    """What a resume file says of its unfinished run (:func:`sims.io.resume.describe_resume`)
    plus its progress as a fraction."""
    info = describe_resume(path)
    info["fraction"] = info["step"] / info["total"] if info["total"] else 0.0
    return info


def _config_lines(cfg: dict) -> None:
    spec = {k: _brief(v) for k, v in cfg.get("instance", {}).items()}
    click.echo(f"{'instance':16s} {json.dumps(spec, sort_keys=True, ensure_ascii=False)}")
    keys = ("eta", "steps", "runs", "batch", "label_noise", "xi_values", "instance_seeds")
    click.echo(f"{'run':16s} " + ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg))
    own = [k for k in all_options() if k in cfg]
    if own:
        click.echo(f"{'options':16s} " + ", ".join(f"{k}={cfg[k]}" for k in own))


def _show_unfinished(path, as_json) -> None:
    info = describe_unfinished(path)
    if as_json:
        click.echo(json.dumps(info, default=str))
        return
    for key in ("format", "loradyn_version", "git_commit", "created"):
        click.echo(f"{key:16s} {info[key]}")
    cfg = info["config"] or {}
    click.echo(f"{'unfinished':16s} step {info['step']} of {info['total']} "
               f"({100 * info['fraction']:.1f}%), checkpoints {info['reached']} of "
               f"{info['checkpoints']} recorded, {info['runs']} runs")
    click.echo(f"{'engine':16s} {info['engine']} ({info['kind']})")
    click.echo(f"{'learner':16s} {cfg.get('learner')}")
    click.echo(f"{'output':16s} {info['out']} (not written yet, or an interrupted run's)")
    _config_lines(cfg)
    resume = info["command"] or "the command that started it, plus --resume"
    click.echo(f"{'resume with':16s} {resume}")


@click.command("show")
@click.argument("file")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
def show(file, as_json):
    """Describe FILE: a trajectory file (`loradyn run`), a sweep file (`loradyn sweep`,
    `scaling`, `reproduce`) or a separation file (`reproduce separation`).

    Also an unfinished run: its resume file OUT.resume, or OUT while only its resume file
    exists (steps reached of the total, runs, config, the command that continues it)."""
    saved = resume_path(file)
    if is_resume_file(file) or (not Path(file).exists() and saved.exists()):
        _show_unfinished(file if is_resume_file(file) else saved, as_json)
        return
    fmt = file_format(file)
    if fmt == SWEEP_FORMAT:
        _show_sweep(file, as_json)
        return
    if fmt != TRAJECTORY_FORMAT and fmt == _separation_format():
        _show_separation(file, as_json)
        return
    if fmt != TRAJECTORY_FORMAT and fmt == _pretraining_format():
        _show_pretraining(file, as_json)
        return
    info = describe(file)
    unfinished = describe_unfinished(saved) if is_resume_file(saved) else None
    if as_json:
        traj, _ = read_trajectory(file)
        info["curve"] = summary_json(traj)
        info["resume_file"] = unfinished
        click.echo(json.dumps(info, default=str))
        return
    for key in HEADER:
        click.echo(f"{key:16s} {info[key]}")
    if info.get("interrupted"):
        stop = info["interrupted"]
        click.echo(f"{'interrupted':16s} at step {stop['at_step']} of {stop['of_steps']} "
                   f"(checkpoints up to step {stop['last_checkpoint']}; {stop['signal']})")
    if unfinished is not None:
        click.echo(f"{'resume file':16s} {saved}: step {unfinished['step']} of "
                   f"{unfinished['total']}; the same command with --resume continues it")
    _config_lines(info["config"] or {})
    for name, shape in info["datasets"].items():
        why = info["placeholders"].get(name)
        click.echo(f"{'dataset':16s} {name} {tuple(shape)}" + (f" ({why})" if why else ""))
    for name, shape in info["extra"].items():
        click.echo(f"{'dataset':16s} extra/{name} {tuple(shape)}")
    if info.get("init_rows"):
        g = info["init_rows"]
        click.echo(f"{'init_rows':16s} {g['init_rows']} (shape {tuple(g['init_rows_shape'])}, "
                   f"{g['init_frame']} frame, sha256 {g['init_rows_sha256']})")
    s = info["summary"]
    click.echo(f"{'summary':16s} " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                                f"{k}={v}" for k, v in s.items()))
    click.echo(f"{'final':16s} " + _final(s, "alignment" in info["extra"]))
