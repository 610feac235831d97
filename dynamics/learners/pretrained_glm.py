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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dynamics.lazy import lazy_import
from dynamics.learners.base import Learner, Memory, RunResult, TensorState, make_trajectory
from dynamics.learners.directions import overlap_np
from dynamics.learners.options import Options, option
from dynamics.learners.problem import Problem
from dynamics.measures.losses import LOSS_EXACT
from dynamics.randomness.sampling import uniform_perp_directions
from hermite.flows.pretrained import pretrained_flow, pretrained_loss

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["PretrainedGLM", "PretrainedGLMOptions", "PretrainedGLMState", "PretrainedGLMPrepared",
           "pretrained_glm_loss", "pretrained_glm_ode"]

OVERLAP_TOL = 1e3  # |m| > 1 + OVERLAP_TOL·eps(dtype) counts as diverged


@dataclass
class PretrainedGLMState(TensorState):
    """State of R runs of the pretrained-glm learner."""

    a: torch.Tensor  # (R,) scale of the update a·v
    v: torch.Tensor  # (R, d) unit direction of the update, canonical frame
    step: int = 0  # SGD steps taken


@dataclass
class PretrainedGLMPrepared:
    """State-independent terms of a chunk of examples x (R, n, b, d)."""

    y: torch.Tensor  # (R, n, b) labels σ(⟨u, x⟩) (+ label noise)
    u_x: torch.Tensor  # (R, n, b) ⟨u, x⟩


@dataclass(frozen=True)
class PretrainedGLMOptions(Options):
    """Options of ``pretrained-glm``: the base's alignment μ and the update's initial scale."""

    mu: float = option(0.9, "Pre-trained base w₀ = μu: its alignment and norm at once, "
                            "0 < μ < 1.", check="unit")
    scale0: float | None = option(None, "Initial scale a₀ of the update a·v [default: 1/d²].")


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
        return f"pre-trained μ = {config.get('mu', PretrainedGLMOptions.mu):g}"

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """State a and v; records |m|, a, m; prepared y and ⟨u, x⟩ per example."""
        return Memory(state=d + 1, records=3, prepared=2)

    def __init__(self, problem: Problem, *, mu: float, eta: float, batch: int = 1,
                 label_noise: float = 0.0):
        self.problem, self.mu, self.batch = problem, mu, batch
        self.noise_sd = math.sqrt(label_noise)
        self.eta_r = eta * torch.ones_like(problem.xi)

    @classmethod
    def from_config(cls, config, problem: Problem) -> PretrainedGLM:
        return cls(problem, mu=config.options.mu, eta=config.eta, batch=config.batch,
                   label_noise=config.label_noise)

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
        """Labels y = σ(⟨u, x⟩) + √noise·ε and ⟨u, x⟩ of a chunk x (R, n, b, d)."""
        u_x = self.problem.u_dot(x)
        y = self.problem.activation.fn(u_x)
        if eps is not None and self.noise_sd > 0:
            y = y.add_(eps, alpha=self.noise_sd)
        return PretrainedGLMPrepared(y, u_x)

    def _terms(self, state: PretrainedGLMState, x: torch.Tensor, y: torch.Tensor,
               u_x: torch.Tensor):
        """(s, δ, ŷ) per example (R, b): s = ⟨v, x⟩, λ = μ⟨u, x⟩ + a s, ŷ = σ(λ),
        δ = (ŷ − y)σ′(λ)."""
        s = torch.linalg.vecdot(x, state.v[:, None])
        lam = torch.addcmul(self.mu * u_x, state.a[:, None], s)
        act = self.problem.activation
        y_hat = act.fn(lam)
        return s, (y_hat - y) * act.deriv(lam), y_hat

    def sample_gradients(self, state: PretrainedGLMState, x: torch.Tensor,
                         eps: torch.Tensor | None = None):
        """Per-example Euclidean gradients of ½(y − ŷ)² (tests): (∂/∂a = δs (R, b),
        ∂/∂v = aδx (R, b, d), the loss (R, b))."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        y = pre.y[:, 0]
        s, delta, y_hat = self._terms(state, x, y, pre.u_x[:, 0])
        grad_v = (state.a[:, None] * delta)[..., None] * x
        return delta * s, grad_v, 0.5 * (y - y_hat) ** 2

    def sample_loss(self, state: PretrainedGLMState, x: torch.Tensor,
                    eps: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example loss ½(y − σ(⟨μu + av, x⟩))² (R, b), differentiable in a and v."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        _, _, y_hat = self._terms(state, x, pre.y[:, 0], pre.u_x[:, 0])
        return 0.5 * (pre.y[:, 0] - y_hat) ** 2

    # ------------------------------------------------------------------ steps
    def step_prepared_(self, state: PretrainedGLMState, x: torch.Tensor,
                       pre: PretrainedGLMPrepared, i: int) -> torch.Tensor:
        """Step i of a prepared chunk in place; returns 1/‖ṽ‖, 0 where a′ is not finite (not
        finite and > 0 ⇒ diverged)."""
        s, delta, _ = self._terms(state, x, pre.y[:, i], pre.u_x[:, i])
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
        return {"overlap": np.abs(m), "scale": a, "m": m}

    @staticmethod
    def trajectory(result: RunResult):
        """|m|, the exact population loss from (a, m), extras ``scale`` and ``m``, and the
        population flow's |m| from each run's own (a₀, m₀) (:func:`pretrained_glm_ode`); from
        the records alone, so an exact chain recording (overlap, scale, m) can share it."""
        act, mu = result.instances[0].activation, result.config.options.mu
        rec = result.records
        a, m = np.asarray(rec["scale"], dtype=float), np.asarray(rec["m"], dtype=float)
        return make_trajectory(result, np.asarray(rec["overlap"], dtype=float),
                               pretrained_glm_loss(act, mu, a, m), loss_kind=LOSS_EXACT,
                               ode=pretrained_glm_ode(result), extra={"scale": a, "m": m})


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
    ok = np.isfinite(a0) & np.isfinite(m0)
    if ok.any():
        flow = pretrained_flow(result.instances[0].activation, config.options.mu, a0[ok],
                               np.clip(m0[ok], -1.0, 1.0), result.steps * config.eta,
                               eta=config.eta, d=result.instances[0].d, batch=config.batch)
        out[ok] = flow.overlap
    return out
