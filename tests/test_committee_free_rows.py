"""Free rows, the committee-machine teacher and scaled activations (issue 17, part 1) against
independent truths: autograd of the sample loss, explicit teacher weights, Monte Carlo of the
population loss, the torch reference step, the committee ODE over three d, nn2pp's units."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import assert_close

from dynamics.activations import get_activation, torch_activation
from dynamics.engines.engine import FullRun, simulate
from dynamics.instances.instance import SpecError, build_instance
from dynamics.learners import Problem
from dynamics.measures.network_loss import network_loss_from_grams, network_loss_from_overlaps
from dynamics.setup.config import ConfigError, RunConfig
from hermite.activations_numba import compiled_activation
from hermite.committee import CommitteeModel, CommitteeState, committee_ode, scaled_erf
from sims.cli import cli

F64 = torch.float64
NN2PP_ERF = "erf(x/sqrt2)"


def committee_spec(d=13, k=3, activation="tanh", **kw):
    return {"activation": activation, "k": k, "d": d, "teacher": "committee",
            "W": "gaussian", "lam": "random_sign", "seed": 4} | kw


def _config(learner="scratch", spec=None, **kw):
    opts = dict(instance=spec or committee_spec(), learner=learner, eta=0.05, steps=40,
                runs=2, checkpoints=4, seed=3, rows="free")
    opts.update(kw)
    return RunConfig(**opts).validate()


def _learner_state(config):
    """(instances, problem, learner, initial state) as the engine builds them (CPU, float64)."""
    run = FullRun(config)
    return run.instances, run.problem, run.learner, run.state



# ---------------------------------------------------------------- scaled activations
@pytest.mark.parametrize("name, base, scale", [
    ("erf(x/sqrt2)", "erf", 1 / math.sqrt(2)), ("erf(x/sqrt(2))", "erf", 1 / math.sqrt(2)),
    ("tanh(x*0.5)", "tanh", 0.5), ("relu(x*2)", "relu", 2.0), ("he3(x/2)", "he3", 0.5),
    ("sigmoid(x*0.3)", "sigmoid", 0.3),
])
def test_scaled_activation_is_sigma_of_a_x(name, base, scale):
    act = get_activation(name)
    x = np.linspace(-3, 3, 13)
    b = get_activation(base)
    np.testing.assert_allclose(act.fn(x), b.fn(scale * x), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(act.deriv(x), scale * b.deriv(scale * x), rtol=1e-14,
                               atol=1e-15)
    assert act.base_and_scale[0] == base and act.base_and_scale[1] == pytest.approx(scale)
    assert get_activation(act.name) is act  # the canonical name reads back as itself
    t = torch_activation(act)
    xt = torch.as_tensor(x)
    assert_close(t.fn(xt), act.fn(x), 1e-14)
    assert_close(t.deriv(xt), act.deriv(x), 1e-14)
    assert compiled_activation(t) is not None  # the compiled step runs it


@pytest.mark.parametrize("name, tol", [
    ("erf(x/sqrt2)", 1e-10), ("erf(x*1.5)", 1e-8), ("quadratic(x*0.7)", 1e-10),
    ("linear(x*1.5)", 1e-10)])
def test_scaled_closed_form_kernels_match_quadrature(name, tol):
    """K_a(ρ) = E[σ(a z₁)σ(a z₂)] and K_a′ against 2-D Gauss–Hermite quadrature of σ_a
    (120² nodes: exact for polynomials; the steeper erf(1.5x) limits the quadrature's own
    accuracy, hence the looser tolerance there)."""
    act = get_activation(name)
    z, w = np.polynomial.hermite_e.hermegauss(120)
    w = w / w.sum()
    for rho in (-0.7, 0.0, 0.4, 0.95):
        z2 = rho * z[:, None] + math.sqrt(1 - rho * rho) * z[None, :]
        ww = w[:, None] * w[None, :]
        k_ref = np.sum(ww * act.fn(z[:, None]) * act.fn(z2))
        kp_ref = np.sum(ww * act.deriv(z[:, None]) * act.deriv(z2))
        assert act.kernel(rho) == pytest.approx(k_ref, rel=tol, abs=tol)
        assert act.kprime(rho) == pytest.approx(kp_ref, rel=tol, abs=tol)


@pytest.mark.parametrize("name", ["relu(x*2)", "abs(x/3)"])
def test_scaled_kinked_kernels_match_monte_carlo(name):
    """Kinked σ (Gauss–Hermite converges slowly there): K_a, K_a′ within 5 standard errors
    of a 10⁶-sample Monte Carlo."""
    act = get_activation(name)
    gen = np.random.default_rng(11)
    z1, zp = gen.standard_normal((2, 1_000_000))
    for rho in (-0.7, 0.0, 0.4, 0.95):
        z2 = rho * z1 + math.sqrt(1 - rho * rho) * zp
        for closed, sample in ((act.kernel, act.fn(z1) * act.fn(z2)),
                               (act.kprime, act.deriv(z1) * act.deriv(z2))):
            se = sample.std() / 1000.0
            assert abs(float(closed(rho)) - sample.mean()) < 5 * se + 1e-12, (rho, name)


def test_scaled_erf_is_the_registry_name():
    assert scaled_erf() is get_activation(NN2PP_ERF)
    assert scaled_erf(1.0) is get_activation("erf")


@pytest.mark.parametrize("name", ["erf(x/0)", "erf(x*-1)", "softplus(x*2)", "erf(y/2)",
                                  "erf(x/sqrt)"])
def test_bad_scaled_names_are_one_line_errors(name):
    with pytest.raises(ValueError) as err:
        get_activation(name)
    assert "\n" not in str(err.value) and name in str(err.value)


# ---------------------------------------------------------------- committee teacher
def test_committee_teacher_is_the_given_rows():
    """Labels from an explicit W (k×d, rows of any norm) are Σ λᵢ σ(⟨wᵢ, x⟩) in the original
    coordinates: the canonical frame is x′ = Qᵀx with Wᵀ = QR, W = L Qᵀ, L = Rᵀ."""
    import scipy.linalg as sla

    gen = np.random.default_rng(0)
    k, d = 3, 11
    W = gen.standard_normal((k, d)) * np.array([[0.5], [1.0], [2.0]])
    lam = np.array([1.0, -0.5, 2.0])
    inst = build_instance(committee_spec(d=d, k=k, W=W.tolist(), lam=lam.tolist()))
    assert inst.committee and inst.xi == 0.0 and np.all(inst.teacher_norms() == 1.0)
    np.testing.assert_allclose(inst.teacher_gram(), W @ W.T, rtol=1e-12)
    q, _ = sla.qr(W.T, mode="economic")
    x = gen.standard_normal((50, d))
    frame = np.zeros((1, 50, d))
    frame[0, :, :k] = x @ q
    problem = Problem.from_instances([inst], torch.device("cpu"), F64)
    xt = torch.as_tensor(frame)
    y = problem.teacher(xt, xt[..., :k] @ problem.lt)
    np.testing.assert_allclose(y[0].numpy(), np.tanh(x @ W.T) @ lam, rtol=1e-12)


def test_gaussian_committee_teacher_gram_is_wishart_over_d():
    """T = VVᵀ for rows i.i.d. N(0, I/d): E T = I, Var T_ij = (1 + δᵢⱼ)/d over 400 seeds."""
    d, k = 50, 3
    T = np.stack([build_instance(committee_spec(d=d, k=k, seed=s)).teacher_gram()
                  for s in range(400)])
    se = np.sqrt(2.0 / d / 400)
    assert np.all(np.abs(T.mean(0) - np.eye(k)) < 5 * se)
    var = T.var(0, ddof=1) * d
    expect = 1.0 + np.eye(k)
    assert np.all(np.abs(var - expect) < 0.25 * expect), var


@pytest.mark.parametrize("spec_kw, key", [
    ({"xi": 1.0}, "xi"), ({"c": "gaussian"}, "c"), ({"u_alpha": 0.2}, "u_alpha"),
    ({"W": "separated"}, "W"), ({"teacher": "student"}, "teacher"), ({"k": 0}, "k"),
    ({"gram": [[1.0, 2.0], [2.0, 1.0]], "k": 2, "W": None}, "gram"),
])
def test_committee_spec_errors_name_the_key(spec_kw, key):
    spec = committee_spec() | spec_kw
    if spec.get("W") is None:
        spec.pop("W")
    with pytest.raises(SpecError) as err:
        build_instance(spec)
    assert err.value.key == key and "\n" not in str(err.value)


@pytest.mark.parametrize("learner", ["finetune", "linearized", "sparse", "lora"])
def test_committee_teacher_is_learnt_from_scratch_only(learner):
    with pytest.raises(ConfigError, match="committee teacher") as err:
        RunConfig(instance=committee_spec(), learner=learner, eta=0.01, steps=10).validate()
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- free rows
@pytest.mark.parametrize("learner", ["scratch", "scratch-csq"])
@pytest.mark.parametrize("teacher", ["committee", "finetune"])
@pytest.mark.parametrize("batch", [1, 3])
def test_free_row_sample_gradients_match_autograd(learner, teacher, batch):
    """∇_ŵ L (not projected) and ∂L/∂λ̂ against autograd of (y − Σλ̂σ(⟨ŵ,x⟩))² / −y f̂."""
    spec = committee_spec() if teacher == "committee" else {
        "activation": "tanh", "k": 3, "d": 13, "xi": 1.3, "W": "separated", "seed": 4}
    train = learner == "scratch"
    cfg = _config(learner, spec, batch=batch, train_second_layer=train,
                  width=5 if train else None, init_scale=1.7)
    inst, problem, lrn, state = _learner_state(cfg)
    gen = np.random.default_rng(1)
    state.rows += 0.3 * torch.as_tensor(gen.standard_normal(state.rows.shape))
    x = torch.as_tensor(gen.standard_normal((2, batch, 13)))
    grad_w, grad_l, loss = lrn.sample_gradients(state, x)
    v = lrn.teacher_rows()
    sig = problem.activation.fn
    for r in range(2):
        for b in range(batch):
            xb = x[r, b]
            y = sig(v[r] @ xb[: v.shape[-1]]) @ problem.lam[r]
            w = state.rows[r].clone().requires_grad_(True)
            lh = state.lam_hat[r].clone().requires_grad_(True)
            f_hat = sig(w @ xb) @ lh
            ref = -y * f_hat if learner == "scratch-csq" else (y - f_hat) ** 2
            gw, gl = torch.autograd.grad(ref, (w, lh))
            assert_close(grad_w[r, b], gw)
            assert_close(grad_l[r, b], gl)
            assert_close(loss[r, b], ref.detach())


def test_free_row_step_is_plain_sgd_and_rows_keep_their_norm():
    cfg = _config(batch=3, init_scale=2.0)
    _, _, lrn, state = _learner_state(cfg)
    norms = state.rows.norm(dim=-1)
    assert float((norms - 2.0).abs().max()) < 0.8  # ‖ŵ‖ ≈ init_scale (d = 13)
    gen = np.random.default_rng(2)
    x = torch.as_tensor(gen.standard_normal((2, 3, 13)))
    grad_w, _, _ = lrn.sample_gradients(state, x)
    new = lrn.step(state, x)
    assert_close(new.rows, state.rows - 0.05 * grad_w.mean(1), 1e-12)
    before = state.rows.clone()
    lrn.renormalize_(state)
    assert torch.equal(state.rows, before)  # no retraction for free rows


FREE_CASES = {
    "erf(x/sqrt2) committee": dict(spec=committee_spec(d=40, activation=NN2PP_ERF)),
    "relu finetune teacher": dict(spec={"activation": "relu", "k": 3, "d": 40, "xi": 1.0,
                                        "seed": 2}),
    "erf csq": dict(learner="scratch-csq", spec=committee_spec(d=40, activation="erf")),
    "tanh(x*0.5), b = 3, trained λ̂": dict(spec=committee_spec(d=40, activation="tanh(x*0.5)"),
                                         batch=3, width=4, train_second_layer=True,
                                         eta_c=0.02),
    "k = 9 (four rows at a time)": dict(spec=committee_spec(d=40, k=9), eta=0.004),
}


@pytest.mark.parametrize("case", sorted(FREE_CASES))
def test_free_row_fast_path_equals_plain_path(case):
    kw = dict(FREE_CASES[case])
    learner = kw.pop("learner", "scratch")
    out = []
    for fast in (False, True):
        run = FullRun(_config(learner, kw.pop("spec") if "spec" in kw else None,
                              **{"eta": 0.01, "steps": 600, "runs": 3,
                                 "finite_d_theory": False, **kw}))
        kw.setdefault("spec", run.config.instance)
        run.learner.fast = fast
        out.append((run, run.run()))
    (plain, tp), (fast, tf) = out
    assert compiled_activation(fast.problem.activation) is not None
    assert_close(fast.state.rows, plain.state.rows)
    assert_close(fast.state.lam_hat, plain.state.lam_hat)
    assert_close(tf.loss, tp.loss)
    assert np.abs(tp.loss[:, -1] - tp.loss[:, 0]).max() > 1e-3  # the runs moved


def test_width_differs_from_teacher_with_equal_lambda_and_a_fixed_second_layer():
    """K = 3 students of an M = 2 teacher with A = 1 (nn2pp's K ≠ M with v = 1): λ̂ = 1,
    fixed; the ODE starts at the run's loss and follows it at d = 400."""
    cfg = _config(spec=committee_spec(d=400, k=2, activation=NN2PP_ERF, lam="ones"),
                  width=3, eta=0.5 / 400, steps=2400, runs=16, checkpoints=4,
                  spacing="linear")
    inst, _, lrn, state = _learner_state(cfg)
    assert torch.equal(state.lam_hat, torch.ones(16, 3, dtype=F64))
    traj = simulate(cfg)
    np.testing.assert_allclose(traj.extra["ode_loss"][:, 0], traj.loss[:, 0], rtol=1e-12)
    diff = (traj.loss - traj.extra["ode_loss"])[:, 1:]
    z = diff.mean(0) / (diff.std(0, ddof=1) / 4.0)
    assert np.all(np.abs(z) < 4.0), z
    assert "lam_hat" not in traj.extra  # λ̂ is not trained: nothing recorded
    with pytest.raises(ConfigError, match="equal λ"):
        _config(spec=committee_spec(d=40, k=2, lam="random_sign"), width=3)


def test_per_run_committee_teachers_each_get_their_ode():
    """instance_seeds = per_run: every run its own N(0, I/d) teacher (as nn2pp draws one per
    process); the ODE of each starts at that run's loss with that run's T."""
    cfg = _config(spec=committee_spec(d=60, k=2, activation=NN2PP_ERF, lam="ones"),
                  eta=0.5 / 60, steps=300, runs=3, instance_seeds="per_run", checkpoints=4)
    grams = [i.teacher_gram() for i in cfg.run_instances()]
    assert not np.allclose(grams[0], grams[1])
    traj = simulate(cfg)
    assert traj.extra_attrs["ode_loss"]["distinct_odes"] == 3
    np.testing.assert_allclose(traj.extra["ode_loss"][:, 0], traj.loss[:, 0], rtol=1e-12)


# ---------------------------------------------------------------- exact loss
@pytest.mark.parametrize("activation", ["erf(x/sqrt2)", "relu", "tanh", "he3"])
def test_free_row_population_loss_matches_monte_carlo(activation):
    """E(f* − f̂)² from the overlaps against a Monte Carlo average over 400k Gaussian x."""
    gen = np.random.default_rng(5)
    k, kp, d = 2, 3, 8
    V = gen.standard_normal((k, d)) * 0.5
    W = gen.standard_normal((kp, d)) * 0.4
    lam, lam_hat = np.array([1.0, -0.7]), np.array([0.5, 1.2, -0.3])
    act = get_activation(activation)
    exact = network_loss_from_overlaps(act, lam, V @ V.T, lam_hat, W @ W.T, V @ W.T)
    x = gen.standard_normal((400_000, d))
    e2 = (act.fn(x @ V.T) @ lam - act.fn(x @ W.T) @ lam_hat) ** 2
    se = e2.std() / math.sqrt(e2.size)
    assert abs(e2.mean() - exact) < 4 * se, (e2.mean(), exact, se)


def test_overlap_loss_equals_dual_kernel_loss_for_unit_rows():
    gen = np.random.default_rng(6)
    V = gen.standard_normal((3, 9))
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    W = gen.standard_normal((4, 5, 9))
    W /= np.linalg.norm(W, axis=-1, keepdims=True)
    lam, lam_hat = gen.standard_normal(3), gen.standard_normal((4, 5))
    gram, cross = W @ W.transpose(0, 2, 1), np.einsum("id,rjd->rij", V, W)
    for act in ("relu", "erf", "he3", "sigmoid"):
        a = network_loss_from_overlaps(act, lam, V @ V.T, lam_hat, gram, cross)
        b = network_loss_from_grams(get_activation(act), lam, V @ V.T, lam_hat, gram, cross)
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9)


