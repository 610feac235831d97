"""The exact population loss of the ``finetune`` learner in every regime with a Gaussian pair
kernel (unprojected û, u_alpha > 0, joint ĉ, the App. B conventions): against an independent
Monte Carlo average in R^d with explicit teacher and student weights, against the overlap
formula where both apply, and as the loss a run records."""

from __future__ import annotations

import math

import numpy as np
import pytest

import dynamics.learners.finetune as finetune_module
import dynamics.reduced.simulate as reduced_module
import hermite
from dynamics.activations import activation_from_callable
from dynamics.engines.engine import simulate
from dynamics.instances.instance import build_instance
from dynamics.measures.losses import (
    LOSS_EXACT,
    LOSS_MONTE_CARLO,
    coordinate_loss,
    exact_loss,
    loss_kind,
    needs_coordinates,
    pair_kernel,
)
from dynamics.setup.config import RunConfig

K, D = 4, 40
SAMPLES, BLOCK = 480_000, 60_000


def _spec(activation, convention="unit", **kw):
    return {"activation": activation, "k": K, "d": D, "xi": 1.3, "u_alpha": 0.5,
            "W": "separated", "c": "gaussian", "c_hat": "gaussian", "lam": "random_sign",
            "seed": 3, "convention": convention} | kw


def _random_state(gen, k):
    """A unit û = (p, μ, ν ê) with p ≠ 0 (unprojected) and a ĉ unlike the instance's."""
    v = gen.standard_normal(k + 2)
    v /= np.linalg.norm(v)
    return v[:k], v[k], v[k + 1], gen.standard_normal(k) / math.sqrt(k)


def _rows(inst, direction, coeff):
    """k×d rows of the model, built from the instance's raw pieces: unit rows rᵢ/‖rᵢ‖ or the
    App. B rows s·rᵢ, rᵢ = wᵢ + ξ coeffᵢ direction, W = [L, 0] in the canonical frame."""
    k, xi = inst.k, inst.xi
    w = np.zeros((k, D))
    w[:, :k] = inst.w_factor
    raw = w + xi * coeff[:, None] * direction[None, :]
    if inst.convention == "unit":
        return raw / np.linalg.norm(raw, axis=1, keepdims=True)
    s = k / (k + xi**2)
    return (math.sqrt(s) if inst.convention == "appB-sqrt" else s) * raw


