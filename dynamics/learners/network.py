"""Learners ``scratch``, ``scratch-csq`` and ``sparse``: a two-layer network of unit rows
(or of free rows: the committee machine).

Student f̂(x) = Σⱼ λ̂ⱼ σ(⟨ŵⱼ, x⟩), ŵⱼ ∈ S^{d−1} (j < k′), trained by spherical online SGD
(the same retraction as eq. 4, one row at a time); with ``rows = "free"`` (scratch,
scratch-csq) the rows are unconstrained, start i.i.d. N(0, s²I/d) (s = ``init_scale``, so
‖ŵⱼ‖ ≈ s) and follow plain online SGD ŵⱼ ← ŵⱼ − η Gⱼ (Saad & Solla's committee machine in
engine units: their η̄ = η·d, docs/theory/committee.md). With aⱼ = ⟨ŵⱼ, x⟩ and y the label
(teacher f*(x) = Σᵢ λᵢ σ(⟨vᵢ, x⟩), plus label noise), the sample gradients are

    squared loss     L = (y − f̂)²:  ∇_{ŵⱼ} L = δⱼ x,  δⱼ = −2(y − f̂) λ̂ⱼ σ′(aⱼ),
                                     ∂L/∂λ̂ⱼ = −2(y − f̂) σ(aⱼ);
    correlation loss L = −y f̂:      δⱼ = −y λ̂ⱼ σ′(aⱼ),  ∂L/∂λ̂ⱼ = −y σ(aⱼ)   (CSQ learner).

A step on a mini-batch averages them: Gⱼ = mean_b δⱼ x, and since ⟨ŵⱼ, Gⱼ⟩ = mean_b δⱼ aⱼ the
tangent step ŵⱼ ← (ŵⱼ − η(Gⱼ − ⟨ŵⱼ,Gⱼ⟩ŵⱼ))/nⱼ has nⱼ² = 1 + η²(‖Gⱼ‖² − ⟨ŵⱼ,Gⱼ⟩²) in closed
form (exact retraction ``sphere.retr``; rows are renormalised exactly at every chunk end).
Only trainable rows move (per-run row mask); the second layer, when trained, follows plain
SGD λ̂ ← λ̂ − η_c mean_b ∂L/∂λ̂ (same pre-step state as the rows). Cost O(b·k′·d) per step
and run.

- ``scratch``: rows start i.i.d. uniform on S^{d−1}; λ̂ fixed to the teacher's λ (k′ = k;
  any k′ when the λᵢ are equal: λ̂ = λ₁·1, e.g. Saad & Solla's A = v = 1), or trained
  (``train_second_layer``; λ̂₀ = λ if k′ = k, else λ̂ⱼ ~ N(0, 1/k′)).
- ``scratch-csq``: the same student under the correlation loss, λ̂ = λ fixed.
- Both start from given rows instead with ``init_rows`` (a file; ``given_rows``).
- ``sparse`` (S²FT, seed 002): rows start at W's rows, λ̂ = λ fixed, only s rows trainable.

Randomness (initial rows, λ̂₀, the ``random`` sparse selection) comes from run r's ``init``
stream ``run_seed(seed, r, "init")`` only, so a run's numbers do not depend on R.

Observables: the cross Gram ⟨vᵢ, ŵⱼ⟩ (k × k′), the student Gram and λ̂; from them the exact
population loss E(f* − f̂)² (``network_loss_from_grams``) and the alignment: mean over teacher
neurons i of maxⱼ |⟨vᵢ, ŵⱼ⟩| (scratch), of ⟨vᵢ, ŵᵢ⟩ (sparse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dynamics.errors import ConfigError
from dynamics.geometry import sphere
from dynamics.lazy import lazy_import
from dynamics.learners.base import Learner, Memory, RunResult, TensorState, make_trajectory
from dynamics.learners.given_rows import (
    INIT_FRAMES,
    canonical_rows,
    check_given_rows,
    given_rows,
    given_rows_attrs,
    resolve_frame,
)
from dynamics.learners.options import Options, eta_c_option, option
from dynamics.learners.problem import Problem, rowmat
from dynamics.measures.losses import LOSS_EXACT
from dynamics.measures.network_loss import network_loss_from_grams, network_loss_from_overlaps
from dynamics.randomness.sampling import run_seed

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["NetworkState", "NetworkLearner", "Scratch", "ScratchCSQ", "Sparse",
           "ScratchOptions", "ScratchCSQOptions", "SparseOptions", "SPARSE_SELECTIONS", "ROWS",
           "exact_loss", "alignment", "sparse_rows", "sparse_selection"]

SQUARED, CORRELATION = "squared", "correlation"
SPARSE_SELECTIONS = ("lambda", "random")
ROWS = ("unit", "free")


@dataclass(frozen=True)
class StartOptions(Options):
    """The options of both from-scratch learners: the rows' kind and where they start."""

    rows: str = option("unit", "First-layer rows: unit (on the sphere, spherical SGD) or free "
                               "(unconstrained, plain SGD: the committee machine).",
                       choices=ROWS)
    init_scale: float = option(1.0, "Free rows: initial rows i.i.d. N(0, init_scale²·I/d) "
                                    "(‖ŵ‖ ≈ init_scale).", check="positive")
    init_rows: str | None = option(None, "Initial rows from a file (.npy or text): a k′×d "
                                         "array for every run or R×k′×d, one per run "
                                         "[default: random rows].")
    init_frame: str = option("auto", "Coordinates of --init-rows: those of the spec's "
                                     "explicit W (original; committee teacher), the canonical "
                                     "frame, or auto (original when W is explicit).",
                             choices=INIT_FRAMES)


