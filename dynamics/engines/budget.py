"""What a run will cost in memory, checked before anything is allocated (issue 16).

:func:`estimate` adds up, from the config alone (no instance per run is built, nothing is
allocated, a few microseconds even for 10⁹ runs), the memory a batch of R runs holds at its
peak:

* ``state``: the learner's state (û (R, d); Û (R, d, r); k′ rows of d for the networks; the
  (d−k)² statistic of ``moment --moment-order 2``; ...), twice (the engine keeps a snapshot of
  every chunk to restore diverged runs), plus the float64 initial arrays it is built from, and
  the per-run instance tables (``Problem``: about 8k + 4 numbers per run, host and device);
* ``examples``: the double-buffered chunk of examples of :class:`~dynamics.randomness.sampling.
  NoiseSource` (2 × R × S × b × w numbers, S the chunk length it picks) and what the learner
  prepares from it (≈ (2k + 2) numbers per example);
* ``generators``: one torch CPU generator per run (per-run streams, ≈ 2.7 kB each, measured);
* ``checkpoints``: the records at every checkpoint and the trajectory's (R, C) float64 arrays
  (overlap, loss, ODE, corrected ODE, band, their masked copies and the theory's temporaries:
  about 16 arrays, plus each learner's extra records, twice: lists and their stack);
* ``instances``: with ``instance_seeds = per_run``, one resolved instance per run;
* ``given_rows``: the array of an ``init_rows`` file (its k′ also sets the network's width).

The reduced engine has no examples and a state of a few numbers per run. On CUDA the state,
examples and instance tables are device memory (checked against ``torch.cuda.mem_get_info``),
the rest host memory.

Measured on this engine (ReLU, d = 2000, k = 5, float64, CPU, `loradyn run`): the peak
resident memory grew by 220 MB from R = 1000 to 4000 (estimate: 220 MB) and by 1.80 GiB from
R = 16 to 20000 (estimate: 1.85 GiB).

:func:`available_memory` reads ``/proc/meminfo`` (MemAvailable) bounded by the cgroup limit
(v2 ``memory.max − memory.current``, v1 ``limit_in_bytes − usage_in_bytes``), falling back to
``os.sysconf`` (free pages); the environment variable ``LORADYN_MEMORY`` (bytes, or with a
K/M/G/T suffix) overrides it. :func:`check_memory` refuses a request whose estimate exceeds
``FRACTION`` of that, with one line saying what it needs, what is available and how many runs
fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dynamics.randomness.chunking import chunk_steps, row_width

__all__ = ["Estimate", "MemoryBudgetError", "estimate", "available_memory", "max_runs",
           "check_memory", "format_bytes", "FRACTION", "GENERATOR_BYTES"]

FRACTION = 0.9  # of the available memory a request may use
GENERATOR_BYTES = 2700  # one torch CPU generator (mt19937 state), measured
TRAJECTORY_ARRAYS = 16  # (R, C) float64 arrays alive while the trajectory is assembled
INSTANCE_BYTES = 4096  # Python overhead of one resolved instance
DEVICE_PARTS = ("state", "examples")


class MemoryBudgetError(ValueError):
    """A request that cannot fit in memory (one line: what it needs and what fits)."""


@dataclass
class Estimate:
    """Bytes per part (``parts``), on host and device; ``runs`` the R it was computed for."""

    runs: int
    parts: dict = field(default_factory=dict)
    device: str = "cpu"

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))

    @property
    def device_total(self) -> int:
        """Bytes on the accelerator (0 on CPU)."""
        if self.device != "cuda":
            return 0
        return int(sum(v for k, v in self.parts.items() if k in DEVICE_PARTS))

    @property
    def host_total(self) -> int:
        return self.total - self.device_total


def format_bytes(n: float) -> str:
    """'143 GiB', '4.5 GiB', '812 MiB' (three significant figures at most)."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


