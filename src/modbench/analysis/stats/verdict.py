"""The verdict rule (docs/statistics.md): which methods beat the baseline, as a pipeline of
named steps, each a small function that mirrors a section of the page.

:func:`compare` runs them in this order (:data:`PIPELINE`):

1. :func:`read_inputs`: the table, orientation and failed seeds ("Inputs and orientation");
2. :func:`failure_rates`: each method's failed seeds as a rate, Fisher's exact test against
   the baseline's ("Failures judged as rates");
3. :func:`floor_of`: the noise floor, and whether a verdict may rest on it ("Noise floor");
4. :func:`choose_test`: the Brown–Forsythe check and the score test it picks, the pooled t or
   each method's own ("The test per method");
5. :func:`run_tests`: that test for every compared method (a registered :class:`ScoreTest`,
   :mod:`modbench.analysis.stats.rule`);
6. :func:`intervals`: each test's Bonferroni-simultaneous interval for delta ("Effect sizes,
   intervals and the detectable effect");
7. :func:`detectable_effects`: the minimum detectable effect at the design (same section);
8. :func:`correct`: the correction family of score and failure-rate tests ("Multiple
   comparisons");
9. :func:`verdicts`: the verdict and its note ("Verdicts");
10. :func:`describe`: each method's :class:`MethodResult`, with the descriptive z and seed
    bootstrap ("z: the effect size", "Seed bootstrap").

The rule's options are one :class:`~modbench.analysis.stats.rule.VerdictRule`. The built-in
score tests, ``"pooled"`` and ``"welch"``, are registered below as any new test would be.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Final, Literal

import numpy as np

from modbench.analysis.stats.bootstrap import (
    DEFAULT_RESAMPLES,
    BootstrapDifference,
    bootstrap_difference,
    bootstrap_mean_ci,
    can_pair,
)
from modbench.analysis.stats.corrections import CORRECTIONS, Correction, adjust_pvalues
from modbench.analysis.stats.distributions import t_isf, t_p
from modbench.analysis.stats.floor import (
    NoiseFloor,
    SigmaSource,
    noise_floor,
    pooled,
    sample_std,
    z_score,
)
from modbench.analysis.stats.rule import (
    NOT_TESTED,
    RESOLUTION,
    SCORE_TESTS,
    Design,
    TestOutcome,
    VerdictRule,
    score_test,
)
from modbench.analysis.stats.scores import NAN, Group, Scores, group
from modbench.analysis.stats.tests import (
    HOMOGENEITY_ALPHA,
    WelchResult,
    detectable_effect,
    fisher,
    fisher_min_p,
    homogeneity,
    method_test,
)

#: The labels of the test column: which test decided a method (see :func:`choose_test`).
TESTS: tuple[str, ...] = ("pooled", "prediction", "welch", "none")

#: The steps of :func:`compare`, in order, each with the section of docs/statistics.md it
#: follows (``results.json``'s rule record lists them).
PIPELINE: Final = (
    ("read_inputs", "Inputs and orientation"),
    ("failure_rates", "Failures judged as rates"),
    ("floor_of", "Noise floor"),
    ("choose_test", "The test per method"),
    ("run_tests", "The test per method"),
    ("intervals", "Effect sizes, intervals and the detectable effect"),
    ("detectable_effects", "Effect sizes, intervals and the detectable effect"),
    ("correct", "Multiple comparisons"),
    ("verdicts", "Verdicts"),
    ("describe", "z: the effect size; Seed bootstrap"),
)


class Verdict(StrEnum):
    """Outcome for one method (compares equal to its string value)."""

    BASELINE = "baseline"
    IMPROVER = "improver"
    WITHIN_NOISE = "within_noise"
    DEGRADER = "degrader"
    DIVERGED = "diverged"
    STALLED = "stalled"
    UNDETERMINED = "undetermined"


@dataclass(frozen=True)
class MethodResult:
    """Everything the report needs about one configuration (see :func:`compare`)."""

    method: str
    is_baseline: bool
    n: int  # finite seeds
    n_diverged: int  # failed seeds that diverged (n_stalled: those that stalled)
    fewer_seeds: bool  # n < the baseline's finite seeds (its verdict rests on less)
    mean: float
    std: float  # ddof=1, NaN with < 2 seeds
    delta: float  # mean - baseline mean (raw units)
    improvement: float  # delta signed so that positive = better
    z: float  # improvement / floor sigma: descriptive effect size
    test: str  # "pooled" | "prediction" (1 seed) | "welch" (>= 2 seeds) | "none"
    t: float  # the test's statistic, signed like improvement
    df: float  # the test's degrees of freedom
    p: float  # the test's two-sided p
    p_adjusted: Mapping[str, float]  # bonferroni / holm / bh
    significant: Mapping[str, bool]  # none / bonferroni / holm / bh (p <= alpha)
    ci_mean: tuple[float, float]
    ci_delta: tuple[float, float]
    prob_not_better: float
    paired: bool
    welch: WelchResult | None
    verdict: Verdict
    floor: NoiseFloor
    n_stalled: int = 0  # failed seeds that stalled (compare's ``stalled``)
    # why the verdict is what it is, in words ("" when the verdict says it all)
    note: str = ""
    ci: tuple[float, float] = (NAN, NAN)  # the test's interval for delta (raw units)
    ci_level: float = NAN  # its simultaneous coverage (Bonferroni over the compared methods)
    mde: float = NAN  # minimum detectable |delta| at MDE_POWER (metric units)
    mde_sigma: float = NAN  # the same in sigmas of the test's error term
    p_failures: float = NAN  # Fisher's exact p of its failure rate against the baseline's
    p_failures_adjusted: float = NAN  # the same, corrected in the verdict's family
    homogeneity_p: float = NAN  # Brown–Forsythe p of the scale (decides pooled vs Welch)

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python dict (verdict as its string; NaN / inf kept as floats)."""
        d = asdict(self)
        d["verdict"] = str(self.verdict)
        d["p_adjusted"] = dict(self.p_adjusted)
        d["significant"] = dict(self.significant)
        return d


