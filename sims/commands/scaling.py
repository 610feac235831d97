"""``loradyn scaling SPEC.toml``: hitting times over a grid of d, fitted as T ∝ d^b."""

from __future__ import annotations

import json
from pathlib import Path

import click

from dynamics.setup.config import ENGINES
from sims.commands.checks import check_sweep
from sims.commands.sweep import default_out
from sims.experiments.scaling import (
    analyse,
    check_slope,
    format_table,
    load_scaling,
    plot_scaling,
    write_scaling,
)
from sims.experiments.sweep import run_sweep
from sims.io.lock import claim_outputs
from sims.io.outputs import Input, Output
from sims.plots.curves import save_figure

__all__ = ["scaling", "parse_range"]


def parse_range(value: str | None):
    """"LO,HI" → (lo, hi) floats with lo ≤ hi (click.BadParameter otherwise)."""
    if value is None:
        return None
    try:
        lo, hi = (float(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected LO,HI (two numbers), got {value!r}",
                                 param_hint="--expect-slope") from None
    if lo > hi:
        raise click.BadParameter(f"LO > HI in {value!r}", param_hint="--expect-slope")
    return lo, hi


@click.command("scaling")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="HDF5 file: the sweep over d plus a /scaling group [default: "
                   "results/<SPEC stem>.h5].")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Log-log figure (.png/.pdf/.svg) [default: --out with .png].")
@click.option("--expect-slope", default=None, metavar="LO,HI",
              help="Exit non-zero when the 95 % interval of the slope b leaves [LO, HI].")
@click.option("--target", type=click.Choice(["level", "strong", "both"]), default="level",
              help="Which fit --expect-slope checks: T_level (weak recovery), T_(1−ε) "
                   "(strong), or both.")
@click.option("--scheduler", default=None, metavar="ADDRESS|local:N",
              help="dask scheduler for the cells (see loradyn sweep) [default: in-process].")
@click.option("--update", is_flag=True,
              help="Resume even if finished cells no longer match the spec (see loradyn sweep).")
@click.option("--engine", type=click.Choice(ENGINES), default=None,
              help="Engine of every cell, overriding the spec's [base] engine.")
@click.option("--json", "as_json", is_flag=True, help="Also print the fits as JSON.")
@click.option("--force", is_flag=True,
              help="Replace an existing --out that is not a sweep file, or a --plot that is "
                   "not the figure of an existing --out (refused otherwise).")
def scaling(spec, out, plot_path, expect_slope, target, scheduler, update, engine, as_json,
            force):
    """Measure hitting times over the d grid of SPEC and fit T ∝ d^b."""
    bounds = parse_range(expect_slope)
    parsed = load_scaling(spec)
    if engine is not None:
        parsed.sweep.base["engine"] = engine
    out = Path(out) if out else default_out(spec)
    plot_path = Path(plot_path) if plot_path else out.with_suffix(".png")
    if plot_path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise click.BadParameter("extension must be .png, .pdf or .svg", param_hint="--plot")
    with claim_outputs([Output("--out", out, "hdf5", "sweep"),
                        Output("--plot", plot_path, "figure", "derived", data=out)],
                       [Input("SPEC", spec)], force=force):
        check_sweep(parsed.sweep, out, force=force)
        run_sweep(parsed.sweep, out, scheduler=scheduler, update=update,
                  progress=True, echo=click.echo)
        result = analyse(out, parsed)
        write_scaling(out, result)
        save_figure(plot_scaling(result), plot_path)
    click.echo(format_table(result))
    if as_json:
        click.echo(json.dumps({k: (v.as_dict() if v is not None else None)
                               for k, v in result.fits.items()}))
    click.echo(f"wrote {out} and {plot_path}")
    if bounds is not None:
        bad = check_slope(result, *bounds, target=target)
        if bad:
            raise click.ClickException("; ".join(bad))
