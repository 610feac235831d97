"""Theory of ``lora-ba`` at finite η·d (issue 39): the SGD noise of A's rest Gram and the escape
from B = 0 (``hermite.flows.lora_ba``'s corrected flow, ``hermite.flows.lora_ba_escape``).

Independent truths: E[ggᵀ] against plain Monte Carlo in R^D; the rest Hessian M against finite
differences of the exact loss; the escape rate against a finite-difference Jacobian of the
population flow; the corrected flow against the population flow as η·d → 0; the drawn
``ode_corrected`` and the predicted median steps against the exact chain.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import excursion_hessian, saddle_jacobian

from dynamics.instances.instance import build_instance
from dynamics.learners import get_learner
from dynamics.learners.lora_ba import update_observables
from dynamics.setup.config import RunConfig
from hermite.flows.linearized import true_network_loss
from hermite.flows.lora_ba import (
    BANoise,
    corrected_flow,
    gradient_covariance,
    lora_ba_flow,
    rest_noise,
)
from hermite.flows.lora_ba_escape import escape_mode, escape_time, rest_hessian, saddle_matrix

SPEC = {"activation": "relu", "k": 4, "xi": 2.0, "W": "separated", "c": "gaussian",
        "c_hat": "gaussian", "seed": 0}  # docs/theory/lora-practice.md's setting


def _inst(d=1000, **kw):
    return build_instance(SPEC | {"d": d} | kw)


def _state(inst, rank, seed=3, b_scale=0.5):
    gen = np.random.default_rng(seed)
    k = inst.k
    b = b_scale * gen.standard_normal((2, k, rank))
    a = gen.standard_normal((2, rank, k + 1 + rank)) / math.sqrt(k + 1 + rank)
    return b, a


@pytest.mark.parametrize("label_noise", [0.0, 0.3])
def test_gradient_covariance_against_monte_carlo(label_noise):
    """E[ggᵀ] (QMC + Price) = the plain Monte Carlo mean of g gᵀ over 4·10⁵ fresh Gaussian x
    (and label noise), within 5 SE entrywise."""
    inst = _inst(activation="tanh")
    b, a = _state(inst, 2)
    noise = BANoise(0.001, 1000, label_noise=label_noise, samples=2**14)
    want = gradient_covariance(inst, b, a, 1.3, noise)
    from hermite.flows.linearized import _geometry

    geo = _geometry(inst)
    width = a.shape[-1]
    w = np.zeros((inst.k, width))
    w[:, : inst.k + 1] = geo.w
    v = np.zeros_like(w)
    v[:, : inst.k + 1] = geo.v
    gen = np.random.default_rng(11)
    n = 400_000
    x = gen.standard_normal((n, width))
    eps = math.sqrt(label_noise) * gen.standard_normal(n)
    for i in range(2):
        h = w + 1.3 * b[i] @ a[i]
        nrm = np.linalg.norm(h, axis=-1)
        pre = x @ (h / nrm[:, None]).T
        resid = np.tanh(x @ v.T) @ geo.lam + eps - np.tanh(pre) @ geo.lam
        g = -2.0 * resid[:, None] * geo.lam * (1 - np.tanh(pre) ** 2) / nrm
        prod = g[:, :, None] * g[:, None, :]
        mean, se = prod.mean(0), prod.std(0) / math.sqrt(n)
        assert (np.abs(want[i] - mean) <= 5 * se + 1e-4).all(), (want[i], mean, se)


def test_rest_noise_is_eta_s2_n_over_b_times_the_moment():
    """(N): η s² (d − k − 1 − r)/b · Bᵀ E[ggᵀ] B, linear in η and 1/b."""
    inst = _inst()
    b, a = _state(inst, 2)
    one = rest_noise(inst, b, a, 0.7, BANoise(0.002, 1000, batch=1))
    four = rest_noise(inst, b, a, 0.7, BANoise(0.004, 1000, batch=4))
    np.testing.assert_allclose(four, one / 2, rtol=1e-12)
    cov = gradient_covariance(inst, b, a, 0.7, BANoise(0.002, 1000))
    want = 0.002 * 0.49 * (1000 - 5 - 2) * np.swapaxes(b, -1, -2) @ cov @ b
    np.testing.assert_allclose(one, want, rtol=1e-12)


@pytest.mark.parametrize("rank", [1, 2])
def test_corrected_flow_tends_to_the_population_flow(rank):
    """As η·d → 0 the corrected flow (in (B, Z, S)) is today's flow (in (B, A_red)); at η·d =
    0.5 it is not, and its gap shrinks in proportion to η·d."""
    inst = _inst()
    b, a = _state(inst, rank, b_scale=0.3)
    times = np.linspace(0.0, 6.0, 13)
    plain = lora_ba_flow(inst, b, a, times, lr_ratio=1.5)
    overlap = update_observables([inst] * 2, plain.b, plain.a, 1.0)[0]
    gaps, loss_gaps = [], []
    for eta_d in (1e-7, 0.005, 0.01, 0.5):
        out = corrected_flow(inst, b, a, times, BANoise(eta_d / 1000, 1000), lr_ratio=1.5)
        gaps.append(np.abs(update_observables([inst] * 2, out.b, out.a, 1.0)[0] - overlap).max())
        loss_gaps.append(np.abs(out.loss - plain.loss).max())
        if eta_d < 1e-6:
            np.testing.assert_allclose(out.b, plain.b, atol=2e-4)
            np.testing.assert_allclose(out.loss, plain.loss, atol=2e-4)
    assert gaps[0] < 2e-4 and gaps[3] > 0.01, gaps
    assert abs(loss_gaps[2] / loss_gaps[1] - 2.0) < 0.3, loss_gaps  # O(η·d) at small η·d


def test_rest_hessian_is_the_second_derivative_of_the_exact_loss():
    """M (eq. (M)) = the finite-difference Hessian of the exact loss in the rows' excursions
    εⱼ out of span(W, u) (rows wⱼ + εⱼe, e ⊥ span)."""
    inst = _inst(activation="tanh", xi=1.0, lam="random_sign")
    k = inst.k
    num = excursion_hessian(lambda delta: true_network_loss(inst, delta), k, k + 2, 1e-3)
    np.testing.assert_allclose(rest_hessian(inst), num, atol=2e-5)


@pytest.mark.parametrize("scale,ratio,rest", [(1.0, 1.0, 1.0), (0.7, 3.0, 0.6)])
def test_escape_rate_is_the_flow_linearised_by_finite_differences(scale, ratio, rest):
    """L (eq. (L1)) = the central-difference Jacobian of the population flow at B = 0, Z = 0
    (rank 1, A's rest √rest); λ₊ its largest eigenvalue."""
    inst = _inst()
    k, t = inst.k, inst.k + 1
    jac = saddle_jacobian(inst, (k, t), scale, ratio, rest)
    mat = saddle_matrix(inst, scale=scale, lr_ratio=ratio, rest=rest)
    np.testing.assert_allclose(mat, jac, atol=1e-6)
    rate = escape_mode(inst, scale=scale, lr_ratio=ratio, rest=rest).rate
    assert rate == pytest.approx(np.linalg.eigvals(jac).real.max(), abs=1e-6)
    g = np.linalg.svd(mat[:k, k:], compute_uv=False)[0] / (ratio * scale)
    assert 0 < rate < scale * math.sqrt(ratio) * g  # the normalisation's M damps the escape


def test_predicted_steps_match_the_chain_median_at_d_1000():
    """Eq. (T) at d = 10³, η·d = 0.5 = the median first passage to overlap 0.9 of 32 exact-chain
    runs (rank 1, B₀ = 0) within 15 %."""
    d, eta_d = 1000, 0.5
    cfg = RunConfig(instance=SPEC | {"d": d}, learner="lora-ba", eta=eta_d / d, steps=80 * d,
                    runs=32, seed=1, engine="reduced", rank=1,
                    finite_d_theory=False).validate()
    hit = get_learner("lora-ba").exact_chain().first_passages(cfg, [0.9])[0]
    assert np.isfinite(hit).all()
    want = escape_time(_inst(d), BANoise(eta_d / d, d)).steps
    assert abs(want / np.median(hit) - 1) < 0.15, (want, np.median(hit))


@pytest.mark.slow
@pytest.mark.parametrize("d,eta_d", [(100, 0.5), (100, 0.1), (1000, 0.5), (1000, 0.1)])
def test_corrected_line_follows_the_chain_mean(d, eta_d):
    """``ode_corrected`` (drawn by the learner: the corrected flow, mean over B's kick) = the
    mean overlap of 64 exact-chain runs (B₀ = 0, rank 1) within max(4 SE, 0.03) at every
    checkpoint over τ ≤ 20, and, where today's ``ode`` is off by more than 0.02, its largest gap
    at most 0.6 of that."""
    cfg = RunConfig(instance=SPEC | {"d": d}, learner="lora-ba", eta=eta_d / d,
                    steps=int(20 * d / eta_d), runs=64, seed=1, engine="reduced", rank=1,
                    checkpoints=21, spacing="linear").validate()
    from dynamics.engines.engine import simulate

    traj = simulate(cfg)
    assert (traj.diverged_step == -1).all()
    x = np.nan_to_num(traj.overlap[:, 1:])
    gaps = {}
    for name in ("ode", "ode_corrected"):
        diff = x - np.nan_to_num(getattr(traj, name)[:, 1:])
        mean, se = diff.mean(0), diff.std(0, ddof=1) / math.sqrt(cfg.runs)
        gaps[name] = (np.abs(mean).max(), (np.abs(mean) <= np.maximum(4 * se, 0.03)).all())
    assert gaps["ode_corrected"][1], gaps
    if gaps["ode"][0] > 0.02:  # where today's flow is off, the corrected line is closer
        assert gaps["ode_corrected"][0] <= 0.6 * gaps["ode"][0], gaps
