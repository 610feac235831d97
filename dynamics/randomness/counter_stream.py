"""Counter-based standard normals for the full engine (config ``streams = "counter"``, CPU).

Number m of run r's example stream (m counts every number the run has drawn, in the order of
its example buffer) is a pure function of (key_r, m), key_r = ``run_seed(seed, r, "data")``
(:func:`dynamics.randomness.sampling.counter_keys`): the SplitMix64 output z = mix(key_r +
(m + 1)·γ) (γ the golden-ratio increment) drives one proposal of the 128-layer ziggurat
(Marsaglia & Tsang 2000 in Doornik's ZIGNOR layout: bits 0–6 the layer, bit 7 the sign, bits
11–63 the uniform). About 98.8% of proposals fall inside their layer's box and are the number;
the rest finish the exact rejection sampler (wedge test, tail, further proposals) from a
sub-stream seeded by z itself. So the law is exactly N(0, 1) (up to the 2⁻⁵³ grid), run r's
numbers depend only on (seed, r) — not on R, the chunking or the threads — and the common
path is a branch-light loop that the compiler vectorises: about 2–3 ns per number on one
core against about 18 ns for torch's float64 ``normal_`` (its double path is scalar Box–Muller
on mt19937), which bounds the O(k′d) learners at small k′ (``benchmarks/peer_nn2pp.py``).

The numbers differ from the default per-run torch streams (same law, other draws).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from dynamics.randomness.ziggurat import ZIGGURAT_TAIL, ziggurat_tables

__all__ = ["fill_normals"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SALT = np.uint64(0x632BE59BD9B4E019)  # sub-stream of a rejected proposal
_S30, _S27, _S31, _S11, _S7 = (np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11),
                               np.uint64(7))
_LOW7, _ONE = np.uint64(127), np.uint64(1)
_TWO_M53 = 1.0 / 9007199254740992.0
_ZX, _ZR = ziggurat_tables()
_KR = np.ceil(_ZR * 2.0**53).astype(np.int64)  # the box test on the 53-bit integer
_ZXS = _ZX * _TWO_M53


@njit(cache=True, inline="always")
def _mix(z):
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, inline="always")
def _uniform(state):
    state = state + _GOLDEN
    return (np.float64(_mix(state) >> _S11) + 0.5) * _TWO_M53, state


@njit(cache=True)
def _finish(z, zx):
    """The rest of the rejection sampler for a proposal z outside its box (sub-stream of z)."""
    state = z ^ _SALT
    i = np.int64(z & _LOW7)
    u = np.float64(z >> _S11) * _TWO_M53
    sign = 1.0 - 2.0 * np.float64((z >> _S7) & _ONE)
    while True:
        if i == 0:  # base strip beyond r: the tail (Marsaglia 1964)
            while True:
                u1, state = _uniform(state)
                u2, state = _uniform(state)
                t = math.log(u1) / ZIGGURAT_TAIL
                if -2.0 * math.log(u2) >= t * t:
                    return sign * (ZIGGURAT_TAIL - t)
        x = u * zx[i]
        f0 = math.exp(-0.5 * (zx[i] * zx[i] - x * x))
        f1 = math.exp(-0.5 * (zx[i + 1] * zx[i + 1] - x * x))
        w, state = _uniform(state)
        if f1 + w * (f0 - f1) < 1.0:
            return sign * x
        state = state + _GOLDEN  # a new proposal
        z = _mix(state)
        i = np.int64(z & _LOW7)
        u = np.float64(z >> _S11) * _TWO_M53
        sign = 1.0 - 2.0 * np.float64((z >> _S7) & _ONE)
        if u < zx[i + 1] / zx[i]:
            return sign * u * zx[i]


_BLOCK = 512  # numbers per block: the SplitMix64 outputs of a block, then their ziggurat


@njit(cache=True)
def _fill_row(out, count, key, start, zx, kr, zxs):
    """out[:count] = numbers start … start + count − 1 of the stream with this key."""
    c0 = key + np.uint64(start + 1) * _GOLDEN
    zb = np.empty(_BLOCK, dtype=np.uint64)
    for lo in range(0, count, _BLOCK):
        nb = min(_BLOCK, count - lo)
        cb = c0 + np.uint64(lo) * _GOLDEN
        for m in range(nb):  # vectorised (64-bit multiplies, no table lookups)
            zb[m] = _mix(cb + np.uint64(m) * _GOLDEN)
        for m in range(nb):
            z = zb[m]
            i = np.int64(z & _LOW7)
            k = np.int64(z >> _S11)  # u = k·2⁻⁵³; u < zr[i] ⟺ k < ⌈zr[i]·2⁵³⌉ (exact)
            if k < kr[i]:
                x = np.float64(k) * zxs[i]  # = u·zx[i] exactly (scaling by 2⁻⁵³ is exact)
                out[lo + m] = -x if (z >> _S7) & _ONE else x
            else:  # ~1.2%: finish the rejection sampler
                out[lo + m] = _finish(z, zx)


@njit(cache=True, nogil=True)
def _fill(out, count, keys, start, lo, hi, zx, kr, zxs):
    for r in range(lo, hi):
        _fill_row(out[r], count, keys[r], start, zx, kr, zxs)


def fill_normals(out: np.ndarray, count: int, keys: np.ndarray, start: int,
                 runs: range) -> None:
    """out[r, :count] ← numbers start … start + count − 1 of run r's stream, r in ``runs``.

    out (R, L) float64 or float32, C-contiguous (a run's slab of the example buffer);
    releases the GIL (the engine fills blocks of runs from several threads)."""
    _fill(out, int(count), keys, int(start), runs.start, runs.stop, _ZX, _KR, _ZXS)
