"""The reduced chain equals the O(d) dynamics step by step on the same random numbers.

Reference: explicit vectors in R^d, ∇L by autograd through N̂ⱼ = ‖wⱼ + ξĉⱼû‖ (App. B: rows
s(wⱼ + ξĉⱼû) and output factor 1/ξ, no renormalisation), then eq. (4) literally:
û ← (û − η(I − ûûᵀ)[Π]∇L)/‖·‖, ĉ ← ĉ − η_c ∂L/∂ĉ. The reduced variates are read off the same
examples: z = x[:k], a = x_k, b = ⟨ê, x⟩, Gram of the parts ⊥ span(W, e, ê).
"""

import numpy as np
import pytest
import torch

from dynamics.activations import torch_activation
from dynamics.instances.instance import build_instance
from dynamics.learners import Finetune, Problem
from dynamics.reduced import _kernel, torch_chain
from dynamics.reduced._chain import ChainState, RankOneSettings
from dynamics.reduced.params import pack_instances

D, K = 13, 3
SPEC = dict(k=K, d=D, W="separated", u_alpha=0.3, c="gaussian", c_hat="gaussian",
            lam="random_sign", xi=1.3, seed=2)
TOL = 1e-12


def _instance(act, w="separated", convention="unit"):
    return build_instance(dict(SPEC, activation=act, W=w, convention=convention))


def _explicit_step(inst, u, ch, X, eps, eta, eta_c, project, joint):
    """One step of eq. (4) on explicit vectors (float64 torch, autograd for ∇)."""
    act = torch_activation(inst.activation)
    W = torch.zeros(K, D, dtype=torch.float64)
    W[:, :K] = torch.as_tensor(inst.w_factor)
    uvec = torch.zeros(D, dtype=torch.float64)
    uvec[:K], uvec[K] = torch.as_tensor(inst.u_w), inst.u_perp
    lam, c = torch.as_tensor(inst.lam), torch.as_tensor(inst.c)
    X = torch.as_tensor(X)
    o = inst.output_scale

    def rows(v):
        return v / v.norm(dim=1, keepdim=True) if inst.unit_rows else inst.row_scale * v

    v = W + inst.xi * c[:, None] * uvec
    y = o * act.fn(X @ rows(v).T) @ lam + torch.as_tensor(eps)
    u = torch.as_tensor(u).clone().requires_grad_(True)
    ch = torch.as_tensor(ch).clone().requires_grad_(True)
    vh = W + inst.xi * ch[:, None] * u
    loss = ((y - o * act.fn(X @ rows(vh).T) @ lam) ** 2).mean()
    gu, gc = torch.autograd.grad(loss, (u, ch))
    u = u.detach()
    if project:
        gu = torch.cat([torch.zeros(K, dtype=gu.dtype), gu[K:]])
    new = u - eta * (gu - (gu @ u) * u)
    return (new / new.norm()).numpy(), (ch.detach() - eta_c * gc * joint).numpy()


def _reduced_variates(u, X):
    """(z, a, b, Gram) of examples X (b, d) relative to û's frame (ê = û's part ⊥ H)."""
    rest = u[K + 1:]
    e_hat = rest / np.linalg.norm(rest)
    b = X[:, K + 1:] @ e_hat
    r = X[:, K + 1:] - b[:, None] * e_hat
    return X[:, :K], X[:, K], b, r @ r.T


def _state(u):
    return u[:K], u[K], np.linalg.norm(u[K + 1:])


CASES = [(act, w, project, joint, batch, noise, "unit")
         for act, w in (("relu", "separated"), ("relu", "orthonormal"),
                        ("sigmoid", "separated"), ("he3", "separated"))
         for project in (True, False) for joint in (False, True)
         for batch, noise in ((1, 0.0), (3, 0.4))]
CASES += [(act, "separated", project, joint, 3, 0.4, conv)
          for act, conv in (("relu", "appB"), ("tanh", "appB-sqrt"), ("he3", "appB"))
          for project, joint in ((True, True), (False, False), (False, True))]


