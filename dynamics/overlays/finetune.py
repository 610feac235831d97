"""Theory curves recorded beside a rank-1 run, from each run's own start.

- the population ODE of ⟨û, u⟩ (the Trajectory's ``ode``) in every regime of the
  ``finetune`` learner:

  * projected, ĉ frozen, unit rows (:func:`theory_applies`): Prop. 4's map
    m̄_{t+1} = m̄_t + η h(m̄_t)(u_perp² − m̄_t²) on the exact h table (``hermite.population_ode``),
    and, where :func:`finite_d_applies`, the noise-corrected map
    (``hermite.finite_d.corrected_ode``) and
    the 10–90% linear-noise band (``hermite.theory_band``);
  * everywhere else (joint ĉ, unprojected û, the App. B conventions, any u_alpha): the plain
    O(η) population ODE of fine-tuning (``hermite.finetune_ode``: minus the Riemannian gradient
    of the exact population loss L(û, ĉ)) from each run's start (p₀, μ₀, ĉ₀), with, when ĉ
    is joint, its ⟨ĉ, c⟩/(‖ĉ‖‖c‖) as ``extra/ode_c_overlap`` (attribute ``note``: which ODE),
    and, where :func:`corrected_applies`, the finite-d corrected ODE of the same regime
    (``hermite.finetune_ode(corrected=True)``) as ``ode_corrected`` and
    ``extra/ode_corrected_c_overlap``, and with joint ĉ, projected û, unit rows and b = 1 the
    10–90% linear-noise band around it (``hermite.finetune.band.joint_band``) as
    ``band_lower``/``band_upper`` and ``extra/band_c_lower``/``extra/band_c_upper``;
- with ĉ joint, unit rows and ξ²/d ≥ ``FINITE_XI_MIN`` (Figs 1b and 6: ξ ~ √d, where the
  d → ∞ ODE leaves out ĉ's step noise, docs/theory/finite-xi.md), the finite-ξ line: the
  diffusion approximation of the exact chain (``hermite.finetune.finite_xi.finite_xi_ensemble``,
  ``FINITE_XI_PATHS`` paths per start) as ``extra/ode_finite_xi`` (E|⟨û, u⟩|) and
  ``extra/ode_finite_xi_c_overlap``, from as many runs' starts as its cost budget allows
  (:func:`finite_xi_lines`);
- :func:`initial_drift_sign`, sign h(0), which fixes the aligned start of Thm 5.

The start: ``m₀`` of every run, and, from the rank-1 assembly, the first checkpoint's
records (step 0): û's reduced coordinates (p₀, μ₀) where they are kept (always when û is
unprojected or the rows are not unit) and ĉ₀ when ĉ is trained; otherwise p₀ = 0 (a projected
û ⊥ span W), μ₀ = m₀/u_perp and ĉ₀ = the instance's ĉ, which is the learner's initial state.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import NamedTuple

import numpy as np

import hermite
from dynamics.instances.instance import Instance, build_instance
from dynamics.measures.observables import group_runs, unit_rows
from dynamics.overlays.audit import MIN_RUNS

__all__ = [
    "FINITE_D_MAX_ETA_D",
    "theory_applies",
    "record_theory",
    "finite_d_applies",
    "theory_records",
    "finetune_theory",
    "corrected_applies",
    "corrected_seconds",
    "finetune_start",
    "initial_drift_sign",
    "budget_groups",
    "corrected_plan",
    "CorrectedPlan",
    "budget_starts",
    "finetune_regime",
    "finite_xi_applies",
    "finite_xi_lines",
]

FINITE_D_MAX_ETA_D = 10.0  # beyond η·d ≈ 10 SGD is far past its noise floor / diverges
CORRECTED_BUDGET_S = 20.0  # estimated seconds allowed for the corrected ODE of a trajectory
# seconds per run, RK4 step and row k of the corrected ODE (QMC average and drift) at small k
# with a closed-form kernel, measured on the 2-core machine under load (k = 4…32, 64 runs;
# hermite.finetune.population); the drift's pair terms add a factor 1 + k/32 and a kernel
# without a closed form its factor (measured at k = 50, unprojected, per run, step and row:
# relu 9.5e-5 s, tanh (Chebyshev dual kernel) 2.3e-4 s, sigmoid App. B (Mehler) 1.3e-3 s)
CORRECTED_SECONDS = {"projected": 2.4e-5, "unprojected": 4.5e-5}
KERNEL_COST = {"closed": 1.0, "interpolated": 3.0, "mehler": 15.0}
# the joint band per start node costs about (BAND_COST + k) corrected ODEs: the Jacobian's
# 2(k + 1) differences every 4 RK4 steps and the step's moments on 2× the points
BAND_COST = 5.0
BAND_STEP_S = 0.01  # and ≈ 0.01 s of Python per RK4 step for each group of runs (k = 8)
POLYNOMIAL_TERMS = 16  # a Mehler series of at most this many terms costs as a closed form
RATE_GROWTH = 1.5  # the drift's stiffness along the corrected ODE over its value at the start
# (Fig. 3's setting, ReLU, ξ = √k: up to 1.3× at k = 50, 1.9× at k = 20)
FINITE_XI_MIN = 0.25  # ξ²/d from which the finite-ξ line is drawn beside the ODEs (ĉ joint)
FINITE_XI_PATHS = 8  # its paths per start (docs/theory/finite-xi.md measured with 8)
# its seconds per start, Euler–Maruyama step (η·h ≤ FLOW_STEP) and row k: the step noise on
# 2¹⁴ QMC points every 16 steps and 8 paths' drift (He₃, k = 10, d = 300, ξ = 12.65, 8
# starts: 31 s for 3000 steps on the 2-core machine under load)
FINITE_XI_SECONDS = 1.3e-4
FINITE_XI_BUDGET_S = 60.0  # its estimated seconds per trajectory (the line to read where
# ξ ~ √d: a larger budget than the corrected ODE's), shared evenly by its run groups


def finetune_regime(config, inst: Instance):
    """The learner's :class:`hermite.FinetuneRegime` on ``inst``: its options (project,
    joint_c, prox), step sizes, and the runs' d, batch and label noise."""
    o = config.options
    return hermite.FinetuneRegime(config.eta, project=o.project, joint_c=o.joint_c,
                                  eta_c=config.step_size_c, prox=o.prox, d=inst.d,
                                  batch=config.batch, label_noise=config.label_noise)


