"""Guard against stale numba caches of the package's compiled modules.

Numba keys an on-disk cache entry on the file that defines the function only, so after an
edit of a compiled helper in another file (the RNG, σ in hermite/activations_numba.py, the
chain) its callers would load stale machine code. Before anything is compiled or loaded, a
compiled module drops its cache entries whenever the combined hash of the sources it depends
on changed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import hermite.activations_numba

__all__ = ["drop_stale_cache", "SIGMA_SOURCE"]

SIGMA_SOURCE = Path(hermite.activations_numba.__file__)


def drop_stale_cache(cache: Path, sources: Iterable[Path], prefix: str = "") -> None:
    """Delete ``cache/<prefix>*.nbi|*.nbc`` if the combined hash of ``sources`` changed since
    the last call (stamp ``cache/<prefix or 'numba_sources'>.sha256``); a read-only install is
    left alone (numba then recompiles in memory)."""
    digest = hashlib.sha256(b"".join(Path(f).read_bytes() for f in sorted(sources))).hexdigest()
    stamp = cache / f"{prefix.rstrip('.') or 'numba_sources'}.sha256"
    try:
        if stamp.read_text() == digest:
            return
    except OSError:
        pass
    try:
        for f in list(cache.glob(f"{prefix}*.nbi")) + list(cache.glob(f"{prefix}*.nbc")):
            f.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        pass
