"""E[f(z₁) g(z₂)] for standard Gaussians of correlation ρ, by 2-D quadrature (vectorised in ρ).

Write z₂ = ρ z₁ + s z₃ with s = √(1 − ρ²) and z₁, z₃ independent.

* Smooth f, g (no breakpoints): tensor Gauss–Hermite in (z₁, z₃), 240 × 240 nodes. For
  integrands analytic in a strip around ℝ (sigmoid: poles at ±iπ, tanh: ±iπ/2) this is at
  machine precision (tanh: 2e-15 against the Hermite series at every ρ ∈ [−1, 1]).
* Piecewise-smooth f, g (breakpoints b): the inner integral G(z₁) = E_{z₃}[g(ρz₁ + s z₃)] is
  composite Gauss–Legendre in z₃ with the kinks (b − ρz₁)/s as panel edges, per outer node;
  the outer integral of f(z₁)φ(z₁)G(z₁) is composite Gauss–Legendre with edges at the
  breakpoints of f and geometrically graded panels around b/ρ, where G has a transition of
  width s/|ρ|. Accurate to ~1e-14 uniformly in ρ, including ρ → ±1.
"""

from __future__ import annotations

import numpy as np

from hermite._quadrature import gauss_hermite, legendre

__all__ = ["pair_expectation", "GH_NODES"]

GH_NODES = 240
_TAIL = 12.0  # φ(12) ≈ 5e-32: beyond this, Gaussian mass is negligible for ≤ polynomial growth
_ORDER = 16
_INV_SQRT_2PI = 1.0 / np.sqrt(2.0 * np.pi)


def pair_expectation(f, g, rho, breaks_f=(), breaks_g=(), n_gh: int = GH_NODES) -> np.ndarray:
    """E[f(z₁) g(z₂)], (z₁, z₂) standard Gaussian with correlation ρ, for each ρ in ``rho``.

    ``f``, ``g`` are numpy callables; ``breaks_f``/``breaks_g`` their non-smooth points.
    """
    rho = np.clip(np.asarray(rho, dtype=np.float64), -1.0, 1.0)
    flat = rho.ravel()
    if len(breaks_f) == 0 and len(breaks_g) == 0:
        out = _smooth(f, g, flat, n_gh)
    else:
        out = np.array([_piecewise_one(f, g, r, tuple(breaks_f), tuple(breaks_g)) for r in flat])
    return out.reshape(rho.shape)


def _smooth(f, g, rho, n):
    x, w = gauss_hermite(n)
    fx = w * np.asarray(f(x), dtype=np.float64)
    out = np.empty(rho.size)
    chunk = max(1, 2_000_000 // (n * n))
    for a in range(0, rho.size, chunk):
        r = rho[a:a + chunk, None, None]
        s = np.sqrt(np.maximum(0.0, 1.0 - r * r))
        gz = np.asarray(g(r * x[None, :, None] + s * x[None, None, :]), dtype=np.float64)
        out[a:a + chunk] = np.einsum("rab,b->ra", gz, w) @ fx
    return out


def _gl_nodes(edges: np.ndarray):
    """Nodes/weights of composite GL on panels between consecutive ``edges`` (last axis)."""
    t, wt = legendre(_ORDER)
    mid = 0.5 * (edges[..., 1:] + edges[..., :-1])
    half = 0.5 * (edges[..., 1:] - edges[..., :-1])
    x = mid[..., None] + half[..., None] * t
    w = half[..., None] * wt
    return x.reshape(*edges.shape[:-1], -1), w.reshape(*edges.shape[:-1], -1)


def _outer_edges(r: float, s: float, breaks_f, breaks_g) -> np.ndarray:
    edges = [np.linspace(-_TAIL, _TAIL, int(2 * _TAIL) + 1), np.asarray(breaks_f, float)]
    if abs(r) > 0.0:
        scale = s / abs(r)
        for b in breaks_g:
            c = b / r
            edges.append(np.array([c]))
            if 0.0 < scale < 1.0:
                d = scale * 2.0 ** np.arange(0, int(np.ceil(np.log2(1.0 / scale))) + 1)
                edges.append(c + d)
                edges.append(c - d)
    e = np.concatenate(edges)
    return np.unique(np.clip(e, -_TAIL, _TAIL))


def _piecewise_one(f, g, r: float, breaks_f, breaks_g) -> float:
    s = float(np.sqrt(max(0.0, 1.0 - r * r)))
    z1, w1 = _gl_nodes(_outer_edges(r, s, breaks_f, breaks_g))
    w1 = w1 * _INV_SQRT_2PI * np.exp(-0.5 * z1 * z1)
    if s == 0.0:
        inner = np.asarray(g(r * z1), dtype=np.float64)
    else:
        base = np.linspace(-_TAIL, _TAIL, int(2 * _TAIL) + 1)
        cuts = (np.asarray(breaks_g, float)[None, :] - r * z1[:, None]) / s
        edges = np.sort(np.concatenate(
            [np.broadcast_to(base, (z1.size, base.size)), np.clip(cuts, -_TAIL, _TAIL)], axis=1),
            axis=1)
        t, wt = _gl_nodes(edges)
        wt = wt * _INV_SQRT_2PI * np.exp(-0.5 * t * t)
        gv = np.asarray(g(r * z1[:, None] + s * t), dtype=np.float64)
        inner = np.sum(wt * gv, axis=1)
    return float(np.dot(w1 * np.asarray(f(z1), dtype=np.float64), inner))
