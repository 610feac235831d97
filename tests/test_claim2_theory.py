"""Claim 2 from theory (issue 17, part 4): the committee-ODE first passage and fixed points
(:mod:`hermite.committee.first_passage`, :mod:`hermite.committee.fixed_points`), its never-hit
handling against closed forms and independent integrations; and benchmarks/claim2_scratch.py's
own table over d, step formatting and ODE orders."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.optimize

import hermite
from dynamics.engines.engine import FullRun
from dynamics.instances.instance import build_instance
from dynamics.overlays.committee import committee_model, committee_state
from dynamics.setup.config import RunConfig
from hermite.committee import (
    ESCAPE_OVERLAP,
    CommitteeState,
    committee_first_passage,
    committee_ode,
    stable_fixed_point,
)


def _spec(k: int, d: int) -> dict:
    """The Claim 2 instance (benchmarks/claim2_scratch.py's ``spec_for``): He₃, W = claim2
    (orthonormal teacher rows), ξ = 1, ĉ = c."""
    return {"activation": "he3", "k": k, "d": d, "xi": 1.0, "W": "claim2", "seed": 0,
            "c_hat": "teacher"}


def _target_loss(inst, level: float = 0.9) -> float:
    """L* = Φ(level): fine-tuning's exact population loss at overlap ``level``."""
    return float(np.ravel(hermite.population_loss(inst, np.array([level])))[0])


# K = M = 1, He₃ normalised (E g² = 1), unit rows, λ̂ = λ = 1: ε = 2(1 − R³) and, to first order,
# dR/dα = γ·3·η̄ (R² − R⁴) (γ = 1 correlation, 2 squared): E[g′(λ) ν g(ν)] = 3R²,
# E[g′(λ) λ g(ν)] = 3R³ (Hermite expansion). So α(R) = (F(R) − F(R₀))/(3γη̄),
# F(R) = −1/R + atanh R, in closed form.
def _F(r):
    return -1.0 / r + math.atanh(r)


def _k1(loss, lr=0.05, d=50):
    inst = build_instance(_spec(1, d))
    model = committee_model(inst, loss=loss, eta=lr / d, second_order=False)
    return inst, model, (1.0 if loss == "correlation" else 2.0) * 3.0 * lr


@pytest.mark.parametrize("loss", ["correlation", "squared"])
def test_first_passage_k1_matches_closed_form(loss):
    d = 50
    inst, model, rate = _k1(loss, d=d)
    level = _target_loss(inst)
    r0 = 0.1
    st = CommitteeState.from_arrays(np.eye(1), [[r0]], inst.lam)
    hit = committee_first_passage(model, st, level, d, alpha_max=1e4)
    r_star = (1.0 - level / 2.0) ** (1.0 / 3.0)
    assert hit.end == "hit" and not hit.stuck
    assert hit.step == pytest.approx((_F(r_star) - _F(r0)) / rate * d, rel=1e-5)
    assert hit.escape == pytest.approx((_F(0.5) - _F(r0)) / rate * d, rel=1e-5)
    assert hit.loss0 == pytest.approx(2.0 * (1.0 - r0**3), rel=1e-12)
    assert hit.loss_end == pytest.approx(level, rel=1e-6)


def test_never_hit_and_horizon_are_inf():
    """R₀ < 0 (odd σ, λ̂ = λ fixed): R → 0⁻ as 1/α and never crosses, so ε never reaches L*:
    inf, ``stalled``; a horizon shorter than the closed-form hitting time: inf, ``horizon``;
    the loss where it stopped is the closed-form ε(α_max) in both cases."""
    d = 50
    inst, model, rate = _k1("correlation", d=d)
    level = _target_loss(inst)

    def r_at(r0, alpha):  # solve F(R) = F(R₀) + rate·α on the side of R₀
        target = _F(r0) + rate * alpha
        lo, hi = (r0, -1e-300) if r0 < 0 else (r0, 1.0 - 1e-15)
        return scipy.optimize.brentq(lambda r: _F(r) - target, lo, hi, xtol=1e-300,
                                     rtol=1e-14)

    neg = CommitteeState.from_arrays(np.eye(1), [[-0.1]], inst.lam)
    h = committee_first_passage(model, neg, level, d, alpha_max=1e4)
    assert math.isinf(h.step) and math.isinf(h.escape) and h.end == "stalled"
    assert h.alpha_end == pytest.approx(1e4)
    assert h.loss_end == pytest.approx(2.0 * (1.0 - r_at(-0.1, 1e4) ** 3), rel=1e-6)

    pos = CommitteeState.from_arrays(np.eye(1), [[0.1]], inst.lam)
    a_hit = (_F((1.0 - level / 2.0) ** (1 / 3)) - _F(0.1)) / rate
    short = committee_first_passage(model, pos, level, d, alpha_max=0.5 * a_hit)
    assert math.isinf(short.step) and short.end == "horizon"
    assert short.loss_end == pytest.approx(2.0 * (1.0 - r_at(0.1, 0.5 * a_hit) ** 3), rel=1e-6)
    assert short.loss_end > level
    cut = committee_first_passage(model, pos, level, d, alpha_max=1e4, max_evals=5)
    assert math.isinf(cut.step) and cut.end == "cap" and 0 < cut.alpha_end < a_hit
    assert cut.evaluations >= 5


def _scratch_start(learner, d, lr, runs, run):
    """(first-order committee model, run ``run``'s initial state, fine-tuning's loss L*) of
    ``learner`` on the benchmark's K = M = 2 instance (seed 0, ``runs`` runs drawn): the
    overlaps of the engine's own initial rows, nothing advanced."""
    spec = _spec(2, d)
    inst = build_instance(spec)
    sgd = FullRun(RunConfig(instance=spec, learner=learner, eta=lr / d, steps=1, runs=runs,
                            seed=0, checkpoints=2, spacing="linear",
                            finite_d_theory=False).validate())
    obs = sgd.learner.observe(sgd.state)
    cross, gram, lam = obs["cross"], obs["gram"], obs["lam_hat"]
    loss = "correlation" if learner == "scratch-csq" else "squared"
    model = committee_model(inst, loss=loss, eta=lr / d, second_order=False)
    state = committee_state(cross[run], gram[run], lam[run])
    return model, state, _target_loss(inst)


def test_first_passage_matches_fine_grid_committee_ode():
    """K = M = 2 from a scratch run's own initial rows: the event-located hitting and escape
    steps agree with a DOP853 committee_ode on an α grid of spacing 0.005 (interpolated)."""
    d, lr = 50, 0.05
    model, state, level = _scratch_start("scratch", d, lr, runs=2, run=1)
    hit = committee_first_passage(model, state, level, d, alpha_max=1e3)
    assert hit.end == "hit" and 5.0 < hit.step / d < 60.0
    grid = np.arange(0.0, hit.step / d + 1.0, 0.005)
    tr = committee_ode(model, state, grid, integrator="solve_ivp", rtol=1e-11, atol=1e-13)

    def crossing(values, thr):
        i = int(np.argmax(values <= thr))
        assert i > 0 and values[i] <= thr < values[i - 1]
        return grid[i - 1] + (grid[i] - grid[i - 1]) * (values[i - 1] - thr) / (
            values[i - 1] - values[i])

    assert hit.step / d == pytest.approx(crossing(tr.loss, level), abs=1e-4)
    esc = -np.abs(tr.R).max(axis=(1, 2))
    assert hit.escape / d == pytest.approx(crossing(esc, -ESCAPE_OVERLAP), abs=1e-4)


def test_stuck_at_a_stable_spurious_fixed_point():
    """K = M = 2, correlation loss, d = 800, run 0: both rows end on one teacher neuron
    (ε = 2 > L*); the first passage stops there as ``stuck``, and an independent longer
    integration confirms: ε stays above L* all the way, and has stopped moving."""
    d, lr = 800, 0.05
    model, state, level = _scratch_start("scratch-csq", d, lr, runs=1, run=0)
    hit = committee_first_passage(model, state, level, d, alpha_max=2e4)
    assert hit.stuck and math.isinf(hit.step) and hit.alpha_end < 2e4
    grid = np.linspace(0.0, 2.0 * hit.alpha_end, 400)
    tr = committee_ode(model, state, grid, integrator="solve_ivp", rtol=1e-10, atol=1e-12)
    assert tr.loss.min() > level + 1.0
    assert tr.loss[-1] == pytest.approx(hit.loss_end, rel=1e-6)
    assert abs(tr.loss[-1] - tr.loss[-100]) < 1e-6  # at rest over the last quarter
    stable, newton, lam_max = stable_fixed_point(
        model, model.check_state(state), CommitteeState(tr.Q[-1], tr.R[-1], tr.v[-1]).pack())
    assert stable and newton < 1e-6 and lam_max < 0


def test_second_order_first_passage_and_probe_match_committee_ode():
    """K = M = 1 with the η̄² terms (η̄ = 0.01: they slow He₃ down 2.5× from R₀ = 0.5, since
    E[δ²] ≈ 340 there): the event-located first passage and the loss at a probe α beyond
    it agree with committee_ode on a fine grid."""
    d, lr = 50, 0.01
    inst = build_instance(_spec(1, d))
    model = committee_model(inst, loss="squared", eta=lr / d, second_order=True)
    first = committee_model(inst, loss="squared", eta=lr / d, second_order=False)
    level = _target_loss(inst)
    st = CommitteeState.from_arrays(np.eye(1), [[0.5]], inst.lam)
    hit = committee_first_passage(model, st, level, d, alpha_max=1e3, alpha_probe=100.0)
    assert hit.end == "hit" and hit.step / d < 100.0
    grid = np.arange(0.0, 100.0 + 1e-9, 0.005)
    tr = committee_ode(model, st, grid, integrator="solve_ivp", rtol=1e-11, atol=1e-13)
    i = int(np.argmax(tr.loss <= level))
    a = grid[i - 1] + 0.005 * (tr.loss[i - 1] - level) / (tr.loss[i - 1] - tr.loss[i])
    assert hit.step / d == pytest.approx(a, abs=1e-4)
    assert hit.loss_probe == pytest.approx(tr.loss[-1], rel=1e-5)
    # the η̄² terms slow it down here (the first-order passage is much earlier)
    assert committee_first_passage(first, st, level, d, alpha_max=1e3).step < 0.5 * hit.step


def test_free_coordinates_round_trip_and_drift():
    """Unit rows: z = (Q_kl for k < l, R, v if trained); free rows keep Q's diagonal too.
    full(z(y)) = y, and the drift on z is committee_terms' drift at the same state."""
    from hermite.activations import get_activation
    from hermite.committee import CommitteeModel, FreeCoordinates, committee_terms

    rng = np.random.default_rng(0)
    W, V = rng.standard_normal((3, 50)), rng.standard_normal((2, 50))
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    for rows, lr_v, size in (("unit", None, 3 + 6), ("free", None, 6 + 6),
                             ("free", 0.1, 6 + 6 + 3)):
        Wr = W / np.linalg.norm(W, axis=1, keepdims=True) if rows == "unit" else W / 7.0
        st = CommitteeState.from_weights(Wr, V, [0.5, -0.2, 0.3], rows=rows)
        model = CommitteeModel(get_activation("he3"), V @ V.T, [1.0, 1.0], lr=0.05,
                               rows=rows, lr_v=lr_v, second_order=False)
        st = model.check_state(st)
        flow = FreeCoordinates(model, st)
        y = st.pack()
        assert flow.size == size
        np.testing.assert_array_equal(flow.full(flow.z(y)), y)
        np.testing.assert_allclose(
            flow.drift(flow.z(y)), committee_terms(model, st).drift.pack()[flow.idx],
            rtol=1e-13, atol=1e-15)
        if rows == "free":
            with pytest.raises(ValueError, match="unit rows"):
                committee_first_passage(model, st, 0.1, 50, alpha_max=1.0)
