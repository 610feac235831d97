"""Output paths of every writing command, checked before any compute (issue 16).

Every command that writes (``run``, ``plot``, ``sweep``, ``scaling``, ``reproduce``) declares
its outputs and inputs and calls :func:`check_outputs` before it simulates anything. The checks
are, per output:

* **collisions**: no two outputs are the same file, and no output is an input (the spec file,
  a plotted file): ``--force`` does not lift these, since the input would be lost;
* **directory**: the path is not a directory (nor names one with a trailing ``/``), no
  existing part of its parent is a file, and the nearest existing folder is writable (missing
  folders are created when the file is written, not here);
* **format**: an HDF5 output needs an HDF5 name (``.h5``, ``.hdf5``, ``.hdf``, ``.he5``), a
  figure ``.png``, ``.pdf`` or ``.svg``;
* **existing files**, by policy: ``new`` (a ``run`` trajectory, a ``plot`` figure): refused
  unless ``--force``; ``sweep`` (resumable sweep files): an existing *sweep* file is resumed,
  anything else is refused unless ``--force``; ``derived`` (the figure a ``scaling`` or
  ``reproduce`` command draws from its sweep file): replaced when its data file exists already
  (the resumed case: the figure is that data's) or the command's own record names it
  (``Output.recorded``) and it is a figure of its own format, else
  refused unless ``--force``; ``edit`` (``reproduce``'s README, edited in place, its other
  sections kept): only has to be a writable file. A replaced file must be writable: a
  read-only one (no write permission bit, even for root) is refused even with ``--force``.

Where an output's size is known before the compute (a trajectory file: runs × checkpoints ×
datasets), :func:`check_free_space` refuses it when its filesystem has no room. While the
command runs, each output is locked against a second writer (:mod:`sims.io.lock`); a fault
while writing is one line too (:mod:`sims.io.atomic`).

Errors are :class:`OutputError` (a ValueError): one line that starts with the option, e.g.
``--out results/x.h5 exists (loradyn trajectory file); pass --force to replace it or choose
another path``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OutputError", "Output", "Input", "check_outputs", "check_free_space",
           "describe_file", "hdf5_format", "HDF5_SUFFIXES", "FIGURE_SUFFIXES", "POLICIES"]

HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")
FIGURE_SUFFIXES = (".png", ".pdf", ".svg")
KINDS = ("hdf5", "figure", "text")
POLICIES = ("new", "sweep", "derived", "edit")
_FIGURE_MAGIC = {".png": (b"\x89PNG\r\n\x1a\n",), ".pdf": (b"%PDF",),
                 ".svg": (b"<?xml", b"<svg")}


class OutputError(ValueError):
    """An output path that cannot or must not be written; the one-line message names the
    option."""


@dataclass(frozen=True)
class Output:
    """One file a command will write: its option (``--out``), path, kind and policy.

    kind : ``hdf5``, ``figure`` or ``text``. policy : see the module docstring. ``data``:
    for a ``derived`` figure, the data file it is drawn from. ``recorded``: a ``derived``
    figure the command's own record names as its earlier output (``reproduce``'s README
    section: a committed figure whose git-ignored data a fresh clone lacks), replaced as a
    resumed one is.
    """

    option: str
    path: Path | str
    kind: str = "hdf5"
    policy: str = "new"
    data: Path | str | None = None
    recorded: bool = False


@dataclass(frozen=True)
class Input:
    """One file a command reads (``SPEC``, ``FILES``): no output may be it."""

    option: str
    path: Path | str


def describe_file(path) -> str:
    """What an existing file is, in a few words: ``loradyn trajectory file``, ``loradyn sweep
    file``, ``HDF5 file``, ``PNG figure``, ``text file`` or ``file of N bytes``."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(512)
    except OSError as exc:
        return f"unreadable file ({exc.strerror})"
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        try:
            import h5py

            with h5py.File(path, "r") as f:
                fmt = f.attrs.get("format", "")
            fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
        except (OSError, ValueError):
            return "damaged HDF5 file"
        return {"loradyn-trajectory": "loradyn trajectory file",
                "loradyn-sweep": "loradyn sweep file"}.get(fmt, "HDF5 file")
    for suffix, magics in _FIGURE_MAGIC.items():
        if any(head.startswith(m) for m in magics) and (suffix != ".svg" or b"<svg" in head):
            return f"{suffix[1:].upper()} figure"
    if not head:
        return "empty file"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return f"file of {path.stat().st_size} bytes"
    return "text file"


def hdf5_format(path) -> str | None:
    """The ``format`` attribute of an HDF5 file ('' if none), None if it is not HDF5."""
    path = Path(path)
    try:
        import h5py

        if not h5py.is_hdf5(path):
            return None
        with h5py.File(path, "r") as f:
            fmt = f.attrs.get("format", "")
    except (OSError, ValueError):
        return None
    return fmt.decode() if isinstance(fmt, bytes) else str(fmt)