def decide(
    *,
    improvement: float,
    p_adjusted: float,
    sigma: float,
    alpha: float = 0.05,
    floor_sigmas: float = 1.0,
    diverged: bool = False,
    stalled: bool = False,
) -> Verdict:
    """The verdict rule, in order:

    1. ``diverged`` → DIVERGED; else ``stalled`` → STALLED (failures, whatever the scores);
    2. improvement, p or sigma not finite (no noise floor, no finite score) → UNDETERMINED;
    3. ``p_adjusted <= alpha`` and ``|improvement| > floor_sigmas * sigma`` → IMPROVER if the
       improvement is positive, DEGRADER if negative;
    4. otherwise WITHIN_NOISE.
    """
    if diverged:
        return Verdict.DIVERGED
    if stalled:
        return Verdict.STALLED
    if not (math.isfinite(improvement) and math.isfinite(sigma)) or math.isnan(p_adjusted):
        return Verdict.UNDETERMINED
    if p_adjusted <= alpha and abs(improvement) > floor_sigmas * sigma:
        return Verdict.IMPROVER if improvement > 0 else Verdict.DEGRADER
    return Verdict.WITHIN_NOISE


# --------------------------------------------------------------------------------------------
# 1. Inputs and orientation


@dataclass(frozen=True)
class Inputs:
    """The table as the rule reads it: each configuration's seeds normalised
    (:func:`~modbench.analysis.stats.scores.group`), the orientation, the methods the caller
    flags as diverged and each configuration's stalled seeds."""

    table: Mapping[str, Scores]
    baseline: str
    groups: Mapping[str, Group]
    higher_is_better: bool
    flagged: frozenset[str]
    n_stalled: Mapping[str, int]

    @property
    def base(self) -> Group:
        return self.groups[self.baseline]

    @property
    def compared(self) -> tuple[str, ...]:
        """The methods whose surviving seeds are compared: not the baseline, not flagged,
        with a finite seed."""
        return tuple(m for m in self.table if m != self.baseline and m not in self.flagged
                     and self.groups[m].n > 0)


