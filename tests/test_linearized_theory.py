"""Exact theory of the linearized learner (hermite/flows/linearized.py, docs/theory/linearized.md):
the quadratic form against Monte Carlo and autograd, the full-rank mean ODE and the rank-1
drift against the learner, the floor against the learner's long-run loss."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import scipy.linalg
import torch

import hermite
from dynamics.activations import torch_activation
from dynamics.engines.engine import FullRun
from dynamics.instances.instance import build_instance
from dynamics.learners import Problem
from dynamics.learners.linearized import Linearized, true_loss
from dynamics.setup.config import RunConfig
from hermite.activations import activation_from_callable
from hermite.flows.linearized import (
    LinearQuadratic,
    dual_kernel_second_derivative,
    linear_model_floor,
    linear_model_loss,
    linear_model_ode,
    linear_model_quadratic,
    linear_model_rank1_gradient,
    linear_model_rank1_ode,
    linear_model_sgd_excess,
    true_network_loss,
    update_mask,
)

F64 = torch.float64
K = 3
GRAM = [[1.0, 0.5, -0.3], [0.5, 1.0, 0.2], [-0.3, 0.2, 1.0]]  # sizeable K″(Gⱼₗ) terms

# a smooth activation without any closed form, given as plain numpy callables
SOFTPLUS = activation_from_callable(lambda x: np.logaddexp(0.0, x),
                                    lambda x: 1.0 / (1.0 + np.exp(-x)), name="softplus")
ACTIVATIONS = ["relu", "tanh", "erf", "he3", "sigmoid", "softplus"]


def _instance(activation="relu", d=K + 3, xi=1.3, u_alpha=0.3, gram=GRAM, k=K, seed=3):
    spec = {"activation": "relu" if activation == "softplus" else activation, "k": k,
            "d": d, "xi": xi, "gram": gram, "c": "gaussian", "c_hat": "gaussian",
            "lam": "random_sign", "u_alpha": u_alpha, "seed": seed}
    inst = build_instance(spec)
    if activation == "softplus":
        inst = dataclasses.replace(inst, activation=SOFTPLUS)
    return inst


def _torch_fn(inst):
    if inst.activation is SOFTPLUS:
        return torch.nn.functional.softplus
    return torch_activation(inst.activation).fn


def _frame(inst, width):
    """(W (k, D), u (D,)) in the canonical frame's first D coordinates."""
    w = np.zeros((inst.k, width))
    w[:, : inst.k] = inst.w_factor
    u = np.zeros(width)
    u[: inst.k] = inst.u_w
    u[inst.k] = inst.u_perp
    return w, u


def _ntk_features(inst, x):
    """Per-example (y − f₀, φ = ∇_Δ f̂(x; Δ)|_{Δ=0}) by autograd of the TRUE network (rows
    (wⱼ + Δⱼ)/‖wⱼ + Δⱼ‖): an independent reference for PⱼΔ, βⱼ and the normalisation."""
    n, width = x.shape
    w, u = (torch.as_tensor(a) for a in _frame(inst, width))
    v = w + inst.xi * torch.as_tensor(inst.c)[:, None] * u
    v = v / v.norm(dim=1, keepdim=True)
    lam, fn = torch.as_tensor(inst.lam), _torch_fn(inst)
    delta = torch.zeros(n, inst.k, width, dtype=F64, requires_grad=True)
    rows = w + delta
    rows = rows / rows.norm(dim=-1, keepdim=True)
    f = (fn(torch.einsum("nkd,nd->nk", rows, x)) * lam).sum(-1)
    (phi,) = torch.autograd.grad(f.sum(), delta)
    y0 = fn(x @ v.T) @ lam - f.detach()
    return y0.numpy(), phi.numpy().reshape(n, -1)


def _mean_se(samples):
    return samples.mean(0), samples.std(0, ddof=1) / math.sqrt(samples.shape[0])


def _zmax(est, se, ref):
    """max |est − ref|/se; entries with se = 0 (exact zeros of φ) must match to 1e-12."""
    est, se, ref = (np.asarray(a, float) for a in (est, se, ref))
    zero = se < 1e-13
    assert np.all(np.abs(est - ref)[zero] < 1e-12)
    return float(np.max(np.abs(est - ref)[~zero] / se[~zero]))


