"""Crash and resume inside a K-seed ensemble (``train_seeds``: three seeds stacked in one
process): SIGKILL it at random points, resume it stacked, and compare every member with the
uninterrupted stacked run, bit for bit.

Members checkpoint one after another, so a kill between two members' checkpoint writes
leaves them at different steps; they resume from the newest step they all have (each keeps
its previous checkpoint). A kill inside the first round of checkpoint writes leaves some
members with a checkpoint and others with none: they share no step but 0, so all start
afresh (``restarted``); the figures count those apart.
"""

from __future__ import annotations

import json
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.reliability.checks import (
    KillTally,
    checkpoint_differences,
    checkpoint_step,
    run_child,
    strip_metrics,
    summary_differences,
)
from tests.reliability.conftest import long_points, long_variant
from tests.reliability.harness import ensemble_child

from modbench.config import resolve

SEEDS = [0, 1, 2]
KINDS = {"after_write": 2.0, "mid_write": 1.0, "ckpt_torn": 2.0, "ckpt_unrenamed": 1.0,
         "ckpt_renamed": 2.0, "timer": 2.0}


def ensemble_config() -> dict[str, Any]:
    return resolve("tiny", method="qknorm", steps=12,
                   overrides=["train.threads=1", "train.checkpoint_every=3",
                              "train.eval_every=4"]).to_dict()


@dataclass
class Reference:
    cfg: dict[str, Any]
    folder: Path
    seconds: float
    counts: dict[str, int]

    def outs(self, folder: Path) -> list[str]:
        return [str(folder / f"s{s}") for s in SEEDS]


def reference(ctx: Any, tmp: Path) -> Reference:
    cfg, folder, report = ensemble_config(), tmp / "ref", tmp / "ref.json"
    t0 = time.perf_counter()
    code = run_child(ctx, ensemble_child, (cfg, SEEDS, [str(folder / f"s{s}") for s in SEEDS],
                                           False, None, str(report)))
    assert code == 0
    counts = json.loads(report.read_text())["counts"]
    assert counts["save"] == 4 * len(SEEDS)
    return Reference(cfg, folder, time.perf_counter() - t0, counts)


def draw(rng: random.Random, ref: Reference) -> dict[str, Any]:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    if kind == "timer":
        return {"kind": kind, "after": round(rng.uniform(0.0, ref.seconds), 3)}
    what = "write" if kind.endswith("_write") else "save"
    return {"kind": kind, "n": rng.randint(1, ref.counts[what]),
            "frac": round(rng.uniform(0.05, 0.95), 3)}


@dataclass
class Tally(KillTally):
    cases: int = 0
    kills: int = 0
    bit_exact: int = 0  # every member equal to the uninterrupted stacked run, bit for bit
    rewound: int = 0  # members' checkpoints at different steps: resumed at a common step
    restarted: int = 0  # some members without a checkpoint: all started afresh


def one_case(ctx: Any, ref: Reference, kill: dict[str, Any], folder: Path,
             tally: Tally) -> None:
    outs = ref.outs(folder)
    hook = None if kill["kind"] == "timer" else kill
    code = run_child(ctx, ensemble_child, (ref.cfg, SEEDS, outs, False, hook, None),
                     kill_after=kill.get("after"))
    if code == 0:
        assert kill["kind"] == "timer"
        return
    assert code == -signal.SIGKILL, code
    tally.kills += 1
    tally.by_kind[kill["kind"]] += 1
    steps = [checkpoint_step(Path(o)) for o in outs]  # each loads: never torn
    report = folder / "resume.json"
    started = any((Path(o) / "config.yaml").exists() for o in outs)
    folder.mkdir(exist_ok=True)
    code = run_child(ctx, ensemble_child, (ref.cfg, SEEDS, outs, started, None, str(report)))
    if code == 3:  # refused in one line: a stacked resume must always be possible
        error = json.loads(report.read_text())["error"]
        tally.failures.append(f"{kill}: steps {steps}, refused: {error}")
    elif None in steps and any(st is not None for st in steps):
        tally.restarted += 1
    elif len(set(steps)) > 1:
        tally.rewound += 1
    problems = []
    for s in SEEDS:
        a, b = ref.folder / f"s{s}", folder / f"s{s}"
        problems += checkpoint_differences(a, b) + summary_differences(a, b)
        if strip_metrics(a) != strip_metrics(b):
            problems.append(f"s{s}: metrics.jsonl differs")
    if code != 0 or problems:
        tally.failures.append(f"{kill}: steps {steps}, exit {code}, {problems[:3]}")
    else:
        tally.bit_exact += 1
    tally.cases += 1


def ensemble_kills(ctx: Any, tmp: Path, n: int, seed: int) -> Tally:
    ref = reference(ctx, tmp)
    rng = random.Random(seed)
    tally = Tally()
    for i in range(n):
        one_case(ctx, ref, draw(rng, ref), tmp / f"case{i:03d}", tally)
    return tally


def test_ensemble_kill_points(forkserver: Any, tmp_path: Path, record: Any) -> None:
    t0 = time.perf_counter()
    tally = ensemble_kills(forkserver, tmp_path, 6, seed=15)
    record({"seconds": round(time.perf_counter() - t0, 1), **tally.as_dict()})
    assert not tally.failures, tally.failures[:5]
    assert tally.bit_exact == tally.cases >= 5


@long_variant
def test_ensemble_kill_points_long(forkserver: Any, tmp_path: Path, record: Any) -> None:
    t0 = time.perf_counter()
    tally = ensemble_kills(forkserver, tmp_path, max(6, long_points() // 4), seed=1515)
    record({"seconds": round(time.perf_counter() - t0, 1), **tally.as_dict()})
    assert not tally.failures, tally.failures[:5]
    assert tally.bit_exact == tally.cases
