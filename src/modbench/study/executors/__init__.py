"""Study executors as a registry: ``modbench study run --executor NAME`` runs the jobs through
the executor registered as NAME. Each executor is one module here that subclasses
:class:`ExecutorKind` (its name, options dataclass, checks, ``--dry-run`` rows and GPU
accounting) and calls :func:`register`; the runner, the planner and the CLI ask :func:`get`.

Adding an executor: a module with an options dataclass, an :class:`ExecutorKind` subclass
whose :meth:`~ExecutorKind.create` returns a :class:`modbench.study.jobs.Executor` (or whose
``implementation`` names one), and ``register(MyKind())`` at its end; then import it below
(a plugin outside modbench registers itself when it is imported). docs/studies.md,
Executors.
"""

from modbench.study.executors import local, ray, slurm
from modbench.study.executors.base import (
    CPUS_PER_GPU,
    ExecutorKind,
    ExecutorOptions,
    get,
    kinds,
    names,
    nproc_for,
    one_line,
    parse_items,
    register,
    require,
    unregister,
)

__all__ = ["CPUS_PER_GPU", "ExecutorKind", "ExecutorOptions", "get", "kinds", "local", "names",
           "nproc_for", "one_line", "parse_items", "ray", "register", "require", "slurm",
           "unregister"]
