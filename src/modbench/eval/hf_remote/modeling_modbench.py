"""Hugging Face model class of an exported modbench model (written by `modbench export`).

It builds modbench's own decoder from the config (so the logits are modbench's), and loads
the weights from ``model.safetensors``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_modbench import ModbenchConfig


class ModbenchForCausalLM(PreTrainedModel):
    config_class = ModbenchConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]  # noqa: RUF012 - transformers reads a plain list

    def __init__(self, config: ModbenchConfig) -> None:
        super().__init__(config)
        from modbench.config import ModelConfig
        from modbench.methods.build import plan
        from modbench.model.transformer import Transformer

        p = plan(ModelConfig(**config.modbench))
        self.model = Transformer(p.cfg, p.spec)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from the checkpoint; only RoPE tables (not saved) are rebuilt."""
        if module is getattr(self, "model", None):
            self._rebuild_rope()

    def _rebuild_rope(self) -> None:
        from modbench.model.rope import rope_tables

        c = self.model.cfg
        cos, sin = rope_tables(c.head_dim, c.max_seq_len, c.rope_theta)
        dev = self.model.embed.weight.device
        if dev.type == "meta":
            return
        self.model.rope_cos, self.model.rope_sin = cos.to(dev), sin.to(dev)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

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
