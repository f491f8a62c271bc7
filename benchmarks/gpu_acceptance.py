"""The GPU acceptance check: one call, at most 8 minutes on one GPU, one JSON file.

Most sessions of this project have no GPU, so what only a GPU can show is gathered by this one
prepared script in a single short lease (issues 27 and 28)::

    python benchmarks/gpu_acceptance.py --device cuda --out acceptance.json   # on a GPU
    python benchmarks/gpu_acceptance.py --device cpu --out dry.json           # the dry path

Run it from the repository root with modbench importable (installed, or ``PYTHONPATH=src``)
and pytest installed; every child process inherits the environment. Nothing is downloaded:
the trainer sections train on the built-in corpus (``modbench.measure.bench.bench_data``).

Sections, in this order, each guarded (a failing one records its error and the script goes
on) and the JSON rewritten after each, so a partial run leaves what it measured:

- ``environment``: torch, the GPU and its catalogue model (``modbench.runtime.gpus``).
- ``tests``: ``pytest tests/test_cuda.py`` and the CUDA-only test of
  ``tests/train/test_distributed.py``: passed / failed / skipped counts, cut at the section's
  time (the JSON says so and counts what finished).
- ``memory_plan``: three presets x three methods, the memory plan's micro-batch and predicted
  peak (``modbench.measure.plan`` where it exists; else a fixed micro-batch, said so) against
  ``torch.cuda.max_memory_allocated`` of a few of the trainer's steps on that micro-batch
  (its engine and optimizer, the run's precision, eager), each in a fresh process.
- ``climb_1_2b``: 20 steps of ``climb-1.2b`` through ``modbench train`` with
  ``train.micro_batch_size=auto`` (a fixed micro-batch where this tree does not accept
  ``auto``, said so), bf16, compiled: steady tokens/s (after the first read-back window,
  which holds compilation), MFU, peak memory.
- ``llama_350m``: ``modbench bench`` at ``llama-350m``, bf16, compiled: bare and trainer MFU.
- ``compile_graphs``: ``modbench bench --compile-check`` on CUDA in bf16 for ten methods
  (:data:`CHECK_METHODS`: graphs, breaks, recompiles, with and without checkpointing), and
  ``torch._dynamo.explain`` of the baseline's training forward, with and
  without activation checkpointing: graphs, graph breaks and their reasons.
- ``fsdp_units``: the modules ``fully_shard`` wraps (``_fully_shard`` of
  ``modbench.train.distributed``) in a one-process group.
- ``nccl_2proc``: ``modbench train --nproc 2`` where two GPUs exist, else skipped.

``--device cpu`` is the dry path: the same code, at the ``tiny`` preset, a few steps, no
two-process run; it finishes in under a minute on an idle machine and runs in CI
(``tests/test_gpu_acceptance.py``). Time: each section gets its share of what is left of
``--budget-s`` (420 s by default; the lease's 8 minutes less start-up), so an early section
that finishes fast leaves more to the later ones; a child process that overruns its share is
killed and the section is recorded as ``cut``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
SCHEMA = 1

# (section, share of the remaining budget). Shares are relative to the sections still to run.
# Measured on an H200 (2026-11-26, BENCHMARKS.md): tests over 63 s (cut), memory plan 10-12 s
# a plan and 12-25 s a measured pair (the first call cut six of nine pairs), climb-1.2b 109 s,
# llama-350m 101 s, graphs 16 s, FSDP units 8 s; the compile check adds ~20 methods x modes.
SECTIONS: list[tuple[str, float]] = [
    ("environment", 0.01), ("tests", 0.13), ("memory_plan", 0.20), ("climb_1_2b", 0.27),
    ("llama_350m", 0.23), ("compile_graphs", 0.10), ("fsdp_units", 0.03),
    ("nccl_2proc", 0.03)]
# The sizes of each path: the GPU's, and the dry path's (tiny, a few steps).
GPU = {"plan_presets": ["llama-60m", "llama-350m", "climb-1.2b"],
       "plan_methods": ["baseline", "softpick", "hyper_connections"],
       "plan_steps": 3, "climb_preset": "climb-1.2b", "climb_steps": 20, "climb_batch": 32,
       "bench_preset": "llama-350m", "graph_preset": "llama-60m", "graph_rows": 2,
       "fsdp_preset": "llama-60m", "tests": ["tests/test_cuda.py",
                                             "tests/train/test_distributed.py::"
                                             "test_two_gpus_train_like_one"]}
DRY = {"plan_presets": ["tiny"], "plan_methods": ["baseline"],
       "plan_steps": 2, "climb_preset": "tiny", "climb_steps": 4, "climb_batch": 2,
       "bench_preset": "tiny", "graph_preset": "tiny", "graph_rows": 1,
       "fsdp_preset": "tiny", "tests": ["tests/test_cuda.py"]}


# ----------------------------------------------------------------------------- helpers


class Budget:
    """What is left of ``--budget-s``, and each section's share of it."""

    def __init__(self, seconds: float, only: list[str] | None = None) -> None:
        self.total, self.t0 = seconds, time.monotonic()
        self.only = only or [n for n, _ in SECTIONS]

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)

    def share(self, name: str) -> float:
        # shares of the sections still to run that this run runs (``--only``)
        names = [n for n, _ in SECTIONS]
        later = [s for n, s in SECTIONS[names.index(name):] if n in self.only or n == name]
        return max(0.0, self.left() * later[0] / sum(later))


