"""Theory audit (issue 40, item 2): each recorded theory line against the SGD mean of the
same runs, from the same starts.

For a theory line θ and the SGD quantity x it predicts (:data:`LINES`), over the runs r
where both are finite at every checkpoint (``runs`` of R; a diverged run, or one whose line
was left out or failed, is not used; a checkpoint where no run has x, such as ``lora-ba``'s
overlap at B₀ = 0, is not audited), per checkpoint c:

    D_rc = x_rc − θ_rc,   D̄_c = mean_r D_rc,   SE_c = sd_r(D_rc) / √runs   (sd with ddof 1)

Overlap lines of ⟨û, u⟩ compare |x| − |θ|, as the figures draw them (``abs_overlap``: a run
that ends at −u counts as aligned); the other lines compare signed values, as plotted.
Reported:

- ``max_abs`` = max_c |D̄_c| (the quantity's units) and ``at_step``, its checkpoint step;
- ``max_se`` = max_c |D̄_c| / max(SE_c, ε), ε = 1e-12 (SE_c = 0: the runs' differences are
  all equal; a difference at round-off level then counts as none);
- ``passage_ratio`` (scalar overlap-type lines) = median over runs of t½(x_r) / t½(θ_r),
  t½ the first checkpoint step with |·| ≥ ½; runs where either never passes, or the theory
  passes at step 0, are left out; NaN where no run is left;
- ``passed``: |D̄_c| ≤ max(4 SE_c, f_c) at every checkpoint, f_c = 0.03 for overlap lines,
  0.03·|mean_r x_rc| for loss lines (SE undefined with one run: f_c alone); ``fail_step``,
  the first checkpoint step where it does not hold (−1 if none).

The writers store an audit as attributes of the theory dataset (:meth:`Audit.attrs`,
``docs/hdf5-schema.md``); :meth:`Audit.text` is the line ``loradyn run`` prints.

Lines not drawn (:func:`not_drawn`): where several theory lines predict the same SGD quantity
of the same runs and at least one of them is within tolerance, each one outside it (audited on
at least ``MIN_RUNS`` runs) gets the attribute ``not_drawn`` saying so and naming the lines to
read; its values stay in the file and its audit in the tables, the figures leave it out and
their legend says why (issue 40: every line drawn is within tolerance, no curve loses its
last line).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["Line", "LINES", "NOT_AUDITED", "Audit", "ATTRS", "SE_TOLERANCE", "FLOOR",
           "LEVEL", "EPS", "fmt_value", "array_of", "paired_difference", "tolerance",
           "passage_steps", "passage_ratio", "audit_line", "audit_trajectory",
           "stored_audits", "not_drawn", "mark_not_drawn", "MIN_RUNS"]

SE_TOLERANCE = 4.0  # |D̄| within this many paired standard errors …
FLOOR = 0.03  # … or within this floor (overlaps: absolute; losses: relative to the SGD mean)
LEVEL = 0.5  # the first-passage level of the passage ratio
EPS = 1e-12  # the smallest SE divided by (the guard of |D̄|/SE)
MIN_RUNS = 4  # a line is left out of a figure only on an audit of at least this many runs
# (fewer: an SE from under 3 degrees of freedom)


class Line(NamedTuple):
    """What a theory line predicts: the SGD dataset ``against``, its ``kind`` (``overlap``
    or ``loss``: the tolerance floor and the passage ratio) and whether the comparison is of
    absolute values (``absolute``)."""

    against: str
    kind: str
    absolute: bool = False


# theory dataset (HDF5 path) → what it predicts; the pairs of the plots' quantities
# (sims.plots.curves.THEORY / QUANTITIES; tests/test_theory_audit.py keeps the two in step)
LINES = {
    "ode": Line("overlap", "overlap", absolute=True),
    "ode_corrected": Line("overlap", "overlap", absolute=True),
    "extra/ode_c_overlap": Line("c_overlap", "overlap"),
    "extra/ode_corrected_c_overlap": Line("c_overlap", "overlap"),
    "extra/ode_finite_xi": Line("overlap", "overlap", absolute=True),
    "extra/ode_finite_xi_c_overlap": Line("c_overlap", "overlap"),
    "extra/ode_alignment": Line("extra/alignment", "overlap"),
    "extra/ode_singular_values": Line("extra/singular_values", "overlap"),
    "extra/ode_loss": Line("loss", "loss"),
    "extra/ode_loss_true": Line("loss", "loss"),
    "extra/ode_loss_linear": Line("extra/loss_linear", "loss"),
    "extra/ode_corrected_loss_true": Line("loss", "loss"),
    "extra/ode_corrected_loss_linear": Line("extra/loss_linear", "loss"),
}
# the plots' theory sources that are not a prediction from the run's start
NOT_AUDITED = {
    "extra/refit_loss_population": "the population refit at the run's own û_t, not a "
                                   "prediction from its start",
    "extra/floor_linear": "a constant floor min L, not a trajectory",
}
ATTRS = ("audit_against", "audit_abs", "audit_kind", "audit_runs", "audit_max_abs",
         "audit_max_se", "audit_at_step", "audit_passage_ratio", "audit_pass",
         "audit_fail_step")


@dataclass(frozen=True)
class Audit:
    """The audit of one theory line (module docstring); ``total``: the runs R of the file."""

    line: str
    against: str
    kind: str
    absolute: bool
    runs: int
    total: int
    max_abs: float
    max_se: float
    at_step: int
    passage_ratio: float
    passed: bool
    fail_step: int

    def attrs(self) -> dict:
        """The HDF5 attributes of the theory dataset (names: :data:`ATTRS`)."""
        return {"audit_against": self.against, "audit_abs": self.absolute,
                "audit_kind": self.kind, "audit_runs": self.runs,
                "audit_max_abs": self.max_abs, "audit_max_se": self.max_se,
                "audit_at_step": self.at_step, "audit_passage_ratio": self.passage_ratio,
                "audit_pass": self.passed, "audit_fail_step": self.fail_step}

    @classmethod
    def from_attrs(cls, line: str, attrs: dict, total: int) -> Audit:
        """The audit stored in a dataset's attributes (as :meth:`attrs` writes them)."""
        return cls(line, str(attrs["audit_against"]), str(attrs["audit_kind"]),
                   bool(attrs["audit_abs"]), int(attrs["audit_runs"]), int(total),
                   float(attrs["audit_max_abs"]), float(attrs["audit_max_se"]),
                   int(attrs["audit_at_step"]), float(attrs["audit_passage_ratio"]),
                   bool(attrs["audit_pass"]), int(attrs["audit_fail_step"]))

    @property
    def quantity(self) -> str:
        """The SGD quantity as compared: ``|overlap|`` or ``extra/alignment``, say."""
        return f"|{self.against}|" if self.absolute else self.against

    @property
    def names(self) -> tuple[str, str]:
        """(theory line, SGD quantity) as printed: dataset names without ``extra/``."""
        return self.line.removeprefix("extra/"), self.quantity.replace("extra/", "")

    def as_json(self) -> dict:
        """JSON-ready values (null for NaN)."""
        out = {"against": self.quantity, "kind": self.kind, "runs": self.runs,
               "total_runs": self.total, "max_abs": self.max_abs, "max_se": self.max_se,
               "at_step": self.at_step, "passage_ratio": self.passage_ratio,
               "within_tolerance": self.passed, "fail_step": self.fail_step}
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in out.items()}

    def verdict(self) -> str:
        """``within tolerance`` or ``OUTSIDE tolerance from step N``."""
        if self.runs == 0:
            return "not audited"
        return "within tolerance" if self.passed else (
            f"OUTSIDE tolerance from step {self.fail_step}")

    def text(self) -> str:
        """``theory ode vs |overlap|: max |Δ| 0.012 at step 4000 (max 2.1 SE), passage ratio
        1.03, within tolerance`` (and ``, on R' of R runs`` where runs were left out)."""
        head = "theory {} vs {}: ".format(*self.names)
        if self.runs == 0:
            return head + (f"not audited: no run of {self.total} has the line and the "
                           "quantity finite at every checkpoint")
        parts = [f"max |Δ| {self.max_abs:.3g} at step {self.at_step} "
                 f"(max {fmt_value(self.max_se, '.2g')} SE)"]
        if self.kind == "overlap":
            parts.append(f"passage ratio {fmt_value(self.passage_ratio, '.3g')}")
        parts.append(self.verdict())
        if self.runs < self.total:
            parts.append(f"on {self.runs} of {self.total} runs")
        return head + ", ".join(parts)


