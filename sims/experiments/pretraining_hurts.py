"""'When pre-training hurts' measured (issue 39; Nwemadji, Loureiro & Barbier 2026): steps for
the adapter's direction v to reach |⟨v, u⟩| = μ from a pre-trained base w₀ = μu, against μ.

Every point (σ, μ) runs R runs of the ``pretrained-glm`` exact chain
(:mod:`dynamics.reduced.pretrained_chain`, float64, CPU) at the paper's setting: d = 1000,
B = 500, a₀ = 1/d², v₀ uniform on the sphere (their ``experiment.py`` normalises V at
initialisation), η = 0.2, and for σ = hₙ (the registry's normalised Heₙ/√(n!)) η = 0.2/n, the
same SGD as theirs on Heₙ with lr 0.2/(n!·n) (:func:`paper_eta`). (a, m) is recorded after
every step (:func:`~dynamics.reduced.pretrained_chain.advance_recording`, in blocks), so that

* the per-run first passage of |m| ≥ μ (NaN: not by the horizon, counted as *never*; a
  run that diverges before crossing counts as never) gives the median and quartiles over runs;
* the paper's statistic (:func:`window_statistic`) is computed on the per-step mean |m| over
  all R runs, and on the means of ``subsets`` random 3-run subsets (the paper averages 3
  seeds): the spread of the statistic a 3-seed measurement gives;
* the first step at which the mean |m| over runs reaches μ.

A point stops at its horizon (:meth:`HurtsSpec.horizon`), or once every run has crossed μ and
every mean curve (all runs, each subset) is above μ + 0.05 (their window is then closed;
later re-entries are not looked for). Theory beside: the population flow's crossing time of
|m| = μ from the runs' typical start (a₀, median |m₀|), with the renormalisation term of η, d
and B (:func:`hermite.flows.pretrained.flow_crossing_time`), and the asymptote ½·τ(μ)·ln d/η
steps (:func:`hermite.flows.pretrained.escape_time`). :func:`run_hurts` measures a
:class:`HurtsSpec` (resuming the points of an earlier file with the same settings);
:func:`write_hurts` stores it (format ``loradyn-pretraining-hurts``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dynamics.randomness.sampling import run_seed
from dynamics.reduced.pretrained_chain import (
    PretrainedSettings,
    PretrainedStart,
    advance_recording,
    initial_runs,
)
from hermite.activations_numba import act_code
from hermite.flows.pretrained import escape_coefficients, escape_time, flow_crossing_time

__all__ = ["FORMAT", "HALF_WIDTH", "PUBLISHED", "PUBLISHED_STD", "PUBLISHED_SOURCE",
           "PUBLISHED_FILES", "HurtsSpec", "HurtsResult", "paper_eta", "window_statistic",
           "asymptote_steps", "trap_mus", "run_quantiles", "measure_point", "run_hurts",
           "write_hurts", "read_hurts", "summary_lines", "table_rows", "TABLE_HEAD",
           "escape_scaling"]

FORMAT = "loradyn-pretraining-hurts"
HALF_WIDTH = 0.05  # the paper's window |mean overlap − μ| ≤ 0.05
SUBSET_STREAM = 39_005  # the 3-run subsets' stream: numpy SeedSequence([seed, this])

#: the public repository of the paper's code and data, and the file of each table
PUBLISHED_SOURCE = ("github.com/GibbsNwemadji/When-pre-training-hurts-LoRA-fine-tuning-a-"
                    "dynamical-analysis-via-single-index-models")
PUBLISHED_FILES = {"linear": "data_numerics_paper/x_time_to_overlap1.npz",
                   "relu": "data_numerics_paper/relu_time_to_overlap1.npz",
                   "erf": "data_numerics_paper/erf_time_to_overlap1.npz",
                   "sigmoid": "data_numerics_paper/sigmoid_time_to_overlap1.npz",
                   "he2": "data_numerics_paper/He2_time_to_overlap2.npz"}
_MU9 = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
_HE2_MU = (0.1, 0.2, 0.4, 0.5, 0.8, 0.9)
#: the published tables, μ → ``time_to_overlap`` (their :func:`window_statistic` on the mean
#: of 3 seeds, d = 1000, B = 500, lr 0.2; He₂ (our he2) with lr 0.2/(2!·2))
PUBLISHED = {
    "linear": dict(zip(_MU9, (9.5, 20.5, 36.0, 45.0, 66.5, 106.0, 194.0, 457.5, 2038.5),
                       strict=True)),
    "relu": dict(zip(_MU9, (13.0, 30.0, 53.0, 79.5, 125.0, 191.5, 374.5, 903.5, 3978.5),
                     strict=True)),
    "erf": dict(zip(_MU9, (19.5, 57.0, 129.0, 265.5, 582.0, 1221.0, 3130.0, 9743.0, 52705.5),
                    strict=True)),
    "sigmoid": dict(zip(_MU9, (215.0, 470.0, 804.5, 1357.5, 2423.5, 4280.0, 9073.5, 24905.0,
                               114464.0), strict=True)),
    "he2": dict(zip(_HE2_MU, (526.0, 511.0, 527.0, 596.0, 2497.0, 11766.5), strict=True)),
}
#: their ``std_time_to_overlap``: the standard deviation of the window's step indices
PUBLISHED_STD = {
    "linear": dict(zip(_MU9, (2.872, 1.708, 1.414, 1.414, 1.708, 2.582, 4.899, 13.28, 92.95),
                       strict=True)),
    "relu": dict(zip(_MU9, (3.742, 2.582, 2.582, 2.872, 3.742, 5.188, 9.233, 26.56, 185.3),
                     strict=True)),
    "erf": dict(zip(_MU9, (6.922, 5.477, 6.055, 8.655, 12.99, 21.65, 40.70, 114.6, 1206.1),
                    strict=True)),
    "sigmoid": dict(zip(_MU9, (67.84, 42.43, 40.41, 46.19, 62.35, 93.24, 172.1, 471.4,
                               2646.3), strict=True)),
    "he2": dict(zip(_HE2_MU, (99.02, 30.31, 17.03, 19.34, 174.1, 1482.1), strict=True)),
}


def paper_eta(activation: str, eta0: float = 0.2) -> float:
    """The paper's step size in loradyn's terms: η₀ for linear, ReLU, erf, sigmoid; η₀/n for
    ``he<n>``: their Heₙ = √(n!)·hₙ with lr η₀/(n!·n) is SGD on hₙ with lr n!·η₀/(n!·n)."""
    if activation.startswith("he") and activation[2:].isdigit():
        return eta0 / int(activation[2:])
    return eta0


def window_statistic(curve, mu: float, half_width: float = HALF_WIDTH) -> float:
    """The paper's "time to overlap μ" (``find_first_time_overlap_ge1`` of their
    ``plot_time_to_overlap.py``): the mean of the 0-based indices i (i = step − 1: their
    record i follows step i + 1) where μ − w ≤ curve[i] ≤ μ + w; NaN where there is none."""
    c = np.asarray(curve, dtype=float)
    idx = np.flatnonzero((c >= mu - half_width) & (c <= mu + half_width))
    return float(idx.mean()) if idx.size else math.nan


def asymptote_steps(activation: str, mu: float, d: int, eta: float) -> float:
    """½·τ(μ)·ln d/η: the search phase's escape in steps at large d (inf at a trap)."""
    return 0.5 * float(escape_time(activation, mu)) * math.log(d) / eta


