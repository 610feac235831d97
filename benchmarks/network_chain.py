"""The network learners' exact chain (``dynamics.reduced.network_chain``): steps/s per thread,
its independence of d, its cost against the rank-1 chain, and side by side with nn2pp.

    python benchmarks/network_chain.py [--nn2pp /path/to/nn2pp.exe] [--repeats 3]
        [--seconds 2] [--out results/network_chain.json]

(or LORADYN_NN2PP=/path/to/nn2pp.exe). One thread everywhere (NUMBA_NUM_THREADS = 1, one run),
float64; medians over interleaved repeats (each repeat's rates kept under ``repeats``); every
ratio is the median over repeats of the ratio of two rates measured side by side in this run.

- ``nn2pp setting``: ``scratch``, free rows, committee teacher (T = I), erf(x/√2), A = v = 1,
  K = M ∈ {2, 50}, N = 2000, η·d = 0.5 (nn2pp's lr 0.5): the chain's rate (two horizons,
  set-up removed) against nn2pp's (``benchmarks/peer_nn2pp.py``: two horizons, start-up
  removed) and the full engine's hot loop (``FullRun.advance``), all at one thread; beside
  them the floor of any exact-law step (:func:`floor_rate`: the step's variates and σ
  evaluations alone), measured in the same run.
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
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chain_settings import NN2PP_ERF, claim2_config, committee_config  # noqa: E402
from peer_nn2pp import loradyn_rate, nn2pp_rate  # noqa: E402

from dynamics.reduced import _rng  # noqa: E402
from dynamics.reduced.network_simulate import ChainStart, NetworkChain  # noqa: E402
from dynamics.setup.config import RunConfig  # noqa: E402
from hermite.activations_numba import compiled_activation, sigma, sigma_and_deriv  # noqa: E402


def chain_rate(config: RunConfig, steps: tuple[int, int]) -> float:
    """Steps/s of the chain's kernel from two horizons (set-up and checkpoints removed)."""
    chain, times = NetworkChain(), []
    for n in steps:
        start = ChainStart(config, config.run_instances())
        t0 = time.perf_counter()
        chain._advance(start, np.zeros(1, np.int64), n)
        times.append(time.perf_counter() - t0)
    return (steps[1] - steps[0]) / max(times[1] - times[0], 1e-9)


@njit  # not cached: a script run as __main__ or through runpy has no module to cache under
def _floor_steps(n, k, kp, t, cap, rest_dim, code, hp, scale, st):
    """``n`` steps of what a chain step cannot do without: its variates (t + m normals, m
    cycling k′ … cap − 1 as the chain's width between compressions, and one χ²_{d−t−m})
    and its σ evaluations (k teacher σ, k′ student σ and σ′), on fields taken from the
    draws alone (no rows, no update). Returns a sum of everything (kept live) and the
    stream, which has then drawn exactly what the chain's run draws in n steps."""
    acc = 0.0
    m = kp
    xs = np.empty(t + cap)
    preps = np.empty((cap, 3))  # tabulated per width, as the chain does
    for mm in range(cap):
        preps[mm, 0], preps[mm, 1], preps[mm, 2] = _rng.chi2_prepare(rest_dim - mm)
    for _ in range(n):
        if m + 1 > cap:
            m = kp
        for q in range(t + m):
            xs[q], st = _rng.normal(st)
        c = preps[m]
        q2, st = _rng.chi2_prepared((np.int64(c[0]), c[1], c[2]), st)
        acc += math.sqrt(q2)
        for i in range(k):
            acc += sigma(scale * xs[i % t], code, hp)
        for j in range(kp):
            sv, sd = sigma_and_deriv(scale * (xs[j % t] + xs[t + j % m]), code, hp)
            acc += sv + sd
        m += 1
    return acc, st


def floor_args(config: RunConfig, stream, least: bool = False) -> tuple:
    """The arguments of :func:`_floor_steps` after n for ``config``'s chain (free rows, b = 1,
    no label noise, the chain's start width k′) from ``stream``. ``least``: the width held
    at k′ (t + k′ normals a step, the fewest of any chain on (P, Z): the rows' outside parts
    span k′ dimensions), as a chain re-triangularising Z every step would draw."""
    start = ChainStart(config, config.run_instances())
    code, hp, scale = compiled_activation(start.instances[0].activation)
    k, kp, t = start.V.shape[1], start.P.shape[1], start.P.shape[2]
    d = config.instance["d"]
    cap = kp + 1 if least else min(start.Z.shape[2], d - t)
    return (k, kp, t, cap, d - t, code, hp, scale, stream)


