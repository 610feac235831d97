"""The network learners' exact overlap chain (``dynamics.reduced.network_chain``, issue 24).

Independent truths: (1) one chain step on given variates against the full learner's own step
on explicit d-dimensional rows and examples (the derivation's reduction (N1)–(N5), to
rounding); (2) the law of whole runs against the full engine (two-sample KS tests at d = 30
and d = 300, every variant), and a deliberately wrong χ² degree rejected; (3) first passages
against the dense trajectory of the same streams.
"""

from __future__ import annotations

import math
import os

import chain_runs
import numpy as np
import pytest
import torch
from scipy import stats

from dynamics.engines.engine import simulate
from dynamics.engines.resolve import resolve_run
from dynamics.learners import get_learner
from dynamics.learners.network import lq_factor
from dynamics.learners.problem import Problem
from dynamics.reduced import network_chain as nc
from dynamics.reduced import reduced_supported
from dynamics.setup.config import RunConfig

FINETUNED = {"activation": "relu", "k": 2, "xi": 1.0, "seed": 3}
COMMITTEE = {"activation": "erf", "k": 2, "teacher": "committee", "seed": 2}

# name → (learner, instance, options)
VARIANTS = {
    "unit": ("scratch", FINETUNED, {}),
    "free": ("scratch", FINETUNED, {"rows": "free", "init_scale": 0.5}),
    "trained": ("scratch", FINETUNED, {"train_second_layer": True, "width": 3}),
    "csq": ("scratch-csq", FINETUNED, {}),
    "batch4-noise": ("scratch", FINETUNED, {"batch": 4, "label_noise": 0.1}),
    "committee-free": ("scratch", COMMITTEE, {"rows": "free"}),
    "committee-unit": ("scratch", {**COMMITTEE, "activation": "relu"}, {}),
    "sparse": ("sparse", {**FINETUNED, "k": 3}, {"sparse_rows": 2}),
}


def config_of(variant: str, d: int, **fields) -> RunConfig:
    learner, inst, opts = VARIANTS[variant]
    base = dict(learner=learner, instance={**inst, "d": d}, eta=0.5 / d, runs=4, steps=10,
                seed=7, finite_d_theory=False)
    return RunConfig(**{**base, **opts, **fields})


# ---------------------------------------------------------------- 1. one step, exactly
def full_and_chain_step(variant: str, d: int, seed: int):
    """The full learner's step from explicit rows and examples, and the chain's step from
    the same point and examples written in the chain's coordinates: both (cross, Gram, λ̂)."""
    config = config_of(variant, d, runs=1)
    run = resolve_run(config)
    inst = run.run_instances[0]
    problem = Problem.from_instances([inst], "cpu", torch.float64)
    learner = get_learner(config.learner).from_config(config, problem)
    rng = np.random.default_rng(seed)
    state, _ = learner.initial_state(config, [inst])
    width, b = learner.width, config.batch
    rows = rng.standard_normal((width, d))
    if not learner.free:
        rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    if variant == "sparse":  # frozen rows start at W's rows, the tuned one anywhere
        rows[~learner.mask[0].numpy()] = state.rows[0][~learner.mask[0]].numpy()
    state.rows = torch.as_tensor(rows[None].copy())
    state.lam_hat = torch.as_tensor(rng.standard_normal((1, width)))
    x = torch.as_tensor(rng.standard_normal((1, 1, b, d)))
    eps = torch.as_tensor(rng.standard_normal((1, 1, b)))
    pre = learner.prepare(state, x, eps)
    before = learner.observe(state)
    learner.step_prepared_(state, x[:, 0], pre, 0)
    after = learner.observe(state)

    v = learner.teacher_rows().numpy()[0]
    t = inst.k + 1 if np.abs(v[:, inst.k]).max() > 0 else inst.k
    q, r = np.linalg.qr(rows[:, t:].T)  # outside parts = Z Qᵀ, Z = Rᵀ
    xs = x[0, 0].numpy()
    xe = xs[:, t:] @ q
    perp = xs[:, t:] - xe @ q.T  # the rest parts: Λ Q₂ᵀ
    _q2, r2 = np.linalg.qr(perp.T)
    storage = nc.storage_width(width, b)
    Z = np.zeros((width, storage))
    Z[:, :width] = r.T
    hyp = nc.make_net_hyper(nc.NetSettings(_code(inst), learner.loss_name == "correlation",
                                           learner.free, learner.train_second_layer,
                                           config.eta, config.step_size_c,
                                           math.sqrt(config.label_noise), b, d - t), 1)
    xe_full = np.zeros((b, storage))
    xe_full[:, :width] = xe
    P, Z, m, lam_hat, status = nc.step_given(
        hyp, v[:, :t], inst.lam, rows[:, :t], Z, width, state_lam(before), learner.mask[0]
        .double().numpy(), nc.GivenExamples(xs[:, :t], xe_full, r2.T,
                                            math.sqrt(config.label_noise) * eps[0, 0].numpy()))
    chain = {"cross": v[:, :t] @ P.T, "gram": P @ P.T + Z[:, :m] @ Z[:, :m].T,
             "lam_hat": lam_hat}
    return {n: a[0] for n, a in after.items()}, chain, status


