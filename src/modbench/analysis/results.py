"""A study's results as typed data: one row per run, the per-scale ``{method: {seed: value}}``
tables of a metric, their comparison with the baseline (one
:class:`~modbench.analysis.stats.MethodResult` per method), and :class:`StudyResults`,
everything a report renders. They become plain dicts only where a file is written
(:func:`comparisons_json`).

Both the study runner (which seeds are still undecided) and the report (Table 2) build their
tables with :func:`metric_table`, so they always judge the same numbers. Reading a study
folder is ``modbench.study.results``; rendering is ``modbench.report``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from modbench.analysis.stats import (
    PIPELINE,
    SCORE_TESTS,
    Look,
    MethodResult,
    Verdict,
    VerdictRule,
    compare,
    sequential_alpha,
    sequential_verdicts,
)
from modbench.errors import ModbenchError
from modbench.runtime.runfolder import PROBES
from modbench.runtime.stall import judge_run_folder

# method -> seed -> metric value (None: a failed run, diverged or stalled)
Table = dict[str, dict[int, float | None]]


@dataclass
class RunRow:
    """One run of a study, from its row in the study's index (``study.store``)."""

    key: str
    scale: str
    method: str
    seed: int
    state: str
    status: str | None
    val_loss: float | None
    params: int | None
    tokens: int | None
    diverged_at_step: int | None
    last_grad_norms: list[dict[str, Any]] = field(default_factory=list)
    tasks: dict[str, float] = field(default_factory=dict)  # task -> score (accuracy etc.)
    task_items: dict[str, list[float]] = field(default_factory=dict)
    climb_avg: float | None = None
    run_dir: Path | None = None  # the run folder (metrics.jsonl for the curves)
    steps: int | None = None  # steps trained (to the divergence for a diverged run)
    steps_planned: int | None = None  # the run's train.steps
    # sha256 chained over every batch the run saw (summary.batches_sha256; None: not recorded)
    batches_sha256: str | None = None
    initial_val_loss: float | None = None  # validation loss before training
    stalled_at_step: int | None = None  # status stalled: the step it stayed stalled from
    unigram_loss: float | None = None  # the unigram level of its validation loss (nats)
    unigram_entropy: float | None = None  # entropy of its training tokens (nats)
    # True when the stall rule was applied by this reader (a summary written before the rule
    # existed: modbench.runtime.stall.judge_run_folder), not by the trainer
    stall_rederived: bool = False

    @classmethod
    def from_record(cls, record: dict[str, Any], run_dir: Path | None = None) -> RunRow:
        """A row from a plain store-row dict (``Store.rows()``: key, scale, method, seed,
        state, status and the parsed ``summary`` and ``eval`` JSON, either may be None).

        A completed run whose summary predates stall detection (no ``stalled_at_step``) is
        judged here from its run folder (:func:`~modbench.runtime.stall.judge_run_folder`), so
        old and new runs of a store get one rule; where that is impossible (no folder, its data
        gone) it stays completed."""
        s = dict(record.get("summary") or {})
        status = record.get("status")
        rederived = False
        if (status == "completed" and record.get("state") == "done" and run_dir is not None
                and s and "stalled_at_step" not in s):
            check = judge_run_folder(run_dir)
            if check is not None:
                s.update(stalled_at_step=check.stalled_at,
                         unigram_loss=check.level.val_loss if check.level else None,
                         unigram_entropy=check.level.entropy if check.level else None)
                status, rederived = ("stalled" if check.stalled_at is not None
                                     else status), True
        ev = record.get("eval") or {}
        tasks, items = {}, {}
        for name, t in (ev.get("tasks") or {}).items():
            score = t.get("accuracy", t.get("score"))
            if isinstance(score, int | float) and math.isfinite(score):
                tasks[name] = float(score)
                items[name] = [float(i.get("score", i.get("acc", math.nan)))
                               for i in t.get("items", [])]
        return cls(
            key=record["key"], scale=record["scale"], method=record["method"],
            seed=int(record["seed"]), state=record["state"], status=status,
            val_loss=s.get("final_val_loss"), params=s.get("params"), tokens=s.get("tokens"),
            diverged_at_step=s.get("diverged_at_step"),
            last_grad_norms=s.get("last_grad_norms") or [], tasks=tasks, task_items=items,
            climb_avg=ev.get("climb_avg"), run_dir=run_dir, steps=s.get("steps"),
            steps_planned=s.get("steps_planned"), batches_sha256=s.get("batches_sha256"),
            initial_val_loss=s.get("initial_val_loss"),
            stalled_at_step=s.get("stalled_at_step"), unigram_loss=s.get("unigram_loss"),
            unigram_entropy=s.get("unigram_entropy"), stall_rederived=rederived)

    @property
    def diverged(self) -> bool:
        return self.status == "diverged"

    @property
    def stalled(self) -> bool:
        return self.status == "stalled"

    @property
    def failed(self) -> bool:
        """A run that diverged or stalled: an outcome, not an ordinary value."""
        return self.diverged or self.stalled

    def metric(self, name: str) -> float | None:
        """The value of a study metric: ``val_loss``, ``probe_avg``, ``climb_avg`` or a task;
        None for a failed run (diverged or stalled), whose numbers are not values to average."""
        if self.failed:
            return None
        if name == "val_loss":
            return self.val_loss
        if name == "climb_avg":
            return self.climb_avg
        if name == "probe_avg":
            probes = [v for k, v in self.tasks.items() if k in PROBES]
            return sum(probes) / len(probes) if probes else None
        return self.tasks.get(name)


