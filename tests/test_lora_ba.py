"""The ``lora-ba`` learner (issue 39, item 2): LoRA as practised, W + s·B·A by plain SGD.

Checked against independent truths: one step against torch autograd of the dense k×d model
(rows (wⱼ + s(BA)ⱼ)/‖·‖, the paper's teacher), a plain-numpy R^d SGD of the same model on the
engine's own draws, the zero-B first step in closed form, and the exact loss against Monte
Carlo. (The protocol items — autograd per example, batch = runs alone, seeds, memory — are
``tests/test_learner_protocol.py``'s ``lora-ba`` variants.)
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from helpers import assert_close, dense_rows

from dynamics.activations import torch_activation
from dynamics.engines.engine import FullRun
from dynamics.errors import ConfigError
from dynamics.instances.instance import build_instance
from dynamics.learners import Problem
from dynamics.learners.lora_ba import LoRABA
from dynamics.randomness.sampling import run_seed
from dynamics.setup.config import RunConfig
from hermite.flows.linearized import true_network_loss
from hermite.flows.lora_ba import lora_ba_gradient

F64 = torch.float64
K, D, R = 3, 12, 2
SPEC = {"activation": "relu", "k": K, "d": D, "xi": 1.3, "c": "gaussian", "c_hat": "gaussian",
        "lam": "random_sign", "W": "separated", "u_alpha": 0.4, "seed": 3}


def _instance(activation="relu", **kw):
    return build_instance(SPEC | {"activation": activation} | kw)


def _learner(inst, *, rank, eta=0.05, alpha=None, train_a=True, lr_ratio=1.0,
             label_noise=0.0):
    problem = Problem.from_instances([inst] * R, torch.device("cpu"), F64)
    return LoRABA(problem, eta=eta, rank=rank, alpha=alpha, train_a=train_a, lr_ratio=lr_ratio,
                  label_noise=label_noise)


def _factors(inst, rank, b_zero, seed=5):
    gen = np.random.default_rng(seed)
    a = gen.standard_normal((R, rank, inst.d)) / math.sqrt(inst.d)
    b = np.zeros((R, inst.k, rank)) if b_zero else 0.3 * gen.standard_normal((R, inst.k, rank))
    return b, a


def _dense_loss(inst, b, a, scale, x, eps=None, noise_sd=0.0):
    """Mean over the batch of (y − f̂)², dense torch (differentiable in b, a): one run."""
    w, v, _ = dense_rows(inst)
    w, v = torch.as_tensor(w), torch.as_tensor(v)
    lam = torch.as_tensor(inst.lam)
    sig = torch_activation(inst.activation).fn
    h = w + scale * b @ a
    rows = h / h.norm(dim=1, keepdim=True)
    y = sig(x @ v.T) @ lam
    if eps is not None:
        y = y + noise_sd * eps
    return ((y - sig(x @ rows.T) @ lam) ** 2).mean()


GRID = list(itertools.product(("relu", "tanh", "he3"), (1, 3), (1, 5), (True, False),
                              (True, False), (1.0, 16.0)))


@pytest.mark.parametrize("activation, rank, batch, b_zero, train_a, ratio", GRID)
def test_one_step_is_autograd(activation, rank, batch, b_zero, train_a, ratio):
    """One step = A − η∇_A, B − ratio·η∇_B of the dense model's batch loss by autograd."""
    inst = _instance(activation)
    alpha = None if rank == 1 else 2.0
    learner = _learner(inst, rank=rank, alpha=alpha, train_a=train_a, lr_ratio=ratio)
    b0, a0 = _factors(inst, rank, b_zero)
    state = learner.init_state(b0, a0)
    x = torch.as_tensor(np.random.default_rng(8).standard_normal((R, batch, inst.d)))
    new = learner.step(state, x)
    scale = (rank if alpha is None else alpha) / rank
    for r in range(R):
        b = torch.as_tensor(b0[r]).requires_grad_(True)
        a = torch.as_tensor(a0[r]).requires_grad_(True)
        gb, ga = torch.autograd.grad(_dense_loss(inst, b, a, scale, x[r]), [b, a])
        ref_a = a0[r] - 0.05 * ga.numpy() if train_a else a0[r]
        assert_close(new.b[r], b0[r] - ratio * 0.05 * gb.numpy())
        assert_close(new.a[r], ref_a)
    if not train_a:
        assert torch.equal(new.a, state.a)
    if b_zero and train_a:  # B = 0: ∇_A = s Bᵀ G = 0
        assert torch.equal(new.a, state.a)


