"""Trainer defects the kill tests found, one test each, with the defect and its fix in the
docstring. All five are fixed in the trainer (checkpoints carry last_val_loss and grad
norms, stacked members keep prev.pt, --resume without a checkpoint starts afresh, stacked
members with no common checkpoint all start afresh); these are regression tests now."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tests.helpers import tiny
from tests.reliability.checks import (
    checkpoint_differences,
    checkpoint_step,
    run_child,
    strip_metrics,
    strip_summary,
)
from tests.reliability.harness import ensemble_child
from tests.reliability.test_ensemble_kills import SEEDS, ensemble_config

from modbench.cli import run_cli
from modbench.runtime.callback import Callback


class Crash(Callback):
    """A crash right after optimizer step ``after`` is logged (nothing else is saved)."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_step_end(self, run: Any, step: int, record: dict[str, Any]) -> None:
        if step + 1 == self.after:
            raise RuntimeError("killed")


class CrashAtTheEnd(Callback):
    """A crash after the final checkpoint, before summary.json is written."""

    def on_train_end(self, run: Any, summary: dict[str, Any]) -> None:
        raise RuntimeError("killed")


def test_a_resumed_run_keeps_its_last_grad_norms(tmp_path: Path) -> None:
    """Defect (fixed): Progress.grad_norms (the divergence signature, the summary's
    last_grad_norms) was not saved in the checkpoint; after a resume at step 15 of 20 the
    summary listed steps 16..20 instead of 11..20, and a run that diverged soon after a
    resume lost its signature. Fix: the checkpoint carries ``grad_norms`` and ``_resume``
    restores them."""
    from modbench.train.trainer import train

    cfg = lambda: tiny("baseline", 0, 20, "train.checkpoint_every=5")  # noqa: E731
    full = train(cfg(), tmp_path / "full", progress=False)
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), tmp_path / "cut", callbacks=[Crash(17)], progress=False)
    resumed = train(cfg(), tmp_path / "cut", resume=True, progress=False)
    assert resumed["last_grad_norms"] == full["last_grad_norms"]


def test_a_resume_from_the_final_checkpoint_keeps_metrics_jsonl(tmp_path: Path) -> None:
    """Defect (fixed): killed after the final checkpoint but before summary.json, a resume
    started at step == train.steps, ran no step, then validated and checkpointed again:
    metrics.jsonl got its final val record twice (and the report's "still falling" check
    compared the final loss with itself). Fix: the checkpoint carries ``last_val_loss``; a
    resume at the final step goes straight to the summary."""
    from modbench.train.trainer import train

    cfg = lambda: tiny("baseline", 0, 8, "train.checkpoint_every=4")  # noqa: E731
    train(cfg(), tmp_path / "full", progress=False)
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), tmp_path / "cut", callbacks=[CrashAtTheEnd()], progress=False)
    assert checkpoint_step(tmp_path / "cut") == 8
    train(cfg(), tmp_path / "cut", resume=True, progress=False)
    assert strip_metrics(tmp_path / "cut") == strip_metrics(tmp_path / "full")


