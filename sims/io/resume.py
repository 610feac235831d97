"""Resume files of ``loradyn run`` (issue 37.3): the durable state of an unfinished run.

Beside its output ``OUT`` (``results/x.h5``), a run keeps ``OUT.resume`` (``results/x.h5.resume``):
an HDF5 file written atomically and fsynced (:func:`sims.io.atomic.hdf5_writer`) every few
minutes of wall time (:class:`dynamics.runtime.resume.Checkpointer`) and when a signal stops the
run; removed when the run finishes. ``loradyn run … --resume`` (the same command plus the flag)
continues from it to the numbers of an uninterrupted run.

Format (``format`` = ``loradyn-resume``, ``format_version`` 1; docs/hdf5-schema.md):
root attributes ``loradyn_version``, ``git_commit``, ``created``, ``config`` (the resolved
config as JSON, exactly as the trajectory file will hold it), ``fingerprint`` (JSON: the
sha256 of that config and of each input file the config only names, e.g. ``init_rows``),
``engine``, ``kind`` (the state layout: ``full/<learner>``, ``reduced/<chain>/<backend>``),
``step`` of ``total`` steps, ``reached`` of ``checkpoints`` checkpoints recorded, ``runs``,
``out`` (the output it belongs to), ``command`` (the command line, where known), ``values``
(JSON) and ``complete`` (written last); the group ``state`` holds the engine's arrays
(:class:`dynamics.runtime.resume.RunState`: learner or chain state, the random streams' state,
divergence, records so far), each with a Fletcher-32 checksum.

:func:`load_resume` reads one back for ``--resume`` and checks it against the command: a
missing file, one of another format, or one whose config, fingerprint or engine differs from
the command's is one :class:`ResumeFileError` line naming the difference; nothing is changed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np

from dynamics.runtime.resume import ResumeError, RunState
from sims.io.atomic import hdf5_writer
from sims.io.trajectory import (
    TrajectoryFileError,
    config_json,
    create_checked,
    open_hdf5,
    plain_attrs,
    provenance,
    read_dataset,
)

__all__ = ["FORMAT", "FORMAT_VERSION", "SUFFIX", "ResumeFileError", "resume_path",
           "is_resume_file", "fingerprint", "write_resume", "read_resume", "load_resume",
           "describe_resume", "config_difference"]

FORMAT = "loradyn-resume"
FORMAT_VERSION = 1
SUFFIX = ".resume"
_HEADER = ("engine", "kind", "step", "total", "reached", "checkpoints", "runs")




class ResumeFileError(ResumeError):
    """A resume file that is missing, unreadable or of another command (one line)."""


def resume_path(out) -> Path:
    """The resume file of the output ``out``: ``OUT.resume`` beside it."""
    out = Path(out)
    return out.with_name(out.name + SUFFIX)


def is_resume_file(path) -> bool:
    """Whether ``path`` is an HDF5 file stamped ``loradyn-resume``."""
    try:
        with open_hdf5(path) as f:
            fmt = f.attrs.get("format", "")
    except TrajectoryFileError:
        return False
    return (fmt.decode() if isinstance(fmt, bytes) else str(fmt)) == FORMAT


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(config, instances) -> tuple[str, dict]:
    """(the config as the trajectory file will hold it (JSON), the fingerprint of the
    command's inputs: the sha256 of that config and of every file the config names only by
    its path (the ``init_rows`` of the network learners))."""
    text = config_json(config, instances)
    out = {"config": _sha256(text.encode())}
    rows = getattr(config.options, "init_rows", None)
    if rows:
        from dynamics.learners.given_rows import given_rows

        out["init_rows"] = given_rows(str(rows)).sha256
    return text, out


def write_resume(path, state: RunState, *, config: str, fingerprint: dict, out,
                 command: str | None = None) -> None:
    """Write ``state`` to the resume file ``path`` (atomically, fsynced; module docstring)."""
    with hdf5_writer(path) as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs.update(provenance())
        f.attrs["config"] = config
        f.attrs["fingerprint"] = json.dumps(fingerprint, sort_keys=True)
        for key in _HEADER:
            f.attrs[key] = getattr(state, key)
        f.attrs["out"] = str(out)
        f.attrs["command"] = command or ""
        f.attrs["values"] = json.dumps(state.values, sort_keys=True, default=_plain)
        group = f.create_group("state")
        for name, value in sorted(state.arrays.items()):
            create_checked(group, name, np.asarray(value))
        f.attrs["complete"] = True


def _plain(value):
    """numpy scalars and arrays as JSON values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def _meta(f, path) -> dict:
    meta = plain_attrs(f)
    if meta.get("format") != FORMAT:
        raise ResumeFileError(f"{path} is not a loradyn resume file (format attribute "
                              f"{meta.get('format')!r}, expected {FORMAT!r})")
    if int(meta.get("format_version", -1)) > FORMAT_VERSION:
        raise ResumeFileError(f"{path} has format version {meta['format_version']}; this "
                              f"loradyn reads up to {FORMAT_VERSION} (upgrade loradyn)")
    if not meta.get("complete", False):
        raise ResumeFileError(f"{path} is a half-written resume file (no completion mark)")
    return meta


