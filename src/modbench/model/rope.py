"""Rotary position embedding (Su et al. 2021), Llama's rotate-half layout."""

from __future__ import annotations

import torch


def rope_tables(
    head_dim: int, max_len: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``(max_len, head_dim)``, computed in float64 (angles at
    long positions lose digits in float32) and rounded to ``dtype``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    t = torch.arange(max_len, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, T, d_h)`` with tables sliced to ``(T, d_h)``."""
    return (x * cos.to(x.dtype)) + (rotate_half(x) * sin.to(x.dtype))
