"""Instances, activations, learners and the batched online-SGD engine.

The package in rooms, from the bottom up (a room imports only from rooms above it in this
list, never from one below; ``tests/test_layering.py`` checks it):

- the root: what every room shares — :mod:`dynamics.errors` (one-line config errors),
  :mod:`dynamics.lazy` (torch on first use), :mod:`dynamics.activations` (σ on torch);
- :mod:`dynamics.runtime`: a run's records and machinery (the Trajectory, resume files,
  progress lines, thread pools over runs, numba's cache guard);
- :mod:`dynamics.randomness`: the example streams (Gaussian chunks, counter streams, the
  ziggurat);
- :mod:`dynamics.geometry`: the sphere and the Stiefel manifold;
- :mod:`dynamics.instances`: the problem instances (teacher, pre-trained rows, LoRA targets);
- :mod:`dynamics.measures`: what a run measures (overlaps, exact losses, the refit head);
- :mod:`dynamics.overlays`: the theory lines drawn beside a run and their audit;
- :mod:`dynamics.learners`: the learners, one file each;
- :mod:`dynamics.setup`: a run's configuration and its defaults;
- :mod:`dynamics.reduced`: the exact reduced chains;
- :mod:`dynamics.engines`: which engine runs a config, what it costs, and ``simulate``.

The names below are imported on first use (PEP 562), so ``import dynamics`` loads nothing
heavy (torch itself is loaded at its first use: :mod:`dynamics.lazy`).
"""

from __future__ import annotations

import importlib

# name → the module that defines it
_WHERE = {
    "ACTIVATION_NAMES": "activations", "Activation": "activations",
    "activation_from_callable": "activations", "get_activation": "activations",
    "Instance": "instances.instance", "SpecError": "instances.instance",
    "build_instance": "instances.instance", "load_instance": "instances.instance",
    "load_spec": "instances.instance",
    "RunConfig": "setup.config", "ConfigError": "errors",
    "simulate": "engines.engine", "simulate_full": "engines.engine",
    "choose_engine": "engines.choice",
    "Trajectory": "runtime.trajectory",
    "simulate_reduced": "reduced",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    try:
        module = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module 'dynamics' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"dynamics.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
