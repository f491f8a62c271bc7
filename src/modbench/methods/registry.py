"""The method registry itself: the names registered so far, and the import of the built-in
method modules that fills it (every module of ``modbench.methods`` but the machinery listed in
:data:`NOT_METHODS`). :mod:`modbench.methods.base` (which registers) and
:mod:`modbench.methods.plugins` (which loads methods from outside) both build on it, so
neither imports the other's module back."""

from __future__ import annotations

from typing import Any

#: every registered method class, by name (built in, or from a plugin)
REGISTRY: dict[str, Any] = {}
#: modules of ``modbench.methods`` that define no method
NOT_METHODS = ("base", "build", "catalog", "options", "plugins", "registry")
_loaded = False


def load_builtins() -> dict[str, Any]:
    """Import every method module of ``modbench.methods`` (each registers its methods), once."""
    global _loaded
    if not _loaded:
        import importlib
        import pkgutil

        import modbench.methods as pkg

        for mod in pkgutil.iter_modules(pkg.__path__):
            if not mod.name.startswith("_") and mod.name not in NOT_METHODS:
                importlib.import_module(f"modbench.methods.{mod.name}")
        _loaded = True
    return REGISTRY
