"""The Ray executor's kind (``modbench study run --executor ray``): its options
(``--ray-address``, ``--gpus-per-run``, ``--cpus-per-run``), their checks, its ``--dry-run``
rows and GPU accounting. The executor itself, every job one Ray task, is
:class:`modbench.study.ray_executor.RayExecutor`, imported (with ray) only when it is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modbench.study.executors.base import ExecutorKind, per_run, register

#: how often a task whose worker process died (killed, out of memory, its node lost) is run
#: again before its unfinished runs are recorded as failed
RAY_MAX_RETRIES = 3


@dataclass(frozen=True)
class RayOptions:
    """``--gpus-per-run`` (None: 1 if the cluster has GPUs, else 0), ``--cpus-per-run`` (None:
    4 per GPU, 1 without), ``--ray-address`` (None: start a local Ray instance)."""

    gpus_per_run: int | None = None
    cpus_per_run: int | None = None
    address: str | None = None


class RayKind(ExecutorKind):
    name = "ray"
    summary = "a local Ray instance, or the cluster at --ray-address"
    options_type = RayOptions
    prefix = "ray_"
    implementation = "modbench.study.ray_executor:RayExecutor"
    requires = "ray"

    def settings(self, opts: RayOptions, out: Path, gpus: int, cpus: int, nproc: int,
                 n_jobs: int) -> list[tuple[str, str]]:
        where = (f"the Ray cluster at {opts.address}" if opts.address
                 else "a local Ray instance started on this machine")
        rows = [("executor", f"ray: {n_jobs} task(s) on {where}; a task whose worker dies is "
                             f"retried up to {RAY_MAX_RETRIES} times"),
                ("per job", f"num_gpus={gpus}, num_cpus={cpus}: {gpus} GPU(s), {cpus} CPU(s), "
                            f"{per_run(nproc)}")]
        if opts.gpus_per_run is None:
            rows.append(("", "(GPUs per job: 1 on a cluster with GPUs, else 0; set "
                             "--gpus-per-run to be sure)"))
        return rows


KIND = register(RayKind())
