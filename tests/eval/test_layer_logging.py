"""``train.log_layers`` (modbench.eval.layer_logging): per-layer gradient norms and activation
RMS in metrics.jsonl, checked against computations that share no code with it (autograd on a
copy of the step's model, a hand-written forward, the stream's own records); the run's numbers
unchanged; every registered method; stacked seeds; off by default; resumable either way."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from modbench.config import RunConfig
from modbench.eval.layer_logging import RECORD_KEY, LayerLogging
from modbench.methods import load_all
from modbench.methods.build import build_model
from modbench.model.stream import ForwardContext
from modbench.runtime.callback import Callback, TrainingRun
from modbench.runtime.checkpoint import load_checkpoint
from modbench.runtime.loss import lm_loss
from modbench.runtime.runfolder import CHECKPOINT
from modbench.study.spec import config_key
from modbench.train.trainer import train, train_seeds
from tests.helpers import read_metrics, run_capturing, tiny

LOG = "train.log_layers=true"


pytestmark = pytest.mark.usefixtures("one_thread")


def train_records(run: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run) if r["kind"] == "train"]


def rms(x: torch.Tensor) -> float:
    return math.sqrt(float(x.detach().double().pow(2).mean()))


class Snapshots(Callback):
    """A copy of the model and the batch at the start of the given steps (before the
    forward: the weights the step's gradient is taken at)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.at: dict[int, tuple[nn.Module, torch.Tensor]] = {}

    def on_batch(self, run: TrainingRun, step: int, batch: torch.Tensor) -> None:
        if step in self.steps:
            self.at[step] = (copy.deepcopy(run.model), batch.clone())


def by_hand(model: nn.Module, batch: torch.Tensor) -> tuple[list[float], float, list[float],
                                                            float, float]:
    """The baseline decoder written out (x += attn(norm(x)); x += ffn(norm(x))), no hooks:
    the RMS of each block's input and of the output; then autograd's gradient norm of each
    block, of the rest, and in all."""
    t = batch.shape[1]
    x = model.embed(batch)
    ctx = ForwardContext(cos=model.rope_cos[:t], sin=model.rope_sin[:t], seq_len=t)
    acts = []
    for block in model.blocks:
        acts.append(rms(x))
        x = x + block.attn.core(block.attn.pre_norm(x), ctx)
        x = x + block.ffn.core(block.ffn.pre_norm(x), ctx)
    final = rms(x)
    model.zero_grad()
    lm_loss(model(batch), batch).backward()

    def norm(params: Any) -> float:
        return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params
                             if p.grad is not None))

    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    grads = [norm(b.parameters()) for b in model.blocks]
    rest = norm(p for p in model.parameters() if id(p) not in in_blocks)
    return acts, final, grads, rest, norm(model.parameters())


@pytest.mark.parametrize("clip", ["1.0", "0.05"])  # 0.05: every step is clipped
def test_baseline_values_against_autograd_and_a_hand_written_forward(tmp_path: Path,
                                                                     clip: str) -> None:
    snaps = Snapshots({0, 3})
    train(tiny("baseline", 0, 4, LOG, f"recipe.grad_clip={clip}"), tmp_path / "r",
          callbacks=[snaps], progress=False)
    records = {r["step"]: r for r in train_records(tmp_path / "r")}
    assert sorted(records) == [1, 2, 3, 4]
    for step, (model, batch) in snaps.at.items():
        rec = records[step + 1]
        layers = rec[RECORD_KEY]
        acts, final, grads, rest, total = by_hand(model, batch)
        assert layers["act_rms"] == pytest.approx(acts, rel=1e-5)
        assert layers["act_rms_final"] == pytest.approx(final, rel=1e-5)
        # pre-clip, like the record's grad_norm, whether or not the step was clipped
        assert layers["grad_norm"] == pytest.approx(grads, rel=1e-4)
        assert layers["grad_norm_rest"] == pytest.approx(rest, rel=1e-4)
        assert rec["grad_norm"] == pytest.approx(total, rel=1e-4)
    for rec in records.values():  # the parts make up the logged global norm
        layers = rec[RECORD_KEY]
        parts = [*layers["grad_norm"], layers["grad_norm_rest"]]
        assert all(math.isfinite(v) and v > 0 for v in parts)
        assert math.sqrt(sum(v * v for v in parts)) == pytest.approx(rec["grad_norm"], rel=1e-5)
        assert all(math.isfinite(v) and v > 0 for v in [*layers["act_rms"],
                                                        layers["act_rms_final"]])


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run / CHECKPOINT)["model"]