def trap_mus(activation: str, grid: int = 99) -> list[float]:
    """The μ ∈ (0, 1) where b(μ) = 0 (τ = ∞, a trap): brentq between sign changes of b on a
    grid of ``grid`` points."""
    from scipy.optimize import brentq

    def b(x):
        return escape_coefficients(activation, x)[0]

    mus = np.linspace(0.01, 0.99, grid)
    vals = np.array([b(x) for x in mus])
    return [float(brentq(b, mus[i], mus[i + 1], xtol=1e-12))
            for i in range(grid - 1) if vals[i] * vals[i + 1] < 0]


# ---------------------------------------------------------------- the measurement
@dataclass(frozen=True)
class HurtsSpec:
    """What :func:`run_hurts` measures: the points (σ, μ) of panel (a) (``main``) and of
    panel (b) (``hermite``), runs per point, the setting (d, B, η₀: :func:`paper_eta`), the
    horizon (``horizon_factor`` × the larger of the published value and the asymptote, at
    least ``min_horizon``, at most ``max_horizon`` steps), the 3-run ``subsets`` and the
    recording block."""

    main: tuple
    hermite: tuple
    runs: int = 64
    d: int = 1000
    batch: int = 500
    eta0: float = 0.2
    seed: int = 0
    horizon_factor: float = 4.0
    min_horizon: int = 2000
    max_horizon: int = 300_000
    subsets: int = 200
    subset_size: int = 3
    block: int = 4096
    label: str = "full"

    def __post_init__(self):
        for act, mu in self.points:
            if act_code(act) is None:
                raise ValueError(f"activation {act!r} has no compiled version for the chain")
            if not 0.0 < mu < 1.0:
                raise ValueError(f"mu must be in (0, 1), got {mu!r} for {act}")
        if not (isinstance(self.runs, int) and self.runs >= self.subset_size >= 1):
            raise ValueError(f"runs must be an integer ≥ {self.subset_size}, got {self.runs!r}")

    @property
    def points(self) -> tuple:
        return tuple(self.main) + tuple(self.hermite)

    @property
    def paper_setting(self) -> bool:
        """Whether d, B and η₀ are the paper's (1000, 500, 0.2): the published tables apply."""
        return (self.d, self.batch, self.eta0) == (1000, 500, 0.2)

    def eta(self, activation: str) -> float:
        return paper_eta(activation, self.eta0)

    def settings(self, activation: str, mu: float) -> PretrainedSettings:
        return PretrainedSettings(act_code(activation), float(mu), self.eta(activation),
                                  self.batch, 0.0, self.d)

    def horizon(self, activation: str, mu: float) -> int:
        ref = max(PUBLISHED.get(activation, {}).get(mu, 0.0),
                  asymptote_steps(activation, mu, self.d, self.eta(activation)))
        return int(min(self.max_horizon, max(self.min_horizon,
                                             math.ceil(self.horizon_factor * ref))))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["main"] = [list(p) for p in self.main]
        out["hermite"] = [list(p) for p in self.hermite]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> HurtsSpec:
        kw = dict(data)
        kw["main"] = tuple((str(a), float(m)) for a, m in kw["main"])
        kw["hermite"] = tuple((str(a), float(m)) for a, m in kw["hermite"])
        return cls(**kw)

    def point_key(self, activation: str, mu: float) -> str:
        """What a point's numbers depend on (resume: a point is reused when this matches)."""
        keep = ("runs", "d", "batch", "eta0", "seed", "horizon_factor", "min_horizon",
                "max_horizon", "subsets", "subset_size")
        return json.dumps({k: getattr(self, k) for k in keep}
                          | {"activation": activation, "mu": float(mu)}, sort_keys=True)


