"""Value residual: layer 0 is plain attention; later layers mix in layer 0's values."""

from __future__ import annotations

import pytest
import torch

from modbench.errors import ModbenchError
from modbench.methods.build import build_model
from tests.helpers import tiny
from tests.methods.attn_reference import (
    IDX,
    assert_matches,
    built,
    decoder,
    qkv,
    small_cfg,
    standard_attention,
)


def test_layer0_is_the_baseline() -> None:
    """Same seed, same weights: the first block's output equals the baseline's exactly."""
    base = build_model(small_cfg("baseline"), seed=2)
    vr = build_model(small_cfg("value_residual"), seed=2)
    outs = {}
    for name, m in (("base", base), ("vr", vr)):
        def hook(mod, args, out, name=name):  # type: ignore[no-untyped-def]
            outs[name] = out
        m.blocks[0].attn.core.register_forward_hook(hook)
        m(IDX)
    torch.testing.assert_close(outs["vr"], outs["base"], rtol=0, atol=0)
    assert not hasattr(vr.blocks[0].attn.core.v_path, "lam")
    assert vr.blocks[1].attn.core.v_path.lam.item() == 0.5
    assert not torch.allclose(base(IDX), vr(IDX))


def test_decoder_equation() -> None:
    model, cfg = built("value_residual")
    sd = model.state_dict()

    def attn(x: torch.Tensor, sdd: dict, p: str, layer: int, shared: dict) -> torch.Tensor:
        _, _, v = qkv(x, sdd, p, cfg)
        if layer == 0:
            shared["v1"] = v
            return standard_attention(x, sdd, p, cfg)
        lam = sd[p + "v_path.lam"].double()
        return standard_attention(x, sdd, p, cfg,
                                  v_fn=lambda vn: lam * shared["v1"] + (1 - lam) * vn)

    assert_matches(model, decoder(model, IDX, cfg, attn=attn))


def test_fixed_variant_has_no_parameters() -> None:
    model = build_model(small_cfg("value_residual(learnable=false)"), seed=0)
    base = build_model(small_cfg("baseline"), seed=0)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in base.parameters())


def test_refused_when_layers_have_other_value_shapes() -> None:
    """Under a per-layer shape plan (layerwise_scaling) the first layer's V_1 cannot be mixed
    into a layer with another KV-head count: a one-line error, not a silent broadcast."""
    cfg = tiny("value_residual+layerwise_scaling(match=false)", 0, 30,
               "model.n_layers=4").model
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 8))
    with pytest.raises(ModbenchError, match="value shape in every layer"):
        model(idx)
