"""The device a run trains on, its mixed precision and whether its step is compiled."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

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
    anywhere, ``auto`` on CUDA only (:func:`compiled`; on the CPU the trainer turns ``auto``
    into ``try`` or ``false`` by :func:`choose_compile` before this is asked)."""
    return setting in (True, "blocks", "try") or (setting == "auto" and device.type == "cuda")


#: ``train.compile=auto`` on the CPU, measured (BENCHMARKS.md, "train.compile=auto on the
#: CPU", ``benchmarks/compile_auto.py``), in seconds of an idle core: the compiled step's
#: speed-up over the eager one (the lowest measured: cpu-deep 1.11× under load, where the
#: issue measured 1.25–1.37× idle; cpu-small 1.33×), the eager step's floating-point rate per
#: intra-op thread (the built-in study's), and the compilation's cost: cold (an empty
#: inductor cache) a fixed part plus a part per decoder layer of the whole-model graph (fitted
#: on tiny, cpu-small and cpu-deep, 2, 4 and 24 layers, and scaled to cpu-deep's idle
#: 36–39 s), and warm (the graph found in the cache) per process.
CPU_COMPILE_SPEEDUP: Final = 1.1
CPU_EAGER_FLOPS_PER_THREAD: Final = 35.7e9
CPU_COLD_COMPILE_S: Final = 13.5
CPU_COLD_COMPILE_S_PER_LAYER: Final = 1.0
CPU_WARM_COMPILE_S: Final = 4.0
#: The file in the inductor cache folder that lists the graphs a modbench run compiled there
#: (:func:`note_compiled`): a graph listed there compiles warm.
COMPILED_GRAPHS: Final = "modbench-compiled-graphs.txt"


@dataclass(frozen=True)
class CompileChoice:
    """What ``train.compile`` comes to for one run: ``setting`` is what the engine compiles
    with (:func:`compiled`; ``try``: compiled, falling back to eager with a warning), and
    ``why`` says in words how ``auto`` decided (empty where the user's setting decided)."""

    setting: bool | str
    why: str = ""

    @property
    def compiled(self) -> bool:
        return self.setting in (True, "blocks", "try", "auto")