# ---------------------------------------------------------------- the ODE beside SGD
@pytest.mark.parametrize("rows", ["free", "unit"])
def test_sgd_tracks_the_committee_ode_and_concentrates_as_d_grows(rows):
    """Committee teacher (T ≈ I from N(0, I/d) rows), erf(x/√2), K = M = 2, η·d = 0.5 to
    α = 6, 48 runs per d ∈ {50, 200, 800}: SGD − ODE per run (paired: each run's own start)
    has mean within 4 standard errors at every checkpoint, and its RMS (fluctuations
    O(d^{-1/2})) falls by > 2.5× from d = 50 to 800 (expected 4×)."""
    rms = []
    for d in (50, 200, 800):
        cfg = _config(spec=committee_spec(d=d, k=2, activation=NN2PP_ERF, lam="ones"),
                      eta=0.5 / d, steps=6 * d, runs=48, checkpoints=5, spacing="linear",
                      rows=rows)
        traj = simulate(cfg)
        assert traj.extra_attrs["ode_loss"]["rows"] == rows
        diff = (traj.loss - traj.extra["ode_loss"])[:, 1:]
        z = diff.mean(0) / (diff.std(0, ddof=1) / math.sqrt(diff.shape[0]))
        assert np.all(np.abs(z) < 4.0), (d, z)
        align = traj.extra["alignment"] - traj.extra["ode_alignment"]
        za = align[:, 1:].mean(0) / (align[:, 1:].std(0, ddof=1) / math.sqrt(48))
        assert np.all(np.abs(za) < 4.0), (d, za)
        assert traj.loss[:, -1].mean() < 0.5 * traj.loss[:, 0].mean()  # it learned
        rms.append(float(np.sqrt((diff ** 2).mean())))
    assert rms[0] > rms[1] > rms[2] and rms[2] < rms[0] / 2.5, rms


