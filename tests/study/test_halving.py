"""The learning-rate profile's successive halving (``lr_profile.halving``; issue 45 item 3):
the rule against a hand reading of the recorded losses, real runs at ``tiny`` paused at a rung
and dropped or resumed, the kept runs equal to an unhalved profile's, replay and reopening
without training twice, and the block's checks."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

import modbench.study.runner as runner
from modbench.analysis.profile import halving_drops, method_profile
from modbench.errors import ModbenchError
from modbench.report.profile import PROFILE_DIR, PROFILE_FILE
from modbench.runtime.checkpoint import load_checkpoint
from modbench.runtime.runfolder import CHECKPOINT
from modbench.study.reporting import write_study_report
from modbench.study.spec import load_spec
from modbench.study.stages.halving import rung_step
from modbench.study.store import Store

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = [0.01, 1.0, 4.0]
SEEDS = [0]  # the profile's (the rule pairs seeds: several seeds are the unit tests' part)
HALVING = {"at": [0.5], "margin": 0.05}


def write_spec(tmp_path: Path, halving: Any = None, name: str = "spec.yaml") -> Path:
    profile: dict[str, Any] = {"grid": GRID, "seeds": SEEDS}
    if halving is not None:
        profile["halving"] = halving
    path = tmp_path / name
    path.write_text(yaml.safe_dump({
        "name": "halv", "baseline": "baseline", "methods": ["qknorm"],
        "seeds": {"default": [0, 1], "noise_floor": [0, 1], "anchors": []},
        "scales": ["tiny"], "overrides": ["train.steps=12", "train.eval_every=3"],
        "evaluation": {"probes": False}, "lr_profile": profile}))
    return path


def profile_runs(out: Path) -> dict[tuple[str, int, float], dict[str, Any]]:
    """Every profile run: (method, seed, lr) -> its row, summary, val losses and folder."""
    store = Store(out / PROFILE_DIR)
    found = {}
    for r in store.rows():
        run = store.run_dir(r["key"])
        lr = float(yaml.safe_load((run / "config.yaml").read_text())["recipe"]["lr"])
        vals = {json.loads(x)["step"]: json.loads(x)["val_loss"]
                for x in (run / "metrics.jsonl").read_text().splitlines()
                if json.loads(x).get("kind") == "val"}
        found[r["method"], int(r["seed"]), lr] = {
            "row": r, "summary": json.loads((run / "summary.json").read_text()),
            "vals": vals, "run": run}
    return found


@pytest.fixture(scope="module")
def halved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("halving")
    out = tmp / "study"
    counts = runner.run_study(load_spec(write_spec(tmp, HALVING)), out, progress=False)
    assert counts["failed"] == 0
    return out, counts


@pytest.fixture(scope="module")
def unhalved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("whole")
    runner.run_study(load_spec(write_spec(tmp)), tmp / "study", progress=False)
    return tmp / "study"


def test_the_rule_drops_what_is_worse_on_every_seed_by_the_margin() -> None:
    losses: list[dict[int, float | None] | None] = [
        {0: 5.0, 1: 5.2},   # best mean (5.1)
        {0: 5.3, 1: 5.21},  # worse on average, but seed 1 only by 0.01: kept
        {0: 5.5, 1: 5.4},   # worse by 0.5 and 0.2 on each seed: dropped
        None,               # out of the running
        {0: 6.0, 1: None},  # a seed failed: ends by itself, not compared
    ]
    drops = halving_drops(losses, 0.1)
    assert [(d.point, d.best) for d in drops] == [(2, 0)]
    assert drops[0].gap == pytest.approx(0.35) and drops[0].min_gap == pytest.approx(0.2)
    assert [d.point for d in halving_drops(losses, 0.0)] == [1, 2]
    assert halving_drops([{0: 5.0}, None], 0.0) == []  # nothing to compare with
    with pytest.raises(ValueError, match="margin"):
        halving_drops(losses, math.nan)


def test_a_dropped_point_is_no_best_rate_and_enters_the_sensitivity_at_its_drop_loss() -> None:
    table = {1e-3: {0: 4.0, 1: 4.2}, 2e-3: {0: 3.5, 1: 3.7}, 4e-3: {0: None, 1: None}}
    prof = method_profile("m", table, 6.0, dropped={1e-3: {0: 5.0, 1: 5.5}})
    cell = prof.cells[0]
    assert cell.dropped == 2 and cell.mean is None and cell.failed == 0
    assert prof.best_rate == 2e-3 and prof.max_stable_rate == 2e-3
    # a dropped point above every trained one: the largest stable rate is the trained one's
    above = method_profile("m", {1e-3: {0: 4.0}, 2e-3: {0: 4.5}}, 6.0,
                           dropped={2e-3: {0: 5.0}})
    assert above.max_stable_rate == 1e-3
    # seed 0: (5.0 - 3.5 + 0 + 6.0 - 3.5) / 3; seed 1: (5.5 - 3.7 + 0 + 6.0 - 3.7) / 3
    assert prof.seed_sensitivities[0] == pytest.approx((1.5 + 2.5) / 3)
    assert prof.seed_sensitivities[1] == pytest.approx((1.8 + 2.3) / 3)
    assert cell.to_dict()["dropped"] == 2 and "dropped" not in prof.cells[1].to_dict()
    with pytest.raises(ValueError, match="not in the table"):
        method_profile("m", table, 6.0, dropped={9.0: {0: 5.0}})


def test_rung_steps_are_validation_steps_before_the_end() -> None:
    assert rung_step(0.2, 500, 100) == 100
    assert rung_step(0.25, 500, 50) == 150  # 125 rounds to the nearer validation, 150
    assert rung_step(0.01, 500, 100) == 100  # at least one validation in
    assert rung_step(0.9, 500, 250) is None  # 500 is the end: no pause
    assert rung_step(0.5, 12, 3) == 6


def test_halving_drops_by_the_recorded_losses_and_the_rest_equal_an_unhalved_profile(
        halved: tuple[Path, dict[str, Any]], unhalved: Path) -> None:
    out, counts = halved
    runs, whole = profile_runs(out), profile_runs(unhalved)
    assert set(runs) == set(whole)
    data = json.loads((out / PROFILE_DIR / PROFILE_FILE).read_text())
    expected = []  # the rule by hand, from the losses the runs logged at step 6
    for method in ("baseline", "qknorm"):
        rates = data["scales"]["tiny"]["rates"][method]
        at6 = {lr: {s: runs[method, s, lr]["vals"][6] for s in SEEDS} for lr in rates}
        best = min(rates, key=lambda lr: (sum(at6[lr].values()) / len(SEEDS), rates.index(lr)))
        for i, lr in enumerate(rates):
            if lr != best and all(at6[lr][s] - at6[best][s] > HALVING["margin"] for s in SEEDS):
                expected.append((method, data["points"][i]))
    decisions = data["halving"]["decisions"]
    assert [(d["method"], d["point"]) for d in decisions] == expected
    assert ("baseline", "×0.01") in expected  # the point that barely trains is dropped
    gone = {(d["method"], d["point"]) for d in decisions}
    for (method, seed, lr), r in runs.items():
        point = data["points"][data["scales"]["tiny"]["rates"][method].index(lr)]
        if (method, point) in gone:
            s = r["summary"]
            assert r["row"]["status"] == s["status"] == "dropped" and s["steps"] == 6
            assert s["val_loss_at_drop"] == r["vals"][6] == whole[method, seed, lr]["vals"][6]
            assert max(r["vals"]) == 6  # it trained no further
            assert load_checkpoint(r["run"] / CHECKPOINT)["step"] == 6  # kept, to reopen
        else:  # paused at 6 and resumed: the very run that never paused
            assert r["summary"]["status"] == "completed"
            assert r["summary"]["final_val_loss"] == whole[method, seed, lr]["summary"][
                "final_val_loss"]
            assert r["summary"]["batches_sha256"] == whole[method, seed, lr]["summary"][
                "batches_sha256"]
    steps = data["halving"]
    assert steps["steps_planned"] == 12 * len(runs)
    assert steps["steps_trained"] == sum(r["summary"]["steps"] for r in runs.values()) \
        < steps["steps_planned"]
    assert counts["dropped"] == len(SEEDS) * len(gone)
    # the frozen study's 4 runs and the profile's kept runs trained; nothing was done before
    assert counts["already_done"] == 0
    assert counts["trained"] == 4 + len(runs) - counts["dropped"]
    cells = {(m, c["rate"]): c for m, p in data["scales"]["tiny"]["profiles"].items()
             for c in p["cells"]}
    for method, point in gone:
        lr = data["scales"]["tiny"]["rates"][method][data["points"].index(point)]
        assert cells[method, lr]["dropped"] == len(SEEDS) and cells[method, lr]["mean"] is None
    by_point = data["scales"]["tiny"]["by_point"][data["points"].index("×0.01")]
    assert {"method": "baseline", "verdict": "dropped"} in by_point


def test_the_dry_run_states_the_rule(halved: tuple[Path, dict[str, Any]]) -> None:
    from modbench.study.plan import format_plan, plan_study

    out, _ = halved
    text = format_plan(plan_study(load_spec(out / "spec.yaml"), out))
    assert "halving: a point worse than its method's best by more than 0.05 on every seed at " \
        "0.5 of the steps stops there" in text


def test_the_report_marks_the_dropped_points(halved: tuple[Path, dict[str, Any]]) -> None:
    out, _ = halved
    write_study_report(out)
    text = (out / "report" / "report.md").read_text()
    assert "Successive halving" in text and " h" in text
    assert (out / "report" / "lr_profile_tiny.png").is_file()


def test_running_again_trains_nothing_and_without_the_rule_reopens_the_dropped(
        tmp_path: Path, halved: tuple[Path, dict[str, Any]], unhalved: Path) -> None:
    out = tmp_path / "study"
    shutil.copytree(halved[0], out)
    before = profile_runs(out)
    again = runner.run_study(load_spec(write_spec(tmp_path, HALVING)), out, progress=False)
    assert again["trained"] == 0 and again["failed"] == 0
    assert {k: r["summary"] for k, r in profile_runs(out).items()} == {
        k: r["summary"] for k, r in before.items()}
    # the rule gone: the dropped runs resume from their checkpoints to the end, and nothing
    # else trains; every run then equals the unhalved profile's
    dropped = sum(r["row"]["status"] == "dropped" for r in before.values())
    assert dropped > 0
    spec = load_spec(write_spec(tmp_path, None, "plain.yaml"))
    last = runner.run_study(spec, out, progress=False)
    assert last["trained"] == dropped
    after, whole = profile_runs(out), profile_runs(unhalved)
    for k, r in after.items():
        assert r["summary"]["status"] == whole[k]["summary"]["status"]
        assert r["summary"]["final_val_loss"] == whole[k]["summary"]["final_val_loss"]
    assert "halving" not in json.loads((out / PROFILE_DIR / PROFILE_FILE).read_text())


@pytest.mark.parametrize(("halving", "message"), [
    ({"at": [0.5, 0.2]}, "'lr_profile.halving.at' must be a non-empty increasing list"),
    ({"at": [1.0]}, "'lr_profile.halving.at' must be a non-empty increasing list"),
    ({"at": []}, "'lr_profile.halving.at' must be a non-empty increasing list"),
    ({"margin": -0.1}, "'lr_profile.halving.margin' must be a loss difference"),
    ({"rungs": [0.5]}, "unknown study key 'lr_profile.halving.rungs'"),
    ("often", "'lr_profile.halving' must be true, or a mapping"),
])
def test_a_bad_halving_block_is_one_line(tmp_path: Path, halving: Any, message: str) -> None:
    with pytest.raises(ModbenchError, match=message):
        load_spec(write_spec(tmp_path, halving))


def test_halving_true_takes_the_calibrated_defaults(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, True))
    assert spec.lr_profile is not None
    assert spec.lr_profile.halving == {"at": [0.2, 0.4], "margin": 0.1}


def test_a_sensitivity_claim_refuses_halving(tmp_path: Path) -> None:
    path = write_spec(tmp_path, True)
    tree = yaml.safe_load(path.read_text())
    tree["claim"] = {"source": "Wortsman et al. 2023", "text": "less sensitive",
                     "expect": {"qknorm": ["less_sensitive"]}}
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ModbenchError, match="halving makes approximate"):
        load_spec(path)
