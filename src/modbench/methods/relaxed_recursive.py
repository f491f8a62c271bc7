"""Relaxed Recursive Transformers: K unique layers looped over the L layers, each layer's
projections relaxed by its own LoRA.

Equation (Bae et al. 2024, section 2; L layers, K unique layers, B = L / K loops). The
Recursive Transformer ties layer l (0-based) to unique layer u(l) of a block of K::

    CYCLE     u(l) = l mod K          (the block repeats: 0 1 .. K-1 | 0 1 .. K-1 | ..)
    SEQUENCE  u(l) = floor(l / B)     (each unique layer repeats in place: 0 0 | 1 1 | ..)

    h_l = f(h_{l-1}; Phi'_{u(l)})

The Relaxed Recursive Transformer adds a per-layer LoRA to every projection W' of the
shared block (roles q k v o gate up down)::

    y = W'_{u(l)} x + (alpha / r) B_l A_l x,     A_l: r x d_in,  B_l: d_out x r

so the layers share W' and differ by a rank-r delta; ``rank=0`` is the plain Recursive
Transformer (no LoRA, no wrapper). The norms of the block are tied like the projections (the
authors' ``ln_share: true``; ``share_norms=false`` keeps them per layer) and never relaxed; the
embedding, the final norm and the head are never shared.

Citation: Bae, Fisch, Harutyunyan, Ji, Kim, Schuster 2024, "Relaxed Recursive Transformers:
Effective Parameter Sharing with Layer-wise LoRA" (arXiv 2410.20672, ICLR 2025); the
looping, initialisation and SVD rules as in the authors' code (raymin0223/mixture_of_recursions,
``model/sharing_strategy/llama.py``, ``model/relaxation/lora/svd_init.py``).

Init, fresh start: the lab's generic pass draws the shared weights once (one module per
unique layer); A_l ~ N(0, init_std^2) and B_l = 0 (LoRA's rule, in ``modbench_init``), so at
initialisation the relaxed model computes exactly the plain recursive model.

Init from a trained full-size run (``train.init_from`` = a run of the same shape without
this method; :meth:`RelaxedRecursive.grow_state_dict`), option ``init``:

- ``average``: W'_u = the mean of the source layers tied to u (CYCLE: u, u+K, u+2K, ..;
  SEQUENCE: uB .. uB+B-1);
- ``stepwise``: W'_u = source layer round(u (L-1) / (K-1)) (numpy ``linspace(0, L-1, K)``
  rounded half to even, first and last layer included; K = 1 takes layer 0), for both
  strategies, as the authors' ``selection_initialize``;
- ``lower``: W'_u = source layer u (the first K layers).

The rule applies to every tied tensor (projections and norm gains). Each LoRA then starts at
the rank-r truncated SVD of the residual R_l = W_l - W'_{u(l)} (the paper's SVD init, the
authors' ``svd_init.py``): U_r S_r V_r^T = SVD_r(R_l), B_l = U_r S_r, A_l = V_r^T (B_l divided by
alpha / r, so the delta is exactly U_r S_r V_r^T). With r = min(d_in, d_out) every
projection equals its source layer's again, and with ``share_norms=false`` (each layer keeps
its source norm gains) the relaxed model computes the source model exactly; tied norms take
the rule's shared gains, which LoRA does not relax. A smaller r gives the best rank-r
approximation of each layer's residual. The tied model's state dict lists a shared tensor
under every tied layer's name, and the mapping writes the same value under each. A source of
another shape, or a ``relaxed_recursive`` source with other options (``init`` aside), is
refused; a source with the same options is passed through (a continued run).

Parameters over the baseline (per layer: P = sum of d_in d_out over q k v o gate up down,
N = 2 d norm gains at the baseline placement, 0 with ``share_norms=false``;
r_p = min(rank, d_in, d_out))::

    L sum_p r_p (d_in + d_out)  -  (L - K)(P + N)

i.e. K unique layers plus L r (d_in + d_out) per relaxed projection plus the unshared rest
(embedding, final norm, head). FLOPs per token: tying changes none; each LoRA costs
2 r_p (d_in + d_out) (the two thin matmuls, not merged into W' while training):
2 L sum_p r_p (d_in + d_out).

Options: ``blocks`` (K; default: L divided by its smallest prime factor, i.e. two loops for
even L, the paper's main setting, e.g. Gemma 2B's 18 layers -> 9; L must be divisible by K),
``strategy`` (``cycle``, the paper's default, or ``sequence``), ``rank`` (8; 0 = plain
recursive), ``alpha`` (LoRA's alpha; default = the rank, scale 1), ``init`` (``average``,
``stepwise``, ``lower``; used only by ``train.init_from``), ``share_norms`` (true: tie the
block's norms with its projections).

Choices of our own (the sources are silent or the lab differs):

- the rank is clamped per projection to min(d_in, d_out), as the authors' ``get_lora_config``
  does, and the scale is alpha / r_p per projection (peft's ``alpha_pattern`` convention);
- default alpha = rank (scale 1): the authors' SVD init writes B = U S, A = V^T and is exact
  only at scale 1; with another alpha we divide B by the scale to keep it exact;
- default ``init=average``: our default model is relaxed (rank 8), where the average leaves
  the smallest residuals for the SVD; the authors' example config uses ``stepwise`` for a
  plain recursive model;
- A ~ N(0, init_std^2) at a fresh start (the lab's std; the LoRA paper draws A Gaussian,
  peft uses Kaiming-uniform); B = 0;
- Muon (``recipe.optimizer=muon``): the LoRA factors are hidden linear maps, so they stay
  in Muon's split like every other hidden matrix (a factor with a side of 1, rank 1, goes
  to AdamW by the split's own rule); the authors' code trains with AdamW;
- the authors' "middle" strategies (first and last layer unshared), the KV-cache sharing,
  the early exits and continuous depth-wise batching are not implemented;
- a core that makes its projections itself rather than through the ``linear`` slot
  (``moe``'s experts, TokenFormer's Pattention) would be neither shared nor relaxed: such
  combinations are refused (:meth:`RelaxedRecursive.post_init`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import (
    block_projection_params,
    projection_widths,
    unreached_sublayer,
)
from modbench.methods.base import Method, method_spec, option_choice, register
from modbench.model.spec import ModelSpec

STRATEGIES = ("cycle", "sequence")
INITS = ("average", "stepwise", "lower")
RELAXED_ROLES = ("q", "k", "v", "o", "gate", "up", "down")
LORA_A, LORA_B = "lora_A", "lora_B"
# the fields of the model shape a source run must share with the new model
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                "attn_head_dim", "tie_embeddings")


class LoRALinear(nn.Module):
    """``inner(x) + scale * B (A x)``: a per-layer low-rank delta on a (shared) linear."""

    def __init__(self, inner: nn.Module, d_in: int, d_out: int, rank: int, scale: float,
                 init_std: float) -> None:
        super().__init__()
        self.inner = inner
        self.scale, self.init_std = scale, init_std
        self.lora_A = nn.Parameter(torch.empty(rank, d_in))
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank))

    def modbench_init(self) -> None:
        nn.init.normal_(self.lora_A, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        delta = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return y + self.scale * delta.to(y.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def smallest_prime_factor(n: int) -> int:
    return next((p for p in range(2, int(n ** 0.5) + 1) if n % p == 0), n)


def stepwise_layers(n_layers: int, blocks: int) -> list[int]:
    """The source layers the ``stepwise`` init copies: numpy's ``linspace(0, L-1, K)``
    (``i * step``, the last one exactly L-1), rounded half to even as the authors' code."""
    if blocks == 1:
        return [0]
    step = (n_layers - 1) / (blocks - 1)
    points = [i * step for i in range(blocks)]
    points[-1] = float(n_layers - 1)
    return [round(p) for p in points]