@dataclass(frozen=True)
class ScratchOptions(StartOptions):
    """Options of ``scratch``."""

    width: int | None = option(None, "Student width k′ [default: k; another width needs "
                                     "--train-second-layer, or a teacher of equal λᵢ (then "
                                     "λ̂ = λ₁·1)].", check="positive")
    train_second_layer: bool = option(False, "Also train the second layer λ̂ (plain SGD, "
                                             "step size eta_c).")
    eta_c: float | None = eta_c_option()


@dataclass(frozen=True)
class ScratchCSQOptions(StartOptions):
    """Options of ``scratch-csq`` (λ̂ = λ fixed: the correlation loss is unbounded in λ̂)."""


@dataclass(frozen=True)
class SparseOptions(Options):
    """Options of ``sparse`` (S²FT)."""

    sparse_rows: int | None = option(None, "Rows s tuned [default: ⌈(k + d)/d⌉, rank-1 "
                                           "LoRA's parameter budget].", check="positive")
    sparse_select: str = option("lambda", "Rows tuned: those of largest |λᵢ| (lambda) or "
                                         "random ones.", choices=SPARSE_SELECTIONS)


@dataclass
class NetworkState(TensorState):
    """State of R runs of a unit-row network learner (run axis first)."""

    rows: torch.Tensor  # (R, k′, d) first-layer rows ŵⱼ, unit norm, canonical frame
    lam_hat: torch.Tensor  # (R, k′) second layer λ̂
    step: int = 0  # SGD steps taken


@dataclass
class Prepared:
    """State-independent terms of a chunk of examples x (R, n, b, d)."""

    y: torch.Tensor  # (R, n, b) labels f*(x) (+ label noise)


def student_width(config, k: int) -> int:
    """k′: option ``width``, else the number of rows in ``init_rows``, else k (learners
    without those options: k)."""
    o = config.options
    if getattr(o, "width", None) is not None:
        return int(o.width)
    if getattr(o, "init_rows", None) is not None:
        return given_rows(o.init_rows).width
    return k


def _trained(config) -> bool:
    """Whether λ̂ is trained (``scratch``'s option; the other network learners keep λ)."""
    return bool(getattr(config.options, "train_second_layer", False))


def _start_kwargs(config) -> dict:
    """The rows' kind and scale from the start options (``sparse`` starts at W: unit)."""
    o = config.options
    if not isinstance(o, StartOptions):
        return {}
    return {"rows": o.rows, "init_scale": o.init_scale}


def sparse_rows(config, k: int, d: int) -> int:
    """s: the option ``sparse_rows``, or min(k, ⌈(k + d)/d⌉) (rank-1 LoRA's budget)."""
    if config.options.sparse_rows is not None:
        return int(config.options.sparse_rows)
    return min(k, math.ceil((k + d) / d))


def sparse_selection(config, lam: np.ndarray, d: int, run: int) -> np.ndarray:
    """Sorted indices of the s rows that ``sparse`` tunes in run ``run`` (λ (k,) its λ).

    ``lambda``: the s largest |λᵢ| (ties: lower index first); ``random``: s distinct rows
    drawn from the run's ``init`` stream.
    """
    lam = np.asarray(lam, dtype=float)
    s = sparse_rows(config, lam.shape[0], d)
    if config.options.sparse_select == "random":
        rng = np.random.default_rng(run_seed(config.seed, run, "init"))
        return np.sort(rng.choice(lam.shape[0], size=s, replace=False))
    return np.sort(np.argsort(-np.abs(lam), kind="stable")[:s])


