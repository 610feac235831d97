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
