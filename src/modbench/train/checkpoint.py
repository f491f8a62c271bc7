"""Atomic checkpoints: write to a temporary file in the same folder, then rename."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from modbench.errors import ModbenchError
from modbench.fsutil import atomic_path


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Save ``state`` so that a crash mid-write leaves the previous checkpoint intact."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModbenchError(f"no checkpoint at {path}; nothing to resume (drop --resume)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file
        raise ModbenchError(
            f"checkpoint {path} cannot be read ({e.__class__.__name__}); delete it and "
            "train again, or resume from a copy"
        ) from e