def exact_loss(instances, cross: np.ndarray, gram: np.ndarray,
               lam_hat: np.ndarray, unit: bool = True) -> np.ndarray:
    """(R, C) exact E(f* − f̂)² from cross (R, C, k, k′), gram (R, C, k′, k′), λ̂ (R, C, k′):
    dual kernels for unit rows and a unit-row teacher (``unit``), else the Gaussian integrals
    of the fields' covariance (``network_loss_from_overlaps``: free rows, committee teacher).

    Non-finite checkpoints (none expected: the engine restores diverged runs) give NaN.
    """
    out = np.full(cross.shape[:2], np.nan)
    for r, inst in enumerate(instances):
        ok = (np.isfinite(cross[r]).all((-1, -2)) & np.isfinite(gram[r]).all((-1, -2))
              & np.isfinite(lam_hat[r]).all(-1))
        if unit:
            out[r, ok] = network_loss_from_grams(inst.activation, inst.lam,
                                                 inst.teacher_gram(), lam_hat[r, ok],
                                                 gram[r, ok], cross[r, ok])
        else:
            out[r, ok] = network_loss_from_overlaps(inst.activation, inst.lam,
                                                    inst.teacher_gram(), lam_hat[r, ok],
                                                    gram[r, ok], cross[r, ok])
    return out


