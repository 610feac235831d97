"""Figures of trajectory and sweep files: one curve per cell (or file), median and band.

:func:`load_curves` reads single-run files (:mod:`sims.io.trajectory`) and sweep files
(:mod:`sims.io.sweep`) into :class:`Curve` objects; :func:`plot_curves` draws them: the median
over runs with its 10–90 % band (or every run), the population-ODE prediction dashed and the
noise-corrected (finite-d) ODE dash-dotted where the file has them, colours by ``hue``, one
panel per value of ``facet``. What all curves share goes in the title; what differs goes in
the legend.

Quantities (``QUANTITIES``) come from Trajectory fields or from its ``extra`` arrays:
``singular_values`` (lora, rank r: one curve per index a, marker per a, the matrix ODE
dashed), ``loss_linear`` (linearized; the true loss of the learned weights dotted),
``alignment`` (scratch, scratch-csq, sparse; with ``loss``, the committee-machine ODE
dashed), ``refit_loss`` (finetune ``refit``; the
population-optimal refit dashed, the base network's loss dotted), ``update_overlap`` (lora)
and ``aligned_c_overlap`` = ⟨ĉ, c⟩/(‖ĉ‖‖c‖)·sign⟨û, u⟩ per run and checkpoint (rank 1).

Honest figures (issue 26): runs of different ξ or instance are never pooled
(:func:`split_runs`); theory lines are drawn above the medians in the curve's own colour (white
edged, :func:`theory_color`) and listed in the legend; a curve without one says why, named by
its legend label (:func:`theory_notes`, on the figure and for stderr); from-scratch runs are
drawn against α = steps/d by default (:func:`resolve_x`); linear axes get short tick labels
(:func:`readable_ticks`); facets follow the sweep's axis order; titles wrap at their separators
(:func:`wrap_title`).

Outputs that never mislead (issue 38): on a log y axis values ≤ 0 (a loss at rounding or
integration tolerance near 0) are left out, not clipped into a cliff, and the panel's legend
says how many (:func:`panel_notes`); legends sit outside the axes, right of them, the figure
widened to keep the panels' size (:func:`legend`); titles name every non-default setting
(batch size b, label noise: ``TITLE_DEFAULTS``).
"""

from __future__ import annotations

import textwrap
import warnings
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from dynamics.runtime.trajectory import Trajectory
from sims.io.atomic import atomic_file
from sims.io.sweep import SWEEP_FORMAT, file_format, read_sweep
from sims.io.trajectory import read_trajectory

__all__ = ["Curve", "QUANTITIES", "NEEDS", "THEORY", "X_UNITS", "X_CHOICES", "TITLE_KEYS",
           "load_curves", "split_runs", "plot_curves", "draw_panel", "PanelAxes", "PanelLook",
           "legend", "describe", "wrap_title", "save_figure", "curve_attributes", "quantity_values",
           "aligned_c_overlap", "lacking", "resolve_x", "no_theory_reason", "theory_notes",
           "left_out_notes", "readable_ticks", "compact_formatter", "theory_color",
           "legend_keys", "panel_notes", "legend_notes", "widen_for", "TITLE_DEFAULTS",
           "theory_effects"]

# quantity → (y label, source: a Trajectory attribute, "extra:NAME", or "aligned" (computed))
QUANTITIES = {
    "overlap": ("overlap ⟨û_t, u⟩", "overlap"),
    "abs_overlap": ("overlap |⟨û_t, u⟩|", "overlap"),
    "loss": ("population loss E(f* − f̂)²", "loss"),
    "c_overlap": ("⟨ĉ_t, c⟩ / ‖ĉ_t‖", "c_overlap"),
    "singular_values": ("singular values σ_a(UᵀÛ_t) (cosines of principal angles)",
                        "extra:singular_values"),
    "loss_linear": ("linear-model loss E(f* − f̂_lin)²", "extra:loss_linear"),
    "alignment": ("alignment: mean over teacher rows of |⟨vᵢ, ŵⱼ⟩|", "extra:alignment"),
    "refit_loss": ("refit loss E(f* − aᵀφ)² (second layer refit on 2k features)",
                   "extra:refit_loss"),
    "update_overlap": ("⟨ĈÛᵀ, CUᵀ⟩_F / (‖Ĉ‖‖C‖)", "extra:update_overlap"),
    "aligned_c_overlap": ("⟨ĉ_t, c⟩·sign⟨û_t, u⟩ / (‖ĉ_t‖‖c‖)", "aligned"),
}
# quantity → what a file must hold for it (the missing-data error's hint)
NEEDS = {
    "c_overlap": "needs joint ĉ", "aligned_c_overlap": "needs joint ĉ",
    "singular_values": "needs a lora learner file",
    "update_overlap": "needs a lora learner file",
    "loss_linear": "needs a linearized learner file",
    "alignment": "needs a scratch, scratch-csq or sparse learner file",
    "refit_loss": "needs a finetune run with --refit",
}
# quantity → reference lines: (source, legend key, line style); median over runs, same colour
REFERENCES = {
    "singular_values": (("extra:ode_singular_values", "matrix_ode", "--"),),
    "loss_linear": (("loss", "true_loss", ":"),
                    ("extra:ode_loss_linear", "linear_ode", "--"),
                    ("extra:ode_corrected_loss_linear", "linear_corrected", "-."),
                    ("extra:floor_linear", "linear_floor", (0, (1, 3)))),
    "refit_loss": (("extra:refit_loss_population", "refit_population", "--"),
                   ("extra:base_loss", "base_loss", ":")),
    "loss": (("extra:ode_loss", "committee_ode", "--"),
             ("extra:ode_loss_true", "linear_ode_true", "--"),
             ("extra:ode_corrected_loss_true", "linear_corrected_true", "-."),
             ("extra:floor_true", "linear_floor_true", (0, (1, 3)))),
    "alignment": (("extra:ode_alignment", "committee_ode", "--"),),
    "c_overlap": (("extra:ode_c_overlap", "c_ode", "--"),
                  ("extra:ode_corrected_c_overlap", "c_ode_corrected", "-."),
                  ("extra:ode_finite_xi_c_overlap", "c_finite_xi", ":")),
    "abs_overlap": (("extra:ode_finite_xi", "finite_xi", ":"),),
}
# quantity → the sources of its theory lines (a curve with no finite value in any has none)
THEORY = {
    "overlap": ("ode", "ode_corrected"),
    "abs_overlap": ("ode", "ode_corrected", "extra:ode_finite_xi"),
    "loss": ("extra:ode_loss",), "alignment": ("extra:ode_alignment",),
    "singular_values": ("extra:ode_singular_values",),
    "refit_loss": ("extra:refit_loss_population",),
    "c_overlap": ("extra:ode_c_overlap", "extra:ode_corrected_c_overlap",
                  "extra:ode_finite_xi_c_overlap"),
}
THEORY["loss"] += ("extra:ode_loss_true",)  # linearized: the true loss at its mean Δ
THEORY["loss"] += ("extra:ode_corrected_loss_true",)  # … and its finite-η corrected mean
THEORY["loss_linear"] = ("extra:ode_loss_linear", "extra:ode_corrected_loss_linear",
                         "extra:floor_linear")
