"""HDF5 trajectory files: one file per command, written atomically, read back with checks.

Schema (``docs/hdf5-schema.md``): root attributes stamp provenance (format, format version,
package version, git commit, creation time, the full resolved config as JSON, seed, dtype,
device, engine, learner, loss kind); datasets hold the checkpoint steps and per-run arrays
with the run axis first. A file is first written under a temporary name in the target's
directory and moved into place with ``os.replace`` only once complete, so an interrupted run
never leaves a file that looks complete and never destroys an existing good one.

Every array is stored chunked with a Fletcher-32 checksum (issue 16): a file whose bytes were
damaged inside a dataset fails to read with a one-line :class:`TrajectoryFileError` naming the
file and the dataset, instead of reading back wrong numbers. Files written before (contiguous,
no checksum) read as before. A theory curve that blew up (``hermite.flows.ode``: NaN after a finite
value, in runs that did not diverge there) carries the attributes ``blowup_runs`` and
``blowup_step`` (the first checkpoint step that is NaN). Every theory line that has an SGD
quantity to predict carries its audit against the SGD mean of the same runs
(:mod:`dynamics.overlays.audit`, issue 40): the attributes ``audit_*``
(:data:`dynamics.overlays.audit.ATTRS`),
read back into ``Trajectory.extra_attrs``.

An OS error while writing (no space, permission, read-only filesystem, quota, I/O error) is
one line naming the file, the temporary file removed (:mod:`sims.io.atomic`, issue 37).

A run stopped by SIGINT/SIGTERM (``loradyn run``, issue 26) is written the same way, complete
and checksummed, with its checkpoints up to the last one reached and the root attributes
``interrupted`` (True), ``interrupted_at_step`` (the step the engine stopped at; the config's
``steps`` is the horizon asked for) and ``interrupted_by`` (``SIGINT`` or ``SIGTERM``);
files of finished runs have none of the three.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import subprocess
from pathlib import Path

import h5py
import numpy as np

from dynamics.instances.instance import distinct_instances
from dynamics.overlays.audit import ATTRS as AUDIT_ATTRS
from dynamics.overlays.audit import audit_trajectory, mark_not_drawn
from dynamics.runtime.trajectory import Trajectory
from sims.io.atomic import hdf5_writer

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "DATASETS",
    "TrajectoryFileError",
    "write_trajectory",
    "trajectory_bytes",
    "read_trajectory",
    "check_writable",
    "git_commit",
    "package_version",
    "plain_attrs",
    "open_hdf5",
    "read_dataset",
    "filled",
    "create_checked",
    "blowups",
    "dataset_attrs",
    "CHECKSUM",
]

# ---------------------------------------------------------------- constants (one place)
FORMAT = "loradyn-trajectory"
FORMAT_VERSION = 1  # bump on incompatible schema changes; independent of the package version
COMPLETE_ATTR = "complete"  # written last
INTERRUPTED_ATTR = "interrupted"  # only on files of interrupted runs (module docstring)
CHECKSUM = True  # Fletcher-32 per chunk on every array (files before issue 16 have none)
FLOAT = np.float64
INT = np.int64
# name → (dtype, axes, description); c_overlap and m0 are optional
DATASETS = {
    "steps": (INT, "C", "checkpoint steps"),
    "overlap": (FLOAT, "R,C", "⟨û, u⟩ per run and checkpoint"),
    "loss": (FLOAT, "R,C", "population loss E(f* − f̂)² (see attribute loss_kind)"),
    "ode": (FLOAT, "R,C", "population-ODE prediction of ⟨û, u⟩ from the run's m0 (NaN: none)"),
    "c_overlap": (FLOAT, "R,C", "⟨ĉ, c⟩/(‖ĉ‖‖c‖) when ĉ is trained"),
    "diverged_step": (INT, "R", "first step with a non-finite state, −1 if never"),
    "xi": (FLOAT, "R", "scale ξ of each run's instance"),
    "instance_seed": (INT, "R", "seed of each run's instance"),
    "instance_index": (INT, "R", "index of each run's instance in config.resolved_instances"),
    "m0": (FLOAT, "R", "initial overlap ⟨û₀, u⟩"),
    "ode_corrected": (FLOAT, "R,C", "noise-corrected (finite-d) overlap map from the run's m0"),
    "band_lower": (FLOAT, "R,C", "10% quantile of the linear-noise theory band"),
    "band_upper": (FLOAT, "R,C", "90% quantile of the linear-noise theory band"),
}
OPTIONAL = ("c_overlap", "m0", "instance_index", "ode_corrected", "band_lower", "band_upper",
            "ode", "xi")  # ode: left out when no population ODE of ⟨û, u⟩ exists and nothing
# says why; xi: left out for a committee teacher (no ξ). Readers fill NaN and 0.0 (older files
# hold them).
STRING_ATTRS = ("format", "loradyn_version", "git_commit", "created", "config", "dtype",
                "device", "engine", "learner", "loss_kind")


class TrajectoryFileError(ValueError):
    """A trajectory file that cannot be read: missing, not HDF5, foreign or half-written."""


# ---------------------------------------------------------------- provenance
@functools.cache
def git_commit() -> str:
    """The source tree's git commit (``+dirty`` if modified), or ``unknown``; asked once per
    process (the code that runs is the code imported at its start)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "") if head else "unknown"