def _subsets(spec: HurtsSpec) -> np.ndarray:
    """(K, 3) run indices of the 3-run subsets (distinct runs each; one stream)."""
    rng = np.random.default_rng([spec.seed, SUBSET_STREAM])
    return np.array([rng.choice(spec.runs, spec.subset_size, replace=False)
                     for _ in range(spec.subsets)], dtype=np.int64).reshape(-1,
                                                                           spec.subset_size)


def measure_point(spec: HurtsSpec, activation: str, mu: float) -> dict:
    """One point (module docstring): first passages, the window statistic of the mean of all
    runs and of each 3-run subset, the mean's first crossing, the theory; a dict."""
    t0 = time.perf_counter()
    settings = spec.settings(activation, mu)
    state = initial_runs(settings, PretrainedStart(run_seed(spec.seed, 0, "data"), spec.runs))
    m0 = np.abs(state["m"])
    passages = np.where(m0 >= mu, 0.0, np.nan)
    subsets = _subsets(spec)
    sums, counts = np.zeros(spec.subsets + 1), np.zeros(spec.subsets + 1)
    dead = np.zeros(spec.runs, dtype=bool)
    mean_cross, horizon, t, closed = math.nan, spec.horizon(activation, mu), 0, False
    while t < horizon:
        n = min(spec.block, horizon - t)
        _, m, div = advance_recording(settings, state, n)
        absm = np.abs(m)
        for r in np.flatnonzero(div >= 0):  # a diverged run is NaN from its divergence on
            absm[r, div[r] - 1:] = np.nan
        dead |= div >= 0
        steps = np.arange(t + 1, t + n + 1)
        todo = np.flatnonzero(np.isnan(passages) & ~dead)
        hits = absm[todo] >= mu
        got = hits.any(axis=1)
        passages[todo[got]] = steps[np.argmax(hits[got], axis=1)]
        with np.errstate(invalid="ignore"):
            mean = np.nanmean(absm, axis=0)
            curves = np.vstack([mean[None], np.nanmean(absm[subsets], axis=1)])
        inside = (curves >= mu - HALF_WIDTH) & (curves <= mu + HALF_WIDTH)
        sums += inside @ (steps - 1.0)
        counts += inside.sum(axis=1)
        if math.isnan(mean_cross) and (mean >= mu).any():
            mean_cross = float(steps[np.argmax(mean >= mu)])
        t += n
        closed = bool((curves[:, -1] > mu + HALF_WIDTH).all())
        if closed and (np.isfinite(passages) | dead).all():
            break
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    eta = settings.eta
    a0 = 1.0 / spec.d**2
    flow_t = flow_crossing_time(activation, mu, a0, float(np.median(m0)), mu, horizon * eta,
                                eta=eta, d=spec.d, batch=spec.batch)
    return {"activation": activation, "mu": float(mu), "eta": eta, "horizon": horizon,
            "steps_run": t, "passages": passages, "m0": m0, "window_stat": float(stats[0]),
            "subset_stats": stats[1:], "mean_cross": mean_cross, "closed": float(closed),
            "never": int(np.sum(np.isnan(passages))), "diverged": int(dead.sum()),
            "flow_steps": flow_t / eta, "asymptote_steps": asymptote_steps(
                activation, mu, spec.d, eta),
            "tau": float(escape_time(activation, mu)),
            "published": (PUBLISHED.get(activation, {}).get(float(mu), math.nan)
                          if spec.paper_setting else math.nan),
            "seconds": time.perf_counter() - t0, "key": spec.point_key(activation, mu)}


