"""Parent-side checks of the reliability tests: run a child, kill it, compare run folders."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modbench.runtime.checkpoint import load_checkpoint
from modbench.runtime.runfolder import CHECKPOINT, SUMMARY_TIMINGS

# Summary keys that measure time, not the result.
TIMING_KEYS = SUMMARY_TIMINGS
# Checkpoint keys that measure time or byte offsets of timing-bearing lines.
CKPT_TIMING_KEYS = ("train_time", "metrics_offset")


def run_child(ctx: Any, target: Any, args: tuple[Any, ...], *, kill_after: float | None = None,
              timeout: float = 300) -> int:
    """Start ``target(*args)`` in a child of ``ctx``; SIGKILL it after ``kill_after`` seconds
    (if given and still running); return its exit code (-9: killed)."""
    p = ctx.Process(target=target, args=args)
    p.start()
    if kill_after is not None:
        p.join(kill_after)
        if p.exitcode is None:
            os.kill(p.pid, signal.SIGKILL)
    p.join(timeout)
    if p.exitcode is None:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        raise AssertionError(f"child {target.__name__}{args} hung for {timeout} s")
    return int(p.exitcode)


def strip_metrics(run: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as strict JSON records, less the timing field."""
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)  # strict: a torn line fails here
        rec.pop("tokens_per_s", None)
        rows.append(rec)
    return rows


def strip_summary(run: Path) -> dict[str, Any]:
    s = json.loads((run / "summary.json").read_text())
    for k in TIMING_KEYS:
        s.pop(k, None)
    return s


def _same(a: Any, b: Any, where: str, out: list[str]) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            out.append(f"{where}: tensors differ")
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            _same(a.get(k), b.get(k), f"{where}.{k}", out)
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]", out)
    elif a != b:
        out.append(f"{where}: {a!r} != {b!r}")


def checkpoint_differences(ref: Path, got: Path) -> list[str]:
    """Differences of two final checkpoints: weights, optimizer state, step, data hash,
    config (bit for bit), ignoring only timing."""
    a, b = load_checkpoint(ref / CHECKPOINT), load_checkpoint(got / CHECKPOINT)
    for k in CKPT_TIMING_KEYS:
        a.pop(k, None)
        b.pop(k, None)
    out: list[str] = []
    _same(a, b, "checkpoint", out)
    return out


def summary_differences(ref: Path, got: Path) -> list[str]:
    """The summary.json keys whose values differ (timing left out)."""
    a, b = strip_summary(ref), strip_summary(got)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def run_differences(ref: Path, got: Path) -> list[str]:
    """What differs between two finished run folders (empty: identical but for timing)."""
    out = checkpoint_differences(ref, got)
    keys = summary_differences(ref, got)
    if keys:
        out.append(f"summary.json differs in {', '.join(keys)}")
    if strip_metrics(ref) != strip_metrics(got):
        out.append("metrics.jsonl differs")
    return out


def checkpoint_step(run: Path) -> int | None:
    """The step of the run's checkpoint on disk (None: none). It must always load."""
    path = run / CHECKPOINT
    if not path.exists():
        return None
    return int(load_checkpoint(path)["step"])


def stray_temp_files(run: Path) -> list[str]:
    return sorted(p.name for p in run.rglob(".*.tmp"))


def wait_for(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@dataclass
class KillTally:
    """What a kill test tried and how it came out: the counts of its subclass's fields, the
    kills by kind, and the failures (recorded for docs/reliability.md by ``as_dict``)."""

    by_kind: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["by_kind"] = dict(sorted(self.by_kind.items()))
        return d
