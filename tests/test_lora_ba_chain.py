"""The exact reduced chain of ``lora-ba`` (issue 39, item 3; ``dynamics.reduced.lora_ba_chain``).

Checked against independent truths: one chain step against the learner's explicit R^d step on
the same example, built in an explicit basis from the chain's draws (x = (x_A, E x_E + Q_ρΛₙ));
the chain's law against the full engine's by two-sample KS tests over many runs (ranks 1 and
2, b = 1 and 4, ReLU / erf / tanh, A trained and frozen, LoRA+, label noise, kaiming A,
d = 30 and 300), with a negative control (a wrong Wishart dof) that the same test rejects;
the in-kernel stop rule's overlap against the records' SVD; ``--engine auto``; determinism and
segments (any cut of the horizon gives the same numbers).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import ba_chain_step_example, ks_last_two

from dynamics.engines.choice import engine_reason
from dynamics.engines.engine import simulate
from dynamics.learners import get_learner
from dynamics.reduced.lora_ba_chain import LoraBASettings, LoraBAStart
from dynamics.reduced.segments import Pace, run_to_end
from dynamics.setup.config import RunConfig

F64 = torch.float64
SPEC = {"activation": "relu", "k": 3, "d": 30, "xi": 1.5, "seed": 2}
KS_P = 1e-3  # two-sample KS: the same law passes at this level (three observables × cps)


def _config(**kw) -> RunConfig:
    fields = dict(instance=SPEC, learner="lora-ba", runs=4, eta=0.1, steps=200, checkpoints=4,
                  dtype="float64", finite_d_theory=False) | kw
    return RunConfig(**fields)


def _chain():
    return get_learner("lora-ba").exact_chain()


# ---------------------------------------------------------------------- one step, exactly
@pytest.mark.parametrize("rank,batch,options", [
    (1, 1, {}),
    (2, 4, {"init_b": "gaussian", "b_scale": 0.3, "lr_ratio": 2.5, "alpha": 3.0}),
    (3, 2, {"init_b": "gaussian", "b_scale": 0.2, "init_a": "kaiming", "train_a": False}),
])
def test_step_matches_explicit_rd_step(rank, batch, options):
    inst = {**SPEC, "activation": "tanh", "u_alpha": 0.4, "c": "gaussian", "lam": "random_sign"}
    config = _config(instance=inst, rank=rank, batch=batch, label_noise=0.2, runs=2, **options)
    instances = config.run_instances()
    start = LoraBAStart(config, instances)
    settings = LoraBASettings.from_config(config, instances[0])
    d, t = SPEC["d"], 4
    gen = np.random.default_rng(7)
    run = 1
    b0 = start.state["b"][run].copy()
    if options.get("init_b", "zero") == "zero":  # move B off zero so that every term acts
        b0 = 0.4 * gen.standard_normal(b0.shape)
        start.state["b"][run] = b0
    # the explicit R^d state and example: A = [Z, C Eᵀ], x = (x_A, E x_E + Q_ρ Λₙ)
    (b1, z1, c1, rss), a0, x, draws = ba_chain_step_example(settings, start, run,
                                                            (d, t, rank, batch), gen)
    learner = start.learner
    state = learner.init_state(np.stack([b0] * 2), np.stack([a0] * 2))
    xt = torch.as_tensor(np.stack([x] * 2), dtype=F64)
    eps = torch.as_tensor(np.stack([draws["eps"]] * 2), dtype=F64)
    pre = learner.prepare(state, xt[:, None], eps[:, None])
    health = learner.step_prepared_(state, xt, pre, 0)
    b_ref, a_ref = state.b[0].numpy(), state.a[0].numpy()
    np.testing.assert_allclose(b1, b_ref, rtol=0, atol=1e-10)
    np.testing.assert_allclose(z1, a_ref[:, :t], rtol=0, atol=1e-10)
    np.testing.assert_allclose(c1 @ c1.T, a_ref[:, t:] @ a_ref[:, t:].T, rtol=0, atol=1e-10)
    assert np.allclose(np.tril(c1), c1)
    assert math.isclose(1.0 / math.sqrt(1.0 + rss / batch), float(health[0]), rel_tol=1e-12)
    assert np.abs(b1 - b0).max() > 1e-3  # the step moved
    if options.get("train_a", True):
        assert np.abs(c1 @ c1.T - a0[:, t:] @ a0[:, t:].T).max() > 1e-4  # C₀C₀ᵀ


# ---------------------------------------------------------------------- the law
def _ks(config, *, rest_dof=None, seed=11) -> dict:
    """min over the compared checkpoints (the last two) of the KS p-value, per observable."""
    full = simulate(replace(config, engine="full"))
    red = _chain().simulate(replace(config, engine="reduced", seed=seed), _chi2_dof=rest_dof)
    return ks_last_two(full, red, ("overlap", "update_overlap", "b_norm"))


LAW_CASES = {
    "d30-r1-b1-relu": dict(rank=1, runs=800),
    "d30-r2-b4-erf-frozen-noise-lora+": dict(
        instance={**SPEC, "activation": "erf"}, rank=2, batch=4, train_a=False,
        init_b="gaussian", b_scale=0.2, lr_ratio=2.0, label_noise=0.3, runs=800),
    "d30-r2-b1-tanh-kaiming": dict(instance={**SPEC, "activation": "tanh"}, rank=2,
                                   init_a="kaiming", runs=800),
    "d300-r1-b4-relu-gaussb": dict(instance={**SPEC, "d": 300}, rank=1, batch=4, eta=0.3,
                                   steps=300, init_b="gaussian", b_scale=0.1, runs=500),
    "d300-r2-b1-erf": dict(instance={**SPEC, "d": 300, "activation": "erf"}, rank=2, eta=0.1,
                           steps=600, runs=400),
}


@pytest.mark.parametrize("case", list(LAW_CASES))
def test_law_matches_full_engine(case):
    ps = _ks(_config(**LAW_CASES[case]))
    assert min(ps.values()) > KS_P, ps


def test_law_test_rejects_a_wrong_wishart_dof():
    """Negative control: the rest's Wishart dof 20 instead of d − t − r = 25 (d = 30)."""
    ps = _ks(_config(rank=1, runs=800), rest_dof=20)
    assert min(ps.values()) < 1e-6, ps


