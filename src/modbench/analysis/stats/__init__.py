"""Statistics for deciding which methods beat the baseline against a multi-seed noise floor.

Implements the protocol of the seed study (arXiv 2605.20798, docs/sources.md#seed-002) §3.3
(noise floor), §4-§5 (tests, corrections, Spearman across scales) and Appendix E.4 (per-task
Welch + Stouffer), with one deliberate change: the verdict accounts for the noise floor being
*estimated* from a few seeds (a t reference, not a normal one). Pure functions and small frozen
dataclasses over numpy, scipy and statsmodels; no I/O. ``docs/statistics.md`` states every
rule. Import everything from here (``modbench.analysis.stats``); the modules split it by
concern:

* :mod:`~modbench.analysis.stats.scores`: per-seed scores as the rule reads them (failed seeds
  as ``None`` / NaN);
* :mod:`~modbench.analysis.stats.distributions`: the normal and Student-t distributions;
* :mod:`~modbench.analysis.stats.floor`: the noise floor and z;
* :mod:`~modbench.analysis.stats.tests`: tests and intervals (Welch's t, the prediction test,
  Brown–Forsythe, Fisher's exact test, the detectable effect, the decision threshold);
* :mod:`~modbench.analysis.stats.corrections`: Bonferroni, Holm, Benjamini–Hochberg;
* :mod:`~modbench.analysis.stats.bootstrap`: the seed bootstrap;
* :mod:`~modbench.analysis.stats.rule`: the verdict rule's settings (:class:`VerdictRule`) and
  its registry of score tests (:func:`score_test`);
* :mod:`~modbench.analysis.stats.verdict`: the verdict rule, :func:`compare`, as a pipeline of
  named steps that mirror docs/statistics.md's sections (:data:`PIPELINE`);
* :mod:`~modbench.analysis.stats.sequential`: ``--until-decided``'s group-sequential looks and
  seed requests;
* :mod:`~modbench.analysis.stats.meta`: ranks and meta-analysis (Spearman, Stouffer).

Which parts are library calls: the normal, Student-t and noncentral-t distributions
(``scipy.stats.norm``, ``scipy.stats.t``, ``scipy.stats.nct``), Welch's t
(``scipy.stats.ttest_ind(equal_var=False)``), Brown–Forsythe (``scipy.stats.levene``),
Fisher's exact test (``scipy.stats.fisher_exact``), Stouffer
(``scipy.stats.combine_pvalues(method="stouffer")``), ranks and Spearman
(``scipy.stats.rankdata``, ``scipy.stats.spearmanr``), Bonferroni and Benjamini–Hochberg
(``statsmodels.stats.multitest.multipletests``). Around each call the modules keep their own
documented edge cases (NaN and diverged seeds dropped, Welch with both groups constant gives
p NaN where scipy says 0, Spearman p NaN for n <= 2, ...). Two procedures stay our own code,
each checked against the library in the tests: Holm's step-down (``corrections``: statsmodels'
calls ``gc.collect()`` on every call) and the seed bootstrap (``bootstrap``: scipy's refuses
one seed, the protocol's most common case).
"""

from __future__ import annotations

from modbench.analysis.stats.bootstrap import (
    DEFAULT_RESAMPLES,
    BootstrapDifference,
    bootstrap_difference,
    bootstrap_mean_ci,
)
from modbench.analysis.stats.corrections import CORRECTIONS, Adjusted, Correction, adjust_pvalues
from modbench.analysis.stats.distributions import (
    Alternative,
    normal_isf,
    normal_sf,
    p_two_sided,
    t_sf,
)
from modbench.analysis.stats.floor import (
    NoiseFloor,
    SigmaSource,
    noise_floor,
    pooled_std,
    sample_std,
    z_score,
)
from modbench.analysis.stats.meta import (
    PerTaskResult,
    SpearmanResult,
    StoufferResult,
    TaskTest,
    per_task_stouffer,
    rankdata,
    spearman,
    spearman_across_scales,
    stouffer,
)
from modbench.analysis.stats.rule import (
    MIN_SURVIVING_BASELINE,
    RESOLUTION,
    SCORE_TESTS,
    Design,
    ScoreTest,
    TestOutcome,
    VerdictRule,
    score_test,
)
from modbench.analysis.stats.scores import Score, Scores
from modbench.analysis.stats.sequential import (
    DEFAULT_SPENDING,
    SPENDING,
    Look,
    SeedRequest,
    alpha_spent,
    baseline_target,
    check_futility,
    conditional_power,
    final_boundary,
    information_fraction,
    sequential_alpha,
    sequential_look,
    sequential_verdicts,
    undecided,
)
from modbench.analysis.stats.tests import (
    HOMOGENEITY_ALPHA,
    MDE_POWER,
    MethodTest,
    WelchResult,
    decision_threshold,
    detectable_effect,
    homogeneity,
    method_test,
    welch_t,
)
from modbench.analysis.stats.verdict import (
    PIPELINE,
    TESTS,
    MethodResult,
    Verdict,
    compare,
    decide,
)

__all__ = [
    "CORRECTIONS",
    "DEFAULT_RESAMPLES",
    "DEFAULT_SPENDING",
    "HOMOGENEITY_ALPHA",
    "MDE_POWER",
    "MIN_SURVIVING_BASELINE",
    "PIPELINE",
    "RESOLUTION",
    "SCORE_TESTS",
    "SPENDING",
    "TESTS",
    "Adjusted",
    "Alternative",
    "BootstrapDifference",
    "Correction",
    "Design",
    "Look",
    "MethodResult",
    "MethodTest",
    "NoiseFloor",
    "PerTaskResult",
    "Score",
    "ScoreTest",
    "Scores",
    "SeedRequest",
    "SigmaSource",
    "SpearmanResult",
    "StoufferResult",
    "TaskTest",
    "TestOutcome",
    "Verdict",
    "VerdictRule",
    "WelchResult",
    "adjust_pvalues",
    "alpha_spent",
    "baseline_target",
    "bootstrap_difference",
    "bootstrap_mean_ci",
    "check_futility",
    "compare",
    "conditional_power",
    "decide",
    "decision_threshold",
    "detectable_effect",
    "final_boundary",
    "homogeneity",
    "information_fraction",
    "method_test",
    "noise_floor",
    "normal_isf",
    "normal_sf",
    "p_two_sided",
    "per_task_stouffer",
    "pooled_std",
    "rankdata",
    "sample_std",
    "score_test",
    "sequential_alpha",
    "sequential_look",
    "sequential_verdicts",
    "spearman",
    "spearman_across_scales",
    "stouffer",
    "t_sf",
    "undecided",
    "welch_t",
    "z_score",
]
