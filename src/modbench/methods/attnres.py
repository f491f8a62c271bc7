"""Attention Residuals (AttnRes): each sublayer's input is a softmax-weighted mix over depth of
the earlier sublayer outputs, instead of their sum.

Equations (docs/sources.md#attnres; arXiv 2605.20798 Appendix B.1: "Full, pseudo-query", Eq. 2
and Table 4 row 2 of the paper). Sublayers k = 0 .. 2L-1 (attention and FFN counted separately);
v_0 = the embedding (after the embedding norm site), v_{k+1} = the output of sublayer k::

    full:   h_k = sum_{i <= k} a_{i,k} v_i,    a_{., k} = softmax_i( w_k^T RMSNorm_k(v_i) )
            v_{k+1} = post_norm(f_k(pre_norm(h_k)))
            h_out = the same op (its own w, RMSNorm) over v_0 .. v_{2L}, then the final norm

    block:  the sublayers are split into N contiguous blocks; inside a block the outputs are
            summed into a partial b_n^i = sum of the block's outputs so far; sublayer k
            attends over [b_0 = v_0, b_1 .. b_{n-1} (completed block sums), b_n^i (the
            partial, when not empty)]; the final op attends over b_0 .. b_N.

RMSNorm_k(v) = v / sqrt(mean(v^2) + eps) * g_k; the softmax is over depth, per token, so
attention over the sequence (SDPA) is untouched.

Citation: Kimi Team 2026, "Attention Residuals" (arXiv 2603.15031); the public reproduction
ilml/Attention-Residuals ``model.py`` (``AttnResOp``, block partition) follows the paper's
pseudocode (stack the sources, RMSNorm them, einsum with the pseudo-query, softmax over
depth, weighted sum).

Init: w_k = 0 for every op (the paper: the pseudo-query must start at zero), so every op
starts as the uniform average of its sources; g_k = 1.

Parameters: one op per sublayer plus the final op, each w (d) and g (d): 2 d (2L + 1), both
variants. FLOPs per token: each op with n sources does two matrix products, the logits
(n x d by d) and the mix (1 x n by n x d): 4 d n. Full: 4 d (2L + 1)(L + 1) in total; block:
4 d times the sum of the sources of every op (``source_counts``).

Options: ``variant`` ``full`` (default, the seed study's) or ``block``; ``blocks`` N (default
8, the paper's "N of about 8") for ``variant=block``. With N >= 2L every block is one
sublayer and block equals full; N is capped at 2L.

Memory: each op stacks its sources (the paper's form) and keeps that stack for the backward
pass: full keeps sum_k (k + 1) = O(L^2) d-vectors per token, block O(L N). That is the
paper's reason for the block variant; ``benchmarks/stream_memory.py`` measures it. (Under
autograd the sources themselves are kept in both variants; only the stacks differ.)

Choices of our own:

- The blocks are N contiguous groups of sublayers, sizes as equal as possible with the
  larger ones first (the reproduction's rule; the paper states S = 2L / N sublayers each).
- The logit w^T (g * v / rms(v)) is computed as ((w * g)^T v) / rms(v), the same number, so
  the normalised stack is not stored a second time.
- Sources are kept in the stream's dtype (sublayer outputs are cast to the embedding's
  dtype) and the op runs without autocast, as the residual add would.
- AttnRes replaces the additive merge: it claims the ``merge`` slot, so methods that fill it
  (layerscale, deepnorm, laurel_*, ngpt) are refused. It has no residual sum to normalise,
  so placements with a post-residual norm (``post_ln``, ``mix_ln``, ``hybrid_norm``) are
  refused when the model is built. Pre-norm placements (sandwich, peri_ln) compose.

Slots: ``stream`` and ``merge``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, option_choice, register
from modbench.model.norms import inv_rms
from modbench.model.spec import SUBLAYERS, ModelSpec, parts_of
from modbench.model.stream import (
    Stream,
    StreamState,
    claim_merge,
    stream_precision,
    sublayer_index,
)

VARIANTS = ("full", "block")
DEFAULT_BLOCKS = 8
SOURCES, PARTIAL = "attnres.sources", "attnres.partial"


def block_sizes(n_sublayers: int, blocks: int) -> list[int]:
    """Sizes of the N (capped at n_sublayers) contiguous blocks, larger ones first."""
    n = min(blocks, n_sublayers)
    base, extra = divmod(n_sublayers, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def block_starts(n_sublayers: int, blocks: int) -> set[int]:
    starts, at = set(), 0
    for size in block_sizes(n_sublayers, blocks):
        starts.add(at)
        at += size
    return starts


def source_counts(n_sublayers: int, variant: str, blocks: int) -> list[int]:
    """Number of depth sources of each op (one per sublayer, then the final op)."""
    if variant == "full":
        return list(range(1, n_sublayers + 2))
    starts = block_starts(n_sublayers, blocks)
    completed, partial, counts = 1, False, []
    for k in range(n_sublayers):
        if k in starts and partial:
            completed, partial = completed + 1, False
        counts.append(completed + partial)
        partial = True
    counts.append(completed + partial)
    return counts


class DepthAttention(nn.Module):
    """One AttnRes op: softmax over depth with a pseudo-query ``query`` (w) and the key
    RMSNorm's gain ``key_gain`` (g)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(dim))
        self.key_gain = nn.Parameter(torch.ones(dim))

    @torch.no_grad()
    def modbench_init(self) -> None:
        self.query.zero_()
        self.key_gain.fill_(1.0)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        v = torch.stack(sources, dim=-2)  # (..., n, d)
        with stream_precision(v):
            q = (self.query * self.key_gain).to(v.dtype)
            vf, inv = inv_rms(v, self.eps)
            logits = (v @ q.unsqueeze(-1)).to(vf.dtype) * inv  # (..., n, 1)
            a = torch.softmax(logits, dim=-2).to(v.dtype)
            return (a.transpose(-1, -2) @ v).squeeze(-2)

    def extra_repr(self) -> str:
        return f"{self.query.shape[0]}, eps={self.eps}"


