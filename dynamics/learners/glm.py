"""The ``glm`` learner: online SGD of a single-index model on the full sphere (ξ → ∞ limit).

Teacher f*(x) = σ(⟨u, x⟩) with the instance's u = (u_w, u⊥, 0, …) (canonical frame; W, λ, c
and ξ are ignored), student σ(⟨û, x⟩), û ∈ S^{d−1} (no projection). With s = ⟨û, x⟩,
y = σ(⟨u, x⟩) (+ label noise) and L = (y − σ(s))² (no 1/2):

    ∇_û L = g x,   g = −2(y − σ(s)) σ′(s),

and one step (mini-batch mean for b > 1) with tangent projection and normalisation retraction
is û' = (û − η(I − ûûᵀ)Ḡ)/‖·‖, Ḡ = (1/b)Σₙ gₙxₙ. For b = 1 this is
û' = ((1 + ηgs)û − ηgx)/n, n² = 1 + η²g²(‖x‖² − s²).

Observables (m = ⟨û, u⟩): the exact population loss E(f* − f̂)² = 2K(1) − 2K(m)
(K(ρ) = E σ(z₁)σ(z₂), ``hermite.dual_kernel``; label noise not included) and the GLM
population map m̄_{t+1} = m̄_t + η·2K′(m̄_t)(1 − m̄_t²) from each run's m₀ (:func:`glm_ode`).
``init = aligned`` flips û₀ so that m₀ ≥ 0 (the upper half-sphere start of Ben Arous et al.).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import scipy.integrate

import hermite
from dynamics.geometry import sphere
from dynamics.lazy import lazy_import
from dynamics.learners.base import Learner, RunResult, TensorState, make_trajectory
from dynamics.learners.directions import overlap_np
from dynamics.learners.options import Options, init_option
from dynamics.learners.problem import Problem
from dynamics.measures.losses import LOSS_EXACT
from dynamics.randomness.sampling import uniform_perp_directions

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["GLMState", "GLMPrepared", "GLM", "GLMOptions", "glm_ode", "glm_loss", "glm_drift",
           "ODE_DISCRETE_BUDGET"]

OVERLAP_TOL = 1e3  # |m| > 1 + OVERLAP_TOL·eps(dtype) counts as diverged
ODE_DISCRETE_BUDGET = 5 * 10**7  # runs × steps up to which the map is iterated step by step


@dataclass
class GLMState(TensorState):
    """State of R runs of the glm learner."""

    u_hat: torch.Tensor  # (R, d) student direction û, unit rows, canonical frame
    step: int = 0  # SGD steps taken


@dataclass
class GLMPrepared:
    """State-independent terms of a chunk of examples x (R, n, b, d)."""

    y: torch.Tensor  # (R, n, b) labels σ(⟨u, x⟩) (+ label noise)
    sqnorm: torch.Tensor | None  # (R, n, b) ‖x‖² (b = 1 only)


@dataclass(frozen=True)
class GLMOptions(Options):
    """Options of ``glm``: only the start (û lives on the full sphere; no ĉ, no W)."""

    init: str = init_option()


class GLM(Learner):
    """Learner ``glm`` for R runs at once (formulas in the module docstring).

    ``eta_r`` is the per-run step size (zeroed by the engine to freeze a diverged run).
    Its one option is ``init``: the options about W, ĉ and projection are not its own
    (û always lives on the full sphere).
    """

    name = "glm"
    Options = GLMOptions
    family = "single-index"
    instance_keys = ()  # W, ξ, ĉ and k do not enter: σ(⟨u, x⟩) alone
    chain = ("dynamics.reduced.glm_chain", "GLMChain")  # the scalar chain in m

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        return "single index, full sphere"

    def __init__(self, problem: Problem, *, eta: float, batch: int = 1,
                 label_noise: float = 0.0):
        self.problem, self.batch = problem, batch
        self.noise_sd = math.sqrt(label_noise)
        self.eta_r = eta * torch.ones_like(problem.xi)
        self._tmp = None

    @classmethod
    def from_config(cls, config, problem: Problem) -> GLM:
        return cls(problem, eta=config.eta, batch=config.batch, label_noise=config.label_noise)

    def step_sizes(self) -> list[torch.Tensor]:
        return [self.eta_r]


    @property
    def sqnorm_columns(self) -> tuple[int, int] | None:
        """‖x‖² over all d columns (b = 1 step)."""
        return (0, self.problem.d) if self.batch == 1 else None

    def initial_state(self, config, instances) -> tuple[GLMState, np.ndarray]:
        """û₀ uniform on S^{d−1} (stream (seed, r, ``init``)); ``aligned`` flips it to m₀ ≥ 0."""
        u0 = uniform_perp_directions(config.seed, config.runs, instances[0].d, 0)
        m0 = overlap_np(u0, instances)
        if config.options.init == "aligned":
            u0[m0 < 0] *= -1.0
            m0 = np.abs(m0)
        return self.init_state(u0), m0

    def init_state(self, u_hat0: np.ndarray) -> GLMState:
        p = self.problem
        return GLMState(torch.as_tensor(u_hat0, dtype=p.xi.dtype, device=p.xi.device).clone())

    # ------------------------------------------------------------------ gradient
    def prepare(self, state: GLMState, x: torch.Tensor, eps: torch.Tensor | None = None,
                sqnorm: torch.Tensor | None = None) -> GLMPrepared:
        """Labels y = σ(⟨u, x⟩) + √noise·ε and ‖x‖² (b = 1) of a chunk x (R, n, b, d)."""
        y = self.problem.activation.fn(self.problem.u_dot(x))
        if eps is not None and self.noise_sd > 0:
            y = y.add_(eps, alpha=self.noise_sd)
        if sqnorm is None and x.shape[2] == 1:
            sqnorm = torch.linalg.vector_norm(x, dim=-1).square_()
        return GLMPrepared(y, sqnorm)

    def _terms(self, state: GLMState, x: torch.Tensor, y: torch.Tensor):
        """(s, g, L) per example (R, b): s = ⟨û,x⟩, g = −2(y − σ(s))σ′(s), L = (y − σ(s))²."""
        if self._tmp is None or self._tmp.shape != x.shape or self._tmp.dtype != x.dtype:
            self._tmp = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s = torch.mul(x, state.u_hat[:, None], out=self._tmp).sum(-1)
        act = self.problem.activation
        resid = y - act.fn(s)
        return s, -2.0 * resid * act.deriv(s), resid * resid

    def sample_gradients(self, state: GLMState, x: torch.Tensor,
                         eps: torch.Tensor | None = None):
        """Reference per-example gradients (tests): (tangent (I − ûûᵀ)∇_û L (R, b, d), None
        (no second layer), L (R, b))."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        _, g, loss = self._terms(state, x, pre.y[:, 0])
        return sphere.proju(state.u_hat[:, None], g[..., None] * x), None, loss

    def sample_loss(self, state: GLMState, x: torch.Tensor,
                    eps: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example loss (y − σ(⟨û, x⟩))² (R, b), differentiable in û (autograd tests;
        :meth:`_terms` takes ⟨û, x⟩ in a scratch buffer, which autograd refuses)."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        resid = pre.y[:, 0] - self.problem.activation.fn(
            torch.linalg.vecdot(x, state.u_hat[:, None]))
        return resid * resid

    # ------------------------------------------------------------------ steps
    def step_prepared_(self, state: GLMState, x: torch.Tensor, pre: GLMPrepared,
                       i: int) -> torch.Tensor:
        """Step i of a prepared chunk in place; returns 1/n (not finite and > 0 ⇒ diverged)."""
        s, g, _ = self._terms(state, x, pre.y[:, i])
        eta, u = self.eta_r, state.u_hat
        state.step += 1
        if x.shape[1] == 1 and pre.sqnorm is not None:
            s, g, q = s[:, 0], g[:, 0], pre.sqnorm[:, i, 0]
            eg = eta * g
            # 1/n = (1 + η²g²(‖x‖² − s²))^{-1/2}; û' = ((1 + ηgs)û − ηgx)/n
            inv = torch.addcmul(q, s, s, value=-1.0).mul_(eg * eg).add_(1.0).rsqrt_()
            alpha = torch.addcmul(inv, inv, eg * s)
            u.mul_(alpha[:, None]).addcmul_(x[:, 0], eg.mul_(inv)[:, None], value=-1.0)
            return inv
        grad = torch.bmm((g / x.shape[1]).unsqueeze(1), x).squeeze(1)  # Ḡ = mean gₙxₙ
        ug = (u * grad).sum(-1)
        u.mul_((1.0 + eta * ug)[:, None]).addcmul_(grad, eta[:, None], value=-1.0)
        n = torch.linalg.vector_norm(u, dim=-1)
        u.div_(n[:, None])
        return n.reciprocal_()

    def renormalize_(self, state: GLMState) -> None:
        """Exact projx of û (removes the rounding drift of the closed-form normaliser)."""
        state.u_hat.div_(torch.linalg.vector_norm(state.u_hat, dim=-1, keepdim=True))

    # ------------------------------------------------------------------ engine protocol
    def bad_runs(self, state: GLMState) -> torch.Tensor:
        """|m| > 1 + tol or non-finite û (shows up in m)."""
        tol = 1.0 + OVERLAP_TOL * torch.finfo(state.u_hat.dtype).eps
        return ~(self.problem.overlap(state.u_hat).abs() <= tol)

    def observe(self, state: GLMState) -> dict:
        return {"overlap": self.problem.overlap(state.u_hat).double().cpu().numpy()}

    @staticmethod
    def trajectory(result: RunResult):
        """Overlap, exact loss 2K(1) − 2K(m) and the population map from each m₀
        (shared by the full engine and the reduced chain, ``dynamics.reduced.glm_chain``)."""
        config, act = result.config, result.instances[0].activation
        overlap = np.asarray(result.records["overlap"], dtype=float)
        ode = glm_ode(act, config.eta, result.m0, result.steps)
        return make_trajectory(result, overlap, glm_loss(act, overlap), loss_kind=LOSS_EXACT,
                               ode=ode)


