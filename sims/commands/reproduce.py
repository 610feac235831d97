"""``loradyn reproduce figN [--quick] [--convention unit|appB|appB-sqrt]``: the paper's App. B
figures, data and PNG in results/ (a non-unit convention suffixes the file names);
``loradyn reproduce separation [--quick]``: Claim 2 / Theorem 19 measured over d."""

from __future__ import annotations

import shlex
from contextlib import contextmanager
from pathlib import Path

import click

from sims.commands.checks import check_sweep
from sims.experiments.figures.recipe import with_convention
from sims.experiments.reproduce import (
    CONVENTIONS,
    FIGURES,
    MEASUREMENTS,
    check_convention,
    check_learner,
    figure_paths,
    get_recipe,
    recorded_figure,
    update_readme,
)
from sims.experiments.reproduce import reproduce as run_figure
from sims.experiments.sweep_spec import parse_sweep
from sims.io.lock import claim_outputs
from sims.io.outputs import Output, hdf5_format

__all__ = ["reproduce"]


def _targets() -> str:
    """The targets and what each draws, for ``--help`` (click keeps \\b paragraphs as
    they are)."""
    width = max(map(len, FIGURES))
    return "\b\nTargets:\n" + "\n".join(
        f"  {name:<{width}}  {recipe.summary}" for name, recipe in FIGURES.items()) + (
        f"\n  {'all':<{width}}  every figure above, in order") + "".join(
        f"\n  {name}  {get_recipe(name).summary}" for name in MEASUREMENTS)


@click.command("reproduce", epilog=_targets(),
               short_help="Reproduce the paper's App. B figures (fig1 … fig6), its separation "
                          "and pretraining-hurts.")
@click.argument("figures", nargs=-1, required=True,
                type=click.Choice([*FIGURES, *MEASUREMENTS, "all"]))
@click.option("--quick", is_flag=True,
              help="Scaled-down sizes (d, k, runs, horizon) that finish in minutes (each "
                   "figure prints its wall time).")
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
@click.option("--force", is_flag=True,
              help="Replace a file in --out-dir that is not this figure's sweep file or "
                   "figure (refused otherwise; a sweep file is resumed).")
def reproduce(figures, quick, out_dir, scheduler, update, readme, convention, force):
    """Reproduce FIGURES (fig1 … fig6 of the paper's App. B, or all), the separation of
    Claim 2 / Theorem 19 (a measurement over d) or pretraining-hurts (Nwemadji–Loureiro–
    Barbier's steps to |⟨v, u⟩| = μ against μ); the last two: unit convention only."""
    names = list(FIGURES) if "all" in figures else list(dict.fromkeys(figures))
    if "all" not in figures:  # an explicitly named figure the convention cannot run: refuse
        for name in names:  # before computing any
            check_convention(get_recipe(name), convention)
    else:
        names = [n for n in names if _runs(n, convention)]
    with _claim_outputs(names, quick, out_dir, readme, convention, force):
        for name in names:
            result = run_figure(name, quick=quick, out_dir=out_dir, scheduler=scheduler,
                                update=update, echo=click.echo, progress=True,
                                convention=convention)
            click.echo(f"{name}: wrote {result.h5} and {result.png} in {result.timing()}")
            if readme:
                command = "loradyn reproduce " + name + (" --quick" if quick else "") + (
                    f" --out-dir {shlex.quote(str(out_dir))}" if str(out_dir) != "results"
                    else "") + (f" --convention {convention}" if convention != "unit" else "")
                update_readme(out_dir, get_recipe(name), quick, result.png, command,
                              result.timing(), convention)


@contextmanager
def _claim_outputs(names, quick, out_dir, readme, convention, force):
    """Every figure's sweep file, figure and the README checked, every recipe's memory and
    disk space too, before the first figure computes (sims.io.outputs, dynamics.engines.budget);
    the sweep files and figures locked for the command (sims.io.lock)."""
    outputs = []
    for name in names:
        h5, png = figure_paths(name, quick, out_dir, convention)
        recorded = recorded_figure(out_dir, get_recipe(name), quick, png, convention)
        policy = "sweep"
        if name in MEASUREMENTS:  # its own file (resumed) or a new one; its figure is its own
            ours = hdf5_format(h5) == MEASUREMENTS[name].FORMAT
            policy, recorded = ("edit" if ours else "new"), recorded or ours
        outputs += [Output("--out-dir", h5, "hdf5", policy),
                    Output("--out-dir", png, "figure", "derived", data=h5, recorded=recorded)]
    if readme:
        outputs.append(Output("--readme", Path(out_dir) / "README.md", "text", "edit"))
    with claim_outputs(outputs, force=force):
        for name in (n for n in names if n not in MEASUREMENTS):
            recipe = FIGURES[name]
            check_learner(recipe)
            spec = parse_sweep(with_convention(recipe.sweep(quick), convention), source=None)
            check_sweep(spec, figure_paths(name, quick, out_dir, convention)[0], force=force)
        yield


def _runs(name: str, convention: str) -> bool:
    """Whether ``all`` includes this figure under the convention (a note when it does not)."""
    try:
        check_convention(FIGURES[name], convention)
    except ValueError as exc:
        click.echo(f"skipping {name}: {exc}", err=True)
        return False
    return True
