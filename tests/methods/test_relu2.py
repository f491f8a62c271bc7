"""ReLU^2: W_2 ReLU(W_1 x)^2 at width 3/2 d_ff, with the SwiGLU parameter count."""

from __future__ import annotations

import pytest
import torch

from modbench.config import PRESETS
from modbench.methods import parse_methods
from modbench.methods.build import build_model, count_params
from tests.methods.attn_reference import IDX, assert_matches, built, decoder, small_cfg


def test_decoder_equation() -> None:
    model, cfg = built("relu2")
    assert model.blocks[0].ffn.core.up_proj.weight.shape == (60, 32)  # 3/2 * 40

    def ffn(x: torch.Tensor, sd: dict, p: str, layer: int) -> torch.Tensor:
        return torch.relu(x @ sd[p + "up_proj.weight"].T) ** 2 @ sd[p + "down_proj.weight"].T

    assert_matches(model, decoder(model, IDX, cfg, ffn=ffn))


@pytest.mark.parametrize("preset", ["tiny", "cpu-small", "llama-130m", "climb-1.2b"])
def test_parameter_parity(preset: str) -> None:
    cfg = PRESETS[preset].model
    cfg_r = type(cfg)(**{**cfg.__dict__, "method": "relu2"})
    base = count_params(cfg)
    assert count_params(cfg_r) == base
    # FFN parameters: SwiGLU 3 d d_ff, ReLU^2 2 d (3/2 d_ff)
    (m,) = parse_methods("relu2")
    assert m.hidden(cfg) * 2 == 3 * cfg.d_ff and m.extra_params(cfg) == 0


def test_odd_width_rounds_up() -> None:
    cfg = small_cfg("relu2", d_ff=41)
    (m,) = parse_methods("relu2")
    assert m.hidden(cfg) == 62
    base = small_cfg("baseline", d_ff=41)
    expected = 3 * (2 * 32 * 62 - 3 * 32 * 41)
    assert count_params(cfg) - count_params(base) == m.extra_params(cfg) == expected
    assert build_model(small_cfg("relu2(hidden=8)")).blocks[0].ffn.core.up_proj.out_features == 8
