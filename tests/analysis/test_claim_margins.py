"""A claim's ``expect`` forms besides verdict names (issue 29, item 3): ``better``, ``worse``,
``not_worse(MARGIN)`` (non-inferiority by the verdict's interval) and ``equivalent(MARGIN)``
(TOST: the interval inside ±MARGIN), MARGIN in the metric's units or sigmas; a result that
cannot show the claim is "not shown", never "agrees"; the spec refuses a bad form in one
line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import yaml

from modbench.analysis.results import (
    Expectation,
    check_claim,
    judge_expectation,
    parse_expectation,
)
from modbench.analysis.stats import MethodResult, compare
from modbench.errors import ModbenchError
from modbench.study.spec import load_spec

from . import verdict_sim as V

BASE = [3.00, 3.01, 2.99, 3.005, 2.995, 3.0, 3.002, 2.998]  # a loss: lower is better


def result(method: list[float] | None, base: list[float] = BASE) -> MethodResult:
    table = {"baseline": base, "m": method}
    return {r.method: r for r in compare(table, higher_is_better=False, n_resamples=10)}["m"]


def outcome(r: MethodResult, text: str) -> str:
    return judge_expectation(r, parse_expectation(text))[0]


@pytest.mark.parametrize(("text", "want"), [
    ("better", Expectation("better")), ("worse", Expectation("worse")),
    ("stalled", Expectation("stalled")),
    ("not_worse(1σ)", Expectation("not_worse", 1.0, True)),
    ("not_worse(0.5sigma)", Expectation("not_worse", 0.5, True)),
    ("equivalent( 0.02 )", Expectation("equivalent", 0.02, False)),
    ("not_worse (2 σ)", Expectation("not_worse", 2.0, True))])
def test_forms_parse(text: str, want: Expectation) -> None:
    assert parse_expectation(text) == want


@pytest.mark.parametrize(("text", "says"), [
    ("not_worse()", "positive margin"), ("not_worse(-1σ)", "positive margin"),
    ("equivalent(abc)", "positive margin"), ("equivalent(0)", "positive margin"),
    ("nope", "unknown verdict 'nope'"), ("better(1σ)", "unknown verdict"),
    ("not_worse", "unknown verdict")])
def test_bad_forms_refused_in_one_line(text: str, says: str) -> None:
    with pytest.raises(ModbenchError, match=says.replace("(", r"\(")) as e:
        parse_expectation(text)
    assert "\n" not in str(e.value)


def test_margin_claims_by_the_interval() -> None:
    tight = result([3.0, 3.001, 2.999, 3.0, 3.0005, 2.9995, 3.001, 2.999])
    assert tight.verdict == "within_noise"
    assert outcome(tight, "not_worse(1σ)") == "agrees"
    assert outcome(tight, "equivalent(1σ)") == "agrees"
    assert outcome(tight, "equivalent(0.0001)") == "not shown"  # margin in loss units, tiny
    assert outcome(tight, "better") == "not shown" and outcome(tight, "worse") == "not shown"
    # 0.6σ worse on 2 seeds: within noise, its interval reaches past -1σ: not shown
    loose = result([3.006, 3.008])
    assert loose.verdict == "within_noise"
    assert outcome(loose, "not_worse(1σ)") == "not shown"
    assert outcome(loose, "not_worse(0.5)") == "agrees"  # half a nat: shown
    # clearly worse: a degrader; worse by more than 1σ is shown, so not_worse contradicts
    bad = result([3.2, 3.21, 3.19, 3.2])
    assert bad.verdict == "degrader"
    assert outcome(bad, "not_worse(1σ)") == "contradicts"
    assert outcome(bad, "equivalent(1σ)") == "contradicts"
    assert outcome(bad, "worse") == "agrees" and outcome(bad, "better") == "contradicts"
    good = result([2.8, 2.81, 2.79, 2.8])
    assert good.verdict == "improver"
    assert outcome(good, "better") == "agrees" and outcome(good, "not_worse(1σ)") == "agrees"
    assert outcome(good, "equivalent(1σ)") == "contradicts"  # shown better by more than 1σ
    # a failure is not "not worse"; it is worse
    failed = result(None)
    assert failed.verdict == "diverged"
    assert outcome(failed, "not_worse(1σ)") == "contradicts"
    assert outcome(failed, "worse") == "agrees"
    # no noise floor (one baseline seed): nothing is shown
    nofloor = result([3.0, 3.01], base=[3.0])
    assert outcome(nofloor, "not_worse(1σ)") == "not shown"


def test_check_claim_combines_entries() -> None:
    comparisons = {"s": [dataclasses.replace(result([3.2, 3.21, 3.19, 3.2]), method="bad"),
                         dataclasses.replace(result([3.006, 3.008]), method="loose"),
                         dataclasses.replace(result(None), method="failed")]}
    check = check_claim(comparisons, {"bad": ["not_worse(1σ)", "better"],
                                      "loose": ["not_worse(1σ)", "degrader"],
                                      "failed": ["stalled", "diverged"],
                                      "absent": ["better"]})
    got = {r.method: r.outcome for r in check.rows}
    assert got == {"bad": "contradicts", "loose": "not shown", "failed": "agrees",
                   "absent": "not run"}
    why = {r.method: r.why for r in check.rows}
    assert "interval" in why["bad"] and "margin" in why["bad"]


@pytest.mark.parametrize("effect", [-3.0, -1.0])
def test_not_worse_is_not_agreement_for_a_worse_method(effect: float) -> None:
    """At the built-in design (3 seeds, 5 methods), a method truly 3σ worse (or exactly at the
    1σ margin) is "within noise or improver" often, but not_worse(1σ) agrees at most at the
    test's level: the claim is shown, not assumed."""
    rng = np.random.default_rng(int(-10 * effect))
    draws = 200
    base, meth = V.simulate(rng, draws, 3, np.array([effect, 0, 0, 0, 0]), 3)
    agree = old = 0
    for i in range(draws):
        # simulate's positive effect is higher; compare's default (higher is better) keeps
        # the planted method worse by |effect|
        table = {"baseline": list(base[i]), **{f"m{j}": list(meth[i, j]) for j in range(5)}}
        r = compare(table, n_resamples=1)[1]
        agree += outcome(r, "not_worse(1σ)") == "agrees"
        old += r.verdict in ("within_noise", "improver")
    assert agree / draws <= 0.05
    assert old / draws >= 0.2  # the verdicts alone would have "agreed" far more often


