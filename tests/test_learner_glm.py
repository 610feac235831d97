"""The ``glm`` learner (single index, full sphere): its sample loss, loss, drift, ODE, reduced
chain (exact law, with power) and the d-exponents of the scaling files (gradients and step
against autograd: ``test_learner_protocol``)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from scipy.stats import beta, ks_2samp, kstest

import hermite
from dynamics.activations import torch_activation
from dynamics.engines.engine import simulate, simulate_full
from dynamics.instances.instance import build_instance
from dynamics.learners import Problem
from dynamics.learners.glm import GLM, glm_drift, glm_loss, glm_ode
from dynamics.reduced import first_passage_reduced, glm_chain, reduced_supported, simulate_reduced
from dynamics.setup.config import ConfigError, RunConfig
from sims.experiments.scaling import parse_scaling
from sims.experiments.sweep_spec import resolve_config

F64 = torch.float64
K, D, R = 3, 9, 3


def _problem(activation, d=D, runs=R, u_alpha=0.4):
    inst = build_instance({"activation": activation, "k": K, "d": d, "u_alpha": u_alpha,
                           "seed": 2})
    return inst, Problem.from_instances([inst] * runs, torch.device("cpu"), F64)


def _u(inst):
    u = torch.zeros(inst.d, dtype=F64)
    u[:K] = torch.as_tensor(inst.u_w)
    u[K] = inst.u_perp
    return u


def _unit_rows(gen, runs, d):
    u = gen.standard_normal((runs, d))
    return torch.as_tensor(u / np.linalg.norm(u, axis=1, keepdims=True))


@pytest.mark.parametrize("activation", ["he3", "relu", "tanh", "sigmoid"])
@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_sample_loss_is_the_single_index_model(activation, noise):
    """sample_loss (whose gradient test_learner_protocol checks against the closed form) and
    sample_gradients' loss = (σ(⟨u, x⟩) + √noise·ε − σ(⟨û, x⟩))², written out."""
    inst, problem = _problem(activation)
    learner = GLM(problem, eta=0.1, batch=2, label_noise=noise)
    gen = np.random.default_rng(4)
    state = learner.init_state(_unit_rows(gen, R, D).numpy())
    x = torch.as_tensor(gen.standard_normal((R, 2, D)))
    eps = torch.as_tensor(gen.standard_normal((R, 2))) if noise else None
    _, none, loss = learner.sample_gradients(state, x, eps)
    assert none is None
    ours = learner.sample_loss(state, x, eps)
    sig, u = torch_activation(inst.activation).fn, _u(inst)
    assert abs(float(u.norm()) - 1.0) < 1e-14 and inst.u_w.any()  # u has a span-W part
    for r in range(R):
        for b in range(2):
            y = sig(u @ x[r, b]) + (math.sqrt(noise) * eps[r, b] if noise else 0.0)
            ref = (y - sig(state.u_hat[r] @ x[r, b])) ** 2
            assert torch.allclose(ours[r, b], ref, rtol=1e-12)
            assert torch.allclose(loss[r, b], ref, rtol=1e-12)


def test_bad_configs_are_refused():
    inst = dict(activation="he3", k=1, d=20)
    for field, value in (("joint_c", True), ("rank", 2)):
        with pytest.raises(ConfigError, match=field):
            RunConfig(instance=inst, learner="glm", **{field: value}).validate()


def test_initial_overlap_has_the_uniform_sphere_law_in_both_engines():
    """m₀ = ⟨û₀, u⟩ for û₀ uniform on S^{d−1}: m₀² ~ Beta(1/2, (d−1)/2), sign symmetric."""
    d, runs = 12, 3000
    cfg = RunConfig(instance=dict(activation="he3", k=2, d=d, u_alpha=0.6), learner="glm",
                    runs=runs, seed=3)
    inst = cfg.run_instances()
    problem = Problem.from_instances(inst, torch.device("cpu"), F64)
    _, m_full = GLM.from_config(cfg, problem).initial_state(cfg, inst)
    _, _, _, m_red, nu_red = glm_chain._start(cfg)
    np.testing.assert_allclose(m_red**2 + nu_red**2, 1.0, rtol=1e-14)
    law = beta(0.5, (d - 1) / 2)
    n_tests = 4
    for m in (m_full, m_red):
        assert kstest(m**2, law.cdf).pvalue > 0.01 / n_tests
        assert abs(np.mean(m > 0) - 0.5) < 4 * 0.5 / math.sqrt(runs)
    # the test has power: d − 2 in place of d is rejected
    assert kstest(m_red**2, beta(0.5, (d - 3) / 2).cdf).pvalue < 1e-4
    aligned = RunConfig(**{**cfg.__dict__, "init": "aligned"})
    _, m_al = GLM.from_config(aligned, problem).initial_state(aligned, inst)
    np.testing.assert_allclose(m_al, np.abs(m_full))