HIGHER_IS_BETTER = {"val_loss": False}

#: The verdict rule of a study's comparisons (:func:`compare_scales`), which the report states:
#: Holm over the non-baseline methods of a scale, alpha, and |delta| > FLOOR_SIGMAS * sigma.
ALPHA: Final = 0.05
CORRECTION: Final = "holm"
FLOOR_SIGMAS: Final = 1.0
#: The same rule as one object: what ``results.json``'s ``"rule"`` record states
#: (:func:`rule_record`); a sequential scale's verdicts use it at the alpha its looks spent.
STUDY_RULE: Final = VerdictRule(alpha=ALPHA, correction=CORRECTION, floor_sigmas=FLOOR_SIGMAS)


def higher_is_better(metric: str) -> bool:
    return HIGHER_IS_BETTER.get(metric, True)


def default_metric(primary: str | None, tasks: list[str] | None) -> str:
    """A study's decision metric: its ``evaluation.primary``, else ``climb_avg`` when it runs
    harness tasks, else ``val_loss``."""
    return primary or ("climb_avg" if tasks else "val_loss")


def metric_table(rows: list[RunRow], scale: str, metric: str, baseline: str) -> Table:
    """``{method: {seed: value}}`` of ``metric`` over the finished (state ``done``) runs at
    ``scale``; a failed run's value (diverged or stalled) is None. The baseline comes first,
    then the methods in name order, each with its seeds in order (the order of
    :func:`compare`'s results)."""
    here = [r for r in rows if r.scale == scale and r.state == "done"]
    table: Table = {}
    for r in sorted(here, key=lambda r: (r.method != baseline, r.method, r.seed)):
        table.setdefault(r.method, {})[r.seed] = r.metric(metric)
    return table


def stalled_counts(rows: list[RunRow], scale: str) -> dict[str, int]:
    """Per method, its finished runs at ``scale`` that stalled (``compare``'s ``stalled``)."""
    stalled: dict[str, int] = {}
    for r in rows:
        if r.scale == scale and r.state == "done" and r.stalled:
            stalled[r.method] = stalled.get(r.method, 0) + 1
    return stalled


