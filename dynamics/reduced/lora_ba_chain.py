r"""The exact reduced chain of the ``lora-ba`` learner: (B, Z, S) at O(b(k + r)² + r³) per step.

Derivation (from the full step of ``dynamics.learners.lora_ba``; no approximation)
--------------------------------------------------------------------------------
Canonical frame: x ~ N(0, I_d), W = [L, 0] (rows in the first k coordinates), u = (u_w, u⊥, 0…);
A = span(W, e) is the first t = k + 1 coordinates. Student H = W + sBA, rows normalised.

(BA0) *Markov property.* The law of x, W, u, f* and the step map (B, A, x) ↦ (B′, A′) are
     invariant under every rotation O fixing A pointwise: F(B, AOᵀ, Ox) = (B′, A′Oᵀ). So the
     law of the next state given (B, A) depends on A only through its orbit: Z = A's first t
     coordinates (r × t) and S = A_⊥A_⊥ᵀ (r × r), A_⊥ the rest. Write A_⊥ = C Eᵀ, C lower
     triangular with CCᵀ = S (Cholesky), E orthonormal ((d − t) × r): [Z, C] is A in the basis
     (A, E), i.e. a reduced basis in the sense of ``linearized.reduce_rows`` (inner products
     with W, u and among A's rows preserved), so the learner's own ``update_observables``,
     ``true_loss`` and flow read the chain's records as the full engine's.
(BA1) *One example.* In the basis (A, E, rest) x = (x_A, x_E, ρ): x_A ~ N(0, I_t), x_E ~ N(0,
     I_r), ρ ~ N(0, I_{d−t−r}), independent. Wx = L x_A[:k], Ax = Z x_A + C x_E, teacher
     pre-activations V x_A (V the teacher rows' A-coordinates), label y = f* + ε, f* =
     Σλᵢσ*(⟨vᵢ, x⟩) (σ* = ``teacher_activation``, default σ), or y = f*² + ε (``labels`` y2):
     a function of (x_A, ε) either way, so (BA0) holds as it stands; nothing of the step but
     the A-gradient's rest part depends on ρ.
(BA2) *Gradient* (the learner's closed form): with P = Z_W Lᵀ, Q = ZZᵀ + CCᵀ, Nⱼ² = ‖wⱼ‖² +
     2s⟨wⱼ, (BA)ⱼ⟩ + s²(BQBᵀ)ⱼⱼ, gₙ, cₙ ∈ R^k per example and mₙ = Bᵀgₙ ∈ R^r, summed over
     the batch (c̄ = Σcₙ):
       ∂B = s(Σ gₙ(Axₙ)ᵀ − diag(c̄)(Pᵀ + sBQ)),
       ∂Z = s(Σ mₙx_{A,n}ᵀ − [Bᵀdiag(c̄)L, 0] − sBᵀdiag(c̄)B Z),
       ∂C_E = s(Σ mₙx_{E,n}ᵀ − sBᵀdiag(c̄)B C),   ∂A_rest = s Σ mₙρₙᵀ.
(BA3) *The rest.* The mₙ depend on (x_A, x_E, ε) only. Write the b rest parts as the rows of
     R = ΛQ_ρᵀ (LQ; Λ b × b lower triangular, Q_ρ orthonormal): ΛΛᵀ = RRᵀ ~ Wishart_b(d − t −
     r, I) and Λ is Bartlett's factor (Λₙₙ² ~ χ²_{d−t−r−n}, N(0, 1) below the diagonal), Q_ρ
     uniform and independent of Λ. Then Σ mₙρₙᵀ = (MΛ)Q_ρᵀ (M = [m₁ … m_b], r × b): the new
     A_⊥ lies in span(E, Q_ρ) with coordinates [C − (η/b)∂C_E, −(ηs/b)MΛ].
(BA4) *Step.* B′ = B − ρ_B(η/b)∂B (ρ_B = lr_ratio), Z′ = Z − (η/b)∂Z and
       S′ = C_E′C_E′ᵀ + (ηs/b)²(MΛ)(MΛ)ᵀ,   C_E′ = C − (η/b)∂C_E,   C′ = chol(S′),
     all from the pre-step state (as the full engine). A frozen: Z, C stay, only B moves (and
     Λ is not drawn).
(BA5) *Start.* A₀ with i.i.d. N(0, 1/d) entries: Z₀ i.i.d. N(0, 1/d), S₀ ~ Wishart_r(d − t, I)/d
     (C₀ = Bartlett's factor/√d, Cᵢᵢ² ~ χ²_{d−t−i}/d). Kaiming A₀ (U(−1/√d, 1/√d) entries in
     the canonical frame, so not rotation invariant and S₀ is not Wishart): Z₀ uniform, and S₀
     = Σ aaᵀ over the d − t rest columns a drawn one by one (O(r²d) flops once per run, no
     O(d) memory): exact. B₀ = 0 or i.i.d. N(0, b_scale²).

Given base and target rows (``dynamics.learners.lora_ba_rows``): A = span(W, W*), t = its
dimension (≤ 2k); W's coordinates (k × t) replace L in (BA1)–(BA2), V = W*'s (divided by their
norms where normalised); with rows as they are Nⱼ = 1 and cₙ = 0 (``LbHyper.normalize``). Nothing
else changes: (BA0) needs only rotations fixing A pointwise to fix W, W* and x's law.

Observables at checkpoints: B and [Z, C] (records ``b`` (R, C, k, r), ``a`` (R, C, r, t + r),
the full engine's shapes) handed to ``LoRABA.trajectory`` (overlap |⟨v₁(BA), u⟩|,
update_overlap, b_norm, a_norm, delta_norm, the exact loss, the population flow beside).
First passages stop a run at the first step with overlap ≥ level (:func:`.lora_ba_kernel.overlap`:
closed form for r = 1, power iteration on BᵀB·Q for r > 1). Needs d ≥ t + r + b.

Cost per step: b(t + r) normals (+ b label noise), b(b − 1)/2 normals and b χ² draws (A
trained), O(b(k + r)(t + r) + r³) flops, independent of d. Divergence (a non-finite residual or
state, or S′ not positive definite) freezes a run at its last finite state; its records read NaN
from then on. Runs advance in blocks on numba's threads, each on its own SplitMix64 stream
seeded from (seed, r) (:mod:`._rng`): a run's numbers depend on neither R nor the thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from dynamics.randomness.sampling import run_seed
from dynamics.reduced import lora_ba_kernel as _lk
from dynamics.reduced.exact_chain import ExactChain, passage_steps
from dynamics.reduced.segments import ChainRun, run_to_end
from dynamics.runtime.run_threads import over_runs
from dynamics.runtime.trajectory import RunResult, Trajectory, checkpoint_steps
from hermite.activations_numba import compiled_activation

__all__ = ["LEARNER", "LoraBASettings", "LoraBAStart", "LoraBARun", "LoraBAChain",
           "lora_ba_supported", "step_given", "min_dimension"]

ENGINE = "reduced"
LEARNER = "lora-ba"


def min_dimension(k: int, rank: int, batch: int, span: int | None = None) -> int:
    """The least d the chain reduces: t + r + b (t = k + 1, or ``span`` = dim span(W, W*))."""
    return (k + 1 if span is None else span) + rank + batch


def _teacher_code(options) -> tuple | None:
    """The compiled (code, p, asc) of the ``teacher_activation`` σ* (None: σ, or none
    compiled)."""
    from hermite.activations import get_activation

    name = options.teacher_activation
    return None if name is None else compiled_activation(get_activation(name))


def _span(config, instance) -> int | None:
    """t = dim span(W, W*) of given base/target rows (``lora_ba_rows``), None for the
    paper's teacher (t = k + 1)."""
    from dynamics.learners.lora_ba_rows import ba_rows_of_instances, is_general

    if not is_general(config.options):
        return None
    return ba_rows_of_instances(config.options, [instance]).t


