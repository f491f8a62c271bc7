"""What a stage of a study is, and the registry of stage kinds.

A study runs as a sequence of stages, each one small object that knows its part of the study:
which runs it trains (:meth:`Stage.runs`), how it runs them through the study's executor and
judges them (:meth:`Stage.run`, given a :class:`Session`), what the dry run says of it
(:meth:`Stage.plan`), what ``modbench study status`` lists of it (:meth:`Stage.status`) and
what it adds to the report (:meth:`Stage.report`). The runner (:func:`modbench.study.runner.
run_study`), the dry run (:func:`modbench.study.plan.plan_study`), ``study status`` and the
report (:func:`modbench.study.reporting.write_study_report`) ask the stages
(:func:`stages_for`); none of them branches on a kind of study.

Adding a stage: a module with a :class:`Stage` subclass (its ``name``, and its ``order`` among
the stages) and ``register(MyStage)`` at its end, imported in :mod:`modbench.study.stages`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from modbench.study.costs import StagePlan, Throughput
from modbench.study.spec import RunSpec, StudySpec

if TYPE_CHECKING:
    from modbench.analysis.results import StudyResults
    from modbench.report.blocks import Block


@dataclass(frozen=True)
class RunSettings:
    """What ``modbench study run`` was given that decides which stages a study has:
    ``--until-decided`` (None: off), ``--spending`` and ``--futility`` (the conditional power
    below which a look stops a method; None: off). ``runs``: the study's own runs in place
    of its spec's (None: :func:`modbench.study.spec.expand`). ``replicate`` and ``only``:
    ``modbench study replicate``'s changes, and the stages it runs."""

    until_decided: int | None = None
    spending: str = "obrien_fleming"
    runs: list[RunSpec] | None = None
    #: ``--futility``: the conditional power below which a look stops a method (None: never)
    futility: float | None = None
    #: ``modbench study replicate --change``: the changes to replicate the study under
    replicate: tuple[str, ...] = ()
    #: the stages to run (None: every stage the study has), e.g. ``("replication",)``
    only: tuple[str, ...] | None = None


class Session(Protocol):
    """What a stage runs its runs through (the runner's, one for the whole study): ``execute``
    registers ``runs`` in ``folder``'s results store (made, with ``spec`` written as its
    ``spec.yaml``, on first use) and trains what is not done through the study's executor,
    adding to ``counts``; with ``until``, only to that step (the runs pause there,
    checkpointed, and stay pending: a later call goes on from there)."""

    counts: dict[str, Any]

    def execute(self, spec: StudySpec, folder: Path, runs: list[RunSpec],
                until: int | None = None) -> None: ...


@dataclass
class StatusPart:
    """A part of ``modbench study status``: a study folder whose runs are listed (with each
    run's value of the config ``key``, if any), and lines said after them."""

    folder: Path | None = None
    key: str | None = None
    lines: list[str] = field(default_factory=list)


class Stage:
    """One stage of the study ``spec`` in the study folder ``out``; see the module's
    docstring. Subclasses set :attr:`name` and override what they do."""

    name: ClassVar[str] = ""
    #: where it runs among the stages (lower first; a tie: the earlier registered)
    order: ClassVar[float] = 100.0

    def __init__(self, spec: StudySpec, out: Path, settings: RunSettings) -> None:
        self.spec, self.out, self.settings = spec, Path(out), settings

    @classmethod
    def applies(cls, spec: StudySpec, out: Path, settings: RunSettings) -> bool:
        """Whether a study of ``spec`` in ``out``, run with ``settings``, has this stage (for
        ``status`` and the report, ``settings`` are the defaults and the stage may look at what
        the folder holds)."""
        return True

    @property
    def folder(self) -> Path:
        """The study folder this stage's runs live in."""
        return self.out

    def check(self) -> None:
        """Refuse, in one line, what this stage cannot run, before anything is written."""

    def runs(self) -> list[RunSpec] | None:
        """The runs this stage trains, as far as they are known now (None: chosen only when
        an earlier stage has finished, or as the stage goes)."""
        return None

    def run(self, session: Session) -> None:
        """Train this stage's runs through ``session`` and write what it judges of them."""
        raise NotImplementedError

    def plan(self, rate: Throughput | None) -> StagePlan | None:
        """The dry run's row for this stage (None: nothing to say); ``rate``: the GPU's
        throughput (None on the CPU)."""
        return None

    def status(self) -> list[StatusPart]:
        """What ``modbench study status`` shows of this stage."""
        return []

    def report(self, results: StudyResults, out: Path) -> list[Block]:
        """This stage's section of the report (figures into ``out``)."""
        return []

    def folder_status(self, key: str | None = None) -> list[StatusPart]:
        """:meth:`status` of a stage that lists its own folder's runs (with each run's value
        of ``key``), once the folder has a results index."""
        if not (self.folder / "index.sqlite").is_file():
            return []
        return [StatusPart(self.folder, key)]


_KINDS: list[type[Stage]] = []


def register(kind: type[Stage]) -> type[Stage]:
    """Add a stage kind; the stages run by their :attr:`Stage.order`."""
    if not kind.name or any(k.name == kind.name for k in _KINDS):
        raise ValueError(f"a stage kind needs a name of its own, got {kind.name!r}")
    _KINDS.append(kind)
    return kind


def kinds() -> list[type[Stage]]:
    """The registered stage kinds, in the order they run."""
    return sorted(_KINDS, key=lambda k: k.order)


def stages_for(spec: StudySpec, out: str | Path, settings: RunSettings | None = None
               ) -> list[Stage]:
    """The stages of a study of ``spec`` in ``out`` run with ``settings`` (default: as
    ``status`` and the report see a study: from its spec and folder)."""
    settings = settings or RunSettings()
    return [k(spec, Path(out), settings) for k in kinds()
            if (settings.only is None or k.name in settings.only)
            and k.applies(spec, Path(out), settings)]


def hours(flops: float, rate: Throughput | None) -> float | None:
    """GPU-hours of ``flops`` at ``rate`` (None on the CPU)."""
    return flops / rate.flops_per_s / 3600 if rate is not None else None
