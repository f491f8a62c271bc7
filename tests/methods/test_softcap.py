"""Softmax-Cap: hard clamp and soft tanh against the equation, fast path for a slack cap, and
the FlexAttention path on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from modbench.methods.softcap import HardCapKernel, SoftCapKernel
from modbench.model.stream import ForwardContext
from tests.methods.attn_reference import (
    IDX,
    assert_matches,
    built,
    decoder,
    softmax_weights,
    standard_attention,
)


def ref_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cap_fn) -> torch.Tensor:  # type: ignore[no-untyped-def]
    h, t = q.shape[1], q.shape[2]
    group = h // k.shape[1]
    vis = torch.ones(t, t, dtype=torch.bool).tril()
    out = torch.zeros(q.shape[0], h, t, v.shape[-1], dtype=q.dtype)
    for b in range(q.shape[0]):
        for i in range(h):
            a = q[b, i] @ k[b, i // group].T / math.sqrt(q.shape[-1])
            out[b, i] = softmax_weights(cap_fn(a), vis) @ v[b, i // group]
    return out


CTX = ForwardContext(cos=torch.zeros(1), sin=torch.zeros(1), seq_len=9)


@pytest.mark.parametrize("form", ["hard", "soft"])
@pytest.mark.parametrize("magnitude", [0.1, 30.0])  # cap slack (fast path) / binding
def test_kernel_equation(form: str, magnitude: float) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64) * magnitude
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) * magnitude
    v = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    cap = 5.0
    if form == "hard":
        kern, fn = HardCapKernel(cap), (lambda a: a.clamp(-cap, cap))
        assert kern.cap_cannot_bind(q, k) == (magnitude < 1)
    else:
        kern, fn = SoftCapKernel(cap), (lambda a: cap * torch.tanh(a / cap))
    torch.testing.assert_close(kern(q, k, v, CTX), ref_kernel(q, k, v, fn), rtol=1e-9,
                               atol=1e-9)


@pytest.mark.parametrize("form", ["hard", "soft"])
def test_decoder_equation(form: str) -> None:
    cap = 2e-3  # small enough to bind on the init-scale logits
    model, cfg = built(f"softcap(cap={cap},form={form})")

    def fn(a: torch.Tensor, i: int) -> torch.Tensor:
        return a.clamp(-cap, cap) if form == "hard" else cap * torch.tanh(a / cap)

    assert_matches(model, decoder(model, IDX, cfg, attn=lambda x, sd, p, ly, sh:
                                  standard_attention(x, sd, p, cfg, logit_fn=fn)))


def test_options_parse_and_validate() -> None:
    from modbench.errors import ModbenchError
    from modbench.methods import parse_methods
    from modbench.methods.build import build_model
    from tests.methods.attn_reference import small_cfg

    (m,) = parse_methods("softcap(cap=30,form=soft)")
    assert m.opts.cap == 30.0 and m.opts.form == "soft" and m.label == "softcap(cap=30.0,form=soft)"
    with pytest.raises(ModbenchError, match="form"):
        build_model(small_cfg("softcap(form=tanh)"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention path needs CUDA")
@pytest.mark.parametrize("form", ["hard", "soft"])
def test_flex_path_matches_explicit(form: str) -> None:  # pragma: no cover - GPU only
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 128, 64, device="cuda", generator=g) * 4
    k = torch.randn(2, 2, 128, 64, device="cuda", generator=g) * 4
    v = torch.randn(2, 2, 128, 64, device="cuda", generator=g)
    kern = (HardCapKernel if form == "hard" else SoftCapKernel)(3.0)
    got = kern(q, k, v, CTX)
    want = super(type(kern), kern).forward(q, k, v, CTX)  # the explicit path
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
