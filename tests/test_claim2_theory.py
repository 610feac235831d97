"""Claim 2 from theory (issue 17, part 4): benchmarks/claim2_scratch.py's committee-ODE first
passage, its never-hit handling and the table over d, against independent computations."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.integrate
import scipy.optimize

from dynamics.committee_overlay import ODE_EVALS, committee_model, committee_state, plan_order
from dynamics.config import RunConfig
from dynamics.instance import build_instance
from dynamics.learners.directions import initial_directions
from hermite import h as h_exact
from hermite.committee import CommitteeState, committee_ode


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "claim2_scratch.py"
    spec = importlib.util.spec_from_file_location("claim2_scratch", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass resolves annotations through sys.modules
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


# K = M = 1, He₃ normalised (E g² = 1), unit rows, λ̂ = λ = 1: ε = 2(1 − R³) and, to first order,
# dR/dα = γ·3·η̄ (R² − R⁴) (γ = 1 correlation, 2 squared): E[g′(λ) ν g(ν)] = 3R²,
# E[g′(λ) λ g(ν)] = 3R³ (Hermite expansion). So α(R) = (F(R) − F(R₀))/(3γη̄),
# F(R) = −1/R + atanh R, in closed form.
def _F(r):
    return -1.0 / r + math.atanh(r)


def _k1(bench, loss, lr=0.05, d=50):
    inst = build_instance(bench.spec_for(1, d))
    model = committee_model(inst, loss=loss, eta=lr / d, second_order=False)
    return inst, model, (1.0 if loss == "correlation" else 2.0) * 3.0 * lr


@pytest.mark.parametrize("loss", ["correlation", "squared"])
def test_first_passage_k1_matches_closed_form(bench, loss):
    d = 50
    inst, model, rate = _k1(bench, loss, d=d)
    level = bench.target_loss(inst)
    r0 = 0.1
    st = CommitteeState.from_arrays(np.eye(1), [[r0]], inst.lam)
    hit = bench.ode_first_passage(model, st, level, d, alpha_max=1e4)
    r_star = (1.0 - level / 2.0) ** (1.0 / 3.0)
    assert hit.end == "hit" and not hit.stuck
    assert hit.step == pytest.approx((_F(r_star) - _F(r0)) / rate * d, rel=1e-5)
    assert hit.escape == pytest.approx((_F(0.5) - _F(r0)) / rate * d, rel=1e-5)
    assert hit.loss0 == pytest.approx(2.0 * (1.0 - r0**3), rel=1e-12)
    assert hit.loss_end == pytest.approx(level, rel=1e-6)


def test_never_hit_and_horizon_are_inf(bench):
    """R₀ < 0 (odd σ, λ̂ = λ fixed): R → 0⁻ as 1/α and never crosses, so ε never reaches L*:
    inf, ``stalled``; a horizon shorter than the closed-form hitting time: inf, ``horizon``;
    the loss where it stopped is the closed-form ε(α_max) in both cases."""
    d = 50
    inst, model, rate = _k1(bench, "correlation", d=d)
    level = bench.target_loss(inst)

    def r_at(r0, alpha):  # solve F(R) = F(R₀) + rate·α on the side of R₀
        target = _F(r0) + rate * alpha
        lo, hi = (r0, -1e-300) if r0 < 0 else (r0, 1.0 - 1e-15)
        return scipy.optimize.brentq(lambda r: _F(r) - target, lo, hi, xtol=1e-300,
                                     rtol=1e-14)

    neg = CommitteeState.from_arrays(np.eye(1), [[-0.1]], inst.lam)
    h = bench.ode_first_passage(model, neg, level, d, alpha_max=1e4)
    assert math.isinf(h.step) and math.isinf(h.escape) and h.end == "stalled"
    assert h.alpha_end == pytest.approx(1e4)
    assert h.loss_end == pytest.approx(2.0 * (1.0 - r_at(-0.1, 1e4) ** 3), rel=1e-6)

    pos = CommitteeState.from_arrays(np.eye(1), [[0.1]], inst.lam)
    a_hit = (_F((1.0 - level / 2.0) ** (1 / 3)) - _F(0.1)) / rate
    short = bench.ode_first_passage(model, pos, level, d, alpha_max=0.5 * a_hit)
    assert math.isinf(short.step) and short.end == "horizon"
    assert short.loss_end == pytest.approx(2.0 * (1.0 - r_at(0.1, 0.5 * a_hit) ** 3), rel=1e-6)
    assert short.loss_end > level
    cut = bench.ode_first_passage(model, pos, level, d, alpha_max=1e4, max_evals=5)
    assert math.isinf(cut.step) and cut.end == "cap" and 0 < cut.alpha_end < a_hit
    assert cut.evaluations >= 5


def _scratch_start(bench, learner, d, lr, runs, run):
    """(first-order committee model, run ``run``'s initial state, fine-tuning's loss L*) of
    ``learner`` on the benchmark's K = M = 2 instance (seed 0, ``runs`` runs drawn)."""
    spec = bench.spec_for(2, d)
    inst = build_instance(spec)
    _, cross, gram, lam = bench.initial_overlaps(spec, learner, lr, runs, 0)
    loss = "correlation" if learner == "scratch-csq" else "squared"
    model = committee_model(inst, loss=loss, eta=lr / d, second_order=False)
    state = committee_state(cross[run], gram[run], lam[run])
    return model, state, bench.target_loss(inst)


