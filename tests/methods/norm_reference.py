"""Reference forward of the decoder for the norm-placement tests, written from the
equations on plain tensors (state-dict entries), independent of modbench's modules.

One sublayer, for a placement that enables a set of norm sites::

    h   = N_pre(x) * s_l          (if attn.pre / ffn.pre is enabled; s_l the LNS factor)
    out = N_post(F(h))            (if *.post is enabled)
    x'  = N_res(alpha * x + out)  (if *.residual is enabled; alpha = 1 unless DeepNorm)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.reference import causal_softmax_attention, rms, rope, swiglu

Sites = Callable[[str, int], bool]


def attention_qkv(x: torch.Tensor, sd: dict[str, torch.Tensor], p: str, n_heads: int,
                  n_kv: int, head_dim: int, eps: float, qk_norm: bool = False,
                  v_norm: bool = False) -> torch.Tensor:
    t = x.shape[0]
    q = (x @ sd[p + "q_proj.weight"].T).view(t, n_heads, head_dim).transpose(0, 1)
    k = (x @ sd[p + "k_proj.weight"].T).view(t, n_kv, head_dim).transpose(0, 1)
    v = (x @ sd[p + "v_proj.weight"].T).view(t, n_kv, head_dim).transpose(0, 1)
    if qk_norm:
        q, k = rms(q, sd[p + "q_norm.weight"], eps), rms(k, sd[p + "k_norm.weight"], eps)
    if v_norm:
        v = rms(v, sd[p + "v_path.norm.weight"], eps)
    y = causal_softmax_attention(rope(q), rope(k), v)
    return y.transpose(0, 1).reshape(t, n_heads * head_dim) @ sd[p + "o_proj.weight"].T


def reference_logits(model: torch.nn.Module, idx: torch.Tensor, cfg: object, sites: Sites, *,
                     alpha: float = 1.0, pre_scale: Callable[[int], float] = lambda i: 1.0,
                     qkv_norm: bool = False, pre_key: str = "pre_norm.weight",
                     norm: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """``norm(x, sd, key)`` defaults to RMSNorm with the gain at ``key``."""
    c = cfg
    sd = {k: v.double() for k, v in model.state_dict().items()}
    eps = c.norm_eps  # type: ignore[attr-defined]
    n_layers = c.n_layers  # type: ignore[attr-defined]

    def N(x: torch.Tensor, key: str) -> torch.Tensor:
        return norm(x, sd, key) if norm is not None else rms(x, sd[key], eps)

    out = []
    for row in idx:
        x = sd["embed.weight"][row]
        if sites("embed", -1):
            x = N(x, "embed_norm.weight")
        for i in range(n_layers):
            for sub in ("attn", "ffn"):
                p = f"blocks.{i}.{sub}."
                h = x
                if sites(f"{sub}.pre", i):
                    h = N(x, p + pre_key) * pre_scale(i)
                if sub == "attn":
                    o = attention_qkv(h, sd, p + "core.", c.n_heads, c.n_kv_heads,  # type: ignore
                                      c.head_dim, eps, qkv_norm, qkv_norm)  # type: ignore
                else:
                    o = swiglu(h, sd, p + "core.")
                if sites(f"{sub}.post", i):
                    o = N(o, p + "post_norm.weight")
                x = alpha * x + o
                if sites(f"{sub}.residual", i):
                    x = N(x, p + "residual_norm.weight")
        if sites("final", n_layers):
            x = N(x, "final_norm.weight")
        head = sd["embed.weight"] if c.tie_embeddings else sd["head.weight"]  # type: ignore
        out.append(x @ head.T)
    return torch.stack(out)
