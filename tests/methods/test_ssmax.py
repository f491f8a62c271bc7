"""SSMax: per-position scaling s_h log(i + 1) of the logits, its init, and the decoder."""

from __future__ import annotations

import math

import torch

from modbench.methods.build import build_model
from modbench.model.stream import ForwardContext
from tests.methods.attn_reference import (
    IDX,
    assert_matches,
    built,
    decoder,
    small_cfg,
    standard_attention,
)


def test_per_position_scaling() -> None:
    model = build_model(small_cfg("ssmax"), seed=0)
    mod = model.blocks[1].attn.core.qk_post
    with torch.no_grad():
        mod.s.copy_(torch.tensor([0.3, 0.5, 0.7, 0.9]))
    q = torch.randn(2, 4, 10, 8)
    k = torch.randn(2, 2, 10, 8)
    q2, k2 = mod(q, k, ForwardContext(cos=torch.zeros(1), sin=torch.zeros(1), seq_len=10))
    assert torch.equal(k2, k)
    for h, s in enumerate([0.3, 0.5, 0.7, 0.9]):
        for i in range(10):
            torch.testing.assert_close(q2[:, h, i], q[:, h, i] * s * math.log(i + 1))
    assert (q2[:, :, 0] == 0).all()  # one visible key: log 1 = 0


def test_init_is_inverse_log_of_training_length() -> None:
    model = build_model(small_cfg("ssmax", max_seq_len=16), seed=0)
    s = model.blocks[0].attn.core.qk_post.s
    torch.testing.assert_close(s, torch.full((4,), 1 / math.log(16)))
    s_opt = build_model(small_cfg("ssmax(init=0.43)"), seed=0).blocks[2].attn.core.qk_post.s
    torch.testing.assert_close(s_opt, torch.full((4,), 0.43))


def test_decoder_equation() -> None:
    model, cfg = built("ssmax")
    sd = model.state_dict()

    def attn(x: torch.Tensor, sdd: dict, p: str, layer: int, shared: dict) -> torch.Tensor:
        s = sd[p + "qk_post.s"].double()
        t = x.shape[0]
        pos = torch.tensor([math.log(i + 1) for i in range(t)], dtype=torch.float64)
        return standard_attention(x, sdd, p, cfg,
                                  logit_fn=lambda a, i: a * (s[i] * pos)[:, None])

    assert_matches(model, decoder(model, IDX, cfg, attn=attn))
