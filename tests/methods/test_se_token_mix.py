"""se_token_mix: the parts against independent float64 references, the whole block against
a reference decoder, identity at init, causality of every part (train mode too), each part
alone trains, compatibility with adaptive_rmsnorm, option errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.build import build_model
from modbench.methods.se_token_mix import CausalSE, CausalTokenMix
from modbench.model.transformer import Transformer
from modbench.runtime.loss import lm_loss
from modbench.train.trainer import train
from tests.helpers import tiny, train_losses
from tests.reference import attention, rms, swiglu

G = torch.Generator().manual_seed(0)
PARTS = ["se_token_mix", "se_token_mix(mix=false,se=false)", "se_token_mix(norm=false,se=false)",
         "se_token_mix(norm=false,mix=false)"]


def model_cfg(method: str) -> ModelConfig:
    return tiny(method).model


def randomize_parts(model: torch.nn.Module, scale: float = 0.5) -> None:
    """Non-trivial values for every parameter the method adds (they start at zero)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("context.weight", "mix_kernel", "squeeze", "excite")):
                p.copy_(torch.randn(p.shape, generator=G, dtype=p.dtype) * scale)


# ------------------------------------------------------------------ the parts, alone


@pytest.mark.parametrize("k", [1, 3, 5])
def test_token_mix_is_a_left_padded_depthwise_conv(k: int) -> None:
    d, t = 6, 9
    m = CausalTokenMix(torch.nn.Identity(), d, k).double()
    with torch.no_grad():
        m.mix_kernel.copy_(torch.randn(d, 1, k, generator=G, dtype=torch.float64))
    h = torch.randn(2, t, d, generator=G, dtype=torch.float64)
    got = m(h)
    ref = h.clone()
    for b in range(2):
        for tt in range(t):
            for c in range(d):
                for j in range(k):
                    s = tt - k + 1 + j
                    if s >= 0:
                        ref[b, tt, c] += m.mix_kernel[c, 0, j] * h[b, s, c]
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    # and the same as torch's Conv1d(groups=d) on the input padded with k - 1 zeros in front
    conv = F.conv1d(F.pad(h.transpose(1, 2), (k - 1, 0)), m.mix_kernel, groups=d).transpose(1, 2)
    torch.testing.assert_close(got, h + conv, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate", ["sigmoid", "tanh"])
def test_se_uses_the_causal_mean_pool(gate: str) -> None:
    d, hid, t = 8, 3, 7
    m = CausalSE(torch.nn.Identity(), d, hid, gate, 0.5).double()
    with torch.no_grad():
        m.squeeze.copy_(torch.randn(hid, d, generator=G, dtype=torch.float64))
        m.excite.copy_(torch.randn(d, hid, generator=G, dtype=torch.float64))
    y = torch.randn(2, t, d, generator=G, dtype=torch.float64)
    got = m(y)
    w1, w2 = m.squeeze.detach(), m.excite.detach()
    for b in range(2):
        for tt in range(t):
            pool = sum(y[b, s] for s in range(tt + 1)) / (tt + 1)
            z = w2 @ torch.clamp(w1 @ pool, min=0.0)
            g = torch.tensor([2.0 / (1.0 + math.exp(-float(v))) if gate == "sigmoid"
                              else 1.0 + math.tanh(float(v)) for v in z], dtype=torch.float64)
            torch.testing.assert_close(got[b, tt], y[b, tt] * g, rtol=1e-12, atol=1e-12)


def test_parts_are_identity_at_init_and_get_gradients() -> None:
    mix = CausalTokenMix(torch.nn.Identity(), 4, 3)
    se = CausalSE(torch.nn.Identity(), 4, 2, "sigmoid", 0.02)
    mix.modbench_init()
    se.modbench_init()
    x = torch.randn(2, 5, 4, generator=G)
    assert torch.equal(mix(x), x) and torch.equal(se(x), x)
    (mix(x) * x).sum().backward()
    (se(x) * x.flip(-1)).sum().backward()
    assert mix.mix_kernel.grad.abs().sum() > 0 and se.excite.grad.abs().sum() > 0


# ------------------------------------------------------------- the block, as a reference


def ref_adaptive(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xh = rms(x, None, eps)
    c = torch.stack([xh[: t + 1].mean(dim=0) for t in range(x.shape[0])])
    return g * (1.0 + torch.tanh(c @ w.T)) * xh


def ref_logits(model: Transformer, idx: torch.Tensor, norm: bool, mix: bool,
               se: bool) -> torch.Tensor:
    """The card's layer from the equations, float64: x' = x + Attn(Mix(N(x)));
    x'' = x' + SE(MLP(N(x'))); final N; tied head."""
    c = model.cfg
    sd = {k: v.double() for k, v in model.state_dict().items()}
    eps = c.norm_eps

    def n(x: torch.Tensor, p: str) -> torch.Tensor:
        if norm:
            return ref_adaptive(x, sd[p + ".weight"], sd[p + ".context.weight"], eps)
        return rms(x, sd[p + ".weight"], eps)

    out = []
    for row in idx:
        x = sd["embed.weight"][row]
        t = x.shape[0]
        for i in range(c.n_layers):
            p = f"blocks.{i}."
            pre = p + "attn.pre_norm" + (".inner" if mix else "")
            h = n(x, pre)
            if mix:
                w = sd[p + "attn.pre_norm.mix_kernel"]
                u = h.clone()
                for tt in range(t):
                    for j in range(w.shape[-1]):
                        s = tt - w.shape[-1] + 1 + j
                        if s >= 0:
                            u[tt] += w[:, 0, j] * h[s]
                h = u
            x = x + attention(h, sd, p + "attn.core.", c.n_heads, c.n_kv_heads)
            y = swiglu(n(x, p + "ffn.pre_norm"), sd, p + "ffn.core.")
            if se:
                w1, w2 = sd[p + "ffn.post_norm.squeeze"], sd[p + "ffn.post_norm.excite"]
                pool = torch.stack([y[: s + 1].mean(dim=0) for s in range(t)])
                y = y * 2.0 * torch.sigmoid(torch.relu(pool @ w1.T) @ w2.T)
            x = x + y
        out.append(n(x, "final_norm") @ sd["embed.weight"].T)
    return torch.stack(out)


@pytest.mark.parametrize("method", PARTS)
def test_block_matches_the_reference_decoder(method: str) -> None:
    model = build_model(model_cfg(method), seed=0).double()
    randomize_parts(model)
    o = model.methods[0].opts
    idx = torch.randint(0, model.cfg.vocab_size, (2, 10), generator=G)
    torch.testing.assert_close(model(idx), ref_logits(model, idx, o.norm, o.mix, o.se),
                               rtol=1e-9, atol=1e-9)


def _baseline_name(name: str) -> str:
    return name.replace(".inner", "")


@pytest.mark.parametrize("method", PARTS)
def test_equals_the_baseline_at_init(method: str) -> None:
    base = build_model(model_cfg("baseline"), seed=4).double()
    model = build_model(model_cfg(method), seed=4).double()
    mine = model.state_dict()
    theirs = base.state_dict()
    if not model.methods[0].opts.norm:  # the parts draw after the generic pass
        assert all(torch.equal(mine[k], theirs[_baseline_name(k)]) for k in mine
                   if _baseline_name(k) in theirs)
    own = {k: theirs[_baseline_name(k)] for k in mine if _baseline_name(k) in theirs}
    assert len(own) == len(theirs)
    model.load_state_dict(own, strict=False)
    idx = torch.randint(0, base.cfg.vocab_size, (2, 16), generator=G)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), base(idx), rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", [*PARTS, "se_token_mix(kernel=5,gate=tanh,reduction=4)"])
def test_every_part_is_causal_in_train_mode(method: str) -> None:
    model = build_model(model_cfg(method), seed=0).train()
    randomize_parts(model)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 20), generator=G)
    changed = idx.clone()
    changed[:, 11:] = (changed[:, 11:] + 3) % model.cfg.vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :11], b[:, :11], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 11:], b[:, 11:])


