"""Softpick: the stable kernel against the direct formula, and the decoder equation."""

from __future__ import annotations

import torch

from modbench.methods.softpick import softpick
from tests.methods.attn_reference import IDX, built, decoder, standard_attention


def direct(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """ReLU(e^x - 1) / (sum_visible |e^x - 1| + eps), straight from the definition."""
    e = torch.exp(x.double()) - 1
    num = torch.where(mask, torch.relu(e), 0.0)
    den = torch.where(mask, e.abs(), 0.0).sum(-1, keepdim=True) + eps
    return num / den


def random_case() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 6, generator=g) * 3
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(3, 6, 6).clone()
    return x, mask


def test_matches_definition_on_random_causal_logits() -> None:
    x, mask = random_case()
    out = softpick(x.double(), mask)
    ref = direct(x, mask)
    # when the row max m > 0 the stable form divides eps by e^m, as the official code does
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    assert (out[~mask] == 0).all()
    assert (out >= 0).all() and (out.sum(-1) <= 1 + 1e-9).all()


def test_all_masked_and_extreme_rows() -> None:
    x, mask = random_case()
    mask[0, 2] = False  # an all-masked row
    x[1, 3, :4] = torch.tensor([1e4, 3.0, -2.0, 0.5])  # one huge logit
    x[1, 4, :5] = -1e4  # every visible logit very negative
    x[2, 5, :6] = 80.0  # e^80 overflows float32 in the direct form
    x.requires_grad_(True)
    out = softpick(x, mask)  # float32
    assert torch.isfinite(out).all()
    assert (out[0, 2] == 0).all()
    torch.testing.assert_close(out[1, 3, 0], torch.tensor(1.0), rtol=1e-6, atol=1e-6)
    assert (out[1, 3, 1:] == 0).all()
    assert (out[1, 4] == 0).all()
    torch.testing.assert_close(out[2, 5], torch.full((6,), 1 / 6), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    # rows not touched still match the definition
    torch.testing.assert_close(out[0, 3].double(), direct(x.detach(), mask)[0, 3],
                               rtol=1e-5, atol=1e-6)


def test_decoder_equation() -> None:
    model, cfg = built("softpick")
    ref = decoder(model, IDX, cfg, attn=lambda x, sd, p, ly, sh: standard_attention(
        x, sd, p, cfg, weights=lambda a, vis: direct(a, vis.expand_as(a))))
    torch.testing.assert_close(model(IDX), ref, rtol=1e-6, atol=1e-8)
