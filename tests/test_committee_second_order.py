"""The committee ODE beside from-scratch curves keeps its η² terms (issue 25, item 5).

The fast second-order integrals (compiled ReLU/abs nested quadrature, direct K + M-dimensional
quadrature for smooth activations without closed forms) equal the previous ones; the
planner keeps the η² terms for ReLU, k = 2, d = 1000, η·d = 0.5, 16 runs; the recorded
second-order ODE tracks the SGD mean where the first-order one is off by a factor 2 (a
d = 250 proxy of that setting, same η·d); a first-order curve says so in its attributes."""

import time
from dataclasses import replace

import numpy as np
import pytest

import dynamics.overlays.committee as overlay
from dynamics.engines.engine import simulate
from dynamics.overlays.committee import (
    ODE_EVALS,
    SECOND_ORDER_BUDGET_S,
    drift_seconds,
    plan_order,
)
from dynamics.setup.config import RunConfig
from hermite.committee import (
    CommitteeIntegrals,
    CommitteeModel,
    CommitteeState,
    _fast,
    committee_ode,
    committee_ode_batch,
    committee_terms,
    committee_terms_batch,
    scaled_erf,
)
from hermite.committee import _nested as nested


# ---------------------------------------------------------------- fast = reference
def _unit_fields(P, rng, parallel=0.0):
    """Covariance of P unit fields in R^(P+3), field 1 leaning on field P−1 by ``parallel``
    (students near teachers)."""
    X = rng.standard_normal((P, P + 3))
    X[1] += parallel * X[P - 1]
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    return X @ X.T


