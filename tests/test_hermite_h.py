"""h(m) of Prop. 4: exact vs series vs direct, truncation bound, paper's T(l,s) and Prop. 18."""

import math

import numpy as np
import pytest

from dynamics.instances.instance import build_instance
from hermite import HSeries, h, h0_sign, hermite_coefficients, truncation_bound

M = np.linspace(-1.0, 1.0, 41)


def _inst(**kw):
    spec = {"activation": "relu", "k": 5, "xi": 1.0, "seed": 3}
    spec.update(kw)
    return build_instance(spec)


def _rel(a, b):
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


@pytest.mark.parametrize("spec", [
    dict(activation="he3"),
    dict(activation="he6", W="separated", d=20, c="gaussian", c_hat="gaussian", xi=1.7),
    dict(activation="quadratic", u_alpha=0.4, lam="random_sign"),
    dict(activation="sigmoid", k=8, xi=2.0, W="separated", d=30),
    dict(activation="erf", k=6, c="gaussian", u_alpha=0.3),
    dict(activation="tanh", k=4, xi=1.5, lam="random_sign"),
])
def test_three_methods_agree(spec):
    inst = _inst(**spec)
    m = M * inst.u_perp
    exact = h(inst, m)
    pmax = 150 if spec["activation"] == "tanh" else 60
    series = h(inst, m, method="series", pmax=pmax)
    direct = h(inst, m, method="direct", pmax=pmax)
    assert _rel(series, exact) <= 1e-8
    assert _rel(direct, exact) <= 1e-8
    assert _rel(series, direct) <= 1e-12
    assert np.max(np.abs(series - exact)) <= truncation_bound(inst, pmax) + 1e-12


def test_relu_moderate_m_with_large_pmax():
    inst = _inst(k=6, c="gaussian", lam="random_sign", seed=5)
    m = np.linspace(-0.4, 0.4, 9)  # max |ρ| ≤ 0.9 here, so p ≤ 400 converges to ~1e-16
    _, q = inst.correlation_affine()
    exact = h(inst, m)
    assert _rel(h(inst, m, method="series", pmax=400), exact) <= 1e-8
    assert _rel(h(inst, m, method="direct", pmax=400), exact) <= 1e-8
    assert q.shape == (6, 6)


@pytest.mark.parametrize("name", ["relu", "abs", "tanh"])
@pytest.mark.parametrize("pmax", [5, 20, 60])
def test_truncation_bound_holds(name, pmax):
    inst = _inst(activation=name, c_hat="teacher")  # ρᵢᵢ(1) = 1: the worst case for the tail
    s = HSeries(inst, pmax)
    err = np.max(np.abs(s(M) - h(inst, M)))
    assert err <= s.truncation_bound
    assert s.truncation_bound == pytest.approx(truncation_bound(inst, pmax))
    if name != "tanh":
        assert err > 1e-4 * s.truncation_bound  # the bound is not absurdly loose


def test_relu_series_is_off_near_one_exact_is_not():
    # docs/theory/hermite-and-price-kernels.md: orthonormal k = 5, ξ = 1 ReLU, p ≤ 60 is ~2% off
    # at m = 0.99 when ĉ = c
    inst = _inst(c_hat="teacher")
    exact, series = h(inst, 0.99), h(inst, 0.99, method="series")
    assert abs(series - exact) / abs(exact) > 5e-3
    # exact h via the closed form of K′: check against an independent formula
    p, q = inst.correlation_affine()
    rho = p + q * 0.99
    kp = (np.pi - np.arccos(rho)) / (2 * np.pi)
    ll = np.outer(inst.lam, inst.lam)
    assert exact == pytest.approx(2 * np.sum(ll * q * kp), rel=1e-14)


def _paper_series_coefficients(inst, pmax):
    """a_l from the paper's Prop. 4 with T(l,s) (quantized c, ĉ, u ⊥ W), p = l+s+1 ≤ pmax."""
    k, xi, lam, c, ch, g = inst.k, inst.xi, inst.lam, inst.c, inst.c_hat, inst.gram
    mu = hermite_coefficients(inst.activation, pmax)
    a = np.zeros(pmax)
    for l in range(pmax):
        tot = 0.0
        for s in range(pmax - l):
            gs = g**s  # Hadamard power: ⟨Σλᵢ wᵢ^{⊗s}, Σλⱼ wⱼ^{⊗s}⟩ = Σ λλ Gᵢⱼˢ
            if l % 2 == 1:
                t = lam @ gs @ lam
            else:
                t = k * (lam * c) @ gs @ (lam * ch)
            p = l + s + 1
            tot += math.comb(l + s, l) * p * mu[p] ** 2 * (1 + xi**2 / k) ** (-p) * t
        a[l] = 2 * (xi**2 / k) ** (l + 1) * tot
    return a


