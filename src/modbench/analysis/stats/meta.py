"""Ranks and meta-analysis: per-task Welch + Stouffer (seed study Appendix E.4) and Spearman's
rho across scales (§5.2); docs/statistics.md, "Per-task Welch + Stouffer" and "Spearman across
scales". ``scipy.stats.combine_pvalues``, ``rankdata`` and ``spearmanr`` with this package's
edge cases."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import stats as _sps

from modbench.analysis.stats.distributions import Alternative, normal_sf, p_two_sided
from modbench.analysis.stats.scores import NAN, Score, Scores, to_float
from modbench.analysis.stats.tests import welch_t

# --------------------------------------------------------------------------------------------
# Per-task Welch + Stouffer (Appendix E.4)


@dataclass(frozen=True)
class StoufferResult:
    """Stouffer's combination ``Z = sum(w_i z_i) / sqrt(sum(w_i^2))``, ``z_i = Phi^-1(1 - p_i)``.

    ``p_one_sided = 1 - Phi(Z)`` (the direction the one-sided p's test), ``p_two_sided =
    2 * (1 - Phi(|Z|))``.
    """

    z: float
    p_one_sided: float
    p_two_sided: float
    n: int
    weighted: bool


def stouffer(pvalues: npt.ArrayLike, weights: npt.ArrayLike | None = None) -> StoufferResult:
    """Combine one-sided p-values with Stouffer's method (optionally weighted;
    ``scipy.stats.combine_pvalues(method="stouffer")``).

    NaN p-values (and their weights) are dropped. Weights must be finite and >= 0. No p-value
    (or all weights 0): NaN.
    """
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    w = np.ones_like(p) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if w.shape != p.shape:
        raise ValueError("weights and pvalues differ in length")
    if np.any(~np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and >= 0")
    ok = np.isfinite(p)
    p, w = p[ok], w[ok]
    if p.size == 0 or not np.any(w > 0):
        return StoufferResult(NAN, NAN, NAN, int(p.size), weights is not None)
    with np.errstate(invalid="ignore", divide="ignore"):  # p = 0 and p = 1 together: NaN
        r = _sps.combine_pvalues(p, method="stouffer", weights=w)
    zc = float(r.statistic)
    return StoufferResult(zc, normal_sf(zc), p_two_sided(zc), int(p.size), weights is not None)


@dataclass(frozen=True)
class TaskTest:
    """One task's Welch test, method vs baseline; ``p_one_sided`` tests 'method better'."""

    task: str
    n_method: int
    n_baseline: int
    delta: float
    t: float
    df: float
    p_two_sided: float
    p_one_sided: float


@dataclass(frozen=True)
class PerTaskResult:
    tasks: tuple[TaskTest, ...]
    stouffer: StoufferResult
    stouffer_weighted: StoufferResult | None


def per_task_stouffer(
    method: Mapping[str, Scores],
    baseline: Mapping[str, Scores],
    *,
    higher_is_better: bool = True,
    weights: Mapping[str, float] | None = None,
) -> PerTaskResult:
    """Welch's t per task, then Stouffer's combination of the one-sided per-task p-values.

    Tasks present in both mappings are used (in the method's order); a task whose Welch test is
    undefined (< 2 seeds on a side, zero variance on both) is listed with NaN and left out of
    the combination. The one-sided alternative is 'method better than baseline' (greater for
    ``higher_is_better``, less otherwise), so the combined ``z > 0`` means better. With
    ``weights`` (e.g. items per task) a weighted combination is reported as well; tasks with no
    weight get weight 0.
    """
    alt: Alternative = "greater" if higher_is_better else "less"
    rows: list[TaskTest] = []
    for task in method:
        if task not in baseline:
            continue
        two = welch_t(method[task], baseline[task])
        one = welch_t(method[task], baseline[task], alternative=alt)
        rows.append(
            TaskTest(task, two.n_a, two.n_b, two.mean_diff, two.t, two.df, two.p, one.p)
        )
    ps = [r.p_one_sided for r in rows]
    unweighted = stouffer(ps)
    weighted = None
    if weights is not None:
        weighted = stouffer(ps, [float(weights.get(r.task, 0.0)) for r in rows])
    return PerTaskResult(tuple(rows), unweighted, weighted)


# --------------------------------------------------------------------------------------------
# Spearman rank correlation


def rankdata(x: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """1-based ranks, ties given the average of the ranks they span (``scipy.stats.rankdata``;
    a NaN in the input makes every rank NaN, scipy's ``nan_policy="propagate"``)."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        return np.empty(0)
    return np.asarray(_sps.rankdata(a), dtype=np.float64)


@dataclass(frozen=True)
class SpearmanResult:
    """Spearman's rho with the t-approximation p-value (n - 2 df, two-sided)."""

    rho: float
    p: float
    n: int
    methods: tuple[str, ...] = ()


def spearman(x: npt.ArrayLike, y: npt.ArrayLike) -> SpearmanResult:
    """Spearman's rank correlation of paired values (average ranks for ties;
    ``scipy.stats.spearmanr``, t approximation with n - 2 df for p).

    Pairs with a non-finite value on either side are dropped. rho NaN when fewer than 2 pairs
    or when either side is constant; p NaN when n <= 2; p = 0 when |rho| = 1 (n > 2).
    """
    a = np.asarray(x, dtype=np.float64).ravel()
    b = np.asarray(y, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError("x and y differ in length")
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    n = int(a.size)
    if n < 2:
        return SpearmanResult(NAN, NAN, n)
    if np.ptp(a) == 0.0 or np.ptp(b) == 0.0:  # a constant side: no ranking to correlate
        return SpearmanResult(NAN, NAN, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = _sps.spearmanr(a, b)
    rho = max(-1.0, min(1.0, float(r.statistic)))
    if n <= 2:
        return SpearmanResult(rho, NAN, n)
    if abs(rho) == 1.0:
        return SpearmanResult(rho, 0.0, n)
    return SpearmanResult(rho, float(r.pvalue), n)


def spearman_across_scales(
    scale_a: Mapping[str, Score], scale_b: Mapping[str, Score]
) -> SpearmanResult:
    """Spearman's rho between methods' scores at two scales (e.g. 1.2B vs 3B).

    Uses the methods with a finite score at both scales (diverged at either scale: left out),
    in ``scale_a``'s order; ``methods`` lists them.
    """
    names = [
        m
        for m in scale_a
        if m in scale_b
        and math.isfinite(to_float(scale_a[m]))
        and math.isfinite(to_float(scale_b[m]))
    ]
    r = spearman(
        [to_float(scale_a[m]) for m in names], [to_float(scale_b[m]) for m in names]
    )
    return SpearmanResult(r.rho, r.p, r.n, tuple(names))
