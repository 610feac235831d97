"""Which engine runs a config: ``full`` or ``reduced`` (``auto``: the reduced engine where its
learner's exact chain covers the config). One rule for the resolver (:mod:`dynamics.resolve`),
the engine and the memory estimate (:mod:`dynamics.budget`, which the resolver imports)."""

from __future__ import annotations

__all__ = ["choose_engine"]


def choose_engine(config) -> str:
    """``full`` or ``reduced`` for ``config`` (``auto``: reduced when its learner's exact
    chain covers it; full where the reduced engine cannot be imported)."""
    if config.engine != "auto":
        return config.engine
    try:
        from .reduced import reduced_supported
    except ImportError:
        return "full"
    ok, _why = reduced_supported(config)
    return "reduced" if ok else "full"