def fmt_value(value: float, spec: str) -> str:
    """``format(value, spec)``, ``n/a`` for NaN."""
    return format(value, spec) if math.isfinite(value) else "n/a"


# ---------------------------------------------------------------- the statistic
def array_of(traj, path: str):
    """A Trajectory's array by HDF5 path (``extra/NAME`` or a field), None if absent."""
    if path.startswith("extra/"):
        return traj.extra.get(path.removeprefix("extra/"))
    return getattr(traj, path, None)


def paired_difference(x, theory) -> tuple[np.ndarray, np.ndarray]:
    """(D̄, SE) per checkpoint (and trailing position) of D = x − θ over the run axis:
    D̄ = mean_r D_r, SE = sd_r(D_r)/√R with ddof 1 (NaN for R < 2)."""
    d = np.asarray(x, dtype=np.float64) - np.asarray(theory, dtype=np.float64)
    runs = d.shape[0]
    mean = d.mean(axis=0)
    if runs < 2:
        return mean, np.full_like(mean, np.nan)
    return mean, d.std(axis=0, ddof=1) / math.sqrt(runs)


def tolerance(kind: str, se, sgd_mean) -> np.ndarray:
    """max(4·SE, f): f = 0.03 (overlaps) or 0.03·|mean SGD| (losses); f alone where SE is
    NaN."""
    floor = FLOOR * (np.abs(sgd_mean) if kind == "loss" else np.ones_like(sgd_mean))
    return np.fmax(SE_TOLERANCE * np.asarray(se, dtype=np.float64), floor)


