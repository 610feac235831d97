"""Population loss Φ(m) = E_x[(f*(x) − f̂(x))²] as a function of m = ⟨u, û⟩ (û ⊥ span W).

Expanding the square (paper App. D.1, proof of Prop. 4) with K the dual kernel:

    Φ(m) = Σᵢⱼ λᵢλⱼ K(⟨vᵢ, vⱼ⟩) + Σᵢⱼ λᵢλⱼ K(⟨v̂ᵢ, v̂ⱼ⟩) − 2 Σᵢⱼ λᵢλⱼ K(Pᵢⱼ + Qᵢⱼ m),

and dΦ/dm = −2 Σ λλ Q K′(ρ(m)) = −h(m). The loss carries no factor 1/2.
"""

from __future__ import annotations

import numpy as np

from hermite.expansion.gradient import check_overlap, h
from hermite.expansion.kernels import dual_kernel

__all__ = ["population_loss", "population_loss_derivative"]


def population_loss(instance, m, c_hat=None) -> np.ndarray:
    """Φ(m) for an array of overlaps m ∈ [−u⊥, u⊥] (exact: closed-form or certified K)."""
    m = check_overlap(m, bound=instance.u_perp)
    act = instance.activation
    lam2 = np.outer(instance.lam, instance.lam)
    const = float(np.sum(lam2 * dual_kernel(act, instance.teacher_gram()))
                  + np.sum(lam2 * dual_kernel(act, instance.student_gram(c_hat))))
    p, q = instance.correlation_affine(c_hat)
    flat = m.ravel()
    rho = np.clip(p.ravel()[None, :] + q.ravel()[None, :] * flat[:, None], -1.0, 1.0)
    cross = dual_kernel(act, rho) @ lam2.ravel()
    return (const - 2.0 * cross).reshape(m.shape)


def population_loss_derivative(instance, m, c_hat=None) -> np.ndarray:
    """dΦ/dm = −h(m)."""
    return -h(instance, m, c_hat=c_hat)
