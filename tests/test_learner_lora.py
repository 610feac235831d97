"""The rank-r ``lora`` learner: sample loss, Stiefel geometry, r = 1 = finetune, ODE (gradients
and steps against autograd: ``test_learner_protocol``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close, assert_sample_loss_is

import hermite
from dynamics.activations import torch_activation
from dynamics.engines.engine import FullRun, simulate
from dynamics.geometry import stiefel
from dynamics.instances.instance import build_instance
from dynamics.instances.lora_instance import build_lora_instance
from dynamics.learners import Problem
from dynamics.learners.lora import LoRA
from dynamics.setup.config import ConfigError, RunConfig

F64 = torch.float64
K, D, R, B = 4, 13, 2, 3


def _lora_instance(activation, rank, u_alpha=0.0, options=None, d=D):
    W = "separated" if u_alpha else "orthonormal"
    base = build_instance({"activation": activation, "k": K, "d": d, "xi": 1.3, "W": W,
                           "c": "gaussian", "c_hat": "gaussian", "lam": "random_sign",
                           "u_alpha": u_alpha, "seed": 3})
    return build_lora_instance(base, rank, options or {})


def _frames(gen, runs, d, rank, lo):
    u0 = np.zeros((runs, d, rank))
    for i in range(runs):
        u0[i, lo:] = stiefel.uniform_frames(gen.standard_normal((d - lo, rank)))
    return u0


def _setup(activation, rank, project, joint, u_alpha=0.0, batch=B, retraction="polar",
           label_noise=0.0, instance=None):
    li = instance or _lora_instance(activation, rank, u_alpha)
    problem = Problem.from_instances([li.base] * R, torch.device("cpu"), F64)
    learner = LoRA(problem, [li] * R, eta=0.07, eta_c=0.05, project=project, joint_c=joint,
                   batch=batch, label_noise=label_noise, retraction=retraction)
    gen = np.random.default_rng(11)
    state = learner.init_state(_frames(gen, R, D, li.rank, K if project else 0))
    state.c_hat += 0.2 * torch.as_tensor(gen.standard_normal((R, K, li.rank)))
    x = torch.as_tensor(gen.standard_normal((R, batch, D)))
    return li, learner, state, x


def _dense_loss(li, u_hat, c_hat, x, label=None):
    """L = (f*(x) − f̂(x))² from explicit k×d matrices W + ξCUᵀ with normalised rows."""
    k, d, r = li.k, x.shape[0], li.rank
    w = torch.zeros(k, d, dtype=F64)
    w[:, :k] = torch.as_tensor(li.w_factor)
    u = torch.zeros(d, r, dtype=F64)
    u[: k + r] = torch.as_tensor(li.U_coords)
    lam, c, xi = torch.as_tensor(li.lam), torch.as_tensor(li.C), li.xi
    v = w + xi * c @ u.T
    v = v / v.norm(dim=1, keepdim=True)
    vh = w + xi * c_hat @ u_hat.T
    vh = vh / vh.norm(dim=1, keepdim=True)
    sig = torch_activation(li.activation).fn
    y = sig(v @ x) @ lam if label is None else label
    return (y - sig(vh @ x) @ lam) ** 2


# ---------------------------------------------------------------- the sample loss
@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("activation", ["relu", "tanh", "he3"])
@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
@pytest.mark.parametrize("joint", [False, True], ids=["frozen", "joint"])
@pytest.mark.parametrize("u_alpha", [0.0, 0.4])
def test_sample_loss_is_the_papers_model(rank, activation, project, joint, u_alpha):
    """sample_loss (whose gradients test_learner_protocol checks against the closed form)
    and sample_gradients' loss = the loss of explicit k×d matrices (projected: Û ⊥ span W)."""
    li, learner, state, x = _setup(activation, rank, project, joint, u_alpha)
    assert_sample_loss_is(learner, state, x, lambda r, b: _dense_loss(
        li, state.u_hat[r], state.c_hat[r], x[r, b]))


