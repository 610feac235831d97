"""Guard against stale numba caches across the package's compiled modules.

Numba keys an on-disk cache entry on the file that defines the function only, so after an
edit of a compiled helper in another file (the RNG, σ, the chain) its callers would load stale
machine code. Before anything is compiled or loaded, this drops the package's cache whenever
the combined hash of its compiled sources changed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["drop_stale_cache"]



def drop_stale_cache() -> None:
    """Delete ``__pycache__/*.nbi|*.nbc`` of this package if the sources changed."""
    here = Path(__file__).parent
    sources = sorted(here.glob("*.py"))  # every module of the package, compiled or not
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()
    cache = here / "__pycache__"
    stamp = cache / "numba_sources.sha256"
    try:
        if stamp.read_text() == digest:
            return
    except OSError:
        pass
    try:
        for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            f.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:  # read-only install: numba then recompiles in memory
        pass
