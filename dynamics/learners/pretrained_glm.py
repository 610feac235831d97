"""The ``pretrained-glm`` learner: LoRA-style fine-tuning of a pre-trained single-index model
(issue 39; Nwemadji, Loureiro & Barbier 2026, "When pre-training hurts LoRA fine-tuning").

Teacher y = σ(⟨u, x⟩) (+ label noise ε, variance ``label_noise``) with the instance's u (W, λ,
c and ξ are ignored, as in ``glm``). Pre-trained base w₀ = μu, 0 < μ < 1 (option ``mu``);
student ŷ = σ(⟨μu + a v, x⟩) with a scalar a (option ``scale0``: a₀, default 1/d²) and a unit
v (uniform on S^{d−1}), both trained by online SGD on B fresh examples per step, loss
½·mean_n (y_n − ŷ_n)², one constant η. With λ_n = ⟨μu + av, x_n⟩, δ_n = (ŷ_n − y_n)σ′(λ_n)
and s_n = ⟨v, x_n⟩, one step from (a, v) is

    a′ = a − η (1/B)Σ δ_n s_n,   ṽ = v − η a (1/B)Σ δ_n x_n,   v′ = ṽ/‖ṽ‖

(plain SGD on v, then renormalised: no tangent projection). Observables (m = ⟨v, u⟩):
``overlap`` |m| (a·v is invariant under (a, v) → (−a, −v)), extras ``scale`` (a) and ``m``;
the exact population loss ½E[(σ(ν) − σ(λ))²], λ = (μ + am)ν + a√(1 − m²)z, without the label
noise (:func:`pretrained_glm_loss`); theory line ``ode``: |m| of the population flow of (a, m)
from each run's own start (:func:`pretrained_glm_ode`; ``hermite.flows.pretrained``). Reduced
engine: the exact chain in (a, m) (``dynamics.reduced.pretrained_chain``).

Options beyond the default (all default to today's model, bit for bit): ``base`` = mixed,
w₀ = μu + (1 − μ)ζ with ζ uniform on S^{d−1}, drawn once per run from its own stream
(seed, r, ``base``: :func:`base_directions`), so λ_n = ⟨w₀ + av, x_n⟩, with extras ``q``
(⟨v, ζ⟩) and ``rho`` (⟨ζ, u⟩, constant); ``teacher_activation`` σ*: y = σ*(⟨u, x⟩);
``labels`` = y2: y = σ*(⟨u, x⟩)² (then + noise). The step is the same with these λ_n and y_n;
loss and theory line from ``hermite.flows.pretrained``'s general setting (:class:`Pretraining`),
the chain in (a, m, q) for the mixed base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dynamics.activations import torch_activation
from dynamics.lazy import lazy_import
from dynamics.learners.base import Learner, Memory, RunResult, TensorState, make_trajectory
from dynamics.learners.directions import overlap_np
from dynamics.learners.options import Options, option
from dynamics.learners.problem import Problem
from dynamics.measures.losses import LOSS_EXACT
from dynamics.randomness.sampling import run_seed, uniform_perp_directions
from hermite.flows.pretrained import (
    LABELS,
    Pretraining,
    general_flow,
    general_loss,
    pretrained_flow,
    pretrained_loss,
)

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["PretrainedGLM", "PretrainedGLMOptions", "PretrainedGLMState", "PretrainedGLMPrepared",
           "pretrained_glm_loss", "pretrained_glm_ode", "base_directions", "BASES"]

OVERLAP_TOL = 1e3  # |m| > 1 + OVERLAP_TOL·eps(dtype) counts as diverged
BASES = ("aligned", "mixed")


@dataclass
class PretrainedGLMState(TensorState):
    """State of R runs of the pretrained-glm learner."""

    a: torch.Tensor  # (R,) scale of the update a·v
    v: torch.Tensor  # (R, d) unit direction of the update, canonical frame
    step: int = 0  # SGD steps taken


@dataclass
class PretrainedGLMPrepared:
    """State-independent terms of a chunk of examples x (R, n, b, d)."""

    y: torch.Tensor  # (R, n, b) labels σ*(⟨u, x⟩) or its square (+ label noise)
    w0_x: torch.Tensor  # (R, n, b) ⟨w₀, x⟩: μ⟨u, x⟩ (aligned base) or μ⟨u, x⟩ + (1 − μ)⟨ζ, x⟩


@dataclass(frozen=True)
class PretrainedGLMOptions(Options):
    """Options of ``pretrained-glm``: the base's alignment μ and kind, the update's initial
    scale, the teacher's σ* and the labels."""

    mu: float = option(0.9, "Pre-trained base w₀ = μu: its alignment and norm at once, "
                            "0 < μ < 1.", check="unit")
    scale0: float | None = option(None, "Initial scale a₀ of the update a·v [default: 1/d²].")
    base: str = option("aligned", "Pre-trained base: aligned (w₀ = μu) or mixed "
                                  "(w₀ = μu + (1 − μ)ζ, ζ a uniform unit vector per run).",
                       choices=BASES)
    teacher_activation: str | None = option(None, "Teacher σ* of y = σ*(⟨u, x⟩) [default: the "
                                                  "student's σ].", check="activation")
    labels: str = option("y", "Labels: y = σ*(⟨u, x⟩), or y2 = σ*(⟨u, x⟩)² (phase "
                              "retrieval-like).", choices=LABELS)


