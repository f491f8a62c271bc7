"""Options of the study executors (``modbench study run --executor local|ray|slurm``): the
resources each job asks for and the cluster settings, checked before anything starts.

A *job* is one run, or a method's seeds stacked in one process (``--ensembles``); resources are
per job. ``gpus_per_run`` > 1 makes each run one ``torchrun`` group of that many processes on
one node (:func:`modbench.train.distributed.launch`), which never stacks seeds.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from modbench.errors import ModbenchError, suggest

EXECUTOR_NAMES = ("local", "ray", "slurm")
CLUSTER_EXTRA = "pip install 'modbench[cluster]'"

#: Ray: how often a task whose worker process died (killed, out of memory, its node lost) is
#: run again before its unfinished runs are recorded as failed.
RAY_MAX_RETRIES = 3
#: SLURM defaults: a day per job (a longer run times out and is requeued from its last
#: checkpoint, at most ``slurm_max_timeouts`` times), submitit's array parallelism.
SLURM_TIME_MIN = 24 * 60
SLURM_ARRAY_PARALLELISM = 256
SLURM_MAX_TIMEOUTS = 30
#: CPUs per GPU when ``--cpus-per-run`` is left out (1 for a job without GPUs).
CPUS_PER_GPU = 4


@dataclass(frozen=True)
class ExecutorOptions:
    """What ``modbench study run`` passes to the executors (None: the executor's default)."""

    gpus_per_run: int | None = None
    cpus_per_run: int | None = None
    ray_address: str | None = None
    slurm_partition: str | None = None
    slurm_time: int | None = None  # minutes
    slurm_account: str | None = None
    slurm_qos: str | None = None
    slurm_constraint: str | None = None
    slurm_mem_gb: float | None = None
    slurm_array_parallelism: int | None = None
    slurm_setup: tuple[str, ...] = ()
    slurm_folder: str | None = None
    slurm_max_timeouts: int | None = None
    slurm_extra: tuple[str, ...] = ()  # KEY=VALUE sbatch parameters

    def slurm_given(self) -> list[str]:
        """The ``--slurm-*`` options that were set."""
        return [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(self)
                if f.name.startswith("slurm_") and getattr(self, f.name) not in (None, ())]


def check_options(executor: str, opts: ExecutorOptions, workers: int | None) -> None:
    """Refuse options that do not apply to ``executor`` or are out of range, in one line."""
    if executor not in EXECUTOR_NAMES:
        raise ModbenchError(f"unknown executor '{executor}'{suggest(executor, EXECUTOR_NAMES)}; "
                            f"use one of {', '.join(EXECUTOR_NAMES)}")
    if opts.gpus_per_run is not None and opts.gpus_per_run < 0:
        raise ModbenchError(f"--gpus-per-run must be 0 or more, got {opts.gpus_per_run}")
    if opts.cpus_per_run is not None and opts.cpus_per_run < 1:
        raise ModbenchError(f"--cpus-per-run must be at least 1, got {opts.cpus_per_run}")
    for name in ("slurm_time", "slurm_array_parallelism"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise ModbenchError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if opts.slurm_max_timeouts is not None and opts.slurm_max_timeouts < 0:
        raise ModbenchError(f"--slurm-max-timeouts must be 0 or more, got "
                            f"{opts.slurm_max_timeouts}")
    if opts.slurm_mem_gb is not None and opts.slurm_mem_gb <= 0:
        raise ModbenchError(f"--slurm-mem-gb must be positive, got {opts.slurm_mem_gb}")
    slurm_extra(opts)  # KEY=VALUE items
    given = opts.slurm_given()
    if given and executor != "slurm":
        raise ModbenchError(f"{', '.join(given)}: SLURM options, for --executor slurm only "
                            f"(got --executor {executor})")
    if opts.ray_address is not None and executor != "ray":
        raise ModbenchError(f"--ray-address only applies to --executor ray (got --executor "
                            f"{executor})")
    if executor == "local":
        if opts.cpus_per_run is not None:
            raise ModbenchError("--cpus-per-run applies to --executor ray or slurm; the local "
                                "executor shares this machine's cores among --workers")
        if (opts.gpus_per_run or 0) > 1 and workers not in (None, 1):
            raise ModbenchError(f"--gpus-per-run {opts.gpus_per_run} runs each run on "
                                f"{opts.gpus_per_run} GPUs of this machine: use --workers 1 "
                                f"(got {workers})")
    elif workers not in (None, 1):
        raise ModbenchError(f"--workers applies to --executor local; the {executor} executor "
                            "runs as many jobs at once as the cluster has room for")


def slurm_extra(opts: ExecutorOptions) -> dict[str, str]:
    """``--slurm-extra KEY=VALUE`` items as sbatch parameters (``mail-user``: ``--mail-user``)."""
    out: dict[str, str] = {}
    for item in opts.slurm_extra:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ModbenchError(f"--slurm-extra takes KEY=VALUE (an sbatch option without its "
                                f"dashes, e.g. mail-type=END), got {item!r}")
        out[key.strip().lstrip("-")] = value.strip()
    return out


def gpus_for(executor: str, opts: ExecutorOptions, cluster_has_gpus: bool) -> int:
    """GPUs per job: as given, else 1 on SLURM and on a Ray cluster with GPUs, else 0."""
    if opts.gpus_per_run is not None:
        return opts.gpus_per_run
    return 1 if executor == "slurm" or cluster_has_gpus else 0


def cpus_for(opts: ExecutorOptions, gpus: int) -> int:
    """CPUs per job: as given, else :data:`CPUS_PER_GPU` per GPU (1 without GPUs)."""
    if opts.cpus_per_run is not None:
        return opts.cpus_per_run
    return CPUS_PER_GPU * gpus if gpus else 1


def nproc_for(gpus: int | None) -> int:
    """Processes per run: one per GPU when a run gets several (a torchrun group), else 1."""
    return gpus if gpus is not None and gpus > 1 else 1


def require(module: str, executor: str) -> ModuleType:
    """Import ``ray`` or ``submitit``, or say in one line how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ModbenchError(f"--executor {executor} needs the {module} package, which is not "
                            f"installed ({e.__class__.__name__}); run `{CLUSTER_EXTRA}`") from e


def one_line(text: Any, limit: int = 300) -> str:
    """The last non-empty line of an error text (a traceback's is the exception), shortened."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
