"""The ``pretrained-glm`` exact chain in (a, m) (``dynamics.reduced.pretrained_chain``) against
the step written in R^d: one step on the same examples, the law of whole runs (two-sample KS
against a numpy simulation in R^d), determinism and divergence."""

from __future__ import annotations

import functools
from dataclasses import replace
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


# ---------------------------------------------------------------------- the new options
def _labels(teacher, squared):
    sig = get_activation(teacher)
    return (lambda z: sig.fn(z) ** 2) if squared else sig.fn


@pytest.mark.parametrize("teacher,squared", [(None, False), ("he3", False), ("tanh", True)])
@pytest.mark.parametrize("batch,noise", [(1, 0.0), (4, 0.3)])
def test_mixed_step_matches_the_step_in_rd(teacher, squared, batch, noise):
    """Mixed base w₀ = μu + (1 − μ)ζ in d = 12: x_n = xu u + xe e + xw w + r_n with ζ = ρu + ρ̄e,
    v = mu + pe + rw and r_n ⊥ span(u, e, w); the chain (M2)–(M4) is given (xu, xe, xw, ε)
    and Q = ‖Σδ_n r_n‖²/Σδ_n²; teacher σ* and squared labels as options."""
    d, eta, act = 12, 0.37, "erf"
    rng = np.random.default_rng(9)
    sig = get_activation(act)
    label = _labels(teacher or act, squared)
    s = replace(_settings(act, d, batch, eta, noise),
                teacher=None if teacher is None else act_code(teacher), squared=squared,
                mixed=True)
    for _ in range(5):
        q_mat, _ = np.linalg.qr(rng.standard_normal((d, d)))
        u, e, w, rest = q_mat[:, 0], q_mat[:, 1], q_mat[:, 2], q_mat[:, 3:]
        rho = rng.uniform(-0.5, 0.5)
        zeta = rho * u + np.sqrt(1 - rho * rho) * e
        m, p = rng.uniform(-0.7, 0.7, 2)
        v = m * u + p * e + np.sqrt(1 - m * m - p * p) * w
        a = rng.normal(0.0, 1.5)
        xu, xe, xw, eps = (rng.standard_normal(batch) for _ in range(4))
        r = rng.standard_normal((batch, d - 3)) @ rest.T
        x = xu[:, None] * u + xe[:, None] * e + xw[:, None] * w + r
        y = label(x @ u) + np.sqrt(noise) * eps
        w0 = MU * u + (1 - MU) * zeta
        lam = x @ (w0 + a * v)
        delta = (sig.fn(lam) - y) * sig.deriv(lam)
        v1 = v - eta * a * (delta @ x) / batch
        v1 /= np.linalg.norm(v1)
        a1 = a - eta * np.mean(delta * (x @ v))
        q = float(np.sum((delta @ r) ** 2) / np.sum(delta**2))
        got = pc.step_given_mixed(s, rho, a, m, float(v @ zeta),
                                  pc.StepDraws(xu, xe, eps, q, xw))
        np.testing.assert_allclose(got, (a1, v1 @ u, v1 @ zeta), rtol=0, atol=1e-12)


def test_mixed_initial_law():
    """(M1): ρ and q₀ = ⟨v₀, ζ⟩ have E = 0, E[·²] = 1/d; m₀ is the aligned chain's (the same
    stream), and (m₀, q₀) are overlaps of a unit vector."""
    d, runs = 50, 4000
    mixed = pc.initial_runs(replace(_settings("relu", d, 1, 0.1), mixed=True),
                            pc.PretrainedStart(1, runs))
    aligned = pc.initial_runs(_settings("relu", d, 1, 0.1), pc.PretrainedStart(1, runs))
    np.testing.assert_array_equal(mixed["mpr"][:, 0], aligned["m"])
    rho, (m, p, r) = mixed["rho"], mixed["mpr"].T
    np.testing.assert_allclose(m * m + p * p + r * r, 1.0, atol=1e-12)
    q = rho * m + np.sqrt(1 - rho**2) * p
    for x in (rho, q, p):
        assert abs(np.mean(x)) < 4 / np.sqrt(d * runs)
        assert np.mean(x * x) == pytest.approx(1.0 / d, rel=0.1)
    assert ks_2samp(rho, m).pvalue > KS_LEVEL and ks_2samp(q, m).pvalue > KS_LEVEL