def read_inputs(table: Mapping[str, Scores], baseline: str, *, higher_is_better: bool,
                diverged: Collection[str], stalled: Mapping[str, int] | None) -> Inputs:
    """The table normalised; a stall count larger than a configuration's failed (``None``)
    seeds is refused (ValueError)."""
    groups = {m: group(s) for m, s in table.items()}
    n_stalled = {m: int((stalled or {}).get(m, 0)) for m in table}
    for m, k in n_stalled.items():
        if not 0 <= k <= groups[m].n_diverged:
            raise ValueError(f"stalled[{m!r}] = {k}, but {m!r} has {groups[m].n_diverged} "
                             "failed (None) seeds; give a stalled seed's score as None")
    return Inputs(table, baseline, groups, higher_is_better, frozenset(diverged), n_stalled)


# --------------------------------------------------------------------------------------------
# 2. Failures judged as rates


@dataclass(frozen=True)
class FailureRates:
    """Each configuration's failed seeds of its total, whether its failures count as diverged
    (any diverged seed, or flagged) rather than stalled, Fisher's exact p against the
    baseline's rate (NaN where neither failed), and whether that test joins the correction
    family (it can reach alpha at these counts: Tarone 1990)."""

    failed: Mapping[str, int]
    total: Mapping[str, int]
    diverged: Mapping[str, bool]
    p: Mapping[str, float]
    in_family: Mapping[str, bool]

    def rate(self, method: str) -> float:
        return self.failed[method] / self.total[method] if self.total[method] else 0.0


def failure_rates(data: Inputs, rule: VerdictRule) -> FailureRates:
    """Each method's k failed seeds of n against the baseline's, by Fisher's exact test
    (:func:`~modbench.analysis.stats.tests.fisher`), for each method where it or the baseline
    has a failed seed; the test is in the family when its smallest possible p is <= alpha
    (:func:`~modbench.analysis.stats.tests.fisher_min_p`). A flagged method's seeds all count
    as failed, and it is not tested."""
    b, groups, flagged = data.baseline, data.groups, data.flagged
    is_div = {m: g.n_diverged > data.n_stalled[m] or m in flagged for m, g in groups.items()}
    failed = {m: (len(g.values) if m in flagged else g.n_diverged) for m, g in groups.items()}
    total = {m: max(len(g.values), failed[m]) for m, g in groups.items()}
    p = {m: NAN for m in data.table}
    for m in data.table:
        if (m != b and m not in flagged and failed[m] + failed[b] > 0 and total[b] > 0
                and total[m] > 0):
            p[m] = fisher(failed[m], total[m], failed[b], total[b])
    in_family = {m: math.isfinite(p[m])
                 and fisher_min_p(total[m], total[b], failed[m] + failed[b]) <= rule.alpha
                 for m in data.table}
    return FailureRates(failed, total, is_div, p, in_family)


# --------------------------------------------------------------------------------------------
# 3. Noise floor


@dataclass(frozen=True)
class Floor:
    """The noise floor the verdicts rest on; ``baseline_note``, why a baseline with failed
    seeds has none; ``zero_spread``, why no verdict may rest on its sigma (below the
    resolution), "" when one may."""

    floor: NoiseFloor
    baseline_note: str = ""
    zero_spread: str = ""


