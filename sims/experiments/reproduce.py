"""Reproducing the paper's figures: run a recipe's sweep, draw its panels, note it in README.

:func:`reproduce` runs the sweep of a :class:`~sims.experiments.figures.Recipe` (resumable, like
``loradyn sweep``) into ``<out_dir>/<fig>[_quick][_<convention>].h5``, renders the ``.png``
of the same stem with :func:`render` and, if asked, records the figure, its exact command,
the convention and the wall time in a section of ``<out_dir>/README.md`` (the rest of the
README is kept). With ``echo``, the theory audit of the file's cells (:func:`audit_table`:
every theory line against the SGD mean of its runs, as the cells store it; issue 40) follows.
A target of ``MEASUREMENTS`` (``separation``: Claim 2 / Theorem 19, issue 38;
``pretraining-hurts``: issue 39) is no sweep: its
module measures, writes ``<out_dir>/<name>[_quick].h5`` and draws the ``.png``.

``convention`` is the instance key of ``dynamics.instances.instance``: ``unit`` (default: the
theory's unit rows, no file suffix) or App. B's ``appB`` / ``appB-sqrt`` model
f(x) = (1/ξ) Σᵢ λᵢ σ(⟨vᵢ, x⟩), vᵢ = s (wᵢ + ξcᵢu), set in every cell's instance
(:func:`~sims.experiments.figures.recipe.with_convention`); these run only the
``finetune`` learner and have no ODE, so a recipe needing another learner
(fig3: ``linearized``) is refused.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from dynamics.overlays.audit import Audit, fmt_value, stored_audits
from sims.experiments.figures import FIGURES, Recipe
from sims.experiments.figures import pretraining_hurts as pretraining_hurts_target
from sims.experiments.figures import separation as separation_target
from sims.experiments.figures.recipe import CONVENTION_TEXT, convention_caption, with_convention
from sims.experiments.sweep import run_sweep
from sims.experiments.sweep_spec import parse_sweep
from sims.io.atomic import atomic_file
from sims.io.sweep import read_sweep
from sims.plots.curves import (
    PanelAxes,
    PanelLook,
    describe,
    draw_panel,
    left_out_notes,
    legend,
    load_curves,
    save_figure,
    wrap_title,
)

__all__ = ["FIGURES", "MEASUREMENTS", "CONVENTIONS", "ReproduceResult", "reproduce", "get_recipe",
           "render", "figure_paths", "check_learner", "check_convention", "update_readme",
           "audit_table"]

CONVENTIONS = tuple(CONVENTION_TEXT)
#: targets that are measurements, not sweeps (run by their module's ``reproduce``; unit
#: convention only; not in ``all``)
MEASUREMENTS = {separation_target.NAME: separation_target,
                pretraining_hurts_target.NAME: pretraining_hurts_target}


@dataclass
class ReproduceResult:
    """Paths written, the wall time of :func:`reproduce` and the cells it reused."""

    name: str
    h5: Path
    png: Path
    seconds: float
    reused: int = 0
    cells: int = 0

    def timing(self) -> str:
        """'23 s' for a fresh run, with a note when finished cells were reused."""
        note = (f" (resumed: {self.reused} of {self.cells} cells were already computed)"
                if self.reused else "")
        return f"{self.seconds:.0f} s{note}"


def figure_paths(name: str, quick: bool, out_dir, convention: str = "unit"
                 ) -> tuple[Path, Path]:
    """``<out_dir>/<name>[_quick][_<convention>].h5`` and ``.png`` (no suffix for unit)."""
    stem = (f"{name}_quick" if quick else name) + _suffix(convention, "_")
    out_dir = Path(out_dir)
    return out_dir / f"{stem}.h5", out_dir / f"{stem}.png"


def check_learner(recipe: Recipe) -> None:
    """ValueError (one line) when the recipe needs a learner this loradyn does not have."""
    if recipe.learner is None:
        return
    from dynamics.learners import LEARNERS

    if recipe.learner not in LEARNERS:
        raise ValueError(f"{recipe.name} needs the learner '{recipe.learner}', which is not "
                         f"available in this loradyn (learners: {', '.join(LEARNERS)})")


def _suffix(convention: str, sep: str) -> str:
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}; valid: {', '.join(CONVENTIONS)}")
    return "" if convention == "unit" else f"{sep}{convention}"


def check_convention(recipe: Recipe, convention: str) -> None:
    """ValueError (one line) when the recipe needs a learner the convention does not run
    (App. B conventions: ``finetune`` only)."""
    from dynamics.learners import LEARNERS, get_learner
    from dynamics.learners.registry import default_learner

    _suffix(convention, "")
    if recipe.name in MEASUREMENTS and convention != "unit":
        where = getattr(MEASUREMENTS[recipe.name], "INSTANCE", "the Claim 2 instance")
        raise ValueError(f"{recipe.name} runs on {where} in the unit-row "
                         f"convention only, not {convention!r}")
    learner = get_learner(recipe.learner or default_learner())
    if convention not in learner.conventions:
        runs = [n for n in LEARNERS if convention in get_learner(n).conventions]
        raise ValueError(f"{recipe.name} needs the learner '{learner.name}', which the "
                         f"App. B convention '{convention}' does not support (it runs "
                         f"{', '.join(repr(n) for n in runs)} only)")


def get_recipe(name: str) -> Recipe:
    try:
        return FIGURES[name] if name in FIGURES else MEASUREMENTS[name].RECIPE
    except KeyError:
        raise ValueError(f"unknown figure {name!r}; valid: "
                         f"{', '.join([*FIGURES, *MEASUREMENTS])}") from None


def reproduce(name: str, quick: bool = False, out_dir="results", scheduler=None,
              update: bool = False, echo=None, progress: bool = False,
              convention: str = "unit") -> ReproduceResult:
    """Run and render one figure (see the module docstring)."""
    start = time.perf_counter()
    recipe = get_recipe(name)
    check_convention(recipe, convention)
    check_learner(recipe)
    h5, png = figure_paths(name, quick, out_dir, convention)
    if name in MEASUREMENTS:
        res = MEASUREMENTS[name].reproduce(quick, h5, png, echo=echo)
        return ReproduceResult(name, h5, png, time.perf_counter() - start, res.reused,
                               res.cells)
    spec = parse_sweep(with_convention(recipe.sweep(quick), convention), source=None)
    done = run_sweep(spec, h5, scheduler=scheduler, update=update, progress=progress,
                     echo=echo)
    save_figure(render(recipe, h5, quick, convention), png)
    if echo is not None:
        for line in audit_table(h5, name):
            echo(line)
    return ReproduceResult(name, h5, png, time.perf_counter() - start, done.reused, done.cells)


def _matches(attrs: dict, select: dict) -> bool:
    for key, want in select.items():
        have = attrs.get(key)
        if isinstance(want, float) and isinstance(have, (int, float)):
            if not math.isclose(have, want, rel_tol=1e-6):
                return False
        elif have != want:
            return False
    return True


QUANTITY_STYLE = ("-", ":")
SHORT = {"overlap": "⟨û,u⟩", "abs_overlap": "|⟨û,u⟩|", "c_overlap": "⟨ĉ,c⟩", "loss": "loss",
         "aligned_c_overlap": "⟨ĉ,c⟩·sign⟨û,u⟩"}


def file_convention(h5) -> str:
    """The instance convention of a sweep file's cells (ValueError if they disagree)."""
    _, cells = read_sweep(h5)
    found = {cell.config["instance"].get("convention", "unit") for cell in cells}
    if len(found) != 1:
        raise ValueError(f"{h5}: cells of different conventions: {', '.join(sorted(found))}")
    return found.pop()