class PretrainedGLM(Learner):
    """Learner ``pretrained-glm`` for R runs at once (formulas in the module docstring).

    ``eta_r`` is the per-run step size (zeroed by the engine to freeze a diverged run).
    """

    name = "pretrained-glm"
    Options = PretrainedGLMOptions
    family = "single-index"
    instance_keys = ()  # W, ξ, ĉ and k do not enter: σ(⟨u, x⟩) alone
    overlap_label = "|⟨v, u⟩|"
    chain = ("dynamics.reduced.pretrained_chain", "PretrainedChain")  # the exact chain in (a, m)

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        out = f"pre-trained μ = {config.get('mu', PretrainedGLMOptions.mu):g}"
        if config.get("base", "aligned") != "aligned":
            out += f", {config.get('base')} base"
        if config.get("teacher_activation") is not None:
            out += f", σ* = {config.get('teacher_activation')}"
        return out + (", labels y²" if config.get("labels", "y") == "y2" else "")

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """State a and v (and ζ for the mixed base); records |m|, a, m (and q, ρ); prepared y
        and ⟨w₀, x⟩ per example."""
        mixed = config.options.base == "mixed"
        return Memory(state=2 * d + 1 if mixed else d + 1, records=5 if mixed else 3,
                      prepared=2)

    def __init__(self, problem: Problem, *, mu: float, eta: float, batch: int = 1,
                 label_noise: float = 0.0, zeta: np.ndarray | None = None,
                 teacher_activation: str | None = None, labels: str = "y"):
        """``zeta`` (R, d): the mixed base's unit ζ per run (None: the aligned base μu);
        ``teacher_activation``: σ* (None: σ); ``labels``: y or y2."""
        self.problem, self.mu, self.batch = problem, mu, batch
        self.noise_sd = math.sqrt(label_noise)
        self.eta_r = eta * torch.ones_like(problem.xi)
        self.teacher = problem.activation if teacher_activation is None else \
            torch_activation(teacher_activation)
        self.squared = labels == "y2"
        self.zeta = None if zeta is None else torch.as_tensor(
            zeta, dtype=problem.xi.dtype, device=problem.xi.device)

    @classmethod
    def from_config(cls, config, problem: Problem) -> PretrainedGLM:
        opts = config.options
        zeta = base_directions(config.seed, config.runs, problem.d) \
            if opts.base == "mixed" else None
        return cls(problem, mu=opts.mu, eta=config.eta, batch=config.batch,
                   label_noise=config.label_noise, zeta=zeta,
                   teacher_activation=opts.teacher_activation, labels=opts.labels)

    def step_sizes(self) -> list[torch.Tensor]:
        return [self.eta_r]

    def initial_state(self, config, instances) -> tuple[PretrainedGLMState, np.ndarray]:
        """v₀ uniform on S^{d−1} (stream (seed, r, ``init``), as ``glm``'s û₀), a₀ = ``scale0``
        (1/d² by default); m₀ of the trajectory is |⟨v₀, u⟩|."""
        d = instances[0].d
        v0 = uniform_perp_directions(config.seed, config.runs, d, 0)
        scale0 = config.options.scale0
        a0 = np.full(config.runs, 1.0 / d**2 if scale0 is None else scale0)
        return self.init_state(a0, v0), np.abs(overlap_np(v0, instances))

    def init_state(self, a0: np.ndarray, v0: np.ndarray) -> PretrainedGLMState:
        p = self.problem

        def tensor(a):
            return torch.as_tensor(a, dtype=p.xi.dtype, device=p.xi.device).clone()

        return PretrainedGLMState(tensor(a0), tensor(v0))

    # ------------------------------------------------------------------ gradient
    def prepare(self, state: PretrainedGLMState, x: torch.Tensor,
                eps: torch.Tensor | None = None, sqnorm=None) -> PretrainedGLMPrepared:
        """Labels y = σ*(⟨u, x⟩) (squared for y2) + √noise·ε and ⟨w₀, x⟩ of a chunk x
        (R, n, b, d)."""
        u_x = self.problem.u_dot(x)
        y = self.teacher.fn(u_x)
        if self.squared:
            y = y * y
        if eps is not None and self.noise_sd > 0:
            y = y.add_(eps, alpha=self.noise_sd)
        if self.zeta is None:
            return PretrainedGLMPrepared(y, self.mu * u_x)
        zeta_x = torch.linalg.vecdot(x, self.zeta.reshape(-1, *(1,) * (x.dim() - 2),
                                                         x.shape[-1]))
        return PretrainedGLMPrepared(y, torch.add(self.mu * u_x, zeta_x, alpha=1.0 - self.mu))

    def _terms(self, state: PretrainedGLMState, x: torch.Tensor, y: torch.Tensor,
               w0_x: torch.Tensor):
        """(s, δ, ŷ) per example (R, b): s = ⟨v, x⟩, λ = ⟨w₀, x⟩ + a s, ŷ = σ(λ),
        δ = (ŷ − y)σ′(λ)."""
        s = torch.linalg.vecdot(x, state.v[:, None])
        lam = torch.addcmul(w0_x, state.a[:, None], s)
        act = self.problem.activation
        y_hat = act.fn(lam)
        return s, (y_hat - y) * act.deriv(lam), y_hat

    def sample_gradients(self, state: PretrainedGLMState, x: torch.Tensor,
                         eps: torch.Tensor | None = None):
        """Per-example Euclidean gradients of ½(y − ŷ)² (tests): (∂/∂a = δs (R, b),
        ∂/∂v = aδx (R, b, d), the loss (R, b))."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        y = pre.y[:, 0]
        s, delta, y_hat = self._terms(state, x, y, pre.w0_x[:, 0])
        grad_v = (state.a[:, None] * delta)[..., None] * x
        return delta * s, grad_v, 0.5 * (y - y_hat) ** 2

    def sample_loss(self, state: PretrainedGLMState, x: torch.Tensor,
                    eps: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example loss ½(y − σ(⟨μu + av, x⟩))² (R, b), differentiable in a and v."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        _, _, y_hat = self._terms(state, x, pre.y[:, 0], pre.w0_x[:, 0])
        return 0.5 * (pre.y[:, 0] - y_hat) ** 2

    # ------------------------------------------------------------------ steps
    def step_prepared_(self, state: PretrainedGLMState, x: torch.Tensor,
                       pre: PretrainedGLMPrepared, i: int) -> torch.Tensor:
        """Step i of a prepared chunk in place; returns 1/‖ṽ‖, 0 where a′ is not finite (not
        finite and > 0 ⇒ diverged)."""
        s, delta, _ = self._terms(state, x, pre.y[:, i], pre.w0_x[:, i])
        eta, a, v = self.eta_r, state.a, state.v
        state.step += 1
        grad_v = torch.bmm((delta / x.shape[1]).unsqueeze(1), x).squeeze(1)  # (1/B)Σ δ_n x_n
        v.addcmul_(grad_v, (eta * a)[:, None], value=-1.0)
        a.addcmul_(eta, (delta * s).mean(-1), value=-1.0)
        inv = torch.linalg.vector_norm(v, dim=-1).reciprocal_()
        v.mul_(inv[:, None])
        return inv.mul_(torch.isfinite(a))

    # ------------------------------------------------------------------ engine protocol
    def bad_runs(self, state: PretrainedGLMState) -> torch.Tensor:
        """Non-finite a or v, or |m| > 1 + tol."""
        tol = 1.0 + OVERLAP_TOL * torch.finfo(state.v.dtype).eps
        return super().bad_runs(state) | ~(self.problem.overlap(state.v).abs() <= tol)

    def observe(self, state: PretrainedGLMState) -> dict:
        m = self.problem.overlap(state.v).double().cpu().numpy()
        a = state.a.double().cpu().numpy().copy()  # a copy: the state moves on in place
        out = {"overlap": np.abs(m), "scale": a, "m": m}
        if self.zeta is not None:  # the mixed base: q = ⟨v, ζ⟩ and ρ = ⟨ζ, u⟩
            out["q"] = torch.linalg.vecdot(state.v, self.zeta).double().cpu().numpy()
            out["rho"] = self.problem.overlap(self.zeta).double().cpu().numpy()
        return out

    @staticmethod
    def trajectory(result: RunResult):
        """|m|, the exact population loss from (a, m), extras ``scale`` and ``m`` (and ``q``,
        ``rho`` for the mixed base), and the population flow's |m| from each run's own start
        (:func:`pretrained_glm_ode`); from the records alone, so an exact chain recording
        (overlap, scale, m, and q, rho for the mixed base) can share it."""
        act, opts = result.instances[0].activation, result.config.options
        rec = result.records
        a, m = np.asarray(rec["scale"], dtype=float), np.asarray(rec["m"], dtype=float)
        extra = {"scale": a, "m": m}
        setting = _setting(result)
        if setting is None:
            loss = pretrained_glm_loss(act, opts.mu, a, m)
        else:
            if setting.mixed:
                extra |= {k: np.asarray(rec[k], dtype=float) for k in ("q", "rho")}
            loss = _general_loss(setting, a, m, extra.get("q"), extra.get("rho"))
        return make_trajectory(result, np.asarray(rec["overlap"], dtype=float), loss,
                               loss_kind=LOSS_EXACT, ode=pretrained_glm_ode(result),
                               extra=extra)


def base_directions(seed: int, runs: int, d: int) -> np.ndarray:
    """(R, d) the mixed base's ζ: run r's unit vector uniform on S^{d−1} from its own stream
    (seed, r, ``base``), so the aligned base draws nothing new."""
    out = np.empty((runs, d))
    for r in range(runs):
        g = np.random.default_rng(run_seed(seed, r, "base")).standard_normal(d)
        out[r] = g / np.linalg.norm(g)
    return out


def _setting(result: RunResult) -> Pretraining | None:
    """The theory's :class:`~hermite.flows.pretrained.Pretraining` of a run with options
    beyond the default (ρ = 0 placeholder for the mixed base: each run's own ρ is passed
    along), None for the default (aligned base, y = σ(⟨u, x⟩))."""
    opts = result.config.options
    if (opts.base, opts.teacher_activation, opts.labels) == ("aligned", None, "y"):
        return None
    return Pretraining(result.instances[0].activation, opts.mu,
                       0.0 if opts.base == "mixed" else None, opts.teacher_activation,
                       opts.labels)


def _finite(*arrays) -> np.ndarray:
    return np.logical_and.reduce([np.isfinite(x) for x in arrays if x is not None])


def _general_loss(setting: Pretraining, a, m, q, rho) -> np.ndarray:
    """:func:`~hermite.flows.pretrained.general_loss` elementwise, NaN where the records are
    not finite (m, q clipped to the unit disc against rounding)."""
    out = np.full(a.shape, np.nan)
    ok = _finite(a, m, q)
    if ok.any():
        m_ok = np.clip(m[ok], -1.0, 1.0)
        q_ok = None if q is None else np.clip(q[ok], -1.0, 1.0)
        if q_ok is not None:  # rounding can leave (m, q) just outside the unit disc
            q_ok = _clip_pair(m_ok, q_ok, rho[ok])
        out[ok] = general_loss(setting, a[ok], m_ok, q_ok, None if rho is None else rho[ok])
    return out


def _clip_pair(m, q, rho):
    """q moved onto the boundary of m² + p² ≤ 1 (p = (q − ρm)/ρ̄) where rounding left it out."""
    rho_bar = np.sqrt(1.0 - rho * rho)
    p = (q - rho * m) / rho_bar
    p = np.clip(p, -np.sqrt(np.maximum(0.0, 1.0 - m * m)), np.sqrt(np.maximum(0.0, 1.0 - m * m)))
    return rho * m + rho_bar * p


# ---------------------------------------------------------------------- theory
def pretrained_glm_loss(activation, mu: float, a, m) -> np.ndarray:
    """Exact population loss ½E[(σ(ν) − σ(λ))²] at (a, m) elementwise
    (``hermite.flows.pretrained.pretrained_loss``; m clipped to [−1, 1] against rounding);
    NaN where a or m is not finite (a diverged run's records)."""
    a, m = np.broadcast_arrays(np.asarray(a, dtype=float), np.asarray(m, dtype=float))
    out = np.full(a.shape, np.nan)
    ok = np.isfinite(a) & np.isfinite(m)
    if ok.any():
        out[ok] = pretrained_loss(activation, mu, a[ok], np.clip(m[ok], -1.0, 1.0))
    return out


def pretrained_glm_ode(result: RunResult) -> np.ndarray:
    """(R, C) |m| of the population flow (``hermite.flows.pretrained.pretrained_flow``, with
    the renormalisation term of the run's η, d and B) from each run's own start (a₀, m₀) (its
    records at step 0) at t = steps·η; NaN rows for runs without a finite start."""
    config, rec = result.config, result.records
    a0 = np.asarray(rec["scale"], dtype=float)[:, 0]
    m0 = np.asarray(rec["m"], dtype=float)[:, 0]
    out = np.full((a0.size, result.steps.size), np.nan)
    setting = _setting(result)
    if setting is not None:
        return _general_ode(setting, result, a0, m0, out)
    ok = np.isfinite(a0) & np.isfinite(m0)
    if ok.any():
        flow = pretrained_flow(result.instances[0].activation, config.options.mu, a0[ok],
                               np.clip(m0[ok], -1.0, 1.0), result.steps * config.eta,
                               eta=config.eta, d=result.instances[0].d, batch=config.batch)
        out[ok] = flow.overlap
    return out


def _general_ode(setting: Pretraining, result: RunResult, a0, m0, out) -> np.ndarray:
    """:func:`pretrained_glm_ode` for the options beyond the default
    (:func:`~hermite.flows.pretrained.general_flow`, each run's own ρ and q₀ for the mixed
    base)."""
    config, rec = result.config, result.records
    q0 = rho = None
    if setting.mixed:
        q0 = np.asarray(rec["q"], dtype=float)[:, 0]
        rho = np.asarray(rec["rho"], dtype=float)[:, 0]
    ok = _finite(a0, m0, q0)
    if ok.any():
        m_ok = np.clip(m0[ok], -1.0, 1.0)
        q_ok = None if q0 is None else _clip_pair(m_ok, np.clip(q0[ok], -1.0, 1.0), rho[ok])
        flow = general_flow(setting, a0[ok], m_ok, result.steps * config.eta, q_ok,
                            rho=None if rho is None else rho[ok], eta=config.eta,
                            d=result.instances[0].d, batch=config.batch)
        out[ok] = flow.overlap
    return out
