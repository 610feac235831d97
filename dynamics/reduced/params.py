"""Pack the runs' instances into the flat arrays the reduced kernels read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamics.instances.instance import Instance

__all__ = ["ChainParams", "pack_instances", "distinct", "split_flat", "join_flat"]


@dataclass(frozen=True)
class ChainParams:
    """Per-instance arrays (leading axis I = number of distinct instances) and the run map.

    L : (I, k, k) rows wᵢ in an orthonormal basis of span W; ident : (I,) L is the identity.
    prm : (I, 4k + 4) rows [λ, c, N (teacher norms), u_w, u⊥, ξ, s, o]: s = 0 for unit rows,
    else the App. B row factor; o the output factor (1/ξ in App. B, else 1).
    inst_idx : (R,) instance of each run. c_hat0 : (R, k) initial ĉ of each run.
    instances : the I distinct instances.
    """

    L: np.ndarray
    ident: np.ndarray
    prm: np.ndarray
    inst_idx: np.ndarray
    c_hat0: np.ndarray
    instances: tuple

    @property
    def k(self) -> int:
        return self.L.shape[1]


def _row(inst: Instance) -> np.ndarray:
    scale = 0.0 if inst.unit_rows else inst.row_scale
    return np.concatenate([inst.lam, inst.c, inst.teacher_norms(), inst.u_w,
                           [inst.u_perp, inst.xi, scale, inst.output_scale]]).astype(np.float64)


def distinct(items: list) -> tuple[list, np.ndarray]:
    """(the distinct items by identity, in first-seen order; (R,) index of each item in it)."""
    uniq: dict[int, int] = {}
    order: list = []
    idx = np.empty(len(items), dtype=np.int64)
    for r, item in enumerate(items):
        if id(item) not in uniq:
            uniq[id(item)] = len(order)
            order.append(item)
        idx[r] = uniq[id(item)]
    return order, idx


def pack_instances(run_instances: list[Instance]) -> ChainParams:
    """Distinct instances (by identity) → arrays; ``run_instances`` has one entry per run."""
    order, idx = distinct(run_instances)
    k = order[0].k
    L = np.stack([np.asarray(i.w_factor, dtype=np.float64) for i in order])
    ident = np.array([np.array_equal(x, np.eye(k)) for x in L])
    prm = np.stack([_row(i) for i in order])
    c_hat0 = np.stack([np.asarray(run_instances[r].c_hat, dtype=np.float64)
                       for r in range(len(run_instances))])
    return ChainParams(L, ident, prm, idx, c_hat0, tuple(order))


def split_flat(order, args, *classes) -> tuple:
    """The flat arguments ``args`` of a kernel entry point, named in turn by ``order``, as
    one instance of each named-tuple class of ``classes`` (fields taken by name)."""
    named = dict(zip(order, args, strict=True))
    return tuple(cls(*(named[f] for f in cls._fields)) for cls in classes)


def join_flat(order, *groups) -> tuple:
    """Inverse of :func:`split_flat`: the fields of the named tuples ``groups`` in ``order``."""
    named = {f: v for g in groups for f, v in zip(g._fields, g, strict=True)}
    return tuple(named[f] for f in order)
