r"""The exact reduced chain of the ``pretrained-glm`` learner: (a, m) (mixed base: (a, m, q))
at O(b) cost per step.

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

(P2′) *Teacher and labels.* The options ``teacher_activation`` (σ*) and ``labels`` = y2 change
     only the label: y = σ*(xu) or σ*(xu)², plus √noise·ε. It is a function of xu and ε, so
     (P0)–(P4) hold as they stand.

The mixed base w₀ = μu + (1 − μ)ζ (option ``base`` = mixed; ζ unit, uniform, fixed per run)
------------------------------------------------------------------------------------------
(M0) *Markov property.* Write ζ = ρu + ρ̄e with ρ = ⟨ζ, u⟩, ρ̄ = √(1 − ρ²), e ⊥ u unit, and
     v = m u + p e + r w with w ⊥ span(u, e) unit, r = √(1 − m² − p²) ≥ 0. The law of x, the
     teacher and w₀ are invariant under the rotations fixing u and ζ (so u and e), and the
     step map is equivariant, so given ρ the next (a, m, p) depends on the state only
     through (a, m, p): (a, m, p) is a Markov chain; the recorded q = ⟨v, ζ⟩ = ρm + ρ̄p is a
     bijective function of it. In a basis (u, e, w, rest) one example is x = (xu, xe, xw, r):
     xu, xe, xw ~ N(0, 1), r ~ N(0, I_{d−3}), independent.
(M1) *Initial law.* ζ and v₀ independent, uniform on S^{d−1}: ρ = g/√(g² + Q), g ~ N(0, 1),
     Q ~ χ²_{d−1}; m₀, ν₀ = √(1 − m₀²) as (P1); the part of v₀ ⊥ u is ν₀ times a uniform
     unit vector of u^⊥ (independent of m₀), whose e-coordinate is g′/√(g′² + Q′), g′ ~ N(0, 1),
     Q′ ~ χ²_{d−2}: p₀ = ν₀g′/√(g′² + Q′), r₀ = ν₀√Q′/√(g′² + Q′). ρ, g′, Q′ come from the run's
     stream after (P1)'s draws.
(M2) *One example.* ⟨ζ, x⟩ = ρxu + ρ̄xe, s = m xu + p xe + r xw,
     λ = μxu + (1 − μ)⟨ζ, x⟩ + a s, δ = (σ(λ) − y)σ′(λ) with y as (P2′); ∂L/∂a = δs,
     ∂L/∂v = aδx. Batch means G_u, G_e, G_w, G_s of δxu, δxe, δxw, δs; the rest mean δ r.
(M3) *Step.* a′ = a − ηG_s; ṽ has components m − ηaG_u, p − ηaG_e, r − ηaG_w along u, e, w
     and −ηa mean δ r in the rest, so with N = ‖ṽ‖
       m′ = (m − ηaG_u)/N,  p′ = (p − ηaG_e)/N,  r′ = √((r − ηaG_w)² + η²a²ρ_r²)/N,
       N² = (m − ηaG_u)² + (p − ηaG_e)² + (r − ηaG_w)² + η²a²ρ_r²,   ρ_r² = ‖mean δ r‖²
     (r carried along, like ν, for precision near |m| = 1).
(M4) *The rest.* As (P4) with d − 3 directions: ρ_r² = (Σδₙ²/b²)·Q, Q ~ χ²_{d−3}.
Cost per step: 3b normals (+ b for label noise) and one χ²; records q and ρ besides a and m.

Records: a and m at the checkpoints (and q = ⟨v, ζ⟩ for the mixed base); the overlap is |m|
(a v is invariant under (a, v) → (−a, −v)). Cost per step: 2b normals (+ b for label noise)
and one χ², O(b) flops, independent of d. Divergence (non-finite a, m or ν, or
|m| > 1 + 1e-12) marks and freezes a run; its records read NaN from then on. Runs advance in
blocks on numba's threads, each on its own SplitMix64 stream seeded from (seed, r)
(:mod:`._rng`), so a run's numbers depend on neither R nor the thread count.
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
                                 "n_steps", "stop_level", "stop_abs", "tcode", "thp",
                                 "squared"])
PtHyper.__doc__ = """The kernels' settings: σ's (code, p), μ, η, batch b, label-noise sd,
χ² dof of the rest (d − 2; mixed base d − 3), horizon, stop level of m (inf: none), whether it
applies to |m|, the teacher σ*'s (code, p) and whether the labels are squared (y²)."""


