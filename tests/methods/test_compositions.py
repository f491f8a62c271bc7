"""The study's combinations (arXiv 2605.20798 B.17, B.18) train on tiny like single methods."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from modbench.train.trainer import train
from tests.helpers import tiny, train_losses

STUDY_COMBOS = ["selective+qknorm", "gated_attn+qknorm", "qknorm+geglu"]


@pytest.mark.parametrize("method", STUDY_COMBOS)
def test_study_combination_trains_on_tiny(method: str, tmp_path: Path) -> None:
    summary = train(tiny(method, steps=30), tmp_path / "run", progress=False)
    assert summary["status"] == "completed" and summary["method"] == method
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.3
