"""Statistics for deciding which methods beat the baseline against a multi-seed noise floor.

Implements the protocol of seeds/002_* §3.3 (noise floor), §4-§5 (z-scores, corrections,
Spearman across scales) and Appendix E.4 (per-task Welch + Stouffer). Pure functions and small
frozen dataclasses over numpy; no I/O and no scipy (the tests check every procedure against
scipy / statsmodels). ``docs/statistics.md`` states every rule; the short version:

* **Orientation.** ``higher_is_better=True`` for accuracies (CLIMB-avg), ``False`` for losses.
  ``delta`` is always the raw ``mean(method) - mean(baseline)`` in metric units;
  ``improvement`` is ``delta`` signed so that positive = better, and ``z`` has the same sign.
* **Divergence.** ``None``, NaN or ±inf in place of a score (or ``None`` in place of a whole
  method) is a diverged run: a result, not an error. A method with any diverged seed gets the
  verdict ``diverged``; its other statistics are computed on its finite seeds for information,
  but it is left out of the multiple-comparison family.
* **Noise floor.** ``sigma`` is the unbiased (ddof=1) std of the baseline's seeds
  (``"baseline"``, the seed study's choice), or the pooled std of the baseline and the
  reference configurations (``"pooled"``), or the largest of their stds (``"max"``). With
  fewer than 2 finite baseline seeds there is no noise floor: z, p and the verdicts are
  ``undetermined``.
* **z-score.** ``z = improvement / sigma`` with the method's mean over its seeds (one seed: its
  score); the per-seed sigma is used even for multi-seed methods (conservative; Welch's t is
  the multi-seed test). ``sigma == 0``: ``z = ±inf`` (p = 0) when ``delta != 0``, ``z = 0``
  (p = 1) when ``delta == 0``. ``p = 2 * (1 - Phi(|z|))``.
* **Verdict.** ``improver`` / ``degrader`` when the corrected p (default Bonferroni over the
  non-baseline, non-diverged methods with a finite p) is ``<= alpha`` (default 0.05) *and*
  ``|delta| > floor_sigmas * sigma`` (default 1 sigma); otherwise ``within_noise``.
* **Bootstrap.** Percentile intervals from ``n_resamples`` (default 10,000) resamples of the
  seeds with replacement, ``np.random.default_rng(seed)`` created afresh for every method (so
  a method's interval does not depend on the other methods in the table). Paired (one index
  draw shared by both groups) only when both groups are given as ``{seed: score}`` mappings
  over the same seeds (or ``paired=True`` with equal-length lists); unpaired otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from statistics import NormalDist
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = [
    "CORRECTIONS",
    "Adjusted",
    "BootstrapDifference",
    "MethodResult",
    "NoiseFloor",
    "PerTaskResult",
    "Scores",
    "SeedRequest",
    "SpearmanResult",
    "StoufferResult",
    "TaskTest",
    "Verdict",
    "WelchResult",
    "adjust_pvalues",
    "bootstrap_difference",
    "bootstrap_mean_ci",
    "compare",
    "decide",
    "decision_threshold",
    "noise_floor",
    "normal_isf",
    "normal_sf",
    "p_two_sided",
    "per_task_stouffer",
    "pooled_std",
    "rankdata",
    "sample_std",
    "spearman",
    "spearman_across_scales",
    "stouffer",
    "t_sf",
    "undecided",
    "welch_t",
    "z_score",
]

Score: TypeAlias = float | None
#: One configuration's per-seed scores: a list (seeds unlabeled), a ``{seed: score}`` mapping
#: (seeds labeled: allows pairing), or ``None`` when the configuration diverged. ``None`` / NaN
#: / ±inf entries are diverged seeds.
Scores: TypeAlias = Sequence[Score] | Mapping[Any, Score] | npt.ArrayLike | None
SigmaSource: TypeAlias = Literal["baseline", "pooled", "max"]
Correction: TypeAlias = Literal["bonferroni", "holm", "bh", "none"]
Alternative: TypeAlias = Literal["two-sided", "greater", "less"]

#: The corrections computed by :func:`compare` (``"none"`` is the raw p-value).
CORRECTIONS: tuple[str, ...] = ("bonferroni", "holm", "bh")
DEFAULT_RESAMPLES = 10_000

_NAN = float("nan")
_STD_NORMAL = NormalDist()


class Verdict(StrEnum):
    """Outcome for one method (compares equal to its string value)."""

    BASELINE = "baseline"
    IMPROVER = "improver"
    WITHIN_NOISE = "within_noise"
    DEGRADER = "degrader"
    DIVERGED = "diverged"
    UNDETERMINED = "undetermined"


# --------------------------------------------------------------------------------------------
# Input normalisation


@dataclass(frozen=True)
class _Group:
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


def _to_float(x: Any) -> float:
    if x is None:
        return _NAN
    v = float(x)
    return v if math.isfinite(v) else _NAN


def _group(scores: Scores) -> _Group:
    if scores is None:
        return _Group(np.empty(0), None, whole_none=True)
    if isinstance(scores, Mapping):
        labels = tuple(scores.keys())
        vals = np.array([_to_float(scores[k]) for k in labels], dtype=np.float64)
        return _Group(vals, labels)
    arr = np.asarray(scores, dtype=object).ravel()
    vals = np.array([_to_float(x) for x in arr], dtype=np.float64)
    return _Group(vals, None)


def _finite(x: Scores) -> npt.NDArray[np.float64]:
    return _group(x).finite


# --------------------------------------------------------------------------------------------
# Distributions (normal via math.erfc / statistics.NormalDist; Student t via the regularised
# incomplete beta function, continued fraction evaluated with the modified Lentz method)


def normal_sf(z: float) -> float:
    """``1 - Phi(z)``, accurate in the upper tail."""
    if math.isnan(z):
        return _NAN
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def normal_isf(p: float) -> float:
    """``z`` with ``normal_sf(z) == p``; ``+inf`` for p = 0, ``-inf`` for p = 1, NaN outside."""
    if math.isnan(p) or p < 0.0 or p > 1.0:
        return _NAN
    if p == 0.0:
        return math.inf
    if p == 1.0:
        return -math.inf
    return -_STD_NORMAL.inv_cdf(p)


def p_two_sided(z: float) -> float:
    """Two-sided normal p-value ``2 * (1 - Phi(|z|))`` (1 at z = 0, 0 at z = ±inf)."""
    if math.isnan(z):
        return _NAN
    return min(1.0, 2.0 * normal_sf(abs(z)))


def _betacf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-16
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((a - 1.0 + m2) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + 1.0 + m2)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta ``I_x(a, b)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """Survival function ``P(T > t)`` of Student's t with (possibly fractional) ``df``."""
    if math.isnan(t) or math.isnan(df) or df <= 0:
        return _NAN
    if math.isinf(df):
        return normal_sf(t)
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return tail if t >= 0 else 1.0 - tail