@dataclass
class HurtsResult:
    """A measured :class:`HurtsSpec`: one dict per point (:func:`measure_point`), in order."""

    spec: HurtsSpec
    points: list
    seconds: float
    reused: int = 0

    @property
    def cells(self) -> int:
        return len(self.spec.points)

    @property
    def complete(self) -> bool:
        return len(self.points) == len(self.spec.points)


def run_hurts(spec: HurtsSpec, path=None, echo=None) -> HurtsResult:
    """Measure every point of ``spec`` (the points of an existing file at ``path`` with the
    same :meth:`HurtsSpec.point_key` are reused); write ``path`` after each point (atomically),
    so an interrupted measurement resumes; ``echo`` gets one line per point."""
    start = time.perf_counter()
    done = _read_points(path) if path is not None and Path(path).exists() else {}
    points, reused = [], 0
    for act, mu in spec.points:
        key = spec.point_key(act, mu)
        if key in done:
            points.append(done[key])
            reused += 1
            continue
        point = measure_point(spec, act, mu)
        points.append(point)
        if echo is not None:
            echo(f"  {act:<8} μ = {mu:<4g} median {_fmt(run_quantiles(point)[1])} steps, "
                 f"statistic {_fmt(point['window_stat'])}, published "
                 f"{_fmt(point['published'])}, never {point['never']}/{spec.runs} "
                 f"({point['seconds']:.1f} s)")
        if path is not None:
            write_hurts(path, HurtsResult(spec, points, time.perf_counter() - start, reused))
    result = HurtsResult(spec, points, time.perf_counter() - start, reused)
    if path is not None:
        write_hurts(path, result)
    return result