# a theory dataset's attributes: why a line is missing (``partial``: for some runs only)
LEFT_OUT = ("no_theory", "corrected", "partial", "not_drawn")
THEORY_ZORDER = 3  # above the medians (Line2D default 2) and bands
REFERENCE_LABELS = {
    "matrix_ode": "matrix ODE (σ_a of its M_t)",
    "true_loss": "true loss of the learned weights",
    "refit_population": "population-optimal refit a = A⁺b",
    "base_loss": "base network f₀",
    "committee_ode": "committee-machine ODE / diffusion",  # which: the curve's note
    "linear_ode": "linear model's mean ODE (L at E Δ)",
    "linear_floor": "linear model's floor min L",
    "linear_ode_true": "true loss at the linear model's mean Δ",
    "linear_floor_true": "true loss at the linear model's floor",
    "linear_corrected": "linear model's finite-η corrected mean loss",
    "linear_corrected_true": "true loss, linear model's finite-η corrected mean",
    "c_ode": "population ODE of fine-tuning (⟨ĉ, c⟩)",
    "c_ode_corrected": "noise-corrected (finite-d) ODE (⟨ĉ, c⟩)",
    "finite_xi": "finite-ξ diffusion (E|⟨û, u⟩|)",
    "c_finite_xi": "finite-ξ diffusion (⟨ĉ, c⟩)",
}
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
SUBSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")
X_UNITS = {"steps": "SGD steps t", "alpha": "α = t / d (SGD steps per input dimension)",
           "steps/d": "SGD steps t / d", "eta*steps": "SGD time η·t (steps × step size)"}
X_CHOICES = ("auto", *X_UNITS)  # auto: α for from-scratch runs, else steps (resolve_x)
TITLE_KEYS = ("activation", "k", "d", "xi", "W", "learner", "eta", "batch", "label_noise",
              "variant")
TITLE_DEFAULTS = {"batch": 1, "label_noise": 0.0}  # named in a title only where not these
SYMBOL = {"activation": "σ", "xi": "ξ", "eta": "η", "u_alpha": "‖Π_W u‖",
          "eta_times_d": "ηd", "instance_seed": "instance", "steps_per_d": "T/d",
          "batch": "b", "label_noise": "label noise σ²"}
BAND = (10, 50, 90)


@dataclass
class Curve:
    """One curve: a trajectory (its runs) and the attributes that name it."""

    traj: Trajectory
    attrs: dict = field(default_factory=dict)
    source: str = ""
    config: dict = field(default_factory=dict)  # the run config (why theory is missing)
    order: dict = field(default_factory=dict)  # sweep axis → its values in the sweep's order


def learner_variant(config: dict, frozen_c: str = ", frozen ĉ") -> str:
    """What sets a run apart within its learner (``Learner.variant``): ``projected, frozen
    ĉ`` (fine-tuning learners), ``free rows, trained λ̂`` (from-scratch learners), ``S²FT``."""
    from dynamics.learners import get_learner

    return get_learner(config.get("learner", "finetune")).variant(config, frozen_c)


def teacher_label(inst: dict) -> str | None:
    """``committee teacher (W gaussian)`` for a committee teacher, else None."""
    if inst.get("teacher", "finetune") != "committee":
        return None
    w = inst.get("W", "gram" if "gram" in inst else "gaussian")
    return f"committee teacher (W {w if isinstance(w, str) else 'explicit'})"


def curve_attributes(config: dict, axes: dict | None = None, source: str = "") -> dict:
    """Displayable attributes of a run config dict (plus sweep axis values and the file)."""
    inst = config.get("instance", {})
    variant = learner_variant(config)
    w = inst.get("W", "gram" if "gram" in inst else "orthonormal")
    committee = teacher_label(inst)
    out = {
        "activation": inst.get("activation"), "k": inst.get("k"), "d": inst.get("d"),
        "xi": None if committee else float(inst.get("xi", 1.0)),
        "W": committee or (w if isinstance(w, str) else "explicit"),
        "learner": config.get("learner", "finetune"), "eta": config.get("eta"),
        "variant": variant, "joint_c": bool(config.get("joint_c", False)),
        "project": bool(config.get("project", True)), "u_alpha": inst.get("u_alpha", 0.0),
        "c": inst.get("c", "quantized"), "c_hat": inst.get("c_hat", "quantized"),
        "runs": config.get("runs"), "seed": config.get("seed"),
        "instance_seed": inst.get("seed", 0), "file": Path(source.split("::")[0]).name,
    }
    if config:  # batch size and label noise (TITLE_DEFAULTS: named where not the default)
        out["batch"] = int(config.get("batch", 1))
        out["label_noise"] = float(config.get("label_noise", 0.0))
    if out["eta"] and out["d"]:
        out["eta_times_d"] = out["eta"] * out["d"]
    for key, val in (axes or {}).items():
        if key in ("case",):
            continue
        out[key] = val
    return out


def split_runs(curve: Curve) -> list[Curve]:
    """One curve per ξ (``xi_values``) and, within a ξ, per instance of ``curve``'s runs, each
    a contiguous block of runs (attributes ``xi``, ``instance_seed`` and ``runs`` set where
    split). Runs that each have an instance of their own (``instance_seeds = per_run``) stay
    one curve per ξ: a median over random instances."""
    traj = curve.traj
    xi = np.asarray(traj.xi, dtype=float).tolist()
    seeds = np.asarray(traj.instance_seed).tolist()
    pairs = list(zip(xi, seeds, strict=True))
    per_run = all(len({s for x, s in pairs if x == v}) == xi.count(v) > 1 for v in set(xi))
    keys = [(x, None if per_run else s) for x, s in pairs]
    groups = list(dict.fromkeys(keys))
    if len(groups) <= 1:
        return [curve]
    from sims.io.split import split_trajectory

    several_xi = len(set(xi)) > 1
    out = []
    for key in groups:
        idx = [r for r, k in enumerate(keys) if k == key]
        attrs = dict(curve.attrs, runs=len(idx))
        if several_xi:
            attrs["xi"] = key[0]
        if len({k[1] for k in groups}) > 1:
            attrs["instance_seed"] = int(key[1])
        if idx[-1] - idx[0] + 1 != len(idx):
            which = ", ".join(_fmt(k, attrs[k]) for k in ("xi", "instance_seed") if k in attrs)
            raise ValueError(f"{curve.source or 'trajectory'}: runs of {which} are not "
                             "contiguous")
        out.append(Curve(split_trajectory(traj, idx[0], len(idx)), attrs, curve.source,
                         curve.config, curve.order))
    return out


