"""The finetune learner's sample loss is the paper's model; its closed-form gradients and
steps against autograd of that loss are checked in ``test_learner_protocol``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close, assert_sample_loss_is, rank1_learner

from dynamics.activations import torch_activation
from dynamics.geometry import sphere
from dynamics.instances.instance import build_instance
from dynamics.learners import Finetune

ACTIVATIONS = ("relu", "abs", "sigmoid", "tanh", "erf", "quadratic", "linear", "he3")

K, D, R, B = 4, 11, 3, 2
F64 = torch.float64


def _instance(activation, u_alpha=0.0, W="orthonormal", seed=3):
    return build_instance({"activation": activation, "k": K, "d": D, "xi": 1.3, "W": W,
                           "c": "gaussian", "c_hat": "gaussian", "lam": "random_sign",
                           "u_alpha": u_alpha, "seed": seed})


def _setup(activation, project, joint, u_alpha=0.0, W="orthonormal", batch=B, label_noise=0.0):
    inst = _instance(activation, u_alpha, W)
    learner, state, x = rank1_learner(Finetune, inst, R, batch, project=project, joint_c=joint,
                                      label_noise=label_noise)
    return inst, learner, state, x


def _dense_loss(inst, u_hat, c_hat, x, label=None):
    """L = (f*(x) − f̂(x))² from full k×d matrices (the paper's model)."""
    w = torch.zeros(K, D, dtype=F64)
    w[:, :K] = torch.as_tensor(inst.w_factor)
    u = torch.zeros(D, dtype=F64)
    u[:K] = torch.as_tensor(inst.u_w)
    u[K] = inst.u_perp
    lam, c, xi = torch.as_tensor(inst.lam), torch.as_tensor(inst.c), inst.xi
    v = w + xi * c[:, None] * u
    v = v / v.norm(dim=1, keepdim=True)
    vh = w + xi * c_hat[:, None] * u_hat
    vh = vh / vh.norm(dim=1, keepdim=True)
    sig = torch_activation(inst.activation).fn
    y = sig(v @ x) @ lam if label is None else label
    return (y - sig(vh @ x) @ lam) ** 2


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
@pytest.mark.parametrize("joint", [False, True], ids=["frozen", "joint"])
@pytest.mark.parametrize("u_alpha", [0.0, 0.4])
def test_sample_loss_is_the_papers_model(activation, project, joint, u_alpha):
    """sample_loss (whose gradients test_learner_protocol checks against the closed form)
    and sample_gradients' loss = the loss of full k×d matrices (projected: û ⊥ span W)."""
    W = "separated" if u_alpha else "orthonormal"  # non-orthogonal rows too
    inst, learner, state, x = _setup(activation, project, joint, u_alpha, W)
    assert_sample_loss_is(learner, state, x, lambda r, b: _dense_loss(
        inst, state.u_hat[r], state.c_hat[r], x[r, b]))


def test_label_noise_enters_the_label():
    inst, learner, state, x = _setup("tanh", True, True, label_noise=0.3)
    eps = torch.as_tensor(np.random.default_rng(2).standard_normal((R, B)))
    tangent, _, loss = learner.sample_gradients(state, x, eps)
    clean, _, _ = learner.sample_gradients(state, x)
    assert float((tangent - clean).abs().max()) > 1e-6
    ours = learner.sample_loss(state, x, eps)
    for r in range(R):
        for b in range(B):
            w = torch.zeros(K, D, dtype=F64)
            w[:, :K] = torch.as_tensor(inst.w_factor)
            u = torch.zeros(D, dtype=F64)
            u[K] = inst.u_perp
            v = w + inst.xi * torch.as_tensor(inst.c)[:, None] * u
            v = v / v.norm(dim=1, keepdim=True)
            y = torch.tanh(v @ x[r, b]) @ torch.as_tensor(inst.lam) + 0.3**0.5 * eps[r, b]
            ref = _dense_loss(inst, state.u_hat[r], state.c_hat[r], x[r, b], y)
            assert_close(ours[r, b], ref)
            assert_close(loss[r, b], ref)


def test_zero_step_size_freezes_a_run():
    _, learner, state, x = _setup("relu", True, True)
    learner.eta_r[1] = 0.0
    learner.eta_c_r[1] = 0.0
    new = learner.step(state, x)
    assert torch.allclose(new.u_hat[1], state.u_hat[1], rtol=0, atol=1e-15)  # up to projx
    assert torch.equal(new.c_hat[1], state.c_hat[1])
    assert not torch.equal(new.u_hat[0], state.u_hat[0])


def test_sphere_geometry():
    gen = torch.Generator().manual_seed(0)
    x = sphere.projx(torch.randn(5, 7, generator=gen, dtype=F64))
    v = torch.randn(5, 7, generator=gen, dtype=F64)
    t = sphere.proju(x, v)
    assert torch.allclose(x.norm(dim=-1), torch.ones(5, dtype=F64), atol=1e-15)
    assert float(sphere.inner(x, t).abs().max()) < 1e-14  # tangent
    assert torch.allclose(sphere.proju(x, t), t, atol=1e-15)  # idempotent
    assert torch.allclose(sphere.retr(x, t).norm(dim=-1), torch.ones(5, dtype=F64))