def theory_applies(config) -> bool:
    """Whether the population ODE of m is exact for this learner (projected, ĉ frozen, unit
    rows)."""
    return config.options.project and not config.options.joint_c and unit_rows(config)


def record_theory(config, instances: list[Instance], m0: np.ndarray,
                  steps: np.ndarray) -> np.ndarray:
    """(R, C) population-ODE prediction at ``steps`` from each run's m₀ (NaN if none)."""
    out = np.full((len(instances), len(steps)), np.nan)
    if not theory_applies(config):
        return out

    for inst, idx in group_runs(instances):
        out[idx] = hermite.population_ode(inst, config.eta, np.asarray(m0)[idx],
                                          np.asarray(steps))
    return out


def finite_d_applies(config, d: int | None = None) -> bool:
    """Whether the noise-corrected ODE and band are recorded: frozen ĉ, projected, b = 1 and
    η·d ≤ ``FINITE_D_MAX_ETA_D`` (the finite-d map is an expansion in η with ηd = O(1));
    ``d``: the runs' dimension (default: the spec's)."""
    d = build_instance(config.instance).d if d is None else d
    return theory_applies(config) and config.batch == 1 and corrected_applies(config, d)


def theory_records(config, instances: list[Instance], m0: np.ndarray,
                   steps: np.ndarray, start: dict | None = None) -> dict:
    """Every theory curve of a trajectory, as Trajectory keyword arguments.

    ``ode`` always: where :func:`theory_applies`, the h-table map (:func:`record_theory`);
    elsewhere the population ODE of fine-tuning (:func:`finetune_theory`, which adds
    ``extra``/``extra_attrs`` keys: pop them before building the Trajectory). Where
    :func:`finite_d_applies`, also ``ode_corrected`` (``hermite.finite_d.corrected_ode`` at the
    run's d, η and label noise, from each run's m₀) and the 10–90% ``band_lower``/``band_upper`` of
    ``hermite.theory_band`` (mixture over the group's m₀). ``start``: the runs' records at
    step 0 (``coords``, ``c_hat``; module docstring). A line that fails numerically is
    left out with why, the runs kept (:func:`_attempt`, :func:`finetune_theory`).
    """
    if not theory_applies(config):
        return finetune_theory(config, instances, m0, steps, start)
    shape = (len(instances), len(steps))
    failed = {}
    ode = _attempt(failed, "ode", np.arange(len(instances)), record_theory, config, instances,
                   m0, steps)
    out = {"ode": np.full(shape, np.nan) if ode is None else ode}
    if finite_d_applies(config, instances[0].d):
        corr, lo, hi = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
        steps = np.asarray(steps)
        for inst, idx in group_runs(instances):
            m0_g = np.asarray(m0)[idx]
            regime = finetune_regime(config, inst)
            table = _attempt(failed, "corrected", idx, hermite.regime_table, inst, regime)
            if table is None:  # neither line has its drift
                failed.setdefault("band", []).append(failed["corrected"][-1])
                continue
            line = _attempt(failed, "corrected", idx, hermite.corrected_ode, inst, regime.eta,
                            regime.d, m0_g, steps, table=table)
            if line is not None:
                corr[idx] = line
            band = _attempt(failed, "band", idx, hermite.theory_band, inst, regime.eta,
                            regime.d, steps, m0=m0_g, table=table)
            if band is not None:
                lo[idx], hi[idx] = band.lower, band.upper
        out.update(ode_corrected=corr, band_lower=lo, band_upper=hi)
    if failed:
        out["extra_attrs"] = {"ode": _reasons(failed)}
    return out


