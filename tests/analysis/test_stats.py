"""modbench.analysis.stats against scipy / statsmodels on fixed inputs, degenerate cases
included (identical seeds, one seed, diverged runs, empty inputs, a single method)."""

from __future__ import annotations

import math

import numpy as np
import pytest

scipy_stats = pytest.importorskip("scipy.stats")
multitest = pytest.importorskip("statsmodels.stats.multitest")
TTestIndPower = pytest.importorskip("statsmodels.stats.power").TTestIndPower

from modbench.analysis import stats as S  # noqa: E402
from modbench.analysis.stats import Verdict  # noqa: E402

# A seed-study-like table (CLIMB-avg, higher is better): 3 seeds of the baseline and of two
# references, single seeds for the rest.
BASE = [0.4829, 0.4841, 0.4817]
SOFTPICK = [0.4922, 0.4931, 0.4909]
QKNORM = [0.4882, 0.4870, 0.4893]
TABLE: dict[str, list[float | None] | None] = {
    "baseline": BASE,
    "softpick": SOFTPICK,
    "qknorm": QKNORM,
    "relu2": [0.4878],
    "geglu": [0.4834],
    "denseformer": [0.4809],
    "diff_attn": [0.4779],
    "sigmoid": [0.3217],
    "hybridnorm": None,  # diverged
}
PVALS = [
    np.array([0.01, 0.04, 0.03, 0.2]),
    np.array([0.001, 0.001, 0.02, 0.5, 1.0, 0.049, 0.0125]),
    np.array([0.3]),
    np.array([1e-12, 0.06, 0.06, 0.06, 0.9]),
]


def by_name(results: list[S.MethodResult]) -> dict[str, S.MethodResult]:
    return {r.method: r for r in results}


# ---------------------------------------------------------------- distributions


@pytest.mark.parametrize("z", [-8.0, -1.96, -0.3, 0.0, 0.5, 1.6448536, 3.0, 9.5, 37.0])
def test_normal_functions_match_scipy(z: float) -> None:
    norm = scipy_stats.norm
    assert S.normal_sf(z) == pytest.approx(norm.sf(z), rel=1e-12, abs=1e-300)
    assert S.p_two_sided(z) == pytest.approx(2 * norm.sf(abs(z)), rel=1e-12, abs=1e-300)
    p = float(norm.sf(z))
    if 0 < p < 1:
        assert S.normal_isf(p) == pytest.approx(norm.isf(p), rel=1e-9, abs=1e-12)


def test_normal_edge_values() -> None:
    assert S.normal_isf(0.0) == math.inf and S.normal_isf(1.0) == -math.inf
    assert math.isnan(S.normal_isf(1.5)) and math.isnan(S.p_two_sided(math.nan))
    assert S.p_two_sided(math.inf) == 0.0 and S.p_two_sided(0.0) == 1.0


@pytest.mark.parametrize("df", [1.0, 2.0, 2.37, 3.9825, 7.0, 30.5, 400.0, 1e6])
@pytest.mark.parametrize("t", [-25.0, -2.1, -0.4, 0.0, 0.7, 1.9, 4.4, 60.0])
def test_t_sf_matches_scipy(t: float, df: float) -> None:
    assert S.t_sf(t, df) == pytest.approx(scipy_stats.t.sf(t, df), rel=1e-9, abs=1e-300)


def test_t_sf_edges() -> None:
    assert S.t_sf(math.inf, 3) == 0.0 and S.t_sf(-math.inf, 3) == 1.0
    assert S.t_sf(1.0, math.inf) == pytest.approx(scipy_stats.norm.sf(1.0))
    assert math.isnan(S.t_sf(1.0, math.nan)) and math.isnan(S.t_sf(1.0, 0.0))


# ---------------------------------------------------------------- noise floor and z


def test_noise_floor_baseline_pooled_max() -> None:
    refs = {"softpick": SOFTPICK, "qknorm": QKNORM}
    f = S.noise_floor(BASE, references=refs)
    assert f.mean == pytest.approx(np.mean(BASE))
    assert f.sigma == pytest.approx(np.std(BASE, ddof=1)) and f.n == 3 and f.defined
    assert f.reference_stds["qknorm"] == pytest.approx(np.std(QKNORM, ddof=1))
    pooled = S.noise_floor(BASE, references=refs, sigma="pooled").sigma
    expect = math.sqrt(
        sum(2 * np.var(g, ddof=1) for g in (BASE, SOFTPICK, QKNORM)) / (2 + 2 + 2)
    )
    assert pooled == pytest.approx(expect)
    # pooled std of equal-size groups = sqrt(mean of variances)
    assert pooled == pytest.approx(math.sqrt(np.mean([np.var(g, ddof=1) for g in refs.values()]
                                                     + [np.var(BASE, ddof=1)])))
    mx = S.noise_floor(BASE, references=refs, sigma="max").sigma
    assert mx == pytest.approx(max(np.std(g, ddof=1) for g in (BASE, SOFTPICK, QKNORM)))
    with pytest.raises(ValueError):
        S.noise_floor(BASE, sigma="median")  # type: ignore[arg-type]


def test_pooled_std_unequal_sizes_and_short_groups() -> None:
    a, b = [1.0, 2.0, 4.0, 7.0], [3.0, 3.5]
    ss = np.sum((np.array(a) - np.mean(a)) ** 2) + np.sum((np.array(b) - np.mean(b)) ** 2)
    assert S.pooled_std([a, b, [9.0], [], None]) == pytest.approx(math.sqrt(ss / 4))
    assert math.isnan(S.pooled_std([[1.0], []]))


def test_noise_floor_degenerate() -> None:
    one = S.noise_floor([0.48])
    assert one.n == 1 and math.isnan(one.sigma) and not one.defined
    # references cannot stand in for a missing baseline spread
    assert not S.noise_floor([0.48], references={"r": [1.0, 2.0]}, sigma="pooled").defined
    empty = S.noise_floor([])
    assert empty.n == 0 and math.isnan(empty.mean) and not empty.defined
    div = S.noise_floor([0.48, None, math.nan, 0.47])
    assert div.n == 2 and div.n_diverged == 2 and div.sigma == pytest.approx(np.std([0.48, 0.47],
                                                                                   ddof=1))
    zero = S.noise_floor([0.5, 0.5, 0.5])
    assert zero.defined and zero.sigma == 0.0


def test_z_score_orientation_and_mean() -> None:
    f = S.noise_floor(BASE)
    mu, sd = np.mean(BASE), np.std(BASE, ddof=1)
    assert S.z_score(0.4922, f) == pytest.approx((0.4922 - mu) / sd)
    assert S.z_score(SOFTPICK, f) == pytest.approx((np.mean(SOFTPICK) - mu) / sd)
    loss = S.noise_floor([2.489, 2.492, 2.486], higher_is_better=False)
    z = S.z_score([2.4771], loss)
    assert z > 0  # lower loss is better
    assert z == pytest.approx(-(2.4771 - np.mean([2.489, 2.492, 2.486]))
                              / np.std([2.489, 2.492, 2.486], ddof=1))
    p = S.p_two_sided(z)
    assert p == pytest.approx(2 * scipy_stats.norm.sf(abs(z)))


