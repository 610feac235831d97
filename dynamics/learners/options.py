"""Learner options: what a learner can be told beyond the settings every run shares.

Each learner declares its options as a frozen dataclass, a subclass of :class:`Options` whose
fields come from :func:`option` (a default, one line of help, the accepted values), and names
it as its class attribute ``Options``. An instance checks itself on construction
(``ConfigError`` naming the option). ``RunConfig.options`` holds the chosen learner's
instance; :func:`all_options` lists every learner's options by name, for the ``loradyn run``
flags and the sweep axes. An option several learners take is made by one factory here
(:func:`eta_c_option`, ...), so it means and defaults to the same for all of them.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields, replace
from functools import cache

import numpy as np

from dynamics.errors import ConfigError, ForeignOptionError
from dynamics.learners.registry import LEARNERS, get_learner

__all__ = ["Options", "OptionSpec", "option", "option_specs", "all_options", "options_of",
           "learner_options", "INITS", "eta_c_option", "init_option", "LowRankOptions",
           "low_rank_variant", "option_names"]

INITS = ("uniform", "aligned")
_KINDS = (bool, int, float, str)


@dataclass(frozen=True)
class OptionSpec:
    """One option as the CLI and the sweeps see it (``learners``: who takes it)."""

    name: str
    default: object
    kind: type  # bool, int, float or str
    nullable: bool
    help: str
    choices: tuple | None = None
    check: str | None = None  # "positive" (> 0), "nonnegative" (≥ 0), "unit" (in (0, 1)),
    # or "activation" (a name hermite.activations knows)
    learners: tuple = ()


def option(default, help: str, *, choices: tuple | None = None, check: str | None = None):
    """A field of an :class:`Options` dataclass: ``default``, one line of ``help``, and the
    accepted values (``choices``, or ``check`` = ``positive`` / ``nonnegative`` / ``unit``:
    in the open interval (0, 1) / ``activation``: an activation name)."""
    return field(default=default, metadata={"help": help, "choices": choices, "check": check})


@dataclass(frozen=True)
class Options:
    """A learner's options (this base class: none)."""

    def __post_init__(self):
        for spec in option_specs(type(self)):
            _check_value(spec, getattr(self, spec.name))


@cache
def option_specs(cls: type[Options]) -> tuple[OptionSpec, ...]:
    """The :class:`OptionSpec` of every field of ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        args = typing.get_args(hints[f.name])
        kinds = [a for a in args if a is not type(None)] if args else [hints[f.name]]
        if len(kinds) != 1 or kinds[0] not in _KINDS:
            raise TypeError(f"{cls.__name__}.{f.name}: an option is a bool, int, float or str "
                            f"(or None), not {hints[f.name]}")
        out.append(OptionSpec(f.name, f.default, kinds[0], type(None) in args,
                              f.metadata.get("help", ""), f.metadata.get("choices"),
                              f.metadata.get("check")))
    return tuple(out)


def option_names(cls: type[Options]) -> tuple[str, ...]:
    """The names of ``cls``'s options, in declaration order."""
    return tuple(spec.name for spec in option_specs(cls))


# ``check`` → (how a message states the bound, the test of a number)
_BOUNDS = {"positive": (" > 0", lambda v: v > 0), "nonnegative": (" ≥ 0", lambda v: v >= 0),
           "unit": (" in (0, 1)", lambda v: 0 < v < 1)}


def _check_value(spec: OptionSpec, value) -> None:
    if value is None and spec.nullable:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    bound, within = _BOUNDS.get(spec.check, ("", None))
    in_bound = number and (within is None or within(value))
    if spec.choices is not None:
        ok = (number or isinstance(value, str)) and value in spec.choices
        problem = f"must be one of {', '.join(map(str, spec.choices))}"
    elif spec.kind is bool:
        ok, problem = isinstance(value, (bool, np.bool_)), "must be true or false"
    elif spec.kind is int:
        ok = in_bound and isinstance(value, int)
        problem = "must be a positive integer" if spec.check == "positive" else \
            f"must be an integer{bound}"
    elif spec.kind is float:
        ok, problem = in_bound and math.isfinite(value), f"must be a finite number{bound}"
    elif spec.check == "activation":
        ok, problem = _activation_problem(value)
    else:
        ok, problem = isinstance(value, str), "must be a string"
    if not ok:
        raise ConfigError(spec.name, f"{problem}, got {value!r}")


