"""Tuned versus frozen verdicts (a spec's ``tuning`` block): the two stages, the choice of the
best value, the seeds no verdict may read, the report's side-by-side section, and the spec's
one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from modbench.analysis.results import RunRow
from modbench.cli import run_cli
from modbench.errors import ModbenchError
from modbench.report.tuning import BEST_FILE, TUNED_DIR, TUNING_DIR, VERDICTS_FILE
from modbench.study.reporting import write_study_report
from modbench.study.results import load_results, load_rows
from modbench.study.runner import run_study
from modbench.study.spec import load_spec
from modbench.study.stages.tuning import choose_best, tuned_runs, tuned_verdicts, tuning_runs

pytestmark = pytest.mark.usefixtures("one_thread")

TUNING_SEEDS = [100]
GRID = [1e-3, 3e-2]


def write_spec(tmp: Path, **kw: Any) -> Path:
    tree: dict[str, Any] = {
        "name": "tuned", "baseline": "baseline", "methods": ["post_ln"],
        "seeds": {"default": [0], "noise_floor": [0, 1, 2], "anchors": []},
        "scales": ["tiny"], "overrides": ["recipe.lr=1e-3", "train.steps=4",
                                          "train.eval_every=0"],
        "evaluation": {"probes": False, "primary": "val_loss"},
        "tuning": {"key": "recipe.lr", "grid": ["1e-3", 3e-2], "seeds": TUNING_SEEDS}}
    tree.update(kw)
    p = tmp / "spec.yaml"
    p.write_text(yaml.safe_dump(tree))
    return p


def _lr(row: RunRow) -> float:
    assert row.run_dir is not None
    cfg = yaml.safe_load((row.run_dir / "config.yaml").read_text())
    return float(cfg["recipe"]["lr"])


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tuned")
    out = tmp / "study"
    counts = run_study(load_spec(write_spec(tmp)), out, progress=False)
    # frozen 3 + 1, tuning 2 methods x 2 values x 1 seed, tuned 3 + 1
    assert counts["total"] == 4 + 4 + 4 and counts["failed"] == 0, counts
    write_study_report(out)
    return out


def test_tuning_seeds_never_enter_a_verdict(study: Path) -> None:
    tuning = load_rows(study / TUNING_DIR)
    assert {r.seed for r in tuning} == set(TUNING_SEEDS)
    # every row a verdict reads: the frozen study's and the tuned stage's
    frozen, tuned = load_rows(study), load_rows(study / TUNED_DIR)
    assert {r.seed for r in frozen} == {r.seed for r in tuned} == {0, 1, 2}
    assert not {r.key for r in tuning} & ({r.key for r in frozen} | {r.key for r in tuned})
    read = json.loads((study / TUNED_DIR / VERDICTS_FILE).read_text())["seeds"]
    seen = {s for per in read.values() for seeds in per.values() for s in seeds}
    assert seen == {0, 1, 2} and not seen & set(TUNING_SEEDS)
    # the frozen verdicts: the main folder only, every run at the spec's rate
    assert {_lr(r) for r in frozen} == {1e-3}


def test_best_value_is_the_argmin_of_the_tuning_runs(study: Path) -> None:
    best = json.loads((study / TUNING_DIR / BEST_FILE).read_text())
    assert best["grid"] == GRID  # "1e-3" from YAML read as the key's float
    by: dict[tuple[str, float], list[float | None]] = {}
    for r in load_rows(study / TUNING_DIR):
        by.setdefault((r.method, _lr(r)), []).append(r.metric("val_loss"))
    tuned = load_rows(study / TUNED_DIR)
    # at 4 steps the higher rate trains further: the tuned stage runs a value the frozen
    # study did not, so the two stores differ (as the test means them to)
    assert {e["best"] for e in best["scales"]["tiny"].values()} == {3e-2}
    for method in ("baseline", "post_ln"):
        scores = {lr: (sum(v is None for v in vs),
                       sum(v for v in vs if v is not None) / max(1, sum(v is not None
                                                                        for v in vs)))
                  for (m, lr), vs in by.items() if m == method}
        assert len(scores) == 2
        want = min(scores, key=lambda lr: scores[lr])
        entry = best["scales"]["tiny"][method]
        assert entry["best"] == want and entry["frozen"] == 1e-3
        # the tuned stage trained the method at that value, on the verdict seeds
        assert {_lr(r) for r in tuned if r.method == method} == {want}


def test_report_shows_both_verdicts(study: Path) -> None:
    text = (study / "report" / "report.md").read_text()
    assert "## Frozen versus tuned" in text
    frozen = {r.method: r.to_dict()["verdict"]
              for r in load_results(study).comparisons["tiny"]}
    tuned = {r["method"]: r["verdict"] for r in json.loads(
        (study / TUNED_DIR / VERDICTS_FILE).read_text())["comparisons"]["tiny"]}
    best = json.loads((study / TUNING_DIR / BEST_FILE).read_text())["scales"]["tiny"]
    row = next(line for line in text.splitlines() if line.startswith("| `post_ln` |")
               and "tuned" not in line and line.count("|") == 9)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == frozen["post_ln"] and cells[6] == tuned["post_ln"]
    assert cells[3] == f"{best['post_ln']['best']:g}"
    assert f"at recipe.lr=0.001{'' if frozen['post_ln'] in ('stalled', 'diverged') else ' (Δ '}" \
        in text
    assert f"at its own best recipe.lr ({best['post_ln']['best']:g}" in text


def test_tuned_verdicts_of_an_earlier_choice_are_not_shown(study: Path, tmp_path: Path) -> None:
    """A tuned stage cut before it finished leaves verdicts.json of the values chosen before:
    the report says the stage has not finished instead of pairing them with the new choice."""
    copy = tmp_path / "study"
    shutil.copytree(study, copy)
    path = copy / TUNED_DIR / VERDICTS_FILE
    data = json.loads(path.read_text())
    data["values"]["tiny"]["post_ln"] = 1e-3
    path.write_text(json.dumps(data))
    text = (write_study_report(copy) / "report.md").read_text()
    assert "The tuned stage has not finished" in text
    row = next(line for line in text.splitlines() if line.startswith("| `post_ln` |")
               and line.count("|") == 9)
    assert [c.strip() for c in row.strip("|").split("|")][6] == "not run"


def _row(key: str, method: str, seed: int, loss: float | None,
         status: str = "completed") -> RunRow:
    return RunRow(key=key, scale="tiny", method=method, seed=seed, state="done",
                  status=status, val_loss=loss, params=None, tokens=None,
                  diverged_at_step=None)


def test_a_failed_tuning_run_is_the_worst_and_ties_go_to_the_frozen_value(
        tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, overrides=["recipe.lr=1e-3", "train.steps=6"],
                                tuning={"key": "recipe.lr", "grid": [3e-2, 1e-3, 3e-3],
                                        "seeds": [100, 101]}))
    runs = tuning_runs(spec)
    assert len(runs) == 2 * 3 * 2
    # per (method, value): the two tuning seeds' losses (means 1.0, 2.0, 1.0; 0.5, 3.0, 2.5)
    loss = {("baseline", 3e-2): (0.5, 1.5), ("baseline", 1e-3): (2.0, 2.0),
            ("baseline", 3e-3): (1.25, 0.75), ("post_ln", 3e-2): (0.5, 0.5),
            ("post_ln", 1e-3): (3.5, 2.5), ("post_ln", 3e-3): (2.0, 3.0)}
    rows = [_row(r.key, r.method, r.seed, loss[(r.method, v)][r.seed - 100],
                 "diverged" if (r.method, v, r.seed) == ("post_ln", 3e-2, 101) else "completed")
            for v, r in runs]
    scales = choose_best(spec, runs, rows)["scales"]["tiny"]
    # baseline: 3e-2 and 3e-3 tie at 1.0, neither is the frozen 1e-3: the earlier grid value
    assert scales["baseline"]["best"] == 3e-2
    # post_ln: one seed of its lowest loss diverged, so counts as worst: 3e-3 wins over the
    # frozen 1e-3 on its mean
    assert scales["post_ln"]["best"] == 3e-3
    assert [(e["mean"], e["failed"]) for e in scales["post_ln"]["tried"]] == [
        (0.5, 1), (3.0, 0), (2.5, 0)]
    tie = [_row(r.key, r.method, r.seed, 1.0) for _, r in runs]
    assert {e["best"] for e in choose_best(spec, runs, tie)["scales"]["tiny"].values()} == {
        1e-3}
    missing = choose_best(spec, runs, [])["scales"]["tiny"]["post_ln"]  # none finished
    assert missing["best"] == 1e-3 and all(e["failed"] == 2 for e in missing["tried"])


def test_tuned_verdicts_read_only_the_runs_at_the_chosen_values(tmp_path: Path) -> None:
    """A tuned folder keeps runs at a value an earlier tuning chose (a changed grid, more
    tuning seeds): the verdicts read only the runs at the values chosen now."""
    spec = load_spec(write_spec(tmp_path))
    best = {"scales": {"tiny": {"baseline": {"best": 3e-2}, "post_ln": {"best": 1e-3}}}}
    runs = tuned_runs(spec, best)
    assert sorted((r.method, r.seed) for r in runs) == [
        ("baseline", 0), ("baseline", 1), ("baseline", 2), ("post_ln", 0)]
    loss = {("baseline", 0): 5.0, ("baseline", 1): 5.02, ("baseline", 2): 4.98,
            ("post_ln", 0): 5.01}
    rows = [_row(r.key, r.method, r.seed, loss[(r.method, r.seed)]) for r in runs]
    old = tuned_runs(spec, {"scales": {"tiny": {"baseline": {"best": 3e-2},
                                                "post_ln": {"best": 3e-2}}}})
    stale = [_row(r.key, r.method, r.seed, 3.0) for r in old if r.method == "post_ln"]
    assert not {r.key for r in stale} & {r.key for r in runs}
    got = tuned_verdicts(spec, rows + stale, runs)
    post = next(r for r in got["comparisons"]["tiny"] if r["method"] == "post_ln")
    assert post["verdict"] == "within_noise" and post["mean"] == pytest.approx(5.01)
    assert got["seeds"]["tiny"] == {"baseline": [0, 1, 2], "post_ln": [0]}
    assert got["values"] == {"tiny": {"baseline": 3e-2, "post_ln": 1e-3}}
    with_stale = tuned_verdicts(spec, rows + stale, old + runs)  # both sets: the stale wins
    assert next(r for r in with_stale["comparisons"]["tiny"]
                if r["method"] == "post_ln")["verdict"] == "improver"


@pytest.mark.parametrize(("tuning", "msg"), [
    ({"key": "recipe.lr", "grid": [1e-3], "seeds": [1]}, "shares seed(s) [1]"),
    ({"key": "recipe.lrr", "grid": [1e-3]}, "'tuning.key' must be a run config key"),
    ({"key": "seed", "grid": [1, 2]}, "'tuning.key' must be a run config key"),
    ({"key": "recipe.lr", "grid": []}, "'tuning.grid' must be a non-empty list"),
    ({"key": "recipe.lr", "grid": [1e-3, "fast"]}, "tuning.grid value 'fast' is not a value"),
    ({"key": "recipe.lr", "grid": [1e-3, 0.001]}, "lists 0.001 twice"),
    ({"key": "recipe.lr", "grid": [1e-3], "seeds": []}, "'tuning.seeds' must be"),
    ({"key": "recipe.lr", "grid": [1e-3], "sedes": [5]}, "unknown study key 'tuning.sedes'"),
])
def test_spec_errors_are_one_line(tmp_path: Path, tuning: dict[str, Any], msg: str) -> None:
    with pytest.raises(ModbenchError, match=None) as e:
        load_spec(write_spec(tmp_path, tuning=tuning))
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_validate_counts_the_stages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["study", "validate", str(write_spec(tmp_path))]) == 0
    assert ("valid — 4 runs, 2 methods, scales tiny; tuning recipe.lr: 4 tuning runs, then 4 "
            "tuned runs") in capsys.readouterr().out
    bad = write_spec(tmp_path, tuning={"key": "recipe.lr", "grid": [1e-3], "seeds": [0]})
    assert run_cli(["study", "validate", str(bad)]) == 2
    assert "tuning.seeds shares seed(s) [0]" in capsys.readouterr().err


def test_until_decided_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ModbenchError, match="--until-decided") as e:
        run_study(load_spec(write_spec(tmp_path)), tmp_path / "s", until_decided=3,
                  progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "s").exists()


def test_dry_run_counts_every_stage(study: Path, tmp_path: Path) -> None:
    """`study run --dry-run` of a tuned spec counts the tuning and tuned stages after the
    frozen study: before anything ran, 2 methods x 2 values x 1 seed and one tuned run per
    verdict run (at a value still to choose); on the finished study, nothing is left."""
    from modbench.study.plan import format_plan, plan_study, run_flops

    spec = load_spec(write_spec(tmp_path))
    fresh = plan_study(spec, tmp_path / "fresh")
    assert [(s.name, s.runs, s.done, s.known) for s in fresh.stages] == [
        ("tuning", 4, 0, True), ("tuned", 4, 0, False)]
    # recipe.lr does not change a run's FLOPs: the tuned stage costs what the frozen one does
    assert fresh.stages[0].flops == pytest.approx(
        sum(run_flops(r.config) for _, r in tuning_runs(spec)))
    assert fresh.stages[1].flops == pytest.approx(fresh.flops)
    assert not fresh.stages[1].upper_bound
    text = format_plan(fresh)
    assert "then stage tuning" in text and "then stage tuned" in text
    assert "all stages: 12 runs" in text
    # train.steps does change them: the tuned stage is costed at the costliest value
    steps = load_spec(write_spec(tmp_path, tuning={"key": "train.steps", "grid": [2, 4],
                                                   "seeds": TUNING_SEEDS}))
    bound = plan_study(steps, tmp_path / "steps").stages[1]
    assert bound.upper_bound and "at most" in format_plan(plan_study(steps, tmp_path / "s2"))
    done = plan_study(spec, study)
    assert done.runs == done.done and [(s.runs, s.done, s.known) for s in done.stages] == [
        (4, 4, True), (4, 4, True)]
    assert "all stages: 0 runs" in format_plan(done)


def test_status_shows_the_stages_with_their_values(study: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["study", "status", str(study)]) == 0
    out = capsys.readouterr().out
    assert f"{study / TUNING_DIR}: 4 runs" in out and f"{study / TUNED_DIR}: 4 runs" in out
    tuning = out.split(str(study / TUNING_DIR))[1].split(str(study / TUNED_DIR))[0]
    assert tuning.count("recipe.lr=0.001") == 2 and tuning.count("recipe.lr=0.03") == 2