def load_curves(paths) -> list[Curve]:
    """Curves from trajectory files and sweep files (one per cell, per ξ and instance
    group of a file: :func:`split_runs`)."""
    curves = []
    for path in paths:
        if file_format(path) == SWEEP_FORMAT:
            meta, cells = read_sweep(path)
            if not cells:
                raise ValueError(f"{path}: the sweep has no finished cell yet")
            for cell in cells:
                src = f"{path}::{cell.name}"
                _with_dataset_attrs(cell.traj, path, f"cells/{cell.name}")
                curves.extend(split_runs(Curve(
                    cell.traj, curve_attributes(cell.config, cell.axes, src), src,
                    cell.config, meta.get("dimensions") or {})))
        else:
            traj, meta = read_trajectory(path)
            _with_dataset_attrs(traj, path, "/")
            attrs = curve_attributes(meta.get("config") or {}, None, str(path))
            curves.extend(split_runs(Curve(traj, attrs, str(path), meta.get("config") or {})))
    return curves


def _with_dataset_attrs(traj: Trajectory, path, group: str) -> None:
    """Add to ``traj.extra_attrs`` the attributes of the theory datasets (``THEORY``) in
    ``group`` of the file (a sweep cell's or the root; the readers keep at most a dataset's
    ``note``): why a theory line is missing (``LEFT_OUT``) is recorded there."""
    import h5py

    from sims.io.trajectory import plain_attrs

    names = {s for sources in THEORY.values() for s in sources}
    with h5py.File(path, "r") as f:
        for name in names:
            where = f"{group.rstrip('/')}/{name.replace('extra:', 'extra/')}"
            attrs = plain_attrs(f[where]) if where in f else {}
            if attrs:
                key = name.removeprefix("extra:")
                traj.extra_attrs[key] = attrs | traj.extra_attrs.get(key, {})


# ---------------------------------------------------------------- formatting
def _fmt(key: str, value) -> str:
    if key == "variant" or (key == "W" and str(value).startswith("committee")):
        return str(value)
    if key in ("joint_c",):
        return "joint ĉ" if value else "frozen ĉ"
    if key == "project":
        return "projected" if value else "unprojected"
    if key == "runs":
        return f"median of {value} runs"
    name = SYMBOL.get(key, key)
    if isinstance(value, float):
        return f"{name} = {value:.3g}"
    return f"{name} = {value}"


def _varying(curves, keys) -> list[str]:
    return [k for k in keys if len({repr(c.attrs.get(k)) for c in curves}) > 1]


def legend_keys(curves) -> list[str]:
    """The attributes that tell ``curves`` apart (named in each curve's legend label)."""
    keys = list(dict.fromkeys([*TITLE_KEYS, *[k for c in curves for k in c.attrs]]))
    skip = {"file", "runs", "variant", "seed", "eta_times_d", "c", "c_hat", "steps_per_d",
            "instance_seeds"}
    varying = [k for k in _varying(curves, keys) if k not in skip]
    for extra in ("variant", "eta_times_d", "c", "c_hat", "seed", "file"):
        if extra in _varying(curves, keys) and not (
                extra == "variant" and {"joint_c", "project"} & set(varying)):
            if extra == "eta_times_d" and "eta" in varying and "d" in varying:
                continue
            varying.append(extra)
    if "eta" in varying and "eta_times_d" in varying:
        varying.remove("eta")
    return varying


def describe(curves) -> str:
    """Title: the attributes every curve shares (instance, learner, η, and the batch size and
    label noise where not the default: ``TITLE_DEFAULTS``)."""
    parts = []
    for key in TITLE_KEYS:
        vals = {repr(c.attrs.get(key)) for c in curves}
        value = curves[0].attrs.get(key)
        if len(vals) == 1 and value is not None and not (
                key in TITLE_DEFAULTS and value == TITLE_DEFAULTS[key]):
            parts.append(_fmt(key, value))
    return ", ".join(parts)


# ---------------------------------------------------------------- drawing
def _source(traj: Trajectory, source: str):
    """A curve's array by plot source (``extra:NAME`` or a field); None where absent or where
    it is a theory line the audit left out of figures (its ``not_drawn`` attribute,
    :func:`dynamics.overlays.audit.not_drawn`)."""
    name = source.removeprefix("extra:")
    if "not_drawn" in getattr(traj, "extra_attrs", {}).get(name, {}):
        return None
    if source.startswith("extra:"):
        return traj.extra.get(name)
    return getattr(traj, source, None)


def aligned_c_overlap(traj: Trajectory, source: str = "") -> np.ndarray | None:
    """(R, C) ⟨ĉ, c⟩/(‖ĉ‖‖c‖)·sign⟨û, u⟩ per run and checkpoint (None without joint ĉ).

    Runs that end at û ≈ −u with ĉ ≈ −c (the same function) count as aligned. Rank 1 only
    (``overlap`` = ⟨û, u⟩); a recorded ``extra["aligned_c_overlap"]`` is used as is.
    """
    if "aligned_c_overlap" in traj.extra:
        return np.asarray(traj.extra["aligned_c_overlap"], dtype=float)
    if traj.c_overlap is None:
        return None
    sv = traj.extra.get("singular_values")
    if sv is not None and np.shape(sv)[-1] > 1:
        raise ValueError(f"quantity 'aligned_c_overlap' is defined for rank 1 only, {source} "
                         f"has rank {np.shape(sv)[-1]} (plot update_overlap instead)")
    return np.asarray(traj.c_overlap, dtype=float) * np.sign(np.asarray(traj.overlap, float))


def _run_mask(curve: Curve):
    ok = ~curve.traj.diverged
    return ok if ok.any() else slice(None)


