"""FlexAttention helpers for the CUDA path of score-modifying kernels (soft-cap).

Guarded: :func:`flex_usable` is False on CPU, when FlexAttention cannot be imported, or when
``MODBENCH_NO_FLEX=1`` is set; callers then fall back to their explicit-score path. The
compiled ``flex_attention`` and the causal block masks are cached per process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def _flex() -> tuple[Any, Any] | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:  # pragma: no cover - depends on the torch build
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def flex_usable(q: torch.Tensor) -> bool:
    """True where the FlexAttention path should run: CUDA tensors, Flex importable."""
    return q.is_cuda and os.environ.get("MODBENCH_NO_FLEX") != "1" and _flex() is not None


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=32)
def _causal_block_mask(t: int, device: str) -> Any:
    flex = _flex()
    assert flex is not None
    return flex[1](_causal, B=None, H=None, Q_LEN=t, KV_LEN=t, device=device)


# Kept out of an enclosing torch.compile graph (a graph break): inlined into a compiled model,
# this call gave logits 1.3e-2 away (relative) from eager on an H100 (torch 2.11), while
# eager FlexAttention and the compiled model with this call disabled both match the CPU's
# explicit path to 2.4e-7 (tests/test_cuda.py). FlexAttention still runs compiled: ``_flex``
# compiles it on its own.
@torch.compiler.disable
def flex_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention ``softmax(score_mod(q k^T * scale)) v`` through FlexAttention (GQA-aware).

    ``score_mod(score, b, h, q_idx, kv_idx)`` sees the scaled logits before masking.
    """
    flex = _flex()
    assert flex is not None, "FlexAttention is not available"
    t = q.shape[-2]
    mask = _causal_block_mask(t, str(q.device))
    return flex[0](q, k, v, score_mod=score_mod, block_mask=mask, scale=scale,
                   enable_gqa=q.shape[1] != k.shape[1])
