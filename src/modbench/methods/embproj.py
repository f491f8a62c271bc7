"""Learnable embedding projections (EmbProj, from Outlier-Safe Pre-Training).

Equations (docs/sources.md#embproj), with ``E`` the token embedding, ``N_e`` the module at the
``embed`` norm site (Identity in the baseline), ``N_f`` the final norm and ``W`` the LM head::

    x0     = N_e( E[t] P_in^T )                    P_in  in R^{d x d}, right after the embedding
    logits = ( N_f(h) P_out^T ) W^T                P_out in R^{d x d}, right before the head

After training both fold away (:func:`fold_embedding_projection`)::

    E' = E P_in^T        W' = W P_out              (exact: x0 = N_e(E'[t]), logits = N_f(h) W'^T)

Citation: Park et al. 2025, "Outlier-Safe Pre-Training for Robust 4-Bit Quantization of Large
Language Models" (OSP; code dmis-lab/Outlier-Safe-Pre-Training): "a learnable embedding
projection, redistributing activation magnitudes originating from embedding matrices",
trained with Muon and folded away after training. ``osp`` composes it with SSNorm and Muon.

Init: P_in and P_out orthogonal (``torch.nn.init.orthogonal_``, in ``modbench_init``, after the
model's generic N(0, init_std^2) pass), so the freshly built model computes what the baseline
with the same embedding and head would, up to a rotation of the stream.

Slots: the additive ``norm_wrappers`` slot at the ``embed`` site (layer -1: P_in applied before
the site's module, norm or Identity) and at the ``final`` site (layer L: P_out applied after
the final norm). No edit to the model. Both matrices are 2-D hidden matrices, so
``recipe.optimizer=muon`` trains them with Muon (``muon_split``: they are neither an
``nn.Embedding`` nor the module named ``head``); AdamW otherwise.

Choices of our own (the sources are silent):

- P_in sits before the embed site's module, so a placement with an embedding norm still folds
  exactly (the norm comes after P_in). The fold refuses when another wrapper applies anything
  between the embedding and P_in, or between P_out and the head (a norm wrapper listed after
  ``embproj`` in the method string wraps it from outside: put ``embproj`` last).
- Tied embeddings: the fold **unties**: E' = E P_in^T becomes the embedding and the model gets
  its own head W' = E P_out (E before the fold), ``cfg.tie_embeddings`` turns false and the
  folded model has V d parameters more than the tied baseline. Refusing would leave tied
  models unfoldable; P_in and P_out are independent, so no single matrix serves both.
- The fold also rewrites the model's config: ``method`` loses ``embproj`` (``osp`` becomes
  ``ssnorm``), so ``build_model(model.cfg)`` builds a model the folded state dict loads into.
- Only a plain ``nn.Linear`` head (no bias) is folded; a head changed by a ``linear`` or
  ``linear_wrappers`` method (nGPT, CoMT, TokenFormer) is refused.

Parameters: + 2 d^2. FLOPs (forward, per token): + 4 d^2 (two d x d matrix products).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, MethodSpec, method_spec, register
from modbench.model.spec import ModelSpec, parts_of

EMBED, FINAL = "embed", "final"
# marks this method's norm_wrappers filler, so that a second one (embproj+osp) is refused
_MARK = "modbench_embproj"


class _Projection(nn.Module):
    """A norm site's module and an orthogonal-initialised d x d projection ``proj``."""

    def __init__(self, module: nn.Module, dim: int) -> None:
        super().__init__()
        self.module = module
        self.proj = nn.Linear(dim, dim, bias=False)

    def modbench_init(self) -> None:
        nn.init.orthogonal_(self.proj.weight)


class EmbedProjection(_Projection):
    """``module(x P_in^T)``: the embed site, the projection applied first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(self.proj(x))


class HeadProjection(_Projection):
    """``module(x) P_out^T``: the final site, the projection applied last (before the head)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.module(x))


def embproj_wrapper(module: nn.Module, site: str, layer: int, cfg: Any) -> nn.Module:
    """The ``norm_wrappers`` filler: P_in at the embed site, P_out at the final site."""
    if site == EMBED:
        return EmbedProjection(module, cfg.d_model)
    if site == FINAL:
        return HeadProjection(module, cfg.d_model)
    return module


