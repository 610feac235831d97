r"""The exact reduced chain of the ``pretrained-glm`` learner: (a, m) at O(b) cost per step.

Derivation (from the full step of ``dynamics.learners.pretrained_glm``; no approximation)
----------------------------------------------------------------------------------------
x ~ N(0, I_d); teacher y = σ(⟨u, x⟩) + √noise·ε, ‖u‖ = 1; pre-trained base w₀ = μu
(0 < μ < 1); student ŷ = σ(⟨μu + a v, x⟩) with a scalar a and a unit v, both trained by
SGD on L = ½·mean(y − ŷ)², one step size η; v is renormalised after every step.

(P0) *Markov property.* Write v = m u + ν e with m = ⟨v, u⟩, ν = ‖v − m u‖ = √(1 − m²)
     and e ⊥ u unit. The law of x, the teacher and w₀ are invariant under the rotations
     fixing u, and the step map is equivariant, so the next (a, m) depends on the state only
     through (a, m): (a, m) is a Markov chain. In a basis (u, e, rest) one example is
     x = (xu, xz, r): xu, xz ~ N(0, 1), r ~ N(0, I_{d−2}), independent.
(P1) *Initial law.* v₀ uniform on S^{d−1}: m₀ = g/√(g² + Q₀), g ~ N(0, 1), Q₀ ~ χ²_{d−1}
     (the glm chain's start, same streams); a₀ = ``scale0`` (default 1/d²).
(P2) *One example.* s = ⟨v, x⟩ = m xu + ν xz, λ = ⟨μu + a v, x⟩ = μ xu + a s,
     δ = (σ(λ) − y)σ′(λ); ∂L/∂a = δ s, ∂L/∂v = a δ x. A mini-batch of b examples averages:
     G_u = mean δ xu, G_z = mean δ xz, G_s = mean δ s, and the rest mean δ r.
(P3) *Step.* a′ = a − η G_s; ṽ = v − η a mean δ x has components m − ηaG_u along u,
     ν − ηaG_z along e and −ηa mean δ r in the rest, so with N = ‖ṽ‖
       m′ = (m − ηaG_u)/N,  ν′ = √((ν − ηaG_z)² + η²a²ρ²)/N,
       N² = (m − ηaG_u)² + (ν − ηaG_z)² + η²a²ρ²,   ρ² = ‖mean δ r‖².
     ν is carried along (rather than √(1 − m²)) so that 1 − m² keeps full precision as
     m → ±1, as in :mod:`.glm_chain`.
(P4) *The rest.* δ depends on (xu, xz, ε) only and the rₙ are independent of them, so
     mean δ r ~ N(0, (Σδₙ²/b²) I_{d−2}) given the δ's: ρ² = (Σδₙ²/b²)·Q, Q ~ χ²_{d−2}, one χ²
     per step whatever b.

Records: a and m at the checkpoints; the overlap is |m| (a v is invariant under
(a, v) → (−a, −v)). Cost per step: 2b normals (+ b for label noise) and one χ², O(b) flops,
independent of d. Divergence (non-finite a, m or ν, or |m| > 1 + 1e-12) marks and freezes a
run; its records read NaN from then on. Runs advance in blocks on numba's threads, each on
its own SplitMix64 stream seeded from (seed, r) (:mod:`._rng`), so a run's numbers depend
on neither R nor the thread count.
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass, replace

import numpy as np
from numba import njit

from dynamics.randomness.sampling import run_seed
from dynamics.reduced import _kernel, _rng
from dynamics.reduced._drive import DIVERGED, drive, overlap_status
from dynamics.reduced.exact_chain import ExactChain, passage_steps
from dynamics.reduced.segments import ChainRun, run_to_end
from dynamics.runtime.run_threads import over_runs
from dynamics.runtime.trajectory import RunResult, Trajectory, checkpoint_steps
from hermite.activations_numba import act_code, sigma, sigma_and_deriv

__all__ = ["LEARNER", "PtHyper", "PretrainedSettings", "PretrainedStart", "PretrainedRun",
           "PretrainedChain", "StepDraws", "pretrained_supported", "initial_runs", "run_chain",
           "step_given", "simulate_pretrained", "start_pretrained",
           "first_passage_pretrained", "advance_recording"]

ENGINE = "reduced"
LEARNER = "pretrained-glm"

PtHyper = namedtuple("PtHyper", ["code", "hp", "mu", "eta", "batch", "noise_sd", "dof",
                                 "n_steps", "stop_level", "stop_abs"])
PtHyper.__doc__ = """The kernels' settings: σ's (code, p), μ, η, batch b, label-noise sd,
χ² dof of the rest (d − 2), horizon, stop level of m (inf: none), whether it applies to |m|."""


@dataclass(frozen=True)
class PretrainedSettings:
    """The chain's regime: σ's numba (code, p), the base's μ, step size η, batch b, label-noise
    standard deviation and dimension d. ``chi2_dof`` replaces the rest's χ² dof d − 2 (a test
    hook: a deliberately wrong law)."""

    act: tuple[int, int]
    mu: float
    eta: float
    batch: int
    noise_sd: float
    d: int
    chi2_dof: int | None = None

    @classmethod
    def from_config(cls, config, d: int, chi2_dof: int | None = None) -> PretrainedSettings:
        """The settings of a ``pretrained-glm`` config whose instances have dimension d."""
        return cls(act_code(str(config.instance.get("activation"))), float(config.options.mu),
                   float(config.eta), int(config.batch), math.sqrt(config.label_noise), int(d),
                   chi2_dof)

    def hyper(self, n_steps: int, stop_level: float = math.inf,
              stop_abs: bool = True) -> PtHyper:
        """The kernels' :data:`PtHyper` for a call of ``n_steps`` steps."""
        dof = self.d - 2 if self.chi2_dof is None else self.chi2_dof
        return PtHyper(int(self.act[0]), int(self.act[1]), float(self.mu), float(self.eta),
                       int(self.batch), float(self.noise_sd), int(dof), int(n_steps),
                       float(stop_level), bool(stop_abs))


