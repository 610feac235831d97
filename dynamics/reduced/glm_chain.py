r"""The exact reduced chain of the ``glm`` learner: the overlap m = ⟨û, u⟩ at O(b) cost per step.

Derivation (from the full step of ``dynamics.learners.glm``; no approximation)
--------------------------------------------------------------------------------
x ~ N(0, I_d); teacher y = σ(⟨u, x⟩) + √noise·ε, ‖u‖ = 1; student û ∈ S^{d−1}.
Write û = m u + ν e with m = ⟨û, u⟩, ν = ‖û − m u‖ ≥ 0 and e the unit vector of û's part
⊥ u (any unit e ⊥ u when ν = 0).

(G0) *Markov property.* The law of x is invariant under every rotation Q fixing u; y depends
     on x through ⟨u, x⟩ only, so the step map F satisfies F(Qû, Qx) = Q F(û, x) and the law
     of the next state given û depends only on û's orbit under those rotations, i.e. on
     (m, ν) — and ν = √(1 − m²). So (m_t) is exactly a scalar Markov chain. In an orthonormal
     basis (u, e, rest) one example is x = (a, b, r): a, b ~ N(0, 1), r ~ N(0, I_{d−2}),
     independent, and s = ⟨û, x⟩ = m a + ν b.
(G1) *Initial law.* û₀ uniform on S^{d−1}: m₀ = g/√(g² + Q), ν₀ = √Q/√(g² + Q), g ~ N(0, 1),
     Q ~ χ²_{d−1} (the first coordinate of a normalised Gaussian vector). ``aligned``: m₀ ← |m₀|.
(G2) *Gradient.* L = (y − σ(s))², ∇_û L = g x, g = −2(y − σ(s))σ′(s); a mini-batch of b examples
     averages: Ḡ = Σₙ ḡₙ xₙ, ḡₙ = gₙ/b. Its components are G_u = Σḡₙaₙ, G_e = Σḡₙbₙ and
     G_r = Σḡₙrₙ ⊥ (u, e).
(G3) *Step.* û − η(I − ûûᵀ)Ḡ with S = ⟨û, Ḡ⟩ = m G_u + ν G_e has components
     m − η(G_u − S m) along u, ν − η(G_e − S ν) along e and −η G_r in the rest, so
       m' = (m − η(G_u − S m))/n,   ν' = √((ν − η(G_e − S ν))² + η²ρ²)/n,
       n² = (m − η(G_u − S m))² + (ν − η(G_e − S ν))² + η²ρ²,   ρ² = ‖G_r‖²,
     and the new e is the unit vector along the last two parts (again ⊥ u). ν is carried
     along (rather than √(1 − m²)) so that 1 − m² keeps full precision as m → ±1.
(G4) *The rest.* ḡ depends on (a, b, ε) only, and the rₙ are independent of them, so given ḡ,
     G_r ~ N(0, ‖ḡ‖² I_{d−2}): ρ² = ‖ḡ‖² χ²_{d−2}, one χ² per step whatever b. For b = 1:
     S = g s, and with ‖r‖² ~ χ²_{d−2} the step reads
       m' = ((1 + ηgs) m − ηga)/√(1 + η²g²(a² + b² + ‖r‖² − s²)),
     since n² = (1 + ηgs)² − 2ηgs(1 + ηgs) + η²g²‖x‖² = 1 + η²g²(‖x‖² − s²).

Cost per step: 2b normals (+ b for label noise) and one χ² (Marsaglia–Tsang Gamma), O(b)
flops, independent of d. Divergence (non-finite state or |m| > 1 + 1e-12) marks and freezes a
run, as in the full engine. Runs advance in blocks on numba's threads, each on its own SplitMix64
stream seeded from (seed, r) (:mod:`._rng`), so a run's numbers do not depend on R or on the
thread count.
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import replace

import numpy as np
from numba import njit

from dynamics.learners.base import RunResult
from dynamics.randomness.sampling import run_seed
from dynamics.reduced import _kernel, _rng
from dynamics.reduced._drive import drive, overlap_status
from dynamics.reduced.exact_chain import ExactChain, passage_steps
from dynamics.reduced.segments import ChainRun, run_to_end
from dynamics.runtime.run_threads import over_runs
from dynamics.runtime.trajectory import Trajectory, checkpoint_steps
from dynamics.setup.config import RunConfig
from hermite.activations_numba import act_code, sigma, sigma_and_deriv

__all__ = ["GLMChain", "GlmRun", "glm_supported", "simulate_glm", "start_glm",
           "first_passage_glm", "advance_glm", "GlmHyper", "GlmRuns"]

ENGINE = "reduced"


def glm_supported(config: RunConfig) -> tuple[bool, str]:
    """(True, "") when the chain applies to this glm config, else (False, one-line reason)."""
    act = str(config.instance.get("activation"))
    if act_code(act) is None:
        return False, (f"reduced engine: activation {act!r} has no compiled version for the "
                       "glm chain (numba only)")
    return True, ""


GlmHyper = namedtuple("GlmHyper", ["code", "hp", "dof", "eta", "batch", "noise_sd", "n_steps",
                                   "stop_level", "stop_abs"])
GlmHyper.__doc__ = """Settings of one call: σ's (code, p), χ² dof d − 2, η, batch b, label-noise
sd, horizon, stop level (inf: none) and whether it applies to |m|."""
GlmRuns = namedtuple("GlmRuns", ["states", "m", "nu", "div_step", "hit_step"])
GlmRuns.__doc__ = "The runs' streams, m, ν (advanced in place) and div/hit steps (R,)."


@njit(cache=True, inline="always")
def _glm_step(ctx, sc, _t):
    """One step (G2)–(G4) from sc = (stream, m, ν): (sc′, status) (:func:`._drive.drive`)."""
    _r, hyp, chi2_prep, inv_b, use_stop, _cp_m = ctx
    st, m, nu = sc
    code, hp = hyp.code, hyp.hp
    gu = 0.0
    ge = 0.0
    g2 = 0.0
    for _n in range(hyp.batch):
        a, st = _rng.normal(st)
        b, st = _rng.normal(st)
        y = sigma(a, code, hp)
        if hyp.noise_sd > 0.0:
            e, st = _rng.normal(st)
            y += hyp.noise_sd * e
        s = m * a + nu * b
        sv, sd = sigma_and_deriv(s, code, hp)
        g = -2.0 * (y - sv) * sd * inv_b
        gu += g * a
        ge += g * b
        g2 += g * g
    q, st = _rng.chi2_prepared(chi2_prep, st)
    eta = hyp.eta
    big_s = m * gu + nu * ge
    pm = m - eta * (gu - big_s * m)
    pe = nu - eta * (ge - big_s * nu)
    rest = pe * pe + eta * eta * g2 * q
    inv = 1.0 / math.sqrt(pm * pm + rest)
    m = pm * inv
    nu = math.sqrt(rest) * inv
    return (st, m, nu), overlap_status(m, nu, use_stop, hyp.stop_level, hyp.stop_abs)


@njit(cache=True, inline="always")
def _glm_record(ctx, sc, c):
    """Checkpoint c of run r: m into cp_m[r, c]."""
    ctx[5][ctx[0], c] = sc[1]


@njit(cache=True, _nrt=False)  # allocates nothing; see _drive on reference counting
def _run_glm(r, hyp, sc, cp_steps, cp_m):
    """Advance run r from sc = (stream, m, ν) by up to ``hyp.n_steps`` steps, recording m
    at ``cp_steps`` into row r of ``cp_m``. Returns (sc, div_step, hit_step) as
    :func:`._drive.drive` (divergence: non-finite state or |m| > 1 + M_TOL)."""
    ctx = (r, hyp, _rng.chi2_prepare(hyp.dof), 1.0 / hyp.batch, math.isfinite(hyp.stop_level),
           cp_m)
    return drive(_glm_step, _glm_record, ctx, sc, hyp.n_steps, cp_steps)


@njit(cache=True, nogil=True)
def _advance_block(lo, hi, hyp, runs, cp_steps, cp_m):
    for r in range(lo, hi):
        sc, runs.div_step[r], runs.hit_step[r] = _run_glm(
            r, hyp, (runs.states[r], runs.m[r], runs.nu[r]), cp_steps, cp_m)
        runs.states[r], runs.m[r], runs.nu[r] = sc


def advance_glm(hyp, runs, cp_steps, cp_m) -> None:
    """All runs of ``runs`` (:class:`GlmRuns`, in place) by ``hyp.n_steps`` steps on numba's
    threads (:func:`dynamics.runtime.run_threads.over_runs`); checkpoints into cp_m (R, C)."""
    over_runs(_advance_block, runs.m.shape[0], hyp, runs, cp_steps, cp_m)


def _start(config: RunConfig, instances=None):
    """Instances, (code, p) of σ, streams and (m₀, ν₀) of every run (G1)."""
    instances = config.run_instances() if instances is None else instances
    d = instances[0].d
    code, hp = act_code(instances[0].activation.name)
    runs = config.runs
    states = np.zeros(runs, dtype=np.uint64)
    m, nu = np.empty(runs), np.empty(runs)
    # (G1) is (R0) on the whole sphere: m₀ = g/√(g² + χ²_{d−1}), the same streams
    _kernel.init_runs(run_seed(config.seed, 0, "data"), d, states, m, nu)
    if config.options.init == "aligned":
        m = np.abs(m)
    return instances, (code, hp), states, m, nu


def _advance(config, instances, act, states, m, nu, cp, n_steps, stop_level=math.inf,
             stop_abs=True):
    runs = config.runs
    dof = instances[0].d - 2
    cp_m = np.empty((runs, len(cp)))
    div = np.full(runs, -1, dtype=np.int64)
    hit = np.full(runs, -1, dtype=np.int64)
    hyp = GlmHyper(act[0], act[1], int(dof), float(config.eta), config.batch,
                   math.sqrt(config.label_noise), int(n_steps), float(stop_level),
                   bool(stop_abs))
    advance_glm(hyp, GlmRuns(states, m, nu, div, hit), np.asarray(cp, dtype=np.int64), cp_m)
    return cp_m, div, hit


def _check(config: RunConfig, backend):
    if backend not in (None, "numba"):
        raise ValueError(f"the glm chain has only the numba backend, got {backend!r}")
    ok, why = glm_supported(config)
    if not ok:
        raise ValueError(why)


def simulate_glm(config: RunConfig, *, backend: str | None = None,
                 _chi2_dof: int | None = None, instances=None) -> Trajectory:
    """The glm learner's Trajectory from the exact chain (same observables as the full
    engine: ``GLM.trajectory``); float64 on CPU. ``_chi2_dof``: test hook (wrong law)."""
    return run_to_end(start_glm(config, backend=backend, _chi2_dof=_chi2_dof,
                                instances=instances)).trajectory()


def start_glm(config: RunConfig, *, backend: str | None = None, _chi2_dof: int | None = None,
              instances=None) -> GlmRun:
    """:func:`simulate_glm`'s runs at step 0, to advance in segments (:mod:`.segments`)."""
    _check(config, backend)
    instances, act, states, m, nu = _start(config, instances)
    steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
    return GlmRun(config, instances, act, states, m, nu, steps, _chi2_dof)


