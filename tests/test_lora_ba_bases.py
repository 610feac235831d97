"""``lora-ba`` on any pre-trained base and any target (issue 39, item 1;
``dynamics.learners.lora_ba_rows``).

Checked against independent truths: the frame keeps every inner product of the given rows
(Gram of [W; W*]); one full-engine step against torch autograd of the dense model and against
a plain-numpy R^d SGD step written out here (rows as they are: ∂L/∂H = g xᵀ); the general code
path with trivial options against the paper's path; one chain step against the explicit R^d
step on the chain's own draws; the chain's law against the full engine's by two-sample KS tests
(bases with unequal norms from a file and drawn with ρ = 0.5, targets not of the form
W + ξcuᵀ, d = 30 and 300); the exact loss against Monte Carlo; bad input as one-line errors.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import assert_ba_flow_within, ba_chain_step_example, ba_step_inputs, ks_last_two
from scipy.stats import ks_2samp

from dynamics.activations import torch_activation
from dynamics.engines.engine import simulate
from dynamics.errors import ConfigError
from dynamics.learners import Problem, get_learner
from dynamics.learners.lora_ba import LoRABA
from dynamics.learners.lora_ba_rows import ba_rows_of_instances, rows_loss
from dynamics.reduced.lora_ba_chain import LoraBASettings, LoraBAStart
from dynamics.setup.config import RunConfig

F64 = torch.float64
K = 3
SPEC = {"activation": "relu", "k": K, "d": 30, "xi": 1.5, "seed": 2}
KS_P = 1e-3


def _rows_files(tmp_path, d: int, seed: int = 0) -> dict:
    """A base with unequal row norms (0.5, 1, 2) and a target W* = W + a generic rank-k
    perturbation (so W* ≠ W + ξcuᵀ with u ⊥ span W), k×d, in the files' own coordinates."""
    g = np.random.default_rng(seed)
    w = g.standard_normal((K, d))
    w *= (np.array([0.5, 1.0, 2.0]) / np.linalg.norm(w, axis=1))[:, None]
    star = w + 0.7 * g.standard_normal((K, d)) / math.sqrt(d)
    out = {}
    for name, arr in (("base_rows", w), ("target_rows", star)):
        path = tmp_path / f"{name}_{d}_{seed}.npy"
        np.save(path, arr)
        out[name] = str(path)
    return out


def _drawn_target(tmp_path, d: int) -> str:
    """A target for the drawn base (canonical frame, W = [L, 0]): W* = W + a rank-2 update
    with parts inside and outside span W."""
    g = np.random.default_rng(1)
    cfg = _config({}, d=d, base_norms="0.5,1,2", base_corr=0.5)
    w = ba_rows_of_instances(cfg.options, cfg.run_instances()[:1]).w[0]
    full = np.zeros((K, d))
    full[:, :K] = w[:, :K]
    full += 0.6 * g.standard_normal((K, 2)) @ g.standard_normal((2, d)) / math.sqrt(d)
    path = tmp_path / f"drawn_target_{d}.npy"
    np.save(path, full)
    return str(path)


def _config(options: dict, d: int = 30, **kw) -> RunConfig:
    fields = dict(instance=SPEC | {"d": d}, learner="lora-ba", runs=4, eta=0.02, steps=200,
                  checkpoints=4, dtype="float64", finite_d_theory=False) | options | kw
    return RunConfig(**fields)


def _learner(config) -> LoRABA:
    problem = Problem.from_instances(config.run_instances(), torch.device("cpu"), F64)
    return LoRABA.from_config(config, problem)


