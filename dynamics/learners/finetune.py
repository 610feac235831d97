"""The ``finetune`` learner: online SGD on û ∈ S^{d−1} (eq. 4), ĉ frozen or trained jointly.

Student rows v̂ⱼ = (wⱼ + ξĉⱼû)/N̂ⱼ, N̂ⱼ = ‖wⱼ + ξĉⱼû‖; loss on one example
L = (f*(x) − f̂(x))² (no 1/2). With s = ⟨û, x⟩, aⱼ = (zⱼ + ξĉⱼ s)/N̂ⱼ, z = Wx and
δⱼ = ∂L/∂aⱼ = −2(y − f̂) λⱼ σ′(aⱼ), the sample gradient is, in closed form,

    ∇_û L = g x − Σⱼ γⱼ wⱼ − (…) û,   g = Σⱼ δⱼ ξĉⱼ/N̂ⱼ,   γⱼ = δⱼ aⱼ ξĉⱼ/N̂ⱼ²,
    ∂L/∂ĉⱼ = δⱼ (ξ s − aⱼ (ξ⟨wⱼ,û⟩ + ξ²ĉⱼ)/N̂ⱼ)/N̂ⱼ.

Projected (eq. 4, û ⊥ span W): (I − ûûᵀ)Π∇L = g (Πx − s û), so one step is
û' = ((1 + ηgs) û − ηg Πx)/n with n² = 1 + η²g²(‖Πx‖² − s²) (docs/model.md,
"The step"). Unprojected: the same with G = g x − Wᵀγ in place of gΠx. Mini-batches average
the b sample gradients. ĉ follows plain SGD with its own step size η_c. In the App. B
conventions (``Instance.convention``) 1/N̂ⱼ is the fixed row factor s and λ carries 1/ξ, so
the normalisation terms (γ, and the second part of ∂L/∂ĉⱼ) vanish.

Hot loop: everything that does not depend on the state (z = Wx, the labels y, ‖Πx‖²) is
computed once per chunk of steps by :meth:`Finetune.prepare`; a step then costs one dot
product ⟨û, x⟩, O(k) small ops and one in-place axpy on û.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dynamics.geometry import sphere
from dynamics.lazy import lazy_import
from dynamics.learners.base import Learner, Memory, RunResult, TensorState
from dynamics.learners.directions import initial_directions
from dynamics.learners.options import LowRankOptions, low_rank_variant, option
from dynamics.learners.problem import Problem, per_run, rowmat
from dynamics.measures.losses import needs_coordinates
from dynamics.measures.observables import reduced_coordinates
from dynamics.overlays.assembly import rank_one_trajectory

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["FinetuneState", "Finetune", "FinetuneOptions", "ExampleTerms", "Prepared"]


OVERLAP_TOL = 1e3  # |m| > 1 + OVERLAP_TOL·eps(dtype) counts as diverged


@dataclass
class FinetuneState(TensorState):
    """State of R runs of the finetune learner (run axis first)."""

    u_hat: torch.Tensor  # (R, d) student direction û, unit rows, canonical frame
    c_hat: torch.Tensor  # (R, k) student second-layer direction ĉ (moves only if joint_c)
    step: int = 0  # SGD steps taken


@dataclass
class Prepared:
    """State-independent quantities of a chunk of examples x (R, n, b, d)."""

    z: torch.Tensor  # (R, n, b, k) Wx
    y: torch.Tensor  # (R, n, b) labels f*(x) (+ label noise)
    zs: torch.Tensor | None  # (R, n, b, k) z/N̂ while N̂ is constant (projected, ĉ frozen)
    sqnorm: torch.Tensor | None  # (R, n, b) ‖Πx‖² (projected) or ‖x‖² (b = 1 only)


@dataclass
class ExampleTerms:
    """Per-example quantities of the sample gradient (shapes (R, b, k) or (R, b)).

    ``delta``, ``g`` and ``loss`` are computed on first use: the projected, frozen-ĉ step
    needs only g = −2(y − f̂) Σⱼ σ′(aⱼ) λⱼ ξĉⱼ/N̂ⱼ.
    """

    z: torch.Tensor  # Wx
    s: torch.Tensor  # ⟨û, x⟩
    a: torch.Tensor  # student pre-activations aⱼ
    resid: torch.Tensor  # y − f̂
    dsig: torch.Tensor  # σ′(aⱼ)
    lam: torch.Tensor  # (R, 1, k) λ
    scale: torch.Tensor  # (R, k) 1/N̂ⱼ
    shift: torch.Tensor  # (R, k) ξĉⱼ/N̂ⱼ
    lam_shift: torch.Tensor  # (R, k) −2λⱼ ξĉⱼ/N̂ⱼ
    omega: torch.Tensor | None  # (R, k) ⟨wⱼ, û⟩ (None when projected: it is 0)

    @cached_property
    def delta(self) -> torch.Tensor:
        """∂L/∂aⱼ = −2(y − f̂) λⱼ σ′(aⱼ)."""
        return (-2.0 * self.resid)[..., None] * self.lam * self.dsig

    @cached_property
    def g(self) -> torch.Tensor:
        """Coefficient of x in ∇_û L: Σⱼ δⱼ ξĉⱼ/N̂ⱼ = (y − f̂) Σⱼ σ′(aⱼ)(−2λⱼξĉⱼ/N̂ⱼ)."""
        return torch.linalg.vecdot(self.dsig, self.lam_shift[:, None]).mul_(self.resid)

    @cached_property
    def loss(self) -> torch.Tensor:
        """L = (y − f̂)²."""
        return self.resid * self.resid


@dataclass(frozen=True)
class FinetuneOptions(LowRankOptions):
    """Options of ``finetune``: the low-rank ones and the second-layer refit (App. F.2)."""

    refit: bool = option(False, "Refit the second layer on the 2k features σ(⟨wᵢ ± ξ/√k û, "
                                "x⟩/norm) at every checkpoint (App. F.2).")
    refit_samples: int = option(20_000, "Examples of the least-squares refit.",
                                check="positive")


class Finetune(Learner):
    """Learner ``finetune`` for R runs at once (see module docstring for the formulas).

    ``eta_r``/``eta_c_r`` are per-run step sizes: the engine zeroes a diverged run's entries,
    which freezes it without branching in the hot loop. ``prox`` adds the proximal term
    prox·‖Δ‖² = prox·ξ²‖ĉ‖² toward the base model (seed 003) to the loss; it does not depend
    on û, so it acts on ĉ only (joint training).
    """

    name = "finetune"
    Options = FinetuneOptions
    conventions = ("unit", "appB", "appB-sqrt")  # App. B's scalings: full engine
    finetune_ode = True  # hermite.finetune.population in every regime
    named_in_titles = False  # the paper's learner: titles name its variant only
    # the rank-1 chain (p, μ, ν[, ĉ]): every setting reduces (:mod:`dynamics.reduced`)
    chain = ("dynamics.reduced.simulate", "RankOneChain")

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """û (d) and ĉ (k); records m, ĉ when joint, and û's k + 2 reduced coordinates
        when they are kept (the loss from them: unprojected, the App. B conventions; refit)."""
        o = config.options
        return Memory(state=d + k, records=1 + (k if o.joint_c else 0) + (
            k + 2 if needs_coordinates(config) else 0), prepared=2 * k + 4)

    @classmethod
    def step_limit(cls, config, instance):
        """The population ODE's stability limit of η (``hermite.finite_d.stability``), unit rows."""
        if not instance.unit_rows:
            return None
        from hermite.finite_d.stability import step_limit

        return step_limit(instance, config.eta, instance.d, label_noise=config.label_noise)

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        return low_rank_variant(config, frozen_c)

    def __init__(self, problem: Problem, *, eta: float, eta_c: float, project: bool = True,
                 joint_c: bool = False, batch: int = 1, label_noise: float = 0.0,
                 prox: float = 0.0, keep_coords: bool = False):
        self.problem, self.k = problem, problem.k
        self.project, self.joint_c, self.batch = project, joint_c, batch
        self.prox, self.keep_coords = prox, keep_coords
        self.noise_sd = math.sqrt(label_noise)
        ones = torch.ones_like(problem.xi)
        self.eta_r, self.eta_c_r = eta * ones, eta_c * ones
        self._frozen = project and not joint_c
        self._coeffs = None
        self._tmp = None  # scratch (R, b, d) for ⟨û, x⟩, reused across steps

    @classmethod
    def from_config(cls, config, problem: Problem) -> Finetune:
        o = config.options
        return cls(problem, eta=config.eta, eta_c=config.step_size_c, project=o.project,
                   joint_c=o.joint_c, batch=config.batch, label_noise=config.label_noise,
                   prox=o.prox, keep_coords=needs_coordinates(config))

    def step_sizes(self) -> list[torch.Tensor]:
        return [self.eta_r, self.eta_c_r]


    @property
    def sqnorm_columns(self) -> tuple[int, int] | None:
        """Columns whose squared norm per example the b = 1 step needs (Πx or x)."""
        if self.batch != 1:
            return None
        return (self.k if self.project else 0, self.problem.d)

    def initial_state(self, config, instances) -> tuple[FinetuneState, np.ndarray]:
        """û₀ uniform on the sphere of span(W)^⊥ (``aligned``: sign-flipped), ĉ₀ = ĉ."""
        u0, m0 = initial_directions(config, instances)
        return self.init_state(u0), m0

    def init_state(self, u_hat0: np.ndarray, c_hat0: torch.Tensor | None = None) -> FinetuneState:
        """State from initial directions (R, d) (float64 numpy) and ĉ (default: instances')."""
        p = self.problem
        u = torch.as_tensor(u_hat0, dtype=p.xi.dtype, device=p.xi.device).clone()
        c = (p.c_hat0 if c_hat0 is None else c_hat0).clone()
        return FinetuneState(u, c, 0)

    # ------------------------------------------------------------------ gradient pieces
    def student_coefficients(self, state: FinetuneState):
        """(1/N̂, ξĉ/N̂, ⟨w,û⟩ or None, −2λξĉ/N̂), each (R, k); cached while constant."""
        if self._coeffs is not None:
            return self._coeffs
        p, ch = self.problem, state.c_hat
        xc = p.xi[:, None] * ch
        if p.row_scale is not None:  # App. B: fixed row factor s, no normalisation terms
            omega = None if self.project else torch.zeros_like(xc)
            scale = p.row_scale[:, None].expand_as(xc)
        elif self.project:
            omega, scale = None, torch.rsqrt(1.0 + xc * xc)
        else:
            omega = rowmat(state.u_hat[:, : self.k], p.lt)
            scale = torch.rsqrt(1.0 + xc * (2.0 * omega + xc))
        shift = xc * scale
        out = (scale, shift, omega, -2.0 * p.lam * shift)
        if self._frozen:
            self._coeffs = out
        return out

    def prepare(self, state: FinetuneState, x: torch.Tensor, eps: torch.Tensor | None = None,
                sqnorm: torch.Tensor | None = None) -> Prepared:
        """State-independent terms of a chunk x (R, n, b, d), label normals eps (R, n, b)."""
        p = self.problem
        z = rowmat(x[..., : self.k], p.lt)
        y = p.teacher(x, z)
        if eps is not None and self.noise_sd > 0:
            y = y.add_(eps, alpha=self.noise_sd)
        zs = z * per_run(self.student_coefficients(state)[0], 4) if self._frozen else None
        lo = self.k if self.project else 0
        if sqnorm is None and x.shape[2] == 1:
            sqnorm = torch.linalg.vector_norm(x[..., lo: self.problem.d], dim=-1).square_()
        return Prepared(z, y, zs, sqnorm)

    def terms(self, state: FinetuneState, x: torch.Tensor, pre: Prepared,
              i: int = 0) -> ExampleTerms:
        """Per-example terms of step i of a prepared chunk; x (R, b, d) is that step's examples."""
        p = self.problem
        s = self._dot(x, state.u_hat)
        scale, shift, omega, lam_shift = self.student_coefficients(state)
        z = pre.z[:, i]
        zs = pre.zs[:, i] if pre.zs is not None else z * scale[:, None]
        a = torch.addcmul(zs, s[..., None], shift[:, None])
        lam = p.lam[:, None]
        resid = pre.y[:, i] - torch.linalg.vecdot(p.activation.fn(a), lam)
        return ExampleTerms(z, s, a, resid, p.activation.deriv(a), lam, scale, shift,
                            lam_shift, omega)

    def _dot(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """⟨û, x⟩ per example (R, b): an elementwise product into scratch and a row sum
        (faster than a batched matmul for these shapes, and no allocation per step)."""
        if self._tmp is None or self._tmp.shape != x.shape or self._tmp.dtype != x.dtype:
            self._tmp = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return torch.mul(x, u[:, None], out=self._tmp).sum(-1)

    def _gamma(self, t: ExampleTerms) -> torch.Tensor:
        """γⱼ = δⱼ aⱼ ξĉⱼ/N̂ⱼ²: ∇_û L ∋ −Σⱼ γⱼ wⱼ (unprojected only; 0 with a fixed row
        scale, App. B, where nothing is renormalised)."""
        if self.problem.row_scale is not None:
            return torch.zeros_like(t.a)
        return t.delta * t.a * (t.shift * t.scale)[:, None]

    def _grad_c(self, state: FinetuneState, t: ExampleTerms) -> torch.Tensor:
        """∂L/∂ĉ per example, (R, b, k), with the proximal term 2·prox·ξ²ĉ."""
        xi = self.problem.xi[:, None]
        xc = xi * state.c_hat
        inner = xi * (xc if t.omega is None else t.omega + xc)  # ξ⟨wⱼ,û⟩ + ξ²ĉⱼ
        dn = xi[:, None] * t.s[..., None]
        if self.problem.row_scale is None:  # derivative of 1/N̂ⱼ
            dn = dn - t.a * (t.scale * inner)[:, None]
        grad = t.delta * t.scale[:, None] * dn
        if self.prox:
            grad = grad + (2.0 * self.prox * xi * xc)[:, None]
        return grad

    def sample_gradients(self, state: FinetuneState, x: torch.Tensor,
                         eps: torch.Tensor | None = None):
        """Reference per-example gradients (tests): (tangent ∇_û (R,b,d), ∂L/∂ĉ (R,b,k), L).

        tangent = (I − ûûᵀ)Π∇_û L (projected) or (I − ûûᵀ)∇_û L.
        """
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        t = self.terms(state, x, pre)
        grad = t.g[..., None] * x
        if self.project:
            grad[..., : self.k] = 0.0
        else:
            grad[..., : self.k] -= rowmat(self._gamma(t), self.problem.l)
        tangent = sphere.proju(state.u_hat[:, None], grad)
        return tangent, self._grad_c(state, t), t.loss

    def sample_loss(self, state: FinetuneState, x: torch.Tensor,
                    eps: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example loss (R, b) whose gradients :meth:`sample_gradients` gives in closed
        form: :meth:`terms`'s data loss plus the proximal term prox·ξ²‖ĉ‖², differentiable
        in the state's tensors (autograd tests). The student coefficients are neither read
        from nor left in the cache, and ⟨û, x⟩ is taken without ``_dot``'s scratch buffer
        (autograd refuses ``out=``)."""
        saved = self._coeffs, self._frozen
        self._coeffs, self._frozen = None, False
        self._dot = lambda x_, u: torch.linalg.vecdot(x_, u[:, None])  # shadows the method
        try:
            pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
            loss = self.terms(state, x, pre).loss
        finally:
            del self._dot
            self._coeffs, self._frozen = saved
        if self.prox:
            xc = self.problem.xi[:, None] * state.c_hat
            loss = loss + self.prox * xc.square().sum(-1)[:, None]
        return loss

    # ------------------------------------------------------------------ steps
    def step_prepared_(self, state: FinetuneState, x: torch.Tensor, pre: Prepared,
                       i: int) -> torch.Tensor:
        """Step i of a prepared chunk, in place; returns 1/n (not finite and > 0 ⇒ diverged)."""
        t = self.terms(state, x, pre, i)
        if self.joint_c:
            grad_c = self._grad_c(state, t).mean(1)
        if x.shape[1] == 1 and pre.sqnorm is not None:
            inv = self._direction_single(state, x[:, 0], t, pre.sqnorm[:, i, 0])
        else:
            inv = self._direction_batch(state, x, t)
        if self.joint_c:
            state.c_hat.addcmul_(grad_c, self.eta_c_r[:, None], value=-1.0)
        if not self._frozen:
            self._coeffs = None
        state.step += 1
        return inv

    def _direction_single(self, state: FinetuneState, x: torch.Tensor, t: ExampleTerms,
                          q: torch.Tensor) -> torch.Tensor:
        """b = 1: û' = α û + β x (+ Wᵀγ part), normaliser n in closed form; q = ‖Πx‖²."""
        k, eta, u = self.k, self.eta_r, state.u_hat
        g, s = t.g[:, 0], t.s[:, 0]
        if self.project:
            eg = eta * g
            # 1/n = (1 + η²g²(‖Πx‖² − s²))^{-1/2}; α = (1 + ηgs)/n; β = −ηg/n
            inv = torch.addcmul(q, s, s, value=-1.0).mul_(eg * eg).add_(1.0).rsqrt_()
            alpha = torch.addcmul(inv, inv, eg * s)
            u[:, k:].mul_(alpha[:, None]).addcmul_(x[:, k:], eg.mul_(inv)[:, None], value=-1.0)
            return inv
        gamma = self._gamma(t)[:, 0]
        lg = rowmat(gamma, self.problem.l)  # Wᵀγ in span W's frame
        ug = g * s - (gamma * t.omega).sum(-1)  # ⟨û, G⟩
        g2 = g * g * q - 2.0 * g * (gamma * t.z[:, 0]).sum(-1) + (lg * lg).sum(-1)  # ‖G‖²
        inv = torch.rsqrt(1.0 + eta * eta * (g2 - ug * ug))
        u.mul_(((1.0 + eta * ug) * inv)[:, None]).addcmul_(x, (-eta * g * inv)[:, None])
        u[:, :k].addcmul_(lg, (eta * inv)[:, None])
        return inv

    def _direction_batch(self, state: FinetuneState, x: torch.Tensor,
                         t: ExampleTerms) -> torch.Tensor:
        """b > 1: Ḡ = mean of the sample gradients, û' = projx(û − η(I − ûûᵀ)Ḡ)."""
        k, eta, u = self.k, self.eta_r, state.u_hat
        grad = torch.bmm((t.g / x.shape[1]).unsqueeze(1), x).squeeze(1)
        if self.project:
            grad[:, :k] = 0.0
        else:
            grad[:, :k] -= rowmat(self._gamma(t).mean(1), self.problem.l)
        ug = (u * grad).sum(-1)
        u.mul_((1.0 + eta * ug)[:, None]).addcmul_(grad, eta[:, None], value=-1.0)
        n = torch.linalg.vector_norm(u, dim=-1)
        u.div_(n[:, None])
        return n.reciprocal_()

    def renormalize_(self, state: FinetuneState) -> None:
        """Exact projx of û (removes the rounding drift of the closed-form normaliser)."""
        state.u_hat.div_(torch.linalg.vector_norm(state.u_hat, dim=-1, keepdim=True))

    # ------------------------------------------------------------------ engine protocol
    def bad_runs(self, state: FinetuneState) -> torch.Tensor:
        """Non-finite ĉ or |m| > 1 + tol (a non-finite û shows up in m)."""
        tol = 1.0 + OVERLAP_TOL * torch.finfo(state.u_hat.dtype).eps
        m = self.problem.overlap(state.u_hat)
        return ~torch.isfinite(state.c_hat).all(-1) | ~(m.abs() <= tol)

    def observe(self, state: FinetuneState) -> dict:
        """Overlap m (R,), ĉ (R, k) when trained, û's reduced coordinates when needed."""
        out = {"overlap": self.problem.overlap(state.u_hat).double().cpu().numpy()}
        if self.joint_c:
            out["c_hat"] = state.c_hat.double().cpu().numpy().copy()  # not a view
        if self.keep_coords:
            out["coords"] = reduced_coordinates(state.u_hat, self.k)
        return out

    def trajectory(self, result: RunResult):
        """Loss (exact or Monte Carlo), theory curves and, with ``refit``, the refit loss."""
        return rank_one_trajectory(result)
