"""Studies killed on purpose: SIGKILL `modbench study run` mid-run, mid-evaluation, around
its writes to the results store, mid-report or after a random delay, again and again, then
let a rerun finish. Nothing may be duplicated, missing or corrupt, and every run, its
evaluation and the report must equal those of a study that was never interrupted.

Also: a worker process of a 2-worker study killed mid-run (the study finishes by itself:
another worker takes the run over), and the whole process group of a 2-worker study killed
(a pre-empted machine), then rerun.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.reliability.checks import (
    KillTally,
    checkpoint_differences,
    run_child,
    strip_metrics,
    summary_differences,
    wait_for,
)
from tests.reliability.conftest import long_points, long_variant
from tests.reliability.harness import children_of, study_child

from modbench.report.build import write_report
from modbench.runtime.checkpoint import load_checkpoint
from modbench.runtime.runfolder import CHECKPOINT
from modbench.study.results import load_results

SPEC = {"name": "reliability", "baseline": "baseline", "methods": ["qknorm", "post_ln"],
        "seeds": {"default": [0], "noise_floor": [0, 1, 2], "anchors": []},
        "scales": ["tiny"],
        "overrides": ["train.steps=12", "train.checkpoint_every=4", "train.eval_every=6",
                      "train.threads=1"],
        "evaluation": {"probes": True, "limit": 4}}
N_RUNS = 5
REPORT_FILES = ("report.md", "results.csv", "results.json", "report.html")

# kind -> weight of the draw
KINDS = {"train": 3.0, "ckpt_torn": 1.5, "eval": 2.0, "store": 2.5, "eval.json": 1.0,
         "summary.json": 1.0, "report": 1.5, "spec.yaml": 0.3, "timer": 3.0}


@dataclass
class Reference:
    spec: Path
    folder: Path
    seconds: float
    counts: dict[str, int]


def reference(ctx: Any, tmp: Path) -> Reference:
    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    folder, report = tmp / "ref", tmp / "ref.json"
    t0 = time.perf_counter()
    assert run_child(ctx, study_child, (str(spec), str(folder), None, str(report))) == 0
    counts = json.loads(report.read_text())["counts"]
    assert counts["finish"] == N_RUNS and counts["eval"] == 3 * N_RUNS
    return Reference(spec, folder, time.perf_counter() - t0, counts)


def draw(rng: random.Random, ref: Reference, scale: float = 1.0) -> dict[str, Any]:
    """A kill point; ``scale`` < 1 draws from the first part of each event count (a rerun
    has only what is left to do)."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    c = {k: max(1, round(v * scale)) for k, v in ref.counts.items()}
    if kind == "train":
        return {"kind": rng.choice(["after_write", "mid_write"]),
                "n": rng.randint(1, c["write"]), "frac": round(rng.uniform(0.05, 0.95), 3)}
    if kind == "ckpt_torn":
        return {"kind": kind, "n": rng.randint(1, c["save"]),
                "frac": round(rng.uniform(0.0, 0.99), 3)}
    if kind == "eval":
        return {"kind": kind, "n": rng.randint(1, c["eval"])}
    if kind == "store":
        op = rng.choice(["claim", "finish"])
        return {"kind": "store", "op": op, "n": rng.randint(1, c[op]),
                "when": rng.choice(["before", "after"])}
    if kind in ("eval.json", "summary.json"):
        return {"kind": "replace", "name": kind, "n": rng.randint(1, c["finish"])}
    if kind == "report":
        return {"kind": "replace", "name": rng.choice(REPORT_FILES), "n": 1}
    if kind == "spec.yaml":
        return {"kind": "replace", "name": "spec.yaml", "n": 1}
    return {"kind": "timer", "after": round(rng.uniform(0.0, ref.seconds * scale), 3)}


def kill_label(kill: dict[str, Any]) -> str:
    if kill["kind"] == "store":
        return f"store.{kill['op']} ({kill['when']})"
    if kill["kind"] == "replace":
        return "report" if kill["name"] in REPORT_FILES else kill["name"]
    return kill["kind"]


def _strip_eval(ev: dict[str, Any] | None) -> dict[str, Any] | None:
    if ev is None:
        return None
    return {k: v for k, v in ev.items() if k != "run"}


