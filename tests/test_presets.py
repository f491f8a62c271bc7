"""Preset shapes and parameter counts (computed on the meta device)."""

from __future__ import annotations

import pytest

from modbench.config import PRESETS, ModelConfig
from modbench.methods.build import count_params


def analytic_params(c: ModelConfig) -> int:
    """Llama-2 parameter count from the shape: embeddings, per-layer q/k/v/o, SwiGLU, two
    norms per layer, final norm, and an untied head when not tied."""
    d, kv = c.d_model, c.n_kv_heads * c.head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * c.d_ff + 2 * d
    emb = c.vocab_size * d * (1 if c.tie_embeddings else 2)
    return emb + c.n_layers * per_layer + d


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_is_analytic(name: str) -> None:
    assert count_params(PRESETS[name].model) == analytic_params(PRESETS[name].model)


def test_climb_1_2b_matches_seed_table_4() -> None:
    assert round(count_params(PRESETS["climb-1.2b"].model) / 1e9, 3) == 1.217


@pytest.mark.parametrize("name,shape", [
    ("llama-60m", (512, 8, 8, 1376)), ("llama-71m", (512, 12, 8, 1368)),
    ("llama-130m", (768, 12, 12, 2048)), ("llama-250m", (768, 24, 16, 2560)),
    ("llama-350m", (1024, 24, 16, 2736)), ("llama-1b", (2048, 24, 32, 5461)),
])
def test_llama_shapes(name: str, shape: tuple[int, int, int, int]) -> None:
    m = PRESETS[name].model
    assert (m.d_model, m.n_layers, m.n_heads, m.d_ff) == shape
    assert m.vocab_size == 32000


def test_cpu_small_is_a_few_million() -> None:
    assert 1e6 < count_params(PRESETS["cpu-small"].model) < 10e6
