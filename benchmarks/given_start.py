"""SGD from one given start against the committee ODE from that start, over d (issue 17).

The setting (one start of erf(x/√2), K = M = 2, free rows, η·d = 0.5, near the unspecialised
plateau) and the measurement: :mod:`sims.experiments.given_start`.

Prints, at each α, the ODE's loss and per d the SGD mean ± standard error, then per d the
RMS over runs and α of SGD − ODE (the per-run fluctuation, ∝ d^{-1/2} expected) and the
largest |mean − ODE|/SE.

Usage: ``python benchmarks/given_start.py [--d 100 400 1600 --runs 64 --alpha-max 40]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from sims.experiments.given_start import run

ALPHAS = (0.5, 1, 2, 5, 10, 20, 30, 40)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[100, 400, 1600])
    ap.add_argument("--runs", type=int, default=64)
    ap.add_argument("--alpha-max", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    alphas = [a for a in ALPHAS if a <= args.alpha_max]
    rows, ode_at = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for d in args.d:
            alpha, ode, sgd, secs = run(d, args.runs, args.alpha_max, args.seed, Path(tmp))
            at = np.array([[np.interp(a, alpha, s) for a in alphas] for s in sgd])
            ode_d = np.array([np.interp(a, alpha, ode) for a in alphas])
            ode_at = ode_d if ode_at is None else ode_at
            assert np.allclose(ode_d, ode_at, rtol=1e-3), "one start, one ODE curve (α units)"
            mean, se = at.mean(0), at.std(0, ddof=1) / np.sqrt(len(at))
            rms = float(np.sqrt(np.mean((sgd - ode) ** 2)))
            rows[d] = (mean, se, rms, float(np.max(np.abs(mean - ode_d) / se)), secs)
    print(f"loss E(f* − f̂)² from one given start, erf(x/√2), K = M = 2, free rows, "
          f"η·d = 0.5, {args.runs} runs per d")
    head = "| α | ODE | " + " | ".join(f"SGD d = {d}" for d in args.d) + " |"
    print(head)
    print("|" + "---|" * (2 + len(args.d)))
    for j, a in enumerate(alphas):
        cells = " | ".join(f"{rows[d][0][j]:.4f} ± {rows[d][1][j]:.4f}" for d in args.d)
        print(f"| {a:g} | {ode_at[j]:.4f} | {cells} |")
    for d in args.d:
        mean, se, rms, zmax, secs = rows[d]
        print(f"d = {d}: RMS(SGD − ODE) over runs and checkpoints {rms:.4f}; "
              f"max |mean − ODE|/SE {zmax:.2f}; {secs:.0f} s")


if __name__ == "__main__":
    main()
