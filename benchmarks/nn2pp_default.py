"""nn2pp's default setting in loradyn (issue 17 acceptance): SGD mean and committee ODE.

sgoldt/nn2pp's defaults: g(x) = erf(x/√2) for teacher and student, K = M = 2, lr 0.5,
second layers A = v = 1 fixed, loss ½(y − ŷ)², fresh x ~ N(0, I_N) each step, weights O(1)
with λ = w·x/√N, teacher B and student w with i.i.d. N(0, 1) entries (``--init 1``), time
α = steps/N. The exact mapping onto loradyn (docs/theory/committee.md, "nn2pp in loradyn"):

    instance  activation = "erf(x/sqrt2)", teacher = "committee", k = M, d = N,
              W = "gaussian" (rows N(0, I/N): nn2pp's B/√N), lam = "ones" (A = 1)
    learner   scratch --rows free --init-scale 1 (w/√N ~ N(0, I/N)), --width K (v = 1
              fixed; nn2pp's --both, a trained v: --train-second-layer)
    step      eta = lr/(2N)   (our loss (y − ŷ)² has no ½, our weights are w/√N)
    time      steps = α·N;    nn2pp's eg = our loss / 2

This script runs R independent runs of that setting, each with its own teacher as nn2pp
draws one per process (``instance_seeds = "per_run"``; counter streams: the fast CPU path),
records the committee ODE from each run's own initial overlaps beside them (``ode_loss``),
and prints eg(α) = loss/2 at the requested α (240 log-spaced checkpoints, interpolated in
log α; nn2pp's 200 printed rows likewise): the ODE (mean over runs), the SGD mean ± its
standard error and the SGD median; with ``--nn2pp-dat`` files (nn2pp's own output at the same
setting) their mean ± standard error beside. ``--out`` keeps the trajectory (HDF5).

Usage: ``python benchmarks/nn2pp_default.py [--N 2000 --runs 16 --alpha-max 1000]
[--engine reduced]`` (≈ 10 min on 2 shared cores at the defaults on the full engine; the
exact network chain, ``--engine reduced``, spends its time on the committee ODE).
"""

from __future__ import annotations

import argparse
import glob
import math
import time
from dataclasses import dataclass

import numpy as np

from dynamics.engines.engine import simulate
from dynamics.setup.config import RunConfig

ALPHAS = (1, 10, 50, 100, 200, 300, 500, 700, 1000)


@dataclass(frozen=True)
class Nn2ppSetting:
    """nn2pp's setting: input dimension N, student width K, teacher width M, learning rate
    ``lr`` and the teacher's rows (gaussian: N(0, I/N); orthonormal: T = I)."""

    N: int
    K: int
    M: int
    lr: float
    teacher: str = "gaussian"


def nn2pp_config(setting: Nn2ppSetting, *, alpha_max: float, runs: int, seed: int,
                 checkpoints: int = 240, streams: str = "counter",
                 engine: str = "full") -> RunConfig:
    """The loradyn run of nn2pp's ``setting`` to α = ``alpha_max`` (module docstring: the
    mapping)."""
    N, K, M = setting.N, setting.K, setting.M
    spec = {"activation": "erf(x/sqrt2)", "teacher": "committee", "k": M, "d": N,
            "W": setting.teacher, "lam": "ones", "seed": seed}
    opts = {"rows": "free", "init_scale": 1.0}
    if K != M:
        opts |= {"width": K}
    return RunConfig(spec, learner="scratch", eta=setting.lr / (2 * N),
                     steps=int(alpha_max * N), runs=runs, seed=seed, checkpoints=checkpoints,
                     spacing="log", streams=streams, instance_seeds="per_run", engine=engine,
                     **opts).validate()


def at_alpha(alpha: np.ndarray, values: np.ndarray, alphas) -> np.ndarray:
    """(R, len(alphas)) ``values`` (R, C) at exactly the requested α, interpolated linearly in
    log α between the recorded ones (both tools record on log grids, neither at round α: a
    few % in α is a few % in eg where it falls fast)."""
    ok = alpha > 0
    la = np.log(alpha[ok])
    return np.array([np.interp(np.log(alphas), la, v[ok]) for v in np.atleast_2d(values)])