def alignment(cross: np.ndarray, diagonal: bool, gram: np.ndarray | None = None,
              teacher_gram: np.ndarray | None = None) -> np.ndarray:
    """Mean over teacher neurons i of cos(vᵢ, ŵᵢ) (``diagonal``) or of maxⱼ |cos(vᵢ, ŵⱼ)|,
    cos = ⟨vᵢ, ŵⱼ⟩ (unit rows) or ⟨vᵢ, ŵⱼ⟩/(‖vᵢ‖‖ŵⱼ‖) given the student Gram ``gram``
    (…, k′, k′) and the teacher's (k, k) or (R, k, k) (free rows, committee teacher)."""
    if gram is not None:
        sn = np.sqrt(np.diagonal(gram, axis1=-2, axis2=-1))[..., None, :]
        tn = np.sqrt(np.diagonal(teacher_gram, axis1=-2, axis2=-1))
        tn = tn[:, None, :, None] if tn.ndim == 2 else tn[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            cross = cross / (sn * tn)
    if diagonal:
        return np.diagonal(cross, axis1=-2, axis2=-1).mean(-1)
    return np.abs(cross).max(-1).mean(-1)


def bartlett_factor(rng: np.random.Generator, n: int, dof: int) -> np.ndarray:
    """(n, n) lower-triangular L with Lⱼⱼ² ~ χ²_{dof−j} and N(0, 1) below the diagonal: the
    L of an n × dof standard Gaussian matrix G = L Qᵀ (Bartlett), so LLᵀ ~ GGᵀ (Wishart)."""
    out = np.tril(rng.standard_normal((n, n)), -1)
    out[np.diag_indices(n)] = np.sqrt(rng.chisquare(dof - np.arange(n)))
    return out


def lq_factor(rows: np.ndarray, width: int) -> np.ndarray:
    """(k′, width) coordinates of ``rows`` (k′ × n) in an orthonormal basis of a space holding
    them, with the same Gram: the L of rows = L Qᵀ, zero-padded (n may be < ``width``)."""
    rows = np.asarray(rows, dtype=np.float64)
    out = np.zeros((rows.shape[0], width))
    if rows.shape[1] == 0:
        return out
    _q, r = np.linalg.qr(rows.T, mode="reduced")  # rows.T = Q R, so rows = Rᵀ Qᵀ
    out[:, : r.shape[0]] = r.T
    return out


class NetworkLearner(Learner):
    """Spherical online SGD of a unit-row two-layer network (module docstring: formulas).

    ``mask`` (R, k′) bool marks the trainable rows. ``eta_r`` (R,) and ``eta_c_r`` (R,) are
    per-run step sizes (the engine zeroes a diverged run's entries).
    """

    loss_name = SQUARED
    family = "network"
    committee_loss = SQUARED
    # the exact overlap chain (P, ZZᵀ, λ̂) at any d (:mod:`dynamics.reduced.network_chain`)
    chain = ("dynamics.reduced.network_simulate", "NetworkChain")

    @classmethod
    def neurons(cls, config, k: int) -> int:
        return student_width(config, k)

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """k′ rows of d and λ̂ (k′); records the cross (k×k′) and Gram (k′×k′) overlaps and
        λ̂; prepares the k′ fields and their derivatives per example."""
        width = cls.neurons(config, k)
        return Memory(state=width * d + width, records=k * width + width * width + width,
                      prepared=2 * max(k, width) + 4)

    def __init__(self, problem: Problem, *, width: int, eta: float, eta_c: float,
                 train_second_layer: bool = False, batch: int = 1, label_noise: float = 0.0,
                 mask: torch.Tensor | None = None, rows: str = "unit",
                 init_scale: float = 1.0):
        self.problem, self.k, self.width = problem, problem.k, width
        self.train_second_layer, self.batch = train_second_layer, batch
        self.rows, self.init_scale = rows, float(init_scale)
        self.noise_sd = math.sqrt(label_noise)
        ones = torch.ones_like(problem.xi)
        self.eta_r, self.eta_c_r = eta * ones, eta_c * ones
        if mask is None:
            mask = torch.ones((problem.runs, width), dtype=torch.bool, device=ones.device)
        self.mask = mask
        self._mask_f = mask.to(ones.dtype)
        self._vrows = None  # teacher rows (R, k, k+1), built on first use
        self.given = None  # (GivenRows, resolved frame) when the rows came from a file

    # ------------------------------------------------------------------ construction
    @classmethod
    def check(cls, config, instance) -> None:
        if config.options.init_rows is not None:
            cls._check_given(config, instance)
        width = student_width(config, instance.k)
        lam = np.asarray(instance.lam, float)
        if not _trained(config) and width != instance.k and np.ptp(lam) != 0:
            raise ConfigError("width", f"{cls.name} with a fixed second layer (λ̂ = λ) needs "
                                       f"width = k = {instance.k} or a teacher of equal λᵢ "
                                       f"(then λ̂ = λ₁·1), got {width}")
        if config.options.rows != "free" and config.options.init_scale != 1.0:
            raise ConfigError("init_scale", "sets the scale of free rows (--rows free); unit "
                                            "rows start uniform on the sphere")

    @classmethod
    def _check_given(cls, config, instance) -> None:
        """``init_rows``: readable, its frame available, its shape and width consistent."""
        rows = given_rows(config.options.init_rows)
        resolve_frame(config.options.init_frame, instance)
        check_given_rows(rows, instance, config.runs, unit=config.options.rows != "free")
        if config.options.init_scale != 1.0:
            raise ConfigError("init_scale", "sets the scale of random free rows; rows given "
                                            "by --init-rows are used as they are")
        width = getattr(config.options, "width", None)  # scratch's option
        if width is not None and width != rows.width:
            raise ConfigError("width", f"is {width} but --init-rows gives "
                                       f"{rows.width} rows")
        if cls.loss_name == CORRELATION and rows.width != instance.k:
            raise ConfigError("init_rows", f"{config.options.init_rows}: {cls.name} keeps "
                                           f"λ̂ = λ, so it needs k′ = k = {instance.k} rows, got "
                                           f"{rows.width}")

    @classmethod
    def init_kwargs(cls, config, problem: Problem) -> dict:
        """Keyword arguments of ``__init__`` from the config (subclasses add the mask)."""
        return dict(width=student_width(config, problem.k),
                    eta=config.eta, eta_c=config.step_size_c,
                    train_second_layer=_trained(config), batch=config.batch,
                    label_noise=config.label_noise, **_start_kwargs(config))

    @classmethod
    def from_config(cls, config, problem: Problem):
        return cls(problem, **cls.init_kwargs(config, problem))

    def step_sizes(self) -> list[torch.Tensor]:
        return [self.eta_r, self.eta_c_r]


    def _tensor(self, a) -> torch.Tensor:
        xi = self.problem.xi
        return torch.as_tensor(np.ascontiguousarray(a), dtype=xi.dtype, device=xi.device)

    def initial_state(self, config, instances) -> tuple[NetworkState, np.ndarray]:
        """(state, m₀): m₀ = the initial alignment (see :func:`alignment`)."""
        rows, lam_hat = self.initial_arrays(config, instances)
        state = NetworkState(self._tensor(rows), self._tensor(lam_hat), 0)
        obs = self.observe(state)
        return state, self.alignment_of(obs["cross"][:, None], obs["gram"][:, None],
                                        instances)[:, 0]

    def initial_arrays(self, config, instances) -> tuple[np.ndarray, np.ndarray]:
        """Initial rows (R, k′, d) and λ̂ (R, k′), float64: defined by each learner."""
        raise NotImplementedError(f"{type(self).__name__} defines no initial state")

    def chain_start(self, config, instances, t: int, storage: int):
        """The start in the exact chain's coordinates: P (R, k′, t), Z (R, k′, storage), λ̂
        (R, k′) (``dynamics.reduced.network_chain`` (N6)); defined by each learner."""
        raise NotImplementedError(f"{type(self).__name__} defines no chain start")

    # ------------------------------------------------------------------ gradients
    def prepare(self, state: NetworkState, x: torch.Tensor, eps: torch.Tensor | None = None,
                sqnorm: torch.Tensor | None = None) -> Prepared:
        """Labels y = f*(x) (+ √label_noise·eps) of a chunk x (R, n, b, d)."""
        p = self.problem
        y = p.teacher(x, rowmat(x[..., : self.k], p.lt))
        if eps is not None and self.noise_sd > 0:
            y = y.add_(eps, alpha=self.noise_sd)
        return Prepared(y)

    def _terms(self, state: NetworkState, x: torch.Tensor, y: torch.Tensor):
        """(a, σ(a), δ, coefficient of σ(aⱼ) in ∂L/∂λ̂ⱼ, loss) for x (R, b, d), y (R, b)."""
        act = self.problem.activation
        a = torch.bmm(x, state.rows.transpose(1, 2))  # (R, b, k′)
        sa = act.fn(a)
        lam = state.lam_hat[:, None]
        f_hat = torch.linalg.vecdot(sa, lam)
        if self.loss_name == SQUARED:
            resid = y - f_hat
            outer = -2.0 * resid  # ∂L/∂f̂
            loss = resid * resid
        else:
            outer = -y
            loss = -y * f_hat
        delta = outer[..., None] * lam * act.deriv(a)
        return a, sa, delta, outer, loss

    def sample_gradients(self, state: NetworkState, x: torch.Tensor,
                         eps: torch.Tensor | None = None):
        """Per-example (tangent ∇_{ŵ} L (R, b, k′, d) (free rows: ∇_{ŵ} L), zero on frozen
        rows; ∂L/∂λ̂ (R, b, k′) (whether or not λ̂ is trained); L (R, b)) for x (R, b, d),
        label normals eps (R, b)."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        _, sa, delta, outer, loss = self._terms(state, x, pre.y[:, 0])
        grad = delta[..., None] * x[:, :, None, :]
        if not self.free:
            grad = sphere.proju(state.rows[:, None], grad)
        return grad * self._mask_f[:, None, :, None], outer[..., None] * sa, loss

    def sample_loss(self, state: NetworkState, x: torch.Tensor,
                    eps: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example loss L (R, b) (squared or correlation, :meth:`_terms`), differentiable
        in the rows and λ̂ (autograd tests; frozen rows too: ``sample_gradients`` masks them)."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        return self._terms(state, x, pre.y[:, 0])[-1]

    # ------------------------------------------------------------------ steps
    def step_prepared_(self, state: NetworkState, x: torch.Tensor, pre: Prepared,
                       i: int) -> torch.Tensor:
        """One spherical SGD step in place on x (R, b, d); returns minⱼ 1/nⱼ (R,). Free rows:
        ŵⱼ ← ŵⱼ − ηGⱼ, returning minⱼ (1 + η²‖Gⱼ‖²)^{−1/2}."""
        a, sa, delta, outer, _ = self._terms(state, x, pre.y[:, i])
        b = x.shape[1]
        if b == 1:  # Gⱼ (R, k′, d): an outer product is cheaper than a bmm
            grad = delta[:, 0, :, None] * x
        else:
            grad = torch.bmm(delta.transpose(1, 2), x).div_(b)
        ug = torch.linalg.vecdot(delta, a, dim=1).div_(b)  # ⟨ŵⱼ, Gⱼ⟩ (R, k′)
        eta = self.eta_r[:, None] * self._mask_f  # 0 on frozen rows
        g2 = torch.linalg.vector_norm(grad, dim=-1).square_()
        if self.free:
            inv = g2.mul(eta * eta).add_(1.0).rsqrt_()
            state.rows.addcmul_(grad, eta[..., None], value=-1.0)
        else:
            inv = torch.addcmul(g2, ug, ug, value=-1.0).mul_(eta * eta).add_(1.0).rsqrt_()
            alpha = torch.addcmul(inv, inv, eta * ug)  # (1 + η⟨ŵ,G⟩)/n
            state.rows.mul_(alpha[..., None]).addcmul_(grad, (eta * inv)[..., None],
                                                       value=-1.0)
        if self.train_second_layer:
            grad_l = torch.linalg.vecdot(outer[..., None], sa, dim=1).div_(b)
            state.lam_hat.addcmul_(grad_l, self.eta_c_r[:, None], value=-1.0)
        state.step += 1
        return inv.amin(-1)

    @property
    def free(self) -> bool:
        """Whether the rows are free (plain SGD) rather than unit (spherical SGD)."""
        return self.rows == "free"

    fast = True  # step_chunk_ through the compiled kernel where it applies (tests: False)

    def step_chunk_(self, state: NetworkState, x: torch.Tensor, pre: Prepared,
                    norms: torch.Tensor) -> None:
        """Every step of a chunk x (R, n, b, d) in place, health values into norms (n, R).

        On CPU with a registry σ: one call of the compiled kernel (``network_kernel``: the
        same update, same examples, equal up to rounding); else :meth:`step_prepared_` per
        step (the reference, and the path on CUDA)."""
        from dynamics.learners.network_kernel import RowRule, network_chunk
        from hermite.activations_numba import compiled_activation

        rows, n = state.rows, x.shape[1]
        code = compiled_activation(self.problem.activation) if (
            self.fast and rows.device.type == "cpu" and rows.is_contiguous()
            and state.lam_hat.is_contiguous()) else None
        if code is None:
            for i in range(n):
                norms[i] = self.step_prepared_(state, x[:, i], pre, i)
            return
        a_pre = None
        if not bool(self.mask.all()):  # frozen rows: their aⱼ for the whole chunk, one GEMM
            runs, _, b, d = x.shape
            a_pre = torch.bmm(x.reshape(runs, n * b, d), rows.transpose(1, 2)).reshape(
                runs, n, b, -1)
        rule = RowRule(code, self.loss_name == CORRELATION, self.train_second_layer,
                       self.free)
        network_chunk(rows, state.lam_hat, x, pre.y, self.eta_r, self.eta_c_r, self.mask,
                      norms, rule=rule, a_pre=a_pre)
        state.step += n

    def bad_runs(self, state: NetworkState) -> torch.Tensor:
        """(R,) True where a row or λ̂ is not finite. A row's sum is non-finite exactly when
        one of its entries is (unit rows cannot overflow it): one reduction instead of the
        default's element mask, ~20× cheaper at R = 64, k′ = 50, d = 2000."""
        return ~(torch.isfinite(state.rows.sum(-1)).all(-1)
                 & torch.isfinite(state.lam_hat).all(-1))

    def renormalize_(self, state: NetworkState) -> None:
        """Exact projx of the trainable rows (frozen rows are left bit-for-bit unchanged);
        nothing for free rows."""
        if self.free:
            return
        norms = torch.linalg.vector_norm(state.rows, dim=-1)
        state.rows.div_(torch.where(self.mask, norms, torch.ones_like(norms))[..., None])

    # ------------------------------------------------------------------ observables
    def teacher_rows(self) -> torch.Tensor:
        """(R, k, k+1) teacher rows vᵢ (canonical frame, first k+1 coordinates): unit, or a
        committee teacher's rows as they are."""
        if self._vrows is None:
            p = self.problem
            lt = p.lt if p.lt.dim() == 3 else p.lt.expand(p.runs, -1, -1)
            w = lt.transpose(1, 2)  # rows wᵢ = L[i]
            u = torch.cat([p.u_w, p.u_perp[:, None]], dim=1)  # (R, k+1)
            head = torch.cat([w, torch.zeros_like(w[..., :1])], dim=2)
            v = head + (p.xi[:, None] * p.c)[..., None] * u[:, None, :]
            if not p.committee:
                v = v / torch.linalg.vector_norm(v, dim=-1, keepdim=True)
            self._vrows = v
        return self._vrows

    def observe(self, state: NetworkState) -> dict:
        """cross ⟨vᵢ, ŵⱼ⟩ (R, k, k′), student Gram (R, k′, k′), λ̂ (R, k′)."""
        rows = state.rows
        cross = torch.bmm(self.teacher_rows(), rows[..., : self.k + 1].transpose(1, 2))
        gram = torch.bmm(rows, rows.transpose(1, 2))

        def host(t):
            return t.double().cpu().numpy().copy()

        return {"cross": host(cross), "gram": host(gram), "lam_hat": host(state.lam_hat)}

    def alignment_of(self, cross: np.ndarray, gram: np.ndarray, instances) -> np.ndarray:
        """(R, C) alignment (:func:`alignment`) of the records cross (R, C, k, k′) and Gram
        (R, C, k′, k′): cosines through the norms unless rows and teacher rows are unit."""
        if not self.free and not instances[0].committee:
            return alignment(cross, self.diagonal_alignment)
        return alignment(cross, self.diagonal_alignment, gram,
                         np.stack([i.teacher_gram() for i in instances]))

    def trajectory(self, result: RunResult):
        """Exact loss and alignment (also ``extra['alignment']``) at every checkpoint, and the
        committee-machine ODE's from each run's initial overlaps (``extra['ode_loss']``,
        ``extra['ode_alignment']``; :mod:`dynamics.overlays.committee`)."""
        from dynamics.overlays.committee import CommitteeRegime, CommitteeStarts, committee_records

        rec = result.records
        insts = result.instances
        unit = not self.free and not insts[0].committee
        loss = exact_loss(insts, rec["cross"], rec["gram"], rec["lam_hat"], unit=unit)
        align = self.alignment_of(rec["cross"], rec["gram"], insts)
        extra = {"alignment": align}
        if self.train_second_layer:
            extra["lam_hat"] = rec["lam_hat"]
        starts = CommitteeStarts(rec["cross"][:, 0], rec["gram"][:, 0], rec["lam_hat"][:, 0],
                                 self.mask.cpu().numpy())
        regime = CommitteeRegime.of_learner(
            result.config, insts[0], starts, loss=self.loss_name, rows=self.rows,
            diagonal=self.diagonal_alignment, train_second_layer=self.train_second_layer)
        ode, attrs = committee_records(result.config, insts, result.steps, starts, regime)
        extra.update(ode)
        if self.given is not None:
            attrs.setdefault("alignment", {}).update(given_rows_attrs(*self.given))
        return make_trajectory(result, align, loss, loss_kind=LOSS_EXACT, extra=extra,
                               extra_attrs=attrs)


class _FromScratch(NetworkLearner):
    """Rows i.i.d. uniform on S^{d−1} (free rows: i.i.d. N(0, s²I/d)) from run r's ``init``
    stream, or the rows of the ``init_rows`` file in the canonical frame
    (``given_rows``; unit rows normalised); λ̂₀ = λ, or, when trained and k′ ≠ k,
    λ̂ⱼ ~ N(0, 1/k′) from the same stream (drawn after the rows)."""

    teachers = ("finetune", "committee")

    @classmethod
    def given_rows(cls, config):
        path = config.options.init_rows
        return None if path is None else given_rows(path)

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        return f"{config.get('rows', 'unit')} rows"

    def _given_rows(self, config, instances):
        """r → the given rows (k′, d) of run r in the canonical frame, or None (random rows);
        records their provenance in ``self.given``."""
        if config.options.init_rows is None:
            return None
        given = given_rows(config.options.init_rows)
        frame = resolve_frame(config.options.init_frame, instances[0])
        w = config.instance["W"] if frame == "original" else None
        shared = None if given.per_run else canonical_rows(given.array, w)
        self.given = (given, frame)  # provenance of the rows actually used
        return lambda r: shared if shared is not None else canonical_rows(given.for_run(r), w)

    def _lam_hat0(self, inst, rng) -> np.ndarray:
        """λ̂₀: λ (k′ = k); λ₁·1 (equal λᵢ, fixed λ̂, any width); else N(0, 1/k′) from ``rng``."""
        if self.width == inst.k:
            return np.asarray(inst.lam, dtype=float)
        if not self.train_second_layer:  # equal λᵢ (checked): λ̂ = λ₁·1, any width
            return np.full(self.width, float(inst.lam[0]))
        return rng.standard_normal(self.width) / math.sqrt(self.width)

    def initial_arrays(self, config, instances) -> tuple[np.ndarray, np.ndarray]:
        d, width = instances[0].d, self.width
        rows = np.empty((len(instances), width, d))
        lam_hat = np.empty((len(instances), width))
        given = self._given_rows(config, instances)
        for r, inst in enumerate(instances):
            rng = np.random.default_rng(run_seed(config.seed, r, "init"))
            if given is not None:
                rows[r] = given(r)
            elif self.free:
                rows[r] = rng.standard_normal((width, d)) * (self.init_scale / math.sqrt(d))
            else:
                rows[r] = rng.standard_normal((width, d))
            if not self.free:
                rows[r] /= np.linalg.norm(rows[r], axis=1, keepdims=True)
            lam_hat[r] = self._lam_hat0(inst, rng)
        return rows, lam_hat

    def chain_start(self, config, instances, t: int, storage: int):
        """The same start law in the exact chain's coordinates (``dynamics.reduced.
        network_chain`` (N6)): random rows' parts outside the first t coordinates by their
        Bartlett factor (Wishart_{k′}(d − t) Gram), given rows by the L factor of theirs."""
        runs, width, d = len(instances), self.width, instances[0].d
        P, Z = np.empty((runs, width, t)), np.zeros((runs, width, storage))
        lam_hat = np.empty((runs, width))
        given = self._given_rows(config, instances)
        for r, inst in enumerate(instances):
            rng = np.random.default_rng(run_seed(config.seed, r, "init"))
            if given is not None:
                rows = given(r)
                P[r], Z[r] = rows[:, :t], lq_factor(rows[:, t:], storage)
            else:
                P[r] = rng.standard_normal((width, t))
                Z[r, :, :width] = bartlett_factor(rng, width, d - t)
                if self.free:
                    P[r] *= self.init_scale / math.sqrt(d)
                    Z[r] *= self.init_scale / math.sqrt(d)
            if not self.free:
                norms = np.sqrt((P[r] ** 2).sum(1) + (Z[r] ** 2).sum(1))[:, None]
                P[r] /= norms
                Z[r] /= norms
            lam_hat[r] = self._lam_hat0(inst, rng)
        return P, Z, lam_hat


class Scratch(_FromScratch):
    """``scratch``: learn the teacher from random rows under the squared loss."""

    name = "scratch"
    Options = ScratchOptions

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        return super().variant(config) + (", trained λ̂" if config.get("train_second_layer")
                                          else "")


class ScratchCSQ(_FromScratch):
    """``scratch-csq``: the correlation loss L = −y f̂ (a CSQ algorithm), λ̂ = λ fixed."""

    name = "scratch-csq"
    Options = ScratchCSQOptions
    loss_name = committee_loss = CORRELATION  # λ̂ = λ (the loss is unbounded in λ̂): k′ = k


class Sparse(NetworkLearner):
    """``sparse`` (S²FT): rows start at W's rows, λ̂ = λ fixed, only s rows are tuned
    (:func:`sparse_selection`); alignment = mean over i of ⟨vᵢ, ŵᵢ⟩."""

    name = "sparse"
    Options = SparseOptions
    diagonal_alignment = True

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """All k rows of d (the s tuned ones move) and λ (k); records as the network
        learners at k′ = k."""
        return Memory(state=k * d + k, records=2 * k * k + k, prepared=2 * k + 4)

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        return "S²FT"

    @classmethod
    def check(cls, config, instance) -> None:
        s = sparse_rows(config, instance.k, instance.d)
        if s > instance.k:
            raise ConfigError("sparse_rows", f"must be ≤ k = {instance.k}, got {s}")

    @classmethod
    def from_config(cls, config, problem: Problem):
        lam = problem.lam.double().cpu().numpy()
        mask = torch.zeros((problem.runs, problem.k), dtype=torch.bool,
                           device=problem.xi.device)
        for r in range(problem.runs):
            mask[r, torch.as_tensor(sparse_selection(config, lam[r], problem.d, r))] = True
        return cls(problem, **cls.init_kwargs(config, problem), mask=mask)

    def chain_start(self, config, instances, t: int, storage: int):
        """W's rows in the chain's coordinates: P = [L, 0], nothing outside (Z = 0)."""
        inst0 = instances[0]
        P = np.zeros((len(instances), inst0.k, t))
        for r, inst in enumerate(instances):
            P[r, :, : inst.k] = inst.w_factor
        lam = np.stack([inst.lam for inst in instances]).astype(float)
        return P, np.zeros((len(instances), inst0.k, storage)), lam

    def initial_arrays(self, config, instances) -> tuple[np.ndarray, np.ndarray]:
        inst0 = instances[0]
        rows = np.zeros((len(instances), inst0.k, inst0.d))
        for r, inst in enumerate(instances):
            rows[r, :, : inst.k] = inst.w_factor
        return rows, np.stack([inst.lam for inst in instances]).astype(float)