@pytest.mark.parametrize("act,w,project,joint,batch,noise,conv", CASES)
def test_numba_chain_equals_explicit_dynamics(act, w, project, joint, batch, noise, conv):
    """Several steps (so ê rotates between steps) agree to 1e-12."""
    inst = _instance(act, w, conv)
    rng = np.random.default_rng(7)
    u = np.zeros(D)
    u[K:] = rng.standard_normal(D - K)
    if not project:
        u[:K] = 0.3 * rng.standard_normal(K)
    u /= np.linalg.norm(u)
    ch = inst.c_hat.copy()
    eta, eta_c = 0.2, 0.15
    p0, mu0, nu0 = _state(u)
    variates = []
    for _ in range(4):
        X = rng.standard_normal((batch, D))
        eps = noise * rng.standard_normal(batch)
        variates.append((*_reduced_variates(u, X), eps))
        u, ch = _explicit_step(inst, u, ch, X, eps, eta, eta_c, project, joint)
    Zg, Ag, Bg, Gg, Eg = (np.stack(v) for v in zip(*variates, strict=True))
    mu, nu, pw, chat = _kernel.replay(
        pack_instances([inst]), 0, act, ChainState(mu0, nu0, p0, inst.c_hat), project=project,
        joint=joint, eta=eta, eta_c=eta_c, Zg=Zg, Ag=Ag, Bg=Bg, Eg=Eg, Gg=Gg)
    p_ref, mu_ref, nu_ref = _state(u)
    np.testing.assert_allclose([mu, nu], [mu_ref, nu_ref], rtol=0, atol=TOL)
    np.testing.assert_allclose(pw, p_ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(chat, ch, rtol=0, atol=TOL)
    if project:
        assert np.all(pw == 0.0)


@pytest.mark.parametrize("project,joint", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("act,conv", [("relu", "unit"), ("he3", "unit"), ("relu", "appB"),
                                      ("he3", "appB-sqrt")])
def test_torch_step_equals_numba_step(act, conv, project, joint):
    """The torch path's step on the numba path's variates (R runs of different states)."""
    inst = _instance(act, convention=conv)
    params = pack_instances([inst] * 5)
    rng = np.random.default_rng(3)
    runs, batch = 5, 2
    st = rng.standard_normal((runs, K + 2))
    if project:
        st[:, :K] = 0.0
    st /= np.linalg.norm(st, axis=1, keepdims=True)
    st[:, K + 1] = np.abs(st[:, K + 1])
    Z = rng.standard_normal((runs, 1, batch, K))
    A, B, E = (rng.standard_normal((runs, 1, batch)) for _ in range(3))
    r = rng.standard_normal((runs, 1, batch, 6))
    G = r @ np.swapaxes(r, -1, -2)
    chat = params.c_hat0 + 0.1 * rng.standard_normal((runs, K))
    P = torch_chain.TorchParams.from_params(params, "cpu", torch.float64)
    t = torch.as_tensor
    settings = RankOneSettings(project, joint, 0, 0.3, 0.15, batch, 0.0)
    got = torch_chain.step(P, inst.activation, settings,
                           ChainState(t(st[:, K]), t(st[:, K + 1]), t(st[:, :K]), t(chat)),
                           torch_chain.Draws(t(Z[:, 0]), t(A[:, 0]), t(B[:, 0]), t(E[:, 0]),
                                             gram=t(G[:, 0])))
    for run in range(runs):
        ref = _kernel.replay(params, run, act,
                             ChainState(st[run, K], st[run, K + 1], st[run, :K], chat[run]),
                             project=project, joint=joint, eta=0.3, eta_c=0.15, Zg=Z[run],
                             Ag=A[run], Bg=B[run], Eg=E[run], Gg=G[run])
        for x_ref, x_got in zip(ref, got, strict=True):
            np.testing.assert_allclose(x_got[run].numpy(), x_ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("project,joint,batch", [(True, False, 1), (True, True, 2),
                                                 (False, True, 1), (False, False, 3)])
def test_numba_chain_equals_full_engine_learner(project, joint, batch):
    """Same numbers as the full engine's own step (``Finetune.step_``) on explicit x."""
    inst = _instance("sigmoid")
    rng = np.random.default_rng(11)
    u = np.zeros(D)
    u[K:] = rng.standard_normal(D - K)
    if not project:
        u[:K] = 0.2 * rng.standard_normal(K)
    u /= np.linalg.norm(u)
    eta, eta_c, noise_sd = 0.25, 0.1, 0.3
    learner = Finetune(Problem.from_instances([inst], "cpu", torch.float64), eta=eta,
                       eta_c=eta_c, project=project, joint_c=joint, batch=batch,
                       label_noise=noise_sd**2)
    state = learner.init_state(u[None])
    X = rng.standard_normal((batch, D))
    eps = rng.standard_normal(batch)
    learner.step_(state, torch.as_tensor(X[None]), torch.as_tensor(eps[None]))
    z, a, b, gram = _reduced_variates(u, X)
    p0, mu0, nu0 = _state(u)
    mu, nu, pw, chat = _kernel.replay(
        pack_instances([inst]), 0, "sigmoid", ChainState(mu0, nu0, p0, inst.c_hat),
        project=project, joint=joint, eta=eta, eta_c=eta_c, Zg=z[None], Ag=a[None],
        Bg=b[None], Eg=noise_sd * eps[None], Gg=gram[None])
    u_full = state.u_hat[0].numpy()
    p_ref, mu_ref, nu_ref = _state(u_full / np.linalg.norm(u_full))
    np.testing.assert_allclose([mu, nu, *pw], [mu_ref, nu_ref, *p_ref], rtol=0, atol=1e-11)
    np.testing.assert_allclose(chat, state.c_hat[0].numpy(), rtol=0, atol=TOL)