def quantity_values(curve: Curve, quantity: str) -> np.ndarray | None:
    """The plotted data of ``curve``: (R', C) (``singular_values``: (R', C, r)) over its
    runs that never diverged (all runs if every one did); None if the file lacks it."""
    source = QUANTITIES[quantity][1]
    if source == "aligned":
        data = aligned_c_overlap(curve.traj, curve.attrs.get("file") or curve.source)
    else:
        data = _source(curve.traj, source)
    if data is None:
        return None
    data = np.asarray(data, dtype=float)[_run_mask(curve)]
    return np.abs(data) if quantity == "abs_overlap" else data



def lacking(curves, quantity: str) -> list[Curve]:
    """The curves that do not hold ``quantity``."""
    return [c for c in curves if quantity_values(c, quantity) is None]


def resolve_x(curves, x: str = "auto") -> str:
    """The x unit: ``x`` itself, or for ``auto`` α = steps/d (the committee-machine
    literature's time) where every curve is a from-scratch run (an ``alignment`` record) with
    a known d, else steps."""
    if x not in X_CHOICES:
        raise ValueError(f"unknown x {x!r}; valid: {', '.join(X_CHOICES)}")
    if x != "auto":
        return x
    scratch = bool(curves) and all("alignment" in c.traj.extra and c.attrs.get("d")
                                   for c in curves)
    return "alpha" if scratch else "steps"


def _x(curve: Curve, x: str) -> np.ndarray:
    steps = np.asarray(curve.traj.steps, dtype=float)
    if x in ("steps/d", "alpha"):
        if not curve.attrs.get("d"):
            raise ValueError(f"x axis {x}: the dimension d of {curve.source or 'the run'} is "
                             "unknown (plot against steps)")
        return steps / float(curve.attrs["d"])
    if x == "eta*steps":
        return steps * float(curve.attrs.get("eta") or 1)
    return steps


def _nanpct(data, q):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanpercentile(data, q, axis=0)


def _palette(curves, hue):
    import matplotlib as mpl

    if hue is None:
        cmap = mpl.colormaps["tab10"]
        return [cmap(i % 10) for i in range(len(curves))]
    values = [c.attrs.get(hue) for c in curves]
    uniq = list(dict.fromkeys(repr(v) for v in values))
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numeric and len(uniq) > 1:
        order = sorted({v for v in values})
        cmap = mpl.colormaps["viridis"]
        pos = {repr(v): i / max(len(order) - 1, 1) * 0.9 for i, v in enumerate(order)}
        return [cmap(pos[repr(v)]) for v in values]
    cmap = mpl.colormaps["tab10"]
    return [cmap(uniq.index(repr(v)) % 10) for v in values]


def theory_color(color):
    """The colour of a curve's theory lines: the curve's own (a theory line is told from its
    median by its line style and the white edge of :func:`theory_effects`, which keeps it
    visible where it lies on the median)."""
    from matplotlib.colors import to_rgba

    return to_rgba(color)


def theory_effects(lw: float = 1.4) -> list:
    """Path effects of a theory line: a white edge under the (dashed) line, so that a theory
    line in its curve's colour stays visible on top of that curve's median."""
    import matplotlib.patheffects as pe

    return [pe.Stroke(linewidth=lw + 1.6, foreground="white", alpha=0.9), pe.Normal()]


@dataclass
class _Panel:
    """What one :func:`draw_panel` call needs to know while drawing: whether y is a log axis,
    and the values ≤ 0 it left out there (what → checkpoints), per curve label."""

    log: bool = False
    masked: dict = field(default_factory=dict)

    def positive(self, values, what: str):
        """``values`` with those ≤ 0 set to NaN on a log axis (counted under ``what``)."""
        values = np.asarray(values, dtype=float)
        if not self.log:
            return values
        bad = np.isfinite(values) & (values <= 0)
        if bad.any():
            self.count(what, int(bad.sum()))
            values = np.where(bad, np.nan, values)
        return values

    def count(self, what: str, n: int) -> None:
        """``n`` more values ≤ 0 of ``what`` left out."""
        if n:
            self.masked[what] = self.masked.get(what, 0) + n


@dataclass(frozen=True)
class PanelAxes:
    """A panel's axes: x in ``X_UNITS`` (or ``auto``: :func:`resolve_x`), the x and y scales
    (log or linear) and the x range (None: matplotlib's)."""

    x: str = "steps"
    xscale: str = "log"
    yscale: str = "linear"
    xlim: tuple[float, float] | None = None


@dataclass(frozen=True)
class PanelLook:
    """How a panel's curves look and are named: colours by ``hue`` (or ``colors``: curve id →
    colour), the median with its band or every run (``style``: band or runs), the attributes
    named in each legend label (``label_keys``; None: those that vary) after ``prefix``, and
    the line style ``ls``."""

    hue: str | None = None
    style: str = "band"
    label_keys: list[str] | None = None
    colors: dict | None = None
    prefix: str = ""
    ls: str = "-"


@dataclass(frozen=True)
class _CurveLook:
    """One curve's lines: colour, legend label, band or runs, line style; ``what``: the
    curve's name in the notes on values left out on a log axis ("" where unnamed)."""

    color: object
    label: str
    style: str = "band"
    ls: str = "-"
    what: str = ""


def _median_line(ax, xs, rows, keep, color, quantity, panel=None, what="theory line",
                 **style) -> bool:
    """Median over runs of a theory array (R, C) where it has finite values, drawn above the
    medians in the curve's colour, white edged (:func:`theory_effects`)."""
    if rows is None:
        return False
    data = np.asarray(rows, dtype=float)[:, keep]
    if not np.isfinite(data).any():
        return False
    med = _nanpct(np.abs(data) if quantity == "abs_overlap" else data, 50)
    if panel is not None:
        med = panel.positive(med, what)
    ax.plot(xs, med, color=theory_color(color), zorder=THEORY_ZORDER,
            path_effects=theory_effects(style.get("lw", 1.4)), **style)
    return True


def _band_median(ax, xs, data, line: _CurveLook, panel: _Panel, **marks):
    """Median over runs of ``data`` (R, C) with its 10–90 % band (or every run); on a log
    axis (``panel``) without its values ≤ 0."""
    color, what = line.color, line.what
    lo, med, hi = _nanpct(data, BAND)
    if line.style == "runs":
        for run in data:
            ax.plot(xs, panel.positive(run, f"single runs{what}"), color=color, lw=0.7,
                    alpha=0.45, ls=line.ls)
    else:
        where = ~(panel.log & ((lo <= 0) | (hi <= 0)))
        panel.count(f"10–90 % band{what}", int((~where).sum()))
        ax.fill_between(xs, lo, hi, where=where, color=color, alpha=0.2, lw=0)
    ax.plot(xs, panel.positive(med, f"median{what}"), color=color, lw=2, label=line.label,
            ls=line.ls, **marks)