# ---------------------------------------------------------------------- theory
def glm_loss(activation, m) -> np.ndarray:
    """Exact population loss E(σ(⟨u,x⟩) − σ(⟨û,x⟩))² = 2K(1) − 2K(m); NaN where m is NaN."""

    m = np.asarray(m, dtype=float)
    out = np.full(m.shape, np.nan)
    ok = np.isfinite(m)
    k1 = float(hermite.dual_kernel(activation, 1.0))
    out[ok] = 2.0 * k1 - 2.0 * hermite.dual_kernel(activation, np.clip(m[ok], -1.0, 1.0))
    return out


def glm_drift(activation, m) -> np.ndarray:
    """D(m) = 2K′(m)(1 − m²): E[m_{t+1} − m_t | m] = η D(m) + O(η²d) (``hermite`` K′)."""

    m = np.clip(np.asarray(m, dtype=float), -1.0, 1.0)
    return 2.0 * hermite.dual_kernel_derivative(activation, m) * (1.0 - m * m)


class KPrimeTable:
    """2K′(m) on [−1, 1] as a ``hermite.HTable`` (cubic interpolation in √(1 − |m|), error
    ≤ 1e-10·max|2K′| checked when built), evaluated in numba by
    ``hermite.expansion.table.table_eval``."""

    _cache: dict = {}

    def __init__(self, activation):

        def exact(_self, m):
            return 2.0 * hermite.dual_kernel_derivative(activation, np.clip(m, -1.0, 1.0))

        cls = type("_KPrimeHTable", (hermite.HTable,), {"_exact": exact})
        self.htable = cls(SimpleNamespace(u_perp=1.0))
        self.table, self.n = self.htable.table, self.htable.n

    @classmethod
    def get(cls, activation) -> KPrimeTable:
        key = activation.name
        if key not in cls._cache:
            cls._cache[key] = cls(activation)
        return cls._cache[key]


