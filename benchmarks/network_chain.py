"""The network learners' exact chain (``dynamics.reduced.network_chain``): steps/s per thread,
its independence of d, its cost against the rank-1 chain, and side by side with nn2pp.

    python benchmarks/network_chain.py [--nn2pp /path/to/nn2pp.exe] [--repeats 3]
        [--seconds 2] [--out results/network_chain.json]

(or LORADYN_NN2PP=/path/to/nn2pp.exe). One thread everywhere (NUMBA_NUM_THREADS = 1, one run),
float64; medians over interleaved repeats; every ratio is of rates measured in this run.

- ``nn2pp setting``: ``scratch``, free rows, committee teacher (T = I), erf(x/√2), A = v = 1,
  K = M ∈ {2, 50}, N = 2000, η·d = 0.5 (nn2pp's lr 0.5): the chain's rate (two horizons,
  set-up removed) against nn2pp's (``benchmarks/peer_nn2pp.py``: two horizons, start-up
  removed) and the full engine's hot loop (``FullRun.advance``), all at one thread.
- ``d-independence``: the same chain at K = M = 2 for d = 10², 10⁴, 10⁶.
- ``Claim 2 instance vs rank-1 chain``: ``scratch`` (unit rows, k = k′ = 4, W = claim2, He₃,
  ξ = 1) against ``finetune``'s rank-1 chain at k = 8, both at d = 10⁴: cost per step.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chain_settings import NN2PP_ERF, claim2_config, committee_config  # noqa: E402
from peer_nn2pp import loradyn_rate, nn2pp_rate  # noqa: E402

from dynamics.config import RunConfig  # noqa: E402
from dynamics.reduced.network_simulate import ChainStart, NetworkChain  # noqa: E402


def chain_rate(config: RunConfig, steps: tuple[int, int]) -> float:
    """Steps/s of the chain's kernel from two horizons (set-up and checkpoints removed)."""
    chain, times = NetworkChain(), []
    for n in steps:
        start = ChainStart(config, config.run_instances())
        t0 = time.perf_counter()
        chain._advance(start, np.zeros(1, np.int64), n)
        times.append(time.perf_counter() - t0)
    return (steps[1] - steps[0]) / max(times[1] - times[0], 1e-9)


def rank_one_rate(d: int, k: int, steps: tuple[int, int]) -> float:
    """Steps/s of ``finetune``'s rank-1 chain (numba) at k, one run, two horizons."""
    from dynamics.reduced import simulate_reduced

    times = []
    for n in (steps[0], *steps):  # the first call compiles (not timed)
        config = RunConfig(instance={"activation": "he3", "k": k, "d": d, "xi": 1.0,
                                     "seed": 0}, eta=0.5 / d, steps=n, runs=1, seed=0,
                           checkpoints=2, engine="reduced", finite_d_theory=False)
        t0 = time.perf_counter()
        simulate_reduced(config, backend="numba")
        times.append(time.perf_counter() - t0)
    return (steps[1] - steps[0]) / max(times[2] - times[1], 1e-9)


def _median(xs):
    xs = [x for x in xs if np.isfinite(x)]
    return statistics.median(xs) if xs else float("nan")


def measure(exe: str | None, repeats: int = 3, seconds: float = 2.0) -> dict:
    n = 2000
    chain_rate(committee_config(n, 2, 10), (10, 20))  # compile outside the timings
    out: dict = {"machine": f"{os.cpu_count()} cores, one thread each", "nn2pp": {},
                 "d_independence": {}, "claim2_vs_rank_one": {}}
    for width in (2, 50):
        rates = {"chain": [], "full": [], "nn2pp": []}
        probe = chain_rate(committee_config(n, width, 10), (1000, 5000))
        steps = int(max(probe * seconds, 2000))
        full_steps = int(max(steps / 300, 2000))
        for _ in range(repeats):
            rates["chain"].append(chain_rate(committee_config(n, width, 10),
                                             (steps // 10, steps)))
            rates["full"].append(loradyn_rate(n, width, full_steps, "auto", NN2PP_ERF)[0])
            if exe:
                with tempfile.TemporaryDirectory() as tmp:
                    alphas = (0.5, 0.5 + max(1.0, 3.0 * seconds * 10000 / (n * width)))
                    rates["nn2pp"].append(nn2pp_rate(exe, n, width, alphas, 1, tmp)[0])
        row = {name: _median(v) for name, v in rates.items()}
        row["chain_over_nn2pp"] = row["chain"] / row["nn2pp"] if exe else None
        row["chain_over_full"] = row["chain"] / row["full"]
        out["nn2pp"][f"K=M={width}"] = row
    for d in (100, 10_000, 1_000_000):
        out["d_independence"][d] = _median([
            chain_rate(committee_config(d, 2, 10), (200_000, 2_000_000))
            for _ in range(repeats)])
    out["d_independence"]["ratio_1e6_over_1e2"] = (out["d_independence"][1_000_000]
                                                   / out["d_independence"][100])
    scratch = _median([chain_rate(claim2_config(10_000, 10), (50_000, 500_000))
                       for _ in range(repeats)])
    rank_one = _median([rank_one_rate(10_000, 8, (200_000, 2_000_000))
                        for _ in range(repeats)])
    out["claim2_vs_rank_one"] = {"scratch_k4": scratch, "rank_one_k8": rank_one,
                                 "cost_ratio": rank_one / scratch}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nn2pp", default=os.environ.get("LORADYN_NN2PP"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    res = measure(args.nn2pp, args.repeats, args.seconds)
    text = json.dumps(res, indent=2, default=float)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
