"""Theorem 19's separation measured: fine-tuning's T ∝ d against learning the same teacher
from scratch (T ∝ d^{p−1} for σ = Heₚ, above the CSQ bound d^{p/2}).

Instance (Claim 2): k = 4, W = ``claim2`` (teacher neurons orthonormal), ξ = 1, ĉ = c
(``c_hat: teacher``), λ = 1, σ = Heₚ, seed 0. Target L* = Φ(0.9), fine-tuning's exact
population loss at overlap 0.9. Every learner runs on its exact dimension-free chain (float64,
CPU, numba):

* ``finetune`` (projected, ĉ frozen, rank-1 chain): T = first passage of ⟨û, u⟩ ≥ 0.9 (the
  same event as its loss reaching L*) at η = c/d, horizon H·d steps;
* ``scratch`` (squared loss) and ``scratch-csq`` (correlation loss), k′ = k random unit rows,
  λ̂ = λ fixed (network chain): T = first step with exact population loss ≤ L*, checked after
  every step, at η = c/d^{p/2}, horizon H·d^{p−1} steps.

A run that has not arrived by the horizon counts as never (NaN, right-censored). Per learner
and d: the censored median of T with a percentile-bootstrap 95 % CI (runs resampled), the
fraction never arriving; per learner: the slope b of log median T = a + b log d with its
bootstrap CI (:func:`sims.experiments.fit.fit_power_law`; a d whose median is censored is left
out of the fit). :func:`run_separation` measures a :class:`SeparationSpec`, resuming the cells
(learner, d) of an earlier file with the same configuration; :func:`write_separation` stores
it (format ``loradyn-separation``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import hermite
from dynamics.instances.instance import build_instance
from dynamics.reduced import first_passages_reduced
from dynamics.reduced.network_simulate import NetworkChain
from dynamics.setup.config import RunConfig
from sims.experiments.fit import censored_median, fit_power_law

__all__ = ["LEVEL", "LEARNERS", "FORMAT", "SeparationSpec", "SeparationResult", "Series",
           "spec_for", "degree", "fine_tuning", "target_loss", "finetune_config", "finetune_times",
           "scratch_config", "scratch_times", "ode_times", "learner_config", "learner_times",
           "median_ci", "run_separation", "write_separation", "read_separation",
           "summary_lines"]

LEVEL = 0.9
#: the learners the separation compares (valid names of SeparationSpec.learners): the
#: fine-tuning learner and the from-scratch network learners of squared and correlation loss
LEARNERS = tuple(dict.fromkeys(["finetune", "scratch", "scratch-csq"]))
SIGMAS = ("he3", "he4")
FORMAT = "loradyn-separation"


# ---------------------------------------------------------------- the instance and its runs
def spec_for(sigma: str, d: int) -> dict:
    """The Claim 2 instance at dimension d."""
    return {"activation": sigma, "k": 4, "d": d, "xi": 1.0, "W": "claim2", "seed": 0,
            "c_hat": "teacher"}


def degree(sigma: str) -> int:
    """p of σ = Heₚ (its information exponent)."""
    return int(sigma.removeprefix("he"))


def target_loss(sigma: str, d: int) -> float:
    """L* = fine-tuning's exact population loss at overlap 0.9."""
    inst = build_instance(spec_for(sigma, d))
    return float(np.ravel(hermite.population_loss(inst, np.array([LEVEL])))[0])


def finetune_config(sigma: str, d: int, runs: int, c_ft: float, seed: int,
                    horizon: float = 400.0) -> RunConfig:
    """Fine-tuning's runs at d: η = c_ft/d, horizon·d steps, the rank-1 chain."""
    return RunConfig(instance=spec_for(sigma, d), learner="finetune", eta=c_ft / d,
                     steps=int(horizon * d), runs=runs, seed=seed, engine="reduced",
                     finite_d_theory=False)


