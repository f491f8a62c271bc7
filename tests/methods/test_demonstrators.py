"""Reference tests of the three demonstrator methods: each recomputes the method's equation
independently (tests/reference.py) and compares with the model built from the registry."""

from __future__ import annotations

import pytest
import torch

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.build import build_model
from modbench.methods.layerscale import cait_init
from tests.reference import decoder_logits, randomize_gains


def cfg_for(method: str, **kw: object) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40,
                max_seq_len=16, method=method)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


IDX = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(7))


def check(method: str, **ref_kw: object) -> None:
    cfg = cfg_for(method)
    model = build_model(cfg, seed=1).double()
    randomize_gains(model)
    ref = decoder_logits(model, IDX, cfg, **ref_kw)  # type: ignore[arg-type]
    torch.testing.assert_close(model(IDX), ref, rtol=1e-9, atol=1e-9)


def test_post_ln_equation() -> None:
    check("post_ln", placement="post")
    model = build_model(cfg_for("post_ln"))
    # no input norm on either sublayer; a norm after each residual merge
    assert isinstance(model.blocks[0].attn.pre_norm, torch.nn.Identity)
    assert isinstance(model.blocks[0].ffn.pre_norm, torch.nn.Identity)
    assert not isinstance(model.blocks[0].ffn.residual_norm, torch.nn.Identity)


def test_layerscale_equation() -> None:
    check("layerscale", layerscale=True)


@pytest.mark.parametrize("depth,expected", [(2, 0.1), (18, 0.1), (24, 1e-5), (36, 1e-6)])
def test_layerscale_cait_init(depth: int, expected: float) -> None:
    # CaiT (Touvron et al. 2021): 0.1 up to depth 18, 1e-5 at 24, 1e-6 deeper
    assert cait_init(depth) == expected
    cfg = cfg_for("layerscale", n_layers=depth, d_model=16, n_heads=2, n_kv_heads=1, d_ff=16)
    model = build_model(cfg)
    scales = [b.attn.merge.scale for b in model.blocks] + [b.ffn.merge.scale for b in model.blocks]
    assert all(torch.all(s == torch.tensor(expected, dtype=s.dtype)) for s in scales)


def test_layerscale_init_option() -> None:
    model = build_model(cfg_for("layerscale(init=0.003)"))
    assert torch.allclose(model.blocks[1].ffn.merge.scale, torch.tensor(0.003))


@pytest.mark.parametrize("scope", ["head", "full"])
def test_qknorm_equation(scope: str) -> None:
    method = "qknorm" if scope == "head" else "qknorm(scope=full)"
    check(method, qk_scope=scope)


def test_qknorm_bad_scope() -> None:
    with pytest.raises(ModbenchError, match="scope"):
        build_model(cfg_for("qknorm(scope=diagonal)"))


def test_post_ln_plus_qknorm_equation() -> None:
    check("post_ln+qknorm", placement="post", qk_scope="head")


def test_all_three_compose() -> None:
    check("post_ln+qknorm+layerscale", placement="post", qk_scope="head", layerscale=True)
