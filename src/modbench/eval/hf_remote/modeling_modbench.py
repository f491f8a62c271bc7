"""Hugging Face model class of an exported modbench model (written by `modbench export`).

It builds modbench's own decoder from the modbench source bundled in this folder (the
``modbench_*.py`` files: the decoder, the planner and the model's methods, their imports
pointed at this folder), so loading needs torch and transformers and not modbench, and the
logits are modbench's. The weights come from ``model.safetensors``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_modbench import ModbenchConfig
from .modbench_config import ModelConfig
from .modbench_exported_methods import METHOD_CLASSES
from .modbench_methods_build import plan
from .modbench_model_rope import rope_tables
from .modbench_model_transformer import Transformer


def build_methods(entries: list[dict[str, Any]]) -> list[Any]:
    """The model's methods, in order, from config.json's ``modbench_methods``."""
    methods = []
    for entry in entries:
        cls = METHOD_CLASSES.get(entry["name"])
        if cls is None:
            raise ValueError(f"method {entry['name']!r} is not bundled in this export; "
                             f"it has {sorted(METHOD_CLASSES) or 'none'}")
        methods.append(cls(cls.Options(**entry.get("options", {}))))
    return methods


class ModbenchForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ModbenchConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]  # noqa: RUF012 - transformers reads a plain list
    _supports_cache_class = False

    def __init__(self, config: ModbenchConfig) -> None:
        super().__init__(config)
        p = plan(ModelConfig(**config.modbench), build_methods(config.modbench_methods))
        self.model = Transformer(p.cfg, p.spec)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from the checkpoint; only RoPE tables (not saved) are rebuilt."""
        if module is getattr(self, "model", None):
            self._rebuild_rope()

    def _rebuild_rope(self) -> None:
        c = self.model.cfg
        cos, sin = rope_tables(c.head_dim, c.max_seq_len, c.rope_theta)
        dev = self.model.embed.weight.device
        if dev.type == "meta":
            return
        self.model.rope_cos, self.model.rope_sin = cos.to(dev), sin.to(dev)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor,
                                      **kwargs: Any) -> dict[str, Any]:
        """The whole sequence at every step: the model keeps no key/value cache."""
        return {"input_ids": input_ids}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs: Any) -> CausalLMOutput:
        if self.model.rope_cos.device != self.model.embed.weight.device or \
                self.model.rope_cos.is_meta:
            self._rebuild_rope()
        logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
