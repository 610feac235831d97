"""Heavy libraries imported on first use, so that ``--help`` and every error found before any
compute (a bad option, an unknown activation, k > d, a missing file) come back in well under a
second: a module of loradyn that needs torch names it with ``torch = lazy_import("torch")``
and the library is imported at its first attribute access (``torch.zeros``), not at import.

How: ``lazy_import`` returns a small stand-in object, not a module. Nothing is put in
``sys.modules`` until the first attribute access, which runs the ordinary, complete
``importlib.import_module`` (the import system's own locking, so a library that imports itself
recursively, as torch does, only ever sees finished modules) and then rebinds every global
name that held the stand-in to the real module, so later accesses cost nothing extra.

(This replaces ``importlib.util.LazyLoader``, whose half-executed module lived in
``sys.modules``: since CPython 3.12.3 its locking makes torch's own import reach it and fail
with ``RecursionError`` or ``module 'torch' has no attribute 'Tensor'``; CPython gh-117178.)
Annotations are strings under ``from __future__ import annotations``, so ``x: torch.Tensor``
loads nothing."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType

__all__ = ["lazy_import", "is_loaded"]


class _Deferred:
    """Stands for module ``name`` until its first attribute access (then imports it)."""

    __slots__ = ("_name", "_module", "_namespaces", "_lock")

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None
        self._namespaces: list[dict] = []
        self._lock = threading.Lock()

    def _load(self) -> ModuleType:
        with self._lock:
            if self._module is None:
                module = importlib.import_module(self._name)
                for namespace in self._namespaces:  # rebind `torch = lazy_import(...)` globals
                    for key, value in list(namespace.items()):
                        if value is self:
                            namespace[key] = module
                self._namespaces.clear()
                self._module = module
            return self._module

    def __getattr__(self, attr: str):
        return getattr(self._load(), attr)

    def __dir__(self):
        return dir(self._load())

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not yet imported"
        return f"<deferred module {self._name!r} ({state})>"


_deferred: dict[str, _Deferred] = {}
_registry_lock = threading.Lock()


def lazy_import(name: str) -> ModuleType:
    """The module ``name``: the one already imported, else a stand-in that imports it on its
    first attribute access and then rebinds the caller's global to the real module
    (ImportError now if ``name`` is not installed)."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    with _registry_lock:
        deferred = _deferred.get(name)
        if deferred is None or deferred._module is not None:
            if deferred is not None:  # loaded meanwhile, and sys.modules had it removed
                return deferred._module
            if importlib.util.find_spec(name) is None:
                raise ImportError(f"No module named {name!r}")
            deferred = _deferred[name] = _Deferred(name)
        caller = sys._getframe(1).f_globals
        if not any(namespace is caller for namespace in deferred._namespaces):
            deferred._namespaces.append(caller)
    return deferred  # type: ignore[return-value]


def is_loaded(name: str) -> bool:
    """Whether ``name`` has really been imported (not merely named with ``lazy_import``)."""
    return name in sys.modules
