"""Batching sweep cells on the run axis, running a batch, and splitting its trajectory.

Cells whose configs differ only in the instance's ξ or seed share every shape, so they run as
one batch: a :class:`BatchConfig` whose runs are the member cells' runs back to back (each
member's own per-run instances, e.g. per-run seeds). The engines only see a RunConfig whose
``run_instances()`` lists those instances. The batch plan is a function of the sweep file
alone, so a sweep reproduces exactly whatever interrupted it. Run r of a batch draws its data
from the streams of (seed, r): a cell's numbers depend on its offset in its batch (recorded
with the cell), not on anything else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from dynamics.runtime.trajectory import Trajectory
from dynamics.setup.config import RunConfig
from sims.experiments.sweep_spec import Cell
from sims.io.split import split_trajectory

__all__ = ["BatchConfig", "Batch", "plan_batches", "run_batch"]

BATCHABLE = ("xi", "seed")  # instance keys that may differ inside a batch
MAX_BATCH_RUNS = 256


@dataclass
class BatchConfig(RunConfig):
    """A RunConfig whose runs are the concatenated runs of ``members`` (same shapes)."""

    members: tuple = ()

    def run_instances(self, base=None):
        """Every member's run instances, back to back (``base``, the batch spec's own
        instance if already built, serves only the members with that same spec)."""
        out = []
        for member in self.members:
            out.extend(member.run_instances(base if member.instance == self.instance else None))
        return out


@dataclass
class Batch:
    """Cells run together. ``cells`` in run order; ``offsets[i]`` = first run of cell i."""

    cells: list
    offsets: list = field(default_factory=list)

    @property
    def config(self) -> RunConfig:
        if len(self.cells) == 1:
            return self.cells[0].config
        members = tuple(c.config for c in self.cells)
        runs = sum(m.runs for m in members)
        return BatchConfig(**(_fields(members[0]) | {"runs": runs}), members=members)

    def info(self, i: int) -> dict:
        """What a cell records about its batch (for provenance)."""
        return {"cells": [c.index for c in self.cells], "run_offset": self.offsets[i],
                "runs": sum(c.config.runs for c in self.cells)}


def _fields(config: RunConfig) -> dict:
    return {f: getattr(config, f) for f in RunConfig.__dataclass_fields__}


def _key(cell: Cell) -> str:
    data = cell.config.to_dict()
    data["instance"] = {k: v for k, v in data["instance"].items() if k not in BATCHABLE}
    data.pop("runs")
    return json.dumps([data, cell.first_passage, cell.absolute, cell.trajectory,
                       cell.first_passage_of],
                      sort_keys=True, default=str)


def plan_batches(cells: list[Cell], batch: bool = True,
                 max_runs: int = MAX_BATCH_RUNS) -> list[Batch]:
    """Group cells with equal keys (in grid order), at most ``max_runs`` runs per batch."""
    if not batch:
        return [Batch([c], [0]) for c in cells]
    groups: dict[str, list[Cell]] = {}
    for cell in cells:
        if cell.config.xi_values is None:
            groups.setdefault(_key(cell), []).append(cell)
        else:
            groups.setdefault(f"single-{cell.index}", []).append(cell)
    out = []
    for members in groups.values():
        cur, runs = [], 0
        for cell in members:
            if cur and runs + cell.config.runs > max_runs:
                out.append(_batch(cur))
                cur, runs = [], 0
            cur.append(cell)
            runs += cell.config.runs
        out.append(_batch(cur))
    return sorted(out, key=lambda b: b.cells[0].index)


def _batch(cells: list[Cell]) -> Batch:
    offsets = np.concatenate([[0], np.cumsum([c.config.runs for c in cells])[:-1]])
    return Batch(list(cells), [int(o) for o in offsets])


def run_batch(batch: Batch, progress: bool = False) -> list[Trajectory]:
    """Simulate a batch; one Trajectory per cell (exact first passages in ``extra``)."""
    from dynamics.engines.engine import choose_engine, simulate

    config = batch.config
    if batch.cells[0].trajectory:
        traj = simulate(config, progress=progress)
    else:  # first passages only: the initial state is the one checkpoint
        from dynamics.reduced import initial_trajectory

        traj = initial_trajectory(config)
    cell = batch.cells[0]
    levels = cell.first_passage
    if levels and choose_engine(config) == "reduced":
        from dynamics.reduced import first_passages_reduced

        hits = first_passages_reduced(config, levels, absolute=cell.absolute,
                                      quantity=cell.first_passage_of)
        for level, hit in zip(levels, hits, strict=True):
            traj.extra[cell.passage_key(level)] = hit
    return [split_trajectory(traj, off, c.config.runs)
            for c, off in zip(batch.cells, batch.offsets, strict=True)]