# ---------------------------------------------------------------- the file
_ARRAYS = ("passages", "m0", "subset_stats")
_SCALARS = ("activation", "mu", "eta", "horizon", "steps_run", "window_stat", "mean_cross",
            "closed", "never", "diverged", "flow_steps", "asymptote_steps", "tau", "published",
            "seconds", "key")


def write_hurts(path, result: HurtsResult) -> Path:
    """The measurement as HDF5 (format ``loradyn-pretraining-hurts``): root attributes
    (provenance: version, commit, created; ``config``: the spec as JSON; the published
    tables and their source; ``complete``), one group per point under ``points/`` (in
    order) with ``passages`` (runs; NaN = never), ``m0`` (|m₀| per run), ``subset_stats``
    (the statistic on each 3-run mean) and the point's numbers as attributes."""
    from sims.io.atomic import hdf5_writer
    from sims.io.trajectory import provenance

    path = Path(path)
    with hdf5_writer(path) as f:
        f.attrs.update({"format": FORMAT} | provenance() | {
            "config": json.dumps(result.spec.to_dict()), "runs": result.spec.runs,
            "seed": result.spec.seed, "dtype": "float64", "device": "cpu", "engine": "reduced",
            "learner": "pretrained-glm", "complete": result.complete,
            "seconds": result.seconds, "published": json.dumps(
                {k: {f"{m:g}": v for m, v in t.items()} for k, t in PUBLISHED.items()}),
            "published_source": PUBLISHED_SOURCE,
            "published_files": json.dumps(PUBLISHED_FILES)})
        group = f.create_group("points")
        for i, point in enumerate(result.points):
            g = group.create_group(f"{i:03d}")
            for key in _ARRAYS:
                g[key] = np.asarray(point[key], dtype=float)
            g["passages"].attrs["description"] = ("steps to |m| ≥ μ per run; NaN = not by "
                                                  "the horizon (or diverged)")
            for key in _SCALARS:
                g.attrs[key] = point[key]
    return path


def _points_of(f) -> list:
    out = []
    for name in sorted(f.get("points", {})):
        g = f["points"][name]
        point = {key: g[key][()] for key in _ARRAYS}
        point |= {key: g.attrs.get(key, math.nan) for key in _SCALARS}  # closed: NaN if
        # the file predates it
        for key in ("activation", "key"):
            point[key] = str(point[key])
        for key in ("horizon", "steps_run", "never", "diverged"):
            point[key] = int(point[key])
        for key in set(_SCALARS) - {"activation", "key", "horizon", "steps_run", "never",
                                    "diverged"}:
            point[key] = float(point[key])
        out.append(point)
    return out


