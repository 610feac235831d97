"""Figure 6: He₃, joint ĉ, unprojected, ξ from 1 to 16√k: plateaus grow as ξ → ∞; panel (c)
times the plateau (steps to |⟨û,u⟩| ≥ LEVEL) against ξ/√k beside the population ODE's."""

import math

from sims.experiments.figures.recipe import CONVENTION, Panel, Recipe, unit_row_instance

MULTIPLES = (1, 2, 4, 8, 16)  # ξ = m·√k; the threshold ξ ≈ d^{1/4}√k is 4.2√k (quick), 5.6√k
LEVEL = 0.5  # weak recovery: panel (c) times the first step with |⟨û,u⟩| ≥ LEVEL


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
    summary=("He₃ as ξ grows: the plateau at initialization and its length against ξ/√k"),
    caption="He₃, ĉ and û trained jointly, û not projected, one η = c/d for every ξ: "
            "(a) short time scale, (b) long time scale (log steps). For ξ = O(√k) the "
            "overlap rises at once; as ξ grows towards the feature-learning threshold "
            "ξ ≈ d^{1/4}√k a plateau at initialization appears and lengthens. "
            f"(c) the plateau's length against ξ/√k: steps to weak recovery, |⟨û,u⟩| ≥ {LEVEL:g}. "
            "Dots: SGD, each run's first checkpoint at the level, median over runs with "
            "10–90 % bars; an open dot at the horizon (dotted) with an arrow: the median run "
            "never reached it, and n/R counts the runs that never did (an arrow on a filled "
            "dot: the 90 % run never did). Solid: the population ODE (plain O(η) drift, "
            "hermite.finetune_steps_to_reach) from m₀ = +d^{−1/2} (red) and m₀ = −d^{−1/2} "
            "(blue), the typical |⟨û₀,u⟩| of a uniform start, with no span-W part (p₀ = 0), "
            "the instance's ĉ₀ and the runs' η, joint ĉ, unprojected û: with ĉ₀ fixed the flow "
            "is not symmetric under m → −m, so both signs are drawn (shaded between). Dashed: "
            "median over runs of the ODE recorded beside each run, from the run's own start "
            "(m₀, its span-W part and ĉ₀); dash-dotted, where the file records it, the same "
            "of the finite-d corrected ODE, and dotted (green) that of the finite-ξ line "
            "(the diffusion of the exact chain, drawn where ξ²/d ≥ 1/4: the regime where the "
            "d → ∞ ODE leaves out the start's signal ξ·m₀); an open marker beside the horizon: "
            "that median lies beyond it. A line the audit left out of the figure (outside its "
            "tolerance against these runs where another line is within) is left out here too. "
            "Convention: " + CONVENTION + ".",
    sweep=sweep,
    panels=lambda quick: (
        Panel("(a) short time scale", {}, hue="xi", xscale="linear", xlim_frac=0.3),
        Panel("(b) long time scale", {}, hue="xi", xscale="log"),
        Panel(f"(c) plateau length against ξ (|⟨û,u⟩| ≥ {LEVEL:g})", {}, x="xi/sqrt(k)",
              xscale="log", yscale="log", kind="passage", level=LEVEL)),
)