@dataclass(frozen=True)
class LoraBASettings:
    """The chain's regime: σ(asc·x) by (code, p, asc), s = α/r, η, lr_ratio, A trained, batch
    b, label-noise sd, d, rank r, and ``rest_dof`` replacing d − t − r (a test hook: a
    deliberately wrong Wishart law); ``span`` t (None: k + 1) and ``normalize`` (rows divided
    by their norms) for given base/target rows (``dynamics.learners.lora_ba_rows``); the
    teacher σ*'s (code, p, asc) (None: σ) and ``squared`` labels y = f*²."""

    act: tuple
    scale: float
    eta: float
    lr_ratio: float
    train_a: bool
    batch: int
    noise_sd: float
    d: int
    k: int
    rest_dof: int | None = None
    span: int | None = None
    normalize: bool = True
    teacher: tuple | None = None
    squared: bool = False

    @classmethod
    def from_config(cls, config, instance, rest_dof: int | None = None) -> LoraBASettings:
        o = config.options
        r = int(o.rank)
        return cls(compiled_activation(instance.activation),
                   float((r if o.alpha is None else o.alpha) / r), float(config.eta),
                   float(o.lr_ratio), bool(o.train_a), int(config.batch),
                   math.sqrt(config.label_noise), int(instance.d), int(instance.k), rest_dof,
                   _span(config, instance), bool(o.normalize_rows), _teacher_code(o),
                   o.labels == "y2")

    def hyper(self, rank: int, n_steps: int, stop_level: float = math.inf) -> _lk.LbHyper:
        """The kernel's :data:`~.lora_ba_kernel.LbHyper` for a call of ``n_steps`` steps."""
        t = self.k + 1 if self.span is None else self.span
        dof = self.d - t - rank if self.rest_dof is None else self.rest_dof
        code, hp, asc = self.act
        tcode, thp, tasc = self.act if self.teacher is None else self.teacher
        return _lk.LbHyper(int(code), int(hp), float(asc), self.scale, self.eta,
                           self.lr_ratio, self.train_a, self.batch, self.noise_sd, int(dof),
                           int(n_steps), float(stop_level), self.normalize, int(tcode),
                           int(thp), float(tasc), bool(self.squared))


