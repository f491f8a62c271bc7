"""CoMT: identity at initialisation, which projections each ``modules`` option modulates,
the modulator equation, the parameter count per hidden size, and Post-LN + CoMT."""

from __future__ import annotations

import pytest
import torch

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods import parse_methods
from modbench.methods.build import build_model, count_params

ROLES = {"q": "attn.core.q_proj", "k": "attn.core.k_proj", "v": "attn.core.v_proj",
         "o": "attn.core.o_proj", "gate": "ffn.core.gate_proj", "up": "ffn.core.up_proj",
         "down": "ffn.core.down_proj"}
EXPECTED = {  # the CoMT preprint's Table 4 and its text
    "all": {"q", "k", "v", "o", "gate", "up", "down"},
    "self_attention": {"q", "k", "v", "o"},
    "self-attention": {"q", "k", "v", "o"},
    "mlp": {"gate", "up", "down"},
    "only_first": {"q", "k", "v", "up", "gate"},
    "only_last": {"o", "down"},
    "only_qk": {"q", "k"},
}


def cfg_for(method: str, **kw: object) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40,
                max_seq_len=16, method=method, tie_embeddings=False)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


IDX = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("placement", ["", "post_ln+"])
def test_identity_at_init_with_the_baseline_weights(placement: str) -> None:
    base = build_model(cfg_for(placement[:-1] or "baseline"), seed=7)
    comt = build_model(cfg_for(placement + "comt"), seed=7)
    # same seed, same weights: the modulators are drawn after the generic pass
    sb = base.state_dict()
    for k, v in comt.state_dict().items():
        if ".mod_" in k:
            continue
        torch.testing.assert_close(v, sb[k.replace(".inner", "")], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(comt(IDX), base(IDX), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("modules", sorted(EXPECTED))
def test_modules_option_selects_projections(modules: str) -> None:
    model = build_model(cfg_for(f"comt(modules={modules})"))
    for block in model.blocks:
        got = {r for r, path in ROLES.items() if hasattr(block.get_submodule(path), "mod_in")}
        assert got == EXPECTED[modules]
    assert not hasattr(model.head, "mod_in")  # the LM head is never modulated


def test_bad_modules_option() -> None:
    with pytest.raises(ModbenchError, match="only_qk"):
        build_model(cfg_for("comt(modules=attention)"))


def test_modulator_equation() -> None:
    model = build_model(cfg_for("comt(hidden=4)"), seed=1).double()
    lin = model.blocks[1].ffn.core.up_proj
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lin.mod_out.copy_(torch.randn(lin.mod_out.shape, generator=g, dtype=torch.float64))
    x = torch.randn(3, 5, 32, generator=g, dtype=torch.float64)
    w, w1, w2 = lin.inner.weight, lin.mod_in, lin.mod_out
    h = x @ w1.T
    m = 2 * torch.sigmoid((h * torch.sigmoid(h)) @ w2.T)  # 2 sigma(W2 silu(W1 x))
    torch.testing.assert_close(lin(x), m * (x @ w.T))
    assert w1.shape == (4, 32) and w2.shape == (40, 4)


@pytest.mark.parametrize("hidden", [2, 4, 8, 16, 32])
def test_parameter_overhead_by_hidden(hidden: int) -> None:
    cfg = cfg_for(f"comt(hidden={hidden})")
    (m,) = parse_methods(cfg.method)
    # per layer: q (32+32), k (32+16), v (32+16), o (32+32), gate, up (32+40), down (40+32)
    per_layer = hidden * (64 + 48 + 48 + 64 + 72 + 72 + 72)
    assert m.extra_params(cfg) == 2 * per_layer
    assert count_params(cfg) - count_params(cfg_for("baseline")) == 2 * per_layer
    assert m.extra_flops(cfg, 16) == 2 * 2 * per_layer


def test_post_ln_comt_trains_a_step() -> None:
    model = build_model(cfg_for("post_ln+comt"), seed=0)
    from modbench.runtime.loss import lm_loss

    lm_loss(model(IDX), IDX).backward()
    lin = model.blocks[0].attn.core.q_proj
    assert lin.mod_out.grad is not None and lin.mod_out.grad.abs().sum() > 0


@pytest.mark.parametrize("method", ["comt(modules=mlp)+moe", "comt+moe", "comt+widenet",
                                    "comt+tokenformer"])
def test_a_sublayer_left_unmodulated_is_refused(method: str) -> None:
    """moe's experts, widenet's and TokenFormer's FFN make their projections themselves, so
    comt's FFN modulators would never be built: refused in one line, naming the sublayer."""
    with pytest.raises(ModbenchError, match=r"FFN's gate/up/down projections.*cannot be "
                                            r"combined.*modules=self_attention") as err:
        build_model(cfg_for(method))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method, modulated", [
    ("comt(modules=self_attention)+moe", {"q", "k", "v", "o"}),
    ("comt+relu2", {"q", "k", "v", "o", "up", "down"}),  # no gate in a two-matrix FFN
    ("comt(modules=only_first)+relu2", {"q", "k", "v", "up"}),
])
def test_what_exists_is_modulated(method: str, modulated: set[str]) -> None:
    model = build_model(cfg_for(method))
    for layer, block in enumerate(model.blocks):
        mods = {name.rsplit(".", 1)[0] for name, _ in block.named_parameters()
                if name.endswith("mod_in")}
        assert {r for r, path in ROLES.items() if path in mods} == modulated, layer
