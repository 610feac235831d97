"""What the engine asks of a learner, and the parts every learner shares.

A learner advances R independent runs at once. Its state is a dataclass of tensors with a
leading run axis (:class:`TensorState`); the engine drives it chunk by chunk:

1. ``prepare(state, x, eps, sqnorm)``: state-independent terms of a chunk of examples
   x (R, n, b, d) (labels, Wx, ...), label normals eps (R, n, b) or None;
2. ``step_prepared_(state, x_i, pre, i)`` for each step i of the chunk (x_i (R, b, d)), in
   place; it returns a per-run value (R,) that is finite and > 0 for a healthy step;
3. ``renormalize_(state)`` at the chunk end (exact retraction onto the manifold);
4. ``bad_runs(state)`` (R,) bool: runs whose end-of-chunk state is invalid; the engine
   restores them to the chunk's start (``TensorState.restore_``) and ``freeze_``s them;
5. ``observe(state)`` at every checkpoint: name → numpy array (R, ...);
6. ``trajectory(result)``: the :class:`~dynamics.runtime.trajectory.Trajectory` from the stacked
   records (:class:`~dynamics.runtime.trajectory.RunResult`), via ``make_trajectory``.

``initial_state(config, instances)`` returns (state, m₀) where m₀ (R,) is the initial overlap
(NaN where the learner has none). ``sample_gradients`` gives per-example gradients for the
autograd tests; ``step``/``step_`` apply one step to one batch of examples.

What the rest of loradyn asks of a learner without building one (class attributes and
classmethods; the learner's file is the one place they are stated, nothing outside it
switches on a learner's name):

* ``name``, ``Options`` (:mod:`.options`), ``family`` (:data:`FAMILIES`);
* ``teachers`` / ``conventions``: the instance teachers it learns and the row conventions it
  runs (``RunConfig.validate`` refuses others);
* ``exact_chain()``: its exact reduced chain (:class:`dynamics.reduced.exact_chain.ExactChain`)
  or None;
* ``memory(config, d, k)``: the numbers it holds per run (:class:`Memory`;
  ``dynamics.engines.budget``), ``neurons(config, k)`` its number of student neurons and
  ``given_rows(config)`` the rows file it starts from (or None);
* ``takes_step_size``, ``has_population_ode``, ``finetune_ode``,
  ``committee_loss`` (network learners: the
  loss of the committee ODE beside their curves, else None), ``diagonal_alignment``;
* ``step_limit(config, instance)``: the stability limit of η its theory gives (or None);
* ``variant(config)`` / ``label(config)``: how figures and titles name a run of it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields

from dynamics.lazy import lazy_import
from dynamics.learners.options import Options
from dynamics.runtime.trajectory import RunResult, make_trajectory, mask_dead

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["TensorState", "Learner", "Memory", "FAMILIES", "RunResult", "mask_dead",
           "make_trajectory"]

#: what a learner trains: a low-rank update of W (rank 1 or r, or its linearisation), a single
#: index on the whole sphere, a whole two-layer network, or no training (an estimator)
FAMILIES = ("low-rank", "single-index", "network", "estimator")


@dataclass(frozen=True)
class Memory:
    """Numbers a learner holds per run on the full engine: its ``state``, what it records at
    every checkpoint (``records``) and what it prepares per example (``prepared``)."""

    state: int
    records: int
    prepared: int


@dataclass
class TensorState:
    """Base of learner states: tensor fields with a leading run axis, plus ``step``."""

    def clone(self):
        return type(self)(**{f.name: _copy(getattr(self, f.name)) for f in fields(self)})

    def restore_(self, snapshot, idx: torch.Tensor) -> None:
        """Copy runs ``idx`` back from ``snapshot`` (tensor fields only)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                value[idx] = getattr(snapshot, f.name)[idx]

    def tensors(self):
        """The state's run-axis tensors."""
        return [v for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)
                and v.dim() > 0]


def _copy(v):
    return v.clone() if isinstance(v, torch.Tensor) else v


