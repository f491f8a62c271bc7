"""Small helpers shared by tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modbench.config import RunConfig, resolve


def tiny(method: str = "baseline", seed: int = 0, steps: int = 30, *overrides: str) -> RunConfig:
    return resolve("tiny", method=method, seed=seed, steps=steps, overrides=list(overrides))


def read_metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]