def assert_same_run(a: Path, b: Path) -> None:
    strip = [{k: v for k, v in r.items() if k not in (RECORD_KEY, "tokens_per_s")}
             for r in read_metrics(a)]
    assert strip == [{k: v for k, v in r.items() if k != "tokens_per_s"}
                     for r in read_metrics(b)]
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_off_by_default_and_on_changes_no_number(tmp_path: Path) -> None:
    cfg = tiny("baseline", 0, 5, "train.log_every=2")
    assert cfg.train.log_layers is False
    train(cfg, tmp_path / "off", progress=False)
    assert all(RECORD_KEY not in r for r in read_metrics(tmp_path / "off"))
    train(tiny("baseline", 0, 5, "train.log_every=2", LOG), tmp_path / "on", progress=False)
    on = train_records(tmp_path / "on")
    assert [r["step"] for r in on] == [2, 4, 5]  # the logged steps, the last one included
    assert all(RECORD_KEY in r for r in on)
    assert_same_run(tmp_path / "on", tmp_path / "off")
    # every 4th step among the logged ones, and the last
    train(tiny("baseline", 0, 9, "train.log_every=2", LOG, "train.log_layers_every=4"),
          tmp_path / "every", progress=False)
    assert [(r["step"], RECORD_KEY in r) for r in train_records(tmp_path / "every")] == [
        (2, False), (4, True), (6, False), (8, True), (9, True)]
    # an execution key: a study's run key ignores it
    assert config_key(tiny("baseline", 0, 5, LOG)) == config_key(tiny("baseline", 0, 5))


def test_stacked_seeds_log_each_members_values_and_change_no_number(tmp_path: Path) -> None:
    # stacked members train through a vmapped forward of stacked weights, which never runs
    # a member's own modules: their activations come from an extra forward (module docstring)
    cfg = tiny("baseline", 0, 3, LOG)
    train_seeds(cfg, [0, 1], tmp_path / "k", progress=False)
    train_seeds(tiny("baseline", 0, 3), [0, 1], tmp_path / "plain", progress=False)
    for s in (0, 1):
        assert_same_run(tmp_path / "k" / f"s{s}", tmp_path / "plain" / f"s{s}")
        single = tmp_path / f"single{s}"
        train(tiny("baseline", s, 3, LOG), single, progress=False)
        for a, b in zip(train_records(tmp_path / "k" / f"s{s}"), train_records(single),
                        strict=True):
            for key in ("grad_norm", "act_rms"):
                assert a[RECORD_KEY][key] == pytest.approx(b[RECORD_KEY][key], rel=1e-4)
    a0 = train_records(tmp_path / "k" / "s0")[0][RECORD_KEY]["act_rms"]
    a1 = train_records(tmp_path / "k" / "s1")[0][RECORD_KEY]["act_rms"]
    assert a0 != a1  # each member's own model


