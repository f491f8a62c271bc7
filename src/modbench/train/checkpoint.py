"""Atomic checkpoints: write to a temporary file in the same folder, then rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from modbench.errors import ModbenchError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Save ``state`` so that a crash mid-write leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