@dataclass(frozen=True)
class PretrainedStart:
    """The runs' start (P1): the master seed of their streams, how many, and a₀ (None: 1/d²)."""

    seed: int
    runs: int
    scale0: float | None = None

    @classmethod
    def from_config(cls, config) -> PretrainedStart:
        return cls(run_seed(config.seed, 0, "data"), int(config.runs), config.options.scale0)


@dataclass(frozen=True)
class StepDraws:
    """One step's variates (tests' :func:`step_given`): xu, xz, ε (b,) and Q ~ χ²_{d−2}."""

    xu: np.ndarray
    xz: np.ndarray
    eps: np.ndarray
    q: float


# ---------------------------------------------------------------------- the step (numba)
@njit(cache=True, inline="always")
def _add_example(hyp, a, m, nu, sums, xu, xz, eps):
    """(P2): sums (Σδxu, Σδxz, Σδs, Σδ²) with one more example."""
    s = m * xu + nu * xz
    y = sigma(xu, hyp.code, hyp.hp) + hyp.noise_sd * eps
    yhat, dyhat = sigma_and_deriv(hyp.mu * xu + a * s, hyp.code, hyp.hp)
    delta = (yhat - y) * dyhat
    return (sums[0] + delta * xu, sums[1] + delta * xz, sums[2] + delta * s,
            sums[3] + delta * delta)


@njit(cache=True, inline="always")
def _update(hyp, a, m, nu, sums, q):
    """(P3)–(P4): (a′, m′, ν′) from the batch sums of :func:`_add_example` and Q ~ χ²_{d−2}."""
    inv_b = 1.0 / hyp.batch
    ea = hyp.eta * a
    pm = m - ea * sums[0] * inv_b
    pz = nu - ea * sums[1] * inv_b
    rest = pz * pz + ea * ea * sums[3] * inv_b * inv_b * q
    nrm = math.sqrt(pm * pm + rest)
    inv = 1.0 / nrm if nrm > 0.0 else math.nan
    return a - hyp.eta * sums[2] * inv_b, pm * inv, math.sqrt(rest) * inv


@njit(cache=True, inline="always")
def _pt_step(ctx, sc, _t):
    """One step from sc = (stream, a, m, ν): (sc′, status) (:func:`._drive.drive`)."""
    hyp, chi2_prep, use_stop = ctx[1], ctx[2], ctx[3]
    st, a, m, nu = sc
    sums = (0.0, 0.0, 0.0, 0.0)
    for _n in range(hyp.batch):
        xu, st = _rng.normal(st)
        xz, st = _rng.normal(st)
        eps = 0.0
        if hyp.noise_sd > 0.0:
            eps, st = _rng.normal(st)
        sums = _add_example(hyp, a, m, nu, sums, xu, xz, eps)
    q, st = _rng.chi2_prepared(chi2_prep, st)
    a, m, nu = _update(hyp, a, m, nu, sums, q)
    status = overlap_status(m, nu, use_stop, hyp.stop_level, hyp.stop_abs)
    if not math.isfinite(a):
        status = DIVERGED
    return (st, a, m, nu), status


@njit(cache=True, inline="always")
def _pt_record(ctx, sc, c):
    """Checkpoint c of run r: a into cp_a[r, c], m into cp_m[r, c]."""
    ctx[4][ctx[0], c] = sc[1]
    ctx[5][ctx[0], c] = sc[2]