def render(recipe: Recipe, h5, quick: bool, convention: str | None = None):
    """The Figure of a recipe from its sweep file: one panel per :class:`Panel`; the title
    names a non-unit convention (``None``: the file's own); a panel's legend says why a theory
    line its file left out is missing (:func:`sims.plots.curves.left_out_notes`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = file_convention(h5)
    if convention is not None and convention != found:
        raise ValueError(f"{h5}: the cells use convention {found!r}, not {convention!r}")
    curves = load_curves([h5])
    panels = recipe.panels(quick)
    width = 5.6 * len(panels) + 0.4
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.6), squeeze=False,
                             constrained_layout=True)
    for ax, panel in zip(axes.flat, panels, strict=True):
        members = [c for c in curves if _matches(c.attrs, panel.select)]
        if not members:
            raise ValueError(f"{h5}: no finished cell for panel {panel.title!r}")
        if panel.kind == "passage":
            from sims.plots.passage import draw_passage

            draw_passage(ax, members, x=panel.x, level=panel.level, xscale=panel.xscale,
                         yscale=panel.yscale)
            ax.set_title(panel.title, fontsize=10)
            continue
        if panel.kind != "curves":
            raise ValueError(f"panel {panel.title!r}: unknown kind {panel.kind!r} "
                             "(curves or passage)")
        quantities = panel.quantity if isinstance(panel.quantity, tuple) else (panel.quantity,)
        theory, notes = set(), []
        for q, ls in zip(quantities, QUANTITY_STYLE, strict=False):
            prefix = f"{SHORT[q]}: " if len(quantities) > 1 else ""
            _, lines = draw_panel(ax, members, quantity=q,
                                  axes=PanelAxes(panel.x, panel.xscale, panel.yscale),
                                  look=PanelLook(hue=panel.hue, style=panel.style,
                                                 prefix=prefix, ls=ls))
            theory |= lines
            notes += [n for n in left_out_notes(members, q) if n not in notes]
        if len(quantities) > 1:
            ax.set_ylabel("overlap")
        if panel.xlim_frac is not None:
            ax.set_xlim(0, panel.xlim_frac * max(float(c.traj.steps[-1]) for c in members))
        ax.set_title(panel.title, fontsize=10)
        legend(ax, style=panel.style, theory=theory, notes=notes)
    head = f"{recipe.name}{_qualifier(quick, found)}: {describe(curves)}"
    fig.suptitle(wrap_title(head, width), fontsize=10)
    return fig


def _qualifier(quick: bool, convention: str) -> str:
    """' (quick)', ' (quick, App. B convention appB)', ' (App. B convention appB)' or ''."""
    words = (["quick"] if quick else []) + (
        [f"App. B convention {convention}"] if convention != "unit" else [])
    return f" ({', '.join(words)})" if words else ""


# ---------------------------------------------------------------- theory audit
AUDIT_HEAD = ("cell", "theory line", "vs", "max |Δ|", "at step", "max |Δ|/SE", "passage",
              "runs", "verdict")


def _cell_labels(cells) -> list[str]:
    """Each cell named by the axis values that differ between the file's cells."""
    keys = [k for k in dict.fromkeys(k for c in cells for k in c.axes)
            if len({repr(c.axes.get(k)) for c in cells}) > 1]
    return [", ".join(f"{k}={_short(c.axes.get(k))}" for k in keys) or c.name for c in cells]


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _audit_row(label: str, audit: Audit, drawn: bool = True) -> tuple:
    return (label, *audit.names, fmt_value(audit.max_abs, ".3g"), str(audit.at_step),
            fmt_value(audit.max_se, ".2g"),
            fmt_value(audit.passage_ratio, ".3g") if audit.kind == "overlap" else "-",
            f"{audit.runs}/{audit.total}",
            audit.verdict() + ("" if drawn else " (not drawn)"))


