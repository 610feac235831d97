"""The ``lora-ba`` learner: LoRA as practised, a B·A adapter trained by plain SGD (issue 39).

Student first layer H = W + s·B·A, B ∈ R^{k×r}, A ∈ R^{r×d}, s = α/r; rows normalised as the
teacher's (unit convention): v̂ⱼ = hⱼ/Nⱼ, Nⱼ = ‖hⱼ‖; second layer λ frozen; the paper's
teacher f* = Σλⱼσ(⟨vⱼ, x⟩), vⱼ = (wⱼ + ξcⱼu)/‖·‖. Loss on one example L = (y − f̂(x))² (no 1/2,
as ``finetune``; y = f* + label noise), averaged over the mini-batch. With aⱼ = ⟨hⱼ, x⟩/Nⱼ,
δⱼ = ∂L/∂aⱼ = −2(y − f̂)λⱼσ′(aⱼ), gⱼ = δⱼ/Nⱼ and cⱼ = δⱼaⱼ/Nⱼ², the gradient with respect to
the rows is ∂L/∂H = g xᵀ − diag(c) H (the normalisation's part), hence, in closed form,

    ∂L/∂B = s (g (Ax)ᵀ − diag(c) H Aᵀ),   H Aᵀ = Pᵀ + s B Q,
    ∂L/∂A = s ((Bᵀg) xᵀ − Bᵀdiag(c) W − s Bᵀdiag(c) B A),

with P = A Wᵀ (r×k, A's coordinates in span W) and Q = A Aᵀ (r×r): a step costs Ax, Q and
two O(r d) updates, never the k×d matrix H. One step (both gradients at the old state):
A ← A − η mean_b ∂L/∂A (unless ``train_a`` is off), B ← B − lr_ratio·η mean_b ∂L/∂B (LoRA+).
Start: A with i.i.d. entries N(0, 1/d) (``init_a = gaussian``) or U(−1/√d, 1/√d) (``kaiming``:
PyTorch's ``nn.Linear`` kaiming_uniform(a=√5)), drawn in the canonical frame; B = 0
(``init_b = zero``) or i.i.d. N(0, b_scale²); from the stream (seed, run, init).

Observables: A in a reduced basis (:func:`dynamics.learners.linearized.reduce_rows`: span W ⊕ e,
then a QR basis of the rest; inner products with W, u and the law of x preserved) and B, every
checkpoint; from them ``overlap`` = |⟨v₁, u⟩|, v₁ the top right singular vector of BA
(:func:`~dynamics.learners.linearized.top_overlap`; NaN while BA = 0), ``loss`` = the exact
population loss of the rows (wⱼ + s(BA)ⱼ)/‖·‖ (``network_loss``, dual kernels, via
``linearized.true_loss``), ``extra["update_overlap"]`` = ⟨BA, c uᵀ⟩_F/(‖BA‖_F‖c‖) (signed),
``extra["b_norm"]`` = ‖B‖_F, ``extra["a_norm"]`` = ‖A‖_F, ``extra["delta_norm"]`` = ‖sBA‖_F.
Theory (``ode``, ``extra["ode_loss"]``, ``extra["ode_update_overlap"]``): the population flow
of (B, A's coordinates in span(W, u), A's Gram) in τ = η·steps, d → ∞ and first order in η,
from each run's recorded (B₀, A₀) (``hermite.flows.lora_ba``); with ``finite_d_theory``,
``ode_corrected``: the finite-η·d flow (the rest's SGD noise; rank 1: mean over B's noise kick
at the escape, ``hermite.flows.lora_ba_escape``). Reduced engine: the exact
chain in (B, Z, S) (``dynamics.reduced.lora_ba_chain``).

Any base and target (options ``base_rows``, ``base_norms``/``base_corr``, ``target_rows``,
``normalize_rows``; ``dynamics.learners.lora_ba_rows``): W and the teacher rows W* in the first
t = dim span(W, W*) coordinates (``self.width`` = t, ``self.lmat`` = W there); with
``normalize_rows`` off the rows are used as they are (Nⱼ = 1, c = 0: ∂L/∂H = g xᵀ, g = δ) and
the teacher is f* = Σλᵢσ(⟨w*ᵢ, x⟩). Observables, loss and flow of those rows
(``lora_ba_rows.rows_observables``, ``rows_loss``, ``hermite.flows.lora_ba.BARowsGeometry``).
A separate teacher σ* (``teacher_activation``: f* = Σλᵢσ*(⟨vᵢ, x⟩), the student keeps σ) and
squared labels (``labels`` = y2: y = f*² + label noise), on either path. With normalised rows
the loss is exact and the flow drawn: labels y through the cross kernel E[σ*(z₁)σ(z₂)]
(``hermite.flows.lora_ba.cross_kernel``), labels y2 through the three-field integrals
E[σ*σ*σ] and E[f*⁴] (``hermite.flows.lora_ba_squared``); on rows as they are, labels y with
σ* ≠ σ through the cross pair integrals of rows of any norm (``hermite.committee.cross``),
while labels y2 have no flow (NaN, a ``no_theory`` attribute) and the loss is a Monte Carlo
average on a fixed set (:func:`monte_carlo_loss`). The finite-η·d line: normalised rows,
labels y or y2 (the paper's or given rows, any σ*). All options at their defaults: the paper's
teacher, number for number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dynamics.activations import torch_activation
from dynamics.errors import ConfigError
from dynamics.lazy import lazy_import
from dynamics.learners.base import Learner, Memory, RunResult, TensorState, make_trajectory
from dynamics.learners.linearized import reduce_rows, top_overlap, true_loss
from dynamics.learners.lora_ba_rows import (
    BARows,
    ba_rows,
    ba_rows_of_instances,
    is_general,
    rows_files,
    rows_loss,
    rows_observables,
)
from dynamics.learners.options import Options, option
from dynamics.learners.problem import Problem, per_run, rowmat
from dynamics.measures.observables import group_runs
from dynamics.randomness.sampling import run_seed
from hermite.flows.pretrained import LABELS

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["LoRABA", "LoRABAOptions", "LoRABAState", "BAPrepared", "initial_factors",
           "update_observables", "monte_carlo_loss"]

INITS_B = ("zero", "gaussian")
INITS_A = ("gaussian", "kaiming")
FLOW_NOTE = ("population flow of (B, A's coordinates in span(W, u), A's Gram), d → ∞, first "
             "order in η (no SGD noise), from each run's own (B₀, A₀)")
CORRECTED_NOTE = ("finite-η·d flow (hermite.flows.lora_ba.corrected_flow): the population flow "
                  "plus the SGD noise of A's rest Gram, O(η·d) (here η·d = {eta_d:.3g}); rank "
                  "1: mean over B's noise kick at the escape (lora_ba_escape.kicked_overlap)")
CORRECTED_RUNS = 64  # the finite-η·d line is drawn from at most this many runs' starts
RANK_KICK = False  # rank r > 1: B's kick in the line (lora_ba_escape eq. (E)); off: it over-
# corrects at d = 100 (docs/learners.md, lora-ba's kick at rank r)
MC_POINTS, MC_SEED = 2**14, 39  # the Monte Carlo loss's fixed evaluation set (no exact loss)
NO_FLOW_Y2 = ("no population flow for labels y2 with rows as they are (three-field integrals "
              "of rows of any norm not tabulated): not drawn")


@dataclass(frozen=True)
class LoRABAOptions(Options):
    """Options of ``lora-ba``: rank, scale α, the factors' initialisation, frozen A, LoRA+."""

    rank: int = option(1, "Rank r of the student's update s·B·A (lora-ba: of B ∈ R^{k×r}, "
                          "A ∈ R^{r×d}; 1 ≤ r ≤ d).", check="positive")
    alpha: float | None = option(None, "LoRA scale α of the update s·B·A, s = α/r "
                                       "[default: r, i.e. s = 1].", check="positive")
    init_b: str = option("zero", "Initial B: zero, or gaussian (entries N(0, b_scale²)).",
                         choices=INITS_B)
    b_scale: float = option(1e-3, "Standard deviation of B's entries with init_b = gaussian.",
                            check="positive")
    init_a: str = option("gaussian", "Initial A: gaussian (entries N(0, 1/d)) or kaiming "
                                     "(U(−1/√d, 1/√d), nn.Linear's kaiming_uniform(a=√5)).",
                         choices=INITS_A)
    train_a: bool = option(True, "Train A (plain SGD, step η); --no-train-a: A frozen.")
    lr_ratio: float = option(1.0, "Step-size ratio η_B/η_A (LoRA+): B moves with "
                                  "lr_ratio·η.", check="positive")
    base_rows: str | None = option(None, "Pre-trained rows W from a file (.npy or text, a "
                                         "k×d array, any norms) [default: the instance's W].")
    base_norms: str | None = option(None, "Draw W with these row norms (one number or k, "
                                          "comma-separated; Gram diag(n)((1−ρ)I + ρ11ᵀ)"
                                          "diag(n)) [default: 1 with base_corr].")
    base_corr: float | None = option(None, "Correlation ρ ∈ (−1/(k−1), 1) of the drawn W's "
                                           "rows (with base_norms) [default: 0].")
    target_rows: str | None = option(None, "Teacher rows W* from a file (k×d, in the base's "
                                           "coordinates) [default: W + ξcuᵀ].")
    normalize_rows: bool = option(True, "Divide student and teacher rows by their norms "
                                        "(unit convention); --no-normalize-rows: use "
                                        "H = W + sBA and W* as they are.")
    teacher_activation: str | None = option(None, "Teacher σ* of f* = Σλᵢσ*(⟨vᵢ, x⟩) (the "
                                                  "student keeps σ) [default: σ].",
                                            check="activation")
    labels: str = option("y", "Labels: y = f*(x), or y2 = f*(x)² (then + label noise).",
                         choices=LABELS)


