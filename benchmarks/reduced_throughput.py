"""Reduced-chain throughput against the number of runs R: numba on the CPU cores, numba-cuda
on the GPU (one thread per run, every step in one launch).

The reduced chain is a Markov chain per run, so a run's steps are sequential whatever the
hardware: the GPU only pays off through many runs at once, and a single run's speed (steps/s
per run) bounds the wall time of a long horizon (d = 10⁶ at T ≈ 10³·d is 10⁹ sequential steps).
This script measures both numbers for each backend and R, with the same differencing of two
horizons as ``loradyn bench engine`` (fixed costs removed), float64, k = 8, ξ = 1, d = 10⁶.

    python benchmarks/reduced_throughput.py [--activation he3] [--runs 16,1024,16384]
                                            [--steps 200000] [--out results.json]

Prints one line per (backend, R): run-steps/s and steps/s per run.
"""

from __future__ import annotations

import argparse
import json
import time

from dynamics.reduced import first_passage_reduced
from dynamics.setup.config import RunConfig


def _config(d, k, runs, steps, activation, device):
    return RunConfig(instance={"activation": activation, "k": k, "d": d, "xi": 1.0, "seed": 3,
                               "W": "orthonormal"},
                     eta=0.002 / d, steps=steps, runs=runs, seed=0, engine="reduced",
                     device=device)


def rate(d, k, runs, steps, activation, device, backend) -> tuple[float, float]:
    """(run-steps/s, seconds of the 2·steps horizon) from horizons steps and 2·steps."""
    def go(n):
        t0 = time.perf_counter()
        first_passage_reduced(_config(d, k, runs, n, activation, device), level=2.0,
                              max_steps=n, backend=backend)
        return time.perf_counter() - t0

    go(2)  # compile / load
    t1, t2 = go(steps), go(2 * steps)
    return runs * steps / max(t2 - t1, 1e-9), t2


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--activation", default="he3")
    ap.add_argument("--d", type=int, default=1_000_000)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--runs", default="16,256,4096,32768")
    ap.add_argument("--cpu-runs", default="16,64,256")
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--budget", type=float, default=60.0,
                    help="Skip larger R once one measurement took longer than this (s).")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import numba

    rows = []
    plans = [("numba", "cpu", args.cpu_runs)]
    try:
        from numba import cuda

        if cuda.is_available():
            plans.append(("numba-cuda", "cuda", args.runs))
    except ImportError:  # pragma: no cover
        pass
    for backend, device, runs_list in plans:
        for runs in [int(r) for r in runs_list.split(",")]:
            rs, wall = rate(args.d, args.k, runs, args.steps, args.activation, device, backend)
            row = {"backend": backend, "runs": runs, "run_steps_per_s": rs,
                   "steps_per_s_per_run": rs / runs, "d": args.d, "k": args.k,
                   "activation": args.activation, "steps": args.steps,
                   "threads": numba.get_num_threads() if backend == "numba" else None}
            rows.append(row)
            print(f"{backend:10s} R={runs:6d}: {rs:14,.0f} run-steps/s, "
                  f"{rs / runs:12,.0f} steps/s per run", flush=True)
            if wall > args.budget:
                break
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    best = {b: max(r["run_steps_per_s"] for r in rows if r["backend"] == b)
            for b in {r["backend"] for r in rows}}
    print("best run-steps/s:", {b: f"{v:,.0f}" for b, v in best.items()})
    if len(best) == 2:
        print(f"numba-cuda / numba (best of each) = {best['numba-cuda'] / best['numba']:.2f}")



if __name__ == "__main__":
    main()
