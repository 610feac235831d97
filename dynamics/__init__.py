"""Instances, activations, learners and the batched online-SGD engine.

The names below are imported on first use (PEP 562), so ``import dynamics.config`` loads no
more than it needs (torch itself is loaded at its first use: :mod:`dynamics.lazy`).
"""

from __future__ import annotations

import importlib

_WHERE = {
    "ACTIVATION_NAMES": "activations", "Activation": "activations",
    "activation_from_callable": "activations", "get_activation": "activations",
    "Instance": "instance", "SpecError": "instance", "build_instance": "instance",
    "load_instance": "instance", "load_spec": "instance",
}


def __getattr__(name: str):
    try:
        module = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module 'dynamics' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"dynamics.{module}"), name)
    globals()[name] = value
    return value

__all__ = [
    "ACTIVATION_NAMES",
    "Activation",
    "activation_from_callable",
    "get_activation",
    "Instance",
    "SpecError",
    "build_instance",
    "load_instance",
    "load_spec",
]
