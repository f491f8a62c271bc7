"""Known accelerators: memory and dense bf16 peak, by exact model.

The memory plan (``modbench plan``) sizes micro-batches against a device's memory and
``modbench bench`` divides achieved FLOP/s by the device's peak, so both need the *exact*
model: an H100 PCIe (756 TFLOP/s) or NVL (835) is not an H100 SXM (989). Figures are the
vendors' datasheet values for dense (not 2:4-sparse) bf16 tensor-core math; memory is the
marketed capacity in GB (10^9 bytes). A detected CUDA device's own ``total_memory`` is what
the trainer plans against; the catalogue's figure is for planning a machine one does not have.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from modbench.errors import ModbenchError, suggest


@dataclass(frozen=True)
class Accelerator:
    """One device model. ``peak_bf16_tflops`` is None where no peak is meaningful (the CPU)."""

    key: str  # the name ``--gpu`` takes
    name: str  # as a person writes it
    memory_gb: float  # 10^9 bytes
    peak_bf16_tflops: float | None
    # how torch.cuda.get_device_name() spells it: a regular expression, case-insensitive
    pattern: str = ""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


#: Ordered so that the first pattern that matches a device name is the right model (the
#: specific variants before the generic SXM part).
ACCELERATORS: dict[str, Accelerator] = {a.key: a for a in (
    Accelerator("h100-pcie", "NVIDIA H100 PCIe 80GB", 80.0, 756.0, r"H100.*PCIe"),
    Accelerator("h100-nvl", "NVIDIA H100 NVL 94GB", 94.0, 835.0, r"H100.*NVL"),
    Accelerator("h100-80gb", "NVIDIA H100 SXM 80GB", 80.0, 989.4, r"H100"),
    Accelerator("h200", "NVIDIA H200 141GB", 141.0, 989.4, r"H200|GH200"),
    Accelerator("a100-40gb", "NVIDIA A100 40GB", 40.0, 312.0, r"A100.*40\s*GB"),
    Accelerator("a100-80gb", "NVIDIA A100 80GB", 80.0, 312.0, r"A100"),
    Accelerator("l40s", "NVIDIA L40S 48GB", 48.0, 362.1, r"L40S"),
    Accelerator("b200", "NVIDIA B200 180GB", 180.0, 2250.0, r"B200"),
)}
#: Other names people use for the same parts.
ALIASES = {"h100": "h100-80gb", "h100-sxm": "h100-80gb", "h100-sxm-80gb": "h100-80gb",
           "h200-141gb": "h200", "a100": "a100-80gb", "a100-80": "a100-80gb",
           "a100-40": "a100-40gb", "l40s-48gb": "l40s"}


def host_memory_bytes() -> int:
    """This machine's RAM (bytes), or 0 where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def cpu() -> Accelerator:
    """The local CPU as a device: its RAM, no peak."""
    return Accelerator("cpu", "this machine's CPU", host_memory_bytes() / 1e9, None)


def lookup(key: str) -> Accelerator:
    """The accelerator named ``key`` (``--gpu``): a catalogue key, an alias, or ``cpu``."""
    k = key.strip().lower()
    if k == "cpu":
        return cpu()
    k = ALIASES.get(k, k)
    if k not in ACCELERATORS:
        names = [*ACCELERATORS, "cpu"]
        raise ModbenchError(f"unknown GPU {key!r}{suggest(k, names)}; choose one of "
                            f"{', '.join(names)} (or give the memory with "
                            "train.device_memory_gb)")
    return ACCELERATORS[k]


def match(device_name: str) -> Accelerator | None:
    """The catalogue entry whose pattern matches a CUDA device name, or None."""
    return next((a for a in ACCELERATORS.values()
                 if a.pattern and re.search(a.pattern, device_name, re.IGNORECASE)), None)


def detect(device: torch.device) -> Accelerator | None:
    """The model of ``device`` with its *own* memory (``total_memory``, which a MIG slice or
    a smaller variant reports truthfully) and the catalogue's peak; the CPU for a CPU device;
    None for an unknown CUDA model (its memory is still known: :func:`device_memory_bytes`)."""
    if device.type != "cuda":
        return cpu()
    name = torch.cuda.get_device_name(device)
    known = match(name)
    total = torch.cuda.get_device_properties(device).total_memory
    if known is None:
        return None
    return Accelerator(known.key, name, total / 1e9, known.peak_bf16_tflops, known.pattern)


def device_memory_bytes(device: torch.device) -> int:
    """What a run on ``device`` may plan to fill: a CUDA device's total memory, the CPU's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return host_memory_bytes()


def peak_tflops(device: torch.device) -> float | None:
    """``device``'s dense bf16 peak (None on the CPU or an unknown GPU model)."""
    if device.type != "cuda":
        return None
    known = match(torch.cuda.get_device_name(device))
    return known.peak_bf16_tflops if known else None
