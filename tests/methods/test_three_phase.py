"""Three-Phase Transformer (three_phase): the per-channel RMSNorm, the per-channel Givens
rotation, the horn injection and a whole float64 forward against independent computations
written here from the equations (plain tensors, explicit loops); the head-count refusal;
N in {1, 2, 4} trains; the parameter overhead L d / (2N); composition and conflicts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods import parse_methods
from modbench.methods.build import build_model, count_params
from modbench.methods.three_phase import PhaseRMSNorm, ThreePhaseStream
from modbench.model.stream import AddMerge
from modbench.train.trainer import train
from tests.helpers import read_metrics, run_capturing, tiny
from tests.methods.attn_reference import (
    IDX,
    random_stream_model,
    small_cfg,
    standard_attention,
    swiglu,
)

Tensor = torch.Tensor
G = torch.Generator().manual_seed(0)


# ------------------------------------------------------------ independent references


def channel_rms(x: Tensor, g: Tensor, n: int, eps: float) -> Tensor:
    """y = x_i / sqrt(mean(x_i^2) + eps) * g_i for each of the n channels (loop)."""
    c = x.shape[-1] // n
    out = torch.empty_like(x)
    for i in range(n):
        xi = x[..., i * c:(i + 1) * c]
        out[..., i * c:(i + 1) * c] = xi / torch.sqrt((xi * xi).mean(-1, keepdim=True) + eps)
    return out * g


def givens(x: Tensor, theta: list[float], n: int) -> Tensor:
    """Rotate the pair (k, k + c/2) of channel i by theta[k] + i 2 pi / n (scalar loops)."""
    c = x.shape[-1] // n
    h = c // 2
    out = x.clone()
    for i in range(n):
        for k in range(h):
            phi = theta[k] + i * 2 * math.pi / n
            a, b = x[..., i * c + k], x[..., i * c + h + k]
            out[..., i * c + k] = a * math.cos(phi) - b * math.sin(phi)
            out[..., i * c + h + k] = a * math.sin(phi) + b * math.cos(phi)
    return out


def with_horn(x0: Tensor, scale: float) -> Tensor:
    """x0[p] + scale * r(p) * 1_d / sqrt(d), r(p) = 1 / (p + 1) (loop over positions)."""
    d = x0.shape[-1]
    out = x0.clone()
    for p in range(x0.shape[-2]):
        out[..., p, :] += scale * (1.0 / (p + 1)) * torch.ones(d, dtype=x0.dtype) / math.sqrt(d)
    return out


def reference_logits(model: torch.nn.Module, cfg: Any, n: int, scale: float) -> Tensor:
    """The Pre-LN 3PT decoder on each sequence of IDX: horn on the embedding; per block
    h = x + Attn(CN(x)), h <- R_l h, x = h + FFN(CN(h)); final CN, tied head."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    eps = cfg.norm_eps
    out = []
    for row in IDX:
        x = with_horn(sd["embed.weight"][row], scale)
        for layer in range(cfg.n_layers):
            p = f"blocks.{layer}."
            h = channel_rms(x, sd[p + "attn.pre_norm.weight"], n, eps)
            x = x + standard_attention(h, sd, p + "attn.core.", cfg)
            x = givens(x, sd[f"stream.theta.{layer}"].tolist(), n)
            h = channel_rms(x, sd[p + "ffn.pre_norm.weight"], n, eps)
            x = x + swiglu(h, sd, p + "ffn.core.", layer)
        h = channel_rms(x, sd["final_norm.weight"], n, eps)
        out.append(h @ sd["embed.weight"].T)
    return torch.stack(out)


def random_model(method: str, seed: int = 1, **kw: Any) -> tuple[torch.nn.Module, Any]:
    """float64 model with random norm gains in [0.5, 1.5] and random thetas."""
    def stream(name: str, p: Tensor, g: torch.Generator) -> Tensor | None:
        if not name.startswith("stream.theta"):
            return None
        return 2 * torch.randn(p.shape, generator=g, dtype=p.dtype)

    return random_stream_model(method, stream, seed=seed, offset=10, **kw)