def floor_of(data: Inputs, references: Sequence[str], rule: VerdictRule) -> Floor:
    """:func:`~modbench.analysis.stats.floor.noise_floor` of the baseline (and the references
    present, for ``sigma="pooled" | "max"``). A baseline with failed seeds keeps it only with
    ``rule.min_surviving_baseline`` finite seeds; a sigma at or below ``rule.resolution``
    times |mean| is no ground for a verdict."""
    table, b = data.table, data.baseline
    floor = noise_floor(
        table[b],
        higher_is_better=data.higher_is_better,
        references={r: table[r] for r in references if r in table and r != b},
        sigma=rule.sigma,
    )
    base = data.base
    note = ""
    base_failed = base.n_diverged > 0 or b in data.flagged
    if base_failed and floor.defined and base.n < rule.min_surviving_baseline:
        note = (f"{base.n_diverged} failed seeds leave {base.n} finite: fewer than "
                f"{rule.min_surviving_baseline}, no noise floor")
        floor = NoiseFloor(**{**asdict(floor), "sigma": NAN, "df": NAN})
    zero = ""
    if floor.defined and floor.sigma <= rule.resolution * abs(floor.mean):
        zero = (f"baseline σ = {floor.sigma:.3g} is below the resolution "
                f"({rule.resolution:g} of the mean): no verdict from zero spread")
    return Floor(floor, note, zero)


# --------------------------------------------------------------------------------------------
# 4. The test per method: the choice


def choose_test(data: Inputs, floor: Floor, rule: VerdictRule) -> Design:
    """The design the score tests see, and the test chosen: with ``rule.test == "auto"`` the
    pooled t when the Brown–Forsythe check over the baseline and the compared methods does not
    reject at ``rule.homogeneity_alpha`` and some method has 2 seeds (else the pooled term is
    the baseline's own and the pooled t the prediction test), otherwise ``"welch"`` (each
    method's own test); any other ``rule.test`` as named."""
    base = data.base
    compared = data.compared
    groups = [base.finite, *(data.groups[m].finite for m in compared)]
    hom_p = homogeneity(groups)
    pooled_s, pooled_df = pooled(groups)
    shared = pooled_df > base.n - 1
    test = rule.test
    if test == "auto":
        test = "pooled" if shared and not hom_p <= rule.homogeneity_alpha else "welch"
    seeds = {m: g.finite for m, g in data.groups.items()}
    return Design(data.baseline, seeds, floor.floor, compared, pooled_s, pooled_df, hom_p,
                  test, rule)


# --------------------------------------------------------------------------------------------
# 5. The tests. The two built-in score tests, registered as any other would be.


@score_test("pooled")
def pooled_t(design: Design, method: str) -> TestOutcome:
    """The pooled t: one error term shared by the baseline and every compared method,
    ``t = improvement / (s_p sqrt(1/n + 1/n_b))`` with ``df = sum(n_i - 1)``."""
    x, floor = design.seeds[method], design.floor
    s_p, df = design.pooled_sigma, float(design.pooled_df)
    if not s_p > design.rule.resolution * abs(floor.mean):
        return TestOutcome("pooled", NAN, df, NAN, scale=s_p,
                           note=f"pooled σ = {s_p:.3g} is below the resolution: no verdict "
                                "from zero spread")
    se = s_p * math.sqrt(1.0 / x.size + 1.0 / floor.n)
    t = design.improvement(method) / se
    return TestOutcome("pooled", t, df, t_p(t, df, "two-sided"), se=se, scale=s_p)


@score_test("welch", label="none")
def own_test(design: Design, method: str) -> TestOutcome:
    """Each method's own test (:func:`~modbench.analysis.stats.tests.method_test`): the
    prediction test for one seed, Welch's t for more."""
    x, floor = design.seeds[method], design.floor
    mt = method_test(x, floor, design.baseline_seeds)
    spread = floor.sigma if x.size == 1 else max(floor.sigma, sample_std(x))
    if not spread > design.rule.resolution * abs(floor.mean) or not math.isfinite(mt.t):
        return TestOutcome(mt.test, NAN, mt.df, NAN, scale=floor.sigma, welch=mt.welch,
                           note="the seeds' spread is below the resolution: no verdict from "
                                "zero spread")
    imp = design.improvement(method)
    se = abs(imp / mt.t) if mt.t != 0.0 else (
        floor.sigma * math.sqrt(1.0 + 1.0 / floor.n) if x.size == 1
        else math.sqrt(float(np.var(x, ddof=1)) / x.size + floor.baseline_std ** 2 / floor.n))
    return TestOutcome(mt.test, mt.t, mt.df, mt.p, se=se, scale=floor.sigma, welch=mt.welch)