class LoraBAStart:
    """The runs' constants (per run: L (k×k), teacher rows V (k×t), λ (k), u (t); given rows:
    W (k×t) in L's place, ``lora_ba_rows.BARows``) and start (BA5): streams, B₀, Z₀, C₀;
    ``learner``: the full engine's learner of the batch (its ``trajectory`` reads the
    records); ``t`` the dimension of A = span(W, W*)."""

    def __init__(self, config, instances):
        import torch

        from dynamics.learners.lora_ba import LoRABA
        from dynamics.learners.problem import Problem

        self.config, self.instances = config, list(instances)
        p = Problem.from_instances(self.instances, "cpu", torch.float64)
        self.learner = LoRABA.from_config(config, p)
        runs, k = p.runs, p.k
        self.rank = r = int(config.options.rank)
        f64 = np.float64
        rows = self.learner.rows
        if rows is None:
            t = k + 1
            self.lf = np.ascontiguousarray(np.broadcast_to(p.l.numpy(), (runs, k, k)),
                                           dtype=f64)
            u = np.concatenate([np.broadcast_to(p.u_w.numpy(), (runs, k)),
                                p.u_perp.numpy()[:, None]], -1)
            base = np.concatenate([self.lf, np.zeros((runs, k, 1))], -1)
            self.vt = np.ascontiguousarray(base * p.t_scale.numpy()[..., None]
                                           + p.t_shift.numpy()[..., None] * u[:, None])
        else:  # given rows: W and W* (divided by its norms where normalised) in A's frame
            t, u = rows.t, rows.u
            self.lf, self.vt = (np.ascontiguousarray(a, dtype=f64) for a in (rows.w, rows.v))
        self.t = t
        self.lam = np.ascontiguousarray(np.broadcast_to(p.lam.numpy(), (runs, k)), dtype=f64)
        self.u = np.ascontiguousarray(u, dtype=f64)
        o = config.options
        d = self.instances[0].d
        self.state = {"states": np.zeros(runs, np.uint64), "b": np.zeros((runs, k, r)),
                      "z": np.zeros((runs, r, t)), "c": np.zeros((runs, r, r))}
        seed = run_seed(config.seed, 0, "data")
        b_scale = float(o.b_scale) if o.init_b == "gaussian" else 0.0
        w = _lk.work_arrays(k, r, t, 1)
        for i in range(runs):
            self.state["states"][i] = _lk.init_factors(
                seed, i, d, o.init_a == "kaiming", b_scale, self.state["b"][i],
                self.state["z"][i], self.state["c"][i], w)

    def records(self, b, z, c) -> dict:
        """Records (``b``, ``a`` = [Z, C]) of states b (R, …, k, r), z, c as the learner's."""
        return {"b": b, "a": np.concatenate([z, c], -1)}

    def overlap0(self) -> np.ndarray:
        """(R,) the runs' overlap at step 0 (NaN while B₀ = 0)."""
        rec = self.records(*(self.state[n][:, None] for n in ("b", "z", "c")))
        return self.learner.observables(self.instances, rec["b"], rec["a"])[0][:, 0]


