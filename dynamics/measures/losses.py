"""Population loss E(f* − f̂)² of rank-1 (û, ĉ) students: exact in every regime that has a
Gaussian pair kernel, Monte Carlo only where none exists.

* Projected û (û ⊥ span W) with unit rows, frozen or current ĉ: :func:`exact_loss` from the
  overlap m alone (``hermite.population_loss``, dual kernels; App. D.1).
* Every other state of the ``finetune`` learner — unprojected û (``--no-project``), u with a
  component in span W (``u_alpha > 0``), joint ĉ, the App. B conventions (``appB``,
  ``appB-sqrt``: fixed row scale s, output 1/ξ): :func:`coordinate_loss`, the exact
  L(û, ĉ) of :class:`hermite.finetune.population.FinetuneModel` from û's reduced coordinates
  (p = its coordinates in span W, μ = along e, u's direction ⊥ span W) and ĉ. Its kernel
  :class:`~hermite.finetune.population.PairKernel` κ(q, q′, c) = E σ(a)σ(b): the dual kernel
  K(ρ) for unit rows (closed form or the certified Chebyshev interpolant); for App. B rows a
  closed form for positively homogeneous σ (relu, abs, linear, quadratic, σ(a·x) of them)
  and erf(a·x), and otherwise (sigmoid, tanh, Hermite polynomials) Mehler's series, exact
  for polynomials; for a quadrature-only σ its error (``PairKernel.error_note``, 160 terms,
  240 Gauss–Hermite nodes, against composite 2-D Gauss–Legendre) is ≤ 2e-16 for sigmoid,
  and for tanh ≤ 5e-16 at row variance ≤ 1, 2e-13 at 2, 4e-10 at 4, 2e-7 at 8
  (docs/theory/joint-c.md).
* No Gaussian pair kernel (App. B rows with a piecewise σ other than relu/abs, e.g. a user's
  σ with breakpoints; the registry has none): :func:`monte_carlo_loss`, an average over one
  fixed evaluation set of ``config.eval_size`` examples drawn in û's reduced coordinates
  (exact in law, cost independent of d).

:func:`loss_kind` says which (``exact`` or ``monte_carlo``); :func:`needs_coordinates` says
whether a run must keep û's reduced coordinates (every case but the projected unit-row one,
and always with ``refit``).
"""

from __future__ import annotations

import numpy as np

import hermite
from dynamics.activations import get_activation, torch_activation
from dynamics.instances.instance import Instance
from dynamics.lazy import lazy_import
from dynamics.measures.observables import group_runs, unit_rows
from dynamics.randomness.sampling import run_seed

torch = lazy_import("torch")  # loaded at its first use

__all__ = [
    "LOSS_EXACT",
    "LOSS_MONTE_CARLO",
    "EVAL_SIZE",
    "loss_kind",
    "overlap_suffices",
    "needs_coordinates",
    "pair_kernel",
    "exact_loss",
    "coordinate_loss",
    "loss_with_c_hat",
    "monte_carlo_loss",
]

LOSS_EXACT = "exact"
LOSS_MONTE_CARLO = "monte_carlo"
EVAL_SIZE = 20_000
_EVAL_BLOCK = 2**22  # elements per Monte Carlo block (memory bound)
_KERNEL_BLOCK = 2**22  # elements per block of the coordinate loss (Mehler: states·k·nodes)
_KERNELS: dict = {}  # (id(activation), unit rows) → (activation, PairKernel or None)


def overlap_suffices(config) -> bool:
    """Whether the overlap m alone fixes the loss: û projected (⊥ span W) with unit rows."""
    return bool(config.options.project) and unit_rows(config)


def needs_coordinates(config) -> bool:
    """Whether the runs must keep û's reduced coordinates (k + 2 per checkpoint): for the loss
    everywhere but the projected unit-row case, and always for ``refit``."""
    return not overlap_suffices(config) or bool(config.options.refit)


def pair_kernel(activation, unit: bool):
    """The :class:`hermite.PairKernel` of σ for unit (``unit``) or App. B rows, or None where
    none exists (App. B rows with a piecewise σ other than relu/abs); one per (σ, unit)."""
    act = get_activation(activation)
    key = (id(act), bool(unit))
    hit = _KERNELS.get(key)
    if hit is None or hit[0] is not act:
        try:
            kernel = hermite.PairKernel(act, unit_rows=bool(unit))
        except ValueError:
            kernel = None
        hit = _KERNELS[key] = (act, kernel)  # the activation kept alive: its id stays its own
    return hit[1]


