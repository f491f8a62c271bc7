"""The ``shape`` slot: per-layer configs. Every per-layer factory (cores, their parts, merges,
linear and norm wrappers) sees its layer's config, the model-level ones the model's; the
unfilled slot leaves the model's config everywhere; bad layer configs are refused with the
layer named; a ``tie`` plan cannot share differently shaped layers."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.model.attention import PassQK, SDPAKernel
from modbench.model.spec import Builder, parts_of
from modbench.model.stream import add_merge_factory, additive_stream_factory
from modbench.model.transformer import Transformer, baseline_spec

CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=40,
                  max_seq_len=16)
# layer -> (n_heads, n_kv_heads, d_ff); layer 1 keeps the model's shape
PLAN = {0: (2, 1, 24), 1: (4, 2, 40), 2: (6, 3, 64)}


def plan_shape(cfg: ModelConfig, layer: int) -> ModelConfig:
    h, kv, ff = PLAN[layer]
    return dataclasses.replace(cfg, n_heads=h, n_kv_heads=kv, d_ff=ff, attn_head_dim=8)


def recording_spec(seen: dict[str, list[tuple[int, ModelConfig]]], shape: Any = plan_shape
                   ) -> Any:
    """The baseline spec with the shape plan and every per-layer slot filled by a recorder
    that notes the config it was given (and then builds the baseline component)."""
    spec = baseline_spec()
    if shape is not None:
        spec.fill("shape", shape, by="test")

    def part(slot: str, make: Any) -> Any:
        def factory(c: ModelConfig, layer: int) -> nn.Module:
            seen[slot].append((layer, c))
            return make()
        return factory

    spec.fill("attn.q_norm", part("attn.q_norm", nn.Identity), by="test")
    spec.fill("attn.k_norm", part("attn.k_norm", nn.Identity), by="test")
    spec.fill("attn.qk_post", part("attn.qk_post", PassQK), by="test")
    spec.fill("attn.kernel", part("attn.kernel", SDPAKernel), by="test")
    spec.fill("ffn.act", part("ffn.act", nn.SiLU), by="test")

    def merge(c: ModelConfig, layer: int, sublayer: str) -> nn.Module:
        seen["merge"].append((layer, c))
        return add_merge_factory(c, layer, sublayer)

    def stream(c: ModelConfig) -> nn.Module:
        seen["stream"].append((-1, c))
        return additive_stream_factory(c)

    def linear_wrap(m: nn.Module, role: str, d_in: int, d_out: int, layer: int,
                    c: ModelConfig) -> nn.Module:
        seen["linear_wrappers"].append((layer, c))
        return m

    def norm_wrap(m: nn.Module, site: str, layer: int, c: ModelConfig) -> nn.Module:
        seen["norm_wrappers"].append((layer, c))
        return m

    spec.fill("merge", merge, by="test")
    spec.fill("stream", stream, by="test")
    spec.add("linear_wrappers", linear_wrap, by="test")
    spec.add("norm_wrappers", norm_wrap, by="test")
    return spec


def test_every_per_layer_factory_sees_its_layers_config() -> None:
    seen: dict[str, list[tuple[int, ModelConfig]]] = defaultdict(list)
    cfg = dataclasses.replace(CFG, tie_embeddings=False)
    model = Transformer(cfg, recording_spec(seen))
    for slot in ("attn.q_norm", "attn.k_norm", "attn.qk_post", "attn.kernel", "ffn.act",
                 "merge", "linear_wrappers", "norm_wrappers"):
        layers = {layer for layer, _ in seen[slot]}
        assert set(range(cfg.n_layers)) <= layers, slot
        for layer, c in seen[slot]:
            if 0 <= layer < cfg.n_layers:
                assert (c.n_heads, c.n_kv_heads, c.d_ff) == PLAN[layer], (slot, layer)
            else:  # embed (-1), final and head (L): the model's own config
                assert c is cfg, (slot, layer)
    assert seen["stream"] == [(-1, cfg)]
    parts = parts_of(model)
    for layer, (h, kv, ff) in PLAN.items():
        assert parts.linear("q", layer).weight.shape == (h * 8, 32)
        assert parts.linear("k", layer).weight.shape == (kv * 8, 32)
        assert parts.linear("o", layer).weight.shape == (32, h * 8)
        assert parts.linear("up", layer).weight.shape == (ff, 32)
        assert parts.linear("down", layer).weight.shape == (32, ff)
    assert model(torch.randint(0, 61, (2, 10))).shape == (2, 10, 61)


def test_unfilled_slot_gives_every_layer_the_models_config_itself() -> None:
    seen: dict[str, list[tuple[int, ModelConfig]]] = defaultdict(list)
    Transformer(CFG, recording_spec(seen, shape=None))
    assert all(c is CFG for items in seen.values() for _, c in items)
    build = Builder(baseline_spec(), CFG)
    assert all(build.layer_cfg(i) is CFG for i in range(-1, CFG.n_layers + 1))


def test_layer_configs_are_computed_once_per_layer() -> None:
    calls: list[int] = []

    def counting(cfg: ModelConfig, layer: int) -> ModelConfig:
        calls.append(layer)
        return plan_shape(cfg, layer)

    Transformer(CFG, recording_spec(defaultdict(list), shape=counting))
    assert sorted(calls) == list(range(CFG.n_layers))


def build_with(shape: Any) -> None:
    spec = baseline_spec()
    spec.fill("shape", shape, by="test")
    Transformer(CFG, spec)


def test_invalid_layer_config_names_the_layer() -> None:
    def bad_gqa(cfg: ModelConfig, layer: int) -> ModelConfig:
        return plan_shape(cfg, layer) if layer != 2 else dataclasses.replace(
            plan_shape(cfg, layer), n_kv_heads=4)

    with pytest.raises(ModbenchError, match=r"layer 2 an invalid config.*n_kv_heads=4"):
        build_with(bad_gqa)


def test_head_dim_must_be_the_models() -> None:
    def other_head_dim(cfg: ModelConfig, layer: int) -> ModelConfig:
        return dataclasses.replace(cfg, n_heads=2, n_kv_heads=1)  # d_h = 32 / 2 = 16, not 8

    with pytest.raises(ModbenchError, match="layer 0 head_dim 16, the model's is 8; RoPE"):
        build_with(other_head_dim)


def test_only_the_shape_fields_may_change() -> None:
    def wider(cfg: ModelConfig, layer: int) -> ModelConfig:
        return dataclasses.replace(cfg, d_model=64, attn_head_dim=8)

    with pytest.raises(ValueError, match="differs from the model's outside n_heads"):
        build_with(wider)
    with pytest.raises(ValueError, match="must return a ModelConfig"):
        build_with(lambda cfg, layer: {"n_heads": 2})


def test_tie_refuses_differently_shaped_layers_and_allows_equal_ones() -> None:
    def tie_to_0(kind: str, name: str, layer: int) -> int:
        return 0 if kind == "core" else layer

    spec = baseline_spec()
    spec.fill("shape", plan_shape, by="test")
    spec.fill("tie", tie_to_0, by="tie_test")
    with pytest.raises(ValueError, match="to layer 0, whose shape differs under the shape slot"):
        Transformer(CFG, spec)

    def same_shape(cfg: ModelConfig, layer: int) -> ModelConfig:
        return dataclasses.replace(cfg, n_heads=2, n_kv_heads=1, d_ff=24, attn_head_dim=8)

    spec = baseline_spec()
    spec.fill("shape", same_shape, by="test")
    spec.fill("tie", tie_to_0, by="tie_test")
    parts = parts_of(Transformer(CFG, spec))
    assert parts.core("attn", 2) is parts.core("attn", 0)
