"""The linearized (NTK) learner: Taylor model, sample loss, losses, engine, Fig. 3(a) (gradients
and steps against autograd: ``test_learner_protocol``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import assert_close, rank1_learner

import hermite
from dynamics.activations import torch_activation
from dynamics.engines.engine import FullRun, simulate
from dynamics.instances.instance import build_instance
from dynamics.learners import Problem
from dynamics.learners.linearized import (
    Linearized,
    LinearizedFullRank,
    linear_loss,
    reduce_rows,
    true_loss,
)
from dynamics.setup.config import ConfigError, RunConfig

K, D, R, B = 4, 11, 3, 2
F64 = torch.float64


def _instance(activation="tanh", u_alpha=0.0, W="orthonormal", xi=1.3, d=D, k=K, seed=3):
    return build_instance({"activation": activation, "k": k, "d": d, "xi": xi, "W": W,
                           "c": "gaussian", "c_hat": "gaussian", "lam": "random_sign",
                           "u_alpha": u_alpha, "seed": seed})


def _dense(inst):
    """(W (k, d), u (d,)) in the canonical frame, for the reference computations."""
    w = torch.zeros(inst.k, inst.d, dtype=F64)
    w[:, : inst.k] = torch.as_tensor(inst.w_factor)
    u = torch.zeros(inst.d, dtype=F64)
    u[: inst.k] = torch.as_tensor(inst.u_w)
    u[inst.k] = inst.u_perp
    return w, u


def _teacher(inst, x):
    w, u = _dense(inst)
    v = w + inst.xi * torch.as_tensor(inst.c)[:, None] * u
    v = v / v.norm(dim=1, keepdim=True)
    return torch_activation(inst.activation).fn(x @ v.T) @ torch.as_tensor(inst.lam)


def _student(inst, delta, x):
    """The true fine-tuned network: rows (wⱼ + Δⱼ)/‖wⱼ + Δⱼ‖, second layer λ."""
    w, _ = _dense(inst)
    rows = w + delta
    rows = rows / rows.norm(dim=1, keepdim=True)
    return torch_activation(inst.activation).fn(x @ rows.T) @ torch.as_tensor(inst.lam)


def _ntk(inst, x):
    """∇_Δ f̂(x; Δ) at Δ = 0 by autograd (the reference linearization), (k, d)."""
    delta = torch.zeros(inst.k, inst.d, dtype=F64, requires_grad=True)
    (grad,) = torch.autograd.grad(_student(inst, delta, x), delta)
    return grad


def _rank1(activation="tanh", project=True, joint=False, u_alpha=0.0, W="orthonormal",
           prox=0.0, batch=B):
    inst = _instance(activation, u_alpha, W)
    learner, state, x = rank1_learner(Linearized, inst, R, batch, project=project,
                                      joint_c=joint, prox=prox)
    return inst, learner, state, x


def _full(activation="tanh", project=True, prox=0.0, u_alpha=0.0, W="orthonormal", batch=B):
    inst = _instance(activation, u_alpha, W)
    problem = Problem.from_instances([inst] * R, torch.device("cpu"), F64)
    learner = LinearizedFullRank(problem, eta=0.03, project=project, prox=prox)
    state, m0 = learner.initial_state(None, [inst] * R)
    assert np.isnan(m0).all() and float(state.delta.abs().max()) == 0.0
    gen = np.random.default_rng(12)
    state.delta += 0.3 * torch.as_tensor(gen.standard_normal((R, K, D)))
    if project:
        state.delta[:, :, :K] = 0.0
    x = torch.as_tensor(gen.standard_normal((R, batch, D)))
    return inst, learner, state, x


def _f_lin_rank1(learner, state, x):
    pre = learner.prepare(state, x[:, None])
    return pre.y[:, 0] - learner.terms(state, x, pre).resid


def _f_lin_full(learner, state, x):
    pre = learner.prepare(state, x[:, None])
    return pre.y[:, 0] - learner._residual(state, x, pre, 0)


def _rank1_delta(inst, state, r):
    return inst.xi * state.c_hat[r][:, None] * state.u_hat[r][None, :]


def _close(ours, ref, rtol=1e-10):
    assert_close(ours, ref, rtol, floor=1e-5)  # floor: rounding of 0


# ---------------------------------------------------------------- the Taylor model
@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("variant", ["proj", "noproj", "full", "full-noproj"])
def test_f_lin_is_the_jvp_of_the_true_student(activation, variant):
    """f_lin(x; Δ) = f̂(x; 0) + ⟨∇_Δ f̂(x; 0), Δ⟩ exactly (autograd reference)."""
    project = not variant.endswith("noproj")
    if variant.startswith("full"):
        inst, learner, state, x = _full(activation, project, u_alpha=0.3, W="separated")
        ours, delta = _f_lin_full(learner, state, x), lambda r: state.delta[r]
    else:
        inst, learner, state, x = _rank1(activation, project, u_alpha=0.3, W="separated")
        ours = _f_lin_rank1(learner, state, x)
        delta = lambda r: _rank1_delta(inst, state, r)  # noqa: E731
    for r in range(R):
        for b in range(B):
            ref = _student(inst, torch.zeros(K, D, dtype=F64), x[r, b]) \
                + (_ntk(inst, x[r, b]) * delta(r)).sum()
            _close(ours[r, b], ref)


@pytest.mark.parametrize("variant", ["rank1", "full"])
def test_f_lin_is_first_order_taylor_of_the_true_student(variant):
    """|f̂(εΔ) − f_lin(εΔ)| = O(ε²): the error ratio for ε → ε/2 is ≈ 1/4."""
    errs = []
    for eps in (0.02, 0.01, 0.005):
        if variant == "full":
            inst, learner, state, x = _full("tanh", False, W="separated")
            state.delta *= eps
            ours = _f_lin_full(learner, state, x)
            delta = [state.delta[r] for r in range(R)]
        else:
            inst, learner, state, x = _rank1("tanh", False, W="separated")
            state.c_hat *= eps
            ours = _f_lin_rank1(learner, state, x)
            delta = [_rank1_delta(inst, state, r) for r in range(R)]
        true = torch.stack([torch.stack([_student(inst, delta[r], x[r, b]) for b in range(B)])
                            for r in range(R)])
        errs.append(float((ours - true).abs().max()))
        f0 = _student(inst, torch.zeros(K, D, dtype=F64), x[0, 0])
        assert abs(float(true[0, 0] - f0)) > 20 * errs[-1]  # the first-order term dominates
    ratios = np.array(errs[1:]) / np.array(errs[:-1])
    assert np.all((ratios > 0.2) & (ratios < 0.3)), ratios


# ---------------------------------------------------------------- the sample loss
def _rank1_reference(inst, u_hat, c_hat, x, prox):
    """(y − f_lin)² and its prox term prox‖ξĉûᵀ‖², f_lin = f̂(0) + ⟨∇f̂(0), ξĉûᵀ⟩."""
    delta = inst.xi * c_hat[:, None] * u_hat[None, :]
    f_lin = _student(inst, torch.zeros(K, D, dtype=F64), x) + (_ntk(inst, x) * delta).sum()
    return (_teacher(inst, x) - f_lin) ** 2, prox * delta.square().sum()


@pytest.mark.parametrize("activation", ["relu", "tanh", "he3"])
@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
@pytest.mark.parametrize("joint", [False, True], ids=["frozen", "joint"])
@pytest.mark.parametrize("prox", [0.0, 0.3])
def test_rank1_sample_loss_is_the_taylor_model(activation, project, joint, prox):
    """sample_loss (whose gradients test_learner_protocol checks against the closed form)
    = (y − f_lin)² + prox‖Δ‖² with f_lin by autograd's JVP of the true student;
    sample_gradients' loss = its data term."""
    u_alpha, W = (0.4, "separated") if not project else (0.0, "orthonormal")
    inst, learner, state, x = _rank1(activation, project, joint, u_alpha, W, prox)
    _, _, loss = learner.sample_gradients(state, x)
    ours = learner.sample_loss(state, x)
    for r in range(R):
        for b in range(B):
            data, penalty = _rank1_reference(inst, state.u_hat[r], state.c_hat[r], x[r, b],
                                             prox)
            _close(ours[r, b], data + penalty)
            _close(loss[r, b], data)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
