"""HDF5 files: single-run trajectories (:mod:`sims.io.trajectory`) and sweeps
(:mod:`sims.io.sweep`); schema in docs/hdf5-schema.md. A trajectory's runs sliced out:
:mod:`sims.io.split`."""

from sims.io.split import split_trajectory
from sims.io.sweep import SWEEP_FORMAT, read_sweep
from sims.io.trajectory import TrajectoryFileError, read_trajectory, write_trajectory

__all__ = ["SWEEP_FORMAT", "TrajectoryFileError", "read_sweep", "read_trajectory",
           "split_trajectory", "write_trajectory"]