def verdict_options(rows: list[RunRow], scale: str, metric: str, anchors: list[str],
                    table: Table) -> dict[str, Any]:
    """The keyword arguments of :func:`compare` the study's verdicts use at ``scale`` (all but
    the table, the baseline and alpha): the report's comparisons and every look of
    ``--until-decided`` decide with the same rule."""
    return {"higher_is_better": higher_is_better(metric),
            "references": [a for a in anchors if a in table],
            "correction": STUDY_RULE.correction, "floor_sigmas": STUDY_RULE.floor_sigmas,
            "stalled": stalled_counts(rows, scale)}


def rule_record(looks: Mapping[str, Sequence[Look]] | None = None) -> dict[str, Any]:
    """``results.json``'s ``"rule"``: the verdict rule that produced the study's comparisons
    (:data:`STUDY_RULE`'s fields), the steps :func:`compare` took in order (``pipeline``, each
    a section of docs/statistics.md), the score tests it knew (``score_tests``) and, for each
    scale judged sequentially (``looks``, :func:`read_looks`), the alpha its final verdicts
    used, its looks, their cap and spending function (``sequential``), and with a futility
    rule (``--futility``) its threshold and the methods it stopped."""
    record = STUDY_RULE.to_dict() | {"pipeline": [step for step, _ in PIPELINE],
                                     "score_tests": list(SCORE_TESTS)}
    sequential = {scale: _design_record(ls) for scale, ls in (looks or {}).items() if ls}
    if sequential:
        record["sequential"] = sequential
    return record


def _design_record(looks: Sequence[Look]) -> dict[str, Any]:
    """One scale's entry of the rule record's ``sequential``."""
    last = looks[-1]
    record = {"alpha": sequential_alpha(looks, ALPHA), "looks": len(looks), "cap": last.cap,
              "spending": last.spending}
    if last.futility is not None:
        record |= {"futility": last.futility,
                   "futile": sorted(m for lk in looks for m in lk.futile)}
    return record


#: Where a sequential study (``study run --until-decided N``) keeps its looks, per scale.
LOOKS_FILE: Final = "sequential.json"


def read_looks(folder: str | Path) -> dict[str, list[Look]]:
    """The looks ``study run --until-decided`` recorded in ``folder`` (scale -> looks, oldest
    first); empty for a study that never ran sequentially."""
    import json

    path = Path(folder) / LOOKS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {scale: [Look.from_dict(d) for d in looks]
                for scale, looks in data["scales"].items()}
    except (ValueError, KeyError, TypeError) as e:
        raise ModbenchError(f"{path} is not a record of looks ({e}); remove it to judge the "
                            "study as if its seeds had been fixed") from None


def looks_json(looks: dict[str, list[Look]]) -> str:
    """:func:`read_looks`' file, as text."""
    import json

    return json.dumps({"scales": {s: [lk.to_dict() for lk in ls] for s, ls in looks.items()}},
                      indent=1) + "\n"


def _study_folder(rows: list[RunRow]) -> Path | None:
    dirs = {r.run_dir.parent.parent for r in rows if r.run_dir is not None}
    return dirs.pop() if len(dirs) == 1 else None


#: Per scale, each method's comparison with the baseline (:func:`compare_scales`).
Comparisons = dict[str, list[MethodResult]]


def compare_scales(rows: list[RunRow], baseline: str, metric: str, anchors: list[str],
                   looks: dict[str, list[Look]] | None = None) -> Comparisons:
    """Per scale (in name order), :func:`modbench.analysis.stats.compare` over the methods'
    seeds (verdict rule: :data:`CORRECTION`, :data:`ALPHA`, :data:`FLOOR_SIGMAS`), one
    :class:`~modbench.analysis.stats.MethodResult` per method (the baseline first); a scale
    without a finished baseline run is left out. Stalled runs are failures
    (``None`` in the table, counted in ``compare``'s ``stalled``), like diverged ones.

    A scale whose seeds were added sequentially (``looks``; None: :func:`read_looks` of the
    study folder the rows' run folders are in) is judged at the alpha spent at its last look
    (:func:`~modbench.analysis.stats.sequential_alpha`), each method decided at an earlier look
    keeping that look's verdict (:func:`~modbench.analysis.stats.sequential_verdicts`)."""
    if looks is None:
        folder = _study_folder(rows)
        looks = read_looks(folder) if folder is not None else {}
    out: Comparisons = {}
    for scale in sorted({r.scale for r in rows}):
        table = metric_table(rows, scale, metric, baseline)
        if baseline not in table:
            continue
        seq = looks.get(scale, [])
        res = compare(table, baseline, alpha=sequential_alpha(seq, ALPHA),
                      **verdict_options(rows, scale, metric, anchors, table))
        out[scale] = sequential_verdicts(res, seq)
    return out