@pytest.mark.parametrize("activation", ["he3", "relu", "tanh"])
def test_exact_loss_matches_monte_carlo(activation):
    act = build_instance({"activation": activation, "k": 1}).activation
    gen = np.random.default_rng(7)
    n = 400_000
    a, b = gen.standard_normal(n), gen.standard_normal(n)
    for m in (-0.4, 0.3, 0.9):
        s = m * a + math.sqrt(1 - m * m) * b
        t_act = torch_activation(act)
        sq = (t_act.fn(torch.as_tensor(a)) - t_act.fn(torch.as_tensor(s))).numpy() ** 2
        se = sq.std() / math.sqrt(n)
        assert abs(sq.mean() - float(glm_loss(act, m))) < 4.5 * se, (activation, m)
    assert np.isnan(glm_loss(act, np.array([np.nan]))).all()


@pytest.mark.parametrize("activation,m", [("he3", 0.5), ("he3", -0.3), ("tanh", 0.3)])
def test_one_step_drift_of_the_full_step(activation, m):
    """E[m' − m | û] = η·2K′(m)(1 − m²) + O(η²d): Monte Carlo over x of the learner's step."""
    d, n, eta = 8, 1_000_000, 1e-6
    inst = build_instance({"activation": activation, "k": 1, "d": d, "seed": 0})
    problem = Problem.from_instances([inst] * n, torch.device("cpu"), F64)
    learner = GLM(problem, eta=eta)
    u0 = np.zeros((n, d))
    u0[:, 1], u0[:, 2] = m, math.sqrt(1 - m * m)  # u = e₁ (k = 1 canonical frame)
    state = learner.init_state(u0)
    x = torch.as_tensor(np.random.default_rng(8).standard_normal((n, 1, d)))
    learner.step_(state, x)
    dm = (problem.overlap(state.u_hat).numpy() - m) / eta
    se = dm.std() / math.sqrt(n)
    want = float(glm_drift(inst.activation, m))
    bias = 2 * eta * d * float(np.mean(dm**2))  # generous O(η²d) bound, in units of η
    assert 4 * se < 0.25 * abs(want)  # informative: resolves the drift to ±25 %
    assert abs(dm.mean() - want) < 4 * se + bias, (dm.mean(), want, se)


def test_population_map_discrete_exact_and_continuous():
    act = build_instance({"activation": "he3", "k": 1}).activation
    m0 = np.array([0.2, -0.1, 0.05, np.nan])
    eta, steps = 2e-3, np.array([0, 1, 7, 300, 2000])
    disc = glm_ode(act, eta, m0, steps, method="discrete")
    ref = np.empty((3, steps.size))  # the map iterated in numpy with the exact K′ = 3m²
    m, t = m0[:3].copy(), 0
    for c, target in enumerate(steps):
        while t < target:
            m = m + eta * 2 * hermite.dual_kernel_derivative(act, m) * (1 - m * m)
            t += 1
        ref[:, c] = m
    # table error ≤ 1e-10·max|2K′| per step, accumulated over ≤ 2000 steps of size η
    np.testing.assert_allclose(disc[:3], ref, rtol=0, atol=2000 * eta * 6e-10)
    cont = glm_ode(act, eta, m0, steps, method="continuous")
    assert np.isnan(cont[3]).all()
    # closed form of the flow for He₃ (2K′ = 6m²): −1/m + atanh m = −1/m₀ + atanh m₀ + 6ηt
    for r in range(3):
        ok = np.abs(cont[r]) < 0.99  # away from the fixed point m = 1
        assert ok.sum() >= 3
        lhs = -1 / cont[r, ok] + np.arctanh(cont[r, ok])
        rhs = -1 / m0[r] + np.arctanh(m0[r]) + 6 * eta * steps[ok]
        np.testing.assert_allclose(lhs, rhs, rtol=1e-7)
    # the map is the flow's Euler scheme: equal up to O(η)
    assert np.max(np.abs(cont[:3] - disc[:3])) < 50 * eta
    assert np.max(np.abs(cont[:3] - disc[:3])) > 0
    auto = glm_ode(act, eta, m0[:3], steps)
    np.testing.assert_array_equal(auto, disc[:3])