def test_label_noise_enters_the_label():
    inst = _instance("tanh")
    learner = _learner(inst, rank=2, label_noise=0.3, lr_ratio=4.0)
    b0, a0 = _factors(inst, 2, False)
    state = learner.init_state(b0, a0)
    gen = np.random.default_rng(9)
    x = torch.as_tensor(gen.standard_normal((R, 4, inst.d)))
    eps = torch.as_tensor(gen.standard_normal((R, 4)))
    new = learner.step(state, x, eps)
    for r in range(R):
        b = torch.as_tensor(b0[r]).requires_grad_(True)
        a = torch.as_tensor(a0[r]).requires_grad_(True)
        loss = _dense_loss(inst, b, a, 1.0, x[r], eps[r], math.sqrt(0.3))
        gb, ga = torch.autograd.grad(loss, [b, a])
        assert_close(new.b[r], b0[r] - 4.0 * 0.05 * gb.numpy())
        assert_close(new.a[r], a0[r] - 0.05 * ga.numpy())


def test_zero_b_first_step_in_closed_form():
    """B₀ = 0: A does not move, and B₁ = ratio·η·s·mean_b 2(y − f₀)λⱼσ′(zⱼ) A(x − zⱼwⱼ)
    (the base network's rows are the student's, unit, so aⱼ = zⱼ and Nⱼ = 1)."""
    inst = _instance("tanh")
    learner = _learner(inst, rank=3, alpha=1.5, lr_ratio=3.0)
    b0, a0 = _factors(inst, 3, True)
    state = learner.init_state(b0, a0)
    x = np.random.default_rng(4).standard_normal((R, 5, inst.d))
    new = learner.step(state, torch.as_tensor(x))
    assert torch.equal(new.a, state.a)
    w, v, _ = dense_rows(inst)
    act = torch_activation(inst.activation)
    for r in range(R):
        z = x[r] @ w.T  # (b, k)
        y = act.fn(torch.as_tensor(x[r] @ v.T)).numpy() @ inst.lam
        f0 = act.fn(torch.as_tensor(z)).numpy() @ inst.lam
        dsig = act.deriv(torch.as_tensor(z)).numpy()
        coef = 2.0 * (y - f0)[:, None] * inst.lam * dsig  # (b, k)
        proj = x[r][:, None, :] - z[..., None] * w[None]  # (b, k, d) x − zⱼwⱼ
        step = np.einsum("nj,njd,ad->ja", coef, proj, a0[r]) / x.shape[1]
        assert_close(new.b[r], 3.0 * 0.05 * 0.5 * step)


def _capture(learner):
    """Wrap ``learner.prepare`` to keep a copy of every chunk of examples (and label normals)
    the engine hands it."""
    seen, prepare = [], learner.prepare

    def wrapped(state, x, eps=None, sqnorm=None):
        seen.append((x.clone().numpy(), None if eps is None else eps.clone().numpy()))
        return prepare(state, x, eps, sqnorm)

    learner.prepare = wrapped
    return seen


def _numpy_sgd(inst, b, a, xs, eps, *, scale, eta, ratio, noise_sd, train_a):
    """Plain numpy SGD of W + s·B·A in R^d on the examples xs (n, b, d): dense rows hⱼ, the
    textbook derivative of hⱼ/‖hⱼ‖ ((I − v̂ⱼv̂ⱼᵀ)/Nⱼ); returns the (B, A) after each step."""
    w, v, _ = dense_rows(inst)
    act = torch_activation(inst.activation)

    def fn(t):
        return act.fn(torch.as_tensor(t)).numpy()

    def deriv(t):
        return act.deriv(torch.as_tensor(t)).numpy()

    out = []
    for t in range(xs.shape[0]):
        x = xs[t]
        h = w + scale * b @ a
        n = np.linalg.norm(h, axis=1)
        vh = h / n[:, None]
        pre = x @ vh.T
        y = fn(x @ v.T) @ inst.lam + (noise_sd * eps[t] if eps is not None else 0.0)
        delta = -2.0 * (y - fn(pre) @ inst.lam)[:, None] * inst.lam * deriv(pre)  # (b, k)
        grad_h = np.zeros_like(h)
        for e in range(x.shape[0]):
            for j in range(inst.k):
                grad_h[j] += delta[e, j] * (x[e] - vh[j] * (vh[j] @ x[e])) / n[j]
        grad_h /= x.shape[0]
        gb, ga = scale * grad_h @ a.T, scale * b.T @ grad_h
        b = b - ratio * eta * gb
        if train_a:
            a = a - eta * ga
        out.append((b, a))
    return out