def comparisons_json(comparisons: Mapping[str, Sequence[MethodResult]],
                     extra: Mapping[str, Mapping[str, dict[str, Any]]] | None = None
                     ) -> dict[str, list[dict[str, Any]]]:
    """The comparisons as a file holds them (``results.json``): per scale, each method's
    :meth:`~modbench.analysis.stats.MethodResult.to_dict`, with ``extra[scale][method]``'s
    keys added after its own (the report's trajectories). The one place results become dicts."""
    more = extra or {}
    return {scale: [r.to_dict() | dict(more.get(scale, {}).get(r.method, {})) for r in res]
            for scale, res in comparisons.items()}


@dataclass(frozen=True)
class MethodFlops:
    """Analytic training FLOPs per token of a method at a scale, and the ratio of its forward
    FLOPs to the baseline's (``modbench.measure.flops.FlopReport``)."""

    train_flops_per_token: float
    flops_ratio: float


# verdicts that settle a method's effect (diverged and stalled: failures)
DECIDED = ("improver", "degrader", "diverged", "stalled")
#: The verdict names a claim may expect (modbench.analysis.stats.Verdict, less the baseline's).
VERDICT_NAMES: Final = ("improver", "within_noise", "degrader", "diverged", "stalled")
#: The forms a claim may expect besides verdict names: ``better`` (shown an improver),
#: ``worse`` (shown a degrader, or failing more often), ``not_worse(MARGIN)`` and
#: ``equivalent(MARGIN)``, MARGIN in the metric's units (``0.02``) or sigmas (``1σ``).
CLAIM_FORMS: Final = ("better", "worse", "not_worse(MARGIN)", "equivalent(MARGIN)")
#: The forms a claim may expect of a method's learning-rate sensitivity (a spec's
#: ``lr_profile``): judged against the profile's sensitivity verdict, not the frozen verdict
#: (:func:`modbench.analysis.profile.sensitivity_verdicts`).
SENSITIVITY_FORMS: Final = ("less_sensitive", "more_sensitive")
_FAILED = ("diverged", "stalled")
_MARGIN_FORM = re.compile(r"^\s*(not_worse|equivalent)\s*\(\s*(.*?)\s*\)\s*$")
_MARGIN = re.compile(r"^([0-9][0-9eE+\-.]*)\s*(σ|sigma|sigmas)?$", re.IGNORECASE)


@dataclass(frozen=True)
class Expectation:
    """One entry of a claim's ``expect`` list, parsed: a verdict name, ``better``, ``worse``,
    or ``not_worse`` / ``equivalent`` with a margin (``margin`` in metric units, or in sigmas
    of the scale's noise floor when ``in_sigmas``)."""

    kind: str
    margin: float = math.nan
    in_sigmas: bool = False

    def margin_at(self, sigma: float) -> float:
        """The margin in metric units at a scale whose noise floor is ``sigma``."""
        return self.margin * sigma if self.in_sigmas else self.margin


