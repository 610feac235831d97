"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import numpy as np
import torch

# the small fine-tuning instance of the CLI tests (ReLU, k = 3, d = 20, ξ = 1), as TOML
TINY_SPEC_TOML = 'activation = "relu"\nk = 3\nd = 20\nxi = 1.0\nseed = 9\n'


def assert_close(ours, ref, rtol: float = 1e-10, floor: float = 1e-300) -> None:
    """max |ours − ref| ≤ rtol · max(max |ref|, floor) (arrays or tensors, any device)."""
    ours, ref = torch.as_tensor(ours), torch.as_tensor(ref)
    scale = max(float(ref.abs().max()), floor)
    err = float((ours - ref).abs().max())
    assert err <= rtol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


def dense_rows(inst):
    """(W (k, d), V (k, d), u (d,)) of an instance written out in the canonical frame from
    the paper's model (eq. 3: vᵢ = (wᵢ + ξcᵢu)/‖wᵢ + ξcᵢu‖), numpy: an independent reference
    for the tests."""
    k, d = inst.k, inst.d
    w = np.zeros((k, d))
    w[:, :k] = inst.w_factor
    u = np.zeros(d)
    u[:k], u[k] = inst.u_w, inst.u_perp
    v = w + inst.xi * inst.c[:, None] * u
    return w, v / np.linalg.norm(v, axis=1, keepdims=True), u


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


# the tiny sweep of the sweep-machinery tests (ReLU, k = 3, d = 20, two ξ; theory off)
SWEEP_BASE = {"finite_d_theory": False, "runs": 2, "eta_times_d": 0.05, "steps_per_d": 5,
              "checkpoints": 6}
SWEEP_INSTANCE = {"activation": "relu", "k": 3, "d": 20, "seed": 1}


def sweep_toml(name: str | None = None, axes: dict | None = None, instance: dict | None = None,
               **base) -> str:
    """A sweep file's text: ``SWEEP_BASE`` updated by ``base``, ``SWEEP_INSTANCE`` by
    ``instance``, ``axes`` (default ξ ∈ {0.5, 1}), one ``key = value`` per line (so tests may
    edit it with ``str.replace``)."""
    lines = ([f"[sweep]\nname = {_toml_value(name)}"] if name else []) + ["[base]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (SWEEP_BASE | base).items()]
    lines += ["[base.instance]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (SWEEP_INSTANCE | (instance or {})).items()]
    lines += ["[axes]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (axes or {"xi": [0.5, 1.0]}).items()]
    return "\n".join(lines) + "\n"
