"""``lora-ba`` with a separate teacher σ* (``teacher_activation``) and squared labels (``labels``
y2; issue 39). Checked against independent truths: one full-engine step against a plain numpy
R^d step (the paper's teacher and given rows, normalised and as they are) and autograd; one
chain step against the explicit R^d step (``test_lora_ba_chain``'s check with these options);
the chain's law against the full engine's by two-sample KS tests (d = 30 and 300), with a
negative control; the cross-kernel loss against Monte Carlo and its gradient against central
differences; the population flow with σ* against the mean of 256 chain runs; the refused flow of
y2 on rows as they are (NaN, ``no_theory``) and Monte Carlo loss (y2's flow and exact loss:
``test_lora_ba_squared``); the defaults unchanged; bad input.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import test_lora_ba_chain as chain_tests
import torch
from helpers import assert_ba_flow_within, ba_step_inputs, dense_rows
from test_lora_ba_chain import KS_P, _config, _ks

from dynamics.engines.engine import simulate
from dynamics.errors import ConfigError
from dynamics.learners import Problem, get_learner
from dynamics.learners.lora_ba import LoRABA, monte_carlo_loss
from dynamics.setup.config import RunConfig

F64 = torch.float64
SPEC = {"activation": "relu", "k": 3, "d": 14, "xi": 1.3, "c": "gaussian", "c_hat": "gaussian",
        "lam": "random_sign", "W": "separated", "u_alpha": 0.4, "seed": 3}
ERF_D = 2.0 / math.sqrt(math.pi)
NP_SIGMA = {  # σ, σ′ written out here (loradyn's he2 is He₂/√2)
    "relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(float)),
    "tanh": (np.tanh, lambda z: 1.0 - np.tanh(z) ** 2),
    "erf": (np.vectorize(math.erf), lambda z: ERF_D * np.exp(-z * z)),
    "he2": (lambda z: (z * z - 1.0) / math.sqrt(2.0), lambda z: 2.0 * z / math.sqrt(2.0))}


def _learner(config) -> LoRABA:
    problem = Problem.from_instances(config.run_instances(), torch.device("cpu"), F64)
    return LoRABA.from_config(config, problem)


def _numpy_step(geo, b, a, x, eps, o: dict):
    """One SGD step of one run in R^d, written out: rows H = W + sBA (divided by their norms
    where ``o["normalize"]``), y = (Σλσ*(⟨vᵢ, x⟩))^{1 or 2} + √noise·ε, L = mean (y − f̂)²."""
    w, v, lam = geo
    sig, dsig = NP_SIGMA[o["act"]]
    scale, normalize, eta = o["scale"], o["normalize"], o["eta"]
    h = w + scale * b @ a
    n = np.linalg.norm(h, axis=1) if normalize else np.ones(len(h))
    pre = x @ h.T / n
    fstar = NP_SIGMA[o["teacher"]][0](x @ v.T) @ lam
    y = (fstar**2 if o["squared"] else fstar) + o["noise_sd"] * eps
    delta = -2.0 * (y - sig(pre) @ lam)[:, None] * lam * dsig(pre)  # ∂L/∂aⱼ per example
    grad_h = (delta / n).T @ x / len(x)
    if normalize:  # the normalisation's part: −δⱼaⱼhⱼ/Nⱼ²
        grad_h -= ((delta * pre).mean(0) / n**2)[:, None] * h
    return b - o["ratio"] * eta * scale * grad_h @ a.T, a - eta * scale * b.T @ grad_h


STEP_CASES = [("relu", "tanh", "y", {}), ("erf", "he2", "y2", {}), ("relu", None, "y2", {}),
              ("tanh", "relu", "y2", {"base_norms": "0.5,1,2", "base_corr": 0.3}),
              ("relu", "erf", "y2", {"base_norms": "0.5,1,2", "normalize_rows": False})]


@pytest.mark.parametrize("act,teacher,labels,rows", STEP_CASES,
                         ids=lambda c: str(c) if not isinstance(c, dict) else "rows" * bool(c))
def test_full_step_is_the_numpy_step_and_autograd(act, teacher, labels, rows):
    """The learner's step (paper's teacher, or given rows in their frame) = the numpy R^d
    step to 1e-10; its per-example gradients = autograd of its per-example loss."""
    rank, batch, eta, ratio, alpha, noise = 2, 3, 0.05, 1.5, 3.0, 0.3
    config = RunConfig(instance=SPEC | {"activation": act}, learner="lora-ba", runs=2,
                       eta=eta, rank=rank, alpha=alpha, lr_ratio=ratio, batch=batch,
                       label_noise=noise, teacher_activation=teacher, labels=labels,
                       dtype="float64", **rows)
    learner = _learner(config)
    inst, d, k = config.run_instances()[0], SPEC["d"], SPEC["k"]
    if learner.rows is None:
        w, v, _ = dense_rows(inst)
    else:
        w, v = (np.pad(m[0], ((0, 0), (0, d - learner.rows.t))) for m in
                (learner.rows.w, learner.rows.v))
    b0, a0, x, eps, state = ba_step_inputs(learner, (k, rank, d, batch), 4)
    xt, et = torch.as_tensor(x), torch.as_tensor(eps)
    new = learner.step(state, xt, et)
    opts = dict(act=act, teacher=teacher or act, squared=labels == "y2",
                normalize=rows.get("normalize_rows", True), noise_sd=math.sqrt(noise),
                eta=eta, scale=alpha / rank, ratio=ratio)
    for r in range(2):
        b1, a1 = _numpy_step((w, v, np.asarray(inst.lam, float)), b0[r], a0[r], x[r], eps[r],
                             opts)
        np.testing.assert_allclose(new.b[r].numpy(), b1, rtol=0, atol=1e-10)
        np.testing.assert_allclose(new.a[r].numpy(), a1, rtol=0, atol=1e-10)
        assert np.abs(b1 - b0[r]).max() > 1e-4 and np.abs(a1 - a0[r]).max() > 1e-4
    gb, ga, _ = learner.sample_gradients(state, xt, et)
    bt = state.b.clone().requires_grad_(True)
    at = state.a.clone().requires_grad_(True)
    loss = learner.sample_loss(type(state)(bt, at, 0), xt, et)
    ab, aa = torch.autograd.grad(loss.sum(), [bt, at])
    np.testing.assert_allclose(gb.sum(1).numpy(), ab.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(ga.sum(1).numpy(), aa.numpy(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("options", [{"teacher_activation": "relu"},
                                     {"teacher_activation": "he2", "labels": "y2"},
                                     {"labels": "y2"}], ids=str)
def test_chain_step_is_the_explicit_rd_step(options):
    """``test_lora_ba_chain``'s check (σ = tanh, rank 2, b = 4, LoRA+, label noise) with σ*
    and y²: one chain step against the learner's R^d step on the same example, to 1e-10."""
    chain_tests.test_step_matches_explicit_rd_step(2, 4, {"init_b": "gaussian", "b_scale": 0.3,
                                              "lr_ratio": 2.5, "alpha": 3.0} | options)


