"""Population ODE: table map vs exact map, discrete vs continuous, hitting times, fixed points."""

import math

import numpy as np
import pytest
import scipy.optimize

from dynamics.instances.instance import build_instance
from hermite import HTable, h, ode_continuous, population_ode, steps_to_reach


def _inst(**kw):
    spec = {"activation": "relu", "k": 5, "xi": 1.0, "seed": 3}
    spec.update(kw)
    return build_instance(spec)


@pytest.mark.parametrize("spec", [
    dict(c_hat="teacher"),  # √(1 − m) singularity of h at m = 1
    dict(activation="abs", k=8, c_hat="teacher", seed=1),
    dict(activation="tanh", k=20, xi=4.0, u_alpha=0.5),
    dict(activation="he4", k=6, xi=2.0, W="separated", d=30, c="gaussian"),
    dict(k=50),
])
def test_table_interpolation_error(spec):
    inst = _inst(**spec)
    tab = HTable(inst)
    u = inst.u_perp
    rng = np.random.default_rng(0)
    # (within ~1e-10 of ±u⊥ the direct evaluation itself loses digits: ρ = P + Qm is rounded
    # and K′ has an infinite slope at ρ = 1, so the comparison stops there)
    m = np.concatenate([rng.uniform(-u, u, 3000), u * (1 - np.logspace(-10, -1, 40)),
                        -u * (1 - np.logspace(-10, -1, 40)), [u, -u, 0.0]])
    err = tab.check(m)
    assert HTable.for_instance(_inst(**spec)) is HTable.for_instance(inst)  # cached by value
    assert tab.max_error <= 1e-10 * tab.scale
    assert err <= 1e-9 * tab.scale  # well inside the 1e-6 relative target


def test_table_map_matches_exact_map():
    inst = _inst(c_hat="teacher", u_alpha=0.2)
    m0 = np.array([-0.9, -0.2, 0.01, 0.5, 0.97]) * inst.u_perp
    steps = [0, 1, 7, 50, 200]
    a = population_ode(inst, 0.05, m0, steps)
    b = population_ode(inst, 0.05, m0, steps, method="exact")
    assert a.shape == (5, 5)
    np.testing.assert_array_equal(a[:, 0], m0)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)


def test_discrete_map_converges_to_continuous_at_rate_eta():
    inst = _inst(activation="tanh", k=6, xi=1.5, seed=2)
    m0 = np.array([0.05, -0.3])
    horizon = 4.0  # in units of η t
    errs = []
    for eta in (4e-3, 2e-3):
        n = int(round(horizon / eta))
        steps = np.linspace(0, n, 9).astype(int)
        disc = population_ode(inst, eta, m0, steps)
        cont = ode_continuous(inst, eta, m0, steps)
        errs.append(np.max(np.abs(disc - cont)))
    assert errs[1] < 5e-3
    assert 1.7 < errs[0] / errs[1] < 2.3  # first-order (Euler) discretisation error


def test_steps_to_reach_consistent_with_trajectories():
    inst = _inst(k=6, seed=4)
    eta, m0 = 1e-2, 0.02 * (1 if float(h(inst, 0.0)) > 0 else -1)
    t_cont = steps_to_reach(inst, eta, m0, 0.5)
    t_disc = steps_to_reach(inst, eta, m0, 0.5, method="discrete")
    assert math.isfinite(t_cont) and t_disc == int(t_disc)
    m_at = ode_continuous(inst, eta, [m0], [0, t_cont])[0, 1]
    assert abs(m_at) == pytest.approx(0.5, abs=1e-7)
    assert abs(t_disc - t_cont) <= 0.02 * t_cont + 2
    traj = population_ode(inst, eta, [m0], [int(t_disc) - 1, int(t_disc)])[0]
    assert abs(traj[0]) < 0.5 <= abs(traj[1])


