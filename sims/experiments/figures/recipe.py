"""What a reproduced figure is: one sweep (full and quick sizes) and the panels drawn from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Panel", "Recipe", "unit_row_instance", "CONVENTION", "CONVENTION_TEXT",
           "convention_caption", "with_convention", "measure_and_draw"]

_DRAWS = ("wᵢ i.i.d. uniform on S^{d−1} (W = separated), c and ĉ i.i.d. uniform on "
          "S^{k−1} (gaussian), λ = 1")
CONVENTION = ("theory's unit-row model (docs/model.md): vᵢ = (wᵢ + ξcᵢu)/‖wᵢ + ξcᵢu‖, "
              + _DRAWS + "; not App. B's (1/ξ)·k/(k+ξ²) scaling")
_APPB = ("; rows are not unit vectors: the dashed line is the plain O(η) population ODE "
         "of these rows (hermite.finetune.population, no finite-d correction), the loss is "
         "exact (Gaussian pair kernel of rows of any norm, hermite.finetune.population) and "
         "the finetune learner runs on the full engine. η is the "
         "recipe's, tuned for unit rows: to first order (∂f/∂u = s Σᵢ cᵢσ′ x against "
         "ξΣᵢ cᵢσ′ x/Nᵢ) the drift of û at equal η is slower than with unit rows by ")
_SLOWER = {"appB": "≈ ξ²(k+ξ²)/k (≈ 1 at ξ = 1, 2k at ξ = √k)", "appB-sqrt": "≈ ξ²"}
# instance key ``convention`` (dynamics.instances.instance) → the caption's convention sentence
CONVENTION_TEXT = {
    "unit": CONVENTION,
    "appB": ("App. B's simulation model as printed (instance convention = appB): "
             "f(x) = (1/ξ) Σᵢ λᵢ σ(⟨vᵢ, x⟩), vᵢ = k/(k+ξ²)·(wᵢ + ξcᵢu), " + _DRAWS + _APPB
             + _SLOWER["appB"]),
    "appB-sqrt": ("App. B's model with the row factor √(k/(k+ξ²)) that keeps ‖vᵢ‖ ≈ 1 "
                  "(instance convention = appB-sqrt): f(x) = (1/ξ) Σᵢ λᵢ σ(⟨vᵢ, x⟩), "
                  "vᵢ = √(k/(k+ξ²))·(wᵢ + ξcᵢu), " + _DRAWS + _APPB + _SLOWER["appB-sqrt"]),
}


@dataclass(frozen=True)
class Panel:
    """One panel: the cells it shows (``select``: attribute → value) and how to draw them.

    quantity : a plot quantity, or a tuple of them drawn on the same axes (solid, dotted).
    xlim_frac : show x ∈ [0, xlim_frac · largest step] (a short-timescale view).
    kind : ``curves`` (the quantity against steps) or ``passage``: the steps at which
        |⟨û,u⟩| first reaches ``level`` against ``x``, a sweep axis or ``xi/sqrt(k)``, one
        point per cell with the population ODE's (:mod:`sims.plots.passage`).
    level : the passage panel's level of |⟨û,u⟩|.
    """

    title: str
    select: dict = field(default_factory=dict)
    quantity: str | tuple = "abs_overlap"
    x: str = "steps"
    xscale: str = "log"
    yscale: str = "linear"
    style: str = "band"
    hue: str | None = None
    xlim_frac: float | None = None
    kind: str = "curves"
    level: float | None = None


@dataclass(frozen=True)
class Recipe:
    """A figure: name, caption, ``sweep(quick)`` → sweep dict, ``panels(quick)`` → Panels,
    the learner it needs beyond ``finetune`` (None if none), and a one-line ``summary``
    (``loradyn reproduce --help``)."""

    name: str
    caption: str
    sweep: Callable[[bool], dict]
    panels: Callable[[bool], tuple]
    learner: str | None = None
    notes: str = ""
    summary: str = ""


def unit_row_instance(activation: str, d: int, k: int, xi: float = 1.0, **extra) -> dict:
    """Instance spec of the App. B setting in the unit-row convention (CONVENTION)."""
    return {"activation": activation, "k": k, "d": d, "xi": float(xi), "W": "separated",
            "c": "gaussian", "c_hat": "gaussian", "seed": 0} | extra


def convention_caption(caption: str, convention: str) -> str:
    """``caption`` with its convention sentence (CONVENTION) replaced by ``convention``'s."""
    if convention not in CONVENTION_TEXT:
        raise ValueError(f"unknown convention {convention!r}; valid: "
                         f"{', '.join(CONVENTION_TEXT)}")
    if CONVENTION not in caption:
        raise ValueError("the caption does not state the unit-row convention to replace")
    return caption.replace(CONVENTION, CONVENTION_TEXT[convention])


def with_convention(sweep: dict, convention: str) -> dict:
    """A copy of the sweep dict whose every cell's instance has ``convention``: the base
    instance gets the key and the sweep name ``-<convention>`` (a case or axis setting its own
    convention is an error). ``unit`` is the instance default: the sweep comes back as it was,
    so its cells (and their hashes) are unchanged."""
    if convention not in CONVENTION_TEXT:
        raise ValueError(f"unknown convention {convention!r}; valid: "
                         f"{', '.join(CONVENTION_TEXT)}")
    if "convention" in sweep.get("axes", {}) or any(
            "convention" in case for case in sweep.get("cases", [])):
        raise ValueError("the recipe sets the convention itself (an axis or a case)")
    if convention == "unit":
        return dict(sweep)
    base = dict(sweep["base"])
    base["instance"] = dict(base["instance"]) | {"convention": convention}
    head = dict(sweep.get("sweep", {}))
    head["name"] = f"{head.get('name', 'figure')}-{convention}"
    return dict(sweep) | {"base": base, "sweep": head}


def measure_and_draw(measure: Callable, draw: Callable, summary: Callable, spec, paths: tuple,
                     echo=None):
    """A measured figure (``pretraining-hurts``, ``separation``): ``measure(spec, h5,
    echo=echo)`` (resuming an earlier ``h5``), ``draw(result)`` saved to ``png`` (``paths`` =
    (h5, png)) and, with ``echo``, each line of ``summary(result)``; returns the result."""
    from sims.plots.curves import save_figure

    h5, png = paths
    result = measure(spec, h5, echo=echo)
    save_figure(draw(result), png)
    if echo is not None:
        for line in summary(result):
            echo(line)
    return result