def test_z_score_degenerate() -> None:
    zero = S.noise_floor([0.5, 0.5, 0.5])
    assert S.z_score(0.6, zero) == math.inf
    assert S.z_score(0.4, zero) == -math.inf
    assert S.z_score(0.5, zero) == 0.0 and S.p_two_sided(0.0) == 1.0
    assert math.isnan(S.z_score(0.6, S.noise_floor([0.5])))
    assert math.isnan(S.z_score([None], S.noise_floor(BASE)))
    assert math.isnan(S.z_score([], S.noise_floor(BASE)))


# ---------------------------------------------------------------- multiple comparisons


# (statsmodels' Holm calls gc.collect(), slow in a process holding torch: one call per case)
@pytest.mark.parametrize(("pv", "alpha"), list(zip(PVALS, (0.05, 0.1, 0.05, 0.1), strict=True)))
@pytest.mark.parametrize(("ours", "theirs"),
                         [("bonferroni", "bonferroni"), ("holm", "holm"), ("bh", "fdr_bh")])
def test_corrections_match_statsmodels(pv: np.ndarray, alpha: float, ours: str,
                                       theirs: str) -> None:
    rej, padj, _, _ = multitest.multipletests(pv, alpha=alpha, method=theirs)
    got = S.adjust_pvalues(pv, ours, alpha)  # type: ignore[arg-type]
    np.testing.assert_allclose(got.p_adjusted, padj, rtol=1e-12)
    np.testing.assert_array_equal(got.reject, rej)
    assert got.n_tests == pv.size


def test_corrections_nan_and_empty() -> None:
    pv = np.array([0.01, np.nan, 0.04, 0.03, np.nan, 0.2])
    ok = ~np.isnan(pv)
    for ours, theirs in [("bonferroni", "bonferroni"), ("holm", "holm"), ("bh", "fdr_bh")]:
        got = S.adjust_pvalues(pv, ours)  # type: ignore[arg-type]
        rej, padj, _, _ = multitest.multipletests(pv[ok], alpha=0.05, method=theirs)
        np.testing.assert_allclose(got.p_adjusted[ok], padj)
        assert np.isnan(got.p_adjusted[~ok]).all() and not got.reject[~ok].any()
        np.testing.assert_array_equal(got.reject[ok], rej)
        assert got.n_tests == 4
    empty = S.adjust_pvalues([], "holm")
    assert empty.p_adjusted.size == 0 and empty.n_tests == 0
    assert S.adjust_pvalues([0.02], "none").p_adjusted[0] == 0.02
    with pytest.raises(ValueError):
        S.adjust_pvalues([0.1], "sidak")  # type: ignore[arg-type]


