"""TokenFormer: Pattention against an independent float64 reference, the init, the options,
growth (function preserved exactly; refusals; the all-zero saddle) and ``train.init_from``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.build import build_model
from modbench.methods.tokenformer import Pattention, grow_tokenformer
from modbench.model.transformer import Transformer
from modbench.runtime.checkpoint import load_checkpoint
from modbench.runtime.loss import lm_loss
from modbench.train.trainer import Callback, Trainer, train
from tests.helpers import read_metrics, tiny
from tests.reference import causal_softmax_attention, rope

G = torch.Generator().manual_seed(0)
SMALL = "tokenformer(slots=24,ffn_slots=40)"


def model_cfg(method: str, **shape: Any) -> ModelConfig:
    cfg = tiny(method).model
    for k, v in shape.items():
        setattr(cfg, k, v)
    return cfg


# ------------------------------------------------------------------ reference equations


def gelu(z: float) -> float:
    return 0.5 * z * (1.0 + math.erf(z / math.sqrt(2.0)))


def ref_theta(row: list[float], activation: str, m: int) -> list[float]:
    """Theta on one row of scores, element by element (plain Python floats)."""
    if activation == "l2_norm_gelu":
        norm = math.sqrt(sum(a * a for a in row))
        return [gelu(math.sqrt(m) * a / norm) for a in row]
    if activation == "gelu_l2_norm":
        g = [gelu(a) for a in row]
        norm = math.sqrt(sum(x * x for x in g))
        return [math.sqrt(m) * x / norm for x in g]
    e = [math.exp(a) for a in row]
    s = sum(abs(x) for x in e)
    return [m * x / s for x in e]


def ref_pattention(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, activation: str,
                   m: int) -> torch.Tensor:
    """Theta(x K^T) V for x (T, d_in), float64, with loops over tokens."""
    out = torch.zeros(x.shape[0], v.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        scores = [float(x[t] @ k[j]) for j in range(k.shape[0])]
        w = ref_theta(scores, activation, m)
        for j, wj in enumerate(w):
            out[t] += wj * v[j]
    return out


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    mu = x.mean(dim=-1, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps)


def ref_logits(model: Transformer, idx: torch.Tensor, activation: str,
               m_attn: int, m_ffn: int) -> torch.Tensor:
    """TokenFormer decoder in float64 from the equations: Pre-LN with non-parametric LN,
    Pattention q/k/v/o and FFN, standard causal softmax attention with RoPE, final LN with
    gain and bias, tied head."""
    c = model.cfg
    sd = {k: v.double() for k, v in model.state_dict().items()}
    h, h_kv, dh = c.n_heads, c.n_kv_heads, c.head_dim

    def pat(x: torch.Tensor, p: str, m: int) -> torch.Tensor:
        return ref_pattention(x, sd[p + ".key_param_tokens"], sd[p + ".value_param_tokens"],
                              activation, m)

    out = []
    for row in idx:
        x = sd["embed.weight"][row]
        t = x.shape[0]
        for i in range(c.n_layers):
            p = f"blocks.{i}."
            a = layer_norm(x, c.norm_eps)
            q = pat(a, p + "attn.core.q_proj", m_attn).view(t, h, dh).transpose(0, 1)
            k = pat(a, p + "attn.core.k_proj", m_attn).view(t, h_kv, dh).transpose(0, 1)
            v = pat(a, p + "attn.core.v_proj", m_attn).view(t, h_kv, dh).transpose(0, 1)
            y = causal_softmax_attention(rope(q), rope(k), v).transpose(0, 1).reshape(t, -1)
            x = x + pat(y, p + "attn.core.o_proj", m_attn)
            x = x + pat(layer_norm(x, c.norm_eps), p + "ffn.core.pattention", m_ffn)
        hfin = layer_norm(x, c.norm_eps) * sd["final_norm.weight"] + sd["final_norm.bias"]
        out.append(hfin @ sd["embed.weight"].T)
    return torch.stack(out)


@pytest.mark.parametrize("activation", ["l2_norm_gelu", "gelu_l2_norm", "softmax"])
def test_pattention_matches_reference(activation: str) -> None:
    p = Pattention(6, 5, 7, activation, norm_slots=3, key_std=0.5, value_std=0.5).double()
    p.modbench_init()
    x = torch.randn(2, 4, 6, generator=G, dtype=torch.float64)
    got = p(x)
    k, v = p.key_param_tokens.detach(), p.value_param_tokens.detach()
    for b in range(2):
        torch.testing.assert_close(got[b], ref_pattention(x[b], k, v, activation, 3),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", ["l2_norm_gelu", "softmax"])
def test_model_matches_reference(activation: str) -> None:
    cfg = model_cfg(f"tokenformer(slots=12,ffn_slots=20,activation={activation})")
    model = build_model(cfg, seed=0).double()
    with torch.no_grad():  # exercise the final LN's gain and bias
        model.final_norm.weight.uniform_(0.5, 1.5, generator=G)
        model.final_norm.bias.uniform_(-0.5, 0.5, generator=G)
    idx = torch.randint(0, cfg.vocab_size, (2, 9), generator=G)
    torch.testing.assert_close(model(idx), ref_logits(model, idx, activation, 12, 20),
                               rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------- structure and init


def test_structure_norms_and_init() -> None:
    cfg = model_cfg("tokenformer", n_layers=3, tie_embeddings=False)
    model = build_model(cfg, seed=0)
    d, std, wang = cfg.d_model, cfg.init_std, 2.0 / 3 / math.sqrt(cfg.d_model)
    names = dict(model.named_parameters())
    # input norms have no parameters; the final norm is a LayerNorm with gain and bias
    assert not any(".pre_norm." in n for n in names)
    assert torch.equal(names["final_norm.weight"], torch.ones(d))
    assert torch.equal(names["final_norm.bias"], torch.zeros(d))
    assert isinstance(model.head, torch.nn.Linear)  # the head stays a plain linear
    keys = torch.cat([p.flatten() for n, p in names.items() if n.endswith("key_param_tokens")])
    vals = torch.cat([p.flatten() for n, p in names.items()
                      if n.endswith("value_param_tokens")])
    assert keys.std().item() == pytest.approx(std, rel=0.05)
    assert vals.std().item() == pytest.approx(wang, rel=0.05)
    blk = model.blocks[0]
    assert names["blocks.0.attn.core.q_proj.key_param_tokens"].shape == (d, d)  # slots = d
    assert names["blocks.0.attn.core.k_proj.value_param_tokens"].shape == (d, cfg.n_kv_heads
                                                                           * cfg.head_dim)
    assert names["blocks.0.ffn.core.pattention.key_param_tokens"].shape == (4 * d, d)
    assert not hasattr(blk.ffn.core, "gate_proj")


@pytest.mark.parametrize("text,msg", [
    ("tokenformer(activation=relu)", "must be one of: l2_norm_gelu"),
    ("tokenformer(slots=0)", "slots=0 .* positive"),
    ("tokenformer(ffn_norm_slots=-1)", "ffn_norm_slots=-1"),
    ("tokenformer+relu2", "both set the ffn slot"),
    ("tokenformer+layernorm", "both set the norm slot"),
])
def test_bad_options_and_combinations(text: str, msg: str) -> None:
    with pytest.raises(ModbenchError, match=msg):
        build_model(model_cfg(text))


def test_norm_slots_sets_the_scale() -> None:
    """norm_slots m replaces n in sqrt(n): Theta's rows have L2 norm sqrt(m) before GeLU."""
    p = Pattention(4, 3, 10, "gelu_l2_norm", norm_slots=7, key_std=1.0, value_std=1.0)
    p.modbench_init()
    from modbench.methods.tokenformer import theta

    a = torch.randn(5, 10, generator=G)
    w = theta(a, "gelu_l2_norm", 7)
    torch.testing.assert_close(w.norm(dim=-1), torch.full((5,), math.sqrt(7.0)))