def test_full_engine_trajectory_and_run_independence():
    cfg = RunConfig(instance=dict(activation="tanh", k=2, d=30, seed=1), learner="glm",
                    eta=0.5 / 30, steps=300, runs=6, seed=4, checkpoints=5)
    tr = simulate(cfg)
    assert tr.engine == "full" and tr.loss_kind == "exact"
    np.testing.assert_allclose(tr.overlap[:, 0], tr.m0)
    np.testing.assert_allclose(tr.loss, glm_loss(build_instance(cfg.instance).activation,
                                                 tr.overlap))
    np.testing.assert_allclose(tr.ode[:, 0], tr.m0)
    assert np.all(np.diff(tr.ode[tr.m0 > 0], axis=1) >= 0)  # tanh: K′ > 0, m̄ increases
    assert tr.overlap[:, -1].mean() > 0.8  # learned
    fewer = simulate(RunConfig(**{**cfg.__dict__, "runs": 3}))
    np.testing.assert_array_equal(fewer.overlap, tr.overlap[:3])


def test_reduced_dispatch_determinism_and_first_passage():
    cfg = RunConfig(instance=dict(activation="he3", k=1, d=40), learner="glm", eta=0.05 / 40,
                    steps=4000, runs=6, seed=2, engine="auto", init="aligned")
    assert reduced_supported(cfg) == (True, "")
    a = simulate(cfg)
    assert a.engine == "reduced" and np.all(a.m0 >= 0)
    b = simulate_reduced(RunConfig(**{**cfg.__dict__, "runs": 3}))
    np.testing.assert_array_equal(a.overlap[:3], b.overlap)
    with pytest.raises(ValueError, match="numba"):
        simulate_reduced(cfg, backend="torch")
    hit = first_passage_reduced(cfg, 0.2, absolute=False)
    assert np.isfinite(hit).any()
    for r in range(cfg.runs):  # same stream: the stopped chain is the recorded one until its hit
        t = np.inf if np.isnan(hit[r]) else hit[r]
        assert np.all(a.overlap[r, a.steps < t] < 0.2)
        assert np.all(a.overlap[r, a.steps == t] >= 0.2)


