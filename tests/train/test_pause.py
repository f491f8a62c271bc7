"""Pausing a run at a step (``until``): what the learning-rate profile's halving rule does to
its grid points (modbench.study.stages.profile). A paused run resumes to exactly the run that
never paused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modbench.errors import ModbenchError
from modbench.runtime.checkpoint import load_checkpoint
from modbench.runtime.runfolder import CHECKPOINT
from modbench.train.trainer import train, train_seeds
from tests.helpers import read_metrics
from tests.train.test_cluster_survival import assert_same_run, cfg_of


def test_a_run_paused_at_a_validation_resumes_to_the_unpaused_run(tmp_path: Path) -> None:
    cfg = cfg_of()  # 8 steps, validation every 4
    paused = train(cfg, tmp_path / "cut", progress=False, until=4)
    assert paused["status"] == "paused" and paused["steps"] == 4
    assert paused["val_loss"] == next(r["val_loss"] for r in read_metrics(tmp_path / "cut")
                                      if r["kind"] == "val" and r["step"] == 4)
    assert not (tmp_path / "cut" / "summary.json").exists()  # still a run to resume
    assert load_checkpoint(tmp_path / "cut" / CHECKPOINT)["step"] == 4
    again = train(cfg, tmp_path / "cut", resume=True, progress=False, until=4)
    assert again["status"] == "paused" and again["steps"] == 4  # nothing trained twice
    assert [r["step"] for r in read_metrics(tmp_path / "cut") if r["kind"] == "train"] == [
        1, 2, 3, 4]
    done = train(cfg, tmp_path / "cut", resume=True, progress=False)
    assert done["status"] == "completed" and done["steps"] == 8
    train(cfg, tmp_path / "whole", progress=False)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")


def test_a_pause_between_validations_validates_there_and_changes_no_step(
        tmp_path: Path) -> None:
    cfg = cfg_of()
    paused = train(cfg, tmp_path / "cut", progress=False, until=3)
    assert paused["status"] == "paused" and paused["steps"] == 3
    vals = [r["step"] for r in read_metrics(tmp_path / "cut") if r["kind"] == "val"]
    assert vals == [0, 3]  # the pause's own validation
    train(cfg, tmp_path / "cut", resume=True, progress=False)
    train(cfg, tmp_path / "whole", progress=False)
    a = json.loads((tmp_path / "whole" / "summary.json").read_text())
    b = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert a["batches_sha256"] == b["batches_sha256"]
    assert a["final_val_loss"] == b["final_val_loss"]
    wa = load_checkpoint(tmp_path / "whole" / CHECKPOINT)["model"]
    wb = load_checkpoint(tmp_path / "cut" / CHECKPOINT)["model"]
    assert all(torch.equal(w, wb[k]) for k, w in wa.items())


def test_stacked_seeds_pause_together_and_resume(tmp_path: Path) -> None:
    cfg = cfg_of()
    outs = [tmp_path / "s0", tmp_path / "s1"]
    paused = train_seeds(cfg, [0, 1], outs, progress=False, until=4)
    assert [p["status"] for p in paused] == ["paused", "paused"]
    assert [p["seed"] for p in paused] == [0, 1]
    done = train_seeds(cfg, [0, 1], outs, resume=True, progress=False)
    assert [d["status"] for d in done] == ["completed", "completed"]
    whole = train_seeds(cfg, [0, 1], [tmp_path / "w0", tmp_path / "w1"], progress=False)
    assert [d["final_val_loss"] for d in done] == [w["final_val_loss"] for w in whole]


def test_until_past_the_end_trains_the_whole_run(tmp_path: Path) -> None:
    summary = train(cfg_of(), tmp_path / "run", progress=False, until=100)
    assert summary["status"] == "completed" and summary["steps"] == 8
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.parametrize("until", [0, -3, 2.5, True])
def test_a_bad_pause_step_is_one_line(tmp_path: Path, until: object) -> None:
    with pytest.raises(ModbenchError, match="cannot pause a run at step"):
        train(cfg_of(), tmp_path / "run", progress=False, until=until)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()