def test_label_noise_enters_the_label():
    li, learner, state, x = _setup("tanh", 2, True, True, label_noise=0.3)
    eps = torch.as_tensor(np.random.default_rng(2).standard_normal((R, B)))
    tangent, _, loss = learner.sample_gradients(state, x, eps)
    clean, _, _ = learner.sample_gradients(state, x)
    assert float((tangent - clean).abs().max()) > 1e-6
    ours = learner.sample_loss(state, x, eps)
    for r in range(R):
        for b in range(B):
            w = torch.zeros(K, D, dtype=F64)
            w[:, :K] = torch.as_tensor(li.w_factor)
            u = torch.zeros(D, 2, dtype=F64)
            u[: K + 2] = torch.as_tensor(li.U_coords)
            v = w + li.xi * torch.as_tensor(li.C) @ u.T
            v = v / v.norm(dim=1, keepdim=True)
            y = torch.tanh(v @ x[r, b]) @ torch.as_tensor(li.lam) + 0.3**0.5 * eps[r, b]
            ref = _dense_loss(li, state.u_hat[r], state.c_hat[r], x[r, b], y)
            assert_close(ours[r, b], ref)
            assert_close(loss[r, b], ref)


# ---------------------------------------------------------------- Stiefel geometry


def test_stiefel_geometry():
    gen = torch.Generator().manual_seed(0)
    x = stiefel.projx(torch.randn(4, 9, 3, generator=gen, dtype=F64))
    assert float(stiefel.orthonormality_error(x).max()) < 1e-14
    v = torch.randn(4, 9, 3, generator=gen, dtype=F64)
    t = stiefel.proju(x, v)
    skew = x.transpose(-1, -2) @ t  # tangent ⇔ XᵀV skew-symmetric
    assert float((skew + skew.transpose(-1, -2)).abs().max()) < 1e-14
    assert_close(stiefel.proju(x, t), t, 1e-14)  # idempotent
    y = x + 0.3 * t
    # polar: the orthogonal polar factor U Vᵀ of Y = U Σ Vᵀ; qr: Q of Y = QR, diag R > 0
    uu, _, vt = torch.linalg.svd(y, full_matrices=False)
    assert_close(stiefel.projx(y, "polar"), uu @ vt, 1e-13)
    q, rr = torch.linalg.qr(y)
    q = q * torch.sign(torch.diagonal(rr, dim1=-2, dim2=-1))[..., None, :]
    assert_close(stiefel.projx(y, "qr"), q, 1e-13)
    # r = 1: both retractions are the sphere's normalisation
    s = torch.randn(5, 7, 1, generator=gen, dtype=F64)
    for method in stiefel.RETRACTIONS:
        assert_close(stiefel.projx(s, method), s / s.norm(dim=-2, keepdim=True), 1e-15)
    bad = torch.full((2, 2), float("nan"), dtype=F64)
    _, health = stiefel.retraction_factor(torch.stack([torch.eye(2, dtype=F64), bad]))
    assert health[0] == 1.0 and not torch.isfinite(health[1])


