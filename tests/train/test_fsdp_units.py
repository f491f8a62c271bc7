"""FSDP2's units and mixed-precision policy (``modbench.train.distributed._fully_shard``) in a
one-process gloo group: one unit per decoder block (and the embedding where the head is
untied), parameters gathered in ``train.fsdp_param_dtype`` for the forward while the
sharded master weights, their gradients and the residual stream stay fp32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from modbench.config import resolve
from modbench.methods.build import build_model
from modbench.train.distributed import _fully_shard, fsdp_param_dtype

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(*extra: str) -> torch.nn.Module:
    cfg = resolve("tiny", overrides=list(extra))
    return build_model(cfg.model, seed=0, device=torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_unit_per_block_and_parameters_gathered_in_the_policys_dtype(
        group: None, dtype: torch.dtype) -> None:
    model = _model("model.tie_embeddings=false")
    units = _fully_shard(model, torch.device("cpu"), 1, set(), dtype)
    assert units == ["<root>", "embed", "blocks.0", "blocks.1"]
    seen: dict[str, torch.dtype] = {}
    stream: list[torch.dtype] = []

    def record(name: str, module: torch.nn.Module) -> None:
        def hook(m: torch.nn.Module, args: object, out: object) -> None:
            seen[name] = next(m.parameters()).dtype
        module.register_forward_hook(hook)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            record(name, m)
    model.blocks[1].register_forward_hook(lambda m, a, out: stream.append(out.x.dtype))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, loss=True)
    loss.backward()
    assert seen and set(seen.values()) == {dtype}  # every projection, the head included
    assert stream == [torch.float32]  # the residual stream is not cast to the param dtype
    for name, p in model.named_parameters():  # after the step: fp32 shards and gradients
        assert p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32, name


def test_a_tied_head_keeps_the_embedding_in_the_root(group: None) -> None:
    model = _model()
    assert _fully_shard(model, torch.device("cpu"), 1, set()) == [
        "<root>", "blocks.0", "blocks.1"]


def test_the_param_dtype_follows_the_runs_autocast() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fsdp_param_dtype("auto", "auto", cuda) == torch.bfloat16
    assert fsdp_param_dtype("auto", "auto", cpu) == torch.float32
    assert fsdp_param_dtype("auto", "bf16", cpu) == torch.bfloat16
    assert fsdp_param_dtype("auto", "fp32", cuda) == torch.float32
    assert fsdp_param_dtype("fp32", "bf16", cuda) == torch.float32
    assert fsdp_param_dtype("bf16", "fp32", cpu) == torch.bfloat16
