"""Theorem 19 measured: fine-tuning's T ∝ d against learning the same teacher from scratch.

Instance (Claim 2): k = 4, W = ``claim2`` (teacher neurons orthonormal), ξ = 1, ĉ = c
(``c_hat: teacher``), λ = 1, σ = He₃ or He₄ (information exponent p = 3, 4), seed 0.

* Target: L* = Φ(0.9), fine-tuning's exact population loss at overlap 0.9.
* Fine-tuning (``finetune``, projected, ĉ frozen, rank-1 chain): T_ft = first passage of
  ⟨û, u⟩ ≥ 0.9 at η = c_ft/d.
* From scratch (``scratch``: squared loss; ``scratch-csq``: correlation loss; k′ = k random
  unit rows, λ̂ = λ fixed), on the exact network chain: T = first passage of the exact
  population loss ≤ L*, checked after every step, at η = c/d^{p/2} (online SGD on
  information exponent p: Ben Arous et al. 2021 take η ∝ d^{−p/2} up to logs), horizon
  H·d^{p−1} steps; runs that do not get there by the horizon count as never (censored).

Per (σ, learner, c): the median T over runs at each d (a censored median: NaN once half the
runs never arrive), the fraction that never arrive, and the slope b of log median T =
a + b log d with a 95 % bootstrap CI (runs resampled within each d;
``sims.experiments.fit.fit_power_law``). Lines for comparison: the CSQ lower bound d^{p/2},
the online-SGD information-exponent law d^{p−1}, and d (fine-tuning).

    python benchmarks/theorem19.py --sigma he3 --d 100 141 200 283 400 --runs 16 \
        --c 0.05 0.1 --horizon 40 [--out results/theorem19_he3.json --plot ...]

Everything runs on the exact chains (float64, CPU, numba threads = cores). The measurement
lives in the library (:mod:`sims.experiments.separation`: the runs; :mod:`sims.experiments.
separation_record`: these records, their fits, merges and figure); this script is its command
line. The same separation as one command with an HDF5 file and a figure:
``loradyn reproduce separation [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sims.experiments.separation import (  # noqa: F401  (the script's names, as before)
    LEVEL,
    degree,
    finetune_times,
    ode_times,
    scratch_config,
    scratch_times,
    spec_for,
    target_loss,
)
from sims.experiments.separation_record import (  # noqa: F401
    ODE_NAME,
    finetune_scan,
    fits_of,
    keyed_rows,
    measure,
    merged,
    plot,
    series_d,
)


def _read_results(files, flag, combine=list):
    """``combine`` of the saved --out files; a missing, half-written or mismatched file is a
    one-line error (exit status 1)."""
    try:
        return combine([json.loads(f.read_text()) for f in files])
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"theorem19.py {flag}: {type(err).__name__}: {err}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sigma", default="he3", choices=["he3", "he4"])
    ap.add_argument("--d", type=int, nargs="+", default=[100, 141, 200, 283, 400])
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--c", type=float, nargs="+", default=[0.05, 0.1])
    ap.add_argument("--c-ft", type=float, default=0.05)
    ap.add_argument("--horizon", type=float, default=40.0)
    ap.add_argument("--learners", nargs="*", default=["scratch", "scratch-csq"],
                    help="From-scratch learners beside fine-tuning (none: fine-tuning alone).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ode-runs", type=int, default=0,
                    help="Also the first-order committee ODE's plateau escape from the first "
                         "N runs' starts, per learner and c.")
    ap.add_argument("--finetune-scan", type=float, nargs="+", metavar="C_FT",
                    help="Fine-tuning alone at η = c_ft/d for these c_ft over --d (horizon "
                         "--horizon·d steps): median T/d and the runs short of 0.9; exit.")
    ap.add_argument("--ode-only", action="store_true",
                    help="With --ode-runs: the ODE series (and fine-tuning) without the SGD.")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--replot", type=Path, nargs="+",
                    help="Draw --plot from these saved --out files (one σ) and exit.")
    ap.add_argument("--merge", type=Path, nargs="+",
                    help="Join these saved --out files (one σ, run count, horizon; different "
                         "d) into --out with the fits over all d, draw --plot, and exit.")
    args = ap.parse_args(argv)
    if args.replot:
        if args.plot is None:
            ap.error("--replot needs --plot")
        plot(_read_results(args.replot, "--replot"), args.plot)
        return 0
    if args.finetune_scan:
        rows = finetune_scan(args.sigma, args.d, args.finetune_scan, args.runs, args.seed,
                             args.horizon)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1, default=float) + "\n")
        return 0
    if args.merge:
        res = _read_results(args.merge, "--merge", merged)
    else:
        res = measure(args.sigma, args.d, args.runs, args.c, args.c_ft, args.horizon,
                      args.seed, args.learners, args.ode_runs, args.ode_only)
    print(json.dumps(res["fits"], indent=1, default=float))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, default=float) + "\n")
    if args.plot:
        plot([res], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
