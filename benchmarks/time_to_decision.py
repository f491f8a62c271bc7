"""Time to decision (issue 32, item 4): how long a study takes until its report says what it
says, and where that time goes.

    python benchmarks/time_to_decision.py                      # the built-in study, this tree
    python benchmarks/time_to_decision.py --vs HEAD~5 --rounds 2   # interleaved against a commit

Each round runs ``modbench study run SPEC --out DIR --no-progress`` in a fresh folder, for
this working tree and (``--vs REV``) a ``git worktree`` of REV run with the same Python
environment (``PYTHONPATH`` set to its ``src``), the two in a random order per round, so load
from other work falls on both alike. The corpus and tokenizer are ready before the first
round only if an earlier run built them (``MODBENCH_CACHE`` is shared by the rounds): run the
study once before timing on a fresh cache.

Per study: the wall time to the final report, the CPU seconds of the whole process tree, CPU
seconds per run, and the shares of the runs' summed seconds spent training runs that ended
stalled, in validation (``summary.val_time_s``), in the first step of a compiled run (where
``torch.compile`` compiles: ``first_step_s`` less the run's median step), and in the
diagnostics (``RUN/diagnostics/time.json``); a tree too old to record a share shows "–".
Last, whether the two trees' verdicts agree (``report/results.json``)."""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def run_study(src: Path, spec: str, out: Path, extra: list[str]) -> dict[str, float]:
    """Wall and CPU seconds of one ``modbench study run`` from the tree whose ``src`` is given."""
    env = dict(os.environ, PYTHONPATH=str(src))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "modbench", "study", "run", *([spec] if spec else []),
           "--out", str(out), "--no-progress", *extra]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def _steps_median(run: Path) -> float | None:
    """The median seconds of the run's logged steps (``tokens`` / ``tokens_per_s``)."""
    per = []
    try:
        for line in (run / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == "train" and r.get("tokens_per_s"):
                per.append(r["tokens"] / r["step"] / r["tokens_per_s"])
    except (OSError, ValueError, KeyError, ZeroDivisionError):
        return None
    return statistics.median(per) if per else None


def shares(out: Path) -> dict[str, Any]:
    """Where the runs' seconds went (see the module docstring)."""
    runs = [p.parent for p in sorted((out / "runs").glob("*/summary.json"))]
    total = stalled = val = compile_s = diag = 0.0
    have_val = have_first = have_diag = False
    steps = 0
    for run in runs:
        s = json.loads((run / "summary.json").read_text())
        train = float(s.get("train_time_s") or 0.0)
        v = s.get("val_time_s")
        have_val |= v is not None
        t = train + float(v or 0.0)
        steps += int(s.get("steps") or 0)
        d = run / "diagnostics" / "time.json"
        if d.is_file():
            have_diag = True
            diag += json.loads(d.read_text())["seconds"]
        total += t
        val += float(v or 0.0)
        if s.get("status") == "stalled":
            stalled += t
        first = s.get("first_step_s")
        have_first |= first is not None
        if s.get("compiled") and first is not None:
            med = _steps_median(run) or 0.0
            compile_s += max(0.0, first - med)
    whole = total + diag

    def pct(x: float, ok: bool) -> str:
        return f"{100 * x / whole:.1f} %" if ok and whole > 0 else "–"

    return {"runs": len(runs), "steps": steps, "run_s": whole,
            "stalled": pct(stalled, True), "validation": pct(val, have_val),
            "compile": pct(compile_s, have_first), "diagnostics": pct(diag, have_diag)}


def verdicts(out: Path) -> dict[str, str]:
    data = json.loads((out / "report" / "results.json").read_text())
    return {f"{scale}/{r['method']}": str(r["verdict"]) for scale, rs in data.items()
            if isinstance(rs, list) for r in rs}


def worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(where), rev],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="", help="a spec (default: the built-in study)")
    ap.add_argument("--vs", default="", help="a git revision to time against, interleaved")
    ap.add_argument("--at", default="", help="time a worktree of this revision instead of the "
                    "working tree (which others may be editing)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to `study run --set` (e.g. train.steps=100 for a quick try)")
    ap.add_argument("--json", default="", help="write the figures here too")
    ap.add_argument("--keep", default="", help="copy each timed study folder into this folder "
                    "(as <tree>-<round>) to read its report or reuse its runs afterwards")
    a = ap.parse_args()
    extra = [x for kv in a.set for x in ("--set", kv)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": HERE / "src"}
        if a.at:
            trees = {a.at: worktree(a.at, Path(tmp) / "at") / "src"}
        if a.vs:
            trees[a.vs] = worktree(a.vs, Path(tmp) / "vs") / "src"
        rng = random.Random(0)
        for k in range(a.rounds):
            order = list(trees.items())
            rng.shuffle(order)
            for name, src in order:
                out = Path(tmp) / f"study-{k}-{len(rows)}"
                t = run_study(src, a.spec, out, extra)
                row = {"tree": name, "round": k, **t, **shares(out),
                       "verdicts": verdicts(out)}
                row["cpu_per_run_s"] = t["cpu_s"] / max(1, row["runs"])
                rows.append(row)
                if a.keep:  # after the timing: the copy is not counted
                    label = "".join(c if c.isalnum() else "_" for c in name)
                    shutil.copytree(out, Path(a.keep) / f"{label}-{k}", dirs_exist_ok=True)
                print(json.dumps({x: y for x, y in row.items() if x != "verdicts"}), flush=True)
        for name in ("at", "vs"):
            if getattr(a, name):
                subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force",
                                str(Path(tmp) / name)], check=False)
    print("\n| tree | round | wall | CPU s | CPU s / run | runs | steps | stalled runs "
          "| validation | compile | diagnostics |\n|---|---:|---:|---:|---:|---:|---:|---:|"
          "---:|---:|---:|")
    for r in rows:
        print(f"| {r['tree']} | {r['round']} | {r['wall_s'] / 60:.1f} min | {r['cpu_s']:.0f} | "
              f"{r['cpu_per_run_s']:.0f} | {r['runs']} | {r['steps']} | {r['stalled']} | "
              f"{r['validation']} | {r['compile']} | {r['diagnostics']} |")
    names = {r["tree"] for r in rows}
    if len(names) > 1:
        by = {r["tree"]: r["verdicts"] for r in rows}
        a_, b_ = list(by.values())[:2]
        diff = {k: (a_.get(k), b_.get(k)) for k in sorted(set(a_) | set(b_))
                if a_.get(k) != b_.get(k)}
        print("verdicts agree" if not diff else f"verdicts differ: {diff}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