def parse_expectation(text: str, where: str = "claim.expect") -> Expectation:
    """A claim's expected outcome: a verdict name (:data:`VERDICT_NAMES`) or one of
    :data:`CLAIM_FORMS`; anything else is refused in one line."""
    t = str(text).strip()
    if t in VERDICT_NAMES or t in ("better", "worse") or t in SENSITIVITY_FORMS:
        return Expectation(t)
    m = _MARGIN_FORM.match(t)
    if m:
        kind, raw = m.group(1), m.group(2)
        mm = _MARGIN.match(raw)
        try:
            value = float(mm.group(1)) if mm else math.nan
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ModbenchError(f"{where}: {kind}({raw}) needs a positive margin in the "
                                f"metric's units or in sigmas, e.g. {kind}(0.02) or {kind}(1σ)")
        return Expectation(kind, value, bool(mm and mm.group(2)))
    raise ModbenchError(f"{where}: unknown verdict {t!r}; use a verdict "
                        f"({', '.join(VERDICT_NAMES)}), {', '.join(CLAIM_FORMS)}, or, with an "
                        f"lr_profile block, {' or '.join(SENSITIVITY_FORMS)}")


@dataclass(frozen=True)
class ClaimRow:
    """One method's verdict at one scale against the verdicts a published claim predicts.

    ``outcome``: ``agrees`` (the verdict is one the claim predicts and shows it),
    ``contradicts`` (a decided verdict, improver / degrader / diverged / stalled, the claim
    does not predict, or an interval that lies wholly beyond a claimed margin) or ``not
    shown`` (within noise or undetermined where the claim predicts an effect: this study
    could not tell; and an interval that reaches past a claimed margin, or within noise where
    the claim allows it but the interval does not show it, :func:`shows_within_noise`),
    ``not run`` (no finished runs). ``why`` says which interval decided a margin claim."""

    scale: str
    method: str
    verdict: str
    expected: tuple[str, ...]
    outcome: str
    why: str = ""


@dataclass
class ClaimCheck:
    """A study's published claim (``claim`` in its spec) held against its verdicts."""

    source: str
    text: str
    rows: list[ClaimRow]

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.rows)

    @property
    def summary(self) -> str:
        """``agrees`` (every method agrees), ``contradicted`` (some decided verdict disagrees),
        else ``partly shown``."""
        if self.rows and self.count("agrees") == len(self.rows):
            return "agrees"
        return "contradicted" if self.count("contradicts") else "partly shown"


def _improvement_interval(result: MethodResult) -> tuple[float, float, float] | None:
    """The test's simultaneous interval for the improvement (positive = better), worst end
    first, and the floor's sigma; None where either is not finite."""
    lo, hi = result.ci
    sigma, sign = result.floor.sigma, result.floor.sign
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in (lo, hi, sigma)):
        return None
    worst, best = sorted((sign * lo, sign * hi))
    return worst, best, sigma


def shows_within_noise(result: MethodResult, expected: list[str] | tuple[str, ...]) -> bool:
    """Whether a ``within_noise`` result shows what a claim allowing it says, by the test's
    simultaneous interval (``compare``'s ``ci``) against the margin ``FLOOR_SIGMAS`` sigma (the
    verdict's own |delta| guard): with ``improver`` also expected ("at least as well as"), the
    least favourable end of the interval must be better than -margin (non-inferiority); with
    ``degrader`` also expected, its most favourable end below +margin; with neither ("no
    effect"), both (equivalence by the interval inside ±margin, as TOST at level alpha/2 per
    side). An interval that reaches past the margin cannot show the claim: ``not shown``, never
    ``agrees``. A spec declares its own margin with ``not_worse(MARGIN)`` /
    ``equivalent(MARGIN)`` (:func:`judge_expectation`)."""
    iv = _improvement_interval(result)
    if iv is None:
        return False
    worst, best, sigma = iv
    margin = FLOOR_SIGMAS * sigma
    not_worse, not_better = worst > -margin, best < margin
    if "improver" in expected and "degrader" not in expected:
        return not_worse
    if "degrader" in expected and "improver" not in expected:
        return not_better
    return not_worse and not_better