@dataclass(frozen=True)
class Resolved:
    n_layers: int
    blocks: int  # K unique layers
    strategy: str
    rank: int
    alpha: float | None
    init: str
    share_norms: bool = True

    @property
    def loops(self) -> int:
        return self.n_layers // self.blocks

    def unique(self, layer: int) -> int:
        """The unique layer (0 .. K-1) block layer ``layer`` uses."""
        return layer % self.blocks if self.strategy == "cycle" else layer // self.loops

    def owner(self, layer: int) -> int:
        """The first block layer that uses ``layer``'s unique layer (the tie's source)."""
        u = self.unique(layer)
        return u if self.strategy == "cycle" else u * self.loops

    def rank_for(self, d_in: int, d_out: int) -> int:
        return min(self.rank, d_in, d_out)

    def scale_for(self, d_in: int, d_out: int) -> float:
        r = self.rank_for(d_in, d_out)
        return 1.0 if self.alpha is None else self.alpha / r

    def source_layer(self, u: int, members: list[int]) -> list[int]:
        """The source layers unique layer ``u`` is made from (``members``: its tied layers)."""
        if self.init == "average":
            return members
        if self.init == "stepwise":
            return [stepwise_layers(self.n_layers, self.blocks)[u]]
        return [u]  # lower


@register
class RelaxedRecursive(Method):
    name = "relaxed_recursive"
    category = "architecture"
    citation = ("Bae et al. 2024, Relaxed Recursive Transformers: Effective Parameter Sharing "
                "with Layer-wise LoRA (arXiv 2410.20672, ICLR 2025)")
    summary = ("K unique layers looped over the depth (CYCLE or SEQUENCE), each layer's "
               "projections relaxed by its own LoRA; init from a full run by average, "
               "stepwise or lower + SVD of the residuals.")

    @dataclass
    class Options:
        blocks: int | None = None  # K unique layers (None: L / its smallest prime factor)
        strategy: str = "cycle"  # cycle | sequence
        rank: int = 8  # LoRA rank per layer (0: plain Recursive Transformer)
        alpha: float | None = None  # LoRA alpha (None: = rank, scale 1)
        init: str = "average"  # average | stepwise | lower (train.init_from only)
        share_norms: bool = True  # tie the block's norms too (the authors' ln_share)

    def resolve(self, cfg: ModelConfig) -> Resolved:
        o, n = self.opts, cfg.n_layers
        strategy = option_choice(self.name, "strategy", o.strategy, STRATEGIES)
        init = option_choice(self.name, "init", o.init, INITS)
        blocks = n // smallest_prime_factor(n) if o.blocks is None else o.blocks
        if not 1 <= blocks <= n or n % blocks:
            raise ModbenchError(
                f"option blocks={blocks} of method 'relaxed_recursive' must divide "
                f"model.n_layers={n} (K unique layers looped L/K times); pick a divisor of {n}")
        if o.rank < 0:
            raise ModbenchError(f"option rank={o.rank} of method 'relaxed_recursive' must be "
                                ">= 0 (0: no LoRA, the plain Recursive Transformer)")
        if o.alpha is not None and not o.alpha > 0:
            raise ModbenchError(f"option alpha={o.alpha} of method 'relaxed_recursive' must "
                                "be positive (or empty: alpha = rank)")
        return Resolved(n, blocks, strategy, o.rank, o.alpha, init, o.share_norms)

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        r = self.resolve(cfg)

        kinds = ("linear", "norm") if r.share_norms else ("linear",)

        def tie(kind: str, name: str, layer: int) -> int:
            if kind in kinds and 0 <= layer < r.n_layers:
                return r.owner(layer)
            return layer  # cores, the embed site (-1), the final norm and head (L)

        spec.fill("tie", tie, by=self.name)
        if r.rank == 0:
            return

        def wrap(module: nn.Module, role: str, d_in: int, d_out: int, layer: int,
                 c: ModelConfig) -> nn.Module:
            if role not in RELAXED_ROLES or not 0 <= layer < r.n_layers:
                return module
            return LoRALinear(module, d_in, d_out, r.rank_for(d_in, d_out),
                              r.scale_for(d_in, d_out), c.init_std)

        spec.add("linear_wrappers", wrap, by=self.name)

    def post_init(self, model: nn.Module) -> None:
        """Refuse a combination whose core makes a sublayer's projections itself (``moe``'s
        experts, TokenFormer's Pattention): those would be neither shared across the loops
        nor relaxed, a partly recursive model under this method's name."""
        missed = unreached_sublayer(model, RELAXED_ROLES)
        if missed is not None:
            layer, sublayer, _ = missed
            raise ModbenchError(
                f"relaxed_recursive shares every block's projections across its loops, but "
                f"block {layer}'s {sublayer} has none made through the linear slot (another "
                "method builds them itself, unshared); these methods cannot be combined")

    def _lora_params(self, cfg: ModelConfig) -> int:
        r = self.resolve(cfg)
        return cfg.n_layers * sum(r.rank_for(i, o) * (i + o)
                                  for i, o in projection_widths(cfg).values())

    def extra_params(self, cfg: ModelConfig) -> int:
        r = self.resolve(cfg)
        per_layer = block_projection_params(cfg)
        per_layer += 2 * cfg.d_model if r.share_norms else 0
        return self._lora_params(cfg) - (cfg.n_layers - r.blocks) * per_layer

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(2 * self._lora_params(cfg))

    def grow_state_dict(self, state: dict[str, Any], old_cfg: ModelConfig,
                        new_cfg: ModelConfig, target: dict[str, Any] | None = None,
                        ) -> dict[str, Any]:
        r = self.resolve(new_cfg)
        _check_same_shape(old_cfg, new_cfg)
        source = next((m for m in method_spec(old_cfg).methods
                       if isinstance(m, RelaxedRecursive)), None)
        if source is not None:
            s = source.resolve(old_cfg)
            if dataclasses.replace(s, init=r.init) != r:
                raise ModbenchError(
                    f"cannot initialise relaxed_recursive(blocks={r.blocks},strategy="
                    f"{r.strategy},rank={r.rank}) from a relaxed_recursive(blocks={s.blocks},"
                    f"strategy={s.strategy},rank={s.rank}) run; start from a full run without "
                    "relaxed_recursive, or keep the source's options (init aside)")
            return state  # the same tied model: its weights load as they are
        return relax_state_dict(state, new_cfg, r)


