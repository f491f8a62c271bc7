"""Independent reference forward of the decoder with replaceable attention and FFN pieces,
for the attention/FFN catalogue tests. Written from the equations on plain float64 tensors
(state-dict weights, explicit loops over heads); never calls modbench's modules.

``decoder(model, idx, cfg, attn=..., ffn=...)`` runs the Pre-LN decoder; ``attn(x, sd, p, l,
shared)`` and ``ffn(x, sd, p, l)`` compute one sublayer core on a single sequence x (T, d).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from tests.reference import rms, rope

Weights = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def causal(t: int) -> torch.Tensor:
    """(T, T) bool, True where key j <= query i."""
    return torch.ones(t, t, dtype=torch.bool).tril()


def softmax_weights(a: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    return torch.softmax(a.masked_fill(~vis, float("-inf")), dim=-1)


def qkv(x: torch.Tensor, sd: dict[str, torch.Tensor], p: str, cfg: Any,
        qk_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projected (H, T, d_h) queries and (H_kv, T, d_h) keys/values, RoPE applied."""
    t = x.shape[0]
    h, h_kv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads
    q = (x @ sd[p + "q_proj.weight"].T).view(t, h, dh).transpose(0, 1)
    k = (x @ sd[p + "k_proj.weight"].T).view(t, h_kv, dh).transpose(0, 1)
    v = (x @ sd[p + "v_proj.weight"].T).view(t, h_kv, dh).transpose(0, 1)
    if qk_norm:
        q = rms(q, sd[p + "q_norm.weight"], cfg.norm_eps)
        k = rms(k, sd[p + "k_norm.weight"], cfg.norm_eps)
    return rope(q), rope(k), v


def logits_of(q: torch.Tensor, k: torch.Tensor, i: int, n_heads: int) -> torch.Tensor:
    """Scaled logits (T, T) of query head i with its KV head (GQA by integer division)."""
    kv = i // (n_heads // k.shape[0])
    return q[i] @ k[kv].T / math.sqrt(q.shape[-1])


def standard_attention(x: torch.Tensor, sd: dict[str, torch.Tensor], p: str, cfg: Any, *,
                       weights: Weights = softmax_weights,
                       logit_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                       v_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       gate: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                       qk_norm: bool = False) -> torch.Tensor:
    """``W_o concat_h gate_h * weights(logit_fn(A_h)) V`` on one sequence."""
    t = x.shape[0]
    q, k, v = qkv(x, sd, p, cfg, qk_norm)
    if v_fn is not None:
        v = v_fn(v)
    vis = causal(t)
    h = cfg.n_heads
    ys = []
    for i in range(h):
        a = logits_of(q, k, i, h)
        if logit_fn is not None:
            a = logit_fn(a, i)
        y = weights(a, vis) @ v[i // (h // k.shape[0])]
        if gate is not None:
            y = y * gate(x, i)
        ys.append(y)
    return torch.cat(ys, dim=-1) @ sd[p + "o_proj.weight"].T


def swiglu(x: torch.Tensor, sd: dict[str, torch.Tensor], p: str, layer: int,
           act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    g = x @ sd[p + "gate_proj.weight"].T
    u = x @ sd[p + "up_proj.weight"].T
    a = g * torch.sigmoid(g) if act is None else act(g)
    return (a * u) @ sd[p + "down_proj.weight"].T


def decoder(model: torch.nn.Module, idx: torch.Tensor, cfg: Any, *,
            attn: Callable[..., torch.Tensor] | None = None,
            ffn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Pre-LN decoder (Llama): x + F(N(x)) per sublayer, final norm, tied or untied head."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    eps = cfg.norm_eps
    attn = attn or (lambda x, sd, p, layer, shared: standard_attention(x, sd, p, cfg))
    ffn = ffn or swiglu
    out = []
    for row in idx:
        shared: dict[str, Any] = {}
        x = sd["embed.weight"][row]
        for layer in range(cfg.n_layers):
            p = f"blocks.{layer}."
            x = x + attn(rms(x, sd[p + "attn.pre_norm.weight"], eps), sd, p + "attn.core.",
                         layer, shared)
            x = x + ffn(rms(x, sd[p + "ffn.pre_norm.weight"], eps), sd, p + "ffn.core.", layer)
        h = rms(x, sd["final_norm.weight"], eps)
        head = sd["embed.weight"] if cfg.tie_embeddings else sd["head.weight"]
        out.append(h @ head.T)
    return torch.stack(out)


def randomize_params(model: torch.nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    """Random values for every 1-D and 0-D parameter (gains, method scalars), so reference
    checks exercise them instead of their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim <= 1:
                r = torch.rand(p.shape, generator=g, dtype=torch.float64) * scale + 0.5 * scale
                p.copy_(r.to(p.dtype))


def random_stream_model(method: str,
                        stream: Callable[[str, torch.Tensor, torch.Generator],
                                         torch.Tensor | None],
                        *, seed: int, offset: int, **kw: Any) -> tuple[torch.nn.Module, Any]:
    """(float64 model of :func:`small_cfg`, its config), with random values the references
    see: each parameter ``stream(name, p, g)`` gives a value for (a residual stream's own
    parameters) takes it, every other 1-D one a gain in [0.5, 1.5]; one generator seeded
    ``seed + offset``, drawn in parameter order."""
    from modbench.methods.build import build_model

    cfg = small_cfg(method, **kw)
    model = build_model(cfg, seed=seed).double()
    g = torch.Generator().manual_seed(seed + offset)
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = stream(name, p, g)
            if value is not None:
                p.copy_(value)
            elif p.ndim == 1:
                p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) + 0.5)
    return model, cfg


def small_cfg(method: str, **kw: Any) -> Any:
    """A float64-friendly small shape with GQA (4 query heads, 2 KV heads)."""
    from modbench.config import ModelConfig

    base: dict[str, Any] = dict(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                d_ff=40, max_seq_len=16, method=method)
    base.update(kw)
    return ModelConfig(**base)


IDX = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(7))


def built(method: str, seed: int = 1, scale: float = 1.0, **kw: Any) -> tuple[Any, Any]:
    """(float64 model with randomised 1-D/0-D parameters, its config)."""
    from modbench.methods.build import build_model

    cfg = small_cfg(method, **kw)
    model = build_model(cfg, seed=seed).double()
    randomize_params(model, scale=scale)
    return model, cfg


def assert_matches(model: torch.nn.Module, ref: torch.Tensor, idx: torch.Tensor = IDX) -> None:
    torch.testing.assert_close(model(idx), ref, rtol=1e-9, atol=1e-9)