def judge_expectation(result: MethodResult, exp: Expectation,
                      expected: list[str] | tuple[str, ...] = ()) -> tuple[str, str]:
    """One expected outcome against one method's result: ``(outcome, why)``, outcome
    ``agrees``, ``contradicts`` or ``not shown``.

    * a verdict name: agrees when the verdict is it (``within_noise`` only where
      :func:`shows_within_noise` shows it, with the list's other names), contradicts when the
      verdict is another decided one (:data:`DECIDED`), else not shown;
    * ``better``: an improver agrees; a degrader, diverged or stalled verdict contradicts;
    * ``worse``: a degrader, diverged or stalled verdict agrees (failing more often is
      worse: the verdict says so only when Fisher's test shows it); an improver contradicts;
    * ``not_worse(M)``: **non-inferiority** by the verdict's Bonferroni-simultaneous
      interval for the improvement (one-sided at alpha/2m): agrees when its worst end is
      above -M, contradicts when its best end is below -M (worse by more than M is shown) or
      the method fails more often (diverged, stalled), else not shown;
    * ``equivalent(M)``: **TOST** by the same interval: agrees when it lies inside ±M,
      contradicts when it lies wholly outside, or on a failure verdict, else not shown.

    Without an interval (no floor, zero spread, no finite seed) a margin is not shown."""
    verdict = str(result.verdict)
    kind = exp.kind
    if kind in VERDICT_NAMES:
        if verdict == kind:
            if kind == "within_noise" and not shows_within_noise(result, expected):
                return "not shown", "its interval reaches past the rule's 1σ margin"
            return "agrees", ""
        return ("contradicts" if verdict in DECIDED else "not shown"), ""
    if kind == "better":
        return ("agrees" if verdict == "improver" else "contradicts"
                if verdict in ("degrader", *_FAILED) else "not shown"), ""
    if kind == "worse":
        return ("agrees" if verdict in ("degrader", *_FAILED) else "contradicts"
                if verdict == "improver" else "not shown"), ""
    if verdict in _FAILED:
        return "contradicts", f"{verdict}: it fails more often than the baseline"
    iv = _improvement_interval(result)
    if iv is None:
        return "not shown", "no interval for Δ (no noise floor or no spread)"
    worst, best, sigma = iv
    m = exp.margin_at(sigma)
    span = f"the improvement's interval [{worst:.3g}, {best:.3g}] against margin {m:.3g}"
    if kind == "not_worse":
        return ("agrees" if worst > -m else "contradicts" if best < -m else "not shown"), span
    # equivalent
    return ("agrees" if -m < worst and best < m else "contradicts" if worst > m or best < -m
            else "not shown"), span


def check_claim(comparisons: Mapping[str, Sequence[MethodResult]], expect: dict[str, list[str]],
                source: str = "", text: str = "",
                sensitivity: Mapping[str, Mapping[str, str]] | None = None) -> ClaimCheck:
    """Each expected method's verdict at each scale of ``comparisons`` (``compare_scales``)
    against the outcomes ``expect`` lists for it (verdict names or :data:`CLAIM_FORMS`,
    judged by :func:`judge_expectation` on the result :func:`as_claimed` gives: a method whose
    seeds mostly failed is judged as failing; :data:`SENSITIVITY_FORMS` by
    :func:`judge_sensitivity` against ``sensitivity``, the learning-rate profile's verdicts,
    scale -> method -> verdict): the row agrees when some entry agrees, contradicts when every
    entry contradicts, else is not shown; a method without a finished run is not run."""
    rows: list[ClaimRow] = []
    for scale, results in comparisons.items():
        by_method = {r.method: r for r in results}
        profile = (sensitivity or {}).get(scale)
        for method, expected in expect.items():
            if method not in by_method:
                rows.append(ClaimRow(scale, method, "missing", tuple(expected), "not run"))
                continue
            r, failing = as_claimed(by_method[method])
            parsed = [parse_expectation(e) for e in expected]
            judged = [judge_sensitivity(profile, method, e) if e.kind in SENSITIVITY_FORMS
                      else judge_expectation(r, e, expected) for e in parsed]
            outcomes = [o for o, _ in judged]
            outcome = ("agrees" if "agrees" in outcomes
                       else "contradicts" if all(o == "contradicts" for o in outcomes)
                       else "not run" if all(o == "not run" for o in outcomes)
                       else "not shown")
            why = next((w for o, w in judged if o == outcome and w), "") or failing
            shown = str(r.verdict) if not failing else failing.split(":")[0]
            if all(e.kind in SENSITIVITY_FORMS for e in parsed):
                shown = (profile or {}).get(method, "no profile")
            rows.append(ClaimRow(scale, method, shown, tuple(expected), outcome, why))
    return ClaimCheck(source, text, rows)