@pytest.mark.parametrize("opts", [
    dict(rank=2, init_b="gaussian", b_scale=0.1, init_a="kaiming", lr_ratio=4.0, batch=2,
         label_noise=0.2, alpha=3.0),
    dict(rank=1, train_a=False, init_b="gaussian", b_scale=0.05),
    dict(rank=3),
])
def test_numpy_sgd_reproduces_the_engine(opts):
    """The engine's run = a plain numpy R^d SGD on the same draws (examples captured from the
    engine, B₀ and A₀ drawn again from the stream (seed, run, init)), state and records."""
    inst = _instance("tanh", d=20)
    cfg = RunConfig(instance=SPEC | {"activation": "tanh", "d": 20}, learner="lora-ba",
                    eta=0.08, steps=120, runs=R, seed=11, checkpoints=5, streams="per_run",
                    finite_d_theory=False, **opts).validate()
    run = FullRun(cfg)
    seen = _capture(run.learner)
    traj = run.run()
    o = cfg.options
    r_, d = o.rank, 20
    xs = np.concatenate([x for x, _ in seen], 1)  # (R, steps, b, d)
    eps = np.concatenate([e for _, e in seen], 1) if seen[0][1] is not None else None
    assert xs.shape[1] == cfg.steps
    scale = (r_ if o.alpha is None else o.alpha) / r_
    w, _, u = dense_rows(inst)
    for r in range(R):
        gen = np.random.default_rng(run_seed(cfg.seed, r, "init"))
        a = (gen.uniform(-1, 1, (r_, d)) if o.init_a == "kaiming"
             else gen.standard_normal((r_, d))) / math.sqrt(d)
        b = o.b_scale * gen.standard_normal((K, r_)) if o.init_b == "gaussian" \
            else np.zeros((K, r_))
        path = [(b, a)] + _numpy_sgd(inst, b, a, xs[r], None if eps is None else eps[r],
                                     scale=scale, eta=cfg.eta, ratio=o.lr_ratio,
                                     noise_sd=math.sqrt(cfg.label_noise), train_a=o.train_a)
        assert_close(run.state.b[r], path[-1][0])
        assert_close(run.state.a[r], path[-1][1])
        for c, step in enumerate(traj.steps):
            bb, aa = path[step]
            ba = bb @ aa
            norm = np.linalg.norm(ba)
            if norm == 0:
                assert np.isnan(traj.overlap[r, c])
                assert np.isnan(traj.extra["update_overlap"][r, c])
            else:
                top = np.linalg.svd(ba)[2][0]
                assert abs(traj.overlap[r, c] - abs(top @ u)) < 1e-10
                want = inst.c @ ba @ u / (norm * np.linalg.norm(inst.c))
                assert abs(traj.extra["update_overlap"][r, c] - want) < 1e-10
            assert abs(traj.extra["b_norm"][r, c] - np.linalg.norm(bb)) < 1e-10
            assert abs(traj.extra["a_norm"][r, c] - np.linalg.norm(aa)) < 1e-10
            assert abs(traj.extra["delta_norm"][r, c] - scale * norm) < 1e-10
    # the flow starts at the run's own state
    np.testing.assert_allclose(traj.ode[:, 0], traj.overlap[:, 0], rtol=0, atol=1e-9)
    np.testing.assert_allclose(traj.extra["ode_loss"][:, 0], traj.loss[:, 0], rtol=1e-12)


def test_exact_loss_against_monte_carlo():
    """``loss`` at a state = a Monte Carlo E(f* − f̂)² of the dense student within 5 SE."""
    spec = SPEC | {"activation": "tanh", "d": 20}
    cfg = RunConfig(instance=spec, learner="lora-ba", rank=2, init_b="gaussian", b_scale=0.5,
                    eta=0.05, steps=30, runs=R, seed=2, checkpoints=3,
                    finite_d_theory=False).validate()
    run = FullRun(cfg)
    traj = run.run()
    inst = _instance("tanh", d=20)
    w, v, _ = dense_rows(inst)
    sig = torch_activation(inst.activation).fn
    gen = np.random.default_rng(0)
    for r in range(R):
        h = w + run.state.b[r].numpy() @ run.state.a[r].numpy()
        rows = h / np.linalg.norm(h, axis=1, keepdims=True)
        x = gen.standard_normal((200_000, 20))
        err = ((sig(torch.as_tensor(x @ v.T)) - sig(torch.as_tensor(x @ rows.T))).numpy()
               @ inst.lam) ** 2
        mc, se = err.mean(), err.std() / math.sqrt(err.size)
        assert abs(traj.loss[r, -1] - mc) <= 5 * se, (traj.loss[r, -1], mc, se)
        assert traj.loss[r, -1] > 10 * se  # a loss that is not 0