@pytest.mark.parametrize("prox", [0.0, 0.3])
def test_full_rank_sample_loss_is_the_taylor_model(activation, project, prox):
    """sample_loss and sample_gradients' loss = (y − f_lin)² + prox‖Δ‖²_F, f_lin by
    autograd's JVP of the true student."""
    inst, learner, state, x = _full(activation, project, prox, u_alpha=0.3, W="separated")
    _, loss = learner.sample_gradients(state, x)
    ours = learner.sample_loss(state, x)
    for r in range(R):
        for b in range(B):
            delta = state.delta[r]
            f_lin = _student(inst, torch.zeros(K, D, dtype=F64), x[r, b]) \
                + (_ntk(inst, x[r, b]) * delta).sum()
            ref = (_teacher(inst, x[r, b]) - f_lin) ** 2 + prox * delta.square().sum()
            _close(ours[r, b], ref)
            _close(loss[r, b], ref)


def test_label_noise_enters_the_label():
    """y = f*(x) + √(label_noise)·ε in both parameterisations (residual shifts by −√v·ε)."""
    eps = torch.as_tensor(np.random.default_rng(2).standard_normal((R, B)))
    for make in (_rank1, _full):
        inst, learner, state, x = make("tanh")
        learner.noise_sd = math.sqrt(0.3)
        assert learner.needs_label_noise
        pre, pre_noisy = learner.prepare(state, x[:, None]), learner.prepare(state, x[:, None],
                                                                               eps[:, None])
        _close(pre_noisy.y[:, 0] - pre.y[:, 0], math.sqrt(0.3) * eps, 1e-12)
        _close(pre.y[:, 0], torch.stack([_teacher(inst, x[r]) for r in range(R)]), 1e-12)


