"""Differential attention: lambda_init by layer, and the decoder equation with head pairs."""

from __future__ import annotations

import math

import pytest
import torch

from modbench.errors import ModbenchError
from modbench.methods.build import build_model
from tests.methods.attn_reference import (
    IDX,
    assert_matches,
    built,
    causal,
    decoder,
    qkv,
    small_cfg,
    softmax_weights,
)
from tests.reference import rms


@pytest.mark.parametrize("layer,expected", [(0, 0.2), (1, 0.8 - 0.6 * math.exp(-0.3)),
                                            (5, 0.8 - 0.6 * math.exp(-1.5))])
def test_lambda_init_by_layer(layer: int, expected: float) -> None:
    model = build_model(small_cfg("diff_attn", n_layers=6), seed=0)
    kern = model.blocks[layer].attn.core.kernel
    assert kern.lambda_init == pytest.approx(expected, abs=1e-12)
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        p = getattr(kern, name)
        assert p.shape == (8,) and 0.0 < p.std().item() < 0.3  # N(0, 0.1^2)


def diff_attention(x: torch.Tensor, sd: dict, p: str, cfg, layer: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    q, k, v = qkv(x, sd, p, cfg)
    t, dh = x.shape[0], q.shape[-1]
    h, h_kv = cfg.n_heads, cfg.n_kv_heads
    li = 0.8 - 0.6 * math.exp(-0.3 * layer)
    lam = (torch.exp(sd[p + "kernel.lambda_q1"] @ sd[p + "kernel.lambda_k1"])
           - torch.exp(sd[p + "kernel.lambda_q2"] @ sd[p + "kernel.lambda_k2"]) + li)
    vis = causal(t)
    outs = []
    for i in range(h // 2):
        j = i // (h // h_kv)  # the KV pair of diff-head i
        a1 = softmax_weights(q[2 * i] @ k[2 * j].T / math.sqrt(dh), vis)
        a2 = softmax_weights(q[2 * i + 1] @ k[2 * j + 1].T / math.sqrt(dh), vis)
        vv = torch.cat([v[2 * j], v[2 * j + 1]], dim=-1)
        o = (a1 - lam * a2) @ vv
        outs.append(rms(o, sd[p + "kernel.subln.weight"], 1e-5) * (1 - li))
    return torch.cat(outs, dim=-1) @ sd[p + "o_proj.weight"].T


@pytest.mark.parametrize("shape", [dict(), dict(n_heads=4, n_kv_heads=4), dict(n_heads=8,
                                                                                n_kv_heads=2)])
def test_decoder_equation(shape: dict) -> None:
    model, cfg = built("diff_attn", scale=0.3, **shape)
    assert_matches(model, decoder(model, IDX, cfg, attn=lambda x, sd, p, ly, sh:
                                  diff_attention(x, sd, p, cfg, ly)))


def test_odd_heads_refused() -> None:
    with pytest.raises(ModbenchError, match="even"):
        build_model(small_cfg("diff_attn", n_heads=4, n_kv_heads=1))


def test_odd_heads_of_one_layer_refused() -> None:
    """Under the shape slot each layer has its own head counts (here layer 0 gets 2 query and
    1 KV head from layerwise_scaling): an odd one is refused in one line, naming the layer."""
    cfg = small_cfg("layerwise_scaling(match=false)+diff_attn", n_heads=4, n_kv_heads=2,
                    n_layers=3)
    with pytest.raises(ModbenchError, match="layer 0 has n_heads=2 and n_kv_heads=1") as err:
        build_model(cfg)
    assert "\n" not in str(err.value)