def test_mixed_segments_and_records():
    settings = replace(_settings("relu", 40, 2, 0.1, 0.05), mixed=True, squared=True)
    steps = np.array([0, 5, 50, 300])
    whole = pc.run_chain(settings, pc.PretrainedStart(3, 6), steps)
    run = pc.PretrainedRun(settings, pc.PretrainedStart(3, 6), steps)
    for n in (3, 1, 77, 300):
        run.advance(n)
    for name in ("a", "m", "q"):
        np.testing.assert_array_equal(whole.masked(name), run.masked(name))
    rho = whole.rho
    m, q = whole.masked("m"), whole.masked("q")
    assert np.all(m * m + (q - rho[:, None] * m) ** 2 / (1 - rho[:, None] ** 2) <= 1 + 1e-12)
    assert not np.array_equal(m[:, -1], m[:, 0])


# (option, σ, d, b, η, steps): the runs' median |m| grows > 3-fold by the horizon
OPTION_CASES = [("mixed", "relu", 30, 1, 0.1, 600), ("mixed", "relu", 300, 4, 0.4, 150),
                ("teacher", "linear", 30, 1, 0.05, 600), ("teacher", "linear", 300, 8, 0.05, 400),
                ("y2", "quadratic", 30, 1, 0.004, 800), ("y2", "quadratic", 300, 8, 0.005, 500)]
OPTIONS = {"mixed": dict(base="mixed"), "teacher": dict(teacher_activation="he2"),
           "y2": dict(teacher_activation="linear", labels="y2")}


def _option_configs(case, **over):
    from dynamics.setup.config import RunConfig

    option, act, d, batch, eta, steps = case
    spec = {"activation": act, "k": 1, "d": d, "seed": 0}
    kw = dict(instance=spec, learner="pretrained-glm", mu=MU, eta=eta, batch=batch,
              steps=steps, runs=400, checkpoints=4, spacing="linear", **OPTIONS[option])
    kw |= over
    return (RunConfig(engine="full", seed=1, **kw).validate(),
            RunConfig(engine="reduced", seed=2, **kw).validate())


def _option_pvalues(full, chain):
    from chain_runs import ks_pvalues

    quantities = {"overlap": lambda t: t.overlap, "scale": lambda t: t.extra["scale"]}
    if "q" in full.extra:
        quantities["q"] = lambda t: t.extra["q"]
    return ks_pvalues(full, chain, quantities, first=1)


@functools.cache
def _full_run(case):
    from dynamics.engines.engine import simulate

    return simulate(_option_configs(case)[0])


@pytest.mark.slow
@pytest.mark.parametrize("case", OPTION_CASES, ids=lambda c: f"{c[0]}-d{c[2]}")
def test_chain_matches_the_full_engine_with_the_options(case):
    """``--engine reduced`` against ``--engine full`` with the mixed base, a separate σ* and
    y² labels: two-sample KS on |m|, a (and q = ⟨v, ζ⟩) at every checkpoint after the start
    (400 runs each, independent streams)."""
    from dynamics.engines.engine import simulate

    full = _full_run(case)
    chain = simulate(_option_configs(case)[1])
    assert (full.engine, chain.engine) == ("full", "reduced")
    p = _option_pvalues(full, chain)
    assert min(p.values()) > KS_LEVEL, p
    assert (full.diverged_step == -1).all() and (chain.diverged_step == -1).all()
    moved = np.median(full.overlap[:, -1]) / np.median(full.overlap[:, 0])
    assert moved > 3, moved


@pytest.mark.slow
@pytest.mark.parametrize("case,wrong", [
    (OPTION_CASES[0], "dof"), (OPTION_CASES[2], "teacher"), (OPTION_CASES[4], "labels")],
    ids=["mixed-dof+5", "teacher-ignored", "y2-ignored"])
def test_the_option_ks_check_has_power(case, wrong):
    """The same KS check fails for a wrong chain: the mixed base's χ² dof d − 3 + 5, or a chain
    that ignores σ* (labels σ(ν)) or the squaring (labels σ*(ν))."""
    from dynamics.engines.engine import simulate

    full = _full_run(case)
    d = case[2]
    if wrong == "dof":
        chain = pc.simulate_pretrained(_option_configs(case)[1], _chi2_dof=d - 3 + 5)
    else:
        over = {"teacher": dict(teacher_activation=None), "labels": dict(labels="y")}[wrong]
        chain = simulate(_option_configs(case, **over)[1])
    assert min(_option_pvalues(full, chain).values()) < KS_LEVEL