def _check_same_shape(old: ModelConfig, new: ModelConfig) -> None:
    for key in SHAPE_FIELDS:
        a, b = getattr(old, key), getattr(new, key)
        if a != b:
            raise ModbenchError(
                f"relaxed_recursive initialises from a run of the same shape, but the source "
                f"run has model.{key}={a} and this one {b}; train the full-size model at "
                f"model.{key}={b} first")


def relax_state_dict(state: dict[str, Any], cfg: ModelConfig, r: Resolved) -> dict[str, Any]:
    """The state dict of the (relaxed) recursive model ``cfg`` made from a full-size model's
    ``state`` (same shape, no sharing): the shared weights by ``r.init``, each LoRA by the
    truncated SVD of its layer's residual. Every name of a tied tensor gets the same value.
    """
    from modbench.methods.build import plan  # the methods layer's planner (import cycle)
    from modbench.model.transformer import Transformer

    p = plan(cfg)
    with torch.device("meta"):  # names and ties only, no memory
        model = Transformer(p.cfg, p.spec)
    blocks = model.blocks
    n = r.n_layers
    per_layer = [dict(blocks[i].state_dict(keep_vars=True)) for i in range(n)]

    def source(name: str) -> torch.Tensor:
        if name not in state:
            raise ModbenchError(
                f"cannot initialise relaxed_recursive from this run: it lacks parameter "
                f"'{name}' (this model is {cfg.method!r}); start from a full-size run of the "
                "same architecture without relaxed_recursive")
        t: torch.Tensor = state[name]
        return t

    out: dict[str, Any] = {}
    for key in model.state_dict(keep_vars=True):
        if not key.startswith("blocks."):
            out[key] = source(key)

    shared: dict[tuple[int, str], torch.Tensor] = {}  # (unique layer, name) -> W'
    for i in range(n):
        wrappers = [k[: -len(LORA_A)] for k in per_layer[i] if k.endswith(LORA_A)]

        def unwrap(rel: str, wrappers: list[str] = wrappers) -> str:
            """The source name: this method's ``inner.`` taken out of the path."""
            for w in wrappers:
                if rel.startswith(w + "inner."):
                    return w + rel[len(w) + len("inner."):]
            return rel

        for rel, t in per_layer[i].items():
            if any(rel in (w + LORA_A, w + LORA_B) for w in wrappers):
                continue  # set from the SVD below
            members = [j for j in range(n) if per_layer[j].get(rel) is t]
            src_rel = unwrap(rel)
            if len(members) == 1:  # not tied: the layer's own tensor
                out[f"blocks.{i}.{rel}"] = source(f"blocks.{i}.{src_rel}")
                continue
            u = r.unique(i)
            if (u, rel) not in shared:
                parts = [source(f"blocks.{j}.{src_rel}") for j in r.source_layer(u, members)]
                if parts[0].is_floating_point():
                    shared[(u, rel)] = torch.stack(parts).double().mean(0).to(parts[0].dtype)
                else:
                    shared[(u, rel)] = parts[0]
            out[f"blocks.{i}.{rel}"] = shared[(u, rel)]

        for w in wrappers:
            lora = blocks[i].get_submodule(w[:-1])
            base = {k for k in per_layer[i] if k.startswith(w + "inner.")}
            if base != {w + "inner.weight"} or not isinstance(lora, LoRALinear):
                raise ModbenchError(
                    f"relaxed_recursive's SVD init needs a plain bias-free linear layer under "
                    f"each LoRA, but blocks.{i}.{w[:-1]} wraps {sorted(base)}; train this "
                    "combination from scratch (no train.init_from)")
            w_shared = out[f"blocks.{i}.{w}inner.weight"]
            w_orig = source(f"blocks.{i}.{w}weight")
            rank = lora.lora_A.shape[0]
            u_, s_, vh = torch.linalg.svd((w_orig.double() - w_shared.double()),
                                          full_matrices=False)
            dtype = w_orig.dtype
            out[f"blocks.{i}.{w}{LORA_B}"] = (u_[:, :rank] * s_[:rank] / lora.scale).to(dtype)
            out[f"blocks.{i}.{w}{LORA_A}"] = vh[:rank].contiguous().to(dtype)
    return out