def test_causal_in_train_mode() -> None:
    cfg = model_cfg("tokenformer(activation=gelu_l2_norm)")
    model = build_model(cfg, seed=0).train()
    idx = torch.randint(0, cfg.vocab_size, (2, 20), generator=G)
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 5) % cfg.vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


# --------------------------------------------------------------------------------- growth


def _trained_like(cfg: ModelConfig) -> Transformer:
    """A model whose weights look trained: random tokens, non-trivial final norm."""
    model = build_model(cfg, seed=3).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=G, dtype=p.dtype) * 0.3)
    return model


@pytest.mark.parametrize("activation", ["l2_norm_gelu", "gelu_l2_norm"])
@pytest.mark.parametrize("with_target", [True, False])
def test_growth_preserves_logits_exactly(activation: str, with_target: bool) -> None:
    small = model_cfg(f"tokenformer(slots=16,ffn_slots=24,activation={activation})")
    big = model_cfg(f"tokenformer(slots=40,ffn_slots=64,activation={activation},"
                    "norm_slots=16,ffn_norm_slots=24)")
    old = _trained_like(small)
    new = build_model(big, seed=5).double()
    target = new.state_dict() if with_target else None
    grown = grow_tokenformer(old.state_dict(), small, big, target=target)
    new.load_state_dict(grown)
    idx = torch.randint(0, small.vocab_size, (3, 17), generator=G)
    with torch.no_grad():
        torch.testing.assert_close(new(idx), old(idx), rtol=0, atol=1e-10)
    k = grown["blocks.1.ffn.core.pattention.key_param_tokens"]
    v = grown["blocks.1.ffn.core.pattention.value_param_tokens"]
    assert k.shape == (64, small.d_model) and torch.equal(k[24:], torch.zeros(40, 64))
    assert torch.equal(k[:24], old.state_dict()["blocks.1.ffn.core.pattention.key_param_tokens"])
    if with_target:  # new values: the grown model's own (wang) init, not zero
        assert torch.equal(v[24:], target["blocks.1.ffn.core.pattention.value_param_tokens"][24:])
        assert v[24:].abs().sum() > 0
    else:
        assert torch.equal(v[24:], torch.zeros(40, 64))