LAW_CASES = {
    "d30-relu-tanh-y": dict(teacher_activation="tanh", rank=1, runs=600),
    "d300-relu-tanh-y": dict(instance={"activation": "relu", "k": 3, "d": 300, "xi": 1.5,
                                       "seed": 2}, teacher_activation="tanh", rank=1, batch=4,
                             eta=0.3, steps=300, init_b="gaussian", b_scale=0.1, runs=400),
    "d30-erf-he2-y2": dict(instance={"activation": "erf", "k": 3, "d": 30, "xi": 1.5,
                                     "seed": 2}, teacher_activation="he2", labels="y2",
                           rank=2, eta=0.02, runs=600),
    "d300-relu-relu-y2": dict(instance={"activation": "relu", "k": 3, "d": 300, "xi": 1.5,
                                        "seed": 2}, labels="y2", rank=1, batch=2, eta=0.05,
                              steps=300, init_b="gaussian", b_scale=0.1, label_noise=0.2,
                              runs=400),
}


@pytest.mark.parametrize("case", list(LAW_CASES))
def test_chain_law_is_the_full_engines(case):
    ps = _ks(_config(**LAW_CASES[case]))
    assert min(ps.values()) > KS_P, ps


def test_law_test_tells_the_labels_apart():
    """Negative control: the chain with labels y against the full engine with y² (σ* = he2,
    σ = erf, d = 30) is rejected by the same KS test."""
    from scipy.stats import ks_2samp

    full = simulate(_config(**LAW_CASES["d30-erf-he2-y2"], engine="full"))
    red = get_learner("lora-ba").exact_chain().simulate(
        _config(**(LAW_CASES["d30-erf-he2-y2"] | {"labels": "y"}), engine="reduced", seed=11))

    assert ks_2samp(full.extra["b_norm"][:, -1], red.extra["b_norm"][:, -1]).pvalue < 1e-6