@dataclass(frozen=True)
class PretrainedSettings:
    """The chain's regime: σ's numba (code, p), the base's μ, step size η, batch b, label-noise
    standard deviation and dimension d; the teacher σ*'s (code, p) (None: σ), squared labels
    y² (``squared``) and the mixed base (``mixed``). ``chi2_dof`` replaces the rest's χ² dof
    (d − 2, mixed d − 3; a test hook: a deliberately wrong law)."""

    act: tuple[int, int]
    mu: float
    eta: float
    batch: int
    noise_sd: float
    d: int
    chi2_dof: int | None = None
    teacher: tuple[int, int] | None = None
    squared: bool = False
    mixed: bool = False

    @classmethod
    def from_config(cls, config, d: int, chi2_dof: int | None = None) -> PretrainedSettings:
        """The settings of a ``pretrained-glm`` config whose instances have dimension d."""
        opts = config.options
        teacher = getattr(opts, "teacher_activation", None)
        return cls(act_code(str(config.instance.get("activation"))), float(opts.mu),
                   float(config.eta), int(config.batch), math.sqrt(config.label_noise), int(d),
                   chi2_dof, None if teacher is None else act_code(teacher),
                   getattr(opts, "labels", "y") == "y2",
                   getattr(opts, "base", "aligned") == "mixed")

    def hyper(self, n_steps: int, stop_level: float = math.inf,
              stop_abs: bool = True) -> PtHyper:
        """The kernels' :data:`PtHyper` for a call of ``n_steps`` steps."""
        dof = self.d - (3 if self.mixed else 2) if self.chi2_dof is None else self.chi2_dof
        teacher = self.act if self.teacher is None else self.teacher
        return PtHyper(int(self.act[0]), int(self.act[1]), float(self.mu), float(self.eta),
                       int(self.batch), float(self.noise_sd), int(dof), int(n_steps),
                       float(stop_level), bool(stop_abs), int(teacher[0]), int(teacher[1]),
                       bool(self.squared))


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
    """One step's variates (tests' :func:`step_given`): xu, xz, ε (b,) and Q ~ χ²_{d−2}; for
    the mixed base (M3) xz is x_e, ``xw`` x_w (b,) and Q ~ χ²_{d−3}."""

    xu: np.ndarray
    xz: np.ndarray
    eps: np.ndarray
    q: float
    xw: np.ndarray | None = None


# ---------------------------------------------------------------------- the step (numba)
@njit(cache=True, inline="always")
def _add_example(hyp, a, m, nu, sums, xu, xz, eps):
    """(P2): sums (Σδxu, Σδxz, Σδs, Σδ²) with one more example."""
    s = m * xu + nu * xz
    yhat, dyhat = sigma_and_deriv(hyp.mu * xu + a * s, hyp.code, hyp.hp)
    delta = (yhat - _label(hyp, xu, eps)) * dyhat
    return (sums[0] + delta * xu, sums[1] + delta * xz, sums[2] + delta * s,
            sums[3] + delta * delta)


@njit(cache=True, inline="always")
def _label(hyp, xu, eps):
    """(P2′) y = σ*(xu) or σ*(xu)² (``squared``), plus √noise·ε."""
    y = sigma(xu, hyp.tcode, hyp.thp)
    if hyp.squared:
        y = y * y
    return y + hyp.noise_sd * eps


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


