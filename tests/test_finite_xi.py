"""hermite.finetune.finite_xi (docs/theory/finite-xi.md): the sample increments behind the step
noise V average to the analytic drift (Price's theorem, an independent derivation), and the
closure flow with its fluctuation terms off is the population ODE (BDF)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from chain_runs import rank_one_chain

from dynamics.instances.instance import build_instance
from hermite.finetune.finite_xi import StepNoise, finite_xi_flow
from hermite.finetune.population import FinetuneModel, finetune_ode
from hermite.flows.regime import FinetuneRegime, FinetuneStart


def _instance(act, xi, k=4, d=100, u_alpha=0.3):
    return build_instance(dict(activation=act, k=k, d=d, xi=xi, W="separated", c="gaussian",
                               c_hat="gaussian", seed=0, u_alpha=u_alpha))


@pytest.mark.parametrize("act,xi", [("he3", 1.0), ("tanh", 2.0), ("he3", 8.0)])
def test_step_increments_average_to_the_drift(act, xi):
    """QMC mean of the O(η) sample increments (p, μ, ĉ) = −η E G_T, −η_c E ∂ℓ/∂ĉ of
    FinetuneModel.drift (unprojected, joint, u_alpha > 0): |z| < 5 (measured ≤ 0.8)."""
    inst = _instance(act, xi)
    model = FinetuneModel(inst, 1e-3, project=False, joint_c=True, eta_c=2e-3)
    rng = np.random.default_rng(1)
    p = 0.2 * rng.standard_normal((2, 4))
    mu = np.array([0.3, -0.2])
    ch = inst.c_hat + 0.1 * rng.standard_normal((2, 4))
    inc = StepNoise(model, 100, points=2**14)._increments(p, mu, ch)
    ref = model.pack(*model.drift(p, mu, ch))
    se = inc.std(axis=1) / math.sqrt(inc.shape[1])
    assert np.all(np.abs(inc.mean(axis=1) - ref) < 5.0 * se)


@pytest.mark.parametrize("act", ["he3", "tanh", "relu"])
@pytest.mark.parametrize("project,joint_c", [(False, True), (True, True), (False, False)])
def test_compiled_step_noise_is_the_numpy_one(act, project, joint_c):
    """StepNoise's compiled increments (step_increments_block) against its numpy reference on the
    same points: 1e-10 relative (σ with a numba code)."""
    inst = _instance(act, 3.0)
    model = FinetuneModel(inst, 1e-3, project=project, joint_c=joint_c, eta_c=2e-3)
    noise = StepNoise(model, 100, points=2**10)
    assert noise.qmc.code is not None
    rng = np.random.default_rng(3)
    p = np.zeros((3, 4)) if project else 0.2 * rng.standard_normal((3, 4))
    mu = np.array([0.3, -0.2, 0.05])
    ch = inst.c_hat + 0.1 * rng.standard_normal((3, 4))
    want = noise._block(p, mu, ch)
    got = noise._compiled(p, mu, ch)
    assert got.shape == want.shape == (3, model.dim, model.dim)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())


def test_flow_without_fluctuations_is_the_population_ode():
    """closure=False, renormalise=False: the mean of (F) is the plain ODE (its exponential
    Rosenbrock–Euler against BDF at rtol 1e-7)."""
    inst = _instance("he3", 3.0, k=3, d=60, u_alpha=0.0)
    eta, d = 0.05 / 60, 60
    steps = np.array([0.0, 100.0, 300.0, 600.0]) / eta * 1e-3
    rng = np.random.default_rng(0)
    mu0 = np.array([0.15, -0.1, 0.3])
    p0 = 0.05 * rng.standard_normal((3, 3))
    kw = dict(project=False, joint_c=True)
    ode = finetune_ode(inst, eta, steps, mu0=mu0, p0=p0, c_hat0=inst.c_hat, **kw)
    flow = finite_xi_flow(inst, FinetuneRegime(eta, d=d, **kw), steps,
                          FinetuneStart(mu0=mu0, p0=p0, c_hat0=inst.c_hat), closure=False,
                          renormalise=False)
    assert np.max(np.abs(flow.m - ode.m)) < 2e-3
    assert np.max(np.abs(flow.c_overlap - ode.c_overlap)) < 2e-3


def _chain(d, k, xi, eta_d, steps, runs, checkpoints):
    """(checkpoint steps, m (R, C), μ₀ (R,), ĉ₀ (R, k), instance, η) of exact-chain runs of
    He₃, joint ĉ, unprojected û (the cell of Figs 1b/6), started as the learner starts."""
    from dynamics.setup.config import RunConfig

    spec = dict(activation="he3", k=k, d=d, xi=float(xi), W="separated", c="gaussian",
                c_hat="gaussian", seed=0)
    cfg = RunConfig(instance=spec, eta=eta_d / d, steps=int(steps), runs=runs, seed=3,
                    checkpoints=checkpoints, spacing="linear", engine="reduced",
                    joint_c=True, project=False).validate()
    ck, rec, mu0, _, params, inst = rank_one_chain(cfg)
    return ck, rec["m"], mu0, params.c_hat0.copy(), inst[0], cfg.eta


@pytest.mark.slow
def test_ensemble_follows_the_chain_where_the_ode_does_not():
    """d = 100, k = 4, ξ = 10 (ξ/√d = 1), η·d = 5·10⁻⁴, 256 chain runs to 1400·d steps: at
    every checkpoint where the plain ODE's mean |⟨û,u⟩| is outside max(4 SE, 0.03) of the
    chain's (there is at least one), the line (S) is inside (measured: within 0.012 where the
    ODE is up to 0.094 off). Both lines
    are taken at 16 equal-probability quantile nodes of the runs' μ₀ (p₀ = 0 and ĉ₀ are
    common to all runs), 8 paths per node."""
    from hermite.finetune.band import start_nodes
    from hermite.finetune.finite_xi import EnsembleScheme, finite_xi_ensemble

    d, k = 100, 4
    steps, m, mu0, c0, inst, eta = _chain(d, k, 10.0, 5e-4, 1400 * d, 256, 8)
    chain = np.abs(m).mean(axis=0)
    tol = np.maximum(4.0 * np.abs(m).std(axis=0, ddof=1) / math.sqrt(m.shape[0]), 0.03)
    mu_n, c_n = start_nodes(mu0, c0, 16)
    kw = dict(project=False, joint_c=True)
    ode = np.abs(finetune_ode(inst, eta, steps, mu0=mu_n, c_hat0=c_n, **kw).m).mean(axis=0)
    line = finite_xi_ensemble(inst, FinetuneRegime(eta, d=d, **kw), steps,
                              FinetuneStart(mu0=mu_n, p0=np.zeros((mu_n.size, k)), c_hat0=c_n),
                              scheme=EnsembleScheme(particles=8)).abs_m.mean(axis=0)
    outside = np.abs(ode - chain) > tol
    assert outside.any()
    assert np.all(np.abs(line - chain)[outside] <= tol[outside]), (chain, ode, line, tol)


def test_the_overlay_draws_the_line_where_xi_is_of_order_root_d(monkeypatch):
    """dynamics.overlays.finetune.finite_xi_lines: drawn for the runs whose ξ²/d ≥
    FINITE_XI_MIN (ĉ joint), none for the others; over its budget, the same number of starts
    in each instance (at least one), the others NaN and the ``partial`` attribute says so."""
    from dynamics.overlays import finetune as overlay
    from dynamics.setup.config import RunConfig

    base = dict(activation="he3", k=3, d=40, W="separated", c="gaussian", c_hat="gaussian",
                seed=0)
    config = RunConfig(instance=base | {"xi": 1.0}, eta=5e-4 / 40, steps=2000, runs=6,
                       joint_c=True, project=False, xi_values=[1.0, 4.0, 8.0])
    instances = config.run_instances()
    assert [i.xi for i in instances] == [1.0, 1.0, 4.0, 4.0, 8.0, 8.0]
    rng = np.random.default_rng(0)
    p0 = 0.1 * rng.standard_normal((6, 3))
    start = (p0, 0.1 * rng.standard_normal(6), np.stack([i.c_hat for i in instances]))
    steps = np.array([0, 1000, 2000])
    extra, attrs = overlay.finite_xi_lines(config, instances, steps, start)
    line = extra["ode_finite_xi"]
    assert np.isnan(line[:2]).all() and np.isfinite(line[2:]).all()  # ξ²/d = 0.025, 0.4, 1.6
    assert np.all((line[2:] >= 0) & (line[2:] <= 1))
    assert "partial" not in attrs["ode_finite_xi"]
    monkeypatch.setattr(overlay, "FINITE_XI_BUDGET_S", 1e-9)
    extra, attrs = overlay.finite_xi_lines(config, instances, steps, start)
    # one start per instance fits; a line is drawn from at least MIN_RUNS = 4 (all 2 here)
    assert np.isfinite(extra["ode_finite_xi_c_overlap"][2:, -1]).all()
    assert "partial" not in attrs["ode_finite_xi"]
    monkeypatch.setattr(overlay, "budget_starts",
                        lambda mu0, n, _f=overlay.budget_starts: _f(mu0, n, least=1))
    extra, attrs = overlay.finite_xi_lines(config, instances, steps, start)
    drawn = np.isfinite(extra["ode_finite_xi_c_overlap"][:, -1])
    assert drawn.tolist() == [False, False, True, False, True, False] or \
        drawn.tolist() == [False, False, False, True, False, True]
    assert drawn[2:4].sum() == drawn[4:].sum() == 1
    assert "from 1 runs' starts per instance" in attrs["ode_finite_xi"]["partial"]
    frozen = RunConfig(instance=base | {"xi": 8.0}, eta=5e-4 / 40, steps=2000, runs=2,
                       project=False)
    assert overlay.finite_xi_lines(frozen, frozen.run_instances(), steps, start) == ({}, {})
