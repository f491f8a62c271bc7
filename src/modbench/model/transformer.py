"""The shared decoder: embedding, blocks of two sublayers, final norm, LM head.

The block reads top to bottom with no branches on methods; everything that varies is a
module in a fixed slot (see :mod:`modbench.model.spec`). The built model keeps the
:class:`~modbench.model.spec.Parts` index of its linear layers and norm sites as
``model.parts`` (a plain attribute, not a submodule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.model.attention import attention_factory, sdpa_kernel_factory
from modbench.model.ffn import gated_ffn_factory
from modbench.model.head import cross_entropy_sum, next_token_targets
from modbench.model.norms import pre_norm_placement, rmsnorm_factory
from modbench.model.rope import rope_tables
from modbench.model.spec import Builder, ModelSpec, Parts
from modbench.model.stream import (
    ForwardContext,
    StreamState,
    add_merge_factory,
    add_terms,
    additive_stream_factory,
)


def plain_linear(role: str, d_in: int, d_out: int, layer: int) -> nn.Module:
    """The baseline linear layer: no bias, initialised N(0, init_std^2) by the model."""
    return nn.Linear(d_in, d_out, bias=False)


def baseline_spec() -> ModelSpec:
    """A spec filled with the Llama-2 defaults; methods then edit it."""
    spec = ModelSpec()
    spec.fill("norm", rmsnorm_factory, by="baseline")
    spec.fill("placement", pre_norm_placement, by="baseline")
    spec.fill("linear", plain_linear, by="baseline")
    spec.fill("attn.kernel", sdpa_kernel_factory, by="baseline")
    spec.fill("attn", attention_factory, by="baseline")
    spec.fill("ffn", gated_ffn_factory, by="baseline")
    spec.fill("merge", add_merge_factory, by="baseline")
    spec.fill("stream", additive_stream_factory, by="baseline")
    return spec


class Sublayer(nn.Module):
    """One residual branch and its four slots: pre-norm, core, branch-output norm, merge and
    post-residual norm."""

    def __init__(self, name: str, core: nn.Module, build: Builder, layer: int) -> None:
        super().__init__()
        self.name = name
        self.pre_norm = build.norm(f"{name}.pre", layer)
        self.core = core
        self.post_norm = build.norm(f"{name}.post", layer)
        self.merge = build.slot("merge", build.layer_cfg(layer), layer, name)
        self.residual_norm = build.norm(f"{name}.residual", layer)


class Block(nn.Module):
    """A decoder layer: attention sublayer, then FFN sublayer, both through the stream.

    A function of tensors: ``forward(state) -> state`` (:class:`StreamState`), with no effect
    on anything else, so ``torch.utils.checkpoint`` can recompute it from its input alone and
    FSDP's hooks see its input and output. The stream is the model's (held by reference, not
    as a submodule: its parameters stay under ``stream.``); the cores get a
    :class:`ForwardContext` made here from the state, whose ``shared`` and ``aux`` go back
    into the state returned."""

    def __init__(self, build: Builder, layer: int, stream: nn.Module | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.attn = Sublayer("attn", build.core("attn", layer), build, layer)
        self.ffn = Sublayer("ffn", build.core("ffn", layer), build, layer)
        # a tuple, so that nn.Module does not register the stream as a submodule
        self._stream: tuple[nn.Module, ...] = (stream,) if stream is not None else ()

    @property
    def stream(self) -> nn.Module:
        if not self._stream:
            raise RuntimeError("this block was built without its model's stream")
        return self._stream[0]

    def forward(self, state: StreamState) -> StreamState:
        stream = self.stream
        if state.cos is None or state.sin is None:
            raise ValueError("the block's state has no RoPE tables (StreamState.cos / .sin)")
        ctx = ForwardContext(cos=state.cos, sin=state.sin, seq_len=state.cos.shape[0],
                             shared=dict(state.shared))
        for sub in (self.attn, self.ffn):
            x, state = stream.read(state, self.layer, sub.name)
            out = sub.post_norm(sub.core(sub.pre_norm(x), ctx))
            state = stream.write(state, self.layer, sub.name, x, out, sub.merge,
                                 sub.residual_norm)
            if state.inputs_kept:  # the merges read the inputs of earlier sublayers
                state = state.replace(inputs=(*state.inputs, x)[-state.inputs_kept:])
        return state.replace(shared=ctx.shared, aux=add_terms_or_none(state.aux, ctx.aux))


def add_terms_or_none(total: torch.Tensor | None, terms: list[torch.Tensor]
                      ) -> torch.Tensor | None:
    """The running auxiliary sum after ``terms`` (None while no core has added a term)."""
    return add_terms(total, terms) if terms else total


class Transformer(nn.Module):
    """Llama-2-style decoder built from a :class:`ModelSpec`."""

    def __init__(self, cfg: ModelConfig, spec: ModelSpec) -> None:
        super().__init__()
        self.cfg, self.spec = cfg, spec
        build = Builder(spec, cfg)
        # linear layers by (role, layer), norm sites by (site, layer), as built; a plain
        # attribute, so parameters and state-dict keys are those of the modules below
        self.parts: Parts = build.parts
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_norm = build.norm("embed", -1)
        self.stream = build.slot("stream", cfg)
        self.blocks = nn.ModuleList(Block(build, i, self.stream) for i in range(cfg.n_layers))
        self.final_norm = build.norm("final", cfg.n_layers)
        self.head = None if cfg.tie_embeddings else build.linear(
            "head", cfg.d_model, cfg.vocab_size, cfg.n_layers)
        self.logits_transform = build.optional("logits", nn.Identity, cfg)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, *, with_aux: bool = False, loss: bool = False,
                mask: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids ``(B, T)`` -> logits ``(B, T, V)``; with ``with_aux``, ``(logits, aux)``:
        the sum of the auxiliary loss terms the cores added to the forward's context
        (``ForwardContext.add_aux``), a 0-d tensor, zero when none did.

        With ``loss``, the summed next-token cross-entropy (fp32, 0-d) in place of the logits,
        computed a piece of the sequence at a time so the full logits never exist
        (:func:`modbench.model.head.cross_entropy_sum`); ``mask`` (``(B, T-1)`` booleans)
        keeps only those predictions. The engines train and validate through this."""
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        e = self.embed(idx)
        # at least fp32: under FSDP2 with bf16 parameters (train.fsdp_param_dtype) the lookup
        # is bf16, and the residual stream stays in the dtype it starts in, fp32 on one process
        x0 = self.embed_norm(e.to(torch.promote_types(e.dtype, torch.float32)))
        state = self.stream.start(x0).replace(
            cos=self.rope_cos[:t], sin=self.rope_sin[:t], inputs_kept=self.inputs_kept)
        for block in self.blocks:
            state = block(state)
        h = self.final_norm(self.stream.finish(state))
        out = (cross_entropy_sum(self.project, h, next_token_targets(idx, mask),
                                 self.cfg.vocab_size)
               if loss else self.project(h))
        if not with_aux:
            return out
        aux = state.aux if state.aux is not None else add_terms(None, [], self.rope_cos.device)
        return out, aux

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits: the LM head (the embedding where tied), then the
        logits slot's transform."""
        logits = F.linear(h, self.embed.weight) if self.head is None else self.head(h)
        return self.logits_transform(logits)

    @property
    def inputs_kept(self) -> int:
        """How many earlier sublayer inputs the state keeps: the most any merge declares
        (``inputs_kept``; LAUREL-PA), 0 for the others."""
        # a list, not max(generator, default=0): Dynamo cannot trace that call (a graph break
        # at every forward, tests/model/test_compile_graphs.py)
        return max([0, *[int(getattr(sub.merge, "inputs_kept", 0)) for block in self.blocks
                         for sub in (block.attn, block.ffn)]])

    def double(self) -> Transformer:
        """float64 copy for reference checks, with RoPE tables recomputed in float64."""
        super().double()
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta,
                               dtype=torch.float64)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        return self

    # ----------------------------------------------------------------- initialisation

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, init_std^2) for every linear and embedding weight (HF Llama's
        ``initializer_range``; plain, not depth-scaled, as the Mix-LN and LayerNorm-Scaling
        scripts use), zero biases; then every component's own ``modbench_init()``, so a
        method's special init (zero gates, identity mixing) is never overwritten."""
        std = self.cfg.init_std
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for m in self.modules():
            init = getattr(m, "modbench_init", None)
            if callable(init):
                init()