# ---------------------------------------------------------------- Welch


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (SOFTPICK, BASE),
        (QKNORM, BASE),
        ([1.0, 2.0, 3.5, 4.0, 8.0], [2.0, 2.5]),
        ([0.1, 0.1, 0.1], [0.2, 0.25, 0.3, 0.22]),  # one group with zero variance
    ],
)
@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")
def test_welch_matches_scipy(a: list[float], b: list[float], alternative: str) -> None:
    ref = scipy_stats.ttest_ind(a, b, equal_var=False, alternative=alternative)
    got = S.welch_t(a, b, alternative=alternative)  # type: ignore[arg-type]
    assert got.t == pytest.approx(ref.statistic, rel=1e-12)
    assert got.df == pytest.approx(ref.df, rel=1e-12)
    assert got.p == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-300)
    assert got.mean_diff == pytest.approx(np.mean(a) - np.mean(b))


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")
def test_welch_degenerate() -> None:
    # both groups constant: t as scipy (±inf), but p (and df) NaN by design (scipy: p=0, df=1)
    ref = scipy_stats.ttest_ind([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], equal_var=False)
    got = S.welch_t([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    assert got.t == ref.statistic == -math.inf
    assert math.isnan(got.p) and math.isnan(got.df)
    same = S.welch_t([1.0, 1.0], [1.0, 1.0, 1.0])
    assert math.isnan(same.t) and math.isnan(same.p)
    one = S.welch_t([0.49], BASE)
    assert one.n_a == 1 and math.isnan(one.t) and math.isnan(one.p)
    nan = S.welch_t([0.49, None, 0.50, math.nan], BASE)
    ref2 = scipy_stats.ttest_ind([0.49, 0.50], BASE, equal_var=False)
    assert nan.n_a == 2 and nan.p == pytest.approx(ref2.pvalue)
    assert math.isnan(S.welch_t([], []).p)
    with pytest.raises(ValueError):
        S.welch_t(SOFTPICK, BASE, alternative="bigger")  # type: ignore[arg-type]


# ---------------------------------------------------------------- Stouffer, per-task Welch


@pytest.mark.parametrize("pv", [[0.01, 0.2, 0.5], [0.3, 0.7, 0.9, 0.45], [1e-9, 0.5]])
def test_stouffer_matches_scipy(pv: list[float]) -> None:
    ref = scipy_stats.combine_pvalues(pv, method="stouffer")
    got = S.stouffer(pv)
    assert got.z == pytest.approx(ref.statistic, rel=1e-9)
    assert got.p_one_sided == pytest.approx(ref.pvalue, rel=1e-9)
    assert got.p_two_sided == pytest.approx(2 * scipy_stats.norm.sf(abs(ref.statistic)))
    w = np.arange(1, len(pv) + 1, dtype=float)
    refw = scipy_stats.combine_pvalues(pv, method="stouffer", weights=w)
    gotw = S.stouffer(pv, w)
    assert gotw.z == pytest.approx(refw.statistic, rel=1e-9) and gotw.weighted
    assert gotw.p_one_sided == pytest.approx(refw.pvalue, rel=1e-9)


def test_stouffer_degenerate() -> None:
    got = S.stouffer([0.01, math.nan, 0.2])
    assert got.n == 2
    assert got.z == pytest.approx(scipy_stats.combine_pvalues([0.01, 0.2], "stouffer").statistic)
    assert math.isnan(S.stouffer([]).z) and math.isnan(S.stouffer([math.nan]).p_one_sided)
    assert S.stouffer([0.0, 0.3]).z == math.inf
    assert math.isnan(S.stouffer([0.1], [0.0]).z)
    with pytest.raises(ValueError):
        S.stouffer([0.1, 0.2], [1.0])
    with pytest.raises(ValueError):
        S.stouffer([0.1], [-1.0])


def _per_task_reference(method, baseline, alternative, weights=None):
    ps = []
    for task in method:
        r = scipy_stats.ttest_ind(method[task], baseline[task], equal_var=False,
                                  alternative=alternative)
        ps.append(r.pvalue)
    return scipy_stats.combine_pvalues(ps, method="stouffer", weights=weights), ps


def test_per_task_stouffer_matches_scipy() -> None:
    rng = np.random.default_rng(7)
    tasks = [f"task{i}" for i in range(12)]
    base = {t: list(0.5 + 0.01 * rng.standard_normal(3)) for t in tasks}
    meth = {t: list(0.503 + 0.01 * rng.standard_normal(3)) for t in tasks}
    weights = {t: float(100 + 50 * i) for i, t in enumerate(tasks)}
    ref, ps = _per_task_reference(meth, base, "greater", list(weights.values()))
    got = S.per_task_stouffer(meth, base, weights=weights)
    np.testing.assert_allclose([r.p_one_sided for r in got.tasks], ps, rtol=1e-9)
    for row, t in zip(got.tasks, tasks, strict=True):
        two = scipy_stats.ttest_ind(meth[t], base[t], equal_var=False)
        assert row.t == pytest.approx(two.statistic) and row.p_two_sided == pytest.approx(
            two.pvalue)
    assert got.stouffer_weighted is not None
    assert got.stouffer_weighted.z == pytest.approx(ref.statistic, rel=1e-9)
    assert got.stouffer_weighted.p_one_sided == pytest.approx(ref.pvalue, rel=1e-9)
    ref_u, _ = _per_task_reference(meth, base, "greater")
    assert got.stouffer.z == pytest.approx(ref_u.statistic, rel=1e-9)
    # lower-is-better: 'better' is 'less'
    ref_l, _ = _per_task_reference(meth, base, "less")
    low = S.per_task_stouffer(meth, base, higher_is_better=False)
    assert low.stouffer.z == pytest.approx(ref_l.statistic, rel=1e-9)
    assert low.stouffer_weighted is None


def test_per_task_stouffer_degenerate_tasks() -> None:
    base = {"a": [0.5, 0.52, 0.51], "b": [0.3, 0.3], "c": [0.7], "d": [0.1, 0.2]}
    meth = {"a": [0.55, 0.56, 0.54], "b": [0.3, 0.3], "c": [0.8, 0.81], "only_m": [1.0, 2.0]}
    got = S.per_task_stouffer(meth, base)
    assert [r.task for r in got.tasks] == ["a", "b", "c"]
    assert math.isnan(got.tasks[1].p_one_sided) and math.isnan(got.tasks[2].p_one_sided)
    assert got.stouffer.n == 1
    ref = scipy_stats.ttest_ind(meth["a"], base["a"], equal_var=False, alternative="greater")
    assert got.stouffer.p_one_sided == pytest.approx(ref.pvalue, rel=1e-9)
    empty = S.per_task_stouffer({}, {})
    assert empty.tasks == () and math.isnan(empty.stouffer.z)


# ---------------------------------------------------------------- Spearman


@pytest.mark.parametrize(
    ("x", "y"),
    [
        ([0.4863, 0.4882, 0.4852, 0.4874, 0.4880, 0.4922, 0.4878],
         [0.5158, 0.5129, 0.5108, 0.5097, 0.5088, 0.5084, 0.5083]),
        ([1, 2, 2, 3, 5], [2, 1, 4, 4, 5]),  # ties on both sides
        ([1, 2, 3, 4], [1, 3, 2, 4]),
        ([3, 3, 1, 2, 2, 2], [1, 2, 3, 4, 5, 6]),
        ([1, 2, 3], [3, 2, 1]),  # perfect: p = 0
    ],
)
def test_spearman_matches_scipy(x: list[float], y: list[float]) -> None:
    ref = scipy_stats.spearmanr(x, y)
    got = S.spearman(x, y)
    assert got.rho == pytest.approx(ref.statistic, rel=1e-12, abs=1e-15)
    assert got.p == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-15)
    np.testing.assert_allclose(S.rankdata(x), scipy_stats.rankdata(x))


def test_spearman_degenerate() -> None:
    assert math.isnan(S.spearman([1, 2, 3], [2, 2, 2]).rho)  # constant side
    two = S.spearman([1, 2], [2, 1])
    assert two.rho == pytest.approx(-1.0) and math.isnan(two.p)
    assert math.isnan(S.spearman([1], [1]).rho) and math.isnan(S.spearman([], []).rho)
    with pytest.raises(ValueError):
        S.spearman([1, 2], [1])


def test_spearman_across_scales_drops_diverged() -> None:
    a = {"qk": 0.4882, "sp": 0.4922, "sel": 0.4874, "hyb": 0.4896, "relu2": 0.4878, "x": 0.48}
    b = {"qk": 0.5129, "sp": 0.5084, "sel": 0.5097, "hyb": None, "relu2": 0.5083}
    got = S.spearman_across_scales(a, b)
    assert got.methods == ("qk", "sp", "sel", "relu2") and got.n == 4
    ref = scipy_stats.spearmanr([a[m] for m in got.methods], [b[m] for m in got.methods])
    assert got.rho == pytest.approx(ref.statistic) and got.p == pytest.approx(ref.pvalue)


# ---------------------------------------------------------------- bootstrap


def test_bootstrap_mean_ci_fixed_rng_and_scipy_sanity() -> None:
    x = np.random.default_rng(3).normal(0.5, 0.01, size=25)
    ci = S.bootstrap_mean_ci(x, seed=11)
    assert ci == S.bootstrap_mean_ci(x, seed=11)  # reproducible
    rng = np.random.default_rng(11)
    idx = rng.integers(0, x.size, size=(10_000, x.size))
    assert ci == tuple(np.quantile(x[idx].mean(axis=1), [0.025, 0.975]))
    ref = scipy_stats.bootstrap((x,), np.mean, method="percentile", n_resamples=10_000,
                                rng=np.random.default_rng(5)).confidence_interval
    se = x.std(ddof=1) / math.sqrt(x.size)
    assert abs(ci[0] - ref.low) < 0.15 * se and abs(ci[1] - ref.high) < 0.15 * se


def test_bootstrap_mean_ci_degenerate() -> None:
    assert S.bootstrap_mean_ci([0.48]) == (0.48, 0.48)
    assert S.bootstrap_mean_ci([0.5, 0.5, 0.5]) == pytest.approx((0.5, 0.5))
    assert all(math.isnan(v) for v in S.bootstrap_mean_ci([]))
    assert all(math.isnan(v) for v in S.bootstrap_mean_ci(None))
    with pytest.raises(ValueError):
        S.bootstrap_mean_ci([1.0], n_resamples=0)
    with pytest.raises(ValueError):
        S.bootstrap_mean_ci([1.0], confidence=1.0)


def test_bootstrap_difference_paired_vs_unpaired() -> None:
    m = {42: 0.4922, 43: 0.4931, 44: 0.4909}
    b = {44: 0.4817, 42: 0.4829, 43: 0.4841}  # same seeds, other order
    paired = S.bootstrap_difference(m, b, n_resamples=2000, seed=4)
    assert paired.paired and paired.n_method == paired.n_baseline == 3
    d = np.array([m[k] - b[k] for k in (44, 42, 43)])  # baseline's seed order
    idx = np.random.default_rng(4).integers(0, 3, size=(2000, 3))
    assert paired.ci == tuple(np.quantile(d[idx].mean(axis=1), [0.025, 0.975]))
    assert paired.prob_not_better == 0.0
    # lists: unpaired, baseline drawn first then the method
    un = S.bootstrap_difference(SOFTPICK, BASE, n_resamples=2000, seed=4)
    assert not un.paired
    rng = np.random.default_rng(4)
    ib = rng.integers(0, 3, size=(2000, 3))
    ia = rng.integers(0, 3, size=(2000, 3))
    boot = np.array(SOFTPICK)[ia].mean(axis=1) - np.array(BASE)[ib].mean(axis=1)
    assert un.ci == tuple(np.quantile(boot, [0.025, 0.975]))
    # lists of equal length may be paired explicitly; different seed sets may not
    assert S.bootstrap_difference(SOFTPICK, BASE, paired=True, n_resamples=100).paired
    with pytest.raises(ValueError):
        S.bootstrap_difference({1: 0.1, 2: 0.2}, {1: 0.1, 3: 0.2}, paired=True)
    assert not S.bootstrap_difference({1: 0.1, 2: 0.2}, {1: 0.1, 3: 0.2}).paired


def test_bootstrap_difference_orientation_and_degenerate() -> None:
    worse = S.bootstrap_difference([0.47], BASE, n_resamples=1000)
    assert worse.prob_not_better == 1.0 and worse.ci[1] < 0
    loss = S.bootstrap_difference([2.40], [2.48, 2.49, 2.50], higher_is_better=False,
                                  n_resamples=1000)
    assert loss.prob_not_better == 0.0 and loss.ci[1] < 0  # raw difference, lower = better
    tie = S.bootstrap_difference([0.5], [0.5, 0.5], n_resamples=100)
    assert tie.prob_not_better == 1.0 and tie.ci == (0.0, 0.0)  # "<= 0" counts ties
    none = S.bootstrap_difference(None, BASE)
    assert math.isnan(none.prob_not_better) and none.n_method == 0


# ---------------------------------------------------------------- compare and verdicts


def prediction_reference(score: float, base: list[float], higher_is_better: bool = True
                         ) -> tuple[float, float, float]:
    """The prediction-interval t test of one seed against the baseline's seeds, from scratch:
    (t, df, two-sided p), t signed so that positive = better."""
    b = np.asarray(base, dtype=float)
    sign = 1.0 if higher_is_better else -1.0
    t = sign * (score - b.mean()) / (b.std(ddof=1) * math.sqrt(1 + 1 / b.size))
    df = b.size - 1
    return t, df, 2 * scipy_stats.t.sf(abs(t), df)


def test_compare_seed_like_table() -> None:
    """The fallback tests (``test="welch"``: prediction for one seed, Welch for more)."""
    res = S.compare(TABLE, n_resamples=2000, seed=1, test="welch")
    assert [r.method for r in res] == list(TABLE)
    r = by_name(res)
    floor = S.noise_floor(BASE)
    assert r["baseline"].verdict == Verdict.BASELINE and r["baseline"].z == 0.0
    assert math.isnan(r["baseline"].p) and r["baseline"].test == "none"
    assert not r["baseline"].fewer_seeds
    # z (descriptive) per method
    for name in ("softpick", "relu2", "sigmoid"):
        mean = np.mean(TABLE[name])  # type: ignore[arg-type]
        assert r[name].z == pytest.approx((mean - floor.mean) / floor.sigma)
        assert r[name].delta == pytest.approx(mean - floor.mean)
    # one seed: the prediction test, t reference with n_b - 1 = 2 df
    for name in ("relu2", "sigmoid", "geglu"):
        t, df, p = prediction_reference(TABLE[name][0], BASE)  # type: ignore[index]
        assert r[name].test == "prediction" and r[name].df == df
        assert r[name].t == pytest.approx(t, rel=1e-12)
        assert r[name].p == pytest.approx(p, rel=1e-9, abs=1e-300)
        assert r[name].fewer_seeds
    # three seeds: Welch's t against the baseline's seeds
    for name in ("softpick", "qknorm"):
        ref = scipy_stats.ttest_ind(TABLE[name], BASE, equal_var=False)
        assert r[name].test == "welch" and not r[name].fewer_seeds
        assert r[name].t == pytest.approx(ref.statistic, rel=1e-12)
        assert r[name].df == pytest.approx(ref.df, rel=1e-12)
        assert r[name].p == pytest.approx(ref.pvalue, rel=1e-9)
        assert r[name].welch is not None and r[name].welch.p == pytest.approx(ref.pvalue)
    assert r["relu2"].welch is None
    # family: the 7 score tests of the non-baseline methods with a finite seed; hybridnorm's
    # failure-rate test (Fisher: 1 of 1 failed against 0 of 3, p = 0.25) cannot reach alpha
    # at these counts, so it is left out (Tarone)
    family = [n for n in TABLE if n not in ("baseline", "hybridnorm")]
    fisher = scipy_stats.fisher_exact([[1, 0], [0, 3]]).pvalue
    assert r["hybridnorm"].p_failures == pytest.approx(fisher) == 0.25
    assert math.isnan(r["hybridnorm"].p_failures_adjusted)
    assert all(math.isnan(r[n].p_failures) for n in family)  # no failed seed anywhere
    pv = np.array([r[n].p for n in family])
    for ours, theirs in [("bonferroni", "bonferroni"), ("holm", "holm"), ("bh", "fdr_bh")]:
        rej, padj, _, _ = multitest.multipletests(pv, alpha=0.05, method=theirs)
        np.testing.assert_allclose([r[n].p_adjusted[ours] for n in family], padj)
        assert [r[n].significant[ours] for n in family] == list(rej)
    # verdicts (Holm by default)
    assert r["softpick"].verdict == Verdict.IMPROVER
    assert r["sigmoid"].verdict == Verdict.DEGRADER
    assert r["geglu"].verdict == Verdict.WITHIN_NOISE
    # relu2 is 4.1 sigma above the baseline: "significant" under the old normal z, not with
    # one seed against a sigma known to 2 degrees of freedom
    assert r["relu2"].z > 4 and r["relu2"].verdict == Verdict.WITHIN_NOISE
    assert r["hybridnorm"].verdict == Verdict.DIVERGED and r["hybridnorm"].n == 0
    assert math.isnan(r["hybridnorm"].p_adjusted["bonferroni"])
    assert r["softpick"].ci_delta[0] > 0 and r["softpick"].prob_not_better == 0.0
    d = r["sigmoid"].to_dict()
    assert d["verdict"] == "degrader" and d["test"] == "prediction" and d["fewer_seeds"]
    assert d["floor"]["df"] == 2
    # deterministic
    again = by_name(S.compare(TABLE, n_resamples=2000, seed=1, test="welch"))
    assert again["geglu"].ci_delta == r["geglu"].ci_delta


def test_compare_verdict_rule_and_threshold() -> None:
    base = [0.0, 1.0, 2.0]  # mean 1, sigma 1, 2 df
    m = 4  # non-baseline methods
    thr = S.decision_threshold(1.0, m, n_baseline=3)
    assert thr == pytest.approx(scipy_stats.t.isf(0.05 / (2 * m), 2) * math.sqrt(1 + 1 / 3))
    table = {"baseline": base, "just_in": [1 + thr * 1.001], "just_out": [1 + thr * 0.999],
             "down": [1 - thr * 1.01], "flat": [1.0]}
    # the threshold is Bonferroni's (Holm's strictest step): exact for Bonferroni
    r = by_name(S.compare(table, correction="bonferroni", n_resamples=200))
    assert r["just_in"].verdict == Verdict.IMPROVER
    assert r["just_out"].verdict == Verdict.WITHIN_NOISE
    assert r["down"].verdict == Verdict.DEGRADER
    assert r["flat"].verdict == Verdict.WITHIN_NOISE
    # the |delta| > floor_sigmas * sigma guard: significant at alpha=0.5 with one test, not beyond
    # 2 sigma
    one = by_name(S.compare({"baseline": base, "m": [2.5]}, alpha=0.5, floor_sigmas=2.0,
                            n_resamples=200))
    assert one["m"].significant["holm"] and one["m"].verdict == Verdict.WITHIN_NOISE
    # correction choice changes the verdict: holm (the default) vs bonferroni. The fixture's
    # p-values, from scratch: a below alpha/3, b between alpha/3 and alpha/2, c far above.
    table2 = {"baseline": base, "a": [1 + 10.0], "b": [1 + 7.5], "c": [1 + 0.2]}
    p = {k: prediction_reference(v[0], base)[2] for k, v in table2.items() if k != "baseline"}
    assert p["a"] < 0.05 / 3 < p["b"] <= 0.05 / 2 and p["c"] > 0.05
    default = by_name(S.compare(table2, n_resamples=200))
    bon = by_name(S.compare(table2, correction="bonferroni", n_resamples=200))
    holm = by_name(S.compare(table2, correction="holm", n_resamples=200))
    none = by_name(S.compare(table2, correction="none", n_resamples=200))
    assert bon["b"].verdict == Verdict.WITHIN_NOISE and holm["b"].verdict == Verdict.IMPROVER
    assert default["b"].verdict == Verdict.IMPROVER  # Holm is the default
    assert bon["a"].verdict == holm["a"].verdict == Verdict.IMPROVER
    assert none["b"].verdict == Verdict.IMPROVER and none["c"].verdict == Verdict.WITHIN_NOISE
    # n_baseline=None: sigma taken as exact, the old normal threshold
    assert S.decision_threshold(1.0, m) == pytest.approx(scipy_stats.norm.isf(0.05 / (2 * m)))
    # n seeds: the interval of a mean of n seeds; "none": no correction; undefined sigma
    thr3 = S.decision_threshold(2.0, m, n=3, n_baseline=3, correction="none")
    assert thr3 == pytest.approx(2.0 * scipy_stats.t.isf(0.025, 2) * math.sqrt(2 / 3))
    assert S.decision_threshold(1.0, m, n=3, n_baseline=3, df=6) == pytest.approx(
        scipy_stats.t.isf(0.05 / (2 * m), 6) * math.sqrt(2 / 3))
    assert S.decision_threshold(0.1, 1, n=50, n_baseline=50, floor_sigmas=1.0) == 0.1
    assert math.isnan(S.decision_threshold(math.nan, m, n_baseline=3))


def test_prediction_test_matches_scipy_t_reference() -> None:
    """One seed against n_b baseline seeds: t = improvement / (s_b sqrt(1 + 1/n_b)), n_b - 1
    df, for several baseline sizes and both orientations, through method_test and compare."""
    rng = np.random.default_rng(12)
    for n_b in (2, 3, 5, 8):
        base = list(rng.normal(2.5, 0.02, n_b))
        for hib in (True, False):
            floor = S.noise_floor(base, higher_is_better=hib)
            for score in (2.5, 2.53, 2.41, 2.5 + 0.2 * rng.standard_normal()):
                t, df, p = prediction_reference(score, base, hib)
                got = S.method_test([score], floor)
                assert got.test == "prediction" and got.df == df == floor.df
                assert got.t == pytest.approx(t, rel=1e-12)
                assert got.p == pytest.approx(p, rel=1e-9, abs=1e-300)
                assert got.p == pytest.approx(
                    2 * scipy_stats.t.sf(abs(t), df), rel=1e-9, abs=1e-300)
            # the prediction interval: a seed exactly at its 95 % edge has p = 0.05
            b = np.asarray(base)
            edge = b.mean() + scipy_stats.t.isf(0.025, n_b - 1) * b.std(ddof=1) * math.sqrt(
                1 + 1 / n_b)
            assert S.method_test([edge], floor).p == pytest.approx(0.05, rel=1e-9)


def test_welch_in_compare_matches_scipy_and_orientation() -> None:
    base = [2.489, 2.492, 2.486]
    meth = [2.4771, 2.4790, 2.4760, 2.4801]
    ref = scipy_stats.ttest_ind(meth, base, equal_var=False)
    for hib, sign in ((True, 1.0), (False, -1.0)):
        r = by_name(S.compare({"baseline": base, "m": meth}, higher_is_better=hib,
                              n_resamples=50, test="welch"))["m"]
        assert r.test == "welch" and not r.fewer_seeds and r.n == 4
        assert r.t == pytest.approx(sign * ref.statistic, rel=1e-12)
        assert r.df == pytest.approx(ref.df, rel=1e-12)
        assert r.p == pytest.approx(ref.pvalue, rel=1e-9)
        assert r.welch is not None and r.welch.t == pytest.approx(ref.statistic)  # raw sign
    # two seeds (fewer than the baseline's three) still get Welch, flagged as fewer seeds
    two = by_name(S.compare({"baseline": base, "m": meth[:2]}, n_resamples=50,
                            test="welch"))["m"]
    ref2 = scipy_stats.ttest_ind(meth[:2], base, equal_var=False)
    assert two.test == "welch" and two.fewer_seeds
    assert two.p == pytest.approx(ref2.pvalue, rel=1e-9)


def test_method_test_edges() -> None:
    floor = S.noise_floor(BASE)
    assert S.method_test([], floor).test == "none"
    assert math.isnan(S.method_test([None], floor).p)
    assert S.method_test([0.5], S.noise_floor([0.48])).test == "none"  # no floor
    with pytest.raises(ValueError):
        S.method_test([0.49, 0.5], floor)  # Welch needs the baseline's seeds
    zero = S.noise_floor([0.5, 0.5, 0.5], higher_is_better=False)
    up = S.method_test([0.4], zero)  # lower is better: an improvement, sigma = 0
    assert up.t == math.inf and up.p == 0.0
    assert S.method_test([0.5], zero).p == 1.0
    both = S.method_test([0.6, 0.6], zero, [0.5, 0.5, 0.5])
    assert both.test == "welch" and both.t == -math.inf and both.p == 0.0
    assert math.isnan(both.df)


def test_compare_lower_is_better_and_sigma_choices() -> None:
    table = {"baseline": [2.489, 2.492, 2.486], "qk": [2.4771, 2.4790, 2.4760],
             "ssmax": [2.5630], "sp": [2.4814, 2.4801, 2.4830]}
    r = by_name(S.compare(table, higher_is_better=False, n_resamples=500, test="welch"))
    assert r["qk"].delta < 0 and r["qk"].improvement > 0 and r["qk"].z > 0
    assert r["qk"].verdict == Verdict.IMPROVER and r["ssmax"].verdict == Verdict.DEGRADER
    assert r["qk"].prob_not_better == 0.0
    pooled = by_name(S.compare(table, higher_is_better=False, references=["qk", "sp"],
                               sigma="pooled", n_resamples=100, test="welch"))
    sig = S.pooled_std([table["baseline"], table["qk"], table["sp"]])
    assert pooled["qk"].floor.sigma == pytest.approx(sig)
    assert pooled["qk"].floor.df == 6  # 2 + 2 + 2
    assert pooled["qk"].z == pytest.approx(
        -(np.mean(table["qk"]) - np.mean(table["baseline"])) / sig)
    # the prediction test with a pooled floor: that sigma, the pooled df, n_b of the baseline
    t = -(2.5630 - np.mean(table["baseline"])) / (sig * math.sqrt(1 + 1 / 3))
    assert pooled["ssmax"].t == pytest.approx(t) and pooled["ssmax"].df == 6
    assert pooled["ssmax"].p == pytest.approx(2 * scipy_stats.t.sf(abs(t), 6), rel=1e-9)
    mx = by_name(S.compare(table, references=["qk", "sp"], sigma="max", n_resamples=100,
                           test="welch"))
    sx = max(np.std(table[k], ddof=1) for k in ("baseline", "qk", "sp"))
    assert mx["sp"].floor.sigma == pytest.approx(sx) and mx["sp"].floor.df == 6
    t = (2.5630 - np.mean(table["baseline"])) / (sx * math.sqrt(1 + 1 / 3))
    assert mx["ssmax"].p == pytest.approx(2 * scipy_stats.t.sf(abs(t), 6), rel=1e-9)
    assert S.noise_floor(table["baseline"]).df == 2
    assert math.isnan(S.noise_floor([2.5]).df)


def test_compare_identical_baseline_seeds() -> None:
    """No verdict from zero spread. (The old rule took sigma = 0 as certainty: a method 0.01
    above three identical baseline seeds was an improver with p = 0; now undetermined.)"""
    table = {"baseline": [0.5, 0.5, 0.5], "up": [0.51], "same": [0.5], "twin": [0.5, 0.5]}
    for test in ("auto", "welch", "pooled"):
        r = by_name(S.compare(table, n_resamples=100, test=test))  # type: ignore[arg-type]
        for m in ("up", "same", "twin"):
            assert r[m].verdict == Verdict.UNDETERMINED, (test, m)
            assert math.isnan(r[m].p) and "resolution" in r[m].note
            assert math.isnan(r[m].p_adjusted["holm"])
        assert r["up"].z == math.inf  # the descriptive z keeps its sigma = 0 convention
    # a spread below the resolution (1e-6 of the mean) is the same; above it, a verdict
    tiny = {"baseline": [1.0, 1.0 + 1e-9, 1.0 - 1e-9], "up": [1.001, 1.001 + 1e-9]}
    assert by_name(S.compare(tiny, n_resamples=10))["up"].verdict == Verdict.UNDETERMINED
    resolved = by_name(S.compare(tiny, n_resamples=10, resolution=1e-12))["up"]
    assert resolved.verdict == Verdict.IMPROVER
    # zero spread in the pooled error term although the baseline varies cannot happen; a
    # constant method against a varying baseline is fine (its spread is the baseline's)
    ok = by_name(S.compare({"baseline": [1.0, 1.1, 0.9], "m": [1.0, 1.0, 1.0]},
                           n_resamples=10))["m"]
    assert ok.verdict == Verdict.WITHIN_NOISE and math.isfinite(ok.p)


def test_compare_one_seed_baseline_is_undetermined() -> None:
    table = {"baseline": [0.48], "a": [0.60], "b": [0.47, 0.46]}
    r = by_name(S.compare(table, n_resamples=100))
    assert not r["a"].floor.defined
    assert r["a"].verdict == r["b"].verdict == Verdict.UNDETERMINED
    assert math.isnan(r["a"].z) and math.isnan(r["a"].p_adjusted["holm"])
    assert r["a"].test == r["b"].test == "none" and math.isnan(r["a"].t)
    assert r["a"].delta == pytest.approx(0.12)  # delta still reported
    assert r["baseline"].verdict == Verdict.BASELINE
    assert r["b"].welch is None  # baseline has one seed


def test_compare_diverged_and_nan_seeds() -> None:
    """Failures are judged as rates. (The old rule labelled a method "diverged" for one
    failed seed of 3; now its survivors are compared and its rate is tested.)"""
    table = {
        "baseline": {42: 0.4829, 43: 0.4841, 44: 0.4817},
        "partly": {42: 0.49, 43: math.nan, 44: 0.495},
        "all_nan": [math.nan, None],
        "flagged": [0.50],
        "ok": {42: 0.4832, 43: 0.4850, 44: 0.4820},
    }
    res = by_name(S.compare(table, diverged=["flagged"], n_resamples=300))
    # one failed seed of 3 against none of 3: Fisher p = 1; judged on its 2 survivors
    assert res["partly"].verdict == Verdict.IMPROVER and res["partly"].n == 2
    assert res["partly"].p_failures == pytest.approx(1.0)
    assert "2 surviving seeds" in res["partly"].note and "1 of 3" in res["partly"].note
    assert res["partly"].n_diverged == 1 and res["partly"].mean == pytest.approx(0.4925)
    # every seed failed: nothing to compare, so the failure is the verdict
    assert res["all_nan"].verdict == Verdict.DIVERGED and res["all_nan"].n_diverged == 2
    fisher = scipy_stats.fisher_exact([[2, 0], [0, 3]]).pvalue
    assert res["all_nan"].p_failures == pytest.approx(fisher)
    assert "no seed survived" in res["all_nan"].note
    assert res["flagged"].verdict == Verdict.DIVERGED
    assert math.isnan(res["flagged"].p_adjusted["bonferroni"])
    assert math.isnan(res["flagged"].p_failures)  # flagged by the caller: not tested
    # the family: the score tests of partly and ok; the rate tests (1 of 3 and 2 of 2
    # against 0 of 3) cannot reach alpha at these counts and are left out
    assert res["ok"].p_adjusted["bonferroni"] == pytest.approx(min(1.0, 2 * res["ok"].p))
    assert "cannot reach α" in res["all_nan"].note
    assert res["ok"].paired  # same seed labels -> paired bootstrap
    assert not S.compare(table, paired=False, n_resamples=50)[-1].paired


def test_failure_rates_fisher_in_the_family() -> None:
    rng = np.random.default_rng(3)
    base = list(rng.normal(3.0, 0.01, 10))
    # 8 of 10 stalled against none: shown to fail more often, whatever its survivors say
    table = {"baseline": base, "bad": [3.0, 3.01] + [None] * 8,
             "one_off": [*rng.normal(3.0, 0.01, 9), None]}
    r = by_name(S.compare(table, higher_is_better=False, stalled={"bad": 8, "one_off": 1},
                          n_resamples=10))
    p_bad = scipy_stats.fisher_exact([[8, 2], [0, 10]]).pvalue
    assert r["bad"].p_failures == pytest.approx(p_bad)
    # one_off's rate test (1 of 10 against 0 of 10) cannot reach alpha: not in the family
    ps = [r["bad"].p_failures, r["bad"].p, r["one_off"].p]
    holm = multitest.multipletests(ps, method="holm")[1]
    assert r["bad"].p_failures_adjusted == pytest.approx(holm[0])
    assert math.isnan(r["one_off"].p_failures_adjusted)
    assert r["one_off"].p_adjusted["holm"] == pytest.approx(holm[2])
    assert r["bad"].verdict == Verdict.STALLED and "fail more often" in r["bad"].note
    assert r["bad"].n_stalled == 8 and r["bad"].n_diverged == 0
    # 1 of 10: not a label; compared on its 9 survivors
    assert r["one_off"].verdict == Verdict.WITHIN_NOISE
    assert "9 surviving seeds" in r["one_off"].note
    # a baseline with a failed seed keeps its floor only with 3 survivors
    two_left = by_name(S.compare({"baseline": [1.0, 1.1, None], "m": [5.0, 5.1, 5.2]},
                                 n_resamples=10))
    assert not two_left["m"].floor.defined and two_left["m"].verdict == Verdict.UNDETERMINED
    assert two_left["baseline"].verdict == Verdict.DIVERGED
    assert "no noise floor" in two_left["baseline"].note
    three_left = by_name(S.compare({"baseline": [1.0, 1.1, 0.9, None], "m": [5.0, 5.1, 5.2]},
                                   n_resamples=10))
    assert three_left["m"].floor.defined and three_left["m"].verdict == Verdict.IMPROVER


def test_compare_empty_missing_and_single_method() -> None:
    assert S.compare({}) == []
    with pytest.raises(KeyError):
        S.compare({"a": [1.0]})
    with pytest.raises(ValueError):
        S.compare({"baseline": [1.0, 2.0]}, correction="sidak")  # type: ignore[arg-type]
    only = S.compare({"baseline": BASE}, n_resamples=100)
    assert len(only) == 1 and only[0].verdict == Verdict.BASELINE
    single = by_name(S.compare({"baseline": BASE, "m": [0.4922]}, n_resamples=100))
    assert single["m"].p_adjusted["bonferroni"] == pytest.approx(single["m"].p)
    assert single["m"].p_adjusted["bh"] == pytest.approx(single["m"].p)
    empty_method = by_name(S.compare({"baseline": BASE, "m": []}, n_resamples=100))
    assert empty_method["m"].verdict == Verdict.UNDETERMINED and empty_method["m"].n == 0
    no_base = by_name(S.compare({"baseline": None, "m": [0.5, 0.6]}, n_resamples=100))
    assert no_base["baseline"].verdict == Verdict.DIVERGED
    assert no_base["m"].verdict == Verdict.UNDETERMINED


def test_compare_paired_true_pairs_equal_length_lists() -> None:
    r = by_name(S.compare({"baseline": BASE, "a": SOFTPICK, "b": [0.49]}, paired=True,
                          n_resamples=200, seed=3))
    assert r["a"].paired and not r["b"].paired
    ref = S.bootstrap_difference(SOFTPICK, BASE, paired=True, n_resamples=200, seed=3)
    assert r["a"].ci_delta == ref.ci


def test_decide_directly() -> None:
    kw = {"sigma": 1.0, "alpha": 0.05}
    assert S.decide(improvement=5.0, p_adjusted=0.001, **kw) == "improver"
    assert S.decide(improvement=-5.0, p_adjusted=0.001, **kw) == "degrader"
    assert S.decide(improvement=0.5, p_adjusted=0.001, **kw) == "within_noise"
    assert S.decide(improvement=5.0, p_adjusted=0.2, **kw) == "within_noise"
    assert S.decide(improvement=5.0, p_adjusted=math.nan, **kw) == "undetermined"
    assert S.decide(improvement=5.0, p_adjusted=0.0, sigma=math.nan) == "undetermined"
    assert S.decide(improvement=5.0, p_adjusted=0.0, diverged=True, **kw) == "diverged"


# ---------------------------------------------------------------- until-decided


def test_undecided_straddling_intervals() -> None:
    base = [0.0, 1.0, 2.0]  # mean 1, sigma 1, 2 df
    floor = S.noise_floor(base)
    table = {
        "baseline": base,
        "clear_up": [10.0, 10.1],  # far above
        "clear_flat": [1.0] * 9,  # interval ±2.87 around 0
        "edge": [1 + 3.0],  # interval 3 ± 4.97 contains thr = 3
        "edge_down": [1 - 2.8, 1 - 3.2],
        "capped": [1 + 3.0, 1 + 3.0, 1 + 3.0],
        "div": None,
        "nodata": [],
    }
    reqs = S.undecided(table, floor, threshold=3.0, max_seeds=3)
    got = {r.method: r for r in reqs}
    assert list(got) == ["edge", "edge_down", "capped", "nodata"]
    q = scipy_stats.t.isf(0.025, 2)  # t reference, n_b - 1 = 2 df

    def half(n: int) -> float:
        return q * math.sqrt(1 / n + 1 / 3)

    assert got["edge"].interval == pytest.approx((3.0 - half(1), 3.0 + half(1)))
    assert got["edge_down"].interval == pytest.approx((-3 - half(2), -3 + half(2)))
    assert half(9) < 3.0  # clear_flat's interval stays inside ±3
    assert got["capped"].capped and not got["edge"].capped
    assert got["nodata"].reason == "no_data" and got["edge"].reason == "straddles"
    # default threshold: each method's own decision threshold (Holm/Bonferroni over the 6 live
    # methods, its n, the baseline's n and df)
    default = {r.method: r for r in S.undecided(table, floor)}
    assert list(default) == ["clear_up", "nodata"]  # far thresholds at 2 df: 9.95 for n = 2
    for name, n in (("clear_up", 2), ("nodata", 1)):  # no data: the one-seed threshold
        want = scipy_stats.t.isf(0.05 / 12, 2) * math.sqrt(1 / n + 1 / 3)
        assert default[name].threshold == pytest.approx(want)
        assert default[name].threshold == pytest.approx(
            S.decision_threshold(1.0, 6, n=n, n_baseline=3))
    # lower is better flips the interval
    lf = S.noise_floor(base, higher_is_better=False)
    low = {r.method: r for r in S.undecided({"m": [1 - 3.0]}, lf, threshold=3.0)}
    assert low["m"].interval[0] < 3.0 < low["m"].interval[1]


def test_undecided_follows_the_verdict() -> None:
    """A one-seed method is undecided exactly when its prediction-test verdict could still
    change: here, in a family of 3, 5 sigma above a 3-seed baseline is not yet an improver (and
    listed), 20 sigma is (and not listed), 0 sigma is settled within the noise."""
    base = [3.0, 3.1, 2.9]  # sigma 0.1
    table = {"baseline": base, "five": [3.5], "twenty": [5.0], "flat": [3.0]}
    floor = S.noise_floor(base)
    res = by_name(S.compare(table, n_resamples=50))
    assert res["five"].verdict == Verdict.WITHIN_NOISE and res["twenty"].verdict == "improver"
    assert res["flat"].verdict == Verdict.WITHIN_NOISE
    assert [r.method for r in S.undecided(table, floor)] == ["five"]


def test_undecided_without_floor_asks_for_baseline_seeds() -> None:
    reqs = S.undecided({"baseline": [0.5], "m": [0.6]}, S.noise_floor([0.5]), max_seeds=5)
    assert [(r.method, r.reason, r.capped) for r in reqs] == [("baseline", "no_floor", False)]
    assert S.undecided({}, S.noise_floor(BASE)) == []


def test_undecided_zero_sigma_never_straddles() -> None:
    floor = S.noise_floor([0.5, 0.5, 0.5])
    assert S.undecided({"baseline": [0.5] * 3, "same": [0.5], "up": [0.6]}, floor) == []


# ---------------------------------------------------------------- the pooled error term


def test_pooled_error_term_when_variances_look_equal() -> None:
    """Brown–Forsythe does not reject: every method is tested with the error term of all
    groups (df = sum(n_i - 1)); it rejects: the prediction test / Welch, and the result says
    which test decided."""
    rng = np.random.default_rng(7)
    base = list(rng.normal(2.0, 0.02, 3))
    table = {"baseline": base, "a": list(rng.normal(1.9, 0.02, 3)),
             "b": list(rng.normal(2.0, 0.02, 3)), "c": [2.01]}
    groups = [table["baseline"], table["a"], table["b"]]
    hom = scipy_stats.levene(*groups, center="median").pvalue
    assert hom > S.HOMOGENEITY_ALPHA
    r = by_name(S.compare(table, higher_is_better=False, n_resamples=10))
    sp = S.pooled_std(groups)
    for m in ("a", "b", "c"):
        n = len(table[m])  # type: ignore[arg-type]
        t = -(np.mean(table[m]) - np.mean(base)) / (sp * math.sqrt(1 / n + 1 / 3))  # type: ignore[arg-type]
        assert r[m].test == "pooled" and r[m].df == 6
        assert r[m].t == pytest.approx(t, rel=1e-12)
        assert r[m].p == pytest.approx(2 * scipy_stats.t.sf(abs(t), 6), rel=1e-9)
        assert r[m].homogeneity_p == pytest.approx(hom)
    # the same as scipy's pooled two-sample t when there is one method
    two = by_name(S.compare({"baseline": base, "a": table["a"]}, n_resamples=10))["a"]
    ref = scipy_stats.ttest_ind(table["a"], base, equal_var=True)
    assert two.test == "pooled" and two.p == pytest.approx(ref.pvalue, rel=1e-9)
    # a wildly spread method makes the check reject: the fallback tests
    wild = {"baseline": [1.0, 1.001, 0.999, 1.0005, 0.9995],
            "x": [1.0, 1.002, 0.998, 1.001, 0.999], "y": [1.0, 1.001, 0.999, 1.0, 1.0],
            "z": [0.0, 2.0, 1.0, 3.0, -1.0]}
    assert S.homogeneity(wild.values()) <= S.HOMOGENEITY_ALPHA
    w = by_name(S.compare(wild, n_resamples=10))
    assert {w[m].test for m in ("x", "y", "z")} == {"welch"}
    assert by_name(S.compare(wild, n_resamples=10, test="pooled"))["z"].test == "pooled"
    with pytest.raises(ValueError):
        S.compare(wild, test="dunnett")  # type: ignore[arg-type]
    assert math.isnan(S.homogeneity([[1.0, 2.0]]))


def test_intervals_and_detectable_effect() -> None:
    """Every compared method has the test's interval for delta (Bonferroni-simultaneous over
    the compared methods) and its minimum detectable effect at 80 % power; within noise with
    |delta| < MDE reads "not shown"."""
    base = [0.0, 1.0, 2.0, 0.5, 1.5]
    table = {"baseline": base, "a": [1.2, 2.0, 0.4], "b": [5.0, 6.0, 5.5]}
    r = by_name(S.compare(table, n_resamples=10))
    sp = S.pooled_std(list(table.values()))
    df = 4 + 2 + 2
    q = scipy_stats.t.isf(0.05 / (2 * 2), df)
    for m in ("a", "b"):
        se = sp * math.sqrt(1 / 3 + 1 / 5)
        assert r[m].ci == pytest.approx((r[m].delta - q * se, r[m].delta + q * se))
        assert r[m].ci_level == 0.95
        # the MDE: power 0.8 at alpha/2 with the noncentral t (statsmodels' formula)
        d = r[m].mde_sigma
        assert r[m].mde == pytest.approx(d * sp)
        power = TTestIndPower().power(d, nobs1=3, alpha=0.05 / 2, ratio=5 / 3, df=df)
        assert power == pytest.approx(0.8, abs=1e-4)
    assert r["b"].verdict == Verdict.IMPROVER and r["b"].ci[0] > 0
    assert r["a"].verdict == Verdict.WITHIN_NOISE and abs(r["a"].delta) < r["a"].mde
    assert r["a"].note.startswith("not shown: |Δ| < MDE")
    assert math.isnan(r["baseline"].mde) and math.isnan(r["baseline"].ci[0])
    # the guard: never below floor_sigmas; more seeds, a smaller MDE
    assert S.detectable_effect(50, 50, 98, floor_sigmas=1.0) == 1.0
    assert S.detectable_effect(10, 10, 18) < S.detectable_effect(3, 3, 4)
    assert math.isnan(S.detectable_effect(1, 1, 0))
