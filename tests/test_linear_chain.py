"""The exact chain of the full-rank ``linearized`` learner (``dynamics.reduced.linear_chain``).

Independent truths: (1) one chain step on given variates against the full learner's own step
on an explicit d-dimensional Δ and examples, mapped into the chain's coordinates (to
rounding); (2) the law of whole runs against the full engine (two-sample KS tests at d = 30
and d = 300, ReLU and tanh, b = 1 and 4, projected or not, label noise, prox), and a
deliberately wrong χ² degree rejected; (3) first passages against the dense trajectory of the
same streams; (4) the engine choice; (5) a golden-value regression.
"""

from __future__ import annotations

import math

import chain_runs
import numba
import numpy as np
import pytest
import torch

from dynamics.engines.engine import simulate
from dynamics.engines.resolve import resolve_run
from dynamics.learners.linearized import LinearizedFullRank, top_overlap
from dynamics.learners.problem import Problem
from dynamics.reduced import linear_chain as lc
from dynamics.reduced import reduced_supported
from dynamics.setup.config import ConfigError, RunConfig
from hermite.activations_numba import compiled_activation

SPEC = {"activation": "relu", "k": 2, "xi": 1.0, "seed": 3}


def config_of(d: int, *, activation="relu", k=2, **fields) -> RunConfig:
    base = dict(learner="linearized", full_rank=True,
                instance={**SPEC, "activation": activation, "k": k, "d": d}, eta=0.5 / d,
                runs=4, steps=10, seed=7, eval_size=500)
    return RunConfig(**{**base, **fields})


# ---------------------------------------------------------------- 1. one step, exactly
def full_and_chain_step(d: int, seed: int, *, project: bool, prox: float, batch: int,
                        label_noise: float, activation: str = "tanh"):
    """The full learner's step (``step_prepared_``) from an explicit Δ (k × d) on explicit
    examples, and the chain's step (``step_given``) from the same point and examples written
    in the chain's coordinates (A, E = the rows' outside span, Q₂ = the examples' rest):
    (Δ′ of the full step, Δ′ rebuilt in R^d from the chain's P′, Z′, status)."""
    k = 3
    config = config_of(d, activation=activation, k=k, runs=1, project=project, prox=prox,
                       batch=batch, label_noise=label_noise,
                       instance={**SPEC, "activation": activation, "k": k, "d": d,
                                 "W": "separated", "u_alpha": 0.3, "c": "gaussian"})
    inst = config.validate().run_instances()[0]
    problem = Problem.from_instances([inst], "cpu", torch.float64)
    learner = LinearizedFullRank.from_config(config, problem)
    rng = np.random.default_rng(seed)
    t = k + 1
    delta = 0.3 * rng.standard_normal((k, d))
    if project:
        delta[:, :k] = 0.0
    state, _ = learner.initial_state(config, [inst])
    state.delta = torch.as_tensor(delta[None].copy())
    x = rng.standard_normal((batch, d))
    eps = rng.standard_normal(batch)
    xt = torch.as_tensor(x[None, None])
    pre = learner.prepare(state, xt, torch.as_tensor(eps[None, None]))
    learner.step_prepared_(state, xt[:, 0], pre, 0)
    full = state.delta[0].numpy()

    q, r = np.linalg.qr(delta[:, t:].T)  # outside parts = Z Qᵀ, Z = Rᵀ (m = k)
    xe = x[:, t:] @ q
    rest = x[:, t:] - xe @ q.T  # the rest parts: Λ Q₂ᵀ
    q2, r2 = np.linalg.qr(rest.T)
    Z = np.zeros((k, k + batch))
    Z[:, :k] = r.T
    code = compiled_activation(inst.activation)
    hyp = lc.make_lin_hyper(lc.LinSettings(code, config.eta, prox, math.sqrt(label_noise),
                                           batch, project, d - t), 1)
    chain = lc._Start(config, [inst])
    P, Z, m, status = lc.step_given(hyp, chain.L[0], chain.V[0], chain.lam[0], delta[:, :t],
                                    Z, k, lc.GivenExamples(x[:, :t], xe, r2.T,
                                                           math.sqrt(label_noise) * eps))
    rebuilt = np.zeros((k, d))
    rebuilt[:, :t] = P
    rebuilt[:, t:] = Z[:, :k] @ q.T + Z[:, k: k + batch] @ q2.T
    assert m == k + batch
    return full, rebuilt, status, delta


