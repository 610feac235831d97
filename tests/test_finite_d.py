"""Finite-d theory (issue 8): noise moments, exact one-step law, corrected ODE, LNA, step size.

Fast unit checks. The statistical comparisons with the reduced engine are in
``test_finite_d_sgd.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dynamics.instances.instance import build_instance
from hermite import h as h_exact
from hermite import population_ode
from hermite.finite_d.corrected_ode import (
    corrected_ode,
    corrected_steps_to_reach,
    drift_table,
    noise_floor,
    stationary_moments,
)
from hermite.finite_d.lna import initial_law, theory_band
from hermite.finite_d.noise import chi2_rule, h_tilde, noise_moments, one_step_moments
from hermite.finite_d.stepsize import max_step_size

SMALL = 2**16  # 8 scrambled Sobol′ replicates of 2^13 points
RELU_TEACHER = dict(activation="relu", k=5, d=200, xi=1.0, c_hat="teacher", seed=0)
RELU_FROZEN = dict(activation="relu", k=5, d=200, xi=1.0, c_hat="quantized", seed=1)


@pytest.fixture(scope="module")
def teacher_inst():
    return build_instance(RELU_TEACHER)


@pytest.fixture(scope="module")
def frozen_inst():
    return build_instance(RELU_FROZEN)


def _brute_force_step(inst, mu, eta, d, n_samples, seed, label_noise=0.0):
    """μ′ − μ by the closed form of docs/theory/exact-reductions.md in the (a, b) parametrisation,
    an independent code path."""
    rng = np.random.default_rng(seed)
    k = inst.k
    z = rng.standard_normal((n_samples, k))
    a, b = rng.standard_normal((2, n_samples))
    r2 = rng.chisquare(d - k - 2, n_samples)
    s = mu * a + math.sqrt(1 - mu * mu) * b
    wz = z @ inst.w_factor.T
    ux = z @ inst.u_w + inst.u_perp * a
    act = inst.activation
    y = act.fn((wz + inst.xi * inst.c * ux[:, None]) / inst.teacher_norms()) @ inst.lam
    y = y + math.sqrt(label_noise) * rng.standard_normal(n_samples)
    nh = inst.student_norms()
    pre = (wz + inst.xi * inst.c_hat * s[:, None]) / nh
    g = (-2.0 * (y - act.fn(pre) @ inst.lam)
         * (act.deriv(pre) @ (inst.lam * inst.xi * inst.c_hat / nh)))
    new = ((1 + eta * g * s) * mu - eta * g * a) / np.sqrt(
        1 + eta**2 * g**2 * (a * a + b * b + r2 - s * s))
    return new - mu


def test_chi2_rule_moments():
    for n in (0, 1, 7, 193, 10**6):
        r, w = chi2_rule(n)
        assert w.sum() == pytest.approx(1.0)
        assert (w * r).sum() == pytest.approx(n, abs=1e-9)
        assert (w * (r - n) ** 2).sum() == pytest.approx(2 * n, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("u_alpha", [0.0, 0.4])
def test_h_tilde_matches_hermite_h_and_stein(u_alpha):
    """h̃(μ) = u⊥ h(u⊥ μ), and E[g t] = −√(1−μ²) h̃ (Stein) by Monte Carlo."""
    inst = build_instance(dict(RELU_FROZEN, u_alpha=u_alpha))
    mu = np.array([-0.6, 0.0, 0.5, 0.9])
    up = inst.u_perp
    np.testing.assert_allclose(h_tilde(inst, mu), up * h_exact(inst, up * mu), rtol=1e-12)
    # the first-order drift of one exact step, brute force: η h̃ (1 − μ²) + O(η²d)
    eta = 1e-4
    for x in (0.0, 0.5):
        delta = _brute_force_step(inst, x, eta, 200, 2**18, seed=3)
        first = eta * h_tilde(inst, [x])[0] * (1 - x * x)
        assert abs(delta.mean() - first) < 5 * delta.std() / math.sqrt(delta.size) + 1e-3 * first


@pytest.mark.parametrize("u_alpha,label_noise", [(0.0, 0.0), (0.4, 0.0), (0.0, 0.3)])
def test_one_step_moments_match_brute_force(u_alpha, label_noise):
    """Exact drift and variance of one step vs direct simulation of the closed form of
    docs/theory/exact-reductions.md;
    the η → 0 drift (no normalisation term) is rejected by the same data."""
    inst = build_instance(dict(RELU_FROZEN, u_alpha=u_alpha))
    eta, d = 2e-3, 200
    mu = np.array([0.3, 0.8])
    mom = one_step_moments(inst, mu, eta, d, label_noise=label_noise, samples=2**18)
    for i, x in enumerate(mu):
        delta = _brute_force_step(inst, x, eta, d, 2**20, seed=10 + i, label_noise=label_noise)
        se = math.hypot(delta.std() / math.sqrt(delta.size), mom.se_drift[i])
        assert abs(delta.mean() - mom.drift[i]) < 4 * se
        assert abs(delta.mean() - mom.drift2[i]) < 4 * se + 0.02 * abs(mom.drift[i])
        plain = eta * mom.h_tilde[i] * (1 - x * x)
        assert abs(delta.mean() - plain) > 10 * se
        var_bf = delta.var()
        se_var = (delta**2).std() / math.sqrt(delta.size)
        assert abs(var_bf - mom.var[i]) < 4 * math.hypot(se_var, mom.se_var[i])


def test_noise_moments_structure(teacher_inst, frozen_inst):
    m = np.array([-1.0, -0.3, 0.0, 0.5, 1.0])
    nm = noise_moments(teacher_inst, m, samples=SMALL)
    n = teacher_inst.d - teacher_inst.k - 2
    np.testing.assert_allclose(nm.e_s2_px2, n * nm.e_s2 + nm.e_s2_t2, rtol=1e-10)
    # realisable (ĉ = c) and noiseless: the sample gradient vanishes at m = 1
    assert nm.e_s2[-1] < 1e-20 and nm.e_s2_t2[-1] < 1e-20
    assert nm.var_u_grad[0] == 0.0 and abs(nm.var_u_grad[-1]) < 1e-20
    assert np.all(nm.se_e_s2[1:-1] > 0) and np.all(nm.se_e_s2[1:-1] < 0.05 * nm.e_s2[1:-1])
    # label noise adds 4σ²E[ψ²] (exact, Price) to E[S²] and E[S²t²], nothing to h
    nm2 = noise_moments(teacher_inst, m, samples=SMALL, label_noise=0.5)
    add = nm2.e_s2 - nm.e_s2
    assert np.all(add > 0) and np.ptp(add) < 1e-12
    np.testing.assert_allclose(nm2.e_s2_t2 - nm.e_s2_t2, add, rtol=1e-12)
    np.testing.assert_allclose(nm2.h, nm.h)
    # frozen ĉ ≠ c: the residual does not vanish at m = 1
    assert noise_moments(frozen_inst, [1.0], samples=SMALL).e_s2[0] > 0.1


def test_corrected_ode_reduces_to_plain(teacher_inst, frozen_inst):
    """As η·d → 0 the corrected map → the plain population ODE (here η → 0 at fixed d, over
    the same η·t): the gap shrinks ∝ η, and 1 − m_∞ ∝ η·d for frozen ĉ ≠ c."""
    gaps = []
    for eta in (1e-4, 1e-5):
        steps = np.linspace(0, 6.0 / eta, 13).astype(np.int64)
        m0 = np.array([0.02, 0.1])
        plain = population_ode(teacher_inst, eta, m0, steps)
        for method in ("second_order", "exact"):
            corr = corrected_ode(teacher_inst, eta, 200, m0, steps, method=method, grid=65,
                                 samples=SMALL)
            gap = np.abs(corr - plain).max()
            if method == "exact":
                gaps.append(gap)
        mine = corrected_ode(teacher_inst, eta, 200, m0, steps, method="plain", grid=65,
                             samples=SMALL)
        assert np.abs(mine - plain).max() < 1e-6
    assert gaps[0] < 0.01 and gaps[1] < 0.1 * gaps[0] * 1.3
    floors = [1 - noise_floor(frozen_inst, eta, 200, grid=65, samples=SMALL)[0]
              for eta in (1e-5, 1e-4)]
    assert 0 < floors[0] < floors[1]
    assert floors[1] / floors[0] == pytest.approx(10.0, rel=0.05)


def test_floor_monotone_and_steps_to_reach(frozen_inst):
    floors = [noise_floor(frozen_inst, eta, 200, grid=65, samples=SMALL, refine_samples=2**18)[0]
              for eta in (5e-4, 1e-3, 2e-3)]
    assert floors[0] > floors[1] > floors[2] > 0.5
    # the plain ODE has no floor; the corrected one stalls just below m_∞
    tab = drift_table(frozen_inst, 1e-3, 200, grid=65, samples=SMALL)
    hit = corrected_steps_to_reach(frozen_inst, 1e-3, 200, 0.9, [0.01, 0.1], table=tab)
    assert np.all(np.isfinite(hit)) and hit[0] > hit[1]
    assert np.isinf(corrected_steps_to_reach(frozen_inst, 1e-3, 200, floors[1] + 1e-3, [0.01],
                                             table=tab)[0])
    traj = corrected_ode(frozen_inst, 1e-3, 200, [0.01], [0, int(hit[0]) - 1, int(hit[0])],
                         table=tab)[0]
    assert traj[1] < 0.9 <= traj[2]
    mean, sd = stationary_moments(frozen_inst, 1e-3, 200, table=tab)
    assert abs(mean - floors[1]) < 0.3 * sd and 0 < sd < 0.05


def test_corrected_ode_is_fast(teacher_inst):
    tab = drift_table(teacher_inst, 1e-5, 200, grid=65, samples=SMALL)
    out = corrected_ode(teacher_inst, 1e-5, 200, np.full(16, 0.05), [0, 10**6], table=tab)
    assert out.shape == (16, 2) and np.all(out[:, 1] > 0.5)


def test_initial_law_and_gaussian_band(teacher_inst):
    nodes, mean, var = initial_law(teacher_inst, 200, "uniform", nodes=4096)
    assert mean == 0.0 and var == pytest.approx(1 / 195)
    assert nodes.var() == pytest.approx(var, rel=0.02)
    nodes, mean, var = initial_law(teacher_inst, 200, "aligned", nodes=4096)
    assert np.all(nodes > 0) and nodes.mean() == pytest.approx(mean, rel=0.01)
    ck = np.arange(0, 6001, 1000)
    tab = drift_table(teacher_inst, 1e-3, 200, grid=65, samples=SMALL)
    g = theory_band(teacher_inst, 1e-3, 200, ck, method="gaussian", table=tab)
    assert g.sd[0] == pytest.approx(math.sqrt(1 / 195))
    np.testing.assert_allclose(g.upper - g.mean, 1.2815515655446004 * g.sd)
    mix = theory_band(teacher_inst, 1e-3, 200, ck, table=tab)
    assert np.all(mix.lower <= mix.mean) and np.all(mix.mean <= mix.upper)
    assert np.all(np.diff(mix.mean) > 0)


@pytest.mark.parametrize("spec,eps", [(RELU_FROZEN, 0.1), (RELU_TEACHER, 0.1),
                                      (dict(RELU_FROZEN, W="separated", seed=4), 0.2)])
def test_max_step_size(spec, eps):
    inst = build_instance(spec)
    rep = max_step_size(inst, 200, eps, samples=SMALL)
    assert rep.eta_max > 0
    # the floor at η_max is the target overlap (the drift touches 0 there) ...
    assert rep.floor_at_eta_max**2 == pytest.approx(1 - eps, abs=0.01)
    # ... and a slightly smaller η clears it, a larger one does not
    fl = [noise_floor(inst, f * rep.eta_max, 200, method="second_order", samples=SMALL,
                      refine_samples=0)[0] ** 2 for f in (0.8, 1.25)]
    assert fl[0] > 1 - eps > fl[1]
    assert rep.eta_theorem < rep.eta_max and rep.floor_at_theorem**2 > 1 - eps
    assert rep.theorem == ("13" if spec.get("W") == "separated" else "11")


def test_corrected_maps_switch_to_their_flow_on_long_horizons(teacher_inst, monkeypatch):
    """corrected_ode and theory_band beyond MAP_STEPS_MAX: RK4 blocks of the flow, within
    O(η) of the step-by-step maps (mean, closure and band)."""
    import importlib

    # the package re-exports the name
    cmod = importlib.import_module("hermite.finite_d.corrected_ode")
    eta = 2e-5
    tab = drift_table(teacher_inst, eta, 200, grid=65, samples=SMALL)
    m0 = np.array([0.05, 0.2, -0.1])
    steps = np.array([0, 1000, 20_001, 100_000, 300_007])
    ref = [corrected_ode(teacher_inst, eta, 200, m0, steps, table=tab),
           corrected_ode(teacher_inst, eta, 200, m0, steps, table=tab, closure=True),
           theory_band(teacher_inst, eta, 200, steps, m0=m0, table=tab)]
    monkeypatch.setattr(cmod, "MAP_STEPS_MAX", 500)
    assert cmod.flow_block(tab, steps) > 50
    new = [corrected_ode(teacher_inst, eta, 200, m0, steps, table=tab),
           corrected_ode(teacher_inst, eta, 200, m0, steps, table=tab, closure=True),
           theory_band(teacher_inst, eta, 200, steps, m0=m0, table=tab)]
    for a, b in zip(ref[:2], new[:2], strict=True):
        assert 0 < np.max(np.abs(a - b)) < 20 * eta
    for field in ("mean", "sd", "lower", "upper"):
        a, b = getattr(ref[2], field), getattr(new[2], field)
        assert np.max(np.abs(a - b)) < 20 * eta, field
