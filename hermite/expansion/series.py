"""Truncated Hermite expansions of h(m): the direct double sum and the Prop. 4 power series.

With ρᵢⱼ(m) = Pᵢⱼ + Qᵢⱼ m (``Instance.correlation_affine``) and bₚ = p μₚ²,

    h(m) = 2 Σᵢⱼ λᵢλⱼ Qᵢⱼ Σ_{p≥1} bₚ ρᵢⱼ(m)^{p−1}                       (paper Prop. 4)
         = Σ_l a_l m^l,   a_l = 2 Σᵢⱼ λᵢλⱼ Qᵢⱼ^{l+1} Σ_s C(l+s, l) b_{l+s+1} Pᵢⱼ^s.

Only Hadamard powers of P enter (for unit-norm rows and û ⊥ W, P = G/(NᵢN̂ⱼ) + ξcᵢ⟨wⱼ,u⟩/(…);
with quantized c, u ⊥ W this is the paper's (ξ²/k)^{l+1}(1+ξ²/k)^{−(l+s+1)} T(l,s) form).
Both truncate at p ≤ pmax; since |ρᵢⱼ| ≤ 1 the dropped tail obeys

    |h − h_pmax| ≤ 2 Σᵢⱼ |λᵢλⱼQᵢⱼ| · (E[σ′(g)²] − Σ_{p≤pmax} p μₚ²)        (truncation_bound).

The a_l are formed without binomials: per pair, Horner in polynomial arithmetic,
poly ← poly·(P + Q m) + bₚ for p = pmax … 1 (no overflow, no cancellation: |P| + |Q| ≤ 1).
"""

from __future__ import annotations

import numba
import numpy as np

from hermite.expansion.coefficients import derivative_second_moment, hermite_coefficients

__all__ = ["HSeries", "h_direct", "derivative_weights", "truncation_bound"]


def derivative_weights(activation, pmax: int) -> np.ndarray:
    """bₚ = p μₚ² for p = 1..pmax (index p − 1)."""
    mu = hermite_coefficients(activation, pmax)
    p = np.arange(pmax + 1, dtype=np.float64)
    return np.ascontiguousarray((p * mu * mu)[1:])


def truncation_bound(instance, pmax: int, c_hat=None) -> float:
    """Upper bound on |h(m) − h_pmax(m)| for every m ∈ [−1, 1] (series and direct)."""
    _, q = instance.correlation_affine(c_hat)
    b = derivative_weights(instance.activation, pmax)
    rest = max(0.0, derivative_second_moment(instance.activation) - float(np.sum(b)))
    lam = instance.lam
    return float(2.0 * np.sum(np.abs(np.outer(lam, lam) * q)) * rest)


@numba.njit(cache=True)
def _series_coefficients(p_mat, q_mat, llq, b):  # pragma: no cover - compiled
    k1, k2 = p_mat.shape
    n = b.size  # degree in m is n − 1
    a = np.zeros(n)
    poly = np.empty(n)
    for i in range(k1):
        for j in range(k2):
            pij = p_mat[i, j]
            qij = q_mat[i, j]
            w = llq[i, j]
            if w == 0.0:
                continue
            poly[:] = 0.0
            poly[0] = b[n - 1]
            deg = 0
            for p in range(n - 2, -1, -1):
                # poly ← poly · (P + Q m) + b_p
                poly[deg + 1] = poly[deg] * qij
                for d in range(deg, 0, -1):
                    poly[d] = poly[d] * pij + poly[d - 1] * qij
                poly[0] = poly[0] * pij + b[p]
                deg += 1
            for d in range(n):
                a[d] += w * poly[d]
    return 2.0 * a


@numba.njit(cache=True)
def _horner(a, m):  # pragma: no cover - compiled
    out = np.empty(m.size)
    n = a.size
    for t in range(m.size):
        x = m[t]
        acc = 0.0
        for d in range(n - 1, -1, -1):
            acc = acc * x + a[d]
        out[t] = acc
    return out


@numba.njit(cache=True)
def _direct(p_flat, q_flat, llq_flat, b, m):  # pragma: no cover - compiled
    # Horner in ρ for all pairs at once (inner loop over pairs vectorises), per m.
    out = np.empty(m.size)
    npair = p_flat.size
    n = b.size
    rho = np.empty(npair)
    acc = np.empty(npair)
    for t in range(m.size):
        x = m[t]
        for q in range(npair):
            rho[q] = p_flat[q] + q_flat[q] * x
            acc[q] = b[n - 1] if n > 0 else 0.0
        for p in range(n - 2, -1, -1):
            bp = b[p]
            for q in range(npair):
                acc[q] = acc[q] * rho[q] + bp
        tot = 0.0
        for q in range(npair):
            tot += llq_flat[q] * acc[q]
        out[t] = 2.0 * tot
    return out


def _pair_arrays(instance, c_hat):
    p, q = instance.correlation_affine(c_hat)
    llq = np.outer(instance.lam, instance.lam) * q
    return np.ascontiguousarray(p), np.ascontiguousarray(q), np.ascontiguousarray(llq)


def h_direct(instance, m, pmax: int = 60, c_hat=None) -> np.ndarray:
    """h(m) truncated at p ≤ pmax by the direct double sum over (i, j, p) (numba)."""
    m = np.asarray(m, dtype=np.float64)
    p, q, llq = _pair_arrays(instance, c_hat)
    b = derivative_weights(instance.activation, pmax)
    flat = np.ascontiguousarray(m.ravel())
    keep = llq.ravel() != 0.0
    pf, qf, lf = (np.ascontiguousarray(a.ravel()[keep]) for a in (p, q, llq))
    return _direct(pf, qf, lf, b, flat).reshape(m.shape)


class HSeries:
    """Prop. 4 power series h(m) ≈ Σ_{l<pmax} a_l m^l, truncated at Hermite degree pmax.

    Calling the object evaluates the series at an array of m (numba Horner);
    :meth:`derivative` gives h′(m) of the truncated series.

    Attributes
    ----------
    coefficients : (pmax,) array a_0 … a_{pmax−1} (empty for pmax = 0).
    truncation_bound : bound on |h − series| over m ∈ [−1, 1] (module docstring).
    pmax : truncation degree.
    """

    def __init__(self, instance, pmax: int = 60, c_hat=None):
        if isinstance(pmax, bool) or int(pmax) != pmax or pmax < 0:
            raise ValueError(f"pmax must be an integer ≥ 0, got {pmax!r}")
        self.pmax = int(pmax)
        p, q, llq = _pair_arrays(instance, c_hat)
        b = derivative_weights(instance.activation, self.pmax)
        if b.size == 0:
            self.coefficients = np.zeros(0)
        else:
            self.coefficients = _series_coefficients(p, q, llq, b)
        self.truncation_bound = truncation_bound(instance, self.pmax, c_hat)

    def __call__(self, m) -> np.ndarray:
        m = np.asarray(m, dtype=np.float64)
        flat = np.ascontiguousarray(m.ravel())
        return _horner(self.coefficients, flat).reshape(m.shape)

    def derivative(self, m) -> np.ndarray:
        """d/dm of the truncated series."""
        m = np.asarray(m, dtype=np.float64)
        flat = np.ascontiguousarray(m.ravel())
        a = self.coefficients  # Σ d·a_d m^{d−1}: Horner on the coefficients d·a_d
        return _horner(np.arange(1, a.size) * a[1:], flat).reshape(m.shape)