def run_child(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
              cwd: Path = ROOT) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own process group; kill the group at ``timeout`` seconds. Returns
    (exit code or None when cut, its output, seconds)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        log.seek(0)
        text = log.read()
    return code, text, time.monotonic() - t0


def child(kind: str, spec: dict[str, Any], timeout: float, work: Path) -> dict[str, Any]:
    """Run one of this script's child modes (:data:`CHILDREN`) in a fresh process and return
    what it wrote; a crash, a non-zero exit or a cut raises with the child's last line."""
    result = work / f"child-{kind}-{time.monotonic_ns()}.json"
    code, text, secs = run_child([sys.executable, str(SCRIPT), "--child", kind, "--spec",
                                  json.dumps(spec), "--out", str(result)], timeout)
    if code is None:
        raise Cut(f"{kind} ran past its {timeout:.0f} s share of the budget")
    if code != 0 or not result.is_file():
        raise RuntimeError(f"{kind} exited with code {code}: {last_line(text)}")
    out: dict[str, Any] = json.loads(result.read_text())
    out["child_s"] = round(secs, 2)
    return out


class Cut(Exception):
    """A section (or part of one) stopped at its share of the time budget."""


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][-500:] if lines else "no output"


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**30, 3)


def steady_tokens_per_s(records: list[dict[str, Any]], window: int) -> float | None:
    """Tokens/s of the training records after the first read-back window (compilation and
    first-call overheads), from the trainer's own per-window times."""
    train = [r for r in records if r.get("kind") == "train" and r["step"] > window]
    if not train:
        return None
    secs = sum(1.0 / r["tokens_per_s"] for r in train)  # each record: one step's tokens
    return len(train) / secs


# ---------------------------------------------------------------- child modes (fresh processes)


def child_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """A few of the trainer's steps (its engine: forward and loss as the run computes them,
    backward, clipping, the recipe's optimizer, the run's precision; eager) of ``method`` at
    ``preset`` on one micro-batch of ``rows`` random rows: the peak allocation."""
    import torch

    from modbench.config import resolve
    from modbench.methods.build import plan_run
    from modbench.runtime.device import autocast_for
    from modbench.train.engine import LocalEngine
    from modbench.train.optim import build_optimizer

    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    cfg = resolve(spec["preset"], method=spec["method"])
    cfg.train.batch_size, cfg.train.micro_batch_size = spec["rows"], None
    run, p = plan_run(cfg)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    model = p.build(run.seed, dev)
    engine = LocalEngine([model], [build_optimizer(model, run.recipe)], dev,
                         autocast_for(run.recipe.precision, dev), n_micro=1, compile=False)
    batch = torch.randint(0, run.model.vocab_size, (spec["rows"], run.train.seq_len),
                          generator=torch.Generator().manual_seed(0))
    secs = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        engine.backward(batch, None, [0])
        engine.clip_grad_norm(run.recipe.grad_clip, [0])
        engine.update([0])
        engine.synchronize()
        secs.append(time.perf_counter() - t0)
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(dev) if cuda else None,
            "max_memory_reserved": torch.cuda.max_memory_reserved(dev) if cuda else None,
            "step_s": secs, "rows": spec["rows"], "seq_len": run.train.seq_len}


