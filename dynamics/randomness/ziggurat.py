"""The 128-layer ziggurat of N(0, 1) shared by the package's samplers (Marsaglia & Tsang 2000,
Doornik's 2005 ZIGNOR layout): :mod:`dynamics.reduced._rng`,
:mod:`dynamics.randomness.counter_stream`."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ZIGGURAT_TAIL", "ziggurat_tables"]

ZIGGURAT_TAIL = 3.442619855899  # r: start of the tail beyond the last layer


def ziggurat_tables(layers=128, r=ZIGGURAT_TAIL, v=9.91256303526217e-3):
    """ZIGNOR tables: x[0] = v/f(r) (base strip), x[1] = r, …, x[layers] = 0; ratios x[i+1]/x[i]."""
    x = np.zeros(layers + 1)
    f = math.exp(-0.5 * r * r)
    x[0], x[1] = v / f, r
    for i in range(2, layers):
        x[i] = math.sqrt(-2.0 * math.log(v / x[i - 1] + f))
        f = math.exp(-0.5 * x[i] * x[i])
    return x, x[1:] / x[:-1]
