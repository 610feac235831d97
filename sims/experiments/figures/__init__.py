"""Recipes of the paper's figures (App. B) for ``loradyn reproduce``: one module per figure."""

from sims.experiments.figures import fig1, fig2, fig3, fig4, fig5, fig6
from sims.experiments.figures.recipe import CONVENTION, Panel, Recipe, unit_row_instance

FIGURES = {m.RECIPE.name: m.RECIPE for m in (fig1, fig2, fig3, fig4, fig5, fig6)}

__all__ = ["FIGURES", "CONVENTION", "Panel", "Recipe", "unit_row_instance"]
