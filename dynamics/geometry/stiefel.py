"""Geometry of the Stiefel manifold St(n, r) = {X ∈ R^{n×r}: XᵀX = I}, geoopt-style.

Small functions on the last two axes (leading axes broadcast: run, batch), composed by the
``lora`` learner. Embedded (Euclidean) metric:

* tangent projection ``proju(X, Z) = Z − X sym(XᵀZ)``, sym(A) = (A + Aᵀ)/2;
* retraction ``retr(X, V) = (X + V) P`` with P = ``retraction_factor((X+V)ᵀ(X+V))``:
  ``polar``: P = (YᵀY)^{−1/2}, so Y P is the orthogonal polar factor of Y = X + V;
  ``qr``: P = R⁻¹ with YᵀY = RᵀR (Cholesky, diag R > 0), so Y P is the Q of Y = QR with a
  positive diagonal (Cholesky-QR; exact in exact arithmetic).

At r = 1 both reduce to the sphere's ``projx(x + v)`` (:mod:`dynamics.geometry.sphere`). A
Riemannian SGD step is ``retr(X, −η proju(X, G))`` for a Euclidean gradient G.
"""

from __future__ import annotations

import numpy as np

from dynamics.lazy import lazy_import

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["RETRACTIONS", "sym", "proju", "retraction_factor", "retr", "projx", "gram",
           "orthonormality_error", "uniform_frames"]

RETRACTIONS = ("polar", "qr")


def sym(a: torch.Tensor) -> torch.Tensor:
    """(A + Aᵀ)/2 over the last two axes."""
    return 0.5 * (a + a.transpose(-1, -2))


def gram(x: torch.Tensor) -> torch.Tensor:
    """XᵀX over the last two axes: (..., n, r) → (..., r, r)."""
    return x.transpose(-1, -2) @ x


def proju(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Tangent projection at X ∈ St(n, r) (embedded metric): Z − X sym(XᵀZ)."""
    return z - x @ sym(x.transpose(-1, -2) @ z)


def retraction_factor(g: torch.Tensor, method: str = "polar") -> tuple[torch.Tensor, torch.Tensor]:
    """(P, health) for a Gram matrix g = YᵀY (..., r, r): Y P ∈ St(n, r).

    polar: P = g^{−1/2} (eigh); qr: P = R⁻¹ with g = RᵀR (Cholesky). ``health`` (...) is
    λ_min(g)^{−1/2} (polar) or 1/min diag R (qr), both 1/‖y‖ at r = 1; it is not a finite
    number > 0 where g is not finite or not positive definite (nothing raises: the engine
    restores and freezes such a run).
    """
    if method not in RETRACTIONS:
        raise ValueError(f"retraction must be one of {', '.join(RETRACTIONS)}, got {method!r}")
    if method == "polar":
        vals, vecs = torch.linalg.eigh(torch.nan_to_num(g, 0.0, 0.0, 0.0))
        inv = vals.rsqrt()  # NaN for a negative, inf for a zero eigenvalue
        p = (vecs * inv[..., None, :]) @ vecs.transpose(-1, -2)
        return p, inv[..., 0] + 0.0 * g.sum((-1, -2))  # NaN where g is not finite
    low, info = torch.linalg.cholesky_ex(torch.nan_to_num(g, 0.0, 0.0, 0.0))
    eye = torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
    p = torch.linalg.solve_triangular(low.transpose(-1, -2), eye.expand_as(low), upper=True)
    dmin = torch.diagonal(low, dim1=-2, dim2=-1).amin(-1)
    bad = torch.where(info == 0, 0.0, float("nan"))
    return p, dmin.reciprocal() + bad + 0.0 * g.sum((-1, -2))


def projx(x: torch.Tensor, method: str = "polar") -> torch.Tensor:
    """Map a full-rank X (..., n, r) onto St(n, r): X P(XᵀX) (polar factor or QR's Q)."""
    return x @ retraction_factor(gram(x), method)[0]


def retr(x: torch.Tensor, v: torch.Tensor, method: str = "polar") -> torch.Tensor:
    """Retraction at X along a tangent V: projx(X + V) (polar or QR)."""
    return projx(x + v, method)


def orthonormality_error(x: torch.Tensor) -> torch.Tensor:
    """max |XᵀX − I| over the last two axes, (...)."""
    r = x.shape[-1]
    eye = torch.eye(r, dtype=x.dtype, device=x.device)
    return (gram(x) - eye).abs().flatten(-2).amax(-1)


def uniform_frames(gauss: np.ndarray) -> np.ndarray:
    """Haar-uniform point of St(n, r) from a Gaussian (n, r) matrix G: G (GᵀG)^{−1/2}.

    The polar factor of a Gaussian matrix is Haar distributed; at r = 1 it is g/‖g‖.
    """
    gauss = np.asarray(gauss, dtype=float)
    if gauss.shape[-1] == 1:
        return gauss / np.linalg.norm(gauss, axis=-2, keepdims=True)
    vals, vecs = np.linalg.eigh(np.swapaxes(gauss, -1, -2) @ gauss)
    return gauss @ (vecs / np.sqrt(vals)[..., None, :]) @ np.swapaxes(vecs, -1, -2)
