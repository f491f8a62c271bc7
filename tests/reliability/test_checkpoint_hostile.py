"""Well-formed but wrong run-folder files (modbench.runtime.checkpoint.check_checkpoint,
check_resumable, check_weights, check_optimizer_state): a checkpoint without ``model`` or with
a bad ``step``, a negative or huge ``metrics_offset``, weights or an optimizer state of another
model (a tensor missing, extra, of another shape or kind), a ``metrics.jsonl`` that is a
symbolic link: one line (exit 2) from every reader, naming the first offending tensor, and
nothing truncated, extended or followed."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.helpers import cli, torch_threads

from modbench.cli import run_cli

# the readers run in process (tests.helpers.cli: what `python -m modbench` runs, its exit code
# and its stderr), one torch thread as the child processes had (restored after each test)
pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = ["train", "--preset", "tiny", "--steps", "6", "--checkpoint-every", "3", "--set",
         "train.threads=1", "--set", "train.eval_every=0", "--no-progress"]


def _one_line(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``modbench *args`` must exit 2 with exactly one line on stderr, no traceback."""
    code, _, err = cli(capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "delete" not in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ckpt") / "R"
    with torch_threads():
        assert run_cli([*TRAIN, "--out", str(run)]) == 0
    return run


def _copy(trained: Path, tmp: Path, change: Callable[[dict[str, Any]], None] | None) -> Path:
    run = tmp / "R"
    shutil.copytree(trained, run)
    if change is not None:
        ckpt = run / "checkpoints" / "last.pt"
        state = torch.load(ckpt, weights_only=True)
        change(state)
        torch.save(state, ckpt)
    return run


BAD: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "no-model": (lambda s: s.pop("model"), "no 'model' mapping"),
    "model-not-tensors": (lambda s: s.update(model={"w": [1, 2]}), "no 'model' mapping"),
    "step-string": (lambda s: s.update(step="six"), "'step' is 'six'"),
    "negative-offset": (lambda s: s.update(metrics_offset=-5), "'metrics_offset' is -5"),
    # well-formed, of another model (issue 47: load_state_dict's RuntimeError tracebacks):
    # one line naming the first tensor that does not fit
    "tensor-shape": (lambda s: s["model"].update({"embed.weight": torch.zeros(7, 3)}),
                     "tensor 'embed.weight' has shape (7, 3) there and"),
    "missing-tensor": (lambda s: s["model"].pop("final_norm.weight"),
                       "it lacks tensor 'final_norm.weight'"),
    "extra-tensor": (lambda s: s["model"].update({"extra.weight": torch.zeros(3)}),
                     "it has tensor 'extra.weight', which the model does not"),
    "complex-tensor": (lambda s: s["model"].update(
        {"final_norm.weight": s["model"]["final_norm.weight"].to(torch.complex64)}),
        "tensor 'final_norm.weight' holds torch.complex64 there"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("reader", ["eval", "resume", "export"])
def test_bad_checkpoint_is_one_line_everywhere(trained: Path, tmp_path: Path, case: str,
                                               reader: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    change, expected = BAD[case]
    run = _copy(trained, tmp_path, change)
    metrics = (run / "metrics.jsonl").read_bytes()
    args = {"eval": ["eval", str(run), "--no-progress"],
            "resume": [*TRAIN, "--out", str(run), "--resume"],
            "export": ["export", str(run), "--hf", str(tmp_path / "hf")]}[reader]
    line = _one_line(capsys, *args)
    assert expected in line
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert not (run / "eval.json").exists() and not (tmp_path / "hf").exists()


def test_huge_offset_does_not_extend_the_log(trained: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(trained, tmp_path, lambda s: s.update(metrics_offset=5_000_000_000))
    before = (run / "metrics.jsonl").read_bytes()
    line = _one_line(capsys, *TRAIN, "--out", str(run), "--resume")
    assert "was cut or replaced" in line
    assert (run / "metrics.jsonl").read_bytes() == before


def test_missing_training_keys_refused_on_resume(trained: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(trained, tmp_path, lambda s: s.pop("optimizer"))
    assert "no optimizer" in _one_line(capsys, *TRAIN, "--out", str(run), "--resume")


def _first_moment(s: dict[str, Any]) -> None:
    s["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3, 3)


def _drop_a_parameter(s: dict[str, Any]) -> None:
    s["optimizer"]["param_groups"][0]["params"].pop()


@pytest.mark.parametrize(("change", "expected"), [
    (_first_moment, "the optimizer's 'exp_avg' of 'embed.weight' has shape (3, 3) there"),
    (_drop_a_parameter, "its optimizer state has parameter groups of ["),
])
def test_optimizer_state_of_another_model_refused_on_resume(
        trained: Path, tmp_path: Path, change: Callable[[dict[str, Any]], None], expected: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The optimizer state's shapes are checked before it loads (a moment of the wrong shape
    loaded silently and broke the first step with a RuntimeError)."""
    run = _copy(trained, tmp_path, change)
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    assert expected in _one_line(capsys, *TRAIN, "--out", str(run), "--resume")
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()} == before


def test_symlinked_metrics_not_followed_on_resume(trained: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(trained, tmp_path, None)
    target = tmp_path / "elsewhere.jsonl"
    target.write_bytes((run / "metrics.jsonl").read_bytes() + b"precious\n" * 100)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(target)
    before = target.read_bytes()
    line = _one_line(capsys, *TRAIN, "--out", str(run), "--resume")
    assert "symbolic link" in line
    assert target.read_bytes() == before
