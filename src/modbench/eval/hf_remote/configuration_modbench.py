"""Hugging Face config of an exported modbench model (written by `modbench export`)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class ModbenchConfig(PretrainedConfig):
    """Holds modbench's own model config under ``modbench`` (shape and method string) and the
    model's methods with their options under ``modbench_methods``."""

    model_type = "modbench"

    def __init__(self, modbench: dict[str, Any] | None = None,
                 modbench_methods: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        self.modbench = dict(modbench or {})
        self.modbench_methods = [dict(m) for m in modbench_methods or []]
        kwargs.setdefault("vocab_size", self.modbench.get("vocab_size"))
        kwargs.setdefault("hidden_size", self.modbench.get("d_model"))
        kwargs.setdefault("num_hidden_layers", self.modbench.get("n_layers"))
        kwargs.setdefault("num_attention_heads", self.modbench.get("n_heads"))
        kwargs.setdefault("max_position_embeddings", self.modbench.get("max_seq_len"))
        # modbench ties inside its own module; Hugging Face must not tie anything itself
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
