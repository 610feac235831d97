"""The ``pretrained-glm`` exact chain in (a, m) (``dynamics.reduced.pretrained_chain``) against
the step written in R^d: one step on the same examples, the law of whole runs (two-sample KS
against a numpy simulation in R^d), determinism and divergence."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import ks_2samp

from dynamics.reduced import pretrained_chain as pc
from hermite.activations import get_activation
from hermite.activations_numba import act_code

MU = 0.5
RUNS = 2000
KS_LEVEL = 1e-3

# (activation, d, b, η, steps, label-noise variance): every pair of (d, b, σ) values
# appears; t = η·steps ∈ [60, 120] takes the median |m| from 1/√d to 0.16–1
CASES = [("relu", 30, 1, 0.05, 1200, 0.0), ("erf", 30, 8, 0.2, 600, 0.01),
         ("erf", 300, 1, 0.2, 300, 0.0), ("relu", 300, 8, 0.4, 150, 0.0)]


def _settings(act, d, batch, eta, noise=0.0, mu=MU, chi2_dof=None):
    return pc.PretrainedSettings(act_code(act), mu, eta, batch, float(np.sqrt(noise)), d,
                                 chi2_dof)


def _rd_step(sig, mu, eta, state, x, y):
    """One SGD step of ŷ = σ(⟨μu + a v, x⟩), u = e₀, in R^d (runs vectorised): x (R, b, d),
    y (R, b) labels; state (a (R,), v (R, d)) → new (a, v)."""
    a, v = state
    s = np.einsum("rbd,rd->rb", x, v)
    lam = mu * x[..., 0] + a[:, None] * s
    delta = (sig.fn(lam) - y) * sig.deriv(lam)
    grad_v = np.einsum("rb,rbd->rd", delta, x) / x.shape[1]
    v_new = v - eta * a[:, None] * grad_v
    return a - eta * np.mean(delta * s, axis=1), v_new / np.linalg.norm(v_new, axis=1)[:, None]


# ---------------------------------------------------------------------- one step
@pytest.mark.parametrize("batch,noise", [(1, 0.0), (4, 0.3)])
@pytest.mark.parametrize("act", ["relu", "erf", "tanh"])
def test_step_matches_the_step_in_rd(act, batch, noise):
    """x_n = ν_n u + z_n v⊥ + r_n built in d = 12 with r_n ⊥ span(u, v⊥); the chain is given
    (ν_n, z_n, ε_n) and Q = ‖Σδ_n r_n‖²/Σδ_n² (= ‖r‖² for b = 1), δ_n from the R^d step."""
    d, eta = 12, 0.37
    rng = np.random.default_rng(5)
    sig = get_activation(act)
    s = _settings(act, d, batch, eta, noise)
    for _ in range(5):
        q_mat, _ = np.linalg.qr(rng.standard_normal((d, d)))
        u, e, rest = q_mat[:, 0], q_mat[:, 1], q_mat[:, 2:]
        m = rng.uniform(-1.0, 1.0)
        a = rng.normal(0.0, 1.5)
        v = m * u + np.sqrt(1.0 - m * m) * e
        xu, xz, eps = (rng.standard_normal(batch) for _ in range(3))
        r = rng.standard_normal((batch, d - 2)) @ rest.T
        x = xu[:, None] * u + xz[:, None] * e + r
        y = sig.fn(x @ u) + np.sqrt(noise) * eps
        # the R^d step in the canonical frame u = e₀ (rotate by q_mat)
        a1, v1 = _rd_step(sig, MU, eta, (np.array([a]), (v @ q_mat)[None]), (x @ q_mat)[None],
                          y[None])
        lam = x @ (MU * u + a * v)
        delta = (sig.fn(lam) - y) * sig.deriv(lam)
        q = float(np.sum(r * r) if batch == 1 else np.sum((delta @ r) ** 2) / np.sum(delta**2))
        a_c, m_c = pc.step_given(s, a, m, pc.StepDraws(xu, xz, eps, q))
        assert a_c == pytest.approx(a1[0], abs=1e-12)
        assert m_c == pytest.approx(v1[0, 0], abs=1e-12)


# ---------------------------------------------------------------------- the law
def _checkpoints(steps):
    return np.array([steps // 3, 2 * steps // 3, steps], dtype=np.int64)


@functools.cache
def _rd_law(act, d, batch, eta, steps, noise):
    """(a, m) (R, 3) at the checkpoints of an R^d simulation with plain numpy Gaussian x."""
    rng = np.random.default_rng(20_260_039)
    sig = get_activation(act)
    v = rng.standard_normal((RUNS, d))
    state = (np.full(RUNS, 1.0 / d**2), v / np.linalg.norm(v, axis=1)[:, None])
    cps = list(_checkpoints(steps))
    out_a, out_m = [], []
    for t in range(1, steps + 1):
        x = rng.standard_normal((RUNS, batch, d))
        y = sig.fn(x[..., 0]) + np.sqrt(noise) * rng.standard_normal((RUNS, batch))
        state = _rd_step(sig, MU, eta, state, x, y)
        if t in cps:
            out_a.append(state[0])
            out_m.append(state[1][:, 0])
    return np.stack(out_a, 1), np.stack(out_m, 1)


def _ks_pvalues(case, chi2_dof=None):
    """KS p-values of a and |m| at the 3 checkpoints, chain vs R^d."""
    act, d, batch, eta, steps, noise = case
    run = pc.run_chain(_settings(act, d, batch, eta, noise, chi2_dof=chi2_dof),
                       pc.PretrainedStart(seed=7, runs=RUNS), _checkpoints(steps))
    _, a_c, m_c = run.records_masked()
    a_r, m_r = _rd_law(*case)
    assert np.isfinite(a_c).all() and np.isfinite(m_r).all()
    return ([ks_2samp(a_c[:, c], a_r[:, c]).pvalue for c in range(3)],
            [ks_2samp(np.abs(m_c[:, c]), np.abs(m_r[:, c])).pvalue for c in range(3)])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-b{c[2]}")
def test_law_matches_rd_simulation(case):
    p_a, p_m = _ks_pvalues(case)
    print(case, "KS p(a)", np.round(p_a, 4), "KS p(|m|)", np.round(p_m, 4))
    assert min(p_a) > KS_LEVEL and min(p_m) > KS_LEVEL, (p_a, p_m)
    _, m_r = _rd_law(*case)
    assert np.median(np.abs(m_r[:, -1])) > 2.0 / np.sqrt(case[1])  # m moved


@pytest.mark.slow
def test_law_test_has_power():
    """Dropping the rest of x (χ² dof 0 instead of d − 2) is caught."""
    p_a, p_m = _ks_pvalues(CASES[0], chi2_dof=0)
    assert min(p_a + p_m) < 1e-6


# ---------------------------------------------------------------------- determinism
def _run(runs, seed=3, settings=None):
    settings = settings or _settings("relu", 40, 2, 0.1, 0.05)
    return pc.run_chain(settings, pc.PretrainedStart(seed, runs), np.array([0, 5, 50, 400]))


def test_same_seed_same_numbers_any_split():
    first, again, wider = _run(8), _run(8), _run(16)
    for x, y, z in zip(first.records_masked(), again.records_masked(), wider.records_masked(),
                       strict=True):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z[: len(x)] if x.ndim > 1 else z)
    assert not np.array_equal(first.records_masked()[2], _run(8, seed=4).records_masked()[2])


def test_segments_do_not_change_numbers():
    whole = _run(6)
    run = pc.PretrainedRun(_settings("relu", 40, 2, 0.1, 0.05), pc.PretrainedStart(3, 6),
                           np.array([0, 5, 50, 400]))
    for n in (3, 1, 77, 400):
        run.advance(n)
    assert run.finished
    for x, y in zip(whole.records_masked(), run.records_masked(), strict=True):
        np.testing.assert_array_equal(x, y)


def test_initial_law_and_scale():
    run = pc.run_chain(_settings("relu", 50, 1, 0.1), pc.PretrainedStart(1, 4000),
                       np.array([0]))
    _, a, m = run.records_masked()
    assert np.all(a == 1.0 / 50**2)
    assert np.mean(m[:, 0] ** 2) == pytest.approx(1.0 / 50, rel=0.1)  # E m₀² = 1/d
    run = pc.run_chain(_settings("relu", 50, 1, 0.1), pc.PretrainedStart(1, 3, 0.25),
                       np.array([0]))
    assert np.all(run.records_masked()[1] == 0.25)


# ---------------------------------------------------------------------- divergence
def test_huge_step_marks_runs_diverged():
    run = pc.run_chain(_settings("relu", 20, 1, 1e6), pc.PretrainedStart(2, 32, 1.0),
                       np.array([0, 10, 200]))
    _, a, m = run.records_masked()
    dead = run.div >= 0
    assert dead.all()
    assert np.isnan(a[:, -1]).all() and np.isnan(m[:, -1]).all()
    assert np.isfinite(a[:, 0]).all()


def test_supported():
    def config(learner, act):
        return SimpleNamespace(learner=learner, instance={"activation": act})

    assert pc.PretrainedChain().supported(config("pretrained-glm", "erf")) == (True, "")
    ok, why = pc.pretrained_supported(config("pretrained-glm", "softplus"))
    assert not ok and "softplus" in why
    assert not pc.pretrained_supported(config("glm", "relu"))[0]


# ---------------------------------------------------------------------- against the engine
@pytest.mark.slow
@pytest.mark.parametrize("d,batch,eta,steps", [(30, 1, 0.1, 600), (300, 4, 0.4, 150)])
def test_chain_matches_the_full_engine(d, batch, eta, steps):
    """``--engine reduced`` (this chain) against ``--engine full`` (the learner's R^d step
    in torch), same config: two-sample KS on |m| and a at every checkpoint after the start
    (400 runs each, independent streams)."""
    from chain_runs import ks_pvalues

    from dynamics.engines.engine import simulate
    from dynamics.setup.config import RunConfig

    spec = {"activation": "relu", "k": 1, "d": d, "seed": 0}
    kw = dict(instance=spec, learner="pretrained-glm", mu=MU, eta=eta, batch=batch,
              steps=steps, runs=400, checkpoints=4, spacing="linear")
    full = simulate(RunConfig(engine="full", seed=1, **kw).validate())
    chain = simulate(RunConfig(engine="reduced", seed=2, **kw).validate())
    assert full.engine != chain.engine
    p = ks_pvalues(full, chain, {"overlap": lambda t: t.overlap,
                                 "scale": lambda t: t.extra["scale"]}, first=1)
    assert min(p.values()) > KS_LEVEL, p
    moved = np.median(full.overlap[:, -1]) / np.median(full.overlap[:, 0])
    assert moved > 3, moved  # the runs escaped the search phase within the test
