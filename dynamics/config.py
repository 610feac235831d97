"""Run configuration shared by every engine (full and reduced) and learner."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .instance import Instance, build_instance
from .learners import LEARNERS as _LEARNER_REGISTRY
from .stiefel import RETRACTIONS

__all__ = ["RunConfig", "ConfigError", "LEARNERS", "ENGINES", "INITS", "CHECKPOINT_SPACINGS",
           "SPARSE_SELECTIONS", "STREAMS"]

LEARNERS = tuple(_LEARNER_REGISTRY)
SPARSE_SELECTIONS = ("lambda", "random")
ENGINES = ("full", "reduced", "auto")
INITS = ("uniform", "aligned")
CHECKPOINT_SPACINGS = ("log", "linear")
STREAMS = ("auto", "per_run", "shared")


class ConfigError(ValueError):
    """An invalid run configuration; the message names the field."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"run config: '{field_name}': {problem}")
        self.field = field_name


@dataclass
class RunConfig:
    """Everything that defines a batch of R independent online-SGD runs.

    Fields
    ------
    instance : the instance spec dict (see ``dynamics.instance``); resolved per run.
    learner : learner name (``finetune``; more in later learners).
    eta : step size η for û (eq. 4). eta_c : step size for ĉ when ``joint_c`` (default η).
    steps : horizon T (number of SGD steps). runs : R, the leading run axis.
    seed : master seed; run r uses streams derived from (seed, r).
    instance_seeds : ``shared`` (one instance for all runs, from the spec's seed) or
        ``per_run`` (run r's instance uses spec seed + r: c, ĉ, random W differ per run).
    xi_values : optional list of ξ; runs are split into equal consecutive blocks, one per ξ.
    joint_c : train ĉ jointly (plain SGD) instead of freezing it.
    project : apply Π onto span(W)^⊥ to the gradient (eq. 4); False = unprojected variant.
    batch : mini-batch size b (1 = online SGD). label_noise : variance of additive label noise.
    init : ``uniform`` on the sphere of span(W)^⊥, or ``aligned`` (m₀·h(0) > 0, Thm 11-13).
    checkpoints : number of checkpoints; spacing : ``log`` or ``linear``.
    dtype : ``float64`` (default) or ``float32``; device : ``cpu``, ``cuda`` or ``auto``.
    engine : ``full``, ``reduced`` or ``auto``.
    streams : examples of the full engine from one generator per run (``per_run``: run r's
        numbers do not depend on R), or one generator for all runs (``shared``: one draw per
        chunk, the fast path on CUDA, where per-run draws cost one launch per run); ``auto``
        = per_run on CPU, shared on CUDA. Same config and seed give the same numbers either way.
    finite_d_theory : also record the noise-corrected ODE and the theory band (issue 8;
        frozen ĉ, projected, b = 1 only; a few seconds per distinct instance).
    eval_size : examples in the fixed Monte Carlo evaluation set of the loss (used where no
        exact population loss applies: unprojected learner).

    Learner options (each ignored by the learners it does not concern):
    prox : proximal regularisation prox·‖Δ‖² toward the base model (finetune, linearized).
    full_rank : linearized learner with a full-rank Δ ∈ R^{k×d} (the NTK of full
        fine-tuning) instead of the rank-1 Δ = ξĉûᵀ.
    width : student width k′ of ``scratch``/``scratch-csq`` (None: k).
    train_second_layer : ``scratch`` also trains its second layer (else fixed to λ).
    moment_order : 1 (first-order Stein estimator) or 2 (top eigenvector) for ``moment``.
    sparse_rows : rows s fine-tuned by ``sparse`` (None: ⌈(k + d)/d⌉, rank-1 LoRA's budget).
    sparse_select : which rows ``sparse`` tunes: ``lambda`` (largest |λᵢ|) or ``random``.
    refit : after the run, refit the second layer on the 2k features
        σ(⟨wᵢ ± ξ/√k û, x⟩/norm) (App. F.2) at every checkpoint; records ``refit_loss``.
    refit_samples : examples of the least-squares refit.
    rank : r, the rank of the teacher's perturbation ξCUᵀ and of the student's ξĈÛᵀ
        (``lora`` learner; 1 = the paper's model). The rank-r teacher (C, its spectrum, Ĉ) is
        set by the instance spec keys ``C``, ``spectrum``, ``C_hat``
        (``dynamics.lora_instance``).
    retraction : Stiefel retraction of ``lora``: ``polar`` (default) or ``qr``.
    """

    instance: dict
    learner: str = "finetune"
    eta: float = 1e-3
    eta_c: float | None = None
    steps: int = 10_000
    runs: int = 8
    seed: int = 0
    instance_seeds: str = "shared"
    xi_values: list[float] | None = None
    joint_c: bool = False
    project: bool = True
    batch: int = 1
    label_noise: float = 0.0
    init: str = "uniform"
    checkpoints: int = 60
    spacing: str = "log"
    dtype: str = "float64"
    device: str = "cpu"
    engine: str = "full"
    streams: str = "auto"
    eval_size: int = 20_000
    finite_d_theory: bool = True
    prox: float = 0.0
    full_rank: bool = False
    width: int | None = None
    train_second_layer: bool = False
    moment_order: int = 1
    sparse_rows: int | None = None
    sparse_select: str = "lambda"
    refit: bool = False
    refit_samples: int = 20_000
    rank: int = 1
    retraction: str = "polar"
    extra: dict = field(default_factory=dict)

    def validate(self) -> RunConfig:
        """Check every field; raise :class:`ConfigError` naming the first bad one."""
        if self.learner not in LEARNERS:
            raise ConfigError("learner", f"unknown learner {self.learner!r}; valid: "
                                         f"{', '.join(LEARNERS)}")
        for name in ("eta",) + (("eta_c",) if self.eta_c is not None else ()):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or not math.isfinite(val) or val <= 0:
                raise ConfigError(name, f"must be a finite number > 0, got {val!r}")
        for name in ("steps", "runs", "batch", "checkpoints", "eval_size", "refit_samples",
                     "rank"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ConfigError(name, f"must be a positive integer, got {val!r}")
        for name in ("label_noise", "prox"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, float)) \
                    or not math.isfinite(val) or val < 0:
                raise ConfigError(name, f"must be a finite number ≥ 0, got {val!r}")
        for name in ("width", "sparse_rows"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int)
                                    or val <= 0):
                raise ConfigError(name, f"must be a positive integer, got {val!r}")
        if self.moment_order not in (1, 2):
            raise ConfigError("moment_order", f"must be 1 or 2, got {self.moment_order!r}")
        for name, valid in (("init", INITS), ("spacing", CHECKPOINT_SPACINGS),
                            ("engine", ENGINES), ("instance_seeds", ("shared", "per_run")),
                            ("dtype", ("float64", "float32")),
                            ("sparse_select", SPARSE_SELECTIONS),
                            ("retraction", RETRACTIONS),
                            ("device", ("cpu", "cuda", "auto")), ("streams", STREAMS)):
            if getattr(self, name) not in valid:
                raise ConfigError(name, f"must be one of {', '.join(valid)}, "
                                        f"got {getattr(self, name)!r}")
        if self.xi_values is not None:
            if not self.xi_values or any(x < 0 for x in self.xi_values):
                raise ConfigError("xi_values", "must be a non-empty list of ξ ≥ 0")
            if self.runs % len(self.xi_values):
                raise ConfigError("runs", f"{self.runs} runs cannot be split evenly over "
                                          f"{len(self.xi_values)} values of ξ")
        base = build_instance(self.instance)  # raises SpecError naming the key
        if base.d is None:
            raise ConfigError("instance", "key 'd' is required to simulate")
        from .learners import get_learner

        try:
            learner = get_learner(self.learner)
        except ImportError as exc:
            raise ConfigError("learner", f"learner {self.learner!r} is not available: "
                                         f"{exc}") from None
        if not base.unit_rows and self.learner != "finetune":  # before the learner's checks,
            # which may evaluate unit-row theory
            raise ConfigError("learner", f"the App. B convention {base.convention!r} is "
                                         f"supported by 'finetune' only, not {self.learner!r}")
        learner.check(self, base)
        if self.refit and self.learner not in ("finetune",):
            raise ConfigError("refit", f"needs a learner that learns û (finetune), "
                                       f"not {self.learner!r}")
        return self

    @property
    def step_size_c(self) -> float:
        return self.eta if self.eta_c is None else self.eta_c

    def run_instances(self) -> list[Instance]:
        """The instance of every run (length R), honouring instance_seeds and xi_values."""
        out = []
        per_xi = self.runs // len(self.xi_values) if self.xi_values else self.runs
        base_seed = int(self.instance.get("seed", 0) or 0)
        cache: dict = {}
        for r in range(self.runs):
            spec = dict(self.instance)
            if self.instance_seeds == "per_run":
                spec["seed"] = base_seed + r
            if self.xi_values:
                spec["xi"] = float(self.xi_values[r // per_xi])
            key = (spec.get("seed"), spec.get("xi"))
            if key not in cache:
                cache[key] = build_instance(spec)
            out.append(cache[key])
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """Inverse of :meth:`to_dict`; also accepts a trajectory file's ``config`` attribute
        (its derived key ``resolved_instances`` is dropped)."""
        data = {k: v for k, v in data.items() if k != "resolved_instances"}
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown field; valid: {', '.join(sorted(known))}")
        return cls(**data)