@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
@pytest.mark.parametrize("batch", [1, 3])
def test_full_rank_step_is_plain_sgd(project, batch):
    inst, learner, state, x = _full("relu", project, prox=0.2, batch=batch)
    grads, _ = learner.sample_gradients(state, x)
    learner.eta_r[1] = 0.0  # a frozen run does not move
    new = learner.step(state, x)
    _close(new.delta, state.delta - learner.eta_r[:, None, None] * grads.mean(1), 1e-12)
    assert torch.equal(new.delta[1], state.delta[1])


def test_full_rank_rows_stay_orthogonal_to_their_base_rows():
    """Without Π the data gradient x − zⱼwⱼ is ⊥ wⱼ: from Δ₀ = 0, ⟨wⱼ, Δⱼ⟩ stays 0."""
    inst, learner, state, x = _full("relu", project=False, prox=0.1)
    state.delta.zero_()
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        learner.step_(state, torch.randn(R, B, D, generator=gen, dtype=F64))
    assert float(state.delta.abs().max()) > 1e-2
    assert float(learner._w_dot(state.delta).abs().max()) < 1e-14
    assert float(state.delta[:, :, :K].abs().max()) > 1e-3  # but not ⊥ span W


# ---------------------------------------------------------------- observables
def _run(config):
    run = FullRun(config.validate())
    traj = run.run()
    return run, traj


