"""What a reproduced figure is: one sweep (full and quick sizes) and the panels drawn from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Panel", "Recipe", "unit_row_instance", "CONVENTION"]

CONVENTION = ("theory's unit-row model (DESIGN.md): vᵢ = (wᵢ + ξcᵢu)/‖wᵢ + ξcᵢu‖, "
              "wᵢ i.i.d. uniform on S^{d−1} (W = separated), c and ĉ i.i.d. uniform on "
              "S^{k−1} (gaussian), λ = 1; not App. B's (1/ξ)·k/(k+ξ²) scaling")


@dataclass(frozen=True)
class Panel:
    """One panel: the cells it shows (``select``: attribute → value) and how to draw them.

    quantity : a plot quantity, or a tuple of them drawn on the same axes (solid, dotted).
    xlim_frac : show x ∈ [0, xlim_frac · largest step] (a short-timescale view).
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


@dataclass(frozen=True)
class Recipe:
    """A figure: name, caption, ``sweep(quick)`` → sweep dict, ``panels(quick)`` → Panels,
    and the learner it needs beyond ``finetune`` (None if none)."""

    name: str
    caption: str
    sweep: Callable[[bool], dict]
    panels: Callable[[bool], tuple]
    learner: str | None = None
    notes: str = ""


def unit_row_instance(activation: str, d: int, k: int, xi: float = 1.0, **extra) -> dict:
    """Instance spec of the App. B setting in the unit-row convention (CONVENTION)."""
    return {"activation": activation, "k": k, "d": d, "xi": float(xi), "W": "separated",
            "c": "gaussian", "c_hat": "gaussian", "seed": 0} | extra
