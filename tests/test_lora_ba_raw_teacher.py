"""``lora-ba`` with rows as they are (``normalize_rows`` off) and a teacher σ* ≠ σ (issue 39):
the cross pair integrals I2×, J2×, P2× (``hermite.committee.cross``), the exact loss and the
population flow they give (``hermite.flows.lora_ba``, Stein's (S×)).

Checked against independent truths: the integrals against Monte Carlo (10⁶ points, 5 SE),
against 1-D quadratures of Stein's lemma where σ or σ* is linear or ReLU against an odd
activation, against erf(x)/erf(x/√2)'s closed forms, and against ``CommitteeIntegrals`` where
σ* = σ; (S×) itself against Monte Carlo; the learner's exact loss against a numpy R^d Monte
Carlo (4·10⁵ examples); ∂F/∂H against central differences of F; the flow against the mean of
256 exact-chain runs; the formerly refused case now drawn.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.special
import torch

from dynamics.engines.engine import simulate
from dynamics.learners import Problem
from dynamics.learners.lora_ba import LoRABA
from dynamics.setup.config import RunConfig
from hermite.committee import CommitteeIntegrals, scaled_erf
from hermite.committee.cross import CrossIntegrals

F64 = torch.float64
SPEC = {"activation": "relu", "k": 3, "d": 14, "xi": 1.3, "c": "gaussian", "c_hat": "gaussian",
        "lam": "random_sign", "W": "separated", "u_alpha": 0.4, "seed": 3}
ROWS = {"normalize_rows": False, "base_norms": "0.5,1,2", "base_corr": 0.3}
SQRT_PI = math.sqrt(math.pi)
NP = {  # σ, σ′, σ″ written out here
    "relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(float), None),
    "tanh": (np.tanh, lambda z: 1.0 - np.tanh(z) ** 2,
             lambda z: -2.0 * np.tanh(z) * (1.0 - np.tanh(z) ** 2)),
    "erf": (scipy.special.erf, lambda z: 2.0 / SQRT_PI * np.exp(-z * z),
            lambda z: -4.0 * z / SQRT_PI * np.exp(-z * z)),
    "sigmoid": (scipy.special.expit, lambda z: scipy.special.expit(z) *
                (1.0 - scipy.special.expit(z)), None),
    "linear": (lambda z: z, np.ones_like, np.zeros_like)}
# covariances of (a, b) = (student's field, teacher's): unequal variances, ρ = 0.3, −0.9, 0.99
COVS = np.array([[[0.7, 0.4], [0.4, 2.5]], [[1.0, -0.9], [-0.9, 1.0]],
                 [[4.0, 0.99], [0.99, 0.25]]])


def _monte_carlo(student, teacher, cov, n=1_000_000, seed=0):
    """(mean, SE) (3,) of σ(a)σ*(b), σ′(a)σ*′(b), aσ′(a)σ*(b) over n draws of N(0, cov)."""
    z = np.random.default_rng(seed).standard_normal((n, 2)) @ np.linalg.cholesky(cov).T
    a, b = z[:, 0], z[:, 1]
    (s, ds, _), (t, dt, _) = NP[student], NP[teacher]
    vals = np.stack([s(a) * t(b), ds(a) * dt(b), a * ds(a) * t(b)])
    return vals.mean(1), vals.std(1) / math.sqrt(n)


@pytest.mark.parametrize("student,teacher", [("relu", "tanh"), ("tanh", "relu"),
                                             ("erf", "relu"), ("sigmoid", "erf"),
                                             ("tanh", "erf")])
def test_cross_integrals_are_monte_carlo(student, teacher):
    """I2×, J2×, P2× at three covariances against 10⁶-point Monte Carlo, within 5 SE."""
    ci = CrossIntegrals(student, teacher)
    ours = np.stack([ci.i2(COVS), ci.j2(COVS), ci.p2(COVS)], 1)  # (3 covs, 3 integrals)
    for c, cov in enumerate(COVS):
        mean, se = _monte_carlo(student, teacher, cov, seed=c)
        assert (np.abs(ours[c] - mean) < 5 * se).all(), (c, ours[c], mean, se)


def _gauss(f, var):
    """E[f(x)], x ~ N(0, var), by adaptive 1-D quadrature."""
    sd = math.sqrt(var)
    return scipy.integrate.quad(lambda z: f(sd * z) * math.exp(-0.5 * z * z), -40, 40,
                                epsabs=1e-14, epsrel=1e-13, limit=400)[0] / math.sqrt(2 * math.pi)


def _stein_truth(student, teacher, cov):
    """(I2×, J2×, P2×) by Stein's lemma on one side, 1-D quadratures: a linear σ* (E[σ(a)b] =
    C_ab E[σ′(a)]), or a ReLU against an odd σ (relu = (x + |x|)/2, the |x| half vanishing by
    symmetry: I2× = ½C_ab E[σ′], J2× = ½E[σ′], P2× = ½C_ab E[σ′ + xσ″] or I2× for a ReLU a)."""
    caa, cab, cbb = cov[0, 0], cov[0, 1], cov[1, 1]
    if student == "relu":  # σ* odd
        e1 = _gauss(NP[teacher][1], cbb)
        return 0.5 * cab * e1, 0.5 * e1, 0.5 * cab * e1
    if teacher == "linear":
        e1 = _gauss(NP[student][1], caa)
        return cab * e1, e1, cab * (e1 + _gauss(lambda x: x * NP[student][2](x), caa))
    e1 = _gauss(NP[student][1], caa)  # σ odd, σ* = relu
    e2 = _gauss(lambda x: x * NP[student][2](x), caa)
    return 0.5 * cab * e1, 0.5 * e1, 0.5 * cab * (e1 + e2)


@pytest.mark.parametrize("student,teacher", [("relu", "tanh"), ("tanh", "relu"),
                                             ("erf", "relu"), ("relu", "erf"),
                                             ("tanh", "linear"), ("relu", "linear"),
                                             ("linear", "relu")])
def test_cross_integrals_are_stein_closed_forms(student, teacher):
    """Against Stein's lemma with 1-D quadratures (:func:`_stein_truth`), to 1e-8."""
    ci = CrossIntegrals(student, teacher)
    for cov in COVS:
        ours = [ci.i2(cov), ci.j2(cov), ci.p2(cov)]
        np.testing.assert_allclose(ours, _stein_truth(student, teacher, cov), rtol=0, atol=1e-8)