def run_tests(design: Design, floor: Floor) -> dict[str, TestOutcome]:
    """The chosen score test (:data:`~modbench.analysis.stats.rule.SCORE_TESTS`) of every
    compared method, when there is a noise floor; none where its sigma is below the resolution
    (the outcome says why); every other configuration :data:`NOT_TESTED`."""
    spec = SCORE_TESTS[design.test]
    out = {m: NOT_TESTED for m in design.seeds}
    if not design.floor.defined:
        return out
    for m in design.compared:
        if floor.zero_spread:
            out[m] = TestOutcome(spec.label, NAN, NAN, NAN, note=floor.zero_spread)
        else:
            out[m] = spec.run(design, m)
    return out


def scored(design: Design, tests: Mapping[str, TestOutcome]) -> list[str]:
    """The compared methods whose test gave a p: the score tests of the family."""
    return [m for m in design.compared if math.isfinite(tests[m].p)]


# --------------------------------------------------------------------------------------------
# 6.-7. Effect sizes, intervals and the detectable effect


def intervals(design: Design, tests: Mapping[str, TestOutcome]
              ) -> dict[str, tuple[float, float]]:
    """Each tested method's interval for delta (raw units), ``delta ± t^-1(1 - alpha/2m; df)
    SE`` with the test's SE and df, m the number of methods with a p: Bonferroni-simultaneous
    at ``1 - alpha``. Methods without a finite SE and df have none."""
    m_ci = max(1, len(scored(design, tests)))
    out: dict[str, tuple[float, float]] = {}
    for m, o in tests.items():
        if m != design.baseline and math.isfinite(o.se) and math.isfinite(o.df):
            delta = float(design.seeds[m].mean()) - design.floor.mean
            q = t_isf(design.rule.alpha / (2.0 * m_ci), o.df)
            out[m] = (delta - q * o.se, delta + q * o.se)
    return out