setattr(embproj_wrapper, _MARK, True)


def add_embedding_projection(spec: ModelSpec, by: str) -> None:
    """Add the projections to ``spec`` (once: a second filler is refused)."""
    spec.add("norm_wrappers", embproj_wrapper, by=by)
    owners = [o for o, fn in spec.additive["norm_wrappers"] if getattr(fn, _MARK, False)]
    if len(owners) > 1:  # (the owner as recorded: a composite's view records its own name)
        raise ModbenchError(f"methods '{owners[0]}' and '{owners[1]}' both add the embedding "
                            "projection (osp includes embproj); list only one of them")


@register
class EmbProj(Method):
    name = "embproj"
    category = "architecture"
    citation = ("Park et al. 2025, Outlier-Safe Pre-Training for Robust 4-Bit Quantization of "
                "Large Language Models")
    summary = ("Learnable d x d projections after the embedding and before the head (orthogonal "
               "init), folded away after training.")
    # what the method string becomes after fold_embedding_projection ("": dropped)
    folds_to: ClassVar[str] = ""

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        add_embedding_projection(spec, self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 2 * cfg.d_model * cfg.d_model

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 4.0 * cfg.d_model * cfg.d_model


def _folded_method(methods: Sequence[Method]) -> MethodSpec:
    """The method spec of a folded model: each method's ``folds_to`` replaces it."""
    terms = []
    for m in methods:
        to = getattr(m, "folds_to", None)
        if to is None:
            terms.append(m.label)
        elif to:
            terms.append(to)
    return MethodSpec.parse("+".join(terms) or "baseline")


@torch.no_grad()
def fold_embedding_projection(model: nn.Module) -> None:
    """Fold the trained projections into the embedding and the head, in place.

    ``E <- E P_in^T``; the head ``W <- W P_out`` (with tied embeddings the model is untied: it
    gets its own head ``E_old P_out``). The wrappers are removed from the embed and final
    sites (``model.parts`` follows), and ``model.cfg`` becomes the folded model's config
    (method without ``embproj``, ``tie_embeddings`` false if untied). The logits are unchanged
    up to rounding (the products are formed in float64). Raises :class:`ModbenchError` for a
    model without the projections or where they cannot be folded exactly.
    """
    parts = parts_of(model)
    cfg = model.cfg
    n = cfg.n_layers
    first, last = parts.norm(EMBED, -1), parts.norm(FINAL, n)
    if not isinstance(first, EmbedProjection) and not isinstance(last, HeadProjection):
        raise ModbenchError("the model has no embedding projection to fold; build it with "
                            "method embproj or osp (or it was folded already)")
    if not isinstance(first, EmbedProjection):
        raise ModbenchError(
            f"cannot fold the embedding projection: {type(first).__name__} is applied to the "
            "embedding before P_in; list embproj after the other norm wrappers")
    if not isinstance(last, HeadProjection):
        raise ModbenchError(
            f"cannot fold the head projection: {type(last).__name__} is applied between P_out "
            "and the head; list embproj after the other norm wrappers")
    head = model.head
    if head is not None and (type(head) is not nn.Linear or head.bias is not None):
        raise ModbenchError(f"cannot fold P_out into the head: it is a {type(head).__name__}, "
                            "not a plain linear layer (a linear or linear_wrappers method)")
    emb = model.embed.weight
    w = emb if head is None else head.weight
    p_in = first.proj.weight.detach().double()
    p_out = last.proj.weight.detach().double()
    new_w = (w.detach().double() @ p_out).to(w.dtype)
    emb.copy_((emb.detach().double() @ p_in.T).to(emb.dtype))
    if head is None:
        head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=emb.device,
                         dtype=emb.dtype)
        head.weight.copy_(new_w)
        model.head = head
        parts.add_linear("head", n, head)
    else:
        head.weight.copy_(new_w)
    model.embed_norm, model.final_norm = first.module, last.module
    parts._norm[(EMBED, -1)] = first.module  # the index follows the unwrapped sites
    parts._norm[(FINAL, n)] = last.module
    folded = _folded_method(getattr(model, "methods", None) or method_spec(cfg).methods)
    model.cfg = dataclasses.replace(cfg, method=folded.canonical, tie_embeddings=False)
    model.methods = list(folded.methods)
