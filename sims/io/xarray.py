"""Trajectory and sweep files as xarray Datasets and tidy pandas DataFrames.

Needs the optional extra ``analysis`` (``pip install -e ".[analysis]"``: xarray and pandas);
both are imported when a function runs, so this module imports without them.

:func:`to_dataset` of a trajectory file (``loradyn run``) gives

* dimensions ``run`` (R) and ``checkpoint`` (C), and the trailing axes of learner extras:
  ``r`` and ``r_student`` (rank r: singular values, M = UᵀÛ), ``k`` (Ĉ's rows), ``width``
  (a trained second layer of width k′); any other trailing axis is ``<name>_dim<i>``;
* coordinates ``steps`` (along ``checkpoint``, indexed: ``ds.sel(steps=1000)``), and per run
  ``xi``, ``instance_seed``, ``instance_index``;
* data variables: every dataset of the file (``overlap``, ``loss``, ``ode``, ``c_overlap``,
  the theory band, ``m0``, ``diverged_step``) and every ``extra/<name>`` as ``<name>``, each
  with its ``description``;
* attributes: the file's root attributes, ``config`` being the resolved RunConfig as a JSON
  string (``json.loads(ds.attrs["config"])``).

A sweep file (``loradyn sweep``, ``loradyn scaling``) gives one Dataset whose leading
dimensions are the swept axes (the file's ``dimensions``, in order; ``[[cases]]`` as ``case``),
followed by ``run``, ``checkpoint`` and trailing axes as above. Cells not finished yet are
NaN (``finished`` says which). Cells that differ in R or C are padded with NaN (so are the
integer datasets, then stored as float); ``steps`` is a coordinate along ``checkpoint`` when
every cell has the same checkpoints, else a variable over the axes and ``checkpoint``. The
attributes are the file's, with ``sweep`` and ``dimensions`` as JSON; ``config`` (over the
axes) holds each cell's resolved RunConfig as JSON. Axis values that are not numbers or
strings (an explicit array, a spectrum) become their JSON text.

:func:`to_dataframe` flattens either into a tidy frame: one row per (cell,) run and
checkpoint, the axis values, ``run``, ``checkpoint`` and ``steps`` as columns, per-run values
repeated along the checkpoints, and a quantity with trailing axes spread over one column per
component (``singular_values_0``, ``singular_values_1``, …).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dynamics.runtime.trajectory import Trajectory
from sims.io.sweep import SWEEP_FORMAT, file_format, read_sweep
from sims.io.trajectory import DATASETS, FORMAT, read_trajectory

__all__ = ["to_dataset", "to_dataframe", "trajectory_dataset", "sweep_dataset", "EXTRA_DIMS"]

# trailing axes of the learners' extras (docs/hdf5-schema.md), after (run, checkpoint)
EXTRA_DIMS = {
    "singular_values": ("r",),
    "ode_singular_values": ("r",),
    "overlap_matrix": ("r", "r_student"),
    "c_hat": ("k", "r"),
    "lam_hat": ("width",),
}
RUN_COORDS = ("xi", "instance_seed", "instance_index")
CORE = ("run", "checkpoint")
_META_SKIP = ("datasets",)


def _xr():
    try:
        import xarray
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ImportError("sims.io.xarray needs xarray and pandas: "
                          'pip install -e ".[analysis]"') from None
    return xarray


# ---------------------------------------------------------------- one trajectory
def _dims(name: str, arr: np.ndarray, checkpoints: int) -> tuple:
    """Dimension names of one (R, ...) array of a trajectory."""
    per_cp = arr.ndim >= 2 and arr.shape[1] == checkpoints
    lead = CORE if per_cp else ("run",)
    trailing = arr.ndim - len(lead)
    known = EXTRA_DIMS.get(name, ())
    if len(known) == trailing:
        return lead + known
    return lead + tuple(f"{name}_dim{i}" for i in range(trailing))


def _variables(traj: Trajectory) -> dict:
    """Name → (R, ...) array of every per-run quantity of ``traj`` (coordinates excluded)."""
    out = {}
    for name in ("overlap", "loss", "ode", "c_overlap", "ode_corrected", "band_lower",
                 "band_upper", "m0", "diverged_step"):
        arr = getattr(traj, name, None)
        if arr is not None:
            out[name] = np.asarray(arr)
    for name, arr in traj.extra.items():
        out[name if name not in out and name not in RUN_COORDS else f"extra_{name}"] = \
            np.asarray(arr)
    return out


def _attr_value(val):
    """An attribute netCDF can store: str, number or bool as is; anything else as JSON."""
    if isinstance(val, (str, int, float, bool, np.integer, np.floating, np.bool_)):
        return val
    return json.dumps(val, sort_keys=True, default=str)


def trajectory_dataset(traj: Trajectory, meta: dict | None = None):
    """The :class:`xarray.Dataset` of a Trajectory (``meta``: the file's root attributes as
    :func:`sims.io.read_trajectory` returns them, stored as attributes)."""
    xr = _xr()
    steps = np.asarray(traj.steps)
    cps = steps.shape[0]
    coords = {"run": np.arange(traj.runs), "checkpoint": np.arange(cps),
              "steps": ("checkpoint", steps, {"description": DATASETS["steps"][2]})}
    index = (meta or {}).get("_instance_index")
    for name, arr in (("xi", traj.xi), ("instance_seed", traj.instance_seed),
                      ("instance_index", index)):
        if arr is not None:
            coords[name] = ("run", np.asarray(arr), {"description": DATASETS[name][2]})
    data = {}
    for name, arr in _variables(traj).items():
        attrs = {"description": DATASETS[name][2]} if name in DATASETS else {}
        if name in traj.extra or name.startswith("extra_"):
            attrs["source"] = f"extra/{name.removeprefix('extra_')}"
        data[name] = (_dims(name, arr, cps), arr, attrs)
    attrs = {k: _attr_value(v) for k, v in (meta or {}).items()
             if not k.startswith("_") and k not in _META_SKIP}
    if isinstance((meta or {}).get("config"), dict):
        attrs["config"] = json.dumps(meta["config"], sort_keys=True)
    ds = xr.Dataset(data, coords=coords, attrs=attrs)
    return ds.set_xindex("steps")


def _read_trajectory_file(path):
    traj, meta = read_trajectory(path)
    import h5py

    with h5py.File(path, "r") as f:
        if "instance_index" in f:
            meta["_instance_index"] = f["instance_index"][()]
    return traj, meta


# ---------------------------------------------------------------- sweeps
def _coord(values) -> np.ndarray:
    """The coordinate of one swept axis: booleans, numbers or strings as they are; anything
    else (explicit arrays, spectra, mixed kinds) as JSON text."""
    values = list(values)
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return np.asarray(values, dtype=bool)
    if all(isinstance(v, (int, float, np.integer, np.floating)) and
           not isinstance(v, (bool, np.bool_)) for v in values):
        return np.asarray(values)
    if all(isinstance(v, str) for v in values):
        return np.asarray(values, dtype=object)
    return np.asarray([v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
                       for v in values], dtype=object)


def _pad(arrays: list, shapes: list) -> np.ndarray:
    """Stack arrays of possibly different shapes, NaN-padded to the largest (ints → float
    when padding is needed)."""
    full = tuple(max(s[i] for s in shapes) for i in range(len(shapes[0])))
    if all(tuple(s) == full for s in shapes):
        return np.stack(arrays)
    out = np.full((len(arrays),) + full, np.nan)
    for i, a in enumerate(arrays):
        out[(i,) + tuple(slice(0, n) for n in a.shape)] = a
    return out


def sweep_dataset(path):
    """The :class:`xarray.Dataset` of a sweep file: the swept axes as dimensions (see the
    module docstring)."""
    xr = _xr()
    meta, cells = read_sweep(path)
    dims = meta["dimensions"]
    axes = list(dims)
    shape = tuple(len(dims[a]) for a in axes)
    n_cells = int(np.prod(shape, dtype=np.int64)) if axes else 1
    per_cell = [None] * n_cells
    configs = np.full(n_cells, "", dtype=object)
    for cell in cells:
        index = int(cell.meta["cell_index"])
        per_cell[index] = trajectory_dataset(cell.traj)
        configs[index] = json.dumps(cell.config, sort_keys=True)
    done = [ds for ds in per_cell if ds is not None]
    finished = np.array([ds is not None for ds in per_cell]).reshape(shape)
    coords = {a: (a, _coord(dims[a])) for a in axes}
    attrs = {k: _attr_value(v) for k, v in meta.items()}
    if not done:
        return xr.Dataset({"finished": (tuple(axes), finished)}, coords=coords, attrs=attrs)
    same_steps = all(ds.sizes["checkpoint"] == done[0].sizes["checkpoint"] and
                     np.array_equal(ds["steps"].values, done[0]["steps"].values) for ds in done)
    names = []  # union of variables and run coordinates, in first-seen order
    for ds in done:
        for n in list(ds.data_vars) + [c for c in RUN_COORDS if c in ds.coords]:
            if n not in names:
                names.append(n)
    if not same_steps:
        names.append("steps")
    data = {"finished": (tuple(axes), finished),
            "config": (tuple(axes), configs.reshape(shape),
                       {"description": "the cell's resolved RunConfig (JSON)"})}
    for name in names:
        source = next(ds[name] for ds in done if name in ds.variables)
        arrays, shapes = [], []
        for ds in per_cell:
            if ds is not None and name in ds.variables:
                a = np.asarray(ds[name].values)
            else:
                a = None
            arrays.append(a)
            if a is not None:
                shapes.append(a.shape)
        filler_shape = tuple(max(s[i] for s in shapes) for i in range(len(shapes[0])))
        stacked = _pad([a if a is not None else np.full(filler_shape, np.nan) for a in arrays],
                       [a.shape if a is not None else filler_shape for a in arrays])
        stacked = stacked.reshape(shape + stacked.shape[1:])
        inner = tuple(d if d in CORE or d not in axes else f"{d}_index" for d in source.dims)
        new = _renamed(name, source.dims, axes)
        var = (tuple(axes) + inner, stacked, dict(source.attrs))
        if name in RUN_COORDS or name == "steps":
            coords[new] = var
        else:
            data[new] = var
    if same_steps:
        coords[_renamed("steps", CORE[1:], axes)] = (
            "checkpoint", done[0]["steps"].values, {"description": DATASETS["steps"][2]})
    for dim in CORE:
        coords[dim] = np.arange(max(ds_.sizes[dim] for ds_ in done))
    ds = xr.Dataset(data, coords=coords, attrs=attrs)
    steps = _renamed("steps", CORE[1:], axes)
    return ds.set_xindex(steps) if same_steps and steps not in axes else ds


def _renamed(name: str, dims, axes) -> str:
    """A cell's variable named like a swept axis (``xi``, ``instance_seed``, ``steps``) is
    renamed ``run_<name>`` (per run) or ``checkpoint_<name>``, so the axis keeps its name."""
    if name not in axes:
        return name
    return ("run_" if dims and dims[0] == "run" else "checkpoint_") + name


# ---------------------------------------------------------------- public entry points
def to_dataset(source, meta: dict | None = None):
    """An :class:`xarray.Dataset` from a trajectory or sweep file path, or from a
    :class:`~dynamics.runtime.trajectory.Trajectory` (with the ``meta`` that
    :func:`sims.io.read_trajectory` returned, optionally).

    Example::

        from sims.io.xarray import to_dataset
        ds = to_dataset("results/quickstart.h5")
        ds.overlap.median("run").plot()           # median curve against the checkpoints
        ds.overlap.sel(steps=ds.steps[-1])        # the final overlap of every run
    """
    if isinstance(source, Trajectory):
        return trajectory_dataset(source, meta)
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], Trajectory):
        return trajectory_dataset(*source)
    path = Path(source)
    fmt = file_format(path)
    if fmt == SWEEP_FORMAT:
        return sweep_dataset(path)
    if fmt == FORMAT:
        return trajectory_dataset(*_read_trajectory_file(path))
    from sims.io.trajectory import TrajectoryFileError

    raise TrajectoryFileError(f"{path} is neither a loradyn trajectory nor a sweep file "
                              f"(format {fmt!r})")


def to_dataframe(source, meta: dict | None = None, variables=None):
    """A tidy :class:`pandas.DataFrame` of a trajectory or sweep (anything :func:`to_dataset`
    takes, or a Dataset it made): one row per (cell,) run and checkpoint, see the module
    docstring. ``variables``: the quantities to keep (default: all)."""
    import pandas as pd

    xr = _xr()
    ds = source if isinstance(source, xr.Dataset) else to_dataset(source, meta)
    swept = list(json.loads(ds.attrs["dimensions"])) if "dimensions" in ds.attrs else []
    core = tuple(d for d in swept if d in ds.dims) + CORE
    steps = "checkpoint_steps" if "checkpoint_steps" in ds.variables else "steps"
    xi = "run_xi" if "run_xi" in ds.variables else "xi"
    names = [n for n in ds.variables if n not in core and n not in ("finished", "config")]
    names.sort(key=lambda n: (n != steps, n not in ds.coords))  # steps, coordinates, data
    if variables is not None:  # the coordinates (steps, ξ, seeds) always come along
        names = [n for n in names if n in variables or n in ds.coords]
    sizes = [ds.sizes[d] for d in core]
    template = xr.DataArray(np.zeros(sizes), dims=core)
    grid = np.stack([a.ravel() for a in np.meshgrid(*[np.arange(n) for n in sizes],
                                                      indexing="ij")])
    columns = {}
    for i, d in enumerate(core):
        values = np.asarray(ds[d].values) if d in ds.coords else np.arange(sizes[i])
        columns[d] = values[grid[i]]
    for name in names:
        var = ds.variables[name]
        var = xr.DataArray(var.values, dims=var.dims)
        extra = [d for d in var.dims if d not in core]
        full = var.broadcast_like(template).transpose(*core, *extra).values
        flat = full.reshape(grid.shape[1], -1)
        if not extra:
            columns[name] = flat[:, 0]
        else:
            for j, idx in enumerate(np.ndindex(*[var.sizes[d] for d in extra])):
                columns[f"{name}_" + "_".join(map(str, idx))] = flat[:, j]
    frame = pd.DataFrame(columns)
    keep = np.ones(len(frame), dtype=bool)  # drop padding and unfinished cells
    for name in (steps, xi):
        if name in frame and frame[name].dtype.kind == "f":
            keep &= np.isfinite(frame[name].to_numpy())
    frame = frame[keep].reset_index(drop=True)
    if frame[steps].dtype.kind == "f":
        frame[steps] = frame[steps].astype(np.int64)
    return frame
