"""A study as stages (modbench.study.stages): the runner, the dry run, ``study status`` and
the report ask the registered stages, so a new kind of stage is one class and one
``register`` line. Runs here are finished by a recording executor with a made-up loss (no
training): what is tested is which runs each stage asks for, where, and what it adds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import modbench.study.runner as runner
from modbench.analysis.results import StudyResults
from modbench.cli import run_cli
from modbench.report.blocks import Block
from modbench.study import stages
from modbench.study.costs import StagePlan, Throughput
from modbench.study.plan import format_plan, plan_study
from modbench.study.reporting import write_study_report
from modbench.study.results import load_rows
from modbench.study.spec import RunSpec, StudySpec, load_spec, run_spec
from modbench.study.stages import Session, Stage, StatusPart
from tests.helpers import RecordingExecutor


def loss_of(method: str, seed: int) -> float:
    """A made-up final validation loss: the method's offset plus a seed's noise."""
    return 4.0 + {"baseline": 0.0, "qknorm": -0.3}.get(method, 0.0) + 0.01 * ((seed * 7) % 5)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> RecordingExecutor:
    return RecordingExecutor(lambda folder, method, seed: loss_of(method, seed)).install(
        monkeypatch)


def spec_file(tmp_path: Path, **extra: Any) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({
        "name": "stages", "baseline": "baseline", "methods": ["qknorm"],
        "seeds": {"default": [0, 1], "noise_floor": [0, 1, 2], "anchors": []},
        "scales": ["tiny"], "overrides": ["train.steps=4"], "evaluation": {"probes": False},
        **extra}))
    return path


class ExtraStage(Stage):
    """This test's own stage: the baseline's seed 9 again, in ``STUDY/extra/``, a file that
    says what it found, a dry-run row, a status listing and a report section."""

    name = "extra"

    @classmethod
    def applies(cls, spec: StudySpec, out: Path, settings: stages.RunSettings) -> bool:
        return spec.name == "stages"

    @property
    def folder(self) -> Path:
        return self.out / "extra"

    def runs(self) -> list[RunSpec]:
        return [run_spec(self.spec, "tiny", self.spec.baseline, 9)]

    def run(self, session: Session) -> None:
        session.execute(self.spec, self.folder, self.runs())
        losses = [r.val_loss for r in load_rows(self.folder)]
        (self.folder / "extra.json").write_text(json.dumps({"losses": losses}))

    def plan(self, rate: Throughput | None) -> StagePlan:
        return StagePlan(self.name, self.folder, 1, 0, 1.0, "the baseline's seed 9 again")

    def status(self) -> list[StatusPart]:
        return [StatusPart(self.folder, lines=["  extra: the baseline once more"])]

    def report(self, results: StudyResults, out: Path) -> list[Block]:
        found = json.loads((self.folder / "extra.json").read_text())["losses"]
        return [Block("h2", "Extra stage"), Block("p", f"seed 9 of {results.baseline}: "
                                                       f"{found[0]:.3f}")]


@pytest.fixture
def extra_stage(monkeypatch: pytest.MonkeyPatch) -> type[Stage]:
    """ExtraStage registered after the built-in stages, for this test only."""
    from modbench.study.stages import base

    monkeypatch.setattr(base, "_KINDS", list(base._KINDS))
    return stages.register(ExtraStage)


def test_the_stages_run_in_their_registered_order() -> None:
    assert [k.name for k in stages.kinds()] == [
        "frozen", "sequential", "tuning", "tuned", "lr_profile", "replication"]
    spec = load_spec("smoke-tiny")
    assert [s.name for s in stages.stages_for(spec, Path("nowhere"))] == ["frozen"]
    seq = stages.stages_for(spec, Path("nowhere"), stages.RunSettings(until_decided=4))
    assert [s.name for s in seq] == ["frozen", "sequential"]
    with pytest.raises(ValueError, match="a name of its own"):
        stages.register(type("Again", (Stage,), {"name": "frozen"}))


def test_a_new_stage_is_one_class_and_one_line(tmp_path: Path, recorder: RecordingExecutor,
                                               extra_stage: type[Stage],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The toy stage runs after the study's own through the same executor (one made, closed
    once), the dry run lists it, status lists its folder and lines, the report has its
    section: no module outside the stage knows of it."""
    spec = load_spec(spec_file(tmp_path))
    out = tmp_path / "study"
    plan = plan_study(spec, out)
    assert [p.name for p in plan.stages] == ["extra"]
    assert f"then stage extra -> {out / 'extra'}: 1 of 1 runs to train" in format_plan(plan)
    counts = runner.run_study(spec, out, progress=False)
    frozen = [("study", "baseline", s) for s in (0, 1, 2)] + [("study", "qknorm", s)
                                                             for s in (0, 1)]
    assert recorder.waves == [frozen, [("extra", "baseline", 9)]]
    assert recorder.made == recorder.closed == 1  # one executor runs every stage
    assert counts["total"] == 6 and counts["trained"] == 6
    assert json.loads((out / "extra" / "extra.json").read_text()) == {
        "losses": [loss_of("baseline", 9)]}
    assert (out / "extra" / "spec.yaml").is_file()
    assert run_cli(["study", "status", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"{out}: 5 runs" in shown and f"{out / 'extra'}: 1 runs" in shown
    assert shown.rstrip().endswith("extra: the baseline once more")
    md = (write_study_report(out) / "report.md").read_text()
    assert f"## Extra stage\n\nseed 9 of baseline: {loss_of('baseline', 9):.3f}" in md
    # done: a second run trains nothing, in either folder
    again = runner.run_study(spec, out, progress=False)
    assert again["already_done"] == 6 and again["trained"] == 0


def test_a_refused_stage_leaves_no_folder_of_its_own(tmp_path: Path, recorder: RecordingExecutor,
                                                     extra_stage: type[Stage],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that fails before any of its runs started: its fresh folder is removed, the
    study's own (with its runs) kept."""
    from modbench.errors import ModbenchError

    def refuse(self: ExtraStage, session: Session) -> None:
        session.store(self.spec, self.folder)  # type: ignore[attr-defined]
        raise ModbenchError("refused")

    monkeypatch.setattr(ExtraStage, "run", refuse)
    out = tmp_path / "study"
    with pytest.raises(ModbenchError, match="refused"):
        runner.run_study(load_spec(spec_file(tmp_path)), out, progress=False)
    assert not (out / "extra").exists() and len(load_rows(out)) == 5


def test_the_sequential_stage_plans_an_upper_bound_and_says_its_looks(
        tmp_path: Path, recorder: RecordingExecutor, capsys: pytest.CaptureFixture[str]) -> None:
    spec = load_spec(spec_file(tmp_path))
    out = tmp_path / "study"
    assert plan_study(spec, out).stages == []  # without --until-decided: no such stage
    row = plan_study(spec, out, until_decided=4).stages[0]
    # up to 4 seeds per group: the baseline has 3, qknorm 2
    assert (row.name, row.runs, row.upper_bound, row.known) == ("sequential", 1 + 2, True, False)
    text = format_plan(plan_study(spec, out, until_decided=4))
    assert "then stage sequential" in text and "at most" in text
    assert run_cli(["study", "run", str(tmp_path / "spec.yaml"), "--out", str(out),
                    "--dry-run", "--until-decided", "4"]) == 0
    assert "then stage sequential" in capsys.readouterr().out
    counts = runner.run_study(spec, out, until_decided=4, progress=False)
    assert counts["added_seeds"] == sum(len(w) for w in recorder.waves[1:])
    assert run_cli(["study", "status", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "sequential tiny: " in shown and "(--until-decided 4, obrien_fleming" in shown
