"""Every learner has the same law on every device and stream kind (the fast path against the
plain one).

The reference is the CPU run with per-run streams (run r's numbers depend on (seed, r) only).
Each other path — one shared stream for all runs (the CUDA default), and on a GPU the CUDA run
— draws different numbers, so the check is in law: at every checkpoint the mean overlap and
the mean loss of 256 runs differ by less than 5 standard errors of the difference (two
independent samples). A wrong sign, scale or step size on one path moves the mean by tens of
SE at these sizes (the test below that doubles η on one side checks that it can fail).
"""

from __future__ import annotations

import numpy as np
import pytest

from dynamics.engines.engine import simulate
from dynamics.learners.registry import LEARNERS
from dynamics.setup.config import RunConfig

RUNS = 256
# learner → (its options, η·d): each moves its overlap well off the start within STEPS
CASES = {
    "finetune": ({}, 0.5),
    "linearized": ({}, 0.5),
    "scratch": ({}, 0.5),
    "scratch-csq": ({}, 0.5),
    "sparse": ({}, 0.5),
    "glm": ({}, 0.5),
    "moment": ({}, 0.5),
    "lora": ({"rank": 2}, 0.5),
    "pretrained-glm": ({"mu": 0.5, "batch": 8}, 4.0),
    "lora-ba": ({"rank": 2}, 0.5),
}
STEPS = 400
D = 40
# checkpoints compared (steps 7, 54, 400): before, a start with no direction (lora-ba's B₀ = 0,
# moment's zero start) has an undefined overlap in some runs, and step 0 is one law exactly
FROM = 2


def test_every_registered_learner_has_a_case():
    assert set(CASES) == set(LEARNERS)


def _config(learner: str, device: str, streams: str, eta_scale: float = 1.0) -> RunConfig:
    options, eta_d = CASES[learner]
    spec = {"activation": "relu", "k": 3, "d": D, "xi": 2.0, "W": "separated", "seed": 3}
    return RunConfig(instance=spec, learner=learner, eta=eta_scale * eta_d / D, steps=STEPS,
                     runs=RUNS, seed=11, checkpoints=5, dtype="float64", device=device,
                     streams=streams, engine="full", finite_d_theory=False,
                     **options).validate()


def _gap_in_se(a, b) -> float:
    """max over checkpoints of |mean a − mean b| / SE of the difference (runs on axis 0)."""
    a, b = a[:, FROM:], b[:, FROM:]
    diff = a.mean(0) - b.mean(0)
    se = np.sqrt(a.var(0, ddof=1) / len(a) + b.var(0, ddof=1) / len(b))
    moving = se > 1e-12
    return float(np.max(np.abs(diff[moving]) / se[moving])) if moving.any() else 0.0


def _paths(device: str) -> list[tuple[str, str]]:
    paths = [("cpu", "shared")]
    if device != "cpu":
        paths += [(device, "shared"), (device, "per_run")]
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("learner", sorted(CASES))
def test_same_law_on_every_path(learner, device):
    ref = simulate(_config(learner, "cpu", "per_run"))
    moved = 0.0
    for name in ("overlap", "loss"):
        x = getattr(ref, name)[:, FROM:]
        assert np.isfinite(x).all()
        moved = max(moved, abs(x[:, -1].mean() - x[:, 0].mean()))
    assert moved > 0.02  # it learns: a frozen path would pass the comparison trivially
    for dev, streams in _paths(device):
        other = simulate(_config(learner, dev, streams))
        for name in ("overlap", "loss"):
            gap = _gap_in_se(getattr(ref, name), getattr(other, name))
            assert gap < 5, f"{learner} {dev}/{streams} {name}: {gap:.1f} SE from cpu/per_run"


def test_the_comparison_can_fail():
    """η × 1.5 on one side: the same comparison sees it."""
    ref = simulate(_config("finetune", "cpu", "per_run"))
    other = simulate(_config("finetune", "cpu", "shared", eta_scale=1.5))
    assert _gap_in_se(ref.overlap, other.overlap) > 5