def _is_figure(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(512)
    except OSError:
        return False
    suffix = path.suffix.lower()
    return any(head.startswith(m) for m in _FIGURE_MAGIC.get(suffix, ())) and (
        suffix != ".svg" or b"<svg" in head)


def _real(path: Path) -> str:
    return os.path.normcase(os.path.realpath(path))


def _same(a: Path, b: Path) -> bool:
    if _real(a) == _real(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_format(out: Output, path: Path) -> None:
    suffix = path.suffix.lower()
    if out.kind == "hdf5" and suffix not in HDF5_SUFFIXES:
        raise OutputError(f"{out.option} {path}: an HDF5 output needs a .h5 (or .hdf5) name"
                          + (f", not {suffix}" if suffix else ""))
    if out.kind == "figure" and suffix not in FIGURE_SUFFIXES:
        raise OutputError(f"{out.option} {path}: the extension must be .png, .pdf or .svg"
                          + (f", not {suffix}" if suffix else ""))


def _nearest(path: Path, option: str) -> Path:
    """The nearest existing ancestor of ``path`` (its folder if that exists)."""
    probe = path.parent if str(path.parent) else Path(".")
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: creating the folder would fail
            raise OutputError(f"{option} {path}: {probe} is a broken link")
        if probe.parent == probe:
            break
        probe = probe.parent
    return probe


def _check_place(out: Output, path: Path, raw: str) -> None:
    """Not a directory; parents are folders (or missing); the nearest folder is writable."""
    if path.is_dir() or raw.endswith(("/", os.sep)):
        raise OutputError(f"{out.option} {raw} is a directory, expected a file path")
    probe = _nearest(path, out.option)
    if probe.exists() and not probe.is_dir():
        raise OutputError(f"{out.option} {path}: cannot write, {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{out.option} {path}: cannot write, directory {probe} is not "
                          "writable")


def _check_existing(out: Output, path: Path, force: bool) -> None:
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_file():
        raise OutputError(f"{out.option} {path} exists and is not a regular file")
    what = describe_file(path)
    if out.policy == "edit":
        if not (os.access(path, os.R_OK | os.W_OK) and path.stat().st_mode & 0o222):
            raise OutputError(f"{out.option} {path} is not writable")
        return
    replace = force
    if out.policy == "sweep":
        fmt = hdf5_format(path)
        if fmt == "loradyn-sweep":
            replace = True  # resumed, not replaced
        elif not force:
            raise OutputError(
                f"{out.option} {path} exists and is not a loradyn sweep file "
                f"({fmt or 'not a readable HDF5 file'}); pass --force to replace it or "
                "choose another path")
    elif out.policy == "derived":
        data = Path(out.data) if out.data is not None else None
        resumed = data is not None and data.exists() and hdf5_format(data) == "loradyn-sweep"
        if (resumed or out.recorded) and _is_figure(path):
            replace = True
        elif not force:
            raise OutputError(f"{out.option} {path} exists ({what}) and is not the figure of "
                              "an existing sweep file; pass --force to replace it or choose "
                              "another path")
    elif not force:
        raise OutputError(f"{out.option} {path} exists ({what}); pass --force to replace it "
                          "or choose another path")
    if replace and not (os.access(path, os.W_OK) and path.stat().st_mode & 0o222):
        raise OutputError(f"{out.option} {path} exists and is read-only; make it writable "
                          "or choose another path")


def check_free_space(option: str, path, need: int) -> None:
    """Refuse (one-line OutputError) an output of at least ``need`` bytes that the filesystem
    of its folder (``shutil.disk_usage`` of the nearest existing one) has no room for."""
    path = Path(path)
    folder = _nearest(path, option)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # the write itself will say what is wrong
    if need > free:
        from dynamics.engines.budget import format_bytes

        raise OutputError(f"{option} {path} needs at least {format_bytes(need)}, only "
                          f"{format_bytes(free)} free on {folder}; free some space or choose "
                          "another path")


def check_outputs(outputs, inputs=(), *, force: bool = False) -> list[Path]:
    """Check every output (see the module docstring); their paths, in order.

    ``outputs``: :class:`Output` items (None entries are skipped and give None);
    ``inputs``: :class:`Input` items. Raises :class:`OutputError` naming the option.
    """
    inputs = [i for i in inputs if i is not None and i.path is not None]
    items = []
    for out in outputs:  # pass 1: collisions, whatever else is wrong with a path
        if out is None or out.path is None:
            items.append(None)
            continue
        if out.kind not in KINDS or out.policy not in POLICIES:
            raise ValueError(f"output {out.option}: unknown kind/policy {out.kind}/{out.policy}")
        path = Path(str(out.path)).expanduser()
        for inp in inputs:
            if _same(path, Path(inp.path)):
                raise OutputError(f"{out.option} {path} is the input {inp.option}; choose "
                                  "another path (it would be lost)")
        for item in items:
            if item is not None and _same(path, item[1]):
                raise OutputError(f"{item[0].option} and {out.option} are the same file "
                                  f"{path}; give them different paths")
        items.append((out, path))
    for item in items:  # pass 2: each path on its own
        if item is not None:
            out, path = item
            _check_place(out, path, str(out.path))
            _check_format(out, path)
            _check_existing(out, path, force)
    return [None if item is None else item[1] for item in items]
