"""The verdict rule as settings and steps (modbench.analysis.stats.rule and .verdict): the
frozen VerdictRule behind compare's options, the pipeline of named steps, the registry of score
tests with docs/statistics.md's example (Dunnett's test) run as printed, and the rule record a
study's results.json holds."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from scipy import stats as sps

from modbench.analysis import stats as S
from modbench.analysis.stats import verdict as V

DOC = Path(__file__).resolve().parents[2] / "docs" / "statistics.md"
TABLE = {"baseline": [3.412, 3.398, 3.405], "qknorm": [3.371, 3.380, 3.366],
         "softcap": [3.409, 3.401, 3.415], "post_ln": [3.52, None, 3.49], "relu2": [3.401]}


def dump(results: list[S.MethodResult]) -> str:
    return json.dumps([r.to_dict() for r in results], default=str)


@pytest.fixture
def registry() -> Iterator[None]:
    """Give the registry of score tests back as it was."""
    before = dict(S.SCORE_TESTS)
    yield
    S.SCORE_TESTS.clear()
    S.SCORE_TESTS.update(before)


def test_the_rule_is_compare_s_options() -> None:
    """VerdictRule's fields are compare's options with the same defaults; a rule and the same
    keywords give the same results; both at once are refused."""
    params = inspect.signature(S.compare).parameters
    for f in dataclasses.fields(S.VerdictRule):
        if f.name in params:
            assert params[f.name].default == f.default, f.name
        else:  # the options compare takes only through rule=
            assert f.name in ("min_surviving_baseline", "mde_power")
    rule = S.VerdictRule(alpha=0.2, correction="bonferroni", test="welch", n_resamples=50)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.alpha = 0.1  # type: ignore[misc]
    by_rule = S.compare(TABLE, higher_is_better=False, rule=rule)
    by_keywords = S.compare(TABLE, higher_is_better=False, alpha=0.2, correction="bonferroni",
                            test="welch", n_resamples=50)
    assert dump(by_rule) == dump(by_keywords)
    with pytest.raises(TypeError, match="not both"):
        S.compare(TABLE, rule=rule, alpha=0.1)
    with pytest.raises(ValueError, match="unknown correction"):
        S.VerdictRule(correction="sidak")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="registered score test"):
        S.compare(TABLE, test="dunnett")
    assert S.VerdictRule().to_dict()["test"] == "auto"


def test_rule_options_compare_did_not_take_before() -> None:
    """min_surviving_baseline and mde_power, constants before, are options of the rule now."""
    table = {"baseline": [1.0, 1.1, None, 0.9], "m": [1.4, 1.5, 1.45]}
    kept = S.compare(table, rule=S.VerdictRule(min_surviving_baseline=3))
    lost = S.compare(table, rule=S.VerdictRule(min_surviving_baseline=4))
    assert kept[1].verdict != "undetermined" and lost[1].verdict == "undetermined"
    assert "fewer than 4" in lost[0].note
    lo = S.compare(TABLE, higher_is_better=False, rule=S.VerdictRule(mde_power=0.5))
    hi = S.compare(TABLE, higher_is_better=False, rule=S.VerdictRule(mde_power=0.9))
    assert lo[1].mde_sigma < hi[1].mde_sigma


def test_compare_is_its_steps_in_order() -> None:
    """PIPELINE names the steps, each a function of stats.verdict, and compare's body calls
    them in that order."""
    names = [name for name, _ in S.PIPELINE]
    assert all(inspect.isfunction(getattr(V, n)) for n in names)
    body = inspect.getsource(V.compare).split('"""')[-1]
    calls = [n for n in re.findall(r"\b([a-z_]+)\(", body) if n in names]
    assert calls == names
    doc = DOC.read_text(encoding="utf-8")
    for i, name in enumerate(names, 1):  # the page's table of steps
        assert f"| {i} | `{name}` |" in doc


