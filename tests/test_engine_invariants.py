"""Invariants of the full engine: sphere, subspace, batch == single runs, determinism, NaN."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from dynamics import learners
from dynamics.engines import engine
from dynamics.engines.engine import FullRun, chunk_schedule, simulate
from dynamics.randomness import chunking, sampling
from dynamics.setup import config as config_mod
from dynamics.setup.config import RunConfig


def _config(**kw) -> RunConfig:
    base = {"instance": {"activation": "relu", "k": 3, "d": 24, "xi": 1.0, "seed": 9},
            "eta": 0.05 / 24, "steps": 300, "runs": 4, "seed": 5, "checkpoints": 8}
    base.update(kw)
    return RunConfig(**base)


@pytest.mark.parametrize("project", [True, False], ids=["proj", "noproj"])
def test_unit_norm_and_subspace_after_1e4_steps(project, dtype_tol, device):
    dtype, tol = dtype_tol
    run = FullRun(_config(steps=10_000, runs=8, project=project, joint_c=not project,
                          dtype=dtype, device=device, checkpoints=3))
    run.run()
    u = run.state.u_hat.double().cpu()
    assert float((u.norm(dim=1) - 1).abs().max()) <= tol
    if project:  # never touched: exactly ⊥ span W = the first k coordinates
        assert float(u[:, :3].abs().max()) == 0.0
    else:
        assert float(u[:, :3].abs().max()) > 1e-6  # the unprojected learner does leave it


def test_run_r_does_not_depend_on_the_other_runs():
    """Run r's streams depend on (seed, r) only: the first runs of a bigger batch replay."""
    small = simulate(_config(runs=2))
    big = simulate(_config(runs=5))
    np.testing.assert_allclose(big.overlap[:2], small.overlap, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(big.m0[:2], small.m0)


def test_batch_equals_loop_of_single_runs_at_the_learner_level():
    """Same examples → a batch of R runs equals R separate single-run steps."""
    run = FullRun(_config(runs=3, joint_c=True))
    x = torch.randn(3, 1, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    batch = run.learner.step(run.state, x)
    for r in range(3):
        single = FullRun(_config(runs=1, joint_c=True))
        single.state.u_hat[0] = run.state.u_hat[r]
        out = single.learner.step(single.state, x[r: r + 1])
        torch.testing.assert_close(out.u_hat[0], batch.u_hat[r], rtol=0, atol=1e-15)
        torch.testing.assert_close(out.c_hat[0], batch.c_hat[r], rtol=0, atol=1e-15)


def test_same_config_same_numbers():
    a, b = simulate(_config(joint_c=True)), simulate(_config(joint_c=True))
    for name in ("overlap", "loss", "ode", "c_overlap", "m0", "diverged_step"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    c = simulate(_config(joint_c=True, seed=6))
    assert not np.array_equal(a.overlap, c.overlap)


def test_chunking_and_checkpoints_do_not_change_the_numbers(monkeypatch):
    """Same examples whatever the chunking; only the exact renormalisation points move (ulps)."""
    ref = simulate(_config(checkpoints=4))
    monkeypatch.setattr(chunking, "MAX_CHUNK_STEPS", 7)
    other = simulate(_config(checkpoints=30))
    assert sampling.NoiseSource(sampling.NoiseStreams(0), 1, 1, 24,
                                device=torch.device("cpu"),
                                dtype=torch.float64).chunk_steps == 7
    common = np.isin(other.steps, ref.steps)
    np.testing.assert_allclose(other.overlap[:, common], ref.overlap, rtol=0, atol=1e-13)


def test_noise_stream_is_split_invariant():
    """torch's CPU sampler yields the same per-run stream for any split into 16-multiples."""
    def draw(chunk):
        src = sampling.NoiseSource(sampling.NoiseStreams(3), 2, 1, 20,
                                   device=torch.device("cpu"), dtype=torch.float32,
                                   chunk_steps=chunk)
        out = [buf.clone() for buf, _ in src.chunks([chunk] * (12 // chunk))]
        src.close()
        return torch.cat(out, dim=1)

    assert torch.equal(draw(12), draw(4)) and torch.equal(draw(3), draw(12))


def test_shared_stream_draws_all_runs_at_once_deterministically():
    """streams = shared: one generator for every run (the CUDA default), N(0, 1), seeded."""
    def draw(seed, runs=64, d=40, per_run=False, sq=None):
        kind = "per_run" if per_run else "shared"
        with sampling.NoiseSource(sampling.NoiseStreams(seed, kind), runs, 2, d,
                                  device=torch.device("cpu"), dtype=torch.float64,
                                  chunk_steps=8, sqnorm_cols=sq) as src:
            return [(buf.clone(), None if n is None else n.clone())
                    for buf, n in src.chunks([8, 8, 5])]

    a, b = draw(1), draw(1)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], draw(2)[0][0])
    assert not torch.equal(a[0][0], draw(1, per_run=True)[0][0])
    x = torch.cat([buf[:, :, :, :40] for buf, _ in a], dim=1)  # (64, 21, 2, 40)
    n = x.numel()
    assert abs(x.mean().item()) < 4 / n**0.5 and abs(x.var().item() - 1) < 4 * (2 / n) ** 0.5
    buf, sqn = draw(3, sq=(0, 40))[2]
    torch.testing.assert_close(sqn, buf[..., :40].square().sum(-1))
    # different runs and steps carry different numbers (not one block repeated)
    assert not torch.equal(x[0], x[1]) and not torch.equal(x[:, 0], x[:, 1])


def test_engine_with_shared_streams_is_reproducible_and_valid():
    ref = simulate(_config(streams="shared"))
    again = simulate(_config(streams="shared"))
    np.testing.assert_array_equal(ref.overlap, again.overlap)
    per_run = simulate(_config(streams="per_run"))
    np.testing.assert_array_equal(per_run.overlap, simulate(_config()).overlap)  # auto on CPU
    assert not np.array_equal(ref.overlap, per_run.overlap)
    assert np.isfinite(ref.overlap).all() and np.ptp(ref.overlap[:, -1]) > 0
    with pytest.raises(config_mod.ConfigError, match="streams"):
        _config(streams="per-chunk").validate()


def test_diverged_run_is_marked_frozen_and_isolated(monkeypatch):
    clean = simulate(_config(steps=200))
    original = learners.Finetune.step_prepared_

    def poisoned(self, state, x, pre, i):
        if state.step == 37:
            state.u_hat[1, 5] = float("nan")
        return original(self, state, x, pre, i)

    monkeypatch.setattr(learners.Finetune, "step_prepared_", poisoned)
    traj = simulate(_config(steps=200))
    assert traj.diverged_step.tolist() == [-1, 38, -1, -1]
    keep = [0, 2, 3]
    np.testing.assert_array_equal(traj.overlap[keep], clean.overlap[keep])
    after = traj.steps >= 38
    assert np.isnan(traj.overlap[1, after]).all() and np.isfinite(traj.overlap[1, ~after]).all()
    assert np.isfinite(traj.loss[keep]).all()


def test_all_runs_diverge_with_absurd_step_size():
    traj = simulate(_config(eta=1e300, steps=50))
    assert (traj.diverged_step > 0).all()
    assert np.isnan(traj.overlap[:, -1]).all()
    assert traj.summary()["diverged"] == 4


def test_aligned_init_and_m0():
    traj = simulate(_config(init="aligned", runs=16))
    import hermite

    sign = np.sign(float(np.asarray(hermite.h(FullRun(_config()).instances[0], 0.0))))
    assert (traj.m0 * sign > 0).all()
    np.testing.assert_allclose(traj.overlap[:, 0], traj.m0, atol=1e-15)
    np.testing.assert_allclose(traj.ode[:, 0], traj.m0, atol=1e-15)


def test_per_run_instances_and_xi_values():
    traj = simulate(_config(runs=4, instance_seeds="per_run", xi_values=[0.5, 2.0]))
    assert traj.xi.tolist() == [0.5, 0.5, 2.0, 2.0]
    assert traj.instance_seed.tolist() == [9, 10, 11, 12]
    assert np.isfinite(traj.ode).all() and np.isfinite(traj.loss).all()


def test_loss_kinds_and_theory_availability():
    proj = simulate(_config(joint_c=True))
    assert proj.loss_kind == "exact" and np.isfinite(proj.ode).all()  # plain O(η) ODE
    assert proj.c_overlap is not None and np.isfinite(proj.c_overlap).all()
    noproj = simulate(_config(project=False, eval_size=2000))
    assert noproj.loss_kind == "exact" and np.isfinite(noproj.ode).all()  # from û's coords
    assert noproj.c_overlap is None and np.isfinite(noproj.loss).all()


def test_monte_carlo_loss_agrees_with_exact_loss_when_both_apply():
    from dynamics.measures.losses import exact_loss, monte_carlo_loss
    from dynamics.measures.observables import reduced_coordinates

    run = FullRun(_config(runs=3))
    coords = reduced_coordinates(run.state.u_hat, 3)[:, None, :]
    overlap = run.problem.overlap(run.state.u_hat).numpy()[:, None]
    c_hat = np.stack([i.c_hat for i in run.instances])
    mc = monte_carlo_loss(run.instances, coords, c_hat, seed=0, size=200_000)
    ex = exact_loss(run.instances, overlap)
    np.testing.assert_allclose(mc, ex, rtol=0.02)


def test_registry_and_dispatch(monkeypatch):
    assert tuple(learners.LEARNERS) == config_mod.LEARNERS
    calls = []
    fake = types.ModuleType("dynamics.reduced")

    class _Chain:  # the runs of an exact chain, driven in segments by the engine
        def __init__(self, run):
            calls.append(run.config.engine)

        def drive(self, **_):
            return self

        def trajectory(self):
            return "reduced-trajectory"

    fake.start_resolved = _Chain
    fake.reduced_supported = lambda cfg: (cfg.options.project,
                                          "" if cfg.options.project else "unprojected")
    monkeypatch.setitem(sys.modules, "dynamics.reduced", fake)
    assert simulate(_config(engine="reduced")) == "reduced-trajectory"
    assert simulate(_config(engine="auto")) == "reduced-trajectory"
    assert engine.choose_engine(_config(engine="auto", project=False)) == "full"
    assert calls == ["reduced", "auto"]


def test_chunk_schedule_covers_every_step():
    sched = chunk_schedule(np.array([0, 1, 5, 40]), 16)
    assert [n for n, _ in sched] == [1, 4, 16, 16, 3]
    assert [end for _, end in sched] == [True, True, False, False, True]


def test_cuda_request_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(ValueError, match="CUDA is not available"):
        simulate(_config(device="cuda"))