def test_first_passage_matches_fine_grid_committee_ode(bench):
    """K = M = 2 from a scratch run's own initial rows: the event-located hitting and escape
    steps agree with a DOP853 committee_ode on an α grid of spacing 0.005 (interpolated)."""
    d, lr = 50, 0.05
    model, state, level = _scratch_start(bench, "scratch", d, lr, runs=2, run=1)
    hit = bench.ode_first_passage(model, state, level, d, alpha_max=1e3)
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
    assert hit.escape / d == pytest.approx(crossing(esc, -bench.ESCAPE_OVERLAP), abs=1e-4)


def test_stuck_at_a_stable_spurious_fixed_point(bench):
    """K = M = 2, correlation loss, d = 800, run 0: both rows end on one teacher neuron
    (ε = 2 > L*); the first passage stops there as ``stuck``, and an independent longer
    integration confirms: ε stays above L* all the way, and has stopped moving."""
    d, lr = 800, 0.05
    model, state, level = _scratch_start(bench, "scratch-csq", d, lr, runs=1, run=0)
    hit = bench.ode_first_passage(model, state, level, d, alpha_max=2e4)
    assert hit.stuck and math.isinf(hit.step) and hit.alpha_end < 2e4
    grid = np.linspace(0.0, 2.0 * hit.alpha_end, 400)
    tr = committee_ode(model, state, grid, integrator="solve_ivp", rtol=1e-10, atol=1e-12)
    assert tr.loss.min() > level + 1.0
    assert tr.loss[-1] == pytest.approx(hit.loss_end, rel=1e-6)
    assert abs(tr.loss[-1] - tr.loss[-100]) < 1e-6  # at rest over the last quarter
    stable, newton, lam_max = bench.stable_fixed_point(
        model, model.check_state(state), CommitteeState(tr.Q[-1], tr.R[-1], tr.v[-1]).pack())
    assert stable and newton < 1e-6 and lam_max < 0


def test_first_hit_quantiles_and_format_with_never(bench):
    steps = np.array([0, 10, 20, 30])
    hit = np.array([[False, False, True, True], [False, False, False, False],
                    [False, True, False, False]])
    t = bench.first_hit(steps, hit)
    assert t[0] == 20 and math.isinf(t[1]) and t[2] == 10
    assert bench.quantiles(np.array([1.0, 2.0, np.inf, np.inf]))[1] == 2.0
    lo, med, hi = bench.quantiles(np.array([1.0, np.inf, np.inf, np.inf, 5.0]))
    assert lo == 1.0 and math.isinf(med) and math.isinf(hi)
    assert bench.fmt(np.inf, 300000) == "> 300000" and bench.fmt(np.inf, None) == "never"
    assert bench.fmt(1234.4, 10) == "1234"


