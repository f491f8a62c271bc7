"""Sigmoid attention: sigmoid(A + b - log n), causal zeros, no normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from modbench.methods.build import build_model
from tests.methods.attn_reference import (
    IDX,
    assert_matches,
    built,
    decoder,
    small_cfg,
    standard_attention,
)


@pytest.mark.parametrize("method,n", [("sigmoid", 16), ("sigmoid(n=2048)", 2048)])
def test_decoder_equation(method: str, n: int) -> None:
    model, cfg = built(method)
    sd = model.state_dict()

    def attn(x: torch.Tensor, sdd: dict, p: str, layer: int, shared: dict) -> torch.Tensor:
        b = sd[p + "kernel.bias"].double()
        return standard_attention(
            x, sdd, p, cfg,
            weights=lambda a, vis: torch.where(vis, torch.sigmoid(a + b - math.log(n)), 0.0))

    assert_matches(model, decoder(model, IDX, cfg, attn=attn))


def test_bias_init_and_fixed_variant() -> None:
    model = build_model(small_cfg("sigmoid"), seed=0)
    assert all(b.attn.core.kernel.bias.item() == 0.0 for b in model.blocks)
    fixed = build_model(small_cfg("sigmoid(learnable_bias=false)"), seed=0)
    assert fixed.blocks[0].attn.core.kernel.bias is None