def finetune_start(config, instances: list[Instance], m0: np.ndarray,
                   start: dict | None = None):
    """(p₀ (R, k), μ₀ (R,), ĉ₀ (R, k)) of every run (module docstring)."""
    start = start or {}
    coords, c_hat = start.get("coords"), start.get("c_hat")
    m0 = np.asarray(m0, dtype=float)
    k = instances[0].k
    if coords is not None:
        coords = np.asarray(coords, dtype=float)
        p0, mu0 = coords[:, :k].copy(), coords[:, k].copy()
    else:
        u_perp = np.array([i.u_perp for i in instances])
        p0, mu0 = np.zeros((len(instances), k)), np.clip(m0 / u_perp, -1.0, 1.0)
    if config.options.project:
        p0[:] = 0.0  # û ⊥ span W (its recorded span-W part is round-off)
    if config.options.joint_c and c_hat is not None:
        c0 = np.asarray(c_hat, dtype=float).copy()
    else:
        c0 = np.stack([i.c_hat for i in instances])
    return p0, mu0, c0


def finetune_theory(config, instances: list[Instance], m0: np.ndarray, steps: np.ndarray,
                    start: dict | None = None) -> dict:
    """The population ODE of fine-tuning (``hermite.finetune_ode``) from each run's start:
    ``ode`` (⟨û, u⟩), and with joint ĉ ``extra`` = {``ode_c_overlap``} and its
    ``extra_attrs`` note. Where :func:`corrected_applies`, also the finite-d corrected ODE
    (``hermite.finetune_ode(corrected=True)``: the O(η²d) renormalisation drift at the runs'
    d, batch and label noise) as ``ode_corrected`` (and ``extra/ode_corrected_c_overlap``):
    at η·d = O(1) the plain ODE is off by O(η·d), the corrected one is the line to read.

    A line over its budget or whose integration fails (:func:`_attempt`: overflow, NaN, a
    stiff stretch) is left out, never the run: NaN for the runs it failed on (not recorded
    where it failed on all), the reason in the ``ode`` dataset's attribute ``corrected`` or
    ``band`` (the plain ODE's: ``no_theory``), likewise on ``extra/ode_c_overlap``, and a
    note on stderr."""
    o = config.options
    steps = np.asarray(steps)
    shape = (len(instances), len(steps))
    p0, mu0, c0 = finetune_start(config, instances, m0, start)
    corrected = corrected_applies(config, instances[0].d)
    why = {}  # attribute of ``ode`` (corrected, band, no_theory) → why that line is left out
    chosen, partial, left_out, rho = (corrected_plan(config, instances, steps, (p0, mu0, c0))
                                      if corrected else (None, None, None, 0.0))
    if corrected and not chosen.any():
        corrected = False
        why["corrected"] = left_out
        print(f"note: {left_out}", file=sys.stderr)
    elif partial:
        print(f"note: {partial}", file=sys.stderr)
    ode, c_ode = np.full(shape, np.nan), np.full(shape, np.nan)
    corr, c_corr = np.full(shape, np.nan), np.full(shape, np.nan)
    band, band_skipped = (_joint_band_plan(config, instances, steps, rho) if corrected
                          else (None, None))
    if band_skipped:
        why["band"] = band_skipped
    failed = {}
    for inst, idx in group_runs(instances):
        regime = finetune_regime(config, inst)
        start = hermite.FinetuneStart(mu0=mu0[idx], p0=p0[idx], c_hat0=c0[idx])
        sol = _attempt(failed, "ode", idx, hermite.finetune_ode, inst, regime, steps, start)
        if sol is not None:
            ode[idx], c_ode[idx] = sol.m, sol.c_overlap
        cidx = idx[chosen[idx]] if corrected else idx[:0]
        if cidx.size:
            chosen_start = hermite.FinetuneStart(mu0=mu0[cidx], p0=p0[cidx], c_hat0=c0[cidx])
            sol = _attempt(failed, "corrected", cidx, hermite.finetune_ode, inst, regime, steps,
                           chosen_start, corrected=True)
            if sol is not None:
                corr[cidx], c_corr[cidx] = sol.m, sol.c_overlap
        if band is not None:
            from hermite.finetune.band import joint_band

            b = _attempt(failed, "band", idx, joint_band, inst, regime, steps, start)
            if b is not None:
                for key, edge in zip(band, (b.lower, b.upper, b.c_lower, b.c_upper),
                                     strict=True):
                    band[key][idx] = edge
    why |= _reasons(failed)
    corrected = corrected and np.isfinite(corr).any()
    if band is not None and not np.isfinite(band["band_lower"]).any():
        band = None
    eta_d = config.eta * instances[0].d
    plain = ("plain O(η) population ODE (hermite.finetune_ode): drops the O(η²d) finite-d "
             f"drift, so its gap to the SGD mean grows with η·d (here η·d = {eta_d:.3g})")
    fixed = (f"finite-d corrected population ODE (hermite.finetune_ode, corrected=True): the "
             f"O(η) drift plus the O(η²d) renormalisation drift at d = {instances[0].d}, "
             f"b = {config.batch}, label noise {config.label_noise:g} (η·d = {eta_d:.3g})")
    if _escape_line(config):
        fixed += ("; with the diffusion of ⟨û, u⟩ during the escape from |m₀| ~ d^(−1/2): the "
                  "mean |⟨û, u⟩| of runs from this start, eq. (E2) of docs/theory/finite-d.md")
    out = {"ode": ode, "extra_attrs": {"ode": {"note": plain, "ode": "plain"} | why},
           "extra": {}}
    part = {"partial": partial} if partial else {}
    if corrected:
        out["ode_corrected"] = corr
        out["extra_attrs"]["ode_corrected"] = {"note": fixed, "ode": "corrected"} | part
    if band is not None:
        from hermite.finetune.band import BAND_NODES

        note = ("10–90% linear-noise band around the finite-d corrected ODE "
                "(hermite.finetune.band.joint_band: mixture over ≤ "
                f"{BAND_NODES} of the runs' starts)")
        out["band_lower"], out["band_upper"] = band["band_lower"], band["band_upper"]
        out["extra"].update(band_c_lower=band["band_c_lower"], band_c_upper=band["band_c_upper"])
        for key in band:
            out["extra_attrs"][key] = {"note": note + ("; of ⟨ĉ, c⟩/‖ĉ‖‖c‖" if "_c_" in key
                                                       else "; of ⟨û, u⟩")}
    xi_extra, xi_attrs = finite_xi_lines(config, instances, steps, (p0, mu0, c0))
    out["extra"].update(xi_extra)
    for key, attrs in xi_attrs.items():
        out["extra_attrs"].setdefault(key, {}).update(attrs)
    if o.joint_c:
        out["extra"]["ode_c_overlap"] = c_ode
        out["extra_attrs"]["ode_c_overlap"] = {
            "note": plain + "; ⟨û, u⟩ of the same ODE is `ode`", "ode": "plain"} | why
        if corrected:
            out["extra"]["ode_corrected_c_overlap"] = c_corr
            out["extra_attrs"]["ode_corrected_c_overlap"] = {
                "note": fixed + "; ⟨û, u⟩ of the same ODE is `ode_corrected`",
                "ode": "corrected"} | part
    return out