def _t_p(t: float, df: float, alternative: Alternative) -> float:
    if alternative == "greater":
        return t_sf(t, df)
    if alternative == "less":
        return t_sf(-t, df)
    if alternative == "two-sided":
        return _NAN if math.isnan(t) else min(1.0, 2.0 * t_sf(abs(t), df))
    raise ValueError(f"alternative must be two-sided, greater or less, not {alternative!r}")


# --------------------------------------------------------------------------------------------
# Noise floor


def sample_std(scores: Scores) -> float:
    """Unbiased (ddof=1) std of the finite scores; NaN with fewer than 2."""
    x = _finite(scores)
    return float(np.std(x, ddof=1)) if x.size >= 2 else _NAN


def pooled_std(groups: Iterable[Scores]) -> float:
    """Pooled std ``sqrt(sum((n_i - 1) s_i^2) / sum(n_i - 1))`` over groups of seeds (groups
    with fewer than 2 finite seeds contribute nothing); NaN when no group has 2 seeds."""
    ss, dof = 0.0, 0
    for g in groups:
        x = _finite(g)
        if x.size >= 2:
            ss += float(np.sum((x - x.mean()) ** 2))
            dof += x.size - 1
    return math.sqrt(ss / dof) if dof else _NAN


@dataclass(frozen=True)
class NoiseFloor:
    """The baseline's multi-seed reference: mean, n and the sigma that z-scores divide by."""

    mean: float
    sigma: float
    n: int
    higher_is_better: bool = True
    sigma_source: str = "baseline"
    baseline_std: float = _NAN
    reference_stds: Mapping[str, float] = field(default_factory=dict)
    n_diverged: int = 0

    @property
    def defined(self) -> bool:
        """True when z-scores can be formed (>= 2 finite baseline seeds, finite sigma)."""
        return self.n >= 2 and math.isfinite(self.sigma) and math.isfinite(self.mean)

    @property
    def sign(self) -> float:
        """+1 if higher scores are better, -1 otherwise."""
        return 1.0 if self.higher_is_better else -1.0


