"""``loradyn bench``: throughput benchmarks, each reporting ratios measured in one run."""

from __future__ import annotations

import click

from sims.bench.engine import command as bench_engine
from sims.bench.hermite import command as bench_hermite
from sims.bench.theory import command as bench_theory


@click.group("bench")
def bench():
    """Benchmarks (ratios measured within one run; no timing is asserted in tests)."""


bench.add_command(bench_hermite)
bench.add_command(bench_engine)
bench.add_command(bench_theory)