# ---------------------------------------------------------------------- the mixed base (numba)
@njit(cache=True, inline="always")
def _add_example_mixed(hyp, geo, a, mpr, sums, xu, xe, xw, eps):
    """(M2): sums (Σδxu, Σδxe, Σδxw, Σδs, Σδ²) with one more example; geo = (ρ, ρ̄),
    mpr = (m, p, r)."""
    s = mpr[0] * xu + mpr[1] * xe + mpr[2] * xw
    base = hyp.mu * xu + (1.0 - hyp.mu) * (geo[0] * xu + geo[1] * xe)
    yhat, dyhat = sigma_and_deriv(base + a * s, hyp.code, hyp.hp)
    delta = (yhat - _label(hyp, xu, eps)) * dyhat
    return (sums[0] + delta * xu, sums[1] + delta * xe, sums[2] + delta * xw,
            sums[3] + delta * s, sums[4] + delta * delta)


@njit(cache=True, inline="always")
def _update_mixed(hyp, a, mpr, sums, q):
    """(M3)–(M4): (a′, m′, p′, r′) from the sums of :func:`_add_example_mixed` and
    Q ~ χ²_{d−3}."""
    inv_b = 1.0 / hyp.batch
    ea = hyp.eta * a
    pm = mpr[0] - ea * sums[0] * inv_b
    pe = mpr[1] - ea * sums[1] * inv_b
    pw = mpr[2] - ea * sums[2] * inv_b
    rest = pw * pw + ea * ea * sums[4] * inv_b * inv_b * q
    nrm = math.sqrt(pm * pm + pe * pe + rest)
    inv = 1.0 / nrm if nrm > 0.0 else math.nan
    return a - hyp.eta * sums[3] * inv_b, pm * inv, pe * inv, math.sqrt(rest) * inv


@njit(cache=True, inline="always")
def _mixed_step(ctx, sc, _t):
    """One step of the mixed base from sc = (stream, a, m, p, r): (sc′, status)."""
    hyp, chi2_prep, use_stop, geo = ctx[1], ctx[2], ctx[3], ctx[7]
    st, a, m, p, r = sc
    sums = (0.0, 0.0, 0.0, 0.0, 0.0)
    for _n in range(hyp.batch):
        xu, st = _rng.normal(st)
        xe, st = _rng.normal(st)
        xw, st = _rng.normal(st)
        eps = 0.0
        if hyp.noise_sd > 0.0:
            eps, st = _rng.normal(st)
        sums = _add_example_mixed(hyp, geo, a, (m, p, r), sums, xu, xe, xw, eps)
    q, st = _rng.chi2_prepared(chi2_prep, st)
    a, m, p, r = _update_mixed(hyp, a, (m, p, r), sums, q)
    status = overlap_status(m, r, use_stop, hyp.stop_level, hyp.stop_abs)
    if not (math.isfinite(a) and math.isfinite(p)):
        status = DIVERGED
    return (st, a, m, p, r), status


@njit(cache=True, inline="always")
def _mixed_record(ctx, sc, c):
    """Checkpoint c of run r: a, m and q = ρm + ρ̄p into cp_a, cp_m, cp_q."""
    geo = ctx[7]
    ctx[4][ctx[0], c] = sc[1]
    ctx[5][ctx[0], c] = sc[2]
    ctx[6][ctx[0], c] = geo[0] * sc[2] + geo[1] * sc[3]


@njit(cache=True, _nrt=False)
def _run_one_mixed(r, hyp, geo, sc, cp_steps, cp_a, cp_m, cp_q):
    """:func:`_run_one` for the mixed base: sc = (stream, a, m, p, r), geo = (ρ, ρ̄)."""
    ctx = (r, hyp, _rng.chi2_prepare(hyp.dof), math.isfinite(hyp.stop_level), cp_a, cp_m,
           cp_q, geo)
    return drive(_mixed_step, _mixed_record, ctx, sc, hyp.n_steps, cp_steps)


