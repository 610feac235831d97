"""``loradyn hermite``: Hermite coefficients, h(m) and the population ODE from the command line.

Library errors (ValueError: bad spec, activation, η, m) surface as one-line ``Error: …`` with
exit status 1 through the top-level group; option-type errors are click usage errors (exit 2).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace

import click
import numpy as np

from dynamics.learners.given_rows import given_rows
from dynamics.learners.options import low_rank_variant
from sims.commands.learner_flags import option_flags

__all__ = ["hermite"]

CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}
LEVELS = (0.5, 0.9)


def _finite_or_none(x):
    x = float(x)
    return x if math.isfinite(x) else None


def _check_positive(value: float | None, flag: str) -> None:
    """A step size ``value`` of option ``flag`` (None: not given) must be finite and > 0."""
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise click.BadParameter(f"must be > 0, got {value:g}", param_hint=f"'{flag}'")


def _emit(payload: dict, as_json: bool, human) -> None:
    if as_json:
        click.echo(json.dumps(payload))
    else:
        human(payload)


def _load(spec_path):
    from dynamics.instances.instance import load_instance

    return load_instance(spec_path)


@click.group("hermite", context_settings=CONTEXT,
             short_help="Exact population theory: μ_p(σ), h(m), the population and committee "
                        "ODEs.")
def hermite():
    """Exact population theory: μ_p(σ), h(m) (Prop. 4) and the population ODE."""


@hermite.command("coeffs")
@click.option("--activation", "-a", default="relu", help="Activation name (relu, he3, ...).")
@click.option("--pmax", type=click.IntRange(min=0), default=10, help="Highest Hermite degree.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def coeffs_cmd(activation, pmax, as_json):
    """Orthonormal Hermite coefficients μ_0..μ_pmax of an activation and Parseval residual."""
    from dynamics.activations import get_activation
    from hermite import hermite_coefficients, parseval_residual
    act = get_activation(activation)
    mu = hermite_coefficients(act, pmax)
    payload = {"activation": act.name, "pmax": pmax, "mu": mu.tolist(),
               "closed_form": act.coefficients is not None,
               "parseval_residual": parseval_residual(act, pmax)}

    def human(p):
        click.echo(f"activation {p['activation']}  (basis h_p = He_p/sqrt(p!); "
                   f"{'closed form' if p['closed_form'] else 'quadrature'})")
        click.echo(f"{'p':>4}  {'mu_p':>22}")
        for i, v in enumerate(p["mu"]):
            click.echo(f"{i:>4}  {v:>22.15e}")
        click.echo(f"parseval residual sum mu_p^2 - E[sigma^2] = {p['parseval_residual']:.3e}")

    _emit(payload, as_json, human)


@hermite.command("h", short_help="Evaluate the population drift h(m) (Prop. 4) of an instance.")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--m", "m_values", type=float, multiple=True, required=True,
              help="Overlap m = <u, u_hat> in [-1, 1] (repeatable).")
@click.option("--method", type=click.Choice(["exact", "series", "direct"]), default="exact")
@click.option("--pmax", type=click.IntRange(min=0), default=60,
              help="Truncation degree for series/direct.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def h_cmd(spec, m_values, method, pmax, as_json):
    """Evaluate h(m) of Prop. 4 for the instance in SPEC (JSON/TOML)."""
    import hermite as th

    inst = _load(spec)
    m = np.asarray(m_values, dtype=float)
    values = th.h(inst, m, method=method, pmax=pmax)
    payload = {"m": m.tolist(), "h": values.tolist(), "method": method,
               "h0_sign": th.h0_sign(inst)}
    if method != "exact":
        payload["pmax"] = pmax
        payload["truncation_bound"] = th.truncation_bound(inst, pmax)

    def human(p):
        click.echo(f"h(m), method {p['method']}" + (
            f", pmax {p['pmax']} (|error| <= {p['truncation_bound']:.3e})" if "pmax" in p else ""))
        click.echo(f"{'m':>10}  {'h(m)':>22}")
        for mi, hi in zip(p["m"], p["h"], strict=True):
            click.echo(f"{mi:>10.6g}  {hi:>22.15e}")

    _emit(payload, as_json, human)


def _checkpoints(steps: int, count: int) -> np.ndarray:
    if steps == 0:
        return np.array([0], dtype=np.int64)
    pts = np.geomspace(1.0, float(steps), max(2, count)).round().astype(np.int64)
    return np.unique(np.concatenate([[0], pts, [steps]]))


def _stages(progress: bool, names):
    """A tqdm bar over named stages (only on a terminal), advanced by ``next(bar_iter)``."""
    from tqdm import tqdm

    bar = tqdm(total=len(names), disable=not progress, leave=False, unit="stage")

    def stages():
        for name in names:
            bar.set_description(name)
            yield
            bar.update(1)
        bar.close()

    return stages()


def _corrected_payload(th, inst, eta, m0, ck, steps, progress=False) -> dict:
    """Noise-corrected map, floor, theory band and hitting times (issue 8) as JSON data."""
    stage = _stages(progress, ["drift table", "corrected map", "theory band", "noise floor",
                               "hitting times"])
    next(stage)
    th.drift_table(inst, eta, inst.d)
    next(stage)
    curve, blow = th.corrected_ode(inst, eta, inst.d, m0, ck, return_blowup=True)
    next(stage)
    band = th.theory_band(inst, eta, inst.d, ck, m0=m0)
    next(stage)
    floor, floor_se = th.noise_floor(inst, eta, inst.d)
    next(stage)
    reach = {f"{lv:g}": [_finite_or_none(v) for v in th.corrected_steps_to_reach(
        inst, eta, inst.d, lv, m0, max_steps=steps)] for lv in LEVELS}
    next(stage, None)
    return {"d": inst.d, "m": _clean(curve), "band_lower": _clean(band.lower),
            "band_upper": _clean(band.upper), "noise_floor": floor,
            "noise_floor_se": floor_se, "steps_to_reach": reach,
            "blowup_step": [None if b < 0 else int(b) for b in blow],
            "band_blowup_step": None if band.blowup_step < 0 else int(band.blowup_step)}


def _clean(a):
    """Nested lists with NaN (a blown-up curve) as null: valid JSON."""
    a = np.asarray(a, dtype=float)
    if a.ndim == 0:
        return _finite_or_none(a)
    return [_clean(x) for x in a]


def _fmt(v, spec):
    return "nan" if v is None else format(v, spec)


def _reach(values, spec, never="never") -> str:
    """Steps to reach a level, one per start, comma-separated (``never`` for None)."""
    return ", ".join(never if v is None else format(v, spec) for v in values)


@dataclass(frozen=True)
class OdeCommand:
    """The options of ``loradyn hermite ode`` (its flags), the step sizes and ``--prox``
    checked."""

    spec: str
    eta: float
    steps: int
    m0_values: tuple
    checkpoints: int
    corrected: bool
    target_eps: float | None
    joint_c: bool
    project: bool
    eta_c: float | None
    prox: float
    as_json: bool

    def __post_init__(self):
        _check_positive(self.eta, "--eta")
        _check_positive(self.eta_c, "--eta-c")
        if not math.isfinite(self.prox) or self.prox < 0:
            raise click.BadParameter(f"must be ≥ 0, got {self.prox:g}", param_hint="'--prox'")


@hermite.command("ode")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--eta", type=float, required=True, help="Step size eta > 0.")
@click.option("--steps", type=click.IntRange(min=0), default=100_000, help="Horizon T.")
@click.option("--m0", "m0_values", type=float, multiple=True,
              help="Initial overlap(s); default sign(h(0))/sqrt(d) (0.01 without d).")
@click.option("--checkpoints", type=click.IntRange(min=2), default=40,
              help="Number of log-spaced checkpoints.")
@click.option("--corrected", is_flag=True,
              help="Also the noise-corrected (finite-d) map, its noise floor and the theory "
                   "band (needs d in SPEC).")
@click.option("--target-eps", type=float, default=None,
              help="Also the largest eta whose predicted floor gives <u_hat,u>^2 >= 1 - eps, "
                   "beside the Theorem 11-13 step size (needs d).")
@option_flags("joint_c", "project", "eta_c", "prox")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def ode_cmd(**options):
    """Population-ODE overlap curve m_t and the steps to reach |m| = 0.5 and 0.9.

    Projected, frozen ĉ, unit rows: Prop. 4's map on the exact h table (with --corrected its
    noise-corrected map, floor and band). Joint ĉ (--joint-c, --eta-c, --prox), unprojected û
    (--no-project) or an App. B convention: the population ODE of fine-tuning
    (hermite.finetune_ode), ⟨ĉ, c⟩ beside ⟨û, u⟩, with --corrected its O(η²d) renormalisation
    drift; u_alpha and the convention come from SPEC."""
    import hermite as th

    cmd = OdeCommand(**options)
    inst = _load(cmd.spec)
    if cmd.joint_c or not cmd.project or not inst.unit_rows:
        return _finetune_ode_cmd(th, inst, cmd)
    if cmd.eta_c is not None or cmd.prox:
        raise ValueError("--eta-c and --prox act on ĉ: they need --joint-c")
    eta, steps, target_eps = cmd.eta, cmd.steps, cmd.target_eps
    m0 = _start_overlaps(cmd.m0_values, inst, lambda: th.h0_sign(inst) or 1)
    ck = _checkpoints(steps, cmd.checkpoints)
    table = th.HTable.for_instance(inst)
    from hermite.finite_d.stability import step_limit

    limit = step_limit(inst, eta, inst.d, table=table)
    if limit is not None and limit.exceeded:
        click.echo(f"warning: {limit.message('--eta')}", err=True)
    progress = sys.stderr.isatty()
    curve, blow = th.population_ode(inst, eta, m0, ck, table=table, progress=progress,
                                    return_blowup=True)
    reach = {}
    reach_discrete = {}
    for level in LEVELS:
        key = f"{level:g}"
        reach[key] = [_finite_or_none(th.steps_to_reach(inst, eta, v, level)) for v in m0]
        reach_discrete[key] = [_finite_or_none(th.steps_to_reach(
            inst, eta, v, level, method="discrete", max_steps=steps, table=table)) for v in m0]
    payload = {"eta": eta, "steps": ck.tolist(), "m0": m0.tolist(), "m": _clean(curve),
               "h0_sign": th.h0_sign(inst), "u_perp": inst.u_perp,
               "steps_to_reach": reach, "steps_to_reach_discrete": reach_discrete,
               "table_max_error": table.max_error,
               "blowup_step": [None if b < 0 else int(b) for b in blow],
               "step_limit": limit.to_dict() if limit is not None else None}
    if (blow >= 0).any():
        click.echo(f"warning: the population ODE blew up (|m| > 2u_perp) in {(blow >= 0).sum()}"
                   f" of {blow.size} curve(s), first at step {blow[blow >= 0].min()}; NaN from "
                   "there on (eta is beyond the map's stability limit)", err=True)
    if (cmd.corrected or target_eps is not None) and inst.d is None:
        raise ValueError("--corrected and --target-eps need key 'd' in the instance spec")
    if cmd.corrected:
        payload["corrected"] = c = _corrected_payload(th, inst, eta, m0, ck, steps, progress)
        if any(b is not None for b in c["blowup_step"]) or c["band_blowup_step"] is not None:
            click.echo("warning: the noise-corrected map or its theory band blew up; NaN from "
                       "there on", err=True)
    if target_eps is not None:
        if not 0 < target_eps < 1:
            raise click.BadParameter(f"must lie in (0, 1), got {target_eps:g}",
                                     param_hint="'--target-eps'")
        payload["step_size"] = th.max_step_size(inst, inst.d, target_eps).to_dict()

    def human(p):
        click.echo(f"population ODE  m_(t+1) = m_t + eta h(m_t)(u_perp^2 - m_t^2),  eta = "
                   f"{p['eta']:g}, sign h(0) = {p['h0_sign']:+d}")
        header = "".join(f"  {'m0=' + format(v, '+.4g'):<14}" for v in p["m0"])
        click.echo(f"{'step':>10}{header}")
        for i, t in enumerate(p["steps"]):
            click.echo(f"{t:>10d}" + "".join(f"  {_fmt(row[i], '<+14.8f'):<14}"
                                              for row in p["m"]))
        for key in p["steps_to_reach"]:
            cont = _reach(p["steps_to_reach"][key], ".6g")
            disc = _reach(p["steps_to_reach_discrete"][key], ".0f", "not within horizon")
            click.echo(f"steps to reach |m| = {key}: continuous {cont}; discrete map {disc}")
        if "corrected" in p:
            c = p["corrected"]
            click.echo(f"noise-corrected map at d = {c['d']}: floor m_inf = "
                       f"{c['noise_floor']:.6g} +- {c['noise_floor_se']:.2g}")
            for i, t in enumerate(p["steps"]):
                click.echo(f"{t:>10d}  corrected {_fmt(c['m'][0][i], '<+12.8f')} band "
                           f"[{_fmt(c['band_lower'][i], '+.4f')}, "
                           f"{_fmt(c['band_upper'][i], '+.4f')}]")
            for key, vals in c["steps_to_reach"].items():
                click.echo(f"corrected steps to reach |m| = {key}: " + _reach(vals, ".0f"))
        if "step_size" in p:
            r = p["step_size"]
            click.echo(f"step size for <u_hat,u>^2 >= 1 - {r['eps']:g} at d = {r['d']}: "
                       f"eta_max = {r['eta_max']:.4g} (eta*d = {r['eta_max'] * r['d']:.3g}); "
                       f"Theorem {r['theorem']}: eta = {r['eta_theorem']:.4g} "
                       f"(ratio {r['ratio']:.3g})")

    _emit(payload, cmd.as_json, human)


def _start_overlaps(m0_values, inst, sign, what: str = "") -> np.ndarray:
    """The starting overlaps of ``hermite ode``: the given ``--m0`` values, or one start at
    sign()·d^{−1/2} (0.01·sign() without d); each must lie in [−u_perp, u_perp]."""
    if m0_values:
        m0 = np.asarray(m0_values, dtype=float)
    else:
        s = sign()
        m0 = np.array([s / math.sqrt(inst.d) if inst.d else 0.01 * s])
    for v in m0:
        if not abs(v) <= inst.u_perp:
            raise ValueError(f"m0 must lie in [-u_perp, u_perp] = [{-inst.u_perp:.6g}, "
                             f"{inst.u_perp:.6g}]{what}, got {v:g}")
    return m0


def _finetune_ode_cmd(th, inst, cmd: OdeCommand):
    """``loradyn hermite ode`` beyond the projected/frozen/unit case: the population ODE of
    fine-tuning (hermite.finetune_ode) from p = 0 and the given m₀, ĉ₀ = the spec's ĉ."""
    eta, steps, joint_c, project, prox = cmd.eta, cmd.steps, cmd.joint_c, cmd.project, cmd.prox
    if cmd.target_eps is not None:
        raise ValueError("--target-eps is derived for the projected learner with frozen ĉ and "
                         "unit rows only (not with --joint-c, --no-project or an App. B "
                         "convention)")
    if (cmd.eta_c is not None or prox) and not joint_c:
        raise ValueError("--eta-c and --prox act on ĉ: they need --joint-c")
    if cmd.corrected and inst.d is None:
        raise ValueError("--corrected needs key 'd' in the instance spec")
    model = th.FinetuneModel(inst, eta, project=project, joint_c=joint_c, eta_c=cmd.eta_c,
                             prox=prox)
    def sign():  # the side the flow leaves m = 0 to
        _, b, _ = model.gradient(None, np.zeros(1), inst.c_hat[None, :])
        return int(np.sign(-b[0])) or 1

    m0 = _start_overlaps(cmd.m0_values, inst, sign, " (a start with û ⊥ span W)")
    ck = _checkpoints(steps, cmd.checkpoints)
    sol = th.finetune_ode(inst, eta, ck, m0=m0, model=model)
    reach = {f"{lv:g}": [_finite_or_none(v) for v in th.finetune_steps_to_reach(
        inst, eta, lv, m0=m0, model=model)] for lv in LEVELS}
    variant = low_rank_variant({"project": project, "joint_c": joint_c})
    payload = {"eta": eta, "eta_c": model.eta_c if joint_c else None, "prox": prox,
               "variant": variant, "convention": inst.convention, "u_alpha": inst.u_alpha,
               "u_perp": inst.u_perp, "ode": sol.kind, "steps": ck.tolist(),
               "m0": m0.tolist(), "m": _clean(sol.m), "c_overlap": _clean(sol.c_overlap),
               "steps_to_reach": reach}
    if cmd.corrected:
        cor = th.finetune_ode(inst, eta, ck, m0=m0, model=model, corrected=True, d=inst.d)
        payload["corrected"] = {
            "d": inst.d, "ode": cor.kind, "m": _clean(cor.m), "c_overlap": _clean(cor.c_overlap),
            "steps_to_reach": {f"{lv:g}": [_finite_or_none(v) for v in th.finetune_steps_to_reach(
                inst, eta, lv, m0=m0, model=model, corrected=True, d=inst.d,
                max_steps=max(steps, 1))] for lv in LEVELS}}

    def human(p):
        click.echo(f"population ODE of fine-tuning ({p['variant']}, convention "
                   f"{p['convention']}, u_alpha = {p['u_alpha']:g}), eta = {p['eta']:g}"
                   + (f", eta_c = {p['eta_c']:g}" if p["eta_c"] is not None else "")
                   + ": the O(eta) drift, minus the Riemannian gradient of the exact loss")
        cols = [("m", "m0="), ("c_overlap", "c_ov,m0=")] if joint_c else [("m", "m0=")]
        header = "".join(f"  {lab + format(v, '+.3g'):<14}" for key, lab in cols
                         for v in p["m0"])
        click.echo(f"{'step':>10}{header}")
        for i, t in enumerate(p["steps"]):
            click.echo(f"{t:>10d}" + "".join(f"  {_fmt(row[i], '<+14.8f'):<14}"
                                              for key, _ in cols for row in p[key]))
        for key, vals in p["steps_to_reach"].items():
            click.echo(f"steps to reach |m| = {key}: " + _reach(vals, ".6g"))
        if "corrected" in p:
            c = p["corrected"]
            click.echo(f"finite-d corrected ODE at d = {c['d']} (O(eta^2 d) renormalisation "
                       "drift):")
            for i, t in enumerate(p["steps"]):
                click.echo(f"{t:>10d}  corrected m {_fmt(c['m'][0][i], '<+12.8f')}" + (
                    f"  c_overlap {_fmt(c['c_overlap'][0][i], '<+12.8f')}" if joint_c else ""))
            for key, vals in c["steps_to_reach"].items():
                click.echo(f"corrected steps to reach |m| = {key}: "
                           + _reach(vals, ".6g", "not within horizon"))

    _emit(payload, cmd.as_json, human)


