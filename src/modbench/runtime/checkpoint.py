"""Checkpoints: written atomically, read safely.

A checkpoint is a ``torch.save`` file of plain containers, numbers, strings and tensors. It is
read with ``weights_only=True``, so a file that carries any other pickled object (code that
would run on loading) is refused before anything of it executes.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from modbench.errors import ModbenchError
from modbench.fsutil import atomic_path


def save_checkpoint(path: Path, state: dict[str, Any], *, keep_previous: bool = False) -> None:
    """Save ``state`` so that a crash mid-write leaves the previous checkpoint intact.

    ``keep_previous``: the checkpoint it replaces stays as :func:`previous_path` (hard-linked
    there before the new one is renamed into place, so at every moment both files are
    complete checkpoints)."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
        if keep_previous and path.is_file():
            link = tmp.with_name(tmp.name + ".prev")
            os.link(path, link)
            os.replace(link, previous_path(path))


def previous_path(path: Path) -> Path:
    """Where :func:`save_checkpoint` keeps the checkpoint before ``path`` (``prev.pt``)."""
    return path.with_name("prev" + path.suffix)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path``, loaded on the CPU without unpickling arbitrary objects."""
    if not path.is_file():
        raise ModbenchError(f"no checkpoint at {path}; nothing to resume (drop --resume)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ModbenchError(
            f"checkpoint {path} holds objects other than tensors and plain data and was not "
            "loaded (loading it could run code); use checkpoints written by modbench only"
        ) from e
    except Exception as e:  # a truncated or foreign file
        raise ModbenchError(
            f"checkpoint {path} cannot be read ({e.__class__.__name__}); delete it and "
            "train again, or resume from a copy"
        ) from e
    if not isinstance(state, dict):
        raise ModbenchError(f"checkpoint {path} is not a modbench checkpoint (not a mapping); "
                            "use checkpoints written by modbench only")
    return state


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint was written at, read without loading its tensors
    (memory-mapped)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        state = load_checkpoint(path)  # not a zip checkpoint: the full, checked load
    return int(state["step"])
