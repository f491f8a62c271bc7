"""The trainer's Adam/AdamW run torch's fused kernel where it can (``fused_kernel``): the same
update as torch's reference for-loop implementation, to float32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch

from modbench.methods.build import plan
from modbench.runtime.device import fused_kernel
from modbench.runtime.loss import lm_loss
from modbench.train.optim import MuonAdamW, build_optimizer, param_groups
from tests.helpers import tiny


def test_fused_only_where_torch_has_the_kernel() -> None:
    assert fused_kernel([torch.zeros(3), torch.zeros(2, 2, dtype=torch.bfloat16)])
    assert not fused_kernel([])
    assert not fused_kernel([torch.zeros(3), torch.zeros(3, dtype=torch.int64)])
    assert not fused_kernel([torch.zeros(3, device="meta")])


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "muon"])
def test_the_trainers_optimizers_use_the_fused_kernel_on_the_cpu(optimizer: str) -> None:
    cfg = tiny("baseline", 0, 2, f"recipe.optimizer={optimizer}")
    opt = build_optimizer(plan(cfg.model).build(0), cfg.recipe)
    inner = opt.adamw if isinstance(opt, MuonAdamW) else opt
    assert inner.param_groups and all(g["fused"] for g in inner.param_groups)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_fused_update_equals_the_for_loop_to_rounding(optimizer: str) -> None:
    """Five steps of the tiny model (weight decay on matrices only, clipping at 1.0) with the
    trainer's optimizer and with torch's for-loop implementation of the same algorithm."""
    cfg = tiny("baseline", 0, 5, f"recipe.optimizer={optimizer}", "recipe.lr=1e-2")
    fused_model = plan(cfg.model).build(0)
    loop_model = copy.deepcopy(fused_model)
    fused = build_optimizer(fused_model, cfg.recipe)
    kind = torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW
    r = cfg.recipe
    loop = kind(param_groups(loop_model, r.weight_decay), lr=r.lr, betas=r.betas, eps=r.eps,
                fused=False, foreach=False)
    batch = torch.randint(0, cfg.model.vocab_size, (4, 32),
                          generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            lm_loss(model(batch), batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    start = plan(cfg.model).build(0)
    moved = 0.0
    for (name, a), b in zip(fused_model.named_parameters(), loop_model.parameters(),
                            strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
        moved = max(moved, (a - start.get_parameter(name)).abs().max().item())
    assert moved > 1e-2  # the weights did move: five steps at lr 1e-2