def inductor_cache_dir() -> Path | None:
    """The inductor cache folder this process compiles into (``TORCHINDUCTOR_CACHE_DIR``, a
    study's own: ``modbench.study.runner.share_compile_cache``; else torch's default), None
    where torch cannot say."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return Path(env)
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return Path(cache_dir())
    except (ImportError, AttributeError, OSError):
        return None


def graph_compiled_before(key: str) -> bool:
    """Whether a modbench run noted the graph ``key`` in this process's inductor cache
    (:func:`note_compiled`): then compiling it again loads it warm."""
    folder = inductor_cache_dir()
    try:
        return folder is not None and key in (folder / COMPILED_GRAPHS).read_text(
            encoding="utf-8").split()
    except OSError:
        return False


def note_compiled(key: str) -> None:
    """Note in the inductor cache that graph ``key`` compiled there (one line appended; a
    cache that cannot be written only makes later runs judge it cold)."""
    folder = inductor_cache_dir()
    if folder is None or graph_compiled_before(key):
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / COMPILED_GRAPHS, "a", encoding="utf-8") as f:
            f.write(key + "\n")
    except OSError:
        pass


def choose_compile(setting: bool | str, device: torch.device, *, steps: int,
                   step_flops: float, layers: int, warm: bool,
                   threads: int | None = None) -> CompileChoice:
    """``train.compile`` for a run of ``steps`` optimizer steps of ``step_flops`` training
    FLOPs each (every seed it stacks counted) through a decoder of ``layers`` layers.

    ``auto`` on CUDA compiles (falling back to eager with a warning). ``auto`` on the CPU
    compiles only when the time the compiled step saves over the run, estimated as
    ``steps · step_flops / (threads · CPU_EAGER_FLOPS_PER_THREAD) · (1 − 1 /
    CPU_COMPILE_SPEEDUP)``, beats the compilation's cost: ``CPU_WARM_COMPILE_S`` when the
    graph is in the inductor cache already (``warm``, :func:`graph_compiled_before`), else
    ``CPU_COLD_COMPILE_S + CPU_COLD_COMPILE_S_PER_LAYER · layers``. The estimate uses no
    timing of this run, so the same config in the same cache state decides the same way.
    Other settings are kept."""
    if setting != "auto" or device.type != "cpu":
        return CompileChoice(setting)
    n = max(1, threads if threads is not None else torch.get_num_threads())
    eager_s = steps * step_flops / (n * CPU_EAGER_FLOPS_PER_THREAD)
    saving = eager_s * (1 - 1 / CPU_COMPILE_SPEEDUP)
    cost = (CPU_WARM_COMPILE_S if warm
            else CPU_COLD_COMPILE_S + CPU_COLD_COMPILE_S_PER_LAYER * max(layers, 1))
    state = "warm" if warm else "cold"
    if saving > cost:
        return CompileChoice("try", f"compiled: it saves about {saving:.0f} s of an estimated "
                                    f"{eager_s:.0f} s eager, more than its {state} "
                                    f"compilation (~{cost:.0f} s)")
    return CompileChoice(False, f"eager: compiling would save about {saving:.0f} s of an "
                                f"estimated {eager_s:.0f} s, less than its {state} "
                                f"compilation (~{cost:.0f} s)")


def compiled(fn: Callable[..., Any], setting: bool | str, device: torch.device,
             on_compiled: Callable[[], None] | None = None) -> Callable[..., Any]:
    """``fn`` (a model or a function of tensors) as the step runs it under ``train.compile``:
    ``False`` eager; ``True`` through ``torch.compile``; ``auto`` (the default) compiled on
    CUDA and, on the CPU, where the trainer's :func:`choose_compile` finds the run long
    enough to repay its compilation (it then passes ``try``). Under ``auto`` and ``try`` a
    model that fails to compile is run eagerly after a warning that names the error (once per
    study: :func:`warn_once`): compilation changes speed, not results (the eager and compiled
    paths agree to rounding; tests/test_cuda.py), so a run is not lost to it. Under ``true``
    it fails. ``on_compiled`` is called once, after the first compiled call returns."""
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
            if on_compiled is not None:
                on_compiled()
            return fn
        setting = True  # not a decoder (stacked seeds' function): compiled whole
    graph = torch.compile(fn)
    state: dict[str, Any] = {"run": None}

    def first_tries_compiled(*args: Any, **kwargs: Any) -> Any:
        run = state["run"]
        if run is not None:
            return run(*args, **kwargs)
        try:
            out = graph(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # not the model's own errors
            if setting is True:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            warn_once(f"train.compile={setting}: torch.compile failed ({type(e).__name__}: "
                      f"{first}); training eagerly (set train.compile=false to skip the "
                      "attempt)")
            state["run"] = fn
            return fn(*args, **kwargs)
        state["run"] = graph
        if on_compiled is not None:
            on_compiled()
        return out

    return first_tries_compiled


#: The folder where :func:`warn_once` notes the warnings already given (a study sets it for
#: its workers: ``modbench.study.runner.share_compile_cache``); unset, every warning is given.
WARN_ONCE_ENV: Final = "MODBENCH_WARN_ONCE_DIR"


def warn_once(message: str) -> None:
    """A ``UserWarning`` given once per study, not once per run: with :data:`WARN_ONCE_ENV`
    set, only the first process to note ``message`` there warns (an exclusive create of a file
    named by its hash); without it, every time."""
    folder = os.environ.get(WARN_ONCE_ENV)
    if folder:
        import hashlib

        mark = Path(folder) / hashlib.sha256(message.encode()).hexdigest()[:16]
        try:
            mark.parent.mkdir(parents=True, exist_ok=True)
            with open(mark, "x", encoding="utf-8") as f:
                f.write(message + "\n")
        except FileExistsError:
            return
        except OSError:
            pass  # cannot note it: warn
    warnings.warn(message, stacklevel=3)


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