@dataclass(frozen=True)
class CommitteeCommand:
    """The options of ``loradyn hermite committee`` (its flags), the step sizes checked."""

    spec: str
    learner: str
    eta: float
    steps: int
    width: int | None
    train_second_layer: bool
    eta_c: float | None
    rows: str
    init_scale: float
    init_rows: str | None
    init_frame: str
    label_noise: float
    batch: int
    seed: int
    init_overlap: float | None
    checkpoints: int
    first_order: bool
    noise_paths: int | None
    integrals: str
    as_json: bool

    def __post_init__(self):
        _check_positive(self.eta, "--eta")
        _check_positive(self.eta_c, "--eta-c")

    def learner_options(self) -> dict:
        """The learner options it sets: one the learner does not take is a one-line
        ForeignOptionError from RunConfig (defaults pass)."""
        return {"rows": self.rows, "init_scale": self.init_scale, "init_rows": self.init_rows,
                "init_frame": self.init_frame, "width": self.width,
                "train_second_layer": self.train_second_layer, "eta_c": self.eta_c}

    def start_label(self) -> str:
        """Where run 0's start comes from, in words."""
        if self.init_rows is not None:
            return f"the rows of {self.init_rows} (run 0)"
        if self.init_overlap is not None:
            return f"R = {self.init_overlap:g}·I"
        return f"the learner's initial rows (run 0, seed {self.seed})"