def passage_steps(values, steps, level: float = LEVEL) -> np.ndarray:
    """Per run (rows of ``values`` (R, C)), the first checkpoint step with |value| ≥ level
    (NaN if never)."""
    hit = np.abs(np.asarray(values, dtype=np.float64)) >= level
    out = np.asarray(steps, dtype=np.float64)[np.argmax(hit, axis=1)]
    out[~hit.any(axis=1)] = np.nan
    return out


def passage_ratio(x, theory, steps, level: float = LEVEL) -> float:
    """median_r t½(x_r)/t½(θ_r) over the runs where both pass and θ not at step 0 (NaN if
    none)."""
    t_sgd, t_theory = passage_steps(x, steps, level), passage_steps(theory, steps, level)
    ok = np.isfinite(t_sgd) & np.isfinite(t_theory) & (t_theory > 0)
    return float(np.median(t_sgd[ok] / t_theory[ok])) if ok.any() else math.nan


def _used_runs(x: np.ndarray, theory: np.ndarray) -> np.ndarray:
    """Runs with both arrays finite at every checkpoint (and trailing position)."""
    both = np.isfinite(x) & np.isfinite(theory)
    return both.reshape(both.shape[0], -1).all(axis=1)


def audit_line(name: str, line: Line, steps, x, theory) -> Audit:
    """The :class:`Audit` of theory array ``theory`` against ``x`` (both (R, C, …))."""
    steps = np.asarray(steps)
    x, theory = np.asarray(x, dtype=np.float64), np.asarray(theory, dtype=np.float64)
    if line.absolute:
        x, theory = np.abs(x), np.abs(theory)
    defined = np.isfinite(x).reshape(x.shape[0], steps.size, -1).any(axis=(0, 2))
    if defined.any() and not defined.all():  # a checkpoint where no run has the quantity
        steps, x, theory = steps[defined], x[:, defined], theory[:, defined]
    used = _used_runs(x, theory)
    x, theory = x[used], theory[used]
    if not used.any():
        return Audit(name, line.against, line.kind, line.absolute, 0, used.size, math.nan,
                     math.nan, -1, math.nan, False, -1)
    mean, se = paired_difference(x, theory)
    gap = np.abs(mean).reshape(steps.size, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # SE NaN with one run
        z = gap / np.maximum(se.reshape(gap.shape), EPS)
    tol = tolerance(line.kind, se, x.mean(axis=0)).reshape(gap.shape)
    bad = (gap > tol).any(axis=1)
    ratio = (passage_ratio(x, theory, steps) if line.kind == "overlap" and x.ndim == 2
             else math.nan)
    return Audit(name, line.against, line.kind, line.absolute, int(used.sum()), used.size,
                 float(gap.max()), float(np.max(z)) if np.isfinite(z).any() else math.nan,
                 int(steps[np.argmax(gap.max(axis=1))]), ratio, not bad.any(),
                 int(steps[np.argmax(bad)]) if bad.any() else -1)


def _audit_of(traj, name: str, line: Line) -> Audit | None:
    """:func:`audit_line` of one line of ``traj``; None where it has no finite value or
    the SGD quantity is missing or of another shape."""
    theory, x = array_of(traj, name), array_of(traj, line.against)
    if theory is None or x is None or np.shape(theory) != np.shape(x):
        return None
    if not np.isfinite(np.asarray(theory, dtype=np.float64)).any():
        return None
    return audit_line(name, line, traj.steps, x, theory)


def audit_trajectory(traj) -> dict[str, Audit]:
    """HDF5 path → :class:`Audit` for every theory line of :data:`LINES` that ``traj``
    records with a finite value beside its SGD quantity."""
    audits = {name: _audit_of(traj, name, line) for name, line in LINES.items()}
    return {name: a for name, a in audits.items() if a is not None}


def stored_audits(traj) -> dict[str, Audit]:
    """The audits a file stores (read back into ``traj.extra_attrs`` by the readers), keyed
    like :func:`audit_trajectory`; a line without them (a file written before the audit) is
    audited now."""
    out = {}
    for name, line in LINES.items():
        attrs = traj.extra_attrs.get(name.removeprefix("extra/"), {})
        if all(key in attrs for key in ATTRS):
            out[name] = Audit.from_attrs(name, attrs, traj.runs)
        elif (audit := _audit_of(traj, name, line)) is not None:
            out[name] = audit
    return out


def not_drawn(audits: dict[str, Audit]) -> dict[str, str]:
    """{line: why} for the lines of ``audits`` a figure leaves out (module docstring): outside
    tolerance on ≥ ``MIN_RUNS`` runs where another line of the same SGD quantity is within."""
    groups: dict[str, list[Audit]] = {}
    for audit in audits.values():
        if audit.runs >= MIN_RUNS:
            groups.setdefault(audit.quantity, []).append(audit)
    out = {}
    for members in groups.values():
        good = [a.names[0] for a in members if a.passed]
        if not good:
            continue
        for a in members:
            if not a.passed:
                out[a.line] = (f"`{a.names[0]}` not drawn: outside the audit's tolerance "
                               f"against these runs (max |Δ| {a.max_abs:.3g} at step "
                               f"{a.at_step}, {fmt_value(a.max_se, '.2g')} SE) where "
                               f"{', '.join(f'`{n}`' for n in good)} "
                               f"{'is' if len(good) == 1 else 'are'} within: read "
                               f"{'it' if len(good) == 1 else 'them'}")
    return out


def mark_not_drawn(traj, audits: dict[str, Audit] | None = None) -> dict[str, str]:
    """Set the attribute ``not_drawn`` (:func:`not_drawn`) in ``traj.extra_attrs`` of each
    line a figure leaves out, from ``audits`` (default: :func:`audit_trajectory`); returns
    them."""
    out = not_drawn(audit_trajectory(traj) if audits is None else audits)
    if out:  # new dicts: the cells of one sweep batch share the batch's attributes
        attrs = dict(traj.extra_attrs)
        for line, why in out.items():
            key = line.removeprefix("extra/")
            attrs[key] = attrs.get(key, {}) | {"not_drawn": why}
        traj.extra_attrs = attrs
    return out