@pytest.fixture
def one_thread():
    """Small r×r LAPACK calls stall on OpenMP teams when the cores are busy (as the engine
    does for its hot loop, run single-threaded)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("retraction", ["polar", "qr"])
def test_frames_stay_orthonormal_and_perpendicular(retraction, one_thread):
    """10⁴ closed-form steps (no end-of-chunk re-orthonormalisation): ÛᵀÛ = I to 1e-12,
    projected Û ⊥ span W exactly."""
    li = _lora_instance("relu", 3, d=40)
    problem = Problem.from_instances([li.base] * 2, torch.device("cpu"), F64)
    learner = LoRA(problem, [li] * 2, eta=0.02, eta_c=0.02, batch=1, retraction=retraction)
    state = learner.init_state(_frames(np.random.default_rng(0), 2, 40, 3, K))
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        x = torch.randn(2, 250, 1, 40, generator=gen, dtype=F64)
        pre = learner.prepare(state, x)
        for i in range(250):
            health = learner.step_prepared_(state, x[:, i], pre, i)
            assert bool(torch.isfinite(health).all())
    assert state.step == 10_000
    assert float(stiefel.orthonormality_error(state.u_hat).max()) < 1e-12
    assert float(state.u_hat[:, :K].abs().max()) == 0.0
    assert hermite.singular_values(learner.overlap_matrix(state).numpy()).max() > 0.5  # moved


# ---------------------------------------------------------------- engine runs
def _config(learner="lora", rank=1, **kw):
    spec = {"activation": "relu", "k": 5, "d": 40, "xi": 1.0, "c": "gaussian",
            "c_hat": "quantized", "seed": 2, "u_alpha": 0.3, "W": "separated"}
    spec.update(kw.pop("instance", {}))
    base = dict(instance=spec, learner=learner, rank=rank, eta=0.01, steps=1500, runs=3,
                seed=5, checkpoints=12, label_noise=0.05, finite_d_theory=False)
    base.update(kw)
    return RunConfig(**base)


@pytest.mark.parametrize("project, joint", [(True, False), (True, True), (False, False),
                                            (False, True)])
def test_rank_one_reproduces_finetune(project, joint):
    ours = simulate(_config("lora", project=project, joint_c=joint))
    ref = simulate(_config("finetune", project=project, joint_c=joint))
    np.testing.assert_allclose(ours.overlap, ref.overlap, rtol=0, atol=1e-11)
    np.testing.assert_allclose(ours.m0, ref.m0, rtol=0, atol=1e-15)
    if project:
        np.testing.assert_allclose(ours.loss, ref.loss, rtol=0, atol=1e-11)
    if project and not joint:
        np.testing.assert_allclose(ours.ode, ref.ode, rtol=0, atol=1e-8)  # ref: h table
    if joint:
        np.testing.assert_allclose(ours.c_overlap, ref.c_overlap, rtol=0, atol=1e-11)
        # ⟨ĉûᵀ, cuᵀ⟩/(‖ĉ‖‖c‖) = ⟨ĉ, c⟩ m/(‖ĉ‖‖c‖) at r = 1
        np.testing.assert_allclose(ours.extra["update_overlap"], ref.c_overlap * ref.overlap,
                                   rtol=0, atol=1e-11)
    assert not ours.diverged.any()


def test_unprojected_exact_loss_matches_finetune_exact_loss():
    """Unprojected, r = 1: the rank-r exact loss (hermite.flows.rank) against finetune's, computed
    independently from its reduced coordinates (hermite.finetune.population)."""
    ours = simulate(_config("lora", project=False, steps=300, checkpoints=4))
    ref = simulate(_config("finetune", project=False, steps=300, checkpoints=4))
    assert ours.loss_kind == "exact" and ref.loss_kind == "exact"
    np.testing.assert_allclose(ours.loss, ref.loss, rtol=1e-10)


def test_trajectory_records_and_determinism():
    cfg = _config(rank=2, runs=4, steps=400, checkpoints=6,
                  extra={"C": "spectrum", "spectrum": [2.0, 1.0]})
    tr = simulate(cfg)
    c = len(tr.steps)
    assert tr.extra["overlap_matrix"].shape == (4, c, 2, 2)
    sv = tr.extra["singular_values"]
    assert sv.shape == (4, c, 2) and np.all(sv[..., 0] >= sv[..., 1])
    np.testing.assert_allclose(np.abs(tr.overlap), sv[..., 1], atol=1e-15)
    np.testing.assert_allclose(tr.overlap, hermite.signed_smallest(tr.extra["overlap_matrix"]))
    assert tr.extra["ode_singular_values"].shape == (4, c, 2)
    np.testing.assert_allclose(tr.extra["ode_singular_values"][:, 0], sv[:, 0], atol=1e-15)
    assert np.all(np.isfinite(tr.loss)) and tr.loss_kind == "exact"
    # run r's numbers do not depend on R
    one = simulate(_config(rank=2, runs=2, steps=400, checkpoints=6,
                           extra={"C": "spectrum", "spectrum": [2.0, 1.0]}))
    np.testing.assert_array_equal(one.extra["overlap_matrix"], tr.extra["overlap_matrix"][:2])
    joint = simulate(_config(rank=2, runs=2, steps=200, checkpoints=4, joint_c=True))
    assert joint.extra["c_hat"].shape == (2, len(joint.steps), 5, 2)
    assert joint.c_overlap.shape == (2, len(joint.steps))
    assert np.all(np.isnan(joint.ode))


def test_loss_decreases_and_update_overlap():
    cfg = _config(rank=2, runs=2, steps=3000, eta=0.01, checkpoints=5, label_noise=0.0,
                  instance={"c_hat": "teacher", "u_alpha": 0.0, "W": "orthonormal"},
                  extra={"C": "spectrum", "spectrum": [1.5, 1.0]})
    tr = simulate(cfg)
    assert np.all(tr.loss[:, -1] < 0.01 * tr.loss[:, 0])
    assert np.all(tr.extra["update_overlap"][:, -1] > 0.95)  # ⟨ĈÛᵀ, CUᵀ⟩ with Ĉ = C


def test_float32_runs():
    """float32 (its own example stream): no spurious divergence, σ(M) ≤ 1 to float32."""
    tr = simulate(_config(rank=2, runs=2, steps=600, checkpoints=4, dtype="float32"))
    assert not tr.diverged.any() and tr.dtype == "float32"
    sv = tr.extra["singular_values"]
    assert np.all(np.isfinite(sv)) and sv.max() <= 1 + 1e-5 and np.all(np.isfinite(tr.loss))


def test_aligned_init_has_a_positive_initial_drift():
    cfg = _config(rank=2, runs=6, steps=1, checkpoints=2, init="aligned",
                  extra={"C": "gaussian"})
    run = FullRun(cfg.validate())
    m0 = run.learner.overlap_matrix(run.state).numpy()
    a0 = hermite.A_matrix(run.learner.instances[0], np.zeros((2, 2)))
    assert np.all(np.einsum("nab,ab->n", m0, a0) > 0)


def test_gauge_changes_no_singular_value():
    """Teacher (C, U) ↦ (CQ, UQ): same labels, same Û path; M ↦ QᵀM, σ(M) unchanged."""
    li = _lora_instance("tanh", 3, options={"C": "spectrum", "spectrum": [2.0, 1.0, 0.5]},
                        d=30)
    q, rr = np.linalg.qr(np.random.default_rng(4).standard_normal((3, 3)))
    lg = li.with_gauge(q * np.sign(np.diag(rr)))
    out = []
    for inst in (li, lg):
        problem = Problem.from_instances([inst.base] * 2, torch.device("cpu"), F64)
        learner = LoRA(problem, [inst] * 2, eta=0.03, eta_c=0.03)
        state = learner.init_state(_frames(np.random.default_rng(0), 2, 30, 3, K))
        x = torch.as_tensor(np.random.default_rng(1).standard_normal((2, 500, 1, 30)))
        pre = learner.prepare(state, x)
        for i in range(500):
            learner.step_prepared_(state, x[:, i], pre, i)
        out.append(learner.overlap_matrix(state).numpy())
    np.testing.assert_allclose(hermite.singular_values(out[1]),
                               hermite.singular_values(out[0]), atol=1e-10)
    assert np.abs(out[1] - out[0]).max() > 1e-3  # M itself is not gauge-invariant


def test_matrix_ode_tracks_sgd():
    """d = 200, k = 4, r = 2, η = 0.1/d, 8 runs: the run-mean of each singular value stays
    within 0.06 of the run-mean of the matrix ODE from each run's M₀ over the whole curve
    (measured: 0.021 and 0.024; the full-size check, d = 2000, k = 8, is
    ``benchmarks/incremental_learning.py --ode-check``)."""
    d = 200
    cfg = RunConfig(instance={"activation": "relu", "k": 4, "d": d, "xi": 1.0, "seed": 1,
                              "c_hat": "teacher"},
                    learner="lora", rank=2, eta=0.1 / d, steps=20_000, runs=8, seed=3,
                    checkpoints=15, extra={"C": "spectrum", "spectrum": [1.2, 0.8]})
    tr = simulate(cfg)
    sgd = tr.extra["singular_values"].mean(0)
    ode = tr.extra["ode_singular_values"].mean(0)
    assert sgd[0, 1] < 0.1 and sgd[-1, 1] > 0.95  # the curve covers the whole rise
    assert np.abs(sgd - ode).max() < 0.06, np.abs(sgd - ode).max(0)


def test_a_non_finite_run_is_reported_and_isolated():
    li, learner, state, x = _setup("relu", 2, True, False, batch=1)
    x[1, 0, 5] = float("nan")
    new = learner.step(state, x)
    pre = learner.prepare(state.clone(), x[:, None])
    health = learner.step_prepared_(state.clone(), x, pre, 0)
    assert torch.isfinite(health[0]) and health[0] > 0 and not torch.isfinite(health[1])
    assert learner.bad_runs(new).tolist() == [False, True]
    ref = learner.step(learner.init_state(state.u_hat[:1].repeat(2, 1, 1)), x[:1].repeat(2, 1, 1))
    assert_close(new.u_hat[0], ref.u_hat[0], 1e-15)  # run 0 is untouched by run 1's NaN


def test_rank_keys_may_not_be_given_twice():
    from types import SimpleNamespace

    from dynamics.instances.lora_instance import lora_options

    cfg = SimpleNamespace(instance={"C": "quantized"}, extra={"C": "gaussian"})
    with pytest.raises(ConfigError, match="both"):
        lora_options(cfg)
    cfg = SimpleNamespace(instance={"spectrum": [2, 1]}, extra={"C": "spectrum", "other": 1})
    assert lora_options(cfg) == {"spectrum": [2, 1], "C": "spectrum"}


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kw, match", [
    (dict(rank=6), "rank"),
    (dict(rank=2, instance={"d": 7}), "d ≥ k"),
    (dict(rank=2, extra={"C": "spectrum"}), "spectrum"),
    (dict(rank=2, instance={"c": [0.5, 0.5, 0.5, 0.5, 0.0]}), "explicit"),
    (dict(rank=2, retraction="cayley"), "retraction"),
    (dict(rank=2, engine="reduced", project=False), "rank-r chain does not cover"),
])
def test_bad_configs_raise_config_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        _config(**kw).validate()


def test_aligned_c_overlap_is_gauge_aligned():
    """extra["aligned_c_overlap"] = ⟨ĈQᵀ, C⟩/(‖Ĉ‖‖C‖) with Q the polar factor of M: at r = 1
    it is ⟨ĉ,c⟩·sign(m) (c_overlap·sign overlap)."""
    from dynamics.engines.engine import simulate
    from dynamics.setup.config import RunConfig

    spec = {"activation": "relu", "k": 4, "d": 30, "xi": 1.0, "c": "gaussian",
            "c_hat": "gaussian", "seed": 2}
    tr = simulate(RunConfig(instance=spec, learner="lora", rank=1, eta=0.01, steps=400,
                            runs=6, joint_c=True, checkpoints=5).validate())
    np.testing.assert_allclose(tr.extra["aligned_c_overlap"],
                               tr.c_overlap * np.sign(tr.overlap), atol=1e-12)
    tr2 = simulate(RunConfig(instance=spec | {"C": "gaussian"}, learner="lora", rank=2,
                             eta=0.01, steps=200, runs=3, joint_c=True,
                             checkpoints=3).validate())
    m = tr2.extra["overlap_matrix"]
    p_, _, vt = np.linalg.svd(m)
    ch = tr2.extra["c_hat"]
    from dynamics.instances.lora_instance import run_lora_instances

    c = run_lora_instances(RunConfig(instance=spec | {"C": "gaussian"}, learner="lora",
                                     rank=2, eta=0.01, steps=1, runs=3))[0].C
    want = np.einsum("rcka,rcba,kb->rc", ch, p_ @ vt, c) / (
        np.linalg.norm(ch, axis=(-2, -1)) * np.linalg.norm(c))
    np.testing.assert_allclose(tr2.extra["aligned_c_overlap"], want, atol=1e-12)
