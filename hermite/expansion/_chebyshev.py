"""Certified Chebyshev interpolants of ρ ↦ F(ρ) on [−1, 1] in the angle θ = arccos ρ.

Dual kernels of piecewise-smooth activations have √(1 − ρ²)-type singularities at ρ = ±1
(ReLU: K′ = (π − θ)/2π), but F(cos θ) is smooth in θ ∈ [0, π]. The interpolant is built
chebfun-style: values at nested Chebyshev–Lobatto points in x = 1 − 2θ/π, degree doubled
until the trailing coefficients fall below ``tol`` relative to max|F| (or stop shrinking: a
noise plateau, ``noise_limited``); ``error_bound`` is the sum of the discarded coefficients'
magnitudes plus the tail level (×10 on a plateau) plus the stated error of the samples.
"""

from __future__ import annotations

import numba
import numpy as np
import scipy.fft

__all__ = ["ChebyshevInTheta"]


@numba.njit(cache=True)
def _clenshaw_theta(coef, rho):  # pragma: no cover - compiled
    out = np.empty(rho.size)
    n = coef.size
    for i in range(rho.size):
        r = min(1.0, max(-1.0, rho[i]))
        x = 1.0 - 2.0 * np.arccos(r) / np.pi
        b1 = 0.0
        b2 = 0.0
        x2 = 2.0 * x
        for j in range(n - 1, 0, -1):
            b0 = coef[j] + x2 * b1 - b2
            b2 = b1
            b1 = b0
        out[i] = coef[0] + x * b1 - b2
    return out


def _lobatto_rho(n: int) -> np.ndarray:
    x = np.cos(np.pi * np.arange(n + 1) / n)
    theta = 0.5 * np.pi * (1.0 - x)
    return np.cos(theta)


class ChebyshevInTheta:
    """Chebyshev series of F(cos θ) in x = 1 − 2θ/π; call it with ρ values.

    Parameters
    ----------
    func : vectorised ρ ↦ F(ρ) (the expensive, accurate evaluation).
    tol : relative size of the trailing coefficients at which the degree stops growing.
    n_min, n_max : first and largest degree tried (powers of two).
    sample_error : absolute error of ``func`` (added to ``error_bound``).
    """

    def __init__(self, func, tol: float = 1e-14, n_min: int = 32, n_max: int = 2048,
                 sample_error: float = 0.0):
        n = n_min
        values = func(_lobatto_rho(n))
        prev_tail = np.inf
        while True:
            coef = scipy.fft.dct(values, type=1) / n
            coef[0] *= 0.5
            coef[-1] *= 0.5
            scale = max(np.max(np.abs(values)), 1e-300)
            tail = np.max(np.abs(coef[-max(4, n // 16):]))
            # stop when resolved, at the cap, or on a noise plateau (samples with error ≫ tol,
            # e.g. σ′ by finite differences): doubling no longer shrinks the tail
            plateau = n >= 128 and tail > 0.25 * prev_tail
            if tail <= tol * scale or n >= n_max or plateau:
                break
            prev_tail = tail
            new = func(_lobatto_rho(2 * n)[1::2])
            merged = np.empty(2 * n + 1)
            merged[0::2] = values
            merged[1::2] = new
            values, n = merged, 2 * n
        cut = max(0.25 * tol * scale, 2.0 * tail if plateau else 0.0)
        keep = np.nonzero(np.abs(coef) > cut)[0]
        last = int(keep[-1]) + 1 if keep.size else 1
        self.coef = np.ascontiguousarray(coef[:last])
        self.degree = last - 1
        self.converged = bool(tail <= tol * scale)
        self.noise_limited = bool(plateau and not self.converged)
        self.error_bound = float(np.sum(np.abs(coef[last:])) + (10.0 if plateau else 1.0) * tail
                                 + sample_error)
        self.scale = float(scale)

    def __call__(self, rho) -> np.ndarray:
        rho = np.asarray(rho, dtype=np.float64)
        flat = np.ascontiguousarray(rho.ravel())
        return _clenshaw_theta(self.coef, flat).reshape(rho.shape)
