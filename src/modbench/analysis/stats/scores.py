"""Per-seed scores as the statistics read them (docs/statistics.md, "Inputs and orientation").

A configuration's scores are a list (seeds unlabelled), a ``{seed: score}`` mapping (seeds
labelled, so two configurations can be paired seed by seed) or ``None`` (the configuration
failed). ``None``, NaN or ±inf in place of a score is a failed seed: diverged, or stalled where
:func:`~modbench.analysis.stats.compare`'s ``stalled`` says so. :func:`group` normalises them
once; every other module of this package reads a :class:`Group`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

Score: TypeAlias = float | None
#: One configuration's per-seed scores: a list (seeds unlabeled), a ``{seed: score}`` mapping
#: (seeds labeled: allows pairing), or ``None`` when the configuration failed. ``None`` / NaN
#: / ±inf entries are failed seeds: diverged, or stalled where ``compare``'s ``stalled`` says so.
Scores: TypeAlias = Sequence[Score] | Mapping[Any, Score] | npt.ArrayLike | None

NAN = float("nan")


@dataclass(frozen=True)
class Group:
    """Normalised scores: finite values, diverged count, seed labels (None if unlabeled)."""

    values: npt.NDArray[np.float64]  # all entries, NaN for diverged seeds
    labels: tuple[Any, ...] | None
    whole_none: bool = False

    @property
    def finite(self) -> npt.NDArray[np.float64]:
        return self.values[np.isfinite(self.values)]

    @property
    def n(self) -> int:
        return int(np.isfinite(self.values).sum())

    @property
    def n_diverged(self) -> int:
        return 1 if self.whole_none else int((~np.isfinite(self.values)).sum())


def to_float(x: Any) -> float:
    """A score as a float, NaN for a failed seed (None, NaN, ±inf)."""
    if x is None:
        return NAN
    v = float(x)
    return v if math.isfinite(v) else NAN


def group(scores: Scores) -> Group:
    """``scores`` normalised (see the module docstring)."""
    if scores is None:
        return Group(np.empty(0), None, whole_none=True)
    if isinstance(scores, Mapping):
        labels = tuple(scores.keys())
        vals = np.array([to_float(scores[k]) for k in labels], dtype=np.float64)
        return Group(vals, labels)
    arr = np.asarray(scores, dtype=object).ravel()
    vals = np.array([to_float(x) for x in arr], dtype=np.float64)
    return Group(vals, None)


def finite(x: Scores) -> npt.NDArray[np.float64]:
    """The finite seeds of ``x``."""
    return group(x).finite