def state_lam(obs) -> np.ndarray:
    return obs["lam_hat"][0]


def _code(inst):
    from hermite.activations_numba import compiled_activation

    return compiled_activation(inst.activation)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("d", [12, 40])
def test_one_chain_step_is_the_full_step_in_overlap_coordinates(variant, d):
    for seed in range(3):
        full, chain, status = full_and_chain_step(variant, d, seed)
        assert status == 0
        for name in ("cross", "gram", "lam_hat"):
            np.testing.assert_allclose(chain[name], full[name], rtol=1e-10, atol=1e-12,
                                       err_msg=f"{variant}, d = {d}, {name}")


def test_compression_keeps_the_gram_and_renormalises_unit_rows():
    rng = np.random.default_rng(0)
    P, Z = rng.standard_normal((3, 4)), rng.standard_normal((3, 9))
    gram = P @ P.T + Z @ Z.T
    hv = np.empty(9)
    P2, Z2 = P.copy(), Z.copy()
    m = nc._compress(P2, Z2, 9, True, hv)  # free rows: nothing renormalised
    assert m == 3 and not Z2[:, 3:].any()
    np.testing.assert_allclose(P2, P)
    np.testing.assert_allclose(P2 @ P2.T + Z2[:, :3] @ Z2[:, :3].T, gram, rtol=1e-12)
    assert np.allclose(np.triu(Z2[:, :3], 1), 0)  # lower triangular: the L of Z = L Qᵀ
    m = nc._compress(P, Z, 9, False, hv)
    norms = (P ** 2).sum(1) + (Z[:, :m] ** 2).sum(1)
    np.testing.assert_allclose(norms, 1.0, rtol=1e-14)


def test_lq_factor_has_the_gram_of_its_rows_and_pads_narrow_ones():
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((3, 50))
    z = lq_factor(rows, 7)
    assert z.shape == (3, 7) and not z[:, 3:].any()
    np.testing.assert_allclose(z @ z.T, rows @ rows.T, rtol=1e-12)
    narrow = lq_factor(rows[:, :2], 7)
    np.testing.assert_allclose(narrow @ narrow.T, rows[:, :2] @ rows[:, :2].T, atol=1e-12)


# ---------------------------------------------------------------- support and errors
def test_the_chain_covers_every_network_variant_and_auto_takes_it():
    for variant in VARIANTS:
        config = config_of(variant, 300, engine="auto")
        assert reduced_supported(config) == (True, ""), variant
        assert resolve_run(config).engine == "reduced", variant