# ---------------------------------------------------------------------- stop rule, engine
def test_first_passage_matches_records():
    """The kernel's stop-rule overlap (closed form r = 1, power iteration r = 2) against the
    records' SVD overlap: the first recorded step ≥ level equals the first passage."""
    for rank in (1, 2):
        config = _config(rank=rank, runs=12, steps=150, checkpoints=151, spacing="linear")
        level = 0.5
        hits = _chain().first_passages(config, [level])[0]
        traj = _chain().simulate(config)
        above = np.nan_to_num(traj.overlap) >= level
        ref = np.where(above.any(1), traj.steps[np.argmax(above, 1)], np.nan)
        np.testing.assert_array_equal(hits, ref)
        assert np.isfinite(hits).sum() >= 3


def test_auto_picks_the_chain():
    config = _config(rank=2, engine="auto")
    assert engine_reason(config) == ("reduced", "")
    small = _config(instance={**SPEC, "d": 6}, rank=2, batch=1, engine="auto")
    engine, why = engine_reason(small)
    assert engine == "full" and "d ≥ k + 1 + r + b = 7" in why
    assert simulate(config).engine == "reduced"


def test_deterministic_segments_and_resume():
    config = _config(rank=2, batch=2, runs=5, steps=300, checkpoints=7, init_b="gaussian",
                     b_scale=0.1, label_noise=0.1, engine="reduced")
    one = run_to_end(_chain().start(config), pace=Pace(fixed=10**6)).trajectory()
    again = simulate(config)
    cut = run_to_end(_chain().start(config), pace=Pace(fixed=37)).trajectory()
    for other in (again, cut):
        np.testing.assert_array_equal(one.overlap, other.overlap)
        for name in ("update_overlap", "b_norm", "a_norm", "delta_norm"):
            np.testing.assert_array_equal(one.extra[name], other.extra[name])
        np.testing.assert_array_equal(one.loss, other.loss)
    part = _chain().start(config)  # resume: the state after 111 steps, in a fresh run
    part.advance(111)
    resumed = _chain().start(config)
    resumed.load_run_state(part.run_state())
    np.testing.assert_array_equal(run_to_end(resumed).trajectory().overlap, one.overlap)
    fewer = _chain().simulate(replace(config, runs=3))  # a run's numbers do not depend on R
    np.testing.assert_array_equal(fewer.overlap, one.overlap[:3])


def test_a_rest_that_loses_directions_is_no_divergence():
    """Rank 4 against a rank-1 teacher: the unused directions of A's rest contract, S tends to
    a singular matrix (as A does in R^d), and the chain factors it semi-definitely (a zero
    column) where a strict Cholesky stopped every run near step 70 000 (d = 200, η·d = 0.5:
    all 8 of 8 'diverged', the full engine none); the kernel's factor itself reproduces a
    singular S and refuses an indefinite one."""
    from dynamics.engines.engine import simulate
    from dynamics.reduced.lora_ba_kernel import cholesky

    g = np.random.default_rng(0).standard_normal((4, 2))
    s = g @ g.T  # rank 2
    out = np.empty((4, 4))
    assert cholesky(s, out) and np.allclose(out @ out.T, s, atol=1e-12)
    assert np.allclose(np.triu(out, 1), 0.0)
    assert not cholesky(s - 0.1 * np.eye(4), out)
    inst = {"activation": "relu", "k": 4, "d": 200, "xi": 2.0, "W": "separated",
            "c": "gaussian", "c_hat": "gaussian", "seed": 0}
    cfg = RunConfig(instance=inst, learner="lora-ba", eta=0.5 / 200, steps=80_000, runs=8,
                    seed=1, engine="reduced", checkpoints=8, spacing="linear",
                    finite_d_theory=False, rank=4)
    traj = simulate(cfg)
    assert traj.engine == "reduced" and not traj.diverged.any()
    assert np.all(np.isfinite(traj.extra["a_norm"][:, -1]))
    assert np.all(np.abs(traj.overlap[:, -1]) > 0.99)