def child_train(spec: dict[str, Any]) -> dict[str, Any]:
    """``modbench train`` with ``spec["args"]`` in this process: its exit code and error,
    and the CUDA peak allocation of the run."""
    import contextlib
    import io

    import torch

    from modbench.cli import run_cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_cli(["train", *spec["args"]])
    cuda = torch.cuda.is_available() and spec["device"] != "cpu"
    return {"rc": code, "error": last_line(err.getvalue()) if code else None,
            "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
            "max_memory_reserved": torch.cuda.max_memory_reserved() if cuda else None}


def child_graphs(spec: dict[str, Any]) -> dict[str, Any]:
    """``torch._dynamo.explain`` of the baseline's training forward (grad enabled), plain and
    with activation checkpointing (``modbench.train.recompute``)."""
    import torch

    from modbench.config import resolve
    from modbench.methods.build import build_model
    from modbench.train.recompute import apply_activation_checkpointing

    dev = torch.device(spec["device"])
    cfg = resolve(spec["preset"])
    idx = torch.randint(0, cfg.model.vocab_size, (spec["rows"], cfg.train.seq_len),
                        generator=torch.Generator().manual_seed(0)).to(dev)
    out: dict[str, Any] = {"preset": spec["preset"], "batch": list(idx.shape)}
    for label, ckpt in (("plain", False), ("activation_checkpointing", True)):
        torch._dynamo.reset()
        model = build_model(cfg.model, seed=0, device=dev)
        model.train()
        if ckpt:
            apply_activation_checkpointing(model, "baseline")
        ctx = (torch.autocast(dev.type, dtype=torch.bfloat16) if dev.type == "cuda"
               else torch.autocast("cpu", enabled=False))
        with ctx:
            ex = torch._dynamo.explain(model)(idx)
        out[label] = {"graph_count": ex.graph_count, "graph_break_count": ex.graph_break_count,
                      "op_count": ex.op_count,
                      "break_reasons": [str(getattr(b, "reason", b)).splitlines()[0][:300]
                                        for b in ex.break_reasons][:10]}
    return out


def child_fsdp(spec: dict[str, Any]) -> dict[str, Any]:
    """The FSDP2 units ``_fully_shard`` makes of the baseline, in a one-process group."""
    import torch
    import torch.distributed as dist

    from modbench.config import resolve
    from modbench.methods.build import build_model
    from modbench.train.distributed import _fully_shard

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch 2.5
        from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
    dev = torch.device(spec["device"])
    if dev.type == "cuda" and dev.index is None:  # set_device and nccl need an index
        dev = torch.device("cuda", 0)
    store = Path(spec["work"]) / f"fsdp-store-{os.getpid()}"
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            init_method=f"file://{store}", rank=0, world_size=1)
    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        cfg = resolve(spec["preset"]).model
        model = build_model(cfg, seed=0, device=dev)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the run's default
        try:
            _fully_shard(model, dev, 1, set(), dtype)
        except TypeError:  # a tree from before the mixed-precision policy
            _fully_shard(model, dev, 1, set())
        units = [name or "<root>" for name, m in model.named_modules()
                 if isinstance(m, FSDPModule)]
        n_params = sum(1 for _ in model.parameters())
    finally:
        dist.destroy_process_group()
    return {"preset": spec["preset"], "units": units, "unit_count": len(units),
            "parameters": n_params, "n_layers": cfg.n_layers}