def package_version() -> str:
    from sims import __version__

    return __version__


def provenance(created: str | None = None) -> dict:
    """The root attributes every loradyn file stamps: ``loradyn_version``, ``git_commit`` and
    ``created`` (UTC, ISO 8601 to the second; ``created`` given: kept)."""
    return {"loradyn_version": package_version(), "git_commit": git_commit(),
            "created": created or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}


def config_json(config, instances) -> str:
    """The full resolved config as JSON, with each distinct resolved instance spec."""
    data = config.to_dict()
    data["resolved_instances"] = [inst.spec for inst in distinct_instances(instances)[0]]
    return json.dumps(data, sort_keys=True, default=_json_default)


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")




# ---------------------------------------------------------------- typed writers
def write_info(f: h5py.File, meta: dict) -> None:
    """Root attributes: format stamp and provenance (strings, ints)."""
    f.attrs["format"] = FORMAT
    f.attrs["format_version"] = FORMAT_VERSION
    for key, val in meta.items():
        f.attrs[key] = val


def create_checked(group, name: str, data) -> h5py.Dataset:
    """A dataset with a Fletcher-32 checksum per chunk (a corrupted chunk then fails to read,
    :func:`read_dataset`); empty and scalar data, which cannot be chunked, are stored plain."""
    data = np.asarray(data)
    checked = CHECKSUM and data.ndim >= 1 and data.size > 0 and data.dtype.kind in "biufc"
    return group.create_dataset(name, data=data, fletcher32=bool(checked))


def write_array(f: h5py.File, name: str, data) -> None:
    """One dataset of the schema, cast to its declared dtype, with its description."""
    dtype, axes, text = DATASETS[name]
    ds = create_checked(f, name, np.asarray(data, dtype=dtype))
    ds.attrs["axes"] = axes
    ds.attrs["description"] = text


def blowups(traj: Trajectory) -> dict:
    """Theory curves that blew up (``hermite.flows.ode``: NaN after a finite value) in runs that did
    not diverge there: name → (runs, first checkpoint step)."""
    from hermite.flows.ode import blowup_index

    out = {}
    for name in ("ode", "ode_corrected", "band_lower", "band_upper"):
        curve = getattr(traj, name, None)
        if curve is None or np.ndim(curve) != 2:
            continue
        idx = blowup_index(curve)
        hit = idx >= 0
        if not hit.any():
            continue
        at = traj.steps[np.where(hit, idx, 0)]
        ds = traj.diverged_step
        hit &= ~((ds >= 0) & (at >= ds))  # NaN because the run itself diverged: not the ODE
        if hit.any():
            out[name] = (int(hit.sum()), int(at[hit].min()))
    return out


