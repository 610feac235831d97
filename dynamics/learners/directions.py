"""Initial student directions û₀ (shared by every learner that learns a direction)."""

from __future__ import annotations

import numpy as np

from dynamics.overlays.finetune import initial_drift_sign
from dynamics.randomness.sampling import uniform_perp_directions

__all__ = ["initial_directions", "overlap_np"]


def initial_directions(config, instances) -> tuple[np.ndarray, np.ndarray]:
    """(û₀ (R, d), m₀ (R,)) float64: uniform on S(span W^⊥), flipped if ``init=aligned``."""
    inst0 = instances[0]
    u0 = uniform_perp_directions(config.seed, config.runs, inst0.d, inst0.k)
    m0 = overlap_np(u0, instances)
    if config.options.init == "aligned":
        flip = m0 * initial_drift_sign(instances) < 0
        u0[flip] *= -1.0
        m0[flip] *= -1.0
    return u0, m0


def overlap_np(u: np.ndarray, instances) -> np.ndarray:
    """⟨û, u⟩ per run for û (R, d) in the canonical frame."""
    k = instances[0].k
    u_w = np.stack([i.u_w for i in instances])
    u_perp = np.array([i.u_perp for i in instances])
    return (u[:, :k] * u_w).sum(1) + u[:, k] * u_perp