class Learner:
    """Shared defaults of the learners (see the module docstring for the protocol).

    Subclasses set ``name`` and ``Options`` (their options dataclass, :mod:`.options`;
    default: none), keep per-run step sizes in :attr:`step_sizes` (the engine zeroes a
    diverged run's entries, which freezes it without branching in the hot loop) and
    implement ``from_config``, ``initial_state``, ``prepare``, ``step_prepared_``,
    ``observe``, ``trajectory`` and ``sample_gradients``.
    """

    name = "?"
    Options = Options
    family = "low-rank"
    teachers = ("finetune",)  # instance teachers it learns (``Instance.teacher``)
    conventions = ("unit",)  # row conventions it runs (``Instance.convention``)
    takes_step_size = True  # False: η means nothing to it (no default-η note)
    has_population_ode = True  # an ODE of its overlap exists (where its options allow one)
    finetune_ode = False  # its (û, ĉ) follow hermite.finetune.population's ODE (rank-1 LoRA)
    committee_loss = None  # "squared" | "correlation": a committee ODE goes beside its curves
    named_in_titles = True  # titles say its name (False: the default learner's variant only)
    diagonal_alignment = False  # alignment: mean ⟨vᵢ, ŵᵢ⟩ (True) or mean maxⱼ |cos(vᵢ, ŵⱼ)|
    noise_sd = 0.0  # standard deviation of the label noise the learner adds
    sqnorm_columns = None  # (lo, hi): columns whose squared norm per example a step needs

    #: its exact reduced chain as (module, class), imported on first use like the registry's
    #: entries (a chain builds on its learner's code, so no import points back), or None
    chain = None

    # ------------------------------------------------------------------ declarations
    @classmethod
    def exact_chain(cls):
        """Its exact reduced chain (an ``ExactChain``, from ``chain``), or None (full engine
        only)."""
        if cls.chain is None:
            return None
        module, name = cls.chain
        return getattr(importlib.import_module(module), name)()

    @classmethod
    def neurons(cls, config, k: int) -> int:
        """Student neurons (k: the base network's; network learners: k′)."""
        return k

    @classmethod
    def given_rows(cls, config):
        """The initial rows file the runs start from (``GivenRows``), or None."""
        return None

    @classmethod
    def memory(cls, config, d: int, k: int) -> Memory:
        """Numbers held per run (state: one direction and a k-vector by default)."""
        return Memory(state=d + k, records=1 + k, prepared=2 * k + 4)

    @classmethod
    def step_limit(cls, config, instance):
        """The largest stable η its theory gives for ``instance`` (a
        ``hermite.finite_d.stability.StepLimit``), or None where it has none."""
        return None

    @classmethod
    def variant(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        """What sets a run apart within this learner, from a config dict (a trajectory
        file's ``config``, or ``RunConfig.to_dict()``); ``frozen_c`` names a frozen ĉ."""
        return ""

    @classmethod
    def label(cls, config, frozen_c: str = ", frozen ĉ") -> str:
        """``name, variant`` (the variant alone where ``named_in_titles`` is False): how a
        title names a run of this learner."""
        variant = cls.variant(config, frozen_c)
        if not cls.named_in_titles:
            return variant
        return f"{cls.name}, {variant}" if variant else cls.name

    #: what its ``overlap`` measures, as scaling tables say it
    overlap_label = "|⟨û, u⟩|"
    #: the instance keys that shape its teacher (scaling titles name them)
    instance_keys = ("k", "xi", "W")

    @property
    def needs_label_noise(self) -> bool:
        """Whether the engine must draw one label normal per example (``noise_sd > 0``)."""
        return self.noise_sd > 0

    @classmethod
    def check(cls, config, instance) -> None:
        """Raise ``ConfigError`` when this learner cannot run ``config`` on ``instance``."""

    def step_sizes(self) -> list[torch.Tensor]:
        """Per-run step-size tensors (R,) that :meth:`freeze_` zeroes."""
        return []

    def freeze_(self, idx: torch.Tensor) -> None:
        for eta in self.step_sizes():
            eta[idx] = 0.0

    def renormalize_(self, state) -> None:
        """Exact retraction at a chunk end (default: nothing to do)."""

    def bad_runs(self, state) -> torch.Tensor:
        """(R,) True where some state tensor is not finite."""
        bad = None
        for t in state.tensors():
            b = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(-1)
            bad = b if bad is None else bad | b
        return bad

    def step(self, state, x: torch.Tensor, eps: torch.Tensor | None = None):
        """Pure step: a new state after one step on the examples x (R, b, d)."""
        new = state.clone()
        self.step_(new, x, eps)
        return new

    def step_(self, state, x: torch.Tensor, eps: torch.Tensor | None = None) -> torch.Tensor:
        """One step in place on x (R, b, d); returns the per-run health value."""
        pre = self.prepare(state, x[:, None], None if eps is None else eps[:, None])
        return self.step_prepared_(state, x, pre, 0)
