"""The ``moment`` learner: non-gradient Stein estimators of u (seed 000; paper Remark 14).

Each engine step consumes that step's b examples, so after t steps the estimate uses
n = t·b samples. With r = y − f₀(x) the residual of the base network f₀ = Σᵢ λᵢσ(⟨wᵢ,x⟩)
and Π⊥ the projector onto span(W)^⊥:

- order 1: S₁ = Σₙ xₙ rₙ (state (R, d)), û = Π⊥S₁/‖Π⊥S₁‖. By Stein's lemma
  E[x σ(⟨v,x⟩)] = μ₁ v for unit v, so E[x r] = μ₁ Σᵢ λᵢ(vᵢ − wᵢ) and
  Π⊥E[x r] = μ₁ ξ u⊥ (Σᵢ λᵢcᵢ/Nᵢ) e (e = u's unit part ⊥ span W, u⊥ = ‖Π⊥u‖):
  consistent iff μ₁ ≠ 0 and Σᵢ λᵢcᵢ/Nᵢ ≠ 0.
- order 2: S₂ = Σₙ rₙ (Π⊥xₙxₙᵀΠ⊥ − Π⊥) (state: Σ r Π⊥xxᵀΠ⊥ as (R, d−k, d−k) on
  span(W)^⊥'s coordinates plus Σ r, the identity term applied on read); û = eigenvector of
  S₂ with the largest |eigenvalue|. Second-order Stein E[σ(⟨v,x⟩)(xxᵀ − I)] = √2 μ₂ vvᵀ
  gives E[r(xxᵀ − I)] = √2 μ₂ Σᵢ λᵢ(vᵢvᵢᵀ − wᵢwᵢᵀ), whose Π⊥ block is
  √2 μ₂ ξ² u⊥² (Σᵢ λᵢcᵢ²/Nᵢ²) eeᵀ: consistent iff μ₂ ≠ 0 and Σᵢ λᵢcᵢ²/Nᵢ² ≠ 0.

Both estimators give a line, not a sign: the recorded ``overlap`` is |⟨û, u⟩| ∈ [0, u⊥], and
the loss is the exact population loss Φ(|⟨û, u⟩|) of the fine-tuned student with that û and
the instance's frozen ĉ (``hermite.population_loss``, loss_kind ``exact``). Before any
sample (step 0) there is no estimate: overlap and loss are NaN there, and so is m₀ (the
estimator has no initial direction). No population ODE applies (``ode`` is NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import hermite
from dynamics.errors import ConfigError
from dynamics.lazy import lazy_import
from dynamics.learners.base import Learner, Memory, RunResult, TensorState, make_trajectory
from dynamics.learners.options import Options, option
from dynamics.learners.problem import Problem, per_run, rowmat
from dynamics.measures.losses import LOSS_EXACT, exact_loss

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["MomentState", "Moment", "MomentOptions", "MomentPrepared", "hermite_mu"]

MU_ZERO_RTOL = 1e-10  # |μ_p| ≤ this × √E[σ²] counts as μ_p = 0 (quadrature round-off)


def hermite_mu(activation, order: int) -> float:
    """μ_order(σ) = E[σ(g) h_order(g)] (closed form where the registry has one)."""

    return float(hermite.hermite_coefficients(activation, order)[order])


@dataclass
class MomentState(TensorState):
    """Running Stein statistic of R runs (run axis first)."""

    stat: torch.Tensor  # (R, d) Σ x r (order 1) or (R, d−k, d−k) Σ r Π⊥xxᵀΠ⊥ (order 2)
    rsum: torch.Tensor  # (R,) Σ r (order 2: S₂ = stat − rsum·I)
    step: int = 0  # engine steps taken (n = step·b samples)


@dataclass
class MomentPrepared:
    """State-independent terms of a chunk x (R, n, b, d): the residuals r = y − f₀(x)."""

    resid: torch.Tensor  # (R, n, b), already multiplied by the run's weight (0 = frozen)


@dataclass(frozen=True)
class MomentOptions(Options):
    """Options of ``moment``."""

    moment_order: int = option(1, "Stein estimator: 1 (Π⊥Σx(y − f₀)) or 2 (top eigenvector "
                                  "of Π⊥Σ(y − f₀)(xxᵀ − I)Π⊥).", choices=(1, 2))


class Moment(Learner):
    """Learner ``moment`` (see the module docstring for the estimators).

    ``weight_r`` (R,) multiplies every residual; the engine zeroes a diverged run's entry
    (:meth:`step_sizes`), which freezes its statistic without branching.
    """

    name = "moment"
    Options = MomentOptions
    family = "estimator"
    takes_step_size = False
    has_population_ode = False  # an estimator: no dynamics

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """Order 1: the running sum (d); order 2: the (d − k)² statistic."""
        order = int(config.options.moment_order)
        return Memory(state=(d if order == 1 else (d - k) ** 2) + 1, records=1,
                      prepared=2 * k + 4)

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        return f"order {config.get('moment_order', 1)}"

    def __init__(self, problem: Problem, *, order: int = 1, batch: int = 1,
                 label_noise: float = 0.0):
        if order not in (1, 2):
            raise ValueError(f"moment order must be 1 or 2, got {order!r}")
        self.problem, self.k, self.d = problem, problem.k, problem.d
        self.order, self.batch = order, batch
        self.noise_sd = math.sqrt(label_noise)
        self.weight_r = torch.ones_like(problem.xi)

    @classmethod
    def check(cls, config, instance) -> None:
        """ConfigError when μ_order(σ) = 0: the order's Stein moment carries no signal."""

        p = config.options.moment_order
        mu = hermite_mu(instance.activation, p)
        scale = math.sqrt(max(hermite.gaussian_second_moment(instance.activation), 0.0))
        if abs(mu) <= MU_ZERO_RTOL * scale:
            raise ConfigError("moment_order", f"order-{p} Stein estimator needs μ_{p}(σ) ≠ 0, "
                                              f"but activation {instance.activation.name!r} "
                                              f"has μ_{p} = {mu:.3g}")

    @classmethod
    def from_config(cls, config, problem: Problem) -> Moment:
        return cls(problem, order=config.options.moment_order, batch=config.batch,
                   label_noise=config.label_noise)

    def step_sizes(self) -> list[torch.Tensor]:
        return [self.weight_r]


    def initial_state(self, config, instances) -> tuple[MomentState, np.ndarray]:
        """Zero statistic; m₀ = NaN (no estimate before the first sample)."""
        return self.init_state(), np.full(len(instances), np.nan)

    def init_state(self) -> MomentState:
        p = self.problem
        opts = {"dtype": p.xi.dtype, "device": p.xi.device}
        runs, dp = p.runs, self.d - self.k
        shape = (runs, self.d) if self.order == 1 else (runs, dp, dp)
        return MomentState(torch.zeros(shape, **opts), torch.zeros(runs, **opts), 0)

    # ------------------------------------------------------------------ per-step update
    def residuals(self, x: torch.Tensor, eps: torch.Tensor | None = None) -> torch.Tensor:
        """r = y − f₀(x) for examples x (R, …, d) (y with label noise when eps is given)."""
        p = self.problem
        z = rowmat(x[..., : self.k], p.lt)
        y = p.teacher(x, z)
        if eps is not None and self.noise_sd > 0:
            y = y.add_(eps, alpha=self.noise_sd)
        f0 = (p.activation.fn(z) * per_run(p.lam, z.dim())).sum(-1)
        return y - f0

    def prepare(self, state: MomentState, x: torch.Tensor, eps: torch.Tensor | None = None,
                sqnorm: torch.Tensor | None = None) -> MomentPrepared:
        """Residuals of a chunk x (R, n, b, d), eps (R, n, b) label normals or None."""
        r = self.residuals(x, eps)
        return MomentPrepared(r.mul_(per_run(self.weight_r, r.dim())))

    def step_prepared_(self, state: MomentState, x: torch.Tensor, pre: MomentPrepared,
                       i: int) -> torch.Tensor:
        """Add step i's b examples x (R, b, d): S₁ += Σ_b r x, or S₂'s terms
        Σ_b r Π⊥xxᵀΠ⊥ and Σ_b r. Returns 1 per run (NaN if a residual is not finite)."""
        r = pre.resid[:, i]  # (R, b)
        if self.order == 1:
            state.stat.add_(torch.bmm(r[:, None], x)[:, 0])
        else:
            xp = x[..., self.k: self.d]
            state.stat.baddbmm_(xp.transpose(1, 2) * r[:, None], xp)
        rs = r.sum(1)
        state.rsum.add_(rs)
        state.step += 1
        return rs.mul(0.0).add_(1.0)

    # ------------------------------------------------------------------ the estimate
    def statistic(self, state: MomentState) -> torch.Tensor:
        """S₁ = Σ x r (R, d), or S₂ = Σ r(Π⊥xxᵀΠ⊥ − Π⊥) on span(W)^⊥'s coordinates
        (R, d−k, d−k)."""
        if self.order == 1:
            return state.stat.clone()
        eye = torch.eye(self.d - self.k, dtype=state.stat.dtype, device=state.stat.device)
        return state.stat - state.rsum[:, None, None] * eye

    def estimate(self, state: MomentState) -> torch.Tensor:
        """û (R, d) in the canonical frame, ⊥ span W, unit; NaN rows where the statistic is
        0 (no samples yet). Sign arbitrary (the estimators only identify a line)."""
        stat = self.statistic(state)
        out = torch.zeros((stat.shape[0], self.d), dtype=stat.dtype, device=stat.device)
        if self.order == 1:
            v = stat[:, self.k:]
        else:
            vals, vecs = torch.linalg.eigh(stat)
            top = vals.abs().argmax(-1)
            v = torch.take_along_dim(vecs, top[:, None, None], dim=2)[..., 0]
        norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
        empty = torch.linalg.vector_norm(stat.reshape(stat.shape[0], -1), dim=-1) == 0
        out[:, self.k:] = v / norm
        out[empty] = torch.nan
        return out

    # ------------------------------------------------------------------ engine protocol
    def observe(self, state: MomentState) -> dict:
        """|⟨û, u⟩| (R,) (NaN before the first sample)."""
        u_hat = self.estimate(state)
        return {"overlap": self.problem.overlap(u_hat).abs().double().cpu().numpy()}

    def trajectory(self, result: RunResult):
        """Overlap |⟨û,u⟩| and the exact population loss Φ(|⟨û,u⟩|) with the frozen ĉ."""
        overlap = result.records["overlap"]
        u_perp = np.array([inst.u_perp for inst in result.instances])[:, None]
        m = np.minimum(overlap, u_perp)  # rounding may put |⟨û,u⟩| a few ulp above u⊥
        return make_trajectory(result, overlap, exact_loss(result.instances, m),
                               loss_kind=LOSS_EXACT)