def test_fixed_point_is_never_crossed():
    # h(0) > 0 but h changes sign at m* ≈ 0.58: the flow stops at m*
    inst = build_instance(dict(activation="relu", k=4, xi=1.0, seed=5, c="gaussian",
                               c_hat="gaussian", lam="random_sign"))
    assert float(h(inst, 0.0)) > 0
    root = scipy.optimize.brentq(lambda x: float(h(inst, x)), 0.3, 0.9, xtol=1e-14)
    assert math.isfinite(steps_to_reach(inst, 0.01, 0.01, 0.5))
    assert steps_to_reach(inst, 0.01, 0.01, 0.9) == math.inf
    assert steps_to_reach(inst, 0.01, 0.01, 0.9, method="discrete", max_steps=10**5) == math.inf
    final = population_ode(inst, 0.5, [0.01, 0.95], [100_000])[:, 0]
    np.testing.assert_allclose(final, root, atol=1e-12)


def test_steps_to_reach_edge_cases():
    inst = _inst(u_alpha=0.5)
    s = 1 if float(h(inst, 0.0)) > 0 else -1
    assert steps_to_reach(inst, 0.01, 0.6 * s, 0.5) == 0.0
    assert steps_to_reach(inst, 0.01, 0.1 * s, 0.9) == math.inf  # 0.9 > u⊥ ≈ 0.866
    t_neg = steps_to_reach(inst, 0.01, -0.1 * s, 0.5)  # drifts through 0 to the good side
    assert math.isfinite(t_neg) and t_neg > steps_to_reach(inst, 0.01, 0.1 * s, 0.5)
    with pytest.raises(ValueError, match="level"):
        steps_to_reach(inst, 0.01, 0.1, -0.5)


def test_ode_argument_errors():
    inst = _inst()
    with pytest.raises(ValueError, match="eta"):
        population_ode(inst, 0.0, [0.1], [0, 10])
    with pytest.raises(ValueError, match="eta"):
        steps_to_reach(inst, -1.0, 0.1, 0.5)
    with pytest.raises(ValueError, match="sorted"):
        population_ode(inst, 0.1, [0.1], [10, 0])
    with pytest.raises(ValueError, match="≥ 0"):
        population_ode(inst, 0.1, [0.1], [-1, 3])
    with pytest.raises(ValueError, match="integers"):
        population_ode(inst, 0.1, [0.1], [0.5])
    with pytest.raises(ValueError, match="m0"):
        population_ode(inst, 0.1, [1.5], [0])
    with pytest.raises(ValueError, match="method"):
        population_ode(inst, 0.1, [0.1], [0], method="rk4")
    out = population_ode(inst, 0.1, 0.2, [0, 0, 3])
    assert out.shape == (1, 3) and out[0, 0] == out[0, 1] == 0.2
    assert ode_continuous(inst, 0.1, [0.2, 0.3], [0]).shape == (2, 1)


def test_long_horizons_integrate_the_flow_in_rk4_blocks(monkeypatch):
    """Beyond MAP_STEPS_MAX steps the map is replaced by RK4 blocks of its flow: equal to the
    exact flow (DOP853) to RK4 accuracy and to the step-by-step map up to O(η)."""
    import hermite.flows.ode as ode_mod

    inst = _inst(activation="tanh", k=6, xi=1.5, seed=2)
    m0 = np.array([0.05, -0.3, 0.001])
    eta = 1e-5
    steps = np.linspace(0, int(6.0 / eta), 7).astype(int) + np.array([0, 3, 0, 11, 0, 0, 5])
    exact_map = population_ode(inst, eta, m0, steps)
    monkeypatch.setattr(ode_mod, "MAP_STEPS_MAX", 1000)
    assert ode_mod._flow_block(HTable.for_instance(inst), eta, inst.u_perp, steps) > 100
    flow = population_ode(inst, eta, m0, steps)
    np.testing.assert_allclose(flow, ode_continuous(inst, eta, m0, steps), rtol=0, atol=1e-8)
    gap = np.max(np.abs(flow - exact_map))
    assert 1e-9 < gap < 20 * eta
