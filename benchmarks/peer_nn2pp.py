"""Side by side with the peer nn2pp (sgoldt/nn2pp, C++/Armadillo): online SGD of a two-layer
network from scratch, one run, one thread each, float64, N = d and K = M = width.

    python benchmarks/peer_nn2pp.py --nn2pp /path/to/nn2pp.exe [--widths 2,50] [--N 2000]
        [--repeats 3] [--streams auto,counter] [--activation relu] [--seconds 3]
        [--cpu 0 | --no-pin] [--out peer.json]

(or LORADYN_NN2PP=/path/to/nn2pp.exe). Without a binary it prints one line and exits 0.

What is timed, interleaved ``--repeats`` times (medians and their ratios are reported):

- nn2pp: the whole process for two horizons α₁ < α₂ (``--steps`` counts updates in units
  of N), wall time and CPU time (rusage) of each; rate = (α₂ − α₁)·N / difference, which
  removes start-up (teacher, student, output file) and its printing (200 log-spaced rows
  with Q, R, T, the same number in both horizons from α₁ = 0.5 on). Flags ``-N N -K w
  -M w --lr 0.5 --seed 1 --quiet``; σ = erf(x/√2) (its default, ``--g1 1 --g2 1``) for
  teacher and student, fixed second layer (A = v = 1). nn2pp's ReLU (``--g1 2 --g2 2``) is
  not used by default: with a ReLU it computes a numerical test error on 10⁵ fresh
  N-dimensional inputs at each of its ~200 print times (10⁵·N·K flops each), which would
  time that evaluation, not the SGD steps (``--nn2pp-g 2`` forces it anyway).
- loradyn: ``scratch`` (fixed second layer λ̂ = λ, width = k), one run, the full engine's
  hot loop ``FullRun.advance`` (sampling included; no set-up), wall and process CPU time.
  erf(x/√2) is not a loradyn activation (``erf`` is erf(x); a user's numpy σ would leave
  the compiled path), so loradyn runs ``--activation`` (default ReLU, the brief's choice);
  σ and σ′ cost k evaluations per step against the O(kd) row work, so the activation does
  not move either rate measurably. Streams: ``auto`` (per-run torch generators, the
  default) and ``counter`` (the counter-based ziggurat, ``dynamics.randomness.counter_stream``).
- sampling bounds at one thread: torch's float64 ``normal_`` of N numbers per step (the
  default streams) and the counter streams' fill of N numbers per step, as steps/s: no
  learner drawing its examples from that sampler can run faster.

One thread each: OMP/MKL/NUMBA threads 1, ``torch.set_num_threads(1)``, and (default) this
process and nn2pp pinned to the same single CPU, so loradyn's background sampler thread
shares that core with its hot loop. On a shared machine the wall rates move with the load;
the CPU-time rates less so; the ratios are of medians over interleaved repeats.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from dynamics.engines.engine import FullRun  # noqa: E402
from dynamics.randomness.counter_stream import fill_normals  # noqa: E402
from dynamics.randomness.sampling import counter_keys  # noqa: E402
from dynamics.setup.config import RunConfig  # noqa: E402

CHUNK = 256  # steps per chunk of examples (the engine's largest chunk)
ALPHA0 = 0.5  # nn2pp's shorter horizon α₁ (units of N steps)


# ---------------------------------------------------------------------------- nn2pp
def _nn2pp_once(exe: str, n: int, width: int, alpha: float, g: int, cwd: str):
    """(wall s, CPU s) of one nn2pp process of α·N steps."""
    cmd = [exe, "-N", str(n), "-K", str(width), "-M", str(width), "--lr", "0.5",
           "--steps", f"{alpha:g}", "--seed", "1", "--quiet", "--g1", str(g), "--g2", str(g)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ))
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
    if status != 0:
        raise RuntimeError(f"nn2pp failed ({status}): {' '.join(cmd)}: {err[-300:]}")
    return wall, usage.ru_utime + usage.ru_stime


def nn2pp_rate(exe, n, width, alphas, g, cwd) -> tuple[float, float]:
    """(wall, CPU) steps/s from the two horizons α₁ < α₂."""
    (w1, c1), (w2, c2) = (_nn2pp_once(exe, n, width, a, g, cwd) for a in alphas)
    steps = (alphas[1] - alphas[0]) * n

    def per_s(dt):  # NaN when noise swamped the difference (ignored by the medians)
        return steps / dt if dt > 0 else float("nan")

    return per_s(w2 - w1), per_s(c2 - c1)


# ---------------------------------------------------------------------------- loradyn
def loradyn_config(n, width, steps, streams, activation) -> RunConfig:
    spec = {"activation": activation, "k": width, "d": n, "xi": 1.0, "W": "separated",
            "seed": 0}
    return RunConfig(instance=spec, learner="scratch", eta=0.5 / n, steps=steps, runs=1,
                     seed=0, checkpoints=2, dtype="float64", device="cpu", streams=streams,
                     finite_d_theory=False).validate()


def loradyn_rate(n, width, steps, streams, activation, fast=True) -> tuple[float, float]:
    """(wall, CPU) steps/s of the engine's hot loop (set-up excluded); ``fast=False``: the
    plain torch step (``step_prepared_`` step by step, the reference path)."""
    run = FullRun(loradyn_config(n, width, steps, streams, activation))
    run.learner.fast = fast
    t0, c0 = time.perf_counter(), time.process_time()
    run.advance()
    return steps / (time.perf_counter() - t0), steps / (time.process_time() - c0)


# ---------------------------------------------------------------------------- bounds
def torch_sampling_rate(n, steps) -> float:
    """Steps/s of torch's float64 normal_ of n numbers per step, one generator."""
    gen = torch.Generator().manual_seed(0)
    buf = torch.empty((CHUNK, n), dtype=torch.float64)
    t0 = time.process_time()
    for _ in range(max(1, steps // CHUNK)):
        buf.normal_(generator=gen)
    return max(1, steps // CHUNK) * CHUNK / (time.process_time() - t0)


def counter_sampling_rate(n, steps) -> float:
    """Steps/s of the counter streams' fill of n numbers per step."""
    keys = counter_keys(0, 1)
    buf = np.empty((1, CHUNK * n))
    fill_normals(buf, CHUNK * n, keys, 0, range(1))  # compile / load
    t0 = time.process_time()
    reps = max(1, steps // CHUNK)
    for i in range(reps):
        fill_normals(buf, CHUNK * n, keys, (i + 1) * CHUNK * n, range(1))
    return reps * CHUNK / (time.process_time() - t0)


# ---------------------------------------------------------------------------- driver
def _calibrate_nn2pp(exe, n, width, g, cwd, seconds) -> tuple[float, float]:
    """Horizons (α₁, α₂) whose difference takes about ``seconds`` (wall) on this machine.

    nn2pp prints (and computes Q, R, T: O(K²N)) at 200 log-spaced times in [0.1, α]; from
    α ≥ 0.3 they fall on 200 distinct steps, so both horizons pay the same printing."""
    probe = ALPHA0 + 0.5
    wall, _ = _nn2pp_once(exe, n, width, probe, g, cwd)  # start-up included: a lower bound
    d_alpha = min(200.0, max(0.25, round(seconds * probe / wall, 2)))
    return ALPHA0, ALPHA0 + d_alpha


def _calibrate_loradyn(n, width, streams, activation, seconds, fast=True) -> int:
    loradyn_rate(n, width, 2 * CHUNK, streams, activation, fast)  # compile / load, warm up
    wall, _ = loradyn_rate(n, width, 4 * CHUNK, streams, activation, fast)
    return int(max(4, round(seconds * wall / CHUNK)) * CHUNK)


def measure(exe, n=2000, widths=(2, 50), repeats=3, streams=("auto", "counter"),
            activation="relu", seconds=3.0, g=1, plain=False) -> dict:
    """Rates and ratios (see the module doc); ``plain`` adds the torch step's row."""
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    load_before = os.getloadavg()
    rates: dict = {}
    with tempfile.TemporaryDirectory() as cwd:
        plan = {w: {"alphas": _calibrate_nn2pp(exe, n, w, g, cwd, seconds),
                    "steps": {s: _calibrate_loradyn(n, w, s, activation, seconds)
                              for s in streams},
                    "plain": (_calibrate_loradyn(n, w, "auto", activation, seconds / 2, False)
                              if plain else 0)} for w in widths}
        for _ in range(repeats):
            for w in widths:
                r = rates.setdefault(w, {})
                r.setdefault("nn2pp", []).append(
                    nn2pp_rate(exe, n, w, plan[w]["alphas"], g, cwd))
                for s in streams:
                    r.setdefault(f"loradyn {s}", []).append(
                        loradyn_rate(n, w, plan[w]["steps"][s], s, activation))
                if plain:
                    r.setdefault("loradyn torch step", []).append(
                        loradyn_rate(n, w, plan[w]["plain"], "auto", activation, False))
        steps = max(p for w in widths for p in plan[w]["steps"].values())
        bounds = {"torch float64 normal_": torch_sampling_rate(n, min(steps, 8 * CHUNK)),
                  "counter streams": counter_sampling_rate(n, min(steps, 32 * CHUNK))}
    out = {"setup": {"N": n, "widths": list(widths), "repeats": repeats,
                     "activation_loradyn": activation,
                     "activation_nn2pp": {1: "erf(x/√2)", 2: "relu"}.get(g, str(g)),
                     "nn2pp": exe, "plan": {str(w): plan[w] for w in widths},
                     "cpus": sorted(os.sched_getaffinity(0)),
                     "load_average": [load_before, os.getloadavg()]},
           "sampling_bound_steps_per_s": bounds, "widths": {}}
    for w in widths:
        med = {name: {kind: _median(v[i] for v in vals)
                      for i, kind in enumerate(("wall", "cpu"))}
               for name, vals in rates[w].items()}
        ratios = {name: {kind: med[name][kind] / med["nn2pp"][kind] for kind in ("wall", "cpu")}
                  for name in med if name != "nn2pp"}
        out["widths"][str(w)] = {"steps_per_s": med, "over_nn2pp": ratios,
                                 "all": {name: vals for name, vals in rates[w].items()}}
    return out


def _median(values) -> float:
    vals = [v for v in values if np.isfinite(v)]
    return statistics.median(vals) if vals else float("nan")


def report(res: dict) -> str:
    s = res["setup"]
    lines = [f"peer nn2pp vs loradyn scratch: N = d = {s['N']}, one run, one thread each "
             f"(CPUs {s['cpus']}), float64, medians of {s['repeats']} interleaved repeats; "
             f"nn2pp σ = {s['activation_nn2pp']}, loradyn σ = {s['activation_loradyn']}; "
             f"load average {s['load_average'][0][0]:.2f} → {s['load_average'][1][0]:.2f}"]
    for w, entry in res["widths"].items():
        lines.append(f"  width K = M = k = {w}:")
        for name, med in entry["steps_per_s"].items():
            ratio = entry["over_nn2pp"].get(name)
            extra = (f"   ×{ratio['wall']:.2f} (wall) ×{ratio['cpu']:.2f} (CPU) nn2pp"
                     if ratio else "")
            lines.append(f"    {name:18s} {med['wall']:10.0f} steps/s wall "
                         f"{med['cpu']:10.0f} steps/s CPU{extra}")
    for name, rate in res["sampling_bound_steps_per_s"].items():
        lines.append(f"  sampling bound ({name}, N numbers per step, CPU): {rate:.0f} steps/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nn2pp", default=os.environ.get("LORADYN_NN2PP"),
                    help="Built nn2pp binary (default: $LORADYN_NN2PP).")
    ap.add_argument("--N", type=int, default=2000)
    ap.add_argument("--widths", default="2,50")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", default="auto,counter")
    ap.add_argument("--activation", default="relu", help="loradyn's σ (registry name).")
    ap.add_argument("--nn2pp-g", type=int, default=1, help="nn2pp's --g1/--g2 (1 = erf).")
    ap.add_argument("--plain", action="store_true",
                    help="Also the plain torch step (learner.fast = False), auto streams.")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="Target length of each timed difference.")
    ap.add_argument("--cpu", type=int, default=None,
                    help="Pin both to this CPU [default: the first allowed one].")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--out", default=None, help="Write the full results as JSON.")
    args = ap.parse_args(argv)
    if not args.nn2pp:
        print("peer_nn2pp: no nn2pp binary given (--nn2pp PATH or LORADYN_NN2PP); skipped")
        return 0
    if not os.access(args.nn2pp, os.X_OK):
        print(f"peer_nn2pp: {args.nn2pp} is not an executable; skipped")
        return 0
    if not args.no_pin:
        os.sched_setaffinity(0, {args.cpu if args.cpu is not None
                                 else min(os.sched_getaffinity(0))})
    res = measure(os.path.abspath(args.nn2pp), n=args.N,
                  widths=tuple(int(w) for w in args.widths.split(",")),
                  repeats=args.repeats, streams=tuple(args.streams.split(",")),
                  activation=args.activation, seconds=args.seconds, g=args.nn2pp_g,
                  plain=args.plain)
    print(report(res))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
