"""``loradyn bench theory``: moments per second of the pre-trained flow's fast path against
its adaptive reference (hermite/flows/pretrained.py), both measured in the same run.

The moments (E[δs], E[δν], E[δ²], E[(σ(λ) − σ(ν))²]) at N random states (a uniform in
[−a_max, a_max], m uniform in [−1, 1]); the fast path (closed forms, the exact polynomial rule
or the smooth rule) evaluates all N at once, the reference state by state on the first
``n_reference``; moments/s = states / best wall time of ``--repeat`` runs. The largest
difference between the two on the shared states is reported beside.
"""

from __future__ import annotations

import json

import click
import numpy as np

from sims.bench.hermite import _best

__all__ = ["command", "run_benchmark"]


def run_benchmark(activation="sigmoid", mu=0.5, n_fast=2_000, n_reference=100, a_max=3.0,
                  repeat=3, seed=0) -> dict:
    """Measure moments/s of the fast path and of the adaptive reference; a result dict."""
    from hermite._activation import resolve_activation
    from hermite.flows.pretrained import _fast_moments, _reference_moments

    act = resolve_activation(activation)
    fast = _fast_moments(act)
    if fast is None:
        raise click.UsageError(f"{act.name} has no fast path (kinked or user-given σ)")
    rng = np.random.default_rng(seed)
    a, m = rng.uniform(-a_max, a_max, n_fast), rng.uniform(-1.0, 1.0, n_fast)
    k = min(n_reference, n_fast)
    fast(mu, a[:2], m[:2])  # warm-up
    t_fast, v_fast = _best(lambda: fast(mu, a, m), repeat)
    t_ref, v_ref = _best(lambda: _reference_moments(act, mu, a[:k], m[:k]), repeat)
    rates = {"fast": n_fast / t_fast, "reference": k / t_ref}
    return {"activation": act.name, "mu": mu, "a_max": a_max,
            "states": {"fast": n_fast, "reference": k}, "moments_per_s": rates,
            "ratio": rates["fast"] / rates["reference"],
            "max_abs_diff": float(np.max(np.abs(v_fast[:, :k] - v_ref)))}


@click.command("theory")
@click.option("--activation", default="sigmoid", show_default=True)
@click.option("--mu", type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
              default=0.5, show_default=True, help="The base's μ.")
@click.option("--n-fast", type=click.IntRange(min=1), default=2_000, show_default=True,
              help="States for the fast path.")
@click.option("--n-reference", type=click.IntRange(min=1), default=100, show_default=True,
              help="States for the adaptive reference (the first of the fast path's).")
@click.option("--a-max", type=click.FloatRange(min=0.0), default=3.0, show_default=True,
              help="States have |a| ≤ a-max.")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(activation, mu, n_fast, n_reference, a_max, repeat, as_json):
    """Moments/s of the pre-trained flow: fast path vs adaptive reference (one run)."""
    res = run_benchmark(activation, mu, n_fast, n_reference, a_max, repeat)
    if as_json:
        click.echo(json.dumps(res))
        return
    click.echo(f"pre-trained flow moments, {res['activation']}, μ = {res['mu']}, "
               f"|a| ≤ {res['a_max']}")
    for name, rate in res["moments_per_s"].items():
        click.echo(f"  {name:<10} {rate:>12.4g} states/s ({res['states'][name]} states)")
    click.echo(f"  fast/reference {res['ratio']:>10.4g}x")
    click.echo(f"  max abs diff fast vs reference: {res['max_abs_diff']:.2e}")