@dataclass
class LoRABAState(TensorState):
    """State of R runs of the lora-ba learner (run axis first), canonical frame."""

    b: torch.Tensor  # (R, k, r) B
    a: torch.Tensor  # (R, r, d) A
    step: int = 0


@dataclass
class BAPrepared:
    """State-independent terms of a chunk of examples x (R, n, b, d)."""

    z: torch.Tensor  # (R, n, b, k) Wx
    y: torch.Tensor  # (R, n, b) labels f*(x) or f*(x)² (+ label noise)


@dataclass
class BATerms:
    """Per-example terms of one step (module docstring), examples x (R, b, d)."""

    ax: torch.Tensor  # (R, b, r) Ax
    p: torch.Tensor  # (R, r, k) P = A Wᵀ
    q: torch.Tensor  # (R, r, r) Q = A Aᵀ
    norm: torch.Tensor  # (R, k) Nⱼ = ‖wⱼ + s(BA)ⱼ‖
    resid: torch.Tensor  # (R, b) y − f̂
    g: torch.Tensor  # (R, b, k) δⱼ/Nⱼ
    c: torch.Tensor  # (R, b, k) δⱼaⱼ/Nⱼ²


def initial_factors(config, runs: int, d: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(B₀ (R, k, r), A₀ (R, r, d)) float64 from the stream (seed, run, init) of each run:
    A's entries first (N(0, 1/d) or U(−1/√d, 1/√d)), then B's (N(0, b_scale²)) if gaussian."""
    o = config.options
    r = int(o.rank)
    b0, a0 = np.zeros((runs, k, r)), np.empty((runs, r, d))
    for i in range(runs):
        gen = np.random.default_rng(run_seed(config.seed, i, "init"))
        if o.init_a == "kaiming":
            a0[i] = gen.uniform(-1.0, 1.0, (r, d)) / math.sqrt(d)
        else:
            a0[i] = gen.standard_normal((r, d)) / math.sqrt(d)
        if o.init_b == "gaussian":
            b0[i] = o.b_scale * gen.standard_normal((k, r))
    return b0, a0


class LoRABA(Learner):
    """Learner ``lora-ba`` (see the module docstring for the formulas)."""

    name = "lora-ba"
    Options = LoRABAOptions
    overlap_label = "|⟨v₁(BA), u⟩|"
    chain = ("dynamics.reduced.lora_ba_chain", "LoraBAChain")  # the exact chain in (B, Z, S)

    @classmethod
    def given_rows(cls, config):
        """The ``base_rows``/``target_rows`` files (``lora_ba_rows.rows_files``), or None."""
        return rows_files(config.options)

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """B (k×r) and A (r×d); records B and A's r × (t + r) reduced coordinates (t = k + 1,
        at most 2k with a ``target_rows`` file)."""
        r = int(config.options.rank)
        t = k + 1 if config.options.target_rows is None else 2 * k
        return Memory(state=k * r + r * d, records=k * r + r * (t + r), prepared=2 * k + 4)

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        """``rank r[, α a][, B gaussian][, A kaiming][, A frozen][, η_B/η_A q]``."""
        r = config.get("rank", 1)
        parts = [f"rank {r}"]
        if config.get("alpha") is not None:
            parts.append(f"α {config['alpha']:g}")
        if config.get("init_b", "zero") != "zero":
            parts.append(f"B {config['init_b']}")
        if config.get("init_a", "gaussian") != "gaussian":
            parts.append(f"A {config['init_a']}")
        if not config.get("train_a", True):
            parts.append("A frozen")
        if config.get("lr_ratio", 1.0) != 1.0:
            parts.append(f"η_B/η_A {config['lr_ratio']:g}")
        if config.get("base_rows") is not None or config.get("base_norms") is not None \
                or config.get("base_corr") is not None:
            parts.append("given base")
        if config.get("target_rows") is not None:
            parts.append("given target")
        if not config.get("normalize_rows", True):
            parts.append("rows as they are")
        if config.get("teacher_activation") is not None:
            parts.append(f"σ* = {config['teacher_activation']}")
        if config.get("labels", "y") == "y2":
            parts.append("labels y²")
        return ", ".join(parts)

    @classmethod
    def check(cls, config, instance) -> None:
        """The rank must not exceed d; base and target rows must be readable and fit
        (``lora_ba_rows``: shapes, norms, ρ, no zero row where normalised)."""
        r, d = config.options.rank, instance.d
        if d is not None and r > d:
            raise ConfigError("rank", f"must be ≤ d = {d} for lora-ba, got {r}")
        if is_general(config.options) and d is not None:
            ba_rows_of_instances(config.options, [instance])

    def __init__(self, problem: Problem, *, eta: float, rank: int = 1, alpha: float | None = None,
                 train_a: bool = True, lr_ratio: float = 1.0, label_noise: float = 0.0,
                 rows: BARows | None = None, teacher_activation: str | None = None,
                 labels: str = "y"):
        """``teacher_activation``: the teacher's σ* (None: σ); ``labels``: y or y2 (f*²)."""
        if lr_ratio <= 0:
            raise ConfigError("lr_ratio", f"must be a finite number > 0, got {lr_ratio!r}")
        self.problem, self.k, self.rank = problem, problem.k, rank
        self.scale = (rank if alpha is None else alpha) / rank  # s = α/r
        self.train_a, self.lr_ratio = train_a, lr_ratio
        self.noise_sd = math.sqrt(label_noise)
        self.eta_r = eta * torch.ones_like(problem.xi)
        self.teacher = None if teacher_activation is None else \
            torch_activation(teacher_activation)  # σ* (None: σ, also when given as σ)
        if self.teacher is not None and self.teacher.theory == problem.activation.theory:
            self.teacher = None
        self.teacher_name = None if self.teacher is None else teacher_activation
        self.squared = labels == "y2"
        # the base in the frame's first ``width`` coordinates (lora_ba_rows; None: the paper's)
        self.rows, self.normalize = rows, True if rows is None else rows.normalize
        if rows is None:
            self.width, self.lmat, self.lt = self.k, problem.l, problem.lt
        else:
            x = problem.xi

            def t(v):
                return torch.as_tensor(np.ascontiguousarray(v), dtype=x.dtype, device=x.device)

            self.width, self.lmat = rows.t, t(rows.w)
            self.lt, self.vt = t(np.swapaxes(rows.w, 1, 2)), t(np.swapaxes(rows.v, 1, 2))
        self.w_sq = (self.lmat * self.lmat).sum(-1).expand(problem.runs, self.k)  # ‖wⱼ‖²

    @classmethod
    def from_config(cls, config, problem: Problem) -> LoRABA:
        o = config.options
        rows = None
        if is_general(o):
            arrays = {n: getattr(problem, n).double().cpu().numpy()
                      for n in ("l", "u_w", "u_perp", "c", "xi", "lam")}
            rows = ba_rows(o, problem.d, arrays)
        return cls(problem, eta=config.eta, rank=o.rank, alpha=o.alpha, train_a=o.train_a,
                   lr_ratio=o.lr_ratio, label_noise=config.label_noise, rows=rows,
                   teacher_activation=o.teacher_activation, labels=o.labels)

    def step_sizes(self) -> list[torch.Tensor]:
        return [self.eta_r]

    def initial_state(self, config, instances) -> tuple[LoRABAState, np.ndarray]:
        """B₀, A₀ from :func:`initial_factors`; m₀ = the overlap of B₀A₀ (NaN when B₀ = 0)."""
        p = self.problem
        b0, a0 = initial_factors(config, p.runs, p.d, p.k)
        state = self.init_state(b0, a0)
        m0 = self.observables(instances, state.b.double().cpu().numpy()[:, None],
                              self.observe(state)["a"][:, None])[0][:, 0]
        return state, m0

    def observables(self, instances, b: np.ndarray, a_red: np.ndarray):
        """(overlap, extras) of records B, A (reduced): :func:`update_observables`, or
        ``lora_ba_rows.rows_observables`` for a given base or target."""
        if self.rows is None:
            return update_observables(instances, b, a_red, self.scale)
        return rows_observables(self.rows, b, a_red, self.scale)

    def init_state(self, b0, a0) -> LoRABAState:
        """State from B₀ (R, k, r) and A₀ (R, r, d) (numpy or tensors)."""
        x = self.problem.xi

        def t(v):
            return torch.as_tensor(v, dtype=x.dtype, device=x.device).clone()

        return LoRABAState(t(b0), t(a0), 0)

    # ------------------------------------------------------------------ gradient pieces
    def prepare(self, state: LoRABAState, x: torch.Tensor, eps: torch.Tensor | None = None,
                sqnorm: torch.Tensor | None = None) -> BAPrepared:
        """Wx and the labels of a chunk x (R, n, b, d), label normals eps (R, n, b): y = f*(x)
        or f*(x)² (``labels`` y2), f* = Σλᵢσ*(⟨vᵢ, x⟩), then + √noise·ε."""
        p = self.problem
        z = rowmat(x[..., : self.width], self.lt)
        if self.rows is None:
            y = p.teacher(x, z, self.teacher)
        else:  # Σλᵢσ*(⟨w*ᵢ, x⟩), W* in the frame's first t coordinates
            act = p.activation if self.teacher is None else self.teacher
            pre = act.fn(rowmat(x[..., : self.width], self.vt))
            y = (pre * per_run(p.lam, z.dim())).sum(-1)
        if self.squared:
            y = y * y
        if eps is not None and self.noise_sd > 0:
            y = y.add_(eps, alpha=self.noise_sd)
        return BAPrepared(z, y)

    def terms(self, state: LoRABAState, x: torch.Tensor, pre: BAPrepared,
              i: int = 0) -> BATerms:
        """Per-example terms of step i of a prepared chunk (no in-place op on the state)."""
        p, s, b, a = self.problem, self.scale, state.b, state.a
        ax = torch.bmm(x, a.transpose(1, 2))  # (R, b, r)
        pm = rowmat(a[..., : self.width], self.lt)  # P = A Wᵀ, (R, r, k)
        q = torch.bmm(a, a.transpose(1, 2))
        if self.normalize:
            bp = (b * pm.transpose(1, 2)).sum(-1)  # ⟨wⱼ, (BA)ⱼ⟩
            bqb = (torch.bmm(b, q) * b).sum(-1)  # ‖(BA)ⱼ‖²
            norm = torch.sqrt(self.w_sq + 2.0 * s * bp + s * s * bqb)
        else:  # rows as they are: Nⱼ = 1, no normalisation part (c = 0)
            norm = torch.ones_like(self.w_sq)
        hx = pre.z[:, i] + s * torch.bmm(ax, b.transpose(1, 2))  # ⟨hⱼ, x⟩
        act = hx / norm[:, None]
        lam = p.lam[:, None]
        resid = pre.y[:, i] - (p.activation.fn(act) * lam).sum(-1)
        delta = (-2.0 * resid)[..., None] * lam * p.activation.deriv(act)
        g = delta / norm[:, None]
        c = g * act / norm[:, None] if self.normalize else torch.zeros_like(g)
        return BATerms(ax, pm, q, norm, resid, g, c)

    def _grad_b(self, state: LoRABAState, t: BATerms) -> torch.Tensor:
        """Σ over the examples of ∂L/∂B, (R, k, r): s(Σ g (Ax)ᵀ − diag(Σc)(Pᵀ + sBQ))."""
        s = self.scale
        ha = t.p.transpose(1, 2) + s * torch.bmm(state.b, t.q)  # H Aᵀ
        return s * (torch.bmm(t.g.transpose(1, 2), t.ax) - t.c.sum(1)[..., None] * ha)

    def _grad_a(self, state: LoRABAState, x: torch.Tensor, t: BATerms) -> torch.Tensor:
        """Σ over the examples of ∂L/∂A, (R, r, d): s(Σ(Bᵀg)xᵀ − Bᵀdiag(Σc)(W + sBA))."""
        s, b = self.scale, state.b
        bc = (b * t.c.sum(1)[..., None]).transpose(1, 2)  # Bᵀdiag(Σc), (R, r, k)
        grad = torch.bmm(torch.bmm(t.g, b).transpose(1, 2), x)
        grad = grad - s * torch.bmm(torch.bmm(bc, b), state.a)
        head = grad[..., : self.width] - rowmat(bc, self.lmat)  # Bᵀdiag(c) W: W's coords
        return s * torch.cat([head, grad[..., self.width:]], -1)

    def sample_gradients(self, state: LoRABAState, x: torch.Tensor,
                         eps: torch.Tensor | None = None):
        """Reference per-example gradients (tests): (∂L/∂B (R, b, k, r), ∂L/∂A (R, b, r, d),
        L (R, b)), whether A is trained or not."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        t = self.terms(state, x, pre)
        gb, ga = [], []
        for j in range(x.shape[1]):
            tj = BATerms(t.ax[:, j: j + 1], t.p, t.q, t.norm, t.resid[:, j: j + 1],
                         t.g[:, j: j + 1], t.c[:, j: j + 1])
            gb.append(self._grad_b(state, tj))
            ga.append(self._grad_a(state, x[:, j: j + 1], tj))
        return torch.stack(gb, 1), torch.stack(ga, 1), t.resid * t.resid

    def sample_loss(self, state: LoRABAState, x: torch.Tensor,
                    eps: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example loss (y − f̂)² (R, b), differentiable in B and A (autograd tests)."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        resid = self.terms(state, x, pre).resid
        return resid * resid

    # ------------------------------------------------------------------ steps
    def step_prepared_(self, state: LoRABAState, x: torch.Tensor, pre: BAPrepared,
                       i: int) -> torch.Tensor:
        """Step i of a prepared chunk, in place (module docstring); returns
        (1 + mean r²)^{−1/2} (not finite ⇒ diverged)."""
        t = self.terms(state, x, pre, i)
        eta = self.eta_r[:, None, None] / x.shape[1]
        grad_b = self._grad_b(state, t)
        if self.train_a:
            state.a.sub_(self._grad_a(state, x, t) * eta)
        state.b.sub_(grad_b * (self.lr_ratio * eta))
        state.step += 1
        return torch.rsqrt(1.0 + (t.resid * t.resid).mean(1))

    # ------------------------------------------------------------------ engine protocol
    def observe(self, state: LoRABAState) -> dict:
        """B (R, k, r) and A in the reduced basis (R, r, t + r′), r′ = min(r, d − t) (t = k + 1,
        or the given rows' frame)."""
        head = self.k if self.rows is None else self.width - 1  # reduce_rows keeps head + 1
        return {"b": state.b.double().cpu().numpy().copy(), "a": reduce_rows(state.a, head)}

    def trajectory(self, result: RunResult):
        """Exact loss, overlap and the extras of the module docstring from the records; the
        population flow from each run's own (B₀, A₀) beside them."""
        rec, insts = result.records, result.instances
        overlap, extra = self.observables(insts, rec["b"], rec["a"])
        delta = self.scale * rec["b"] @ rec["a"]  # (R, C, k, D)
        why = self.no_flow()
        if why is None:
            ode, ode_extra = self.flow(result)
            attrs = {n: {"note": FLOW_NOTE} for n in ("ode", "ode_loss", "ode_update_overlap")}
        else:  # no theory applies: NaN lines, and why
            ode = np.full(overlap.shape, np.nan)
            ode_extra = {"loss": ode, "update_overlap": ode}
            attrs = {n: {"no_theory": why} for n in ("ode", "ode_loss", "ode_update_overlap")}
        extra |= {"ode_loss": ode_extra["loss"], "ode_update_overlap": ode_extra["update_overlap"]}
        theory = {"ode": ode}
        if (corr := self.corrected(result)) is not None:
            theory["ode_corrected"], attrs["ode_corrected"] = corr
        loss, kind = self.loss(insts, delta)
        return make_trajectory(result, overlap, loss, loss_kind=kind, extra=extra,
                               theory=theory, extra_attrs=attrs)

    def no_flow(self) -> str | None:
        """Why the population flow does not apply (labels y2 on rows as they are), None where
        it does."""
        return NO_FLOW_Y2 if self.squared and not self.normalize else None

    def geometry(self, inst, run: int):
        """The flow's geometry of run ``run`` (instance ``inst``): the instance itself (the
        paper's teacher, σ* = σ, labels y), else ``hermite.flows.lora_ba.BARowsGeometry`` of its
        rows with the teacher's σ* and labels y2 (labels y2: normalised rows; rows as they are
        keep labels y here)."""
        from hermite.flows.lora_ba import BARowsGeometry, teacher_geometry

        teacher = self.teacher_name
        squared = self.squared and self.normalize
        if self.rows is None:
            return inst if teacher is None and not squared else \
                teacher_geometry(inst, teacher, squared)
        r = self.rows
        return BARowsGeometry(inst.activation, r.lam[run], r.w[run], r.v[run], r.normalize,
                              teacher, squared)

    def loss(self, insts, delta: np.ndarray) -> tuple[np.ndarray, str]:
        """((R, C) population loss E(f* − f̂)² of the rows W + Δ (no label noise), its kind):
        exact (dual kernels; σ* ≠ σ: with the cross kernel, or on rows as they are the cross
        pair integrals, ``hermite.flows.lora_ba``; labels y2:
        ``hermite.flows.lora_ba_squared``), or a Monte Carlo average (:func:`monte_carlo_loss`)
        for labels y2 on rows as they are."""
        from hermite.flows.lora_ba import rows_loss as geometry_loss

        if self.teacher is None and not self.squared:
            loss = true_loss(insts, delta) if self.rows is None else \
                rows_loss(insts[0].activation, self.rows, delta)  # given rows: exact loss
            return loss, "exact"
        exact = self.no_flow() is None
        out = np.full(delta.shape[:2], np.nan)
        ok = np.isfinite(delta).all((2, 3))
        for inst, idx in group_runs(insts):
            geo = self.geometry(inst, idx[0])
            for i in idx:
                if exact:
                    out[i, ok[i]] = geometry_loss(geo, delta[i, ok[i]])
                else:
                    out[i, ok[i]] = monte_carlo_loss(geo, self.teacher_name, self.squared,
                                                     delta[i, ok[i]])
        return out, "exact" if exact else "monte_carlo"

    def corrected(self, result: RunResult) -> tuple[np.ndarray, dict] | None:
        """(overlap (R, C), attributes) of the finite-η·d flow (``hermite.flows.lora_ba``'s
        ``corrected_flow``; rank 1: ``lora_ba_escape.kicked_overlap``, the mean over B's noise
        kick at the escape; rank r > 1 where ``RANK_KICK``: its eq. (E), the flow read at the
        kicks' shifts) of each run's :meth:`geometry` (given rows: t = dim span(W, W*) for
        k + 1; a σ* enters the labels only; labels y2: y = f*² in E[ggᵀ], M's teacher term
        through the three-field integrals' first derivatives, ``lora_ba_squared``) from the
        first ``CORRECTED_RUNS`` runs' starts (NaN in the others); None where
        ``finite_d_theory`` is off, A frozen, rows as they are (gⱼ = δⱼ, Nⱼ = 1: neither
        E[ggᵀ] nor M is written for rows of any norm), or d ≤ t + r."""
        from hermite.flows.lora_ba import BANoise, corrected_flow
        from hermite.flows.lora_ba_escape import (
            kick_grid,
            kicked_overlap,
            rank_kick_shifts,
            read_kicked,
        )

        config, rec, insts = result.config, result.records, result.instances
        runs, cps = len(insts), result.steps.size
        t = self.k + 1 if self.rows is None else self.rows.t
        if (not config.finite_d_theory or not self.train_a or not self.normalize
                or insts[0].d <= t + self.rank):
            return None
        noise = BANoise(float(config.eta), int(insts[0].d), int(config.batch),
                        float(config.label_noise))
        times = config.eta * result.steps.astype(float)
        out = np.full((runs, cps), np.nan)
        chosen = np.arange(runs) < CORRECTED_RUNS
        for inst, idx in group_runs(insts):
            idx = idx[chosen[idx]]
            if not idx.size:
                continue
            kw = dict(scale=self.scale, lr_ratio=self.lr_ratio)
            b0, a0 = rec["b"][idx, 0], rec["a"][idx, 0]
            geo = self.geometry(inst, idx[0])
            if self.rank == 1:
                direction = None  # the instance's u
                if self.rows is not None:
                    direction = self.rows.u[idx[0]]
                elif geo is not inst:  # the paper's rows with a σ*
                    direction = np.append(inst.u_w, inst.u_perp)
                out[idx] = kicked_overlap(geo, b0, a0, times, noise, direction=direction, **kw)
                continue
            # rank r > 1, RANK_KICK: the flow read at τ + δ over B's kicks (eq. (E))
            shifts = rank_kick_shifts(geo, b0, a0, times, noise, **kw) if RANK_KICK else None
            fine = times if shifts is None else kick_grid(times, shifts)
            fl = corrected_flow(geo, b0, a0, fine, noise, train_a=True, **kw)
            if self.rows is None:
                curve = update_observables([inst] * idx.size, fl.b, fl.a, self.scale)[0]
            else:
                part = BARows(*(getattr(self.rows, n)[idx] for n in
                                ("w", "v", "u", "target", "lam")), self.rows.normalize)
                curve = rows_observables(part, fl.b, fl.a, self.scale)[0]
            if shifts is None:
                out[idx] = curve
                continue
            curve = np.where(np.linalg.norm(fl.b, axis=(-2, -1)) > 0, curve, 0.0)
            out[idx] = read_kicked(times, fine, curve, shifts)
        note = CORRECTED_NOTE.format(eta_d=config.eta * insts[0].d)
        if RANK_KICK and self.rank > 1:
            note += "; rank r > 1: mean over B's kicks (lora_ba_escape, eq. (E))"
        if runs > CORRECTED_RUNS:
            note += f"; from the first {CORRECTED_RUNS} of {runs} runs' starts (NaN in the rest)"
        return out, {"note": note, "ode": "corrected"}

    def flow(self, result: RunResult) -> tuple[np.ndarray, dict]:
        """(overlap (R, C), {loss, update_overlap}) of the population flow
        (``hermite.flows.lora_ba``) in τ = η·steps from each run's recorded (B₀, A₀); given
        rows: the flow of their ``BARowsGeometry``."""
        from hermite.flows.lora_ba import lora_ba_flow

        rec, insts = result.records, result.instances
        runs, cps = len(insts), result.steps.size
        b = np.full((runs, cps) + rec["b"].shape[2:], np.nan)
        a = np.full((runs, cps) + rec["a"].shape[2:], np.nan)
        loss = np.full((runs, cps), np.nan)
        times = result.config.eta * result.steps.astype(float)
        for inst, idx in group_runs(insts):
            out = lora_ba_flow(self.geometry(inst, idx[0]), rec["b"][idx, 0],
                               rec["a"][idx, 0], times, scale=self.scale,
                               lr_ratio=self.lr_ratio, train_a=self.train_a)
            b[idx], a[idx], loss[idx] = out.b, out.a, out.loss
        overlap, extra = self.observables(insts, b, a)
        return overlap, {"loss": loss, "update_overlap": extra["update_overlap"]}


def monte_carlo_loss(geo, teacher: str | None, squared: bool, delta: np.ndarray) -> np.ndarray:
    """(…) E(y − f̂)² (no label noise) at the rows W + Δ (Δ (…, k, D), divided by their norms
    where ``geo.normalize``) of a geometry (``geo.w``, ``geo.v``, ``geo.lam``, ``geo.act``; an
    instance's or ``BARowsGeometry``): y = f* or f*², f* = Σλᵢσ*(⟨vᵢ, x⟩), averaged over
    ``MC_POINTS`` fixed normals x ∈ R^D (seed ``MC_SEED``; exact in law: every row lies in
    the first D coordinates)."""
    from hermite._activation import resolve_activation
    from hermite.flows.linearized import _geometry
    from hermite.flows.lora_ba import BARowsGeometry

    geo = geo if isinstance(geo, BARowsGeometry) else _geometry(geo)
    delta = np.asarray(delta, float)
    width = delta.shape[-1]
    x = np.random.default_rng(MC_SEED).standard_normal((MC_POINTS, width))
    t = geo.w.shape[-1]
    h = delta.copy()
    h[..., :t] += geo.w
    if getattr(geo, "normalize", True):
        h /= np.linalg.norm(h, axis=-1, keepdims=True)
    act = geo.act
    star = act if teacher is None else resolve_activation(teacher)
    y = star.fn(x[:, :t] @ geo.v.T) @ geo.lam  # (S,)
    y = y * y if squared else y
    fhat = act.fn(np.einsum("sd,...kd->...sk", x, h)) @ geo.lam  # (…, S)
    return ((y - fhat) ** 2).mean(-1)


def update_observables(instances, b: np.ndarray, a_red: np.ndarray,
                       scale: float) -> tuple[np.ndarray, dict]:
    """(overlap (R, C), extras) of B (R, C, k, r) and A (R, C, r, D) in a reduced basis
    whose first k + 1 coordinates are the canonical ones: |⟨v₁(BA), u⟩|, update_overlap
    ⟨BA, c uᵀ⟩_F/(‖BA‖_F‖c‖) (NaN where BA = 0), b_norm, a_norm, delta_norm = ‖sBA‖_F."""
    k = instances[0].k
    ba = b @ a_red
    u = np.zeros((len(instances), 1, a_red.shape[-1]))
    u[:, 0, :k] = np.stack([i.u_w for i in instances])
    u[:, 0, k] = [i.u_perp for i in instances]
    c = np.stack([i.c for i in instances])[:, None]  # (R, 1, k)
    norm = np.linalg.norm(ba, axis=(-2, -1))
    with np.errstate(invalid="ignore", divide="ignore"):
        signed = np.einsum("rck,rckd,rcd->rc", np.broadcast_to(c, ba.shape[:3]), ba,
                           np.broadcast_to(u, ba.shape[:2] + u.shape[-1:]))
        update = np.where(norm > 0, signed / (norm * np.linalg.norm(c, axis=-1)), np.nan)
    extra = {"update_overlap": update, "b_norm": np.linalg.norm(b, axis=(-2, -1)),
             "a_norm": np.linalg.norm(a_red, axis=(-2, -1)), "delta_norm": abs(scale) * norm}
    return top_overlap(ba, u), extra
