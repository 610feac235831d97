"""Figure 1: (a) activations at ξ = √k (fine-tuning regime), (b) He₃ for growing ξ."""

from sims.experiments.figures import fig4, fig6
from sims.experiments.figures.recipe import CONVENTION, Panel, Recipe


def _sizes(quick: bool):
    a, b = fig4.sweep(quick), fig6.sweep(quick)
    return a, b, a["base"]["instance"], b["base"]["instance"]


def sweep(quick: bool) -> dict:
    a, b, ia, ib = _sizes(quick)
    cases = [c | {"d": ia["d"], "k": ia["k"], "runs": a["base"]["runs"]}
             for c in fig4.cases(quick, scales=(2,))]
    cases += [{"activation": "he3", "xi": xi, "d": ib["d"], "k": ib["k"],
               "runs": b["base"]["runs"], "eta_times_d": b["base"]["eta_times_d"],
               "steps_per_d": b["base"]["steps_per_d"]} for xi in b["axes"]["xi"]]
    base = {k: v for k, v in a["base"].items() if k != "runs"}
    base["instance"] = {k: v for k, v in ia.items() if k not in ("d", "k")}
    return {"sweep": {"name": "fig1" + ("-quick" if quick else "")}, "base": base,
            "cases": cases}


def panels(quick: bool) -> tuple:
    _, _, ia, ib = _sizes(quick)
    # (a) log time: each activation runs at its own η, so He₃ takes ~10× the steps of ReLU
    # and a linear axis squeezes the other three into its first 5 %
    return (Panel(f"(a) ξ = √k, different activations (k = {ia['k']}, d = {ia['d']})",
                  {"d": ia["d"]}, hue="activation", x="steps/d", xscale="log"),
            Panel(f"(b) He₃, growing ξ (k = {ib['k']}, d = {ib['d']})", {"d": ib["d"]},
                  hue="xi", xscale="linear"))


RECIPE = Recipe(
    name="fig1",
    summary=("fine-tuning at ξ = √k for ReLU, sigmoid, quadratic, He₃ (no plateau); He₃ as ξ "
             "grows (a plateau forms)"),
    caption="(a) Fine-tuning regime ξ = √k: |⟨û_t, u⟩| for σ ∈ {ReLU, sigmoid, quadratic, "
            "He₃}, ĉ and û trained jointly, û not projected, each at its own η = c/d: all "
            "rise without a plateau at initialization. (b) He₃ for growing ξ at one η: a "
            "plateau at initialization forms as ξ → ∞, as in feature learning. Convention: "
            + CONVENTION + ".",
    sweep=sweep,
    panels=panels,
)
