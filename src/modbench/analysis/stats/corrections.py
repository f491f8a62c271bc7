"""Corrections for multiple comparisons (seed study §4; docs/statistics.md, "Multiple
comparisons"): Bonferroni, Holm's step-down and Benjamini–Hochberg's step-up.

Bonferroni and BH are ``statsmodels.stats.multitest.multipletests``. **Holm** is the four-line
step-down below, not ``multipletests(method="holm")``: statsmodels' Holm branch calls
``gc.collect()`` on every call, which costs ~130 ms in a process holding torch (measured), and
``compare`` computes it for every table. The tests check it against statsmodels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

Correction: TypeAlias = Literal["bonferroni", "holm", "bh", "none"]

#: The corrections computed by :func:`~modbench.analysis.stats.compare` (``"none"`` is the raw
#: p-value).
CORRECTIONS: tuple[str, ...] = ("bonferroni", "holm", "bh")


@dataclass(frozen=True)
class Adjusted:
    """Adjusted p-values and reject flags (NaN p in → NaN adjusted p, reject False)."""

    method: str
    alpha: float
    p_adjusted: npt.NDArray[np.float64]
    reject: npt.NDArray[np.bool_]
    n_tests: int


def holm(q: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Holm's step-down adjusted p-values of the finite p-values ``q`` (not statsmodels': see
    the module docstring)."""
    order = np.argsort(q, kind="mergesort")
    steps = (q.size - np.arange(q.size)) * q[order]
    adj = np.empty(q.size)
    adj[order] = np.minimum(1.0, np.maximum.accumulate(steps))
    return adj


def adjust_pvalues(
    pvalues: npt.ArrayLike, method: Correction = "bonferroni", alpha: float = 0.05
) -> Adjusted:
    """Bonferroni, Holm (step-down) or Benjamini–Hochberg (step-up FDR) adjusted p-values.

    Bonferroni and BH are ``statsmodels.stats.multitest.multipletests`` (``bonferroni``,
    ``fdr_bh``); Holm is our own step-down (same values, without statsmodels' per-call
    ``gc.collect()``). The family is the finite p-values (m = their count); NaN entries stay NaN
    and are never rejected. ``reject = p_adjusted <= alpha``. ``"none"`` returns the raw
    p-values.
    """
    if method not in (*CORRECTIONS, "none"):
        raise ValueError(f"unknown correction {method!r}")
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    out = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    q = p[ok]
    m = int(q.size)
    if m:
        if method == "none":
            adj = q.copy()
        elif method == "holm":
            adj = holm(q)
        else:
            # imported here: statsmodels takes ~0.4 s to import, and only this needs it
            from statsmodels.stats.multitest import multipletests

            sm = {"bonferroni": "bonferroni", "bh": "fdr_bh"}[method]
            adj = np.asarray(multipletests(q, alpha=alpha, method=sm)[1], dtype=np.float64)
        out[ok] = adj
    reject = np.zeros(p.shape, dtype=bool)
    reject[ok] = out[ok] <= alpha
    return Adjusted(method, alpha, out, reject, m)
