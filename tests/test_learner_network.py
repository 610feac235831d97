"""The unit-row network learners (scratch, scratch-csq, sparse) against independent truths
(gradients and steps against autograd: ``test_learner_protocol``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close

from dynamics.activations import torch_activation
from dynamics.engines.engine import FullRun, simulate
from dynamics.geometry import sphere
from dynamics.instances.instance import build_instance
from dynamics.learners import Problem, get_learner
from dynamics.learners.network import Scratch, ScratchCSQ, Sparse, exact_loss, sparse_selection
from dynamics.measures.network_loss import network_loss, teacher_rows
from dynamics.setup.config import ConfigError, RunConfig

F64 = torch.float64
K, D, R = 3, 13, 2
LEARNERS = ("scratch", "scratch-csq", "sparse")


def _spec(activation="tanh", **kw):
    spec = {"activation": activation, "k": K, "d": D, "xi": 1.3, "W": "separated",
            "c": "gaussian", "lam": "random_sign", "u_alpha": 0.3, "seed": 4}
    spec.update(kw)
    return spec


def _config(learner, spec=None, **kw):
    opts = dict(instance=spec or _spec(), learner=learner, eta=0.05, steps=40, runs=R,
                checkpoints=4, seed=3)
    opts.update(kw)
    return RunConfig(**opts).validate()


def _learner_state(config):
    inst = config.run_instances()
    problem = Problem.from_instances(inst, torch.device("cpu"), F64)
    learner = get_learner(config.learner).from_config(config, problem)
    state, m0 = learner.initial_state(config, inst)
    return inst, learner, state, m0


def _perturb(state, gen, lam_too=False):
    """Move every row off its start (so sparse's rows are generic too)."""
    rows = state.rows + 0.3 * torch.as_tensor(gen.standard_normal(state.rows.shape))
    state.rows.copy_(sphere.projx(rows))
    if lam_too:
        state.lam_hat += 0.4 * torch.as_tensor(gen.standard_normal(state.lam_hat.shape))


def _dense_loss(inst, rows, lam_hat, x, correlation, label=None):
    """L for one example, from the full d-dimensional teacher and the student's rows."""
    v = torch.zeros(inst.k, inst.d, dtype=F64)
    v[:, : inst.k + 1] = torch.as_tensor(teacher_rows(inst))
    sig = torch_activation(inst.activation).fn
    y = sig(v @ x) @ torch.as_tensor(inst.lam) if label is None else label
    f_hat = sig(rows @ x) @ lam_hat
    return -y * f_hat if correlation else (y - f_hat) ** 2


@pytest.mark.parametrize("activation", ["relu", "tanh", "he3", "erf"])
@pytest.mark.parametrize("learner", LEARNERS)
@pytest.mark.parametrize("batch", [1, 3])
def test_sample_loss_is_the_networks_loss(activation, learner, batch):
    """sample_loss (whose gradients test_learner_protocol checks against the closed form)
    and sample_gradients' loss = the loss written out from the full d-dimensional rows."""
    train = learner == "scratch"
    width = 5 if train else None  # scratch: k′ ≠ k with a trained second layer
    cfg = _config(learner, _spec(activation), batch=batch, width=width,
                  train_second_layer=train, label_noise=0.2)
    inst, lrn, state, _ = _learner_state(cfg)
    gen = np.random.default_rng(1)
    _perturb(state, gen, lam_too=train)
    x = torch.as_tensor(gen.standard_normal((R, batch, D)))
    eps = torch.as_tensor(gen.standard_normal((R, batch)))
    _, _, loss = lrn.sample_gradients(state, x, eps)
    ours = lrn.sample_loss(state, x, eps)
    for r in range(R):
        v = torch.as_tensor(teacher_rows(inst[r]))
        for b in range(batch):
            sig = torch_activation(inst[r].activation).fn
            y = (sig(v @ x[r, b, : K + 1]) @ torch.as_tensor(inst[r].lam)
                 + 0.2**0.5 * eps[r, b])
            ref = _dense_loss(inst[r], state.rows[r], state.lam_hat[r], x[r, b],
                              learner == "scratch-csq", y)
            assert_close(ours[r, b], ref)
            assert_close(loss[r, b], ref)


def test_teacher_rows_and_exact_loss_against_monte_carlo():
    """observe's cross Gram = ⟨vᵢ, ŵⱼ⟩; the exact loss = a Monte Carlo E(f* − f̂)²."""
    cfg = _config("scratch", _spec("tanh"), width=4, train_second_layer=True, runs=1)
    inst, lrn, state, _ = _learner_state(cfg)
    _perturb(state, np.random.default_rng(5), lam_too=True)
    obs = lrn.observe(state)
    rows, lam_hat = state.rows[0].numpy(), state.lam_hat[0].numpy()
    np.testing.assert_allclose(obs["cross"][0], teacher_rows(inst[0]) @ rows[:, : K + 1].T,
                               atol=1e-14)
    exact = exact_loss(inst, obs["cross"][:, None], obs["gram"][:, None],
                       obs["lam_hat"][:, None])[0, 0]
    assert exact == pytest.approx(float(network_loss(inst[0], rows, lam_hat)), rel=1e-12)
    x = np.random.default_rng(6).standard_normal((400_000, D))
    v = np.zeros((K, D))
    v[:, : K + 1] = teacher_rows(inst[0])
    diff = np.tanh(x @ v.T) @ inst[0].lam - np.tanh(x @ rows.T) @ lam_hat
    mc, se = np.mean(diff**2), np.std(diff**2) / np.sqrt(len(x))
    assert abs(exact - mc) < 4 * se, (exact, mc, se)
    assert exact > 20 * se  # the comparison has power


def test_rows_stay_unit_and_frozen_rows_never_move():
    cfg = _config("sparse", _spec("relu", k=4, d=20), steps=300, sparse_rows=2,
                  sparse_select="random", runs=3)
    run = FullRun(cfg)
    start = run.state.rows.clone()
    run.advance()
    moving = run.learner.mask
    assert moving.sum(1).tolist() == [2, 2, 2]
    assert torch.equal(run.state.rows[~moving], start[~moving])  # bit for bit
    assert float((run.state.rows[moving] - start[moving]).abs().amax()) > 1e-3
    norms = torch.linalg.vector_norm(run.state.rows, dim=-1)
    assert float((norms - 1).abs().max()) < 1e-13
    # single steps (no chunk-end renormalisation) keep unit rows to rounding as well
    _, lrn, state, _ = _learner_state(_config("scratch", _spec("he3")))
    x = torch.as_tensor(np.random.default_rng(0).standard_normal((R, 1, D)))
    for _ in range(50):
        lrn.step_(state, x)
    assert float((torch.linalg.vector_norm(state.rows, dim=-1) - 1).abs().max()) < 1e-12


def test_sparse_selection_and_start():
    """λ selection: largest |λ|, ties by index; start at W's rows: m₀ = mean ⟨vᵢ, wᵢ⟩."""
    cfg = _config("sparse", sparse_rows=2)
    lam = np.array([1.0, -3.0, 0.5, 3.0, 1.0])
    assert sparse_selection(cfg, lam, 50, 0).tolist() == [1, 3]
    cfg3 = _config("sparse", sparse_rows=3)
    assert sparse_selection(cfg3, lam, 50, 0).tolist() == [0, 1, 3]
    rand = _config("sparse", sparse_rows=2, sparse_select="random")
    picks = {tuple(sparse_selection(rand, lam, 50, r)) for r in range(12)}
    assert len(picks) > 1 and all(len(set(p)) == 2 for p in picks)
    assert sparse_selection(rand, lam, 50, 4).tolist() == sparse_selection(
        rand, lam, 50, 4).tolist()
    # default s = ⌈(k + d)/d⌉ = 2 for d ≥ k
    inst, lrn, state, m0 = _learner_state(_config("sparse"))
    assert lrn.mask.sum(1).tolist() == [2] * R
    v = teacher_rows(inst[0])
    np.testing.assert_allclose(m0, np.mean(np.sum(v[:, :K] * inst[0].w_factor, 1)),
                               rtol=1e-13)
    claim2 = build_instance({"activation": "he3", "k": 4, "d": 40, "xi": 1.0, "W": "claim2"})
    _, _, _, m0c = _learner_state(_config("sparse", {"activation": "he3", "k": 4, "d": 40,
                                                     "xi": 1.0, "W": "claim2"}))
    np.testing.assert_allclose(m0c, 1 / np.sqrt(1 + claim2.xi**2 / 4), rtol=1e-13)


@pytest.mark.parametrize("learner", LEARNERS)
def test_engine_learns_an_easy_instance(learner):
    """ReLU, d = 20, orthonormal W: the exact loss falls and alignment rises. k = 3, but
    k = 1 for the correlation loss (its rows do not repel: each climbs to the top of
    E[f* σ(⟨ŵ,x⟩)] on its own, which for one ReLU teacher neuron is v itself)."""
    k = 1 if learner == "scratch-csq" else 3
    spec = {"activation": "relu", "k": k, "d": 20, "xi": 1.0, "seed": 1}
    traj = simulate(RunConfig(instance=spec, learner=learner, eta=0.005, steps=6000, runs=3,
                              checkpoints=6, seed=2, finite_d_theory=False))  # not its subject
    assert traj.loss_kind == "exact" and not traj.diverged.any()
    assert np.all(traj.loss[:, -1] < 0.5 * traj.loss[:, 0]), traj.loss[:, [0, -1]]
    assert np.all(traj.overlap[:, -1] > traj.overlap[:, 0])
    np.testing.assert_array_equal(traj.extra["alignment"], traj.overlap)
    np.testing.assert_array_equal(traj.m0, traj.overlap[:, 0])


def test_scratch_reaches_near_zero_loss_with_trained_second_layer():
    spec = {"activation": "relu", "k": 2, "d": 12, "xi": 1.0, "seed": 1}
    traj = simulate(RunConfig(instance=spec, learner="scratch", eta=0.01, steps=20000,
                              runs=2, checkpoints=4, seed=5, train_second_layer=True,
                              eta_c=0.005))
    assert np.all(traj.loss[:, -1] < 0.02), traj.loss
    assert traj.extra["lam_hat"].shape == (2, traj.steps.size, 2)


@pytest.mark.parametrize("learner", LEARNERS)
def test_batch_of_runs_equals_single_runs(learner):
    opts = dict(steps=300, batch=2, label_noise=0.1)
    if learner == "sparse":  # its option only
        opts["sparse_select"] = "random"
    batch = simulate(_config(learner, runs=3, **opts))
    single = simulate(_config(learner, runs=1, **opts))
    np.testing.assert_allclose(batch.loss[:1], single.loss, rtol=1e-12)
    np.testing.assert_allclose(batch.overlap[:1], single.overlap, rtol=1e-12)
    assert not np.allclose(batch.loss[0], batch.loss[1])  # runs are independent


@pytest.mark.parametrize("learner, opts, field", [
    ("scratch", {"width": 4}, "width"),
    ("scratch-csq", {"width": 4}, "width"),
    ("scratch-csq", {"train_second_layer": True}, "train_second_layer"),
    ("sparse", {"sparse_rows": K + 1}, "sparse_rows"),
    ("sparse", {"width": K + 2}, "width"),
    ("sparse", {"train_second_layer": True}, "train_second_layer"),
])
def test_config_errors_name_the_field(learner, opts, field):
    with pytest.raises(ConfigError) as err:
        _config(learner, **opts)
    assert err.value.field == field
    assert f"'{field}'" in str(err.value) and "\n" not in str(err.value)


def test_registry_classes():
    assert get_learner("scratch") is Scratch
    assert get_learner("scratch-csq") is ScratchCSQ
    assert get_learner("sparse") is Sparse
