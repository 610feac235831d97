"""Figure 2: ReLU, ξ = 1, 10 random instances, joint (a) vs frozen (b) ĉ (App. B)."""

from sims.experiments.figures.recipe import CONVENTION, Panel, Recipe, unit_row_instance


def sweep(quick: bool) -> dict:
    d, k = (500, 20) if quick else (2000, 50)
    return {
        "sweep": {"name": "fig2" + ("-quick" if quick else "")},
        "base": {"runs": 10, "instance_seeds": "per_run", "project": True,
                 "eta_times_d": 0.04 if quick else 0.02, "steps_per_d": 400,
                 "checkpoints": 80, "spacing": "linear", "engine": "auto",
                 "instance": unit_row_instance("relu", d, k, 1.0)},
        "axes": {"joint_c": [True, False]},
    }


RECIPE = Recipe(
    name="fig2",
    summary=("10 random instances, ReLU, ξ = 1: ĉ trained jointly or frozen, the same S-curves"),
    caption="⟨û_t, u⟩ for 10 random instances (one run each), ReLU, ξ = 1, projected û: "
            "(a) ĉ trained jointly, (b) ĉ frozen at its random start. Same S-shaped "
            "trajectories, on different time scales. Convention: " + CONVENTION + ".",
    sweep=sweep,
    panels=lambda quick: (
        Panel("(a) joint training of ĉ and û", {"joint_c": True}, style="runs",
              xscale="linear"),
        Panel("(b) ĉ frozen, û trained", {"joint_c": False}, style="runs", xscale="linear")),
)
