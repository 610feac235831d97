"""``loradyn plot FILE.h5 [FILE ...]``: overlap, loss, ⟨ĉ, c⟩, σ_a(UᵀÛ), … against steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from sims.io.lock import claim_outputs
from sims.io.outputs import Input, Output
from sims.plots.curves import (
    QUANTITIES,
    X_CHOICES,
    lacking,
    legend_notes,
    load_curves,
    plot_curves,
    save_figure,
    theory_notes,
)

__all__ = ["plot", "PlotRequest"]


@dataclass(frozen=True)
class PlotRequest:
    """The options of one ``loradyn plot``: its click parameters; the figure's extension is
    checked when the request is made."""

    files: tuple[str, ...]
    quantity: str
    x: str
    xscale: str
    yscale: str
    hue: str | None
    facet: str | None
    style: str
    title: str | None
    out: str
    force: bool

    def __post_init__(self):
        if Path(self.out).suffix.lower() not in (".png", ".pdf", ".svg"):
            raise click.BadParameter("extension must be .png, .pdf or .svg", param_hint="--out")


@click.command("plot")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--quantity", type=click.Choice(list(QUANTITIES)), default="overlap",
              help="What to plot against steps: singular_values (lora), loss_linear "
              "(linearized), alignment (scratch, sparse), refit_loss (--refit), "
              "aligned_c_overlap = ⟨ĉ,c⟩·sign⟨û,u⟩ (joint ĉ).")
@click.option("--x", "x", type=click.Choice(list(X_CHOICES)), default="auto",
              help="x axis: auto (α = steps/d for from-scratch learners, the committee-"
              "machine literature's time; else steps), steps, alpha (steps/d), steps/d, "
              "or η·steps.")
@click.option("--xscale", type=click.Choice(["log", "linear"]), default="log",
              help="x axis scale (log drops step 0).")
@click.option("--yscale", type=click.Choice(["linear", "log"]), default="linear",
              help="y axis scale.")
@click.option("--hue", default=None, metavar="AXIS",
              help="Colour curves by this sweep axis / attribute (e.g. xi, activation).")
@click.option("--facet", default=None, metavar="AXIS",
              help="One panel per value of this sweep axis / attribute.")
@click.option("--style", type=click.Choice(["band", "runs"]), default="band",
              help="Median with its 10–90 % band, or every run as a thin line.")
@click.option("--title", default=None, help="Figure title [default: the shared instance].")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="Output figure; format from the extension (.png, .pdf, .svg).")
@click.option("--force", is_flag=True, help="Replace an existing --out file (refused "
              "otherwise).")
def plot(**params):
    """Plot trajectory files (loradyn run) and sweep files (loradyn sweep)."""
    request = PlotRequest(**params)
    with claim_outputs([Output("--out", request.out, "figure")],
                       [Input("FILES", f) for f in request.files], force=request.force):
        curves = load_curves(request.files)
        fig = plot_curves(curves, quantity=request.quantity, x=request.x,
                          xscale=request.xscale, yscale=request.yscale, hue=request.hue,
                          facet=request.facet, style=request.style, title=request.title)
        notes = theory_notes(curves, request.quantity)
        for ax in fig.axes:  # what the legend says besides (values ≤ 0 on a log axis)
            notes = legend_notes(ax, notes)
        save_figure(fig, request.out)
    skipped = lacking(curves, request.quantity)
    click.echo(f"wrote {request.out} ({len(curves) - len(skipped)} curve(s))")
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if skipped:
        files = ", ".join(dict.fromkeys(c.attrs.get("file") or c.source for c in skipped))
        click.echo(f"skipped {len(skipped)} curve(s) without {request.quantity}: {files}")