@hermite.command("committee")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--learner", default="scratch", metavar="NAME",
              help="A network learner (one with a committee ODE: scratch, scratch-csq, "
                   "sparse).")
@click.option("--eta", type=float, required=True,
              help="Step size eta > 0: the ODE's η̄ = eta·d; nn2pp's lr = 2·eta·d (squared "
                   "loss, docs/theory/committee-engine.md), so nn2pp's --lr 0.5 at N = 2000 "
                   "is --eta 0.000125.")
@click.option("--steps", type=click.IntRange(min=1), required=True, help="Horizon T (SGD steps).")
@click.option("--width", type=click.IntRange(min=1), default=None,
              help="Student width k' (scratch; another width than k needs "
                   "--train-second-layer).")
@click.option("--train-second-layer", is_flag=True, help="Also train λ̂ (scratch).")
@click.option("--eta-c", type=float, default=None, help="Second-layer step size [default: eta].")
@option_flags("rows", "init_scale", "init_rows", "init_frame")
@click.option("--label-noise", type=click.FloatRange(min=0), default=0.0)
@click.option("--batch", type=click.IntRange(min=1), default=1)
@click.option("--seed", type=int, default=0, help="Seed of run 0's random initial rows.")
@click.option("--init-overlap", type=float, default=None,
              help="Start from orthonormal student rows with R = m·I (m = this value) "
                   "instead of the learner's random rows.")
