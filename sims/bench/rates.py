"""Rates of ``loradyn bench engine``: run-steps/s of the full engine's hot loop, of raw
normal sampling, and of the engine's own sampler."""

from __future__ import annotations

import time

import torch

from dynamics.engines.engine import FullRun
from dynamics.randomness.sampling import NoiseSource, NoiseStreams
from dynamics.setup.config import RunConfig

__all__ = ["engine_rate", "sampling_rate", "sampler_rate"]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_rate(config: RunConfig) -> float:
    run = FullRun(config)
    _sync(run.device)
    t0 = time.perf_counter()
    run.advance()
    _sync(run.device)
    return config.runs * config.steps / (time.perf_counter() - t0)


def sampling_rate(runs, d, steps, device, dtype) -> float:
    buf = torch.empty((runs, d), dtype=dtype, device=device)
    buf.normal_()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        buf.normal_()
    _sync(device)
    return runs * steps / (time.perf_counter() - t0)


def sampler_rate(runs, d, steps, device, dtype) -> float:
    """The engine's own sampler alone, double-buffered: per-run generators (threaded) on CPU,
    one shared generator on CUDA (the engine's ``streams = auto``)."""
    with NoiseSource(NoiseStreams(0), runs, 1, d, device=device, dtype=dtype) as src:
        sizes = [src.chunk_steps] * max(1, steps // src.chunk_steps)
        _sync(device)
        t0 = time.perf_counter()
        for _ in src.chunks(sizes):
            pass
        _sync(device)
    return runs * sum(sizes) / (time.perf_counter() - t0)
