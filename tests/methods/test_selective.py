"""Selective attention: the accumulated mask F from its definition, and the decoder equation."""

from __future__ import annotations

import torch

from modbench.methods.build import build_model
from tests.methods.attn_reference import (
    IDX,
    assert_matches,
    built,
    decoder,
    logits_of,
    qkv,
    small_cfg,
    standard_attention,
)


def selection(a0: torch.Tensor) -> torch.Tensor:
    """F[i, j] = sum_{k < i} S[k, j], S[k, j] = ReLU(a0[k, j]) for 1 <= j < k, else 0."""
    t = a0.shape[0]
    f = torch.zeros_like(a0)
    for i in range(t):
        for j in range(t):
            f[i, j] = sum((torch.relu(a0[k, j]) for k in range(i) if 1 <= j < k),
                          torch.tensor(0.0, dtype=a0.dtype))
    return f


def test_decoder_equation() -> None:
    model, cfg = built("selective")

    def attn(x: torch.Tensor, sd: dict, p: str, layer: int, shared: dict) -> torch.Tensor:
        q, k, _ = qkv(x, sd, p, cfg)
        f = selection(logits_of(q, k, 0, cfg.n_heads))
        return standard_attention(x, sd, p, cfg, logit_fn=lambda a, i: a - f)

    assert_matches(model, decoder(model, IDX, cfg, attn=attn))


def test_mask_is_not_trivial() -> None:
    """With large logits the mask changes the output (so the test above means something)."""
    cfg = small_cfg("selective")
    base = build_model(small_cfg("baseline"), seed=3)
    sel = build_model(cfg, seed=3)
    with torch.no_grad():
        for m in (base, sel):
            for b in m.blocks:
                b.attn.core.q_proj.weight.mul_(40)
                b.attn.core.k_proj.weight.mul_(40)
        assert not torch.allclose(base(IDX), sel(IDX), atol=1e-4)


def test_selection_properties() -> None:
    from modbench.methods.selective import selection_mask

    a0 = torch.randn(2, 7, 7, dtype=torch.float64)
    vis = torch.ones(7, 7, dtype=torch.bool).tril()
    f = selection_mask(a0, vis)
    for b in range(2):
        torch.testing.assert_close(f[b], selection(a0[b]))
    assert (f[:, :, 0] == 0).all() and (torch.diagonal(f, dim1=-2, dim2=-1) == 0).all()
    assert (f[:, 0] == 0).all() and (f[:, 1] == 0).all()  # queries 0, 1 are never masked