# ---------------------------------------------------------------------- loss and flow
def _dense_mc(inst, teacher, squared, delta, n=400_000, seed=1):
    """(mean, SE) of (y − f̂)² over n examples in R^d (rows (wⱼ + Δⱼ)/‖·‖, the paper's V)."""
    w, v, _ = dense_rows(inst)
    h = w + delta
    h /= np.linalg.norm(h, axis=1, keepdims=True)
    x = np.random.default_rng(seed).standard_normal((n, inst.d))
    lam = np.asarray(inst.lam, float)
    fstar = NP_SIGMA[teacher][0](x @ v.T) @ lam
    y = fstar**2 if squared else fstar
    err = (y - NP_SIGMA[inst.activation.name][0](x @ h.T) @ lam) ** 2
    return err.mean(), err.std() / math.sqrt(n)


@pytest.mark.parametrize("act,teacher,labels", [("relu", "tanh", "y"), ("erf", "relu", "y"),
                                                ("relu", "he2", "y2")])
def test_loss_is_monte_carlo(act, teacher, labels):
    """The learner's loss (exact: with the cross kernel for y, ``lora_ba_squared`` for y2)
    against an independent R^d Monte Carlo of 4·10⁵ examples, within 5 SE."""
    config = RunConfig(instance=SPEC | {"activation": act}, learner="lora-ba", runs=1,
                       teacher_activation=teacher, labels=labels)
    learner, inst = _learner(config), config.run_instances()[0]
    delta = 0.5 * np.random.default_rng(2).standard_normal((1, 1, SPEC["k"], SPEC["d"]))
    loss, kind = learner.loss([inst], delta)
    want, se = _dense_mc(inst, teacher, labels == "y2", delta[0, 0])
    assert kind == "exact"
    assert abs(loss[0, 0] - want) < 5 * se, (loss, want, se)


@pytest.mark.parametrize("act,teacher", [("relu", "tanh"), ("erf", "relu"), ("tanh", "he2")])
def test_flow_gradient_is_the_cross_loss_derivative(act, teacher):
    """∂F/∂H with K×′ (the teacher's sum) against central differences of F with K×: the
    pair quadratures of σ*′σ′ and of σ*σ agree through Price's theorem."""
    from hermite.flows.lora_ba import row_gradient, rows_loss, teacher_geometry

    inst = RunConfig(instance=SPEC | {"activation": act}, learner="lora-ba").run_instances()[0]
    geo = teacher_geometry(inst, teacher)
    k, width = SPEC["k"], SPEC["k"] + 3
    delta = 0.4 * np.random.default_rng(0).standard_normal((k, width))
    h = np.pad(geo.w, ((0, 0), (0, width - geo.w.shape[1]))) + delta
    fd = np.zeros_like(h)
    for j, q in np.ndindex(*h.shape):
        step = np.zeros_like(h)
        step[j, q] = 1e-6
        fd[j, q] = (rows_loss(geo, delta + step) - rows_loss(geo, delta - step)) / 2e-6
    np.testing.assert_allclose(row_gradient(geo, h), fd, rtol=0, atol=1e-7)


# (σ, σ*, rows options, τ); η·d = 0.02, d = 300, rank 2. σ* ≠ σ: the teacher is not
# realisable, the SGD noise keeps an O(η·d) excess over the flow (measured at η·d = 0.1: mean
# update_overlap gaps 0.033 (relu-tanh) and 0.077 (erf-relu), 4-5× those at η·d = 0.02)
FLOW_CASES = {
    "relu-tanh-paper": ("relu", "tanh", {}, 10.0),
    "erf-relu-drawn": ("erf", "relu", {"base_norms": "0.5,1,2", "base_corr": 0.5}, 10.0),
}