def test_sgd_order_parameters_track_the_ode():
    """Free rows, erf(x/√2), K = M = 2, d = 500, η·d = 0.5, 32 runs to α = 5: the SGD mean of
    Q = ŴŴᵀ and R = ŴVᵀ minus each run's own ODE is within 4 standard errors, entry by entry
    at every checkpoint (the ODE integrated here, independently of the recorded overlay)."""
    from dynamics.overlays.committee import committee_model, committee_state

    d, runs = 500, 32
    cfg = _config(spec=committee_spec(d=d, k=2, activation=NN2PP_ERF, lam="ones"),
                  eta=0.5 / d, steps=5 * d, runs=runs, checkpoints=5, spacing="linear",
                  finite_d_theory=False)
    run = FullRun(cfg)
    run.run()
    rec = run.records.arrays()
    steps = np.asarray(run.steps, dtype=float)
    inst = run.instances[0]
    model = committee_model(inst, loss="squared", eta=cfg.eta, rows="free")
    gaps = []
    for r in range(runs):
        start = committee_state(rec["cross"][r, 0], rec["gram"][r, 0], rec["lam_hat"][r, 0],
                                "free")
        tr = committee_ode(model, start, steps / d, integrator="solve_ivp")
        gaps.append(np.concatenate([(rec["gram"][r] - tr.Q).reshape(len(steps), -1),
                                    (np.swapaxes(rec["cross"][r], -1, -2) - tr.R).reshape(
                                        len(steps), -1)], axis=1))
    gaps = np.asarray(gaps)[:, 1:]
    z = gaps.mean(0) / (gaps.std(0, ddof=1) / math.sqrt(runs))
    assert np.all(np.abs(z) < 4.0), z
    assert np.abs(rec["cross"][:, -1]).max() > 0.3  # R moved off its O(d^{-1/2}) start