@njit(cache=True, _nrt=False)  # allocates nothing; see _drive on reference counting
def _run_one(r, hyp, sc, cp_steps, cp_a, cp_m):
    """Advance run r from sc = (stream, a, m, ν) by up to ``hyp.n_steps`` steps, recording
    at ``cp_steps`` into row r of cp_a, cp_m; (sc, div_step, hit_step) as :func:`._drive.drive`."""
    ctx = (r, hyp, _rng.chi2_prepare(hyp.dof), math.isfinite(hyp.stop_level), cp_a, cp_m)
    return drive(_pt_step, _pt_record, ctx, sc, hyp.n_steps, cp_steps)


@njit(cache=True, nogil=True)
def _advance_block(lo, hi, hyp, states, a, m, nu, div, hit, cp_steps, cp_a, cp_m):
    for r in range(lo, hi):
        sc, div[r], hit[r] = _run_one(r, hyp, (states[r], a[r], m[r], nu[r]), cp_steps, cp_a,
                                      cp_m)
        states[r], a[r], m[r], nu[r] = sc


@njit(cache=True)
def _step_given(hyp, a, m, nu, xu, xz, eps, q):
    sums = (0.0, 0.0, 0.0, 0.0)
    for n in range(xu.shape[0]):
        sums = _add_example(hyp, a, m, nu, sums, xu[n], xz[n], eps[n])
    return _update(hyp, a, m, nu, sums, q)


def step_given(settings: PretrainedSettings, a: float, m: float,
               draws: StepDraws) -> tuple[float, float]:
    """One step (P2)–(P4) from (a, m), ν = √(1 − m²), on given ``draws`` (tests): (a′, m′)."""
    f64 = np.float64
    a1, m1, _ = _step_given(settings.hyper(1), f64(a), f64(m), f64(math.sqrt(1.0 - m * m)),
                            *(np.ascontiguousarray(x, dtype=f64)
                              for x in (draws.xu, draws.xz, draws.eps)), f64(draws.q))
    return float(a1), float(m1)


# ---------------------------------------------------------------------- runs
def initial_runs(settings: PretrainedSettings, start: PretrainedStart) -> dict:
    """(P1): the runs' per-run arrays ``states``, ``a``, ``m``, ``nu`` at step 0."""
    states = np.zeros(start.runs, dtype=np.uint64)
    m, nu = np.empty(start.runs), np.empty(start.runs)
    _kernel.init_runs(start.seed, settings.d, states, m, nu)
    a0 = 1.0 / settings.d**2 if start.scale0 is None else float(start.scale0)
    return {"states": states, "a": np.full(start.runs, a0), "m": m, "nu": nu}


def _advance(hyp: PtHyper, state: dict, cp: np.ndarray, rec: dict):
    """All runs of ``state`` (in place) by ``hyp.n_steps`` on numba's threads; (div, hit)."""
    n = state["m"].shape[0]
    div, hit = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    over_runs(_advance_block, n, hyp, state["states"], state["a"], state["m"], state["nu"],
              div, hit, np.asarray(cp, dtype=np.int64), rec["a"], rec["m"])
    return div, hit


