"""What a learner's exact reduced chain offers (:meth:`dynamics.learners.base.Learner.exact_chain`).

A chain simulates a learner's runs with exactly the law of the full engine at a cost per step
independent of d (rotation invariance; each chain's module derives its state and step). The
public entry points of :mod:`dynamics.reduced` ask the learner for its chain and call these
methods; nothing outside the learner's file names which chain a learner has.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ExactChain", "convention_supported", "passage_steps"]


def convention_supported(config, chain) -> tuple[bool, str]:
    """(False, reason) where ``chain`` does not reduce the instance's row convention
    (``chain.conventions``: the unit rows, and for the rank-1 chain the App. B ones too)."""
    convention = config.instance.get("convention", "unit")
    if convention not in chain.conventions:
        return False, (f"reduced engine: the {chain.name} chain reduces the "
                       f"{', '.join(chain.conventions)} convention(s), not {convention!r}; "
                       "use --engine full")
    return True, ""


def passage_steps(hit: np.ndarray, started: np.ndarray) -> np.ndarray:
    """(R,) first-passage steps from a kernel's ``hit`` (−1: not by the horizon → NaN), 0
    where the run's start (``started``) is already past the level."""
    out = hit.astype(float)
    out[hit < 0] = np.nan
    out[started] = 0.0
    return out


class ExactChain:
    """An exact overlap chain (subclasses implement every method but
    :meth:`initial_trajectory`, which only chains with ``records_start`` provide).
    :meth:`simulate` runs :meth:`start`'s runs to the horizon in segments
    (:mod:`dynamics.reduced.segments`), so a signal or a progress line comes between two."""

    name = "?"
    #: the instance row conventions (``convention`` of the spec) the chain reduces
    conventions = ("unit",)
    #: the chain can record the runs' start alone (``initial_trajectory``): what a sweep cell
    #: with ``trajectory = false`` stores beside its exact first passages
    records_start = False
    #: what :meth:`first_passages` can time: ``overlap`` (≥ a level) always; ``loss`` (the
    #: exact population loss ≤ a level) where the chain checks it every step
    first_passage_quantities = ("overlap",)

    def quantity_supported(self, config, quantity: str) -> tuple[bool, str]:
        """(True, "") when :meth:`first_passages` can time ``quantity`` for ``config``,
        else (False, one-line reason)."""
        try:
            self.require_quantity(quantity)
        except ValueError as exc:
            return False, str(exc)
        return True, ""

    def supported(self, config) -> tuple[bool, str]:
        """(True, "") when the chain is exact for ``config``, else (False, one-line reason)."""
        raise NotImplementedError

    def simulate(self, config, *, instances=None, backend: str | None = None,
                 _chi2_dof: int | None = None):
        """The :class:`~dynamics.runtime.trajectory.Trajectory` of ``config`` (validated and
        supported); ``instances``: the runs' resolved instances (default: built from the
        config); ``_chi2_dof`` is a test hook (a deliberately wrong χ² law)."""
        raise NotImplementedError

    def start(self, config, *, instances=None, backend: str | None = None,
              _chi2_dof: int | None = None):
        """:meth:`simulate`'s runs at step 0 as a
        :class:`~dynamics.reduced.segments.ChainRun`, advanced in segments by the caller
        (:func:`~dynamics.reduced.segments.run_to_end`: :meth:`simulate` is that, to the
        horizon); the same numbers however the segments fall."""
        raise NotImplementedError

    def first_passages(self, config, levels, max_steps: int | None = None, *,
                       absolute: bool = True, backend: str | None = None,
                       quantity: str = "overlap") -> np.ndarray:
        """(L, R) first steps at which each run's ``quantity`` reaches each level (NaN: not
        by ``max_steps``, default ``config.steps``; diverged runs never); ValueError where the
        chain cannot time ``quantity`` (:meth:`require_quantity`)."""
        raise NotImplementedError

    def require_quantity(self, quantity: str) -> None:
        """ValueError (:meth:`quantity_supported`'s reason) unless ``quantity`` is one of
        ``first_passage_quantities``; config-dependent conditions are each chain's own."""
        if quantity not in self.first_passage_quantities:
            raise ValueError(f"the {self.name} chain times first passages of "
                             f"{' or '.join(self.first_passage_quantities)} only, not "
                             f"{quantity!r}")

    def initial_trajectory(self, config, *, backend: str | None = None):
        """The runs' start only (one checkpoint, step 0), as :meth:`simulate` records it."""
        raise ValueError(f"initial_trajectory: the {self.name} chain does not record the start "
                         "alone")
