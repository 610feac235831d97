"""A run resolved once: what a command builds from a config before any compute and hands to
the pre-flight checks, the engine and the writer (nothing downstream builds it again).

:func:`resolve_run` validates the config (once), builds every distinct instance (once; the
spec's own instance may be passed in when the caller built it already, e.g. for the default
η), picks the engine and checks the memory estimate. The engine's trajectory carries the same
instances (``Trajectory.instances``), so the writer stores them without rebuilding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamics.engines.budget import Estimate, check_memory
from dynamics.engines.choice import choose_engine
from dynamics.instances.instance import Instance, distinct_instances
from dynamics.setup.config import RunConfig

__all__ = ["ResolvedRun", "resolve_run", "choose_engine"]


@dataclass(frozen=True)
class ResolvedRun:
    """A validated config and everything derived from it.

    Fields: ``config`` (validated), ``instances`` (the distinct resolved instances),
    ``index`` (R,) the instance of each run, ``learner`` (its class), ``width`` (student
    neurons), ``engine`` (``full`` or ``reduced``) and ``memory`` (the checked estimate).
    """

    config: RunConfig
    instances: list[Instance]
    index: np.ndarray
    learner: type
    width: int
    engine: str
    memory: Estimate

    @property
    def run_instances(self) -> list[Instance]:
        """The instance of every run (length R; shared objects, as ``config.run_instances``)."""
        return [self.instances[i] for i in self.index]


def resolve_run(config: RunConfig, *, instance: Instance | None = None,
                names: dict | None = None) -> ResolvedRun:
    """Validate ``config`` and resolve it (module docstring). ``instance``: the spec's own
    instance if already built; ``names``: how the caller calls the config fields in a memory
    error (``{"runs": "--runs"}``). Raises ``ConfigError``/``SpecError`` or
    ``MemoryBudgetError`` (one line) before anything is allocated."""
    from dynamics.learners import get_learner

    if instance is None:
        from dynamics.instances.instance import build_instance

        instance = build_instance(config.instance)
    config.validate(instance)
    per_run = config.run_instances(instance)
    instances, index = distinct_instances(per_run)
    learner = get_learner(config.learner)
    engine = choose_engine(config)
    memory = check_memory(config, names, engine=engine)
    return ResolvedRun(config, instances, index, learner, learner.neurons(config, instance.k),
                       engine, memory)
