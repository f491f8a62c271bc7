"""Verdicts over training (issue 29, item 9): the verdict rule at every validation step where
every seed has a validation loss, the late-flip warning, and the report's section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modbench.analysis import stats as S
from modbench.analysis.results import RunRow, StudyResults, compare_scales
from modbench.analysis.trajectory import common_steps, late_flips, trajectory

NOISE = {0: 0.0, 1: 0.01, 2: -0.01}
STEPS = list(range(10, 101, 10))


def curve(method: str, seed: int) -> list[tuple[int, float]]:
    """Validation losses falling with step; 'steady' 0.1 lower throughout, 'late' 0.1 lower
    until step 70 and 0.1 higher from step 80 (its verdict flips in the last third)."""
    out = []
    for s in STEPS:
        v = 4.0 - s / 100 + NOISE[seed]
        if method == "steady":
            v -= 0.1
        elif method == "late":
            v += -0.1 if s <= 70 else 0.1
        out.append((s, v))
    return out


def curves_of(methods: tuple[str, ...] = ("baseline", "steady", "late")
              ) -> dict[str, dict[int, list[tuple[int, float]] | None]]:
    return {m: {seed: curve(m, seed) for seed in NOISE} for m in methods}


def test_steps_where_every_seed_has_a_loss() -> None:
    cv = curves_of()
    cv["steady"][1] = [p for p in cv["steady"][1] if p[0] != 50]  # one validation missing
    cv["late"][2] = None  # a failed run: no constraint, a failed seed at every step
    assert common_steps(cv) == [s for s in STEPS if s != 50]
    assert common_steps({}) == []


def test_each_step_is_the_verdict_rule() -> None:
    """At each step, exactly compare() of that step's losses (lower is better)."""
    cv = curves_of()
    pts = trajectory(cv, higher_is_better=False)
    assert [p.step for p in pts] == [s for s in STEPS for _ in range(2)]
    for step in (10, 80):
        table = {m: {seed: dict(c)[step] for seed, c in s.items()} for m, s in cv.items()}
        want = S.compare(table, higher_is_better=False, n_resamples=1)[1:]
        got = [p for p in pts if p.step == step]
        assert [(p.method, p.verdict, p.n) for p in got] == [
            (r.method, str(r.verdict), r.n) for r in want]
        assert [p.delta for p in got] == pytest.approx([r.delta for r in want])
        assert [p.ci for p in got] == [r.ci for r in want]
    late = {p.step: p.verdict for p in pts if p.method == "late"}
    assert late[70] == "improver" and late[80] == "degrader"
    assert trajectory({"m": {0: [(1, 1.0)]}}) == []  # no baseline


def test_late_flip_is_warned_an_early_one_is_not() -> None:
    pts = trajectory(curves_of(), higher_is_better=False)
    (flip,) = late_flips(pts)
    assert (flip.method, flip.step, flip.before, flip.after, flip.last_step) == (
        "late", 80, "improver", "degrader", 100)
    assert "last third" in flip.sentence()
    # a change at step 30 of 100 is not late
    early = [p for p in pts if p.method == "late"]
    shifted = [type(p)(p.step, p.method, p.n, p.delta, p.ci,
                       "within_noise" if p.step <= 20 else "improver") for p in early]
    assert late_flips(shifted) == []
    assert late_flips([]) == []


def write_run(root: Path, method: str, seed: int) -> RunRow:
    run = root / "runs" / f"{method}-{seed}"
    run.mkdir(parents=True)
    pts = curve(method, seed)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "val", "step": s, "val_loss": v}) + "\n" for s, v in pts))
    return RunRow(key=run.name, scale="tiny", method=method, seed=seed, state="done",
                  status="completed", val_loss=pts[-1][1], params=1000, tokens=10**6,
                  diverged_at_step=None, run_dir=run, steps=100, steps_planned=100)


def test_report_section_figure_and_results_json(tmp_path: Path) -> None:
    from modbench.report.build import write_report

    rows = [write_run(tmp_path, m, s) for m in ("baseline", "steady", "late") for s in NOISE]
    comparisons = compare_scales(rows, "baseline", "val_loss", [], looks={})
    results = StudyResults(name="t", folder=tmp_path, baseline="baseline", metric="val_loss",
                           anchors=[], rows=rows, comparisons=comparisons)
    out = write_report(results, tmp_path / "report")
    assert (out / "trajectory_tiny.png").stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "## Verdicts over training" in md and "trajectory_tiny.png" in md
    assert "late: improver at the step before 80, degrader from step 80" in md
    assert "steady:" not in md.split("## Verdicts over training")[1]
    res = {r["method"]: r for r in json.loads((out / "results.json").read_text())["tiny"]}
    assert "trajectory" not in res["baseline"]
    traj = res["late"]["trajectory"]
    assert [p["step"] for p in traj] == STEPS
    assert traj[-1]["verdict"] == res["late"]["verdict"] == "degrader"
    assert traj[-1]["delta"] == pytest.approx(res["late"]["delta"])
    assert "## Sequential seeds" not in md  # not a sequential study
