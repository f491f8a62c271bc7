"""The SLURM executor's kind (``modbench study run --executor slurm``): its options (the
``--slurm-*`` flags, ``--gpus-per-run``, ``--cpus-per-run``), their checks, its ``--dry-run``
rows (the job array, time limit and requeues, sbatch settings) and GPU accounting (one GPU
per job unless told). The executor itself, job arrays through submitit, is
:class:`modbench.study.slurm_executor.SlurmExecutor`, imported (with submitit) only when it is
made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from modbench.errors import ModbenchError
from modbench.study.executors.base import ExecutorKind, flag, per_run, register

#: a day per job (a longer run times out and is requeued from its last checkpoint, at most
#: ``max_timeouts`` times), submitit's array parallelism
SLURM_TIME_MIN = 24 * 60
SLURM_ARRAY_PARALLELISM = 256
SLURM_MAX_TIMEOUTS = 30


@dataclass(frozen=True)
class SlurmOptions:
    """``--gpus-per-run`` (None: 1), ``--cpus-per-run`` (None: 4 per GPU) and the
    ``--slurm-*`` options without their prefix (None: the default above, or the cluster's)."""

    gpus_per_run: int | None = None
    cpus_per_run: int | None = None
    partition: str | None = None
    time: int | None = None  # minutes
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    mem_gb: float | None = None
    array_parallelism: int | None = None
    setup: tuple[str, ...] = ()
    folder: str | None = None
    max_timeouts: int | None = None
    extra: tuple[str, ...] = ()  # KEY=VALUE sbatch parameters

    @property
    def time_min(self) -> int:
        return self.time or SLURM_TIME_MIN

    @property
    def timeouts_allowed(self) -> int:
        return SLURM_MAX_TIMEOUTS if self.max_timeouts is None else self.max_timeouts


def extra_parameters(opts: SlurmOptions) -> dict[str, str]:
    """``--slurm-extra KEY=VALUE`` items as sbatch parameters (``mail-user``: ``--mail-user``)."""
    out: dict[str, str] = {}
    for item in opts.extra:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ModbenchError(f"--slurm-extra takes KEY=VALUE (an sbatch option without its "
                                f"dashes, e.g. mail-type=END), got {item!r}")
        out[key.strip().lstrip("-")] = value.strip()
    return out


class SlurmKind(ExecutorKind):
    name = "slurm"
    summary = "job arrays through submitit"
    options_type = SlurmOptions
    prefix = "slurm_"
    implementation = "modbench.study.slurm_executor:SlurmExecutor"
    requires = "submitit"
    time_limited = True

    def check(self, opts: SlurmOptions) -> None:
        for name in ("time", "array_parallelism"):
            value = getattr(opts, name)
            if value is not None and value < 1:
                raise ModbenchError(f"{flag(self.prefix + name)} must be at least 1, got {value}")
        if opts.max_timeouts is not None and opts.max_timeouts < 0:
            raise ModbenchError(f"--slurm-max-timeouts must be 0 or more, got "
                                f"{opts.max_timeouts}")
        if opts.mem_gb is not None and opts.mem_gb <= 0:
            raise ModbenchError(f"--slurm-mem-gb must be positive, got {opts.mem_gb}")
        extra_parameters(opts)  # KEY=VALUE items

    def gpus(self, opts: SlurmOptions, cluster_has_gpus: bool = True) -> int:
        """``--gpus-per-run``, else 1: a SLURM job asks for its GPU."""
        return super().gpus(opts, cluster_has_gpus=True)

    def timeouts(self, opts: SlurmOptions, wall_hours: float | None) -> int | None:
        if wall_hours is None:
            return None
        return max(0, math.ceil(wall_hours / (opts.time_min / 60)) - 1)

    def warnings(self, opts: SlurmOptions, timeouts: list[int | None],
                 gpus: int) -> list[str]:
        over = [t or 0 for t in timeouts if (t or 0) > opts.timeouts_allowed]
        out = [f"{len(over)} job(s) need more than --slurm-max-timeouts "
               f"{opts.timeouts_allowed} requeues at --slurm-time {opts.time_min} (the longest "
               f"{max(over)}): raise one of them, or --gpus-per-run"] if over else []
        return out + super().warnings(opts, timeouts, gpus)

    def settings(self, opts: SlurmOptions, out: Path, gpus: int, cpus: int, nproc: int,
                 n_jobs: int) -> list[tuple[str, str]]:
        parallel = opts.array_parallelism or SLURM_ARRAY_PARALLELISM
        sbatch = [("partition", opts.partition or "(cluster default)"),
                  ("account", opts.account or "(default)"),
                  *([("qos", opts.qos)] if opts.qos else []),
                  *([("constraint", opts.constraint)] if opts.constraint else []),
                  *extra_parameters(opts).items()]
        rows = [("executor", f"slurm (submitit): one job array of {n_jobs} task(s), at most "
                             f"{parallel} at once"),
                ("per job", f"1 node, 1 task, {gpus} GPU(s), {cpus} CPU(s), {per_run(nproc)}"
                            + (f", {opts.mem_gb:g} GB memory" if opts.mem_gb else "")),
                ("time limit", f"{opts.time_min} min per job; timed out or preempted, it is "
                               f"requeued and resumes from its last checkpoint (up to "
                               f"{opts.timeouts_allowed} time-outs)"),
                ("sbatch", ", ".join(f"{k}={v}" for k, v in sbatch)),
                ("logs", str(self.folder(opts, out)))]
        return rows + [("setup", line) for line in opts.setup]

    def folder(self, opts: SlurmOptions, root: Path) -> Path:
        """Where submitit's logs and pickles go: ``--slurm-folder``, else ``<study>/slurm``."""
        return Path(opts.folder) if opts.folder else root / "slurm"


KIND = register(SlurmKind())
