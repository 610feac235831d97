"""The ``linearized`` learner: online SGD on the first-order Taylor model around the base network.

The fine-tuned student has rows (wⱼ + Δⱼ)/‖wⱼ + Δⱼ‖ (unit wⱼ); to first order in Δ,
d/dΔ (w + Δ)/‖w + Δ‖ at Δ = 0 is Δ − w⟨w, Δ⟩, so the linearized (NTK / lazy) model is

    f_lin(x) = f₀(x) + Σⱼ βⱼ(x) (⟨Δⱼ, x⟩ − zⱼ⟨wⱼ, Δⱼ⟩),   βⱼ = λⱼσ′(zⱼ),   z = Wx,

with f₀ = Σⱼ λⱼσ(zⱼ) the base network (paper §B, Fig. 3: "Taylor expand around the base
model"). Note ⟨Δⱼ, x⟩ − zⱼ⟨wⱼ, Δⱼ⟩ = ⟨(I − wⱼwⱼᵀ)Δⱼ, x⟩: f_lin sees each Δⱼ only through
its part ⊥ wⱼ. The loss on one example is L = (y − f_lin(x))² + prox·‖Δ‖²_F (no 1/2; y the
teacher label, plus label noise if configured; prox from seed 003). Two parameterisations:

- rank 1 (default, :class:`Linearized`): Δ = ξ ĉ ûᵀ with û on the sphere, ĉ frozen or trained
  jointly, exactly the parameterisation and spherical step of ``finetune`` (eq. 4). With
  s = ⟨û, x⟩, ωⱼ = ⟨wⱼ, û⟩, b = ξ Σⱼ βⱼĉⱼ and r = y − f_lin, f_lin = f₀ + b s − ξΣⱼβⱼĉⱼzⱼωⱼ and

      ∇_û L = g x − Σⱼ γⱼ wⱼ,   g = −2 r b,   γⱼ = −2 r ξ βⱼ ĉⱼ zⱼ,
      ∂L/∂ĉⱼ = −2 r ξ βⱼ (s − zⱼωⱼ) + 2·prox·ξ²ĉⱼ,

  the same structure as finetune's sample gradient, so the û step (projected: ω = 0 and the
  span-W part drops) is finetune's, reused unchanged.
- full rank (``full_rank=True``, :class:`LinearizedFullRank`): Δ ∈ R^{k×d}, Δ₀ = 0, plain
  SGD Δ ← Δ − η(mean_b ∇_Δ L): ∇_{Δⱼ} L = −2 r βⱼ (x − zⱼwⱼ) + 2·prox·Δⱼ, the NTK of full
  fine-tuning. No projection ⊥ wⱼ is applied: the data gradient x − zⱼwⱼ is already ⊥ wⱼ
  (the linearized normalisation is that projection), so from Δ₀ = 0 every Δⱼ stays ⊥ wⱼ
  anyway. ``project=True`` applies eq. 4's Π to the gradient's rows, as for finetune, so the
  rows of Δ stay in span(W)^⊥ (Δ₀ = 0). Full rank has an exact reduced chain at any d
  (``dynamics.reduced.linear_chain``: Δ's coordinates in span W ⊕ e and the Gram of the rest,
  O(k²(k + b)) per step), which ``--engine auto`` takes where it applies; rank 1 has none.

Observables: ``overlap`` = ⟨û, u⟩ (rank 1) or, full rank, |⟨v₁, u⟩| with v₁ the top right
singular vector of Δ (NaN while Δ = 0); ``loss`` = the exact population loss of the *true*
network with rows (wⱼ + Δⱼ)/‖·‖ (``network_loss``, dual kernels); extra ``loss_linear`` = the
population loss of f_lin, exact (the quadratic form of ``hermite.flows.linearized``; a Monte Carlo
estimate on one evaluation set shared by every run put a common error of a few % into every
run's value, which the runs' spread cannot show); extra ``delta_norm`` = ‖Δ‖_F; ``c_overlap`` when ĉ
is trained. Theory (:func:`_theory`): the mean ODE (``ode``, ``ode_loss_true``,
``ode_loss_linear``) and the floors; rank 1 with û projected, also the finite-η corrected lines
``ode_corrected``, ``ode_corrected_loss_true``, ``ode_corrected_loss_linear``
(``hermite.finite_d.linearized_corrected``); a line outside the audit's tolerance beside
one within is not drawn (``dynamics.overlays.audit.not_drawn``).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dynamics.errors import ConfigError
from dynamics.lazy import lazy_import
from dynamics.learners.base import Learner, Memory, RunResult, TensorState, make_trajectory
from dynamics.learners.finetune import Finetune, FinetuneState
from dynamics.learners.options import LowRankOptions, option
from dynamics.learners.problem import Problem, per_run, rowmat
from dynamics.measures.network_loss import network_loss
from dynamics.measures.observables import c_overlap, group_runs

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["Linearized", "LinearizedOptions", "LinearizedFullRank", "FullRankState",
           "LinearPrepared", "LinearTerms", "reduce_rows", "top_overlap", "true_loss",
           "linear_loss"]



def _config_error(field: str, problem: str):
    return ConfigError(field, problem)


@dataclass
class LinearPrepared:
    """State-independent quantities of a chunk of examples x (R, n, b, d)."""

    z: torch.Tensor  # (R, n, b, k) Wx
    y: torch.Tensor  # (R, n, b) labels f*(x) (+ label noise)
    f0: torch.Tensor  # (R, n, b) base network f₀(x)
    beta: torch.Tensor  # (R, n, b, k) βⱼ = λⱼσ′(zⱼ)
    b: torch.Tensor | None  # (R, n, b) ξΣⱼβⱼĉⱼ while ĉ is frozen (rank 1), else None
    sqnorm: torch.Tensor | None  # (R, n, b) ‖Πx‖² or ‖x‖² (rank 1, b = 1 only)


@dataclass
class LinearTerms:
    """Per-example terms of the rank-1 sample gradient (shapes (R, b, k) or (R, b))."""

    z: torch.Tensor  # Wx
    s: torch.Tensor  # ⟨û, x⟩
    omega: torch.Tensor | None  # (R, k) ⟨wⱼ, û⟩ (None when projected: it is 0)
    resid: torch.Tensor  # r = y − f_lin
    beta: torch.Tensor  # βⱼ = λⱼσ′(zⱼ)
    b: torch.Tensor  # ξΣⱼβⱼĉⱼ
    xc: torch.Tensor  # (R, 1, k) ξĉ

    @cached_property
    def g(self) -> torch.Tensor:
        """Coefficient of x in ∇_û L: −2 r b."""
        return -2.0 * self.resid * self.b

    @cached_property
    def gamma(self) -> torch.Tensor:
        """γⱼ = −2 r ξ βⱼ ĉⱼ zⱼ: ∇_û L ∋ −Σⱼ γⱼ wⱼ (unprojected only)."""
        return (-2.0 * self.resid)[..., None] * self.beta * self.xc * self.z

    @cached_property
    def ell(self) -> torch.Tensor:
        """⟨(I − wⱼwⱼᵀ)û, x⟩ = s − zⱼωⱼ, (R, b, k)."""
        s = self.s[..., None]
        return s.expand_as(self.z) if self.omega is None else s - self.z * self.omega[:, None]

    @cached_property
    def loss(self) -> torch.Tensor:
        """L = (y − f_lin)² (without the prox term)."""
        return self.resid * self.resid


def _prepare(problem: Problem, x: torch.Tensor, eps, noise_sd: float):
    """z = Wx, y (+ noise), f₀ and β for x (R, …, d)."""
    z = rowmat(x[..., : problem.k], problem.lt)
    y = problem.teacher(x, z)
    if eps is not None and noise_sd > 0:
        y = y.add_(eps, alpha=noise_sd)
    lam = per_run(problem.lam, z.dim())
    act = problem.activation
    return z, y, (act.fn(z) * lam).sum(-1), act.deriv(z) * lam


@dataclass(frozen=True)
class LinearizedOptions(LowRankOptions):
    """Options of ``linearized``: the low-rank ones (rank 1) or a full-rank Δ."""

    full_rank: bool = option(False, "Train a full-rank Δ ∈ R^{k×d} (the NTK of full "
                                    "fine-tuning) instead of the rank-1 Δ = ξĉûᵀ.")


def _check(config, instance) -> None:
    """ConfigError for the settings the linearized learner does not support."""
    if config.engine == "reduced":
        if not config.options.full_rank:
            raise _config_error("engine", "rank-1 linearized has no reduced engine (only "
                                          "full_rank has an exact chain); use full or auto")
        ok, why = LinearizedFullRank.exact_chain().supported(config)
        if not ok:
            raise _config_error("engine", why)
    if config.options.full_rank:
        if config.options.joint_c:
            raise _config_error("joint_c", "full_rank linearized has no ĉ to train "
                                           "(Δ ∈ R^{k×d} is trained directly)")
        if config.options.init != "uniform":
            raise _config_error("init", "full_rank linearized starts at Δ = 0; init must be "
                                        "'uniform' (unused)")
    if instance.d is not None and instance.d < instance.k + 2:
        raise _config_error("instance", f"linearized needs d ≥ k + 2, got d = {instance.d}, "
                                        f"k = {instance.k}")


class Linearized(Finetune):
    """Learner ``linearized``, rank 1: Δ = ξĉûᵀ, finetune's spherical step on f_lin's loss.

    ``from_config`` returns a :class:`LinearizedFullRank` when ``config.options.full_rank``.
    """

    name = "linearized"
    Options = LinearizedOptions
    conventions = ("unit",)
    named_in_titles = True
    # the linear model's exact theory (hermite.flows.linearized): mean ODE and floor, recorded
    chain = None  # f_lin's rank-1 step is not the rank-1 chain's: it has none

    @classmethod
    def exact_chain(cls):
        """The registry hands out this class for both parameterisations (``from_config``
        picks :class:`LinearizedFullRank` for ``full_rank``), so it answers with the
        full-rank learner's chain, whose ``supported`` refuses rank-1 configs in one line."""
        return LinearizedFullRank.exact_chain()

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """Rank 1: û (d) and ĉ (k), records m, ĉ and û's k + 2 reduced coordinates; full
        rank: Δ (k×d), records its overlap and k(2k + 1) reduced coordinates."""
        if config.options.full_rank:
            return Memory(state=k * d, records=2 + k * (2 * k + 1), prepared=2 * k + 4)
        return Memory(state=d + k, records=1 + k + (k + 2), prepared=2 * k + 4)

    @classmethod
    def step_limit(cls, config, instance):
        return None

    def __init__(self, problem: Problem, *, eta: float, eta_c: float, project: bool = True,
                 joint_c: bool = False, batch: int = 1, label_noise: float = 0.0,
                 prox: float = 0.0):
        super().__init__(problem, eta=eta, eta_c=eta_c, project=project, joint_c=joint_c,
                         batch=batch, label_noise=label_noise, prox=prox, keep_coords=True)

    @classmethod
    def check(cls, config, instance) -> None:
        _check(config, instance)

    @classmethod
    def from_config(cls, config, problem: Problem):
        if config.options.full_rank:
            return LinearizedFullRank.from_config(config, problem)
        o = config.options
        return cls(problem, eta=config.eta, eta_c=config.step_size_c, project=o.project,
                   joint_c=o.joint_c, batch=config.batch, label_noise=config.label_noise,
                   prox=o.prox)

    def _xc(self, state: FinetuneState) -> torch.Tensor:
        return self.problem.xi[:, None] * state.c_hat

    def prepare(self, state: FinetuneState, x: torch.Tensor, eps: torch.Tensor | None = None,
                sqnorm: torch.Tensor | None = None) -> LinearPrepared:
        """State-independent terms of a chunk x (R, n, b, d), label normals eps (R, n, b)."""
        z, y, f0, beta = _prepare(self.problem, x, eps, self.noise_sd)
        b = None if self.joint_c else (beta * per_run(self._xc(state), 4)).sum(-1)
        lo = self.k if self.project else 0
        if sqnorm is None and x.shape[2] == 1:
            sqnorm = torch.linalg.vector_norm(x[..., lo: self.problem.d], dim=-1).square_()
        return LinearPrepared(z, y, f0, beta, b, sqnorm)

    def terms(self, state: FinetuneState, x: torch.Tensor, pre: LinearPrepared,
              i: int = 0) -> LinearTerms:
        """Per-example terms of step i of a prepared chunk; x (R, b, d) is that step's examples."""
        s = self._dot(x, state.u_hat)
        z, beta = pre.z[:, i], pre.beta[:, i]
        xc = self._xc(state)[:, None]
        b = pre.b[:, i] if pre.b is not None else torch.linalg.vecdot(beta, xc)
        f = pre.f0[:, i] + b * s
        omega = None
        if not self.project:
            omega = rowmat(state.u_hat[:, : self.k], self.problem.lt)
            f = f - torch.linalg.vecdot(beta * xc * z, omega[:, None])
        return LinearTerms(z, s, omega, pre.y[:, i] - f, beta, b, xc)

    def _gamma(self, t: LinearTerms) -> torch.Tensor:
        return t.gamma

    def _grad_c(self, state: FinetuneState, t: LinearTerms) -> torch.Tensor:
        """∂L/∂ĉ per example, (R, b, k): −2 r ξ βⱼ (s − zⱼωⱼ) + 2·prox·ξ²ĉⱼ."""
        xi = self.problem.xi[:, None, None]
        grad = (-2.0 * t.resid)[..., None] * xi * t.beta * t.ell
        if self.prox:
            grad = grad + 2.0 * self.prox * xi * t.xc
        return grad

    def trajectory(self, result: RunResult):
        """True (exact) and linear-model (Monte Carlo) losses from û's reduced coordinates."""
        rec, insts = result.records, result.instances
        xi = np.array([i.xi for i in insts])[:, None, None]
        c_hats = rec.get("c_hat")
        ch = c_hats if c_hats is not None else np.stack([i.c_hat for i in insts])[:, None]
        xc = xi * ch  # (R, C or 1, k)
        delta = xc[..., None] * rec["coords"][:, :, None, :]  # (R, C, k, k+2)
        c_ov = None
        if c_hats is not None:
            c_ov = c_overlap(c_hats, np.stack([i.c for i in insts])[:, None, :])
        return _trajectory(result, rec["overlap"], delta, c_ov)