def test_erf_pair_of_two_scales_is_its_closed_form():
    """σ = erf(x), σ* = erf(x/√2): I2× = (2/π) arcsin(2c₁c₂C_ab/√(D_a D_b)), D = 1 + 2c²C,
    J2× = (4c₁c₂/π)/√(D_a D_b − 4c₁²c₂²C_ab²), P2× = d/dt I2× at a → ta, t = 1 (central
    differences of the closed form)."""
    c1, c2 = 1.0, 1.0 / math.sqrt(2.0)

    def i2(cov, t=1.0):
        da, db = 1 + 2 * c1**2 * t * t * cov[0, 0], 1 + 2 * c2**2 * cov[1, 1]
        return 2 / math.pi * math.asin(2 * c1 * c2 * t * cov[0, 1] / math.sqrt(da * db))

    ci = CrossIntegrals("erf", scaled_erf())
    h = 1e-4
    for cov in COVS:
        da, db = 1 + 2 * c1**2 * cov[0, 0], 1 + 2 * c2**2 * cov[1, 1]
        j2 = 4 * c1 * c2 / math.pi / math.sqrt(da * db - 4 * c1**2 * c2**2 * cov[0, 1] ** 2)
        p2 = (8 * (i2(cov, 1 + h) - i2(cov, 1 - h)) - (i2(cov, 1 + 2 * h) - i2(cov, 1 - 2 * h))) \
            / (12 * h)
        np.testing.assert_allclose([ci.i2(cov), ci.j2(cov), ci.p2(cov)], [i2(cov), j2, p2],
                                   rtol=0, atol=1e-9)


