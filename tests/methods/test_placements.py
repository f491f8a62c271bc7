"""Reference tests of the norm placements: sandwich, Peri-LN, HybridNorm(*), Mix-LN, DeepNorm,
LayerNorm Scaling. Each equation is recomputed on plain tensors
(tests/methods/norm_reference.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.build import build_model, plan
from tests.methods.norm_reference import Sites, reference_logits
from tests.reference import randomize_gains


def cfg_for(method: str, **kw: object) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=40,
                max_seq_len=16, method=method, tie_embeddings=False)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


IDX = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(3))


def check(method: str, sites: Sites, cfg: ModelConfig | None = None, **kw: object) -> None:
    cfg = cfg or cfg_for(method)
    model = build_model(cfg, seed=1).double()
    randomize_gains(model)
    ref = reference_logits(model, IDX, cfg, sites, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(model(IDX), ref, rtol=1e-9, atol=1e-9)


def test_sandwich_equation() -> None:
    check("sandwich", lambda s, i: s in ("attn.pre", "attn.post", "ffn.pre", "ffn.post", "final"))


def test_peri_ln_equation() -> None:
    check("peri_ln", lambda s, i: s in ("embed", "attn.pre", "attn.post", "ffn.pre", "ffn.post",
                                        "final"))


def test_hybrid_norm_equation() -> None:
    # attention: x' = x + Attn_QKVnorm(x); FFN: y = N(x') + FFN(N(x')); final norm
    check("hybrid_norm", lambda s, i: s in ("attn.residual", "final"), qkv_norm=True)


def test_hybrid_norm_seed002_equation() -> None:
    # seed 002 Appendix B.15: x' = x + Attn(N(x)); y = N(x' + FFN(x')); final norm; no QKV norms
    check("hybrid_norm(form=seed002)", lambda s, i: s in ("attn.pre", "ffn.residual", "final"))
    p = plan(cfg_for("hybrid_norm(form=seed002)"))
    base = plan(cfg_for("baseline"))
    assert p.count_params() == base.count_params()  # two d-wide norms per block, as baseline


def test_hybrid_norm_forms_refused_in_one_line() -> None:
    with pytest.raises(ModbenchError, match="must be one of zhuo, seed002"):
        plan(cfg_for("hybrid_norm(form=olmo)"))
    with pytest.raises(ModbenchError, match="no seed002 form"):
        plan(cfg_for("hybrid_norm_star(form=seed002)"))


def test_hybrid_norm_star_equation() -> None:
    def sites(s: str, i: int) -> bool:
        if i == 0:
            return s in ("attn.pre", "ffn.pre")
        return s in ("attn.residual", "final")

    check("hybrid_norm_star", sites, qkv_norm=True)


def test_hybrid_norm_composes_with_qknorm() -> None:
    check("hybrid_norm+qknorm", lambda s, i: s in ("attn.residual", "final"), qkv_norm=True)


# ---------------------------------------------------------------------------- Mix-LN


@pytest.mark.parametrize("layers,post", [(12, 3), (24, 6)])  # the code's POST_NUM
def test_mix_ln_layer_assignment(layers: int, post: int) -> None:
    cfg = cfg_for("mix_ln", n_layers=layers, d_model=8, n_heads=2, n_kv_heads=1, d_ff=8)
    model = build_model(cfg)
    for i, block in enumerate(model.blocks):
        for sub in (block.attn, block.ffn):
            is_post = i < post
            assert isinstance(sub.pre_norm, nn.Identity) == is_post, (i, sub.name)
            assert isinstance(sub.residual_norm, nn.Identity) != is_post, (i, sub.name)
            assert isinstance(sub.post_norm, nn.Identity)
    assert not isinstance(model.final_norm, nn.Identity)


def test_mix_ln_equation() -> None:
    cfg = cfg_for("mix_ln(fraction=0.5)", n_layers=4)

    def sites(s: str, i: int) -> bool:
        if s == "final":
            return True
        if s == "embed":
            return False
        return s.endswith(".residual") if i < 2 else s.endswith(".pre")

    check("mix_ln(fraction=0.5)", sites, cfg=cfg)


# -------------------------------------------------------------------------- DeepNorm


@pytest.mark.parametrize("layers", [3, 12])
def test_deepnorm_constants_and_scaled_matrices(layers: int) -> None:
    kw = dict(n_layers=layers, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24)
    base = build_model(cfg_for("post_ln", **kw), seed=5)
    deep = build_model(cfg_for("deepnorm", **kw), seed=5)
    alpha, beta = (2 * layers) ** 0.25, (8 * layers) ** -0.25  # decoder-only DeepNet
    assert deep.blocks[0].attn.merge.alpha == pytest.approx(alpha)
    sb, sd = base.state_dict(), deep.state_dict()
    assert sb.keys() == sd.keys()
    scaled = ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for k in sb:
        factor = beta if any(f".core.{m}." in k for m in scaled) else 1.0
        torch.testing.assert_close(sd[k], sb[k] * factor, rtol=1e-6, atol=0, msg=k)
    # q, k, embedding and head untouched
    q = "blocks.0.attn.core.q_proj.weight"
    assert torch.equal(sd[q], sb[q])
    assert torch.equal(sd["head.weight"], sb["head.weight"])


def test_deepnorm_equation() -> None:
    cfg = cfg_for("deepnorm")
    check("deepnorm", lambda s, i: s in ("attn.residual", "ffn.residual", "final"),
          alpha=(2 * cfg.n_layers) ** 0.25)


def test_deepnorm_with_comt_scales_the_wrapped_linear() -> None:
    kw = dict(n_layers=2)
    base = build_model(cfg_for("post_ln+comt", **kw), seed=2)
    deep = build_model(cfg_for("deepnorm+comt", **kw), seed=2)
    beta = 16 ** -0.25
    a = base.blocks[1].ffn.core.down_proj.inner.weight
    b = deep.blocks[1].ffn.core.down_proj.inner.weight
    torch.testing.assert_close(b, a * beta)


def test_deepnorm_with_relu2_scales_up_and_down() -> None:
    """The two-matrix FFN has no gate: DeepNorm scales W_v, W_o, W_up and W_down by
    beta = (8L)^-1/4 and leaves the rest as the same seed's plain relu2 model draws them."""
    layers = 3
    kw = dict(n_layers=layers, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24)
    base = build_model(cfg_for("relu2", **kw), seed=4).state_dict()
    deep = build_model(cfg_for("deepnorm+relu2", **kw), seed=4).state_dict()
    beta = (8 * layers) ** -0.25
    linear = [k for k in base if k.endswith("_proj.weight") or k in ("embed.weight", "head.weight")]
    assert len(linear) == 6 * layers + 2 and not any("gate_proj" in k for k in deep)
    for k in linear:
        factor = beta if k.split(".")[-2] in ("v_proj", "o_proj", "up_proj", "down_proj") else 1
        torch.testing.assert_close(deep[k], base[k] * factor, rtol=1e-6, atol=0, msg=k)
    up = "blocks.1.ffn.core.up_proj.weight"
    assert not torch.equal(deep[up], base[up])