def finite_xi_applies(config, inst: Instance) -> bool:
    """Whether the finite-ξ line is drawn for runs of ``inst``: ĉ joint, unit rows, finite-d
    theory on within its η·d range (:func:`corrected_applies`) and ξ²/d ≥ ``FINITE_XI_MIN``."""
    return (config.options.joint_c and unit_rows(config) and corrected_applies(config, inst.d)
            and inst.xi ** 2 / inst.d >= FINITE_XI_MIN)


def finite_xi_lines(config, instances: list[Instance], steps, start) -> tuple[dict, dict]:
    """({``ode_finite_xi``, ``ode_finite_xi_c_overlap``: (R, C)}, their attributes) for the
    run groups where :func:`finite_xi_applies` (({}, {}) where none does): the diffusion
    approximation of the chain (``finite_xi_ensemble``, ``FINITE_XI_PATHS`` paths per start,
    seed 0) from each run's ``start`` (p₀, μ₀, ĉ₀), from the runs :func:`budget_starts`
    picks, as many in each group, when all of them would take more than
    ``FINITE_XI_BUDGET_S`` (NaN in the others, said in the ``partial`` attribute); a group
    whose line fails numerically is left out (NaN, the reason in the ``finite_xi``
    attribute of it and, where every group failed, of ``ode``)."""
    from hermite.finetune.finite_xi import EnsembleScheme, finite_xi_ensemble

    groups = [(inst, idx) for inst, idx in group_runs(instances)
              if finite_xi_applies(config, inst)]
    if not groups:
        return {}, {}
    p0, mu0, c0 = start
    steps = np.asarray(steps)
    scheme = EnsembleScheme(particles=FINITE_XI_PATHS)
    rate = max(config.eta, config.step_size_c)
    per_run = (math.ceil(rate * float(np.max(steps)) / scheme.flow_step) * instances[0].k
               * FINITE_XI_SECONDS)
    runs = sum(idx.size for _, idx in groups)
    cost = runs * per_run
    shape = (len(instances), len(steps))
    m, c = np.full(shape, np.nan), np.full(shape, np.nan)
    chosen = np.ones(len(instances), dtype=bool)
    partial = None
    if cost > FINITE_XI_BUDGET_S:  # the same number of starts in each group, at least one
        chosen = budget_groups(groups, mu0, max(1, int(FINITE_XI_BUDGET_S // per_run)),
                               out=chosen)
        if not chosen.all():
            drawn = max(int(chosen[idx].sum()) for _, idx in groups)
            partial = (f"finite-ξ line from {drawn} runs' starts per instance only (spread "
                       f"over their ⟨û₀, u⟩; NaN in the others): all {runs} ≈ {cost:.0f} s > "
                       f"{FINITE_XI_BUDGET_S:g} s")
            print(f"note: {partial}", file=sys.stderr)
    failed = {}
    for inst, idx in groups:
        cidx = idx[chosen[idx]]
        if not cidx.size:
            continue
        begin = hermite.FinetuneStart(mu0=mu0[cidx], p0=p0[cidx], c_hat0=c0[cidx])
        sol = _attempt(failed, "finite_xi", cidx, finite_xi_ensemble, inst,
                       finetune_regime(config, inst), steps, begin, scheme=scheme)
        if sol is not None:
            m[cidx], c[cidx] = sol.abs_m, sol.c_overlap
    why = _reasons(failed)
    if not np.isfinite(m).any():
        return {}, {"ode": why} if why else {}
    note = ("finite-ξ line (hermite.finetune.finite_xi.finite_xi_ensemble): the diffusion "
            "approximation of the exact chain, the corrected drift plus the step noise of "
            f"(p, μ, ĉ), {FINITE_XI_PATHS} paths per start; at ξ ~ √d the d → ∞ ODE leaves out "
            "ĉ's step noise (docs/theory/finite-xi.md)")
    attrs = {"ode": "finite-xi"} | ({"partial": partial} if partial else {}) | why
    return ({"ode_finite_xi": m, "ode_finite_xi_c_overlap": c},
            {"ode_finite_xi": {"note": note + "; E|⟨û, u⟩| of its paths"} | attrs,
             "ode_finite_xi_c_overlap": {"note": note + "; ⟨ĉ, c⟩/(‖ĉ‖‖c‖) of its paths"}
             | attrs})


def budget_starts(mu0, n: int, least: int = MIN_RUNS) -> np.ndarray:
    """Mask of ``n`` of the runs (none, or at least ``least``, at most all), spread evenly
    over the runs' starts sorted by ⟨û₀, u⟩'s coordinate ``mu0``: the runs a line over its
    cost budget is drawn from (issue 40.4: fewer starts, said so, rather than no line). A line
    drawn at all comes from at least ``MIN_RUNS`` starts, the fewest its audit judges: from
    three, one 27 SE off was drawn (fig1 quick, ⟨ĉ, c⟩ at ξ = 12.65) because no audit of three
    runs may leave a line out."""
    runs = len(mu0)
    mask = np.zeros(runs, dtype=bool)
    n = max(0, min(int(n), runs))
    if n:
        n = min(max(n, int(least)), runs)
    if n:
        order = np.argsort(np.asarray(mu0, dtype=float), kind="stable")
        mask[order[np.unique(np.round(np.linspace(0, runs - 1, n)).astype(int))]] = True
    return mask


def budget_groups(groups, mu0, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Mask of the runs a line over its budget is drawn from: ``n`` starts shared evenly by
    the instance ``groups`` ((instance, run indices), :func:`group_runs`), at least one each,
    by :func:`budget_starts` in each group — so at least ``MIN_RUNS`` (or all) in each, the
    fewest its audit judges: a sweep batch's cells are audited one by one. ``out``: the mask
    to fill (runs outside the groups keep their value); none where ``n`` ≤ 0."""
    chosen = np.zeros(len(mu0), dtype=bool) if out is None else out
    if n <= 0:
        return chosen
    each = max(1, int(n) // max(1, len(groups)))
    for _, idx in groups:
        chosen[idx] = budget_starts(mu0[idx], each)
    return chosen


LINES = {"ode": "population ODE", "corrected": "finite-d corrected ODE",
         "band": "linear-noise band",
         "finite_xi": "finite-ξ line"}  # the theory lines of a run, as notes name them


def _attempt(failed: dict, line: str, idx, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None where it fails numerically (an ArithmeticError or
    ValueError: overflow, NaN, a stiff stretch, a solver failure), appending why to
    ``failed[line]``: a theory line that fails is left out, the runs and the other lines are
    kept."""
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return fn(*args, **kwargs)
    except (ArithmeticError, ValueError) as exc:
        runs = f"runs {idx[0]}…{idx[-1]}" if len(idx) > 1 else f"run {idx[0]}"
        failed.setdefault(line, []).append(f"{runs}: {exc}")
        return None


def _reasons(failed: dict) -> dict:
    """{attribute of ``ode``: one line} for the lines of ``failed`` (:func:`_attempt`): which
    theory line is left out and why (the first failure, then a count), each also a note on
    stderr; the attribute is the line's (``corrected``, ``band``), ``no_theory`` for ``ode``
    itself."""
    out = {}
    for line, where in failed.items():
        more = f"; {len(where) - 1} more run groups failed" if len(where) > 1 else ""
        text = f"{LINES[line]} left out: its integration failed ({where[0]}){more}"
        out["no_theory" if line == "ode" else line] = text
        print(f"note: {text}", file=sys.stderr)
    return out


def _joint_band_plan(config, instances: list[Instance], steps, rho: float = 0.0):
    """({band key: NaN (R, C) array to fill}, None) where the joint band is recorded beside
    the corrected ODE, (None, why not) where its estimate is over the budget, (None, None)
    where it is not derived (:func:`hermite.finetune.band.joint_band_applies`); ``rho``: as
    in :func:`corrected_seconds`."""
    from dynamics.measures.losses import pair_kernel
    from hermite.finetune.band import BAND_NODES, joint_band_applies

    if not config.options.joint_c:
        return None, None
    inst = instances[0]
    model = hermite.FinetuneModel.of(inst, finetune_regime(config, inst),
                                     kernel=pair_kernel(inst.activation, inst.unit_rows))
    if joint_band_applies(model, config.batch) is not None:
        return None, None
    groups = len(list(group_runs(instances)))
    nodes = instances[: min(len(instances), BAND_NODES * groups)]
    cost = (corrected_seconds(config, nodes, steps, rho) * (BAND_COST + instances[0].k)
            + groups * _rk4_steps(config, steps, rho) * BAND_STEP_S)
    if cost > CORRECTED_BUDGET_S:
        why = (f"joint linear-noise band not recorded: ≈ {cost:.0f} s > "
               f"{CORRECTED_BUDGET_S:g} s (hermite.finetune.band.joint_band gives it)")
        print(f"note: {why}", file=sys.stderr)
        return None, why
    shape = (len(instances), len(steps))
    keys = ("band_lower", "band_upper", "band_c_lower", "band_c_upper")
    return {key: np.full(shape, np.nan) for key in keys}, None


def _costly_cells(costly: list) -> str:
    """The cells left out by their cost, [(ξ, seconds a start)], for a note: each by its ξ
    where the ξ differ, else counted (a batch of random instances at one ξ)."""
    xis = [xi for xi, _ in costly]
    if len(set(xis)) == len(xis) or len(xis) < 3:
        return "; ".join(f"ξ = {xi:.4g}: ≈ {cost:.0f} s a start" for xi, cost in costly)
    costs = [cost for _, cost in costly]
    return (f"{len(costly)} cells (ξ = {', '.join(f'{x:.4g}' for x in sorted(set(xis)))}): "
            f"≈ {min(costs):.0f}–{max(costs):.0f} s a start")


def corrected_seconds(config, instances: list[Instance], steps, rho: float = 0.0) -> float:
    """Estimated seconds of the corrected ODE of every run (``CORRECTED_SECONDS`` per run,
    RK4 step and row; RK4 steps: :func:`_rk4_steps`, ``rho`` the drift's stiffness at the
    runs' starts, :func:`_group_rate`; 0: steps of ``FLOW_STEP`` only)."""
    o = config.options
    rk4 = _rk4_steps(config, steps, rho)
    k = instances[0].k
    per = CORRECTED_SECONDS["projected" if o.project else "unprojected"] * (1.0 + k / 32.0)
    if _escape_line(config):  # the escape line carries COST_FLOWS corrected flows per start
        from hermite.finetune.escape import COST_FLOWS

        per *= COST_FLOWS
    return len(instances) * rk4 * k * per * KERNEL_COST[_kernel_kind(instances[0])]


def _escape_line(config) -> bool:
    """Whether ``hermite.finetune_ode(corrected=True)`` returns the escape line (E2) for this
    learner: ĉ joint and û unprojected (hermite.finetune.escape)."""
    return config.options.joint_c and not config.options.project


def _rk4_steps(config, steps, rho: float = 0.0) -> int:
    """RK4 steps of the corrected ODE to ``max(steps)``: η·Δt ≤
    ``hermite.finetune.population.FLOW_STEP`` and Δt·ρ ≤ ``FLOW_RATE`` with ρ =
    ``RATE_GROWTH``·``rho`` (the stiffness per SGD step at the start)."""
    from hermite.finetune.population import FLOW_RATE, FLOW_STEP

    rate = max(config.eta, config.step_size_c if config.options.joint_c else 0.0)
    per_step = max(rate / FLOW_STEP, RATE_GROWTH * rho / FLOW_RATE)
    return math.ceil(float(np.max(steps)) * per_step)


def _group_rate(config, inst: Instance, idx, start) -> float:
    """ρ of the corrected ODE of the runs ``idx`` of ``inst`` at their first 4 starts
    (``start`` = (p₀, μ₀, ĉ₀) of every run; :func:`hermite.finetune.population.drift_rate`,
    per SGD step; 0 where it fails): the drift's stiffness grows with ξ (He₃, d = 1000,
    k = 20: ρ = 6·10⁻⁵ at ξ = √k, 2.8·10⁻³ at 16√k), so each group has its own."""
    from hermite.finetune.population import drift_rate

    p0, mu0, c0 = start
    idx = idx[:4]
    model = hermite.FinetuneModel.of(inst, finetune_regime(config, inst))
    try:
        with np.errstate(all="ignore"):
            rho = drift_rate(model, p0[idx], mu0[idx], c0[idx])
    except (ArithmeticError, ValueError):  # the integration says why (finetune_theory)
        return 0.0
    return rho if math.isfinite(rho) else 0.0


class CorrectedPlan(NamedTuple):
    """Where the finite-d corrected ODE is computed (:func:`corrected_plan`)."""

    chosen: np.ndarray  # mask of the runs whose corrected ODE is computed
    partial: str | None  # the ``partial`` note (some runs' starts only), or None
    left_out: str | None  # why it is nowhere computed, or None
    stiffness: float  # the largest ρ of the costed groups (:func:`_group_rate`; 0: none)


def corrected_plan(config, instances: list[Instance], steps, start) -> CorrectedPlan:
    """The runs whose finite-d corrected ODE is computed, with the notes of
    :class:`CorrectedPlan`. ``start`` = (p₀, μ₀, ĉ₀) of every run.

    Each instance group is costed at its own stiffness (:func:`_group_rate`,
    :func:`corrected_seconds`). Not in a group where :func:`finite_xi_applies`: there the
    finite-ξ line carries the same finite-d drift with the step noise, the line to read
    (the corrected ODE without that noise is off where the plain one is, against 1024 chain
    runs: docs/theory/audit.md), and the escape line costs most (He₃, d = 1000, k = 20:
    ≈ 90 s a start at ξ = 4√k). Where all groups' starts cost more than
    ``CORRECTED_BUDGET_S``, each group gets an equal share of it and is drawn from as many
    starts as that allows (:func:`budget_starts`: at least ``MIN_RUNS``), or not at all where
    one start costs more than its share."""
    _, mu0, _ = start
    chosen = np.zeros(len(instances), dtype=bool)
    groups = group_runs(instances)
    own = [(inst, idx) for inst, idx in groups if not finite_xi_applies(config, inst)]
    rates = [_group_rate(config, inst, idx, start) for inst, idx in own]
    per_start = [corrected_seconds(config, [inst], steps, rate)
                 for rate, (inst, _) in zip(rates, own, strict=True)]
    stiffness = max(rates, default=0.0)
    total = sum(cost * idx.size for cost, (_, idx) in zip(per_start, own, strict=True))
    share = CORRECTED_BUDGET_S / max(1, len(own))
    costly = []  # the groups left out by their cost
    for cost, (inst, idx) in zip(per_start, own, strict=True):
        if total <= CORRECTED_BUDGET_S:
            chosen[idx] = True
        elif cost > share:
            costly.append((inst.xi, cost))
        else:
            chosen[idx] = budget_starts(mu0[idx], int(share // cost))
    skipped = len(own) < len(groups)
    notes = ([f"none where ξ²/d ≥ {FINITE_XI_MIN:g} (the finite-ξ line, the same drift with "
              "the step noise, is drawn there)"] if skipped else [])
    if costly:
        notes.append(f"none at {_costly_cells(costly)} > {share:.3g} s (its share of the "
                     f"{CORRECTED_BUDGET_S:g} s budget; loradyn hermite ode --corrected gives "
                     "it from chosen starts)")
    if not chosen.any():  # every group skipped or over its share: a note says each
        return CorrectedPlan(chosen, None, "finite-d corrected ODE not recorded: "
                             + "; ".join(notes), stiffness)
    if chosen.all():
        return CorrectedPlan(chosen, None, None, stiffness)
    if total > CORRECTED_BUDGET_S:
        notes.insert(0, f"from {int(chosen.sum())} of {len(instances)} runs' starts, spread "
                     f"over their ⟨û₀, u⟩ (all ≈ {total:.0f} s > {CORRECTED_BUDGET_S:g} s)")
    return CorrectedPlan(chosen, "finite-d corrected ODE from some runs' starts only (NaN in "
                         "the others): " + "; ".join(notes), None, stiffness)


def _kernel_kind(inst: Instance) -> str:
    """``closed`` (a closed-form pair kernel), ``interpolated`` (unit rows, the certified
    interpolant of the dual kernel) or ``mehler`` (App. B rows, Mehler's series)."""
    from dynamics.measures.losses import pair_kernel

    kernel = pair_kernel(inst.activation, inst.unit_rows)
    if kernel is None:  # no pair kernel: the corrected ODE's drift has none either
        return "mehler"
    if kernel.method == "mehler":  # a polynomial's series is short: as cheap as closed
        return "mehler" if kernel.terms > POLYNOMIAL_TERMS else "closed"
    if kernel.method == "unit" and kernel.act.kernel is None:
        return "interpolated"
    return "closed"


def corrected_applies(config, d: int) -> bool:
    """Whether :func:`finetune_theory` records the finite-d corrected ODE: finite-d theory
    on (``--finite-d-theory``, the default) and η·d ≤ ``FINITE_D_MAX_ETA_D`` (the correction is
    the next order of an expansion in η with η·d = O(1))."""
    return bool(config.finite_d_theory) and config.eta * d <= FINITE_D_MAX_ETA_D


def initial_drift_sign(instances: list[Instance]) -> np.ndarray:
    """sign h(0) per run (Thm 5's aligned start needs m₀ h(0) > 0)."""

    out = np.zeros(len(instances))
    for inst, idx in group_runs(instances):
        out[idx] = np.sign(float(np.asarray(hermite.h(inst, 0.0)).reshape(-1)[0]))
    return out
