"""Outlier-Safe Pre-Training (OSP): SSNorm + learnable embedding projections + Muon.

Equations (docs/sources.md#osp): every norm is single-scale RMSNorm ``x / RMS(x) * s`` (``ssnorm``,
one scalar per norm, the final norm included), the embedding and the head get the orthogonally
initialised projections of ``embproj``::

    x0     = E[t] P_in^T                 (then the embed site's module, Identity in Pre-LN)
    logits = ( SSNorm_f(h) P_out^T ) W^T

and the run trains with ``recipe.optimizer=muon`` (a recipe exception, recorded in the run's
config): Muon on the hidden matrices, P_in and P_out included, AdamW on the embedding, the
head and the norm scales.

Citation: Park et al. 2025, "Outlier-Safe Pre-Training for Robust 4-Bit Quantization of Large
Language Models" (code dmis-lab/Outlier-Safe-Pre-Training).

Init: as its parts: s = 1, P_in and P_out orthogonal.

Slots: it configures the registered ``ssnorm`` and ``embproj`` methods (no code of theirs is
repeated) through a view of the spec that records ``osp`` as the filler: the ``norm`` slot
(keyed as ssnorm's, so ``osp+ssnorm`` is the same thing twice and accepted, while
``osp+layernorm`` or ``osp+dyt`` is refused as two norm types) and the additive
``norm_wrappers`` slot (``osp+embproj`` is refused: one projection pair). Placements compose
(``osp+post_ln``, ``osp+sandwich``). After training,
:func:`modbench.methods.embproj.fold_embedding_projection` folds the projections away and the
model becomes an ``ssnorm`` model (untied, if it was tied).

Recipe: ``recipe.optimizer=muon`` is imposed; the paper's other settings (its lr, Muon's
hyper-parameters) are not: the frozen recipe's ``muon_*`` keys apply. Parameters: ssnorm's
(1 - d) per baseline norm (2 L + 1) plus 2 d^2; FLOPs: + 4 d^2 per token (the projections).
"""

from __future__ import annotations

from typing import Any, ClassVar

from modbench.config import ModelConfig
from modbench.methods.base import Method, register
from modbench.methods.basic_norms import SSNorm
from modbench.methods.embproj import EmbProj
from modbench.model.spec import ModelSpec


class FilledAs(ModelSpec):
    """A view of ``spec`` (the same slot tables) whose fills and additions are recorded as
    made by ``name``: a composite method configures registered methods through it. A fill
    keeps the component's own key (its name unless it passes one), so the composite is
    compatible with that component listed alongside it and conflicts as it would."""

    def __init__(self, spec: ModelSpec, name: str) -> None:
        super().__init__(fills=spec.fills, additive=spec.additive)
        self.name = name

    def fill(self, slot: str, value: Any, *, by: str, key: Any = None) -> None:  # type: ignore[override]
        super().fill(slot, value, by=self.name, key=by if key is None else key)

    def add(self, slot: str, value: Any, *, by: str) -> None:  # type: ignore[override]
        super().add(slot, value, by=self.name)


@register
class OSP(Method):
    name = "osp"
    category = "architecture"
    citation = ("Park et al. 2025, Outlier-Safe Pre-Training for Robust 4-Bit Quantization of "
                "Large Language Models")
    summary = ("Outlier-Safe Pre-Training: single-scale RMSNorm, embedding projections and the "
               "Muon optimizer.")
    recipe_exceptions: ClassVar[dict[str, Any]] = {"optimizer": "muon"}
    # what the method string becomes after fold_embedding_projection
    folds_to: ClassVar[str] = "ssnorm"

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.parts: list[Method] = [SSNorm(), EmbProj()]

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        view = FilledAs(spec, self.name)
        for part in self.parts:
            part.configure(view, cfg)

    def extra_params(self, cfg: ModelConfig) -> int:
        return sum(part.extra_params(cfg) for part in self.parts)

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(sum(part.extra_flops(cfg, seq_len) for part in self.parts))
