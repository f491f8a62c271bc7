"""Independent reference computations of the baseline equations, written from the
equations (not from modbench's modules) and used to check them.

Everything works on plain tensors taken from a state dict, with explicit loops over heads.
"""

from __future__ import annotations

import math

import torch


def rms(x: torch.Tensor, g: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * g over the last dimension."""
    y = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return y if g is None else y * g


def rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate pairs (j, j + d/2) of x[..., T, d] by angle pos * theta^(-2j/d)."""
    t, d = x.shape[-2], x.shape[-1]
    half = d // 2
    out = x.clone()
    for j in range(half):
        freq = theta ** (-2.0 * j / d)
        ang = torch.arange(t, dtype=torch.float64) * freq
        c, s = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
        a, b = x[..., :, j], x[..., :, j + half]
        out[..., :, j] = a * c - b * s
        out[..., :, j + half] = a * s + b * c
    return out


def causal_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: (H, T, d), k/v: (H_kv, T, d). Loops over heads; GQA by integer division."""
    h, t, d = q.shape
    group = h // k.shape[0]
    out = torch.zeros_like(q)
    for i in range(h):
        kv = i // group
        scores = q[i] @ k[kv].T / math.sqrt(d)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(mask, float("-inf"))
        out[i] = torch.softmax(scores, dim=-1) @ v[kv]
    return out


def attention(x: torch.Tensor, sd: dict[str, torch.Tensor], prefix: str, n_heads: int,
              n_kv: int, qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
              qk_scope: str = "head", eps: float = 1e-5) -> torch.Tensor:
    """One attention sublayer on x: (T, d) for a single sequence."""
    t, d = x.shape
    dh = d // n_heads
    q = (x @ sd[prefix + "q_proj.weight"].T).view(t, n_heads, dh).transpose(0, 1)
    k = (x @ sd[prefix + "k_proj.weight"].T).view(t, n_kv, dh).transpose(0, 1)
    v = (x @ sd[prefix + "v_proj.weight"].T).view(t, n_kv, dh).transpose(0, 1)
    if qk_norm is not None:
        gq, gk = qk_norm
        if qk_scope == "head":
            q, k = rms(q, gq, eps), rms(k, gk, eps)
        else:  # over the whole projection, per token
            q = rms(q.transpose(0, 1).reshape(t, -1), gq, eps).view(t, n_heads, dh).transpose(0, 1)
            k = rms(k.transpose(0, 1).reshape(t, -1), gk, eps).view(t, n_kv, dh).transpose(0, 1)
    q, k = rope(q), rope(k)
    y = causal_softmax_attention(q, k, v)
    return y.transpose(0, 1).reshape(t, d) @ sd[prefix + "o_proj.weight"].T


def swiglu(x: torch.Tensor, sd: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    g = x @ sd[prefix + "gate_proj.weight"].T
    u = x @ sd[prefix + "up_proj.weight"].T
    return (g * torch.sigmoid(g) * u) @ sd[prefix + "down_proj.weight"].T


def decoder_logits(model: torch.nn.Module, idx: torch.Tensor, cfg: object, *,
                   placement: str = "pre", layerscale: bool = False,
                   qk_scope: str | None = None) -> torch.Tensor:
    """Reference forward of the whole decoder, in float64, from the equations:

    - pre:  h = x + s * F(N(x))            (Llama, Pre-LN)
    - post: h = N(x + s * F(x))            (Post-LN; final norm kept)

    s = diag(lambda) of the sublayer when ``layerscale`` else 1; ``qk_scope`` adds QK-Norm
    ("head" or "full") with the model's gains.
    """
    c = cfg
    sd = {k: v.double() for k, v in model.state_dict().items()}
    eps = c.norm_eps  # type: ignore[attr-defined]
    out = []
    for row in idx:
        x = sd["embed.weight"][row]
        for i in range(c.n_layers):  # type: ignore[attr-defined]
            p = f"blocks.{i}."
            for sub in ("attn", "ffn"):
                q = p + sub + "."

                def branch(inp: torch.Tensor, sub: str = sub, q: str = q) -> torch.Tensor:
                    if sub == "ffn":
                        return swiglu(inp, sd, q + "core.")
                    norms = None
                    if qk_scope is not None:
                        norms = (sd[q + "core.q_norm" + (".weight" if qk_scope == "head"
                                                         else ".norm.weight")],
                                 sd[q + "core.k_norm" + (".weight" if qk_scope == "head"
                                                         else ".norm.weight")])
                    return attention(inp, sd, q + "core.", c.n_heads, c.n_kv_heads,
                                     qk_norm=norms, qk_scope=qk_scope or "head", eps=eps)

                scale = sd[q + "merge.scale"] if layerscale else 1.0
                if placement == "pre":
                    x = x + scale * branch(rms(x, sd[q + "pre_norm.weight"], eps))
                else:
                    x = rms(x + scale * branch(x), sd[q + "residual_norm.weight"], eps)
        h = rms(x, sd["final_norm.weight"], eps)
        head = sd["embed.weight"] if c.tie_embeddings else sd["head.weight"]  # type: ignore
        out.append(h @ head.T)
    return torch.stack(out)


def randomize_gains(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every 1-D parameter (norm gains, LayerScale) random values, so reference tests
    exercise them instead of their trivial init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(torch.rand(p.shape, generator=g, dtype=torch.float64).to(p.dtype) + 0.5)