def noise_floor(
    baseline: Scores,
    *,
    higher_is_better: bool = True,
    references: Mapping[str, Scores] | None = None,
    sigma: SigmaSource = "baseline",
) -> NoiseFloor:
    """Noise floor from the baseline's seeds (and optional reference configurations' seeds).

    ``sigma="baseline"`` (seed study): the baseline's ddof=1 std. ``"pooled"``: pooled std of
    the baseline and every reference (see :func:`pooled_std`). ``"max"``: the largest defined
    std among them. The floor is undefined (``defined`` False) when the baseline has fewer than
    2 finite seeds, whatever the references: without a baseline spread there is no floor.
    """
    g = _group(baseline)
    x = g.finite
    mean = float(x.mean()) if x.size else _NAN
    base_std = sample_std(x)
    refs = dict(references or {})
    ref_stds = {name: sample_std(s) for name, s in refs.items()}
    if sigma == "baseline":
        s = base_std
    elif sigma == "pooled":
        s = pooled_std([x, *refs.values()])
    elif sigma == "max":
        cands = [v for v in (base_std, *ref_stds.values()) if math.isfinite(v)]
        s = max(cands) if cands else _NAN
    else:
        raise ValueError(f"sigma must be baseline, pooled or max, not {sigma!r}")
    if x.size < 2:
        s = _NAN
    return NoiseFloor(
        mean=mean,
        sigma=s,
        n=int(x.size),
        higher_is_better=higher_is_better,
        sigma_source=sigma,
        baseline_std=base_std,
        reference_stds=ref_stds,
        n_diverged=g.n_diverged,
    )


def z_score(scores: Scores | float, floor: NoiseFloor) -> float:
    """``z = sign * (mean(scores) - floor.mean) / floor.sigma`` (positive = better).

    NaN when the floor is undefined or there is no finite score. ``sigma == 0``: ±inf when the
    difference is non-zero, 0 when it is exactly zero.
    """
    x = _finite([float(scores)] if isinstance(scores, int | float) else scores)
    if not floor.defined or x.size == 0:
        return _NAN
    imp = floor.sign * (float(x.mean()) - floor.mean)
    if floor.sigma == 0.0:
        return 0.0 if imp == 0.0 else math.copysign(math.inf, imp)
    return imp / floor.sigma


# --------------------------------------------------------------------------------------------
# Seed bootstrap


