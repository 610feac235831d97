"""Figure 6: He₃, joint ĉ, unprojected, ξ from 1 to 8√k: plateaus grow as ξ → ∞."""

import math

from sims.experiments.figures.recipe import CONVENTION, Panel, Recipe, unit_row_instance

MULTIPLES = (1, 2, 4, 8, 16)  # ξ = m·√k; the threshold ξ ≈ d^{1/4}√k is 4.2√k (quick), 5.6√k


def xis(k: int) -> list:
    return [round(m * math.sqrt(k), 4) for m in MULTIPLES]


def sweep(quick: bool) -> dict:
    d, k = (300, 10) if quick else (1000, 20)
    return {
        "sweep": {"name": "fig6" + ("-quick" if quick else "")},
        "base": {"runs": 8 if quick else 16, "joint_c": True, "project": False,
                 "eta_times_d": 0.0005, "steps_per_d": 3000, "checkpoints": 120,
                 "spacing": "linear",
                 "engine": "auto", "eval_size": 2000,
                 "instance": {key: v for key, v in unit_row_instance("he3", d, k).items()
                              if key != "xi"}},
        "axes": {"xi": xis(k)},
    }


RECIPE = Recipe(
    name="fig6",
    caption="He₃, ĉ and û trained jointly, û not projected, one η = c/d for every ξ: "
            "(a) short time scale, (b) long time scale (log steps). For ξ = O(√k) the "
            "overlap rises at once; as ξ grows towards the feature-learning threshold "
            "ξ ≈ d^{1/4}√k a plateau at initialization appears and lengthens. "
            "Convention: " + CONVENTION + ".",
    sweep=sweep,
    panels=lambda quick: (
        Panel("(a) short time scale", {}, hue="xi", xscale="linear", xlim_frac=0.3),
        Panel("(b) long time scale", {}, hue="xi", xscale="log")),
)
