"""Shared fixtures: small instance specs, per-dtype tolerances, devices (cuda only if present)."""

from __future__ import annotations

import pytest
import torch

# one table of tolerances per dtype (relative), used by the engine tests
TOLERANCE = {"float64": 1e-12, "float32": 1e-5}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=sorted(TOLERANCE))
def dtype_tol(request) -> tuple[str, float]:
    """(dtype name, relative tolerance of invariants in that dtype)."""
    return request.param, TOLERANCE[request.param]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def small_spec() -> dict:
    """A small projected instance: ReLU, k = 3, d = 16, ξ = 1, orthonormal W."""
    return {"activation": "relu", "k": 3, "d": 16, "xi": 1.0, "seed": 9}