def _dims(config) -> tuple[int, int]:
    inst = config.instance
    d = int(inst.get("d") or 0)
    k = inst.get("k")
    if k is None:
        for key in ("W", "gram", "lam", "c"):
            value = inst.get(key)
            if isinstance(value, (list, tuple)):
                k = len(value)
                break
    return d, int(k or 1)


def _learner(config):
    """The config's learner class (the base ``Learner``'s defaults for an unknown one or a
    config whose options are not its learner's: validation names those)."""
    from dynamics.learners import get_learner
    from dynamics.learners.base import Learner

    try:
        learner = get_learner(config.learner)
    except (ValueError, ImportError):
        return Learner
    return learner if type(config.options) is learner.Options else Learner


def _memory(learner, config, d: int, k: int):
    """The learner's declared memory (the defaults where its options cannot say yet: an
    unreadable ``init_rows`` file, which validation names)."""
    from dynamics.errors import ConfigError
    from dynamics.learners.base import Learner

    try:
        return learner.memory(config, d, k)
    except ConfigError:
        return Learner.memory(config, d, k)


def _given_rows(learner, config):
    """The array of the rows file the runs start from (None: none, or unreadable)."""
    from dynamics.errors import ConfigError

    try:
        return learner.given_rows(config)
    except ConfigError:
        return None


def _checkpoints(config) -> int:
    from dynamics.runtime.trajectory import checkpoint_steps

    steps, count = int(config.steps), int(config.checkpoints)
    if count > 100_000:  # do not build a huge grid just to count it
        return min(count, steps) + 1
    try:
        return int(checkpoint_steps(steps, count, config.spacing).size)
    except (ValueError, MemoryError, OverflowError):
        return count + 2


def _engine(config) -> str:
    if config.engine != "auto":
        return config.engine
    from dynamics.engines.choice import choose_engine

    try:
        return choose_engine(config)
    except Exception:  # noqa: BLE001 - an estimate must not fail on an unsupported config
        return "full"


def _device(config) -> str:
    if config.device == "auto":
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            return "cpu"
    return config.device


def estimate(config, runs: int | None = None, *, engine: str | None = None,
             checkpoints: int | None = None) -> Estimate:
    """The memory of ``config`` (with ``runs`` runs if given); see the module docstring."""
    runs = int(config.runs if runs is None else runs)
    d, k = _dims(config)
    item = 4 if config.dtype == "float32" else 8
    batch = int(config.batch)
    engine = engine or _engine(config)
    device = _device(config)
    cps = checkpoints if checkpoints is not None else _checkpoints(config)
    learner = _learner(config)
    mem = _memory(learner, config, d, k)
    state_n, rec_n = mem.state, mem.records
    parts = {}
    if engine == "reduced":
        parts["state"] = runs * (k + 8) * 8 * 2
        parts["checkpoints"] = runs * cps * 8 * (TRAJECTORY_ARRAYS + 2 * (rec_n + 3 + k))
    else:
        problem = runs * (8 * k + 4) * (8 + item)
        parts["state"] = runs * state_n * (2 * item + 8) + problem
        width = row_width(d, int((config.label_noise or 0) > 0))
        examples = runs * chunk_steps(runs, batch, width, item) * batch
        parts["examples"] = (examples * (2 * width + 2 + mem.prepared) * item
                             + runs * batch * d * item)
        streams = config.streams
        if streams == "per_run" or (streams == "auto" and device == "cpu"):
            parts["generators"] = runs * GENERATOR_BYTES
        parts["checkpoints"] = runs * cps * 8 * (TRAJECTORY_ARRAYS + 2 * rec_n)
    given = _given_rows(learner, config)
    if given is not None:  # the file's array, held while the runs start
        parts["given_rows"] = given.array.nbytes
    if config.instance_seeds == "per_run":
        parts["instances"] = runs * (INSTANCE_BYTES + (3 * k * k + 10 * k) * 8)
    else:
        parts["instances"] = runs * 16
    return Estimate(runs, parts, device)


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, size in (("K", 2**10), ("M", 2**20), ("G", 2**30), ("T", 2**40)):
        if text.endswith(suffix):
            text, scale = text[:-1], size
            break
    return int(float(text) * scale)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_room() -> int | None:
    """Bytes the cgroup still allows (None when unlimited or unknown)."""
    limit = _read_int("/sys/fs/cgroup/memory.max")
    if limit is not None:
        used = _read_int("/sys/fs/cgroup/memory.current") or 0
        return max(0, limit - used)
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit is not None and limit < 2**60:
        used = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
        return max(0, limit - used)
    return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device: str = "cpu") -> int | None:
    """Bytes available to a new allocation on ``device`` (``cpu`` or ``cuda``), or None if
    unknown. ``LORADYN_MEMORY`` overrides the host figure (and the device's, when set)."""
    override = os.environ.get("LORADYN_MEMORY")
    if override:
        try:
            return _parse_size(override)
        except ValueError:
            raise ValueError(f"LORADYN_MEMORY={override!r}: expected bytes, e.g. 8G") from None
    if device == "cuda":
        try:
            import torch

            free, _total = torch.cuda.mem_get_info()
            return int(free)
        except Exception:  # noqa: BLE001 - no usable CUDA: unknown
            return None
    found = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return min(found)