def _direct_monte_carlo(inst, p, mu, nu, ch, seed):
    """(mean, standard error) of (f* − f̂)² over SAMPLES x ~ N(0, I_d), û's rest along a random
    unit vector of the last d − k − 1 coordinates."""
    gen = np.random.default_rng(seed)
    k = inst.k
    u = np.zeros(D)
    u[:k], u[k] = inst.u_w, math.sqrt(1.0 - float(inst.u_w @ inst.u_w))
    rest = gen.standard_normal(D - k - 1)
    u_hat = np.zeros(D)
    u_hat[:k], u_hat[k], u_hat[k + 1:] = p, mu, nu * rest / np.linalg.norm(rest)
    out_scale = 1.0 if inst.convention == "unit" else 1.0 / inst.xi
    lam = out_scale * np.asarray(inst.lam)
    teacher, student = _rows(inst, u, np.asarray(inst.c)), _rows(inst, u_hat, ch)
    sig = inst.activation.fn
    total = total2 = 0.0
    for _ in range(SAMPLES // BLOCK):
        x = gen.standard_normal((BLOCK, D))
        r2 = (sig(x @ teacher.T) @ lam - sig(x @ student.T) @ lam) ** 2
        total += r2.sum()
        total2 += (r2 * r2).sum()
    mean = total / SAMPLES
    var = total2 / SAMPLES - mean * mean
    return mean, math.sqrt(var / SAMPLES)


CASES = [("relu", "unit"), ("tanh", "unit"), ("he3", "unit"),
         ("relu", "appB"), ("erf", "appB"), ("tanh", "appB"),
         ("relu", "appB-sqrt"), ("erf", "appB-sqrt"), ("tanh", "appB-sqrt")]


@pytest.mark.parametrize(("activation", "convention"), CASES)
def test_exact_loss_matches_direct_monte_carlo(activation, convention):
    """Unprojected û, u_alpha = 0.5, joint (random) ĉ: the exact loss at two random states
    equals a 480k-sample Monte Carlo average in R^d with explicit weights (< 5 SE)."""
    inst = build_instance(_spec(activation, convention))
    gen = np.random.default_rng(11)
    states = [_random_state(gen, K) for _ in range(2)]
    coords = np.array([[np.r_[p, mu, nu] for p, mu, nu, _ in states]])  # (1, 2, k+2)
    ch = np.array([[c for *_, c in states]])  # (1, 2, k)
    exact = coordinate_loss([inst], coords, ch, eta=0.01)[0]
    for j, (p, mu, nu, c) in enumerate(states):
        mc, se = _direct_monte_carlo(inst, p, mu, nu, c, seed=100 + j)
        assert abs(exact[j] - mc) < 5 * se, (exact[j], mc, se)
        model = hermite.FinetuneModel(inst, 0.01, project=False, joint_c=True)
        np.testing.assert_allclose(exact[j], model.loss(p[None], [mu], c[None])[0],
                                   rtol=1e-11, atol=0)  # same sum, rounding only


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_coordinate_loss_equals_overlap_loss_when_projected(activation):
    """û ⊥ span W, unit rows: the pair-kernel loss from (p = 0, μ) equals the dual-kernel
    loss from m = u⊥μ (hermite.population_loss), frozen and per-checkpoint ĉ; NaN states stay
    NaN."""
    inst = build_instance(_spec(activation))
    gen = np.random.default_rng(5)
    mu = gen.uniform(-1.0, 1.0, (3, 6))
    mu[1, 2] = np.nan
    coords = np.zeros((3, 6, K + 2))
    coords[..., K] = mu
    coords[..., K + 1] = np.sqrt(1.0 - np.nan_to_num(mu) ** 2)
    m = inst.u_perp * mu
    frozen = np.stack([inst.c_hat] * 3)
    got = coordinate_loss([inst] * 3, coords, frozen)
    np.testing.assert_allclose(got, exact_loss([inst] * 3, m), rtol=1e-10, atol=1e-13)
    assert np.isnan(got[1, 2]) and np.isfinite(np.delete(got.ravel(), 8)).all()
    ch = gen.standard_normal((3, 6, K))
    got = coordinate_loss([inst] * 3, coords, ch)
    np.testing.assert_allclose(got, exact_loss([inst] * 3, m, ch), rtol=1e-10, atol=1e-13)


def _capture(monkeypatch, module):
    """Record the checkpoint records a run hands to rank_one_trajectory."""
    seen = {}
    original = module.rank_one_trajectory

    def wrapped(result):
        seen["records"] = {k: (None if v is None else np.array(v))
                           for k, v in result.records.items()}
        return original(result)

    monkeypatch.setattr(module, "rank_one_trajectory", wrapped)
    return seen


@pytest.mark.parametrize(("convention", "engine", "joint"), [
    ("unit", "full", False), ("unit", "reduced", True), ("appB-sqrt", "full", True)])
def test_run_records_the_exact_loss(monkeypatch, convention, engine, joint):
    """project = False (d = 40, 300 steps, 4 runs): loss_kind ``exact`` and the recorded loss
    is FinetuneModel.loss at the recorded coordinates (and ĉ), which also give the overlap."""
    module = finetune_module if engine == "full" else reduced_module
    seen = _capture(monkeypatch, module)
    cfg = RunConfig(instance=_spec("relu", convention, xi=1.0), eta=0.01, steps=300, runs=4,
                    seed=2, checkpoints=5, engine=engine, project=False, joint_c=joint)
    assert loss_kind(cfg) == LOSS_EXACT and needs_coordinates(cfg)
    tr = simulate(cfg)
    assert tr.loss_kind == LOSS_EXACT and tr.engine == engine
    rec = seen["records"]
    coords = rec["coords"]
    assert coords.shape == (4, len(tr.steps), K + 2) and np.isfinite(tr.loss).all()
    for r, inst in enumerate(tr.instances):
        model = hermite.FinetuneModel(inst, cfg.eta, project=False, joint_c=joint)
        ch = rec["c_hat"][r] if joint else inst.c_hat
        want = model.loss(coords[r, :, :K], coords[r, :, K], ch)
        np.testing.assert_allclose(tr.loss[r], want, rtol=1e-12, atol=1e-14)
        m = coords[r, :, :K] @ inst.u_w + coords[r, :, K] * inst.u_perp
        np.testing.assert_allclose(tr.overlap[r], m, atol=1e-5)
    assert (coords[:, -1, :K] != 0).any()  # unprojected: û left span(W)^⊥


def test_projected_unit_rows_keep_no_coordinates():
    cfg = RunConfig(instance=_spec("relu"), eta=0.01, steps=10, runs=2)
    assert loss_kind(cfg) == LOSS_EXACT and not needs_coordinates(cfg)
    assert needs_coordinates(RunConfig(instance=_spec("relu"), eta=0.01, steps=10, runs=2,
                                       refit=True))
    assert needs_coordinates(RunConfig(instance=_spec("relu", "appB"), eta=0.01, steps=10,
                                       runs=2))


def _hard_tanh():
    """clip(x, −1, 1): piecewise, not relu/abs. The registry has no such σ (its piecewise
    ones are relu, abs and their rescalings, all with closed-form pair kernels), so a user's."""
    return activation_from_callable(lambda x: np.clip(x, -1.0, 1.0),
                                    lambda x: (np.abs(x) < 1.0).astype(float),
                                    name="hard_tanh", breakpoints=(-1.0, 1.0))


def test_no_pair_kernel_stays_monte_carlo():
    """App. B rows with a piecewise σ other than relu/abs: no pair kernel, loss_kind
    ``monte_carlo`` (coordinates kept); unit rows of the same σ (dual kernel by quadrature) are
    exact. (A run of it stops earlier, in the theory overlay's FinetuneModel, which has no
    kernel either; so only the config is checked.)"""
    act = _hard_tanh()
    assert pair_kernel(act, unit=False) is None and pair_kernel(act, unit=True) is not None
    with pytest.raises(ValueError, match="no Gaussian pair kernel"):
        hermite.PairKernel(act, unit_rows=False)
    for conv in ("appB", "appB-sqrt"):
        for project in (True, False):
            cfg = RunConfig(instance=_spec(act, conv), eta=0.01, steps=40, runs=2,
                            project=project)
            assert loss_kind(cfg) == LOSS_MONTE_CARLO and needs_coordinates(cfg)
    assert loss_kind(RunConfig(instance=_spec(act), eta=0.01, steps=40, runs=2,
                               project=False)) == LOSS_EXACT
    for name in ("relu", "abs", "relu(x*2)", "erf", "erf(x/sqrt2)", "tanh", "sigmoid", "he3"):
        assert pair_kernel(name, unit=False) is not None, name
