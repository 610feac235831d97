"""The full engine's example chunks: their row width and length (torch-free, so that
:mod:`dynamics.engines.budget` computes them exactly as
:class:`dynamics.randomness.sampling.NoiseSource` does
without importing torch)."""

from __future__ import annotations

import math

__all__ = ["ALIGN", "CHUNK_BYTES", "MAX_CHUNK_STEPS", "row_width", "chunk_steps"]

ALIGN = 16  # torch's CPU normal_ works in blocks of 16 numbers
CHUNK_BYTES = 32 * 2**20  # target size of the example buffer
MAX_CHUNK_STEPS = 256


def row_width(d: int, extra: int = 0) -> int:
    """Numbers stored per example: d (+ the label-noise normal), rounded up to ALIGN."""
    return ALIGN * math.ceil((d + extra) / ALIGN)


def chunk_steps(runs: int, batch: int, width: int, itemsize: int) -> int:
    """Steps per chunk: the most whose buffer (R × S × b × w numbers) fits CHUNK_BYTES, at
    least 1 and at most MAX_CHUNK_STEPS."""
    per_step = max(1, runs * batch * width * itemsize)
    return max(1, min(MAX_CHUNK_STEPS, CHUNK_BYTES // per_step))