@pytest.mark.parametrize("act", ["relu", "abs", "erf", "tanh", "sigmoid"])
def test_equal_activations_are_the_committee_integrals(act):
    """σ* = σ: ``CommitteeIntegrals``' numbers, bit for bit; the cross quadrature path
    (method ``quadrature``) against ``CommitteeIntegrals``' closed forms (ReLU, abs, erf) to
    1e-8."""
    ref = CommitteeIntegrals(act)
    same, quad = CrossIntegrals(act, act), CrossIntegrals(act, act, "quadrature")
    for name in ("i2", "j2", "p2"):
        want = getattr(ref, name)(COVS)
        np.testing.assert_array_equal(getattr(same, name)(COVS), want)
        if ref.closed(name):
            np.testing.assert_allclose(getattr(quad, name)(COVS), want, rtol=0, atol=1e-8)


@pytest.mark.parametrize("student,teacher", [("relu", "tanh"), ("tanh", "relu"),
                                             ("erf", "relu")])
def test_stein_identity_is_monte_carlo(student, teacher):
    """(S×) E[σ′(⟨h, x⟩)σ*(⟨g, x⟩) x] = h(P2× − ⟨h, g⟩J2×)/‖h‖² + g J2× (the flow's
    ``_stein_sum``) against 10⁶-point Monte Carlo in R⁴, every coordinate within 5 SE."""
    from hermite.flows.lora_ba import _stein_sum

    gen = np.random.default_rng(7)
    h, g = gen.standard_normal((1, 4)), gen.standard_normal((1, 4))
    h *= 1.5 / np.linalg.norm(h)
    g *= 0.8 / np.linalg.norm(g)
    ours = _stein_sum(CrossIntegrals(student, teacher), h, g, np.ones(1))[0]
    x = gen.standard_normal((1_000_000, 4))
    vals = (NP[student][1](x @ h[0]) * NP[teacher][0](x @ g[0]))[:, None] * x
    mean, se = vals.mean(0), vals.std(0) / math.sqrt(len(x))
    assert (np.abs(ours - mean) < 5 * se).all(), (ours, mean, se)


# ---------------------------------------------------------------------- loss and gradient
def _learner(config) -> LoRABA:
    problem = Problem.from_instances(config.run_instances(), torch.device("cpu"), F64)
    return LoRABA.from_config(config, problem)


LOSS_CASES = [("relu", "tanh"), ("tanh", "relu"), ("erf", "relu")]


@pytest.mark.parametrize("act,teacher", LOSS_CASES)
def test_loss_is_monte_carlo(act, teacher):
    """The learner's loss (kind exact) at rows W + Δ of a drawn base (norms 0.5, 1, 2, ρ =
    0.3) against a numpy R^d Monte Carlo of 4·10⁵ examples, within 5 SE."""
    config = RunConfig(instance=SPEC | {"activation": act}, learner="lora-ba", runs=1,
                       teacher_activation=teacher, **ROWS)
    learner, inst = _learner(config), config.run_instances()[0]
    d, rows = SPEC["d"], learner.rows
    w, v = (np.pad(m[0], ((0, 0), (0, d - rows.t))) for m in (rows.w, rows.v))
    delta = 0.5 * np.random.default_rng(2).standard_normal((1, 1, SPEC["k"], d))
    loss, kind = learner.loss([inst], delta)
    x = np.random.default_rng(1).standard_normal((400_000, d))
    lam = rows.lam[0]
    err = (NP[teacher][0](x @ v.T) @ lam - NP[act][0](x @ (w + delta[0, 0]).T) @ lam) ** 2
    want, se = err.mean(), err.std() / math.sqrt(len(x))
    assert kind == "exact"
    assert abs(loss[0, 0] - want) < 5 * se, (loss, want, se)


