"""A stop asked in the middle of a read-back window (issue 46 item 3): the flag is read every
step, so the save starts a step after the signal, not up to a window (16 steps on an
accelerator) later; in a group the processes agree on it through a host-side all-reduce and
save at the same step. The window is widened here on the CPU (whose window is one step) as it
is on a GPU."""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modbench.config import from_dict
from modbench.runtime.checkpoint import Preempted, load_checkpoint
from modbench.runtime.runfolder import CHECKPOINT
from modbench.train.trainer import SYNC_EVERY, Trainer
from tests.helpers import read_metrics
from tests.train.test_cluster_survival import _SignalAt, assert_same_run, cfg_of

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available() and hasattr(signal, "SIGUSR1")),
    reason="needs torch.distributed with gloo and POSIX signals")

# 12 steps, validation at 8 only: without the per-step read a stop signalled during step 2
# would wait for the window's end at step 8
EXTRA = ("train.eval_every=8",)
SIGNAL_AT = 1  # sent during step 2 (0-based 1): the save is at step 2


def _train(cfg: Any, out: Path, *, resume: bool = False, signal_rank: int | None = None,
           signalled: bool = False) -> dict[str, Any]:
    t = Trainer(cfg, out, resume=resume, progress=False,
                callbacks=[_SignalAt(SIGNAL_AT, rank=signal_rank)] if signalled else [])
    t.sync_every = SYNC_EVERY  # an accelerator's window
    return t.run()


def test_one_process_saves_a_step_after_the_signal_and_resumes_exactly(
        tmp_path: Path) -> None:
    cfg = cfg_of("builtin", *EXTRA, steps=12)
    with pytest.raises(Preempted):
        _train(cfg, tmp_path / "cut", signalled=True)
    assert load_checkpoint(tmp_path / "cut" / CHECKPOINT)["step"] == SIGNAL_AT + 1
    assert [r["step"] for r in read_metrics(tmp_path / "cut") if r["kind"] == "train"] == [
        1, 2]
    _train(cfg, tmp_path / "cut", resume=True)
    _train(cfg, tmp_path / "whole")
    assert_same_run(tmp_path / "whole", tmp_path / "cut")


def _group_worker(rank: int, world: int, root: str, tree: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    base = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    cfg = from_dict(tree)
    out: dict[str, Any] = {}
    try:  # only rank 1 is signalled; both must stop at its step
        _train(cfg, base / "cut", signal_rank=1, signalled=True)
        out["stopped"] = None
    except Preempted as e:
        out["stopped"] = str(e)
    _train(cfg, base / "cut", resume=True)
    _train(cfg, base / "whole")
    (base / f"out.{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_a_group_agrees_on_the_step_and_resumes_exactly(tmp_path: Path) -> None:
    tree = cfg_of("builtin", *EXTRA, steps=12).to_dict()
    mp.start_processes(_group_worker, args=(2, str(tmp_path), tree), nprocs=2, join=True,
                       start_method="spawn")
    for rank in (0, 1):
        said = json.loads((tmp_path / f"out.{rank}.json").read_text())["stopped"]
        assert said is not None and f"after step {SIGNAL_AT + 1}:" in said
    assert load_checkpoint(tmp_path / "whole" / CHECKPOINT)["step"] == 12
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
