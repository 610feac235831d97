"""Shared fixtures: small instance specs, per-dtype tolerances, devices (cuda only if present)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import TINY_SPEC_TOML

if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: one torch thread each
    torch.set_num_threads(1)

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


@pytest.fixture
def spec_dir(tmp_path, monkeypatch) -> Path:
    """A fresh working directory holding spec.toml (``helpers.TINY_SPEC_TOML``)."""
    monkeypatch.chdir(tmp_path)
    Path("spec.toml").write_text(TINY_SPEC_TOML)
    return tmp_path


@pytest.fixture
def runner(spec_dir) -> CliRunner:
    """A CliRunner working in ``spec_dir``."""
    return CliRunner()