@pytest.mark.parametrize("kw, field", [
    (dict(rank=13), "rank"),
    (dict(lr_ratio=0.0), "lr_ratio"),
    (dict(lr_ratio=-2.0), "lr_ratio"),
    (dict(init_a="xavier"), "init_a"),
    (dict(init_b="ones"), "init_b"),
    (dict(alpha=0.0), "alpha"),
])
def test_bad_input_is_a_one_line_error(kw, field):
    with pytest.raises(ConfigError) as err:
        RunConfig(instance=SPEC, learner="lora-ba", **kw).validate()
    assert err.value.field == field and "\n" not in str(err.value)


def test_other_conventions_are_refused():
    with pytest.raises(ConfigError) as err:
        RunConfig(instance=SPEC | {"convention": "appB"}, learner="lora-ba").validate()
    assert "'lora-ba'" in str(err.value) and "\n" not in str(err.value)


def test_rank_d_is_accepted():
    RunConfig(instance=SPEC, learner="lora-ba", rank=D).validate()


# ---------------------------------------------------------------- the population flow
@pytest.mark.parametrize("activation", ["relu", "tanh", "he3"])
def test_population_gradient_is_the_derivative_of_the_exact_loss(activation):
    """``lora_ba_gradient`` = central differences of the exact loss (dual kernels)."""
    inst = _instance(activation)
    gen = np.random.default_rng(0)
    b, a, scale = 0.4 * gen.standard_normal((K, 2)), 0.5 * gen.standard_normal((2, K + 3)), 0.7
    gb, ga = lora_ba_gradient(inst, b, a, scale)

    def loss(b_, a_):
        return float(true_network_loss(inst, scale * b_ @ a_))

    for point, grad, other in ((b, gb, "b"), (a, ga, "a")):
        fd = np.zeros_like(point)
        for i in np.ndindex(point.shape):
            e = np.zeros_like(point)
            e[i] = 1e-6
            args = ((b + e, a), (b - e, a)) if other == "b" else ((b, a + e), (b, a - e))
            fd[i] = (loss(*args[0]) - loss(*args[1])) / 2e-6
        assert_close(grad, fd, 1e-7)


def test_population_gradient_is_the_mean_sample_gradient():
    """``lora_ba_gradient`` = the mean of the learner's closed-form sample gradients over
    Monte Carlo examples, entry by entry within 5 SE (the flow's drift is the step's mean)."""
    inst = _instance("tanh")
    learner = _learner(inst, rank=2, alpha=3.0)
    b0, a0 = _factors(inst, 2, False)
    state = learner.init_state(b0, a0)
    x = torch.as_tensor(np.random.default_rng(1).standard_normal((R, 20_000, inst.d)))
    gb, ga, _ = learner.sample_gradients(state, x)
    for r in range(R):
        want_b, want_a = lora_ba_gradient(inst, b0[r], a0[r], 1.5)
        for samples, want in ((gb[r].numpy(), want_b), (ga[r].numpy(), want_a)):
            se = samples.std(0) / math.sqrt(samples.shape[0])
            assert (np.abs(samples.mean(0) - want) <= 5 * se + 1e-12).all()


@pytest.mark.parametrize("opts", [
    dict(rank=2),
    dict(rank=1, lr_ratio=4.0),
    dict(rank=3, train_a=False, init_b="gaussian", b_scale=0.01),
])
def test_flow_follows_the_mean_of_engine_runs(opts):
    """``ode`` (the flow from each run's start) = the mean overlap of 48 engine runs at
    d = 40, η = 0.0025 (η·d = 0.1), within max(4 SE, 0.03) at every checkpoint."""
    spec = {"activation": "relu", "k": 3, "d": 40, "xi": 1.5, "c": "gaussian",
            "c_hat": "gaussian", "lam": "random_sign", "seed": 3}
    cfg = RunConfig(instance=spec, learner="lora-ba", eta=0.0025, steps=2000, runs=48,
                    seed=1, checkpoints=9, spacing="linear", finite_d_theory=False,
                    **opts).validate()
    traj = FullRun(cfg).run()
    assert (traj.diverged_step == -1).all()
    defined = np.isfinite(traj.overlap).all(0)
    assert defined[1:].all()
    mean = traj.overlap[:, defined].mean(0)
    se = traj.overlap[:, defined].std(0) / math.sqrt(cfg.runs)
    ode = traj.ode[:, defined].mean(0)
    assert (np.abs(mean - ode) <= np.maximum(4 * se, 0.03)).all(), (mean, ode, se)
    assert ode[-1] - ode[0] > 0.05 if defined[0] else ode[-1] > 0.5  # it learns
