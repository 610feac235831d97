"""The network learners' exact chain on a GPU: ``numba-cuda`` (one thread per run, every step
in one launch) against ``numba`` on all the CPU cores, and the two backends' numbers compared.

    python benchmarks/network_chain_gpu.py [--runs 1024,8192,65536] [--cpu-runs 64,1024]
                                           [--steps 20000] [--out results/network_chain_gpu.json]

Two settings, float64, d = 10⁴ (the chain's cost does not depend on d):

- ``nn2pp``: ``scratch``, free rows, committee teacher, erf(x/√2), K = M = 2, η·d = 0.5;
- ``claim2``: ``scratch``, unit rows, He₃, k = k′ = 4, W = claim2, ξ = 1, η·d = 0.5.

For each (setting, backend, R): run-steps/s and steps/s per run from two horizons (n and 2n
steps; set-up, copies and compilation removed by the difference). Before timing, the same
few-step runs on both backends (the test cases of ``tests/test_network_chain.py``) are
compared: the largest relative difference of their records is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch  # noqa: F401  (loaded before scipy.stats, which probes torch.Tensor)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from chain_settings import claim2_config, committee_config  # noqa: E402

from dynamics.reduced.network_simulate import ChainStart, NetworkChain  # noqa: E402


def _config(setting: str, d: int, runs: int):
    from dataclasses import replace

    config = committee_config(d, 2, 10) if setting == "nn2pp" else claim2_config(d, 10)
    return replace(config, runs=runs).validate()


def rate(setting: str, d: int, runs: int, steps: int, backend: str) -> tuple[float, float]:
    """(run-steps/s, seconds of the 2·steps horizon) from horizons ``steps`` and 2·``steps``."""
    config = _config(setting, d, runs)
    chain = NetworkChain()

    def go(n):
        start = ChainStart(config, config.run_instances())
        t0 = time.perf_counter()
        chain._advance(start, np.zeros(1, np.int64), n, backend=backend)
        return time.perf_counter() - t0

    go(2)  # compile / load
    t1, t2 = go(steps), go(2 * steps)
    return runs * steps / max(t2 - t1, 1e-9), t2


def agreement() -> dict:
    """Largest relative difference between numba-cuda and numba on the test cases."""
    from test_network_chain import CUDA_CASES, advance_cuda_case

    out = {}
    for name in CUDA_CASES:
        cpu, gpu = advance_cuda_case(name, "numba"), advance_cuda_case(name, "numba-cuda")
        out[name] = max(float(np.max(np.abs(g - c) / np.maximum(np.abs(c), 1e-12)))
                        if c.size else 0.0 for c, g in zip(cpu, gpu, strict=True))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=10_000)
    ap.add_argument("--runs", default="1024,8192,65536")
    ap.add_argument("--cpu-runs", default="64,1024")
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--settings", default="nn2pp,claim2")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="Skip larger R once one measurement took longer than this (s).")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import numba
    from numba import cuda

    res: dict = {"threads": numba.get_num_threads(), "rows": []}
    plans = [("numba", args.cpu_runs)]
    if cuda.is_available():
        name = cuda.get_current_device().name
        res["gpu"] = name.decode() if isinstance(name, bytes) else name
        res["agreement_max_rel"] = agreement()
        print("numba-cuda vs numba, largest relative difference:", res["agreement_max_rel"],
              flush=True)
        plans.append(("numba-cuda", args.runs))
    for setting in args.settings.split(","):
        for backend, runs_list in plans:
            for runs in [int(r) for r in runs_list.split(",")]:
                rs, wall = rate(setting, args.d, runs, args.steps, backend)
                row = {"setting": setting, "backend": backend, "runs": runs, "d": args.d,
                       "steps": args.steps, "run_steps_per_s": rs, "steps_per_s_per_run":
                       rs / runs}
                res["rows"].append(row)
                print(f"{setting:7s} {backend:10s} R={runs:6d}: {rs:14,.0f} run-steps/s, "
                      f"{rs / runs:12,.0f} steps/s per run", flush=True)
                if wall > args.budget:
                    break
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