def _drawn(cell, line: str) -> bool:
    """Whether a cell's figure draws its theory ``line`` (no ``not_drawn`` attribute:
    :func:`dynamics.overlays.audit.not_drawn`)."""
    return "not_drawn" not in cell.traj.extra_attrs.get(line.removeprefix("extra/"), {})


def audit_table(h5, name: str = "") -> list[str]:
    """The theory audit of a sweep file (:mod:`dynamics.overlays.audit`): a header, one row per cell
    and theory line (max |Δ| = max over checkpoints of |mean over runs of SGD − theory|, its
    step, the largest |Δ|/SE, the median first-passage ratio t½(SGD)/t½(theory), the runs
    used, the verdict against max(4 SE, 0.03) (losses: 0.03·|SGD mean|)) and the count
    ``N of M theory lines within tolerance`` (``… (not drawn)``: a line the figure leaves out
    where another line of the same quantity is within, and the count of the lines drawn);
    one line where no cell has a theory line."""
    _, cells = read_sweep(h5)
    rows = [_audit_row(label, audit, _drawn(cell, line))
            for label, cell in zip(_cell_labels(cells), cells, strict=True)
            for line, audit in stored_audits(cell.traj).items()]
    who = f"{name}: " if name else ""
    if not rows:
        return [f"{who}theory audit: no cell records a theory line"]
    widths = [max(len(r[i]) for r in (AUDIT_HEAD, *rows)) for i in range(len(AUDIT_HEAD))]
    lines = [f"{who}theory audit (Δ = SGD − theory per run, mean over runs; tolerance "
             f"|Δ| ≤ max(4 SE, 0.03), losses 0.03·|SGD mean|):"]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
              for r in (AUDIT_HEAD, *rows)]
    within = sum(r[-1] == "within tolerance" for r in rows)
    hidden = sum(r[-1].endswith("(not drawn)") for r in rows)
    drawn = (f"; {within} of the {len(rows) - hidden} drawn ({hidden} outside, not drawn: "
             "another line of their quantity is within)" if hidden else "")
    lines.append(f"{who}{within} of {len(rows)} theory lines within tolerance{drawn}")
    return lines