@pytest.mark.parametrize("batch", [1, 3])
def test_chain_step_formula_is_the_full_step(batch):
    """(G3)/(G4) of ``glm_chain``: with x = (a, b, r) in the basis (u, e, rest), the full
    step's m' and ν' are the chain's functions of (m, ν, a, b, ‖Σḡₙrₙ‖²)."""
    d, runs, eta = 7, 5, 0.3
    inst = build_instance({"activation": "he3", "k": 1, "d": d, "seed": 0})
    problem = Problem.from_instances([inst] * runs, torch.device("cpu"), F64)
    learner = GLM(problem, eta=eta, batch=batch, label_noise=0.2)
    gen = np.random.default_rng(9)
    m = np.array([0.9, 0.3, 0.0, -0.5, -0.99])
    nu = np.sqrt(1 - m * m)
    u0 = np.zeros((runs, d))
    u0[:, 1], u0[:, 2] = m, nu  # u = coordinate 1, e = coordinate 2, rest = {0, 3, …}
    state = learner.init_state(u0)
    x = torch.as_tensor(gen.standard_normal((runs, batch, d)))
    eps = torch.as_tensor(gen.standard_normal((runs, batch)))
    new = learner.step(state, x, eps)
    xn = x.numpy()
    a, b = xn[..., 1], xn[..., 2]
    rest = np.concatenate([xn[..., :1], xn[..., 3:]], -1)
    sig = torch_activation(inst.activation)
    s = m[:, None] * a + nu[:, None] * b
    y = sig.fn(torch.as_tensor(a)).numpy() + math.sqrt(0.2) * eps.numpy()
    g = -2 * (y - sig.fn(torch.as_tensor(s)).numpy()) * sig.deriv(torch.as_tensor(s)).numpy()
    g = g / batch
    gu, ge = (g * a).sum(1), (g * b).sum(1)
    rho2 = ((g[..., None] * rest).sum(1) ** 2).sum(-1)
    big_s = m * gu + nu * ge
    pm, pe = m - eta * (gu - big_s * m), nu - eta * (ge - big_s * nu)
    n = np.sqrt(pm**2 + pe**2 + eta**2 * rho2)
    uh = new.u_hat.numpy()
    np.testing.assert_allclose(uh[:, 1], pm / n, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.sqrt(1 - uh[:, 1] ** 2), np.sqrt(pe**2 + eta**2 * rho2) / n,
                               rtol=1e-10)
    if batch == 1:  # closed form (G4), docs/theory/exact-reductions.md; ‖r‖² for the χ² draw
        q = (rest[:, 0] ** 2).sum(-1)
        gg, ss, aa = g[:, 0], s[:, 0], a[:, 0]
        m1 = ((1 + eta * gg * ss) * m - eta * gg * aa) / np.sqrt(
            1 + eta**2 * gg**2 * (aa**2 + b[:, 0] ** 2 + q - ss**2))
        np.testing.assert_allclose(uh[:, 1], m1, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- exact law of the chain
RUNS = 256
# (activation, η·d^a, a, steps, batch, label noise, init)
LAW_SETTINGS = [("relu", 1.0, 1.0, 400, 1, 0.0, "uniform"),
                ("he3", 0.5, 1.5, 2000, 1, 0.0, "aligned"),
                ("tanh", 0.3, 1.0, 300, 3, 0.5, "uniform")]
N_COMPARISONS = 5 * len(LAW_SETTINGS) + 5
P_EACH = 0.01 / N_COMPARISONS  # Bonferroni, family-wise 1 %


def _law_config(act, c, a, steps, batch, noise, init, d=50):
    return RunConfig(instance=dict(activation=act, k=1, d=d, seed=0), learner="glm",
                     eta=c / d**a, steps=steps, runs=RUNS, seed=1, batch=batch,
                     label_noise=noise, init=init, checkpoints=6, spacing="linear")


@functools.cache
def _full(setting):
    return simulate_full(_law_config(*setting))


@pytest.mark.parametrize("setting", LAW_SETTINGS, ids=lambda s: f"{s[0]}-b{s[4]}")
def test_reduced_chain_has_the_law_of_the_full_engine(setting):
    cfg = _law_config(*setting)
    full, red = _full(setting), simulate_reduced(cfg)
    assert (red.diverged_step < 0).all() and (full.diverged_step < 0).all()
    for j in range(1, 6):
        x, y = full.overlap[:, j], red.overlap[:, j]
        assert x.std() > 1e-3, f"degenerate law at checkpoint {j}"
        assert ks_2samp(x, y).pvalue > P_EACH, f"KS rejects at checkpoint {j}"


def test_wrong_chi2_law_is_rejected():
    """χ²_d in place of χ²_{d−2}: the same comparison rejects (the test has power)."""
    cfg = _law_config(*LAW_SETTINGS[0])
    full = _full(LAW_SETTINGS[0])
    wrong = glm_chain.simulate_glm(cfg, _chi2_dof=cfg.instance["d"])
    pvals = [ks_2samp(full.overlap[:, j], wrong.overlap[:, j]).pvalue for j in range(1, 6)]
    assert min(pvals) < P_EACH


# ---------------------------------------------------------------- scaling exponents
def test_sweep_and_scaling_d_exponents():
    cfg = resolve_config({"eta_times_d": 0.05, "eta_d_exponent": 1.5, "steps_per_d": 20,
                          "steps_d_exponent": 2, "learner": "glm"},
                         {"activation": "he3", "k": 1, "d": 400})
    assert cfg.eta == pytest.approx(0.05 / 8000, rel=1e-15) and cfg.steps == 20 * 400**2
    plain = resolve_config({"eta_times_d": 0.05, "steps_per_d": 20},
                           {"activation": "he3", "k": 1, "d": 400})
    assert plain.eta == 0.05 / 400 and plain.steps == 8000
    with pytest.raises(ValueError, match="needs 'eta_times_d'"):
        resolve_config({"eta": 0.1, "eta_d_exponent": 1.5, "steps": 5},
                       {"activation": "he3", "k": 1, "d": 400})
    table = {"d": [100, 300], "c": 0.05, "horizon": 20}
    base = {"base": {"learner": "glm", "runs": 2, "instance": {"activation": "he3", "k": 1}}}
    spec = parse_scaling({"scaling": table | {"eta_exponent": 1.5, "horizon_exponent": 2}}
                         | base)
    cells = spec.sweep.cells()
    assert [c.config.steps for c in cells] == [20 * 100**2, 20 * 300**2]
    assert cells[1].config.eta == pytest.approx(0.05 / 300**1.5, rel=1e-15)
    default = parse_scaling({"scaling": table} | base)
    assert [c.config.steps for c in default.sweep.cells()] == [2000, 6000]
    assert "eta_d_exponent" not in default.sweep.base  # unchanged files resolve as before
