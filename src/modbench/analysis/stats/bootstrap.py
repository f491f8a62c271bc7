"""The seed bootstrap (seed study §3.3; docs/statistics.md, "Seed bootstrap"): percentile
intervals of a mean and of a difference of means from resampled seeds.

Our own code, not ``scipy.stats.bootstrap(method="percentile")``: given the same generator
scipy reproduces the one-sample and paired intervals (checked with scipy 1.17), but it refuses
a group with one seed, the protocol's most common case (a single-seed method's difference
interval reflects only the baseline's spread, the seed study's "baseline bootstrap interval");
it draws an unpaired resample's groups in the other order (method first, where the documented
draws take the baseline first); and it has no ``prob_not_better`` or pairing by seed label.
Using it would need our code for exactly the cases the study runs most, so the ~20 lines stay.
The tests check the intervals against ``scipy.stats.bootstrap``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from modbench.analysis.stats.scores import NAN, Group, Scores, finite, group

DEFAULT_RESAMPLES = 10_000


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
    x = finite(scores)
    if x.size == 0:
        return NAN, NAN
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


def pairable(a: Group, b: Group) -> bool:
    """Both groups labelled by the same seeds (at least 2): paired by default."""
    return (
        a.labels is not None
        and b.labels is not None
        and set(a.labels) == set(b.labels)
        and len(a.labels) >= 2
    )


def can_pair(a: Group, b: Group) -> bool:
    """:func:`pairable`, or unlabelled lists of one length (at least 2): ``paired=True``."""
    unlabeled = a.labels is None and b.labels is None and a.values.size == b.values.size >= 2
    return pairable(a, b) or unlabeled


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
    a, b = group(method), group(baseline)
    if paired is None:
        paired = pairable(a, b)
    elif paired and not can_pair(a, b):
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
            return BootstrapDifference((NAN, NAN), NAN, True, n_resamples, 0, 0)
        idx = rng.integers(0, d.size, size=(n_resamples, d.size))
        boot = d[idx].mean(axis=1)
    else:
        xa, xb = a.finite, b.finite
        n_a, n_b = int(xa.size), int(xb.size)
        if n_a == 0 or n_b == 0:
            return BootstrapDifference((NAN, NAN), NAN, False, n_resamples, n_a, n_b)
        ib = rng.integers(0, n_b, size=(n_resamples, n_b))
        ia = rng.integers(0, n_a, size=(n_resamples, n_a))
        boot = xa[ia].mean(axis=1) - xb[ib].mean(axis=1)
    prob = float(np.mean(sign * boot <= 0.0))
    return BootstrapDifference(
        _percentile_ci(boot, confidence), prob, bool(paired), n_resamples, n_a, n_b
    )
