"""GeGLU: W_down(GELU(W_gate x) * W_up x), same parameters as SwiGLU."""

from __future__ import annotations

import math

import pytest
import torch

from tests.methods.attn_reference import (
    IDX,
    assert_matches,
    built,
    decoder,
    standard_attention,
    swiglu,
)


def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("method,act", [("geglu", gelu_exact),
                                        ("geglu(approximate=tanh)", gelu_tanh)])
def test_decoder_equation(method: str, act) -> None:  # type: ignore[no-untyped-def]
    model, cfg = built(method)
    assert_matches(model, decoder(model, IDX, cfg,
                                  ffn=lambda x, sd, p, ly: swiglu(x, sd, p, ly, act=act)))


def test_qknorm_plus_geglu() -> None:
    model, cfg = built("qknorm+geglu")
    assert_matches(model, decoder(
        model, IDX, cfg,
        attn=lambda x, sd, p, ly, sh: standard_attention(x, sd, p, cfg, qk_norm=True),
        ffn=lambda x, sd, p, ly: swiglu(x, sd, p, ly, act=gelu_exact)))
