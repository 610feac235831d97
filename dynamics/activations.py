"""The engine's side of an activation: σ and σ′ on torch tensors.

The registry, the kernels and the Hermite coefficients live on the theory side
(:mod:`hermite.activations`, no torch). :func:`torch_activation` adds tensor versions of σ
and σ′ on top: torch's own ops for the named activations; polynomial ones (``quadratic``,
``linear``, ``he<p>``) are written with arithmetic only and apply to tensors as they are; a
scaled one σ(a·x) (``erf(x/sqrt2)``) wraps its base's torch ops; a
user's numpy callable is evaluated through numpy (correct, not fast).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from dynamics.lazy import lazy_import
from hermite.activations import (
    ACTIVATION_NAMES,
    Activation,
    activation_from_callable,
    get_activation,
    hermite_normalized,
)

torch = lazy_import("torch")  # loaded at its first use

__all__ = [
    "ACTIVATION_NAMES",
    "Activation",
    "TorchActivation",
    "activation_from_callable",
    "get_activation",
    "hermite_normalized",
    "torch_activation",
]

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _sigmoid_deriv(x):
    s = torch.sigmoid(x)
    return s * (1 - s)


def _tanh_deriv(x):
    t = torch.tanh(x)
    return 1 - t * t


def _torch_ops() -> dict[str, tuple[Callable, Callable]]:
    """σ and σ′ of the registry activations as torch functions (built on first use: torch is
    loaded then)."""
    return {
        "relu": (torch.relu, lambda x: (x > 0).to(x.dtype)),
        "abs": (torch.abs, torch.sign),
        "sigmoid": (torch.sigmoid, _sigmoid_deriv),
        "tanh": (torch.tanh, _tanh_deriv),
        "erf": (torch.erf, lambda x: _TWO_OVER_SQRT_PI * torch.exp(-x * x)),
    }


def _through_numpy(f: Callable) -> Callable:
    def apply(x: torch.Tensor) -> torch.Tensor:
        out = f(x.detach().cpu().numpy())
        return torch.as_tensor(out, dtype=x.dtype).to(x.device)

    return apply


@dataclass(frozen=True)
class TorchActivation:
    """σ and σ′ on tensors, beside the theory's :class:`Activation` they implement.

    Fields
    ------
    theory : the :class:`hermite.activations.Activation` (name, kernels, coefficients).
    fn, deriv : σ and σ′, tensor in, tensor out (same dtype and device).
    """

    theory: Activation
    fn: Callable
    deriv: Callable

    @property
    def name(self) -> str:
        return self.theory.name

    def __call__(self, x):
        return self.fn(x)


def torch_activation(activation) -> TorchActivation:
    """The tensor σ, σ′ of a name, an :class:`Activation` or a :class:`TorchActivation`."""
    if isinstance(activation, TorchActivation):
        return activation
    act = get_activation(activation)
    base, a = act.base_and_scale
    ops = _torch_ops()
    if act.name in ops and act.fn is get_activation(act.name).fn:
        fn, deriv = ops[act.name]
    elif base in ops and act is get_activation(act.name):  # σ(a·x), a registry σ
        f0, d0 = ops[base]

        def fn(x):
            return f0(a * x)

        def deriv(x):
            return a * d0(a * x)
    elif act.polynomial_degree is not None:  # quadratic, linear, he<p>: arithmetic only
        fn, deriv = act.fn, act.deriv
    else:
        fn, deriv = _through_numpy(act.fn), _through_numpy(act.deriv)
    return TorchActivation(act, fn, deriv)

