"""Which engine runs a config: ``full`` or ``reduced`` (``auto``: the reduced engine where its
learner's exact chain covers the config). One rule for the resolver
(:mod:`dynamics.engines.resolve`),
the engine and the memory estimate (:mod:`dynamics.engines.budget`, which the resolver imports)."""

from __future__ import annotations

__all__ = ["choose_engine", "engine_reason"]


def choose_engine(config) -> str:
    """``full`` or ``reduced`` for ``config`` (``auto``: reduced when its learner's exact
    chain covers it; full where the reduced engine cannot be imported)."""
    return engine_reason(config)[0]


def engine_reason(config) -> tuple[str, str]:
    """(engine, why): the engine :func:`choose_engine` takes and, where ``auto`` had to take
    the full engine, the one-line reason the exact chain does not cover ``config`` ('' else)."""
    if config.engine != "auto":
        return config.engine, ""
    try:
        from dynamics.reduced import reduced_supported
    except ImportError as exc:
        return "full", f"the reduced engine cannot be imported ({exc})"
    ok, why = reduced_supported(config)
    return ("reduced", "") if ok else ("full", why)
