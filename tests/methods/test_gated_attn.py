"""Gated attention: sigmoid(x W_theta) per head or per channel on each head's output."""

from __future__ import annotations

import pytest
import torch

from tests.methods.attn_reference import IDX, assert_matches, built, decoder, standard_attention


@pytest.mark.parametrize("form", ["head", "elementwise"])
def test_decoder_equation(form: str) -> None:
    model, cfg = built(f"gated_attn(form={form})")
    dh = cfg.d_model // cfg.n_heads

    def attn(x: torch.Tensor, sd: dict, p: str, layer: int, shared: dict) -> torch.Tensor:
        w = sd[p + "out_gate.proj.weight"]  # (H or H d_h, d)
        g = torch.sigmoid(x @ w.T)

        def gate(xx: torch.Tensor, i: int) -> torch.Tensor:
            return g[:, i:i + 1] if form == "head" else g[:, i * dh:(i + 1) * dh]

        return standard_attention(x, sd, p, cfg, gate=gate)

    assert_matches(model, decoder(model, IDX, cfg, attn=attn))


def test_with_qknorm() -> None:
    model, cfg = built("gated_attn+qknorm")

    def attn(x: torch.Tensor, sd: dict, p: str, layer: int, shared: dict) -> torch.Tensor:
        g = torch.sigmoid(x @ sd[p + "out_gate.proj.weight"].T)
        return standard_attention(x, sd, p, cfg, gate=lambda xx, i: g[:, i:i + 1],
                                  qk_norm=True)

    assert_matches(model, decoder(model, IDX, cfg, attn=attn))