@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
@pytest.mark.parametrize("prox", [0.0, 0.2])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_chain_step_is_the_full_step_in_chain_coordinates(project, prox, batch):
    """Δ′ rebuilt from the chain's (P′, Z′) in the examples' own basis equals the full step's
    Δ′ entry by entry (so P′ and the Gram agree too), label noise included."""
    for seed, activation in enumerate(("tanh", "relu")):
        full, rebuilt, status, before = full_and_chain_step(
            20, seed, project=project, prox=prox, batch=batch, label_noise=0.3,
            activation=activation)
        assert status == 0
        assert np.abs(full - before).max() > 1e-3  # the step moved Δ
        np.testing.assert_allclose(rebuilt, full, rtol=0, atol=1e-10 * np.abs(full).max())
        np.testing.assert_allclose(rebuilt @ rebuilt.T, full @ full.T, rtol=1e-10)


def test_compressed_records_keep_p_and_the_gram():
    """A checkpoint's (k, 2k+1) record is P and an L factor of Z: PPᵀ + ZZᵀ preserved, the
    state not compressed (recording every step gives the same end state as recording none)."""
    config = config_of(30, runs=3, steps=40, checkpoints=41, spacing="linear")
    chain, start = lc.LinearChain(), lc._Start(config, config.run_instances())
    runs, rec = chain._advance(start, np.arange(41), 40)
    sparse, rec2 = chain._advance(start, np.array([40]), 40)
    np.testing.assert_array_equal(runs.states, sparse.states)
    np.testing.assert_array_equal(runs.P, sparse.P)
    np.testing.assert_array_equal(rec.delta[:, -1], rec2.delta[:, 0])
    for r in range(3):
        z = sparse.Z[r, :, : sparse.m[r]]
        gram = sparse.P[r] @ sparse.P[r].T + z @ z.T
        red = rec2.delta[r, 0]
        np.testing.assert_allclose(red @ red.T, gram, rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(red[:, :3], sparse.P[r])
        assert np.allclose(np.triu(red[:, 3:], 1), 0)


def test_gram_top_overlap_is_the_top_singular_vector_s():
    """The kernel's stop-rule overlap (Jacobi on the k × k Gram) equals the SVD's."""
    rng = np.random.default_rng(4)
    for k, m in ((1, 0), (2, 3), (4, 9), (6, 13)):
        P, Z = rng.standard_normal((k, k + 1)), rng.standard_normal((k, m + 2))
        u = rng.standard_normal(k + 1)
        u /= np.linalg.norm(u)
        ours = lc.gram_top_overlap(P, Z, m, u, np.empty((k, k)), np.empty((k, k)),
                                   np.empty(k))
        full = np.concatenate([P, Z[:, :m]], 1)
        ref = top_overlap(full, np.r_[u, np.zeros(m)])
        assert ours == pytest.approx(float(ref), rel=1e-11, abs=1e-13)
    zero = lc.gram_top_overlap(np.zeros((2, 3)), np.zeros((2, 2)), 2, np.ones(3),
                               np.empty((2, 2)), np.empty((2, 2)), np.empty(2))
    assert math.isnan(zero)


# ---------------------------------------------------------------- 2. the same law
LAW_RUNS = 256
LAW_P = 1e-3  # per comparison (fixed seeds: each test is deterministic)
# name → (activation, batch, project, label noise, prox)
LAW_CASES = {
    "relu-b1-proj": ("relu", 1, True, 0.0, 0.0),
    "relu-b4-noproj-noise": ("relu", 4, False, 0.2, 0.0),
    "tanh-b1-noproj-noise-prox": ("tanh", 1, False, 0.2, 0.05),
    "tanh-b4-proj-noise": ("tanh", 4, True, 0.2, 0.0),
}


def law_config(case: str, d: int, engine: str, seed: int = 11, **fields) -> RunConfig:
    """d steps at η = 0.75/d, 4 linear checkpoints: Δ grows to O(1)."""
    act, b, project, noise, prox = LAW_CASES[case]
    fields = {"eta": 0.75 / d, "steps": d, **fields}
    return config_of(d, activation=act, engine=engine, runs=LAW_RUNS, checkpoints=4,
                     spacing="linear", seed=seed, batch=b, project=project,
                     label_noise=noise, prox=prox, **fields)


def ks_pvalues(a, b) -> dict:
    """(quantity, checkpoint) → two-sample KS p-value of the true loss, ‖Δ‖_F and the
    overlap, at the checkpoints after the start."""
    return chain_runs.ks_pvalues(a, b, {"loss": lambda t: t.loss,
                                        "delta_norm": lambda t: t.extra["delta_norm"],
                                        "overlap": lambda t: t.overlap}, first=1)


@pytest.mark.parametrize("d", [30, 300])
@pytest.mark.parametrize("case", list(LAW_CASES))
def test_chain_has_the_law_of_the_full_engine(case, d):
    chain = simulate(law_config(case, d, "reduced"))
    full = simulate(law_config(case, d, "full", seed=12))
    assert chain.engine == "reduced" and full.engine == "full"
    assert np.isfinite(chain.loss).all() and (chain.diverged_step < 0).all()
    moved = np.median(chain.extra["delta_norm"][:, -1])
    assert moved > 0.1, f"{case}: Δ barely moved ({moved:.3g}), no test of the step"
    p = ks_pvalues(chain, full)
    assert len(p) == 9 and min(p.values()) > LAW_P, {k: round(v, 6) for k, v in p.items()}


def test_a_wrong_chi2_degree_is_rejected():
    """The same comparison has the power to see a wrong rest dimension (L3): at d = 12
    (k = 2, rest d − 3 = 9) a rest of 27 inflates ‖x‖² and so the rows' new rest parts
    (when written: every p < 1e-13, the least 5e-61; the right one's least 0.14)."""
    d = 12
    config = law_config("relu-b1-proj", d, "reduced")
    wrong = lc.LinearChain().simulate(config, _chi2_dof=27)
    right = lc.LinearChain().simulate(config)
    full = simulate(law_config("relu-b1-proj", d, "full", seed=12))
    assert min(ks_pvalues(wrong, full).values()) < 1e-6
    assert min(ks_pvalues(right, full).values()) > LAW_P


# ---------------------------------------------------------------- 3. first passages
@pytest.mark.parametrize("case", ["relu-b1-proj", "tanh-b4-proj-noise"])
def test_first_passages_are_the_dense_trajectory_s_crossings(case):
    d, steps = 40, 120
    act, b, project, noise, prox = LAW_CASES[case]
    config = config_of(d, activation=act, k=3, runs=16, steps=steps, checkpoints=steps + 1,
                       spacing="linear", eta=1.0 / d, batch=b, project=project,
                       label_noise=noise, prox=prox)
    traj = lc.LinearChain().simulate(config)
    assert np.array_equal(traj.steps, np.arange(steps + 1))
    never = np.nanmax(traj.overlap) + 1e-9
    best = np.nanmax(traj.overlap, 1)
    levels = [*np.quantile(best, [0.3, 0.7]), never]  # some runs, not all
    hits = lc.LinearChain().first_passages(config, levels)
    for level, hit in zip(levels, hits, strict=True):
        above = np.nan_to_num(traj.overlap, nan=-1.0) >= level
        want = np.where(above.any(1), above.argmax(1).astype(float), np.nan)
        np.testing.assert_array_equal(hit, want)
    assert (hits[:2] > 0).any() and np.isnan(hits[2]).all()
    with pytest.raises(ValueError, match="overlap only, not 'loss'"):
        lc.LinearChain().first_passages(config, [0.5], quantity="loss")


# ---------------------------------------------------------------- 4. engine choice, errors
def test_auto_takes_the_chain_for_full_rank_linearized():
    config = config_of(50, engine="auto", batch=2, project=False)
    assert reduced_supported(config) == (True, "")
    assert resolve_run(config).engine == "reduced"
    traj = simulate(config)
    assert traj.engine == "reduced" and np.isfinite(traj.loss).all()


def test_where_the_chain_is_not_exact_it_says_why_in_one_line():
    rank1 = config_of(50, engine="auto", full_rank=False)
    ok, why = reduced_supported(rank1)
    assert not ok and "full_rank only" in why and "\n" not in why
    assert resolve_run(rank1).engine == "full"
    with pytest.raises(ConfigError, match="rank-1 linearized has no reduced engine") as err:
        simulate(config_of(50, engine="reduced", full_rank=False))
    assert err.value.field == "engine" and "\n" not in str(err.value)

    small = config_of(6, engine="auto", batch=2)  # d < k + 1 + k + b = 7
    ok, why = reduced_supported(small)
    assert not ok and "d ≥ k + 1 + k + b = 7" in why and "\n" not in why
    assert resolve_run(small).engine == "full"
    with pytest.raises(ConfigError, match="d ≥ k") as err:
        simulate(config_of(6, engine="reduced", batch=2))
    assert "\n" not in str(err.value)
    assert reduced_supported(config_of(7, engine="auto", batch=2)) == (True, "")


def test_backends():
    config = config_of(30)
    with pytest.raises(ValueError, match="the linearized chain has no CUDA kernel"):
        lc.LinearChain().simulate(config, backend="numba-cuda")
    with pytest.raises(ValueError, match="backend must be 'numba'"):
        lc.LinearChain().simulate(config, backend="torch")
    a = lc.LinearChain().simulate(config, backend="numba")
    b = lc.LinearChain().simulate(config)
    np.testing.assert_array_equal(a.extra["delta_norm"], b.extra["delta_norm"])


def test_numbers_do_not_depend_on_the_thread_count_or_the_batch_of_runs():
    config = config_of(30, runs=5, steps=60, checkpoints=3, batch=2, label_noise=0.1)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = lc.LinearChain().simulate(config)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = lc.LinearChain().simulate(config)
    finally:
        numba.set_num_threads(before)
    alone = lc.LinearChain().simulate(config_of(30, runs=2, steps=60, checkpoints=3, batch=2,
                                                label_noise=0.1))
    np.testing.assert_array_equal(one.extra["delta_norm"], two.extra["delta_norm"])
    np.testing.assert_array_equal(one.extra["delta_norm"][:2], alone.extra["delta_norm"])


def test_divergence_freezes_the_run_at_its_last_finite_state():
    config = config_of(30, eta=5.0, runs=3, steps=200, checkpoints=4, project=False)
    traj = lc.LinearChain().simulate(config)
    assert (traj.diverged_step > 0).all()
    assert np.isnan(traj.loss[:, -1]).all()
    start = lc._Start(config, config.run_instances())
    runs, _ = lc.LinearChain()._advance(start, np.array([200]), 200)
    assert np.isfinite(runs.P).all() and np.isfinite(runs.Z).all()  # the frozen state
    assert np.array_equal(runs.div_step, traj.diverged_step)


def test_initial_trajectory_is_the_start_simulate_records():
    config = config_of(30, runs=4, steps=20, checkpoints=3)
    start = lc.LinearChain().initial_trajectory(config)
    full = lc.LinearChain().simulate(config)
    assert list(start.steps) == [0] and np.isnan(start.overlap).all()
    np.testing.assert_array_equal(start.loss[:, 0], full.loss[:, 0])
    np.testing.assert_array_equal(start.extra["delta_norm"][:, 0], 0.0)


# ---------------------------------------------------------------- 5. regression
def test_golden_values_of_a_small_run():
    """Golden-value regression test: numbers of a small chain run frozen when the chain was
    written (its law is checked above; this only guards the streams and the arithmetic
    against unintended change)."""
    config = config_of(25, activation="tanh", k=2, runs=3, steps=40, checkpoints=3, batch=2,
                       project=False, label_noise=0.1, prox=0.01, eval_size=200)
    traj = lc.LinearChain().simulate(config)
    np.testing.assert_allclose(traj.extra["delta_norm"][:, -1], GOLDEN_NORM, rtol=1e-9)
    np.testing.assert_allclose(traj.overlap[:, -1], GOLDEN_OVERLAP, rtol=1e-9)
    np.testing.assert_allclose(traj.loss[:, -1], GOLDEN_LOSS, rtol=1e-9)


GOLDEN_NORM = [0.3198318539102013, 0.2998266293550786, 0.2891907776115815]
GOLDEN_OVERLAP = [0.11993713843924797, 0.2229877555696323, 0.4732117842639252]
GOLDEN_LOSS = [0.09733007636138225, 0.09181051645642002, 0.07879869396593353]
