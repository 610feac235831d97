"""The ``pretrained-glm`` learner (issue 39: a pre-trained base μu, LoRA-like update a·v): its
step against an explicit R^d step and autograd, its population loss against closed forms and
Monte Carlo, its refusals, and the escape from the search phase."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import pretrained_setup

from dynamics.engines.engine import simulate
from dynamics.errors import ConfigError
from dynamics.learners.pretrained_glm import pretrained_glm_loss
from dynamics.setup.config import RunConfig
from sims.cli import cli

F64 = torch.float64
R, D, K = 3, 9, 2
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pretraining_hurts.toml"
# loradyn's he3 is the normalised Hermite polynomial He₃/√6
SIGMA = {"relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(float)),
         "tanh": (np.tanh, lambda z: 1.0 - np.tanh(z) ** 2),
         "he3": (lambda z: (z**3 - 3 * z) / math.sqrt(6), lambda z: (3 * z**2 - 3) / math.sqrt(6))}
TORCH_SIGMA = {"relu": torch.relu, "tanh": torch.tanh,
               "he3": lambda z: (z**3 - 3 * z) / math.sqrt(6)}


def _setup(activation, batch, noise, mu=0.6, eta=0.3):
    """(learner, dense u (D,), state, x (R, B, D), eps (R, B) or None) of the aligned base:
    ``tests.helpers.pretrained_setup``."""
    learner, u, _, state, x, eps = pretrained_setup((activation, None, "y", False), batch,
                                                    noise, mu, eta, shape=(R, D, K))
    return learner, u, state, x, eps


def _numpy_step(activation, u, a, v, x, eps, mu, eta, noise):
    """One run's step, written out in R^d: labels, ŷ = σ(⟨μu + av, x⟩), the gradients of
    ½·mean(y − ŷ)² and the renormalised update."""
    sig, dsig = SIGMA[activation]
    y = sig(x @ u) + (math.sqrt(noise) * eps if eps is not None else 0.0)
    lam = x @ (mu * u + a * v)
    delta = (sig(lam) - y) * dsig(lam)
    grad_a = np.mean(delta * (x @ v))
    grad_v = a * np.mean(delta[:, None] * x, axis=0)
    v_new = v - eta * grad_v
    return a - eta * grad_a, v_new / np.linalg.norm(v_new), grad_a, grad_v


@pytest.mark.parametrize("activation", ["relu", "tanh", "he3"])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_one_step_is_the_explicit_step_and_autograd(activation, batch, noise):
    mu, eta = 0.6, 0.3
    learner, u, state, x, eps = _setup(activation, batch, noise, mu, eta)
    new = learner.step(state, x, eps)
    assert new.step == 1 and state.step == 0
    grads_a, grads_v, loss = learner.sample_gradients(state, x, eps)
    for r in range(R):
        a, v = float(state.a[r]), state.v[r].numpy()
        e = None if eps is None else eps[r].numpy()
        a1, v1, ga, gv = _numpy_step(activation, u, a, v, x[r].numpy(), e, mu, eta, noise)
        assert abs(float(new.a[r]) - a1) < 1e-10
        np.testing.assert_allclose(new.v[r].numpy(), v1, rtol=0, atol=1e-10)
        assert abs(float(grads_a[r].mean()) - ga) < 1e-10
        np.testing.assert_allclose(grads_v[r].mean(0).numpy(), gv, rtol=0, atol=1e-10)
        # autograd of ½·mean(y − ŷ)², the model written here in torch
        ta = torch.tensor(a, dtype=F64, requires_grad=True)
        tv = torch.as_tensor(v).clone().requires_grad_(True)
        tx, tu = x[r], torch.as_tensor(u)
        sig = TORCH_SIGMA[activation]
        y = sig(tx @ tu) + (math.sqrt(noise) * eps[r] if noise else 0.0)
        per_example = 0.5 * (y - sig(tx @ (mu * tu + ta * tv))) ** 2
        per_example.mean().backward()
        assert abs(float(ta.grad) - ga) < 1e-10
        np.testing.assert_allclose(tv.grad.numpy(), gv, rtol=0, atol=1e-10)
        np.testing.assert_allclose(loss[r].numpy(), per_example.detach().numpy(), rtol=1e-12)
    assert bool((new.a != state.a).any()) and bool((new.v != state.v).any())  # both move
    np.testing.assert_allclose(torch.linalg.vector_norm(new.v, dim=-1).numpy(), 1.0,
                               atol=1e-14)


def test_population_loss_closed_forms_and_monte_carlo():
    from hermite.activations import get_activation

    mu = 0.5
    a = np.array([0.0, 0.3, -0.7, 1.0 - mu, 0.2])
    m = np.array([0.1, 0.4, -0.9, 1.0, np.nan])
    # linear σ: ½E[(ν − λ)²] = ½((1 − μ − am)² + a²(1 − m²))
    lin = pretrained_glm_loss(get_activation("linear"), mu, a, m)
    ref = 0.5 * ((1 - mu - a * m) ** 2 + a**2 * (1 - m**2))
    np.testing.assert_allclose(lin[:4], ref[:4], rtol=1e-10, atol=1e-14)
    assert np.isnan(lin[4])
    relu = pretrained_glm_loss(get_activation("relu"), mu, a[:4], m[:4])
    assert abs(relu[0] - (1 - mu) ** 2 / 4) < 1e-12  # a = 0: ½(1 − μ)²E[relu(ν)²]
    assert abs(relu[3]) < 1e-12  # μu + (1 − μ)u = u: the teacher
    gen = np.random.default_rng(0)
    nu, z = gen.standard_normal((2, 2_000_000))
    for ai, mi, li in zip(a[1:3], m[1:3], relu[1:3], strict=True):
        lam = (mu + ai * mi) * nu + ai * math.sqrt(1 - mi**2) * z
        sample = 0.5 * (np.maximum(nu, 0) - np.maximum(lam, 0)) ** 2
        assert abs(sample.mean() - li) < 4 * sample.std() / math.sqrt(nu.size)


@pytest.mark.parametrize("kw, name", [(dict(mu=0.0), "mu"), (dict(mu=-0.2), "mu"),
                                      (dict(mu=1.0), "mu"), (dict(mu=1.5), "mu"),
                                      (dict(mu=math.nan), "mu"), (dict(scale0=math.inf), "scale0"),
                                      (dict(scale0=math.nan), "scale0")])
def test_bad_options_are_one_line_errors_naming_them(kw, name):
    with pytest.raises(ConfigError, match=f"'{name}'") as err:
        RunConfig(dict(activation="relu", k=1, d=20), learner="pretrained-glm", **kw)
    assert "\n" not in str(err.value)


def test_the_example_runs_and_refuses_a_bad_mu(tmp_path):
    runner = CliRunner()
    args = ["run", str(EXAMPLE), "--learner", "pretrained-glm", "--eta", "0.2", "--batch",
            "500", "--runs", "2", "--checkpoints", "3", "--engine", "full"]
    bad = runner.invoke(cli, [*args, "--steps", "5", "--mu", "1.5", "--out",
                              str(tmp_path / "bad.h5")])
    text = bad.output.strip()
    assert bad.exit_code != 0 and len(text.splitlines()) == 1 and "'mu'" in text, text
    assert not (tmp_path / "bad.h5").exists()
    ok = runner.invoke(cli, [*args, "--steps", "5", "--mu", "0.9", "--out",
                             str(tmp_path / "ok.h5")])
    assert ok.exit_code == 0, ok.output
    from sims.io.trajectory import read_trajectory

    traj, meta = read_trajectory(tmp_path / "ok.h5")
    assert meta["config"]["mu"] == 0.9 and traj.overlap.shape == (2, 3)
    np.testing.assert_allclose(traj.extra["scale"][:, 0], 1e-6)  # a₀ = 1/d², d = 1000


def test_a_short_run_escapes_the_search_phase():
    """d = 200, B = 50, η = 0.2, μ = 0.5 (ReLU: τ = 9.66): by t = 60 the median |m| is past
    0.9; the records, the loss and the flow beside them agree with one another."""
    config = RunConfig(dict(activation="relu", k=1, d=200), learner="pretrained-glm",
                       eta=0.2, batch=50, steps=300, runs=16, checkpoints=6, mu=0.5,
                       engine="full")
    traj = simulate(config)
    assert traj.engine == "full"
    med = np.median(traj.overlap, axis=0)
    assert med[0] < 0.2 and med[-1] > 0.9, med
    assert (traj.diverged_step == -1).all()
    np.testing.assert_array_equal(traj.overlap, np.abs(traj.extra["m"]))
    np.testing.assert_allclose(traj.extra["scale"][:, 0], 1 / 200**2)
    assert np.median(traj.loss[:, 0]) == pytest.approx(0.0625, abs=1e-6)  # (1 − μ)²/4
    assert np.median(traj.loss[:, -1]) < 1e-3
    np.testing.assert_allclose(traj.ode[:, 0], traj.overlap[:, 0], atol=1e-12)
    assert np.median(traj.ode[:, -1]) > 0.9