def _references(ax, curve, xs, keep, line: _CurveLook, quantity, panel: _Panel, index=None,
                **marks) -> set:
    """The quantity's reference lines (median over the plotted runs), dashed or dotted."""
    drawn = set()
    for source, key, ls in REFERENCES.get(quantity, ()):
        rows = _source(curve.traj, source)
        if rows is None:
            continue
        rows = np.asarray(rows, dtype=float)[_run_mask(curve)]
        if rows.ndim == 1:  # one value per run (base_loss): a horizontal line
            rows = np.repeat(rows[:, None], keep.size, axis=1)
        rows = rows[:, keep] if index is None else rows[:, keep, index]
        if _median_line(ax, xs, rows, slice(None), line.color, quantity, panel,
                        f"{REFERENCE_LABELS[key]}{line.what}", lw=1.4, ls=ls, **marks):
            drawn.add(key)
    return drawn


def _draw_singular_values(ax, curve, data, xs, keep, line: _CurveLook, panel: _Panel) -> set:
    """One median (and band) per singular value σ_a, a = 1..r, marker per index."""
    theory = set()
    every = max(1, xs.size // 8)
    for a in range(data.shape[-1]):
        name = "σ" + str(a + 1).translate(SUBSCRIPT)
        lab = name if line.label == "_nolegend_" else f"{name}: {line.label}"
        marks = {"marker": MARKERS[a % len(MARKERS)], "markevery": every, "markersize": 5}
        _band_median(ax, xs, data[:, keep, a], replace(line, label=lab), panel, **marks)
        theory |= _references(ax, curve, xs, keep, line, "singular_values", panel, a,
                              markerfacecolor="none", **marks)
    return theory


def _draw(ax, curve, line: _CurveLook, quantity, axes: PanelAxes, panel: _Panel) -> set | None:
    """One curve on ``ax`` (``axes.x`` resolved): None if it lacks the quantity, else the
    theory lines drawn."""
    data = quantity_values(curve, quantity)
    if data is None:
        return None
    color = line.color
    xs = _x(curve, axes.x)
    keep = xs > 0 if axes.xscale == "log" else np.ones_like(xs, dtype=bool)
    xs = xs[keep]
    if quantity == "singular_values":
        return _draw_singular_values(ax, curve, data, xs, keep, line, panel)
    _band_median(ax, xs, data[:, keep], line, panel)
    theory = _references(ax, curve, xs, keep, line, quantity, panel)
    what = line.what
    if quantity in ("overlap", "abs_overlap"):
        t = curve.traj
        if _median_line(ax, xs, _source(t, "ode"), keep, color, quantity, panel,
                        f"population ODE{what}", lw=1.4, ls="--"):
            theory.add("ode")
        if _median_line(ax, xs, _source(t, "ode_corrected"), keep, color, quantity,
                        panel, f"corrected ODE{what}", lw=1.2, ls="-."):
            theory.add("corrected")
        if quantity == "overlap" and _theory_band(ax, xs, getattr(t, "band_lower", None),
                                                  getattr(t, "band_upper", None), keep, color):
            theory.add("band")
    if quantity == "c_overlap" and _theory_band(
            ax, xs, _source(curve.traj, "extra:band_c_lower"),
            _source(curve.traj, "extra:band_c_upper"), keep, color):
        theory.add("band")
    return theory


def _theory_band(ax, xs, lo, hi, keep, color) -> bool:
    """Hatched 10–90% linear-noise theory band (median over runs of its edges), if recorded."""
    if lo is None or hi is None:
        return False
    lo, hi = np.asarray(lo, dtype=float)[:, keep], np.asarray(hi, dtype=float)[:, keep]
    if not np.isfinite(lo).any():
        return False
    ax.fill_between(xs, _nanpct(lo, 50), _nanpct(hi, 50), facecolor="none",
                    edgecolor=theory_color(color), hatch="///", lw=0.0, alpha=0.6)
    return True


# Axes → [(key, note)]: what draw_panel learnt that the panel's legend must say (values ≤ 0
# left out on a log axis, why a curve has no theory line); legend() adds the notes whose key
# is not already in its own notes. Weak keys: a closed figure's axes go with it.
_PANEL_NOTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def panel_notes(ax) -> list[str]:
    """The notes :func:`draw_panel` recorded for ``ax`` (values ≤ 0 left out on a log axis,
    missing theory lines, named by their curves), in the order recorded."""
    return [note for _, note in _PANEL_NOTES.get(ax, [])]


def _add_panel_note(ax, key: str, note: str) -> None:
    notes = _PANEL_NOTES.setdefault(ax, [])
    if all(k != key for k, _ in notes):
        notes.append((key, note))


def _masked_note(quantity: str, masked: dict) -> str:
    """One line: how many values ≤ 0 each drawn line left out on the log axis."""
    parts = [f"{what} at {n} checkpoint{'s' if n > 1 else ''}" for what, n in masked.items()]
    name = "loss" if "loss" in quantity else quantity
    return (f"{name} ≤ 0 (rounding or integration tolerance near 0) not drawn on the log "
            f"axis: {'; '.join(parts)}")


def draw_panel(ax, curves, *, quantity="overlap", axes: PanelAxes = PanelAxes(),
               look: PanelLook = PanelLook()) -> tuple[int, set]:
    """Draw ``curves`` on one Axes; (number of curves drawn, theory lines drawn: a subset of
    {"ode", "corrected", "band"} and the ``REFERENCE_LABELS`` keys)."""
    axes = replace(axes, x=resolve_x(curves, axes.x))
    colors = look.colors or dict(zip(map(id, curves), _palette(curves, look.hue), strict=True))
    keys = legend_keys(curves) if look.label_keys is None else look.label_keys
    drawn, theory = 0, set()
    panel = _Panel(log=axes.yscale == "log")
    for c in curves:
        label = look.prefix + ", ".join(_fmt(k, c.attrs.get(k)) for k in keys)
        label = label.rstrip(": ") or "_nolegend_"
        named = len(curves) > 1 and label != "_nolegend_"  # left-out values named by label
        line = _CurveLook(colors[id(c)], label, look.style, look.ls,
                          f" of “{label}”" if named else "")
        lines = _draw(ax, c, line, quantity, axes, panel)
        if lines is not None:
            drawn += 1
            theory |= lines
    if panel.masked:
        note = _masked_note(quantity, panel.masked)
        _add_panel_note(ax, note, note)
    for reason, note in _missing_theory(curves, quantity, keys):
        _add_panel_note(ax, reason, note)
    ax.set_xscale(axes.xscale)
    if axes.yscale == "log":
        ax.set_yscale("log", nonpositive="mask")  # never a cliff down to the axis' floor
    else:
        ax.set_yscale(axes.yscale)
    if axes.xlim is not None:
        ax.set_xlim(*axes.xlim)
    readable_ticks(ax)
    ax.grid(alpha=0.3)
    ax.set_xlabel(X_UNITS[axes.x])
    ax.set_ylabel(QUANTITIES[quantity][0])
    return drawn, theory


def compact_formatter():
    """A matplotlib tick Formatter whose labels have at most about six characters: 0, 50k,
    125k, 1.5M, 0.25, 2.5e-4 (one suffix for all ticks of an axis, as many decimals as the
    ticks need). Built on call: matplotlib is imported only when a figure is drawn."""
    from matplotlib.ticker import Formatter

    class CompactFormatter(Formatter):
        scale, suffix, digits = 1.0, "", 0

        def set_locs(self, locs):
            super().set_locs(locs)
            finite = [float(v) for v in locs if np.isfinite(v)]
            top = max(map(abs, finite), default=0.0)
            self.scale, self.suffix = 1.0, ""
            for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
                if top >= scale:
                    self.scale, self.suffix = scale, suffix
                    break
            else:
                if 0 < top < 1e-2:
                    exp = int(np.floor(np.log10(top)))
                    self.scale, self.suffix = 10.0 ** exp, f"e{exp}"
            scaled = [v / self.scale for v in finite]
            self.digits = next((n for n in range(7) if all(
                abs(round(v, n) - v) < 1e-9 * max(1.0, abs(v)) for v in scaled)), 6)

        def __call__(self, value, pos=None):
            text = f"{value / self.scale:.{self.digits}f}"
            return "0" if float(text) == 0 else text + self.suffix

    return CompactFormatter()


def readable_ticks(ax, nbins: int = 6) -> None:
    """At most ``nbins`` + 1 round ticks with :func:`compact_formatter` labels on each linear
    axis of ``ax`` (large step counts would otherwise run into each other); on a log axis,
    minor labels only at 2 and 5 × 10ⁿ, plain and short, where it spans under 1.5 decades
    (matplotlib labels 2, 3, 4, 6 × 10ⁿ in scientific notation, which overlap)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale == "linear":
            axis.set_major_locator(MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10]))
            axis.set_major_formatter(compact_formatter())
        elif scale == "log":
            axis.set_minor_formatter(FuncFormatter(
                lambda value, _pos, axis=axis: _log_minor_label(axis, value)))


def _log_minor_label(axis, value: float) -> str:
    lo, hi = sorted(axis.get_view_interval())
    if value <= 0 or lo <= 0 or np.log10(hi / lo) > 1.5:
        return ""
    mantissa = value / 10.0 ** np.floor(np.log10(value) + 1e-9)
    if not any(abs(mantissa - m) < 1e-6 for m in (2, 5)):
        return ""
    return compact_formatter().format_ticks([value])[0]


def _recorded_reason(traj: Trajectory, sources) -> str | None:
    """Why the file says a theory array is missing (a ``no_theory``, ``note`` or ``reason``
    attribute of its dataset), if it says."""
    for source in sources:
        attrs = getattr(traj, "extra_attrs", {}).get(source.removeprefix("extra:"), {})
        for key in ("no_theory", "note", "reason"):
            if attrs.get(key):
                return str(attrs[key])
    return None


def _has_theory(curve: Curve, quantity: str) -> bool:
    for source in THEORY.get(quantity, ()):
        rows = _source(curve.traj, source)
        if rows is not None and np.isfinite(np.asarray(rows, dtype=float)).any():
            return True
    return False


def no_theory_reason(curve: Curve, quantity: str = "overlap") -> str | None:
    """Why ``curve`` has no theory line of ``quantity`` (None where it has one): what its
    file records, else what its run config (``curve.config``; without one, the trajectory)
    shows: an App. B convention, joint ĉ, an unprojected or linearized learner, …"""
    if _has_theory(curve, quantity):
        return None
    traj, cfg = curve.traj, curve.config or {}
    sources = THEORY.get(quantity, ())
    recorded = _recorded_reason(traj, sources)
    if recorded:
        return recorded
    if not sources:
        return f"loradyn has no theory of {quantity}"
    learner = cfg.get("learner") or curve.attrs.get("learner")
    inst = cfg.get("instance") or {}
    if "alignment" in traj.extra:  # from-scratch learners: the committee ODE
        if quantity not in ("loss", "alignment"):
            return "a from-scratch run's theory is the committee ODE of its loss and alignment"
        if cfg.get("finite_d_theory") is False:
            return "run with --no-finite-d-theory: the committee ODE was not recorded"
        if any(_source(traj, source) is not None for source in sources):
            return "the committee ODE failed from every run's initial state (NaN)"
        return "the file records no committee ODE"
    if quantity == "loss":
        return f"no theory of the loss is recorded for the {learner or 'fine-tuning'} learner"
    regime = ([f"App. B convention {inst['convention']}"]
              if inst.get("convention", "unit") != "unit" else [])
    regime += ["joint ĉ"] if cfg.get("joint_c", traj.c_overlap is not None) else []
    regime += ["unprojected û"] if cfg.get("project") is False else []
    if regime:
        return (f"{', '.join(regime)}: the file records no population ODE (it predates "
                "hermite.finetune.population; a run made now records it)")
    if learner and not _has_population_ode(learner):
        return f"the {learner} learner has no population ODE"
    if traj.diverged.all():
        return "every run diverged"
    return "the file records no finite theory value (the ODE was not recorded or failed)"


def _has_population_ode(learner: str) -> bool:
    """``Learner.has_population_ode`` (True for a name loradyn does not know)."""
    from dynamics.learners import get_learner

    try:
        return get_learner(learner).has_population_ode
    except ValueError:
        return True


def _drawn_theory_notes(curves, quantity: str) -> list[str]:
    """``theory line: NOTE`` for every drawn theory curve whose dataset says what it is and
    what it leaves out (a ``note`` attribute: the plain O(η) ODE of fine-tuning, a
    first-order committee ODE, the linearized model's mean-drift ODE), once each."""
    out = []
    for c in curves:
        for source in THEORY.get(quantity, ()):
            name = source.removeprefix("extra:")
            note = c.traj.extra_attrs.get(name, {}).get("note")
            values = _source(c.traj, source)
            drawn = values is not None and np.isfinite(np.asarray(values, dtype=float)).any()
            if note and drawn and f"theory line: {note}" not in out:
                out.append(f"theory line: {note}")
    return out


def _names(members, keys) -> str:
    """The legend labels of ``members`` (by ``keys``), ``; ``-separated."""
    return "; ".join(", ".join(_fmt(k, c.attrs.get(k)) for k in keys) for c in members)


def _left_out(curves, quantity: str, keys) -> list[tuple[str, str]]:
    """[(reason, note)] of :func:`left_out_notes`."""
    fields = LEFT_OUT + (("band",) if quantity in ("overlap", "c_overlap") else ())
    by_reason: dict[str, list[Curve]] = {}
    for c in curves:
        for source in THEORY.get(quantity, ()):
            attrs = getattr(c.traj, "extra_attrs", {}).get(source.removeprefix("extra:"), {})
            for key in fields:
                why = attrs.get(key)
                members = by_reason.setdefault(str(why), []) if why else None
                if why and not any(c is m for m in members):  # identity: a Curve's arrays
                    members.append(c)  # make == ambiguous
    out = []
    for why, members in by_reason.items():
        names = _names(members, keys)
        whole = len(members) == len(curves) or not names.strip("; ")
        out.append((why, why if whole else f"for {names}: {why}"))
    return out


def left_out_notes(curves, quantity: str = "overlap", label_keys=None) -> list[str]:
    """Why a theory line of ``quantity`` is missing where its file says so, once each: the
    ``LEFT_OUT`` attributes of the quantity's theory datasets (a line over its cost budget,
    one whose integration failed: dynamics.overlays.finetune.finetune_theory, the committee ODE
    failed from some or all starts: dynamics.overlays.committee); ``band`` only where the
    quantity draws a band. A reason that holds for only some of ``curves`` names them
    (``for A; B: REASON``, by ``label_keys``, default: the attributes that vary)."""
    keys = legend_keys(curves) if label_keys is None else label_keys
    have = [c for c in curves if quantity_values(c, quantity) is not None]
    return [note for _, note in _left_out(have, quantity, keys)]


def _missing_theory(curves, quantity: str, keys) -> list[tuple[str, str]]:
    """[(reason, note)]: why curves holding ``quantity`` lack a theory line (:func:`theory_notes`
    without the drawn lines' notes)."""
    have = [c for c in curves if quantity_values(c, quantity) is not None]
    by_reason: dict[str, list[Curve]] = {}
    for c in have:
        reason = no_theory_reason(c, quantity)
        if reason:
            by_reason.setdefault(reason, []).append(c)
    out = []
    for reason, members in by_reason.items():
        names = _names(members, keys)
        if len(members) == len(have) or not names.strip("; "):
            out.append((reason, f"no theory line: {reason}"))
        else:
            out.append((reason, f"no theory line for {names}: {reason}"))
    said = " ".join(note for _, note in out)
    return out + [(why, note) for why, note in _left_out(have, quantity, keys)
                  if why not in said]


def theory_notes(curves, quantity: str = "overlap", label_keys=None) -> list[str]:
    """One line per reason why curves holding ``quantity`` have no theory line:
    ``no theory line: REASON``, or ``no theory line for A; B: REASON`` where only some
    curves (named by ``label_keys``, default: the attributes that vary) lack one; then the
    lines their files left out (:func:`left_out_notes`, named the same way); then what
    each drawn theory line leaves out, where its file says so (:func:`_drawn_theory_notes`)."""
    keys = legend_keys(curves) if label_keys is None else label_keys
    have = [c for c in curves if quantity_values(c, quantity) is not None]
    return ([note for _, note in _missing_theory(curves, quantity, keys)]
            + _drawn_theory_notes(have, quantity))


def legend_notes(ax, notes=()) -> list[str]:
    """``notes`` and then each note :func:`draw_panel` recorded for ``ax``
    (:func:`panel_notes`) whose reason none of them already gives: what ``ax``'s legend
    lists (and a command prints on stderr)."""
    out = list(notes)
    for key, note in _PANEL_NOTES.get(ax, []):
        if not any(key in n for n in out):
            out.append(note)
    return out


def legend(ax, handles=None, style="band", theory=(), notes=(), outside: bool = True,
           **kwargs):
    """Legend of the curves plus what the line styles mean (median/band, theory lines in the
    curve's colour, white edged, drawn above the medians) and ``notes``
    (:func:`theory_notes`) and the panel's own notes (:func:`legend_notes`: values ≤ 0 left
    out on a log axis, missing theory lines) as entries without a line.

    ``outside`` (default): right of the axes, off the data, the figure widened by the
    legend's width so that the panels keep their size (``loc``/``bbox_to_anchor`` given:
    where they say)."""
    from matplotlib.lines import Line2D

    if handles is None:
        handles = ax.get_legend_handles_labels()[0]
    band = "every run (thin)" if style == "runs" else "10–90 % of runs (band)"
    extra = [Line2D([], [], color="grey", lw=2, label=f"median; {band}")]
    dark = theory_color("dimgrey")
    halo = {"path_effects": theory_effects()}
    if "ode" in theory:
        extra.append(Line2D([], [], color=dark, lw=1.4, ls="--", label="population ODE",
                            **halo))
    if "corrected" in theory:
        extra.append(Line2D([], [], color=dark, lw=1.2, ls="-.",
                            label="noise-corrected (finite-d) ODE", **halo))
    if "band" in theory:
        from matplotlib.patches import Patch

        extra.append(Patch(facecolor="none", edgecolor=dark, hatch="///",
                           label="theory band 10–90 % (linear noise)"))
    for key, text in REFERENCE_LABELS.items():
        if key in theory:
            ls = next(r[2] for refs in REFERENCES.values() for r in refs if r[1] == key)
            extra.append(Line2D([], [], color=dark, lw=1.4, ls=ls, label=f"{text} (median)",
                                **halo))
    extra += [Line2D([], [], ls="none", label=textwrap.fill(note, 48))
              for note in legend_notes(ax, notes)]
    kwargs.setdefault("fontsize", 7.5)
    if outside and "loc" not in kwargs and "bbox_to_anchor" not in kwargs:
        kwargs.update(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
        leg = ax.legend(handles=list(handles) + extra, **kwargs)
        widen_for(ax.figure, leg)
        return leg
    kwargs.setdefault("loc", "best")
    return ax.legend(handles=list(handles) + extra, **kwargs)


def widen_for(fig, artist, pad_in: float = 0.15) -> None:
    """Widen ``fig`` by the width of ``artist`` (a legend placed outside its axes), so that
    constrained layout makes room for it without shrinking the panels."""
    renderer = fig.canvas.get_renderer()
    width = artist.get_window_extent(renderer).width / fig.dpi
    w, h = fig.get_size_inches()
    fig.set_size_inches(w + width + pad_in, h)


def _pieces(text: str, depth_at: int = 0) -> list[str]:
    """``text`` cut after each ", " or "; " at parenthesis depth ``depth_at`` (the comma or
    semicolon stays with the piece before it, the space goes)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if depth == depth_at and ch in ",;" and text[i + 1:i + 2] == " ":
            out.append(text[start:i + 1])
            start = i + 2
    out.append(text[start:])
    return [p for p in out if p]


def _atoms(text: str, chars: int) -> list[str]:
    """Pieces of ``text`` of at most ``chars`` characters where possible: cut at its
    top-level separators; a longer piece before its parenthesised group, then at the
    separators inside the group, then at spaces."""
    out = []
    for piece in _pieces(text):
        if len(piece) <= chars:
            out.append(piece)
        elif (cut := piece.find(" (")) > 0:
            out += _atoms(piece[:cut], chars) + _atoms(piece[cut + 1:], chars)
        else:
            inner = _pieces(piece, 1)
            out += [w for p in inner for w in (textwrap.wrap(p, chars) if len(p) > chars
                                               else [p])]
    return out


def wrap_title(text: str, width_in: float, fontsize: float = 10) -> str:
    """Wrap a title to the figure width (about 0.55 em per character) at its separators
    (", ", "; "), never inside a parenthesised group that fits on a line."""
    chars = max(20, int(width_in * 72 / (0.55 * fontsize)))
    lines: list[str] = []
    for atom in _atoms(text, chars):
        if lines and len(lines[-1]) + 1 + len(atom) <= chars:
            lines[-1] += " " + atom
        else:
            lines.append(atom)
    return "\n".join(lines)


def plot_curves(curves: list[Curve], quantity: str = "overlap", x: str = "auto",
                xscale: str = "log", yscale: str = "linear", hue: str | None = None,
                facet: str | None = None, style: str = "band", title: str | None = None,
                xlim=None):
    """The matplotlib Figure of ``curves`` (see the module docstring); nothing is saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not curves:
        raise ValueError("nothing to plot: no curves")
    x = resolve_x(curves, x)
    _check_options(curves, quantity, xscale, hue, facet, style)
    groups = _facets(curves, facet)
    ncols = min(len(groups), 3)
    nrows = -(-len(groups) // ncols)
    width = 5.2 * ncols + 0.6
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 3.9 * nrows + 0.6),
                             squeeze=False, sharey=True, constrained_layout=True)
    colors = dict(zip(map(id, curves), _palette(curves, hue), strict=True))
    label_keys = legend_keys(curves)
    if hue and hue not in label_keys:
        label_keys = [hue, *label_keys]
    if facet in label_keys:
        label_keys.remove(facet)
    theory, drawn = set(), 0
    for ax, (fval, members) in zip(axes.flat, groups, strict=False):
        n, lines = draw_panel(ax, members, quantity=quantity,
                              axes=PanelAxes(x, xscale, yscale, xlim),
                              look=PanelLook(style=style, label_keys=label_keys, colors=colors))
        drawn, theory = drawn + n, theory | lines
        if not n:
            ax.text(0.5, 0.5, f"no {quantity} here", transform=ax.transAxes, ha="center",
                    va="center", color="grey")
        if facet is not None:
            ax.set_title(_fmt(facet, fval), fontsize=10)
        if ax not in axes[:, 0]:
            ax.set_ylabel("")
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    if not drawn:
        files = ", ".join(dict.fromkeys(c.attrs.get("file") or c.source for c in curves))
        raise ValueError(f"no curve has the quantity '{quantity}' "
                         f"({NEEDS.get(quantity, 'not recorded')}): {files}")
    notes = theory_notes(curves, quantity, label_keys)
    for ax in axes.flat:  # values ≤ 0 left out on a log axis, in any panel
        notes = legend_notes(ax, notes)
    legend(axes.flat[0], _all_handles(axes)[0], style=style, theory=theory, notes=notes)
    fig.suptitle(wrap_title(title if title is not None else describe(curves), width),
                 fontsize=10)
    return fig


def _all_handles(axes):
    seen, handles = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in seen:
                seen[lab] = h
                handles.append(h)
    return handles, list(seen)


def _facets(curves, facet):
    """(value, curves) per value of ``facet``: in the sweep's axis order where ``facet`` is a
    sweep axis (values no sweep names last, as they come), else sorted."""
    if facet is None:
        return [(None, curves)]
    groups: dict[str, tuple] = {}
    for c in curves:
        v = c.attrs.get(facet)
        groups.setdefault(repr(v), (v, []))[1].append(c)
    items = list(groups.values())
    rank: dict[str, int] = {}
    for c in curves:
        for v in c.order.get(facet, ()):
            rank.setdefault(repr(v), len(rank))
    if rank:
        items.sort(key=lambda item: rank.get(repr(item[0]), len(rank)))
        return items
    try:
        items.sort(key=lambda item: item[0])
    except TypeError:
        pass
    return items


def _check_options(curves, quantity, xscale, hue, facet, style):
    if quantity not in QUANTITIES:
        raise ValueError(f"unknown quantity {quantity!r}; valid: {', '.join(QUANTITIES)}")
    if xscale not in ("log", "linear"):
        raise ValueError(f"xscale must be log or linear, got {xscale!r}")
    if style not in ("band", "runs"):
        raise ValueError(f"style must be band or runs, got {style!r}")
    known = sorted({k for c in curves for k in c.attrs})
    for opt, name in (("--hue", hue), ("--facet", facet)):
        if name is not None and name not in known:
            raise ValueError(f"unknown {opt} axis {name!r}; available: {', '.join(known)}")


def save_figure(fig, path, dpi: int = 130) -> Path:
    """Save by extension (.png, .pdf, .svg), atomically (:func:`sims.io.atomic.atomic_file`:
    an OS error is one line naming ``path``, an earlier file kept), and close the figure."""
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise ValueError(f"--out {path}: the extension must be .png, .pdf or .svg")
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format=path.suffix.lower()[1:])
    finally:
        plt.close(fig)
    return path