def loss_kind(config) -> str:
    """``exact`` wherever a Gaussian pair kernel gives the loss (projected unit rows: from m;
    any other state: :func:`coordinate_loss`), ``monte_carlo`` where none exists (App. B rows
    with a piecewise σ other than relu/abs)."""
    if overlap_suffices(config) or unit_rows(config):
        return LOSS_EXACT
    try:
        kernel = pair_kernel(config.instance.get("activation"), unit=False)
    except ValueError:  # an unknown activation: the config's validation says so
        return LOSS_MONTE_CARLO
    return LOSS_EXACT if kernel is not None else LOSS_MONTE_CARLO


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


def coordinate_loss(instances: list[Instance], coords: np.ndarray, c_hat: np.ndarray,
                    *, eta: float = 1.0) -> np.ndarray:
    """(R, C) exact population loss L(û, ĉ) of any finetune state, from û's reduced
    coordinates (:func:`hermite.FinetuneModel.loss`, module docstring).

    coords : (R, C, k+2) as :func:`dynamics.measures.observables.reduced_coordinates` records them
    (p = coords[..., :k] in span W, μ = coords[..., k]; ν does not enter the loss);
    c_hat : (R, k) (frozen, one per run) or (R, C, k). ``eta`` > 0 only builds the model (the
    run's η; it does not enter the loss). NaN where the state is not finite. Raises
    ValueError where σ has no pair kernel (see :func:`loss_kind`).
    """
    coords = np.asarray(coords, dtype=float)
    runs, cps, k2 = coords.shape
    k = k2 - 2
    c_hat = np.asarray(c_hat, dtype=float)
    if c_hat.ndim == 2:
        c_hat = np.broadcast_to(c_hat[:, None, :], (runs, cps, k))
    out = np.full((runs, cps), np.nan)
    for inst, idx in group_runs(instances):
        kernel = pair_kernel(inst.activation, inst.unit_rows)
        if kernel is None:
            raise ValueError(f"no Gaussian pair kernel of activation {inst.activation.name!r} "
                             f"for convention {inst.convention!r}: the loss is Monte Carlo")
        model = hermite.FinetuneModel(inst, eta, project=False, kernel=kernel)
        p = coords[idx, :, :k].reshape(-1, k)
        mu = coords[idx, :, k].reshape(-1)
        ch = c_hat[idx].reshape(-1, k)
        ok = np.flatnonzero(np.isfinite(p).all(1) & np.isfinite(mu) & np.isfinite(ch).all(1))
        vals = np.full(p.shape[0], np.nan)
        nodes = max(k, getattr(kernel, "nodes", 0), getattr(kernel, "terms", 0) + 1)
        block = max(1, _KERNEL_BLOCK // (k * nodes))
        for j0 in range(0, ok.size, block):
            sel = ok[j0:j0 + block]
            vals[sel] = model.loss(p[sel], mu[sel], ch[sel])
        out[idx] = vals.reshape(idx.size, cps)
    return out


def _eval_set(seed: int, k: int, size: int) -> np.ndarray:
    """(size, k+2) standard normals: x's coordinates (span W, e = u's ⊥ direction, rest)."""
    return np.random.default_rng(run_seed(seed, 0, "eval")).standard_normal((size, k + 2))


def monte_carlo_loss(instances: list[Instance], coords: np.ndarray, c_hat: np.ndarray,
                     *, seed: int, size: int = EVAL_SIZE) -> np.ndarray:
    """(R, C) Monte Carlo population loss on one fixed evaluation set of ``size`` examples:
    the loss only where no Gaussian pair kernel exists (:func:`loss_kind`).

    coords : (R, C, k+2) reduced coordinates of û (see
    :func:`dynamics.measures.observables.reduced_coordinates`); c_hat : (R, k) or (R, C, k).
    Because x is isotropic, ⟨û, x⟩ only needs these coordinates, so the estimate costs O(size·k²)
    per run, independent of d.
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
