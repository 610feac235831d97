"""Heavy libraries imported on first use, so that ``--help`` and every error found before any
compute (a bad option, an unknown activation, k > d, a missing file) come back in well under a
second: a module of loradyn that needs torch names it with ``torch = lazy_import("torch")``
and the library is loaded at its first attribute access (``torch.zeros``), not at import.
(``importlib.util.LazyLoader``, the standard library's mechanism; annotations are strings
under ``from __future__ import annotations``, so ``x: torch.Tensor`` loads nothing.)"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

__all__ = ["lazy_import", "is_loaded"]


def lazy_import(name: str) -> ModuleType:
    """The module ``name``: the one already imported, else a lazy module in ``sys.modules``
    that executes on its first attribute access (ImportError now if it is not installed)."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"No module named {name!r}")
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


def is_loaded(name: str) -> bool:
    """Whether ``name`` has really been executed (not merely registered lazily)."""
    module = sys.modules.get(name)
    return module is not None and not isinstance(module, importlib.util._LazyModule)