def check_writable(path) -> Path:
    """Fail early (one-line OSError) if ``path`` cannot be created; returns it as a Path."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise IsADirectoryError(f"--out {path} is a directory, expected a .h5 file path")
    if parent.exists() and not parent.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {parent} is not a directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create directory {parent}: {exc.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write {path}: directory {parent} is not writable")
    return path


def trajectory_bytes(runs: int, checkpoints: int) -> int:
    """A lower bound on the size of a trajectory file: its (R, C) arrays that every file has
    (``overlap``, ``loss``), its per-run arrays and ``steps``, as float64/int64."""
    per_run = sum(axes == "R" and name not in OPTIONAL
                  for name, (_, axes, _) in DATASETS.items())
    return 8 * (2 * runs * checkpoints + per_run * runs + checkpoints)


def write_trajectory(path, traj: Trajectory, config, instances=None, *,
                     created: str | None = None, interrupted_at: int | None = None,
                     interrupted_by: str = "SIGINT", attrs: dict | None = None) -> Path:
    """Write one trajectory file atomically (:func:`sims.io.atomic.hdf5_writer`: temporary
    file + ``os.replace``; an OS error is one line naming ``path``).

    ``instances``: the runs' resolved instances; default: those the trajectory carries
    (``Trajectory.instances``, set by every engine), so nothing is rebuilt.
    ``interrupted_at``: the step an interrupted run stopped at (the file is then marked
    interrupted, module docstring); ``interrupted_by``: the signal's name. ``attrs``: more
    root attributes (a sweep cell's).
    """
    path = check_writable(path)
    if instances is None:
        instances = traj.instances
    if instances is None:
        raise ValueError("write_trajectory: the trajectory carries no instances; pass them")
    distinct, index = distinct_instances(instances)
    meta = provenance(created) | {
        "config": config_json(config, instances),
        "seed": int(config.seed),
        "dtype": traj.dtype, "device": traj.device, "engine": traj.engine,
        "learner": config.learner, "loss_kind": traj.loss_kind,
    }
    if interrupted_at is not None:
        meta |= {INTERRUPTED_ATTR: True, "interrupted_at_step": int(interrupted_at),
                 "interrupted_by": str(interrupted_by)}
    audits = audit_trajectory(traj)
    mark_not_drawn(traj, audits)  # the lines a figure leaves out (their ``not_drawn``)
    with hdf5_writer(path) as f:
        write_info(f, meta | (attrs or {}))
        for name in DATASETS:
            data = _dataset_value(traj, name, index, instances)
            if data is not None:
                write_array(f, name, data)
                for key, val in traj.extra_attrs.get(name, {}).items():
                    f[name].attrs[key] = val  # e.g. which ODE ``ode`` is (its note)
        for name, (runs, step) in blowups(traj).items():
            f[name].attrs["blowup_runs"] = runs
            f[name].attrs["blowup_step"] = step
        for name, arr in traj.extra.items():
            ds = create_checked(f, f"extra/{name}", arr)
            for key, val in getattr(traj, "extra_attrs", {}).get(name, {}).items():
                ds.attrs[key] = val
        for name, audit in audits.items():
            f[name].attrs.update(audit.attrs())
        f.attrs[COMPLETE_ATTR] = True
    return path


def _dataset_value(traj: Trajectory, name: str, index, instances):
    """The array stored as schema dataset ``name``; None where it holds no information:
    ``ode`` all NaN with no attribute saying why (no population ODE of ⟨û, u⟩ for this
    learner: its theory is in ``extra/``), ``xi`` of committee teachers (no ξ)."""
    if name == "instance_index":
        return index
    if name == "ode" and not traj.extra_attrs.get("ode") and \
            not np.isfinite(np.asarray(traj.ode, dtype=float)).any():
        return None
    if name == "xi" and all(getattr(inst, "committee", False) for inst in instances):
        return None
    return getattr(traj, name)


def filled(arrays: dict, steps, runs: int) -> dict:
    """``arrays`` (schema datasets read from a file or sweep cell) with ``ode`` (NaN) and
    ``xi`` (0.0) filled in where the writer left them out (:func:`_dataset_value`)."""
    shape = (runs, len(steps))
    return {"ode": np.full(shape, np.nan), "xi": np.zeros(runs)} | arrays


# ---------------------------------------------------------------- reader
def open_hdf5(path) -> h5py.File:
    """Open an HDF5 file read-only; TrajectoryFileError if missing, foreign or truncated."""
    path = Path(path)
    if not path.exists():
        raise TrajectoryFileError(f"no such file: {path}")
    if not h5py.is_hdf5(path):
        raise TrajectoryFileError(f"{path} is not an HDF5 file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        reason = str(exc).splitlines()[0]
        raise TrajectoryFileError(f"{path} is a truncated or half-written HDF5 file "
                                  f"({reason})") from None


def _check(f: h5py.File, path) -> None:
    fmt = f.attrs.get("format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode()
    if fmt != FORMAT:
        raise TrajectoryFileError(f"{path} is not a loradyn trajectory file "
                                  f"(format attribute {fmt!r}, expected {FORMAT!r})")
    version = int(f.attrs.get("format_version", -1))
    if version > FORMAT_VERSION:
        raise TrajectoryFileError(f"{path} has format version {version}; this loradyn reads "
                                  f"up to {FORMAT_VERSION} (upgrade loradyn)")
    if not f.attrs.get(COMPLETE_ATTR, False):
        raise TrajectoryFileError(f"{path} is a half-written trajectory file "
                                  "(no completion mark)")
    missing = [n for n in DATASETS if n not in OPTIONAL and n not in f]
    if missing:
        raise TrajectoryFileError(f"{path} lacks dataset '{missing[0]}' (damaged file)")


def read_dataset(path, group, name: str) -> np.ndarray:
    """``group[name][()]``; a failed read (a chunk whose Fletcher-32 checksum does not match,
    a damaged chunk index) is a one-line :class:`TrajectoryFileError` naming file and
    dataset."""
    try:
        return group[name][()]
    except (OSError, KeyError, ValueError) as exc:
        where = f"{group.name.rstrip('/')}/{name}".lstrip("/")
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "filter" in reason.lower() or "checksum" in reason.lower():
            reason = "checksum mismatch: the file is corrupted"
        raise TrajectoryFileError(f"{path}: cannot read dataset '{where}' ({reason})") from None


def plain_attrs(obj) -> dict:
    """HDF5 attributes of a file or group as plain Python values (bytes decoded)."""
    out = {}
    for key, val in obj.attrs.items():
        if isinstance(val, bytes):
            val = val.decode()
        elif isinstance(val, np.generic):
            val = val.item()
        out[key] = val
    return out


KEPT_ATTRS = ("note", "not_drawn", *AUDIT_ATTRS)  # of a schema dataset, read back into
# extra_attrs


def dataset_attrs(group) -> dict:
    """``Trajectory.extra_attrs`` of a file's (or sweep cell's) group: every attribute of each
    ``extra/`` dataset, a schema dataset's ``note`` and theory audit (``audit_*``)."""
    extra = group["extra"] if "extra" in group else {}
    out = {n: a for n in extra if (a := plain_attrs(extra[n]))}
    for name in DATASETS:
        if name in group:
            kept = {k: v for k, v in plain_attrs(group[name]).items() if k in KEPT_ATTRS}
            if kept:
                out[name] = kept
    return out