def _kpp_term(inst, quad):
    """The K″ part of A (to build a deliberately wrong quadratic form)."""
    w, _ = _frame(inst, inst.k + 1)
    g = np.clip(w @ w.T, -1, 1)
    off = ~np.eye(inst.k, dtype=bool)
    kpp = np.zeros_like(g)
    kpp[off] = dual_kernel_second_derivative(inst.activation, g[off])
    proj = np.eye(inst.k + 1)[None] - w[:, :, None] * w[:, None, :]
    pw = np.einsum("jab,lb->jla", proj, w)
    lam2 = np.outer(inst.lam, inst.lam)
    return (lam2 * kpp)[:, None, :, None] * np.einsum("jla,ljb->jalb", pw, pw)


# ---------------------------------------------------------------- K″
@pytest.mark.parametrize("activation", ["relu", "abs", "erf", "erf(x/sqrt2)", "he3", "he5",
                                        "quadratic", "relu(x*2)"])
def test_second_derivative_closed_forms_match_the_interpolant(activation):
    rho = np.linspace(-0.95, 0.95, 39)
    closed = dual_kernel_second_derivative(activation, rho, method="closed")
    interp = dual_kernel_second_derivative(activation, rho, method="interpolant")
    np.testing.assert_allclose(interp, closed, rtol=1e-11, atol=1e-11 * np.max(np.abs(closed)))


