"""h(m) and Φ(m) against Monte Carlo estimates from per-example gradients and losses.

Canonical frame (docs/model.md, "Canonical frame"): coordinates 0..k−1 span W with
W = [L, 0], coordinate k carries Π⊥u: u = (u_w, u⊥, 0), and û = (0, m/u⊥, √(1 − m²/u⊥²)) ⊥ W with
⟨u, û⟩ = m. Only these k + 2 coordinates of x enter. The per-example projected spherical
gradient ∇̂L = (I − ûûᵀ)Π ∇_û L is written in closed form (checked against torch autograd
below), and −⟨∇̂L, u⟩/(u⊥² − m²) is an unbiased estimate of h(m) (Prop. 4).
"""

import numpy as np
import pytest
import torch

from dynamics.instances.instance import build_instance
from hermite import h, population_loss

N_SAMPLES = 1_000_000
CHUNK = 200_000


def _frame(inst, m):
    k = inst.k
    w = np.zeros((k, k + 2))
    w[:, :k] = inst.w_factor
    u = np.zeros(k + 2)
    u[:k] = inst.u_w
    u[k] = inst.u_perp
    uh = np.zeros(k + 2)
    uh[k] = m / inst.u_perp
    uh[k + 1] = np.sqrt(1.0 - (m / inst.u_perp) ** 2)
    v = w + inst.xi * np.outer(inst.c, u)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    vh_raw = w + inst.xi * np.outer(inst.c_hat, uh)
    nh = np.linalg.norm(vh_raw, axis=1)
    return w, u, uh, v, vh_raw / nh[:, None], nh


def _per_example(inst, m, x):
    """(−⟨∇̂L, u⟩, L) for each row of x (closed form)."""
    act, lam, xi = inst.activation, inst.lam, inst.xi
    _, u, uh, v, vh, nh = _frame(inst, m)
    zs, zh = x @ v.T, x @ vh.T
    resid = act.fn(zs) @ lam - act.fn(zh) @ lam
    g = -2.0 * resid * (act.deriv(zh) @ (lam * xi * inst.c_hat / nh))  # ∇_û L = g · x  (+ ∥ w, û)
    k = inst.k
    proj_u = x[:, k] * inst.u_perp - m * (x @ uh)  # ⟨(I − ûûᵀ)Π x, u⟩
    return -g * proj_u, resid**2


def _mc(inst, m, seed):
    rng = np.random.default_rng(seed)
    grads, losses = [], []
    for _ in range(N_SAMPLES // CHUNK):
        x = rng.standard_normal((CHUNK, inst.k + 2))
        gval, lval = _per_example(inst, m, x)
        grads.append(gval)
        losses.append(lval)
    grads, losses = np.concatenate(grads), np.concatenate(losses)
    denom = inst.u_perp**2 - m * m
    sd = np.sqrt(N_SAMPLES)
    return (grads.mean() / denom, grads.std() / sd / denom, losses.mean(), losses.std() / sd)


def test_closed_form_gradient_matches_autograd():
    inst = build_instance(dict(activation="tanh", k=4, xi=1.3, c="gaussian", c_hat="gaussian",
                               W="separated", d=12, u_alpha=0.3, seed=7))
    m = 0.4
    w, u, uh, v, _, _ = _frame(inst, m)
    x = np.random.default_rng(0).standard_normal((500, inst.k + 2))
    tw, tx, tv = (torch.tensor(a) for a in (w, x, v))
    tuh = torch.tensor(uh, requires_grad=True)
    ch, lam = torch.tensor(inst.c_hat), torch.tensor(inst.lam)
    raw = tw + inst.xi * ch[:, None] * tuh[None, :]
    vh = raw / raw.norm(dim=1, keepdim=True)
    loss = ((torch.tanh(tx @ tv.T) @ lam - torch.tanh(tx @ vh.T) @ lam) ** 2).sum()
    (grad,) = torch.autograd.grad(loss, tuh)
    pi = np.eye(inst.k + 2)
    pi[: inst.k, : inst.k] = 0.0  # Π: projector onto span(W)^⊥ (span W = first k coordinates)
    proj = (np.eye(inst.k + 2) - np.outer(uh, uh)) @ pi @ grad.numpy()
    gval, _ = _per_example(inst, m, x)
    assert -proj @ u == pytest.approx(gval.sum(), rel=1e-10)


MC_CASES = [
    (dict(activation="relu", k=4, xi=1.0, seed=1), 0.3),
    (dict(activation="relu", k=5, xi=1.5, c="gaussian", c_hat="gaussian", W="separated", d=15,
          u_alpha=0.4, lam="random_sign", seed=2), -0.6),
    (dict(activation="he3", k=3, xi=2.0, seed=3), 0.5),
    (dict(activation="tanh", k=4, xi=1.0, seed=4, c_hat="teacher"), 0.8),
]


@pytest.mark.parametrize(("spec", "m"), MC_CASES)
def test_h_and_loss_match_monte_carlo(spec, m):
    inst = build_instance(spec)
    h_mc, h_se, loss_mc, loss_se = _mc(inst, m, seed=hash((spec["seed"], m)) % 2**32)
    z_h = (float(h(inst, m)) - h_mc) / h_se
    z_loss = (float(population_loss(inst, m)) - loss_mc) / loss_se
    assert abs(z_h) < 4.0, (z_h, h_mc, h_se)
    assert abs(z_loss) < 4.0, (z_loss, loss_mc, loss_se)
    assert h_se < 0.02 * max(abs(float(h(inst, m))), 0.1)  # the test has power
