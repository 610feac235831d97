"""SGD from one given start against the committee ODE from that start (issue 17): the
measurement behind ``benchmarks/given_start.py`` and its test.

Every run starts from the same rows (``--init-rows``, canonical frame of an orthonormal
committee teacher, so coordinate i of a row is its overlap with vᵢ): the ODE is then one
curve and the SGD mean of R runs should approach it as d grows, at fixed η·d and fixed α =
steps/d. Setting: erf(x/√2), K = M = 2, free rows, λ = λ̂ = 1, η·d = 0.5 (nn2pp's lr 1),

    ŵ₁ = (0.35, 0.25, 0.5, 0, …),   ŵ₂ = (0.25, 0.35, 0, 0.5, …)

a start near the unspecialised plateau (both rows nearly equally aligned with both teacher
rows) from which the ODE escapes, deterministically, through its initial asymmetry.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from dynamics.engines.engine import simulate
from dynamics.setup.config import RunConfig


def start_rows(d: int) -> np.ndarray:
    """The start (module docstring), k′ × d, canonical frame."""
    rows = np.zeros((2, d))
    rows[0, :4] = (0.35, 0.25, 0.5, 0.0)
    rows[1, :4] = (0.25, 0.35, 0.0, 0.5)
    return rows


def run(d: int, runs: int, alpha_max: float, seed: int, folder: Path):
    """R runs at dimension d from :func:`start_rows` (written to ``folder``): (α, the ODE's
    loss, the runs' losses (R, C), seconds)."""
    path = folder / f"start_{d}.npy"
    np.save(path, start_rows(d))
    spec = {"activation": "erf(x/sqrt2)", "teacher": "committee", "k": 2, "d": d,
            "W": "orthonormal"}
    config = RunConfig(spec, learner="scratch", eta=0.5 / d, steps=int(alpha_max * d),
                       runs=runs, seed=seed, checkpoints=200, spacing="log", rows="free",
                       init_rows=str(path), init_frame="canonical",
                       streams="counter").validate()
    t0 = time.perf_counter()
    traj = simulate(config)
    alpha = traj.steps / d
    ode = traj.extra["ode_loss"][0]
    sgd = traj.loss
    return alpha, ode, sgd, time.perf_counter() - t0