# ---------------------------------------------------------------------- the frame
def test_frame_keeps_inner_products(tmp_path):
    files = _rows_files(tmp_path, 30)
    w, star = (np.load(files[n]) for n in ("base_rows", "target_rows"))
    for normalize in (False, True):
        cfg = _config(files, normalize_rows=normalize)
        rows = ba_rows_of_instances(cfg.options, cfg.run_instances()[:1])
        assert rows.t == 2 * K  # a generic W* spans k more directions
        both, ref = np.concatenate([rows.w[0], rows.v[0]]), np.concatenate([w, star])
        if normalize:
            ref[K:] /= np.linalg.norm(ref[K:], axis=1, keepdims=True)
        np.testing.assert_allclose(both @ both.T, ref @ ref.T, rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.triu(rows.w[0][:, :K], 1), 0.0, atol=1e-12)
    # a target W + ξcuᵀ-like rank-1 update ⊥ span W adds one direction: t = k + 1
    e = np.linalg.qr(np.concatenate([w, np.eye(30)[:1]]).T)[0][:, K]
    np.save(tmp_path / "rank1.npy", w + np.outer([0.3, -0.2, 0.5], e))
    cfg = _config({"base_rows": files["base_rows"], "target_rows": str(tmp_path / "rank1.npy")})
    assert ba_rows_of_instances(cfg.options, cfg.run_instances()[:1]).t == K + 1
    # the drawn base: Gram diag(n)((1 − ρ)I + ρ11ᵀ)diag(n)
    cfg = _config({}, base_norms="0.5,1,2", base_corr=0.5)
    w = ba_rows_of_instances(cfg.options, cfg.run_instances()[:1]).w[0]
    n = np.array([0.5, 1.0, 2.0])
    np.testing.assert_allclose(w @ w.T, np.outer(n, n) * (0.5 * np.eye(K) + 0.5), atol=1e-14)


# ---------------------------------------------------------------------- one step, exactly
def _dense_rows(learner, d):
    rows = learner.rows
    pad = np.zeros((2, K, d))
    pad[..., : rows.t] = rows.w
    vpad = np.zeros((2, K, d))
    vpad[..., : rows.t] = rows.v
    return pad, vpad


def _numpy_step(w, v, lam, b, a, x, eps, *, scale, eta, lr_ratio, noise_sd, act):
    """Plain SGD on one run with rows as they are: L = (y − Σλⱼσ(⟨hⱼ, x⟩))², H = W + sBA,
    ∂L/∂H = g xᵀ, gⱼ = −2(y − f̂)λⱼσ′(⟨hⱼ, x⟩); ∂B = s(∂L/∂H)Aᵀ, ∂A = sBᵀ(∂L/∂H)."""
    h = w + scale * b @ a
    gb, ga = np.zeros_like(b), np.zeros_like(a)
    for n in range(x.shape[0]):
        y = lam @ act.fn(torch.as_tensor(v @ x[n])).numpy() + noise_sd * eps[n]
        pre = torch.as_tensor(h @ x[n])
        resid = y - lam @ act.fn(pre).numpy()
        g = -2.0 * resid * lam * act.deriv(pre).numpy()
        grad_h = np.outer(g, x[n])
        gb += scale * grad_h @ a.T
        ga += scale * b.T @ grad_h
    m = x.shape[0]
    return b - lr_ratio * eta * gb / m, a - eta * ga / m


