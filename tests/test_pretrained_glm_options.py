"""The ``pretrained-glm`` options of issue 39's second round: the mixed base w₀ = μu + (1 − μ)ζ
(``base``), a separate teacher σ* (``teacher_activation``) and squared labels (``labels`` y2).
One full-engine step against a plain numpy R^d step and torch autograd, ζ's stream and
records, the defaults unchanged, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import pretrained_setup

from dynamics.engines.engine import simulate
from dynamics.errors import ConfigError
from dynamics.learners.pretrained_glm import base_directions
from dynamics.randomness.sampling import run_seed
from dynamics.setup.config import RunConfig

F64 = torch.float64
R, D, K = 3, 9, 2
# σ, σ′ written out here (loradyn's he3 is He₃/√6)
NP_SIGMA = {"relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(float)),
            "tanh": (np.tanh, lambda z: 1.0 - np.tanh(z) ** 2),
            "erf": (lambda z: np.vectorize(math.erf)(z),
                    lambda z: 2.0 / math.sqrt(math.pi) * np.exp(-z * z)),
            "he3": (lambda z: (z**3 - 3 * z) / math.sqrt(6),
                    lambda z: (3 * z**2 - 3) / math.sqrt(6))}
TORCH_SIGMA = {"relu": torch.relu, "tanh": torch.tanh, "erf": torch.erf,
               "he3": lambda z: (z**3 - 3 * z) / math.sqrt(6)}
# (student σ, teacher σ* or None, labels, mixed base)
CASES = [("relu", None, "y", True), ("tanh", "relu", "y", False), ("relu", None, "y2", False),
         ("erf", "he3", "y2", True)]


def _setup(case, batch, noise, mu=0.6, eta=0.3):
    """(learner, dense u, ζ or None, state, x, eps or None): ``tests.helpers.pretrained_setup``."""
    return pretrained_setup(case, batch, noise, mu, eta, shape=(R, D, K))


def _numpy_step(case, w0, u, a, v, x, eps, eta, noise):
    """One run's step written out in R^d: y = σ*(⟨u, x⟩) (squared for y2) + noise,
    ŷ = σ(⟨w₀ + av, x⟩), the gradients of ½·mean(y − ŷ)², the renormalised update."""
    act, teacher, labels, _ = case
    sig, dsig = NP_SIGMA[act]
    tsig = NP_SIGMA[teacher or act][0]
    y = tsig(x @ u) ** (2 if labels == "y2" else 1)
    y = y + (math.sqrt(noise) * eps if eps is not None else 0.0)
    lam = x @ (w0 + a * v)
    delta = (sig(lam) - y) * dsig(lam)
    grad_a = np.mean(delta * (x @ v))
    grad_v = a * np.mean(delta[:, None] * x, axis=0)
    v_new = v - eta * grad_v
    return a - eta * grad_a, v_new / np.linalg.norm(v_new), grad_a, grad_v


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("batch,noise", [(1, 0.0), (5, 0.3)])
def test_one_step_is_the_explicit_step_and_autograd(case, batch, noise):
    mu, eta = 0.6, 0.3
    learner, u, zeta, state, x, eps = _setup(case, batch, noise, mu, eta)
    new = learner.step(state, x, eps)
    grads_a, grads_v, loss = learner.sample_gradients(state, x, eps)
    act, teacher, labels, _ = case
    for r in range(R):
        w0 = mu * u + ((1 - mu) * zeta[r] if zeta is not None else 0.0)
        a, v = float(state.a[r]), state.v[r].numpy()
        e = None if eps is None else eps[r].numpy()
        a1, v1, ga, gv = _numpy_step(case, w0, u, a, v, x[r].numpy(), e, eta, noise)
        assert abs(float(new.a[r]) - a1) < 1e-10
        np.testing.assert_allclose(new.v[r].numpy(), v1, rtol=0, atol=1e-10)
        assert abs(float(grads_a[r].mean()) - ga) < 1e-10
        np.testing.assert_allclose(grads_v[r].mean(0).numpy(), gv, rtol=0, atol=1e-10)
        # autograd of ½·mean(y − ŷ)², the model written here in torch
        ta = torch.tensor(a, dtype=F64, requires_grad=True)
        tv = torch.as_tensor(v).clone().requires_grad_(True)
        tx = x[r]
        y = TORCH_SIGMA[teacher or act](tx @ torch.as_tensor(u)) ** (2 if labels == "y2" else 1)
        y = y + (math.sqrt(noise) * eps[r] if noise else 0.0)
        per_example = 0.5 * (y - TORCH_SIGMA[act](tx @ (torch.as_tensor(w0) + ta * tv))) ** 2
        per_example.mean().backward()
        assert abs(float(ta.grad) - ga) < 1e-10
        np.testing.assert_allclose(tv.grad.numpy(), gv, rtol=0, atol=1e-10)
        np.testing.assert_allclose(loss[r].numpy(), per_example.detach().numpy(), rtol=1e-12)
    assert bool((new.a != state.a).any()) and bool((new.v != state.v).any())


def test_zeta_stream_and_records():
    """ζ of run r is the unit normal vector of stream (seed, r, base) alone; the mixed base
    records q = ⟨v, ζ⟩ and ρ = ⟨ζ, u⟩ (constant), the aligned base neither."""
    zeta = base_directions(5, 4, 50)
    np.testing.assert_allclose(np.linalg.norm(zeta, axis=1), 1.0, atol=1e-14)
    g = np.random.default_rng(run_seed(5, 2, "base")).standard_normal(50)
    np.testing.assert_array_equal(zeta[2], g / np.linalg.norm(g))
    np.testing.assert_array_equal(base_directions(5, 2, 50), zeta[:2])
    kw = dict(learner="pretrained-glm", eta=0.2, batch=4, steps=20, runs=4, checkpoints=3,
              mu=0.5, engine="full", seed=5)
    config = RunConfig(dict(activation="relu", k=1, d=50), base="mixed", **kw)
    mixed = simulate(config)
    rho = mixed.extra["rho"]
    assert np.all(rho == rho[:, :1]) and np.all(np.abs(rho) < 1)
    inst = config.run_instances()[0]
    u = np.zeros(50)
    u[:1], u[1] = inst.u_w, inst.u_perp
    np.testing.assert_allclose(rho[:, 0], zeta @ u, atol=1e-12)
    q = mixed.extra["q"]
    assert np.all(np.isfinite(q)) and np.all(np.abs(q) <= 1)
    aligned = simulate(RunConfig(dict(activation="relu", k=1, d=50), **kw))
    assert "q" not in aligned.extra and "rho" not in aligned.extra
    np.testing.assert_array_equal(mixed.overlap[:, 0], aligned.overlap[:, 0])  # same v₀


def test_explicit_defaults_are_the_defaults():
    """base = aligned, labels = y and σ* = σ given explicitly give the same numbers as the
    defaults, bit for bit (full engine, and the chain)."""
    spec = dict(activation="erf", k=1, d=30)
    kw = dict(learner="pretrained-glm", eta=0.3, batch=3, steps=40, runs=3, checkpoints=3,
              mu=0.4, label_noise=0.1)
    for engine in ("full", "reduced"):
        plain = simulate(RunConfig(spec, engine=engine, **kw))
        told = simulate(RunConfig(spec, engine=engine, base="aligned", labels="y",
                                  teacher_activation="erf", **kw))
        for x, y in ((plain.overlap, told.overlap), (plain.extra["scale"], told.extra["scale"]),
                     (plain.loss, told.loss)):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_allclose(plain.ode, told.ode, rtol=0, atol=1e-9)


@pytest.mark.parametrize("kw, name", [
    (dict(base="tilted"), "base"), (dict(labels="y3"), "labels"),
    (dict(teacher_activation="nope"), "teacher_activation"),
    (dict(teacher_activation="erf(x/0)"), "teacher_activation"),
    (dict(mu=0.0, base="mixed"), "mu"), (dict(mu=1.0, base="mixed"), "mu")])
def test_bad_options_are_one_line_errors_naming_them(kw, name):
    with pytest.raises(ConfigError, match=f"'{name}'") as err:
        RunConfig(dict(activation="relu", k=1, d=20), learner="pretrained-glm", **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw", [dict(base="mixed"), dict(teacher_activation="he3"),
                                dict(labels="y2")])
def test_auto_engine_takes_the_chain(kw):
    config = RunConfig(dict(activation="relu", k=1, d=30), learner="pretrained-glm",
                       eta=0.1, batch=2, steps=10, runs=2, checkpoints=2, mu=0.5,
                       engine="auto", **kw)
    assert simulate(config).engine == "reduced"


def test_a_teacher_without_a_compiled_version_keeps_the_full_engine():
    from dynamics.reduced.pretrained_chain import pretrained_supported

    config = RunConfig(dict(activation="relu", k=1, d=30), learner="pretrained-glm",
                       teacher_activation="erf(x/sqrt2)", steps=5, runs=2)
    ok, why = pretrained_supported(config)
    assert not ok and "teacher_activation" in why and "\n" not in why
