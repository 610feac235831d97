"""Figure 3: linearized vs fine-tuning at ξ = √k (a: loss), and (b) ⟨û,u⟩, ⟨ĉ,c⟩ jointly."""

import math

from sims.experiments.figures.recipe import CONVENTION, Panel, Recipe, unit_row_instance


def sweep(quick: bool) -> dict:
    d, k = (500, 20) if quick else (2000, 50)
    return {
        "sweep": {"name": "fig3" + ("-quick" if quick else "")},
        "base": {"runs": 16 if quick else 8, "joint_c": True, "project": True,
                 "eta_times_d": 0.01 if quick else 0.004, "steps_per_d": 300,
                 "checkpoints": 80, "engine": "auto",
                 "instance": unit_row_instance("relu", d, k, math.sqrt(k))},
        "axes": {"learner": ["finetune", "linearized"]},
    }


RECIPE = Recipe(
    name="fig3",
    summary=("fine-tuning against its linearization (NTK) at ξ = √k: the linearized model "
             "stalls"),
    caption="ReLU, ξ = √k, ĉ and û trained jointly: (a) population loss of low-rank "
            "fine-tuning and of its linearization around the base model (learner "
            "`linearized`: SGD on the first-order Taylor model f₀ + Σⱼ λⱼσ′(zⱼ)⟨(I − wⱼwⱼᵀ)Δⱼ, x⟩ "
            "with Δ = ξĉûᵀ; drawn is the exact loss of the network with its learned rows "
            "(wⱼ + Δⱼ)/‖·‖, the linear model's own loss is stored as `loss_linear`); the "
            "linearized model stays at a loss far above fine-tuning's; (b) fine-tuning's "
            "|⟨û_t, u⟩| (solid) and ⟨ĉ_t, c⟩·sign⟨û_t, u⟩ (dotted; û ≈ −u with ĉ ≈ −c is the "
            "same network): ĉ aligns only once û has. Convention: " + CONVENTION + ".",
    sweep=sweep,
    panels=lambda quick: (
        Panel("(a) loss: linearized vs low-rank fine-tuning", {}, quantity="loss",
              yscale="log", hue="learner"),
        Panel("(b) fine-tuning: |⟨û_t, u⟩| and ⟨ĉ_t, c⟩·sign⟨û_t, u⟩", {"learner": "finetune"},
              quantity=("abs_overlap", "aligned_c_overlap"))),
    learner="linearized",
)
