"""The paper's App. B simulation convention (``convention = appB | appB-sqrt``): fixed row
scale s, output 1/ξ; gradients against autograd, Monte Carlo loss, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dynamics.activations import torch_activation
from dynamics.engines.engine import simulate
from dynamics.geometry import sphere
from dynamics.instances.instance import SpecError, build_instance
from dynamics.learners import Finetune, Problem
from dynamics.measures.losses import monte_carlo_loss
from dynamics.measures.observables import reduced_coordinates
from dynamics.setup.config import ConfigError, RunConfig

K, D, R, B = 5, 13, 3, 2
F64 = torch.float64


def _spec(convention, **kw):
    return {"activation": "relu", "k": K, "d": D, "xi": 1.7, "W": "separated",
            "c": "gaussian", "c_hat": "gaussian", "lam": "random_sign", "seed": 2,
            "convention": convention} | kw


def _model_rows(inst, direction, coeff):
    """k×d rows s(wᵢ + ξ coeffᵢ direction) of the App. B model, built independently."""
    w = torch.zeros(K, D, dtype=F64)
    w[:, :K] = torch.as_tensor(inst.w_factor)
    s = K / (K + inst.xi**2)
    if inst.convention == "appB-sqrt":
        s = math.sqrt(s)
    return s * (w + inst.xi * coeff[:, None] * direction)


@pytest.mark.parametrize("convention", ["appB", "appB-sqrt"])
@pytest.mark.parametrize("project", [True, False])
@pytest.mark.parametrize("joint", [False, True])
def test_gradients_match_autograd(convention, project, joint):
    inst = build_instance(_spec(convention))
    problem = Problem.from_instances([inst] * R, torch.device("cpu"), F64)
    learner = Finetune(problem, eta=0.05, eta_c=0.05, project=project, joint_c=joint, batch=B)
    gen = np.random.default_rng(4)
    u0 = gen.standard_normal((R, D))
    if project:
        u0[:, :K] = 0.0
    u0 /= np.linalg.norm(u0, axis=1, keepdims=True)
    state = learner.init_state(u0)
    x = torch.as_tensor(gen.standard_normal((R, B, D)))
    tangent, grad_c, loss = learner.sample_gradients(state, x)
    u = torch.zeros(D, dtype=F64)
    u[:K] = torch.as_tensor(inst.u_w)
    u[K] = inst.u_perp
    lam, sig = torch.as_tensor(inst.lam) / inst.xi, torch_activation(inst.activation).fn
    for r in range(R):
        for n in range(B):
            uh = state.u_hat[r].clone().requires_grad_(True)
            ch = state.c_hat[r].clone().requires_grad_(True)
            xr = x[r, n]
            y = sig(_model_rows(inst, u, torch.as_tensor(inst.c)) @ xr) @ lam
            ell = (y - sig(_model_rows(inst, uh, ch) @ xr) @ lam) ** 2
            gu, gc = torch.autograd.grad(ell, (uh, ch))
            if project:
                gu[:K] = 0.0
            torch.testing.assert_close(tangent[r, n], sphere.proju(state.u_hat[r], gu),
                                       rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(grad_c[r, n], gc, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(loss[r, n], ell.detach(), rtol=1e-10, atol=1e-12)


def test_monte_carlo_loss_matches_direct_average():
    """The reduced-coordinate Monte Carlo loss equals a direct d-dimensional average."""
    inst = build_instance(_spec("appB"))
    gen = np.random.default_rng(0)
    u_hat = gen.standard_normal((2, D))
    u_hat /= np.linalg.norm(u_hat, axis=1, keepdims=True)
    coords = reduced_coordinates(torch.as_tensor(u_hat), K)[:, None, :]
    c_hat = np.stack([inst.c_hat] * 2)
    mc = monte_carlo_loss([inst, inst], coords, c_hat, seed=0, size=200_000)[:, 0]
    x = torch.as_tensor(gen.standard_normal((200_000, D)))
    u = torch.zeros(D, dtype=F64)
    u[:K] = torch.as_tensor(inst.u_w)
    u[K] = inst.u_perp
    lam, sig = torch.as_tensor(inst.lam) / inst.xi, torch_activation(inst.activation).fn
    y = sig(x @ _model_rows(inst, u, torch.as_tensor(inst.c)).T) @ lam
    for r in range(2):
        fh = sig(x @ _model_rows(inst, torch.as_tensor(u_hat[r]),
                                 torch.as_tensor(inst.c_hat)).T) @ lam
        direct = float(((y - fh) ** 2).mean())
        assert abs(mc[r] - direct) < 0.03 * direct


def test_run_uses_the_exact_loss():
    cfg = RunConfig(instance=_spec("appB", d=60, k=4, xi=2.0), eta=0.02, steps=400, runs=4,
                    checkpoints=5, eval_size=2000, joint_c=True, project=False)
    traj = simulate(cfg)
    assert traj.loss_kind == "exact"  # the Gaussian pair kernel (relu: closed form)
    # the plain O(η) ODE of fine-tuning covers App. B's rows, and so does its finite-d
    # correction (hermite.finetune.population.SecondMoment)
    assert np.isfinite(traj.ode).all() and np.isfinite(traj.ode_corrected).all()
    assert np.isfinite(traj.loss).all() and np.isfinite(traj.overlap).all()
    # the rank-1 chain reduces App. B's rows too (its step = the explicit step to 1e-12:
    # tests/test_reduced_step.py), so auto takes it, with the same exact loss and theory
    red = simulate(RunConfig(**(cfg.to_dict() | {"engine": "auto"})))
    assert red.engine == "reduced" and red.loss_kind == "exact"
    assert np.isfinite(red.loss).all() and np.isfinite(red.ode_corrected).all()
    np.testing.assert_allclose(red.c_overlap[:, 0], traj.c_overlap[:, 0], rtol=1e-12)


def test_bad_convention_inputs():
    with pytest.raises(SpecError, match="convention"):
        build_instance(_spec("paper"))
    with pytest.raises(SpecError, match="ξ > 0"):
        build_instance(_spec("appB", xi=0.0))
    with pytest.raises(ValueError, match="unit rows"):
        build_instance(_spec("appB")).correlation_affine()
    for learner in ("glm", "linearized", "scratch", "lora"):  # named, not a theory error
        with pytest.raises(ConfigError, match="supported by 'finetune' only"):
            RunConfig(instance=_spec("appB"), learner=learner, eta=0.01, steps=10).validate()


def test_cli_run_defaults_without_theory(tmp_path):
    """`loradyn run` on an App. B instance with no --eta/--steps falls back to the
    theory-free defaults (η = ETA_C/d) instead of failing in the Hermite theory."""
    from click.testing import CliRunner

    from dynamics.setup.defaults import ETA_C
    from sims.cli import cli
    from sims.io.trajectory import read_trajectory

    spec = tmp_path / "appb.toml"
    spec.write_text('activation = "relu"\nk = 3\nd = 20\nxi = 1.5\nconvention = "appB"\n')
    out = tmp_path / "r.h5"
    res = CliRunner().invoke(cli, ["run", str(spec), "--runs", "2", "--checkpoints", "4",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    _, meta = read_trajectory(out)
    assert meta["config"]["eta"] == pytest.approx(ETA_C / 20)
