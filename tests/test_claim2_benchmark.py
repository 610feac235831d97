"""benchmarks/claim2_scratch.py's own code (its table over d, step formatting, ODE orders)
and that it runs the library's theory: the script is loaded by path, being no module; the
theory itself is tested in tests/test_claim2_theory.py."""

from __future__ import annotations

import math
import runpy
import types
from pathlib import Path

import numpy as np
import pytest
import scipy.integrate
from test_claim2_theory import _scratch_start, _spec, _target_loss

from dynamics.instances.instance import build_instance
from dynamics.learners.directions import initial_directions
from dynamics.overlays.committee import ODE_EVALS, committee_state, plan_order
from dynamics.setup.config import RunConfig
from hermite import h as h_exact
from hermite.committee import ESCAPE_OVERLAP, committee_first_passage


@pytest.fixture(scope="module")
def bench():
    """The benchmark script's namespace, for the tests of the script itself (its table over
    d, its formatting, its ODE orders): the theory tests import the library instead."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "claim2_scratch.py"
    return types.SimpleNamespace(**runpy.run_path(str(path), run_name="claim2_scratch"))


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


def test_benchmark_runs_the_library_theory(bench):
    """The script integrates with the library's first passage, on the instance, target loss
    and initial overlaps the theory tests above rebuild on their own."""
    assert bench.committee_first_passage is committee_first_passage
    assert bench.ESCAPE_OVERLAP == ESCAPE_OVERLAP
    assert bench.spec_for(2, 50) == _spec(2, 50)
    inst = build_instance(_spec(2, 50))
    assert bench.target_loss(inst) == _target_loss(inst)
    model, state, _ = _scratch_start("scratch", 50, 0.05, runs=2, run=1)
    _, cross, gram, lam = bench.initial_overlaps(_spec(2, 50), "scratch", 0.05, 2, 0)
    ref = committee_state(cross[1], gram[1], lam[1])
    np.testing.assert_array_equal(ref.pack(), state.pack())

