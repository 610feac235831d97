"""Fig. 3(a) acceptance check: the linearized model cannot fit a ξ = √k rank-1 perturbation.

Setting (the full-size ``loradyn reproduce fig3`` sweep, ``sims/experiments/figures/fig3.py``):
ReLU, d = 2000, k = 50, ξ = √k, unit-row instance (W separated, c and ĉ gaussian), ĉ trained
jointly with û (projected, eq. 4), η = 0.004/d, T = 300·d steps. Fine-tuning runs on ``engine=auto``
(the exact reduced chain); the linearized learner on the full engine.

Claim checked: every checkpoint of every linearized run has a true population loss (the
non-linear network with its learned rows) above 10× the largest final loss of the
fine-tuning runs, and every fine-tuning run ends with ⟨û, u⟩ > 0.95.

    python benchmarks/fig3a_check.py [--runs 4] [--d 2000 --k 50] [--steps-per-d 300]
                                     [--full-rank]

Prints the numbers and exits 1 if the claim fails.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from sims.experiments.linearized_plateau import configs, measure

FRACTIONS = (0.001, 0.01, 0.1, 0.33, 1.0)  # checkpoints (fractions of T) printed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--d", type=int, default=2000)
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--eta-times-d", type=float, default=0.004)
    ap.add_argument("--steps-per-d", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--full-rank", action="store_true",
                    help="also run the full-rank linearized learner (reported, not checked)")
    a = ap.parse_args(argv)
    res = measure(configs(a.d, a.k, a.runs, a.eta_times_d, a.steps_per_d, a.seed,
                          full_rank=a.full_rank))
    np.set_printoptions(precision=4, suppress=False)
    print(f"ReLU d={a.d} k={a.k} xi=sqrt(k) eta={a.eta_times_d}/d T={a.steps_per_d}*d "
          f"runs={a.runs} seed={a.seed}; joint c, projected")
    for key in ("initial_loss", "ft_final_overlap", "ft_final_c_overlap", "ft_final_loss",
                "lin_min_loss", "lin_final_loss", "lin_final_loss_linear",
                "lin_final_overlap"):
        print(f"  {key:24s} {res[key]}")
    for name in ("finetune", "linearized", "linearized_full_rank"):
        if name not in res:
            continue
        traj = res[name]
        idx = [int(np.searchsorted(traj.steps, f * traj.steps[-1])) for f in FRACTIONS]
        line = ", ".join(f"t={traj.steps[i]}: {np.median(traj.loss[:, i]):.4g}" for i in idx)
        print(f"  {name} median true loss   {line}")
        if "loss_linear" in traj.extra:
            lin = traj.extra["loss_linear"]
            line = ", ".join(f"t={traj.steps[i]}: {np.median(lin[:, i]):.4g}" for i in idx)
            print(f"  {name} median linear loss {line}")
        if name == "linearized_full_rank":
            print(f"  {name} final |<v1,u>| {traj.overlap[:, -1]}, min true loss "
                  f"{np.nanmin(traj.loss, axis=1)}")
        print(f"  {name} seconds {res[name + '_seconds']:.1f}")
    print(f"  min linearized true loss / max finetune final loss = {res['ratio']:.1f} "
          f"(> 10 needed); finetune overlap > 0.95: {bool(np.all(res['ft_final_overlap'] > 0.95))}")
    print("PASS" if res["passed"] else "FAIL")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
