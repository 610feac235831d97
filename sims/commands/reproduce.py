"""``loradyn reproduce figN [--quick] [--convention unit|appB|appB-sqrt]``: the paper's App. B
figures, data and PNG in results/ (a non-unit convention suffixes the file names)."""

from __future__ import annotations

import shlex
import sys

import click

from sims.experiments.reproduce import CONVENTIONS, FIGURES, check_convention, update_readme
from sims.experiments.reproduce import reproduce as run_figure

__all__ = ["reproduce"]


@click.command("reproduce")
@click.argument("figures", nargs=-1, required=True,
                type=click.Choice([*FIGURES, "all"]))
@click.option("--quick", is_flag=True,
              help="Scaled-down sizes (d, k, runs, horizon) that finish in about a minute.")
@click.option("--out-dir", type=click.Path(file_okay=False), default="results",
              help="Where the HDF5 sweep files and the PNG figures go.")
@click.option("--scheduler", default=None, metavar="ADDRESS|local:N",
              help="dask scheduler for the cells (see loradyn sweep) [default: in-process].")
@click.option("--update", is_flag=True,
              help="Resume even if finished cells no longer match the recipe (they stay in "
                   "the .cells/ folder; the changed cells are computed).")
@click.option("--readme/--no-readme", default=True,
              help="Record each figure, its command and wall time in <out-dir>/README.md.")
@click.option("--convention", type=click.Choice(CONVENTIONS), default="unit", show_default=True,
              help="Model of every cell's instance: the theory's unit rows, or App. B's "
                   "(1/ξ)Σλσ(⟨vᵢ,x⟩) with vᵢ = s(wᵢ + ξcᵢu), s = k/(k+ξ²) (appB) or its "
                   "square root (appB-sqrt); finetune only, no ODE; files get _<convention>.")
def reproduce(figures, quick, out_dir, scheduler, update, readme, convention):
    """Reproduce FIGURES (fig1 … fig6, or all) of the paper's App. B."""
    names = list(FIGURES) if "all" in figures else list(dict.fromkeys(figures))
    if "all" not in figures:  # an explicitly named figure the convention cannot run: refuse
        for name in names:  # before computing any
            check_convention(FIGURES[name], convention)
    else:
        names = [n for n in names if _runs(n, convention)]
    for name in names:
        result = run_figure(name, quick=quick, out_dir=out_dir, scheduler=scheduler,
                            update=update, echo=click.echo, progress=sys.stderr.isatty(),
                            convention=convention)
        click.echo(f"{name}: wrote {result.h5} and {result.png} in {result.timing()}")
        if readme:
            command = "loradyn reproduce " + name + (" --quick" if quick else "") + (
                f" --out-dir {shlex.quote(str(out_dir))}" if str(out_dir) != "results" else ""
            ) + (f" --convention {convention}" if convention != "unit" else "")
            update_readme(out_dir, FIGURES[name], quick, result.png, command, result.timing(),
                          convention)


def _runs(name: str, convention: str) -> bool:
    """Whether ``all`` includes this figure under the convention (a note when it does not)."""
    try:
        check_convention(FIGURES[name], convention)
    except ValueError as exc:
        click.echo(f"skipping {name}: {exc}", err=True)
        return False
    return True