@pytest.mark.parametrize("normalize,opts", [
    (False, {"rank": 2, "batch": 3, "alpha": 3.0, "lr_ratio": 2.0, "label_noise": 0.2}),
    (True, {"rank": 2, "batch": 2, "activation": "tanh"}),
    (False, {"rank": 1, "batch": 2, "activation": "tanh", "drawn": True}),
    (False, {"rank": 2, "batch": 2, "default_target": True}),
])
def test_full_step_is_autograd_and_numpy(tmp_path, normalize, opts):
    opts = dict(opts)
    act_name, drawn = opts.pop("activation", "relu"), opts.pop("drawn", False)
    files = ({"base_norms": "0.5,1,2", "base_corr": 0.5,
              "target_rows": _drawn_target(tmp_path, 30)} if drawn
             else _rows_files(tmp_path, 30))
    if opts.pop("default_target", False):  # W* = W + ξcuᵀ on the file's base: t = k + 1
        files.pop("target_rows")
    config = _config(files, normalize_rows=normalize, runs=2, eta=0.05,
                     instance=SPEC | {"activation": act_name}, **opts)
    learner = _learner(config)
    d, r, batch, s = 30, config.options.rank, config.batch, learner.scale
    b0, a0, x, eps, state = ba_step_inputs(learner, (K, r, d, batch), 3)
    xt, et = torch.as_tensor(x, dtype=F64), torch.as_tensor(eps, dtype=F64)
    learner.step_prepared_(state, xt, learner.prepare(state, xt[:, None], et[:, None]), 0)
    w, v = _dense_rows(learner, d)
    lam = learner.rows.lam
    act = torch_activation(config.run_instances()[0].activation)
    # autograd of the dense model (rows divided by their norms where normalised)
    bt = torch.tensor(b0[0], requires_grad=True)
    at = torch.tensor(a0[0], requires_grad=True)
    h = torch.as_tensor(w[0]) + s * bt @ at
    if normalize:
        h = h / h.norm(dim=1, keepdim=True)
    lam_t = torch.as_tensor(lam[0])
    y = act.fn(xt[0] @ torch.as_tensor(v[0]).T) @ lam_t + learner.noise_sd * et[0]
    loss = ((y - act.fn(xt[0] @ h.T) @ lam_t) ** 2).mean()
    gb, ga = torch.autograd.grad(loss, (bt, at))
    eta = config.eta
    np.testing.assert_allclose(state.b[0].numpy(), b0[0] - config.options.lr_ratio * eta
                               * gb.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(state.a[0].numpy(), a0[0] - eta * ga.numpy(), rtol=0, atol=1e-10)
    if not normalize:  # the R^d step written out
        b1, a1 = _numpy_step(w[0], v[0], lam[0], b0[0], a0[0], x[0], eps[0], scale=s,
                             eta=eta, lr_ratio=config.options.lr_ratio,
                             noise_sd=learner.noise_sd, act=act)
        np.testing.assert_allclose(state.b[0].numpy(), b1, rtol=0, atol=1e-10)
        np.testing.assert_allclose(state.a[0].numpy(), a1, rtol=0, atol=1e-10)
    assert np.abs(state.b[0].numpy() - b0[0]).max() > 1e-3


def test_trivial_options_are_the_papers_path():
    """base_norms = 1, ρ = 0 is the orthonormal base of the spec: the general code path
    (explicit teacher rows, frame by QR) gives the paper's path's numbers to round-off."""
    base = _config({}, runs=6, eta=0.05, steps=120, rank=2, batch=2, label_noise=0.1,
                   init_b="gaussian", b_scale=0.2, engine="full")
    ref = simulate(base)
    gen = simulate(replace(base, options=replace(base.options, base_norms="1", base_corr=0.0)))
    np.testing.assert_allclose(gen.overlap, ref.overlap, rtol=0, atol=1e-9)
    np.testing.assert_allclose(gen.loss, ref.loss, rtol=0, atol=1e-9)
    np.testing.assert_allclose(gen.extra["update_overlap"], ref.extra["update_overlap"],
                               rtol=0, atol=1e-9)


def test_exact_loss_is_monte_carlo(tmp_path):
    """rows_loss against a Monte Carlo average of (f* − f̂)² (rows as they are, and
    normalised), at a random (B, A)."""
    files = _rows_files(tmp_path, 30)
    gen = np.random.default_rng(4)
    for normalize in (False, True):
        cfg = _config(files, normalize_rows=normalize, instance=SPEC | {"activation": "erf"})
        rows = ba_rows_of_instances(cfg.options, cfg.run_instances()[:1])
        delta = 0.5 * gen.standard_normal((1, 1, K, rows.t + 2))
        exact = rows_loss(cfg.run_instances()[0].activation, rows, delta)[0, 0]
        h = np.zeros((K, rows.t + 2))
        h[:, : rows.t] = rows.w[0]
        h += delta[0, 0]
        v = np.zeros_like(h)
        v[:, : rows.t] = rows.v[0]
        if normalize:
            h /= np.linalg.norm(h, axis=1, keepdims=True)
        x = gen.standard_normal((400_000, h.shape[1]))
        sig = cfg.run_instances()[0].activation.fn
        diff = (sig(x @ v.T) - sig(x @ h.T)) @ rows.lam[0]
        mc, se = (diff**2).mean(), (diff**2).std() / math.sqrt(x.shape[0])
        assert abs(mc - exact) < 4 * se, (normalize, mc, exact, se)


# ---------------------------------------------------------------------- the chain's step
@pytest.mark.parametrize("normalize,rank,batch,train_a", [
    (False, 1, 1, True), (False, 2, 3, True), (True, 2, 2, True), (False, 2, 2, False)])
def test_chain_step_matches_explicit_rd_step(tmp_path, normalize, rank, batch, train_a):
    files = _rows_files(tmp_path, 30)
    config = _config(files, normalize_rows=normalize, rank=rank, batch=batch, runs=2,
                     label_noise=0.2, train_a=train_a, instance=SPEC | {"activation": "tanh"})
    instances = config.run_instances()
    start = LoraBAStart(config, instances)
    settings = LoraBASettings.from_config(config, instances[0])
    d, t = 30, start.t
    assert t == 2 * K and settings.span == t
    gen = np.random.default_rng(7)
    run = 1
    b0 = 0.4 * gen.standard_normal(start.state["b"][run].shape)
    start.state["b"][run] = b0
    (b1, z1, c1, rss), a0, x, draws = ba_chain_step_example(settings, start, run,
                                                            (d, t, rank, batch), gen)
    w, v = _dense_rows(start.learner, d)
    act = torch_activation(instances[0].activation)
    s = start.learner.scale
    if normalize:  # the full engine's step on the same example
        learner = start.learner
        state = learner.init_state(np.stack([b0] * 2), np.stack([a0] * 2))
        xt = torch.as_tensor(np.stack([x] * 2), dtype=F64)
        eps = torch.as_tensor(np.stack([draws["eps"]] * 2), dtype=F64)
        learner.step_prepared_(state, xt, learner.prepare(state, xt[:, None], eps[:, None]), 0)
        b_ref, a_ref = state.b[0].numpy(), state.a[0].numpy()
    else:  # the R^d step written out
        b_ref, a_ref = _numpy_step(w[0], v[0], start.lam[run], b0, a0, x, draws["eps"],
                                   scale=s, eta=config.eta, lr_ratio=1.0,
                                   noise_sd=math.sqrt(0.2), act=act)
        if not train_a:
            a_ref = a0
    np.testing.assert_allclose(b1, b_ref, rtol=0, atol=1e-10)
    np.testing.assert_allclose(z1, a_ref[:, :t], rtol=0, atol=1e-10)
    np.testing.assert_allclose(c1 @ c1.T, a_ref[:, t:] @ a_ref[:, t:].T, rtol=0, atol=1e-10)
    assert math.isfinite(rss) and np.abs(b1 - b0).max() > 1e-3


# ---------------------------------------------------------------------- the law
def _ks(config) -> dict:
    full = simulate(replace(config, engine="full"))
    red = get_learner("lora-ba").exact_chain().simulate(replace(config, engine="reduced",
                                                                seed=11))
    return ks_last_two(full, red, ("overlap", "loss", "b_norm"))


LAW_CASES = {
    "d30-file-raw-r1-b1": dict(d=30, rank=1, runs=600, eta=0.02, steps=300),
    "d30-drawn-raw-r2-b2": dict(d=30, drawn=True, rank=2, batch=2, runs=600, eta=0.02,
                                steps=300, init_b="gaussian", b_scale=0.1),
    "d30-file-unit-r2-b1": dict(d=30, rank=2, normalize_rows=True, runs=1000, eta=0.05,
                                steps=300),
    "d300-file-raw-r1-b4": dict(d=300, rank=1, batch=4, runs=300, eta=0.005, steps=400),
    "d300-drawn-raw-r2-b1": dict(d=300, drawn=True, rank=2, runs=300, eta=0.003, steps=400,
                                 init_b="gaussian", b_scale=0.1),
    "d30-drawn-default-target-raw-r1-b2": dict(d=30, drawn=True, default_target=True, rank=1,
                                               batch=2, runs=600, eta=0.02, steps=300),
}


@pytest.mark.parametrize("case", list(LAW_CASES))
def test_law_matches_full_engine(tmp_path, case):
    kw = dict(LAW_CASES[case])
    d, drawn = kw.pop("d"), kw.pop("drawn", False)
    files = ({"base_norms": "0.5,1,2", "base_corr": 0.5,
              "target_rows": _drawn_target(tmp_path, d)} if drawn else _rows_files(tmp_path, d))
    if kw.pop("default_target", False):  # W* = W + ξcuᵀ on the drawn base (u ⊥ span W)
        files.pop("target_rows")
    kw.setdefault("normalize_rows", False)
    ps = _ks(_config(files, d=d, checkpoints=3, spacing="linear", **kw))
    assert min(ps.values()) > KS_P, ps


# ---------------------------------------------------------------------- bad input
def test_bad_input_is_one_line_config_error(tmp_path):
    files = _rows_files(tmp_path, 30)
    lora = get_learner("lora-ba")

    def problem(options, spec=SPEC):
        cfg = _config(options, instance=spec)
        with pytest.raises(ConfigError) as info:
            lora.check(cfg, cfg.run_instances()[0])
        msg = str(info.value)
        assert "\n" not in msg
        return msg

    np.save(tmp_path / "short.npy", np.ones((K, 29)))
    assert "k×d = 3×30" in problem({"base_rows": str(tmp_path / "short.npy")})
    zero = np.load(files["base_rows"])
    zero[1] = 0.0
    np.save(tmp_path / "zero.npy", zero)
    assert "row 1 is zero" in problem({"base_rows": str(tmp_path / "zero.npy")})
    lora.check(_config({"base_rows": str(tmp_path / "zero.npy"), "normalize_rows": False}),
               _config({}).run_instances()[0])  # rows as they are: a zero row is fine
    assert "(−1/(k − 1), 1)" in problem({"base_corr": -0.5})
    assert "(−1/(k − 1), 1)" in problem({"base_corr": 1.0})
    assert "> 0" in problem({"base_norms": "1,-2,1"})
    assert "1 or k = 3" in problem({"base_norms": "1,2"})
    assert "not both" in problem({"base_rows": files["base_rows"], "base_norms": "1"})
    np.save(tmp_path / "wide.npy", np.ones((K + 1, 30)))
    assert "base's shape" in problem({"target_rows": str(tmp_path / "wide.npy")})
    assert "no such file" in problem({"target_rows": str(tmp_path / "missing.npy")})
    assert "≤ d = 30" in problem({"rank": 31})


def test_help_shows_the_options():
    from dynamics.learners.options import option_names

    names = option_names(LoRABA.Options)
    for name in ("base_rows", "base_norms", "base_corr", "target_rows", "normalize_rows"):
        assert name in names


def test_law_test_rejects_a_wrong_wishart_dof(tmp_path):
    """Negative control: the rest's Wishart dof 18 instead of d − t − r = 23 (d = 30, t = 6)."""
    config = _config(_rows_files(tmp_path, 30), rank=1, runs=600, eta=0.02, steps=300,
                     checkpoints=3, spacing="linear", normalize_rows=False)
    full = simulate(replace(config, engine="full"))
    red = get_learner("lora-ba").exact_chain().simulate(replace(config, engine="reduced",
                                                                seed=11), _chi2_dof=18)
    p = ks_2samp(full.extra["a_norm"][:, -1], red.extra["a_norm"][:, -1]).pvalue
    assert p < 1e-6, p


# ---------------------------------------------------------------------- the population flow
@pytest.mark.parametrize("activation,normalize", [("relu", False), ("erf", False),
                                                  ("relu", True)])
def test_flow_gradient_is_the_loss_derivative(tmp_path, activation, normalize):
    """hermite's ∂F/∂H (Stein's (S) for rows as they are) against central differences of
    hermite's F, and hermite's F against the engine's exact loss (dynamics' pair integrals)."""
    from hermite.flows.lora_ba import BARowsGeometry, row_gradient
    from hermite.flows.lora_ba import rows_loss as flow_loss

    cfg = _config(_rows_files(tmp_path, 30), normalize_rows=normalize,
                  instance=SPEC | {"activation": activation})
    inst = cfg.run_instances()[0]
    rows = ba_rows_of_instances(cfg.options, [inst])
    geo = BARowsGeometry(inst.activation, rows.lam[0], rows.w[0], rows.v[0], normalize)
    delta = 0.4 * np.random.default_rng(0).standard_normal((1, 2, K, rows.t + 2))
    np.testing.assert_allclose(flow_loss(geo, delta), rows_loss(inst.activation, rows, delta),
                               rtol=0, atol=1e-12)
    h = np.zeros((K, rows.t + 2))
    h[:, : rows.t] = rows.w[0]
    h += delta[0, 0]
    fd = np.zeros_like(h)
    for j, q in np.ndindex(*h.shape):
        step = np.zeros_like(h)
        step[j, q] = 1e-6
        fd[j, q] = (flow_loss(geo, delta[0, 0] + step) - flow_loss(geo, delta[0, 0] - step)) / 2e-6
    np.testing.assert_allclose(row_gradient(geo, h), fd, rtol=0, atol=1e-8)


FLOW_CASES = {  # (activation, drawn base, rows normalised, τ); η·d = 0.1, d = 300, rank 2
    "relu-file-raw": ("relu", False, False, 10.0),
    "erf-drawn-raw": ("erf", True, False, 20.0),
    "relu-file-unit": ("relu", False, True, 10.0),
}


@pytest.mark.parametrize("case", list(FLOW_CASES))
def test_flow_follows_the_chain_mean(tmp_path, case):
    """The population flow from each run's own (B₀, A₀) against 256 exact-chain runs: the
    mean over runs of (chain − flow) within max(4 SE, 0.03) at every checkpoint, for the
    overlap, the exact loss and update_overlap, while the loss falls by a third or more."""
    activation, drawn, normalize, tau = FLOW_CASES[case]
    d = 300
    files = ({"base_norms": "0.5,1,2", "base_corr": 0.5,
              "target_rows": _drawn_target(tmp_path, d)} if drawn else _rows_files(tmp_path, d))
    eta = 0.1 / d
    cfg = _config(files, d=d, rank=2, runs=256, eta=eta, steps=int(round(tau / eta)),
                  checkpoints=5, spacing="linear", normalize_rows=normalize, engine="reduced",
                  instance=SPEC | {"d": d, "activation": activation})
    tr = simulate(cfg)
    assert tr.engine == "reduced"
    assert np.nanmean(tr.loss[:, -1]) < 0.67 * np.nanmean(tr.loss[:, 0])
    assert_ba_flow_within(tr, case)


def test_sweep_cell_hash_covers_the_files_content(tmp_path):
    """A sweep cell's hash changes with the rows files' content, not only their paths; the
    default options keep the cell hash of a config without them."""
    from sims.experiments.sweep_spec import cell_hash

    files = _rows_files(tmp_path, 30)
    cfg = _config(files)
    before = cell_hash(cfg)
    np.save(files["target_rows"], np.load(files["target_rows"]) * 1.01)
    assert cell_hash(cfg) != before
    plain = _config({})
    explicit = replace(plain, options=replace(plain.options, normalize_rows=True,
                                              base_rows=None))
    assert cell_hash(explicit) == cell_hash(plain)