@njit(cache=True, nogil=True)
def _advance_block_mixed(lo, hi, hyp, states, a, mpr, rho, div, hit, cp_steps, cp_a, cp_m,
                         cp_q):
    """Runs lo … hi − 1 of the mixed base; mpr (R, 3): m, p, r."""
    for r in range(lo, hi):
        geo = (rho[r], math.sqrt(1.0 - rho[r] * rho[r]))
        sc = (states[r], a[r], mpr[r, 0], mpr[r, 1], mpr[r, 2])
        sc, div[r], hit[r] = _run_one_mixed(r, hyp, geo, sc, cp_steps, cp_a, cp_m, cp_q)
        states[r], a[r], mpr[r, 0], mpr[r, 1], mpr[r, 2] = sc


@njit(cache=True, nogil=True)
def _init_block_mixed(lo, hi, d, states, rho, mpr):
    """(M1): ρ = g/√(g² + χ²_{d−1}) (ζ uniform), and v₀'s part ⊥ u (norm ν₀ = mpr[r, 2] on
    entry, uniform on the sphere of u^⊥) split into p₀ = ν₀g′/√(g′² + Q′) along e and
    r₀ = ν₀√Q′/√(g′² + Q′), Q′ ~ χ²_{d−2}: from each run's stream after
    :func:`._kernel.init_runs`."""
    for r in range(lo, hi):
        st = states[r]
        g, st = _rng.normal(st)
        q, st = _rng.chi2(d - 1, st)
        rho[r] = g / math.sqrt(g * g + q)
        g, st = _rng.normal(st)
        q, st = _rng.chi2(d - 2, st)
        nrm = math.sqrt(g * g + q)
        nu = mpr[r, 2]
        mpr[r, 1], mpr[r, 2] = nu * g / nrm, nu * math.sqrt(q) / nrm
        states[r] = st


@njit(cache=True)
def _step_given_mixed(hyp, geo, a, mpr, xu, xe, xw, eps, q):
    sums = (0.0, 0.0, 0.0, 0.0, 0.0)
    for n in range(xu.shape[0]):
        sums = _add_example_mixed(hyp, geo, a, mpr, sums, xu[n], xe[n], xw[n], eps[n])
    return _update_mixed(hyp, a, mpr, sums, q)


def step_given_mixed(settings: PretrainedSettings, rho: float, a: float, m: float, q: float,
                     draws: StepDraws) -> tuple[float, float, float]:
    """One step (M2)–(M4) of the mixed base from (a, m, q = ⟨v, ζ⟩), ⟨ζ, u⟩ = ρ, on given
    ``draws`` (xz = x_e, xw = x_w; tests): (a′, m′, q′)."""
    f64 = np.float64
    rho_bar = math.sqrt(1.0 - rho * rho)
    p = (q - rho * m) / rho_bar
    mpr = (f64(m), f64(p), f64(math.sqrt(max(0.0, 1.0 - m * m - p * p))))
    a1, m1, p1, _ = _step_given_mixed(settings.hyper(1), (f64(rho), f64(rho_bar)), f64(a), mpr,
                                      *(np.ascontiguousarray(x, dtype=f64)
                                        for x in (draws.xu, draws.xz, draws.xw, draws.eps)),
                                      f64(draws.q))
    return float(a1), float(m1), float(rho * m1 + rho_bar * p1)


# ---------------------------------------------------------------------- runs
def initial_runs(settings: PretrainedSettings, start: PretrainedStart) -> dict:
    """(P1): the runs' per-run arrays ``states``, ``a``, ``m``, ``nu`` at step 0."""
    states = np.zeros(start.runs, dtype=np.uint64)
    m, nu = np.empty(start.runs), np.empty(start.runs)
    _kernel.init_runs(start.seed, settings.d, states, m, nu)
    a0 = 1.0 / settings.d**2 if start.scale0 is None else float(start.scale0)
    if settings.mixed:  # (M1): ρ, and v₀'s split; mpr rows (m, p, r)
        rho, mpr = np.empty(start.runs), np.stack([m, np.zeros_like(m), nu], axis=1)
        over_runs(_init_block_mixed, start.runs, settings.d, states, rho, mpr)
        return {"states": states, "a": np.full(start.runs, a0), "mpr": mpr, "rho": rho}
    return {"states": states, "a": np.full(start.runs, a0), "m": m, "nu": nu}