@pytest.mark.parametrize("activation", ["tanh", "sigmoid", "erf"])
def test_second_derivative_is_the_hermite_series(activation):
    """K″(ρ) = Σₚ p(p−1)μₚ²ρ^{p−2} (smooth σ: geometric convergence for |ρ| ≤ 0.8)."""
    mu = hermite.hermite_coefficients(activation, 120)
    p = np.arange(mu.size)
    rho = np.linspace(-0.8, 0.8, 17)
    series = np.sum((p * (p - 1) * mu**2)[None, 2:] * rho[:, None] ** (p[None, 2:] - 2), 1)
    ours = dual_kernel_second_derivative(activation, rho)
    np.testing.assert_allclose(ours, series, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------- the quadratic form
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_quadratic_form_matches_monte_carlo(activation):
    """A = E[φφᵀ], b = E[(f* − f₀)φ], L₀ = E(f* − f₀)², and the sample loss and gradient at a
    random Δ, against 2·10⁵ seeded examples in d = k + 3 (exact in law: x is isotropic);
    φ by autograd of the true network. Every entry within 5 standard errors."""
    inst = _instance(activation)
    quad = linear_model_quadratic(inst)
    n, width = 200_000, inst.d
    x = torch.as_tensor(np.random.default_rng(17).standard_normal((n, width)))
    y0, phi = _ntk_features(inst, x)
    a_ref, b_ref = quad.dense(width)
    a_ref, b_ref = a_ref.reshape(phi.shape[1], -1), b_ref.ravel()
    a_mc, a_se = _mean_se(np.einsum("na,nb->nab", phi, phi).reshape(n, -1))
    b_mc, b_se = _mean_se(y0[:, None] * phi)
    c_mc, c_se = _mean_se(y0**2)
    assert _zmax(a_mc, a_se, a_ref.ravel()) < 5
    assert _zmax(b_mc, b_se, b_ref) < 5
    assert _zmax(c_mc, c_se, quad.const) < 5
    delta = 0.4 * np.random.default_rng(5).standard_normal((inst.k, width))
    resid = y0 - phi @ delta.ravel()
    l_mc, l_se = _mean_se(resid**2)
    g_mc, g_se = _mean_se(-2.0 * resid[:, None] * phi)
    assert _zmax(l_mc, l_se, linear_model_loss(inst, delta, quad)) < 5
    assert _zmax(g_mc, g_se, quad.gradient(delta).ravel()) < 5
    # power: the same form without its K″ term is rejected (z ≥ 19 for every σ here)
    wrong = quad.A - _kpp_term(inst, quad)
    a_wrong = LinearQuadratic(wrong, quad.b, quad.const, quad.B, quad.k).dense(width)[0]
    assert _zmax(a_mc, a_se, a_wrong.ravel()) > 10


@pytest.mark.parametrize("activation", ["relu", "tanh", "erf", "he3", "softplus"])
def test_population_gradient_matches_autograd_and_finite_differences(activation):
    """∇L = 2(AΔ_S − b) ⊕ 2BΔ_⊥ against torch autograd of the quadratic form and central
    differences of L; L is rotation invariant in S^⊥ and agrees with the dense form."""
    inst = _instance(activation, d=9)
    quad = linear_model_quadratic(inst)
    delta = 0.5 * np.random.default_rng(8).standard_normal((inst.k, inst.d))
    grad = quad.gradient(delta)
    a_t, b_t = (torch.as_tensor(m) for m in quad.dense(inst.d))
    dt = torch.as_tensor(delta).requires_grad_(True)
    loss_t = quad.const - 2 * (b_t * dt).sum() + torch.einsum("ja,jalb,lb->", dt, a_t, dt)
    (auto,) = torch.autograd.grad(loss_t, dt)
    np.testing.assert_allclose(grad, auto.numpy(), rtol=1e-12, atol=1e-12)
    assert float(loss_t.detach()) == pytest.approx(float(quad.loss(delta)), rel=1e-12)
    h = 1e-6
    fd = np.zeros_like(delta)
    for idx in np.ndindex(delta.shape):
        e = np.zeros_like(delta)
        e[idx] = h
        fd[idx] = (quad.loss(delta + e) - quad.loss(delta - e)) / (2 * h)
    np.testing.assert_allclose(fd, grad, rtol=1e-7, atol=1e-7)
    # S^⊥ enters through Δ_⊥Δ_⊥ᵀ only: a rotation of the ⊥ coordinates changes nothing
    q, _ = np.linalg.qr(np.random.default_rng(9).standard_normal((inst.d - K - 1,) * 2))
    rotated = np.concatenate([delta[:, : K + 1], delta[:, K + 1:] @ q], 1)
    assert float(quad.loss(rotated)) == pytest.approx(float(quad.loss(delta)), rel=1e-12)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_true_network_loss_is_the_learners(activation):
    """true_network_loss = dynamics' true_loss (rows (wⱼ + Δⱼ)/‖·‖), and L(0) = that loss
    at Δ = 0 = E(f* − f₀)²."""
    inst = _instance(activation, d=20)
    delta = 0.3 * np.random.default_rng(2).standard_normal((1, 4, K, 2 * K + 1))
    delta[0, 0] = 0.0
    ref = true_loss([inst], delta)[0]
    np.testing.assert_allclose(true_network_loss(inst, delta[0]), ref, rtol=1e-12)
    assert linear_model_quadratic(inst).const == pytest.approx(ref[0], rel=1e-12)


# ---------------------------------------------------------------- full-rank ODE
@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
@pytest.mark.parametrize("prox", [0.0, 0.2])
def test_ode_is_the_iterated_mean_step(project, prox):
    """The closed form equals iterating m ← m − η[Π(∇L(m))] − 2η·prox·m step by step (from a
    Δ₀ with components outside the update's range too), and flow=True equals expm."""
    inst = _instance("tanh")
    quad = linear_model_quadratic(inst)
    width, eta, steps = K + 4, 0.05, [0, 1, 2, 7, 60, 300]
    d0 = 0.3 * np.random.default_rng(4).standard_normal((K, width))
    ode = linear_model_ode(inst, d0, eta, steps, project=project, prox=prox, quad=quad)
    mask = update_mask(K, width, project)
    m, ref = d0.copy(), {}
    for t in range(max(steps) + 1):
        ref[t] = m.copy()
        m = m - eta * np.where(mask, quad.gradient(m), 0.0) - 2 * eta * prox * m
    np.testing.assert_allclose(ode.delta, np.stack([ref[t] for t in steps]), rtol=0,
                               atol=1e-13)
    # gradient flow: the affine system on vec(Δ), exponentiated
    n = K * width
    a_full, b_full = quad.dense(width)
    proj = np.diag(mask.ravel().astype(float))
    gen = np.zeros((n + 1, n + 1))
    gen[:n, :n] = -2 * eta * (proj @ a_full.reshape(n, n) + prox * np.eye(n))
    gen[:n, n] = 2 * eta * proj @ b_full.ravel()
    flow = linear_model_ode(inst, d0, eta, [0.0, 13.5, 400.0], project=project, prox=prox,
                            flow=True, quad=quad)
    for t, got in zip(flow.steps, flow.delta, strict=True):
        ref = (scipy.linalg.expm(t * gen) @ np.append(d0.ravel(), 1.0))[:n]
        np.testing.assert_allclose(got.ravel(), ref, rtol=0, atol=1e-12)


_SGD_SPEC = {"activation": "relu", "k": 2, "xi": 1.5, "gram": [[1.0, 0.5], [0.5, 1.0]],
             "c": "gaussian", "c_hat": "gaussian", "lam": "random_sign", "u_alpha": 0.3,
             "seed": 5}


def _learner_run(**kw):
    cfg = RunConfig(**({"instance": _SGD_SPEC | {"d": 40}, "learner": "linearized",
                        "runs": 64, "finite_d_theory": False, "eval_size": 1000, "seed": 1,
                        "streams": "counter"} | kw))
    run = FullRun(cfg.validate())
    run.advance()
    return cfg, run


@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
def test_full_rank_ode_is_the_mean_of_the_learners_sgd(project):
    """E Δₜ on S (the recorded canonical coordinates of the learner's Δ, 64 runs of the full
    engine, k = 2, d = 40, η = 0.01) equals the exact mean map within 4.5 standard errors at
    every checkpoint, while the ODE moves by > 20 of them and the form without its K″ term
    is rejected."""
    cfg, run = _learner_run(full_rank=True, project=project, eta=0.01, steps=1500,
                            checkpoints=8, spacing="log")
    inst, k = run.instances[0], 2
    rec = run.records.arrays()["delta"][..., : k + 1]  # (R, C, k, k+1)
    mean, se = rec.mean(0), rec.std(0, ddof=1) / math.sqrt(cfg.runs)
    quad = linear_model_quadratic(inst)
    ode = linear_model_ode(inst, None, cfg.eta, run.steps, project=project, quad=quad)
    theory = ode.delta[:, :, : k + 1]
    live = se > 0  # step 0 (Δ = 0) and the frozen span-W columns when projected
    z = np.abs(mean - theory)[live] / se[live]
    assert z.max() < 4.5, z.max()
    assert np.all(np.abs(mean - theory)[~live] < 1e-12)
    assert (np.abs(theory[-1] - theory[0])[live[-1]] / se[-1][live[-1]]).max() > 20
    if not project:  # only the unprojected Δ sees the span-W block of A
        wrong = LinearQuadratic(quad.A - _kpp_term(inst, quad), quad.b, quad.const,
                                quad.B, quad.k)
        bad = linear_model_ode(inst, None, cfg.eta, run.steps, project=False, quad=wrong)
        zb = np.abs(mean - bad.delta[:, :, : k + 1])[live] / se[live]
        assert zb.max() > 8, zb.max()


def test_floor_is_the_long_run_loss_of_the_learner():
    """Unprojected full rank, η = 3·10⁻⁴, d = 30, 40 000 steps (the mean's gap to the floor
    < 0.05 SE): E L(Δ_T) = L* + η tr N (SGD noise) within 4 standard errors of the 64-run mean
    of the exact L at the learner's Δ (and not without the noise term), which is the
    learner's recorded loss_linear."""
    eta, d = 3e-4, 30
    cfg, run = _learner_run(instance=_SGD_SPEC | {"d": d}, full_rank=True, project=False,
                            eta=eta, steps=40_000, checkpoints=2, spacing="linear",
                            seed=2)
    inst = run.instances[0]
    quad = linear_model_quadratic(inst)
    floor = linear_model_floor(inst, project=False, quad=quad)
    excess = linear_model_sgd_excess(inst, eta, d=d, project=False, floor=floor)
    ode = linear_model_ode(inst, None, eta, run.steps, project=False, quad=quad)
    exact = quad.loss(run.records.arrays()["delta"][:, -1])  # (R,)
    mean, se = exact.mean(), exact.std(ddof=1) / math.sqrt(cfg.runs)
    assert ode.loss_linear[-1] - floor.loss_linear < 0.05 * se  # the mean has converged
    assert abs(mean - floor.loss_linear - excess) < 4 * se
    assert mean - floor.loss_linear > 10 * se  # the noise term is needed
    traj = run.trajectory()
    # the recorded loss_linear is that exact L at the learner's Δ (no evaluation set)
    np.testing.assert_allclose(traj.extra["loss_linear"][:, -1], exact, rtol=1e-10)
    # the learner's true loss at its Δ is near the true loss at Δ* (Δ fluctuates around it)
    assert traj.loss[:, -1].mean() == pytest.approx(floor.loss_true, rel=0.05)


# ---------------------------------------------------------------- the floor
def test_floors_are_ordered_and_stationary():
    """Full rank ≤ rank 1 joint ĉ ≤ rank 1 frozen ĉ; projected rank-1 joint = projected full
    rank (Δ* = B⁺b_e eᵀ); the full-rank Δ* zeroes the gradient on the update's range and is
    the limit of the mean ODE; the frozen-ĉ floor beats a dense sample of the sphere."""
    inst = _instance("relu", d=20)
    quad = linear_model_quadratic(inst)
    for project in (True, False):
        full = linear_model_floor(inst, project=project, quad=quad)
        joint = linear_model_floor(inst, rank=1, project=project, joint_c=True, quad=quad)
        frozen = linear_model_floor(inst, rank=1, project=project, quad=quad)
        assert full.loss_linear <= joint.loss_linear + 1e-12
        assert joint.loss_linear <= frozen.loss_linear + 1e-12
        assert full.loss_linear < quad.const
        mask = update_mask(K, K + 2, project)
        assert np.abs(np.where(mask, quad.gradient(full.delta), 0)).max() < 1e-12
        ode = linear_model_ode(inst, None, 0.05, [1e6], project=project, quad=quad)
        assert ode.loss_linear[0] == pytest.approx(full.loss_linear, rel=1e-12)
        np.testing.assert_allclose(ode.delta[0], full.delta, atol=1e-10)
        if project:
            assert joint.loss_linear == pytest.approx(full.loss_linear, rel=1e-12)
            assert np.linalg.matrix_rank(full.delta, tol=1e-10) == 1
            assert full.overlap == pytest.approx(inst.u_perp, rel=1e-12)
        # frozen ĉ: the trust-region minimum against 4·10⁵ points of the sphere
        idx = np.arange(K + 2) if not project else np.array([K, K + 1])
        pts = np.random.default_rng(1).standard_normal((400_000, idx.size))
        pts /= np.linalg.norm(pts, axis=1, keepdims=True)
        u = np.zeros((pts.shape[0], K + 2))
        u[:, idx] = pts
        sampled = quad.loss(inst.xi * inst.c_hat[None, :, None] * u[:, None, :]).min()
        assert frozen.loss_linear <= sampled + 1e-12
        assert frozen.loss_linear > sampled - 0.02 * abs(sampled)
        assert frozen.loss_true == pytest.approx(float(true_network_loss(inst, frozen.delta)))


# ---------------------------------------------------------------- rank 1
@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
@pytest.mark.parametrize("prox", [0.0, 0.3])
def test_rank1_drift_is_the_mean_of_the_learners_gradients(project, prox):
    """(tangent, ∂L/∂ĉ) of linear_model_rank1_gradient = the mean of
    Linearized.sample_gradients over 2·10⁵ examples, within 5 standard errors."""
    inst = _instance("tanh", d=7)
    n = 200_000
    problem = Problem.from_instances([inst], torch.device("cpu"), F64)
    learner = Linearized(problem, eta=0.01, eta_c=0.01, project=project, joint_c=True,
                         batch=n, prox=prox)
    gen = np.random.default_rng(6)
    u0 = gen.standard_normal(inst.d)
    if project:
        u0[:K] = 0.0
    u0 /= np.linalg.norm(u0)
    c_hat = inst.c_hat + 0.3 * gen.standard_normal(K)
    state = learner.init_state(u0[None], torch.as_tensor(c_hat)[None])
    x = torch.as_tensor(gen.standard_normal((1, n, inst.d)))
    tangent, grad_c, _ = learner.sample_gradients(state, x)
    tan_ref, gc_ref = linear_model_rank1_gradient(inst, u0, c_hat, project=project, prox=prox)
    t_mc, t_se = _mean_se(tangent[0].numpy())
    c_mc, c_se = _mean_se(grad_c[0].numpy())
    assert _zmax(t_mc, t_se, tan_ref) < 5
    assert _zmax(c_mc, c_se, gc_ref) < 5
    assert np.abs(tan_ref).max() > 20 * t_se.max()  # a drift well resolved by the test


def test_rank1_ode_projected_frozen_closed_form():
    """Projected, frozen ĉ: ⟨û, e⟩ = tanh(2ηξĉᵀb_e t + artanh m₀) (docs/theory/linearized.md)."""
    inst = _instance("erf", d=12)
    quad = linear_model_quadratic(inst)
    u0 = np.zeros(K + 2)
    u0[K], u0[K + 1] = 0.1, math.sqrt(1 - 0.01)
    eta, steps = 0.01, np.array([0, 50, 300, 1000, 4000])
    ode = linear_model_rank1_ode(inst, u0, eta, steps, quad=quad)
    rate = 2 * eta * inst.xi * float(inst.c_hat @ quad.b[:, K])
    np.testing.assert_allclose(ode.u_hat[:, K], np.tanh(rate * steps + np.arctanh(0.1)),
                               atol=1e-9)
    np.testing.assert_allclose(np.linalg.norm(ode.u_hat, axis=1), 1.0, atol=1e-9)
    np.testing.assert_allclose(ode.overlap, inst.u_perp * ode.u_hat[:, K], atol=1e-12)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_projected_drift_is_h_at_zero_without_student_normalisation(activation):
    """2ξĉᵀb_e = u⊥·h_lin with h_lin = lim_{ε→0} h(0; εĉ)/ε (hermite.h: the true model's
    drift at m = 0, whose student norms N̂ⱼ → 1 as ε → 0)."""
    inst = _instance(activation, d=20, gram=np.eye(K).tolist() if activation == "tanh" else GRAM)
    quad = linear_model_quadratic(inst)
    rate = 2 * inst.xi * float(inst.c_hat @ quad.b[:, K])
    eps = 1e-6
    h0 = float(hermite.h(inst.with_c_hat(eps * inst.c_hat), np.array([0.0]))[0]) / eps
    assert rate == pytest.approx(inst.u_perp * h0, rel=1e-8)


@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
def test_rank1_joint_ode_reaches_the_rank1_floor(project):
    inst = _instance("relu", d=12)
    quad = linear_model_quadratic(inst)
    floor = linear_model_floor(inst, rank=1, project=project, joint_c=True, quad=quad)
    u0 = np.zeros(K + 2)
    u0[K], u0[K + 1] = (0.3, math.sqrt(1 - 0.09)) if project else (0.3, 0.5)
    if not project:
        u0[:K] = 0.2
    u0 /= np.linalg.norm(u0)
    ode = linear_model_rank1_ode(inst, u0, 0.05, [0, 4e4], joint_c=True, project=project,
                                 quad=quad)
    assert ode.loss_linear[-1] == pytest.approx(floor.loss_linear, rel=1e-6)
    assert ode.loss_linear[0] > floor.loss_linear + 0.05


def test_rank1_ode_follows_the_learners_sgd():
    """Projected, frozen ĉ, d = 40, η = 5·10⁻⁴, 64 runs: the run-averaged ODE from each run's
    û₀ is within 4 standard errors of the mean coordinates of the learner's û (the ODE
    omits the O(ηd) retraction drift, ~1 % of ⟨û, e⟩ here) while it moves by > 40."""
    cfg, run = _learner_run(eta=5e-4, steps=6000, checkpoints=6, spacing="linear")
    inst, k = run.instances[0], 2
    coords = run.records.arrays()["coords"]  # (R, C, k+2)
    quad = linear_model_quadratic(inst)
    odes = linear_model_rank1_ode(inst, coords[:, 0], cfg.eta, run.steps, quad=quad).u_hat
    one = linear_model_rank1_ode(inst, coords[5, 0], cfg.eta, run.steps, quad=quad)
    np.testing.assert_allclose(odes[5], one.u_hat, atol=1e-8)  # batched = one run alone
    mean, se = coords.mean(0), coords.std(0, ddof=1) / math.sqrt(cfg.runs)
    theory = odes.mean(0)
    z = np.abs(mean - theory)[1:, k:] / se[1:, k:]
    assert z.max() < 4, z.max()
    assert np.abs(theory[-1, k] - theory[0, k]) / se[-1, k] > 40
