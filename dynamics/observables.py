"""Observables recorded at checkpoints, shared by the full and the reduced engine.

- overlaps m = ⟨û, u⟩ and ⟨ĉ, c⟩/(‖ĉ‖‖c‖) come from the engines' states;
- the population loss E(f* − f̂)² is exact (``hermite.population_loss``) when û ⊥ span W
  (projected learner), with the frozen or the current ĉ; otherwise it is a Monte Carlo
  average over a fixed evaluation set, drawn in û's reduced coordinates (exact in law);
- the population-ODE prediction m̄_{t+1} = m̄_t + η h(m̄_t)(u_perp² − m̄_t²) (Prop. 4) from
  each run's own m₀, where it is exact (projected, ĉ frozen); NaN elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch

import hermite

from .activations import torch_activation
from .instance import Instance, build_instance
from .sampling import run_seed

__all__ = [
    "LOSS_EXACT",
    "LOSS_MONTE_CARLO",
    "EVAL_SIZE",
    "loss_kind",
    "unit_rows",
    "theory_applies",
    "group_runs",
    "record_theory",
    "finite_d_applies",
    "theory_records",
    "assemble_trajectory",
    "initial_drift_sign",
    "exact_loss",
    "loss_with_c_hat",
    "monte_carlo_loss",
    "reduced_coordinates",
    "c_overlap",
]

LOSS_EXACT = "exact"
LOSS_MONTE_CARLO = "monte_carlo"
EVAL_SIZE = 20_000
_EVAL_BLOCK = 2**22  # elements per Monte Carlo block (memory bound)


def unit_rows(config) -> bool:
    """Whether the config's instance uses the theory's unit rows (not an App. B convention)."""
    return config.instance.get("convention", "unit") == "unit"


def loss_kind(config) -> str:
    """``exact`` when û stays ⊥ span W (projected) with unit rows, else ``monte_carlo``."""
    return LOSS_EXACT if config.project and unit_rows(config) else LOSS_MONTE_CARLO


def theory_applies(config) -> bool:
    """Whether the population ODE of m is exact for this learner (projected, ĉ frozen, unit
    rows)."""
    return config.project and not config.joint_c and unit_rows(config)


def group_runs(instances: list[Instance]) -> list[tuple[Instance, np.ndarray]]:
    """Distinct instances (by identity) with the indices of their runs."""
    groups: dict[int, tuple[Instance, list[int]]] = {}
    for r, inst in enumerate(instances):
        groups.setdefault(id(inst), (inst, []))[1].append(r)
    return [(inst, np.asarray(idx)) for inst, idx in groups.values()]


def record_theory(config, instances: list[Instance], m0: np.ndarray,
                  steps: np.ndarray) -> np.ndarray:
    """(R, C) population-ODE prediction at ``steps`` from each run's m₀ (NaN if none)."""
    out = np.full((len(instances), len(steps)), np.nan)
    if not theory_applies(config):
        return out

    for inst, idx in group_runs(instances):
        out[idx] = hermite.population_ode(inst, config.eta, np.asarray(m0)[idx],
                                          np.asarray(steps))
    return out


FINITE_D_MAX_ETA_D = 10.0  # beyond η·d ≈ 10 SGD is far past its noise floor / diverges


def finite_d_applies(config) -> bool:
    """Whether the noise-corrected ODE and band are recorded: frozen ĉ, projected, b = 1 and
    η·d ≤ ``FINITE_D_MAX_ETA_D`` (the finite-d map is an expansion in η with ηd = O(1))."""
    d = build_instance(config.instance).d
    return (theory_applies(config) and config.batch == 1 and config.finite_d_theory
            and config.eta * d <= FINITE_D_MAX_ETA_D)


def theory_records(config, instances: list[Instance], m0: np.ndarray,
                   steps: np.ndarray) -> dict:
    """Every theory curve of a trajectory, as Trajectory keyword arguments.

    ``ode`` (plain population ODE, :func:`record_theory`) always; where
    :func:`finite_d_applies`, also ``ode_corrected`` (``hermite.corrected_ode`` at the run's
    d, η and label noise, from each run's m₀) and the 10–90% ``band_lower``/``band_upper`` of
    ``hermite.theory_band`` (mixture over the group's m₀).
    """
    out = {"ode": record_theory(config, instances, m0, steps)}
    if not finite_d_applies(config):
        return out

    shape = (len(instances), len(steps))
    corr, lo, hi = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    steps = np.asarray(steps)
    for inst, idx in group_runs(instances):
        m0_g = np.asarray(m0)[idx]
        corr[idx] = hermite.corrected_ode(inst, config.eta, inst.d, m0_g, steps,
                                          label_noise=config.label_noise)
        band = hermite.theory_band(inst, config.eta, inst.d, steps, m0=m0_g,
                                   label_noise=config.label_noise)
        lo[idx], hi[idx] = band.lower, band.upper
    out.update(ode_corrected=corr, band_lower=lo, band_upper=hi)
    return out


