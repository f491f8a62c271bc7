"""Activation checkpointing frees what it claims to: after a forward with it on, no sublayer
output of a checkpointed block is alive (weak references taken by forward hooks, then
``gc.collect()``); the modes of ``train.activation_checkpointing`` and their numbers."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from modbench.config import TrainConfig
from modbench.errors import ModbenchError
from modbench.methods.build import build_model
from modbench.runtime.loss import lm_loss
from modbench.train.recompute import apply_activation_checkpointing, parse_mode
from tests.helpers import tiny

METHODS = ["baseline", "hyper_connections", "denseformer", "attnres", "value_residual",
           "laurel_pa", "moe",
           "relaxed_recursive"]  # layers sharing weights (the tie slot): no buffers


def sublayer_modules(block: nn.Module) -> list[nn.Module]:
    """Every module of a block's sublayers whose output is a sublayer's own (its pre-norm,
    core and everything in it, branch-output norm); not the merge and post-residual norm,
    whose outputs are stream values the next sublayer reads."""
    mods: list[nn.Module] = []
    for sub in (block.attn, block.ffn):
        mods += [sub.pre_norm, *sub.core.modules(), sub.post_norm]
    return mods


def tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors_in(v)]
    return []


def alive_outputs(model: nn.Module, idx: torch.Tensor, blocks: list[int]
                  ) -> tuple[int, int, torch.Tensor]:
    """(outputs alive, outputs seen) of the sublayer modules of ``blocks`` after a training
    forward and its loss, and the loss (kept alive: the graph is still there). Tensors the
    final stream state keeps on purpose (a method's declared kept tensors: AttnRes's depth
    sources, Value-Residual's V_1, and the tensors they are views of) do not count."""
    refs: list[weakref.ref[torch.Tensor]] = []
    declared: list[int] = []
    finish = model.stream.finish

    def capture(state: Any) -> torch.Tensor:
        declared.extend(t.untyped_storage().data_ptr() for t in tensors_in(state))
        return finish(state)

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        for t in (out if isinstance(out, tuple) else (out,)):
            if isinstance(t, torch.Tensor):
                refs.append(weakref.ref(t))

    handles = [m.register_forward_hook(hook) for i in blocks
               for m in sublayer_modules(model.blocks[i])]
    model.stream.finish = capture
    try:
        loss = lm_loss(model(idx), idx)
    finally:
        del model.stream.finish
        for h in handles:
            h.remove()
    gc.collect()
    kept = set(declared)
    alive = [t for r in refs if (t := r()) is not None]
    return sum(t.untyped_storage().data_ptr() not in kept for t in alive), len(refs), loss


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", METHODS)
def test_no_sublayer_output_survives_a_checkpointed_forward(method: str) -> None:
    cfg = tiny(method).model
    idx = batch(cfg.vocab_size)
    plain = build_model(cfg, seed=0).train()
    alive, seen, _ = alive_outputs(plain, idx, list(range(cfg.n_layers)))
    assert seen and alive > 0  # without it the graph keeps sublayer outputs
    model = build_model(cfg, seed=0).train()
    assert apply_activation_checkpointing(model, method, True) == list(range(cfg.n_layers))
    alive, seen, loss = alive_outputs(model, idx, list(range(cfg.n_layers)))
    assert seen > 0 and alive == 0
    loss.backward()  # the recomputation still has what it needs
    ref = lm_loss(plain(idx), idx)
    ref.backward()
    assert torch.equal(loss.detach(), ref.detach())
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_every_k_checkpoints_every_kth_block() -> None:
    cfg = tiny("baseline", 0, 1, "model.n_layers=4").model
    idx = batch(cfg.vocab_size)
    model = build_model(cfg, seed=0).train()
    assert apply_activation_checkpointing(model, "baseline", "every:2") == [0, 2]
    alive, seen, _ = alive_outputs(model, idx, [0, 2])
    assert seen > 0 and alive == 0
    alive, _, _ = alive_outputs(model, idx, [1, 3])
    assert alive > 0


class CountAttention(TorchDispatchMode):
    """Counts the fused attention forward ops run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if "scaled_dot_product" in str(func) and "backward" not in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode,recomputed", [("full", 1), ("attn", 0)])
def test_attn_mode_does_not_recompute_attention(mode: str, recomputed: int) -> None:
    """Selective: the attention op's output is saved, so the backward runs no attention
    forward again (full: once per block); the rest of the block is recomputed, and the
    gradients equal the plain backward's."""
    cfg = tiny().model
    idx = batch(cfg.vocab_size)
    plain = build_model(cfg, seed=0).train()
    model = build_model(cfg, seed=0).train()
    apply_activation_checkpointing(model, "baseline", mode)
    alive, seen, loss = alive_outputs(model, idx, list(range(cfg.n_layers)))
    assert seen > 0 and alive == 0  # the kernel module's own output is not the op's
    with CountAttention() as count:
        loss.backward()
    assert count.calls == recomputed * cfg.n_layers
    lm_loss(plain(idx), idx).backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("value,want", [(False, None), (True, ("full", 1)),
                                        ("full", ("full", 1)), ("attn", ("attn", 1)),
                                        ("every:3", ("every", 3))])
def test_modes(value: bool | str, want: tuple[str, int] | None) -> None:
    assert parse_mode(value) == want
    TrainConfig(activation_checkpointing=value).validate()


@pytest.mark.parametrize("value", ["yes", "every:0", "every:", "every:x", "partial", ""])
def test_bad_modes_are_refused_in_one_line(value: str) -> None:
    with pytest.raises(ModbenchError, match=r"train\.activation_checkpointing must be"):
        TrainConfig(activation_checkpointing=value).validate()
    with pytest.raises(ModbenchError, match=r"train\.activation_checkpointing must be"):
        parse_mode(value)


_HEAP_PROBE = """
import os, sys, torch
from modbench.runtime.device import return_freed_activations
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if sys.argv[1] == "1":
    assert return_freed_activations(torch.device("cpu"))
big = torch.ones(4 << 20)  # 16 MB, freed: glibc's dynamic threshold rises above 4 MB
del big
kept, freed = [], []
for i in range(40):  # 4 MB activations, every other one kept (checkpointed block inputs)
    (kept if i % 2 else freed).append(torch.ones(1 << 20))
before = rss()
n = sum(t.numel() * 4 for t in freed)
freed.clear()
print((before - rss()) / n)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists()
                    or not hasattr(os, "confstr") or "glibc" not in (
                        os.confstr("CS_GNU_LIBC_VERSION") or ""), reason="glibc on Linux")
def test_freed_activations_leave_the_process_on_the_cpu() -> None:
    """With the heap setting the trainer makes under checkpointing on the CPU, freeing 4 MB
    activations between kept ones returns their memory; with glibc's default (its threshold
    raised by an earlier large free) none of it leaves the resident set."""
    returned = {}
    for setting in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, setting], check=True,
                             capture_output=True, text=True)
        returned[setting] = float(out.stdout.strip())
    assert returned["1"] > 0.9, returned
    assert returned["0"] < 0.5, returned
