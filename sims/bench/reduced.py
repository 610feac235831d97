"""Throughput of the reduced engine (run-steps/s) across d, and against the full engine.

Run-steps/s = runs × steps / seconds of stepping. Fixed costs (instance packing, initial law,
observables) are removed by timing two horizons and differencing. A difference below
:data:`MIN_INTERVAL_S` is no measurement (the clock's resolution and the fixed costs' jitter are
of its size: 500 steps at d = 100 once gave 8·10¹² run-steps/s): the horizon is doubled until
the difference reaches it, up to :data:`MAX_GROWTH` times the steps asked for, and refused
beyond (:class:`ShortInterval`). The reduced engine is timed
through :func:`dynamics.reduced.first_passage_reduced` with an unreachable level (pure
stepping), the full engine through :func:`dynamics.engines.engine.simulate_full`. All measurements
of one call are taken in the same process, so their ratios are meaningful even on a shared host.
"""

from __future__ import annotations

import math
import time

import numpy as np

__all__ = ["measure_reduced", "MIN_INTERVAL_S", "MAX_GROWTH", "ShortInterval"]

MIN_INTERVAL_S = 0.01  # the shortest timed difference a rate is computed from
MAX_GROWTH = 1024  # the most the horizon is enlarged to reach it


class ShortInterval(ValueError):
    """A rate whose timed interval stays below :data:`MIN_INTERVAL_S` even at the largest
    horizon tried."""


def _config(d, k, runs, steps, activation, engine, dtype="float64", seed=0, device="cpu"):
    from dynamics.setup.config import RunConfig

    return RunConfig(instance={"activation": activation, "k": k, "d": int(d), "xi": 1.0,
                               "seed": seed},
                     eta=0.05 / d, steps=int(steps), runs=runs, seed=seed, checkpoints=2,
                     spacing="linear", engine=engine, dtype=dtype, device=device)


def _rate(run, runs, steps, repeat, steps_used: list | None = None):
    """(wall, cpu) run-steps per second from horizons ``steps`` and ``2·steps``.

    Each horizon keeps its fastest of ``repeat`` runs (wall and process CPU time separately),
    then the two are differenced; cpu counts every thread, so it is per core. Where the wall
    difference is below :data:`MIN_INTERVAL_S`, ``steps`` is doubled and the pair timed again
    (up to :data:`MAX_GROWTH`·steps; beyond, :class:`ShortInterval`); ``steps_used`` gets the
    horizon the rate comes from.
    """
    n = int(steps)
    while True:
        best = {1: [np.inf, np.inf], 2: [np.inf, np.inf]}
        for _ in range(repeat):
            for mult in (1, 2):
                w0, c0 = time.perf_counter(), time.process_time()
                run(mult * n)
                w, c = time.perf_counter() - w0, time.process_time() - c0
                best[mult] = [min(best[mult][0], w), min(best[mult][1], c)]
        wall = best[2][0] - best[1][0]
        if wall >= MIN_INTERVAL_S:
            break
        if 2 * n > MAX_GROWTH * steps:
            raise ShortInterval(
                f"{n} steps more took {max(wall, 0) * 1e3:.2g} ms, below the "
                f"{MIN_INTERVAL_S * 1e3:g} ms a rate needs (the clock's resolution and the "
                f"fixed costs' jitter), even at {MAX_GROWTH}× the {steps} steps asked for: "
                "no rate reported")
        n *= 2
    if steps_used is not None:
        steps_used.append(n)
    work = runs * n
    cpu = best[2][1] - best[1][1]
    return work / wall, work / cpu if cpu >= MIN_INTERVAL_S else math.nan


def measure_reduced(d_values=(100, 10_000, 10_000_000), k=50, runs=256, steps=10_000,
                    activation="relu", full_d: int | None = 2000, full_steps=40,
                    full_dtype="float32", repeat=3, device="cpu") -> dict:
    """Reduced-engine run-steps/s at each d and the full engine's at full_d.

    On ``device`` cpu the reduced chain is the ``numba`` backend (all cores), on cuda the
    ``numba-cuda`` one (one thread per run, all steps in one launch); both float64.

    Returns {"reduced": {d: rate}, "reduced_per_cpu_s": {d: rate per CPU-second (NaN where
    the CPU time's difference is below MIN_INTERVAL_S)}, "steps_used": {d: the horizon the rate
    comes from (``steps``, or more where its interval was too short: :func:`_rate`)},
    "ratio_large_small": rate(max d)/rate(min d), "full": rate or None, "full_per_cpu_s",
    "reduced_at_full_d", "ratio_to_full": rate(reduced at full_d)/rate(full), settings}.
    """
    from dynamics.engines.engine import simulate_full
    from dynamics.reduced import first_passage_reduced

    def reduced(d):
        return lambda n: first_passage_reduced(
            _config(d, k, runs, n, activation, "reduced", device=device), level=2.0,
            max_steps=n)

    reduced(min(d_values))(2)  # compile / load the kernels
    used: dict = {}
    both = {int(d): _rate(reduced(d), runs, steps, repeat, used.setdefault(int(d), []))
            for d in d_values}
    rates = {d: r[0] for d, r in both.items()}
    out = {"reduced": rates, "reduced_per_cpu_s": {d: r[1] for d, r in both.items()},
           "steps_used": {d: n[0] for d, n in used.items()},
           "ratio_large_small": rates[max(rates)] / rates[min(rates)],
           "full": None, "ratio_to_full": None,
           "settings": {"k": k, "runs": runs, "steps": steps, "activation": activation,
                        "full_d": full_d, "full_steps": full_steps, "full_dtype": full_dtype,
                        "device": device,
                        "backend": ("numba-cuda" if device == "cuda" else "numba") + " (float64)"}}
    if full_d is not None:
        def full(n):
            return simulate_full(_config(full_d, k, runs, n, activation, "full", full_dtype,
                                         device=device))

        full(2)
        out["full"], out["full_per_cpu_s"] = _rate(full, runs, full_steps, repeat)
        out["reduced_at_full_d"] = _rate(reduced(full_d), runs, steps, repeat)[0]
        out["ratio_to_full"] = out["reduced_at_full_d"] / out["full"]
    return out


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(measure_reduced(), indent=1))