def detectable_effects(design: Design, tests: Mapping[str, TestOutcome],
                       ci: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Each method with an interval: its minimum detectable effect in sigmas of the test's
    error term and in metric units, the |delta| found with probability ``rule.mde_power`` at
    level alpha/m (:func:`~modbench.analysis.stats.tests.detectable_effect`), at least
    ``rule.floor_sigmas``."""
    rule = design.rule
    m_ci = max(1, len(scored(design, tests)))
    out: dict[str, tuple[float, float]] = {}
    for m in ci:
        o = tests[m]
        d = detectable_effect(int(design.seeds[m].size), design.floor.n, o.df,
                              alpha=rule.alpha, n_tests=m_ci, power=rule.mde_power,
                              floor_sigmas=rule.floor_sigmas)
        out[m] = (d, d * o.scale)
    return out


# --------------------------------------------------------------------------------------------
# 8. Multiple comparisons


@dataclass(frozen=True)
class Family:
    """The correction family: one score test per method with a p, one failure-rate test per
    method where it can reach alpha; each member's adjusted p by every correction."""

    adjusted: Mapping[tuple[str, str], Mapping[str, float]]

    def has_score(self, method: str) -> bool:
        return (method, "score") in self.adjusted

    def score(self, method: str) -> dict[str, float]:
        """The method's score test's adjusted p by each of :data:`CORRECTIONS` (NaN: none)."""
        return {c: self.adjusted.get((method, "score"), {}).get(c, NAN) for c in CORRECTIONS}

    def failures(self, method: str, correction: str) -> float:
        return self.adjusted.get((method, "fail"), {}).get(correction, NAN)


def correct(design: Design, tests: Mapping[str, TestOutcome], failures: FailureRates
            ) -> Family:
    """Every correction of :data:`CORRECTIONS` over the family: the score tests (in the
    table's order), then the failure-rate tests that can reach alpha."""
    fams = [(m, "score", tests[m].p) for m in scored(design, tests)] + [
        (m, "fail", failures.p[m]) for m in failures.p if failures.in_family[m]]
    adjusted: dict[tuple[str, str], dict[str, float]] = {}
    for c in CORRECTIONS:
        adj = adjust_pvalues([p for _, _, p in fams], c,  # type: ignore[arg-type]
                             design.rule.alpha)
        for (m, kind, _), v in zip(fams, adj.p_adjusted, strict=True):
            adjusted.setdefault((m, kind), {})[c] = float(v)
    return Family(adjusted)


# --------------------------------------------------------------------------------------------
# 9. Verdicts


@dataclass(frozen=True)
class Decision:
    """A configuration's verdict, its failure-rate test's corrected p and the notes that say
    why (the test's first)."""

    verdict: Verdict
    p_failures_adjusted: float
    notes: tuple[str, ...]


def _failure_note(m: str, b: str, failures: FailureRates, shown_more: bool,
                  fail_adj: float) -> str:
    what = "diverged" if failures.diverged[m] else "stalled"
    return (f"{failures.failed[m]} of {failures.total[m]} seeds {what} (baseline "
            f"{failures.failed[b]} of {failures.total[b]}): "
            + (f"shown to fail more often (Fisher p {fail_adj:.2g})" if shown_more
               else "no seed survived; the rate is not shown to differ from the "
                    f"baseline's (Fisher p {failures.p[m]:.2g}"
                    + ("" if math.isfinite(fail_adj) else ", which cannot reach α at "
                       "these seed counts") + ")"))


def _mean(x: np.ndarray[Any, Any]) -> float:
    return float(x.mean()) if x.size else NAN


def verdicts(data: Inputs, design: Design, tests: Mapping[str, TestOutcome],
             failures: FailureRates, family: Family, mde: Mapping[str, tuple[float, float]]
             ) -> dict[str, Decision]:
    """Each configuration's verdict: the baseline's is ``baseline`` (or ``diverged`` /
    ``stalled`` when it failed); a method flagged diverged stays so; a method with failed
    seeds is ``diverged`` / ``stalled`` when its rate is shown higher or no seed survived;
    any other is :func:`decide` on its corrected p and the |delta| guard. A ``within_noise``
    note says whether |delta| is below the detectable effect; an ``undetermined`` one why."""
    rule, floor, b = design.rule, design.floor, design.baseline
    alpha = rule.alpha
    out: dict[str, Decision] = {}
    for m, o in tests.items():
        notes = [o.note] if o.note else []
        fail_adj = (failures.p[m] if rule.correction == "none"
                    else family.failures(m, rule.correction))
        if m == b:
            v = (Verdict.DIVERGED if failures.diverged[m] else Verdict.STALLED
                 if failures.failed[m] else Verdict.BASELINE)
            out[m] = Decision(v, fail_adj, tuple(notes))
            continue
        x = design.seeds[m]
        delta = _mean(x) - floor.mean
        shown_more = fail_adj <= alpha and failures.rate(m) > failures.rate(b)
        if m in data.flagged:
            v = Verdict.DIVERGED
        elif failures.failed[m] and (shown_more or x.size == 0):
            v = Verdict.DIVERGED if failures.diverged[m] else Verdict.STALLED
            notes.append(_failure_note(m, b, failures, shown_more, fail_adj))
        else:
            p_use = ((o.p if rule.correction == "none" else family.score(m)[rule.correction])
                     if family.has_score(m) else NAN)
            v = decide(improvement=floor.sign * delta, p_adjusted=p_use, sigma=floor.sigma,
                       alpha=alpha, floor_sigmas=rule.floor_sigmas)
            if failures.failed[m]:
                notes.append(
                    f"{failures.failed[m]} of {failures.total[m]} seeds failed (baseline "
                    f"{failures.failed[b]} of {failures.total[b]}), a rate not shown to "
                    f"differ (Fisher p {failures.p[m]:.2g}): judged on its {x.size} "
                    "surviving seeds")
        if v == Verdict.WITHIN_NOISE:
            mde_s, mde_x = mde.get(m, (NAN, NAN))
            if math.isfinite(mde_x) and abs(delta) < mde_x:
                notes.append(f"not shown: |Δ| < MDE ({mde_x:.3g}, {mde_s:.2g}σ at "
                             f"{rule.mde_power:.0%} power)")
            else:
                notes.append("not shown at this α: |Δ| is above the detectable effect "
                             "but its interval includes no effect")
        if v == Verdict.UNDETERMINED and not notes:
            notes.append("no noise floor" if not floor.defined else "no finite seed")
        out[m] = Decision(v, fail_adj, tuple(notes))
    return out


# --------------------------------------------------------------------------------------------
# 10. The results: z and the seed bootstrap (descriptive), and everything above


def describe(data: Inputs, design: Design, floor: Floor, tests: Mapping[str, TestOutcome],
             failures: FailureRates, family: Family, ci: Mapping[str, tuple[float, float]],
             mde: Mapping[str, tuple[float, float]], decisions: Mapping[str, Decision]
             ) -> list[MethodResult]:
    """One :class:`MethodResult` per configuration, in the table's order: the steps' results,
    with the descriptive z (:func:`~modbench.analysis.stats.floor.z_score`) and the seed
    bootstrap of the mean and of delta (a fresh generator per method)."""
    rule, nf, b = design.rule, design.floor, data.baseline
    out: list[MethodResult] = []
    for m, g in data.groups.items():
        o, d = tests[m], decisions[m]
        is_base = m == b
        x = g.finite
        mean = _mean(x)
        in_family = family.has_score(m)
        padj = family.score(m)
        sig = {"none": bool(o.p <= rule.alpha) if in_family else False}
        sig.update({c: bool(padj[c] <= rule.alpha) for c in CORRECTIONS})
        bd: BootstrapDifference | None = None
        if not is_base:
            pair = can_pair(g, data.base) if rule.paired else rule.paired
            bd = bootstrap_difference(
                data.table[m], data.table[b], higher_is_better=data.higher_is_better,
                n_resamples=rule.n_resamples, confidence=rule.confidence, seed=rule.seed,
                paired=pair,
            )
        interval = ci.get(m, (NAN, NAN))
        mde_s, mde_x = mde.get(m, (NAN, NAN))
        delta = 0.0 if is_base else mean - nf.mean
        out.append(
            MethodResult(
                method=m,
                is_baseline=is_base,
                n=g.n,
                n_diverged=g.n_diverged - data.n_stalled[m],
                fewer_seeds=not is_base and g.n < nf.n,
                mean=mean,
                std=sample_std(x),
                delta=delta,
                improvement=0.0 if is_base else nf.sign * delta,
                z=0.0 if is_base else z_score(x, nf),
                test=o.test,
                t=o.t,
                df=o.df,
                p=o.p,
                p_adjusted=padj,
                significant=sig,
                ci_mean=bootstrap_mean_ci(
                    x, n_resamples=rule.n_resamples, confidence=rule.confidence,
                    seed=rule.seed
                ),
                ci_delta=bd.ci if bd else (NAN, NAN),
                prob_not_better=bd.prob_not_better if bd else NAN,
                paired=bd.paired if bd else False,
                welch=o.welch,
                verdict=d.verdict,
                floor=nf,
                n_stalled=data.n_stalled[m],
                note="; ".join(((floor.baseline_note,) if is_base and floor.baseline_note
                                else ()) + d.notes),
                ci=interval,
                ci_level=1.0 - rule.alpha if math.isfinite(interval[0]) else NAN,
                mde=mde_x,
                mde_sigma=mde_s,
                p_failures=failures.p[m],
                p_failures_adjusted=d.p_failures_adjusted,
                homogeneity_p=design.homogeneity_p,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# compare: the steps in order


#: compare's keyword options that are :class:`VerdictRule` fields, with their defaults.
_OPTIONS: Final = ("sigma", "alpha", "correction", "floor_sigmas", "n_resamples", "confidence",
                   "seed", "paired", "test", "homogeneity_alpha", "resolution")


def compare(
    table: Mapping[str, Scores],
    baseline: str = "baseline",
    *,
    higher_is_better: bool = True,
    references: Sequence[str] = (),
    sigma: SigmaSource = "baseline",
    alpha: float = 0.05,
    correction: Correction = "holm",
    floor_sigmas: float = 1.0,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
    paired: bool | None = None,
    diverged: Collection[str] = (),
    stalled: Mapping[str, int] | None = None,
    test: Literal["auto", "pooled", "welch"] | str = "auto",
    homogeneity_alpha: float = HOMOGENEITY_ALPHA,
    resolution: float = RESOLUTION,
    rule: VerdictRule | None = None,
) -> list[MethodResult]:
    """Compare every method of ``table`` (``{name: per-seed scores or None}``) with ``baseline``.

    Returns one :class:`MethodResult` per entry, in the table's order, baseline included (its
    delta, improvement and z are 0, its test ``"none"``, its verdict ``baseline`` unless it
    has failed seeds). ``references`` join the baseline's seeds for ``sigma="pooled"|"max"``
    (the floor of z and of the |delta| guard). ``diverged`` flags methods as diverged whatever
    their scores; ``stalled`` says how many of a method's failed (``None``) seeds stalled.

    The rule's options are ``rule`` (a :class:`~modbench.analysis.stats.rule.VerdictRule`) or,
    equally, its fields as keywords (``alpha=``, ``correction=``, ``test=``, ...; not both).
    The rule runs as the steps of :data:`PIPELINE` (this module's docstring): failures as
    rates, the noise floor, the choice of test (the **pooled** t when the Brown–Forsythe check
    does not reject at ``homogeneity_alpha``, else each method's prediction test or Welch's t;
    ``test=`` forces one, a registered test by name), the tests, their Bonferroni-simultaneous
    intervals (``ci``) and minimum detectable effects (``mde``, ``mde_sigma``), the correction
    family (score and failure-rate tests, Holm by default) and the verdicts. No verdict rests on
    an estimated sigma of 0 or below ``resolution`` times |baseline mean|: ``undetermined``.
    docs/statistics.md states every rule. An empty table gives []; a table without
    ``baseline`` raises KeyError.
    """
    if not table:
        return []
    if baseline not in table:
        raise KeyError(f"baseline {baseline!r} is not in the table")
    options = dict(sigma=sigma, alpha=alpha, correction=correction, floor_sigmas=floor_sigmas,
                   n_resamples=n_resamples, confidence=confidence, seed=seed, paired=paired,
                   test=test, homogeneity_alpha=homogeneity_alpha, resolution=resolution)
    if rule is None:
        rule = VerdictRule(**options)  # type: ignore[arg-type]
    elif options != {k: getattr(_DEFAULT_RULE, k) for k in _OPTIONS}:
        raise TypeError("compare: give the rule's options in rule= or as keywords, not both")
    data = read_inputs(table, baseline, higher_is_better=higher_is_better, diverged=diverged,
                       stalled=stalled)
    failures = failure_rates(data, rule)
    floor = floor_of(data, references, rule)
    design = choose_test(data, floor, rule)
    tests = run_tests(design, floor)
    ci = intervals(design, tests)
    mde = detectable_effects(design, tests, ci)
    family = correct(design, tests, failures)
    decisions = verdicts(data, design, tests, failures, family, mde)
    return describe(data, design, floor, tests, failures, family, ci, mde, decisions)


_DEFAULT_RULE: Final = VerdictRule()