# ----------------------------------------------------------------- training, options


@pytest.mark.parametrize("method", PARTS[1:])
def test_each_part_alone_trains(method: str, tmp_path: Path) -> None:
    summary = train(tiny(method, steps=20), tmp_path / "run", progress=False)
    losses = train_losses(tmp_path / "run")
    assert summary["status"] == "completed" and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3


@pytest.mark.parametrize("combo", ["se_token_mix+adaptive_rmsnorm",
                                   "adaptive_rmsnorm+se_token_mix"])
def test_combines_with_adaptive_rmsnorm_as_the_same_norm(combo: str) -> None:
    a = build_model(model_cfg("se_token_mix"), seed=2)
    b = build_model(model_cfg(combo), seed=2)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    randomize_parts(a)
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, a.cfg.vocab_size, (2, 12), generator=G)
    torch.testing.assert_close(a(idx), b(idx), rtol=0, atol=0)
    lm_loss(b(idx), idx).backward()


def test_norm_part_conflicts_with_other_norm_types_unless_off() -> None:
    with pytest.raises(ModbenchError, match="'se_token_mix' and 'layernorm' both set the norm"):
        build_model(model_cfg("se_token_mix+layernorm"))
    build_model(model_cfg("se_token_mix(norm=false)+layernorm"))
    build_model(model_cfg("post_ln+se_token_mix"))


@pytest.mark.parametrize("text,msg", [
    ("se_token_mix(norm=false,mix=false,se=false)", "enable at least one part"),
    ("se_token_mix(kernel=0)", "kernel=0"),
    ("se_token_mix(reduction=0)", "reduction=0"),
    ("se_token_mix(gate=relu)", "must be one of: sigmoid, tanh"),
])
def test_bad_options(text: str, msg: str) -> None:
    with pytest.raises(ModbenchError, match=msg):
        build_model(model_cfg(text))