def _new_token_grads(with_target: bool) -> tuple[float, float]:
    small = model_cfg(SMALL)
    big = model_cfg("tokenformer(slots=32,ffn_slots=56,norm_slots=24,ffn_norm_slots=40)")
    old = _trained_like(small)
    new = build_model(big, seed=5).double()
    new.load_state_dict(grow_tokenformer(old.state_dict(), small, big,
                                         target=new.state_dict() if with_target else None))
    idx = torch.randint(0, small.vocab_size, (2, 16), generator=G)
    lm_loss(new(idx), idx).backward()
    gk = sum(float(p.grad[24:].abs().sum()) for n, p in new.named_parameters()
             if n.endswith("attn.core.q_proj.key_param_tokens"))
    gv = sum(float(p.grad[24:].abs().sum()) for n, p in new.named_parameters()
             if n.endswith("attn.core.q_proj.value_param_tokens"))
    return gk, gv


def test_all_zero_new_tokens_get_no_gradient_but_initialised_values_do() -> None:
    """Why new V_P rows take the fresh init: with K_P and V_P rows both zero, the new tokens
    get exactly zero gradient (a saddle); with initialised V_P rows, K_P's rows learn."""
    assert _new_token_grads(with_target=False) == (0.0, 0.0)
    gk, gv = _new_token_grads(with_target=True)
    assert gk > 0 and gv == 0.0  # GeLU(0) = 0: the values learn once the keys have moved


@pytest.mark.parametrize("old,new,msg", [
    (SMALL, "tokenformer(slots=48,ffn_slots=40)", r"add norm_slots=24 .*tokenformer\(slots=48"),
    (SMALL, "tokenformer(slots=16,ffn_slots=40,norm_slots=24)", "cannot remove"),
    ("tokenformer(slots=24,ffn_slots=40,activation=softmax)",
     "tokenformer(slots=48,ffn_slots=40,norm_slots=24,activation=softmax)", "softmax"),
    (SMALL, "tokenformer(slots=24,ffn_slots=40,activation=gelu_l2_norm)", "activation"),
    ("baseline", SMALL, "needs a tokenformer model"),
])
def test_growth_refusals(old: str, new: str, msg: str) -> None:
    a, b = model_cfg(old), model_cfg(new)
    with pytest.raises(ModbenchError, match=msg):
        grow_tokenformer(build_model(a).state_dict(), a, b)


# ------------------------------------------------------------------ train.init_from