def read_resume(path, arrays: bool = True) -> tuple[RunState, dict]:
    """(the saved :class:`RunState`, the root attributes) of the resume file ``path``;
    ``arrays=False`` reads the header only (``loradyn show``). ResumeFileError (one line)
    if it is missing, foreign, half-written or damaged."""
    try:
        with open_hdf5(path) as f:
            meta = _meta(f, path)
            data = {}
            if arrays and "state" in f:
                names = []
                f["state"].visititems(lambda n, obj: names.append(n)
                                      if isinstance(obj, h5py.Dataset) else None)
                data = {n: read_dataset(path, f["state"], n) for n in names}
    except TrajectoryFileError as exc:
        raise ResumeFileError(str(exc).replace("trajectory file", "resume file")) from None
    state = RunState(engine=str(meta["engine"]), kind=str(meta["kind"]),
                     step=int(meta["step"]), total=int(meta["total"]),
                     reached=int(meta["reached"]), checkpoints=int(meta["checkpoints"]),
                     runs=int(meta["runs"]), arrays=data,
                     values=json.loads(meta.get("values") or "{}"))
    return state, meta


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def config_difference(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """The keys whose values differ between two config dicts, as ``key saved ≠ now`` (one
    level into nested dicts: ``instance.d 200 ≠ 400``)."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "(none)"), now.get(key, "(none)")
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and not prefix:
            out += config_difference(a, b, f"{key}.")
        elif key == "resolved_instances":
            out.append("resolved_instances differ")
        else:
            out.append(f"{prefix}{key} {_short(a)} ≠ {_short(b)}")
    return out


def load_resume(path, *, config: str, fingerprint: dict, engine: str) -> RunState:
    """The saved state of the resume file ``path`` if it continues this command: its config
    (JSON), fingerprint and engine the command's; else ResumeFileError naming the first
    difference (module docstring)."""
    path = Path(path)
    if not path.exists():
        raise ResumeFileError(f"--resume: no resume file {path} (the run finished, never "
                              "saved its state, or another --out was given); run the command "
                              "without --resume")
    state, meta = read_resume(path)
    head = f"--resume: {path} is not this command's run"
    saved_fp = json.loads(meta.get("fingerprint") or "{}")
    if meta.get("config") != config:
        diff = config_difference(json.loads(meta.get("config") or "{}"), json.loads(config))
        raise ResumeFileError(f"{head}: config differs ({'; '.join(diff[:3]) or 'in order'}; "
                              "the file's value first)")
    for key in sorted(set(saved_fp) | set(fingerprint)):
        if saved_fp.get(key) != fingerprint.get(key):
            what = "the config" if key == "config" else f"the {key} file"
            raise ResumeFileError(f"{head}: {what} changed since it was saved (sha256 "
                                  f"{str(saved_fp.get(key))[:12]} ≠ "
                                  f"{str(fingerprint.get(key))[:12]})")
    if state.engine != engine:
        raise ResumeFileError(f"{head}: it ran the {state.engine} engine, this command takes "
                              f"the {engine} engine")
    return state


def describe_resume(path) -> dict:
    """What ``loradyn show`` says of a resume file: its header (steps reached of the total,
    checkpoints, runs, engine, provenance), the config and how to go on."""
    state, meta = read_resume(path, arrays=False)
    out = {key: meta.get(key) for key in ("format", "format_version", "loradyn_version",
                                          "git_commit", "created")}
    out.update(engine=state.engine, kind=state.kind, step=state.step, total=state.total,
               reached=state.reached, checkpoints=state.checkpoints, runs=state.runs,
               out=meta.get("out"), command=meta.get("command") or None,
               config=json.loads(meta.get("config") or "{}"), resume_file=str(path))
    return out
