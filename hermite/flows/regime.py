"""The fine-tuning learner's regime, its start and the solver's settings, as frozen objects
passed whole to the flows of :mod:`hermite.flows.linearized`, :mod:`hermite.finite_d` and
:mod:`hermite.finetune` (each validated here, once).

The public functions keep their old keyword form (``finetune_ode(inst, eta, steps, m0=…,
joint_c=True)``): :func:`from_keywords` builds the objects from those keywords, strictly (an
unknown keyword is a TypeError naming it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

__all__ = ["FinetuneRegime", "FinetuneStart", "SolverSettings", "from_keywords", "LEARNER"]


def _positive(name, val) -> float:
    val = float(val)
    if not math.isfinite(val) or val <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {val:g}")
    return val


def _nonnegative(name, val) -> float:
    out = float(val)
    if not (math.isfinite(out) and out >= 0.0):
        raise ValueError(f"{name} must be a finite number ≥ 0, got {val!r}")
    return out


@dataclass(frozen=True)
class FinetuneRegime:
    """The learner's options that shape the flow: step sizes ``eta`` (û) and ``eta_c`` (ĉ;
    None: η), ``project`` (û ⊥ span W), ``joint_c`` (ĉ trained), ``prox`` (the proximal
    weight), and for the finite-d corrections the dimension ``d`` (None: none), the
    mini-batch ``batch`` and the label-noise variance ``label_noise``."""

    eta: float
    project: bool = True
    joint_c: bool = False
    eta_c: float | None = None
    prox: float = 0.0
    d: int | None = None
    batch: int = 1
    label_noise: float = 0.0

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "eta", _positive("eta", self.eta))
        if self.eta_c is not None:
            set_(self, "eta_c", _positive("eta_c", self.eta_c))
        set_(self, "prox", _nonnegative("prox", self.prox))
        if self.d is not None and (int(self.d) != self.d or self.d < 1):
            raise ValueError(f"d must be an integer ≥ 1, got {self.d!r}")
        if int(self.batch) != self.batch or self.batch < 1:
            raise ValueError(f"batch must be an integer ≥ 1, got {self.batch!r}")
        _nonnegative("label_noise", self.label_noise)


@dataclass(frozen=True, eq=False)
class FinetuneStart:
    """The runs' start: ``m0`` (R,) overlaps with p = 0, or ``mu0`` (R,) with ``p0`` (R, k)
    (default 0); ``c_hat0`` (k,) or (R, k) (default the instance's ĉ). Checked against the
    model by :func:`hermite.finetune.population._start`."""

    m0: np.ndarray | None = None
    mu0: np.ndarray | None = None
    p0: np.ndarray | None = None
    c_hat0: np.ndarray | None = None

    def __post_init__(self):
        if self.m0 is None and self.mu0 is None:
            raise ValueError("give the start: m0, or mu0 (and p0)")


@dataclass(frozen=True)
class SolverSettings:
    """``solve_ivp``'s ``rtol``, ``atol`` and ``method``, and ``chunk``: runs per call are
    limited to about chunk / k² (memory)."""

    rtol: float = 1e-7
    atol: float = 1e-10
    method: str = "BDF"
    chunk: int = 2_000_000

    def __post_init__(self):
        _positive("rtol", self.rtol)
        _positive("atol", self.atol)
        if int(self.chunk) != self.chunk or self.chunk < 1:
            raise ValueError(f"chunk must be an integer ≥ 1, got {self.chunk!r}")


LEARNER = ("project", "joint_c", "eta_c", "prox")  # the regime's fields of the d → ∞ learner


def from_keywords(caller: str, regime, keywords: dict, start=False, solver=False,
                  accepted: tuple = LEARNER + ("d", "batch", "label_noise")):
    """``regime`` (with ``start`` and ``solver`` where asked) of ``caller`` from its objects or its
    old keywords:
    ``regime`` a :class:`FinetuneRegime`, or the step size η with the regime's fields in
    ``accepted`` as keywords; ``start`` a :class:`FinetuneStart` or None (then from m0, mu0,
    p0, c_hat0; None if none of them) and ``solver`` a :class:`SolverSettings` or None (then
    from rtol, atol, method, chunk), each only where ``caller`` takes one (not False). A
    keyword beside its object, or one of none of them, is a TypeError naming it."""
    kw = dict(keywords)
    groups = [(FinetuneRegime, regime, accepted)]
    groups += [(cls, given, tuple(f.name for f in fields(cls)))
               for cls, given in ((FinetuneStart, start), (SolverSettings, solver))
               if given is not False]
    out = []
    for cls, given, names in groups:
        picked = {name: kw.pop(name) for name in names if name in kw}
        if isinstance(given, cls):
            if picked:
                raise TypeError(f"{caller}() got a {cls.__name__} and its keyword(s) "
                                f"{', '.join(picked)}: give one or the other")
            out.append(given)
        elif cls is FinetuneRegime:
            out.append(cls(given, **picked))
        elif given is not None:
            raise TypeError(f"{caller}() needs a {cls.__name__}, got {type(given).__name__}")
        else:
            out.append(cls(**picked) if picked or cls is SolverSettings else None)
    if kw:
        raise TypeError(f"{caller}() got an unexpected keyword argument {next(iter(kw))!r}")
    return tuple(out) if len(out) > 1 else out[0]