def test_a_run_killed_before_its_first_checkpoint_resumes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect (fixed): `modbench train --out R` killed before its first checkpoint (with
    the presets' default train.checkpoint_every=0, anywhere before the end) left R with
    config.yaml and metrics.jsonl; `--resume` answered "R has no checkpoints/last.pt; run
    without --resume", and without it "R already exists ...; use --resume": the user had to
    delete R by hand. Fix: --resume on a folder with its config.yaml and no checkpoint starts
    the run afresh in it (metrics.jsonl emptied), as the study runner already did."""
    from modbench.train.trainer import train

    train(tiny("baseline", 0, 6), tmp_path / "full", progress=False)
    with pytest.raises(RuntimeError, match="killed"):
        train(tiny("baseline", 0, 6), tmp_path / "cut", callbacks=[Crash(3)], progress=False)
    assert (tmp_path / "cut" / "config.yaml").is_file()
    argv = ["train", "--out", str(tmp_path / "cut"), "--no-progress"]
    assert run_cli(argv) == 2  # "already exists ... use --resume"
    capsys.readouterr()
    assert run_cli([*argv, "--resume"]) == 0, capsys.readouterr().err
    assert strip_metrics(tmp_path / "cut") == strip_metrics(tmp_path / "full")


def _kill_and_resume_stacked(forkserver: Any, tmp_path: Path, n: int,
                             steps: list[int | None]) -> tuple[Path, Path]:
    """Train the stacked seeds uninterrupted into ``ref``; kill a second stacked run right
    after its ``n``-th checkpoint is in place, check the members' checkpoint ``steps``, resume
    it stacked, and check every member's checkpoint equals the uninterrupted one's. Returns
    (ref, cut)."""
    cfg = ensemble_config()
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    outs = lambda d: [str(d / f"s{s}") for s in SEEDS]  # noqa: E731
    assert run_child(forkserver, ensemble_child, (cfg, SEEDS, outs(ref), False, None,
                                                  None)) == 0
    kill = {"kind": "ckpt_renamed", "n": n}
    assert run_child(forkserver, ensemble_child, (cfg, SEEDS, outs(cut), False, kill,
                                                  None)) == -9
    assert [checkpoint_step(Path(o)) for o in outs(cut)] == steps
    report = tmp_path / "resume.json"
    code = run_child(forkserver, ensemble_child, (cfg, SEEDS, outs(cut), True, None,
                                                  str(report)))
    assert code == 0, json.loads(report.read_text())
    for s in SEEDS:
        assert not checkpoint_differences(ref / f"s{s}", cut / f"s{s}")
    return ref, cut


def test_an_ensemble_killed_between_member_checkpoints_resumes_stacked(
        forkserver: Any, tmp_path: Path) -> None:
    """Defect (fixed): the members of a stacked run write their checkpoints one after
    another; a kill between two of them leaves them at different steps (here s0 at step 6,
    s1 and s2 at step 3). `train_seeds(..., resume=True)` refused ("cannot resume these seeds
    together ... resume each on its own"), and members resumed one by one match the stacked
    run only to ~1e-5, not bit for bit. Fix: stacked members keep their previous checkpoint
    (prev.pt) and resume from the newest step they all have."""
    ref, cut = _kill_and_resume_stacked(forkserver, tmp_path, len(SEEDS) + 1,  # s0's 2nd
                                        [6, 3, 3])
    for s in SEEDS:
        assert strip_summary(ref / f"s{s}")["final_val_loss"] == \
            strip_summary(cut / f"s{s}")["final_val_loss"]


def test_an_ensemble_killed_in_its_first_checkpoint_round_resumes_stacked(
        forkserver: Any, tmp_path: Path) -> None:
    """Defect (fixed): killed after member s0 wrote its first checkpoint (step 3) and before
    s1 and s2 wrote theirs, a stacked resume was refused ("cannot resume these seeds
    together: they stand at steps [0, 3]"): s0 had no earlier checkpoint to go back to. Fix:
    ``_resume_points`` counts "no checkpoint" as step 0, which every member has; when the
    members share no checkpointed step all start afresh (s0's stale checkpoint removed)."""
    _kill_and_resume_stacked(forkserver, tmp_path, 1,  # s0's first, before s1's
                             [3, None, None])


def test_the_defects_do_not_touch_final_losses_or_weights(tmp_path: Path) -> None:
    """What the defects above leave intact (and the kill tests assert for every kill
    point): a resume from the final checkpoint still ends on the uninterrupted run's final
    loss and weights, bit for bit."""
    from modbench.train.trainer import train

    cfg = lambda: tiny("baseline", 0, 8, "train.checkpoint_every=4")  # noqa: E731
    full = train(cfg(), tmp_path / "full", progress=False)
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), tmp_path / "cut", callbacks=[CrashAtTheEnd()], progress=False)
    resumed = train(cfg(), tmp_path / "cut", resume=True, progress=False)
    assert resumed["final_val_loss"] == full["final_val_loss"]
    assert not checkpoint_differences(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut")