def options_of(learner: str) -> type[Options]:
    """The options class of the learner registered under ``learner`` (ValueError if none)."""
    return get_learner(learner).Options


@cache
def all_options() -> dict[str, OptionSpec]:
    """Every learner's options by name, in registry order, each with the learners that take
    it; a name several learners declare must agree on default, kind and accepted values."""
    out: dict[str, OptionSpec] = {}
    for learner in LEARNERS:
        for spec in option_specs(options_of(learner)):
            prev = out.get(spec.name)
            if prev is None:
                out[spec.name] = replace(spec, learners=(learner,))
                continue
            if replace(prev, help="", learners=()) != replace(spec, help=""):
                raise TypeError(f"option {spec.name!r}: learner {learner!r} declares it "
                                f"unlike {prev.learners[0]!r}")
            out[spec.name] = replace(prev, learners=prev.learners + (learner,))
    return out


def learner_options(learner: str, carried=None, given: dict | None = None) -> Options:
    """``learner``'s :class:`Options` from ``carried`` (another config's options: a dataclass
    or a mapping) updated by ``given`` (keyword options). An option the learner does not take
    is a ``ForeignOptionError`` unless it has its default value, which changes nothing: it is
    dropped (a config switching learners, a file written when options were shared fields)."""
    cls = options_of(learner)
    own = option_names(cls)
    if isinstance(carried, Options):
        carried = {f.name: getattr(carried, f.name) for f in fields(carried)}
    known = all_options()
    values = {}
    for name, value in {**(carried or {}), **(given or {})}.items():
        if name in own:
            values[name] = value
        elif name not in known:
            raise ConfigError(name, f"unknown learner option; valid: {', '.join(known)}")
        elif value != known[name].default:
            raise ForeignOptionError(learner, name, own)
    return cls(**values)


# ---------------------------------------------------------------- options several learners take
def eta_c_option():
    return option(None, "Step size of the trained second layer (ĉ, Ĉ or λ̂) [default: η].",
                  check="positive")


def init_option():
    return option("uniform", "Initial û: uniform on the sphere of span(W)^⊥ (glm: of "
                             "R^d), or aligned (sign-flipped to m₀·h(0) > 0, Thm 11-13).",
                  choices=INITS)


@dataclass(frozen=True)
class LowRankOptions(Options):
    """Options of the learners that train a low-rank update ξĉûᵀ (ξĈÛᵀ) of W."""

    eta_c: float | None = eta_c_option()
    joint_c: bool = option(False, "Train ĉ jointly with û (plain SGD); else ĉ stays frozen.")
    project: bool = option(True, "Apply Π onto span(W)^⊥ to the gradient of û (eq. 4); "
                                 "--no-project: App. B's unprojected variant.")
    init: str = init_option()
    prox: float = option(0.0, "Proximal regularisation prox·‖Δ‖² toward the base model.",
                         check="nonnegative")


def low_rank_variant(config, frozen_c: str = ", frozen ĉ") -> str:
    """``projected, frozen ĉ`` / ``unprojected, joint ĉ``: a low-rank learner's run from its
    config dict (``Learner.variant``)."""
    return ("projected" if config.get("project", True) else "unprojected") + (
        ", joint ĉ" if config.get("joint_c") else frozen_c)


def _activation_problem(value) -> tuple[bool, str]:
    """(whether ``value`` names an activation, the problem if not: hermite's own message)."""
    from hermite.activations import get_activation

    if not isinstance(value, str):
        return False, "must be an activation name"
    try:
        get_activation(value)
    except ValueError as exc:  # "unknown activation 'x'; valid names: …"
        return False, f"must be an activation name ({str(exc).partition('; ')[2]})"
    return True, ""