def test_spec_accepts_and_refuses_forms(tmp_path: Path) -> None:
    def write(expect: object) -> Path:
        p = tmp_path / "spec.yaml"
        p.write_text(yaml.safe_dump({"name": "c", "methods": ["post_ln", "mix_ln"],
                                     "scales": ["tiny"], "claim": {"expect": expect}}))
        return p

    spec = load_spec(write({"mix_ln": ["not_worse(1σ)"], "post_ln": "worse"}))
    assert spec.claim is not None
    assert spec.claim.expect == {"mix_ln": ["not_worse(1σ)"], "post_ln": ["worse"]}
    for bad, says in [({"mix_ln": ["not_worse(x)"]}, "positive margin"),
                      ({"mix_ln": ["equivalnt(1σ)"]}, "unknown verdict"),
                      ({"mix_ln": ["bettr"]}, "did you mean 'better'"),
                      ({"mix_ln": [3]}, "is not a verdict")]:
        with pytest.raises(ModbenchError, match=says) as e:
            load_spec(write(bad))
        assert "\n" not in str(e.value) and "claim.expect.mix_ln" in str(e.value)


def test_spec_verdicts_are_the_claims() -> None:
    from modbench.analysis.results import VERDICT_NAMES
    from modbench.study.spec import VERDICTS

    assert VERDICTS == VERDICT_NAMES