def finetune_times(sigma: str, d: int, runs: int, c_ft: float, seed: int,
                   horizon: float = 400.0) -> np.ndarray:
    """First passages of ⟨û, u⟩ ≥ 0.9 of ``finetune`` at η = c_ft/d (NaN: not by
    horizon·d steps)."""
    config = finetune_config(sigma, d, runs, c_ft, seed, horizon)
    return first_passages_reduced(config, [LEVEL])[0]


def scratch_config(sigma: str, learner: str, d: int, runs: int, c: float, horizon: float,
                   seed: int) -> RunConfig:
    """The from-scratch runs at d: η = c/d^{p/2}, horizon·d^{p−1} steps, the exact chain."""
    p = degree(sigma)
    return RunConfig(instance=spec_for(sigma, d), learner=learner, eta=c / d ** (p / 2),
                     steps=int(math.ceil(horizon * d ** (p - 1))), runs=runs, seed=seed,
                     engine="reduced", finite_d_theory=False)


def scratch_times(sigma: str, learner: str, d: int, runs: int, c: float, horizon: float,
                  seed: int) -> tuple[np.ndarray, int]:
    """First passages of the exact population loss ≤ L* (NaN: not by the horizon) and the
    horizon in steps."""
    config = scratch_config(sigma, learner, d, runs, c, horizon, seed)
    hits = NetworkChain().first_passages(config, [target_loss(sigma, d)], quantity="loss")
    return hits[0], config.steps


def fine_tuning(learner: str) -> bool:
    """Whether ``learner`` is the fine-tuning side (a low-rank learner: rank-1 chain, η ∝ 1/d,
    horizon ∝ d), asked of the learner, else a from-scratch network learner."""
    from dynamics.learners import get_learner

    return get_learner(learner).family == "low-rank"


def learner_config(sigma: str, learner: str, d: int, runs: int, c: float, horizon: float,
                   seed: int) -> RunConfig:
    """The RunConfig of one learner's runs at d (``finetune``: :func:`finetune_config`)."""
    if fine_tuning(learner):
        return finetune_config(sigma, d, runs, c, seed, horizon)
    return scratch_config(sigma, learner, d, runs, c, horizon, seed)


def learner_times(sigma: str, learner: str, d: int, runs: int, c: float, horizon: float,
                  seed: int) -> np.ndarray:
    """The runs' first-passage steps to L* (fine-tuning: overlap 0.9, the same event)."""
    if fine_tuning(learner):
        return finetune_times(sigma, d, runs, c, seed, horizon)
    return scratch_times(sigma, learner, d, runs, c, horizon, seed)[0]


def ode_times(sigma: str, learner: str, d: int, runs: int, c: float, horizon: float,
              seed: int, max_evals: int = 30_000) -> np.ndarray:
    """Plateau escapes (steps; NaN = not by the horizon) of the committee ODE
    (``hermite.committee.committee_first_passage``, first order: the η̄² terms dropped) from
    each of the first ``runs`` chain runs' own starts (the rows the SGD runs start from),
    η̄ = η·d with η = c/d^{p/2}: the first step where some |cos(ŵⱼ, vᵢ)| reaches 0.5. Its
    first passage of L* is no law here: from most starts the ODE comes to rest at a spurious
    fixed point above L* (loss ≈ 1.2–1.5), which SGD leaves."""
    from dynamics.overlays.committee import committee_model, committee_state
    from dynamics.reduced.network_simulate import ChainStart
    from hermite.committee import PassageSettings, committee_first_passage

    config = scratch_config(sigma, learner, d, runs, c, horizon, seed)
    start = ChainStart(config, config.run_instances())
    cross, gram = start.overlaps()
    level = target_loss(sigma, d)
    out = np.full(runs, np.nan)
    for r, inst in enumerate(start.instances):
        model = committee_model(inst, loss=start.learner.loss_name, eta=config.eta,
                                second_order=False)
        hit = committee_first_passage(model, committee_state(cross[r], gram[r],
                                                             start.lam_hat[r]),
                                      level, d, PassageSettings(config.steps / d,
                                                                max_evals=max_evals))
        if math.isfinite(hit.escape):
            out[r] = hit.escape
    return out