@click.option("--checkpoints", type=click.IntRange(min=2), default=20,
              help="Number of log-spaced checkpoints.")
@click.option("--first-order", is_flag=True, help="Drop the η² terms.")
@click.option("--noise-paths", type=click.IntRange(min=1), default=None,
              help="Integrate the order parameters as a diffusion with SGD's step noise "
                   "(hermite.committee.diffusion) over this many paths: their mean loss and "
                   "alignment, and the loss's standard error.")
@click.option("--integrals", type=click.Choice(("auto", "closed", "quadrature")),
              default="auto", help="Gaussian integrals: closed forms where they exist "
                                   "(auto), closed forms only (an error without them), or "
                                   "quadrature throughout.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def committee_cmd(**options):
    """Committee-machine ODE (hermite.committee) of a network learner alone: loss and
    alignment at log-spaced steps (and α = steps/d) from run 0's initial overlaps; with
    --noise-paths the diffusion with SGD's step noise instead (its mean over the paths)."""
    from dynamics.errors import ForeignOptionError
    from dynamics.instances.instance import build_instance, load_spec
    from dynamics.learners import LEARNERS, get_learner
    from dynamics.learners.options import option_names
    from dynamics.overlays.committee import (
        CommitteeRegime,
        CommitteeStarts,
        committee_state,
        integrate,
    )
    from dynamics.setup.config import RunConfig

    cmd = CommitteeCommand(**options)
    spec_dict = load_spec(cmd.spec)
    inst = build_instance(spec_dict)
    if inst.d is None:
        raise ValueError(f"instance spec {cmd.spec}: key 'd' is required (α = steps/d, "
                         "η̄ = eta·d)")
    if not inst.unit_rows:
        raise ValueError("the committee ODE needs the unit-row convention")
    having = [n for n in LEARNERS if get_learner(n).committee_loss is not None]
    if cmd.learner not in having:
        raise click.BadParameter(f"{cmd.learner!r} has no committee ODE; valid: "
                                 f"{', '.join(having)}", param_hint="'--learner'")
    cls = get_learner(cmd.learner)
    runs = 1
    if cmd.init_rows is not None:
        if cmd.init_overlap is not None:
            raise ValueError("--init-rows and --init-overlap both set the start: give one")
        given = given_rows(cmd.init_rows)  # ConfigError naming the file's problem
        runs = given.array.shape[0] if given.per_run else 1
    try:
        config = RunConfig(spec_dict, learner=cmd.learner, eta=cmd.eta, steps=cmd.steps,
                           runs=runs, seed=cmd.seed, batch=cmd.batch,
                           label_noise=cmd.label_noise, **cmd.learner_options())
    except ForeignOptionError as exc:
        flags = ", ".join("--" + n.replace("_", "-") for n in option_names(cls.Options))
        raise ValueError(f"--{exc.field.replace('_', '-')} is not an option of learner "
                         f"{cmd.learner!r} (its options: {flags or 'none'})") from None
    config.validate()
    cross, gram, lam_hat, mask = _committee_start(config, cmd.init_overlap)
    starts = CommitteeStarts(cross[None], gram[None], lam_hat[None], mask[None])
    regime = replace(CommitteeRegime.of_learner(
        config, inst, starts, loss=cls.committee_loss, rows=cmd.rows,
        diagonal=cls.diagonal_alignment,
        train_second_layer=getattr(config.options, "train_second_layer", False)),
        second_order=not cmd.first_order, method=cmd.integrals)
    model = regime.model(inst, mask)
    state = committee_state(cross, gram, lam_hat, cmd.rows)
    if cmd.init_overlap is not None:
        try:
            model.check_state(state)
        except ValueError as exc:
            raise ValueError(f"--init-overlap {cmd.init_overlap:g}: {exc}") from None
    ck = _checkpoints(cmd.steps, cmd.checkpoints)
    extra = {}
    if cmd.noise_paths is None:
        loss, align, integrator = integrate(model, state, ck, inst.d, diagonal=regime.diagonal)
    else:
        from hermite.committee.diffusion import committee_diffusion

        tr = committee_diffusion(model, [state], (ck - ck[0]) / inst.d, float(inst.d),
                                 paths=cmd.noise_paths, seed=cmd.seed,
                                 diagonal=regime.diagonal)
        loss, align, integrator = tr.loss[0], tr.alignment[0], "diffusion"
        extra = {"paths": cmd.noise_paths, "loss_se": _clean(tr.loss_se[0])}
    payload = {"learner": cmd.learner, "rows": cmd.rows, "eta": cmd.eta,
               "eta_d": cmd.eta * inst.d,
               "nn2pp_lr": nn2pp_lr(cmd.eta, inst.d, cls.committee_loss), "d": inst.d,
               "order": 1 if cmd.first_order else 2, "integrator": integrator,
               "init": cmd.start_label(), "steps": ck.tolist(),
               "alpha": (ck / inst.d).tolist(), "loss": _clean(loss),
               "alignment": _clean(align)} | extra

    def human(p):
        what = (f"committee diffusion, mean of {p['paths']} paths" if "paths" in p
                else "committee ODE")
        rate = f"η̄ = η·d = {p['eta_d']:.4g}"
        if p["nn2pp_lr"] is not None:
            rate += f", nn2pp lr = 2·η·d = {p['nn2pp_lr']:.4g}"
        click.echo(f"{what} ({p['learner']}, {p['rows']} rows, {rate}, order {p['order']}, "
                   f"{p['integrator']}, {p['init']})")
        click.echo(f"{'step':>10}  {'alpha':>10}  {'loss':>14}  {'alignment':>10}")
        for t, a, lo, al in zip(p["steps"], p["alpha"], p["loss"], p["alignment"],
                                strict=True):
            click.echo(f"{t:>10d}  {a:>10.4g}  {_fmt(lo, '>14.8g')}  {_fmt(al, '>10.6f')}")

    _emit(payload, cmd.as_json, human)


def nn2pp_lr(eta: float, d: int, loss: str) -> float | None:
    """nn2pp's lr of the step size ``eta`` in dimension ``d``: 2·η·d (its loss is
    ½(y − ŷ)², loradyn's (y − ŷ)²; docs/theory/committee-engine.md), None for a loss nn2pp
    does not have (correlation)."""
    return 2.0 * eta * d if loss == "squared" else None


def _committee_start(config, init_overlap):
    """Run 0's initial (cross (k, k′), Gram (k′, k′), λ̂ (k′,), trainable rows (k′,)), drawn
    as the learner draws them, or orthonormal rows with R = m·I (``init_overlap`` m)."""
    import torch

    from dynamics.learners import Problem, get_learner

    instances = config.run_instances()
    problem = Problem.from_instances(instances, torch.device("cpu"), torch.float64)
    cls = get_learner(config.learner)
    cls.check(config, instances[0])
    learner = cls.from_config(config, problem)
    mask = learner.mask[0].numpy()
    if init_overlap is None:
        state, _ = learner.initial_state(config, instances)
        obs = learner.observe(state)
        return obs["cross"][0], obs["gram"][0], obs["lam_hat"][0], mask
    m = float(init_overlap)
    if not math.isfinite(m):
        raise ValueError(f"--init-overlap must be finite, got {m}")
    k, width = instances[0].k, learner.width
    cross = m * np.eye(k, width)
    lam_hat = instances[0].lam if width == k else np.full(width, 1.0 / math.sqrt(width))
    return cross, np.eye(width), np.asarray(lam_hat, float), mask
