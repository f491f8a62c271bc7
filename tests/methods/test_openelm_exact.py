"""layerwise_scaling(round_multipliers=true) reproduces OpenELM-270M's released shape: corenet
rounds each ramp value to two decimals before rounding to whole heads and widths (issue 31,
item 6)."""

from __future__ import annotations

import pytest

from modbench.config import ModelConfig
from modbench.methods import parse_methods
from modbench.methods.build import count_params

# OpenELM-270M (corenet's config): 16 layers, width 1280, head size 64, GQA groups of 4,
# vocabulary 32000, tied head, QK-norm, alpha 0.5 -> 1.0, beta 0.5 -> 4.0, FFN divisor 256
OPENELM_270M = dict(vocab_size=32000, d_model=1280, n_layers=16, n_heads=20, n_kv_heads=5,
                    d_ff=3456, max_seq_len=2048, tie_embeddings=True)
OPTS = "match=false,ffn_divisor=256"


def openelm(round_multipliers: bool) -> ModelConfig:
    flag = "true" if round_multipliers else "false"
    return ModelConfig(**OPENELM_270M,  # type: ignore[arg-type]
                       method=f"qknorm+layerwise_scaling({OPTS},round_multipliers={flag})")


def test_openelm_270m_has_its_released_parameter_count() -> None:
    assert count_params(openelm(True)) == 271_527_168
    assert count_params(openelm(False)) == 270_707_968  # the unrounded count


def test_rounding_changes_layer_5_to_the_released_16_of_4_heads() -> None:
    cfg = openelm(True)
    (_, lws) = parse_methods(cfg.method)
    rounded, raw = lws.shapes(cfg), parse_methods(openelm(False).method)[1].shapes(cfg)
    assert rounded.alpha[5] == pytest.approx(0.67) and raw.alpha[5] == pytest.approx(2 / 3)
    assert (rounded.heads[5], rounded.kv_heads[5]) == (16, 4)
    assert (raw.heads[5], raw.kv_heads[5]) == (12, 3)
    assert all(round(a, 2) == a for a in rounded.alpha + rounded.beta)
    # every other layer agrees: only the multipliers that round across a divisor step move
    moved = [i for i in range(16) if (rounded.heads[i], rounded.d_ff[i]) != (raw.heads[i],
                                                                             raw.d_ff[i])]
    assert 5 in moved and len(moved) < 16