# -------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_per_channel_rmsnorm_matches_reference(n: int) -> None:
    d = 48
    eps = 0.0  # so that each channel of y / g has exactly unit RMS
    norm = PhaseRMSNorm(d, n, eps=eps).double()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, generator=G, dtype=torch.float64) + 0.5)
    # channels of very different scales: a whole-vector RMS would not normalise each
    x = torch.randn(2, 5, d, generator=G, dtype=torch.float64)
    x = x * torch.repeat_interleave(torch.logspace(-2, 2, n, dtype=torch.float64), d // n)
    y = norm(x)
    torch.testing.assert_close(y, channel_rms(x, norm.weight.detach(), n, eps),
                               rtol=1e-12, atol=1e-12)
    # every channel of y / g has unit RMS
    c = d // n
    z = (y / norm.weight).unflatten(-1, (n, c))
    torch.testing.assert_close(z.pow(2).mean(-1), torch.ones(2, 5, n, dtype=torch.float64))


def test_per_channel_rmsnorm_keeps_dtype_and_refuses_uneven_width() -> None:
    norm = PhaseRMSNorm(12, 3)
    x = torch.randn(2, 3, 12, generator=G).to(torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16
    with pytest.raises(ModbenchError, match="cannot be split into 5 equal channels"):
        PhaseRMSNorm(12, 5)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_rotation_matches_reference(n: int) -> None:
    d = 24
    stream = ThreePhaseStream(d, 2, n, 1.0).double()
    theta = torch.randn(d // n // 2, generator=G, dtype=torch.float64)
    with torch.no_grad():
        stream.theta[1].copy_(theta)
    x = torch.randn(3, 4, d, generator=G, dtype=torch.float64)
    y = stream.rotate(x, 1)
    torch.testing.assert_close(y, givens(x, theta.tolist(), n), rtol=1e-12, atol=1e-12)
    # a rotation: every channel keeps its norm
    norms = x.unflatten(-1, (n, d // n)).norm(dim=-1)
    torch.testing.assert_close(y.unflatten(-1, (n, d // n)).norm(dim=-1), norms)
    # block 0 still has theta = 0: channel i is turned by the fixed offset i 2 pi / n alone
    torch.testing.assert_close(stream.rotate(x, 0), givens(x, [0.0] * (d // n // 2), n),
                               rtol=1e-12, atol=1e-12)


def test_rotation_at_init_is_identity_only_for_one_channel() -> None:
    x = torch.randn(2, 3, 16, generator=G, dtype=torch.float64)
    assert torch.equal(ThreePhaseStream(16, 1, 1, 0.0).double().rotate(x, 0), x)
    y = ThreePhaseStream(16, 1, 2, 0.0).double().rotate(x, 0)
    torch.testing.assert_close(y[..., :8], x[..., :8])  # channel 0: angle 0
    torch.testing.assert_close(y[..., 8:], -x[..., 8:])  # channel 1: angle pi


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.0])
def test_horn_injection_matches_reference(scale: float) -> None:
    d, t = 16, 10
    stream = ThreePhaseStream(d, 1, 2, scale).double()
    x0 = torch.randn(2, t, d, generator=G, dtype=torch.float64)
    state = stream.start(x0)
    torch.testing.assert_close(state.x, with_horn(x0, scale), rtol=1e-12, atol=1e-12)
    assert state.embedding is state.x
    # the component along the unit DC direction grows by scale * r(p) = scale / (p + 1)
    u = torch.ones(d, dtype=torch.float64) / math.sqrt(d)
    r = torch.tensor([1.0 / (p + 1) for p in range(t)], dtype=torch.float64)
    torch.testing.assert_close((state.x - x0) @ u, scale * r.expand(2, t))


def test_stream_records_the_rotated_value_after_attention() -> None:
    model, _ = random_model("three_phase", n_layers=2)
    _, state = run_capturing(model, IDX)
    assert [(r.layer, r.sublayer) for r in state.history] == [
        (0, "attn"), (0, "ffn"), (1, "attn"), (1, "ffn")]
    for rec in state.history:
        added = rec.input + rec.output
        if rec.sublayer == "attn":
            theta = model.stream.theta[rec.layer].tolist()
            torch.testing.assert_close(rec.after, givens(added, theta, 2))
        else:
            torch.testing.assert_close(rec.after, added)


# -------------------------------------------------------------- whole model, float64


@pytest.mark.parametrize("n,kw", [(1, {}), (2, {}), (4, {"n_kv_heads": 4})])
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_forward_matches_reference_decoder(n: int, kw: dict[str, Any], scale: float) -> None:
    method = f"three_phase(phases={n},horn_scale={scale})"
    model, cfg = random_model(method, **kw)
    with torch.no_grad():
        torch.testing.assert_close(model(IDX), reference_logits(model, cfg, n, scale),
                                   rtol=1e-9, atol=1e-9)


def test_one_channel_without_horn_is_the_baseline_at_init() -> None:
    base = build_model(small_cfg("baseline"), seed=3).double()
    model = build_model(small_cfg("three_phase(phases=1,horn_scale=0)"), seed=4).double()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("stream.theta") for k in missing)
    with torch.no_grad():
        torch.testing.assert_close(model(IDX), base(IDX), rtol=1e-12, atol=1e-12)
        # the default (two channels, horn) differs from the baseline at init
        other = build_model(small_cfg("three_phase"), seed=4).double()
        other.load_state_dict(base.state_dict(), strict=False)
        assert not torch.allclose(other(IDX), base(IDX))


def test_init_sets_theta_to_zero() -> None:
    model = build_model(small_cfg("three_phase"), seed=0)
    thetas = [p for n, p in model.named_parameters() if n.startswith("stream.theta")]
    assert len(thetas) == 3 and all(p.shape == (8,) and not p.any() for p in thetas)


# ------------------------------------------------------------ refusals and shapes


@pytest.mark.parametrize("method,shape", [
    ("three_phase(phases=3)", {}),                    # 4 heads, 2 KV heads
    ("three_phase(phases=4)", {}),                    # 2 KV heads
    ("three_phase(phases=0)", {}),
    ("three_phase(phases=2)", {"n_heads": 3, "n_kv_heads": 3, "d_model": 48}),
])
def test_head_count_refusal_is_one_line_and_names_the_fix(method: str,
                                                         shape: dict[str, Any]) -> None:
    cfg = small_cfg(method, **shape)
    with pytest.raises(ModbenchError, match=r"needs model\.n_heads .* divisible by .*; use "
                                            r"phases in \{.*\}") as e:
        build_model(cfg)
    assert "\n" not in str(e.value)
    (m,) = parse_methods(method)
    with pytest.raises(ModbenchError, match=r"needs model\.n_heads"):
        m.extra_params(cfg)


def test_refusal_lists_the_channel_counts_the_shape_allows() -> None:
    with pytest.raises(ModbenchError, match=r"phases in \{1, 2\}"):
        build_model(tiny("three_phase(phases=3)").model)
    cfg = small_cfg("three_phase(phases=4)", d_model=72, n_heads=6, n_kv_heads=6)
    with pytest.raises(ModbenchError, match=r"phases in \{1, 2, 3, 6\}"):
        build_model(cfg)


def test_head_alignment_is_checked_per_layer() -> None:
    """layerwise_scaling gives layer 0 of this shape 2 query and 1 KV head: one KV head
    cannot be split over 2 channels, refused in one line naming the layer; with phases=1
    every layer aligns."""
    shape = {"n_heads": 4, "n_kv_heads": 2, "n_layers": 3}
    with pytest.raises(ModbenchError, match=r"layer 0 has n_heads=2 and n_kv_heads=1") as e:
        build_model(small_cfg("layerwise_scaling(match=false)+three_phase", **shape))
    assert "\n" not in str(e.value)
    build_model(small_cfg("layerwise_scaling(match=false)+three_phase(phases=1)", **shape))


def test_paper_shape_with_three_phases_builds() -> None:
    cfg = small_cfg("three_phase(phases=3)", d_model=48, n_heads=6, n_kv_heads=3)
    model = build_model(cfg).double()
    assert model(IDX).shape == (2, 12, 61)
    assert isinstance(model.final_norm, PhaseRMSNorm) and model.final_norm.phases == 3


@pytest.mark.parametrize("n,over", [(1, ()), (2, ()), (4, ("model.n_kv_heads=4",))])
def test_trains_a_few_steps(n: int, over: tuple[str, ...], tmp_path: Path) -> None:
    cfg = tiny(f"three_phase(phases={n})", 0, 12, "train.eval_every=0", *over)
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["status"] == "completed"
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1


# ------------------------------------------------------------------ overheads


def paper_cfg() -> ModelConfig:
    return ModelConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, n_kv_heads=3,
                       d_ff=2048, max_seq_len=1024)


def test_paper_overhead_is_1536() -> None:
    (m,) = parse_methods("three_phase(phases=3)")
    assert m.extra_params(paper_cfg()) == 1536


@pytest.mark.parametrize("n,shape", [
    (1, {}), (2, {}), (4, {"n_kv_heads": 4}), (2, {"n_layers": 5, "d_model": 64}),
    (3, {"d_model": 48, "n_heads": 6, "n_kv_heads": 3}),
])
def test_parameter_overhead_is_l_d_over_2n(n: int, shape: dict[str, Any]) -> None:
    cfg = small_cfg("baseline", **shape)
    base = count_params(cfg)
    cfg.method = f"three_phase(phases={n})"
    assert count_params(cfg) - base == cfg.n_layers * cfg.d_model // (2 * n)
    (m,) = parse_methods(cfg.method)
    assert m.extra_params(cfg) == cfg.n_layers * cfg.d_model // (2 * n)
    assert m.extra_flops(cfg, 64) == 0.0


# ------------------------------------------------------------ composition, conflicts


def test_composes_with_a_merge_and_a_placement() -> None:
    model, cfg = random_model("three_phase+layerscale")
    assert not isinstance(model.blocks[0].attn.merge, AddMerge)
    _, state = run_capturing(model, IDX)
    rec = state.history[0]
    merged = model.blocks[0].attn.merge(rec.input, rec.output, state)
    torch.testing.assert_close(rec.after, givens(merged, model.stream.theta[0].tolist(), 2))
    # Post-LN: the rotation follows the post-residual (per-channel) norm
    model, cfg = random_model("three_phase+post_ln")
    _, state = run_capturing(model, IDX)
    rec = state.history[0]
    sd = {k: v.double() for k, v in model.state_dict().items()}
    normed = channel_rms(rec.input + rec.output, sd["blocks.0.attn.residual_norm.weight"], 2,
                         cfg.norm_eps)
    torch.testing.assert_close(rec.after, givens(normed, model.stream.theta[0].tolist(), 2))


@pytest.mark.parametrize("other", ["denseformer", "layernorm", "hyper_connections"])
def test_conflicts_are_refused(other: str) -> None:
    with pytest.raises(ModbenchError, match=r"both set the .* slot differently"):
        build_model(small_cfg(f"three_phase+{other}"))