def test_a_run_resumes_with_the_logging_switched_on(tmp_path: Path) -> None:
    class Kill(Callback):
        def on_step_end(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
            if step + 1 == 3:
                raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train(tiny("baseline", 0, 5, "train.checkpoint_every=2"), tmp_path / "r",
              callbacks=[Kill()], progress=False)
    train(tiny("baseline", 0, 5, "train.checkpoint_every=2", LOG), tmp_path / "r",
          resume=True, progress=False)
    logged = {r["step"]: RECORD_KEY in r for r in train_records(tmp_path / "r")}
    assert logged == {1: False, 2: False, 3: True, 4: True, 5: True}


# ------------------------------------------------------------------ every method


@dataclass
class FakeRun:
    """What the callback reads of a run (TrainingRun), around a bare model."""

    cfg: RunConfig
    model: nn.Module
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


ALL = ["baseline", *sorted(load_all())]


@pytest.mark.parametrize("method", ALL)
def test_every_method_against_the_streams_records(method: str) -> None:
    cfg = tiny(method, 0, 1)
    model = build_model(cfg.model, seed=0).train()
    batch = torch.randint(0, cfg.model.vocab_size, (2, 16),
                          generator=torch.Generator().manual_seed(1))
    run = FakeRun(cfg, model)
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():  # the reference: what each block read, from the stream's records
        _, state = run_capturing(model, batch)
        ref_acts = [rms(rec.input) for rec in state.history if rec.sublayer == "attn"]
        ref_final = rms(model.stream.finish(state))
    model.load_state_dict(before)  # running statistics back to where they were
    cb = LayerLogging()
    cb.on_train_start(run)  # type: ignore[arg-type]
    cb.on_batch(run, 0, batch)  # type: ignore[arg-type]
    lm_loss(model(batch), batch).backward()
    total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
                          if p.grad is not None))
    # the trainer's order: clip (tiny's recipe clips at 1.0), then after_backward
    clipped = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.recipe.grad_clip))
    cb.after_backward(run, 0)  # type: ignore[arg-type]
    record: dict[str, Any] = {"grad_norm": clipped}  # the pre-clip norm, as the trainer logs
    cb.on_step_end(run, 0, record)  # type: ignore[arg-type]
    layers = record[RECORD_KEY]
    assert len(layers["grad_norm"]) == len(layers["act_rms"]) == cfg.model.n_layers
    assert layers["act_rms"] == pytest.approx(ref_acts, rel=1e-5), method
    assert layers["act_rms_final"] == pytest.approx(ref_final, rel=1e-5), method
    parts = [*layers["grad_norm"], layers["grad_norm_rest"]]
    assert all(v is not None and math.isfinite(v) for v in parts), method
    assert math.sqrt(sum(v * v for v in parts)) == pytest.approx(total, rel=1e-5), method
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # removed


# ------------------------------------------------------------------ several processes


def _ddp_worker(rank: int, world: int, root: str, jobs: list[tuple[str, dict[str, Any]]]) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from modbench.config import from_dict

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    for name, tree in jobs:
        train(from_dict(tree), Path(root) / name, progress=False)
    dist.destroy_process_group()


@pytest.mark.skipif(not (torch.distributed.is_available()
                         and torch.distributed.is_gloo_available()), reason="needs gloo")
def test_two_processes_log_the_global_values(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    # batch 8: 4 rows per process in 2 micro-batches. FSDP: the gradients are sharded
    # (their squares summed over the processes) but for DyT's scalar alpha, which stays whole
    # on every process (not summed); the blocks are recomputed in the backward (the hooks see
    # each block twice). DDP differs only in having no shards (one job keeps this quick).
    base = ("train.micro_batch_size=2", "train.threads=1", LOG)
    jobs = {"fsdp": tiny("dyt", 0, 3, *base, "train.parallel=fsdp",
                         "train.activation_checkpointing=true")}
    mp.start_processes(_ddp_worker, args=(2, str(tmp_path),
                                          [(k, c.to_dict()) for k, c in jobs.items()]),
                       nprocs=2, join=True, start_method="spawn")
    for name, cfg in jobs.items():
        train(cfg, tmp_path / f"one_{name}", progress=False)
        for a, b in zip(train_records(tmp_path / name), train_records(tmp_path / f"one_{name}"),
                        strict=True):
            for key in ("grad_norm", "act_rms"):
                assert a[RECORD_KEY][key] == pytest.approx(b[RECORD_KEY][key], rel=1e-4), name
            parts = [*a[RECORD_KEY]["grad_norm"], a[RECORD_KEY]["grad_norm_rest"]]
            assert math.sqrt(sum(v * v for v in parts)) == pytest.approx(a["grad_norm"],
                                                                         rel=1e-5)
