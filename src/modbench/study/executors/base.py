"""What every study executor is to the rest of modbench: an :class:`ExecutorKind` registered
under its name (:func:`register`, :func:`get`, :func:`names`), the options a user gave
(:class:`ExecutorOptions`, by their ``modbench study run`` flag names), and the helpers the
kinds share. The runner, the dry-run planner and the CLI ask a kind; none compares names.

A kind owns its name, its options dataclass (which given options it reads, and into which
fields), their checks, its ``--dry-run`` rows and its GPU accounting. The executor it makes
(:class:`modbench.study.jobs.Executor`) runs jobs; a kind whose executor needs an optional
package (ray, submitit) names the module holding it in :attr:`ExecutorKind.implementation`,
imported only when that executor is made, so ``--help`` and ``--dry-run`` need neither.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from modbench.errors import ModbenchError, suggest

if TYPE_CHECKING:
    from modbench.runtime.gpus import Accelerator
    from modbench.study.jobs import Executor

CLUSTER_EXTRA = "pip install 'modbench[cluster]'"
#: CPUs per GPU when ``--cpus-per-run`` is left out (1 for a job without GPUs).
CPUS_PER_GPU = 4


class ExecutorOptions(Mapping[str, Any]):
    """The executor options a user gave, by their ``modbench study run`` flag names without
    the dashes (``gpus_per_run=8``, ``slurm_partition="gpu"``); an option left out (None, or
    an empty sequence) is not kept. Each kind reads the ones it takes into its own options
    dataclass (:meth:`ExecutorKind.options`) and refuses the others."""

    def __init__(self, values: Mapping[str, Any] | None = None, /, **given: Any) -> None:
        merged = {**(values or {}), **given}
        self._values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in merged.items()
                        if v is not None and v != () and v != []}

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ExecutorOptions({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


def parse_items(items: Iterable[str], given: Mapping[str, Any]) -> dict[str, Any]:
    """``--executor-option KEY=VALUE`` items (KEY a flag name without its dashes, ``-`` or
    ``_`` alike: ``toy-tag=x``) added to ``given``; a key given twice keeps every value (a
    sequence option). Values stay text until the executor's kind reads them."""
    out: dict[str, Any] = dict(given)
    added: dict[str, list[str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ModbenchError(f"--executor-option takes KEY=VALUE (an executor's option "
                                f"without its dashes, e.g. slurm-qos=high), got {item!r}")
        if key in out:
            raise ModbenchError(f"{flag(key)} is given twice (as a flag and as "
                                "--executor-option); give it once")
        added.setdefault(key, []).append(value.strip())
    out.update({k: v[0] if len(v) == 1 else tuple(v) for k, v in added.items()})
    return out


def coerce(key: str, value: Any, hint: Any) -> Any:
    """A text value (``--executor-option``) as the type of the field it sets: ``int``,
    ``float``, ``bool``, ``str``, or a tuple of text; anything else is passed through."""
    if not isinstance(value, str | tuple):
        return value
    options = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(
        hint, types.UnionType) or typing.get_origin(hint) is typing.Union else [hint]
    target = options[0] if options else str
    if typing.get_origin(target) is tuple:
        return (value,) if isinstance(value, str) else value
    if isinstance(value, tuple):
        raise ModbenchError(f"{flag(key)} takes one value, got {len(value)}")
    if target is bool:
        if value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ModbenchError(f"{flag(key)} takes true or false, got {value!r}")
    if target in (int, float):
        try:
            return target(value)
        except ValueError:
            raise ModbenchError(f"{flag(key)} takes a number ({target.__name__}), got "
                                f"{value!r}") from None
    return value


def flag(key: str) -> str:
    """An option's flag: ``slurm_time`` -> ``--slurm-time``."""
    return "--" + key.replace("_", "-")


class ExecutorKind:
    """One executor: subclass it in the executor's module, then :func:`register` an instance.

    ``options_type`` is a dataclass whose fields are the options the kind takes: a given
    option ``prefix + field`` (or ``field`` itself, for the shared ``gpus_per_run``,
    ``cpus_per_run`` and ``workers``) sets that field. The defaults below are a cluster's: one
    GPU per job unless ``--gpus-per-run`` says otherwise, no time limit, no rows of its own."""

    name: ClassVar[str]
    #: a few words for ``--executor``'s help and the docs
    summary: ClassVar[str] = ""
    options_type: ClassVar[type[Any]]
    #: given options ``prefix + field`` are this kind's (``slurm_`` + ``partition``)
    prefix: ClassVar[str] = ""
    #: ``module:Class`` of the executor, imported when it is made (None: :meth:`create`)
    implementation: ClassVar[str | None] = None
    #: the optional package its executor needs (``ray``, ``submitit``): a one-line error
    #: saying how to install it when it is missing
    requires: ClassVar[str | None] = None
    #: whether its jobs have a time limit after which they are requeued (a dry-run column)
    time_limited: ClassVar[bool] = False

    # ------------------------------------------------------------------ options

    def fields(self) -> dict[str, str]:
        """Given option name -> field of :attr:`options_type`."""
        shared = ("gpus_per_run", "cpus_per_run", "workers")
        return {(f.name if f.name in shared else self.prefix + f.name): f.name
                for f in dataclasses.fields(self.options_type)}

    def options(self, given: Mapping[str, Any] | None = None,
                workers: int | None = None) -> Any:
        """``given`` (and ``--workers``) read into :attr:`options_type` and checked; an option
        this kind does not take is refused in one line naming the executors that do."""
        if isinstance(given, self.options_type):
            opts = given
            if workers is not None and workers != getattr(opts, "workers", 1):
                if "workers" not in self.fields():
                    raise ModbenchError(_foreign(self, ["workers"]))
                opts = dataclasses.replace(opts, workers=workers)
        else:
            values = dict(ExecutorOptions(given or {}))
            if workers is not None:
                values["workers"] = workers
            mine = self.fields()
            if "workers" not in mine and values.get("workers") == 1:
                values.pop("workers")  # one worker: what every executor does by default
            foreign = [k for k in values if k not in mine]
            if foreign:
                raise ModbenchError(_foreign(self, foreign))
            hints = typing.get_type_hints(self.options_type)
            opts = self.options_type(**{mine[k]: coerce(k, v, hints[mine[k]])
                                        for k, v in values.items()})
        check_shared(opts)
        self.check(opts)
        return opts

    def check(self, opts: Any) -> None:
        """Refuse options out of range, in one line (the shared ones are checked already)."""

    # ------------------------------------------------------------------ the executor

    def create(self, opts: Any, *, verbose: bool = False) -> Executor:
        """The executor for checked ``opts``: by default :attr:`implementation` (its class
        takes the options and ``verbose``)."""
        if self.implementation is None:
            raise NotImplementedError(f"executor kind {self.name} has no implementation")
        if self.requires is not None:
            require(self.requires, self.name)
        module, _, cls = self.implementation.partition(":")
        made: Executor = getattr(importlib.import_module(module), cls)(opts, verbose=verbose)
        return made

    # ------------------------------------------------------------------ GPU accounting

    def gpus(self, opts: Any, cluster_has_gpus: bool = True) -> int:
        """GPUs per job: ``--gpus-per-run``, else 1 where the cluster has GPUs, else 0."""
        given = getattr(opts, "gpus_per_run", None)
        if given is not None:
            return int(given)
        return 1 if cluster_has_gpus else 0

    def cpus(self, opts: Any, gpus: int) -> int:
        """CPUs per job: ``--cpus-per-run``, else :data:`CPUS_PER_GPU` per GPU (1 without)."""
        given = getattr(opts, "cpus_per_run", None)
        if given is not None:
            return int(given)
        return CPUS_PER_GPU * gpus if gpus else 1

    def ensemble_gpus(self, gpus: int | None) -> int | None:
        """The GPUs per job ``--ensembles auto`` judges by (None: this machine's CUDA)."""
        return gpus

    def stack_memory(self, gpus: int | None) -> int | None:
        """Device memory (bytes) stacked seeds are planned against: on a cluster of one GPU
        per job the catalogue's H100 80 GB (a run's ``train.device_memory_gb`` overrides it);
        None otherwise."""
        if gpus != 1:
            return None
        from modbench.runtime.gpus import lookup

        return lookup("h100-80gb").memory_bytes

    def memory_gpu(self, gpus: int | None, gpu_type: str | None = None) -> Accelerator | None:
        """The GPU each job's memory plan is checked against (:mod:`modbench.study.fits`)
        where a job gets ``gpus`` GPUs: ``gpu_type`` (``--gpu-type``: H100, H200, A100,
        B200), else the H100 80 GB a cluster job is assumed to get (as :meth:`stack_memory`
        assumes); None without GPUs, or for a GPU the catalogue does not know (a
        ``--gpu-tflops`` one): nothing is checked."""
        if not gpus:
            return None
        from modbench.runtime.gpus import lookup
        from modbench.study.costs import DEFAULT_GPU

        try:
            return lookup(gpu_type or DEFAULT_GPU)
        except ModbenchError:
            return None

    # ------------------------------------------------------------------ dry run

    def plan_gpus(self, opts: Any) -> int:
        """GPUs per job as ``--dry-run`` counts them (a cluster is assumed to have GPUs)."""
        return self.gpus(opts, cluster_has_gpus=True)

    def plan_cpus(self, opts: Any, gpus: int) -> int:
        return self.cpus(opts, gpus)

    def settings(self, opts: Any, out: Path, gpus: int, cpus: int, nproc: int,
                 n_jobs: int) -> list[tuple[str, str]]:
        """``--dry-run``'s settings rows (label, text)."""
        return [("executor", f"{self.name}: {n_jobs} job(s)"),
                ("per job", f"{gpus} GPU(s), {cpus} CPU(s), {per_run(nproc)}")]

    def timeouts(self, opts: Any, wall_hours: float | None) -> int | None:
        """Time-limit requeues a job of ``wall_hours`` needs (None: no time limit)."""
        return None

    def warnings(self, opts: Any, timeouts: list[int | None], gpus: int) -> list[str]:
        """``--dry-run``'s warnings for these jobs (their :meth:`timeouts`)."""
        if not gpus:
            return ["the jobs get no GPU (--gpus-per-run 0): no GPU-hours to estimate"]
        return []


def per_run(nproc: int) -> str:
    """Processes per run, as ``--dry-run`` says it."""
    return f"{nproc} processes (one torchrun group on one node)" if nproc > 1 else "1 process"


def check_shared(opts: Any) -> None:
    """The options every kind may take: ``--gpus-per-run`` 0 or more, ``--cpus-per-run`` and
    ``--workers`` at least 1."""
    gpus, cpus = getattr(opts, "gpus_per_run", None), getattr(opts, "cpus_per_run", None)
    if gpus is not None and gpus < 0:
        raise ModbenchError(f"--gpus-per-run must be 0 or more, got {gpus}")
    if cpus is not None and cpus < 1:
        raise ModbenchError(f"--cpus-per-run must be at least 1, got {cpus}")
    workers = getattr(opts, "workers", None)
    if workers is not None and workers < 1:
        raise ModbenchError(f"--workers must be at least 1, got {workers}")


def _foreign(kind: ExecutorKind, keys: list[str]) -> str:
    """One line: these options are not ``kind``'s; which executors take them."""
    owners = {k: [o.name for o in kinds() if k in o.fields()] for k in keys}
    first = keys[0]
    flags = ", ".join(flag(k) for k in keys if owners[k] == owners[first])
    if not owners[first]:
        return (f"{flag(first)} is no option of any executor; --executor {kind.name} takes "
                f"{', '.join(flag(k) for k in kind.fields()) or 'no options'}")
    return (f"{flags} applies to --executor {' or '.join(owners[first])} only (got "
            f"--executor {kind.name})")


def require(module: str, executor: str) -> ModuleType:
    """Import an executor's optional package (``ray``, ``submitit``), or say in one line how
    to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ModbenchError(f"--executor {executor} needs the {module} package, which is not "
                            f"installed ({e.__class__.__name__}); run `{CLUSTER_EXTRA}`") from e


def nproc_for(gpus: int | None) -> int:
    """Processes per run: one per GPU when a run gets several (a torchrun group), else 1."""
    return gpus if gpus is not None and gpus > 1 else 1


def one_line(text: Any, limit: int = 300) -> str:
    """The last non-empty line of an error text (a traceback's is the exception), shortened."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------- the registry

_KINDS: dict[str, ExecutorKind] = {}


def register(kind: ExecutorKind) -> ExecutorKind:
    """Make ``kind`` an executor of ``modbench study run --executor NAME``; a name taken is
    refused."""
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        raise ModbenchError(f"an executor named '{kind.name}' is registered already")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Forget the executor ``name`` (a test's toy executor)."""
    _KINDS.pop(name, None)


def get(name: str) -> ExecutorKind:
    """The executor kind registered as ``name``, or a one-line error listing them."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ModbenchError(f"unknown executor '{name}'{suggest(name, list(_KINDS))}; use one "
                            f"of {', '.join(_KINDS)}") from None


def names() -> list[str]:
    """The registered executors' names, in registration order."""
    return list(_KINDS)


def kinds() -> list[ExecutorKind]:
    return list(_KINDS.values())
