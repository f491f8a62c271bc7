"""The hot loop's host synchronisation (issue 19): losses and grad norms stay on the device and
are read back once per window of ``Trainer.sync_every`` steps (on an accelerator), and the
batches are read ahead by a background thread (:class:`~modbench.runtime.data.Prefetcher`).
Neither may change what a run computes or records: a run read back in windows equals the run
read back every step (the CPU default), bit for bit in every logged value but the step time,
including a member that diverges inside a window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from modbench.errors import ModbenchError
from modbench.runtime.data import Prefetcher, open_data
from modbench.runtime.runfolder import SUMMARY_TIMINGS
from modbench.train.engine import host_floats
from modbench.train.trainer import Trainer
from tests.helpers import read_metrics, tiny


def _strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def _summary(run: Path) -> dict[str, Any]:
    s = json.loads((run / "summary.json").read_text())
    return {k: v for k, v in s.items() if k not in SUMMARY_TIMINGS}


def _train(cfg: Any, out: Path | list[Path], sync_every: int,
           seeds: list[int] | None = None) -> None:
    t = Trainer(cfg, out, seeds=seeds, progress=False)
    t.sync_every = sync_every
    t.run_all()


@pytest.mark.parametrize("overrides", [
    ("train.eval_every=6", "train.checkpoint_every=4", "train.log_every=3"),
    ("train.eval_every=0", "train.log_every=1"),
])
def test_windows_record_what_every_step_records(tmp_path: Path,
                                                overrides: tuple[str, ...]) -> None:
    cfg = tiny("baseline", 0, 14, *overrides)
    _train(cfg, tmp_path / "each", 1)
    _train(cfg, tmp_path / "windows", 5)  # windows cut by validations and checkpoints too
    assert _strip(read_metrics(tmp_path / "windows")) == _strip(read_metrics(tmp_path / "each"))
    assert _summary(tmp_path / "windows") == _summary(tmp_path / "each")


def test_a_divergence_inside_a_window_is_caught_at_its_step(tmp_path: Path) -> None:
    # lr 1e6 makes the loss non-finite within a few steps; a window of 8 reads it back late
    cfg = tiny("baseline", 0, 12, "recipe.lr=1e6", "recipe.warmup_steps=0",
               "train.eval_every=0")
    _train(cfg, tmp_path / "each", 1)
    _train(cfg, tmp_path / "windows", 8)
    each, windows = _summary(tmp_path / "each"), _summary(tmp_path / "windows")
    assert each["status"] == "diverged" and each["diverged_at_step"] < 8
    assert windows == each
    assert _strip(read_metrics(tmp_path / "windows")) == _strip(read_metrics(tmp_path / "each"))


def test_stacked_seeds_read_back_in_windows(tmp_path: Path) -> None:
    cfg = tiny("baseline", 0, 9, "train.eval_every=4")
    _train(cfg, tmp_path / "each", 1, seeds=[0, 1])
    _train(cfg, tmp_path / "windows", 3, seeds=[0, 1])
    for s in ("s0", "s1"):
        assert (_strip(read_metrics(tmp_path / "windows" / s))
                == _strip(read_metrics(tmp_path / "each" / s)))
        assert _summary(tmp_path / "windows" / s) == _summary(tmp_path / "each" / s)


def test_host_floats_sums_parts_in_order_like_item() -> None:
    parts = torch.tensor([0.1, 1e8, -1e8, 0.3], dtype=torch.float32)
    total = 0.0
    for p in parts:
        total += p.item()
    norm = torch.tensor(2.5)
    assert host_floats([parts, 7.0, norm]) == [total, 7.0, 2.5]
    assert host_floats([]) == []


def test_prefetcher_gives_the_batches_in_order(tmp_path: Path) -> None:
    cfg = tiny("baseline", 0, 6)
    data = open_data(cfg, progress=False)
    with Prefetcher(data, range(2, 6), 4, 7) as ahead:
        for step in range(2, 6):
            batch, mask = ahead.get(step)
            want, want_mask = data.train_batch_and_mask(step, 4, 7)
            assert torch.equal(batch, want) and mask is None and want_mask is None
    with Prefetcher(data, range(0, 3), 4, 7) as ahead, pytest.raises(ValueError, match="order"):
        ahead.get(1)


def test_prefetcher_raises_a_read_error_at_its_step() -> None:
    class Broken:
        def train_batch_and_mask(self, step: int, batch_size: int,
                                 data_seed: int) -> tuple[torch.Tensor, None]:
            if step == 2:
                raise ModbenchError("shard 3 is damaged")
            return torch.full((batch_size, 4), step), None

    with Prefetcher(Broken(), range(5), 2, 0, depth=1) as ahead:  # type: ignore[arg-type]
        assert int(ahead.get(0)[0][0, 0]) == 0
        assert int(ahead.get(1)[0][0, 0]) == 1
        with pytest.raises(ModbenchError, match="damaged"):
            ahead.get(2)
