"""The conformance kit: what makes a method correct, checked the same way for the catalogue's
methods and for methods written outside the package (plugins), and scaffolding for new ones.

- :func:`check_method` runs the checks of :data:`CHECKS` on one method string and returns a
  :class:`CheckResult` per check (``modbench methods check``); :func:`format_table` prints
  them as one table naming the first failed check.
- :func:`write_method` writes a commented template method for one slot and a test that runs
  the kit on it (``modbench methods new``).

``modbench.conformance.kit`` imports torch; this package's ``__init__`` does not, so the CLI
can import :mod:`modbench.conformance.cli` without it. The names below are imported on first
use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modbench.conformance.kit import (
        CHECKS,
        SLOW_CHECKS,
        CheckFailed,
        CheckResult,
        check_method,
        first_failure,
        format_table,
    )
    from modbench.conformance.scaffold import SCAFFOLD_SLOTS, write_method

_WHERE = {
    "CHECKS": "kit", "SLOW_CHECKS": "kit", "CheckFailed": "kit", "CheckResult": "kit",
    "check_method": "kit", "first_failure": "kit", "format_table": "kit",
    "SCAFFOLD_SLOTS": "scaffold", "write_method": "scaffold",
}
__all__ = ["CHECKS", "SCAFFOLD_SLOTS", "SLOW_CHECKS", "CheckFailed", "CheckResult", "check_method",
           "first_failure", "format_table", "write_method"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
