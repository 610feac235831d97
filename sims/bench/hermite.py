"""``loradyn bench hermite``: throughput of h(m) — Prop. 4 series and direct double sum (numba)
against a plain-numpy direct double sum, all measured in the same run on one core.

Each method evaluates h on an array of overlaps (the numba kernels are single-threaded);
evals/s = number of m values / best wall time of ``--repeat`` runs. Optionally the population
ODE (R runs × steps, numba, all cores) is timed too.
"""

from __future__ import annotations

import json
import time

import click
import numpy as np

__all__ = ["command", "numpy_direct", "run_benchmark"]


def numpy_direct(p_mat, q_mat, llq, b, m) -> np.ndarray:
    """Reference: h(m) = 2 Σᵢⱼ λλQ Σ_{p≤pmax} p μₚ² ρᵢⱼ^{p−1} in plain numpy (batched over m)."""
    rho = p_mat[None] + q_mat[None] * m[:, None, None]
    acc = np.zeros_like(rho)
    for coef in b[::-1]:
        acc = acc * rho + coef
    return 2.0 * np.einsum("mij,ij->m", acc, llq)


def _best(fn, repeat):
    best = np.inf
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run_benchmark(k=50, pmax=60, activation="relu", n_series=1_000_000, n_direct=2_000,
                  n_numpy=200, repeat=3, ode_runs=0, ode_steps=0, seed=0) -> dict:
    """Measure evals/s of h(m) by series, direct (numba) and numpy; returns a result dict."""
    from dynamics.instances.instance import build_instance
    from hermite import HSeries, HTable, h_direct, population_ode
    from hermite.expansion.series import _pair_arrays, derivative_weights

    inst = build_instance({"activation": activation, "k": k, "xi": 1.0, "seed": seed})
    rng = np.random.default_rng(seed)
    m_series = rng.uniform(-1, 1, n_series)
    m_direct = m_series[:n_direct]
    m_numpy = m_series[:n_numpy]
    series = HSeries(inst, pmax)
    p_mat, q_mat, llq = _pair_arrays(inst, None)
    b = derivative_weights(inst.activation, pmax)
    # warm-up (JIT compilation)
    series(m_series[:10])
    h_direct(inst, m_direct[:2], pmax)
    t_series, v_series = _best(lambda: series(m_series), repeat)
    t_direct, v_direct = _best(lambda: h_direct(inst, m_direct, pmax), repeat)
    t_numpy, v_numpy = _best(lambda: numpy_direct(p_mat, q_mat, llq, b, m_numpy), repeat)
    scale = float(np.max(np.abs(v_numpy)))
    res = {
        "k": k, "pmax": pmax, "activation": inst.activation.name,
        "evals_per_s": {"series": n_series / t_series, "direct_numba": n_direct / t_direct,
                        "numpy_direct": n_numpy / t_numpy},
        "n_evals": {"series": n_series, "direct_numba": n_direct, "numpy_direct": n_numpy},
        "max_rel_diff_vs_numpy": {
            "series": float(np.max(np.abs(v_series[:n_numpy] - v_numpy)) / scale),
            "direct_numba": float(np.max(np.abs(v_direct[:n_numpy] - v_numpy)) / scale)},
    }
    rate = res["evals_per_s"]
    res["ratios"] = {"series/numpy": rate["series"] / rate["numpy_direct"],
                     "direct_numba/numpy": rate["direct_numba"] / rate["numpy_direct"],
                     "series/direct_numba": rate["series"] / rate["direct_numba"]}
    if ode_runs and ode_steps:
        t0 = time.perf_counter()
        table = HTable(inst)
        t_table = time.perf_counter() - t0
        m0 = np.full(ode_runs, 0.01)
        population_ode(inst, 1e-3, m0[:1], [0, 1], table=table)  # JIT warm-up
        t_ode, _ = _best(lambda: population_ode(inst, 1e-3, m0, [0, ode_steps], table=table), 1)
        res["ode"] = {"runs": ode_runs, "steps": ode_steps, "seconds": t_ode,
                      "table_seconds": t_table, "table_cells": table.n,
                      "table_max_error": table.max_error,
                      "run_steps_per_s": ode_runs * ode_steps / t_ode}
    return res


@click.command("hermite")
@click.option("--k", type=click.IntRange(min=1), default=50, help="Number of neurons.")
@click.option("--pmax", type=click.IntRange(min=1), default=60, help="Hermite truncation.")
@click.option("--activation", default="relu")
@click.option("--n-series", type=click.IntRange(min=1), default=1_000_000)
@click.option("--n-direct", type=click.IntRange(min=1), default=2_000)
@click.option("--n-numpy", type=click.IntRange(min=1), default=200)
@click.option("--repeat", type=click.IntRange(min=1), default=3)
@click.option("--ode-runs", type=click.IntRange(min=0), default=256,
              help="Also time the population ODE with this many runs (0: skip).")
@click.option("--ode-steps", type=click.IntRange(min=0), default=1_000_000)
@click.option("--json", "as_json", is_flag=True)
def command(k, pmax, activation, n_series, n_direct, n_numpy, repeat, ode_runs, ode_steps,
            as_json):
    """Evaluations/s of h(m): series and direct (numba, one core) vs plain numpy."""
    res = run_benchmark(k, pmax, activation, n_series, n_direct, n_numpy, repeat,
                        ode_runs, ode_steps)
    if as_json:
        click.echo(json.dumps(res))
        return
    click.echo(f"h(m), k = {res['k']}, pmax = {res['pmax']}, {res['activation']} (one core)")
    for name, rate in res["evals_per_s"].items():
        click.echo(f"  {name:<14} {rate:>14.4g} evals/s")
    for name, ratio in res["ratios"].items():
        click.echo(f"  {name:<20} {ratio:>10.4g}x")
    for name, diff in res["max_rel_diff_vs_numpy"].items():
        click.echo(f"  max rel diff {name} vs numpy: {diff:.2e}")
    if "ode" in res:
        o = res["ode"]
        click.echo(f"population ODE: {o['runs']} runs x {o['steps']} steps in {o['seconds']:.2f} s "
                   f"({o['run_steps_per_s']:.3g} run-steps/s; table {o['table_seconds']:.2f} s, "
                   f"{o['table_cells']} cells, max error {o['table_max_error']:.1e})")
