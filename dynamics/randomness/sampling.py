"""Randomness of the engine: one independent, explicitly seeded stream per run.

Run r of a batch draws its initial direction from ``numpy`` (stream ``init``) and its
examples x ~ N(0, I_d) (plus label noise) from its own ``torch.Generator`` (stream ``data``),
both seeded from (seed, r) only. So run r's numbers do not depend on R, on the other runs or
on the chunking below, and a batch of R runs replays R single runs with the same seeds.

Examples are drawn a chunk of steps at a time, per run, into one preallocated buffer of shape
(R, S, b, w): w = d (+1 for label noise) rounded up to a multiple of 16, so that every
``normal_`` call fills a multiple of 16 numbers; torch's CPU sampler then yields the same
stream however the calls are split (it transforms uniforms in blocks of 16). On CPU the
per-run fills run in parallel threads (torch releases the GIL); on CUDA they are queued.

On CUDA the Philox generator advances by an amount that depends on the size of each draw, so
a run's examples there depend on the chunk schedule too: the same config and seed give the
same numbers, but a batch replays single runs exactly only while the chunk length (at most
``MAX_CHUNK_STEPS``, less when R·b·w is large) is the same for both. Per-run draws also cost
one kernel launch per run and chunk, which caps the CUDA engine near 10⁶ run-steps/s; so
kind ``shared`` (the default on CUDA, config ``streams``) draws every run's examples of a
chunk in ONE call from one generator seeded by (seed, ``data_shared``): run r's numbers then
depend on R, but the same config and seed still give the same numbers.

Kind ``counter`` (config ``streams = "counter"``, CPU only) fills each run's slab with the
counter-based ziggurat of :mod:`dynamics.randomness.counter_stream` instead: number m of run r is a
function of (seed, r, m) alone (so again independent of R and of the chunking), the law is the
same, the draws are not, and a number costs ~3 ns against ~18 ns for torch's float64
``normal_``.

Resuming (``loradyn run --resume``, :mod:`dynamics.runtime.resume`): with ``capture`` set, the
source keeps the state of its streams (every generator's ``get_state``, or the counter
streams' position) as it was before the draw of each chunk it starts; :meth:`NoiseSource.
snapshot` hands it out for the chunk the caller goes on with, :meth:`NoiseSource.load_state`
puts it back in a new source, whose chunks are then the very numbers the first would have
drawn (same chunk length, same schedule from there).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dynamics.lazy import lazy_import
from dynamics.randomness.chunking import chunk_steps as default_chunk_steps
from dynamics.randomness.chunking import row_width

torch = lazy_import("torch")  # loaded at its first use

__all__ = [
    "STREAMS",
    "run_seed",
    "counter_keys",
    "resolve_device",
    "resolve_dtype",
    "uniform_perp_directions",
    "NoiseStreams",
    "NoiseSource",
]

STREAMS = {"init": 0, "data": 1, "eval": 2, "refit": 3, "data_shared": 4, "theory": 5,
           "base": 6}  # base: the pretrained-glm mixed base's ζ
DTYPES = ("float64", "float32")


def run_seed(seed: int, run: int, stream: str) -> int:
    """A 63-bit seed for (master seed, run index, stream name), stable across versions."""
    words = np.random.SeedSequence([int(seed), int(run), STREAMS[stream]]).generate_state(2)
    return int(words[0]) << 31 ^ int(words[1])


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` (error if unavailable) or ``auto`` (cuda when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available "
                         "(use --device cpu or auto)")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    """``float64`` or ``float32``."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def counter_keys(seed: int, runs: int) -> np.ndarray:
    """(R,) uint64 keys of the counter streams (``streams = "counter"``): run r's from
    (seed, r) alone (the seed of its ``data`` stream)."""
    return np.array([run_seed(seed, r, "data") for r in range(runs)], dtype=np.uint64)


