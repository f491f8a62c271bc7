"""A study spec's ``claim``: a published claim, and the verdicts that agree with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from modbench.errors import ModbenchError
from modbench.study.spec import ClaimSpec, expand, load_spec


def write(tmp_path: Path, claim: object, methods: tuple[str, ...] = ("post_ln", "mix_ln")) -> Path:
    tree = {"name": "c", "methods": list(methods), "scales": ["tiny"], "claim": claim}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_claim_is_read_and_survives_the_round_trip_through_spec_yaml(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, {"source": "CoMT preprint Table 3", "text": "Post-LN stalls.",
                                      "expect": {"post_ln": ["degrader", "diverged"],
                                                 "mix_ln": "improver"}}))
    assert spec.claim == ClaimSpec("CoMT preprint Table 3", "Post-LN stalls.",
                                   {"post_ln": ["degrader", "diverged"], "mix_ln": ["improver"]})
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(spec.to_dict()))
    assert load_spec(again) == spec
    expand(spec)  # valid


def test_a_spec_without_claim_round_trips(tmp_path: Path) -> None:
    spec = load_spec("smoke-tiny")
    assert spec.claim is None
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec.to_dict()))
    assert load_spec(path).claim is None


@pytest.mark.parametrize(("claim", "message"), [
    ({"expect": {"post_ln": ["worst"]}}, "unknown verdict 'worst'"),
    ({"expect": ["post_ln"]}, "must map methods to verdicts"),
    ({"expect": {"post_ln": []}}, "must be a verdict or a list"),
    ({"texts": "x"}, "unknown study key 'claim.texts'"),
    ("Post-LN stalls", "must be a mapping"),
])
def test_bad_claims_are_refused_in_one_line(claim: object, message: str, tmp_path: Path) -> None:
    with pytest.raises(ModbenchError, match=message) as e:
        load_spec(write(tmp_path, claim))
    assert "\n" not in str(e.value)


def test_expectations_only_for_methods_the_study_runs(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, {"expect": {"deepnorm": "degrader"}}))
    with pytest.raises(ModbenchError, match=r"claim.expect names \['deepnorm'\]"):
        expand(spec)


def test_load_results_checks_the_claim_against_the_verdicts(tmp_path: Path) -> None:
    """The fake study's verdicts: qknorm improver (15 sigma), post_ln degrader (5 sigma, Holm
    over the two live methods), layerscale diverged; the spec's claim is held against them."""
    from modbench.study.results import load_results
    from tests.study.test_study import fake_study

    folder = fake_study(tmp_path)
    tree = yaml.safe_load((folder / "spec.yaml").read_text())
    tree["claim"] = {"source": "a paper", "text": "qknorm helps, post_ln hurts",
                     "expect": {"qknorm": ["improver"], "post_ln": ["degrader"],
                                "layerscale": ["within_noise", "improver"]}}
    (folder / "spec.yaml").write_text(yaml.safe_dump(tree))
    res = load_results(folder)
    assert res.claim is not None and res.claim.text == "qknorm helps, post_ln hurts"
    got = {(r.scale, r.method): (r.verdict, r.outcome) for r in res.claim.rows}
    assert got == {("tiny", "qknorm"): ("improver", "agrees"),
                   ("tiny", "post_ln"): ("degrader", "agrees"),
                   ("tiny", "layerscale"): ("diverged", "contradicts")}
    assert res.claim.summary == "contradicted"


def test_a_method_whose_seeds_mostly_failed_is_claimed_as_failing() -> None:
    """Two of three seeds stalled and the third trained well: the verdict rests on the
    survivor (Fisher's test of 2 of 3 against 0 of 3 does not reject), but the claim judges
    the method as failing, its commoner outcome; one failed seed of three does not."""
    from modbench.analysis.results import check_claim
    from modbench.analysis.stats import compare

    base = {0: 4.0, 1: 4.02, 2: 3.98}
    results = compare({"baseline": base, "mostly": {0: 3.5, 1: None, 2: None},
                       "once": {0: 3.5, 1: 3.52, 2: None}}, "baseline",
                      higher_is_better=False, stalled={"mostly": 2, "once": 1})
    assert {str(r.verdict) for r in results if r.method == "mostly"} <= {"improver",
                                                                       "within_noise"}
    expect = {"mostly": ["stalled", "diverged"], "once": ["stalled"]}
    rows = {r.method: r for r in check_claim({"s": results}, expect).rows}
    assert rows["mostly"].verdict == "fails 2 of 3 (stalled)"
    assert rows["mostly"].outcome == "agrees" and "not on its 1 surviving seed" in rows[
        "mostly"].why
    assert rows["once"].verdict == str(next(r.verdict for r in results if r.method == "once"))
    assert rows["once"].outcome != "agrees"
    better = check_claim({"s": results}, {"mostly": ["improver"]}).rows[0]
    assert better.outcome == "contradicts"
