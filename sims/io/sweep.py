"""Sweep files on disk: one file per finished cell, and the combined sweep file.

Layout for ``--out results/x.h5``:

* ``results/x.h5.cells/<hash16>.h5`` — one finished cell, a regular trajectory file
  (:mod:`sims.io.trajectory`) plus the attributes ``sweep_cell_hash``, ``sweep_axes`` and
  ``sweep_batch``,
  written under a temporary name, fsynced and moved into place with ``os.replace``: a file
  with a final name is always complete.
* ``results/x.h5`` — the combined file, rebuilt from the cell files (temporary file +
  ``os.replace``) after every finished batch: root attributes (format ``loradyn-sweep``, the
  sweep spec, its dimensions, provenance, counts) and one group ``/cells/cell_0007`` per
  finished cell holding that cell's datasets and attributes plus ``cell_index``, ``hash``,
  ``axes`` (JSON).

Killing the writer at any moment leaves every finished cell intact (``kill -9`` included).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import h5py

from dynamics.runtime.trajectory import Trajectory
from sims.io.atomic import hdf5_writer
from sims.io.lock import output_lock
from sims.io.trajectory import (
    DATASETS,
    TrajectoryFileError,
    check_writable,
    dataset_attrs,
    filled,
    open_hdf5,
    plain_attrs,
    provenance,
    read_dataset,
    write_trajectory,
)

__all__ = [
    "SWEEP_FORMAT",
    "SWEEP_FORMAT_VERSION",
    "SweepCellData",
    "cell_dir",
    "cell_path",
    "sweep_lock",
    "write_cell",
    "finished_cells",
    "rebuild_sweep_file",
    "read_sweep",
    "file_format",
]

SWEEP_FORMAT = "loradyn-sweep"
SWEEP_FORMAT_VERSION = 1
CELL_SUFFIX = ".h5"
PARTIAL = ".partial.h5"  # temporary cell files of loradyn before issue 37


def cell_dir(out) -> Path:
    """The sidecar directory of finished cells next to the sweep file ``out``."""
    out = Path(out)
    return out.parent / f"{out.name}.cells"


def cell_path(out, digest: str) -> Path:
    return cell_dir(out) / f"{digest[:16]}{CELL_SUFFIX}"


@contextmanager
def sweep_lock(out):
    """Hold the lock of the sweep file ``out`` (:func:`sims.io.lock.output_lock`: one writer,
    a stale lock taken over, removed at exit); on entry, leftovers of a killed writer go."""
    folder = cell_dir(out)
    check_writable(folder / "x.h5")
    with output_lock(out):
        _clean(folder)
        yield


def _clean(folder: Path) -> None:
    """Remove temporary files left by a killed writer (only ours, by name)."""
    for p in folder.iterdir():
        if p.name.startswith(".") and (p.name.endswith(PARTIAL) or p.name.endswith(".tmp.h5")):
            p.unlink(missing_ok=True)
    stem = folder.name[: -len(".cells")]
    for p in folder.parent.glob(f".{stem}.*.tmp.h5"):
        p.unlink(missing_ok=True)


def write_cell(out, cell, traj: Trajectory, instances, batch_info: dict) -> Path:
    """Write one finished cell atomically into the sidecar directory; its final path."""
    attrs = {"sweep_cell_hash": cell.hash,
             "sweep_axes": json.dumps(cell.axes, default=str),
             "sweep_batch": json.dumps(batch_info)}
    return write_trajectory(cell_path(out, cell.hash), traj, cell.config, instances,
                            attrs=attrs)


def _cell_hash(path: Path) -> str | None:
    try:
        with h5py.File(path, "r") as f:
            val = f.attrs.get("sweep_cell_hash")
            complete = bool(f.attrs.get("complete", False))
    except OSError:
        return None
    if isinstance(val, bytes):
        val = val.decode()
    return val if complete else None


def finished_cells(out) -> dict[str, Path]:
    """Hash → path of every complete cell file in the sidecar directory."""
    folder = cell_dir(out)
    if not folder.is_dir():
        return {}
    found = {}
    for p in sorted(folder.glob(f"*{CELL_SUFFIX}")):
        if p.name.startswith("."):
            continue
        digest = _cell_hash(p)
        if digest is None:
            raise TrajectoryFileError(f"{p} is not a finished sweep cell (damaged?); move it "
                                      "away to recompute that cell")
        found[digest] = p
    return found


def rebuild_sweep_file(out, spec, cells, finished: dict[str, Path]) -> Path:
    """Write the combined sweep file from the finished cell files (atomic replace)."""
    out = check_writable(out)
    done = [c for c in cells if c.hash in finished]
    with hdf5_writer(out) as f:
        f.attrs["format"] = SWEEP_FORMAT
        f.attrs["format_version"] = SWEEP_FORMAT_VERSION
        f.attrs.update(provenance())
        f.attrs["sweep"] = json.dumps(spec.to_dict(), default=str)
        f.attrs["dimensions"] = json.dumps(spec.dimensions(), default=str)
        f.attrs["cell_dir"] = cell_dir(out).name
        f.attrs["n_cells"] = len(cells)
        f.attrs["n_finished"] = len(done)
        group = f.create_group("cells")
        for cell in done:
            with h5py.File(finished[cell.hash], "r") as src:
                group.copy(src, cell.name)
            g = group[cell.name]
            g.attrs["cell_index"] = cell.index
            g.attrs["hash"] = cell.hash
            g.attrs["axes"] = json.dumps(cell.axes, default=str)
        f.attrs["complete"] = len(done) == len(cells)
    return out


# ---------------------------------------------------------------- reading
@dataclass
class SweepCellData:
    """One cell read back: name, axis values, resolved config dict, Trajectory, attributes."""

    name: str
    axes: dict
    config: dict
    traj: Trajectory
    meta: dict


def file_format(path) -> str:
    """The ``format`` attribute of an HDF5 file (TrajectoryFileError if unreadable)."""
    with open_hdf5(path) as f:
        fmt = f.attrs.get("format", "")
    return fmt.decode() if isinstance(fmt, bytes) else str(fmt)


TRAJ_FIELDS = {f.name for f in fields(Trajectory)}


def _trajectory(g, meta: dict, path=None) -> Trajectory:
    """A Trajectory from a cell group (every schema dataset that is a Trajectory field; the
    datasets' kept attributes, their theory audits among them, in ``extra_attrs``)."""
    path = path or g.file.filename
    arrays = {n: read_dataset(path, g, n) for n in DATASETS if n in g and n in TRAJ_FIELDS}
    arrays = filled(arrays, arrays["steps"], len(arrays["diverged_step"]))
    extra = ({n: read_dataset(path, g["extra"], n) for n in g["extra"]}
             if "extra" in g else {})
    return Trajectory(**arrays, loss_kind=meta.get("loss_kind", "exact"),
                      dtype=meta.get("dtype", "float64"), device=meta.get("device", "cpu"),
                      engine=meta.get("engine", "full"), extra=extra,
                      extra_attrs=dataset_attrs(g))


def read_sweep(path) -> tuple[dict, list[SweepCellData]]:
    """(root attributes with ``sweep``/``dimensions`` parsed, finished cells in grid order)."""
    fmt = file_format(path)
    if fmt != SWEEP_FORMAT:
        raise TrajectoryFileError(f"{path} is not a loradyn sweep file (format {fmt!r})")
    with h5py.File(path, "r") as f:
        meta = plain_attrs(f)
        if int(meta.get("format_version", -1)) > SWEEP_FORMAT_VERSION:
            raise TrajectoryFileError(f"{path}: sweep format version "
                                      f"{meta['format_version']} is newer than this loradyn")
        for key in ("sweep", "dimensions"):
            meta[key] = json.loads(meta.get(key, "{}"))
        cells = []
        names = sorted(f["cells"], key=lambda n: int(f["cells"][n].attrs["cell_index"]))
        for name in names:
            g = f["cells"][name]
            cmeta = plain_attrs(g)
            config = json.loads(cmeta.pop("config"))
            axes = json.loads(cmeta.pop("axes"))
            cells.append(SweepCellData(name, axes, config, _trajectory(g, cmeta, path), cmeta))
    return meta, cells
