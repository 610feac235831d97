"""Theory of fine-tuning from a pre-trained base w₀ = μu (hermite/flows/pretrained.py,
docs/theory/pretraining-hurts.md): escape times against closed forms, b and c against Monte
Carlo and the σ″ form, the Jacobian against finite differences of the flow, the drift against
one exact SGD step in R^d, the He₃ trap, bad input; and the general setting (the mixed base
w₀ = μu + (1 − μ)ζ, a teacher σ* ≠ σ, labels y²): the mixed τ against its closed form for
linear σ, escape rates against the flow's own finite-difference Jacobian, the pair moments
against the adaptive reference and Monte Carlo, the flow against the mean of chain runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.optimize
import scipy.special as sp

from hermite.activations import get_activation
from hermite.flows.pretrained import (
    PretrainedFlow,
    Pretraining,
    _fast_moments,
    _integrate,
    _pair_moments,
    _pair_reference,
    _reference_moments,
    _smooth_moments,
    escape_coefficients,
    escape_rate,
    escape_time,
    general_drift,
    general_escape_coefficients,
    general_escape_time,
    general_flow,
    general_loss,
    pretrained_drift,
    pretrained_flow,
    pretrained_loss,
)

MUS = (0.1, 0.3, 0.5, 0.7, 0.9)


def _linear_tau(mu):
    return 2.0 / (math.sqrt(1.0 + 4.0 * (1.0 - mu) ** 2) - 1.0)


# σ″ of the smooth activations, for the Stein-free form of c
def _erf2(x):
    return -4.0 * x * np.exp(-x * x) / math.sqrt(math.pi)


def _sigmoid2(x):
    s = sp.expit(x)
    return s * (1 - s) * (1 - 2 * s)


def _tanh2(x):
    t = np.tanh(x)
    return -2.0 * t * (1 - t * t)


def _he3_2(x):
    return 6.0 * x / math.sqrt(6.0)  # h₃ = (x³ − 3x)/√6


SECOND = {"erf": _erf2, "sigmoid": _sigmoid2, "tanh": _tanh2, "he3": _he3_2}


# ---------------------------------------------------------------- escape times
@pytest.mark.parametrize("mu", MUS)
def test_escape_time_closed_forms(mu):
    assert escape_time("linear", mu) == pytest.approx(_linear_tau(mu), rel=1e-8)
    assert escape_time("relu", mu) == pytest.approx(2.0 * _linear_tau(mu), rel=1e-8)
    b, c = escape_coefficients(get_activation("relu"), mu)
    assert b == pytest.approx((mu - 1.0) / 2.0, abs=1e-12) and c == pytest.approx(0.5, abs=1e-12)


def test_relu_escape_time_at_half_and_vectorised():
    assert round(escape_time("relu", 0.5), 3) == 9.657
    taus = escape_time("relu", np.array(MUS))
    assert taus.shape == (5,)
    np.testing.assert_allclose(taus, [2.0 * _linear_tau(m) for m in MUS], rtol=1e-8)
    np.testing.assert_allclose(escape_rate("relu", np.array(MUS)), 1.0 / taus, rtol=1e-12)


@pytest.mark.parametrize("name", ["erf", "sigmoid", "tanh", "he3"])
def test_b_and_c_against_monte_carlo(name):
    """b from its definition, c from the σ″ form E[σ′(μν)² + (σ(μν) − σ(ν))σ″(μν)]."""
    act = get_activation(name)
    rng = np.random.default_rng(39)
    nu = rng.standard_normal(1_000_000)
    for mu in (0.3, 0.7):
        b, c = escape_coefficients(act, mu)
        gap = act.fn(mu * nu) - act.fn(nu)
        b_mc = gap * act.deriv(mu * nu) * nu
        c_mc = act.deriv(mu * nu) ** 2 + gap * SECOND[name](mu * nu)
        for exact, sample in ((b, b_mc), (c, c_mc)):
            se = sample.std() / math.sqrt(sample.size)
            assert abs(sample.mean() - exact) < 5 * se, (name, mu, exact, sample.mean(), se)


def test_stein_form_of_c_equals_second_derivative_form():
    act = get_activation("tanh")
    for mu in MUS:
        def integrand(x, mu=mu):
            gap = np.tanh(mu * x) - np.tanh(x)
            return (act.deriv(mu * x) ** 2 + gap * _tanh2(mu * x)) * np.exp(-x * x / 2)
        c_direct = scipy.integrate.quad(integrand, -np.inf, np.inf, epsabs=1e-14,
                                        epsrel=1e-13)[0] / math.sqrt(2 * math.pi)
        assert escape_coefficients(act, mu)[1] == pytest.approx(c_direct, abs=1e-10)


@pytest.mark.parametrize("name", ["relu", "erf", "he3", "tanh", "sigmoid"])
def test_escape_rate_is_the_linearised_flow(name):
    """Central differences of the flow's right-hand side at (0, 0): [[−c, −b], [−b, 0]] (tiny
    h: at a kink the drift has an a·|a| term, so the central difference errs by O(h))."""
    mu, h = 0.45, 1e-8
    cols = []
    for e in ((h, 0.0), (0.0, h)):
        plus = np.array(pretrained_drift(name, mu, e[0], e[1]))
        minus = np.array(pretrained_drift(name, mu, -e[0], -e[1]))
        cols.append((plus - minus) / (2 * h))
    jac = np.column_stack(cols)
    b, c = escape_coefficients(name, mu)
    np.testing.assert_allclose(jac, [[-c, -b], [-b, 0.0]], atol=1e-7 * (abs(b) + abs(c)))
    assert np.linalg.eigvals(jac).real.max() == \
        pytest.approx(escape_rate(name, mu), rel=1e-6)


# ---------------------------------------------------------------- the drift against SGD
def _sgd_step_increments(act, mu, state, eta, d, n, rng):
    """(a′ − a)/η and (m′ − m)/η of one exact online SGD step (B = 1) in R^d, n examples."""
    a, m = state
    v = np.zeros(d)
    v[0], v[1] = m, math.sqrt(1 - m * m)  # u = e₁
    da, dm = [], []
    for _ in range(n // 50_000):
        x = rng.standard_normal((50_000, d))
        s = x @ v
        lam = mu * x[:, 0] + a * s
        delta = (act.fn(lam) - act.fn(x[:, 0])) * act.deriv(lam)
        v_new = v[None, :] - eta * a * delta[:, None] * x
        da.append(-delta * s)
        dm.append((v_new[:, 0] / np.linalg.norm(v_new, axis=1) - m) / eta)
    return np.concatenate(da), np.concatenate(dm)


@pytest.mark.parametrize("name,state", [("relu", (0.8, 0.4)), ("erf", (-0.7, 0.6))])
def test_drift_is_the_mean_sgd_step(name, state):
    act = get_activation(name)
    mu, eta, d = 0.4, 2e-3, 200
    da, dm = _sgd_step_increments(act, mu, state, eta, d, 600_000, np.random.default_rng(7))
    flow = pretrained_drift(act, mu, *state, eta=eta, d=d, batch=1)
    bare = pretrained_drift(act, mu, *state)
    for k, sample in enumerate((da, dm)):
        se = sample.std() / math.sqrt(sample.size)
        assert abs(sample.mean() - flow[k]) < 5 * se, (k, sample.mean(), flow[k], se)
    # the renormalisation term is seen: leaving it out would fail
    assert abs(bare[1] - flow[1]) > 8 * dm.std() / math.sqrt(dm.size)


# ---------------------------------------------------------------- loss and flow
def test_loss_closed_form_for_linear():
    mu, a, m = 0.3, np.array([0.0, 0.5, -1.2]), np.array([0.2, 0.9, -0.4])
    expected = 0.5 * ((mu + a * m - 1.0) ** 2 + a * a * (1 - m * m))
    np.testing.assert_allclose(pretrained_loss("linear", mu, a, m), expected, rtol=1e-13)


def test_relu_flow_descends_the_loss_to_the_teacher():
    mu = 0.5
    flow = pretrained_flow("relu", mu, 1e-3, [0.05, -0.05], np.linspace(0.0, 120.0, 13))
    assert isinstance(flow, PretrainedFlow) and flow.a.shape == flow.m.shape == (2, 13)
    for r in range(2):
        loss = pretrained_loss("relu", mu, flow.a[r], flow.m[r])
        assert np.all(np.diff(loss) <= 1e-12) and loss[-1] < 1e-6 < loss[0]
    np.testing.assert_allclose(flow.a[:, -1] * flow.m[:, -1], 1.0 - mu, atol=1e-4)
    np.testing.assert_allclose(flow.overlap[:, -1], 1.0, atol=1e-4)


def test_flow_escapes_at_the_escape_rate():
    mu = 0.5
    tau = escape_time("erf", mu)
    flow = pretrained_flow("erf", mu, np.array([1e-6]), [0.0], [0.0, 2 * tau, 5 * tau])
    a = flow.a[0]
    assert math.log(a[2] / a[1]) / (3 * tau) == pytest.approx(1.0 / tau, rel=1e-5)


# ---------------------------------------------------------------- fast paths vs the reference
GRID = [(mu, a, m) for mu in (0.1, 0.5, 0.9) for a in (0.0, 1e-6, -1e-6, 0.3, -0.7, 1.0, 2.0)
        for m in (0.0, 0.6, -0.6, 0.999999, -1.0, 1.0)]


@pytest.mark.parametrize("name", ["relu", "erf", "linear", "he3", "quadratic"])
def test_fast_moments_match_the_adaptive_reference(name):
    """Closed forms (ReLU, erf) and the vectorised exact rule (polynomials) against the adaptive
    quadrature: loss and drift moments to 1e-9 (the reference's own error; ReLU's ≲ 1e-12)."""
    act = get_activation(name)
    fast = _fast_moments(act)
    tol = 1e-12 if name == "relu" else 1e-9
    for mu in (0.1, 0.5, 0.9):
        a, m = np.array([(g[1], g[2]) for g in GRID if g[0] == mu]).T
        ref = _reference_moments(act, mu, a, m)
        np.testing.assert_allclose(fast(mu, a, m), ref, atol=tol, rtol=1e-13 if tol < 1e-9
                                   else 1e-12)


def test_erf_closed_form_against_one_dimensional_quadrature():
    """At m = ±1 the moments are 1-D integrals in ν: E[δ²] = (4/π)E[(erf cν − erf ν)²e^{−2c²ν²}]
    with c = μ ± a (where the closed form is exact and the 2-D reference is good to ~3e-10)."""
    mu, a = 0.9, 2.0
    for m in (1.0, -1.0):
        c = mu + a * m

        def integrand(x, c=c):
            return ((sp.erf(c * x) - sp.erf(x)) ** 2 * np.exp(-2 * c * c * x * x - x * x / 2)
                    * 4 / math.pi / math.sqrt(2 * math.pi))
        exact = scipy.integrate.quad(integrand, -12.0, 12.0, points=[0.0], epsabs=1e-14,
                                     epsrel=1e-12, limit=200)[0]
        fast = _fast_moments(get_activation("erf"))(mu, np.array([a]), np.array([m]))
        assert fast[2, 0] == pytest.approx(exact, abs=1e-13)


# the smooth rule's checked range: |a| up to 3.6 (√Var λ ≤ 4.55 > its 4.5: the last column
# crosses over to the reference), m at the poles and the corners
SMOOTH_GRID = [(a, m) for a in np.linspace(-3.6, 3.6, 25) for m in
               (0.0, 0.3, -0.6, 0.9, 0.99, 0.999999, -1.0, 1.0)] + [(1e-6, 0.2), (-1e-6, 0.0)]


@pytest.mark.parametrize("name", ["tanh", "sigmoid", "erf"])
def test_smooth_rule_matches_the_adaptive_reference(name):
    """The fixed trapezoid rule in the principal axes against the adaptive plane rule: all
    four moments to 1e-9 (the reference's own error, ~9e-10 for E[δ²] at m = ±1); tanh and
    sigmoid take it as their fast path, erf (a closed form there) is checked for the rule."""
    act = get_activation(name)
    a, m = np.array(SMOOTH_GRID).T
    for mu in (0.05, 0.5, 0.95):
        fast = _smooth_moments(act, mu, a, m)
        np.testing.assert_allclose(fast, _reference_moments(act, mu, a, m), atol=1e-9, rtol=0)
        if name != "erf":
            np.testing.assert_array_equal(_fast_moments(act)(mu, a, m), fast)


def test_smooth_rule_against_the_erf_closed_form():
    """erf through the smooth rule against its closed forms (an independent truth): 1e-11."""
    act = get_activation("erf")
    a, m = np.array(SMOOTH_GRID).T
    for mu in (0.05, 0.5, 0.95):
        np.testing.assert_allclose(_smooth_moments(act, mu, a, m),
                                   _fast_moments(act)(mu, a, m), atol=1e-11, rtol=0)


def test_smooth_rule_beyond_its_range_is_the_reference():
    """States with √Var λ > 4.5 (|a| ≳ 3.5) go to the adaptive reference, state by state."""
    act = get_activation("sigmoid")
    a, m = np.array([5.0, 0.4, -4.2]), np.array([0.3, 0.5, -1.0])
    fast = _fast_moments(act)(0.5, a, m)
    np.testing.assert_allclose(fast[:, [0, 2]], _reference_moments(act, 0.5, a[[0, 2]],
                                                                   m[[0, 2]]),
                               rtol=1e-12, atol=1e-15)  # (E[δs] from the pair moments)
    np.testing.assert_allclose(fast[:, 1], _reference_moments(act, 0.5, a[1:2], m[1:2])[:, 0],
                               atol=1e-9, rtol=0)


@pytest.mark.parametrize("name", ["abs", "tanh(x*2)", "sigmoid(x/2)"])
def test_other_activations_keep_the_adaptive_path(name):
    """Kinked σ and scaled ones (the rule's spacing is not checked for them) stay adaptive."""
    act = get_activation(name)
    assert _fast_moments(act) is None
    loss = pretrained_loss(act, 0.4, np.array([0.3, -0.8]), np.array([0.5, 0.1]))
    ref = _reference_moments(act, 0.4, np.array([0.3, -0.8]), np.array([0.5, 0.1]))[3] / 2
    np.testing.assert_array_equal(loss, ref)


@pytest.mark.parametrize("name", ["relu", "erf"])
def test_fast_flow_matches_the_reference_flow(name):
    """All 8 runs in one system with the closed-form drift vs run by run with the adaptive
    drift (the old path); both carry the renormalisation term."""
    act = get_activation(name)
    mu, times = 0.5, np.linspace(0.0, 25.0, 26)
    m0 = np.random.default_rng(3).uniform(-0.8, 0.8, 8)
    flow = pretrained_flow(name, mu, 0.1, m0, times, eta=0.2, d=1000, batch=500)
    assert np.abs(flow.a[:, -1]).max() > 0.3  # the runs move far from the start
    a, m = _integrate(lambda mu, a, m: _reference_moments(act, mu, a, m), mu,
                      np.stack([np.full(8, 0.1), m0]), times, 0.2 * 998 / 500, joint=False)
    np.testing.assert_allclose(flow.a, a, atol=1e-7)
    np.testing.assert_allclose(flow.m, m, atol=1e-7)


@pytest.mark.parametrize("name", ["tanh", "sigmoid"])
def test_smooth_flow_matches_the_reference_flow(name):
    """All 3 runs in one system with the smooth rule's drift vs run by run with the adaptive
    drift (the old path), with the renormalisation term: 1e-7."""
    act = get_activation(name)
    mu, times = 0.5, np.linspace(0.0, 12.0, 7)
    m0 = np.array([0.5, -0.3, 0.05])
    flow = pretrained_flow(name, mu, 0.5, m0, times, eta=0.2, d=1000, batch=500)
    assert np.abs(flow.a[:, -1] - 0.5).max() > 0.05  # the runs move
    a, m = _integrate(lambda mu, a, m: _reference_moments(act, mu, a, m), mu,
                      np.stack([np.full(3, 0.5), m0]), times, 0.2 * 998 / 500, joint=False)
    np.testing.assert_allclose(flow.a, a, atol=1e-7)
    np.testing.assert_allclose(flow.m, m, atol=1e-7)


# ---------------------------------------------------------------- the He₃ trap
def test_he3_trap():
    b = [escape_coefficients("he3", mu)[0] for mu in (0.2, 0.5)]
    assert b[0] * b[1] < 0
    root = scipy.optimize.brentq(lambda mu: escape_coefficients("he3", mu)[0], 0.2, 0.5,
                                 xtol=1e-12)
    assert round(root, 2) == 0.32
    assert escape_time("he3", root) > 1e12 * escape_time("he3", 0.5)
    taus = escape_time("he3", np.linspace(0.1, 0.9, 17))
    steps = np.sign(np.diff(taus))
    assert np.any(steps > 0) and np.any(steps < 0)  # not monotone


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("call,match", [
    (lambda: escape_time("relu", 0.0), "mu must be in"),
    (lambda: escape_time("relu", 1.0), "mu must be in"),
    (lambda: escape_coefficients("relu", -0.2), "mu must be in"),
    (lambda: pretrained_flow("relu", 1.5, 0.1, [0.0], [1.0]), "mu must be in"),
    (lambda: pretrained_flow("relu", 0.5, np.nan, [0.0], [1.0]), "finite"),
    (lambda: pretrained_flow("relu", 0.5, 0.1, [1.2], [1.0]), r"\|m\|"),
    (lambda: pretrained_flow("relu", 0.5, 0.1, [0.0], [2.0, 1.0]), "times"),
    (lambda: pretrained_drift("relu", 0.5, 0.1, 0.0, eta=0.1), "go together"),
    (lambda: pretrained_loss("relu", 0.5, np.inf, 0.0), "finite"),
])
def test_bad_input_one_line_errors(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- the general setting
def _mixed_linear_tau(mu, rho):
    """Linear σ, mixed base: δ₀ = (1 − μ)(⟨ζ, x⟩ − ν), so E[δ₀ν] = (1 − μ)(ρ − 1),
    E[δ₀z] = β₀ = (1 − μ)ρ̄, c = 1, b² = 2(1 − μ)²(1 − ρ): τ = 2/(√(1 + 8(1−μ)²(1−ρ)) − 1)."""
    return 2.0 / (math.sqrt(1.0 + 8.0 * (1.0 - mu) ** 2 * (1.0 - rho)) - 1.0)


@pytest.mark.parametrize("mu", MUS)
@pytest.mark.parametrize("rho", [0.0, 0.031, -0.2, 0.6])
def test_mixed_linear_escape_time_closed_form(mu, rho):
    setting = Pretraining("linear", mu, rho)
    assert general_escape_time(setting) == pytest.approx(_mixed_linear_tau(mu, rho), rel=1e-8)
    b, c = general_escape_coefficients(setting)
    assert c == pytest.approx(1.0, abs=1e-12)
    assert b * b == pytest.approx(2 * (1 - mu) ** 2 * (1 - rho), rel=1e-10)


@pytest.mark.parametrize("name", ["relu", "erf", "linear", "tanh"])
def test_aligned_setting_is_the_old_flow(name):
    """The general path with y = σ(ν) and the aligned base is :func:`pretrained_drift`'s flow."""
    rng = np.random.default_rng(4)
    a, m = rng.normal(0, 1, 6), rng.uniform(-1, 1, 6)
    setting = Pretraining(name, 0.4, teacher=name)
    np.testing.assert_allclose(general_drift(setting, a, m, eta=0.1, d=50, batch=2),
                               pretrained_drift(name, 0.4, a, m, eta=0.1, d=50, batch=2),
                               rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(general_loss(setting, a, m), pretrained_loss(name, 0.4, a, m),
                               rtol=1e-11, atol=1e-13)
    assert general_escape_time(setting) == escape_time(name, 0.4)


SETTINGS = [("relu", 0.45, 0.1, None, "y"), ("erf", 0.45, -0.05, None, "y"),
            ("tanh", 0.6, 0.2, None, "y"), ("relu", 0.45, None, "erf", "y"),
            ("erf", 0.3, None, "relu", "y"), ("linear", 0.5, None, "he2", "y"),
            ("quadratic", 0.5, None, "linear", "y2"), ("relu", 0.5, None, None, "y2"),
            ("erf", 0.5, 0.1, "tanh", "y2")]


@pytest.mark.parametrize("spec", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_general_escape_rate_is_the_linearised_flow(spec):
    """Central differences of the general flow's right-hand side at a = 0, m = q = 0 (h = 1e-7;
    O(h) at a kink): the largest real eigenvalue is λ₊ of the escape coefficients."""
    setting = Pretraining(*spec)
    dim, h = (3 if setting.mixed else 2), 1e-7
    cols = []
    for e in np.eye(dim) * h:
        plus = np.array(general_drift(setting, *e))
        minus = np.array(general_drift(setting, *(-e)))
        cols.append((plus - minus) / (2 * h))
    jac = np.column_stack(cols)
    assert np.abs(general_drift(setting, *np.zeros(dim))).max() < 1e-12  # a fixed point
    rate = 1.0 / general_escape_time(setting)
    assert np.linalg.eigvals(jac).real.max() == pytest.approx(rate, rel=1e-5)


PAIRS = [(al, be) for al in (0.0, 0.3, -0.8, 1.5) for be in (0.0, 1e-6, 0.5, -1.2, 2.0)]


@pytest.mark.parametrize("name", ["relu", "erf"])
def test_pair_closed_forms_match_the_reference(name):
    """(E[δν], E[δz], E[δ²], E[(σ(λ) − σ(ν))²]) at λ = αν + βz: closed forms against the
    adaptive plane rule."""
    setting = Pretraining(name, 0.5, 0.0)
    fast, joint = _pair_moments(setting)
    assert joint
    al, be = np.array(PAIRS).T
    np.testing.assert_allclose(fast(al, be), _pair_reference(setting.activation, setting.label,
                                                             al, be), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("spec", [("tanh", 0.5, None, "sigmoid", "y"),
                                  ("sigmoid", 0.5, 0.2, None, "y2"),
                                  ("erf", 0.5, None, "tanh", "y2"),
                                  ("tanh", 0.5, None, "he3", "y"),
                                  ("he3", 0.5, None, "tanh", "y")], ids=str)
def test_smooth_pair_rule_matches_the_reference(spec):
    """Kink-free σ and σ* (not both polynomial, not erf's closed form): the smooth rule,
    vectorised, against the adaptive plane rule to 1e-9 (relative 1e-10 for He₃'s large
    moments); a kinked teacher keeps the reference."""
    setting = Pretraining(*spec)
    fast, joint = _pair_moments(setting)
    assert joint
    al, be = np.array(PAIRS + [(3.2, -3.0), (-4.0, 0.5)]).T
    np.testing.assert_allclose(fast(al, be), _pair_reference(setting.activation, setting.label,
                                                             al, be), atol=1e-9, rtol=1e-10)
    assert not _pair_moments(Pretraining(spec[0], 0.5, None, "relu"))[1]


def test_polynomial_pair_rule_matches_the_reference_and_monte_carlo():
    """Quadratic σ with y = ν² (linear σ*, labels y2): the exact Gauss–Hermite rule against the
    adaptive reference (1e-9) and Monte Carlo (5 SE)."""
    setting = Pretraining("quadratic", 0.5, None, "linear", "y2")
    fast, joint = _pair_moments(setting)
    assert joint
    al, be = np.array([0.3, -0.7]), np.array([0.6, 0.2])
    exact = fast(al, be)
    np.testing.assert_allclose(exact, _pair_reference(setting.activation, setting.label, al, be),
                               atol=1e-9, rtol=1e-9)
    rng = np.random.default_rng(2)
    nu, z = rng.standard_normal((2, 1_000_000))
    for i in range(2):
        lam = al[i] * nu + be[i] * z
        gap = lam**2 - nu**2
        delta = gap * 2 * lam
        for k, sample in enumerate((delta * nu, delta * z, delta**2, gap**2)):
            se = sample.std() / math.sqrt(sample.size)
            assert abs(sample.mean() - exact[k, i]) < 5 * se, (i, k)


def test_mixed_drift_is_the_mean_sgd_step():
    """ȧ, ṁ, q̇ of the mixed base (ReLU) against the mean of one exact online SGD step in R^d
    (B = 1, 6·10⁵ examples), renormalisation term with d − 3."""
    act = get_activation("relu")
    mu, eta, d, rho = 0.4, 2e-3, 200, 0.3
    a, m, p = 0.7, 0.3, -0.4
    u, e, w = np.eye(d)[:3]
    zeta = rho * u + math.sqrt(1 - rho * rho) * e
    v = m * u + p * e + math.sqrt(1 - m * m - p * p) * w
    q = float(v @ zeta)
    rng = np.random.default_rng(8)
    incs = []
    for _ in range(12):
        x = rng.standard_normal((50_000, d))
        s = x @ v
        lam = x @ (mu * u + (1 - mu) * zeta) + a * s
        delta = (act.fn(lam) - act.fn(x[:, 0])) * act.deriv(lam)
        v_new = v[None, :] - eta * a * delta[:, None] * x
        v_new /= np.linalg.norm(v_new, axis=1)[:, None]
        incs.append(np.stack([-delta * s, (v_new[:, 0] - m) / eta,
                              (v_new @ zeta - q) / eta]))
    incs = np.concatenate(incs, axis=1)
    flow = general_drift(Pretraining(act, mu, rho), a, m, q, eta=eta, d=d, batch=1)
    for k in range(3):
        se = incs[k].std() / math.sqrt(incs.shape[1])
        assert abs(incs[k].mean() - flow[k]) < 5 * se, (k, incs[k].mean(), flow[k], se)


# (options, σ, η): one case per new option, 64 chain runs at d = 1000, B = 500
FLOW_CASES = [(dict(base="mixed"), "relu", 0.2), (dict(teacher_activation="he2"), "linear", 0.2),
              (dict(teacher_activation="linear", labels="y2"), "quadratic", 0.02)]


@pytest.mark.slow
@pytest.mark.parametrize("case", FLOW_CASES, ids=["mixed", "teacher", "y2"])
def test_flow_follows_the_mean_of_chain_runs(case):
    """The population flow from each run's own start (with its ρ, q₀; renormalisation term)
    against the mean |m| of 64 exact-chain runs: within max(4 SE, 0.03) at every checkpoint,
    and the runs leave the search phase."""
    from dynamics.engines.engine import simulate
    from dynamics.setup.config import RunConfig

    options, act, eta = case
    config = RunConfig(dict(activation=act, k=1, d=1000), learner="pretrained-glm", mu=0.5,
                       eta=eta, batch=500, steps=300, runs=64, checkpoints=13,
                       spacing="linear", engine="reduced", seed=3, **options)
    traj = simulate(config)
    assert traj.engine == "reduced" and (traj.diverged_step == -1).all()
    mean, flow = traj.overlap.mean(0), traj.ode.mean(0)
    se = traj.overlap.std(0, ddof=1) / math.sqrt(traj.overlap.shape[0])
    gap = np.abs(mean - flow)
    assert np.all(gap <= np.maximum(4 * se, 0.03)), (gap, se)
    assert mean[-1] > 5 * mean[0]


@pytest.mark.parametrize("call,match", [
    (lambda: Pretraining("relu", 0.5, labels="y3"), "labels"),
    (lambda: Pretraining("relu", 0.5, rho=1.0), "rho"),
    (lambda: Pretraining("relu", 1.2), "mu must be in"),
    (lambda: Pretraining("nope", 0.5), "unknown activation"),
    (lambda: general_drift(Pretraining("relu", 0.5, 0.1), 0.1, 0.2), "needs q"),
    (lambda: general_drift(Pretraining("relu", 0.5), 0.1, 0.2, 0.3), "only with rho"),
    (lambda: general_loss(Pretraining("relu", 0.5, 0.0), 0.1, 0.9, 0.9), "unit v"),
    (lambda: general_flow(Pretraining("relu", 0.5), 0.1, [0.0], [2.0, 1.0]), "times"),
])
def test_general_bad_input_one_line_errors(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