def test_table_over_d(bench):
    """Theory-only table, k = 2, d = 50, 200, 800, two runs: the documented columns; the
    fine-tuning population ODE's per-run T_ft is (d/c)∫_{m₀}^{0.9} dm/(h(m)(1 − m²)) (an
    independent quadrature of h from each run's m₀); the ODE step counts grow with d."""
    args = bench.parse(["--theory-only", "--k", "2", "--d", "50", "200", "800", "--runs", "2",
                        "--ft-c", "0.05", "--scratch-c", "0.05", "--budget", "20000",
                        "--no-corrected", "--order", "1"])
    args.csq_c = []
    results = bench.measure(args)
    rows = bench.table_rows(results)
    assert all(set(r) == set(bench.TABLE_COLUMNS) for r in rows)
    assert [(r["d"], r["learner"], r["order"]) for r in rows] == [
        (d, lr, o) for d in (50, 200, 800) for lr, o in (("finetune", 0), ("scratch", 1))]
    fin = [r for r in rows if r["learner"] == "finetune"]
    scr = [r for r in rows if r["learner"] == "scratch"]
    inst = build_instance(bench.spec_for(2, 50))  # h does not depend on d
    for res, r in zip(results, fin, strict=True):
        d = res["d"]
        cfg = RunConfig(instance=bench.spec_for(2, d), learner="finetune", eta=0.05 / d,
                        steps=1, runs=2, seed=0).validate()
        _, m0 = initial_directions(cfg, cfg.run_instances())
        expect = [d / 0.05 * scipy.integrate.quad(
            lambda m: 1.0 / (float(h_exact(inst, m)) * (1.0 - m * m)), m, 0.9)[0] for m in m0]
        np.testing.assert_allclose(res["ft"]["row"]["pop"], expect, rtol=1e-6)
        assert r["ode_median"] == pytest.approx(min(expect), rel=1e-6)  # inverted CDF: lower
        assert r["ode_ratio"] == pytest.approx(r["ode_median"] / r["sgd_median"])
        assert r["sgd_reached"] == 1.0 and r["theory_ratio"] == pytest.approx(1.0)
    for r in scr:
        assert math.isnan(r["sgd_median"]) and math.isnan(r["sgd_reached"])
    for rows_ in (fin, scr):
        key = "ode_median" if rows_ is fin else "escape_median"
        vals = [r[key] for r in rows_]
        assert all(np.isfinite(vals)) and vals[0] < vals[1] < vals[2], vals
    assert all(r["ode_runs"] == 2 for r in rows)
    p = bench.scaling_exponent(rows, "finetune", "ode_median")
    assert p == pytest.approx(1.0, abs=0.1)


def test_orders_auto_follows_plan_order(bench):
    order, why = plan_order(build_instance(bench.spec_for(4, 200)).activation, 4, 4, 16,
                            ODE_EVALS)
    assert bench.ode_orders(bench.parse(["--d", "200"]), 200) == (
        [1, order], [16, 4], ["requested", why], [30000, 4000])
    assert bench.ode_orders(bench.parse(["--order", "2", "--ode-runs", "3"]), 200) == (
        [2], [3], ["requested"], [4000])


def test_second_order_first_passage_and_probe_match_committee_ode(bench):
    """K = M = 1 with the η̄² terms (η̄ = 0.01: they slow He₃ down 2.5× from R₀ = 0.5, since
    E[δ²] ≈ 340 there): the event-located first passage and the loss at a probe α beyond
    it agree with committee_ode on a fine grid."""
    d, lr = 50, 0.01
    inst = build_instance(bench.spec_for(1, d))
    model = committee_model(inst, loss="squared", eta=lr / d, second_order=True)
    first = committee_model(inst, loss="squared", eta=lr / d, second_order=False)
    level = bench.target_loss(inst)
    st = CommitteeState.from_arrays(np.eye(1), [[0.5]], inst.lam)
    hit = bench.ode_first_passage(model, st, level, d, alpha_max=1e3, alpha_probe=100.0)
    assert hit.end == "hit" and hit.step / d < 100.0
    grid = np.arange(0.0, 100.0 + 1e-9, 0.005)
    tr = committee_ode(model, st, grid, integrator="solve_ivp", rtol=1e-11, atol=1e-13)
    i = int(np.argmax(tr.loss <= level))
    a = grid[i - 1] + 0.005 * (tr.loss[i - 1] - level) / (tr.loss[i - 1] - tr.loss[i])
    assert hit.step / d == pytest.approx(a, abs=1e-4)
    assert hit.loss_probe == pytest.approx(tr.loss[-1], rel=1e-5)
    # the η̄² terms slow it down here (the first-order passage is much earlier)
    assert bench.ode_first_passage(first, st, level, d, alpha_max=1e3).step < 0.5 * hit.step
