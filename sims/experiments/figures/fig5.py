"""Figure 5: u not ⊥ span(W): (a) ‖Π_W u‖ sweep, (b) instances at ‖Π_W u‖ = 1/2 (ReLU)."""

from sims.experiments.figures.recipe import CONVENTION, Panel, Recipe, unit_row_instance

ALPHAS = (0.0, 0.25, 0.5, 0.75)


def sweep(quick: bool) -> dict:
    d, k = (300, 20) if quick else (1000, 100)
    cases = [{"u_alpha": a, "instance_seeds": "shared", "runs": 8} for a in ALPHAS]
    cases.append({"u_alpha": 0.5, "instance_seeds": "per_run", "runs": 10})
    return {
        "sweep": {"name": "fig5" + ("-quick" if quick else "")},
        "base": {"joint_c": True, "project": False,
                 "eta_times_d": 0.04 if quick else 0.03, "steps_per_d": 500,
                 "checkpoints": 60, "spacing": "linear", "engine": "auto",
                 "eval_size": 2000, "instance": unit_row_instance("relu", d, k, 1.0)},
        "cases": cases,
    }


RECIPE = Recipe(
    name="fig5",
    summary=("u with a component in span(W): ‖Π_W u‖ ∈ {0, 1/4, 1/2, 3/4}, and random "
             "instances"),
    caption="ReLU, ξ = 1, ĉ and û trained jointly, û not projected, u with a component "
            "‖Π_W u‖ in span(W): (a) ‖Π_W u‖ ∈ {0, 1/4, 1/2, 3/4} (median and 10–90 % band of "
            "8 runs on one instance), (b) 10 random instances at ‖Π_W u‖ = 1/2: generic "
            "S-curves. Convention: " + CONVENTION + ".",
    sweep=sweep,
    panels=lambda quick: (
        Panel("(a) varying ‖Π_W u‖", {"instance_seeds": "shared"}, hue="u_alpha",
              xscale="linear"),
        Panel("(b) random instances, ‖Π_W u‖ = 1/2", {"instance_seeds": "per_run"},
              style="runs", xscale="linear")),
)