def _doc_example() -> str:
    doc = DOC.read_text(encoding="utf-8")
    section = doc.split("## Adding a test", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_doc_example_adds_dunnett_in_one_function_and_one_line(registry: None) -> None:
    """docs/statistics.md's example, run as printed: one function and its registration line
    make Dunnett's test a test of the rule; it prints what the page says; its t is the pooled
    t and its p scipy's Dunnett p."""
    code = _doc_example()
    assert code.count("@score_test(") == 1 and code.count("\ndef ") == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {"__name__": "statistics_md"})
    printed = [line for line in code.splitlines() if line.startswith("# ")]
    assert out.getvalue().splitlines() == [line[2:] for line in printed]
    assert "dunnett" in S.SCORE_TESTS
    table = {k: TABLE[k] for k in ("baseline", "qknorm", "softcap")}
    got = S.compare(table, higher_is_better=False, test="dunnett", correction="none")
    pooled = S.compare(table, higher_is_better=False, test="pooled")
    ref = sps.dunnett(table["qknorm"], table["softcap"], control=table["baseline"], rng=0)
    for r, p, want in zip(got[1:], pooled[1:], ref.pvalue, strict=True):
        assert r.test == "dunnett" and r.t == pytest.approx(p.t, rel=1e-12)
        assert r.p == pytest.approx(float(want), rel=1e-12)
        assert r.ci == pytest.approx(p.ci, rel=1e-12) and r.mde == pytest.approx(p.mde)
    assert [r.verdict for r in got] == ["baseline", "improver", "within_noise"]


def test_a_registered_test_joins_the_family_and_the_zero_spread_rule(registry: None) -> None:
    """A new test's p is corrected with the failure-rate tests; a floor below the resolution
    calls no test and labels it; a name is registered once."""
    calls: list[str] = []

    @S.score_test("halved")
    def halved(design: S.Design, method: str) -> S.TestOutcome:
        calls.append(method)
        o = S.SCORE_TESTS["pooled"].run(design, method)
        return dataclasses.replace(o, test="halved", p=o.p / 2)

    with pytest.raises(ValueError, match="already registered"):
        S.score_test("halved")(halved)
    got = {r.method: r for r in S.compare(TABLE, higher_is_better=False, test="halved")}
    pooled = {r.method: r for r in S.compare(TABLE, higher_is_better=False, test="pooled")}
    assert calls == ["qknorm", "softcap", "post_ln", "relu2"]
    for m in calls:
        assert got[m].test == "halved" and got[m].p == pytest.approx(pooled[m].p / 2)
    # the family: four score tests (holm: the smallest p times 4) and no failure test that
    # can reach alpha at 1 of 3 against 0 of 3
    smallest = min(got[m].p for m in calls)
    assert min(got[m].p_adjusted["holm"] for m in calls) == pytest.approx(4 * smallest)
    flat = {"baseline": [2.0, 2.0, 2.0], "m": [2.1, 2.2]}
    calls.clear()
    r = S.compare(flat, test="halved")[1]
    assert not calls and r.test == "halved" and math.isnan(r.p) and r.verdict == "undetermined"
    assert "below the resolution" in r.note


def test_the_rule_record() -> None:
    """results.json's "rule": the study's rule, the steps, the tests, and the alpha of each
    sequential scale."""
    from modbench.analysis.results import STUDY_RULE, rule_record

    rec = rule_record()
    assert {k: rec[k] for k in STUDY_RULE.to_dict()} == STUDY_RULE.to_dict()
    assert rec["alpha"] == 0.05 and rec["correction"] == "holm" and rec["floor_sigmas"] == 1.0
    assert rec["pipeline"] == [n for n, _ in S.PIPELINE]
    assert rec["score_tests"][:2] == ["pooled", "welch"] and "sequential" not in rec
    looks = [S.Look(1, {"baseline": 3}, 0.3, 0.0004, 0.0004, {}, {"baseline": 2}, 6),
             S.Look(2, {"baseline": 5}, 0.6, 0.01, 0.0104, {}, {}, 6, "pocock")]
    seq = rule_record({"tiny": looks, "small": []})["sequential"]
    assert seq == {"tiny": {"alpha": 0.01, "looks": 2, "cap": 6, "spending": "pocock"}}


def test_a_scale_named_rule_is_refused(tmp_path: Path) -> None:
    from modbench.analysis.results import StudyResults
    from modbench.errors import ModbenchError
    from modbench.report.build import results_json

    results = StudyResults("s", tmp_path, "baseline", "val_loss", [], [], {})
    assert results_json(results, {"tiny": []})["rule"]["alpha"] == 0.05
    with pytest.raises(ModbenchError, match="named 'rule'"):
        results_json(results, {"rule": []})
