"""layerwise_scaling (OpenELM): per-layer heads and FFN widths against the formulas written out
here (alpha/beta ramps, corenet's make_divisible), the parameter count against the sum over
layers, the matched-size rescaling against a brute-force scan, an independent float64 forward
with per-layer head counts, other methods' parts at the layer's sizes, FLOPs, bad options."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from modbench.config import ModelConfig, resolve
from modbench.errors import ModbenchError
from modbench.measure import flop_report, measure_flops
from modbench.methods import parse_methods
from modbench.methods.build import build_model, count_params, plan
from modbench.model.spec import parts_of
from tests.methods.attn_reference import (
    IDX,
    assert_matches,
    built,
    decoder,
    standard_attention,
)

SHAPES = [
    dict(),
    dict(n_layers=3, n_kv_heads=4, tie_embeddings=False),
    dict(n_layers=5, d_model=128, n_heads=8, n_kv_heads=2, d_ff=344),
    dict(n_layers=1),
]


def tiny_cfg(method: str, **shape: Any) -> ModelConfig:
    cfg = resolve("tiny", method=method).model
    for k, v in shape.items():
        setattr(cfg, k, v)
    return cfg


def divisible(v: float, div: int) -> int:
    """MobileNet's / corenet's rule, written out: nearest multiple (half up), at least div,
    plus div when the rounded value is below 90 % of v."""
    r = max(div, math.floor(v + div / 2) // div * div)
    return r + div if r < 0.9 * v else r


def formula(cfg: ModelConfig, a: tuple[float, float], b: tuple[float, float],
            sa: float = 1.0, sb: float = 1.0, ffn_div: int = 8
            ) -> tuple[list[int], list[int], list[int]]:
    """(n_h^i, n_kv^i, m^i) from the paper's ramps at scales (sa, sb)."""
    n, d, dh = cfg.n_layers, cfg.d_model, cfg.d_model // cfg.n_heads
    g = cfg.n_heads // cfg.n_kv_heads
    heads, kv, ff = [], [], []
    for i in range(n):
        t = i / (n - 1) if n > 1 else 0.0
        alpha = sa * (a[0] + (a[1] - a[0]) * t)
        beta = sb * (b[0] + (b[1] - b[0]) * t)
        h = divisible(alpha * d, dh * g) // dh
        heads.append(h)
        kv.append(h // g)
        ff.append(divisible(beta * d, ffn_div))
    return heads, kv, ff


def formula_params(cfg: ModelConfig, heads: list[int], kv: list[int], ff: list[int]) -> int:
    """sum_i [d d_h (2 n_h^i + 2 n_kv^i) + 3 d m^i] + embeddings + norms."""
    d, dh = cfg.d_model, cfg.d_model // cfg.n_heads
    layers = sum(d * dh * (2 * h + 2 * k) + 3 * d * m for h, k, m in zip(heads, kv, ff,
                                                                        strict=True))
    emb = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return layers + emb + cfg.n_layers * 2 * d + d


def assert_built_shapes(cfg: ModelConfig, heads: list[int], kv: list[int], ff: list[int]
                        ) -> None:
    model = build_model(cfg, seed=0)
    parts, d, dh = parts_of(model), cfg.d_model, cfg.d_model // cfg.n_heads
    for i in range(cfg.n_layers):
        core = parts.core("attn", i)
        assert (core.n_heads, core.n_kv_heads, core.head_dim) == (heads[i], kv[i], dh), i
        assert parts.linear("q", i).weight.shape == (heads[i] * dh, d)
        assert parts.linear("k", i).weight.shape == (kv[i] * dh, d)
        assert parts.linear("v", i).weight.shape == (kv[i] * dh, d)
        assert parts.linear("o", i).weight.shape == (d, heads[i] * dh)
        for role in ("gate", "up"):
            assert parts.linear(role, i).weight.shape == (ff[i], d)
        assert parts.linear("down", i).weight.shape == (d, ff[i])
    assert sum(p.numel() for p in model.parameters()) == formula_params(cfg, heads, kv, ff)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("opts,a,b,div", [
    ("match=false", (0.5, 1.0), (0.5, 4.0), 8),
    ("match=false,alpha_min=0.25,alpha_max=1.5,beta_min=1,beta_max=3,ffn_divisor=16",
     (0.25, 1.5), (1.0, 3.0), 16),
    ("match=false,alpha_min=1.0,alpha_max=0.5", (1.0, 0.5), (0.5, 4.0), 8),
])
def test_unmatched_shapes_and_count_follow_the_formula(shape: dict[str, Any], opts: str,
                                                       a: tuple[float, float],
                                                       b: tuple[float, float], div: int
                                                       ) -> None:
    cfg = tiny_cfg(f"layerwise_scaling({opts})", **shape)
    heads, kv, ff = formula(cfg, a, b, ffn_div=div)
    assert_built_shapes(cfg, heads, kv, ff)
    base = count_params(tiny_cfg("baseline", **shape))
    (m,) = parse_methods(cfg.method)
    assert count_params(cfg) - base == m.extra_params(cfg)


def test_openelm_shapes_at_openelm_scale() -> None:
    """OpenELM-270M's ramp (L = 16, d = 1280, d_h = 64, group 4, FFN divisor 256), without
    corenet's 2-decimal rounding of the multipliers: the first layer has 12 query heads
    (0.5 * 1280 / 64 = 10, rounded to whole groups of 4), the last 20; FFN widths from 768
    (0.5 * 1280 = 640, rounded to a multiple of 256) to 5120."""
    cfg = ModelConfig(vocab_size=256, d_model=1280, n_layers=16, n_heads=20, n_kv_heads=5,
                      d_ff=3456, max_seq_len=64)
    (m,) = parse_methods("layerwise_scaling(match=false,ffn_divisor=256)")
    s = m.shapes(cfg)
    heads, kv, ff = formula(cfg, (0.5, 1.0), (0.5, 4.0), ffn_div=256)
    assert list(s.heads) == heads and list(s.kv_heads) == kv and list(s.d_ff) == ff
    assert (s.heads[0], s.heads[-1], s.d_ff[0], s.d_ff[-1]) == (12, 20, 768, 5120)
    assert all(h % 4 == 0 and h // k == 4 for h, k in zip(s.heads, s.kv_heads, strict=True))


def closest_by_scan(total: Any, target: int) -> int:
    """The smallest |sum - target| over a fine grid of scales (independent of the bisection)."""
    return min(abs(total(k / 2000) - target) for k in range(1, 16001))


@pytest.mark.parametrize("shape", SHAPES)
def test_matched_sizes_are_the_closest_the_rounding_allows(shape: dict[str, Any]) -> None:
    cfg = tiny_cfg("layerwise_scaling", **shape)
    (m,) = parse_methods("layerwise_scaling")
    s = m.shapes(cfg)
    a, b = (0.5, 1.0), (0.5, 4.0)
    # the reported multipliers are the ramps times one factor each (ratio max/min kept)
    assert s.alpha == pytest.approx(tuple(s.alpha_scale * x for x in
                                          (a[0] + (a[1] - a[0]) * (i / max(cfg.n_layers - 1, 1))
                                           for i in range(cfg.n_layers))))
    if cfg.n_layers > 1:
        assert s.alpha[-1] / s.alpha[0] == pytest.approx(2.0)
        assert s.beta[-1] / s.beta[0] == pytest.approx(8.0)
    heads, kv, ff = formula(cfg, a, b, s.alpha_scale, s.beta_scale)
    assert_built_shapes(cfg, heads, kv, ff)
    n = cfg.n_layers
    target_h, target_f = n * cfg.n_heads, n * cfg.d_ff
    assert abs(sum(heads) - target_h) == closest_by_scan(
        lambda x: sum(formula(cfg, a, b, x, 1.0)[0]), target_h)
    assert abs(sum(ff) - target_f) == closest_by_scan(
        lambda x: sum(formula(cfg, a, b, 1.0, x)[2]), target_f)


@pytest.mark.parametrize("preset", ["cpu-small", "llama-130m"])
def test_matched_at_real_presets(preset: str) -> None:
    """At llama-130m the sums land exactly on the baseline (equal parameters)."""
    cfg = resolve(preset, method="layerwise_scaling").model
    base = resolve(preset).model
    (m,) = parse_methods("layerwise_scaling")
    s = m.shapes(cfg)
    heads, kv, ff = formula(cfg, (0.5, 1.0), (0.5, 4.0), s.alpha_scale, s.beta_scale)
    assert (list(s.heads), list(s.kv_heads), list(s.d_ff)) == (heads, kv, ff)
    assert count_params(cfg) == formula_params(cfg, heads, kv, ff)
    assert count_params(cfg) - count_params(base) == m.extra_params(cfg)
    if preset == "llama-130m":
        assert m.extra_params(cfg) == 0 and sum(heads) == 12 * 12 and sum(ff) == 12 * 2048
        assert heads[0] < heads[-1] and ff[0] < ff[-1]


def test_forward_matches_a_float64_reference_with_per_layer_heads() -> None:
    """The decoder written out on plain tensors (tests/methods/attn_reference), each layer's
    attention with its own n_h^i and n_kv^i from the formula, the FFN at the widths of the
    state dict."""
    method = "layerwise_scaling(match=false,alpha_min=0.5,alpha_max=1.5)"
    model, cfg = built(method)
    heads, kv, _ = formula(cfg, (0.5, 1.5), (0.5, 4.0))
    assert len(set(heads)) == 3  # 2, 4, 6 heads: every layer differs
    dh = cfg.d_model // cfg.n_heads
    per_layer = [SimpleNamespace(n_heads=h, n_kv_heads=k, d_model=h * dh)
                 for h, k in zip(heads, kv, strict=True)]

    def attn(x: torch.Tensor, sd: dict[str, torch.Tensor], p: str, layer: int,
             shared: dict[str, Any]) -> torch.Tensor:
        return standard_attention(x, sd, p, per_layer[layer])

    assert_matches(model, decoder(model, IDX, cfg, attn=attn))


@pytest.mark.parametrize("other,name,width", [
    ("ssmax", "s", lambda h, kv, dh, ff: h),
    ("gated_attn", "proj.weight", lambda h, kv, dh, ff: h * dh),
    ("qknorm(scope=full)", "q_norm.norm.weight", lambda h, kv, dh, ff: h * dh),
    ("relu2", "up_proj.weight", lambda h, kv, dh, ff: (3 * ff + 1) // 2),
])
def test_other_methods_parts_take_the_layers_sizes(other: str, name: str, width: Any) -> None:
    cfg = tiny_cfg(f"layerwise_scaling(match=false,alpha_max=1.5)+{other}", n_layers=3)
    heads, kv, ff = formula(cfg, (0.5, 1.5), (0.5, 4.0))
    dh = cfg.d_model // cfg.n_heads
    model = build_model(cfg, seed=0)
    for i, block in enumerate(model.blocks):
        found = [p.shape[0] for n, p in block.named_parameters() if n.endswith(name)]
        assert found and found[0] == width(heads[i], kv[i], dh, ff[i]), (other, i, found)
    model(IDX % cfg.vocab_size).sum().backward()


@pytest.mark.parametrize("method", ["layerwise_scaling", "layerwise_scaling(match=false)"])
def test_flops_match_the_counter(method: str) -> None:
    cfg = tiny_cfg(method, n_layers=3)
    (m,) = parse_methods(method)
    heads = m.shapes(cfg).heads
    assert sum(heads) != 3 * cfg.n_heads  # the score term is exercised
    report = flop_report(cfg, 32)
    model = build_model(cfg, seed=0)
    assert report.forward_flops_per_token == pytest.approx(measure_flops(model, 32), rel=1e-9)


@pytest.mark.parametrize("opts,msg", [
    ("alpha_min=0", "option alpha_min=0.0 of method 'layerwise_scaling' must be a positive"),
    ("beta_max=-1", "option beta_max=-1.0 of method"),
    ("ffn_divisor=0", "option ffn_divisor=0 of method 'layerwise_scaling' must be at least 1"),
])
def test_bad_options_are_refused(opts: str, msg: str) -> None:
    with pytest.raises(ModbenchError, match=msg):
        plan(tiny_cfg(f"layerwise_scaling({opts})"))


def test_shape_slot_is_filled_and_the_baseline_untouched() -> None:
    assert plan(tiny_cfg("layerwise_scaling")).spec.owner("shape") == "layerwise_scaling"
    assert "shape" not in plan(tiny_cfg("baseline")).spec.fills