def _attrs(f: h5py.File) -> dict:
    out = plain_attrs(f)
    if "config" in out:
        out["config"] = json.loads(out["config"])
    return out


def read_trajectory(path) -> tuple[Trajectory, dict]:
    """(Trajectory, meta) from a file; :class:`TrajectoryFileError` with a one-line reason."""
    with open_hdf5(path) as f:
        _check(f, path)
        meta = _attrs(f)
        arrays = {n: read_dataset(path, f, n) for n in DATASETS if n in f}
        extra = ({n: read_dataset(path, f["extra"], n) for n in f["extra"]}
                 if "extra" in f else {})
        extra_attrs = dataset_attrs(f)
    meta["datasets"] = {n: list(a.shape) for n, a in arrays.items()}  # as stored
    arrays = filled(arrays, arrays["steps"], len(arrays["diverged_step"]))
    traj = Trajectory(
        steps=arrays["steps"], overlap=arrays["overlap"], loss=arrays["loss"],
        ode=arrays["ode"], diverged_step=arrays["diverged_step"], xi=arrays["xi"],
        instance_seed=arrays["instance_seed"], c_overlap=arrays.get("c_overlap"),
        loss_kind=meta.get("loss_kind", "exact"), dtype=meta.get("dtype", "float64"),
        device=meta.get("device", "cpu"), engine=meta.get("engine", "full"), extra=extra,
        m0=arrays.get("m0"), ode_corrected=arrays.get("ode_corrected"),
        band_lower=arrays.get("band_lower"), band_upper=arrays.get("band_upper"),
        extra_attrs=extra_attrs,
    )
    return traj, meta