@pytest.mark.parametrize("act,teacher", LOSS_CASES)
def test_gradient_is_the_loss_derivative(act, teacher):
    """∂F/∂H of rows as they are with σ* (Stein's (S×) and (S)) against central differences
    of F (I₂×, I₂*, I₂), max error ≤ 1e-5 of the gradient's largest entry (rows of norms
    0.66, 1.69, 1.49)."""
    from hermite.flows.lora_ba import BARowsGeometry, row_gradient, rows_loss

    config = RunConfig(instance=SPEC | {"activation": act}, learner="lora-ba", runs=1,
                       teacher_activation=teacher, **ROWS)
    rows = _learner(config).rows
    geo = BARowsGeometry(act, rows.lam[0], rows.w[0], rows.v[0], False, teacher)
    width = rows.t + 2
    delta = 0.4 * np.random.default_rng(0).standard_normal((SPEC["k"], width))
    h = np.pad(rows.w[0], ((0, 0), (0, 2))) + delta
    fd = np.zeros_like(h)
    for j, q in np.ndindex(*h.shape):
        step = np.zeros_like(h)
        step[j, q] = 1e-5
        fd[j, q] = (rows_loss(geo, delta + step) - rows_loss(geo, delta - step)) / 2e-5
    grad = row_gradient(geo, h)
    assert np.abs(grad - fd).max() <= 1e-5 * np.abs(fd).max(), np.abs(grad - fd).max()


def test_formerly_refused_case_has_a_flow_and_exact_loss():
    """σ* ≠ σ on rows as they are (the case once refused): finite flow lines with their note,
    loss kind exact, through the engine."""
    cfg = RunConfig(instance=SPEC, learner="lora-ba", runs=2, steps=20, eta=0.05,
                    engine="full", teacher_activation="tanh", normalize_rows=False,
                    base_norms="1")
    tr = simulate(cfg)
    assert np.isfinite(tr.ode[:, 1:]).all() and np.isfinite(tr.extra["ode_loss"]).all()
    assert "no_theory" not in tr.extra_attrs["ode"] and tr.loss_kind == "exact"
    np.testing.assert_allclose(tr.extra["ode_loss"][:, 0], tr.loss[:, 0], rtol=1e-12)


# ---------------------------------------------------------------------- the flow
# (σ, σ*, rank, d, η·d, τ); base norms 0.5, 1, 2, ρ = 0.3, the default target, 256 runs
FLOW_CASES = {
    "relu-tanh-r1": ("relu", "tanh", 1, 50, 0.01, 6.0),
    "erf-relu-r2": ("erf", "relu", 2, 50, 0.005, 6.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FLOW_CASES))
def test_flow_follows_the_chain_mean(case):
    """The population flow from each run's own (B₀, A₀) against 256 exact-chain runs (the
    reduced engine): the mean over runs of (chain − flow) at every checkpoint within
    max(4 SE, 0.03) for the overlap and update_overlap, max(4 SE, 3 % of the flow's loss) for
    the exact loss, while the loss falls by a third or more."""
    act, teacher, rank, d, eta_d, tau = FLOW_CASES[case]
    eta = eta_d / d
    cfg = RunConfig(instance={**SPEC, "d": d, "activation": act}, learner="lora-ba",
                    rank=rank, runs=256, eta=eta, steps=int(round(tau / eta)), checkpoints=5,
                    spacing="linear", engine="reduced", teacher_activation=teacher,
                    finite_d_theory=False, **ROWS)
    tr = simulate(cfg)
    assert tr.engine == "reduced" and tr.loss_kind == "exact"
    assert np.mean(tr.loss[:, -1]) < 0.67 * np.mean(tr.loss[:, 0])
    for x, y, floor in ((tr.overlap, tr.ode, 0.03),
                        (tr.loss, tr.extra["ode_loss"], 0.03 * tr.extra["ode_loss"].mean(0)),
                        (tr.extra["update_overlap"], tr.extra["ode_update_overlap"], 0.03)):
        diff = (x - y)[:, 1:]
        assert np.isfinite(diff).all()
        mean, se = diff.mean(0), diff.std(0, ddof=1) / np.sqrt(diff.shape[0])
        tol = np.maximum(4 * se, floor if np.ndim(floor) == 0 else floor[1:])
        assert (np.abs(mean) <= tol).all(), (case, mean, se)


def test_closed_method_without_a_closed_form_is_refused():
    """``method="closed"`` where σ* ≠ σ: a one-line ValueError naming both activations."""
    with pytest.raises(ValueError, match="'relu' and 'tanh'") as err:
        CrossIntegrals("relu", "tanh", "closed").j2(COVS)
    assert "\n" not in str(err.value)