@pytest.mark.parametrize("spec", [
    dict(activation="relu", k=6, xi=1.0),
    dict(activation="relu", k=7, xi=1.3, W="separated", d=25, lam="random_sign"),
    dict(activation="he5", k=5, xi=2.0, W="separated", d=12),
])
def test_series_matches_paper_T_formula(spec):
    inst = build_instance(dict(spec, seed=11))
    pmax = 30
    ours = HSeries(inst, pmax).coefficients
    np.testing.assert_allclose(ours, _paper_series_coefficients(inst, pmax), rtol=1e-11,
                               atol=1e-14 * np.max(np.abs(ours)))


def test_design_formula_quantized():
    # docs/theory/hermite-and-price-kernels.md (quantized c, ĉ, u ⊥ W):
    # h = 2 Σ λλ ξ² cĉ Σ_p p μ_p² (1+ξ²/k)^{−p} (G + ξ² cĉ m)^{p−1}
    inst = build_instance(dict(activation="he4", k=6, xi=1.4, W="separated", d=15, seed=2))
    k, xi = inst.k, inst.xi
    ll = np.outer(inst.lam, inst.lam)
    ccm = np.outer(inst.c, inst.c_hat)
    for m in (-0.7, 0.0, 0.45):
        val = 2 * np.sum(ll * xi**2 * ccm * 4 * (1 + xi**2 / k) ** -4
                         * (inst.gram + xi**2 * ccm * m) ** 3)
        assert float(h(inst, m)) == pytest.approx(val, rel=1e-12)


def test_prop18_claim2_construction():
    # Claim 2 (ξ = 1): teacher neurons orthonormal; Prop. 18: for σ = h_p,
    # h(m) = 2p (k/(k+1))^p Σ λλ cĉ (⟨wᵢ,wⱼ⟩ + cᵢĉⱼ m)^{p−1}
    p, k = 4, 9
    inst = build_instance(dict(activation=f"he{p}", k=k, xi=1.0, W="claim2", seed=4))
    np.testing.assert_allclose(inst.teacher_gram(), np.eye(k), atol=1e-12)
    ll, ccm = np.outer(inst.lam, inst.lam), np.outer(inst.c, inst.c_hat)
    for m in (-0.5, 0.2, 0.9):
        val = 2 * p * (k / (k + 1)) ** p * np.sum(ll * ccm * (inst.gram + ccm * m) ** (p - 1))
        assert float(h(inst, m)) == pytest.approx(val, rel=1e-12)
    # ... and h̃ ≈ Σ λ² cĉ up to O(1/k)
    lead = np.sum(inst.lam**2 * inst.c * inst.c_hat)
    assert abs(float(h(inst, 0.3)) / (2 * p * (k / (k + 1)) ** p) - lead) < 2.0 / k


def test_h0_sign_and_shapes():
    inst = _inst()
    s = h0_sign(inst)
    assert s in (-1, 1) and s == np.sign(float(h(inst, 0.0)))
    assert h0_sign(inst, c_hat=-inst.c_hat) == -s  # h is linear in ĉ's sign
    out = h(inst, np.zeros((2, 3)))
    assert out.shape == (2, 3)
    assert np.shape(h(inst, 0.2)) == ()
    np.testing.assert_allclose(h(inst, M, c_hat=inst.c), h(inst.with_c_hat(inst.c), M))


def test_h_errors():
    inst = _inst()
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        h(inst, 1.5)
    with pytest.raises(ValueError, match="finite"):
        h(inst, np.nan)
    with pytest.raises(ValueError, match="u_perp"):
        h(_inst(u_alpha=0.6), 0.9)
    assert float(h(inst, 1.0 + 1e-14)) == float(h(inst, 1.0))
    with pytest.raises(ValueError, match="method"):
        h(inst, 0.1, method="fast")
    with pytest.raises(ValueError, match="pmax"):
        h(inst, 0.1, method="series", pmax=-1)
    with pytest.raises(ValueError, match="pmax"):
        h(inst, 0.1, method="direct", pmax=-2)
    assert float(h(inst, 0.3, method="series", pmax=0)) == 0.0