def _mc_reference(inst, delta, n, seed):
    """Independent Monte Carlo in all d coordinates: (true loss, linear loss, their SEs)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inst.d, generator=gen, dtype=F64)
    w, _ = _dense(inst)
    y = _teacher(inst, x)
    rows = (w + delta) / (w + delta).norm(dim=1, keepdim=True)
    lam = torch.as_tensor(inst.lam)
    true = (y - torch_activation(inst.activation).fn(x @ rows.T) @ lam) ** 2
    z = x @ w.T
    ell = x @ delta.T - z * (w * delta).sum(1)  # ⟨Δⱼ, x⟩ − zⱼ⟨wⱼ, Δⱼ⟩, written out again
    act = torch_activation(inst.activation)
    f_lin = act.fn(z) @ lam + (act.deriv(z) * lam * ell).sum(1)
    lin = (y - f_lin) ** 2
    return [(float(v.mean()), float(v.std() / math.sqrt(n))) for v in (true, lin)]


@pytest.mark.parametrize("variant", ["rank1-joint", "rank1-noproj", "full"])
def test_losses_match_independent_monte_carlo(variant):
    """loss and loss_linear (dual kernels, reduced basis; both exact) vs
    plain Monte Carlo in d dimensions on independent examples with the final weights."""
    inst_spec = {"activation": "relu", "k": 3, "d": 24, "xi": math.sqrt(3), "W": "separated",
                 "c": "gaussian", "c_hat": "gaussian", "seed": 2, "u_alpha": 0.2}
    opts = {"rank1-joint": dict(joint_c=True), "rank1-noproj": dict(project=False),
            "full": dict(full_rank=True, project=False, eta=0.002)}[variant]
    cfg = RunConfig(**({"instance": inst_spec, "learner": "linearized", "eta": 0.02,
                        "steps": 600, "runs": 2, "checkpoints": 4, "eval_size": 100_000,
                        "seed": 4} | opts))
    run, traj = _run(cfg)
    inst = run.instances[0]
    for r in range(cfg.runs):
        if cfg.options.full_rank:
            delta = run.state.delta[r]
        else:
            delta = _rank1_delta(inst, run.state, r)
        (t_mc, t_se), (l_mc, l_se) = _mc_reference(inst, delta, 100_000, 7 + r)
        assert abs(traj.loss[r, -1] - t_mc) < 4.5 * t_se
        assert abs(traj.extra["loss_linear"][r, -1] - l_mc) < 4.5 * l_se  # exact
        assert traj.extra["loss_linear"][r, -1] != pytest.approx(traj.loss[r, -1], rel=1e-3)
        _close(traj.extra["delta_norm"][r, -1], delta.norm(), 1e-10)


def test_rank1_true_loss_is_the_population_loss():
    """Projected rank 1: the network loss equals hermite.population_loss(inst, m, ĉ)."""
    cfg = RunConfig(instance={"activation": "relu", "k": 5, "d": 30, "xi": 2.0,
                              "W": "separated", "c": "gaussian", "c_hat": "gaussian",
                              "seed": 1}, learner="linearized", eta=0.02, steps=300, runs=2,
                    checkpoints=5, joint_c=True, eval_size=2000)
    run, traj = _run(cfg)
    inst = run.instances[0]
    c_hats = run.records.arrays()["c_hat"]
    for r in range(cfg.runs):
        for j in range(len(traj.steps)):
            ref = hermite.population_loss(inst, np.array([traj.overlap[r, j]]),
                                          c_hat=c_hats[r, j])
            assert traj.loss[r, j] == pytest.approx(float(ref[0]), rel=1e-10)
    # the rank-1 mean-drift ODE (hermite.flows.linearized) from each run's start
    assert traj.c_overlap is not None and np.isfinite(traj.ode).all()


def test_reduce_rows_preserves_inner_products():
    gen = torch.Generator().manual_seed(3)
    delta = torch.randn(2, 4, 17, generator=gen, dtype=F64)
    red = torch.as_tensor(reduce_rows(delta, 4))
    assert red.shape == (2, 4, 9)
    _close(red[:, :, :5], delta[:, :, :5], 0)
    _close(red @ red.transpose(1, 2), delta @ delta.transpose(1, 2), 1e-12)


def test_full_rank_overlap_is_the_top_singular_direction():
    inst, learner, state, _ = _full("relu", project=True)
    _, u = _dense(inst)
    state.delta[0] = 0.01 * state.delta[0] + 5.0 * torch.outer(torch.ones(K, dtype=F64), u)
    state.delta[2] = 0.0
    obs = learner.observe(state)
    vt = torch.linalg.svd(state.delta[1], full_matrices=False)[2]
    assert obs["overlap"][0] > 0.999
    assert obs["overlap"][1] == pytest.approx(abs(float(vt[0] @ u)), rel=1e-10)
    assert np.isnan(obs["overlap"][2])


def test_loss_helpers_at_zero_delta_give_the_base_model_loss():
    """Δ = 0: true and linear loss both equal E(f* − f₀)² (closed form by dual kernels)."""
    inst = _instance("relu", d=20, xi=2.0)
    delta = np.zeros((1, 1, K, 2 * K + 1))
    base = true_loss([inst], delta)[0, 0]
    lin = linear_loss([inst], delta)[0, 0]
    (ref, se), _ = _mc_reference(inst, torch.zeros(K, 20, dtype=F64), 200_000, 9)
    assert abs(base - ref) < 4.5 * se
    assert lin == pytest.approx(base, rel=1e-12)


# ---------------------------------------------------------------- engine
_SMALL = {"activation": "relu", "k": 4, "d": 30, "xi": 2.0, "W": "separated", "c": "gaussian",
          "c_hat": "gaussian", "seed": 0}


@pytest.mark.parametrize("opts", [dict(joint_c=True), dict(project=False, prox=0.05),
                                  dict(full_rank=True, eta=0.002, project=False,
                                       instance_seeds="per_run")],
                         ids=["rank1-joint", "rank1-noproj-prox", "full-noproj-per-run-W"])
def test_engine_runs_batched_equal_runs_alone(opts):
    base = {"instance": _SMALL, "learner": "linearized", "eta": 0.02, "steps": 300,
            "checkpoints": 6, "eval_size": 3000, "seed": 5} | opts
    many = simulate(RunConfig(**(base | {"runs": 3})))
    one = simulate(RunConfig(**(base | {"runs": 1})))
    # same streams; equal up to the BLAS blocking, which may differ with R on many cores
    same = dict(rtol=1e-12, atol=0)
    np.testing.assert_allclose(many.overlap[:1], one.overlap, **same)
    np.testing.assert_allclose(many.loss[:1], one.loss, **same)
    np.testing.assert_allclose(many.extra["loss_linear"][:1], one.extra["loss_linear"], **same)
    assert many.loss_kind == "exact" and np.isfinite(many.loss).all()
    assert not np.array_equal(many.loss[0], many.loss[1])
    again = simulate(RunConfig(**(base | {"runs": 3})))
    np.testing.assert_array_equal(many.loss, again.loss)


def test_full_rank_divergence_is_detected():
    traj = simulate(RunConfig(instance=_SMALL, learner="linearized", full_rank=True, eta=5.0,
                              steps=200, runs=2, checkpoints=4, eval_size=1000))
    assert (traj.diverged_step > 0).all()
    assert np.isnan(traj.loss[:, -1]).all()


@pytest.mark.parametrize("opts, field", [
    (dict(rank=2), "rank"),
    (dict(full_rank=True, joint_c=True), "joint_c"),
    (dict(full_rank=True, init="aligned"), "init"),
    (dict(engine="reduced"), "engine"),
])
def test_unsupported_settings_are_config_errors(opts, field):
    with pytest.raises(ConfigError) as err:
        RunConfig(instance=_SMALL, learner="linearized", **opts).validate()
    assert err.value.field == field and "\n" not in str(err.value)


# ---------------------------------------------------------------- Fig. 3(a), scaled down
def test_fig3a_scaled_down_linearized_plateaus_while_finetuning_recovers():
    """ReLU, ξ = √k, ĉ joint: fine-tuning reaches ⟨û,u⟩ > 0.95, while the linearized model's
    true loss stays above 10× fine-tuning's final loss at every checkpoint."""
    from sims.experiments import linearized_plateau as bench

    res = bench.measure(bench.configs(d=100, k=8, runs=2, eta_times_d=0.15, steps_per_d=200,
                                      seed=0, checkpoints=20))
    assert np.all(res["ft_final_overlap"] > 0.95), res["ft_final_overlap"]
    assert res["ratio"] > 10, res["ratio"]
    assert np.all(res["lin_final_loss_linear"] < res["initial_loss"])  # it did train f_lin
