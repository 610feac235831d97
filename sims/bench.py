"""``loradyn bench``: throughput benchmarks, each reporting ratios measured in one run."""

from __future__ import annotations

import importlib

import click

BENCHMARKS = (("bench_hermite", "command"), ("bench_engine", "command"))


@click.group("bench")
def bench():
    """Benchmarks (ratios measured within one run; no timing is asserted in tests)."""


for _module, _attr in BENCHMARKS:
    try:  # TEMPORARY during parallel development; made explicit at integration
        _mod = importlib.import_module(f"sims.{_module}")
    except ModuleNotFoundError as _exc:
        if _exc.name != f"sims.{_module}":
            raise
        continue
    bench.add_command(getattr(_mod, _attr))
