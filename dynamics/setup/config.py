"""Run configuration shared by every engine (full and reduced) and learner.

A :class:`RunConfig` holds the settings every run shares and, in ``options``, the chosen
learner's own options (``dynamics.learners.options``: each learner declares them as a
dataclass). Options are given flat (``RunConfig(..., learner="lora", rank=2)``) and read
through the typed options (``config.options.rank``). An option the learner does not take is a
:class:`ForeignOptionError` unless it has its default value (then it changes nothing and is
dropped).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields

from dynamics.errors import ConfigError, ForeignOptionError
from dynamics.instances.instance import Instance, build_instance
from dynamics.learners.network import SPARSE_SELECTIONS
from dynamics.learners.options import INITS, Options, all_options, learner_options, options_of
from dynamics.learners.registry import LEARNERS as _LEARNER_REGISTRY
from dynamics.learners.registry import get_learner, learns_teacher, runs_convention

__all__ = ["RunConfig", "ConfigError", "ForeignOptionError", "LEARNERS", "ENGINES", "INITS",
           "CHECKPOINT_SPACINGS", "SPARSE_SELECTIONS", "STREAMS"]

LEARNERS = tuple(_LEARNER_REGISTRY)
ENGINES = ("full", "reduced", "auto")
CHECKPOINT_SPACINGS = ("log", "linear")
STREAMS = ("auto", "per_run", "shared", "counter")


def _quoted(names, sep: str = ", ") -> str:
    return sep.join(f"'{n}'" for n in names) if names else "no learner"


@dataclass(init=False)
class RunConfig:
    """Everything that defines a batch of R independent online-SGD runs.

    Fields
    ------
    instance : the instance spec dict (see ``dynamics.instances.instance``); resolved per run.
    learner : learner name (``dynamics.learners.LEARNERS``).
    eta : step size η. steps : horizon T (number of SGD steps). runs : R, the leading run axis.
    seed : master seed; run r uses streams derived from (seed, r).
    instance_seeds : ``shared`` (one instance for all runs, from the spec's seed) or
        ``per_run`` (run r's instance uses spec seed + r: c, ĉ, random W differ per run).
    xi_values : optional list of ξ; runs are split into equal consecutive blocks, one per ξ.
    batch : mini-batch size b (1 = online SGD). label_noise : variance of additive label noise.
    checkpoints : number of checkpoints; spacing : ``log`` or ``linear``.
    dtype : ``float64`` (default) or ``float32``; device : ``cpu``, ``cuda`` or ``auto``.
    engine : ``full``, ``reduced`` or ``auto``.
    streams : examples of the full engine from one generator per run (``per_run``: run r's
        numbers do not depend on R), or one generator for all runs (``shared``: one draw per
        chunk, the fast path on CUDA, where per-run draws cost one launch per run); ``auto``
        = per_run on CPU, shared on CUDA. Same config and seed give the same numbers either way.
        ``counter`` (CPU): a counter-based ziggurat per run
        (``dynamics.randomness.counter_stream``; run
        r's numbers depend on (seed, r) only, same law, other draws), ~6× cheaper per number
        than torch's float64 sampler, which bounds the O(k′d) learners at small k′.
    eval_size : examples in the fixed Monte Carlo evaluation set of the loss (used where no
        exact population loss applies: the linear model's loss; finetune only for App. B rows
        with a piecewise σ other than relu/abs, see ``dynamics.measures.losses``).
    finite_d_theory : also record the noise-corrected ODE and the theory band (issue 8;
        frozen ĉ, projected, b = 1 only; a few seconds per distinct instance), and for the
        network learners the committee-machine ODE (``dynamics.overlays.committee``).
    options : the learner's options (its ``Options`` dataclass; None for an unknown learner,
        which :meth:`validate` names). Built by the constructor from ``options=`` (another
        config's options or a mapping) and keyword options (``rank=2``) on top.
    extra : free-form settings (the rank-r teacher keys of ``dynamics.instances.lora_instance``).
    """

    instance: dict
    learner: str = "finetune"
    eta: float = 1e-3
    steps: int = 10_000
    runs: int = 8
    seed: int = 0
    instance_seeds: str = "shared"
    xi_values: list[float] | None = None
    batch: int = 1
    label_noise: float = 0.0
    checkpoints: int = 60
    spacing: str = "log"
    dtype: str = "float64"
    device: str = "cpu"
    engine: str = "full"
    streams: str = "auto"
    eval_size: int = 20_000
    finite_d_theory: bool = True
    options: Options | None = None
    extra: dict = field(default_factory=dict)

    def __init__(self, instance: dict, *, options=None, **kwargs):
        known = all_options()
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in known}
        for f in fields(self):
            if f.name in ("instance", "options"):
                continue
            if f.name in kwargs:
                value = kwargs.pop(f.name)
            else:
                value = f.default if f.default_factory is MISSING else f.default_factory()
            setattr(self, f.name, value)
        if kwargs:
            raise TypeError(f"RunConfig() got an unexpected keyword argument "
                            f"{next(iter(kwargs))!r}")
        self.instance = instance
        try:
            options_of(self.learner)
        except (ValueError, ImportError):  # unknown or unavailable: validate() says which
            self.options = None
        else:
            self.options = learner_options(self.learner, options, given)

    def __setattr__(self, name, value):
        if name in all_options():
            raise AttributeError(f"{name!r} is a learner option: use "
                                 f"dataclasses.replace(config, {name}=...)")
        super().__setattr__(name, value)

    def check_fields(self) -> RunConfig:
        """The shared fields alone (learner name, η, counts, seed, enums, ξ values): what
        :meth:`validate` checks before it builds the instance and asks the learner; cheap
        (no instance, no torch), so a command can refuse bad input before computing any
        default."""
        if self.learner not in LEARNERS:
            raise ConfigError("learner", f"unknown learner {self.learner!r}; valid: "
                                         f"{', '.join(LEARNERS)}")
        val = self.eta
        if not isinstance(val, (int, float)) or not math.isfinite(val) or val <= 0:
            raise ConfigError("eta", f"must be a finite number > 0, got {val!r}")
        for name in ("steps", "runs", "batch", "checkpoints", "eval_size"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ConfigError(name, f"must be a positive integer, got {val!r}")
        val = self.seed  # 63 bits: the streams take any, the HDF5 attribute is an int64
        if isinstance(val, bool) or not isinstance(val, int) or not 0 <= val < 2**63:
            raise ConfigError("seed", f"(--seed) must be an integer in 0 … 2**63 − 1, "
                                      f"got {val!r}")
        val = self.label_noise
        if isinstance(val, bool) or not isinstance(val, (int, float)) \
                or not math.isfinite(val) or val < 0:
            raise ConfigError("label_noise", f"must be a finite number ≥ 0, got {val!r}")
        for name, valid in (("spacing", CHECKPOINT_SPACINGS),
                            ("engine", ENGINES), ("instance_seeds", ("shared", "per_run")),
                            ("dtype", ("float64", "float32")),
                            ("device", ("cpu", "cuda", "auto")), ("streams", STREAMS)):
            if getattr(self, name) not in valid:
                raise ConfigError(name, f"must be one of {', '.join(valid)}, "
                                        f"got {getattr(self, name)!r}")
        if self.streams == "counter" and self.device == "cuda":
            raise ConfigError("streams", "'counter' streams are CPU only (device cuda: use "
                                         "per_run or shared)")
        if self.xi_values is not None:
            if not self.xi_values or any(x < 0 for x in self.xi_values):
                raise ConfigError("xi_values", "must be a non-empty list of ξ ≥ 0")
            if self.runs % len(self.xi_values):
                raise ConfigError("runs", f"{self.runs} runs cannot be split evenly over "
                                          f"{len(self.xi_values)} values of ξ")
        return self

    def validate(self, instance: Instance | None = None) -> RunConfig:
        """Check every field; raise :class:`ConfigError` naming the first bad one (the
        learner's options checked themselves on construction). ``instance``: the spec's
        instance when the caller built it already (not built again)."""
        self.check_fields()
        base = build_instance(self.instance) if instance is None else instance  # SpecError
        if base.d is None:
            raise ConfigError("instance", "key 'd' is required to simulate")
        try:
            learner = get_learner(self.learner)
        except ImportError as exc:
            raise ConfigError("learner", f"learner {self.learner!r} is not available: "
                                         f"{exc}") from None
        if type(self.options) is not learner.Options:
            raise ConfigError("options", f"must be {learner.Options.__name__} (the options of "
                                         f"{self.learner!r}), got {type(self.options).__name__}")
        if base.convention not in learner.conventions:  # before the learner's checks,
            # which may evaluate unit-row theory
            raise ConfigError("learner", f"the App. B convention {base.convention!r} is "
                                         f"supported by {_quoted(runs_convention(base))} "
                                         f"only, not {self.learner!r}")
        if base.teacher not in learner.teachers:
            raise ConfigError("learner", f"a {base.teacher} teacher (instance teacher = "
                                         f"{base.teacher!r}) is learnt by learner "
                                         f"{_quoted(learns_teacher(base), ' or ')}, not "
                                         f"{self.learner!r}")
        learner.check(self, base)
        return self

    @property
    def step_size_c(self) -> float:
        """The second layer's step size: the option ``eta_c`` where the learner takes it and
        it is set, else η."""
        eta_c = getattr(self.options, "eta_c", None)
        return self.eta if eta_c is None else eta_c

    def run_instances(self, base: Instance | None = None) -> list[Instance]:
        """The instance of every run (length R), honouring instance_seeds and xi_values; each
        distinct one built once (``base``: the spec's own instance, if already built, is
        reused for the runs it serves)."""
        out = []
        per_xi = self.runs // len(self.xi_values) if self.xi_values else self.runs
        base_seed = int(self.instance.get("seed", 0) or 0)
        cache: dict = {}
        if base is not None:
            cache[(self.instance.get("seed"), self.instance.get("xi"))] = base
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
        """The shared fields and the learner's own options, flat (``extra`` last)."""
        data = asdict(self)
        options, extra = data.pop("options") or {}, data.pop("extra")
        return data | options | {"extra": extra}

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """Inverse of :meth:`to_dict`; also accepts a trajectory file's ``config`` attribute
        (its derived key ``resolved_instances`` is dropped), including one written when every
        learner option was a field: an option the learner does not take is dropped where it
        has its default value, and is a :class:`ForeignOptionError` otherwise."""
        data = {k: v for k, v in data.items() if k != "resolved_instances"}
        shared = {f.name for f in fields(cls)} - {"options"}
        known = all_options()
        unknown = sorted(set(data) - shared - set(known))
        if unknown:
            valid = sorted(shared | set(known))
            raise ConfigError(unknown[0], f"unknown field; valid: {', '.join(valid)}")
        return cls(**data)
