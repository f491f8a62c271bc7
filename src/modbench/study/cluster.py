"""The executors' options and checks under their old names: they now live with each executor
(:mod:`modbench.study.executors`: ``base`` for what they share, ``local``, ``ray``,
``slurm`` for each one's options dataclass, checks, dry-run rows and GPU accounting). Kept so
that code written against ``modbench.study.cluster`` still imports; new code asks the
registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modbench.study.executors import get, names
from modbench.study.executors.base import (
    CLUSTER_EXTRA,
    CPUS_PER_GPU,
    ExecutorOptions,
    nproc_for,
    one_line,
    require,
)
from modbench.study.executors.ray import RAY_MAX_RETRIES
from modbench.study.executors.slurm import (
    SLURM_ARRAY_PARALLELISM,
    SLURM_MAX_TIMEOUTS,
    SLURM_TIME_MIN,
)

__all__ = ["CLUSTER_EXTRA", "CPUS_PER_GPU", "RAY_MAX_RETRIES", "SLURM_ARRAY_PARALLELISM",
           "SLURM_MAX_TIMEOUTS", "SLURM_TIME_MIN", "ExecutorOptions", "check_options", "names",
           "nproc_for", "one_line", "require"]


def check_options(executor: str, opts: Mapping[str, Any] | None, workers: int | None) -> Any:
    """The options ``executor``'s kind reads from ``opts`` (and ``--workers``), checked: an
    unknown executor, an option it does not take or one out of range is one line."""
    return get(executor).options(opts, workers)
