"""The ``lora`` learner: rank-r fine-tuning, Riemannian online SGD of Û on the Stiefel manifold.

Student rows v̂ⱼ = (wⱼ + ξÛĉⱼ)/N̂ⱼ, N̂ⱼ = ‖wⱼ + ξÛĉⱼ‖, Û ∈ St(d, r) (ÛᵀÛ = I), Ĉ ∈ R^{k×r}
frozen or trained jointly (``joint_c``); the teacher is ``dynamics.instances.lora_instance``'s (C,
U). Loss on one example L = (y − f̂(x))². With s = Ûᵀx (r), z = Wx, ω = WÛ (k×r, 0 when
projected), aⱼ = (zⱼ + ξĉⱼᵀs)/N̂ⱼ and δⱼ = ∂L/∂aⱼ = −2(y − f̂)λⱼσ′(aⱼ), the sample gradients
are, in closed form (∂N̂ⱼ/∂Û = ξ(wⱼ + ξÛĉⱼ)ĉⱼᵀ/N̂ⱼ, ∂N̂ⱼ/∂ĉⱼ = (ξωⱼ + ξ²ĉⱼ)/N̂ⱼ):

    ∇_Û L = x gᵀ − Wᵀ diag(γ) Ĉ − ξ Û Ĉᵀ diag(γ) Ĉ,  g = Σⱼ δⱼ ξĉⱼ/N̂ⱼ (r),  γⱼ = δⱼaⱼξ/N̂ⱼ²,
    ∂L/∂ĉⱼ = δⱼ (ξ s − aⱼ (ξωⱼ + ξ²ĉⱼ)/N̂ⱼ)/N̂ⱼ.

The last term of ∇_Û L is Û·(symmetric): the tangent projection removes it. Step (Riemannian
SGD, embedded metric; b examples averaged): G = mean ∇_Û L, with Π (onto span(W)^⊥) applied
when ``project`` (then Wᵀ… vanishes and G = Πx gᵀ), ξ = G − Û sym(ÛᵀG), Û' = retr(Û, −ηξ)
with the polar (default) or QR retraction (option ``retraction``,
:mod:`dynamics.geometry.stiefel`); Ĉ' = Ĉ − η_c mean ∂L/∂Ĉ (+ the proximal term 2·prox·ξ²Ĉ).

Projected, b = 1 (the hot path): Y = Û(I + ηS) − η Πx gᵀ with S = sym(s gᵀ), and
YᵀY = BᵀB − η(Bᵀs)gᵀ − η g(Bᵀs)ᵀ + η²‖Πx‖² ggᵀ, B = I + ηS, in closed form (r×r), so a step
costs Ûᵀx, two O(d r²) products and no d×r Gram. At r = 1 this is the ``finetune`` step
û' = ((1 + ηgs)û − ηgΠx)/n, n² = 1 + η²g²(‖Πx‖² − s²).

Observables: M = UᵀÛ (r×r) → ``extra["overlap_matrix"]`` (R, C, r, r), its singular values
(descending; cosines of the principal angles) ``extra["singular_values"]`` (R, C, r);
``overlap`` (R, C) = sign(det M)·σ_min(M), the smallest singular value with det M's sign, so
that at r = 1 it is m = ⟨u, û⟩ exactly as the ``finetune`` learner reports it; the exact loss
(``hermite.population_loss_rank``, projected or not); where ĉ is trained, ``c_overlap`` =
⟨Ĉ, C⟩_F/(‖Ĉ‖‖C‖); always ``extra["update_overlap"]`` = ⟨ĈÛᵀ, CUᵀ⟩_F/(‖Ĉ‖‖C‖) = tr(ĈᵀCM)/…
(gauge-invariant); projected with Ĉ frozen, the matrix ODE (``hermite.matrix_ode``) from each
run's M₀: ``extra["ode_singular_values"]`` (R, C, r) and ``ode`` = its signed σ_min.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import hermite
from dynamics.errors import ConfigError
from dynamics.geometry import stiefel
from dynamics.instances.lora_instance import lora_options, run_lora_instances
from dynamics.lazy import lazy_import
from dynamics.learners.base import Learner, Memory, RunResult, TensorState, make_trajectory
from dynamics.learners.options import LowRankOptions, low_rank_variant, option
from dynamics.learners.problem import Problem, rowmat
from dynamics.measures.observables import group_runs
from dynamics.randomness.sampling import run_seed, uniform_perp_directions

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["LoRA", "LoRAOptions", "LoRAState", "LoRAPrepared", "LoRATerms"]

ORTHO_TOL = 1e-8  # max |ÛᵀÛ − I| at a chunk end beyond which a run counts as diverged
# (float64; at least 1e4·eps of the dtype)


@dataclass
class LoRAState(TensorState):
    """State of R runs of the lora learner (run axis first)."""

    u_hat: torch.Tensor  # (R, d, r) Û, orthonormal columns, canonical frame
    c_hat: torch.Tensor  # (R, k, r) Ĉ (moves only if joint_c)
    step: int = 0


@dataclass
class LoRAPrepared:
    """State-independent terms of a chunk of examples x (R, n, b, d)."""

    z: torch.Tensor  # (R, n, b, k) Wx
    y: torch.Tensor  # (R, n, b) labels (+ label noise)
    zs: torch.Tensor | None  # (R, n, b, k) z/N̂ while N̂ is constant (projected, Ĉ frozen)
    sqnorm: torch.Tensor | None  # (R, n, b) ‖Πx‖² (projected, b = 1)


@dataclass
class LoRATerms:
    """Per-example terms of the sample gradient of one step."""

    s: torch.Tensor  # (R, b, r) Ûᵀx
    a: torch.Tensor  # (R, b, k) student pre-activations
    resid: torch.Tensor  # (R, b) y − f̂
    delta: torch.Tensor  # (R, b, k) δⱼ = −2(y − f̂)λⱼσ′(aⱼ)
    g: torch.Tensor  # (R, b, r) Σⱼ δⱼ ξĉⱼ/N̂ⱼ
    scale: torch.Tensor  # (R, k) 1/N̂ⱼ
    omega: torch.Tensor | None  # (R, k, r) WÛ (None when projected)


@dataclass(frozen=True)
class LoRAOptions(LowRankOptions):
    """Options of ``lora``: the low-rank ones, the rank r and the Stiefel retraction."""

    rank: int = option(1, "Rank r of the teacher's perturbation ξCUᵀ and of the student's "
                          "ξĈÛᵀ (teacher: spec keys C, spectrum, C_hat).", check="positive")
    retraction: str = option("polar", "Stiefel retraction of Û.", choices=stiefel.RETRACTIONS)


class LoRA(Learner):
    """Learner ``lora`` (see the module docstring for the formulas)."""

    name = "lora"
    Options = LoRAOptions
    overlap_label = "σ_min(UᵀÛ) (all r directions)"
    # the rank-r chain: projected, b = 1, U ⊥ span W
    chain = ("dynamics.reduced.rank_simulate", "RankChain")

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """Û (d×r) and Ĉ (k×r); records M (r×r), Ĉ when joint, WÛ when not projected."""
        o = config.options
        r = int(o.rank)
        return Memory(state=d * r + k * r, records=r * r + (k * r if o.joint_c else 0) + (
            0 if o.project else k * r), prepared=2 * k + 4)

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        """``rank r[, C spectrum s], projected, frozen ĉ``."""
        spectrum = config.get("instance", {}).get("spectrum")
        rank = f"rank {config.get('rank', 1)}" + (f", C spectrum {spectrum}" if spectrum
                                                  else "")
        return f"{rank}, {low_rank_variant(config, frozen_c)}"

    def __init__(self, problem: Problem, instances, *, eta: float, eta_c: float,
                 project: bool = True, joint_c: bool = False, batch: int = 1,
                 label_noise: float = 0.0, prox: float = 0.0, retraction: str = "polar"):
        if retraction not in stiefel.RETRACTIONS:
            raise ValueError(f"retraction must be one of {', '.join(stiefel.RETRACTIONS)}")
        self.problem, self.k, self.instances = problem, problem.k, list(instances)
        self.rank = self.instances[0].rank
        self.project, self.joint_c, self.batch, self.prox = project, joint_c, batch, prox
        self.retraction = retraction
        self.noise_sd = math.sqrt(label_noise)
        ones = torch.ones_like(problem.xi)
        self.eta_r, self.eta_c_r = eta * ones, eta_c * ones
        self.eta = eta
        self._frozen = project and not joint_c
        self._coeffs = None

        def t(values):
            return torch.as_tensor(np.stack([np.asarray(v, dtype=float) for v in values]),
                                   dtype=problem.xi.dtype, device=problem.xi.device)

        insts = self.instances
        self.C = t(i.C for i in insts)  # (R, k, r)
        self.c_hat0 = t(i.C_hat for i in insts)
        self.U_w = t(i.U_w for i in insts)  # (R, k, r)
        self.U_perp = t(i.U_perp for i in insts)  # (R, r, r)
        self.any_u_w = bool(self.U_w.abs().max() > 0)
        norms = t(i.teacher_norms() for i in insts)  # (R, k)
        self.t_scale = 1.0 / norms
        # teacher pre-activation: z/N + (Uᵀx) @ t_shift, t_shift = ξCᵀ/N (R, r, k)
        self.t_shift = problem.xi[:, None, None] * self.C.transpose(1, 2) / norms[:, None, :]

    # ------------------------------------------------------------------ construction
    @classmethod
    def check(cls, config, instance) -> None:
        """Rank-r keys valid for ``instance`` (``lora_instance``) and the engine (``reduced``
        only where the rank-r chain is exact); the retraction name is checked by its options."""
        from dynamics.instances.lora_instance import build_lora_instance

        build_lora_instance(instance, config.options.rank, lora_options(config))
        if config.engine == "reduced":
            ok, why = cls.exact_chain().supported(config)
            if not ok:
                raise ConfigError("engine", why)

    @classmethod
    def from_config(cls, config, problem: Problem) -> LoRA:
        o = config.options
        return cls(problem, run_lora_instances(config), eta=config.eta,
                   eta_c=config.step_size_c, project=o.project, joint_c=o.joint_c,
                   batch=config.batch, label_noise=config.label_noise, prox=o.prox,
                   retraction=o.retraction)

    def step_sizes(self) -> list[torch.Tensor]:
        return [self.eta_r, self.eta_c_r]


    @property
    def sqnorm_columns(self) -> tuple[int, int] | None:
        """‖Πx‖² per example for the projected b = 1 step."""
        return (self.k, self.problem.d) if self.project and self.batch == 1 else None

    def initial_frames(self, config) -> np.ndarray:
        """Û₀ (R, d, r) float64: Haar on St(span(W)^⊥, r) from the stream (seed, run, init)
        (r = 1: ``sampling.uniform_perp_directions``, the finetune learner's û₀); with
        ``init = aligned`` a run's Û₀ is negated where tr(M₀ᵀA(0)) < 0 (r = 1: m₀h(0) < 0)."""
        p, r = self.problem, self.rank
        runs, d, k = p.runs, p.d, p.k
        if r == 1:
            u0 = uniform_perp_directions(config.seed, runs, d, k)[..., None]
        else:
            u0 = np.zeros((runs, d, r))
            for i in range(runs):
                g = np.random.default_rng(run_seed(config.seed, i, "init")).standard_normal(
                    (d - k, r))
                u0[i, k:] = stiefel.uniform_frames(g)
        if config.options.init == "aligned":

            m0 = self._overlap_np(u0)
            for inst, idx in group_runs(self.instances):
                a0 = hermite.A_matrix(inst, np.zeros((r, r)))
                flip = idx[np.einsum("nab,ab->n", m0[idx], a0) < 0]
                u0[flip] *= -1.0
        return u0

    def _overlap_np(self, u0: np.ndarray) -> np.ndarray:
        k, r = self.k, self.rank
        uc = np.stack([i.U_coords for i in self.instances])  # (R, k + r, r)
        return np.einsum("nia,nib->nab", uc, u0[:, : k + r])

    def initial_state(self, config, instances) -> tuple[LoRAState, np.ndarray]:
        """Û₀ from :meth:`initial_frames`, Ĉ₀ = the instances' Ĉ; m₀ = sign(det M₀)σ_min(M₀)."""

        u0 = self.initial_frames(config)
        m0 = hermite.signed_smallest(self._overlap_np(u0))
        return self.init_state(u0), m0

    def init_state(self, u_hat0: np.ndarray, c_hat0: torch.Tensor | None = None) -> LoRAState:
        """State from Û₀ (R, d, r) (numpy or tensor) and Ĉ₀ (default: the instances')."""
        x = self.problem.xi
        u = torch.as_tensor(u_hat0, dtype=x.dtype, device=x.device).clone()
        c = (self.c_hat0 if c_hat0 is None else c_hat0).clone()
        return LoRAState(u, c, 0)

    # ------------------------------------------------------------------ gradient pieces
    def coefficients(self, state: LoRAState):
        """(1/N̂ (R, k), ξĈ/N̂ (R, k, r), ω = WÛ or None); cached while constant."""
        if self._coeffs is not None:
            return self._coeffs
        p, ch = self.problem, state.c_hat
        xc = p.xi[:, None, None] * ch
        if self.project:
            omega, n2 = None, 1.0 + (xc * xc).sum(-1)
        else:
            omega = p.l @ state.u_hat[:, : self.k]  # ωⱼ = wⱼᵀÛ
            n2 = 1.0 + (xc * (2.0 * omega + xc)).sum(-1)
        scale = torch.rsqrt(n2)
        out = (scale, xc * scale[..., None], omega)
        if self._frozen:
            self._coeffs = out
        return out

    def teacher_labels(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """f*(x) = Σᵢ λᵢσ((zᵢ + ξcᵢᵀUᵀx)/Nᵢ) for x (R, …, d), z = Wx (R, …, k)."""
        k, r = self.k, self.rank
        ux = rowmat(x[..., k: k + r], self.U_perp)
        if self.any_u_w:
            ux = ux + rowmat(x[..., :k], self.U_w)
        pre = rowmat(ux, self.t_shift)
        pre = pre.addcmul_(z, self.t_scale.reshape(z.shape[0], *([1] * (z.dim() - 2)), k))
        lam = self.problem.lam.reshape(z.shape[0], *([1] * (z.dim() - 2)), k)
        return (self.problem.activation.fn(pre) * lam).sum(-1)

    def prepare(self, state: LoRAState, x: torch.Tensor, eps: torch.Tensor | None = None,
                sqnorm: torch.Tensor | None = None) -> LoRAPrepared:
        """Labels, Wx (and z/N̂, ‖Πx‖²) of a chunk x (R, n, b, d), label normals eps (R, n, b)."""
        z = rowmat(x[..., : self.k], self.problem.lt)
        y = self.teacher_labels(x, z)
        if eps is not None and self.noise_sd > 0:
            y = y.add_(eps, alpha=self.noise_sd)
        zs = z * self.coefficients(state)[0][:, None, None] if self._frozen else None
        if self.project and x.shape[2] == 1 and sqnorm is None:
            sqnorm = torch.linalg.vector_norm(x[..., self.k:], dim=-1).square_()
        return LoRAPrepared(z, y, zs, sqnorm if self.project else None)

    def terms(self, state: LoRAState, x: torch.Tensor, pre: LoRAPrepared,
              i: int = 0) -> LoRATerms:
        """Per-example terms of step i of a prepared chunk (x (R, b, d): its examples)."""
        p = self.problem
        s = torch.bmm(x, state.u_hat)  # (R, b, r)
        scale, shift, omega = self.coefficients(state)
        zs = pre.zs[:, i] if pre.zs is not None else pre.z[:, i] * scale[:, None]
        a = zs + torch.bmm(s, shift.transpose(1, 2))
        lam = p.lam[:, None]
        resid = pre.y[:, i] - (p.activation.fn(a) * lam).sum(-1)
        delta = (-2.0 * resid)[..., None] * lam * p.activation.deriv(a)
        g = torch.bmm(delta, shift)
        return LoRATerms(s, a, resid, delta, g, scale, omega)

    def _gamma(self, t: LoRATerms) -> torch.Tensor:
        """γⱼ = δⱼaⱼξ/N̂ⱼ² (R, b, k): ∇_Û L ∋ −Wᵀdiag(γ)Ĉ (unprojected)."""
        return t.delta * t.a * (self.problem.xi[:, None] * t.scale * t.scale)[:, None]

    def _grad_c(self, state: LoRAState, t: LoRATerms) -> torch.Tensor:
        """∂L/∂Ĉ per example (R, b, k, r), plus the proximal term 2·prox·ξ²Ĉ."""
        xi = self.problem.xi[:, None, None]
        inner = xi * xi * state.c_hat if t.omega is None else xi * (t.omega + xi * state.c_hat)
        coef = t.delta * t.scale[:, None]  # δⱼ/N̂ⱼ
        grad = (xi[:, None] * coef[..., None] * t.s[:, :, None, :]
                - (coef * t.a * t.scale[:, None])[..., None] * inner[:, None])
        if self.prox:
            grad = grad + (2.0 * self.prox * xi * xi * state.c_hat)[:, None]
        return grad

    def euclidean_gradients(self, state: LoRAState, x: torch.Tensor, t: LoRATerms):
        """Per-example (Π)∇_Û L without its Û·sym term, (R, b, d, r)."""
        grad = x[..., :, None] * t.g[:, :, None, :]
        if self.project:
            grad[:, :, : self.k] = 0.0
        else:
            wg = self.problem.lt @ (self._gamma(t)[..., None] * state.c_hat[:, None])
            grad[:, :, : self.k] -= wg
        return grad

    def sample_gradients(self, state: LoRAState, x: torch.Tensor,
                         eps: torch.Tensor | None = None):
        """Reference per-example gradients (tests): (tangent (R, b, d, r), ∂L/∂Ĉ (R, b, k, r),
        L (R, b)); tangent = proju(Û, (Π)∇_Û L)."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        t = self.terms(state, x, pre)
        tangent = stiefel.proju(state.u_hat[:, None], self.euclidean_gradients(state, x, t))
        return tangent, self._grad_c(state, t), t.resid * t.resid

    def sample_loss(self, state: LoRAState, x: torch.Tensor,
                    eps: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example loss (R, b) whose gradients :meth:`sample_gradients` gives in closed
        form: :meth:`terms`'s (y − f̂)² plus the proximal term prox·ξ²‖Ĉ‖²_F, differentiable
        in Û and Ĉ (autograd tests; the coefficients are neither read from nor left in the
        cache)."""
        saved = self._coeffs, self._frozen
        self._coeffs, self._frozen = None, False
        try:
            pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
            t = self.terms(state, x, pre)
        finally:
            self._coeffs, self._frozen = saved
        loss = t.resid * t.resid
        if self.prox:
            xc = self.problem.xi[:, None, None] * state.c_hat
            loss = loss + self.prox * xc.square().sum((1, 2))[:, None]
        return loss

    # ------------------------------------------------------------------ steps
    def step_prepared_(self, state: LoRAState, x: torch.Tensor, pre: LoRAPrepared,
                       i: int) -> torch.Tensor:
        """Step i of a prepared chunk, in place; returns the retraction's health (R,)."""
        t = self.terms(state, x, pre, i)
        if self.joint_c:
            grad_c = self._grad_c(state, t).mean(1)
        if self.project and x.shape[1] == 1 and pre.sqnorm is not None:
            health = self._step_single(state, x[:, 0], t, pre.sqnorm[:, i, 0])
        else:
            health = self._step_general(state, x, t)
        if self.joint_c:
            state.c_hat.sub_(grad_c * self.eta_c_r[:, None, None])
        if not self._frozen:
            self._coeffs = None
        state.step += 1
        return health

    def _step_single(self, state: LoRAState, x: torch.Tensor, t: LoRATerms,
                     q: torch.Tensor) -> torch.Tensor:
        """Projected, b = 1: Û' = (Û B − η Πx gᵀ) P, P = retraction factor of the closed-form
        YᵀY (module docstring); only rows k.. of Û move (rows 0..k−1 stay 0)."""
        k = self.k
        eta = self.eta_r[:, None, None]
        s, g = t.s, t.g  # (R, 1, r)
        st, gt = s.transpose(1, 2), g.transpose(1, 2)
        sg = st * g  # s gᵀ
        sym = 0.5 * (sg + sg.transpose(1, 2))  # S
        v = sym @ st  # S s
        vg = v * g
        # YᵀY = I + η²[S² − (Ss)gᵀ − g(Ss)ᵀ + ‖Πx‖² g gᵀ] (the O(η) terms cancel)
        yty = (sym @ sym - vg - vg.transpose(1, 2) + q[:, None, None] * (gt * g)).mul_(eta * eta)
        torch.diagonal(yty, dim1=1, dim2=2).add_(1.0)
        p, health = stiefel.retraction_factor(yty, self.retraction)
        u = state.u_hat[:, k:]
        new = torch.bmm(u, p + eta * (sym @ p))  # Û B P, B = I + ηS
        new.baddbmm_(x[:, k:, None], eta * (g @ p), alpha=-1.0)
        u.copy_(new)
        return health

    def _step_general(self, state: LoRAState, x: torch.Tensor, t: LoRATerms) -> torch.Tensor:
        """Any b, projected or not: Y = Û − η proju(Û, Ḡ), Û' = Y P(YᵀY)."""
        u = state.u_hat
        grad = torch.bmm(x.transpose(1, 2), t.g / x.shape[1])  # mean of x gᵀ, (R, d, r)
        if self.project:
            grad[:, : self.k] = 0.0
        else:
            gamma = self._gamma(t).mean(1)
            grad[:, : self.k] -= self.problem.lt @ (gamma[..., None] * state.c_hat)
        y = u - self.eta_r[:, None, None] * stiefel.proju(u, grad)
        p, health = stiefel.retraction_factor(stiefel.gram(y), self.retraction)
        torch.bmm(y, p, out=u)
        return health

    def renormalize_(self, state: LoRAState) -> None:
        """Exact re-orthonormalisation Û ← Û P(ÛᵀÛ) (removes the closed-form step's drift)."""
        p, _ = stiefel.retraction_factor(stiefel.gram(state.u_hat), self.retraction)
        state.u_hat.copy_(torch.bmm(state.u_hat, p))

    # ------------------------------------------------------------------ engine protocol
    def overlap_matrix(self, state: LoRAState) -> torch.Tensor:
        """M = UᵀÛ (R, r, r) = U_⊥ᵀÛ[k:k+r] + U_wᵀÛ[:k]."""
        k, r = self.k, self.rank
        m = self.U_perp.transpose(1, 2) @ state.u_hat[:, k: k + r]
        if self.any_u_w:
            m = m + self.U_w.transpose(1, 2) @ state.u_hat[:, :k]
        return m

    def bad_runs(self, state: LoRAState) -> torch.Tensor:
        """Non-finite Û or Ĉ, or |ÛᵀÛ − I| > ORTHO_TOL."""
        u, c = state.u_hat, state.c_hat
        finite = torch.isfinite(u).flatten(1).all(-1) & torch.isfinite(c).flatten(1).all(-1)
        ortho = stiefel.orthonormality_error(torch.nan_to_num(u))
        tol = max(ORTHO_TOL, 1e4 * torch.finfo(u.dtype).eps)
        return ~finite | ~(ortho <= tol)

    def observe(self, state: LoRAState) -> dict:
        """M (R, r, r); Ĉ (R, k, r) when trained; ω = WÛ (R, k, r) when unprojected."""
        out = {"overlap_matrix": self.overlap_matrix(state).double().cpu().numpy()}
        if self.joint_c:
            out["c_hat"] = state.c_hat.double().cpu().numpy().copy()
        if not self.project:
            out["omega"] = (self.problem.l @ state.u_hat[:, : self.k]).double().cpu().numpy()
        return out

    def trajectory(self, result: RunResult):
        """Exact loss, overlaps and (projected, Ĉ frozen) the matrix ODE; see module doc."""

        rec, insts = result.records, self.instances
        m = rec["overlap_matrix"]  # (R, C, r, r)
        c_hats, omega = rec.get("c_hat"), rec.get("omega")
        sv = hermite.singular_values(m)
        loss = np.empty(m.shape[:2])
        for r, inst in enumerate(insts):
            loss[r] = hermite.population_loss_rank(
                inst, m[r], None if c_hats is None else c_hats[r],
                None if omega is None else omega[r])
        c_mat = np.stack([i.C for i in insts])[:, None]  # (R, 1, k, r)
        ch = np.stack([i.C_hat for i in insts])[:, None] if c_hats is None else c_hats
        norms = np.linalg.norm(ch, axis=(-2, -1)) * np.linalg.norm(c_mat, axis=(-2, -1))
        cc = np.swapaxes(ch, -1, -2) @ c_mat  # ĈᵀC, (R, 1 or C, r, r)
        update = np.einsum("...ab,...ba->...", cc, m) / norms  # tr(ĈᵀC M)/(‖Ĉ‖‖C‖)
        extra = {"overlap_matrix": m, "singular_values": sv, "update_overlap": update}
        c_ov = None
        if c_hats is not None:
            extra["c_hat"] = c_hats
            c_ov = (c_hats * c_mat).sum((-2, -1)) / norms
            # gauge-aligned ⟨ĈQᵀ, C⟩/(‖Ĉ‖‖C‖), Q = PVᵀ the polar factor of M = PSVᵀ: if
            # Û = UQ the teacher needs Ĉ = CQ (r = 1: ⟨ĉ,c⟩·sign m)
            p_, _, vt = np.linalg.svd(np.nan_to_num(m))
            q = p_ @ vt
            aligned = (c_hats @ np.swapaxes(q, -1, -2) * c_mat).sum((-2, -1)) / norms
            extra["aligned_c_overlap"] = np.where(np.isfinite(m).all((-2, -1)), aligned,
                                                  np.nan)
        ode = None
        if self.project and not self.joint_c:
            consts = hermite.RankConstants.stack(insts)
            m_ode = hermite.matrix_ode(consts, self.eta, m[:, 0], result.steps)
            extra["ode_singular_values"] = hermite.singular_values(m_ode)
            ode = hermite.signed_smallest(m_ode)
        return make_trajectory(result, hermite.signed_smallest(m), loss, loss_kind="exact",
                               ode=ode, c_overlap=c_ov, extra=extra)
