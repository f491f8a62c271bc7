"""DDP's gradients are views of its all-reduce buckets (``gradient_as_bucket_view``; issue 46):
one copy of the gradients, from the first step on (they are made views before DDP wraps the
model) and between steps (zeroed in place, not freed), as the memory plan counts them; and
``train.parallel=auto`` on the CPU (gloo) trains with DDP and records it. Two gloo processes;
the numbers against one process are tests/train/test_distributed.py's."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from modbench.runtime.callback import Callback, TrainingRun
from modbench.train.trainer import train
from tests.helpers import read_metrics, tiny

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available() and hasattr(signal, "SIGKILL")),
    reason="needs torch.distributed with gloo")


class _Views(Callback):
    """At the start, after each backward and at each step's end: whether every gradient is a
    view (of DDP's bucket), and the storages the gradients live in."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def _look(self, run: TrainingRun, when: str) -> None:
        grads = [p.grad for p in run.model.parameters() if p.requires_grad]
        self.seen.append({
            "when": when, "all_defined": all(g is not None for g in grads),
            "views": all(g is not None and g._base is not None for g in grads),
            "storages": sorted({g.untyped_storage().data_ptr() for g in grads
                                if g is not None}),
            "zero": all(g is not None and not g.any() for g in grads)})

    def on_train_start(self, run: TrainingRun) -> None:
        self._look(run, "start")

    def after_backward(self, run: TrainingRun, step: int) -> None:
        self._look(run, "backward")

    def on_step_end(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        self._look(run, "end")


def _worker(rank: int, world: int, root: str, tree: dict[str, Any]) -> None:
    from datetime import timedelta

    from modbench.config import from_dict

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    views = _Views()
    summary = train(from_dict(tree), Path(root) / "run", callbacks=[views], progress=False)
    (Path(root) / f"rank{rank}.json").write_text(json.dumps({"seen": views.seen,
                                                              "summary": summary}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("views")
    cfg = tiny("baseline", 0, 3, "train.threads=1", "train.eval_every=0",
               "train.micro_batch_size=2", "train.parallel=auto")  # 2 micro-batches a process
    mp.start_processes(_worker, args=(2, str(root), cfg.to_dict()), nprocs=2, join=True,
                       start_method="spawn")
    return root


def test_ddp_gradients_are_bucket_views_from_the_first_step_on(ran: Path) -> None:
    for rank in (0, 1):
        seen = json.loads((ran / f"rank{rank}.json").read_text())["seen"]
        assert [s["when"] for s in seen] == ["start"] + ["backward", "end"] * 3
        assert all(s["all_defined"] and s["views"] for s in seen), seen
        # a few buckets (tiny: one), never a tensor of each parameter's own; DDP rebuilds its
        # buckets once, at the second step's forward (in the order the gradients came), and
        # points the gradients at the new ones
        assert all(len(s["storages"]) <= 2 for s in seen)
        later = {tuple(s["storages"]) for s in seen[3:]}
        assert len(later) == 1 and len({tuple(s["storages"]) for s in seen}) <= 2
        assert seen[0]["zero"] and all(s["zero"] for s in seen if s["when"] == "end")
        assert not any(s["zero"] for s in seen if s["when"] == "backward")


def test_auto_on_the_cpu_trains_with_ddp_and_records_it(ran: Path) -> None:
    summary = json.loads((ran / "rank0.json").read_text())["summary"]
    assert summary["status"] == "completed"
    assert (summary["processes"], summary["parallel"]) == (2, "ddp")
    written = list(yaml.safe_load_all((ran / "run" / "config.yaml").read_text()))
    config = {k: v for doc in written for k, v in doc.items()}
    assert config["train"]["parallel"] == "auto"  # the run key's value
    assert config["meta"]["parallel"] == "ddp"  # what auto chose
    assert len([r for r in read_metrics(ran / "run") if r["kind"] == "train"]) == 3