# ---------------------------------------------------------------- README
def _tag(recipe: Recipe, quick: bool, convention: str) -> str:
    return f"{recipe.name}{'-quick' if quick else ''}{_suffix(convention, '-')}"


def _section(recipe: Recipe, quick: bool, png: Path, command: str, timing: str,
             convention: str = "unit") -> str:
    tag = _tag(recipe, quick, convention)
    title = f"{recipe.name.replace('fig', 'Figure ')}{_qualifier(quick, convention)}"
    caption = (recipe.caption if recipe.name in MEASUREMENTS  # its own instance, unit rows
               else convention_caption(recipe.caption, convention))
    return (f"<!-- reproduce:{tag} -->\n## {title}\n\n![{title}]({png.name})\n\n"
            f"{caption}\n\n```\n{command}\n```\n\nWall time: {timing} on {os.cpu_count()} "
            f"CPU cores. Data (git-ignored, rebuilt by the command): "
            f"`{png.with_suffix('.h5').name}`.\n<!-- /reproduce:{tag} -->\n")


def _order(tag: str) -> tuple:
    """Sort key of a README section tag ``figN[-quick][-convention]``."""
    name, _, rest = tag.partition("-")
    quick = rest == "quick" or rest.startswith("quick-")
    convention = rest[len("quick-"):] if rest.startswith("quick-") else (
        "unit" if rest in ("", "quick") else rest)
    rank = CONVENTIONS.index(convention) if convention in CONVENTIONS else len(CONVENTIONS)
    return rank, quick, name


def recorded_figure(out_dir, recipe: Recipe, quick: bool, png: Path,
                    convention: str = "unit") -> bool:
    """Whether ``<out_dir>/README.md`` has this figure's section (:func:`update_readme`)
    showing ``png``: the figure is this command's own earlier output."""
    path = Path(out_dir) / "README.md"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    tag = re.escape(_tag(recipe, quick, convention))
    match = re.search(rf"<!-- reproduce:{tag} -->(.*?)<!-- /reproduce:{tag} -->", text, re.S)
    return match is not None and f"]({Path(png).name})" in match.group(1)


def update_readme(out_dir, recipe: Recipe, quick: bool, png: Path, command: str,
                  timing: str, convention: str = "unit") -> Path:
    """Insert or replace this figure's section of ``<out_dir>/README.md`` (one per figure,
    size and convention; a new one goes after the last figure section); keep the rest."""
    path = Path(out_dir) / "README.md"
    text = path.read_text() if path.exists() else "# results/\n"
    section = _section(recipe, quick, Path(png), command, timing, convention)
    tag = re.escape(_tag(recipe, quick, convention))
    pattern = re.compile(rf"<!-- reproduce:{tag} -->.*?<!-- /reproduce:{tag} -->\n?", re.S)
    key = _order(_tag(recipe, quick, convention))
    ends = list(re.finditer(r"<!-- /reproduce:([^ ]+) -->\n?", text))
    before = [m for m in ends if _order(m.group(1)) < key]
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    elif ends:  # in order among the figure sections: convention, full before quick, figure
        if before:
            at = before[-1].end()
        else:
            at = text.index(f"<!-- reproduce:{ends[0].group(1)} -->")
        rest = text[at:].lstrip("\n")
        text = text[:at].rstrip("\n") + "\n\n" + section + ("\n" + rest if rest else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return path
