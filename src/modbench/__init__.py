"""modbench: does this Transformer modification really help, once everything else is fixed?

``modbench.load_study(DIR)`` and ``modbench.load_run(DIR)`` read a study or a run folder into
pandas DataFrames (:mod:`modbench.api`); they are imported on first use, so ``import
modbench`` imports neither torch nor pandas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modbench.errors import ModbenchError

if TYPE_CHECKING:
    from modbench.api import Run, Study, load_run, load_study

__version__ = "0.1.0"

__all__ = ["ModbenchError", "Run", "Study", "__version__", "load_run", "load_study"]

_API = ("Run", "Study", "load_run", "load_study")  # modbench.api's, imported on first use


def __getattr__(name: str) -> Any:
    if name in _API:
        from modbench import api

        return getattr(api, name)
    raise AttributeError(f"module 'modbench' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