def _read_points(path) -> dict:
    """The points of an earlier file by key ({} if it is none)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return ({p["key"]: p for p in _points_of(f)}
                    if f.attrs.get("format") == FORMAT else {})
    except (OSError, ValueError, KeyError):
        return {}


def read_hurts(path) -> HurtsResult:
    """A file of :func:`write_hurts` back as a result (ValueError: not one)."""
    import h5py

    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise ValueError(f"{path}: not a loradyn pretraining-hurts file")
        spec = HurtsSpec.from_dict(json.loads(f.attrs["config"]))
        return HurtsResult(spec, _points_of(f), float(f.attrs["seconds"]))


# ---------------------------------------------------------------- the table
def run_quantiles(point: dict) -> tuple[float, float, float]:
    """(25 %, 50 %, 75 %) of the first passages, a run that never crossed counting as +∞."""
    t = np.where(np.isnan(point["passages"]), np.inf, point["passages"])
    return tuple(float(np.quantile(t, q, method="lower" if q < 0.5 else "higher"))
                 if q != 0.5 else float(np.median(t)) for q in (0.25, 0.5, 0.75))


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if math.isinf(x):
        return "∞"
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.3g}"


TABLE_HEAD = ("σ", "μ", "η", "median [25 %, 75 %] steps", "never", "paper stat.",
              "3-seed stat. [5 %, 95 %]", "published", "ratio", "flow", "½τ ln d/η")


def table_rows(result: HurtsResult) -> list[tuple]:
    """One row per point (strings): σ, μ, η, the median [quartiles] of the first passages,
    runs that never crossed, the paper's statistic on the mean of all runs and its 5–95 %
    range over the 3-run subsets, the published value, the ratio statistic/published, the
    flow's crossing and the asymptote (steps). "(open)": the mean |m| (or a subset's) was
    still within ±0.05 of μ at the horizon, so the statistic depends on it."""
    rows = []
    for p in result.points:
        q1, med, q3 = run_quantiles(p)
        sub = p["subset_stats"][np.isfinite(p["subset_stats"])]
        spread = (f"{_fmt(float(np.median(sub)))} [{_fmt(float(np.quantile(sub, 0.05)))}, "
                  f"{_fmt(float(np.quantile(sub, 0.95)))}]" if sub.size else "–")
        ratio = p["window_stat"] / p["published"]
        rows.append((p["activation"], f"{p['mu']:g}", f"{p['eta']:.4g}",
                     f"{_fmt(med)} [{_fmt(q1)}, {_fmt(q3)}]", f"{p['never']}/{len(p['m0'])}",
                     _fmt(p["window_stat"]) + ("" if p["closed"] != 0.0 else " (open)"),
                     spread, _fmt(p["published"]),
                     "–" if math.isnan(ratio) else f"{ratio:.2f}", _fmt(p["flow_steps"]),
                     _fmt(p["asymptote_steps"])))
    return rows


def summary_lines(result: HurtsResult) -> list[str]:
    """The table of :func:`table_rows` under a header line."""
    spec = result.spec
    lines = [f"pretraining-hurts ({spec.label}: d = {spec.d}, B = {spec.batch}, η = "
             f"{spec.eta0:g} (hₙ: {spec.eta0:g}/n), a₀ = 1/d², v₀ on the sphere, {spec.runs} "
             "runs per point, exact chain): steps to |⟨v, u⟩| ≥ μ; paper stat. = mean index "
             f"with the mean |m| within ±{HALF_WIDTH} of μ; ratio = paper stat./published"]
    rows = table_rows(result)
    widths = [max(len(r[i]) for r in (TABLE_HEAD, *rows)) for i in range(len(TABLE_HEAD))]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
              for r in (TABLE_HEAD, *rows)]
    if not result.complete:
        lines.append(f"  (incomplete: {len(result.points)} of {result.cells} points)")
    return lines


# ---------------------------------------------------------------- escape time against d
def escape_scaling(activation: str, mu: float, ds, runs: int = 32, eta: float = 0.2,
                   seed: int = 0, horizon: float = 4.0) -> list[dict]:
    """Per d: the median over ``runs`` chain runs (B = d/2, η, a₀ = 1/d², v₀ on the sphere)
    of the first passage of |m| ≥ μ (a run not there by ``horizon`` × the asymptote counts
    as +∞), and median·η/(τ(μ) ln d), which tends to ½ if the escape is ½τ ln d/η + o(ln d)."""
    from dynamics.reduced.pretrained_chain import first_passage_pretrained
    from dynamics.setup.config import RunConfig

    tau = float(escape_time(activation, mu))
    out = []
    for d in ds:
        t0 = time.perf_counter()
        steps = int(math.ceil(horizon * asymptote_steps(activation, mu, d, eta)))
        cfg = RunConfig(instance={"activation": activation, "k": 1, "d": int(d), "seed": 0},
                        learner="pretrained-glm", mu=mu, eta=eta, batch=int(d) // 2,
                        steps=steps, runs=runs, seed=seed, engine="reduced").validate()
        hits = first_passage_pretrained(cfg, mu)
        med = float(np.median(np.where(np.isnan(hits), np.inf, hits)))
        out.append({"activation": activation, "mu": mu, "d": int(d), "tau": tau,
                    "median_steps": med, "ratio": med * eta / (tau * math.log(d)),
                    "never": int(np.isnan(hits).sum()), "runs": runs,
                    "seconds": time.perf_counter() - t0})
    return out
