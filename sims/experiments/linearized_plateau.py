"""Fig. 3(a)'s claim measured: the linearized model cannot fit a ξ = √k rank-1 perturbation
that fine-tuning recovers (the measurement behind ``benchmarks/fig3a_check.py`` and its test).

Setting (the full-size ``loradyn reproduce fig3``): ReLU, d = 2000, k = 50, ξ = √k, unit-row
instance (W separated, c and ĉ gaussian), ĉ trained jointly with û (projected, eq. 4),
η = 0.004/d, T = 300·d steps. Fine-tuning runs on ``engine=auto`` (the exact reduced chain);
the linearized learner on the full engine. The claim: every checkpoint of every linearized
run has a true population loss above 10× the largest final loss of the fine-tuning runs, and
every fine-tuning run ends with ⟨û, u⟩ > 0.95.
"""

from __future__ import annotations

import math
import time

import numpy as np

from dynamics.engines.engine import simulate
from dynamics.setup.config import RunConfig
from sims.experiments.figures.recipe import unit_row_instance


def configs(d: int, k: int, runs: int, eta_times_d: float, steps_per_d: int, seed: int,
            checkpoints: int = 40, full_rank: bool = False) -> dict[str, RunConfig]:
    """The learners' configs on the same instance and seeds (``full_rank``: also the
    full-rank linearized learner, Δ ∈ R^{k×d} from 0, same η; it has no ĉ)."""
    base = dict(instance=unit_row_instance("relu", d, k, math.sqrt(k)), runs=runs, seed=seed,
                joint_c=True, project=True, eta=eta_times_d / d, steps=steps_per_d * d,
                checkpoints=checkpoints)
    out = {"finetune": RunConfig(learner="finetune", engine="auto", **base),
           "linearized": RunConfig(learner="linearized", engine="full", **base)}
    if full_rank:
        out["linearized_full_rank"] = RunConfig(learner="linearized", engine="full",
                                                full_rank=True, **(base | {"joint_c": False}))
    return out


def measure(cfgs: dict[str, RunConfig]) -> dict:
    """Run both learners; the numbers the claim is about."""
    out = {}
    for name, cfg in cfgs.items():
        t0 = time.perf_counter()
        traj = simulate(cfg)
        out[name] = traj
        out[name + "_seconds"] = time.perf_counter() - t0
    ft, lin = out["finetune"], out["linearized"]
    out["ft_final_overlap"] = np.abs(ft.overlap[:, -1])
    out["ft_final_loss"] = ft.loss[:, -1]
    out["ft_final_c_overlap"] = ft.c_overlap[:, -1]
    out["lin_min_loss"] = np.nanmin(lin.loss, axis=1)  # over checkpoints, per run
    out["lin_final_loss"] = lin.loss[:, -1]
    out["lin_final_loss_linear"] = lin.extra["loss_linear"][:, -1]
    out["lin_final_overlap"] = lin.overlap[:, -1]
    out["initial_loss"] = ft.loss[:, 0]
    out["ratio"] = float(np.min(out["lin_min_loss"]) / np.max(out["ft_final_loss"]))
    out["passed"] = bool(out["ratio"] > 10 and np.all(out["ft_final_overlap"] > 0.95))
    return out