def test_nn2pp_mapping_is_exact():
    """nn2pp (lr η̄, ½(y − ŷ)², O(1) weights) = loradyn free rows at η = η̄/(2N), its ε = our
    loss/2: the two ODEs agree to rounding from one initial state."""
    N, lr = 1000, 0.5
    inst = build_instance(committee_spec(d=N, k=2, activation=NN2PP_ERF, lam="ones",
                                         W="orthonormal"))
    from dynamics.overlays.committee import committee_model

    ours = committee_model(inst, loss="squared", eta=lr / (2 * N), rows="free")
    theirs = CommitteeModel(scaled_erf(), np.eye(2), np.ones(2), lr=lr, loss_scale=0.5)
    start = CommitteeState.from_arrays(np.eye(2) + 0.1, 0.01 * np.eye(2) + 0.02)
    alphas = np.array([0.0, 1.0, 10.0, 50.0])
    # the same RK4 on both vector fields: dt = 0.05 (5× cheaper than 0.01, same curves to 1e-8)
    # still separates a mapping off by 0.1% in η̄ (relative loss gap 4e-4 ≫ 1e-12)
    a = committee_ode(ours, start, alphas, integrator="rk4", dt=0.05)
    b = committee_ode(theirs, start, alphas, integrator="rk4", dt=0.05)
    np.testing.assert_allclose(a.loss / 2, b.loss, rtol=1e-12)
    np.testing.assert_allclose(a.alignment, b.alignment, rtol=1e-12)