def read_nn2pp_dat(paths) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(α, eg)] of nn2pp's ``.dat`` outputs (comma-separated, first column α = steps/N,
    second eg; '#' comments)."""
    out = []
    for path in paths:
        data = np.loadtxt(path, comments="#", delimiter=",", ndmin=2)
        out.append((data[:, 0], data[:, 1]))
    return out


def mean_se(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(v, float)
    return v.mean(0), v.std(0, ddof=1) / math.sqrt(v.shape[0]) if v.shape[0] > 1 else \
        np.full(v.shape[1], np.nan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--N", type=int, default=2000)
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--M", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--alpha-max", type=float, default=1000.0)
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--teacher", choices=("gaussian", "orthonormal"), default="gaussian",
                    help="Teacher rows N(0, I/N) (nn2pp's B ~ N(0,1)) or exactly T = I.")
    ap.add_argument("--streams", default="counter")
    ap.add_argument("--engine", choices=("full", "reduced", "auto"), default="full",
                    help="full (the O(k′d) engine) or reduced (the exact network chain: "
                         "the same law at a cost per step independent of N).")
    ap.add_argument("--nn2pp-dat", nargs="*", default=[],
                    help="nn2pp output files (.dat) of the same setting, to print beside.")
    ap.add_argument("--out", default=None, help="Write the trajectory (HDF5) here.")
    args = ap.parse_args()

    setting = Nn2ppSetting(N=args.N, K=args.K, M=args.M, lr=args.lr, teacher=args.teacher)
    config = nn2pp_config(setting, alpha_max=args.alpha_max, runs=args.runs, seed=args.seed,
                          streams=args.streams, engine=args.engine)
    t0 = time.perf_counter()
    traj = simulate(config)
    wall = time.perf_counter() - t0
    if args.out:
        from sims.io.trajectory import write_trajectory

        write_trajectory(args.out, traj, config, config.run_instances())
    alphas = [a for a in ALPHAS if a <= args.alpha_max]
    alpha = traj.steps / args.N
    sgd = at_alpha(alpha, traj.loss / 2, alphas)
    ode = at_alpha(alpha, traj.extra["ode_loss"] / 2, alphas)
    s_mean, s_se = mean_se(sgd)
    s_med = np.median(sgd, axis=0)
    o_mean = np.nanmean(ode, axis=0)
    files = sorted(p for pat in args.nn2pp_dat for p in glob.glob(pat))
    peer = np.concatenate([at_alpha(a, eg, alphas) for a, eg in read_nn2pp_dat(files)]) \
        if files else None
    print(f"nn2pp default in loradyn: erf(x/sqrt2), K = {args.K}, M = {args.M}, lr = "
          f"{args.lr} (eta = lr/(2N) = {config.eta:.4g}), N = {args.N}, teacher "
          f"{args.teacher}, {args.runs} runs, alpha to {args.alpha_max:g}, engine "
          f"{traj.engine}: {wall:.0f} s "
          f"({args.runs * config.steps / wall:,.0f} run-steps/s)")
    head = (f"{'alpha':>7}  {'ODE (mean)':>11}  {'SGD mean ± SE':>22}  {'SGD median':>11}"
            + (f"  {'nn2pp SGD mean ± SE (' + str(len(files)) + ')':>26}" if files else ""))
    print(head)
    for j, a in enumerate(alphas):
        line = (f"{a:>7g}  {o_mean[j]:>11.5g}  {s_mean[j]:>11.5g} ± {s_se[j]:<8.2g}  "
                f"{s_med[j]:>11.5g}")
        if peer is not None:
            p_mean, p_se = mean_se(peer)
            line += f"  {p_mean[j]:>14.5g} ± {p_se[j]:<8.2g}"
        print(line)


if __name__ == "__main__":
    main()
