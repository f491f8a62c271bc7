"""The normal and Student-t distributions with this package's NaN and edge conventions
(``scipy.stats.norm`` and ``scipy.stats.t``; docs/statistics.md)."""

from __future__ import annotations

import math
from typing import Literal, TypeAlias

from scipy import stats as _sps

from modbench.analysis.stats.scores import NAN

Alternative: TypeAlias = Literal["two-sided", "greater", "less"]


def normal_sf(z: float) -> float:
    """``1 - Phi(z)``, accurate in the upper tail (``scipy.stats.norm.sf``)."""
    if math.isnan(z):
        return NAN
    return float(_sps.norm.sf(z))


def normal_isf(p: float) -> float:
    """``z`` with ``normal_sf(z) == p``; ``+inf`` for p = 0, ``-inf`` for p = 1, NaN outside."""
    if math.isnan(p) or p < 0.0 or p > 1.0:
        return NAN
    return float(_sps.norm.isf(p))


def p_two_sided(z: float) -> float:
    """Two-sided normal p-value ``2 * (1 - Phi(|z|))`` (1 at z = 0, 0 at z = ±inf)."""
    if math.isnan(z):
        return NAN
    return min(1.0, 2.0 * normal_sf(abs(z)))


def t_sf(t: float, df: float) -> float:
    """Survival function ``P(T > t)`` of Student's t with (possibly fractional) ``df``
    (``scipy.stats.t.sf``); the normal one for ``df = inf``, NaN for ``df <= 0`` or NaN."""
    if math.isnan(t) or math.isnan(df) or df <= 0:
        return NAN
    if math.isinf(df):
        return normal_sf(t)
    return float(_sps.t.sf(t, df))


def t_isf(p: float, df: float) -> float:
    """``t`` with ``t_sf(t, df) == p`` (the normal quantile for ``df = inf``)."""
    if math.isnan(p) or math.isnan(df) or df <= 0:
        return NAN
    return normal_isf(p) if math.isinf(df) else float(_sps.t.isf(p, df))


def t_p(t: float, df: float, alternative: Alternative) -> float:
    """The p-value of ``t`` with ``df`` degrees of freedom against ``alternative``."""
    if alternative == "greater":
        return t_sf(t, df)
    if alternative == "less":
        return t_sf(-t, df)
    if alternative == "two-sided":
        return NAN if math.isnan(t) else min(1.0, 2.0 * t_sf(abs(t), df))
    raise ValueError(f"alternative must be two-sided, greater or less, not {alternative!r}")