def test_where_the_chain_is_not_exact_it_says_why_in_one_line():
    small = config_of("unit", 5, engine="auto")  # d < k + 1 + k′ + b
    ok, why = reduced_supported(small)
    assert not ok and "d ≥ k + 1 + k′ + b = 6" in why and "\n" not in why
    assert resolve_run(small).engine == "full"
    with pytest.raises(ValueError, match="d ≥ k"):
        simulate(config_of("unit", 5, engine="reduced"))


# ---------------------------------------------------------------- 2. the same law
LAW_RUNS = 400
LAW_P = 1e-4  # per comparison (fixed seeds: each test is deterministic)


def law_config(variant: str, d: int, engine: str, seed: int = 11) -> RunConfig:
    """~1.5·d steps at η = 0.8/d: every variant moves well away from its start. The full
    engine on its counter streams (their law is the default streams':
    tests/test_learner_network_fast.py::test_counter_streams_same_law_ks)."""
    return config_of(variant, d, engine=engine, runs=LAW_RUNS, steps=int(1.5 * d),
                     checkpoints=3, eta=0.8 / d, seed=seed, streams="counter")


def ks_pvalues(a, b) -> dict:
    """(quantity, checkpoint) → two-sample KS p-value of the loss and alignment."""
    return chain_runs.ks_pvalues(a, b, {"loss": lambda t: t.loss,
                                        "overlap": lambda t: t.overlap})


@pytest.mark.parametrize("d", [30, 300])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chain_has_the_law_of_the_full_engine(variant, d):
    chain = simulate(law_config(variant, d, "reduced"))
    full = simulate(law_config(variant, d, "full", seed=12))
    assert chain.engine == "reduced" and full.engine == "full"
    assert np.isfinite(chain.loss).all() and (chain.diverged_step < 0).all()
    moved = np.median(np.abs(chain.loss[:, -1] - chain.loss[:, 0]))
    assert moved > 0.02, f"{variant}: the runs barely moved ({moved:.3g}), no test of the step"
    p = ks_pvalues(chain, full)
    assert min(p.values()) > LAW_P, {k: round(v, 6) for k, v in p.items()}


