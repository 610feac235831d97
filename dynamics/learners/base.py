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
6. ``trajectory(result)``: the :class:`~dynamics.trajectory.Trajectory` from the stacked
   records (:class:`RunResult`).

``initial_state(config, instances)`` returns (state, m₀) where m₀ (R,) is the initial overlap
(NaN where the learner has none). ``sample_gradients`` gives per-example gradients for the
autograd tests; ``step``/``step_`` apply one step to one batch of examples.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

__all__ = ["TensorState", "Learner", "RunResult", "mask_dead", "make_trajectory"]


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


@dataclass
class RunResult:
    """What the engine hands to ``Learner.trajectory`` after the last step."""

    config: object
    instances: list
    steps: np.ndarray  # (C,) checkpoint steps
    records: dict  # name → (R, C, ...) stacked observations
    diverged_step: np.ndarray  # (R,) int64, −1 if never
    m0: np.ndarray  # (R,)
    device: object
    engine: str = "full"

    @property
    def dead(self) -> np.ndarray:
        """(R, C) True from the checkpoint a run diverged at on."""
        ds = self.diverged_step
        return (ds[:, None] >= 0) & (self.steps[None, :] >= ds[:, None])


def mask_dead(result: RunResult, array: np.ndarray) -> np.ndarray:
    """``array`` (R, C, ...) with NaN at a run's checkpoints from its divergence on."""
    dead = result.dead.reshape(result.dead.shape + (1,) * (array.ndim - 2))
    return np.where(dead, np.nan, array)


def make_trajectory(result: RunResult, overlap: np.ndarray, loss: np.ndarray, *,
                    loss_kind: str, ode: np.ndarray | None = None,
                    c_overlap: np.ndarray | None = None, extra: dict | None = None):
    """A :class:`~dynamics.trajectory.Trajectory` from a learner's (R, C) curves.

    Divergence masking is applied here to every curve and extra array (run axis first,
    checkpoint axis second where it has one); ``ode`` defaults to NaN (no theory).
    """
    from ..trajectory import Trajectory

    runs, cps = result.diverged_step.shape[0], result.steps.shape[0]

    def masked(a):
        a = np.asarray(a, dtype=float)
        return mask_dead(result, a) if a.ndim >= 2 and a.shape[1] == cps else a

    inst = result.instances
    return Trajectory(
        steps=result.steps, overlap=masked(overlap), loss=masked(loss),
        ode=masked(ode) if ode is not None else np.full((runs, cps), np.nan),
        diverged_step=result.diverged_step, xi=np.array([i.xi for i in inst]),
        instance_seed=np.array([i.seed for i in inst], dtype=np.int64),
        c_overlap=None if c_overlap is None else masked(c_overlap), loss_kind=loss_kind,
        dtype=result.config.dtype, device=str(result.device), engine=result.engine,
        extra={n: masked(a) for n, a in (extra or {}).items()}, m0=result.m0,
    )


class Learner:
    """Shared defaults of the learners (see the module docstring for the protocol).

    Subclasses set ``name``, keep per-run step sizes in :attr:`step_sizes` (the engine zeroes a
    diverged run's entries, which freezes it without branching in the hot loop) and
    implement ``from_config``, ``initial_state``, ``prepare``, ``step_prepared_``,
    ``observe``, ``trajectory`` and ``sample_gradients``.
    """

    name = "?"
    noise_sd = 0.0  # standard deviation of the label noise the learner adds
    sqnorm_columns = None  # (lo, hi): columns whose squared norm per example a step needs

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
