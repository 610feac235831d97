"""Gaussian quadrature rules shared by the coefficient and kernel computations.

* :func:`gauss_panels` — composite Gauss–Legendre on [−L, L] split at given breakpoints,
  with the standard normal density folded into the weights (for E[f(g)], g ~ N(0, 1)).
* :func:`gauss_hermite` — probabilists' Gauss–Hermite nodes/weights normalised to N(0, 1).
* :func:`sobol_normals` — a scrambled Sobol′ set mapped to N(0, I) (quasi-Monte Carlo).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = ["gauss_panels", "gauss_hermite", "legendre", "GAUSS_TAIL", "sobol_normals"]

#: Half-width of the integration window. |hₚ(x)| φ(x) ≤ 1.09 e^{−x²/4}/√(2π) for every p
#: (Cramér's bound), so at L = 16 the neglected tail is < 1e-27 · (growth of σ).
GAUSS_TAIL = 16.0

_INV_SQRT_2PI = 1.0 / np.sqrt(2.0 * np.pi)


@lru_cache(maxsize=32)
def legendre(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Gauss–Legendre nodes and weights on [−1, 1]."""
    x, w = np.polynomial.legendre.leggauss(n)
    x.setflags(write=False)
    w.setflags(write=False)
    return x, w


def panel_edges(lo: float, hi: float, width: float, breakpoints=()) -> np.ndarray:
    """Edges of panels of width ≤ ``width`` on [lo, hi], with every breakpoint an edge."""
    n = max(1, int(np.ceil((hi - lo) / width)))
    edges = np.linspace(lo, hi, n + 1)
    inner = [b for b in breakpoints if lo < b < hi]
    return np.unique(np.concatenate([edges, np.asarray(inner, dtype=float)]))


def gauss_panels(width: float = 0.5, order: int = 24, breakpoints=(), tail: float = GAUSS_TAIL,
                 density: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Nodes x and weights w with Σ w f(x) ≈ E[f(g)], g ~ N(0, 1) (``density=False``: ∫ f dx).

    Composite Gauss–Legendre of ``order`` points on panels of width ≤ ``width`` covering
    [−tail, tail], with the breakpoints of f as panel edges (exact for piecewise polynomials
    of degree < 2·order between breakpoints).
    """
    edges = panel_edges(-tail, tail, width, breakpoints)
    t, wt = legendre(order)
    mid = 0.5 * (edges[1:] + edges[:-1])
    half = 0.5 * (edges[1:] - edges[:-1])
    x = (mid[:, None] + half[:, None] * t[None, :]).ravel()
    w = (half[:, None] * wt[None, :]).ravel()
    if density:
        w = w * _INV_SQRT_2PI * np.exp(-0.5 * x * x)
    return x, w


@lru_cache(maxsize=16)
def gauss_hermite(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n-point probabilists' Gauss–Hermite rule: Σ w f(x) ≈ E[f(g)], g ~ N(0, 1)."""
    x, w = np.polynomial.hermite_e.hermegauss(n)
    w = w / np.sqrt(2.0 * np.pi)
    x.setflags(write=False)
    w.setflags(write=False)
    return x, w


def sobol_normals(dim: int, samples: int, seed: int) -> np.ndarray:
    """(samples, dim) N(0, 1) points: one scrambled Sobol′ set (seeded by (seed, dim)) mapped
    by Φ⁻¹; ``samples`` a power of 2."""
    import scipy.special
    import scipy.stats

    m = int(round(math.log2(samples)))
    if 2**m != samples:
        raise ValueError(f"samples must be a power of 2, got {samples}")
    sob = scipy.stats.qmc.Sobol(d=dim, scramble=True, seed=np.random.default_rng([seed, dim]))
    return scipy.special.ndtri(np.clip(sob.random_base2(m), 1e-300, 1.0 - 2.0**-53))
