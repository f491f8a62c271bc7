"""Pre-CRMSNorm: formula, shape, and equivalence with a converted Pre-LN model.

The conversion is written here from the paper (Jiang et al. 2023), on plain tensors: fold
each LayerNorm gain into the next linear layer, re-centre the embedding and the output
projections over the model dimension and drop its last entry, and replace each input weight
W by W[:, :-1] - W[:, -1:]."""

from __future__ import annotations

import pytest
import torch

from modbench.config import ModelConfig
from modbench.methods.build import build_model, count_params
from tests.reference import randomize_gains


def cfg_for(method: str, **kw: object) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40,
                max_seq_len=16, method=method, tie_embeddings=False)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def test_crmsnorm_formula() -> None:
    model = build_model(cfg_for("crmsnorm"))
    norm = model.blocks[0].attn.pre_norm
    x = torch.randn(4, 31, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    d = 32
    ref = x / torch.sqrt(((x * x).sum(-1, keepdim=True) + x.sum(-1, keepdim=True) ** 2) / d
                         + 1e-5)
    torch.testing.assert_close(norm(x), ref)
    # = RMSNorm of the zero-mean vector [x, -sum x] restricted to its first d - 1 entries
    full = torch.cat([x, -x.sum(-1, keepdim=True)], -1)
    torch.testing.assert_close(norm(x), (full / torch.sqrt((full * full).mean(-1, keepdim=True)
                                                           + 1e-5))[:, :-1])


def test_crmsnorm_shapes() -> None:
    model = build_model(cfg_for("crmsnorm"))
    assert model.embed.weight.shape == (61, 31)
    assert model.blocks[0].attn.core.q_proj.weight.shape == (32, 31)  # heads keep d_h = 8
    assert model.blocks[0].attn.core.o_proj.weight.shape == (31, 32)
    assert not list(model.blocks[0].attn.pre_norm.parameters())  # no affine
    assert model.cfg.head_dim == 8 and model.cfg.d_model == 31


@pytest.mark.parametrize("tied", [False, True])
def test_crmsnorm_parameter_count(tied: bool) -> None:
    base = cfg_for("baseline", tie_embeddings=tied)
    c = cfg_for("crmsnorm", tie_embeddings=tied)
    expected = count_params(cfg_for("baseline", tie_embeddings=tied)) - (
        5 * 32  # 2 L + 1 gains
        + 61 * (1 if tied else 2)  # embedding (and head) column
        + 2 * (2 * 4 * 8 + 2 * 2 * 8 + 3 * 40))  # one row/column less in every matrix
    assert count_params(c) == expected
    assert count_params(base) > count_params(c)


def convert(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Pre-LN (LayerNorm without bias) state dict -> Pre-CRMSNorm state dict."""

    def recentre_out(w: torch.Tensor) -> torch.Tensor:  # (d_out = d, d_in): output side
        return (w - w.mean(0, keepdim=True))[:-1]

    def compress_in(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:  # (d_out, d_in = d)
        w = w * g  # fold the preceding norm's gain: W diag(g)
        return w[:, :-1] - w[:, -1:]

    out: dict[str, torch.Tensor] = {}
    e = sd["embed.weight"]  # (V, d): each row is an output vector in the model space
    out["embed.weight"] = (e - e.mean(1, keepdim=True))[:, :-1]
    for i in range(n_layers):
        p = f"blocks.{i}."
        ga, gf = sd[p + "attn.pre_norm.weight"], sd[p + "ffn.pre_norm.weight"]
        for m in ("q", "k", "v"):
            k = p + f"attn.core.{m}_proj.weight"
            out[k] = compress_in(sd[k], ga)
        out[p + "attn.core.o_proj.weight"] = recentre_out(sd[p + "attn.core.o_proj.weight"])
        for m in ("gate", "up"):
            k = p + f"ffn.core.{m}_proj.weight"
            out[k] = compress_in(sd[k], gf)
        out[p + "ffn.core.down_proj.weight"] = recentre_out(sd[p + "ffn.core.down_proj.weight"])
    out["head.weight"] = compress_in(sd["head.weight"], sd["final_norm.weight"])
    return out


def test_pre_ln_converted_to_pre_crmsnorm_gives_the_same_logits() -> None:
    pre_ln = build_model(cfg_for("layernorm(bias=false)"), seed=3).double()
    randomize_gains(pre_ln)  # non-trivial LayerNorm gains, folded by the conversion
    crms = build_model(cfg_for("crmsnorm"), seed=4).double()
    converted = convert(pre_ln.state_dict(), 2)
    missing = crms.load_state_dict(converted, strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys
    idx = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(crms(idx), pre_ln(idx), rtol=1e-9, atol=1e-9)