def initial_drift_sign(instances: list[Instance]) -> np.ndarray:
    """sign h(0) per run (Thm 5's aligned start needs m₀ h(0) > 0)."""

    out = np.zeros(len(instances))
    for inst, idx in group_runs(instances):
        out[idx] = np.sign(float(np.asarray(hermite.h(inst, 0.0)).reshape(-1)[0]))
    return out


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


def reduced_coordinates(u_hat: torch.Tensor, k: int) -> np.ndarray:
    """(R, k+2) coordinates of unit û that fix its law against x: (û_w, û_k, ‖rest‖)."""
    head = u_hat[:, : k + 1].detach().double().cpu().numpy()
    rest = torch.linalg.vector_norm(u_hat[:, k + 1:], dim=-1).double().cpu().numpy()
    return np.concatenate([head, rest[:, None]], axis=1)


def c_overlap(c_hat: np.ndarray, c: np.ndarray) -> np.ndarray:
    """⟨ĉ, c⟩/(‖ĉ‖‖c‖) over the last axis (= ⟨ĉ, c⟩/‖ĉ‖ for the unit c of the paper)."""
    num = (c_hat * c).sum(-1)
    return num / (np.linalg.norm(c_hat, axis=-1) * np.linalg.norm(c, axis=-1))


def _eval_set(seed: int, k: int, size: int) -> np.ndarray:
    """(size, k+2) standard normals: x's coordinates (span W, e = u's ⊥ direction, rest)."""
    return np.random.default_rng(run_seed(seed, 0, "eval")).standard_normal((size, k + 2))


def monte_carlo_loss(instances: list[Instance], coords: np.ndarray, c_hat: np.ndarray,
                     *, seed: int, size: int = EVAL_SIZE) -> np.ndarray:
    """(R, C) Monte Carlo population loss on one fixed evaluation set of ``size`` examples.

    coords : (R, C, k+2) reduced coordinates of û (see :func:`reduced_coordinates`);
    c_hat : (R, k) or (R, C, k). Because x is isotropic, ⟨û, x⟩ only needs these
    coordinates, so the estimate costs O(size·k²) per run, independent of d.
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


def assemble_trajectory(config, instances: list[Instance], steps: np.ndarray,
                        overlap: np.ndarray, c_hats: np.ndarray | None,
                        coords: np.ndarray | None, diverged_step: np.ndarray, m0: np.ndarray,
                        *, dtype: str, device, engine: str):
    """The Trajectory both engines return, from their raw checkpoint records.

    overlap (R, C); c_hats (R, C, k) when ĉ is trained; coords (R, C, k+2) of û in
    span(W) ⊕ e ⊕ rest (needed for the Monte Carlo loss and for ``config.refit``). Records
    from the step a run diverged on are set to NaN; loss and theory curves follow
    :func:`exact_loss` / :func:`monte_carlo_loss` and :func:`theory_records`; with
    ``config.refit``, ``extra`` holds ``dynamics.refit.refit_records`` (App. F.2).
    """
    from .trajectory import Trajectory

    dead = (diverged_step[:, None] >= 0) & (steps[None, :] >= diverged_step[:, None])
    overlap = np.where(dead, np.nan, overlap)
    c_ov = None
    if c_hats is not None:
        c_hats = np.where(dead[..., None], np.nan, c_hats)
        c_ov = c_overlap(c_hats, np.stack([i.c for i in instances])[:, None, :])
    kind = loss_kind(config)
    if kind == LOSS_EXACT:
        loss = exact_loss(instances, overlap, c_hats)
    else:
        coords = np.where(dead[..., None], np.nan, coords)
        ch = c_hats if c_hats is not None else np.stack([i.c_hat for i in instances])
        loss = monte_carlo_loss(instances, coords, ch, seed=config.seed, size=config.eval_size)
    extra = {}
    if config.refit:
        from .refit import refit_records

        extra.update(refit_records(config, instances, coords, dead))
    return Trajectory(
        steps=steps, overlap=overlap, loss=loss,
        **theory_records(config, instances, m0, steps), diverged_step=diverged_step,
        xi=np.array([i.xi for i in instances]),
        instance_seed=np.array([i.seed for i in instances], dtype=np.int64),
        c_overlap=c_ov, loss_kind=kind, dtype=dtype, device=str(device), engine=engine, m0=m0,
        extra=extra,
    )