def _advance(hyp: PtHyper, state: dict, cp: np.ndarray, rec: dict):
    """All runs of ``state`` (in place) by ``hyp.n_steps`` on numba's threads; (div, hit).
    The mixed base's state (``rho`` in it) records q = ⟨v, ζ⟩ into ``rec["q"]`` too."""
    n = state["a"].shape[0]
    div, hit = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    cp = np.asarray(cp, dtype=np.int64)
    if "rho" in state:
        over_runs(_advance_block_mixed, n, hyp, state["states"], state["a"], state["mpr"],
                  state["rho"], div, hit, cp, rec["a"], rec["m"], rec["q"])
    else:
        over_runs(_advance_block, n, hyp, state["states"], state["a"], state["m"],
                  state["nu"], div, hit, cp, rec["a"], rec["m"])
    return div, hit


def _m0(state: dict) -> np.ndarray:
    """A copy of the runs' m from :func:`initial_runs`'s arrays."""
    return (state["mpr"][:, 0] if "rho" in state else state["m"]).copy()


def _record_names(settings: PretrainedSettings) -> tuple[str, ...]:
    return ("a", "m", "q") if settings.mixed else ("a", "m")


def advance_recording(settings: PretrainedSettings, state: dict, n_steps: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Advance ``state`` (:func:`initial_runs`'s arrays, in place) by ``n_steps`` steps,
    recording after every one: (a, m) of shape (R, n_steps) and div (R,), the step of the
    call a run diverged at (−1: not; frozen there, its later records repeat its state). Calls
    in blocks give the numbers of one call over the whole span (each run's own stream)."""
    n = int(n_steps)
    runs = state["a"].shape[0]
    rec = {k: np.empty((runs, n)) for k in _record_names(settings)}
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
        self.m0 = _m0(per_run)
        shape = (start.runs, len(steps))
        super().__init__(steps, per_run, {k: np.empty(shape) for k in _record_names(settings)})

    def _kernel(self, state, rec, n_steps, cp, more):
        return _advance(self.settings.hyper(n_steps), state, cp, rec)

    def records_masked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps, a, m) recorded so far, NaN from each run's divergence on."""
        return self.recorded()[0], self.masked("a"), self.masked("m")

    def masked(self, name: str) -> np.ndarray:
        """Record ``name`` (a, m; q for the mixed base) so far, NaN from each run's
        divergence on."""
        steps, rec = self.recorded()
        dead = (self.div[:, None] >= 0) & (steps[None, :] >= self.div[:, None])
        return np.where(dead, np.nan, rec[name])

    @property
    def rho(self) -> np.ndarray | None:
        """(R,) ⟨ζ, u⟩ of the mixed base's runs; None for the aligned base."""
        return self.per_run["rho"].copy() if self.settings.mixed else None

    def trajectory(self) -> Trajectory:
        """The learner's own Trajectory of the records (``PretrainedGLM.trajectory``: overlap
        |m|, the exact population loss, the population flow from each run's start, extras
        ``scale`` (a) and signed ``m``); m₀ = |m| at step 0."""
        from dynamics.learners.pretrained_glm import PretrainedGLM

        config, instances = self.origin
        steps, rec = self.recorded()
        records = {"overlap": np.abs(rec["m"]), "scale": rec["a"], "m": rec["m"]}
        if self.settings.mixed:
            records |= {"q": rec["q"], "rho": np.repeat(self.rho[:, None], steps.size, 1)}
        result = RunResult(replace(config, dtype="float64"), instances, steps, records,
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
    teacher = getattr(getattr(config, "options", None), "teacher_activation", None)
    if teacher is not None and act_code(teacher) is None:
        return False, (f"reduced engine: teacher_activation {teacher!r} has no compiled "
                       "version for the pretrained chain (numba only)")
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
    m0 = _m0(state)
    n = int(config.steps if max_steps is None else max_steps)
    empty = np.empty((config.runs, 0))
    _, hit = _advance(settings.hyper(n, float(level), absolute), state, np.zeros(0, np.int64),
                      {k: empty for k in _record_names(settings)})
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