def _cases(rng):
    """(C, coef, pairs): generic, near-parallel, repeated fields (singular C), a student
    equal to a teacher, zero coefficients (correlation loss), 2 ≤ P ≤ 6."""
    out = []
    for P in (2, 3, 4, 5, 6):
        K = max(1, P // 2)
        pairs = np.stack(np.triu_indices(K), 1)
        out.append((_unit_fields(P, rng), rng.normal(size=P), pairs))
        out.append((_unit_fields(P, rng, 3.0), rng.normal(size=P), pairs))
    C = _unit_fields(4, rng)
    idx = np.array([0, 1, 2, 2, 3])  # a repeated field
    out.append((C[np.ix_(idx, idx)], rng.normal(size=5), np.stack(np.triu_indices(2), 1)))
    C = _unit_fields(4, rng)
    C[0] = C[3]
    C[:, 0] = C[:, 3]  # student 0 = teacher
    out.append((C, np.array([-1.0, -0.7, 1.0, 1.0]), np.stack(np.triu_indices(2), 1)))
    out.append((_unit_fields(4, rng), np.array([0.0, 0.0, 1.0, 0.8]),
                np.stack(np.triu_indices(2), 1)))
    return out


@pytest.mark.parametrize("act", ["relu", "abs"])
def test_compiled_e2_equals_the_numpy_nested_quadrature(act):
    """Same rule, same closed forms: equal to 1e-12 of the largest value (measured ≤ 7e-16).
    Where two fields coincide (singular C) both evaluate the pair moment at the clipped
    ρ = 1 − 1e-15 and carry errors of ≈ 2e-8 of the exact value (checked by dropping the
    repeated field); they agree to 1e-8 there (measured 8e-10)."""
    rng = np.random.default_rng(21)
    ig = CommitteeIntegrals(act)
    for C, coef, pairs in _cases(rng):
        fast = ig.gprime_e2(C, coef, pairs)
        ref = ig.gprime_e2(C, coef, pairs, reference=True)
        singular = np.linalg.eigvalsh(C)[0] < 1e-12
        tol = 1e-8 if singular else 1e-12
        np.testing.assert_allclose(fast, ref, rtol=0, atol=tol * np.abs(ref).max())


def test_compiled_bivariate_normal_and_pair_moments_match_owens_t():
    rng = np.random.default_rng(22)
    n = 4000
    h, k = 2.0 * rng.standard_normal(n), 2.0 * rng.standard_normal(n)
    r = np.concatenate([rng.uniform(-0.999, 0.999, n - 1000),
                        1.0 - 10.0 ** rng.uniform(-15, -1, 500),
                        -1.0 + 10.0 ** rng.uniform(-15, -1, 500)])
    np.testing.assert_allclose(_fast.bvn_upper(h, k, r),
                               nested._bvn_upper(h, k, np.clip(r, -1 + 1e-15, 1 - 1e-15)),
                               rtol=0, atol=1e-14)
    sx, sy = rng.uniform(0.01, 2.0, n), rng.uniform(0.01, 2.0, n)
    for fam, ref in (("relu", nested.pair_relu), ("abs", nested.pair_abs)):
        want = ref(h, k, sx, sy, r)
        np.testing.assert_allclose(_fast.pair_moment(fam, h, k, sx, sy, r), want,
                                   rtol=1e-12, atol=1e-13)


def test_direct_e2_equals_the_i4_sum_for_smooth_activations():
    """sigmoid (quadrature only): the direct 4-D quadrature of E[g′g′e²] equals the sum of
    I4's (same 16 Gauss–Hermite nodes per level) to 1e-6 of the largest value (measured
    1e-8), and both are within 1e-4 of 32 nodes per level (measured 5e-5); He₃: both exact.
    erf keeps its closed forms, checked against the quadrature reference."""
    rng = np.random.default_rng(23)
    sig = CommitteeIntegrals("sigmoid")
    fine = CommitteeIntegrals("sigmoid", quadrature={"n4": 32})
    he3 = CommitteeIntegrals("he3")
    erf = CommitteeIntegrals(scaled_erf())
    erf_quad = CommitteeIntegrals(scaled_erf(), method="quadrature",
                                  quadrature={"n4": 48, "n2": 128})
    pairs = np.stack(np.triu_indices(2), 1)
    for trial in range(4):
        C = _unit_fields(4, rng, 0.9 * trial)
        coef = rng.normal(size=4)
        if trial == 3:
            coef[:2] = 0.0  # correlation loss: the students are not in e
        assert sig._direct_e2(4, 4)
        fast = sig.gprime_e2(C, coef, pairs)
        ref = sig.gprime_e2(C, coef, pairs, reference=True)
        hi = fine.gprime_e2(C, coef, pairs, reference=True)
        scale = np.abs(hi).max()
        np.testing.assert_allclose(fast, ref, rtol=0, atol=1e-6 * scale)
        np.testing.assert_allclose(fast, hi, rtol=0, atol=1e-4 * scale)
        ex = he3.gprime_e2(C, coef, pairs, reference=True)
        np.testing.assert_allclose(he3.gprime_e2(C, coef, pairs), ex, rtol=0,
                                   atol=1e-12 * np.abs(ex).max())
        want = erf_quad.gprime_e2(0.5 * C, coef, pairs)
        np.testing.assert_allclose(erf.gprime_e2(0.5 * C, coef, pairs), want, rtol=0,
                                   atol=1e-6 * np.abs(want).max())
    assert not sig._direct_e2(5, 5) and not sig._direct_e2(6, 6)  # there the I4 sum is cheaper


# ---------------------------------------------------------------- cost and the planner
def _relu_state(rng, d=1000):
    W = rng.standard_normal((2, d))
    V = rng.standard_normal((2, d)) / np.sqrt(d)
    W /= np.linalg.norm(W, axis=1, keepdims=True)
    return CommitteeState(W @ W.T, W @ V.T, np.ones(2)), V @ V.T


def test_relu_second_order_drift_costs_about_a_millisecond():
    """One second-order drift evaluation, ReLU, K = M = 2, unit rows: ≈ 1 ms (was 25–60 ms);
    asserted < 10 ms (best of 5, shared cores)."""
    state, T = _relu_state(np.random.default_rng(24))
    model = CommitteeModel("relu", T, np.ones(2), lr=0.5, rows="unit")
    committee_terms(model, state)  # compile / load the cache
    best = np.inf
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            committee_terms(model, state, check=False)
        best = min(best, (time.perf_counter() - t) / 10)
    assert best < 0.01, best


def test_planner_keeps_the_eta_squared_terms_for_the_users_relu_setting():
    """ReLU, k = 2, d = 1000, η·d = 0.5, 16 runs (16 distinct starts), default steps: the
    estimate is below the 20 s budget (before: ≈ 160 s, first order)."""
    order, why = plan_order("relu", 2, 2, 16, ODE_EVALS)
    assert order == 2, why
    assert 16 * ODE_EVALS * drift_seconds("relu", 2, 2, True) < SECOND_ORDER_BUDGET_S
    assert plan_order("relu", 4, 4, 1, ODE_EVALS)[0] == 1  # K + M = 8: still first order
    assert plan_order("abs", 2, 2, 16, ODE_EVALS)[0] == 2  # ≈ 15 s (g′ ≠ 0 everywhere)
    # 64 starts: one stacked ODE (BATCH_SHARE of the one-by-one cost) fits the budget
    assert plan_order("relu", 2, 2, 64, ODE_EVALS)[0] == 2


# ---------------------------------------------------------------- many starts at once
def _starts(rng, n, K=2, M=2, rows="unit", d=400):
    """n states of K student rows against M teacher rows in R^d (unit or free rows)."""
    V = rng.standard_normal((M, d))
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    out = []
    for _ in range(n):
        W = rng.standard_normal((K, d))
        W /= np.linalg.norm(W, axis=1, keepdims=True)
        if rows == "free":
            W *= rng.uniform(0.5, 1.5, size=(K, 1))
        out.append(CommitteeState(W @ W.T, W @ V.T, rng.uniform(0.5, 1.5, K)))
    return out, V @ V.T


@pytest.mark.parametrize("act,rows,kw", [
    ("relu", "unit", {}),
    ("relu", "free", {"lr_v": 0.3, "noise_var": 0.1, "batch": 2}),
    ("abs", "unit", {"trainable": (True, False, True)}),
    ("erf", "unit", {"loss": "correlation"}),
    ("tanh", "unit", {}),
])
def test_batch_drift_equals_one_state_at_a_time(act, rows, kw):
    """committee_terms_batch (one call for every state; the relu/abs η² terms of the whole
    batch in one compiled call per group of fields) equals committee_terms state by state:
    D, S, E∂L/∂v and the drift, to rounding."""
    K = 3 if "trainable" in kw else 2
    states, T = _starts(np.random.default_rng(5), 4, K=K, rows=rows)
    model = CommitteeModel(act, T, np.array([1.0, -0.8]), lr=0.5, rows=rows, **kw)
    batch = committee_terms_batch(model, np.stack([st.Q for st in states]),
                                  np.stack([st.R for st in states]),
                                  np.stack([st.v for st in states]))
    assert np.abs(batch.S).max() > 0  # the η² terms are there
    for b, st in enumerate(states):
        one = committee_terms(model, st)
        for name in ("D", "S", "Gv"):
            np.testing.assert_allclose(getattr(batch, name)[b], getattr(one, name),
                                       rtol=1e-12, atol=1e-14)
        for name in ("Q", "R", "v"):
            np.testing.assert_allclose(getattr(batch.drift, name)[b],
                                       getattr(one.drift, name), rtol=1e-12, atol=1e-14)


def test_stacked_ode_equals_each_start_on_its_own():
    """committee_ode_batch (one stacked DOP853, rtol 1e-6) against committee_ode from each
    start at rtol 1e-9: the same losses and alignments to 1e-4 (ReLU, unit rows, η̄ = 0.5,
    through the escape), in about the evaluations of one start."""
    states, T = _starts(np.random.default_rng(9), 6, d=1000)
    model = CommitteeModel("relu", T, np.ones(2), lr=0.5, rows="unit")
    alphas = np.linspace(0.0, 60.0, 31)
    ones = [committee_ode(model, st, alphas, integrator="solve_ivp", rtol=1e-9, atol=1e-12)
            for st in states]
    many = committee_ode_batch(model, states, alphas, rtol=1e-6, atol=1e-9)
    for a, b in zip(ones, many, strict=True):
        np.testing.assert_allclose(b.loss, a.loss, atol=1e-4)
        np.testing.assert_allclose(b.alignment, a.alignment, atol=1e-4)
    assert min(a.loss[-1] / a.loss[0] for a in ones) < 0.5  # through an escape
    single = committee_ode(model, states[0], alphas, integrator="solve_ivp", rtol=1e-6,
                           atol=1e-9)
    assert many[0].evaluations < 2 * single.evaluations


def test_overlay_integrates_a_models_starts_together(monkeypatch):
    """committee_records sends the distinct starts of one model to integrate_batch, records
    its curves, and they are each start's own ODE (integrate), to 1e-5."""
    calls = []
    original = overlay.integrate_batch

    def spy(model, states, steps, d, **kw):
        res = original(model, states, steps, d, **kw)
        calls.append((model, states, steps, d, res))
        return res

    monkeypatch.setattr(overlay, "integrate_batch", spy)
    cfg = RunConfig(instance=dict(activation="relu", k=2, d=200, xi=1.0, seed=1),
                    eta=0.09 / 200, steps=6000, runs=3, seed=2, checkpoints=9,
                    learner="scratch")  # η·d < 0.1: the ODE (not the diffusion)
    tr = simulate(cfg)
    assert len(calls) == 1 and len(calls[0][1]) == 3
    assert tr.extra_attrs["ode_loss"]["order"] == 2
    model, states, steps, d, res = calls[0]
    recorded = {tuple(np.round(row, 12)) for row in tr.extra["ode_loss"]}
    for state, (lo, al) in zip(states, res, strict=True):
        assert tuple(np.round(lo, 12)) in recorded
        one_lo, one_al, _ = overlay.integrate(model, state, steps, d)
        np.testing.assert_allclose(lo, one_lo, atol=1e-5)
        np.testing.assert_allclose(al, one_al, atol=1e-5)


# ---------------------------------------------------------------- the ODE beside SGD
@pytest.fixture
def both_orders(monkeypatch):
    """Record the first-order ODE of the same starts next to the planned one."""
    seen = {}
    original = overlay.committee_records

    def records(config, instances, steps, starts, regime, **kw):
        seen["first"] = original(config, instances, steps, starts,
                                 replace(regime, second_order=False), **dict(kw, quiet=True))
        return original(config, instances, steps, starts, regime, **kw)

    monkeypatch.setattr(overlay, "committee_records", records)
    return seen


def test_second_order_ode_tracks_the_sgd_mean_where_first_order_is_off(both_orders):
    """The user's setting (ReLU committee teacher, k = 2, η·d = 0.5, 16 runs, 100·d steps)
    at d = 250 instead of 1000 (≈ 20 s instead of ≈ 2 min). Measured (seeds 0, 1, 2):

    * before the plateau escape (SGD mean loss > 0.3) the mean of the second-order ODEs is
      within 4–5.4 % of the SGD mean, the first-order one 61–63 % off;
    * the loss floor (median over runs at the last checkpoint) 0.0067 in both SGD and the
      second-order ODE (within 1.5 %), 0.0018 to first order (×3.8 too low).

    During the escape (0.1 < loss < 0.3) SGD, pushed off the plateau by its fluctuations,
    leaves earlier than the noiseless ODE of each run's own start (26–58 % above SGD's at
    d = 250), so at this η·d the overlay records the diffusion with the step noise
    (hermite.committee.diffusion; its η̄² terms sampled): the second-order curve checked
    here is that; tests/test_committee_diffusion.py checks its escape against 256 runs."""
    d = 250
    config = RunConfig(instance={"activation": "relu", "teacher": "committee", "k": 2,
                                 "d": d},
                       learner="scratch", eta=0.5 / d, steps=100 * d, runs=16,
                       seed=0).validate()
    traj = simulate(config)
    attrs = traj.extra_attrs["ode_loss"]
    assert attrs["order"] == 2 and "first order" not in attrs["note"], attrs
    assert attrs["integrator"] == "diffusion" and "step noise" in attrs["note"]  # η·d = 0.5
    first_attrs = both_orders["first"][1]["ode_loss"]
    assert first_attrs["order"] == 1 and "first order in η·d only" in first_attrs["note"]
    sgd = traj.loss.mean(0)
    second = traj.extra["ode_loss"].mean(0)
    first = both_orders["first"][0]["ode_loss"].mean(0)
    plateau = sgd > 0.3
    assert plateau.sum() >= 20
    rel2 = np.abs(second - sgd)[plateau] / sgd[plateau]
    rel1 = np.abs(first - sgd)[plateau] / sgd[plateau]
    assert rel2.max() < 0.15, rel2.max()
    assert rel1.max() > 0.4, rel1.max()
    floor = np.median(traj.loss[:, -1])
    assert np.median(traj.extra["ode_loss"][:, -1]) == pytest.approx(floor, rel=0.15)
    assert np.median(both_orders["first"][0]["ode_loss"][:, -1]) < 0.5 * floor


def test_a_first_order_curve_says_so(capsys):
    """ReLU, k = 3, 16 distinct starts: over the budget (≈ 70 s), so first order; the
    datasets carry ``order`` 1, ``order_reason`` and a ``note`` (η·d and the share of the
    drift dropped at the start), and the same note goes to stderr once."""
    d = 60
    config = RunConfig(instance={"activation": "relu", "teacher": "committee", "k": 3,
                                 "d": d},
                       learner="scratch", eta=0.05 / d, steps=1000, runs=16,
                       checkpoints=8).validate()  # η·d < 0.1: the ODE, not the diffusion
    assert plan_order("relu", 3, 3, 16, ODE_EVALS)[0] == 1
    traj = simulate(config)
    for name in ("ode_loss", "ode_alignment"):
        attrs = traj.extra_attrs[name]
        assert attrs["order"] == 1 and "> 20 s" in attrs["order_reason"]
        note = attrs["note"]
        assert note.startswith("committee ODE to first order in η·d only (η·d = 0.05; the "
                               "dropped η² terms are ")
        assert "% of the drift at the start)" in note and attrs["order_reason"] in note
    err = capsys.readouterr().err
    assert err.count("first order") == 1 and traj.extra_attrs["ode_loss"]["note"] in err
    assert np.isfinite(traj.extra["ode_loss"]).all()