def _advance(hyp, start: LoraBAStart, state: dict, cp, rec: dict):
    """The runs of ``state`` (in place) by ``hyp.n_steps`` steps on numba's threads; (div, hit)."""
    n = state["states"].shape[0]
    div, hit = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    idx = state.get("idx")
    consts = [a if idx is None else np.ascontiguousarray(a[idx])
              for a in (start.lf, start.vt, start.lam, start.u)]
    over_runs(_lk.advance_block, n, hyp, *consts, state["states"], state["b"], state["z"],
              state["c"], div, hit, np.asarray(cp, dtype=np.int64), rec["b"], rec["a"])
    return div, hit


class LoraBARun(ChainRun):
    """The chain's runs between segments: per run the stream, B, Z and C; records ``b`` and
    ``a`` = [Z, C] (the learner's own records)."""

    name = "lora-ba"

    def __init__(self, settings: LoraBASettings, start: LoraBAStart, steps):
        self.settings, self.start = settings, start
        self.m0 = start.overlap0()
        runs, k, r = start.state["b"].shape
        shape = (runs, len(steps))
        per_run = dict(start.state) | {"idx": np.arange(runs)}
        super().__init__(steps, per_run, {"b": np.empty(shape + (k, r)),
                                          "a": np.empty(shape + (r, start.t + r))})

    def _kernel(self, state, rec, n_steps, cp, more):
        return _advance(self.settings.hyper(self.start.rank, n_steps), self.start, state, cp,
                        rec)

    def trajectory(self) -> Trajectory:
        """``LoRABA.trajectory`` of the records (float64)."""
        config = self.start.config
        steps, rec = self.recorded()
        result = RunResult(replace(config, dtype="float64"), self.start.instances, steps,
                           dict(rec), self.div.copy(), self.m0, "cpu", engine=ENGINE)
        return self.start.learner.trajectory(result)


def step_given(settings: LoraBASettings, start: LoraBAStart, run: int, draws: dict) -> tuple:
    """One step (BA1)–(BA4) of run ``run`` from its current state on given ``draws`` (tests):
    ``xa`` (b, t), ``xe`` (b, r), ``eps`` (b,) (standard normals, times the noise sd),
    ``lam`` (b, b) the rest's Bartlett factor. Returns (B′, Z′, C′, Σ(y − f̂)²)."""
    b, z, c = (start.state[n][run] for n in ("b", "z", "c"))
    k, r = b.shape
    w = _lk.work_arrays(k, r, start.t, settings.batch)
    for i, name in enumerate(("xa", "xe", "eps", "lam")):
        w[i][...] = draws[name]
    rss = _lk.step(settings.hyper(r, 1), start.lf[run], start.vt[run], start.lam[run], b, z, c,
                   w)
    return w[16].copy(), w[17].copy(), w[18].copy(), rss


