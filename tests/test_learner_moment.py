"""The ``moment`` learner (Stein estimators of u): statistic, expectations, acceptance (each
step's statistic against a dense recomputation: ``test_learner_protocol``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import dense_rows

import hermite
from dynamics.engines.engine import FullRun, chunk_schedule, simulate
from dynamics.instances.instance import build_instance
from dynamics.learners import Problem
from dynamics.learners.moment import Moment
from dynamics.randomness.sampling import NoiseSource, NoiseStreams
from dynamics.setup.config import ConfigError, RunConfig

F64 = torch.float64
CPU = torch.device("cpu")
S8 = 8 ** -0.5


def _instance(activation="relu", k=3, d=10, **kw):
    spec = {"activation": activation, "k": k, "d": d, "xi": 1.3, "W": "separated",
            "c": "gaussian", "lam": "random_sign", "u_alpha": 0.4, "seed": 4}
    spec.update(kw)
    return build_instance(spec)


def _full_rows(inst):
    """(W (k, d), V (k, d), u (d,)) in the canonical frame, numpy."""
    return dense_rows(inst)


def _numpy_residuals(inst, x):
    """r = f*(x) − f₀(x) from full k×d matrices (independent of the learner's code)."""
    w, v, _ = _full_rows(inst)
    sig = inst.activation.fn
    return sig(x @ v.T) @ inst.lam - sig(x @ w.T) @ inst.lam


def _numpy_statistic(inst, x, order):
    """S₁ = Σ x r (d,) or S₂ = Σ r (Π⊥xxᵀΠ⊥ − Π⊥) on the ⊥ coordinates; x (n, d)."""
    r = _numpy_residuals(inst, x)
    if order == 1:
        return x.T @ r
    xp = x[:, inst.k:]
    return (xp * r[:, None]).T @ xp - r.sum() * np.eye(xp.shape[1])


def _config(order=1, **kw):
    base = {"instance": {"activation": "relu", "k": 3, "d": 20, "xi": 1.0, "seed": 2,
                         "c": [0.6, 0.6, -0.2]},
            "learner": "moment", "moment_order": order, "steps": 50, "runs": 3, "seed": 5,
            "checkpoints": 6}
    base.update(kw)
    return RunConfig(**base)


# ---------------------------------------------------------------- the statistic
@pytest.mark.parametrize("order", [1, 2])
def test_engine_statistic_equals_recomputation_from_the_run_streams(order, device):
    """A FullRun consumes exactly its (seed, r) example stream: same statistic in numpy.

    The stream is replayed in the engine's chunks: on CPU any split gives the same numbers,
    but CUDA's Philox offsets depend on the size of each draw."""
    cfg = _config(order, batch=2, steps=40, device=device)
    run = FullRun(cfg.validate())
    run.run()
    inst = run.instances[0]
    with NoiseSource(NoiseStreams(cfg.seed), cfg.runs, cfg.batch, inst.d,
                     device=torch.device(device), dtype=F64) as noise:
        sizes = [n for n, _ in chunk_schedule(run.steps, noise.chunk_steps)]
        x = np.concatenate([buf[..., : inst.d].cpu().numpy().copy()
                            for buf, _ in noise.chunks(sizes)], axis=1)
    stat = run.learner.statistic(run.state).cpu().numpy()
    for r in range(cfg.runs):
        ref = _numpy_statistic(inst, x[r].reshape(-1, inst.d), order)
        np.testing.assert_allclose(stat[r], ref, rtol=1e-11, atol=1e-11 * np.abs(ref).max())


def test_estimate_is_the_projected_mean_or_the_top_eigenvector():
    inst = _instance("relu", d=9)
    learner1 = Moment(Problem.from_instances([inst], CPU, F64), order=1)
    learner2 = Moment(Problem.from_instances([inst], CPU, F64), order=2)
    s1, s2 = learner1.init_state(), learner2.init_state()
    assert torch.isnan(learner1.estimate(s1)).all()  # no sample yet: no estimate
    x = torch.randn(1, 50, inst.d, dtype=F64, generator=torch.Generator().manual_seed(1))
    learner1.step_(s1, x)
    learner2.step_(s2, x)
    x_np = x[0].numpy()
    u1 = learner1.estimate(s1)[0].numpy()
    ref1 = _numpy_statistic(inst, x_np, 1)
    ref1[: inst.k] = 0.0
    np.testing.assert_allclose(u1, ref1 / np.linalg.norm(ref1), atol=1e-12)
    vals, vecs = np.linalg.eigh(_numpy_statistic(inst, x_np, 2))
    top = vecs[:, np.argmax(np.abs(vals))]
    u2 = learner2.estimate(s2)[0].numpy()
    assert np.all(u2[: inst.k] == 0.0)
    assert abs(abs(u2[inst.k:] @ top) - 1.0) < 1e-10  # a line: sign is arbitrary


# ---------------------------------------------------------------- Stein expectations
def _mc_residual_moments(inst, n, seed):
    learner = Moment(Problem.from_instances([inst], CPU, F64))
    x = torch.randn(1, n, inst.d, dtype=F64, generator=torch.Generator().manual_seed(seed))
    r = learner.residuals(x)[0].numpy()
    return x[0].numpy(), r


@pytest.mark.parametrize("activation", ["relu", "erf", "quadratic"])
def test_first_order_expectation_by_monte_carlo(activation):
    """E[x r] = μ₁ Σᵢ λᵢ(vᵢ − wᵢ) (Stein), entrywise z-scores; its Π⊥ part is
    μ₁ ξ u⊥ (Σᵢ λᵢcᵢ/Nᵢ) e exactly."""
    inst = _instance(activation)
    x, r = _mc_residual_moments(inst, 200_000, 1)
    terms = x * r[:, None]
    mean, se = terms.mean(0), terms.std(0) / math.sqrt(len(r))
    w, v, _ = _full_rows(inst)
    mu1 = float(hermite.hermite_coefficients(inst.activation, 1)[1])
    expect = mu1 * inst.lam @ (v - w)
    assert np.max(np.abs(mean - expect) / se) < 5.0
    perp = np.zeros(inst.d)
    perp[inst.k] = mu1 * inst.xi * inst.u_perp * np.sum(inst.lam * inst.c / inst.teacher_norms())
    np.testing.assert_allclose(np.r_[np.zeros(inst.k), expect[inst.k:]], perp, atol=1e-14)
    if mu1:
        assert abs(perp[inst.k]) > 10 * se[inst.k]  # the test resolves the signal


@pytest.mark.parametrize("activation", ["relu", "abs", "tanh"])
def test_second_order_expectation_by_monte_carlo(activation):
    """E[r(xxᵀ − I)] = √2 μ₂ Σᵢ λᵢ(vᵢvᵢᵀ − wᵢwᵢᵀ); Π⊥ block √2 μ₂ ξ²u⊥²(Σλᵢcᵢ²/Nᵢ²) eeᵀ."""
    inst = _instance(activation, d=7)
    x, r = _mc_residual_moments(inst, 200_000, 2)
    terms = r[:, None, None] * (x[:, :, None] * x[:, None, :] - np.eye(inst.d))
    mean, se = terms.mean(0), terms.std(0) / math.sqrt(len(r))
    w, v, _ = _full_rows(inst)
    mu2 = float(hermite.hermite_coefficients(inst.activation, 2)[2])
    expect = math.sqrt(2.0) * mu2 * (np.einsum("i,ij,ik->jk", inst.lam, v, v)
                                     - np.einsum("i,ij,ik->jk", inst.lam, w, w))
    assert np.max(np.abs(mean - expect) / se) < 5.0
    k = inst.k
    block = np.zeros((inst.d - k, inst.d - k))
    block[0, 0] = (math.sqrt(2.0) * mu2 * inst.xi**2 * inst.u_perp**2
                   * np.sum(inst.lam * inst.c**2 / inst.teacher_norms() ** 2))
    np.testing.assert_allclose(expect[k:, k:], block, atol=1e-14)
    if abs(mu2) > 1e-6:
        assert abs(block[0, 0]) > 10 * se[k, k]


# ---------------------------------------------------------------- batching, seeds
def test_batch_of_runs_replays_single_runs():
    """Run r depends only on (seed, r): the first runs of a bigger batch replay exactly."""
    small = simulate(_config(2, runs=2))
    big = simulate(_config(2, runs=4))
    np.testing.assert_allclose(big.overlap[:2], small.overlap, rtol=0, atol=1e-12)
    np.testing.assert_allclose(big.loss[:2], small.loss, rtol=0, atol=1e-12)


@pytest.mark.parametrize("order", [1, 2])
def test_minibatch_b_equals_b_single_steps(order):
    """Same stream: T steps of b examples = b·T steps of 1 example (n = step·b)."""
    a = FullRun(_config(order, batch=4, steps=30).validate())
    a.run()
    b = FullRun(_config(order, batch=1, steps=120).validate())
    b.run()
    sa, sb = a.learner.statistic(a.state), b.learner.statistic(b.state)
    torch.testing.assert_close(sa, sb, rtol=1e-12, atol=1e-12 * float(sb.abs().max()))


def test_learner_level_batch_equals_loop_of_single_runs():
    inst = _instance("relu")
    x = torch.randn(3, 2, inst.d, dtype=F64, generator=torch.Generator().manual_seed(8))
    batch = Moment(Problem.from_instances([inst] * 3, CPU, F64), order=2)
    out = batch.step(batch.init_state(), x)
    for r in range(3):
        single = Moment(Problem.from_instances([inst], CPU, F64), order=2)
        one = single.step(single.init_state(), x[r: r + 1])
        torch.testing.assert_close(one.stat[0], out.stat[r], rtol=0, atol=1e-14)


# ---------------------------------------------------------------- trajectory contents
def test_trajectory_overlap_and_exact_loss():
    traj = simulate(_config(1, steps=200))
    inst = _config().run_instances()[0]
    assert traj.loss_kind == "exact"
    assert np.isnan(traj.m0).all() and np.isnan(traj.ode).all()
    assert np.isnan(traj.overlap[:, 0]).all() and np.isnan(traj.loss[:, 0]).all()  # n = 0
    m = traj.overlap[:, 1:]
    assert np.all((m >= 0) & (m <= inst.u_perp + 1e-12))
    np.testing.assert_allclose(traj.loss[:, 1:], hermite.population_loss(inst, m), rtol=1e-12)


# ---------------------------------------------------------------- acceptance
def _moment_run(c, order=1, activation="relu", d=200, steps=None, runs=8, batch=1,
                checkpoints=200, spacing="linear"):
    k = 8
    cfg = RunConfig(instance={"activation": activation, "k": k, "d": d, "xi": 1.0, "c": c,
                              "seed": 1},
                    learner="moment", moment_order=order, steps=steps or 50 * d // batch,
                    runs=runs, seed=7, batch=batch, checkpoints=checkpoints,
                    spacing=spacing)
    return cfg, simulate(cfg)


def test_order1_recovers_u_within_50d_samples_on_relu():
    """Σλᵢcᵢ/Nᵢ ≠ 0 (c = (5 plus, 3 minus)/√8): overlap > 0.9 after n ≤ 50·d samples
    (median over runs; measured ≈ 15·d for this c, 5·d for c = 1/√8)."""
    c = [S8] * 5 + [-S8] * 3
    cfg, traj = _moment_run(c)
    n_needed = traj.first_passage(0.9) * cfg.batch
    assert np.all(np.isfinite(n_needed))
    assert np.median(n_needed) <= 50 * 200
    assert np.median(traj.overlap[:, -1]) > 0.95


def test_order1_fails_when_the_signal_vanishes():
    """Σλᵢcᵢ/Nᵢ = 0 (balanced quantized c, λ = 1): E[Π⊥ x r] = 0, so even after 200·d
    samples û is a noise direction. Its overlap² ≈ χ²₁ ρ/(d − k − 1 + ρ), ρ = E[r²x_e²]/E[r²]
    (the noise is ρ times stronger along e than along the other ⊥ directions; ρ ≈ 3.2 here):
    the 1/√d noise level, at every checkpoint."""
    d, k = 200, 8
    c = [S8, -S8] * 4
    inst = build_instance({"activation": "relu", "k": k, "d": d, "xi": 1.0, "c": c})
    assert abs(np.sum(inst.lam * inst.c / inst.teacher_norms())) < 1e-15
    x, r = _mc_residual_moments(inst, 50_000, 3)
    rho = float(np.mean(r**2 * x[:, k] ** 2) / np.mean(r**2))
    noise = math.sqrt(rho / (d - k - 1 + rho))
    assert 0.1 < noise < 0.2
    _, traj = _moment_run(c, steps=200 * d // 8, batch=8, runs=12, checkpoints=4)
    m = traj.overlap[:, 1:]
    assert np.all(np.median(m, axis=0) < 2.0 * noise)
    assert np.all(m < 4.0 * noise)


def test_order2_recovers_u_when_mu1_vanishes():
    """abs: μ₁ = 0 (order 1 is refused), μ₂ ≠ 0: the top eigenvector finds u."""
    d = 60
    with pytest.raises(ConfigError, match="abs"):
        _moment_run("quantized", order=1, activation="abs", d=d)
    _, traj = _moment_run("quantized", order=2, activation="abs", d=d, steps=200 * d // 4,
                          batch=4, checkpoints=6, spacing="log")
    assert np.median(traj.overlap[:, -1]) > 0.9
    assert traj.steps[1] == 1 and np.median(traj.overlap[:, 1]) < 0.5  # learned, not given


@pytest.mark.parametrize("activation,order", [("he3", 1), ("abs", 1), ("quadratic", 1),
                                              ("linear", 2), ("he3", 2), ("tanh", 2)])
def test_config_error_when_the_hermite_coefficient_vanishes(activation, order):
    cfg = _config(order, instance={"activation": activation, "k": 3, "d": 20})
    with pytest.raises(ConfigError, match=f"{activation}.*μ_{order}") as err:
        cfg.validate()
    assert "\n" not in str(err.value) and "moment_order" in str(err.value)


@pytest.mark.parametrize("activation,order", [("relu", 1), ("relu", 2), ("quadratic", 2),
                                              ("tanh", 1), ("he2", 2)])
def test_no_config_error_when_the_coefficient_is_nonzero(activation, order):
    _config(order, instance={"activation": activation, "k": 3, "d": 20}).validate()
