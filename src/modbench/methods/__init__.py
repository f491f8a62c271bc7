"""The modifications, one file each, registered by name (see :mod:`modbench.methods.base`).

Every module in this package is imported by :func:`load_all`, so adding a method is adding
one file.
"""

from modbench.methods.base import (
    REGISTRY,
    Method,
    canonical,
    collect_recipe_exceptions,
    load_all,
    parse_methods,
    register,
)

__all__ = [
    "REGISTRY",
    "Method",
    "canonical",
    "collect_recipe_exceptions",
    "load_all",
    "parse_methods",
    "register",
]
