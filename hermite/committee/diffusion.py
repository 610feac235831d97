r"""The committee machine's order parameters as a diffusion: SGD's step noise in the escape.

The ODE of :mod:`.ode` is the mean of one step: X = (Q, R, v) moves by (1/N) dX/dα per step,
deterministically as N → ∞. At finite N each step also carries a fluctuation of order η̄/N,
so over dα (αN steps) the order parameters pick up a Gaussian kick of covariance
(η̄²/(N b)) Cov(ξ) dα, ξ the per-example increment at unit step. Along the ODE's path that
noise is negligible — except on a plateau with an unstable direction: there the student's
initial asymmetry (O(N^{-1/2})) and the noise's (variance ∝ η̄²α/N) are of the same order,
both are amplified until the escape, and the noiseless ODE escapes late (ReLU, K = M = 2,
η·d = 0.5: 26–44 % above SGD's mean loss; docs/theory/committee.md).

This module integrates the Itô diffusion (the standard diffusion approximation of online
SGD's order parameters, leading order in 1/N; Heun's step for the drift, the kick after it)

    dX = F(X) dα + (η̄/√(N b)) Cov(ξ)^{1/2} dB_α,

F the ODE's drift with its η̄² terms, by steps ``dalpha`` (Heun for the drift) over ``paths``
paths per start. Per-example increments (unit rows; free rows drop the terms in u = 1):

    ζ_R[k, m] = −δ_k (ν_m − u λ_k R_km),
    ζ_Q[k, l] = −(δ_k (λ_l − u λ_k Q_kl) + δ_l (λ_k − u λ_l Q_kl)),
    ζ_v[k]   = 2 s e g(λ_k)  (η̄_v in place of η̄; trained second layer only),

with δ_k of :mod:`.ode` (squared: −2 s v_k g′(λ_k) e, e = y − ŷ; correlation: −s y v_k g′(λ_k);
label noise in y). E ζ is the ODE's first-order drift over η̄. One step moves X by
(η̄/N)(ζ + η̄χ) (‖x‖² = N), χ the second-order part whose mean gives the ODE's η̄² terms:

    χ_R[k, m] = −½ u δ_k² R_km,   χ_Q[k, l] = δ_k δ_l − ½ u (δ_k² + δ_l²) Q_kl,

of the same order as ζ at η̄ ~ 1, so the noise is that of ξ = ζ + (η̄/b)χ (exact for b = 1 to
leading order in 1/N; for b > 1 the examples' second-order cross terms are left out).
Each step draws per path n examples z (n = :func:`diffusion_points`), their fields f = L z
(LLᵀ = [[Q, R], [Rᵀ, T]]) and n weights wᵢ ~ N(0, 1):

* the kick is η̄ √(dα/(N b)) Σᵢ wᵢ (ξᵢ − ξ̄)/√n: given the examples, Gaussian with the sample
  covariance of ξ, so η̄² Cov(ξ) dα/(N b) on average (SGD's own kick over dα is the sum of
  αN centred increments);
* S = E[δδᵀ] of the η̄² terms is the sample mean over the same n examples: unbiased, so no
  quadrature is needed, any σ; its fresh error each step acts as a spurious extra noise,
  kept below 5 % of the step noise's variance by n (:func:`diffusion_points`).

Unit rows keep Q_kk = 1 exactly (ζ_Q[k, k] = 0); a path whose joint Gram a kick makes
indefinite (next to R = T) is moved to the nearest PSD one (:func:`psd_repaired`, counted).
The theory is the mean over paths, a Monte Carlo estimate with its standard error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from hermite.activations_numba import compiled_activation
from hermite.committee.ode import (
    CommitteeModel,
    _check_alphas,
    _terms_batch,
    committee_alignment_batch,
    committee_loss_batch,
    drift_from_terms,
    joint_cov_batch,
)

__all__ = ["DIFFUSION_STEP", "DiffusionTrajectory", "committee_diffusion",
           "sample_sums_numpy", "psd_repaired", "compiled_code",
           "diffusion_points"]

DIFFUSION_STEP = 0.1  # dα of a step (Heun; noiseless: within 0.003 of the ODE, free-row erf)


@dataclass(frozen=True)
class DiffusionTrajectory:
    """Per start (S starts): the mean over its paths of the loss and alignment (S, C) at
    ``alpha`` (C,), their standard errors (S, C), ``paths`` per start, Heun
    ``steps``, and ``repaired`` (path-steps moved back to a PSD Gram)."""

    alpha: np.ndarray
    loss: np.ndarray
    alignment: np.ndarray
    loss_se: np.ndarray
    alignment_se: np.ndarray
    paths: int
    steps: int
    repaired: int


def compiled_code(model: CommitteeModel):
    """(code, p, scale) of the compiled σ(x) = σ_code(scale·x) when the model's activation is
    a registry entry or one scaled (nn2pp's erf(x/√2)), or None (then
    :func:`sample_sums_numpy`)."""
    return compiled_activation(model.integrals.activation)


def sample_sums_numpy(model: CommitteeModel, L, z, w, v, Q, R):
    """(S (B, K, K), kick_Q (B, K, K), kick_R (B, K, M), kick_v (B, K)) over each path's n
    points z (B, n, P + 1) with weights w (B, n) (module docstring; the reference of the compiled
    sums): S = mean δδᵀ, kick = Σᵢ wᵢ (ξᵢ − ξ̄)/√n, ξ = ζ + (η̄/b)χ."""
    K, M = v.shape[1], model.M
    act = model.integrals.activation
    f = np.einsum("bac,bnc->bna", L, z[..., :K + M])
    lam, nu = f[..., :K], f[..., K:]
    y = act.fn(nu) @ model.A + math.sqrt(model.noise_var) * z[..., K + M]
    g, gp = act.fn(lam), act.deriv(lam)
    e = y - np.einsum("bnk,bk->bn", g, v)
    s, v_eff = float(model.loss_scale), _v_eff(model, v)
    if model.loss == "squared":
        dl = -model.gamma * s * v_eff[:, None] * gp * e[..., None]
    else:
        dl = -s * v_eff[:, None] * gp * y[..., None]
    u, c2 = (1.0 if model.rows == "unit" else 0.0), float(model.lr) / model.batch
    zR = -dl[..., None] * (nu[..., None, :] - u * lam[..., None] * R[:, None]
                           + u * 0.5 * c2 * dl[..., None] * R[:, None])
    t1 = dl[..., None] * (lam[..., None, :] - u * lam[..., None] * Q[:, None])
    sq = dl * dl
    zQ = c2 * (dl[..., None] * dl[..., None, :]
               - u * 0.5 * (sq[..., None] + sq[..., None, :]) * Q[:, None]) \
        - (t1 + np.swapaxes(t1, -1, -2))
    zv = 2.0 * s * e[..., None] * g
    n = z.shape[1]

    def kick(zz):
        return np.einsum("bn,bn...->b...", w, zz - zz.mean(1, keepdims=True)) / math.sqrt(n)

    return np.einsum("bnk,bnl->bkl", dl, dl) / n, kick(zQ), kick(zR), kick(zv)


def _v_eff(model: CommitteeModel, v):
    return v if model.trainable is None else v * np.asarray(model.trainable, dtype=float)


def _sums(model, code, L, z, w, v, Q, R, kicks: bool = True):
    if code is None:
        return sample_sums_numpy(model, L, z, w, v, Q, R)
    from hermite.committee._diffusion_numba import sample_sums

    B, K, M = v.shape[0], v.shape[1], model.M
    out = (np.empty((B, K, K)), np.empty((B, K, K)), np.empty((B, K, M)), np.empty((B, K)))
    sample_sums(np.ascontiguousarray(L), z, w, np.ascontiguousarray(v),
                np.ascontiguousarray(_v_eff(model, v)), np.ascontiguousarray(model.A, float),
                np.ascontiguousarray(Q), np.ascontiguousarray(R), model.rows == "unit",
                model.loss == "squared", float(model.loss_scale), float(model.gamma),
                math.sqrt(model.noise_var), float(model.lr) / model.batch, *code, kicks, *out)
    return out


def diffusion_points(lr: float, N: float, batch: int, dalpha: float = DIFFUSION_STEP) -> int:
    """Examples per step n (a power of 2 in [64, 4096]) for which the sampled S adds ≤ 5 % to
    the step noise's variance: its error is fresh each step, a spurious diffusion of variance
    ≈ dα η̄⁴ Var(δδ)/n per unit α against the step noise's η̄² Var(ζ)/(N b); measured on ReLU's
    plateau (K = M = 2, N = 1000, η̄ = 0.5), 5 % needs n ≈ 20 dα η̄² N / b."""
    need = 20.0 * dalpha * lr * lr * N / batch
    return int(2 ** min(12, max(6, math.ceil(math.log2(max(need, 1.0))))))


def psd_repaired(Q, R, T, unit: bool, tol: float = math.inf):
    """(Q, R, moved (B,)): each state whose joint Gram [[Q, R], [Rᵀ, T]] is indefinite (by at
    most ``tol``·max(1, ‖Q‖_max): a larger violation is left as it is) gets
    Q = R T⁻¹ Rᵀ + (the Schur complement's PSD part), then unit rows Q ← DQD, R ← DR with
    D = diag(Q)^{−1/2} (which keeps it PSD); the others are returned as they are."""
    Q, R = Q.copy(), R.copy()
    tinv = np.linalg.pinv(np.asarray(T, dtype=np.float64), hermitian=True)
    base = R @ tinv @ np.swapaxes(R, 1, 2)
    w, vecs = np.linalg.eigh(0.5 * ((Q - base) + np.swapaxes(Q - base, 1, 2)))
    bound = tol * np.maximum(1.0, np.abs(Q).max((1, 2))) if math.isfinite(tol) else math.inf
    moved = (w[:, 0] < 0.0) & (w[:, 0] >= -bound)
    if moved.any():
        wv, vv = np.clip(w[moved], 0.0, None), vecs[moved]
        q = base[moved] + np.einsum("bij,bj,bkj->bik", vv, wv, vv)
        q = 0.5 * (q + np.swapaxes(q, 1, 2))
        r = R[moved]
        if unit:
            dinv = 1.0 / np.sqrt(np.diagonal(q, axis1=1, axis2=2))
            q, r = q * dinv[:, :, None] * dinv[:, None, :], r * dinv[:, :, None]
            q[:, np.arange(q.shape[1]), np.arange(q.shape[1])] = 1.0
        Q[moved], R[moved] = q, r
    return Q, R, moved


def _drift(model: CommitteeModel, first: CommitteeModel, S, Q, R, v):
    """(dQ, dR, dv)/dα: the first-order terms in closed form (``first``: the model without
    its η̄² terms), the η̄² ones from the sampled S."""
    D, _, Gv, _ = _terms_batch(first, Q, R, v)
    return drift_from_terms(model, D, S if model.second_order else 0.0 * S, Gv, Q, R)


def _tidy(Q, R, T, unit: bool):
    """Q symmetric with unit diagonal (unit rows), then :func:`psd_repaired`."""
    Q = 0.5 * (Q + np.swapaxes(Q, 1, 2))
    if unit:
        Q[:, np.arange(Q.shape[1]), np.arange(Q.shape[1])] = 1.0
    return psd_repaired(Q, R, T, unit)


def _factor(C):
    """A square root L (LLᵀ = C) of each PSD C (B, P, P): Cholesky, or V√w for the few that
    are only semidefinite."""
    try:
        return np.linalg.cholesky(C)
    except np.linalg.LinAlgError:
        w, V = np.linalg.eigh(C)
        return V * np.sqrt(np.clip(w, 0.0, None))[:, None, :]


def committee_diffusion(model: CommitteeModel, states, alphas, N: float, *, paths: int = 16,
                        dalpha: float = DIFFUSION_STEP, points: int | None = None,
                        seed: int = 0, diagonal: bool = False,
                        compiled: bool = True) -> DiffusionTrajectory:
    """Integrate the diffusion (module docstring) from each of ``states`` with ``paths``
    paths each to the times ``alphas`` (α = steps/N, from 0), in dimension ``N``; the loss
    and alignment (``diagonal``: ``sparse``'s) averaged over each start's paths. Seeded:
    the same arguments give the same numbers (``compiled``: numba sums where σ has a code,
    else numpy; both the same law)."""
    alphas = _check_alphas(alphas)
    for name, val, lo in (("N", N, 1.0), ("paths", paths, 1),
                          ("points", 2 if points is None else points, 2)):
        if not (math.isfinite(float(val)) and val >= lo):
            raise ValueError(f"{name} must be ≥ {lo}, got {val}")
    if not (math.isfinite(float(dalpha)) and dalpha > 0):
        raise ValueError(f"dalpha must be > 0, got {dalpha}")
    states = [model.check_state(s) for s in states]
    starts = len(states)
    Q = np.repeat(np.stack([s.Q for s in states]), paths, 0)
    R = np.repeat(np.stack([s.R for s in states]), paths, 0)
    v = np.repeat(np.stack([s.v for s in states]), paths, 0)
    B, K = Q.shape[:2]
    P = K + model.M
    first = replace(model, second_order=False)
    code = compiled_code(model) if compiled else None
    rng = np.random.default_rng(seed)
    lr = float(model.lr)
    if points is None:
        points = diffusion_points(lr, N, model.batch, dalpha)
    lr_v = None if model.lr_v is None else float(model.lr_v)
    unit = model.rows == "unit"
    loss, align = np.empty((B, alphas.size)), np.empty((B, alphas.size))
    now, steps, repaired = 0.0, 0, 0
    for ci, target in enumerate(alphas):
        while now < target * (1.0 - 1e-12):
            h = min(dalpha, target - now)
            L = _factor(joint_cov_batch(model, Q, R))
            z = rng.standard_normal((B, points, P + 1))  # each path's examples of the step
            S, kQ, kR, kv = _sums(model, code, L, z, rng.standard_normal((B, points)), v, Q, R)
            # Heun's step for the drift (S at the predictor from the same examples), the kick
            f0 = _drift(model, first, S, Q, R, v)
            Qp, Rp, _ = _tidy(Q + h * f0[0], R + h * f0[1], model.T, unit)
            vp = v + h * f0[2]
            Sp = _sums(model, code, _factor(joint_cov_batch(model, Qp, Rp)), z,
                       np.zeros((B, points)), vp, Qp, Rp, kicks=False)[0]
            f1 = _drift(model, first, Sp, Qp, Rp, vp)
            scale = math.sqrt(h / (N * model.batch))
            Q = Q + 0.5 * h * (f0[0] + f1[0]) + scale * lr * kQ
            R = R + 0.5 * h * (f0[1] + f1[1]) + scale * lr * kR
            if lr_v is not None:
                v = v + 0.5 * h * (f0[2] + f1[2]) + scale * lr_v * kv
            Q, R, moved = _tidy(Q, R, model.T, unit)
            repaired += int(moved.sum())
            now += h
            steps += 1
        loss[:, ci] = committee_loss_batch(model, Q, R, v)
        align[:, ci] = committee_alignment_batch(Q, R, model.T, diagonal)
    shape = (starts, paths, alphas.size)
    lo, al = loss.reshape(shape), align.reshape(shape)
    se = (lambda a: a.std(1, ddof=1) / math.sqrt(paths)) if paths > 1 else \
        (lambda a: np.full(a.shape[::2], np.nan))
    return DiffusionTrajectory(alphas, lo.mean(1), al.mean(1), se(lo), se(al), int(paths),
                               steps, repaired)
