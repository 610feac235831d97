"""Dimension scaling of hitting times: T ∝ d^b for a learner on an instance family.

A scaling file (TOML) has a ``[scaling]`` table — the grid ``d``, the step-size constant ``c``
(η = c/d; docs/conventions.md, "Choosing η"), the horizon ``H`` (steps = H·d), the
weak-recovery ``level`` and the strong-recovery ``epsilon``; optionally ``eta_exponent`` a and
``horizon_exponent`` e (η = c/d^a, steps = H·d^e, both 1 by default: e.g. a = 3/2, e = 2 for
the glm learner with information exponent 3, whose online SGD needs T ∝ d² with η ∝ d^{−3/2},
Ben Arous et al. 2021) — and the ``[base]``/``[base.instance]`` tables
of a sweep file (everything but d, η and the steps). It runs as a sweep over d (resumable,
:mod:`sims.experiments.sweep`), with linear checkpoints and, where the reduced engine applies, exact
first-passage times. Per run:

* T_level — the first step with overlap ≥ level (exact when available, else the first
  checkpoint at or above it);
* T_strong — the step from which the overlap stays ≥ 1 − ε: the checkpoint after the last one
  below 1 − ε; never (NaN) if the last checkpoint is below.

``mode = "first_passage"`` (reduced engine; finetune and the network learners, whose chains
record the start alone) records no trajectory: every run stops at its exact first passage
of each level, so a cell costs the hitting times instead of the horizon, and T_strong is
then the exact first passage of 1 − ε (strong recovery in the sense of Thm 11–13: the
overlap reaches 1 − ε; ε should leave 1 − ε below the noise floor).

``quantity = "loss"`` (first_passage mode, chains that check the exact population loss every
step: the network learners with unit rows and a fine-tuned teacher) times the loss instead:
T_level is the first step with loss ≤ ``level`` (e.g. the L* of Theorem 19) and T_strong the
first with loss ≤ ``epsilon`` (a lower loss level, < level).

Both are fitted as log T = a + b log d (:func:`sims.experiments.fit.fit_power_law`,
bootstrap 95 % CI).
"""

from __future__ import annotations

import json
import math
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sims.experiments.fit import PowerLawFit, fit_power_law
from sims.experiments.sweep_spec import SweepSpec, SweepSpecError, parse_sweep, passage_key
from sims.io.atomic import hdf5_writer
from sims.io.sweep import read_sweep

__all__ = ["ScalingSpec", "ScalingResult", "load_scaling", "hitting_times", "analyse",
           "format_table", "plot_scaling", "write_scaling", "check_slope", "SCALING_KEYS"]

SCALING_KEYS = ("d", "c", "horizon", "level", "epsilon", "checkpoints", "n_boot",
                "boot_seed", "absolute", "eta_exponent", "horizon_exponent", "mode", "quantity")
MODES = ("trajectory", "first_passage")
QUANTITIES = ("overlap", "loss")
RESERVED = ("eta", "eta_times_d", "steps", "steps_per_d", "eta_d_exponent", "steps_d_exponent",
            "spacing", "checkpoints")


@dataclass
class ScalingSpec:
    """A parsed scaling file: the sweep over d and the analysis settings."""

    sweep: SweepSpec
    d: list
    c: float
    horizon: float
    level: float = 0.5
    epsilon: float = 0.1
    checkpoints: int = 400
    n_boot: int = 2000
    boot_seed: int = 0
    absolute: bool = True
    eta_exponent: float = 1.0
    horizon_exponent: float = 1.0
    mode: str = "trajectory"
    quantity: str = "overlap"

    @property
    def strong_level(self) -> float:
        """Overlap 1 − ε, or (``quantity = "loss"``) the loss level ε."""
        return self.epsilon if self.quantity == "loss" else 1.0 - self.epsilon

    def settings(self) -> dict:
        return {k: getattr(self, k) for k in SCALING_KEYS}