def test_deepnorm_refuses_projections_that_are_not_linear() -> None:
    with pytest.raises(ModbenchError, match="deepnorm scales the W_v projection") as err:
        build_model(cfg_for("deepnorm+tokenformer"))
    assert "\n" not in str(err.value) and "cannot be combined" in str(err.value)


def test_deepnorm_refuses_an_ffn_without_linear_layers() -> None:
    class NoMatrices(nn.Module):
        def forward(self, x: torch.Tensor, ctx: object) -> torch.Tensor:
            return x

    p = plan(cfg_for("deepnorm"))
    p.spec.fill("ffn", lambda cfg, build, layer: NoMatrices(), by="custom")
    with pytest.raises(ModbenchError, match=r"FFN projections \(W_gate, W_up or W_down\)"):
        p.build()


def test_deepnorm_refuses_other_merge_or_placement() -> None:
    for other in ("layerscale", "mix_ln", "sandwich"):
        with pytest.raises(ModbenchError, match="deepnorm"):
            build_model(cfg_for(f"deepnorm+{other}"))


# ---------------------------------------------------------------- LayerNorm Scaling


def test_ln_scaling_factor_per_layer() -> None:
    model = build_model(cfg_for("ln_scaling", n_layers=6))
    for i, block in enumerate(model.blocks):
        for sub in (block.attn, block.ffn):
            assert sub.pre_norm.scale == pytest.approx(1 / math.sqrt(i + 1))  # l = index + 1
    assert isinstance(model.final_norm, type(model.blocks[0].attn.pre_norm.norm))  # unscaled


def test_ln_scaling_equation() -> None:
    check("ln_scaling", lambda s, i: s in ("attn.pre", "ffn.pre", "final"),
          pre_scale=lambda i: 1 / math.sqrt(i + 1), pre_key="pre_norm.norm.weight")


def test_ln_scaling_with_mix_ln_scales_only_pre_ln_layers() -> None:
    model = build_model(cfg_for("mix_ln(fraction=0.5)+ln_scaling", n_layers=4))
    assert isinstance(model.blocks[1].attn.pre_norm, nn.Identity)
    assert model.blocks[2].attn.pre_norm.scale == pytest.approx(1 / math.sqrt(3))


@pytest.mark.parametrize("placement", ["post_ln", "deepnorm", "hybrid_norm"])
def test_ln_scaling_refuses_placements_without_input_norms(placement: str) -> None:
    with pytest.raises(ModbenchError, match="no input norms"):
        build_model(cfg_for(f"{placement}+ln_scaling"))
