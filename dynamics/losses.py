"""Population loss E(f* − f̂)² of rank-1 (û, ĉ) students, exact or Monte Carlo.

Exact (``hermite.population_loss``, dual kernels) when û ⊥ span W (projected learner) with
unit rows, with the frozen or the current ĉ; otherwise a Monte Carlo average over one fixed
evaluation set, drawn in û's reduced coordinates (exact in law, cost independent of d).
"""

from __future__ import annotations

import numpy as np

import hermite

from .activations import torch_activation
from .instance import Instance
from .lazy import lazy_import
from .observables import group_runs, unit_rows
from .sampling import run_seed

torch = lazy_import("torch")  # loaded at its first use

__all__ = [
    "LOSS_EXACT",
    "LOSS_MONTE_CARLO",
    "EVAL_SIZE",
    "loss_kind",
    "exact_loss",
    "loss_with_c_hat",
    "monte_carlo_loss",
]

LOSS_EXACT = "exact"
LOSS_MONTE_CARLO = "monte_carlo"
EVAL_SIZE = 20_000
_EVAL_BLOCK = 2**22  # elements per Monte Carlo block (memory bound)


def loss_kind(config) -> str:
    """``exact`` when û stays ⊥ span W (projected) with unit rows, else ``monte_carlo``."""
    return LOSS_EXACT if config.options.project and unit_rows(config) else LOSS_MONTE_CARLO


def exact_loss(instances: list[Instance], overlap: np.ndarray,
               c_hat: np.ndarray | None = None) -> np.ndarray:
    """(R, C) exact population loss for û ⊥ span W at overlaps m (R, C).

    ``c_hat``: None (each instance's frozen ĉ), (R, k) per run, or (R, C, k) per checkpoint
    (joint training; evaluated for all checkpoints at once, see :func:`loss_with_c_hat`).
    """

    overlap = np.asarray(overlap, dtype=float)
    out = np.full(overlap.shape, np.nan)
    ok = np.isfinite(overlap)
    for inst, idx in group_runs(instances):
        for r in idx:
            if c_hat is not None and np.ndim(c_hat) == 3:
                out[r, ok[r]] = loss_with_c_hat(inst, overlap[r, ok[r]], c_hat[r, ok[r]])
                continue
            ch = None if c_hat is None else c_hat[r]
            out[r, ok[r]] = hermite.population_loss(inst, overlap[r, ok[r]], c_hat=ch)
    return out


def loss_with_c_hat(inst: Instance, m: np.ndarray, c_hat: np.ndarray) -> np.ndarray:
    """Φ(mₙ; ĉₙ) for pairs (n,) × (n, k) in one dual-kernel call (App. D.1):

    Φ = Σ λλ K(⟨vᵢ,vⱼ⟩) + Σ λλ K(⟨v̂ᵢ,v̂ⱼ⟩) − 2 Σ λλ K(Pᵢⱼ + Qᵢⱼ m), as in
    ``hermite.population_loss`` (which takes one ĉ per call).
    """

    act, xi, g = inst.activation, inst.xi, inst.gram
    lam2 = np.outer(inst.lam, inst.lam)
    nt = inst.teacher_norms()
    nh = np.sqrt(1.0 + (xi * c_hat) ** 2)  # (n, k) student norms for û ⊥ span W
    outer_nh = nh[:, :, None] * nh[:, None, :]
    student = (g[None] + xi**2 * c_hat[:, :, None] * c_hat[:, None, :]) / outer_nh
    denom = nt[None, :, None] * nh[:, None, :]
    p = (g + xi * np.outer(inst.c, inst.w_dot_u))[None] / denom
    q = xi**2 * inst.c[None, :, None] * c_hat[:, None, :] / denom
    cross = p + q * np.asarray(m, dtype=float)[:, None, None]
    k_t = float(np.sum(lam2 * hermite.dual_kernel(act, inst.teacher_gram())))
    k_s = hermite.dual_kernel(act, np.clip(student, -1.0, 1.0))
    k_c = hermite.dual_kernel(act, np.clip(cross, -1.0, 1.0))
    return k_t + (lam2 * k_s).sum((1, 2)) - 2.0 * (lam2 * k_c).sum((1, 2))


def _eval_set(seed: int, k: int, size: int) -> np.ndarray:
    """(size, k+2) standard normals: x's coordinates (span W, e = u's ⊥ direction, rest)."""
    return np.random.default_rng(run_seed(seed, 0, "eval")).standard_normal((size, k + 2))


def monte_carlo_loss(instances: list[Instance], coords: np.ndarray, c_hat: np.ndarray,
                     *, seed: int, size: int = EVAL_SIZE) -> np.ndarray:
    """(R, C) Monte Carlo population loss on one fixed evaluation set of ``size`` examples.

    coords : (R, C, k+2) reduced coordinates of û (see
    :func:`dynamics.observables.reduced_coordinates`); c_hat : (R, k) or (R, C, k). Because x
    is isotropic, ⟨û, x⟩ only needs these coordinates, so the estimate costs O(size·k²) per
    run, independent of d.
    """
    runs, cps, k2 = coords.shape
    k = k2 - 2
    xs = torch.as_tensor(_eval_set(seed, k, size))
    xw, xe = xs[:, :k], xs[:, k]
    out = np.full((runs, cps), np.nan)
    for inst, idx in group_runs(instances):
        act, l_t = torch_activation(inst.activation), torch.as_tensor(inst.w_factor).T
        z = xw @ l_t
        u_dot = xw @ torch.as_tensor(inst.u_w) + inst.u_perp * xe
        t_pre = (z + inst.xi * torch.as_tensor(inst.c) * u_dot[:, None]) / torch.as_tensor(
            inst.teacher_norms())
        lam = torch.as_tensor(inst.lam * inst.output_scale)
        y = act.fn(t_pre) @ lam
        block = max(1, _EVAL_BLOCK // (size * k))
        for r in idx:
            cr = torch.as_tensor(coords[r])
            chr_ = torch.as_tensor(c_hat[r] if np.ndim(c_hat) == 3 else
                                   np.broadcast_to(c_hat[r], (cps, k)).copy())
            for j0 in range(0, cps, block):
                sl = slice(j0, j0 + block)
                out[r, sl] = _student_loss(inst, xs, z, y, lam, cr[sl], chr_[sl])
    return out


def _student_loss(inst, xs, z, y, lam, coords, c_hat) -> np.ndarray:
    """Mean (y − f̂)² for a block of checkpoints: coords (B, k+2), c_hat (B, k)."""
    k = inst.k
    s = xs @ coords.T  # (n, B): ⟨û, x⟩ = û_w·x_w + û_k x_k + ‖rest‖ x_rest
    omega = coords[:, :k] @ torch.as_tensor(inst.w_factor).T  # (B, k) ⟨wⱼ, û⟩
    xc = inst.xi * c_hat
    if inst.unit_rows:
        scale = torch.rsqrt(1.0 + xc * (2.0 * omega + xc))
    else:  # App. B: fixed row factor (lam already carries 1/ξ)
        scale = torch.full_like(xc, inst.row_scale)
    a = (z[:, None, :] + xc[None] * s[..., None]) * scale[None]
    f_hat = torch_activation(inst.activation).fn(a) @ lam
    return ((y[:, None] - f_hat) ** 2).mean(0).numpy()
