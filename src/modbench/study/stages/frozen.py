"""The study's own stage: every method of the spec at every scale on its seeds (the verdict
seeds, and the noise-floor seeds of the baseline and the anchors: :func:`modbench.study.spec.
expand`), trained into the study folder at the recipe's frozen settings. Its verdicts are the
report's main tables, so it adds no section of its own; the dry run lists its jobs in full."""

from __future__ import annotations

from modbench.study.spec import RunSpec, expand
from modbench.study.stages.base import Session, Stage, StatusPart, register


class FrozenStage(Stage):
    name = "frozen"
    order = 0

    def runs(self) -> list[RunSpec]:
        given = self.settings.runs
        return expand(self.spec) if given is None else given

    def run(self, session: Session) -> None:
        runs = self.runs()
        if runs:
            session.execute(self.spec, self.folder, runs)

    def status(self) -> list[StatusPart]:
        return [StatusPart(self.folder)]


register(FrozenStage)