def lora_ba_supported(config) -> tuple[bool, str]:
    """(True, "") when the chain applies to ``config``, else (False, one-line reason)."""
    from dynamics.reduced.network_simulate import compiled_activation_missing

    if config.learner != LEARNER:
        return False, f"reduced engine: the lora-ba chain is {LEARNER!r}'s, not " \
                      f"{config.learner!r}'s"
    inst = config.instance
    why = compiled_activation_missing(inst, "lora-ba")
    if not why and config.options.teacher_activation is not None:
        why = compiled_activation_missing(
            {"activation": config.options.teacher_activation}, "lora-ba")
        why = why.replace("activation", "teacher_activation", 1)
    if why:
        return False, why
    k, d = int(inst["k"]), int(inst["d"])
    span = None
    if config.options.target_rows is not None:  # t = dim span(W, W*) of the given rows
        span = _span(config, config.run_instances()[0])
    need = min_dimension(k, int(config.options.rank), int(config.batch), span)
    if d < need:
        t = "k + 1" if span is None else "t"
        return False, (f"reduced engine: the lora-ba chain needs d ≥ {t} + r + b = {need} "
                       f"(here d = {d}); the full engine is cheap there")
    return True, ""


def _start(config, backend, instances, rest_dof) -> tuple[LoraBASettings, LoraBAStart]:
    if backend not in (None, "numba"):
        raise ValueError(f"the lora-ba chain has only the numba backend, got {backend!r}")
    ok, why = lora_ba_supported(config)
    if not ok:
        raise ValueError(why)
    instances = config.run_instances() if instances is None else instances
    start = LoraBAStart(config, instances)
    settings = LoraBASettings.from_config(config, instances[0], rest_dof)
    return replace(settings, span=None if start.learner.rows is None else start.t), start


class LoraBAChain(ExactChain):
    """The exact chain in (B, Z, S) of ``lora-ba`` (module docstring): any rank, A trained or
    frozen, LoRA+, any b, label noise, both initialisations; numba on CPU, float64."""

    name = "lora-ba"

    def supported(self, config) -> tuple[bool, str]:
        return lora_ba_supported(config)

    def start(self, config, *, instances=None, backend=None, _chi2_dof=None) -> LoraBARun:
        settings, start = _start(config, backend, instances, _chi2_dof)
        steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
        return LoraBARun(settings, start, steps)

    def simulate(self, config, *, instances=None, backend=None, _chi2_dof=None) -> Trajectory:
        return run_to_end(self.start(config, instances=instances, backend=backend,
                                     _chi2_dof=_chi2_dof)).trajectory()

    def first_passages(self, config, levels, max_steps=None, *, absolute=True,
                       backend=None, quantity="overlap") -> np.ndarray:
        """(L, R) first steps with overlap |⟨v₁(BA), u⟩| ≥ each level (NaN: not by
        ``max_steps``, default ``config.steps``; diverged runs never)."""
        self.require_quantity(quantity)
        n = int(config.steps if max_steps is None else max_steps)
        out = []
        for level in levels:
            settings, start = _start(config, backend, None, None)
            m0 = start.overlap0()
            empty = {"b": np.empty((len(m0), 0, 1, 1)), "a": np.empty((len(m0), 0, 1, 1))}
            _, hit = _advance(settings.hyper(start.rank, n, float(level)), start, start.state,
                              np.zeros(0, np.int64), empty)
            out.append(passage_steps(hit, np.nan_to_num(m0) >= level))
        return np.array(out)
