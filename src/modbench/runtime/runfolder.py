"""The files of a run folder, their names and readers (docs/runs.md has the formats)::

    RUN/config.yaml            the fully resolved config, then ``meta`` (code version, slots)
    RUN/metrics.jsonl          one JSON object per line: train steps and validation points
    RUN/summary.json           written once, at the end (status completed | diverged | stalled)
    RUN/eval.json              ``modbench eval`` (validation loss, probes, harness tasks)
    RUN/checkpoints/last.pt    the latest checkpoint
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import subprocess
from pathlib import Path
from typing import IO, Any

import torch

import modbench

CONFIG = Path("config.yaml")
METRICS = Path("metrics.jsonl")
SUMMARY = Path("summary.json")
EVAL = Path("eval.json")
CHECKPOINT = Path("checkpoints") / "last.pt"

# The offline probes (modbench.eval.probes), as named in eval.json's "tasks" and in the
# "probes" of metrics.jsonl's validation records; their mean is the study metric probe_avg.
PROBES = ("mqar", "induction", "cloze")


def code_version() -> dict[str, Any]:
    """What produced a run: modbench's version and git commit, torch and Python."""
    git = None
    with contextlib.suppress(Exception):
        here = Path(modbench.__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            git = out.stdout.strip()
    return {"modbench": modbench.__version__, "git_commit": git, "torch": str(torch.__version__),
            "python": platform.python_version()}


class MetricsLog:
    """``metrics.jsonl``, appended one record a line and flushed at once. A resumed run first
    cuts the file back to ``truncate_at`` bytes: the log as of its checkpoint."""

    def __init__(self, path: Path, truncate_at: int | None = None) -> None:
        if truncate_at is not None:
            with open(path, "r+b") as f:
                f.truncate(truncate_at)
        self._file: IO[str] = open(path, "a")  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


def read_metrics(run: Path, upto: int | None = None) -> list[dict[str, Any]]:
    """Every record of a run's ``metrics.jsonl`` (none when the file is missing); ``upto``:
    only its first ``upto`` bytes (the log as of a checkpoint's ``metrics_offset``)."""
    path = Path(run) / METRICS
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        text = f.read(-1 if upto is None else upto).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def val_points(records: list[dict[str, Any]]) -> list[tuple[int, float | None]]:
    """The (step, validation loss) of each validation record, in log order."""
    return [(int(r["step"]), r.get("val_loss")) for r in records if r.get("kind") == "val"]


CURVES = ("loss", "grad_norm", "val_loss")  # per-step fields of metrics.jsonl records


def curves(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Training loss, grad norm and validation loss against step, from ``metrics.jsonl``, and
    ``probe:NAME`` for each held-out probe scored at validation (``train.eval_probes``)."""
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in CURVES}
    for rec in read_metrics(run):
        found = {k: rec.get(k) for k in CURVES}
        if rec.get("kind") == "val" and isinstance(rec.get("probes"), dict):
            found.update({f"probe:{k}": v for k, v in rec["probes"].items()})
        for k, v in found.items():
            if isinstance(v, int | float) and math.isfinite(v):
                out.setdefault(k, []).append((int(rec["step"]), float(v)))
    return out