def median_ci(times, n_boot: int = 2000, level: float = 0.95, seed: int = 0
              ) -> tuple[float, float]:
    """Percentile-bootstrap CI of the censored median of ``times`` (NaN = never: +∞, so an
    end is inf where half the resampled runs never arrive)."""
    t = np.where(np.isnan(times), np.inf, np.asarray(times, dtype=float))
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(t, size=(n_boot, t.size)), axis=1)
    alpha = (1.0 - level) / 2.0
    return (float(np.quantile(meds, alpha, method="lower")),
            float(np.quantile(meds, 1.0 - alpha, method="higher")))


# ---------------------------------------------------------------- the measurement
@dataclass(frozen=True)
class SeparationSpec:
    """What :func:`run_separation` measures: σ, the d grid, runs per d, the learners and,
    per learner, the step-size constant c and horizon constant H (``finetune``: η = c/d,
    H·d steps; from scratch: η = c/d^{p/2}, H·d^{p−1} steps)."""

    sigma: str
    d: tuple
    runs: int
    learners: tuple = LEARNERS
    c: dict = field(default_factory=dict)
    horizon: dict = field(default_factory=dict)
    seed: int = 0
    n_boot: int = 2000

    def __post_init__(self):
        if self.sigma not in SIGMAS:
            raise ValueError(f"unknown sigma {self.sigma!r}; valid: {', '.join(SIGMAS)}")
        if not self.learners:
            raise ValueError("separation needs at least one learner")
        for name in self.learners:
            if name not in LEARNERS:
                raise ValueError(f"unknown learner {name!r}; valid: {', '.join(LEARNERS)}")
            for what, table in (("c", self.c), ("horizon", self.horizon)):
                value = table.get(name)
                if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                    raise ValueError(f"learner {name!r}: {what} must be a positive number, "
                                     f"got {value!r}")
        ds = list(self.d)
        if any(not isinstance(x, int) or x < 2 for x in ds):
            raise ValueError(f"d must be integers ≥ 2, got {ds}")
        if len(set(ds)) < 2:
            raise ValueError(f"a slope in d needs at least two distinct values of d, got {ds}")
        if not (isinstance(self.runs, int) and self.runs >= 2):
            raise ValueError(f"runs must be an integer ≥ 2, got {self.runs!r}")

    @property
    def p(self) -> int:
        return degree(self.sigma)

    def settings(self) -> dict:
        return asdict(self) | {"d": list(self.d), "learners": list(self.learners), "p": self.p,
                               "level": LEVEL}

    def config(self, learner: str, d: int) -> RunConfig:
        return learner_config(self.sigma, learner, d, self.runs, self.c[learner],
                              self.horizon[learner], self.seed)

    def eta_law(self, learner: str) -> str:
        return (f"{self.c[learner]:g}/d" if fine_tuning(learner)
                else f"{self.c[learner]:g}/d^{self.p / 2:g}")

    def horizon_law(self, learner: str) -> str:
        return (f"{self.horizon[learner]:g}·d" if fine_tuning(learner)
                else f"{self.horizon[learner]:g}·d^{self.p - 1}")


@dataclass
class Series:
    """One learner's measurement over d: first passages (n_d, runs; NaN = never), their
    censored medians with bootstrap CIs, the fraction never arriving, and the fit (or why
    there is none)."""

    learner: str
    d: np.ndarray
    times: np.ndarray
    horizon_steps: np.ndarray
    eta: np.ndarray
    target_loss: np.ndarray
    seconds: np.ndarray
    configs: list
    median: np.ndarray = None
    median_ci: np.ndarray = None
    never: np.ndarray = None
    fit: dict = None

    def analyse(self, n_boot: int, seed: int) -> Series:
        self.median = np.array([censored_median(t) for t in self.times])
        self.median_ci = np.array([median_ci(t, n_boot, seed=seed) for t in self.times])
        self.never = np.mean(np.isnan(self.times), axis=1)
        try:
            fit = fit_power_law(self.d, list(self.times), n_boot=n_boot, seed=seed)
            self.fit = {"slope": fit.slope, "slope_ci": list(fit.slope_ci),
                        "intercept": fit.intercept,
                        "d_fitted": [float(x) for x, m in zip(fit.d, fit.median_T, strict=True)
                                     if np.isfinite(m)]}
        except ValueError as err:
            self.fit = {"slope": None, "why": str(err).removeprefix("fit_power_law: ")}
        return self