@dataclass
class FullRankState(TensorState):
    """State of R runs of the full-rank linearized learner (run axis first)."""

    delta: torch.Tensor  # (R, k, d) Δ in the canonical frame
    step: int = 0


class LinearizedFullRank(Learner):
    """Learner ``linearized`` with ``full_rank``: plain SGD on Δ ∈ R^{k×d} (module docstring)."""

    name = "linearized"
    # its exact reduced chain (P in span W ⊕ e, the Gram of the rest): any d at O(k²(k + b))
    chain = ("dynamics.reduced.linear_chain", "LinearChain")

    def __init__(self, problem: Problem, *, eta: float, project: bool = True,
                 label_noise: float = 0.0, prox: float = 0.0):
        self.problem, self.k, self.project, self.prox = problem, problem.k, project, prox
        self.noise_sd = float(np.sqrt(label_noise))
        self.eta_r = eta * torch.ones_like(problem.xi)

    @classmethod
    def check(cls, config, instance) -> None:
        _check(config, instance)

    @classmethod
    def from_config(cls, config, problem: Problem) -> LinearizedFullRank:
        return cls(problem, eta=config.eta, project=config.options.project,
                   label_noise=config.label_noise, prox=config.options.prox)


    def step_sizes(self) -> list[torch.Tensor]:
        return [self.eta_r]

    def initial_state(self, config, instances) -> tuple[FullRankState, np.ndarray]:
        """Δ₀ = 0 (the base model); no initial overlap (NaN)."""
        p = self.problem
        delta = torch.zeros((p.runs, p.k, p.d), dtype=p.xi.dtype, device=p.xi.device)
        return FullRankState(delta, 0), np.full(p.runs, np.nan)

    def prepare(self, state: FullRankState, x: torch.Tensor, eps: torch.Tensor | None = None,
                sqnorm: torch.Tensor | None = None) -> LinearPrepared:
        z, y, f0, beta = _prepare(self.problem, x, eps, self.noise_sd)
        return LinearPrepared(z, y, f0, beta, None, None)

    def _residual(self, state: FullRankState, x: torch.Tensor, pre: LinearPrepared, i: int):
        """r = y − f_lin per example (R, b): f_lin = f₀ + Σⱼ βⱼ(⟨Δⱼ, x⟩ − zⱼ⟨wⱼ, Δⱼ⟩)."""
        z, beta = pre.z[:, i], pre.beta[:, i]
        dx = torch.bmm(x, state.delta.transpose(1, 2))  # (R, b, k) ⟨Δⱼ, x⟩
        wd = self._w_dot(state.delta)  # (R, k) ⟨wⱼ, Δⱼ⟩
        lin = dx - z * wd[:, None]
        return pre.y[:, i] - pre.f0[:, i] - torch.linalg.vecdot(beta, lin)

    def _w_dot(self, delta: torch.Tensor) -> torch.Tensor:
        """⟨wⱼ, Δⱼ⟩ (R, k): wⱼ = row j of L in the first k coordinates."""
        return (delta[:, :, : self.k] * self.problem.l).sum(-1)

    def _data_gradient(self, x: torch.Tensor, z: torch.Tensor, coef: torch.Tensor):
        """Σ_b coefⱼ (Π)(x − zⱼwⱼ) as (R, k, d), coef (R, b, k) (the −∇ of the data term)."""
        grad = torch.bmm(coef.transpose(1, 2), x)
        if self.project:
            grad[:, :, : self.k] = 0.0
        else:
            grad[:, :, : self.k] -= (coef * z).sum(1)[..., None] * self.problem.l
        return grad

    def sample_gradients(self, state: FullRankState, x: torch.Tensor,
                         eps: torch.Tensor | None = None):
        """Reference per-example gradients (tests): (∇_Δ L (R, b, k, d), L (R, b)).

        ∇_Δ L = (−2 r βⱼ (x − zⱼwⱼ) + 2·prox·Δⱼ)Π (Π on the rows, only if projected),
        L = r² + prox·‖Δ‖²_F.
        """
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        r = self._residual(state, x, pre, 0)
        coef = 2.0 * r[..., None] * pre.beta[:, 0]
        grads = torch.stack([-self._data_gradient(x[:, j: j + 1], pre.z[:, 0, j: j + 1],
                                                  coef[:, j: j + 1])
                             for j in range(x.shape[1])], 1)
        grads = grads + 2.0 * self.prox * state.delta[:, None]
        if self.project:
            grads[..., : self.k] = 0.0
        sq = state.delta.square().sum((1, 2))
        return grads, r * r + self.prox * sq[:, None]

    def sample_loss(self, state: FullRankState, x: torch.Tensor,
                    eps: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example loss r² + prox·‖Δ‖²_F (R, b) (:meth:`_residual`), differentiable in Δ
        (autograd tests). The rank-1 learner's is finetune's (``Finetune.sample_loss``)."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        r = self._residual(state, x, pre, 0)
        return r * r + self.prox * state.delta.square().sum((1, 2))[:, None]

    def step_prepared_(self, state: FullRankState, x: torch.Tensor, pre: LinearPrepared,
                       i: int) -> torch.Tensor:
        """Δ ← (1 − 2η·prox)Δ + η Σ_b (2rβⱼ/b) Π(x − zⱼwⱼ); returns (1 + mean r²)^{−1/2}."""
        r = self._residual(state, x, pre, i)
        coef = (2.0 / x.shape[1]) * r[..., None] * pre.beta[:, i]
        grad = self._data_gradient(x, pre.z[:, i], coef)
        eta = self.eta_r[:, None, None]
        if self.prox:
            state.delta.mul_(1.0 - 2.0 * self.prox * eta)
        state.delta.addcmul_(grad, eta)
        state.step += 1
        return torch.rsqrt(1.0 + (r * r).mean(1))

    fast = True  # step_chunk_ through the compiled kernel on CPU (tests: False)

    def bad_runs(self, state: FullRankState) -> torch.Tensor:
        """(R,) True where Δ has a non-finite entry: its row maxima and minima (NaN
        propagates through both, ±∞ shows in one), ~10× cheaper than an element mask."""
        delta = state.delta
        return ~(torch.isfinite(delta.amax(-1)) & torch.isfinite(delta.amin(-1))).all(-1)

    def step_chunk_(self, state: FullRankState, x: torch.Tensor, pre: LinearPrepared,
                    norms: torch.Tensor) -> None:
        """Every step of a chunk x (R, n, b, d) in place, health values into norms (n, R):
        on CPU one call of ``network_kernel.linear_chunk`` (the same update row by row, equal
        up to rounding), else :meth:`step_prepared_` per step (the reference)."""
        delta, n = state.delta, x.shape[1]
        if not (self.fast and delta.device.type == "cpu" and delta.is_contiguous()):
            for i in range(n):
                norms[i] = self.step_prepared_(state, x[:, i], pre, i)
            return
        from dynamics.learners.network_kernel import linear_chunk

        linear_chunk(delta, x, pre, self.problem.l, self.eta_r, norms, prox=self.prox,
                     project=self.project)
        state.step += n

    def observe(self, state: FullRankState) -> dict:
        """Δ in a (k, 2k+1) orthonormal basis of span W ⊕ e ⊕ rows(Δ) (:func:`reduce_rows`),
        and the overlap |⟨v₁, u⟩| of its top right singular vector."""
        red = reduce_rows(state.delta, self.k)
        p = self.problem
        u = np.zeros((p.runs, red.shape[-1]))
        u[:, : self.k] = p.u_w.double().cpu().numpy()
        u[:, self.k] = p.u_perp.double().cpu().numpy()
        return {"overlap": top_overlap(red, u), "delta": red}

    def trajectory(self, result: RunResult):
        rec = result.records
        return _trajectory(result, rec["overlap"], rec["delta"], None, full_rank=True)


def top_overlap(red: np.ndarray, u: np.ndarray) -> np.ndarray:
    """|⟨v₁, u⟩| with v₁ the top right singular vector of each Δ (…, k, D) written in a
    reduced basis (:func:`reduce_rows`), u (…, D) in the same basis (broadcast against Δ's
    leading axes); NaN where Δ = 0 (or is not finite). The full engine's ``observe`` and the
    exact chain's records (``dynamics.reduced.linear_chain``) both use it. Each Δ is scaled
    by its largest entry first (same singular vectors; a huge frozen Δ does not overflow)."""
    scale = np.abs(red).max((-2, -1), keepdims=True)
    ok = np.isfinite(scale) & (scale > 0)
    _, _, vt = np.linalg.svd(np.where(ok, red / np.where(ok, scale, 1.0), 0.0),
                             full_matrices=False)
    ov = np.abs((vt[..., 0, :] * u).sum(-1))
    return np.where(ok[..., 0, 0], ov, np.nan)


def reduce_rows(delta: torch.Tensor, k: int) -> np.ndarray:
    """(R, k, 2k+1) coordinates of Δ (R, k, d) in an orthonormal basis: the first k+1
    canonical coordinates (span W, e), then a basis of the rows' remaining part (QR).

    Gram matrices and inner products with W and u are preserved, and x's coordinates in
    the basis are again i.i.d. N(0, 1), so every population quantity is unchanged."""
    head = delta[:, :, : k + 1]
    _, rfac = torch.linalg.qr(delta[:, :, k + 1:].transpose(1, 2))  # restᵀ = Q R
    return torch.cat([head, rfac.transpose(1, 2)], -1).double().cpu().numpy()


def _base_rows(inst, width: int) -> np.ndarray:
    """(k, width) rows wⱼ in the canonical frame's first coordinates."""
    w = np.zeros((inst.k, width))
    w[:, : inst.k] = inst.w_factor
    return w


def true_loss(instances, delta: np.ndarray) -> np.ndarray:
    """(R, C) exact E(f* − f̂)² of the networks with rows (wⱼ + Δⱼ)/‖wⱼ + Δⱼ‖, λ̂ = λ.

    delta : (R, C, k, D) Δ in a basis whose first k+1 coordinates are the canonical ones
    (span W, e), D ≥ k + 1. NaN entries give NaN."""
    runs, cps = delta.shape[:2]
    out = np.full((runs, cps), np.nan)
    ok = np.isfinite(delta).all((2, 3))
    for inst, idx in group_runs(instances):
        rows = _base_rows(inst, delta.shape[-1]) + delta[idx]
        rows = rows / np.linalg.norm(rows, axis=-1, keepdims=True)
        loss = network_loss(inst, np.where(ok[idx][..., None, None], rows, 0.0), inst.lam)
        out[idx] = np.where(ok[idx], loss, np.nan)
    return out


def linear_loss(instances, delta: np.ndarray) -> np.ndarray:
    """(R, C) E(f* − f_lin)² exactly: ``hermite.flows.linearized.linear_model_loss`` (the quadratic
    form const − 2⟨b, Δ_S⟩ + ⟨Δ_S, AΔ_S⟩ + tr(BΔ_⊥Δ_⊥ᵀ), dual kernels) per instance group;
    delta (R, C, k, D) as in :func:`true_loss`."""
    from hermite.flows.linearized import linear_model_loss

    out = np.full(delta.shape[:2], np.nan)
    for inst, idx in group_runs(instances):
        out[idx] = linear_model_loss(inst, np.asarray(delta[idx], dtype=float))
    return out


FLOOR_BFGS_MAX_K = 10  # the rank-1 unprojected joint floor (BFGS, seeded starts) up to this k
ODE_RTOL = 1e-7  # the rank-1 mean-drift ODE's tolerance (a curve beside SGD, not a test value)


def _theory(result: RunResult, full_rank: bool) -> tuple[dict, dict, dict]:
    """The linear model's exact theory beside its runs (``hermite.flows.linearized``), per instance
    group: the mean ODE of the overlap and of the linear loss L(E Δₜ), the floor min L and the
    true network loss at its minimiser. Returns (Trajectory theory kwargs, extras, attrs).

    Full rank: E Δₜ is exact (the sample gradient is affine in Δ), so ``ode_loss_linear`` is
    L at the mean (a lower bound of the mean loss by the SGD noise, ``tr A Cov Δₜ``). Rank 1:
    the mean-drift ODE of (û, ĉ), first order in η (no retraction lag). A mean that diverges
    with its runs (η beyond its stability) reads NaN."""
    runs, cps = len(result.instances), result.steps.size
    curves = tuple(np.full((runs, cps), np.nan) for _ in range(3))  # overlap, L_lin, L_true
    floors = (np.full(runs, np.nan), np.full(runs, np.nan))  # L_lin*, L_true at Δ*
    notes: list[str] = []
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for inst, idx in group_runs(result.instances):
            _theory_group(result, inst, idx, full_rank, curves, floors, notes)
    for a in (*curves, *floors):
        a[~np.isfinite(a)] = np.nan
    order = ("exact mean of SGD (E Δₜ; L at the mean, below the mean loss by the SGD noise)"
             if full_rank else "mean-drift ODE, first order in η (no retraction lag)")
    # the floors are constants, stored per checkpoint to be drawn as lines like the ODE
    extra = {"ode_loss_linear": curves[1], "ode_loss_true": curves[2],
             "floor_linear": np.repeat(floors[0][:, None], cps, 1),
             "floor_true": np.repeat(floors[1][:, None], cps, 1)}
    attrs = {"ode_loss_linear": {"note": order}, "ode_loss_true": {"note": order},
             "floor_linear": {"note": "min over the learner's Δ of the linear model's "
                                      "population loss" + ("; " + "; ".join(notes)
                                                           if notes else "")},
             "floor_true": {"note": "the true network's loss at the floor's minimiser"}}
    return {"ode": curves[0]}, extra, attrs


def _theory_group(result, inst, idx, full_rank, curves, floors, notes) -> None:
    """:func:`_theory` for the runs ``idx`` of one instance, into ``curves``/``floors``."""
    from hermite.flows.linearized import (
        linear_model_floor,
        linear_model_ode,
        linear_model_quadratic,
        linear_model_rank1_ode,
    )
    from hermite.flows.regime import FinetuneRegime

    cfg, rec, steps, o = result.config, result.records, result.steps, result.config.options
    quad = linear_model_quadratic(inst)
    if full_rank:
        mean = linear_model_ode(inst, None, cfg.eta, steps, project=o.project, prox=o.prox,
                                quad=quad)
    else:
        c0 = rec["c_hat"][idx, 0] if o.joint_c else None
        regime = FinetuneRegime(cfg.eta, project=o.project, joint_c=o.joint_c,
                                eta_c=cfg.step_size_c, prox=o.prox)
        mean = linear_model_rank1_ode(inst, rec["coords"][idx, 0], regime, steps, c0=c0,
                                      quad=quad, rtol=ODE_RTOL)
    for out, value in zip(curves, (mean.overlap, mean.loss_linear, mean.loss_true),
                          strict=True):
        out[idx] = value
    if not full_rank and o.joint_c and not o.project and inst.k > FLOOR_BFGS_MAX_K:
        notes.append(f"rank-1 unprojected joint-ĉ floor not computed for k = {inst.k} > "
                     f"{FLOOR_BFGS_MAX_K} (a BFGS search over the sphere)")
        return
    floor = linear_model_floor(inst, rank="full" if full_rank else 1, project=o.project,
                               joint_c=o.joint_c, prox=o.prox, quad=quad)
    floors[0][idx], floors[1][idx] = floor.loss_linear, floor.loss_true


def _trajectory(result: RunResult, overlap, delta, c_ov, full_rank: bool = False):
    """The Trajectory of either parameterisation from Δ (R, C, k, D) in a reduced basis, with
    the linear model's exact theory (:func:`_theory`) and, rank 1 projected, its finite-η
    corrected lines (:func:`_corrected_theory`)."""
    insts = result.instances
    theory, extra, attrs = _theory(result, full_rank)
    loss = true_loss(insts, delta)
    extra = {"loss_linear": linear_loss(insts, delta),
             "delta_norm": np.sqrt(np.square(delta).sum((2, 3)))} | extra
    if not full_rank:
        corrected, corr_attrs = _corrected_theory(result)
        if corrected:
            theory["ode_corrected"] = corrected.pop("ode_corrected")
            extra |= corrected
            attrs |= corr_attrs
    return make_trajectory(result, overlap, loss, loss_kind="exact",
                           c_overlap=c_ov, extra=extra, theory=theory, extra_attrs=attrs)


def corrected_seconds(runs: int, k: int, checkpoints: int, rk4_steps: int) -> float:
    """Estimated seconds of :func:`hermite.finite_d.linearized_corrected.linear_rank1_corrected`
    for ``runs`` runs (``CORRECTED_COST``: per run, RK4 step and point·row of the QMC
    average; per run, checkpoint and sigma point·row² of the true loss)."""
    from hermite.finite_d.linearized_corrected import Q_EVERY, SAMPLES

    flow = CORRECTED_COST["flow"] * runs * rk4_steps * SAMPLES * (k + 1) * (1 + k / Q_EVERY)
    sigma = CORRECTED_COST["sigma"] * runs * checkpoints * 2 * (k + 1) * k * k
    return flow + sigma


# seconds per unit of corrected_seconds' counts, measured at Fig. 3's quick cell (k = 20,
# 4 runs, 73 checkpoints, 631 RK4 steps: 9.6 s flow, 2.8 s sigma points) on the 2-core
# machine under load
CORRECTED_COST = {"flow": 6.3e-9, "sigma": 5.7e-7}


def _corrected_theory(result: RunResult) -> tuple[dict, dict]:
    """The finite-η corrected lines of the rank-1 learner, projected û
    (``hermite.finite_d.linearized_corrected``, eq. L2 of docs/theory/linearized.md) from each
    run's start: ``ode_corrected`` (E|⟨û, u⟩|) and extra ``ode_corrected_loss_true`` /
    ``ode_corrected_loss_linear``, with their attributes; ({}, {}) where they do not apply
    (unprojected û, ``--no-finite-d-theory``, η·d beyond ``FINITE_D_MAX_ETA_D``). Over the
    cost budget: from some runs' starts only (``partial``); a failure: left out with why
    (``corrected``)."""
    from dynamics.overlays.finetune import (
        CORRECTED_BUDGET_S,
        budget_groups,
        corrected_applies,
        finetune_regime,
    )
    from hermite.finite_d.linearized_corrected import linear_rank1_corrected, rk4_steps

    cfg, rec, steps, insts = result.config, result.records, result.steps, result.instances
    if not cfg.options.project or not corrected_applies(cfg, insts[0].d):
        return {}, {}
    k, runs = insts[0].k, len(insts)
    mu0 = np.asarray(rec["coords"][:, 0, k], dtype=float)
    c0 = (np.asarray(rec["c_hat"][:, 0], dtype=float) if cfg.options.joint_c
          else np.stack([i.c_hat for i in insts]))
    names = ("ode_corrected", "ode_corrected_loss_true", "ode_corrected_loss_linear")
    out = {name: np.full((runs, steps.size), np.nan) for name in names}
    regime0 = finetune_regime(cfg, insts[0])
    cost = corrected_seconds(runs, k, steps.size, rk4_steps(insts[0], regime0, steps))
    chosen, meta = np.ones(runs, dtype=bool), {}
    if cost > CORRECTED_BUDGET_S:
        chosen = budget_groups(group_runs(insts), mu0, int(runs * CORRECTED_BUDGET_S // cost))
    if not chosen.all():
        meta["partial"] = (f"finite-η corrected line from {int(chosen.sum())} of {runs} runs' "
                           f"starts (spread over ⟨û₀, u⟩; NaN in the others): all ≈ "
                           f"{cost:.0f} s > {CORRECTED_BUDGET_S:g} s")
        print(f"note: {meta['partial']}", file=sys.stderr)
    failed = []
    for inst, idx in group_runs(insts):
        idx = idx[chosen[idx]]
        if not idx.size:
            continue
        try:
            with np.errstate(all="ignore"):
                line = linear_rank1_corrected(inst, mu0[idx], c0[idx],
                                              finetune_regime(cfg, inst), steps)
        except (ArithmeticError, ValueError) as exc:
            failed.append(f"runs {idx[0]}…{idx[-1]}: {exc}")
            continue
        for name, value in zip(names, (line.overlap, line.loss_true, line.loss_linear),
                               strict=True):
            out[name][idx] = value
    if failed:
        meta["corrected"] = (f"finite-η corrected line left out: its integration failed "
                             f"({failed[0]})" + (f"; {len(failed) - 1} more run groups failed"
                                                 if len(failed) > 1 else ""))
        print(f"note: {meta['corrected']}", file=sys.stderr)
    if not np.isfinite(out["ode_corrected"]).any():
        return {}, ({"ode": {"corrected": meta["corrected"]}} if failed else {})
    eta_d = cfg.eta * insts[0].d
    note = ("finite-η corrected mean of the rank-1 learner (hermite.finite_d.linearized_"
            "corrected, eq. L2 of docs/theory/linearized.md): the O(η) drift, the spherical "
            "step's O(η²d) renormalisation and the linear-noise spread of (⟨û, e⟩, ĉ) "
            f"(η·d = {eta_d:.3g})")
    attrs = {"ode_corrected": {"note": note + "; E|⟨û, u⟩|", "ode": "corrected"} | meta,
             "ode_corrected_loss_true": {"note": note + "; E of the true loss", "ode":
                                         "corrected"} | meta,
             "ode_corrected_loss_linear": {"note": note + "; E of the linear loss (exact "
                                                  "given the moments)", "ode": "corrected"}
             | meta}
    return out, attrs