def test_train_grow_and_continue_end_to_end(tmp_path: Path) -> None:
    """Train a small TokenFormer 10 steps; grow it; the grown model's logits equal the
    small one's; train() from it starts at the small run's final validation loss."""
    small = train(tiny(SMALL, 0, 10), tmp_path / "small", progress=False)
    big_method = "tokenformer(slots=48,ffn_slots=72,norm_slots=24,ffn_norm_slots=40)"
    state = load_checkpoint(tmp_path / "small/checkpoints/last.pt")
    small_cfg, big_cfg = tiny(SMALL).model, tiny(big_method).model
    old = build_model(small_cfg).double()
    old.load_state_dict(state["model"])
    new = build_model(big_cfg, seed=1).double()
    new.load_state_dict(grow_tokenformer(state["model"], small_cfg, big_cfg,
                                         target=new.state_dict()))
    idx = torch.randint(0, small_cfg.vocab_size, (2, 32), generator=G)
    with torch.no_grad():
        torch.testing.assert_close(new(idx), old(idx), rtol=0, atol=1e-10)

    cfg = tiny(big_method, 1, 10, f"train.init_from={tmp_path / 'small'}")
    big = train(cfg, tmp_path / "big", progress=False)
    assert big["status"] == "completed"
    assert big["initial_val_loss"] == pytest.approx(small["final_val_loss"], abs=1e-5)
    assert big["final_val_loss"] < big["initial_val_loss"]
    recorded = yaml.safe_load((tmp_path / "big/config.yaml").read_text())
    assert recorded["train"]["init_from"] == str(tmp_path / "small")
    meta = recorded["meta"]["init_from"]
    assert meta["step"] == 10 and meta["method"] == SMALL
    assert meta["checkpoint"] == str(tmp_path / "small/checkpoints/last.pt")
    trained = load_checkpoint(tmp_path / "big/checkpoints/last.pt")["model"]
    assert trained["blocks.0.ffn.core.pattention.key_param_tokens"].shape == (72, 64)


@pytest.mark.parametrize("method,over,msg", [
    ("baseline", "model.d_ff=64", r"'blocks.0.ffn.core.gate_proj.weight' has shape \(176, 64\) "
                                  r"there and \(64, 64\) here"),
    ("baseline", "model.n_layers=3", "lacks parameter 'blocks.2"),
    ("qknorm", "", "lacks parameter 'blocks.0.attn.core.k_norm.weight'"),
])
def test_init_from_refuses_other_shapes(method: str, over: str, msg: str,
                                        tmp_path: Path) -> None:
    train(tiny("baseline", 0, 2), tmp_path / "a", progress=False)
    extra = [over] if over else []
    cfg = tiny(method, 0, 2, f"train.init_from={tmp_path / 'a'}", *extra)
    with pytest.raises(ModbenchError, match=msg):
        train(cfg, tmp_path / "b", progress=False)
    assert not (tmp_path / "b").exists()  # nothing left behind


def test_init_from_bad_path_fails_before_writing(tmp_path: Path) -> None:
    cfg = tiny("baseline", 0, 2, f"train.init_from={tmp_path / 'nothing'}")
    with pytest.raises(ModbenchError, match="neither a checkpoint file nor a run folder"):
        Trainer(cfg, tmp_path / "b", progress=False)
    assert not (tmp_path / "b").exists()


class Kill(Callback):
    def on_step_end(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None:
        if step + 1 == 3:
            raise RuntimeError("killed")


def test_init_from_loads_the_weights_and_resume_ignores_it(tmp_path: Path) -> None:
    """A fresh start from a run of the same architecture starts at that run's weights; on
    --resume the run's own checkpoint wins and init_from is not read again."""
    src = train(tiny("baseline", 0, 3), tmp_path / "src", progress=False)
    cfg = lambda: tiny("baseline", 9, 5, f"train.init_from={tmp_path / 'src'}",  # noqa: E731
                       "train.checkpoint_every=2")
    full = train(cfg(), tmp_path / "full", progress=False)
    assert full["initial_val_loss"] == pytest.approx(src["final_val_loss"], abs=1e-6)
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), tmp_path / "cut", callbacks=[Kill()], progress=False)
    (tmp_path / "src/checkpoints/last.pt").unlink()  # resume must not need it
    resumed = train(cfg(), tmp_path / "cut", resume=True, progress=False)
    assert resumed["final_val_loss"] == full["final_val_loss"]
    losses = [r["loss"] for r in read_metrics(tmp_path / "cut") if r["kind"] == "train"]
    assert losses == [r["loss"] for r in read_metrics(tmp_path / "full") if r["kind"] == "train"]
    # a checkpoint file works as well as a run folder
    again = train(tiny("baseline", 9, 1, f"train.init_from={tmp_path / 'full'}/checkpoints/"
                       "last.pt"), tmp_path / "again", progress=False)
    assert again["initial_val_loss"] == pytest.approx(full["final_val_loss"], abs=1e-6)
