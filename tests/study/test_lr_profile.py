"""The learning-rate profile stage (spec ``lr_profile``): end to end at ``tiny`` (real runs),
its sensitivity against a hand computation from the recorded run losses, the report's
figure, table and sentences, resuming without training twice, and the block's checks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

import modbench.study.runner as runner
from modbench.cli import run_cli
from modbench.errors import ModbenchError
from modbench.report.profile import PROFILE_DIR, PROFILE_FILE
from modbench.study.plan import format_plan, plan_study
from modbench.study.reporting import write_study_report
from modbench.study.spec import load_spec
from modbench.study.store import Store
from tests.helpers import RecordingExecutor, Stopped

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = [0.5, 1.0, 4.0]


def write_spec(tmp_path: Path, claim: dict[str, Any] | None = None, **profile: Any) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({
        "name": "prof", "baseline": "baseline", "methods": ["qknorm"],
        "seeds": {"default": [0, 1], "noise_floor": [0, 1], "anchors": []},
        "scales": ["tiny"], "overrides": ["train.steps=12", "train.eval_every=6"],
        "evaluation": {"probes": False},
        "claim": claim or {"source": "Wortsman et al. 2023, arXiv:2309.14322",
                           "text": "QK-layernorm lowers learning-rate sensitivity.",
                           "expect": {"qknorm": ["less_sensitive"]}},
        "lr_profile": {"grid": GRID, **profile}}))
    return path


def hand_sensitivity(losses: list[float | None], init: float) -> float:
    """Wortsman et al. 2023 (arXiv:2309.14322) §3.1, computed here from the losses: the mean
    over the grid of min(loss, init) − the best loss, a failed point counted at init."""
    capped = [init if v is None or not math.isfinite(v) else min(v, init) for v in losses]
    return sum(c - min(capped) for c in capped) / len(capped)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("profile")
    out = tmp / "study"
    counts = runner.run_study(load_spec(write_spec(tmp)), out, progress=False)
    assert counts["failed"] == 0
    # the frozen study's 4 runs, then 2 methods x 3 rates x 2 seeds
    assert counts["total"] == 4 + 12
    write_study_report(out)
    return out


def test_a_profile_runs_end_to_end_and_its_sensitivity_is_the_hand_computation(
        profiled: Path) -> None:
    data = json.loads((profiled / PROFILE_DIR / PROFILE_FILE).read_text())
    per = data["scales"]["tiny"]
    store = Store(profiled / PROFILE_DIR)
    rows = store.rows()
    assert len(rows) == 12 and all(r["state"] == "done" for r in rows)
    # every run's rate and its recorded losses, read from its own folder
    recorded: dict[tuple[str, int, float], tuple[float | None, float]] = {}
    for r in rows:
        run = store.run_dir(r["key"])
        lr = yaml.safe_load((run / "config.yaml").read_text())["recipe"]["lr"]
        summary = json.loads((run / "summary.json").read_text())
        vals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        first = next(v["val_loss"] for v in vals if v.get("kind") == "val")
        failed = summary["status"] in ("diverged", "stalled")
        recorded[r["method"], int(r["seed"]), float(lr)] = (
            None if failed else summary["final_val_loss"], first)
    for method in ("baseline", "qknorm"):
        rates = per["rates"][method]
        base_lr = rates[GRID.index(1.0)]
        assert rates == pytest.approx([m * base_lr for m in GRID])
        prof = per["profiles"][method]
        seeds = {}
        for seed in (0, 1):
            losses = [recorded[method, seed, r][0] for r in rates]
            init = recorded[method, seed, rates[0]][1]
            seeds[str(seed)] = hand_sensitivity(losses, init)
            assert prof["seed_sensitivities"][str(seed)] == pytest.approx(seeds[str(seed)])
        assert prof["sensitivity"] == pytest.approx(sum(seeds.values()) / 2)
        for cell, rate in zip(prof["cells"], rates, strict=True):
            finite = [recorded[method, s, rate][0] for s in (0, 1)]
            finite = [v for v in finite if v is not None]
            assert cell["rate"] == pytest.approx(rate)
            if finite:
                assert cell["mean"] == pytest.approx(sum(finite) / len(finite))
    # a verdict at every grid point, the sensitivity verdict, the rule
    assert len(per["by_point"]) == len(GRID)
    assert {r["method"] for point in per["by_point"] for r in point} == {"baseline", "qknorm"}
    assert [v["method"] for v in per["sensitivity"]] == ["baseline", "qknorm"]
    assert per["sensitivity"][1]["delta"] == pytest.approx(
        per["profiles"]["qknorm"]["sensitivity"] - per["profiles"]["baseline"]["sensitivity"])
    assert set(per["rate_dependent"]) <= {"qknorm"}
    assert data["rule"]["alpha"] == 0.05


def test_a_sensitivity_claim_is_judged_by_the_profiles_verdict(profiled: Path) -> None:
    from modbench.study.results import load_results

    per = json.loads((profiled / PROFILE_DIR / PROFILE_FILE).read_text())["scales"]["tiny"]
    verdict = next(v["verdict"] for v in per["sensitivity"] if v["method"] == "qknorm")
    claim = load_results(profiled).claim
    assert claim is not None
    (row,) = claim.rows
    assert (row.method, row.verdict) == ("qknorm", verdict)
    assert row.outcome == {"less_sensitive": "agrees", "more_sensitive": "contradicts"}.get(
        verdict, "not shown")


def test_sensitivity_forms_against_the_profiles_verdicts() -> None:
    from modbench.analysis.results import check_claim
    from modbench.analysis.stats import compare

    comparisons = {"tiny": compare({"baseline": {0: 4.0, 1: 4.1, 2: 4.05},
                                    "a": {0: 4.0, 1: 4.1, 2: 4.05},
                                    "b": {0: 4.0, 1: 4.1, 2: 4.05}}, "baseline",
                                   higher_is_better=False)}
    expect = {"a": ["less_sensitive"], "b": ["less_sensitive"]}
    sens = {"tiny": {"a": "less_sensitive", "b": "more_sensitive"}}
    rows = {r.method: r for r in check_claim(comparisons, expect, sensitivity=sens).rows}
    assert (rows["a"].outcome, rows["a"].verdict) == ("agrees", "less_sensitive")
    assert (rows["b"].outcome, rows["b"].verdict) == ("contradicts", "more_sensitive")
    shown = check_claim(comparisons, expect, sensitivity={"tiny": {"a": "not_shown"}}).rows
    assert [r.outcome for r in shown] == ["not shown", "not run"]
    assert [r.outcome for r in check_claim(comparisons, expect).rows] == ["not run"] * 2
    mixed = check_claim(comparisons, {"a": ["improver", "less_sensitive"]}, sensitivity=sens)
    assert mixed.rows[0].outcome == "agrees" and mixed.rows[0].verdict == "within_noise"


def test_a_sensitivity_claim_needs_a_profile(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "methods": ["qknorm"], "scales": ["tiny"],
                                    "claim": {"expect": {"qknorm": ["less_sensitive"]}}}))
    with pytest.raises(ModbenchError, match="less_sensitive judges a learning-rate profile"):
        load_spec(path)


def test_the_report_has_the_figure_the_table_and_a_sentence(profiled: Path) -> None:
    md = (profiled / "report" / "report.md").read_text()
    assert "## Learning-rate profile" in md
    assert (profiled / "report" / "lr_profile_tiny.png").stat().st_size > 1000
    assert "| method | best rate | best loss | sensitivity | vs baseline |" in md
    section = md.split("## Learning-rate profile")[1]
    line = next(x for x in section.splitlines() if x.startswith("- `qknorm` "))
    assert ("improves" in line or "degrades" in line or "no decided difference" in line)
    assert "sensitiv" in line


def test_status_and_the_dry_run_name_the_profile(profiled: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["study", "status", str(profiled)]) == 0
    shown = capsys.readouterr().out
    assert f"{profiled / PROFILE_DIR}: 12 runs" in shown and "recipe.lr=" in shown
    spec = load_spec(profiled / "spec.yaml")
    text = format_plan(plan_study(spec, profiled))
    assert f"then stage lr_profile -> {profiled / PROFILE_DIR}: 0 of 12 runs to train" in text


def test_a_killed_profile_resumes_without_training_anything_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_spec(write_spec(tmp_path))
    out = tmp_path / "study"

    def loss(folder: str, method: str, seed: int) -> float:
        return 4.0 + 0.01 * seed

    # the frozen study's 4 runs, then 5 of the profile's 12
    first = RecordingExecutor(loss, stop=4 + 5).install(monkeypatch)
    with pytest.raises(Stopped):
        runner.run_study(spec, out, progress=False)
    assert not (out / PROFILE_DIR / PROFILE_FILE).exists()
    again = RecordingExecutor(loss).install(monkeypatch)
    counts = runner.run_study(spec, out, progress=False)
    assert counts["already_done"] == 4 + 5 and counts["trained"] == 7
    # each (folder, key) once (the profile's ×1 point has the frozen runs' keys, in its folder)
    assert not set(first.keys) & set(again.keys) and len(set(first.keys + again.keys)) == 16
    assert (out / PROFILE_DIR / PROFILE_FILE).is_file()


@pytest.mark.parametrize(("profile", "message"), [
    ({"rates": [1e-3, 2e-3]}, "one of grid .* or rates .*; got both"),
    ({"grid": [1.0]}, "'lr_profile.grid' must be a list of at least two"),
    ({"grid": [1.0, -2.0]}, "'lr_profile.grid' must be a list of at least two distinct"),
    ({"select_seeds": [1]}, r"select_seeds shares seed\(s\) \[1\]"),
    ({"tolerance": 0}, "'lr_profile.tolerance' must be a positive loss difference"),
    ({"step": 2}, "unknown study key 'lr_profile.step'"),
])
def test_a_bad_profile_block_is_one_line(tmp_path: Path, profile: dict[str, Any],
                                         message: str) -> None:
    with pytest.raises(ModbenchError, match=message):
        load_spec(write_spec(tmp_path, **profile))


def test_a_rate_dependent_method_is_named_in_the_warnings_and_results(tmp_path: Path) -> None:
    """The profile's flag reaches the study's own report: a warning in its first lines, and
    ``rate_dependent`` on the method's row of results.json (no other row has the key)."""
    import dataclasses

    from modbench.analysis.stats import compare
    from modbench.report.build import budget_warnings, results_json
    from modbench.study.results import rate_dependence_of

    folder = tmp_path / "s"
    (folder / PROFILE_DIR).mkdir(parents=True)
    point = [{"method": "baseline", "verdict": "baseline"}]
    (folder / PROFILE_DIR / PROFILE_FILE).write_text(json.dumps({
        "points": ["×0.5", "×1", "×4"], "scales": {"tiny": {
            "rate_dependent": {"a": True, "b": False},
            "by_point": [[*point, {"method": "a", "verdict": v}, {"method": "b", "verdict": w}]
                         for v, w in (("improver", "improver"), ("within_noise", "improver"),
                                      ("degrader", "within_noise"))]}}}))
    flagged = rate_dependence_of(folder)
    assert flagged == {"tiny": {"a": "improver at ×0.5; degrader at ×4"}}
    from modbench.analysis.results import StudyResults

    table = {"baseline": {0: 4.0, 1: 4.1, 2: 4.05}, "a": {0: 4.0, 1: 4.1, 2: 4.05},
             "b": {0: 4.0, 1: 4.1, 2: 4.05}}
    res = StudyResults(name="s", folder=folder, baseline="baseline", metric="val_loss",
                       anchors=[], rows=[], comparisons={"tiny": compare(
                           table, "baseline", higher_is_better=False)})
    assert not any("rate-dependent" in w for w in budget_warnings(res))
    res = dataclasses.replace(res, rate_dependent=flagged)
    assert any(w.startswith("`a` at tiny is rate-dependent (improver at ×0.5; degrader at ×4")
               for w in budget_warnings(res))
    from modbench.analysis.results import comparisons_json

    rows = results_json(res, comparisons_json(res.comparisons))["tiny"]
    assert [r.get("rate_dependent") for r in rows] == [None, True, None]