def _fits(est: Estimate, host: int | None, dev: int | None) -> bool:
    if host is not None and est.host_total > FRACTION * host:
        return False
    return not (dev is not None and est.device_total > FRACTION * dev)


def max_runs(config, host: int | None = None, dev: int | None = None, **kw) -> int:
    """The largest R whose estimate fits (0 if not even one run does)."""
    lo, hi = 0, max(1, int(config.runs))
    while _fits(estimate(config, hi, **kw), host, dev) and hi < 2**62:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(estimate(config, mid, **kw), host, dev):
            lo = mid
        else:
            hi = mid
    return lo


def _round_down(n: int) -> int:
    """Two significant figures, rounded down (44321 → 44000)."""
    if n < 100:
        return n
    scale = 10 ** (len(str(n)) - 2)
    return n // scale * scale


def check_memory(config, names: dict | None = None, *, engine: str | None = None) -> Estimate:
    """The estimate of ``config``; :class:`MemoryBudgetError` if it does not fit.

    ``names`` maps config fields to how the caller calls them (``{"runs": "--runs"}``); the
    default names them as ``runs = R``. ``engine``: the engine already chosen (else as
    ``engine_choice.choose_engine``).
    """
    names = names or {}
    engine = engine or _engine(config)
    est = estimate(config, engine=engine)
    device = est.device
    host = available_memory("cpu")
    dev = available_memory("cuda") if device == "cuda" else None
    if _fits(est, host, dev):
        return est
    runs_name = names.get("runs")
    subject = f"{runs_name} {config.runs}" if runs_name else f"runs = {config.runs}"
    shown = {k: v for k, v in est.parts.items() if v >= 2**20 or k == "state"}
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in shown.items())
    if dev is not None and est.device_total > FRACTION * dev:
        need, have, where = est.device_total, dev, " on the GPU"
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in shown.items()
                          if k in DEVICE_PARTS)
    else:
        need, have, where = est.host_total, host, ""
    fit = max_runs(config, host, dev, engine=engine)
    if fit >= 1:
        advice = f"at most {_round_down(fit)} runs fit"
    else:
        advice = "not even one run fits (lower d"
        cp = names.get("checkpoints", "checkpoints")
        advice += f" or {cp})" if est.parts.get("checkpoints", 0) > need / 2 else ")"
    if fit >= 1 and est.parts.get("checkpoints", 0) > need / 2:
        advice += f" (or lower {names.get('checkpoints', 'checkpoints')})"
    raise MemoryBudgetError(f"{subject} needs {format_bytes(need)}{where} ({parts}), "
                            f"{format_bytes(have)} available; {advice}")