def floor_rate(config: RunConfig, steps: tuple[int, int], least: bool = False) -> float:
    """Steps/s of :func:`_floor_steps` for ``config``'s chain (one thread, two horizons): the
    bound on any exact-law chain step that draws these variates (``least``: the fewest) and
    evaluates σ as the chain does."""
    args = floor_args(config, np.uint64(1), least)
    _floor_steps(10, *args)  # compile outside the timings
    times = []
    for n in steps:
        t0 = time.perf_counter()
        _floor_steps(n, *args)
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


def _ratio(rates, a, b):
    """The median over repeats of rates[a]/rates[b], each repeat's pair measured side by side
    (this machine's speed drifts between repeats by up to 2×, both sides alike)."""
    return _median([x / y for x, y in zip(rates[a], rates[b], strict=True)])


def measure(exe: str | None, repeats: int = 3, seconds: float = 2.0) -> dict:
    n = 2000
    chain_rate(committee_config(n, 2, 10), (10, 20))  # compile outside the timings
    out: dict = {"machine": f"{os.cpu_count()} cores, one thread each", "nn2pp": {},
                 "d_independence": {}, "claim2_vs_rank_one": {}}
    for width in (2, 50):
        rates = {"chain": [], "floor": [], "floor_least": [], "full": [], "nn2pp": []}
        probe = chain_rate(committee_config(n, width, 10), (1000, 5000))
        steps = int(max(probe * seconds, 2000))
        full_steps = int(max(steps / 300, 2000))
        if exe:  # nn2pp's two horizons ≈ 1.5·seconds apart at its own rate (a shorter gap
            # lets the start-up's jitter swamp the difference)
            with tempfile.TemporaryDirectory() as tmp:
                peer = nn2pp_rate(exe, n, width, (0.5, 1.5), 1, tmp)[0]
            gap = 1.5 * seconds * (peer if np.isfinite(peer) else 2e4 / width) / n
            alphas = (0.5, 0.5 + max(1.0, gap))
        for _ in range(repeats):
            rates["chain"].append(chain_rate(committee_config(n, width, 10),
                                             (steps // 10, steps)))
            for least, key in ((False, "floor"), (True, "floor_least")):
                rates[key].append(floor_rate(committee_config(n, width, 10),
                                             (steps // 10, steps), least))
            rates["full"].append(loradyn_rate(n, width, full_steps, "auto", NN2PP_ERF)[0])
            if exe:
                with tempfile.TemporaryDirectory() as tmp:
                    rates["nn2pp"].append(nn2pp_rate(exe, n, width, alphas, 1, tmp)[0])
        row = {name: _median(v) for name, v in rates.items()}
        for key in ("chain", "floor", "floor_least"):
            row[f"{key}_over_nn2pp"] = _ratio(rates, key, "nn2pp") if exe else None
        row["chain_over_floor"] = _ratio(rates, "chain", "floor")
        row["chain_over_full"] = _ratio(rates, "chain", "full")
        row["repeats"] = rates
        out["nn2pp"][f"K=M={width}"] = row
    rates = {d: [] for d in (100, 10_000, 1_000_000)}
    for rep in range(repeats):  # the order alternates: a drift within a repeat cancels
        for d in list(rates)[::1 if rep % 2 == 0 else -1]:
            rates[d].append(chain_rate(committee_config(d, 2, 10), (200_000, 2_000_000)))
    out["d_independence"] = {d: _median(v) for d, v in rates.items()}
    out["d_independence"]["ratio_1e6_over_1e2"] = _ratio(rates, 1_000_000, 100)
    out["d_independence"]["repeats"] = rates
    rates = {"scratch_k4": [], "rank_one_k8": []}
    for rep in range(repeats):
        for key in list(rates)[::1 if rep % 2 == 0 else -1]:
            rates[key].append(
                chain_rate(claim2_config(10_000, 10), (50_000, 500_000)) if key == "scratch_k4"
                else rank_one_rate(10_000, 8, (200_000, 2_000_000)))
    out["claim2_vs_rank_one"] = {key: _median(v) for key, v in rates.items()}
    out["claim2_vs_rank_one"]["cost_ratio"] = _ratio(rates, "rank_one_k8", "scratch_k4")
    out["claim2_vs_rank_one"]["repeats"] = rates
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
