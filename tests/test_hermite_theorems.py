"""Theorem 11/12/13/16 step sizes and horizons: formulas, case splits, scaling in d."""

import math

import pytest

from dynamics.instances.instance import build_instance
from hermite import (
    h,
    population_lower_bound,
    theorem11_schedule,
    theorem12_schedule,
    theorem13_schedule,
    theorem16_schedule,
)


def _inst(**kw):
    spec = {"activation": "relu", "k": 16, "d": 1000, "xi": 1.0, "seed": 0}
    spec.update(kw)
    return build_instance(spec)


def test_theorem11_formula():
    inst = _inst()
    eps, gamma, cd = 0.1, 0.5, 0.2
    s = theorem11_schedule(inst, eps, gamma=gamma, C_delta=cd)
    big = 1000 * 16**2
    delta = cd * gamma * eps**3 / math.log(big) ** 2
    assert s.delta == pytest.approx(delta)
    assert s.eta == pytest.approx(delta / big)
    assert s.alpha == pytest.approx(math.log(big) / (gamma * eps * delta))
    assert s.T == math.ceil(s.alpha * big)
    assert s.m0_min == pytest.approx(1 / math.sqrt(1000))


def test_theorem11_information_exponent_split():
    # μ₁(σ) = 0 (σ = h₃): δ gets 1/√k and α gets √k, so T grows by k
    lin, cub = _inst(), _inst(activation="he3")
    a, b = theorem11_schedule(lin, 0.2), theorem11_schedule(cub, 0.2)
    assert b.delta == pytest.approx(a.delta / 4)
    assert b.T / a.T == pytest.approx(16, rel=1e-6)


def test_theorem11_horizon_is_linear_in_d_up_to_logs():
    t1 = theorem11_schedule(_inst(d=10**4), 0.2).T
    t2 = theorem11_schedule(_inst(d=10**5), 0.2).T
    lg = lambda d: math.log(d * 16**2)  # noqa: E731
    assert t2 / t1 == pytest.approx(10 * (lg(10**5) / lg(10**4)) ** 3, rel=1e-6)


def test_theorem12_formula_and_xi_bar_default():
    inst = _inst(xi=0.5 * 4.0)  # ξ̄ = ξ/√k = 0.5
    s = theorem12_schedule(inst, 0.3, gamma=1.0, C_delta=1e-3)
    k, d, xb = 16, 1000, 0.5
    lg = math.log(d * k**2)
    delta = min(1e-3 * xb**2 * math.sqrt(k) * 0.3**3 / lg**2 * math.sqrt(k), 1.0)
    assert s.constants["xi_bar"] == pytest.approx(xb)
    assert s.delta == pytest.approx(delta)
    assert s.eta == pytest.approx(delta / (xb**2 * d * k**4))
    alpha = lg / (xb**2 * math.sqrt(k) * 0.3 * delta) / math.sqrt(k)
    assert s.T == math.ceil(alpha * xb**2 * d * k**4)
    assert theorem12_schedule(inst, 0.3, C_delta=1e9).delta == 1.0  # the min{·, 1}


def test_theorem13_uses_corrected_eta():
    inst = _inst(W="separated", lam="random_sign")
    s = theorem13_schedule(inst, 0.2, gamma=1.0, C_delta=1.0)
    big = 1000 * 16**2
    assert s.eta == pytest.approx(s.delta / big)
    assert s.delta == pytest.approx(0.2**3 / (math.log(big) ** 2 * 4))


def test_theorem16_with_instance_lower_bound():
    inst = _inst(k=6, c_hat="teacher")
    S = population_lower_bound(inst)
    assert 0 < S
    s = theorem16_schedule(inst, 0.2)
    assert s.constants["S_k"] == pytest.approx(min(S, abs(float(h(inst, 0.0))) / 2))
    V = s.constants["V_k"]
    assert s.eta == pytest.approx(s.delta / (1000 * V))
    assert s.T == math.ceil(s.alpha * 1000 * V)
    assert s.to_dict()["theorem"] == "16"


def test_schedule_errors():
    with pytest.raises(ValueError, match="eps"):
        theorem11_schedule(_inst(), 1.5)
    with pytest.raises(ValueError, match="pass d"):
        theorem11_schedule(build_instance({"activation": "relu", "k": 4}), 0.1)
    bad = build_instance(dict(activation="relu", k=4, xi=1.0, seed=5, c="gaussian",
                              c_hat="gaussian", lam="random_sign", d=50))
    with pytest.raises(ValueError, match="Condition 3"):
        theorem16_schedule(bad, 0.1)  # h changes sign on the path (fixed point at m ≈ 0.58)