class GlmRun(ChainRun):
    """The glm chain's runs between segments: per run the stream, m and ν; records m."""

    name = "glm"

    def __init__(self, config, instances, act, states, m, nu, steps, dof=None):
        self.config, self.instances, self.m0 = config, instances, m.copy()
        dof = instances[0].d - 2 if dof is None else dof
        self.hyper = (act[0], act[1], int(dof), float(config.eta), config.batch,
                      math.sqrt(config.label_noise))
        super().__init__(steps, {"states": states, "m": m, "nu": nu},
                         {"m": np.empty((config.runs, len(steps)))})

    def _kernel(self, state, rec, n_steps, cp, more):
        n = state["m"].shape[0]
        div, hit = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        hyp = GlmHyper(*self.hyper, int(n_steps), math.inf, True)
        advance_glm(hyp, GlmRuns(state["states"], state["m"], state["nu"], div, hit), cp,
                    rec["m"])
        return div, hit

    def trajectory(self) -> Trajectory:
        from dynamics.learners.glm import GLM

        steps, rec = self.recorded()
        result = RunResult(replace(self.config, dtype="float64"), self.instances, steps,
                           {"overlap": rec["m"]}, self.div.copy(), self.m0, "cpu",
                           engine=ENGINE)
        return GLM.trajectory(result)