def advance_recording(settings: PretrainedSettings, state: dict, n_steps: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Advance ``state`` (:func:`initial_runs`'s arrays, in place) by ``n_steps`` steps,
    recording after every one: (a, m) of shape (R, n_steps) and div (R,), the step of the
    call a run diverged at (−1: not; frozen there, its later records repeat its state). Calls
    in blocks give the numbers of one call over the whole span (each run's own stream)."""
    n = int(n_steps)
    runs = state["m"].shape[0]
    rec = {"a": np.empty((runs, n)), "m": np.empty((runs, n))}
    div, _ = _advance(settings.hyper(n), state, np.arange(1, n + 1, dtype=np.int64), rec)
    return rec["a"], rec["m"], div


class PretrainedRun(ChainRun):
    """The chain's runs between segments: per run the stream, a, m and ν; records a and m.
    ``origin``: (config, instances) of an engine run, which :meth:`trajectory` needs."""

    name = "pretrained"

    def __init__(self, settings: PretrainedSettings, start: PretrainedStart, steps,
                 origin=None):
        self.settings, self.origin = settings, origin
        per_run = initial_runs(settings, start)
        self.m0 = per_run["m"].copy()
        shape = (start.runs, len(steps))
        super().__init__(steps, per_run, {"a": np.empty(shape), "m": np.empty(shape)})

    def _kernel(self, state, rec, n_steps, cp, more):
        return _advance(self.settings.hyper(n_steps), state, cp, rec)

    def records_masked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps, a, m) recorded so far, NaN from each run's divergence on."""
        steps, rec = self.recorded()
        dead = (self.div[:, None] >= 0) & (steps[None, :] >= self.div[:, None])
        return steps, np.where(dead, np.nan, rec["a"]), np.where(dead, np.nan, rec["m"])

    def trajectory(self) -> Trajectory:
        """The learner's own Trajectory of the records (``PretrainedGLM.trajectory``: overlap
        |m|, the exact population loss, the population flow from each run's start, extras
        ``scale`` (a) and signed ``m``); m₀ = |m| at step 0."""
        from dynamics.learners.pretrained_glm import PretrainedGLM

        config, instances = self.origin
        steps, rec = self.recorded()
        result = RunResult(replace(config, dtype="float64"), instances, steps,
                           {"overlap": np.abs(rec["m"]), "scale": rec["a"], "m": rec["m"]},
                           self.div.copy(), np.abs(self.m0), "cpu", engine=ENGINE)
        return PretrainedGLM.trajectory(result)


def run_chain(settings: PretrainedSettings, start: PretrainedStart, steps) -> PretrainedRun:
    """``start``'s runs driven to the last of the checkpoint ``steps`` (read them with
    :meth:`PretrainedRun.records_masked`)."""
    return run_to_end(PretrainedRun(settings, start, np.asarray(steps, dtype=np.int64)))


# ---------------------------------------------------------------------- the engine's chain
def pretrained_supported(config) -> tuple[bool, str]:
    """(True, "") when the chain applies to ``config``, else (False, one-line reason)."""
    if config.learner != LEARNER:
        return False, f"reduced engine: the pretrained chain is {LEARNER!r}'s, not " \
                      f"{config.learner!r}'s"
    act = str(config.instance.get("activation"))
    if act_code(act) is None:
        return False, (f"reduced engine: activation {act!r} has no compiled version for the "
                       "pretrained chain (numba only)")
    return True, ""


def _check(config, backend) -> None:
    if backend not in (None, "numba"):
        raise ValueError(f"the pretrained chain has only the numba backend, got {backend!r}")
    ok, why = pretrained_supported(config)
    if not ok:
        raise ValueError(why)


def start_pretrained(config, *, backend: str | None = None, _chi2_dof: int | None = None,
                     instances=None) -> PretrainedRun:
    """:func:`simulate_pretrained`'s runs at step 0, to advance in segments (:mod:`.segments`)."""
    _check(config, backend)
    instances = config.run_instances() if instances is None else instances
    settings = PretrainedSettings.from_config(config, instances[0].d, _chi2_dof)
    steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
    return PretrainedRun(settings, PretrainedStart.from_config(config), steps,
                         (config, instances))


def simulate_pretrained(config, *, backend: str | None = None, _chi2_dof: int | None = None,
                        instances=None) -> Trajectory:
    """The learner's Trajectory from the exact chain (float64, CPU); ``_chi2_dof``: test hook."""
    return run_to_end(start_pretrained(config, backend=backend, _chi2_dof=_chi2_dof,
                                       instances=instances)).trajectory()


def first_passage_pretrained(config, level: float, max_steps: int | None = None, *,
                             absolute: bool = True, backend: str | None = None) -> np.ndarray:
    """(R,) first step with m ≥ ``level`` (|m| if ``absolute``), NaN if not by ``max_steps``
    (default ``config.steps``); runs stop at their hit, diverged runs count as never."""
    _check(config, backend)
    settings = PretrainedSettings.from_config(config, config.run_instances()[0].d)
    state = initial_runs(settings, PretrainedStart.from_config(config))
    m0 = state["m"].copy()
    n = int(config.steps if max_steps is None else max_steps)
    empty = np.empty((config.runs, 0))
    _, hit = _advance(settings.hyper(n, float(level), absolute), state, np.zeros(0, np.int64),
                      {"a": empty, "m": empty})
    return passage_steps(hit, (np.abs(m0) if absolute else m0) >= level)


class PretrainedChain(ExactChain):
    """The exact chain in (a, m) of the ``pretrained-glm`` learner (module docstring)."""

    name = "pretrained"

    def supported(self, config) -> tuple[bool, str]:
        return pretrained_supported(config)

    def simulate(self, config, *, instances=None, backend=None, _chi2_dof=None) -> Trajectory:
        return simulate_pretrained(config, backend=backend, _chi2_dof=_chi2_dof,
                                   instances=instances)

    def start(self, config, *, instances=None, backend=None,
              _chi2_dof=None) -> PretrainedRun:
        return start_pretrained(config, backend=backend, _chi2_dof=_chi2_dof,
                                instances=instances)

    def first_passages(self, config, levels, max_steps=None, *, absolute=True,
                       backend=None, quantity="overlap") -> np.ndarray:
        self.require_quantity(quantity)
        return np.array([first_passage_pretrained(config, x, max_steps, absolute=absolute,
                                                  backend=backend) for x in levels])