def as_claimed(result: MethodResult) -> tuple[MethodResult, str]:
    """The result a claim judges, and why it differs from the verdict (empty: it does not).
    A method whose seeds **mostly failed** (more than half diverged or stalled) with a score
    verdict from its surviving seeds is judged as failing, by its commoner failure, not on
    its survivors: "fails 2 of 3 (stalled)" (which seed survives depends on the machine's
    kernels, so a verdict from a lone survivor is not the method's)."""
    failed = result.n_diverged + result.n_stalled
    total = result.n + failed
    if str(result.verdict) in _FAILED or result.is_baseline or failed * 2 <= total:
        return result, ""
    kind = "stalled" if result.n_stalled >= result.n_diverged else "diverged"
    return (dataclasses.replace(result, verdict=Verdict(kind)),
            f"fails {failed} of {total} ({kind}): judged as failing, not on its {result.n} "
            f"surviving seed{'s' if result.n != 1 else ''}")


def judge_sensitivity(profile: Mapping[str, str] | None, method: str, exp: Expectation
                      ) -> tuple[str, str]:
    """A sensitivity form (``less_sensitive`` / ``more_sensitive``) against the method's
    sensitivity verdict at the scale (``profile``: method -> verdict; None: no profile ran):
    agrees when it is the expected one, contradicts when it is the other, not shown when the
    verdict decided neither (``not_shown``, ``undetermined``, a failure), not run without a
    profile."""
    if profile is None or method not in profile:
        return "not run", "no learning-rate profile of it (the spec's lr_profile block)"
    verdict = profile[method]
    if verdict == exp.kind:
        return "agrees", ""
    if verdict in SENSITIVITY_FORMS:
        return "contradicts", f"the profile shows it {verdict.replace('_', ' ')}"
    return "not shown", f"the profile's sensitivity verdict is {verdict.replace('_', ' ')}"


@dataclass
class StudyResults:
    """Everything a study report shows, typed (files get dicts: :func:`comparisons_json`)."""

    name: str
    folder: Path  # the study folder, as given
    baseline: str
    metric: str
    anchors: list[str]
    rows: list[RunRow]
    comparisons: Comparisons  # scale -> compare_scales()' results, the baseline first
    flops: dict[str, dict[str, MethodFlops]] = field(default_factory=dict)  # scale -> method
    claim: ClaimCheck | None = None  # the published claim the study tests, if it names one
    # the spec's data.order: "fixed" (every run sees one batch sequence) or "per_seed" (runs
    # of one init seed see one sequence); the report checks the runs' batch hashes against it
    data_order: str = "fixed"
    # runs left out because the code of an outside method they used differs from the code
    # loaded now: run label -> what changed (modbench.study.results.code_changes)
    code_changed: dict[str, str] = field(default_factory=dict)
    # methods whose verdict depends on the learning rate (the spec's lr_profile: an improver
    # at one grid point and a degrader at another): scale -> method -> where, in words
    rate_dependent: dict[str, dict[str, str]] = field(default_factory=dict)

    def flops_of(self, scale: str, method: str) -> MethodFlops | None:
        return self.flops.get(scale, {}).get(method)