def study_problems(ref: Path, got: Path) -> tuple[list[str], bool]:
    """Everything wrong with the finished study ``got`` against the uninterrupted ``ref``:
    the index (each run once, done, its records equal to its files), every run folder
    (parses, loads, equals the reference's bit for bit) and the report. Returns the problems
    and whether every run's metrics.jsonl equals the reference's."""
    out: list[str] = []
    db = sqlite3.connect(got / "index.sqlite")
    if db.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
        out.append("index.sqlite fails its integrity check")
    rows = db.execute("SELECT key, state, status, summary, eval FROM runs").fetchall()
    db.close()
    keys = [r[0] for r in rows]
    ref_keys = sorted(p.name for p in (ref / "runs").iterdir())
    if sorted(keys) != ref_keys or len(set(keys)) != len(keys):
        out.append(f"index has runs {sorted(keys)}, expected {ref_keys}")
    if sorted(p.name for p in (got / "runs").iterdir()) != ref_keys:
        out.append("run folders differ from the runs of the study")
    same_metrics = True
    for key, state, status, summary, ev in rows:
        run, ref_run = got / "runs" / key, ref / "runs" / key
        if state != "done":
            out.append(f"{key}: state {state}")
            continue
        on_disk = json.loads((run / "summary.json").read_text())
        if json.loads(summary) != on_disk or status != on_disk["status"]:
            out.append(f"{key}: index summary differs from summary.json")
        eval_disk = json.loads((run / "eval.json").read_text())
        if json.loads(ev) != eval_disk:
            out.append(f"{key}: index eval differs from eval.json")
        if _strip_eval(eval_disk) != _strip_eval(json.loads((ref_run / "eval.json")
                                                            .read_text())):
            out.append(f"{key}: eval.json differs from the uninterrupted study's")
        load_checkpoint(run / CHECKPOINT)
        diffs = checkpoint_differences(ref_run, run)
        keys_differ = summary_differences(ref_run, run)
        if diffs or keys_differ:
            out.append(f"{key}: {diffs[:2]} {keys_differ}")
        if strip_metrics(run) != strip_metrics(ref_run):  # strict JSON lines, or this fails
            same_metrics = False
            out.append(f"{key}: metrics.jsonl differs from the uninterrupted study's")
    for name in REPORT_FILES:
        if not (got / "report" / name).is_file():
            out.append(f"report/{name} missing")
    if not out:
        fresh = write_report(load_results(got), got.parent / f"{got.name}-fresh-report")
        for name in ("report.md", "results.csv", "results.json"):
            if (fresh / name).read_bytes() != (got / "report" / name).read_bytes():
                out.append(f"report/{name} differs from a report written from scratch")
        if same_metrics:
            for name in ("report.md", "results.csv", "results.json"):
                a = (got / "report" / name).read_text().replace(str(got), "DIR")
                b = (ref / "report" / name).read_text().replace(str(ref), "DIR")
                if a != b:
                    out.append(f"report/{name} differs from the uninterrupted study's")
    return out, same_metrics


@dataclass
class Tally(KillTally):
    chains: int = 0
    kills: int = 0
    reruns: int = 0
    identical: int = 0  # studies equal to the uninterrupted one (runs, evals, report)


