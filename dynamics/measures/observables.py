"""Per-run observables the engines record, and the grouping of runs by instance.

- m = ⟨û, u⟩ comes from the engines' states; ⟨ĉ, c⟩/(‖ĉ‖‖c‖) is :func:`c_overlap`;
- :func:`reduced_coordinates` are û's coordinates that fix its law against an isotropic x
  (what the loss of every state but the projected unit-row one, and the refit, need);
- :func:`group_runs` batches per-instance work; :func:`unit_rows` tells the theory's unit rows
  from an App. B convention.
"""

from __future__ import annotations

import numpy as np

from dynamics.instances.instance import Instance
from dynamics.lazy import lazy_import

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["unit_rows", "group_runs", "reduced_coordinates", "c_overlap"]


def unit_rows(config) -> bool:
    """Whether the config's instance uses the theory's unit rows (not an App. B convention)."""
    return config.instance.get("convention", "unit") == "unit"


def group_runs(instances: list[Instance]) -> list[tuple[Instance, np.ndarray]]:
    """Distinct instances (by identity) with the indices of their runs."""
    groups: dict[int, tuple[Instance, list[int]]] = {}
    for r, inst in enumerate(instances):
        groups.setdefault(id(inst), (inst, []))[1].append(r)
    return [(inst, np.asarray(idx)) for inst, idx in groups.values()]


def reduced_coordinates(u_hat: torch.Tensor, k: int) -> np.ndarray:
    """(R, k+2) coordinates of unit û that fix its law against x: (û_w, û_k, ‖rest‖)."""
    head = u_hat[:, : k + 1].detach().double().cpu().numpy()
    rest = torch.linalg.vector_norm(u_hat[:, k + 1:], dim=-1).double().cpu().numpy()
    return np.concatenate([head, rest[:, None]], axis=1)


def c_overlap(c_hat: np.ndarray, c: np.ndarray) -> np.ndarray:
    """⟨ĉ, c⟩/(‖ĉ‖‖c‖) over the last axis (= ⟨ĉ, c⟩/‖ĉ‖ for the unit c of the paper)."""
    num = (c_hat * c).sum(-1)
    return num / (np.linalg.norm(c_hat, axis=-1) * np.linalg.norm(c, axis=-1))