@dataclass
class SeparationResult:
    spec: SeparationSpec
    series: dict
    seconds: float
    reused: int = 0
    cells: int = 0


def _cell_key(config: RunConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def run_separation(spec: SeparationSpec, path=None, echo=None) -> SeparationResult:
    """Measure every (learner, d) cell of ``spec`` (cells of an existing file at ``path``
    with the same RunConfig are reused); write ``path`` after each cell (atomically), so an
    interrupted measurement resumes; ``echo`` gets one line per cell."""
    start = time.perf_counter()
    done = _read_cells(path) if path is not None and Path(path).exists() else {}
    cells, reused = {}, 0
    for learner in spec.learners:
        for d in spec.d:
            config = spec.config(learner, d)
            key = _cell_key(config)
            if key in done:
                cells[key] = done[key]
                reused += 1
                continue
            t0 = time.perf_counter()
            hits = learner_times(spec.sigma, learner, d, spec.runs, spec.c[learner],
                                 spec.horizon[learner], spec.seed)
            cells[key] = {"learner": learner, "d": d, "times": hits,
                          "seconds": time.perf_counter() - t0, "config": config}
            if echo is not None:
                echo(f"  {learner:<11} d = {d:<5} median T = {censored_median(hits):.3g}, "
                     f"never {100 * np.mean(np.isnan(hits)):.0f} % "
                     f"({cells[key]['seconds']:.1f} s)")
            if path is not None:
                write_separation(path, _result(spec, cells, start, reused, complete=False))
    result = _result(spec, cells, start, reused, complete=True)
    if path is not None:
        write_separation(path, result)
    return result


def _result(spec, cells, start, reused, complete) -> SeparationResult:
    series = {}
    for learner in spec.learners:
        mine = [c for c in cells.values() if c["learner"] == learner]
        if not mine:
            continue
        mine.sort(key=lambda c: c["d"])
        s = Series(learner, np.array([c["d"] for c in mine]),
                   np.array([c["times"] for c in mine], dtype=float),
                   np.array([c["config"].steps for c in mine]),
                   np.array([c["config"].eta for c in mine]),
                   np.array([target_loss(spec.sigma, c["d"]) for c in mine]),
                   np.array([c["seconds"] for c in mine]), [c["config"] for c in mine])
        series[learner] = s.analyse(spec.n_boot, spec.seed) if complete else s
    n = len(spec.learners) * len(spec.d)
    return SeparationResult(spec, series, time.perf_counter() - start, reused, n)


# ---------------------------------------------------------------- the file
def write_separation(path, result: SeparationResult) -> Path:
    """The measurement as HDF5 (format ``loradyn-separation``): root attributes (settings
    JSON, σ, p, level, seed, dtype, device, engine, version, commit, created, ``complete``),
    one group per learner under ``series/`` with ``d``, ``times`` (d × runs, NaN = never),
    ``median``, ``median_ci``, ``never``, ``horizon_steps``, ``eta``, ``target_loss``,
    ``seconds`` and its RunConfigs and fit as JSON attributes."""
    from sims.io.atomic import hdf5_writer
    from sims.io.trajectory import provenance

    path = Path(path)
    spec = result.spec
    complete = all(s.fit is not None for s in result.series.values()) and sum(
        len(s.d) for s in result.series.values()) == len(spec.learners) * len(spec.d)
    with hdf5_writer(path) as f:
        f.attrs.update({"format": FORMAT} | provenance() | {
            "config": json.dumps(spec.settings()), "sigma": spec.sigma, "p": spec.p,
            "level": LEVEL, "seed": spec.seed, "runs": spec.runs, "dtype": "float64",
            "device": "cpu", "engine": "reduced", "complete": complete,
            "seconds": result.seconds})
        group = f.create_group("series")
        for name, s in result.series.items():
            g = group.create_group(name)
            for key in ("d", "times", "horizon_steps", "eta", "target_loss", "seconds"):
                g[key] = getattr(s, key)
            g["times"].attrs["description"] = ("steps to L* per run (fine-tuning: to "
                                               "overlap 0.9); NaN = not by the horizon")
            if s.fit is not None:
                g["median"] = s.median
                g["median_ci"] = s.median_ci
                g["never"] = s.never
                g.attrs["fit"] = json.dumps(s.fit)
                if s.fit["slope"] is not None:
                    g.attrs["slope"] = s.fit["slope"]
                    g.attrs["slope_ci"] = s.fit["slope_ci"]
            g.attrs["configs"] = json.dumps([c.to_dict() for c in s.configs], default=str)
            g.attrs["seeds"] = [c.seed for c in s.configs]
            g.attrs["eta_law"] = spec.eta_law(name)
            g.attrs["horizon_law"] = spec.horizon_law(name)
    return path


def read_separation(path) -> SeparationResult:
    """A complete file of :func:`write_separation` back as a result (ValueError: not one)."""
    import h5py

    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise ValueError(f"{path}: not a loradyn separation file")
        settings = json.loads(f.attrs["config"])
        seconds = float(f.attrs["seconds"])
        cells = _cells_of(f)
    spec = SeparationSpec(**{k: (tuple(v) if k in ("d", "learners") else v)
                             for k, v in settings.items() if k not in ("p", "level")})
    return _result(spec, cells, time.perf_counter() - seconds, 0, complete=True)


def _cells_of(f) -> dict:
    cells = {}
    for name, g in f.get("series", {}).items():
        configs = [RunConfig.from_dict(c) for c in json.loads(g.attrs["configs"])]
        for i, config in enumerate(configs):
            cells[_cell_key(config)] = {"learner": name, "d": int(g["d"][i]),
                                        "times": g["times"][i], "config": config,
                                        "seconds": float(g["seconds"][i])}
    return cells


def _read_cells(path) -> dict:
    """The finished cells of an earlier separation file ({} if it is none)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return _cells_of(f) if f.attrs.get("format") == FORMAT else {}
    except (OSError, ValueError, KeyError):
        return {}


def summary_lines(result: SeparationResult) -> list[str]:
    """Per learner: slope with CI (or why none), d range, fraction never arriving per d."""
    spec = result.spec
    lines = [f"separation (σ = He{spec.p}, Claim 2 instance, {spec.runs} runs per d, target "
             f"L* = loss at overlap {LEVEL}): slope of median T in d [95 % CI]"]
    for name, s in result.series.items():
        fit = s.fit
        slope = (f"{fit['slope']:.2f} [{fit['slope_ci'][0]:.2f}, {fit['slope_ci'][1]:.2f}]"
                 if fit["slope"] is not None else f"no fit ({fit['why']})")
        never = ", ".join(f"{100 * x:.0f}" for x in s.never)
        lines.append(f"  {name:<11} η = {spec.eta_law(name)}, horizon {spec.horizon_law(name)}:"
                     f" slope {slope}; never arriving {never} % at d = "
                     + ", ".join(str(int(x)) for x in s.d))
    refs = {"d": 1.0, f"d^{spec.p / 2:g} (CSQ)": spec.p / 2, f"d^{spec.p - 1}": spec.p - 1.0}
    lines.append("  reference slopes: " + ", ".join(f"{k} = {v:g}" for k, v in refs.items()))
    return lines