@pytest.mark.parametrize("case", list(FLOW_CASES))
def test_flow_follows_the_chain_mean(case):
    """The population flow with σ* ≠ σ from each run's own (B₀, A₀) against 256 exact-chain
    runs: mean over runs of (chain − flow) within max(4 SE, 0.03) at every checkpoint, for
    the overlap, the exact loss and update_overlap, while the loss falls by a fifth or more."""
    act, teacher, rows, tau = FLOW_CASES[case]
    d = 300
    eta = 0.02 / d
    cfg = RunConfig(instance={**SPEC, "d": d, "activation": act}, learner="lora-ba",
                    rank=2, runs=256, eta=eta, steps=int(round(tau / eta)), checkpoints=5,
                    spacing="linear", engine="reduced", teacher_activation=teacher,
                    finite_d_theory=False, **rows)
    tr = simulate(cfg)
    assert tr.engine == "reduced" and tr.loss_kind == "exact"
    assert np.nanmean(tr.loss[:, -1]) < 0.8 * np.nanmean(tr.loss[:, 0])
    assert_ba_flow_within(tr, case)


@pytest.mark.parametrize("options", [{"labels": "y2", "normalize_rows": False,
                                      "teacher_activation": "tanh"},
                                     {"labels": "y2", "normalize_rows": False,
                                      "base_norms": "1"}], ids=str)
def test_no_flow_is_nan_with_its_reason(options):
    """Where no flow applies (y² on rows as they are; σ* ≠ σ there has one:
    ``test_lora_ba_raw_teacher``) the theory lines are NaN with a ``no_theory`` attribute, and
    the loss is the fixed-set Monte Carlo."""
    cfg = RunConfig(instance=SPEC, learner="lora-ba", runs=2, steps=20, eta=0.05,
                    engine="full", **options)
    tr = simulate(cfg)
    assert np.isnan(tr.ode).all() and np.isnan(tr.extra["ode_loss"]).all()
    assert "no population flow" in tr.extra_attrs["ode"]["no_theory"]
    assert tr.loss_kind == "monte_carlo" and np.isfinite(tr.loss).all()


def test_monte_carlo_loss_is_the_exact_loss_where_both_apply():
    """The fixed-set Monte Carlo (2¹⁴ points) against the exact dual-kernel loss (σ* = σ)."""
    inst = RunConfig(instance=SPEC, learner="lora-ba").run_instances()[0]
    from hermite.flows.linearized import true_network_loss

    delta = 0.5 * np.random.default_rng(3).standard_normal((4, SPEC["k"], SPEC["k"] + 3))
    mc = monte_carlo_loss(inst, None, False, delta)
    np.testing.assert_allclose(mc, true_network_loss(inst, delta), rtol=0.03)


# ---------------------------------------------------------------------- defaults, bad input
def test_explicit_defaults_are_the_defaults():
    """σ* = σ and labels = y given explicitly: the same numbers, bit for bit (full engine and
    chain), the same flow."""
    kw = dict(instance={**SPEC, "activation": "erf", "d": 30}, learner="lora-ba", rank=2,
              runs=3, eta=0.05, batch=2, steps=60, checkpoints=3, label_noise=0.1,
              finite_d_theory=False)
    for engine in ("full", "reduced"):
        plain = simulate(RunConfig(engine=engine, **kw))
        told = simulate(RunConfig(engine=engine, teacher_activation="erf", labels="y", **kw))
        np.testing.assert_array_equal(plain.overlap, told.overlap)
        np.testing.assert_array_equal(plain.loss, told.loss)
        np.testing.assert_array_equal(plain.extra["b_norm"], told.extra["b_norm"])
        np.testing.assert_allclose(plain.ode, told.ode, rtol=0, atol=1e-9)
        assert told.loss_kind == "exact"


@pytest.mark.parametrize("kw, name", [(dict(labels="y3"), "labels"),
                                      (dict(teacher_activation="nope"), "teacher_activation")])
def test_bad_options_are_one_line_errors_naming_them(kw, name):
    with pytest.raises(ConfigError, match=f"'{name}'") as err:
        RunConfig(instance=SPEC, learner="lora-ba", **kw)
    assert "\n" not in str(err.value)
