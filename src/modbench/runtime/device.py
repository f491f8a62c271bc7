"""The device a run trains on, its mixed precision and whether its step is compiled."""

from __future__ import annotations

import contextlib
import os
import warnings
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


def bf16_forward(precision: str, device_type: str) -> bool:
    """Whether the forward runs under bf16 autocast: ``recipe.precision=bf16``, or ``auto`` on
    CUDA (the one rule the autocast, FSDP2's gathered dtype and the memory plan follow)."""
    return precision == "bf16" or (precision == "auto" and device_type == "cuda")


def fsdp_gathers_bf16(setting: str, forward_bf16: bool) -> bool:
    """Whether FSDP2 gathers parameters in bf16 (``train.fsdp_param_dtype``): ``bf16``, or
    ``auto`` with a bf16 forward (:func:`bf16_forward`). The trainer and the memory plan both
    ask this."""
    return setting == "bf16" or (setting == "auto" and forward_bf16)


def autocast_for(precision: str, device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    """A factory of the forward's autocast context: bf16 for ``recipe.precision=bf16`` and for
    ``auto`` on CUDA, none (fp32) otherwise. Master weights stay in fp32 either way."""
    if bf16_forward(precision, device.type):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext



def compiles(setting: bool | str, device: torch.device) -> bool:
    """Whether ``train.compile`` = ``setting`` compiles the step on ``device``: ``true``
    anywhere, ``auto`` on CUDA only (:func:`compiled`)."""
    return setting is True or setting == "blocks" or (setting == "auto"
                                                       and device.type == "cuda")


def compiled(fn: Callable[..., Any], setting: bool | str,
             device: torch.device) -> Callable[..., Any]:
    """``fn`` (a model or a function of tensors) as the step runs it under ``train.compile``:
    ``False`` eager; ``True`` through ``torch.compile``; ``auto`` (the default) compiled on
    CUDA, where it pays for its compilation within minutes, and eager on the CPU, where a
    few-minute study would spend more on compiling than it saves (BENCHMARKS.md). Under
    ``auto`` a model that fails to compile is run eagerly after a warning that names the
    error: compilation changes speed, not results (the eager and compiled paths agree to
    rounding; tests/test_cuda.py), so a run is not lost to it. Under ``true`` it fails."""
    if not compiles(setting, device):
        return fn
    if setting == "blocks":
        target = getattr(fn, "module", fn)  # DDP's wrapped model
        blocks = getattr(target, "blocks", None)
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks):
            # Dynamo keeps a few graphs per code object (recompile_limit, 8) and runs the
            # rest eagerly without a word; every block shares Block.forward's code, and a
            # block's layer index is a constant of its graph, so each block needs its own,
            # twice: training, and validation (eval mode, no gradients)
            dynamo, need = torch._dynamo.config, 2 * len(blocks) + 8
            for name in ("recompile_limit", "cache_size_limit"):
                if getattr(dynamo, name, None) is not None and getattr(dynamo, name) < need:
                    setattr(dynamo, name, need)
            for block in blocks:  # in place: the model (and FSDP2's hooks around it) stay
                block.compile()
            return fn
        setting = True  # not a decoder (stacked seeds' function): compiled whole
    graph = torch.compile(fn)
    if setting is True:
        return graph
    state: dict[str, Any] = {"run": None}

    def first_tries_compiled(*args: Any, **kwargs: Any) -> Any:
        run = state["run"]
        if run is not None:
            return run(*args, **kwargs)
        try:
            out = graph(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # not the model's own errors
            warnings.warn(f"train.compile=auto: torch.compile failed ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                          "training eagerly (set train.compile=false to skip the attempt)",
                          stacklevel=2)
            state["run"] = fn
            return fn(*args, **kwargs)
        state["run"] = graph
        return out

    return first_tries_compiled


def fused_kernel(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused Adam/AdamW kernel can take ``params`` (floating point, on the CPU
    or a CUDA device): one vectorised pass per tensor instead of a dozen element-wise ops, the
    same update to rounding. The trainer's optimizers use it where it can (torch's default on
    the CPU is a Python loop over the tensors; ``benchmarks/optimizer_kernel.py``)."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                                for p in params)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, which is what a SLURM allocation
    (cgroup cpuset), ``taskset`` or a container's CPU set allows, else ``os.cpu_count()`` (the
    machine's, which on a shared cluster node can be many times the allocation)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return max(1, os.cpu_count() or 1)


#: glibc's ``mallopt`` parameter for the mmap threshold (malloc.h's ``M_MMAP_THRESHOLD``)
_M_MMAP_THRESHOLD = -3
#: The threshold :func:`return_freed_activations` sets: an activation of a CPU run above
#: 1 MiB gets its own mapping, returned to the system when the tensor is freed.
ACTIVATION_MMAP_BYTES = 1 << 20


def return_freed_activations(device: torch.device) -> bool:
    """On the CPU under glibc, map each allocation above :data:`ACTIVATION_MMAP_BYTES` on its
    own (``mallopt(M_MMAP_THRESHOLD)``) so that memory freed by activation checkpointing
    leaves the process. By default glibc raises its threshold up to 32 MB as large blocks are
    freed, serves activations from its heap, and keeps the heap's freed space resident between
    the block inputs checkpointing keeps: the resident set then stays near the memory of a run
    without checkpointing (BENCHMARKS.md, "Activation checkpointing"). Returns whether the
    threshold was set (not on CUDA, not without glibc); it holds for the rest of the process."""
    if device.type != "cpu" or not os.path.exists("/proc/self/maps"):
        return False
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, ACTIVATION_MMAP_BYTES))
