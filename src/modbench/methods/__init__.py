"""The modifications, one file each, registered by name (see :mod:`modbench.methods.base`).

Every module in this package is imported by :func:`load_all`, so adding a method is adding
one file. The names below are imported on first use (PEP 562): :mod:`modbench.methods.catalog`
(what ``modbench methods`` lists) is read without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modbench.methods.base import (
        REGISTRY,
        Method,
        MethodSpec,
        canonical,
        collect_recipe_exceptions,
        load_all,
        method_spec,
        parse_methods,
        register,
    )

__all__ = [
    "REGISTRY",
    "Method",
    "MethodSpec",
    "canonical",
    "collect_recipe_exceptions",
    "load_all",
    "method_spec",
    "parse_methods",
    "register",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("modbench.methods.base"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
