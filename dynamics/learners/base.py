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
   records (:class:`~dynamics.trajectory.RunResult`), via ``make_trajectory``.

``initial_state(config, instances)`` returns (state, m₀) where m₀ (R,) is the initial overlap
(NaN where the learner has none). ``sample_gradients`` gives per-example gradients for the
autograd tests; ``step``/``step_`` apply one step to one batch of examples.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..trajectory import RunResult, make_trajectory, mask_dead
from .options import Options

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
