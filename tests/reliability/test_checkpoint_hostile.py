"""Well-formed but wrong run-folder files (modbench.runtime.checkpoint.check_checkpoint,
check_resumable): a checkpoint without ``model`` or with a bad ``step``, a negative or huge
``metrics_offset``, a ``metrics.jsonl`` that is a symbolic link: one line (exit 2) from every
reader, and nothing truncated, extended or followed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

TRAIN = ["train", "--preset", "tiny", "--steps", "6", "--checkpoint-every", "3", "--set",
         "train.threads=1", "--set", "train.eval_every=0", "--no-progress"]


def _modbench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "modbench", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "delete" not in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ckpt") / "R"
    r = _modbench(*TRAIN, "--out", str(run))
    assert r.returncode == 0, r.stderr
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
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("reader", ["eval", "resume", "export"])
def test_bad_checkpoint_is_one_line_everywhere(trained: Path, tmp_path: Path, case: str,
                                               reader: str) -> None:
    change, expected = BAD[case]
    run = _copy(trained, tmp_path, change)
    metrics = (run / "metrics.jsonl").read_bytes()
    args = {"eval": ["eval", str(run), "--no-progress"],
            "resume": [*TRAIN, "--out", str(run), "--resume"],
            "export": ["export", str(run), "--hf", str(tmp_path / "hf")]}[reader]
    line = _one_line(_modbench(*args))
    assert expected in line
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert not (run / "eval.json").exists() and not (tmp_path / "hf").exists()


def test_huge_offset_does_not_extend_the_log(trained: Path, tmp_path: Path) -> None:
    run = _copy(trained, tmp_path, lambda s: s.update(metrics_offset=5_000_000_000))
    before = (run / "metrics.jsonl").read_bytes()
    line = _one_line(_modbench(*TRAIN, "--out", str(run), "--resume"))
    assert "was cut or replaced" in line
    assert (run / "metrics.jsonl").read_bytes() == before


def test_missing_training_keys_refused_on_resume(trained: Path, tmp_path: Path) -> None:
    run = _copy(trained, tmp_path, lambda s: s.pop("optimizer"))
    assert "no optimizer" in _one_line(_modbench(*TRAIN, "--out", str(run), "--resume"))


def test_symlinked_metrics_not_followed_on_resume(trained: Path, tmp_path: Path) -> None:
    run = _copy(trained, tmp_path, None)
    target = tmp_path / "elsewhere.jsonl"
    target.write_bytes((run / "metrics.jsonl").read_bytes() + b"precious\n" * 100)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(target)
    before = target.read_bytes()
    line = _one_line(_modbench(*TRAIN, "--out", str(run), "--resume"))
    assert "symbolic link" in line
    assert target.read_bytes() == before
