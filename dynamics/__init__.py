"""Instances, activations, learners and the batched online-SGD engine."""

from .activations import ACTIVATION_NAMES, Activation, activation_from_callable, get_activation
from .instance import Instance, SpecError, build_instance, load_instance, load_spec

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
