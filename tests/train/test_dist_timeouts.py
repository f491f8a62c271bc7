"""Two collective timeouts (docs/cluster.md, "Timeouts"): ``train.dist_timeout`` while a
multi-process run starts (data preparation, hashing, compiling, the first step) and while a
checkpoint is written, ``train.dist_step_timeout`` once the first step has run, so a stuck or
lost process ends the run (and a restart begins) in minutes, not half an hour.

On the CPU: a one-process gloo group for the switch itself, and a two-process group the
trainer initialises (env:// on localhost, as torchrun's) where process 1 is slow at the first
step and rank 0's checkpoint write is slow (the run completes), then process 1 is stuck at a
later step (the run fails in one line naming ``train.dist_step_timeout``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modbench.config import EXECUTION_KEYS, from_dict, resolve
from modbench.errors import ModbenchError
from modbench.study.spec import config_key
from modbench.train.distributed import World, collective_failure
from modbench.train.trainer import train
from tests.train.test_cluster_survival import _SleepAt

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

BASE = ("train.threads=1", "train.eval_every=3", "train.micro_batch_size=2",
        "data.source=builtin", "train.dist_timeout=60", "train.dist_step_timeout=3")
SLOW = 6.0  # seconds: past the step timeout, well inside the start-up one


def _timeout(group: Any = None) -> float:
    pg = group or dist.group.WORLD
    return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())


def test_settle_shortens_every_group_and_patient_restores_the_start_up_wait(
        tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        world = World(0, 0, 2, owned=True, startup=60.0,
                      waits=("train.dist_timeout", 60.0))
        host = dist.new_group(backend="gloo")  # an nccl run's host-side group
        world.settle(3)
        assert (_timeout(), _timeout(host)) == (3, 3)
        assert world.waits == ("train.dist_step_timeout", 3)
        with world.patient():
            assert (_timeout(), _timeout(host)) == (60, 60)
            assert world.waits == ("train.dist_timeout", 60)
        assert (_timeout(), _timeout(host)) == (3, 3)
        assert world.waits == ("train.dist_step_timeout", 3)
        # the smaller of the two applies
        longer = World(0, 0, 2, owned=True, startup=2.0, waits=("train.dist_timeout", 2.0))
        longer.settle(300)
        assert _timeout() == 2 and longer.waits == ("train.dist_timeout", 2)
        # a group the trainer did not initialise keeps its owner's timeout
        World(0, 0, 2, owned=False).settle(1)
        assert _timeout() == 2
    finally:
        dist.destroy_process_group()


def test_a_timeout_names_the_key_in_force() -> None:
    world = World(0, 0, 2, waits=("train.dist_step_timeout", 300.0))
    got = collective_failure(RuntimeError("[gloo] Timed out waiting 300000ms"), world, 1800)
    assert got is not None and str(got).startswith(
        "process 0 of 2 waited more than train.dist_step_timeout=300s at a collective")
    assert "raise train.dist_step_timeout if that wait is expected" in str(got)
    before = collective_failure(RuntimeError("Timed out"), World(0, 0, 2), 1800)
    assert before is not None and "train.dist_timeout=1800s" in str(before)


def test_dist_step_timeout_key() -> None:
    assert resolve("tiny").train.dist_step_timeout == 300
    for bad in ("0", "-5", "1e12"):
        with pytest.raises(ModbenchError, match=r"^train.dist_step_timeout must be a positive "
                                                r"number of seconds"):
            resolve("tiny", overrides=[f"train.dist_step_timeout={bad}"])
    assert "train.dist_step_timeout" in EXECUTION_KEYS  # never in a study's run key
    assert config_key(resolve("tiny", overrides=["train.dist_step_timeout=60"])) == config_key(
        resolve("tiny"))


# ------------------------------------------------------------------------------ a group


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        summary = fn()
    except BaseException as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "status": summary["status"]}


def _worker(rank: int, world: int, root: str, ports: list[int],
            trees: dict[str, dict[str, Any]]) -> None:
    """Two runs, each in a group its trainer initialises: ``slow_start`` (process 1 sleeps
    at the first step, rank 0's first checkpoint write sleeps), then ``stuck`` (process 1
    sleeps before its third step)."""
    import modbench.train.trainer as trainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    real, slept = trainer.save_checkpoint, []

    def slow_save(*args: Any, **kwargs: Any) -> None:
        if not slept:
            slept.append(True)
            time.sleep(SLOW)
        real(*args, **kwargs)

    trainer.save_checkpoint = slow_save  # type: ignore[assignment]
    out: dict[str, Any] = {}
    for (name, sleep_at), port in zip((("slow_start", 0), ("stuck", 2)), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        callbacks = [_SleepAt(sleep_at, SLOW)] if rank == 1 else []
        out[name] = _outcome(lambda name=name, callbacks=callbacks: train(  # type: ignore[misc]
            from_dict(trees[name]), Path(root) / name, callbacks=callbacks, progress=False))
    Path(root, f"out.{rank}.json").write_text(json.dumps(out))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_start_up_and_checkpoints_wait_long_steps_wait_short(tmp_path: Path) -> None:
    trees = {"slow_start": resolve("tiny", seed=0, steps=4, overrides=[
                 *BASE, "train.checkpoint_every=2"]).to_dict(),
             "stuck": resolve("tiny", seed=0, steps=6, overrides=list(BASE)).to_dict()}
    ports = [_free_port(), _free_port()]
    mp.start_processes(_worker, args=(2, str(tmp_path), ports, trees), nprocs=2, join=True,
                       start_method="spawn")
    got = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1)]
    for rank in (0, 1):
        # a first step 6 s late and a checkpoint written for 6 s, under a 3 s step timeout
        assert got[rank]["slow_start"] == {"type": None, "status": "completed"}, got[rank]
    waited = got[0]["stuck"]  # process 0 waited at the third step for process 1
    assert waited["type"] == "ModbenchError", waited
    assert "\n" not in waited["message"]
    assert waited["message"].startswith("process 0 of 2 waited more than "
                                        "train.dist_step_timeout=3s at a collective")
    assert got[1]["stuck"]["type"] == "ModbenchError"