def glm_ode(activation, eta: float, m0, steps, method: str = "auto") -> np.ndarray:
    """(R, C) GLM population map m̄_{t+1} = m̄_t + η·2K′(m̄_t)(1 − m̄_t²) at ``steps``.

    ``method``: ``discrete`` iterates the map (numba, 2K′ from
    :class:`KPrimeTable`); ``continuous`` solves its flow dm/dt = η·2K′(m)(1 − m²) per run
    (DOP853, rtol 1e-10) at the checkpoints — the map is the flow's Euler scheme with unit
    step, so the two differ by O(η) (global Euler error); ``auto`` (default) iterates the map
    when runs × steps ≤ ``ODE_DISCRETE_BUDGET`` and solves the flow otherwise (scaling runs of
    10⁷–10⁸ steps). NaN m₀ gives a NaN row.
    """
    m0 = np.atleast_1d(np.asarray(m0, dtype=np.float64))
    ckpts = np.asarray(steps, dtype=np.int64)
    if method == "auto":
        method = "discrete" if m0.size * int(ckpts[-1]) <= ODE_DISCRETE_BUDGET else "continuous"
    tab = KPrimeTable.get(activation)
    if method == "discrete":
        from dynamics.learners.glm_map import iterate_map  # numba: compiled on first use

        return iterate_map(m0, float(eta), tab.table, tab.n, ckpts)
    if method != "continuous":
        raise ValueError(f"method must be auto, discrete or continuous, got {method!r}")
    out = np.full((m0.size, ckpts.size), np.nan)
    eta = float(eta)

    def rhs(_t, m):
        mc = np.clip(m, -1.0, 1.0)
        return eta * tab.htable(mc) * (1.0 - mc * mc)

    for r, start in enumerate(m0):
        if not np.isfinite(start):
            continue
        if ckpts[-1] == 0:
            out[r] = start
            continue
        sol = scipy.integrate.solve_ivp(rhs, (0.0, float(ckpts[-1])), [start], method="DOP853",
                                        t_eval=ckpts.astype(float), rtol=1e-10, atol=1e-14)
        if not sol.success:
            raise ArithmeticError(f"glm_ode: solver failed ({sol.message})")
        out[r] = sol.y[0]
    return out