def uniform_perp_directions(seed: int, runs: int, d: int, k: int) -> np.ndarray:
    """(R, d) float64 unit vectors uniform on the sphere of span(W)^⊥ (coordinates ≥ k).

    Run r uses only the stream (seed, r, ``init``) — eq. (4)'s u₀ ~ S(Π⊥ span W).
    """
    out = np.zeros((runs, d))
    for r in range(runs):
        g = np.random.default_rng(run_seed(seed, r, "init")).standard_normal(d - k)
        out[r, k:] = g / np.linalg.norm(g)
    return out


@dataclass(frozen=True)
class NoiseStreams:
    """Which streams a :class:`NoiseSource` draws from: the master ``seed`` and the ``kind``
    (config ``streams``): ``per_run`` (one generator per run), ``shared`` (one for all
    runs), ``counter`` (counter-based, CPU only) or ``auto`` (per run on CPU, shared on
    CUDA)."""

    seed: int
    kind: str = "auto"

    def __post_init__(self):
        if self.kind not in ("auto", "per_run", "shared", "counter"):
            raise ValueError(f"stream kind must be auto, per_run, shared or counter, got "
                             f"{self.kind!r}")


class NoiseSource:
    """Chunks of examples for R runs, one ``torch.Generator`` per run, or one for all runs
    (by ``streams.kind``; default: per run on CPU, shared on CUDA) — see the module doc.

    :meth:`chunks` yields, per requested chunk of n steps, a view (R, n, b, w) of fresh
    N(0, 1) numbers — columns 0..d−1 of an example are x, column d (``extra`` = 1) is the
    standard normal of the label noise — and, if ``sqnorm_cols`` = (lo, hi) is given, the
    squared norms (R, n, b) of columns lo..hi−1. While the caller works on one chunk the
    next is drawn by background threads into a second buffer (double buffering).
    """

    def __init__(self, streams: NoiseStreams, runs: int, batch: int, d: int, *,
                 extra: int = 0, sqnorm_cols: tuple[int, int] | None = None,
                 device: torch.device, dtype: torch.dtype, chunk_steps: int | None = None,
                 threads: int | None = None):
        seed, kind = streams.seed, streams.kind
        counter = kind == "counter"
        if counter and device.type != "cpu":
            raise ValueError("streams 'counter' are CPU only (use per_run or shared)")
        self.width, self.batch = row_width(d, extra), batch
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.chunk_steps = int(chunk_steps or default_chunk_steps(runs, batch, self.width,
                                                                  itemsize))
        shape = (runs, self.chunk_steps, batch)
        self.buffers = [torch.empty((*shape, self.width), dtype=dtype, device=device)
                        for _ in range(2)]
        self.sqnorms = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
        self.sqnorm_cols = sqnorm_cols
        self.per_run = device.type == "cpu" if kind == "auto" else kind != "shared"
        self.counter, self._drawn = counter, 0  # numbers drawn per run so far
        self.capture = False  # keep the streams' state before each chunk drawn (resuming)
        self._started, self._snapshot = 0, None  # chunks started; (index, state) kept
        if self.counter:  # counter-based ziggurat (``dynamics.randomness.counter_stream``)
            self.per_run, self.generators = True, []
            self.keys = counter_keys(seed, runs)
            threads = threads or torch.get_num_threads()
        elif self.per_run:
            self.generators = [
                torch.Generator(device=device).manual_seed(run_seed(seed, r, "data"))
                for r in range(runs)]
            threads = threads or (torch.get_num_threads() if device.type == "cpu" else 1)
        else:
            self.generators = [torch.Generator(device=device).manual_seed(
                run_seed(seed, 0, "data_shared"))]
            threads = 1
        blocks = np.array_split(np.arange(runs), min(threads, runs))
        self._blocks = [range(int(b[0]), int(b[-1]) + 1) for b in blocks if len(b)]
        self._pool = (ThreadPoolExecutor(len(self._blocks), initializer=torch.set_num_threads,
                                         initargs=(1,))
                      if device.type == "cpu" and self.per_run else None)

    def _fill(self, slot: int, steps: int, runs: range, start: int = 0) -> None:
        buf = self.buffers[slot]
        if self.counter:  # run r's numbers start … start + steps·b·w − 1
            from dynamics.randomness.counter_stream import fill_normals

            fill_normals(buf.view(buf.shape[0], -1).numpy(), steps * self.batch * self.width,
                         self.keys, start, runs)
        elif self.per_run:
            for r in runs:
                buf[r, :steps].normal_(generator=self.generators[r])
        else:  # every run at once (runs is the single block 0..R−1)
            buf[:, :steps].normal_(generator=self.generators[0])
        if self.sqnorm_cols is not None:
            lo, hi = self.sqnorm_cols
            block = buf[runs.start: runs.stop, :steps, :, lo:hi]
            self.sqnorms[slot][runs.start: runs.stop, :steps] = (
                torch.linalg.vector_norm(block, dim=-1).square_())

    def _start(self, slot: int, steps: int):
        if not 0 < steps <= self.chunk_steps:
            raise ValueError(f"chunk of {steps} steps; must be in 1..{self.chunk_steps}")
        if self.capture:  # every earlier fill has ended (chunks waits for them first)
            self._snapshot = (self._started, self.state())
        self._started += 1
        start, self._drawn = self._drawn, self._drawn + steps * self.batch * self.width
        if self._pool is None:
            for block in self._blocks:
                self._fill(slot, steps, block, start)
            return []
        return [self._pool.submit(self._fill, slot, steps, block, start)
                for block in self._blocks]

    def _view(self, slot: int, steps: int):
        sq = self.sqnorms[slot][:, :steps] if self.sqnorm_cols is not None else None
        return self.buffers[slot][:, :steps], sq

    def chunks(self, sizes):
        """Yield (examples (R, n, b, w), squared norms (R, n, b) or None) for each n in sizes.

        ``sizes`` may be any iterable, read lazily one ahead (a generator of 10¹⁰ chunk sizes
        is fine). A yielded view stays valid until the next one is requested.
        """
        sizes = iter(sizes)
        n = next(sizes, None)
        if n is None:
            return
        n, slot = int(n), 0
        pending = self._start(0, n)
        try:
            while True:
                for fut in pending:
                    fut.result()
                nxt = next(sizes, None)
                pending = self._start(1 - slot, int(nxt)) if nxt is not None else []
                yield self._view(slot, n)
                if nxt is None:
                    return
                n, slot = int(nxt), 1 - slot
        finally:
            for fut in pending:
                fut.result()

    def chunk(self, steps: int):
        """Draw one chunk synchronously: (examples (R, n, b, w), squared norms or None)."""
        for fut in self._start(0, steps):
            fut.result()
        return self._view(0, steps)

    def state(self) -> dict:
        """The streams' state now: {"drawn": numbers drawn per run, "generators": list of
        the generators' ``get_state`` (uint8 numpy arrays; none for counter streams)}."""
        return {"drawn": int(self._drawn),
                "generators": [g.get_state().numpy().copy() for g in self.generators]}

    def snapshot(self, index: int) -> dict | None:
        """The streams' state from just before chunk ``index`` (0-based, in the order the
        chunks were started) was drawn, if :attr:`capture` kept it; else None."""
        if self._snapshot is not None and self._snapshot[0] == index:
            return self._snapshot[1]
        return None

    def load_state(self, state: dict) -> None:
        """Continue the streams from :meth:`state` or :meth:`snapshot` (before any chunk of
        this source is drawn): its next chunk is the one that state was taken before."""
        gens = state.get("generators", [])
        if len(gens) != len(self.generators):
            raise ValueError(f"stream state of {len(gens)} generator(s), this source has "
                             f"{len(self.generators)}")
        for g, st in zip(self.generators, gens, strict=True):
            g.set_state(torch.as_tensor(np.asarray(st, dtype=np.uint8)))
        self._drawn = int(state.get("drawn", 0))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> NoiseSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
