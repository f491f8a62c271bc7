"""The device a run trains on and its mixed precision."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from modbench.errors import ModbenchError


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when present, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModbenchError(f"train.device={name} but CUDA is not available; use cpu or auto")
    return dev


def autocast_for(precision: str, device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    """A factory of the forward's autocast context: bf16 for ``recipe.precision=bf16`` and for
    ``auto`` on CUDA, none (fp32) otherwise. Master weights stay in fp32 either way."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