class AttnResStream(Stream):
    """Depth sources in ``state.kept``: the completed ones (a tuple) and the block variant's
    partial sum; ``read`` runs sublayer k's op, ``write`` adds v_{k+1} (full) or grows the
    block's partial sum (block)."""

    def __init__(self, dim: int, n_layers: int, variant: str, blocks: int, eps: float) -> None:
        super().__init__()
        self.variant, self.blocks = variant, blocks
        self.n_sublayers = 2 * n_layers
        self.ops = nn.ModuleList(DepthAttention(dim, eps) for _ in range(self.n_sublayers + 1))
        self.starts = block_starts(self.n_sublayers, blocks)

    def start(self, x0: torch.Tensor) -> StreamState:
        return StreamState(x=x0, embedding=x0, kept={SOURCES: (x0,), PARTIAL: None})

    def _sources(self, state: StreamState, k: int | None
                 ) -> tuple[list[torch.Tensor], StreamState]:
        sources: tuple[torch.Tensor, ...] = state.kept[SOURCES]
        if self.variant == "full":
            return list(sources), state
        partial = state.kept[PARTIAL]
        if partial is not None and (k is None or k in self.starts):
            sources = (*sources, partial)  # the block is complete
            state = state.replace(kept={**state.kept, SOURCES: sources, PARTIAL: None})
            partial = None
        return (list(sources) if partial is None else [*sources, partial]), state

    def read(self, state: StreamState, layer: int, sublayer: str
             ) -> tuple[torch.Tensor, StreamState]:
        k = sublayer_index(layer, sublayer)
        sources, state = self._sources(state, k)
        x = self.ops[k](sources)
        return x, state.replace(x=x)

    def write(self, state: StreamState, layer: int, sublayer: str, x: torch.Tensor,
              out: torch.Tensor, merge: nn.Module, residual_norm: nn.Module) -> StreamState:
        v = out.to(state.embedding.dtype)
        if self.variant == "full":
            newest = v
            kept = {**state.kept, SOURCES: (*state.kept[SOURCES], v)}
        else:
            partial = state.kept[PARTIAL]
            newest = v if partial is None else partial + v
            kept = {**state.kept, PARTIAL: newest}
        self.record(layer, sublayer, x, out, newest)
        return state.replace(kept=kept)

    def finish(self, state: StreamState) -> torch.Tensor:
        sources, _ = self._sources(state, None)
        return self.ops[self.n_sublayers](sources)

    def extra_repr(self) -> str:
        extra = f", blocks={len(block_sizes(self.n_sublayers, self.blocks))}"
        return f"variant={self.variant}" + (extra if self.variant == "block" else "")


@register
class AttnRes(Method):
    name = "attnres"
    category = "residual"
    citation = "Kimi Team 2026, Attention Residuals (arXiv 2603.15031)"
    summary = ("Softmax attention over depth replaces the residual sum; zero-init "
               "pseudo-query per sublayer; full or block variant.")

    @dataclass
    class Options:
        variant: str = "full"  # full | block
        blocks: int = DEFAULT_BLOCKS  # N, for variant=block

    def _checked(self) -> tuple[str, int]:
        variant = option_choice(self.name, "variant", self.opts.variant, VARIANTS)
        blocks = self.opts.blocks
        if blocks < 1:
            raise ModbenchError(f"option blocks={blocks} of method 'attnres' must be >= 1 "
                                "(the number of sublayer blocks, e.g. 8)")
        if variant == "full" and blocks != DEFAULT_BLOCKS:
            raise ModbenchError(f"option blocks={blocks} of method 'attnres' applies to the "
                                f"block variant; write attnres(variant=block,blocks={blocks})")
        return variant, blocks

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        variant, blocks = self._checked()

        def factory(c: ModelConfig) -> nn.Module:
            return AttnResStream(c.d_model, c.n_layers, variant, blocks, c.norm_eps)

        spec.fill("stream", factory, by=self.name)
        claim_merge(spec, self.name)

    def post_init(self, model: nn.Module) -> None:
        spec: ModelSpec = model.spec  # type: ignore[assignment]
        cfg: ModelConfig = model.cfg  # type: ignore[assignment]
        n_layers = cfg.n_layers
        parts = parts_of(model)
        for i in range(n_layers):
            for sub in SUBLAYERS:
                site = f"{sub}.residual"
                if isinstance(parts.norm(site, i), nn.Identity):
                    continue
                owner = (spec.owner("placement") if spec.get("placement")(site, i, n_layers)
                         else spec.describe().get("norm_wrappers", "a norm wrapper"))
                raise ModbenchError(
                    f"attnres has no residual sum for the post-residual norm that '{owner}' "
                    f"puts at {site}; combine attnres with a pre-norm placement (baseline, "
                    "sandwich, peri_ln)"
                )

    def extra_params(self, cfg: ModelConfig) -> int:
        self._checked()
        return 2 * cfg.d_model * (2 * cfg.n_layers + 1)

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        variant, blocks = self._checked()
        return 4.0 * cfg.d_model * sum(source_counts(2 * cfg.n_layers, variant, blocks))
