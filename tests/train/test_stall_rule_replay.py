"""benchmarks/stall_rule.py's replay: a finished study's full-length runs are read back as
curves (``--studies``), a recovery is judged on the whole curve, and the rate carries its
one-sided 95 % upper bound."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from modbench.train.trainer import train
from tests.helpers import load_script, tiny

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stall_rule.py"


def load() -> ModuleType:
    return load_script(SCRIPT, "stall_rule_bench")


# DyT on cpu-small (300 steps, warm-up 15), validated every 20 (benchmarks/stall_rule.py,
# 2026-11-26): drifting down inside the unigram level's margin from step 20 to its end
DYT = [(0, 8.306), (20, 6.995), (40, 6.891), (60, 6.813), (80, 6.765), (100, 6.745),
       (120, 6.727), (140, 6.704), (160, 6.702), (180, 6.676), (200, 6.665), (220, 6.650),
       (240, 6.638), (260, 6.630), (280, 6.627), (300, 6.621)]


def curve(vals: list[tuple[int, float]], case: str) -> dict[str, Any]:
    return {"case": case, "method": "m", "seed": 0, "steps": 300, "warmup": 15, "margin": 0.1,
            "patience_frac": 0.5, "min_steps": 100, "cadence": 100, "level": 6.6045,
            "status": "?", "final_val_loss": vals[-1][1], "vals": vals, "cpu_s": None}


def test_study_runs_are_read_back_as_curves(tmp_path: Path) -> None:
    bench = load()
    study = tmp_path / "study"
    (study / "runs").mkdir(parents=True)
    (study / "spec.yaml").write_text("name: builtin-cpu\n")
    summary = train(tiny("post_ln", 0, 20, "train.eval_every=10"), study / "runs" / "a",
                    progress=False)
    (run,) = bench.study_curves(study)
    assert run["case"] == "builtin-cpu" and run["method"] == "post_ln" and run["seed"] == 0
    assert run["steps"] == 20 and run["cadence"] == 10
    assert [s for s, _ in run["vals"]] == [0, 10, 20]
    assert run["level"] == summary["unigram_loss"]
    # a run stopped before its planned steps is no evidence of what would have followed
    (study / "runs" / "a" / "summary.json").write_text(
        (study / "runs" / "a" / "summary.json").read_text().replace('"steps": 20', '"steps": 10'))
    assert bench.study_curves(study) == []


def row(table: str, cadence: str, patience: int) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if cells[:2] == [cadence, str(patience)]:
            return cells
    raise AssertionError(f"no row {cadence} {patience}")


def test_recovery_is_judged_on_the_whole_curve() -> None:
    bench = load()
    # validated every 100, DyT meets the stop rule at step 200 (patience 100: at the level
    # from 100, fallen 0.08 < the margin); thinned to every 100 its curve fails the end rule
    # (fallen 0.124 from step 100, and 200 to 300 is shorter than half the run), but on the
    # whole curve it stalled from step 140 and never left the level: no false stop
    stalled = curve(DYT, "dyt")
    # the same start, then learning: a false stop
    recovers = curve([*DYT[:11], (220, 6.4), (260, 6.0), (300, 5.6)], "rec")
    # the stop as it was then, at the end-of-run rule's margin
    cells = row(bench.replay([stalled, recovers], [100], every=20, margin=0.1), "study's", 100)
    assert cells[3] == "2" and cells[4] == "1 (rec/m/s0@200)" and cells[5] == "50%"
    # one of two stops false: the exact one-sided 95 % upper bound, beta.ppf(0.95, 2, 1)
    assert cells[6] == f"{0.95 ** 0.5:.0%}"
    cells = row(bench.replay([stalled], [100], every=20, margin=0.1), "study's", 100)
    assert cells[3:6] == ["1", "0", "0%"] and cells[6] == "95%"


def test_the_longest_plateau_is_that_of_a_run_that_learned_on() -> None:
    """The figure the studies' patience must exceed: the longest stretch within the stop's
    margin (or above the level) of a run that was not stalled at its end. DyT, at the level
    to its end, is a true stall and is left out though its stretch is longer."""
    bench = load()
    late = curve([(0, 8.3), (20, 6.70), (40, 6.60), (60, 6.62), (80, 6.58), (100, 6.61),
                  (120, 6.59), (140, 6.30), (160, 6.0), (200, 5.8), (300, 5.5)], "late")
    stall = curve(DYT, "dyt")
    assert bench.stalled_at_end(stall) and not bench.stalled_at_end(late)
    got = bench.longest_plateau([stall, late], 0.05)
    assert "dyt/" not in got and "100 steps (late/m/s0, 20–120)" in got, got
    # a tighter margin ends the stretch at the first point more than it below the level
    assert "40 steps (late/m/s0, 20–60)" in bench.longest_plateau([late], 0.02)
    assert bench.longest_plateau([stall], 0.05).startswith("no run that learned on")
    # a run shorter than the end-of-run rule's min_steps is never called stalled: left out
    short = {**late, "steps": 80, "vals": [(s, v) for s, v in late["vals"] if s <= 80]}
    assert bench.longest_plateau([short], 0.05).startswith("no run that learned on")