def first_passage_glm(config: RunConfig, level: float, max_steps: int | None = None, *,
                      absolute: bool = True, backend: str | None = None) -> np.ndarray:
    """(R,) first step with m ≥ ``level`` (|m| if ``absolute``), NaN if not by ``max_steps``
    (default ``config.steps``); runs stop at their hit, diverged runs count as never."""
    _check(config, backend)
    instances, act, states, m, nu = _start(config)
    m0 = m.copy()
    n = int(config.steps if max_steps is None else max_steps)
    _, _, hit = _advance(config, instances, act, states, m, nu, np.zeros(0, np.int64), n,
                         float(level), absolute)
    return passage_steps(hit, (np.abs(m0) if absolute else m0) >= level)


class GLMChain(ExactChain):
    """The exact scalar chain in m of the ``glm`` learner (module docstring), numba only."""

    name = "glm"

    def supported(self, config) -> tuple[bool, str]:
        return glm_supported(config)

    def simulate(self, config, *, instances=None, backend=None, _chi2_dof=None) -> Trajectory:
        return simulate_glm(config, backend=backend, _chi2_dof=_chi2_dof, instances=instances)

    def start(self, config, *, instances=None, backend=None, _chi2_dof=None) -> GlmRun:
        return start_glm(config, backend=backend, _chi2_dof=_chi2_dof, instances=instances)

    def first_passages(self, config, levels, max_steps=None, *, absolute=True,
                       backend=None, quantity="overlap") -> np.ndarray:
        self.require_quantity(quantity)
        return np.array([first_passage_glm(config, x, max_steps, absolute=absolute,
                                           backend=backend) for x in levels])
