"""Small helpers shared by tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from modbench.config import RunConfig, resolve
from modbench.model.stream import StreamState


def tiny(method: str = "baseline", seed: int = 0, steps: int = 30, *overrides: str) -> RunConfig:
    return resolve("tiny", method=method, seed=seed, steps=steps, overrides=list(overrides))


def read_metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def run_capturing(model: torch.nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, StreamState]:
    """Logits and the forward's StreamState (every sublayer's input, output, after)."""
    seen: list[StreamState] = []
    finish = model.stream.finish  # type: ignore[union-attr]

    def capture(state: StreamState) -> torch.Tensor:
        seen.append(state)
        return finish(state)

    model.stream.finish = capture  # type: ignore[union-attr,method-assign]
    try:
        logits = model(idx)
    finally:
        del model.stream.finish  # type: ignore[union-attr]
    return logits, seen[0]
