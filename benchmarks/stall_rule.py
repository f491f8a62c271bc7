"""The early stall stop's false-stop rate: how often a run that met the mid-run stall rule at
step s would have left the unigram level by the end (docs/runs.md, "Stopping stalled runs").

Each case is trained once to the end without an early stop, validating every ``--every``
steps; its validation curve, unigram level and warm-up are recorded. The rule
(``train.stop_stalled_after``: the trainer's stop, :func:`modbench.runtime.stall.stalled_at`
over the points so far, with ``min_steps`` = the patience and ``train.stop_stalled_margin``,
or ``--stop-margin``, as the margin) is then replayed on each curve at several patiences and
at two validation cadences: the setting's own (100 steps for both
presets) and every ``--every`` steps (more chances to stop wrongly). A stop is *false* when the
whole run is not stalled by the end-of-run rule (``check_stall``), i.e. the stop changed its
status.

Usage::

    python benchmarks/stall_rule.py                          # train, replay, markdown table
    python benchmarks/stall_rule.py --replay benchmarks/results/stall_rule-2026-11-26.json
    python benchmarks/stall_rule.py --cases builtin --methods baseline,post_ln --every 20
    python benchmarks/stall_rule.py --resume --runs builtin/post_ln/0,deep-lr1e-3/baseline/0
    python benchmarks/stall_rule.py --replay RESULTS.json --studies STUDY_DIR[,STUDY_DIR...]
    python benchmarks/stall_rule.py --runs builtin/dyt/0,builtin/sandwich/0 --out B.json
    python benchmarks/stall_rule.py --replay RESULTS.json,B.json

The curves are written to ``--out`` after each run (``--resume`` keeps them and trains the
rest; ``--budget-s`` stops training once that many CPU seconds are spent). One thread, a
``cpu-deep`` run of 500 steps took about 190 CPU s on the 2-core machine, a ``cpu-small`` one
several times that: the full default list does not fit 25 minutes of one core.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modbench.config import TrainConfig, resolve
from modbench.errors import ModbenchError
from modbench.runtime.runfolder import read_metrics, val_points
from modbench.runtime.stall import stalled_at

BUILTIN = ["baseline", "post_ln", "deepnorm", "mix_ln", "ln_scaling", "post_ln+comt"]
# cpu-small: the built-in study's norm placements first, then two other norm replacements
# of the catalogue (where a stall could hide)
SMALL = ["baseline", "post_ln", "deepnorm", "dyt", "ngpt", "mix_ln", "ln_scaling", "post_ln+comt"]


# a study spec whose runs are a case's setting (builtin-cpu.yaml: cpu-deep, lr 3e-3, 500 steps)
SAME_SETTING = {"builtin-cpu": "builtin"}


@dataclass(frozen=True)
class Case:
    """One setting: a preset, its overrides, the cadence its study validates at, and the
    (method, seed) runs trained at it."""

    name: str
    preset: str
    overrides: tuple[str, ...]
    cadence: int
    runs: tuple[tuple[str, int], ...]


def cases(every: int, methods: list[str] | None) -> dict[str, Case]:
    def pick(ms: list[str]) -> list[str]:
        return [m for m in dict.fromkeys(ms) if methods is None or m in methods]

    deep3 = ("recipe.lr=3e-3", "train.steps=500")
    return {
        # builtin-cpu.yaml's settings (cpu-deep, lr 3e-3, 500 steps)
        "builtin": Case("builtin", "cpu-deep", deep3, 100,
                        tuple((m, 0) for m in pick(BUILTIN))),
        # the known late recoveries (LOG.md 2026-11-22 / 11-23): Pre-LN at cpu-deep's own
        # lr 1e-3 sits near the level from step 100 to 300, then learns; DeepNorm seed 0
        # escaped the stall in a 300-step schedule at lr 3e-3
        "deep-lr1e-3": Case("deep-lr1e-3", "cpu-deep", ("train.steps=500",), 100,
                            tuple((m, s) for m in pick(["baseline"]) for s in (0, 1))),
        "deep-300": Case("deep-300", "cpu-deep", ("recipe.lr=3e-3", "train.steps=300"), 100,
                         tuple((m, 0) for m in pick(["deepnorm", "post_ln"]))),
        # cpu-small's own settings (300 steps, recipe cpu)
        "cpu-small": Case("cpu-small", "cpu-small", (), 100,
                          tuple((m, 0) for m in pick(SMALL))),
    }


def train_curve(case: Case, method: str, seed: int, every: int, threads: int,
                root: Path) -> dict[str, Any]:
    """Train one run to the end (no early stop) and return its curve and what the rule
    needs."""
    from modbench.train.trainer import Trainer

    cfg = resolve(case.preset, method=method, seed=seed, overrides=[
        *case.overrides, f"train.eval_every={every}", f"train.threads={threads}",
        "train.log_layers=false", "train.checkpoint_every=0"])
    out = root / f"{case.name}-{method.replace('+', '_')}-s{seed}"
    t0, c0 = time.perf_counter(), time.process_time()
    summary = Trainer(cfg, out, progress=False).run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    vals = val_points(read_metrics(out))
    shutil.rmtree(out, ignore_errors=True)
    return curve_record(case.name, method, seed, cfg, summary, vals, case.cadence,
                        wall_s=round(wall, 1), cpu_s=round(cpu, 1))


def curve_record(case: str, method: str, seed: int, cfg: Any, summary: dict[str, Any],
                 vals: list[tuple[int, float | None]], cadence: int, *,
                 wall_s: float | None = None, cpu_s: float | None = None) -> dict[str, Any]:
    """One run's curve with what the rule needs (its config's stall keys and warm-up, the
    unigram level of its summary), as the results JSON keeps it."""
    return {"case": case, "method": method, "seed": seed, "steps": cfg.train.steps,
            "warmup": cfg.recipe.warmup_for(cfg.train.steps), "margin": cfg.train.stall_margin,
            "patience_frac": cfg.train.stall_patience, "min_steps": cfg.train.stall_min_steps,
            "cadence": cadence, "level": summary["unigram_loss"],
            "status": summary["status"], "stalled_at_step": summary.get("stalled_at_step"),
            "final_val_loss": summary.get("final_val_loss"), "vals": vals,
            "wall_s": wall_s, "cpu_s": cpu_s}


def study_curves(folder: Path) -> list[dict[str, Any]]:
    """The curves of a finished study's runs that trained to their planned end (none stopped
    early, none diverged), for the replay at the cadence they were validated at
    (``train.eval_every``): a full-length study's stalled runs are the stop's events at the
    study's own cadence. The case is the spec's name, with the run's preset after a ``/`` where
    the study trained more than one (a ladder's rungs are separate curves)."""
    import yaml

    spec_file = folder / "spec.yaml"
    spec = yaml.safe_load(spec_file.read_text()) if spec_file.is_file() else None
    name = str((spec or {}).get("name", folder.name))
    runs = []
    for summary_path in sorted(folder.glob("**/runs/*/summary.json")):
        run = summary_path.parent
        try:
            summary = json.loads(summary_path.read_text())
            cfg = resolve(yaml_file=run / "config.yaml")  # a run's own config.yaml
        except (OSError, ValueError, ModbenchError):
            continue
        if (summary.get("status") not in ("completed", "stalled")
                or summary.get("steps") != summary.get("steps_planned")
                or summary.get("unigram_loss") is None):
            continue
        runs.append(curve_record(summary.get("preset") or "", summary["method"],
                                 summary["seed"], cfg, summary, val_points(read_metrics(run)),
                                 cfg.train.eval_every))
    several = len({r["case"] for r in runs}) > 1
    for r in runs:
        r["case"] = f"{name}/{r['case']}" if several else name
    return runs


def first_stop(run: dict[str, Any], patience: int, cadence: int,
               margin: float) -> tuple[int, int] | None:
    """(the step the run would stop at, its stalled_at_step) under the stop rule with this
    patience and margin (``train.stop_stalled_margin``; the record's ``margin`` is the
    end-of-run rule's), validating every ``cadence`` steps; None: it never stops."""
    vals = [(s, v) for s, v in run["vals"] if s % cadence == 0 or s == run["steps"]]
    for i, (t, _) in enumerate(vals):
        if t >= run["steps"]:  # the last validation: the run ends there anyway
            break
        at = stalled_at(vals[:i + 1], run["level"], steps=t, warmup=run["warmup"],
                        margin=margin, patience=0.0, min_steps=patience)
        if at is not None:
            return t, at
    return None


def stalled_at_end(run: dict[str, Any]) -> bool:
    """The end-of-run rule on the whole recorded curve (the status without a stop)."""
    return stalled_at(run["vals"], run["level"], steps=run["steps"], warmup=run["warmup"],
                      margin=run["margin"], patience=run["patience_frac"],
                      min_steps=run["min_steps"]) is not None


def replay(runs: list[dict[str, Any]], patiences: list[int], every: int,
           margin: float) -> str:
    """The markdown table: per patience and cadence, runs that met the rule, how many of them
    would have recovered (false stops), the rate with its one-sided 95 % upper bound
    (Clopper–Pearson), and the steps the stop saves.

    Whether a run recovered is judged on its whole recorded curve (every ``every`` steps), by
    the end-of-run rule: thinned to the study's cadence, a run that stalled from step 20 to
    its end can fail the end-of-run rule's patience (its first point at the level comes too
    late) without ever leaving the level, and would count as "recovered" though it did not."""
    from scipy.stats import beta

    lines = ["| cadence | patience (steps) | runs | met the rule | recovered (false stops) | "
             "rate | 95 % upper bound | steps saved |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label in ("study's", f"every {every}"):
        for p in patiences:
            met = false = saved = 0
            total = sum(r["steps"] for r in runs)
            names: list[str] = []
            for r in runs:
                cadence = r["cadence"] if label == "study's" else every
                stop = first_stop(r, p, cadence, margin)
                if stop is None:
                    continue
                met += 1
                saved += r["steps"] - stop[0]
                if not stalled_at_end(r):
                    false += 1
                    names.append(f"{r['case']}/{r['method']}/s{r['seed']}@{stop[0]}")
            rate = f"{false / met:.0%}" if met else "–"
            upper = f"{beta.ppf(0.95, false + 1, met - false):.0%}" if met > false else "–"
            lines.append(f"| {label} | {p} | {len(runs)} | {met} | {false}"
                         f"{' (' + ', '.join(names) + ')' if names else ''} | {rate} | {upper} | "
                         f"{saved} of {total} ({saved / total:.0%}) |")
    return "\n".join(lines)


def level_spans(run: dict[str, Any], margin: float) -> list[tuple[int, int]]:
    """The stretches (first and last step) of consecutive validations after warm-up at the
    unigram level within ``margin`` or above it."""
    spans: list[tuple[int, int]] = []
    start = None
    for s, v in run["vals"]:
        if s > run["warmup"] and v is not None and v >= run["level"] - margin:
            start = s if start is None else start
            if spans and spans[-1][0] == start:
                spans[-1] = (start, s)
            else:
                spans.append((start, s))
        else:
            start = None
    return spans


def longest_plateau(runs: list[dict[str, Any]], margin: float) -> str:
    """The longest stretch (last minus first step of consecutive validations after warm-up,
    each at the unigram level within ``margin`` or above it) of a run that was not stalled at
    its end: the stop may not fire inside such a stretch, so the patience must exceed it. A run
    shorter than the end-of-run rule's ``min_steps`` is never called stalled, so it is left
    out: whether it learned on is not known."""
    best: tuple[int, str] | None = None
    for r in runs:
        if r["final_val_loss"] is None or r["steps"] < r["min_steps"] or stalled_at_end(r):
            continue
        for first, last in level_spans(r, margin):
            if best is None or last - first > best[0]:
                best = (last - first, f"{r['case']}/{r['method']}/s{r['seed']}, {first}–{last}")
    if best is None:
        return "no run that learned on sat at the level after warm-up"
    return (f"longest stretch at the level (within {margin} or above it) of a run that learned "
            f"on: {best[0]} steps ({best[1]}); a patience at or below it can cut such a run")


def loss(v: float | None) -> str:
    """A loss as the tables show it; a diverged run's is null."""
    return "–" if v is None else f"{v:.3f}"


def curves_table(runs: list[dict[str, Any]]) -> str:
    lines = ["| case | method | seed | status | final | unigram | validations at the level "
             "(within the margin) after warm-up | CPU s |", "|---|---|---:|---|---:|---:|---|---:|"]
    for r in runs:
        shown = ", ".join(f"{a}–{b}" if b > a else str(a) for a, b in level_spans(r, r["margin"]))
        lines.append(f"| {r['case']} | `{r['method']}` | {r['seed']} | {r['status']} | "
                     f"{loss(r['final_val_loss'])} | {r['level']:.3f} | {shown or '–'} | "
                     f"{r['cpu_s'] if r['cpu_s'] is not None else '–'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="builtin,deep-lr1e-3,deep-300,cpu-small")
    ap.add_argument("--methods", default=None, help="comma-separated: only these methods")
    ap.add_argument("--every", type=int, default=20, help="validate every K steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--patiences", default="40,60,100,150,200,300")
    ap.add_argument("--out", default="benchmarks/results/stall_rule-2026-11-26.json")
    ap.add_argument("--replay", default=None,
                    help="comma-separated results JSONs: replay only, no training (the runs "
                         "of several, e.g. of two processes that each trained some)")
    ap.add_argument("--budget-s", type=float, default=1500.0,
                    help="train no further run once this many CPU seconds are spent")
    ap.add_argument("--runs", default=None,
                    help="comma-separated CASE/METHOD/SEED: these runs, in this order, instead "
                         "of every run of --cases")
    ap.add_argument("--studies", default=None,
                    help="comma-separated finished study folders: replay the rule also on "
                         "their runs that trained to the end (validated at their own cadence)")
    ap.add_argument("--stop-margin", type=float, default=TrainConfig().stop_stalled_margin,
                    help="the early stop's margin (train.stop_stalled_margin) to replay; "
                         "default: the key's default")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in --out and train only the others")
    args = ap.parse_args(argv)
    patiences = [int(p) for p in args.patiences.split(",")]
    if args.replay:
        runs = [r for f in args.replay.split(",") for r in json.loads(Path(f).read_text())["runs"]]
    else:
        methods = args.methods.split(",") if args.methods else None
        table = cases(args.every, methods)
        todo = ([(c, m, int(sd)) for c, m, sd in (x.split("/") for x in args.runs.split(","))]
                if args.runs else [(c, m, sd) for c in args.cases.split(",")
                                   for m, sd in table[c].runs])
        runs = json.loads(Path(args.out).read_text())["runs"] if args.resume else []
        done = {(r["case"], r["method"], r["seed"]) for r in runs}
        with tempfile.TemporaryDirectory(prefix="stall_rule-") as tmp:
            for name, method, seed in todo:
                case = table[name]
                if (name, method, seed) not in done:
                    if sum(r["cpu_s"] for r in runs) > args.budget_s:
                        print(f"budget spent: {name} {method} s{seed} not trained", flush=True)
                        continue
                    r = train_curve(case, method, seed, args.every, args.threads, Path(tmp))
                    print(f"{name} {method} s{seed}: {r['status']} {loss(r['final_val_loss'])} "
                          f"(unigram {r['level']:.3f}) {r['cpu_s']} cpu s", flush=True)
                    runs.append(r)
                    Path(args.out).write_text(json.dumps(
                        {"every": args.every, "threads": args.threads, "runs": runs}) + "\n")
    # one curve per (setting, method, seed): the same run kept by several studies (or trained
    # here too, as the builtin case's seed-0 runs are) counts once, the first one kept
    def setting(r: dict[str, Any]) -> tuple[str, str, int]:
        return SAME_SETTING.get(r["case"], r["case"]), r["method"], r["seed"]

    seen: set[tuple[str, str, int]] = set()
    runs = [r for r in runs if not (setting(r) in seen or seen.add(setting(r)))]
    for folder in args.studies.split(",") if args.studies else []:
        for r in study_curves(Path(folder)):
            if (key := setting(r)) not in seen:
                seen.add(key)
                runs.append(r)
    print(curves_table(runs))
    print()
    print(f"the stop's margin: {args.stop_margin} nats (train.stop_stalled_margin)")
    print(replay(runs, patiences, args.every, args.stop_margin))
    print()
    print(longest_plateau(runs, args.stop_margin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