def _number(table, key, default, lo=None, hi=None, integer=False):
    val = table.get(key, default)
    ok = isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val)
    if not ok or (integer and val != int(val)):
        raise SweepSpecError(f"[scaling] {key} must be {'an integer' if integer else 'a number'}"
                             f", got {val!r}")
    if (lo is not None and val <= lo) or (hi is not None and val >= hi):
        raise SweepSpecError(f"[scaling] {key} = {val} must lie in ({lo}, {hi})")
    return int(val) if integer else float(val)


def load_scaling(path) -> ScalingSpec:
    """Read and check a scaling TOML file (SweepSpecError with a one-line reason)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SweepSpecError(f"no such scaling file: {path}") from None
    except OSError as exc:
        raise SweepSpecError(f"cannot read scaling file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SweepSpecError(f"scaling file {path} is not valid TOML ({exc})") from None
    try:
        return parse_scaling(data, path)
    except SweepSpecError as exc:
        msg = str(exc)
        raise SweepSpecError(msg if msg.startswith("sweep file") else
                             f"scaling file {path}: {msg}") from None


def parse_scaling(data: dict, source=None) -> ScalingSpec:
    """Check a scaling dict (as read from TOML); see the module docstring."""
    extra = [k for k in data if k not in ("scaling", "base", "sweep")]
    if extra:
        raise SweepSpecError(f"unknown top-level table '{extra[0]}'; valid: scaling, base, "
                             "sweep")
    table = data.get("scaling")
    if not isinstance(table, dict):
        raise SweepSpecError("a [scaling] table is required")
    bad = [k for k in table if k not in SCALING_KEYS]
    if bad:
        raise SweepSpecError(f"unknown [scaling] key '{bad[0]}'; valid: {', '.join(SCALING_KEYS)}")
    ds = table.get("d")
    if not isinstance(ds, list) or len(ds) < 2 or not all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ds):
        raise SweepSpecError("[scaling] d must be a list of at least two positive integers")
    if len(set(ds)) != len(ds):
        raise SweepSpecError("[scaling] d repeats a value")
    base = dict(data.get("base", {}))
    clash = [k for k in RESERVED if k in base]
    if clash:
        raise SweepSpecError(f"[base] {clash[0]} is set by [scaling] (c, horizon, their "
                             "exponents, checkpoints)")
    inst = base.get("instance")
    if isinstance(inst, dict) and "d" in inst:
        raise SweepSpecError("[base.instance] d is set by [scaling] d")
    quantity = table.get("quantity", "overlap")
    if quantity not in QUANTITIES:
        raise SweepSpecError(f"[scaling] quantity must be one of {', '.join(QUANTITIES)}, "
                             f"got {quantity!r}")
    loss = quantity == "loss"
    spec = ScalingSpec(
        sweep=None, d=sorted(ds), c=_number(table, "c", None, lo=0),
        horizon=_number(table, "horizon", None, lo=0),
        level=_number(table, "level", 0.5, lo=0, hi=None if loss else 1),
        epsilon=_number(table, "epsilon", 0.1, lo=0, hi=None if loss else 1),
        checkpoints=_number(table, "checkpoints", 400, lo=1, integer=True),
        n_boot=_number(table, "n_boot", 2000, lo=0, integer=True),
        boot_seed=_number(table, "boot_seed", 0, lo=-1, integer=True),
        absolute=table.get("absolute", True),
        eta_exponent=_number(table, "eta_exponent", 1.0, lo=0),
        horizon_exponent=_number(table, "horizon_exponent", 1.0, lo=0))
    if not isinstance(spec.absolute, bool):
        raise SweepSpecError("[scaling] absolute must be true or false")
    spec.mode, spec.quantity = table.get("mode", "trajectory"), quantity
    if spec.mode not in MODES:
        raise SweepSpecError(f"[scaling] mode must be one of {', '.join(MODES)}, "
                             f"got {spec.mode!r}")
    if loss and spec.mode != "first_passage":
        raise SweepSpecError("[scaling] quantity = \"loss\" needs mode = \"first_passage\" "
                             "(the exact loss is timed in the chain, not at checkpoints)")
    if loss and not spec.epsilon < spec.level:
        raise SweepSpecError(f"[scaling] with quantity = \"loss\", epsilon (the strong loss "
                             f"level, {spec.epsilon:g}) must lie below level ({spec.level:g})")
    base.update(eta_times_d=spec.c, steps_per_d=spec.horizon, spacing="linear",
                checkpoints=spec.checkpoints)
    if spec.eta_exponent != 1:  # only when set: default files resolve exactly as before
        base["eta_d_exponent"] = spec.eta_exponent
    if spec.horizon_exponent != 1:
        base["steps_d_exponent"] = spec.horizon_exponent
    base.setdefault("engine", "auto")
    meta = dict(data.get("sweep", {}))
    meta.setdefault("name", f"scaling {Path(source).stem}" if source else "scaling")
    if spec.mode == "first_passage":
        meta.update(first_passage=[spec.level, spec.strong_level], absolute=spec.absolute,
                    trajectory=False)
        if loss:
            meta["first_passage_of"] = "loss"
    else:
        meta.update(first_passage=[spec.level], absolute=spec.absolute)
    sweep = {"sweep": meta, "base": base, "axes": {"d": spec.d}}
    spec.sweep = parse_sweep(sweep, source=source)
    return spec


# ---------------------------------------------------------------- hitting times
def _signed(traj, absolute):
    ov = np.asarray(traj.overlap, dtype=float)
    return np.abs(ov) if absolute else ov


def hitting_times(traj, level: float, strong_level: float, absolute: bool = True,
                  strong_first_passage: bool = False, quantity: str = "overlap"):
    """(T_level (R,), T_strong (R,), source of T_level) for one cell; NaN = never.

    ``strong_first_passage``: T_strong is the exact first passage of ``strong_level``
    (recorded by a first-passage-only cell) instead of "stays above from a checkpoint".
    ``quantity = "loss"``: both are the exact first passages of the loss (recorded)."""
    ov = _signed(traj, absolute)
    steps = np.asarray(traj.steps, dtype=float)
    exact = traj.extra.get(passage_key(level, quantity))
    if exact is None and quantity != "overlap":
        raise ValueError(f"no exact first passage of the {quantity} to {level:g} in this cell")
    if exact is not None:
        t_level, source = np.asarray(exact, dtype=float).copy(), "exact first passage"
    else:
        hit = ov >= level
        t_level = np.where(hit.any(1), steps[np.argmax(hit, axis=1)], np.nan)
        source = "first checkpoint at or above the level"
    if strong_first_passage:
        exact_strong = traj.extra.get(passage_key(strong_level, quantity))
        if exact_strong is None:
            raise ValueError(f"no exact first passage of {strong_level:g} in this cell")
        t_strong = np.asarray(exact_strong, dtype=float).copy()
    else:
        below = ~(ov >= strong_level)  # NaN counts as below
        last = below.shape[1] - 1 - np.argmax(below[:, ::-1], axis=1)
        t_strong = np.where(below.any(1), steps[np.minimum(last + 1, steps.size - 1)], 0.0)
        t_strong[below[:, -1]] = np.nan
    dead = np.asarray(traj.diverged_step) >= 0
    t_level[dead] = np.nan
    t_strong[dead] = np.nan
    return t_level, t_strong, source


@dataclass
class ScalingResult:
    """Per-d hitting times (n_d, R), their fits (None when not fittable) and context."""

    spec: ScalingSpec
    d: np.ndarray
    t_level: list
    t_strong: list
    level_source: str
    fits: dict = field(default_factory=dict)  # "level"/"strong" → PowerLawFit | None
    errors: dict = field(default_factory=dict)
    title: str = ""
    overlap_label: str = "|⟨û, u⟩|"  # what the overlap measures (``Learner.overlap_label``)


def analyse(sweep_path, spec: ScalingSpec) -> ScalingResult:
    """Hitting times and fits from a finished scaling sweep file."""
    _meta, cells = read_sweep(sweep_path)
    by_d = {int(c.config["instance"]["d"]): c for c in cells}
    missing = [d for d in spec.d if d not in by_d]
    if missing:
        raise ValueError(f"{sweep_path}: no finished cell for d = {missing[0]}")
    t_level, t_strong, source = [], [], ""
    for d in spec.d:
        a, b, source = hitting_times(by_d[d].traj, spec.level, spec.strong_level, spec.absolute,
                                     strong_first_passage=spec.mode == "first_passage",
                                     quantity=spec.quantity)
        t_level.append(a)
        t_strong.append(b)
    from dynamics.learners import get_learner

    config = by_d[spec.d[0]].config
    result = ScalingResult(spec, np.array(spec.d), t_level, t_strong, source,
                           title=_title(config, spec), overlap_label=get_learner(
                               config.get("learner", "finetune")).overlap_label)
    for name, times in (("level", t_level), ("strong", t_strong)):
        try:
            result.fits[name] = fit_power_law(spec.d, times, n_boot=max(spec.n_boot, 1),
                                              seed=spec.boot_seed)
        except ValueError as exc:
            result.fits[name], result.errors[name] = None, str(exc)
    return result


def _title(config: dict, spec: ScalingSpec) -> str:
    from dynamics.learners import get_learner

    inst = config["instance"]
    learner = get_learner(config.get("learner", "finetune"))
    shown = {"k": f"k = {inst.get('k')}", "xi": f"ξ = {inst.get('xi', 1.0):g}",
             "W": f"W = {inst.get('W', 'orthonormal')}"}
    setting = ", ".join([f"σ = {inst.get('activation')}"]
                        + [shown[key] for key in learner.instance_keys]
                        + [f"learner = {learner.name} ({learner.variant(config)})"])
    return (f"{setting}; η = c/{_power(spec.eta_exponent)}, c = {spec.c:g}; "
            f"steps = {spec.horizon:g}·{_power(spec.horizon_exponent)}; "
            f"{config.get('runs')} runs per d")


def _overlap_note(result) -> str:
    if result.spec.quantity == "loss":
        return "; the exact population loss, checked after every step"
    return f"; overlap taken as {result.overlap_label}"


def _power(exponent: float) -> str:
    """"d" or "d^e"."""
    return "d" if exponent == 1 else f"d^{exponent:g}"


def _names(spec: ScalingSpec) -> dict:
    if spec.quantity == "loss":
        return {"level": f"T_(L≤{spec.level:g})", "strong": f"T_(L≤{spec.strong_level:g})"}
    return {"level": f"T_{spec.level:g}", "strong": f"T_(1−ε={spec.strong_level:g})"}


def _strong_description(spec: ScalingSpec) -> str:
    if spec.quantity == "loss":
        return f"steps to first reach population loss ≤ {spec.strong_level:g} (exact)"
    if spec.mode == "first_passage":
        return f"steps to first reach overlap {spec.strong_level:g} (exact)"
    return f"steps from which the overlap stays ≥ {spec.strong_level:g}"


def format_table(result: ScalingResult) -> str:
    """The per-d table and the fitted slopes, as printed by ``loradyn scaling``."""
    spec, names = result.spec, _names(result.spec)
    strong = ("exact first passage (no trajectory recorded)" if spec.mode == "first_passage"
              else f"stays above from the next of {spec.checkpoints} linear checkpoints")
    lines = [result.title, f"{names['level']}: {result.level_source}; "
             f"{names['strong']}: {strong}"
             + (_overlap_note(result) if spec.absolute or spec.quantity == "loss" else "")]
    head = f"{'d':>9} {'runs':>5}"
    for key in ("level", "strong"):
        head += f" | {'reached':>7} {'median ' + names[key]:>22} " \
                f"{'/ ' + _power(spec.horizon_exponent):>8}"
    lines.append(head)
    for i, d in enumerate(result.d):
        row = f"{d:>9d} {result.t_level[i].size:>5d}"
        for times in (result.t_level[i], result.t_strong[i]):
            reached = np.mean(np.isfinite(times))
            med = _censored_median(times)
            scaled = med / float(d) ** spec.horizon_exponent
            row += f" | {100 * reached:>6.0f}% {_num(med):>22} {_num(scaled, '.3g'):>8}"
        lines.append(row)
    for key in ("level", "strong"):
        fit = result.fits.get(key)
        if fit is None:
            lines.append(f"fit {names[key]}: not fitted ({result.errors.get(key)})")
        else:
            lo, hi = fit.slope_ci
            lines.append(f"fit {names[key]} ∝ d^b: b = {fit.slope:.3f}, 95 % CI [{lo:.3f}, "
                         f"{hi:.3f}] (c = {spec.c:g}; reached {_pct(fit.reached)})")
    return "\n".join(lines)


def _censored_median(times) -> float:
    t = np.where(np.isnan(times), np.inf, times)
    return float(np.median(t))


def _num(x, fmt=".0f") -> str:
    return "never" if not np.isfinite(x) else format(x, fmt)


def _pct(reached) -> str:
    return ", ".join(f"{100 * r:.0f}%" for r in reached)


def check_slope(result: ScalingResult, lo: float, hi: float, target: str = "level") -> list:
    """Messages for each checked fit whose 95 % interval leaves [lo, hi] (empty: all pass)."""
    keys = ("level", "strong") if target == "both" else (target,)
    names, bad = _names(result.spec), []
    for key in keys:
        fit = result.fits.get(key)
        if fit is None:
            bad.append(f"{names[key]}: no fit ({result.errors.get(key)})")
        elif fit.slope_ci[0] < lo or fit.slope_ci[1] > hi:
            bad.append(f"{names[key]}: slope interval [{fit.slope_ci[0]:.3f}, "
                       f"{fit.slope_ci[1]:.3f}] leaves [{lo:g}, {hi:g}]")
    return bad


# ---------------------------------------------------------------- figure and file
def plot_scaling(result: ScalingResult):
    """Log-log figure: per-run times, medians, fitted lines with slopes and CIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _names(result.spec)
    fig, ax = plt.subplots(figsize=(6.6, 4.8), constrained_layout=True)
    colors = {"level": "tab:blue", "strong": "tab:red"}
    for key, times in (("level", result.t_level), ("strong", result.t_strong)):
        for d, t in zip(result.d, times, strict=True):
            ax.plot(np.full(t.size, d), t, ".", color=colors[key], alpha=0.3, ms=3)
        med = np.array([_censored_median(t) for t in times])
        ax.plot(result.d, np.where(np.isfinite(med), med, np.nan), "o", color=colors[key],
                ms=6, label=f"median {names[key]}")
        fit = result.fits.get(key)
        if fit is not None:
            lo, hi = fit.slope_ci
            label = (f"fit {names[key]} ∝ d^b: b = {fit.slope:.2f} [{lo:.2f}, {hi:.2f}]; "
                     f"reached {100 * np.mean(fit.reached):.0f}%")
            ax.plot(result.d, fit.predict(result.d), "-", color=colors[key], lw=1.5, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("dimension d")
    ax.set_ylabel("SGD steps T")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("\n".join(textwrap.wrap(result.title, 80)), fontsize=8.5)
    return fig


def _pad(times: list) -> np.ndarray:
    width = max(t.size for t in times)
    out = np.full((len(times), width), np.nan)
    for i, t in enumerate(times):
        out[i, : t.size] = t
    return out


def write_scaling(path, result: ScalingResult) -> Path:
    """Add (replace) the ``/scaling`` group of the sweep file ``path``, atomically."""
    path = Path(path)
    with hdf5_writer(path, update=True) as f:
        if "scaling" in f:
            del f["scaling"]
        g = f.create_group("scaling")
        g["d"] = result.d.astype(np.int64)
        g["t_level"] = _pad(result.t_level)
        g["t_strong"] = _pad(result.t_strong)
        g["t_level"].attrs["description"] = f"steps to first reach {result.spec.level:g} " \
                                            f"({result.level_source}); NaN = never"
        g["t_strong"].attrs["description"] = (f"{_strong_description(result.spec)}; "
                                              "NaN = never")
        g.attrs["settings"] = json.dumps(result.spec.settings())
        g.attrs["c"] = result.spec.c
        g.attrs["title"] = result.title
        g.attrs["fits"] = json.dumps({k: (v.as_dict() if isinstance(v, PowerLawFit)
                                          else None) for k, v in result.fits.items()})
        g.attrs["table"] = format_table(result)
    return path
