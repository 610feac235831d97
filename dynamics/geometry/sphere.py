"""Geometry of the unit sphere, geoopt-style: tiny functions composed by the learners.

All functions act on the last axis and broadcast over leading (run, batch) axes; they accept
torch tensors (the engine) and are reused by the tests' reference implementations.
The spherical SGD step of eq. (4) is ``retr(x, -eta * proju(x, grad))``.
"""

from __future__ import annotations

from dynamics.lazy import lazy_import

torch = lazy_import("torch")  # loaded at its first use


__all__ = ["inner", "projx", "proju", "retr"]


def inner(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """⟨x, y⟩ over the last axis (keeps it as a size-1 axis for broadcasting)."""
    return (x * y).sum(-1, keepdim=True)


def projx(x: torch.Tensor) -> torch.Tensor:
    """Map a point onto the sphere: x/‖x‖ (the paper's ``proj``)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def proju(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tangent projection at x ∈ S^{d−1}: (I − x xᵀ) u."""
    return u - inner(x, u) * x


def retr(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Projection retraction: projx(x + u)."""
    return projx(x + u)