# ---------------------------------------------------------------- bad input, CLI
@pytest.mark.parametrize("learner, kw, name", [
    ("scratch", {"rows": "diagonal"}, "rows"),
    ("scratch", {"init_scale": 2.0, "rows": "unit"}, "init_scale"),
    ("scratch", {"init_scale": -1.0}, "init_scale"),
    ("scratch", {"width": 0}, "width"),
    ("scratch-csq", {"train_second_layer": True}, "train_second_layer"),
    ("sparse", {"rows": "free"}, "rows"),
])
def test_bad_free_row_options_are_one_line_errors(learner, kw, name):
    spec = {"activation": "relu", "k": 2, "d": 20, "seed": 1}
    with pytest.raises(ConfigError) as err:
        RunConfig(instance=spec, learner=learner, eta=0.01, steps=10, **kw).validate()
    assert name in str(err.value) and "\n" not in str(err.value)


@pytest.fixture
def nn2pp_spec(tmp_path):
    path = tmp_path / "nn2pp.json"
    path.write_text(json.dumps({"activation": NN2PP_ERF, "teacher": "committee", "k": 2,
                                "d": 200, "W": "orthonormal"}))
    return str(path)


def test_cli_free_rows_json_matches_the_recorded_ode(nn2pp_spec, tmp_path):
    out_h5 = tmp_path / "r.h5"
    res = CliRunner().invoke(cli, ["run", nn2pp_spec, "--learner", "scratch", "--rows", "free",
                                   "--eta", "0.00125", "--steps", "400", "--runs", "1",
                                   "--seed", "5", "--checkpoints", "6", "--engine", "full",
                                   "--out", str(out_h5),
                                   "--plot", str(tmp_path / "r.png")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "r.png").stat().st_size > 10_000
    import h5py

    with h5py.File(out_h5) as f:
        steps = f["steps"][:]
        ode = f["extra/ode_loss"][0]
        assert f["extra/ode_loss"].attrs["rows"] == "free"
    res = CliRunner().invoke(cli, ["hermite", "committee", nn2pp_spec, "--rows", "free",
                                   "--eta", "0.00125", "--steps", "400", "--seed", "5",
                                   "--checkpoints", "6", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["rows"] == "free" and out["alpha"][-1] == pytest.approx(2.0)
    assert out["loss"][0] == pytest.approx(ode[0], rel=1e-12)
    got = np.interp(steps, out["steps"], out["loss"])
    assert got[-1] == pytest.approx(ode[-1], rel=1e-9)


@pytest.mark.parametrize("args, message", [
    (["--rows", "free", "--learner", "sparse"], "--rows is not an option of learner 'sparse'"),
    (["--rows", "free", "--init-scale", "0"], "init_scale"),
    (["--integrals", "closed", "--learner", "scratch"], None),
])
def test_cli_committee_bad_input(nn2pp_spec, tmp_path, args, message):
    res = CliRunner().invoke(cli, ["hermite", "committee", nn2pp_spec, "--eta", "0.001",
                                   "--steps", "10", *args])
    if message is None:  # erf has closed forms: --integrals closed works
        assert res.exit_code == 0, res.output
        return
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1 and message in lines[0], res.output


def test_cli_integrals_closed_without_closed_forms_is_one_line_error(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"activation": "sigmoid", "teacher": "committee", "k": 2,
                                "d": 50}))
    res = CliRunner().invoke(cli, ["hermite", "committee", str(path), "--eta", "0.001",
                                   "--steps", "10", "--integrals", "closed"])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1 and "closed-form" in lines[0], res.output


def test_run_learns_a_committee_teacher_from_scratch_by_default(nn2pp_spec, tmp_path):
    """No --learner: a committee teacher gets scratch (finetune cannot learn it); a fine-tuned
    teacher still gets finetune."""
    import h5py

    out = tmp_path / "c.h5"
    res = CliRunner().invoke(cli, ["run", nn2pp_spec, "--rows", "free", "--steps", "50",
                                   "--runs", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    with h5py.File(out) as f:
        assert f.attrs["learner"] == "scratch"
    ft = tmp_path / "ft.json"
    ft.write_text(json.dumps({"activation": "relu", "k": 2, "d": 20}))
    res = CliRunner().invoke(cli, ["run", str(ft), "--steps", "50", "--runs", "2",
                                   "--out", str(tmp_path / "f.h5")])
    assert res.exit_code == 0, res.output
    with h5py.File(tmp_path / "f.h5") as f:
        assert f.attrs["learner"] == "finetune"


def test_example_nn2pp_spec_is_the_documented_setting(tmp_path):
    """examples/nn2pp_default.toml: nn2pp's default teacher; a short run of its documented
    command (fewer steps and runs) writes SGD and ODE curves that start together."""
    from pathlib import Path

    import h5py

    from dynamics.instances.instance import load_spec

    path = Path(__file__).resolve().parents[1] / "examples" / "nn2pp_default.toml"
    spec = load_spec(path)
    assert spec == {"activation": NN2PP_ERF, "teacher": "committee", "k": 2, "d": 2000,
                    "W": "gaussian"}
    out = tmp_path / "n.h5"
    res = CliRunner().invoke(cli, ["run", str(path), "--rows", "free", "--eta", "0.000125",
                                   "--steps", "2000", "--runs", "2", "--streams", "counter",
                                   "--instance-seeds", "per_run", "--out", str(out)])
    assert res.exit_code == 0, res.output
    with h5py.File(out) as f:
        assert f.attrs["learner"] == "scratch"
        np.testing.assert_allclose(f["extra/ode_loss"][:, 0], f["loss"][:, 0], rtol=1e-10)
