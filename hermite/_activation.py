"""Resolve the ``activation`` argument of the hermite API to an :class:`Activation`."""

from __future__ import annotations

from collections.abc import Callable

from hermite.activations import Activation, activation_from_callable, get_activation

__all__ = ["resolve_activation"]

_WRAPPED: dict[Callable, Activation] = {}


def resolve_activation(activation) -> Activation:
    """Name (``"relu"``, ``"he3"``), :class:`Activation`, or plain numpy callable σ.

    A plain callable is wrapped once (σ′ by finite differences, no breakpoints) and the
    wrapper is memoised, so per-activation caches (kernel interpolants) are reused.
    """
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, str):
        return get_activation(activation)
    if callable(activation):
        act = _WRAPPED.get(activation)
        if act is None:
            name = getattr(activation, "__name__", "custom")
            act = activation_from_callable(activation, name=name)
            _WRAPPED[activation] = act
        return act
    raise ValueError(f"activation must be a name, an Activation or a callable, got {activation!r}")
