"""The committee flow on its free coordinates: the order parameters that actually move.

The packed state y = (Q, R, v) of :class:`~hermite.committee.ode.CommitteeState` has
K² + KM + K entries, not all of them free: Q is symmetric, its diagonal is fixed at 1 for
unit rows (``rows="unit"``: dQ_kk/dα = 0), and v is constant when the second layer is
frozen (``lr_v is None``). The free coordinates are

    z = (Q_kl for k < l  [k ≤ l for free rows],  R_km for all k, m,  v_k if lr_v is set),

and the flow dz/dα = f(z) is the drift of :func:`~hermite.committee.ode.committee_terms`
restricted to them (docs/theory/committee.md). Working on z makes the Jacobian ∂f/∂z of a
fixed point square and non-singular where the fixed point is hyperbolic
(:mod:`.fixed_points`), and keeps an ODE solver off the fixed entries
(:mod:`.first_passage`).
"""

from __future__ import annotations

import numpy as np

from hermite.committee.ode import CommitteeModel, CommitteeState, committee_loss, committee_terms

__all__ = ["FreeCoordinates"]


class FreeCoordinates:
    """The free coordinates z of ``model``'s flow around the (checked) state ``st``.

    ``z(y)`` picks z out of a packed state y; ``full(z)`` is the packed state again (the fixed
    entries from ``st``, Q_lk mirrored from Q_kl); ``drift(z)`` = dz/dα; ``loss(z)`` the
    generalisation error ε; ``max_overlap(z)`` = max_km |R_km| (a cosine for unit student
    and teacher rows). ``evaluations`` counts the drift evaluations."""

    def __init__(self, model: CommitteeModel, st: CommitteeState):
        self.model, self.st = model, st
        K, M = st.K, st.M
        size = K * K + K * M + K
        first = 0 if model.rows == "free" else 1  # unit rows: the diagonal of Q is fixed
        idx, src, dst = [], [], []
        for k in range(K):
            for m in range(k + first, K):
                if m != k:
                    src.append(len(idx))
                    dst.append(m * K + k)
                idx.append(k * K + m)
        idx += list(range(K * K, K * K + K * M))
        if model.lr_v is not None:
            idx += list(range(K * K + K * M, size))
        self.idx = np.array(idx)
        self.mirror_src = np.array(src, dtype=int)
        self.mirror = np.array(dst, dtype=int)
        self.base = st.pack()
        self.evaluations = 0

    @property
    def size(self) -> int:
        """The number of free coordinates."""
        return int(self.idx.size)

    def full(self, z: np.ndarray) -> np.ndarray:
        y = self.base.copy()
        y[self.idx] = z
        y[self.mirror] = np.asarray(z)[self.mirror_src]
        return y

    def z(self, y: np.ndarray) -> np.ndarray:
        return np.asarray(y)[self.idx].copy()

    def drift(self, z: np.ndarray) -> np.ndarray:
        self.evaluations += 1
        return committee_terms(self.model, self.st.unpack(self.full(z)),
                               check=False).drift.pack()[self.idx]

    def loss(self, z: np.ndarray) -> float:
        return committee_loss(self.model, self.st.unpack(self.full(z)), check=False)

    def max_overlap(self, z: np.ndarray) -> float:
        return float(np.abs(self.st.unpack(self.full(z)).R).max())