@pytest.fixture(scope="module")
def study_ref(forkserver: Any, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted study every test here compares with."""
    return reference(forkserver, tmp_path_factory.mktemp("study-ref"))


def kill_chains(ctx: Any, ref: Reference, tmp: Path, chains: int, seed: int,
                max_kills: int = 4) -> Tally:
    """``chains`` studies, each killed up to ``max_kills`` times at random points (a kill
    point that its rerun never reaches lets that rerun finish), then finished."""
    rng = random.Random(seed)
    tally = Tally()
    for c in range(chains):
        folder = tmp / f"chain{c:03d}"
        kills = 0
        while True:
            kill = draw(rng, ref, 0.6 ** kills) if kills < max_kills else None
            hook = None if kill is None or kill["kind"] == "timer" else kill
            code = run_child(ctx, study_child, (str(ref.spec), str(folder), hook, None),
                             kill_after=kill.get("after") if kill else None)
            tally.reruns += 1
            if code == 0:
                break
            if code != -signal.SIGKILL:
                tally.failures.append(f"chain {c}: {kill} exited {code}")
                break
            kills += 1
            tally.by_kind[kill_label(kill)] += 1  # type: ignore[arg-type]
        tally.kills += kills
        tally.chains += 1
        problems, _ = study_problems(ref.folder, folder)
        tally.identical += not problems
        tally.failures += [f"chain {c}: {p}" for p in problems]
    return tally


def test_killed_studies_rerun_to_the_same_results(forkserver: Any, study_ref: Reference,
                                                  tmp_path: Path, record: Any) -> None:
    t0 = time.perf_counter()
    tally = kill_chains(forkserver, study_ref, tmp_path, chains=4, seed=15)
    record({"seconds": round(time.perf_counter() - t0, 1), **tally.as_dict()})
    assert not tally.failures, tally.failures[:5]
    assert tally.identical == tally.chains == 4 and tally.kills >= 4


@long_variant
def test_killed_studies_rerun_to_the_same_results_long(forkserver: Any, study_ref: Reference,
                                                       tmp_path: Path, record: Any) -> None:
    chains = max(4, long_points() // 10)
    t0 = time.perf_counter()
    tally = kill_chains(forkserver, study_ref, tmp_path, chains=chains, seed=1515)
    record({"seconds": round(time.perf_counter() - t0, 1), **tally.as_dict()})
    assert not tally.failures, tally.failures[:5]
    assert tally.identical == tally.chains


def _two_worker_study(ctx: Any, ref: Reference, folder: Path, rng: random.Random,
                      group: bool) -> tuple[int, int]:
    """A 2-worker study: once it trains, SIGKILL one worker (``group``: the whole process
    group); returns the exit code and the number of reruns that followed."""
    p = ctx.Process(target=study_child,
                    args=(str(ref.spec), str(folder), None, None, 2, "off", True))
    p.start()
    # wait until a worker trains (a metrics file exists), then a random moment more
    wait_for(lambda: any((folder / "runs").glob("*/metrics.jsonl")), 120, "a worker to train")
    time.sleep(rng.uniform(0.0, 1.0))
    if group:
        os.killpg(p.pid, signal.SIGKILL)
    else:
        workers = [c for c in children_of(p.pid) if b"spawn_main" in
                   Path(f"/proc/{c}/cmdline").read_bytes()]
        os.kill(rng.choice(workers), signal.SIGKILL)
    p.join(300)
    code, reruns = p.exitcode, 0
    if group:
        assert code == -signal.SIGKILL
        reruns = 1
        code = run_child(ctx, study_child, (str(ref.spec), str(folder), None, None, 2, "off",
                                            True))
    return int(code or 0), reruns


def two_worker_cases(ctx: Any, ref: Reference, tmp: Path, n: int, group: bool,
                     seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    failures: list[str] = []
    reruns = identical = 0
    for i in range(n):
        folder = tmp / f"w{i}"
        code, r = _two_worker_study(ctx, ref, folder, rng, group)
        reruns += r
        problems = [f"exit code {code}"] if code else study_problems(ref.folder, folder)[0]
        identical += not problems
        failures += [f"case {i}: {p}" for p in problems]
    return {"cases": n, "killed": "process group" if group else "one worker",
            "reruns": reruns, "identical": identical, "failures": failures}


@pytest.mark.parametrize("group", [False, True], ids=["one-worker", "process-group"])
def test_two_worker_study_survives_a_killed_worker(forkserver: Any, study_ref: Reference,
                                                   tmp_path: Path, record: Any,
                                                   group: bool) -> None:
    """One worker killed: the run it held is released and finished by another worker in
    the same `study run` (no rerun). The whole group killed: a rerun finishes the study.
    Either way the results equal the uninterrupted study's."""
    res = two_worker_cases(forkserver, study_ref, tmp_path, 1, group, seed=7 + group)
    record(res)
    assert not res["failures"], res["failures"][:5]


@long_variant
@pytest.mark.parametrize("group", [False, True], ids=["one-worker", "process-group"])
def test_two_worker_study_survives_a_killed_worker_long(forkserver: Any, study_ref: Reference,
                                                        tmp_path: Path, record: Any,
                                                        group: bool) -> None:
    res = two_worker_cases(forkserver, study_ref, tmp_path, max(2, long_points() // 30), group,
                           seed=700 + group)
    record(res)
    assert not res["failures"], res["failures"][:5]
