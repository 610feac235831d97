"""The linear-noise band of fine-tuning with ĉ trained jointly (hermite.finetune.band): the
step's moments against closed forms and an explicit R^d step under autograd, the band against
1024 runs of the exact chain, and its records beside a run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from chain_runs import joint_chain_runs

from dynamics.activations import torch_activation
from dynamics.engines.engine import simulate
from dynamics.instances.instance import build_instance
from dynamics.setup.config import RunConfig
from hermite.finetune.band import StepMoments, joint_band, joint_band_applies
from hermite.finetune.population import FinetuneModel, SecondMoment
from hermite.flows.regime import FinetuneRegime, FinetuneStart

SPEC = dict(k=3, xi=1.0, c="gaussian", c_hat="gaussian", u_alpha=0.4, seed=2)


def _model(act, d, eta_d=1.0, eta_c_ratio=0.7):
    inst = build_instance(dict(SPEC, activation=act, d=d))
    return inst, FinetuneModel(inst, eta_d / d, project=True, joint_c=True,
                               eta_c=eta_c_ratio * eta_d / d)


@pytest.mark.parametrize("act", ["relu", "tanh", "erf", "he3", "tanh(x*2)"])
def test_step_mean_is_the_drift_and_the_compiled_moments_equal_numpy(act):
    """The mean exact increment of ĉ is the closed-form population drift (|z| < 5); that of
    μ is the corrected drift (O(η) + O(η²d)) up to O(η²); compiled = numpy to 1e-12
    (tanh(2x): no compiled code, numpy only). Not for He₃ at this d: its heavy-tailed
    gradient makes the higher orders of the normalisation count (d = 400, η·d = 1: exact mean
    −0.010, corrected drift −0.090; η·d = 0.1: 0.0012 against 0.0021), which is why the band
    is checked against SGD on ReLU only."""
    d = 400
    inst, model = _model(act, d)
    sm = StepMoments(model, d, label_noise=0.05)
    mu = np.array([0.35, -0.6])
    ch = np.stack([inst.c_hat, 0.5 * inst.c_hat + inst.c])
    inc = sm.increments(mu, ch)  # (R, N, 1 + k), numpy
    mean, cov = sm(mu, ch)
    if sm.code is not None:
        sm.code, (mean_np, cov_np) = None, sm(mu, ch)
        np.testing.assert_allclose(mean, mean_np, rtol=1e-12, atol=1e-18)
        np.testing.assert_allclose(cov, cov_np, rtol=1e-10, atol=1e-20)
    se = inc.std(axis=1) / math.sqrt(inc.shape[1])
    _, dmu, dc = model.drift(np.zeros((2, 3)), mu, ch)
    assert np.abs((mean[:, 1:] - dc) / se[:, 1:]).max() < 5
    coef = SecondMoment(model, d, 1, 0.05)(np.zeros((2, 3)), mu, ch)
    corrected = dmu - 0.5 * model.eta**2 * coef * mu
    if act == "he3":
        return
    assert np.abs(mean[:, 0] - corrected).max() < 5 * se[:, 0].max() + 20 * model.eta**2
    assert np.abs(mean[:, 0] - dmu).max() > 2 * np.abs(mean[:, 0] - corrected).max()


def _explicit_steps(inst, model, mu, ch, n, seed, noise_sd):
    """n independent exact steps of (μ, ĉ) in R^d with explicit vectors and autograd: the
    frame x = (z ∈ span W, a along e, b along ê, rest), W = [L, 0], u = (u_w, u⊥, 0, …)."""
    d, k, xi = inst.d, inst.k, inst.xi
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    W = torch.zeros(k, d, dtype=dt)
    W[:, :k] = torch.as_tensor(inst.w_factor)
    u = torch.zeros(d, dtype=dt)
    u[:k], u[k] = torch.as_tensor(inst.u_w), inst.u_perp
    uh = torch.zeros(d, dtype=dt)
    uh[k], uh[k + 1] = mu, math.sqrt(1 - mu * mu)
    lam, c = torch.as_tensor(inst.lam), torch.as_tensor(inst.c)
    act = torch_activation(inst.activation)
    x = torch.randn(n, d, generator=g, dtype=dt)
    rows = W + xi * c[:, None] * u
    y = act(x @ (rows / rows.norm(dim=1, keepdim=True)).T) @ lam
    y = y + noise_sd * torch.randn(n, generator=g, dtype=dt)
    U = uh.repeat(n, 1).requires_grad_()
    C = torch.as_tensor(ch).repeat(n, 1).requires_grad_()
    srows = W[None] + xi * C[:, :, None] * U[:, None, :]  # (n, k, d)
    pre = torch.einsum("nkd,nd->nk", srows, x) / srows.norm(dim=2)
    loss = ((y - act(pre) @ lam) ** 2).sum()
    gu, gc = torch.autograd.grad(loss, (U, C))
    gu[:, :k] = 0.0  # projected on span(W)^⊥
    gt = gu - (gu @ uh)[:, None] * uh
    new = uh - model.eta * gt
    new = new / new.norm(dim=1, keepdim=True)
    dmu = (new[:, k] - mu).numpy()
    return np.concatenate([dmu[:, None], (-model.eta_c * gc).numpy()], axis=1)


@pytest.mark.parametrize("act", ["relu", "tanh"])
def test_step_covariance_against_an_explicit_step_under_autograd(act):
    """Cov(Δμ, Δĉ) of the reduced formulas against 160k explicit R^d steps (d = 30, η·d = 1,
    so the normalisation's fluctuation is of the same order as the gradient noise): every
    entry within 5 of its Monte Carlo standard errors."""
    d = 30
    inst, model = _model(act, d)
    mu, ch = -0.45, inst.c_hat + 0.3 * inst.c
    mean, cov = StepMoments(model, d, label_noise=0.04, points=2**15)(np.array([mu]), ch[None])
    inc = np.concatenate([_explicit_steps(inst, model, mu, ch, 40_000, s, 0.2)
                          for s in range(4)])
    dev = inc - inc.mean(axis=0)
    prod = dev[:, :, None] * dev[:, None, :]
    z = (cov[0] - prod.mean(axis=0)) / (prod.std(axis=0) / math.sqrt(len(inc)))
    assert np.abs(z).max() < 5, np.abs(z).max()
    zm = (mean[0] - inc.mean(axis=0)) / (inc.std(axis=0) / math.sqrt(len(inc)))
    assert np.abs(zm).max() < 5


def test_band_against_1024_exact_chain_runs():
    """ReLU, k = 4, d = 1000, η·d = 1, aligned start, joint ĉ: the band's 10–90 % width is
    within 10 % of that of 1024 exact-chain runs at every checkpoint, for ⟨û, u⟩ and for
    cos(ĉ, c), its edges within 0.5 sd of the empirical quantiles (measured: widths 0.94–1.05,
    edges ≤ 0.34 sd), and without the step noise the band would be far too narrow."""
    steps, m, cos, inst, m0, eta = joint_chain_runs("relu", 1000, 4, 1.0)
    band = joint_band(inst, FinetuneRegime(eta, joint_c=True, d=inst.d), steps,
                      FinetuneStart(mu0=m0 / inst.u_perp, c_hat0=inst.c_hat))
    for x, lo, hi in ((m, band.lower, band.upper), (cos, band.c_lower, band.c_upper)):
        q = np.quantile(x, [0.1, 0.9], axis=0)
        sd = x.std(axis=0)
        ratio = (hi - lo)[1:] / (q[1] - q[0])[1:]
        assert 0.9 < ratio.min() and ratio.max() < 1.1, ratio
        edge = np.maximum(np.abs(lo - q[0]), np.abs(hi - q[1]))[1:] / sd[1:]
        assert edge.max() < 0.5, edge
    paths = inst.u_perp * band.means[:, -1, 0]  # the start nodes' corrected paths alone
    q = np.quantile(m[:, -1], [0.1, 0.9])
    assert np.ptp(paths) < 0.5 * (q[1] - q[0])


def test_band_is_recorded_beside_a_joint_run_and_drawn(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sims.plots.curves import Curve, draw_panel

    spec = dict(activation="relu", k=3, d=300, xi=1.0, c="gaussian", c_hat="gaussian", seed=1)
    cfg = RunConfig(instance=spec, eta=0.5 / 300, steps=1200, runs=8, seed=3, checkpoints=5,
                    engine="reduced", joint_c=True, init="aligned")
    tr = simulate(cfg)
    assert np.isfinite(tr.band_lower).all() and np.all(tr.band_lower <= tr.band_upper)
    assert np.all(tr.extra["band_c_lower"] <= tr.extra["band_c_upper"])
    assert "linear-noise band" in tr.extra_attrs["band_c_lower"]["note"]
    inst = tr.instances[0]
    direct = joint_band(inst, FinetuneRegime(cfg.eta, joint_c=True, d=300), tr.steps,
                        FinetuneStart(mu0=tr.m0 / inst.u_perp, c_hat0=inst.c_hat))
    np.testing.assert_allclose(tr.band_upper[0], direct.upper, rtol=1e-12)
    for quantity in ("overlap", "c_overlap"):
        fig, ax = plt.subplots()
        assert "band" in draw_panel(ax, [Curve(tr, {})], quantity=quantity)[1]
        plt.close(fig)
    unprojected = simulate(RunConfig(instance=spec, eta=0.5 / 300, steps=200, runs=2,
                                     checkpoints=3, joint_c=True, project=False))
    assert unprojected.band_lower is None and unprojected.ode_corrected is not None


def test_band_where_not_derived_is_a_one_line_error():
    inst, model = _model("relu", 100)
    free = FinetuneModel(inst, 0.01, project=False, joint_c=True)
    assert "projected" in joint_band_applies(free)
    with pytest.raises(ValueError, match="projected û only"):
        joint_band(inst, FinetuneRegime(0.01, joint_c=True, d=100), [0, 10],
                   FinetuneStart(mu0=np.zeros(2), c_hat0=inst.c_hat), model=free)
    with pytest.raises(ValueError, match="b = 1 only"):
        if why := joint_band_applies(model, batch=4):
            raise ValueError(why)


def test_band_over_its_budget_is_skipped_with_a_note():
    """Each group of runs (distinct instance) pays ≈ 0.01 s of Python per RK4 step: 64
    per-run instances over 300 steps at η·d = 1 (38 RK4 steps each) are over 20 s."""
    from dynamics.overlays.finetune import _joint_band_plan

    spec = dict(activation="relu", k=8, d=200, xi=1.0, seed=3)
    cfg = RunConfig(instance=spec, eta=1.0 / 200, steps=300, runs=64, joint_c=True,
                    instance_seeds="per_run").validate()
    band, why = _joint_band_plan(cfg, cfg.run_instances(), np.array([0, 300]))
    assert band is None and "joint linear-noise band not recorded" in why
    one = RunConfig(**(cfg.to_dict() | {"instance_seeds": "shared"})).validate()
    band, why = _joint_band_plan(one, one.run_instances(), np.array([0, 300]))
    assert set(band) == {"band_lower", "band_upper", "band_c_lower", "band_c_upper"}
