"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import torch

# the small fine-tuning instance of the CLI tests (ReLU, k = 3, d = 20, ξ = 1), as TOML
TINY_SPEC_TOML = 'activation = "relu"\nk = 3\nd = 20\nxi = 1.0\nseed = 9\n'


def assert_close(ours, ref, rtol: float = 1e-10, floor: float = 1e-300) -> None:
    """max |ours − ref| ≤ rtol · max(max |ref|, floor) (arrays or tensors, any device)."""
    ours, ref = torch.as_tensor(ours), torch.as_tensor(ref)
    scale = max(float(ref.abs().max()), floor)
    err = float((ours - ref).abs().max())
    assert err <= rtol * scale, f"max error {err:.3g} vs scale {scale:.3g}"
