"""Exact population loss of two-layer networks of unit-row neurons (dual kernels).

For f(x) = Σᵢ λᵢ σ(⟨vᵢ,x⟩) and f̂(x) = Σⱼ λ̂ⱼ σ(⟨v̂ⱼ,x⟩) with unit rows and x ~ N(0, I),

    E(f − f̂)² = λᵀK(VVᵀ)λ + λ̂ᵀK(V̂V̂ᵀ)λ̂ − 2 λᵀK(VV̂ᵀ)λ̂,   K(ρ) = E[σ(z₁)σ(z₂)]

(App. D.1; ``hermite.dual_kernel`` evaluates K exactly). Every learner whose student is a
network of unit rows (scratch, sparse, full-rank linearized weights) reports this loss.
Rows of any norm (free rows, a committee teacher): :func:`network_loss_from_overlaps`.
"""

from __future__ import annotations

import numpy as np

import hermite

__all__ = ["teacher_rows", "network_loss", "network_loss_from_grams",
           "network_loss_from_overlaps"]


def teacher_rows(instance) -> np.ndarray:
    """(k, k+1) teacher rows vᵢ = (wᵢ + ξcᵢu)/Nᵢ in the canonical frame's first k+1
    coordinates (span W, then u's unit part ⊥ span W); the remaining coordinates are 0."""
    xi, c = instance.xi, instance.c
    head = instance.w_factor + xi * c[:, None] * instance.u_w[None, :]
    tail = (xi * c * instance.u_perp)[:, None]
    return np.concatenate([head, tail], axis=1) / instance.teacher_norms()[:, None]


def _clip(rho):
    return np.clip(rho, -1.0, 1.0)


def network_loss_from_grams(activation, lam, teacher_gram, lam_hat, student_gram,
                            cross) -> np.ndarray:
    """E(f − f̂)² from Gram matrices; student arguments may carry leading batch axes.

    lam (k,), teacher_gram (k, k); lam_hat (..., k′), student_gram (..., k′, k′),
    cross (..., k, k′) = ⟨vᵢ, v̂ⱼ⟩. Returns an array of the batch shape.
    """

    lam, lam_hat = np.asarray(lam, float), np.asarray(lam_hat, float)
    k_t = lam @ hermite.dual_kernel(activation, _clip(teacher_gram)) @ lam
    k_s = np.einsum("...i,...ij,...j->...", lam_hat,
                    hermite.dual_kernel(activation, _clip(student_gram)), lam_hat)
    k_c = np.einsum("i,...ij,...j->...", lam,
                    hermite.dual_kernel(activation, _clip(cross)), lam_hat)
    return k_t + k_s - 2.0 * k_c


def network_loss(instance, rows_hat, lam_hat) -> np.ndarray:
    """Exact population loss of students with unit rows ``rows_hat`` (..., k′, D) in the
    canonical frame (D ≥ k+1 coordinates) and second layer ``lam_hat`` (..., k′) against
    the instance's teacher."""
    rows_hat = np.asarray(rows_hat, float)
    v = teacher_rows(instance)
    cross = np.einsum("id,...jd->...ij", v, rows_hat[..., : v.shape[1]])
    gram = np.einsum("...id,...jd->...ij", rows_hat, rows_hat)
    return network_loss_from_grams(instance.activation, instance.lam, instance.teacher_gram(),
                                   lam_hat, gram, cross)


def network_loss_from_overlaps(activation, lam, teacher_gram, lam_hat, student_gram,
                               cross) -> np.ndarray:
    """E(f − f̂)² for rows of any norm, arguments as :func:`network_loss_from_grams`.

    The fields (⟨ŵⱼ, x⟩, ⟨vᵢ, x⟩) are Gaussian with covariance C = [[Q, Rᵀ…]] built from the
    student Gram Q, cross = ⟨vᵢ, ŵⱼ⟩ and the teacher Gram T, so
    E(f − f̂)² = Σ_ab c_a c_b E[σ(a)σ(b)] over all k′ + k fields, c = (−λ̂, λ), each term a
    two-field integral (:class:`hermite.committee.CommitteeIntegrals`: closed forms for erf,
    linear, relu/abs, polynomials; quadrature otherwise). Equal to
    :func:`network_loss_from_grams` for unit rows.
    """
    lam_hat = np.asarray(lam_hat, float)
    gram = np.asarray(student_gram, float)
    cross = np.asarray(cross, float)
    T = np.asarray(teacher_gram, float)
    kp, k = gram.shape[-1], T.shape[-1]
    batch = gram.shape[:-2]
    C = np.empty(batch + (kp + k, kp + k))
    C[..., :kp, :kp] = gram
    C[..., :kp, kp:] = np.swapaxes(cross, -1, -2)
    C[..., kp:, :kp] = cross
    C[..., kp:, kp:] = T
    a, b = np.triu_indices(kp + k)
    pairs = np.empty(batch + (a.size, 2, 2))
    pairs[..., 0, 0], pairs[..., 1, 1] = C[..., a, a], C[..., b, b]
    pairs[..., 0, 1] = pairs[..., 1, 0] = C[..., a, b]
    from hermite.committee import CommitteeIntegrals  # numba: loaded on first use

    i2 = CommitteeIntegrals(activation).i2(pairs)
    coef = np.concatenate([-lam_hat, np.broadcast_to(np.asarray(lam, float),
                                                     batch + (k,))], axis=-1)
    mult = np.where(a == b, 1.0, 2.0)
    return np.sum(mult * coef[..., a] * coef[..., b] * i2, axis=-1)