def _percentile_ci(boot: npt.NDArray[np.float64], confidence: float) -> tuple[float, float]:
    lo, hi = np.quantile(boot, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return float(lo), float(hi)


def _check_boot_args(n_resamples: int, confidence: float) -> None:
    if n_resamples < 1:
        raise ValueError("n_resamples must be >= 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")


def bootstrap_mean_ci(
    scores: Scores,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of the finite seeds (resampled with
    replacement); (NaN, NaN) with no finite seed, a point with one seed or identical seeds."""
    _check_boot_args(n_resamples, confidence)
    x = _finite(scores)
    if x.size == 0:
        return _NAN, _NAN
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_resamples, x.size))
    return _percentile_ci(x[idx].mean(axis=1), confidence)


@dataclass(frozen=True)
class BootstrapDifference:
    """Bootstrap of ``mean(method) - mean(baseline)`` (raw metric units)."""

    ci: tuple[float, float]
    prob_not_better: float  # fraction of resamples with sign * difference <= 0
    paired: bool
    n_resamples: int
    n_method: int
    n_baseline: int


def _pairable(a: _Group, b: _Group) -> bool:
    return (
        a.labels is not None
        and b.labels is not None
        and set(a.labels) == set(b.labels)
        and len(a.labels) >= 2
    )


def _can_pair(a: _Group, b: _Group) -> bool:
    unlabeled = a.labels is None and b.labels is None and a.values.size == b.values.size >= 2
    return _pairable(a, b) or unlabeled


def bootstrap_difference(
    method: Scores,
    baseline: Scores,
    *,
    higher_is_better: bool = True,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
    paired: bool | None = None,
) -> BootstrapDifference:
    """Seed bootstrap of the difference of means, method minus baseline.

    ``paired=None`` (auto): paired when both groups are ``{seed: score}`` mappings over the
    same seed set (>= 2 seeds); unpaired otherwise. ``paired=True`` also accepts lists of equal
    length (position i = the same seed); it raises ValueError if the groups cannot be paired.
    Paired: one index draw per resample over the seeds finite in both groups, applied to both.
    Unpaired: the baseline's seeds and then the method's seeds are drawn independently from the
    same generator. ``prob_not_better`` is the fraction of resamples whose difference, signed so
    that positive = better, is <= 0 (for ``higher_is_better`` that is ``P(diff <= 0)``).
    """
    _check_boot_args(n_resamples, confidence)
    a, b = _group(method), _group(baseline)
    if paired is None:
        paired = _pairable(a, b)
    elif paired and not _can_pair(a, b):
        raise ValueError("paired=True needs the same seeds in both groups")
    sign = 1.0 if higher_is_better else -1.0
    rng = np.random.default_rng(seed)
    if paired:
        if a.labels is not None and b.labels is not None:
            order = list(b.labels)
            av = np.array([a.values[a.labels.index(k)] for k in order])
        else:
            av = a.values
        bv = b.values
        ok = np.isfinite(av) & np.isfinite(bv)
        d = av[ok] - bv[ok]
        n_a = n_b = int(ok.sum())
        if d.size == 0:
            return BootstrapDifference((_NAN, _NAN), _NAN, True, n_resamples, 0, 0)
        idx = rng.integers(0, d.size, size=(n_resamples, d.size))
        boot = d[idx].mean(axis=1)
    else:
        xa, xb = a.finite, b.finite
        n_a, n_b = int(xa.size), int(xb.size)
        if n_a == 0 or n_b == 0:
            return BootstrapDifference((_NAN, _NAN), _NAN, False, n_resamples, n_a, n_b)
        ib = rng.integers(0, n_b, size=(n_resamples, n_b))
        ia = rng.integers(0, n_a, size=(n_resamples, n_a))
        boot = xa[ia].mean(axis=1) - xb[ib].mean(axis=1)
    prob = float(np.mean(sign * boot <= 0.0))
    return BootstrapDifference(
        _percentile_ci(boot, confidence), prob, bool(paired), n_resamples, n_a, n_b
    )


# --------------------------------------------------------------------------------------------
# Multiple comparisons


@dataclass(frozen=True)
class Adjusted:
    """Adjusted p-values and reject flags (NaN p in → NaN adjusted p, reject False)."""

    method: str
    alpha: float
    p_adjusted: npt.NDArray[np.float64]
    reject: npt.NDArray[np.bool_]
    n_tests: int


def adjust_pvalues(
    pvalues: npt.ArrayLike, method: Correction = "bonferroni", alpha: float = 0.05
) -> Adjusted:
    """Bonferroni, Holm (step-down) or Benjamini–Hochberg (step-up FDR) adjusted p-values.

    The family is the finite p-values (m = their count); NaN entries stay NaN and are never
    rejected. ``reject = p_adjusted <= alpha``. ``"none"`` returns the raw p-values.
    """
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    out = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    q = p[ok]
    m = int(q.size)
    if m:
        if method == "none":
            adj = q.copy()
        elif method == "bonferroni":
            adj = np.minimum(1.0, m * q)
        elif method == "holm":
            order = np.argsort(q, kind="mergesort")
            steps = (m - np.arange(m)) * q[order]
            adj = np.empty(m)
            adj[order] = np.minimum(1.0, np.maximum.accumulate(steps))
        elif method == "bh":
            order = np.argsort(q, kind="mergesort")
            steps = m * q[order] / np.arange(1, m + 1)
            adj = np.empty(m)
            adj[order] = np.minimum(1.0, np.minimum.accumulate(steps[::-1])[::-1])
        else:
            raise ValueError(f"unknown correction {method!r}")
        out[ok] = adj
    elif method not in (*CORRECTIONS, "none"):
        raise ValueError(f"unknown correction {method!r}")
    reject = np.zeros(p.shape, dtype=bool)
    reject[ok] = out[ok] <= alpha
    return Adjusted(method, alpha, out, reject, m)


# --------------------------------------------------------------------------------------------
# Welch's t


@dataclass(frozen=True)
class WelchResult:
    """Welch's unequal-variance t-test of ``mean(a) - mean(b)``."""

    t: float
    df: float
    p: float
    alternative: str
    n_a: int
    n_b: int
    mean_diff: float


def welch_t(a: Scores, b: Scores, *, alternative: Alternative = "two-sided") -> WelchResult:
    """Welch's t for the finite seeds of ``a`` against those of ``b``.

    Needs >= 2 finite seeds per group, else t, df and p are NaN. When both groups have zero
    variance the test is undefined: t = ±inf (or NaN if the means are equal), df and p NaN
    (scipy reports p = 0 with df = 1 there; we deliberately do not).
    """
    xa, xb = _finite(a), _finite(b)
    na, nb = int(xa.size), int(xb.size)
    diff = float(xa.mean() - xb.mean()) if na and nb else _NAN
    if na < 2 or nb < 2:
        return WelchResult(_NAN, _NAN, _NAN, alternative, na, nb, diff)
    va = float(np.var(xa, ddof=1)) / na
    vb = float(np.var(xb, ddof=1)) / nb
    se2 = va + vb
    if se2 == 0.0:
        t = _NAN if diff == 0.0 else math.copysign(math.inf, diff)
        return WelchResult(t, _NAN, _NAN, alternative, na, nb, diff)
    t = diff / math.sqrt(se2)
    df = se2 * se2 / (va * va / (na - 1) + vb * vb / (nb - 1))
    return WelchResult(t, df, _t_p(t, df, alternative), alternative, na, nb, diff)


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
    """Combine one-sided p-values with Stouffer's method (optionally weighted).

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
        return StoufferResult(_NAN, _NAN, _NAN, int(p.size), weights is not None)
    z = np.array([normal_isf(float(v)) for v in p])
    with np.errstate(invalid="ignore"):
        zc = float(np.sum(w * z) / math.sqrt(float(np.sum(w * w))))
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
    """1-based ranks, ties given the average of the ranks they span."""
    a = np.asarray(x, dtype=np.float64).ravel()
    n = a.size
    if n == 0:
        return np.empty(0)
    order = np.argsort(a, kind="mergesort")
    s = a[order]
    new = np.r_[True, s[1:] != s[:-1]]
    group = np.cumsum(new) - 1  # 0-based tie group of each sorted position
    # group g spans the sorted positions [starts[g], starts[g + 1])
    starts = np.r_[np.flatnonzero(new), n]
    avg = 0.5 * (starts[group] + starts[group + 1] + 1)
    ranks = np.empty(n)
    ranks[order] = avg
    return ranks


@dataclass(frozen=True)
class SpearmanResult:
    """Spearman's rho with the t-approximation p-value (n - 2 df, two-sided)."""

    rho: float
    p: float
    n: int
    methods: tuple[str, ...] = ()


def spearman(x: npt.ArrayLike, y: npt.ArrayLike) -> SpearmanResult:
    """Spearman's rank correlation of paired values (average ranks for ties).

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
        return SpearmanResult(_NAN, _NAN, n)
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float(np.sum(ra * ra)) * float(np.sum(rb * rb)))
    if den == 0.0:
        return SpearmanResult(_NAN, _NAN, n)
    rho = max(-1.0, min(1.0, float(np.sum(ra * rb)) / den))
    if n <= 2:
        return SpearmanResult(rho, _NAN, n)
    if abs(rho) == 1.0:
        return SpearmanResult(rho, 0.0, n)
    t = rho * math.sqrt((n - 2) / (1.0 - rho * rho))
    return SpearmanResult(rho, _t_p(t, n - 2, "two-sided"), n)


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
        and math.isfinite(_to_float(scale_a[m]))
        and math.isfinite(_to_float(scale_b[m]))
    ]
    r = spearman(
        [_to_float(scale_a[m]) for m in names], [_to_float(scale_b[m]) for m in names]
    )
    return SpearmanResult(r.rho, r.p, r.n, tuple(names))


# --------------------------------------------------------------------------------------------
# Verdicts


def decide(
    *,
    improvement: float,
    p_adjusted: float,
    sigma: float,
    alpha: float = 0.05,
    floor_sigmas: float = 1.0,
    diverged: bool = False,
) -> Verdict:
    """The verdict rule, in order:

    1. ``diverged`` → DIVERGED;
    2. improvement, p or sigma not finite (no noise floor, no finite score) → UNDETERMINED;
    3. ``p_adjusted <= alpha`` and ``|improvement| > floor_sigmas * sigma`` → IMPROVER if the
       improvement is positive, DEGRADER if negative;
    4. otherwise WITHIN_NOISE.
    """
    if diverged:
        return Verdict.DIVERGED
    if not (math.isfinite(improvement) and math.isfinite(sigma)) or math.isnan(p_adjusted):
        return Verdict.UNDETERMINED
    if p_adjusted <= alpha and abs(improvement) > floor_sigmas * sigma:
        return Verdict.IMPROVER if improvement > 0 else Verdict.DEGRADER
    return Verdict.WITHIN_NOISE


def decision_threshold(
    sigma: float,
    n_tests: int = 1,
    *,
    alpha: float = 0.05,
    correction: Correction = "bonferroni",
    floor_sigmas: float = 1.0,
) -> float:
    """The |improvement| (metric units) a method's mean must exceed to be decided.

    ``sigma * max(floor_sigmas, z_crit)`` with ``z_crit = Phi^-1(1 - alpha / (2 m))``,
    ``m = n_tests`` for bonferroni, holm and bh (Holm's and BH's thresholds depend on the other
    p-values; the Bonferroni one is the strictest step of both, hence conservative) and m = 1
    for ``"none"``. NaN if sigma is undefined.
    """
    if not math.isfinite(sigma):
        return _NAN
    m = 1 if correction == "none" else max(1, n_tests)
    return sigma * max(floor_sigmas, normal_isf(alpha / (2.0 * m)))


@dataclass(frozen=True)
class SeedRequest:
    """A configuration whose verdict could still change with more seeds.

    ``interval`` bounds the improvement (positive = better, metric units) of its mean;
    ``reason`` is ``"straddles"`` (+threshold or -threshold lies inside the interval),
    ``"no_data"`` (no finite seed yet) or ``"no_floor"`` (the baseline itself needs seeds).
    ``capped``: it already has ``max_seeds`` seeds, so a runner should stop adding.
    """

    method: str
    n: int
    interval: tuple[float, float]
    threshold: float
    reason: str
    capped: bool


def undecided(
    table: Mapping[str, Scores],
    floor: NoiseFloor,
    threshold: float | None = None,
    *,
    baseline: str = "baseline",
    n_tests: int | None = None,
    alpha: float = 0.05,
    correction: Correction = "bonferroni",
    floor_sigmas: float = 1.0,
    confidence: float = 0.95,
    max_seeds: int | None = None,
) -> list[SeedRequest]:
    """Which configurations need more seeds before their verdict is settled.

    Each non-baseline, non-diverged method with n finite seeds gets the interval
    ``improvement ± Phi^-1((1 + confidence) / 2) * sigma / sqrt(n)`` (the uncertainty of its
    mean given the floor sigma); it is returned when ``+threshold`` or ``-threshold`` lies
    strictly inside the interval (so with sigma = 0 nothing straddles: seeds do not vary).
    ``threshold`` defaults to :func:`decision_threshold` with ``n_tests`` = the number of
    non-baseline, non-diverged methods; it is in metric units, like the improvement. If the floor is
    undefined, only the baseline is returned (reason ``"no_floor"``). Diverged methods are never
    returned (a divergence is a result). Order: the table's.
    """
    names = [m for m in table if m != baseline]
    cap = max_seeds if max_seeds is not None else math.inf
    if not floor.defined:
        return [SeedRequest(baseline, floor.n, (-math.inf, math.inf), _NAN, "no_floor",
                            floor.n >= cap)]
    groups = {m: _group(table[m]) for m in names}
    live = [m for m in names if groups[m].n_diverged == 0]
    if threshold is None:
        m_tests = n_tests if n_tests is not None else len(live)
        threshold = decision_threshold(
            floor.sigma, m_tests, alpha=alpha, correction=correction, floor_sigmas=floor_sigmas
        )
    half_unit = normal_isf((1.0 - confidence) / 2.0) * floor.sigma
    out: list[SeedRequest] = []
    for m in live:
        g = groups[m]
        if g.n == 0:
            out.append(SeedRequest(m, 0, (-math.inf, math.inf), threshold, "no_data", cap <= 0))
            continue
        imp = floor.sign * (float(g.finite.mean()) - floor.mean)
        half = half_unit / math.sqrt(g.n)
        lo, hi = imp - half, imp + half
        if lo < threshold < hi or lo < -threshold < hi:
            out.append(SeedRequest(m, g.n, (lo, hi), threshold, "straddles", g.n >= cap))
    return out


# --------------------------------------------------------------------------------------------
# compare


@dataclass(frozen=True)
class MethodResult:
    """Everything the report needs about one configuration (see :func:`compare`)."""

    method: str
    is_baseline: bool
    n: int  # finite seeds
    n_diverged: int
    mean: float
    std: float  # ddof=1, NaN with < 2 seeds
    delta: float  # mean - baseline mean (raw units)
    improvement: float  # delta signed so that positive = better
    z: float
    p: float  # two-sided normal p of z
    p_adjusted: Mapping[str, float]  # bonferroni / holm / bh
    significant: Mapping[str, bool]  # none / bonferroni / holm / bh (p <= alpha)
    ci_mean: tuple[float, float]
    ci_delta: tuple[float, float]
    prob_not_better: float
    paired: bool
    welch: WelchResult | None
    verdict: Verdict
    floor: NoiseFloor

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python dict (verdict as its string; NaN / inf kept as floats)."""
        d = asdict(self)
        d["verdict"] = str(self.verdict)
        d["p_adjusted"] = dict(self.p_adjusted)
        d["significant"] = dict(self.significant)
        return d


def compare(
    table: Mapping[str, Scores],
    baseline: str = "baseline",
    *,
    higher_is_better: bool = True,
    references: Sequence[str] = (),
    sigma: SigmaSource = "baseline",
    alpha: float = 0.05,
    correction: Correction = "bonferroni",
    floor_sigmas: float = 1.0,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
    paired: bool | None = None,
    diverged: Collection[str] = (),
) -> list[MethodResult]:
    """Compare every method of ``table`` (``{name: per-seed scores or None}``) with ``baseline``.

    Returns one :class:`MethodResult` per entry, in the table's order, baseline included (its
    delta, improvement and z are 0, its p NaN, its verdict ``baseline`` unless it diverged).
    ``references`` names table entries whose seeds join the baseline's for
    ``sigma="pooled"|"max"``. ``diverged`` flags extra methods as diverged even if they have
    scores. The correction family is the non-baseline, non-diverged methods with a finite p;
    ``correction`` picks which adjusted p the verdict uses (see :func:`decide`). Welch's t
    (two-sided) is reported when the method and the baseline both have >= 2 finite seeds. An
    empty table gives []; a non-empty table without ``baseline`` raises KeyError.
    """
    if not table:
        return []
    if baseline not in table:
        raise KeyError(f"baseline {baseline!r} is not in the table")
    if correction not in (*CORRECTIONS, "none"):
        raise ValueError(f"unknown correction {correction!r}")
    floor = noise_floor(
        table[baseline],
        higher_is_better=higher_is_better,
        references={r: table[r] for r in references if r in table and r != baseline},
        sigma=sigma,
    )
    groups = {m: _group(s) for m, s in table.items()}
    is_div = {m: g.n_diverged > 0 or m in diverged for m, g in groups.items()}
    base = groups[baseline]

    rows: dict[str, dict[str, Any]] = {}
    for m, g in groups.items():
        x = g.finite
        mean = float(x.mean()) if x.size else _NAN
        delta = 0.0 if m == baseline else mean - floor.mean
        if m == baseline:
            z, p = 0.0, _NAN
        else:
            z = z_score(x, floor)
            p = p_two_sided(z)
        boot = None
        if m != baseline:
            pair = _can_pair(g, base) if paired else paired  # True: pair where possible
            boot = bootstrap_difference(
                table[m], table[baseline], higher_is_better=higher_is_better,
                n_resamples=n_resamples, confidence=confidence, seed=seed, paired=pair,
            )
        welch = welch_t(x, base.finite) if m != baseline and x.size >= 2 and base.n >= 2 else None
        rows[m] = {
            "g": g, "mean": mean, "delta": delta, "z": z, "p": p, "boot": boot, "welch": welch,
        }

    family = [m for m in table if m != baseline and not is_div[m] and math.isfinite(rows[m]["p"])]
    adjusted: dict[str, dict[str, float]] = {m: {} for m in table}
    for c in CORRECTIONS:
        adj = adjust_pvalues([rows[m]["p"] for m in family], c, alpha)  # type: ignore[arg-type]
        for m, v in zip(family, adj.p_adjusted, strict=True):
            adjusted[m][c] = float(v)

    out: list[MethodResult] = []
    for m in table:
        r = rows[m]
        g = r["g"]
        padj = {c: adjusted[m].get(c, _NAN) for c in CORRECTIONS}
        sig = {"none": bool(r["p"] <= alpha) if m in family else False}
        sig.update({c: bool(padj[c] <= alpha) for c in CORRECTIONS})
        improvement = floor.sign * r["delta"] if m != baseline else 0.0
        if m == baseline:
            verdict = Verdict.DIVERGED if is_div[m] else Verdict.BASELINE
        else:
            p_use = r["p"] if correction == "none" else padj[correction]
            if m not in family:
                p_use = _NAN
            verdict = decide(
                improvement=improvement, p_adjusted=p_use, sigma=floor.sigma, alpha=alpha,
                floor_sigmas=floor_sigmas, diverged=is_div[m],
            )
        bd: BootstrapDifference | None = r["boot"]
        out.append(
            MethodResult(
                method=m,
                is_baseline=m == baseline,
                n=g.n,
                n_diverged=g.n_diverged,
                mean=r["mean"],
                std=sample_std(g.finite),
                delta=r["delta"],
                improvement=improvement,
                z=r["z"],
                p=r["p"],
                p_adjusted=padj,
                significant=sig,
                ci_mean=bootstrap_mean_ci(
                    g.finite, n_resamples=n_resamples, confidence=confidence, seed=seed
                ),
                ci_delta=bd.ci if bd else (_NAN, _NAN),
                prob_not_better=bd.prob_not_better if bd else _NAN,
                paired=bd.paired if bd else False,
                welch=r["welch"],
                verdict=verdict,
                floor=floor,
            )
        )
    return out