def plan_one(preset: str, method: str, device: dict[str, Any]) -> dict[str, Any]:
    """The memory plan of ``method`` at ``preset`` on ``device`` (``key``, ``memory_gb``,
    ``type``: CPU-side work, the device is not touched): its micro-batch and predicted peak;
    a fixed micro-batch (``"source": "fixed"``, no prediction) where this tree has no plan."""
    from modbench.config import resolve
    from modbench.runtime.gpus import Accelerator

    cfg = resolve(preset, method=method)
    try:
        from modbench.measure import plan as memory_plan
    except ImportError:
        from modbench.measure.bench import GPU_TOKENS

        rows = (cfg.train.batch_size if device["type"] == "cpu"
                else max(1, GPU_TOKENS // cfg.train.seq_len))
        return {"micro_batch": rows, "source": "preset" if device["type"] == "cpu" else "fixed",
                "predicted_bytes": None,
                "note": "modbench.measure.plan is not in this tree: no prediction"}
    acc = Accelerator(device["key"], device["key"], device["memory_gb"], None)
    p = memory_plan.choose_micro_batch(cfg, acc)
    return {"micro_batch": int(p.micro_batch), "source": "plan",
            "predicted_bytes": int(p.peak_bytes), "predicted_terms": dict(p.terms),
            "usable_bytes": int(p.usable_bytes)}


def _plan_entry(args: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        out = plan_one(*args)
    except Exception as e:  # one pair's failure is recorded
        out = {"error": f"{type(e).__name__}: {e}"[:1000]}
    return {**out, "plan_s": round(time.monotonic() - t0, 2)}


def child_plans(spec: dict[str, Any]) -> dict[str, Any]:
    """Every pair's plan, in parallel worker processes (the planner traces fake models on the
    CPU while the GPU runs the tests)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from modbench.measure.bench import bench_data

    for vocab, seq in spec.get("data", []):  # the trainer sections' data, prepared ahead
        bench_data(vocab, seq)
    jobs = [(p, m, spec["device"]) for p, m in spec["pairs"]]
    if len(jobs) == 1:
        results = [_plan_entry(jobs[0])]
    else:
        workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 2))
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(_plan_entry, jobs))
    return {f"{p}|{m}": r for (p, m, _), r in zip(jobs, results, strict=True)}


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "memory": child_memory, "train": child_train, "graphs": child_graphs, "fsdp": child_fsdp,
    "plans": child_plans}


# ----------------------------------------------------------------------------- sections


class Run:
    """The state the sections share: device, sizes, budget, work folder, the JSON."""

    def __init__(self, device: str, out: Path, budget_s: float, work: Path,
                 only: list[str] | None = None, plan_presets: list[str] | None = None) -> None:
        self.device, self.out, self.work = device, out, work
        self.cuda = device == "cuda"
        self.size = dict(GPU if self.cuda else DRY)
        if plan_presets:
            self.size["plan_presets"] = plan_presets
        self.budget = Budget(budget_s, only)
        self.plans_proc: subprocess.Popen[bytes] | None = None
        self.plans_file = work / "plans.json"
        self.report: dict[str, Any] = {
            "schema": SCHEMA, "script": "benchmarks/gpu_acceptance.py", "device": device,
            "dry_run": not self.cuda, "budget_s": budget_s,
            "started": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "sections": {}, "complete": False}

    def write(self) -> None:
        self.report["elapsed_s"] = round(self.budget.total - self.budget.left(), 2)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=2) + "\n")
        os.replace(tmp, self.out)

    def section(self, name: str, fn: Callable[[Run, float], dict[str, Any]]) -> None:
        # its share, but at least 10 s where that much is left (the quick sections)
        allot = max(self.budget.share(name), min(self.budget.left(), 10.0))
        t0 = time.monotonic()
        entry: dict[str, Any]
        if allot < 5:
            entry = {"status": "cut", "error": f"no time left in the {self.budget.total:.0f} s "
                     "budget"}
        else:
            try:
                entry = {"status": "ok", **fn(self, allot)}
            except Cut as e:
                entry = {"status": "cut", "error": str(e)}
            except Exception as e:  # every section is guarded: recorded
                entry = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000],
                         "traceback": traceback.format_exc()[-3000:]}
        entry["allotted_s"] = round(allot, 1)
        entry["elapsed_s"] = round(time.monotonic() - t0, 2)
        self.report["sections"][name] = entry
        self.write()


def s_environment(run: Run, allot: float) -> dict[str, Any]:
    import torch

    from modbench.runtime.gpus import detect

    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda_available": torch.cuda.is_available(),
                           "device_count": torch.cuda.device_count()}
    if run.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch sees no CUDA device")
        dev = torch.device("cuda")
        known = detect(dev)
        out.update(name=torch.cuda.get_device_name(dev),
                   total_memory_gib=gib(torch.cuda.get_device_properties(dev).total_memory),
                   gpu=known.key if known else None,
                   peak_bf16_tflops=known.peak_bf16_tflops if known else None,
                   cuda=torch.version.cuda)
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True,
                                       capture_output=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        out["commit"] = None
    return out


_RESULT = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


def s_tests(run: Run, allot: float) -> dict[str, Any]:
    """pytest -v, counted from its per-test lines, so a cut run still counts what ran."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o",
           "console_output_style=classic", *run.size["tests"]]
    code, text, seconds = run_child(cmd, allot)
    outcomes = {m.group(1): m.group(2) for m in _RESULT.finditer(text)}
    counts = {k.lower(): sum(1 for v in outcomes.values() if v == k)
              for k in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
    failed = sorted(t for t, v in outcomes.items() if v in ("FAILED", "ERROR"))
    out: dict[str, Any] = {"command": " ".join(["pytest", *run.size["tests"]]),
                           "exit_code": code, "counts": counts, "failed": failed[:50],
                           "cut": code is None, "seconds": round(seconds, 1)}
    if code is None:
        out["note"] = (f"cut at its {allot:.0f} s share of the budget: the counts are the "
                       "tests that finished")
    elif not outcomes:
        raise RuntimeError(f"pytest exited {code} with no test results: {last_line(text)}")
    if code not in (0, None) and failed:
        out["failure_tail"] = text[-3000:]
    return out


def device_spec(device: str) -> dict[str, Any]:
    """This run's device for the planner: the catalogue key and the device's own memory."""
    import torch

    from modbench.runtime.gpus import detect, device_memory_bytes

    dev = torch.device(device)
    known = detect(dev)
    return {"key": known.key if known else ("cpu" if dev.type == "cpu" else "unknown-gpu"),
            "memory_gb": device_memory_bytes(dev) / 1e9, "type": dev.type}


def start_plans(run: Run) -> None:
    """Plan the memory section's pairs in a background process (CPU work) from now on."""
    pairs = [[p, m] for p in run.size["plan_presets"] for m in run.size["plan_methods"]]
    run.plans_file = run.work / "plans.json"
    from modbench.config import resolve

    shapes = {(c.model.vocab_size, c.train.seq_len)
              for c in (resolve(run.size["climb_preset"]), resolve(run.size["bench_preset"]))}
    spec = {"pairs": pairs, "device": device_spec(run.device), "data": sorted(shapes)}
    run.plans_log = open(run.work / "plans.log", "w+")  # noqa: SIM115 - closed in s_memory_plan
    run.plans_proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--child", "plans", "--spec", json.dumps(spec),
         "--out", str(run.plans_file)], stdout=run.plans_log, stderr=subprocess.STDOUT,
        cwd=ROOT, start_new_session=True)


def collect_plans(run: Run, timeout: float) -> dict[str, Any]:
    """The background plans (waiting up to ``timeout``); raises where there are none."""
    proc = run.plans_proc
    if proc is None:
        start_plans(run)
        proc = run.plans_proc
    try:
        proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise Cut(f"the memory plans took more than {timeout:.0f} s") from None
    finally:
        run.plans_log.seek(0)
        text = run.plans_log.read()
        run.plans_log.close()
    if proc.returncode != 0 or not run.plans_file.is_file():
        raise RuntimeError(f"planning exited with code {proc.returncode}: {last_line(text)}")
    plans: dict[str, Any] = json.loads(run.plans_file.read_text())
    return plans


def s_memory_plan(run: Run, allot: float) -> dict[str, Any]:
    deadline = time.monotonic() + allot
    pairs = [(p, m) for p in run.size["plan_presets"] for m in run.size["plan_methods"]]
    plans = collect_plans(run, allot / 2)
    rows: list[dict[str, Any]] = []
    for i, (preset, method) in enumerate(pairs):
        row: dict[str, Any] = {"preset": preset, "method": method}
        left = deadline - time.monotonic()
        if left < 5:
            row.update(status="cut", error="no time left in the section's share")
            rows.append(row)
            continue
        try:
            plan = plans[f"{preset}|{method}"]
            row.update(plan)
            if "error" in plan:
                raise RuntimeError(f"the plan failed: {plan['error']}")
            got = child("memory", {"device": run.device, "preset": preset, "method": method,
                                   "rows": plan["micro_batch"],
                                   "steps": run.size["plan_steps"]},
                        left / (len(pairs) - i) * 1.5, run.work)
            row.update(status="ok", measured_bytes=got["max_memory_allocated"],
                       reserved_bytes=got["max_memory_reserved"],
                       measured_gib=gib(got["max_memory_allocated"]),
                       step_s=got["step_s"], child_s=got["child_s"])
            if plan["predicted_bytes"] and got["max_memory_allocated"]:
                row["measured_over_predicted"] = round(
                    got["max_memory_allocated"] / plan["predicted_bytes"], 4)
        except Cut as e:
            row.update(status="cut", error=str(e))
        except Exception as e:  # one pair's failure is recorded
            row.update(status="error", error=f"{type(e).__name__}: {e}"[:1000])
        rows.append(row)
        run.report["sections"]["memory_plan"] = {"status": "running", "rows": rows}
        run.write()
    return {"what": "the memory plan's micro-batch and predicted peak against "
                    "torch.cuda.max_memory_allocated of a few of the trainer's steps (its "
                    "engine, eager: compilation only lowers the peak) on that micro-batch, "
                    "one fresh process each",
            "rows": rows, "errors": sum(r["status"] != "ok" for r in rows)}


def s_climb(run: Run, allot: float) -> dict[str, Any]:

    from modbench.config import resolve
    from modbench.measure.bench import bench_data

    size = run.size
    preset = size["climb_preset"]
    cfg = resolve(preset)
    data = bench_data(cfg.model.vocab_size, cfg.train.seq_len)
    batch, steps = size["climb_batch"], size["climb_steps"]
    out_dir = run.work / "climb"
    base = ["--preset", preset, "--steps", str(steps), "--no-progress",
            "--set", f"train.batch_size={batch}", "--set", f"data.source={data}",
            "--set", "recipe.precision=bf16", "--set", "train.eval_every=0",
            "--set", f"train.eval_sequences={batch}", "--set", "train.checkpoint_every=0",
            "--set", "train.stall_margin=0",
            "--set", f"train.compile={'true' if run.cuda else 'false'}",
            "--set", f"train.device={run.device}"]
    deadline = time.monotonic() + allot
    micro: dict[str, Any] = {"setting": "auto"}
    folder = out_dir / "auto"
    try:
        got = child("train", {"device": run.device, "args": [
            *base, "--out", str(folder), "--set", "train.micro_batch_size=auto"]},
            deadline - time.monotonic(), run.work)
    except Cut as e:  # what the killed run logged is still worth keeping
        return {"status": "cut", "error": str(e), **_climb_partial(folder, cfg, run)}
    if got["rc"] == 2 and "micro_batch_size" in (got["error"] or ""):
        plan = plan_one(preset, "baseline", device_spec(run.device))
        rows = max(r for r in range(1, batch + 1) if batch % r == 0 and r <= plan["micro_batch"])
        micro = {"setting": rows, "source": plan["source"],
                 "note": f"train.micro_batch_size=auto refused by this tree ({got['error']}); "
                         f"ran the {plan['source']} micro-batch {rows}"}
        folder = out_dir / "fixed"
        got = child("train", {"device": run.device, "args": [
            *base, "--out", str(folder), "--set", f"train.micro_batch_size={rows}"]},
            deadline - time.monotonic(), run.work)
    if got["rc"] != 0:
        raise RuntimeError(f"modbench train exited {got['rc']}: {got['error']}")
    partial = _climb_partial(folder, cfg, run)
    summary = json.loads((folder / "summary.json").read_text())
    shutil.rmtree(out_dir, ignore_errors=True)  # its checkpoint: 15 GB at climb-1.2b
    return {"preset": preset, "steps": steps, "batch": [batch, cfg.train.seq_len],
            "micro_batch": {**micro, "chosen": summary.get("micro_batch_size")},
            **partial, "tokens_per_s_run": summary.get("tokens_per_s"),
            "peak_memory_gib": gib(got["max_memory_allocated"]),
            "reserved_memory_gib": gib(got["max_memory_reserved"]),
            "run_status": summary.get("status"), "child_s": got["child_s"],
            "note": (f"batch {batch}, not the preset's {cfg.train.batch_size}, to fit the "
                     "lease: the optimizer step is shared by fewer micro-batches, so the MFU "
                     "is a little below a real run's. " if batch != cfg.train.batch_size
                     else "") + "tokens_per_s_steady: the trainer's own window times after "
                    "its first read-back window (compilation); tokens_per_s_run: "
                    "summary.json, compilation included"}


def _climb_partial(folder: Path, cfg: Any, run: Run) -> dict[str, Any]:
    """Steady throughput and MFU from what a run logged so far (a run cut midway too)."""
    import torch

    from modbench.measure.flops import flop_report
    from modbench.runtime.gpus import peak_tflops

    path = folder / "metrics.jsonl"
    records = ([json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
               if path.is_file() else [])
    window = 16 if run.cuda else 1
    steady = steady_tokens_per_s(records, window)
    fpt = flop_report(cfg.model, cfg.train.seq_len).train_flops_per_token
    peak = peak_tflops(torch.device(run.device)) if run.cuda else None
    train = [r for r in records if r.get("kind") == "train"]
    return {"tokens_per_s_steady": steady,
            "steady_steps": sum(1 for r in train if r["step"] > window),
            "steps_logged": len(train),
            "mfu": (steady * fpt / (peak * 1e12)) if steady and peak else None,
            "final_loss": train[-1]["loss"] if train else None}


def s_llama_350m(run: Run, allot: float) -> dict[str, Any]:
    preset = run.size["bench_preset"]
    cmd = [sys.executable, "-m", "modbench", "bench", "--json", "--no-hf", "--methods",
           "baseline", "--preset", preset, "--device", run.device, "--no-progress",
           "--rounds", "3" if run.cuda else "1", "--steps", "2" if run.cuda else "1",
           "--trainer"]
    if not run.cuda:
        cmd += ["--trainer-steps", "2"]
    code, text, secs = run_child(cmd, allot)
    if code is None:
        raise Cut(f"modbench bench ran past its {allot:.0f} s share of the budget")
    if code != 0:
        raise RuntimeError(f"modbench bench exited {code}: {last_line(text)}")
    start = text.find("{\n")  # the JSON report: the output's last block
    if start < 0:
        raise RuntimeError(f"modbench bench printed no JSON: {last_line(text)}")
    report, _ = json.JSONDecoder().raw_decode(text[start:])  # warnings may follow it
    base = report["methods"][0]
    t = report.get("trainer") or {}
    return {"command": " ".join(["modbench", *cmd[3:]]), "preset": preset,
            "dtype": report["dtype"], "compiled": report["compiled"], "gpu": report["gpu"],
            "peak_tflops": report["peak_tflops"], "batch": report["batch"],
            "batch_source": report["batch_source"],
            "bare": {k: base.get(k) for k in ("median_ms", "tokens_per_s", "mfu", "step_gib")},
            "trainer": {k: t.get(k) for k in ("step_ms", "step_with_validation_ms",
                                              "tokens_per_s", "mfu", "validation_s",
                                              "trainer_over_bare")},
            "seconds": round(secs, 1)}


#: the methods of ``modbench bench --compile-check`` on the GPU: the baseline, the fast-path
#: residual and attention methods, softcap (FlexAttention outside the graph on CUDA), two
#: that update statistics and one that declares host reads
CHECK_METHODS = "baseline,softcap,hyper_connections,denseformer,attnres,diff_attn,ngpt," \
    "powernorm,prepbn,moe"


def s_compile_graphs(run: Run, allot: float) -> dict[str, Any]:
    out = child("graphs", {"device": run.device, "preset": run.size["graph_preset"],
                           "rows": run.size["graph_rows"]}, allot / 3, run.work)
    methods = CHECK_METHODS if run.cuda else "baseline,softcap"
    cmd = [sys.executable, "-m", "modbench", "bench", "--compile-check", "--json",
           "--methods", methods, "--device", run.device, "--no-progress"]
    if run.cuda:
        cmd += ["--dtype", "bf16"]
    code, text, secs = run_child(cmd, max(allot * 2 / 3 - 1, 5))
    check: dict[str, Any] = {"command": " ".join(["modbench", *cmd[3:]]), "seconds": round(
        secs, 1)}
    if code is None:
        check["status"] = "cut"
    elif code != 0:
        check.update(status="error", error=last_line(text))
    else:
        try:
            start = text.index("[")
            rows = json.loads(text[start:text.rindex("]") + 1])
            check.update(status="ok", rows=[{k: r.get(k) for k in (
                "method", "checkpointing", "graphs", "graph_breaks", "recompiles", "reasons",
                "expected")} for r in rows])
        except ValueError as e:
            check.update(status="error", error=f"unreadable JSON: {e}")
    out["compile_check"] = check
    return out


def s_fsdp_units(run: Run, allot: float) -> dict[str, Any]:
    return child("fsdp", {"device": run.device, "preset": run.size["fsdp_preset"],
                          "work": str(run.work)}, allot, run.work)


def s_nccl(run: Run, allot: float) -> dict[str, Any]:
    import torch

    if not run.cuda:
        return {"status": "skipped", "reason": "dry path (--device cpu): the two-process gloo "
                "path is tested by tests/train/test_distributed.py"}
    if torch.cuda.device_count() < 2:
        return {"status": "skipped",
                "reason": f"{torch.cuda.device_count()} GPU(s): needs 2 for an nccl run"}
    out = run.work / "nccl"
    cmd = [sys.executable, "-m", "modbench", "train", "--nproc", "2", "--preset", "tiny",
           "--steps", "6", "--out", str(out), "--no-progress", "--set", "train.device=cuda",
           "--set", "train.eval_every=3"]
    code, text, secs = run_child(cmd, allot)
    if code is None:
        raise Cut(f"the 2-process run ran past its {allot:.0f} s share")
    if code != 0:
        raise RuntimeError(f"modbench train --nproc 2 exited {code}: {last_line(text)}")
    summary = json.loads((out / "summary.json").read_text())
    return {"processes": summary.get("processes"), "status_run": summary.get("status"),
            "final_val_loss": summary.get("final_val_loss"), "seconds": round(secs, 1)}


FUNCS: dict[str, Callable[[Run, float], dict[str, Any]]] = {
    "environment": s_environment, "tests": s_tests, "memory_plan": s_memory_plan,
    "climb_1_2b": s_climb, "llama_350m": s_llama_350m, "compile_graphs": s_compile_graphs,
    "fsdp_units": s_fsdp_units, "nccl_2proc": s_nccl}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--out", type=Path, default=Path("acceptance.json"))
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--only", default="", help="comma-separated sections (default: all)")
    ap.add_argument("--plan-presets", default="",
                    help="comma-separated presets of the memory_plan section (default: its own)")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = CHILDREN[args.child](json.loads(args.spec))
        args.out.write_text(json.dumps(result) + "\n")
        return 0
    if args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in FUNCS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(FUNCS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="modbench-acceptance-") as work:
        run = Run(args.device, args.out.resolve(), args.budget_s, Path(work), only,
                  [p.strip() for p in args.plan_presets.split(",") if p.strip()])
        run.write()
        for name, _ in SECTIONS:
            if only and name not in only:
                continue
            run.section(name, FUNCS[name])
            if name == "environment" and (not only or "memory_plan" in only):
                try:  # the planner's CPU work overlaps the tests' GPU work
                    start_plans(run)
                except Exception as e:  # memory_plan starts it again, and records the error
                    run.report["sections"]["environment"]["plans_error"] = str(e)
        if run.plans_proc is not None and run.plans_proc.poll() is None:
            os.killpg(run.plans_proc.pid, signal.SIGKILL)  # its section never collected it
            run.plans_proc.wait()
        run.report["complete"] = True
        run.write()
    bad = [n for n, s in run.report["sections"].items() if s["status"] in ("error", "cut")]
    print(f"{args.out}: {len(run.report['sections'])} sections, "
          f"{len(bad)} with errors or cut{': ' + ', '.join(bad) if bad else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
