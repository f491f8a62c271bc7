"""Analytic parameters and training FLOPs per token, for the baseline and any method string.

Convention (arXiv 2605.20798 Appendix C, and what ``torch.utils.flop_counter`` counts): matrix
multiplications only, 2 FLOPs per multiply-add; attention scores and mixing counted over the
full T x T square (no causal halving, as the fused kernels' FLOP formulas do); element-wise
operations (norms, activations, softmax) and the embedding lookup not counted. Per token,
per layer, forward::

    attention projections  2 d (H d_h) + 2 * 2 d (H_kv d_h) + 2 (H d_h) d    (q, k and v, o)
    attention scores+mix   2 T H d_h + 2 T H d_h                              (Appendix C 4T^2d
                                                                              per sequence)
    FFN                    m * 2 d d_ff,  m = 3 (SwiGLU)
plus the LM head 2 d V once. Training FLOPs = 3 x forward (forward, backward for inputs,
backward for weights), as in Appendix C. A method adds its ``extra_flops(cfg, T)``
(forward, per token) on top; parameters are the baseline formula plus ``extra_params``.

:func:`measure_flops` counts the same quantity with ``FlopCounterMode`` (with a formula for
the CPU flash-attention op, which the counter does not know), for checks.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from modbench.config import ModelConfig

if TYPE_CHECKING:  # imported where used: `modbench presets` counts parameters without torch
    import torch


def baseline_params(cfg: ModelConfig) -> int:
    """Parameters of the baseline decoder (tied embeddings count once)."""
    d, dh, h, h_kv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    attn = d * h * dh + 2 * d * h_kv * dh + h * dh * d
    ffn = 3 * d * cfg.d_ff
    norms = 2 * d
    emb = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return emb + cfg.n_layers * (attn + ffn + norms) + d


def baseline_forward_flops(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of the baseline, by component (summed over layers)."""
    d, dh, h, h_kv, n = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers
    return {
        "attn_proj": float(n * (2 * d * h * dh + 4 * d * h_kv * dh + 2 * h * dh * d)),
        "attn_scores": float(n * 4 * seq_len * h * dh),
        "ffn": float(n * 3 * 2 * d * cfg.d_ff),
        "head": float(2 * d * cfg.vocab_size),
    }


@dataclass
class FlopReport:
    """Parameters and FLOPs per token of one model at one training sequence length."""

    method: str
    seq_len: int
    params: int
    baseline_params: int
    forward_flops_per_token: float
    train_flops_per_token: float
    baseline_forward_flops_per_token: float
    components: dict[str, float] = field(default_factory=dict)  # forward, per token

    @property
    def flops_ratio(self) -> float:
        return self.forward_flops_per_token / self.baseline_forward_flops_per_token

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["flops_ratio"] = self.flops_ratio
        out["six_n"] = 6.0 * self.params  # the 6N rule of thumb, for comparison
        return out


def flop_report(cfg: ModelConfig, seq_len: int | None = None) -> FlopReport:
    """Analytic report for ``cfg`` (its ``method`` string included) at ``seq_len`` tokens
    per sequence (default ``cfg.max_seq_len``)."""
    from modbench.methods import method_spec

    t = cfg.max_seq_len if seq_len is None else seq_len
    spec = method_spec(cfg)
    base_cfg = copy.deepcopy(cfg)
    base_cfg.method = "baseline"
    comps = baseline_forward_flops(base_cfg, t)
    base_fwd = sum(comps.values())
    params = base_params = baseline_params(base_cfg)
    for m in spec.methods:
        try:
            extra = float(m.extra_flops(base_cfg, t))
            params += int(m.extra_params(base_cfg))
        except NotImplementedError:  # not documented (and a ModbenchError: one line)
            raise
        except Exception as e:  # a method from outside modbench that raised: one line
            from modbench.methods.plugins import blame

            failed = blame(e, [m], "to count its FLOPs and parameters (extra_flops, "
                           "extra_params)")
            if failed is None:
                raise
            raise failed from e
        comps[m.name] = extra
    fwd = sum(comps.values())
    return FlopReport(spec.canonical, t, params, base_params, fwd, 3.0 * fwd, base_fwd, comps)


# ------------------------------------------------------------------ measured (for checks)


def _cpu_flash_mapping() -> dict[Any, Any]:
    """FLOP formulas for the CPU flash-attention ops (unknown to FlopCounterMode)."""
    import torch
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    mapping: dict[Any, Any] = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        def fwd_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None,
                      **kw: Any) -> int:
            return sdpa_flop_count(q, k, v)

        mapping[fwd] = fwd_flops
    if bwd is not None:
        def bwd_flops(grad_out: Any, q: Any, k: Any, v: Any, *args: Any,
                      out_shape: Any = None, **kw: Any) -> int:
            return sdpa_backward_flop_count(grad_out, q, k, v)

        mapping[bwd] = bwd_flops
    return mapping


def measure_flops(model: torch.nn.Module, seq_len: int, *, train: bool = False,
                  batch: int = 1) -> float:
    """FLOPs per token counted by ``FlopCounterMode`` for one forward (``train=False``) or
    one forward and backward pass (``train=True``) on random tokens."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from modbench.runtime.loss import lm_loss

    vocab = model.cfg.vocab_size  # type: ignore[attr-defined]
    idx = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    idx = idx.to(next(model.parameters()).device)
    with FlopCounterMode(display=False, custom_mapping=_cpu_flash_mapping()) as counter:
        if train:
            lm_loss(model(idx), idx).backward()
        else:
            with torch.no_grad():
                model(idx)
    return counter.get_total_flops() / (batch * seq_len)
