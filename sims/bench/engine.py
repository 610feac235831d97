"""``loradyn bench engine``: run-steps/s of the engine against two references, in one run.

- engine: the full engine's hot loop (``FullRun.advance``), R runs at once;
- autograd loop: ``sims/bench/autograd_loop.py``, the paper's eq. (4) with autograd, one run
  at a time (the faster of 1 thread and all threads);
- sampling bound: just ``torch.Tensor.normal_`` of an (R, d) tensor per step.
Each is measured ``--repeats`` times, interleaved; medians and their ratios are reported.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import dataclass, replace

import click
import torch

from dynamics.randomness.sampling import resolve_device, resolve_dtype
from dynamics.setup.config import RunConfig
from sims.bench.rates import engine_rate, sampler_rate, sampling_rate

__all__ = ["command", "EngineBench", "measure"]

GOALS = {"engine_over_autograd": 100.0, "engine_over_sampling": 0.5}


def _autograd_module():
    from sims.bench import autograd_loop

    return autograd_loop


def measure(d=2000, k=50, runs=256, steps=1024, autograd_steps=1000, dtype="float32",
            device="cpu", repeats=3) -> dict:
    """Medians of the rates (ReLU, projected, b = 1) over interleaved repeats, and ratios."""
    activation = "relu"
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    spec = {"activation": activation, "k": k, "d": d, "xi": 1.0, "W": "separated", "seed": 0}
    config = RunConfig(instance=spec, eta=0.05 / d, steps=steps, runs=runs, seed=0,
                       checkpoints=2, dtype=dtype, device=str(dev)).validate()
    baseline = _autograd_module()
    problem = baseline.make_problem(k, d, dtype=dt)
    rates: dict[str, list[float]] = {"engine": [], "autograd_loop": [], "sampling_bound": [],
                                     "engine_sampler": []}
    threads_used = []
    load_before = os.getloadavg()[0]
    for _ in range(repeats):
        rates["engine"].append(engine_rate(config))
        by_threads = {n: baseline.rate(problem, 0.05 / d, autograd_steps, threads=n)
                      for n in sorted({1, torch.get_num_threads()})}
        best = max(by_threads, key=by_threads.get)
        threads_used.append(best)
        rates["autograd_loop"].append(by_threads[best])
        for n, val in by_threads.items():
            rates.setdefault(f"autograd_loop_{n}_threads", []).append(val)
        rates["sampling_bound"].append(sampling_rate(runs, d, steps, dev, dt))
        rates["engine_sampler"].append(sampler_rate(runs, d, steps, dev, dt))
    med = {key: statistics.median(vals) for key, vals in rates.items()}
    return {
        "setup": {"d": d, "k": k, "runs": runs, "steps": steps, "autograd_steps": autograd_steps,
                  "dtype": dtype, "device": str(dev), "activation": activation,
                  "repeats": repeats, "torch_threads": torch.get_num_threads(),
                  "autograd_threads": statistics.mode(threads_used),
                  "torch": torch.__version__, "machine": platform.processor() or
                  platform.machine(), "cpu_count": os.cpu_count(),
                  "load_average": [load_before, os.getloadavg()[0]]},
        "run_steps_per_s": med,
        "all_run_steps_per_s": rates,
        "ratios": {"engine_over_autograd": med["engine"] / med["autograd_loop"],
                   "engine_over_sampling": med["engine"] / med["sampling_bound"]},
        "goals": GOALS,
    }


def _report(res: dict) -> str:
    s, r, q = res["setup"], res["run_steps_per_s"], res["ratios"]
    lines = [f"loradyn bench engine: d={s['d']} k={s['k']} R={s['runs']} {s['activation']} "
             f"{s['dtype']} {s['device']} ({s['torch_threads']} threads), online SGD b=1, "
             f"projected; medians of {s['repeats']}; load average "
             f"{s['load_average'][0]:.1f}→{s['load_average'][1]:.1f} on {s['cpu_count']} CPUs",
             f"  engine          {r['engine']:>12,.0f} run-steps/s",
             f"  autograd loop   {r['autograd_loop']:>12,.0f} run-steps/s  (one run at a time, "
             f"full W, {s['autograd_threads']} thread(s))",
             f"  sampling bound  {r['sampling_bound']:>12,.0f} run-steps/s  "
             "(Tensor.normal_ of (R, d) per step)",
             f"  engine sampler  {r['engine_sampler']:>12,.0f} run-steps/s  "
             "(the engine's streams: per run on CPU, shared on CUDA; for information)",
             f"  engine / autograd loop  = {q['engine_over_autograd']:8.1f}x  "
             f"(goal ≥ {GOALS['engine_over_autograd']:g}x)",
             f"  engine / sampling bound = {q['engine_over_sampling']:8.2f}   "
             f"(goal ≥ {GOALS['engine_over_sampling']:g})"]
    if "reduced" in res:
        red = res["reduced"]
        lines.append(f"  reduced engine: {red.get('backend', 'numba (float64)')}, "
                     f"R={red.get('runs', '?')}")
        used = red.get("steps_used", {})
        lines += [f"  reduced engine  {r_:>12,.0f} run-steps/s at d = {int(dd):,}"
                  + (f"  (timed over {used[dd]:,} steps: {red['steps']:,} is too short to "
                     "time)" if used.get(dd, red.get("steps")) != red.get("steps") else "")
                  for dd, r_ in red["run_steps_per_s"].items()]
        lines += [f"  reduced d=1e7 / d=1e2     = {red['ratio_1e7_over_1e2']:8.2f}   (goal ≥ 0.9)",
                  f"  reduced / full at d={red['d']} = {red['ratio_to_full_at_d']:8.1f}x  "
                  "(goal ≥ 20x)"]
    if "learners" in res:
        lr = res["learners"]
        lines.append(f"  learners (full engine, R={lr['runs']}, {lr['steps']} steps, "
                     f"best of {lr['repeats']}):")
        for label, rate in lr["run_steps_per_s"].items():
            text = f"{rate:>12,.0f} run-steps/s" if isinstance(rate, float) else rate
            lines.append(f"    {label:<24}{text}")
    return "\n".join(lines)


@dataclass(frozen=True)
class EngineBench:
    """The options of one ``loradyn bench engine``: its click parameters."""

    d: int
    k: int
    runs: int
    steps: int
    autograd_steps: int
    dtype: str
    device: str
    repeats: int
    reduced: bool
    reduced_steps: int
    reduced_runs: int | None
    learners: bool
    learner_runs: int
    learner_steps: int
    quick: bool
    as_json: bool

    def measured(self) -> EngineBench:
        """The settings measured: with ``quick``, fewer steps and one repeat."""
        if not self.quick:
            return self
        return replace(self, steps=min(self.steps, 128),
                       autograd_steps=min(self.autograd_steps, 100), repeats=1,
                       learner_steps=min(self.learner_steps, 32))


@click.command("engine")
@click.option("--d", "d", type=int, default=2000, help="Input dimension d.")
@click.option("--k", "k", type=int, default=50, help="Width k.")
@click.option("--runs", type=int, default=256, help="Runs R.")
@click.option("--steps", type=int, default=1024, help="Engine steps per measurement.")
@click.option("--autograd-steps", type=int, default=1000, help="Steps of the autograd loop.")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu")
@click.option("--repeats", type=int, default=3, help="Interleaved repeats (medians reported).")
@click.option("--reduced/--no-reduced", default=True,
              help="Also the reduced (dimension-free) engine at d = 1e2, 1e4, 1e7 and at --d.")
@click.option("--reduced-steps", type=int, default=10_000,
              help="Steps per reduced-engine measurement.")
@click.option("--reduced-runs", type=int, default=None,
              help="Runs of the reduced-engine rows (default --runs; on CUDA one thread per "
                   "run, so thousands fill the GPU).")
@click.option("--learners/--no-learners", default=True,
              help="Also one row per learner (full engine, same d and k).")
@click.option("--learner-runs", type=int, default=64, help="Runs R of the learner rows.")
@click.option("--learner-steps", type=int, default=256, help="Steps of each learner row.")
@click.option("--quick", is_flag=True, help="Fewer steps and one repeat (smoke test).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def command(**params):
    """Engine run-steps/s vs a per-run autograd loop and the sampling bound (ratios), and the
    reduced engine's run-steps/s across d with its ratio to the full engine at --d."""
    bench = EngineBench(**params).measured()
    res = measure(d=bench.d, k=bench.k, runs=bench.runs, steps=bench.steps,
                  autograd_steps=bench.autograd_steps, dtype=bench.dtype, device=bench.device,
                  repeats=bench.repeats)
    if bench.reduced:
        res["reduced"] = reduced_rows(bench.d, bench.k, bench.reduced_runs or bench.runs,
                                      bench.reduced_steps, bench.repeats,
                                      res["run_steps_per_s"]["engine"],
                                      res["setup"]["device"], bench.runs)
    if bench.learners:
        from sims.bench.learners import learner_rows

        res["learners"] = {"runs": bench.learner_runs, "steps": bench.learner_steps,
                           "repeats": bench.repeats,
                           "run_steps_per_s": learner_rows(bench.d, bench.k, bench.learner_runs,
                                                           bench.learner_steps, bench.dtype,
                                                           bench.device, bench.repeats)}
    click.echo(json.dumps(res) if bench.as_json else _report(res))


REDUCED_D = (100, 10_000, 10_000_000)


def reduced_rows(d, k, runs, steps, repeats, full_rate, device="cpu", full_runs=None) -> dict:
    """Reduced-engine rates (float64; numba on CPU, numba-cuda on CUDA) at ``REDUCED_D`` and at
    ``d``, with the ratios rate(1e7)/rate(1e2) and rate(d)/full-engine rate(d) measured in this
    same run (the full engine with ``full_runs`` runs)."""
    from sims.bench.reduced import measure_reduced

    device = "cuda" if str(device).startswith("cuda") else "cpu"
    res = measure_reduced(d_values=tuple(sorted(set(REDUCED_D) | {d})), k=k, runs=runs,
                          steps=steps, full_d=None, repeat=repeats, device=device)
    rates = res["reduced"]
    return {"run_steps_per_s": {str(dd): r for dd, r in rates.items()},
            "steps": steps, "steps_used": {str(dd): n for dd, n in res["steps_used"].items()},
            "runs": runs, "full_runs": full_runs or runs, "backend": res["settings"]["backend"],
            "ratio_1e7_over_1e2": rates[max(REDUCED_D)] / rates[min(REDUCED_D)],
            "ratio_to_full_at_d": rates[d] / full_rate, "d": d}