def test_a_wrong_chi2_degree_is_rejected():
    """The same comparison has the power to see a wrong rest dimension (N3): d − t → (d − t)/3
    changes the retraction's normalisation (and for free rows the rest's share of ‖G‖²)."""
    from dynamics.reduced.network_simulate import NetworkChain

    d = 300
    for variant in ("unit", "free"):
        config = law_config(variant, d, "reduced")
        wrong = NetworkChain().simulate(config, _chi2_dof=(d - 3) // 3)
        full = simulate(law_config(variant, d, "full", seed=12))
        assert min(ks_pvalues(wrong, full).values()) < 1e-6, variant


# ---------------------------------------------------------------- 3. first passages
@pytest.mark.parametrize("variant", ["unit", "free", "sparse"])
def test_first_passages_are_the_dense_trajectory_s_crossings(variant):
    from dynamics.reduced.network_simulate import NetworkChain

    d, steps = 40, 120
    config = config_of(variant, d, runs=16, steps=steps, checkpoints=steps + 1,
                       spacing="linear", eta=1.0 / d)
    traj = NetworkChain().simulate(config)
    assert np.array_equal(traj.steps, np.arange(steps + 1))
    never = traj.overlap.max() + 1e-9
    levels = [*np.quantile(traj.overlap.max(1), [0.3, 0.7]), never]  # some runs, not all
    hits = NetworkChain().first_passages(config, levels)
    for level, hit in zip(levels, hits, strict=True):
        above = traj.overlap >= level
        want = np.where(above.any(1), above.argmax(1).astype(float), np.nan)
        np.testing.assert_array_equal(hit, want)
    assert (hits[:2] > 0).any() and np.isnan(hits[2]).all()


@pytest.mark.parametrize("variant, activation", [("unit", "relu"), ("unit", "he3"),
                                                 ("csq", "tanh"), ("trained", "relu")])
def test_loss_first_passages_are_the_dense_trajectory_s_crossings(variant, activation):
    """The kernel's every-step exact loss (power series for He₃, the Chebyshev interpolant in
    θ otherwise) crosses where the learner's own exact loss (hermite dual kernels) does."""
    from dynamics.reduced.network_simulate import NetworkChain

    d, steps = 40, 150
    learner, inst, opts = VARIANTS[variant]
    config = RunConfig(learner=learner, instance={**inst, "d": d, "activation": activation},
                       runs=16, steps=steps, checkpoints=steps + 1, spacing="linear",
                       eta=1.0 / d, seed=7, finite_d_theory=False, **opts)
    traj = NetworkChain().simulate(config)
    never = traj.loss.min() - 1e-9
    levels = [*np.quantile(traj.loss.min(1), [0.3, 0.7]), never]
    hits = NetworkChain().first_passages(config, levels, quantity="loss")
    for level, hit in zip(levels, hits, strict=True):
        below = traj.loss <= level
        want = np.where(below.any(1), below.argmax(1).astype(float), np.nan)
        np.testing.assert_array_equal(hit, want)
    assert (hits[:2] > 0).any() and np.isnan(hits[2]).all()


@pytest.mark.parametrize("activation", ["he3", "tanh"])
def test_long_loss_first_passages_with_carried_overlaps_are_the_dense_crossings(activation):
    """Over several RESYNC periods (b = 1: the overlaps carried along the steps, the loss
    evaluated only where its bound or the carried loss comes near the level; He₃ by the power
    series with the |K′| bound, tanh by the interpolant without it), the hits are the
    crossings of the learner's own exact loss recorded after every step."""
    from dynamics.reduced.network_simulate import NetworkChain

    d, steps = 60, 4 * nc.RESYNC + 37
    config = RunConfig(learner="scratch", instance={"activation": activation, "k": 4, "d": d,
                                                    "xi": 1.0, "W": "claim2", "seed": 0,
                                                    "c_hat": "teacher"},
                       runs=12, steps=steps, checkpoints=steps + 1, spacing="linear",
                       eta=2.0 / d, seed=5, finite_d_theory=False)
    traj = NetworkChain().simulate(config)
    low = traj.loss.min(1)
    assert (traj.loss[:, :steps // 2].min(1) > np.quantile(low, 0.5)).mean() > 0.3  # late hits
    levels = [*np.quantile(low, [0.2, 0.5, 0.8]), low.min() - 1e-9]
    hits = NetworkChain().first_passages(config, levels, quantity="loss")
    for level, hit in zip(levels, hits, strict=True):
        below = traj.loss <= level
        want = np.where(below.any(1), below.argmax(1).astype(float), np.nan)
        np.testing.assert_array_equal(hit, want)
    assert (hits[:3] > nc.RESYNC).any() and np.isnan(hits[3]).all()


def test_kernel_slope_bound_bounds_the_derivative_of_the_power_series():
    from dynamics.instances.instance import build_instance
    from dynamics.reduced.network_simulate import kernel_series

    mode, coef, _ = kernel_series(build_instance({"activation": "he4", "k": 2, "d": 10})
                                  .activation)
    assert mode == nc.KERNEL_MODES["power"]
    rho = np.linspace(-1, 1, 2001)
    slope = np.abs(np.polynomial.polynomial.polyval(rho, np.polynomial.polynomial.polyder(coef)))
    bound = nc.kernel_slope_bound(mode, coef)
    assert slope.max() <= bound + 1e-12 and slope.max() >= 0.99 * bound  # tight at ρ = 1
    assert nc.kernel_slope_bound(nc.KERNEL_MODES["chebyshev_theta"], coef) == math.inf


def test_loss_levels_need_unit_rows_and_a_fine_tuned_teacher():
    from dynamics.reduced.network_simulate import NetworkChain

    for variant in ("free", "committee-unit"):
        with pytest.raises(ValueError, match="unit rows and a fine-tuned teacher only"):
            NetworkChain().first_passages(config_of(variant, 40), [0.1], quantity="loss")


def test_initial_trajectory_is_the_start_simulate_records():
    from dynamics.reduced.network_simulate import NetworkChain

    config = config_of("trained", 40, runs=6)
    start = NetworkChain().initial_trajectory(config)
    full = NetworkChain().simulate(config)
    assert list(start.steps) == [0]
    np.testing.assert_allclose(start.loss[:, 0], full.loss[:, 0], rtol=1e-13)
    np.testing.assert_array_equal(start.overlap[:, 0], full.overlap[:, 0])
    np.testing.assert_array_equal(start.m0, full.m0)


def test_cli_reduced_where_not_exact_is_one_line_and_keeps_files(runner):
    from pathlib import Path

    from sims.cli import cli

    Path("x.h5").write_bytes(b"earlier results")
    args = ["run", "spec.toml", "--learner", "scratch", "--steps", "50", "--runs", "2"]
    res = runner.invoke(cli, [*args, "--engine", "reduced", "--set", "d=7", "--out", "x.h5",
                              "--force"])
    assert res.exit_code != 0
    assert "d ≥ k + 1 + k′ + b = 8" in res.output and len(res.output.strip().splitlines()) == 1
    assert Path("x.h5").read_bytes() == b"earlier results"
    res = runner.invoke(cli, [*args, "--engine", "auto", "--out", "y.h5"])
    assert res.exit_code == 0, res.output
    from sims.io import read_trajectory

    traj, meta = read_trajectory("y.h5")
    assert traj.engine == "reduced" and np.isfinite(traj.loss).all()


# ---------------------------------------------------------------- 4. the CUDA kernel
CUDA_SCRIPT = '''
import sys, warnings
import numpy as np
warnings.simplefilter("ignore")  # uint64 wrap-around of the interpreted RNG
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests")
from test_network_chain import advance_cuda_case
np.savez(sys.argv[2], **{f"{n}:{i}": a for n in sys.argv[3:]
                         for i, a in enumerate(advance_cuda_case(n, "numba-cuda"))})
'''
CUDA_CASES = ("unit", "batch4-noise", "committee-free", "sparse")


def advance_cuda_case(variant: str, backend: str):
    """A few steps of ``variant`` through the chain's driver on ``backend``: the records,
    streams, widths and the alignment stop's hit steps."""
    from dynamics.reduced.network_simulate import ChainStart, NetworkChain

    config = config_of(variant, 30, runs=3, steps=12, eta=0.05)
    chain = NetworkChain()
    start = ChainStart(config, config.run_instances())
    runs, rec = chain._advance(start, np.array([0, 5, 12]), 12, backend=backend)
    level = float(start.alignment().max()) + 0.01
    start = ChainStart(config, config.run_instances())
    stop, _ = chain._advance(start, np.zeros(0, np.int64), 12, stop_kind="alignment",
                             stop_level=level, backend=backend)
    return (rec.cross, rec.gram, rec.lam_hat, runs.states.astype(np.float64),
            runs.m.astype(np.float64), stop.hit_step.astype(np.float64))


def test_cuda_kernel_in_simulator_equals_cpu_kernel(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBA_DISABLE_JIT="1")
    out = tmp_path / "cuda.npz"
    proc = subprocess.run([sys.executable, "-c", CUDA_SCRIPT, root, str(out), *CUDA_CASES],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim = np.load(out)
    for name in CUDA_CASES:
        cpu = advance_cuda_case(name, "numba")
        assert np.ptp(cpu[0][:, -1]) > 0, name  # the runs really moved apart
        for i, ref in enumerate(cpu):
            np.testing.assert_allclose(sim[f"{name}:{i}"], ref, rtol=1e-12, atol=1e-13,
                                       err_msg=f"{name}, array {i}")


@pytest.mark.skipif(not os.environ.get("LORADYN_TEST_CUDA"), reason="set LORADYN_TEST_CUDA=1 "
                    "on a machine with a GPU")
def test_cuda_kernel_on_device_equals_cpu_kernel():  # pragma: no cover - needs a GPU
    for name in CUDA_CASES:
        for i, (gpu, cpu) in enumerate(zip(advance_cuda_case(name, "numba-cuda"),
                                           advance_cuda_case(name, "numba"), strict=True)):
            np.testing.assert_allclose(gpu, cpu, rtol=1e-9, atol=1e-12,
                                       err_msg=f"{name}, array {i}")


def test_cuda_backend_needs_a_cuda_device():
    from dynamics.reduced.network_simulate import NetworkChain

    with pytest.raises(ValueError, match="numba-cuda backend runs on device 'cuda' only"):
        NetworkChain().simulate(config_of("unit", 30), backend="numba-cuda")
    with pytest.raises(ValueError, match="backend must be one of numba, numba-cuda"):
        NetworkChain().simulate(config_of("unit", 30), backend="torch")


def test_committee_teacher_reduces_down_to_d_k_plus_width_plus_b():
    """A committee teacher's rows lie in span W (t = k), so the chain covers d = k + k′ + b:
    there its law is the full engine's (KS on the loss, 256 runs each); one less is refused."""
    from dynamics.reduced import reduced_supported

    spec = {"activation": "erf(x/sqrt2)", "k": 2, "d": 5, "teacher": "committee",
            "W": "orthonormal", "seed": 0}
    cfg = RunConfig(instance=spec, learner="scratch", rows="free", eta=0.1, steps=200,
                    runs=256, seed=0, checkpoints=5, engine="reduced", finite_d_theory=False)
    assert reduced_supported(cfg) == (True, "")
    red = simulate(cfg)
    full = simulate(RunConfig(**(cfg.to_dict() | {"engine": "full"})))
    assert red.engine == "reduced" and full.engine == "full"
    for j in range(1, 5):
        assert stats.ks_2samp(red.loss[:, j], full.loss[:, j]).pvalue > 1e-3
    ok, why = reduced_supported(RunConfig(**(cfg.to_dict() | {"instance": spec | {"d": 4}})))
    assert not ok and "d ≥ k + k′ + b = 5" in why


def test_fused_pass_gives_the_two_pass_numbers():
    """Wide rows (k′(t + 2k′ + 1) ≥ FUSE_MIN, b = 1) take the next step's fields in the pass
    that updates the rows; a stop rule (here one never met) turns that off. Both draw the same
    numbers in the same order, so the records agree to rounding and the streams exactly."""
    from dynamics.reduced.network_simulate import ChainStart, NetworkChain

    spec = {"activation": "erf(x/sqrt2)", "k": 2, "d": 500, "teacher": "committee",
            "W": "orthonormal", "seed": 0}
    config = RunConfig(instance=spec, learner="scratch", rows="free", width=32, eta=0.5 / 500,
                       steps=300, runs=3, seed=0, checkpoints=3,
                       finite_d_theory=False).validate()
    assert 32 * (2 + nc.storage_width(32, 1)) >= nc.FUSE_MIN
    chain, steps = NetworkChain(), np.array([0, 97, 300])
    fused, rec_f = chain._advance(ChainStart(config, config.run_instances()), steps, 300)
    plain, rec_p = chain._advance(ChainStart(config, config.run_instances()), steps, 300,
                                  stop_kind="alignment", stop_level=2.0)
    np.testing.assert_array_equal(fused.states, plain.states)
    np.testing.assert_array_equal(fused.m, plain.m)
    assert np.ptp(rec_f.cross[:, -1]) > 0  # the runs moved apart
    for a, b in ((rec_f.cross, rec_p.cross), (rec_f.gram, rec_p.gram)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
