"""Stream-slot methods: DenseFormer, Hyper-Connections (full and two-lane), Attention
Residuals. Each is checked against a reference forward written here from its equations
(float64, plain tensors from the state dict, explicit loops over tokens and lanes), against
the baseline at initialisation, for causality with random weights, for its conflicts, and
for activation memory."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from modbench.errors import ModbenchError
from modbench.measure import measure_flops
from modbench.measure.memory import saved_activation_bytes
from modbench.methods import parse_methods
from modbench.methods.attnres import block_sizes, source_counts
from modbench.methods.build import build_model, count_params
from tests.methods.attn_reference import (
    IDX,
    random_stream_model,
    small_cfg,
    standard_attention,
    swiglu,
)
from tests.reference import rms

Tensor = torch.Tensor
SD = dict[str, Tensor]


# --------------------------------------------------------------------------- helpers


def random_model(method: str, seed: int = 1, **kw: Any) -> tuple[torch.nn.Module, Any]:
    """float64 model; every norm gain gets a random value in [0.5, 1.5] and every stream
    parameter a signed random perturbation, so the references see them."""
    def stream(name: str, p: Tensor, g: torch.Generator) -> Tensor | None:
        if not name.startswith("stream."):
            return None
        return p + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)

    return random_stream_model(method, stream, seed=seed, offset=100, **kw)


def branch(sd: SD, cfg: Any, layer: int, sub: str, x: Tensor) -> Tensor:
    """One Pre-LN sublayer's output F(N(x)) on a single sequence x (T, d)."""
    p = f"blocks.{layer}.{sub}."
    h = rms(x, sd[p + "pre_norm.weight"], cfg.norm_eps)
    if sub == "attn":
        return standard_attention(h, sd, p + "core.", cfg)
    return swiglu(h, sd, p + "core.", layer)


def reference(model: torch.nn.Module, cfg: Any, stream: Callable[..., Tensor],
              idx: Tensor = IDX) -> Tensor:
    """Logits of the decoder whose residual stream is ``stream(sd, cfg, x0)`` (one sequence,
    returns the value fed to the final norm)."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    out = []
    for row in idx:
        h = rms(stream(sd, cfg, sd["embed.weight"][row]), sd["final_norm.weight"],
                cfg.norm_eps)
        out.append(h @ sd["embed.weight"].T)
    return torch.stack(out)


def sublayers(cfg: Any) -> list[tuple[int, int, str]]:
    return [(2 * i + j, i, s) for i in range(cfg.n_layers) for j, s in enumerate(("attn", "ffn"))]


def with_baseline_weights(method: str, **kw: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(baseline, method model) in float64, the shared parameters equal (the method's own
    stay at their init)."""
    base = build_model(small_cfg(kw.pop("base", "baseline"), **kw), seed=3).double()
    model = build_model(small_cfg(method, **kw), seed=4).double()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("stream.") for k in missing), missing
    return base, model


def one_line_error(method: str, build: bool = False) -> str:
    with pytest.raises(ModbenchError) as e:
        cfg = small_cfg(method)
        build_model(cfg) if build else count_params(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------- equal at init


@pytest.mark.parametrize("method,base", [
    ("denseformer", "baseline"),
    ("denseformer(dilation=2,period=2)", "baseline"),
    ("denseformer+post_ln+layerscale", "post_ln+layerscale"),
    ("hyper_connections(dynamic=false)", "baseline"),
    ("hyper_connections(dynamic=false,n=1)", "baseline"),
    ("hyper_connections(dynamic=false,n=3)", "baseline"),
    ("hyper_connections", "baseline"),
    ("hyper_connections(dynamic=false)+post_ln", "post_ln"),
    ("hyper_connections_2lane", "baseline"),
    ("hyper_connections_2lane+layerscale+post_ln", "layerscale+post_ln"),
])
def test_identity_init_gives_the_baselines_output(method: str, base: str) -> None:
    """Static (and dynamic) HC, DenseFormer and the two-lane variant start as the model they
    modify: same logits in float64 once the shared weights are equal."""
    ref, model = with_baseline_weights(method, base=base)
    with torch.no_grad():
        torch.testing.assert_close(model(IDX), ref(IDX), rtol=1e-13, atol=1e-13)


def test_init_survives_the_generic_weight_init() -> None:
    dense = build_model(small_cfg("denseformer"), seed=0)
    assert [a.tolist() for a in dense.stream.alphas] == [[0, 1], [0, 0, 1], [0, 0, 0, 1]]
    hc = build_model(small_cfg("hyper_connections(n=2)"), seed=0).stream.conns
    assert hc[1].static_alpha.tolist() == [0, 1, 0, 1, 0, 1]  # [a_m | I], a_m = e_1
    assert hc[2].static_alpha.tolist() == [1, 1, 0, 0, 0, 1]  # a_m = e_(2 mod 2)
    assert hc[0].dynamic_fn.abs().sum() == 0 and hc[0].alpha_scale.item() == pytest.approx(0.01)
    ar = build_model(small_cfg("attnres"), seed=0).stream.ops
    assert all(op.query.abs().sum() == 0 and (op.key_gain == 1).all() for op in ar)


# ------------------------------------------------------------------------ DenseFormer


@pytest.mark.parametrize("k,p", [(1, 1), (2, 1), (1, 2), (2, 3)])
def test_denseformer_dwa_equation(k: int, p: int) -> None:
    model, cfg = random_model(f"denseformer(dilation={k},period={p})")

    def stream(sd: SD, cfg: Any, x0: Tensor) -> Tensor:
        outputs, x, slot = [x0], x0, 0
        for i in range(cfg.n_layers):
            for s in ("attn", "ffn"):
                x = x + branch(sd, cfg, i, s, x)
            outputs.append(x)  # X_{i+1}
            if (i + 1) % p == 0:
                a = sd[f"stream.alphas.{slot}"]
                js = [j for j in range(i + 2) if (i + 1 - j) % k == 0]
                assert len(a) == len(js) and js[-1] == i + 1
                x = sum(a[n] * outputs[j] for n, j in enumerate(js))
                slot += 1
        return x

    torch.testing.assert_close(model(IDX), reference(model, cfg, stream), rtol=1e-10,
                               atol=1e-10)


@pytest.mark.parametrize("layers,k,p", [(3, 1, 1), (6, 2, 1), (6, 1, 2), (7, 3, 2), (5, 5, 5)])
def test_denseformer_parameter_formula(layers: int, k: int, p: int) -> None:
    """P(L, k, p) = sum_{m=1}^{floor(L/p)} (floor(m p / k) + 1); L(L+3)/2 at k = p = 1."""
    method = f"denseformer(dilation={k},period={p})"
    formula = sum(m * p // k + 1 for m in range(1, layers // p + 1))
    if k == p == 1:
        assert formula == layers * (layers + 3) // 2
    (m,) = parse_methods(method)
    cfg = small_cfg(method, n_layers=layers)
    assert m.extra_params(cfg) == formula == count_params(cfg) - count_params(
        small_cfg("baseline", n_layers=layers))


# ------------------------------------------------------------------ Hyper-Connections


def hc_stream(n: int, dynamic: bool) -> Callable[..., Tensor]:
    """Alg. 2 per token: alpha = s_a tanh(Hbar W_m|W_r) + [a_m|a_r], beta = s_b tanh(Hbar W_b)
    + b; h_in = sum_i alpha[i,0] H_i; H'_j = beta_j y + sum_i alpha[i,j+1] H_i; mean at
    the end."""

    def stream(sd: SD, cfg: Any, x0: Tensor) -> Tensor:
        t = x0.shape[0]
        lanes = [x0.clone() for _ in range(n)]  # lanes[i]: (T, d)
        for k, i, s in sublayers(cfg):
            p = f"stream.conns.{k}."
            a0 = sd[p + "static_alpha"].view(n, n + 1)
            b0 = sd[p + "static_beta"]
            alpha = torch.zeros(t, n, n + 1, dtype=x0.dtype)
            beta = torch.zeros(t, n, dtype=x0.dtype)
            for tok in range(t):
                for li in range(n):
                    hv = lanes[li][tok]
                    hbar = hv / torch.sqrt((hv * hv).mean() + cfg.norm_eps)
                    for j in range(n + 1):
                        dyn = 0.0
                        if dynamic:
                            dyn = sd[p + "alpha_scale"] * torch.tanh(
                                hbar @ sd[p + "dynamic_fn"][:, j])
                        alpha[tok, li, j] = a0[li, j] + dyn
                    dyn = 0.0
                    if dynamic:
                        dyn = sd[p + "beta_scale"] * torch.tanh(
                            hbar @ sd[p + "dynamic_fn"][:, n + 1])
                    beta[tok, li] = b0[li] + dyn
            h_in = sum(alpha[:, li, 0:1] * lanes[li] for li in range(n))
            y = branch(sd, cfg, i, s, h_in)
            lanes = [beta[:, j:j + 1] * y
                     + sum(alpha[:, li, j + 1:j + 2] * lanes[li] for li in range(n))
                     for j in range(n)]
        return sum(lanes) / n

    return stream


@pytest.mark.parametrize("n,dynamic", [(4, True), (2, True), (3, False)])
def test_hyper_connections_equations(n: int, dynamic: bool) -> None:
    model, cfg = random_model(f"hyper_connections(n={n},dynamic={str(dynamic).lower()})",
                                  n_layers=2)
    if dynamic:  # the random W must matter: the scales are 0.01 + noise, W is zero at init
        with torch.no_grad():
            for c in model.stream.conns:
                c.dynamic_fn.normal_(0, 1.0, generator=torch.Generator().manual_seed(5))
    ref = reference(model, cfg, hc_stream(n, dynamic))
    torch.testing.assert_close(model(IDX), ref, rtol=1e-10, atol=1e-10)


def test_hyper_connections_mix_lanes_and_learn_them() -> None:
    """After a few AdamW steps the static mixing has moved off the identity and the dynamic
    weights off zero: every part of A_m, A_r, B is trained."""
    cfg = small_cfg("hyper_connections(n=2)")
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    from modbench.runtime.loss import lm_loss

    for _ in range(3):
        opt.zero_grad()
        lm_loss(model(IDX), IDX).backward()
        opt.step()
    c = model.stream.conns[1]
    a = c.static_alpha.view(2, 3)
    assert (a[:, 0] - torch.tensor([0.0, 1.0])).abs().max() > 1e-3  # A_m
    assert (a[:, 1:] - torch.eye(2)).abs().max() > 1e-3  # A_r
    assert (c.static_beta - 1).abs().max() > 1e-3  # B
    assert c.dynamic_fn.abs().max() > 1e-3


def test_two_lane_equation() -> None:
    model, cfg = random_model("hyper_connections_2lane")

    def stream(sd: SD, cfg: Any, x0: Tensor) -> Tensor:
        x, slow = x0, torch.zeros_like(x0)
        for k, i, s in sublayers(cfg):
            out = branch(sd, cfg, i, s, x)
            r = 1.0 / (1.0 + math.exp(-float(sd["stream.slow_rate_logit"][k])))
            slow = (1 - r) * slow + r * out
            x = x + out + sd["stream.slow_weight"][k] * slow
        return x

    assert (model.stream.slow_weight.abs() > 0).all()
    torch.testing.assert_close(model(IDX), reference(model, cfg, stream), rtol=1e-10,
                               atol=1e-10)


def test_two_lane_rate_init() -> None:
    model = build_model(small_cfg("hyper_connections_2lane(rate=0.25)"), seed=0)
    torch.testing.assert_close(torch.sigmoid(model.stream.slow_rate_logit),
                               torch.full((6,), 0.25))
    assert (model.stream.slow_weight == 0).all()


# ------------------------------------------------------------------ Attention Residuals


def depth_attention(sd: SD, p: str, sources: list[Tensor], eps: float) -> Tensor:
    """softmax_i(w^T RMSNorm_g(v_i)) weighted sum, per token, by explicit loops."""
    w, g = sd[p + "query"], sd[p + "key_gain"]
    t = sources[0].shape[0]
    out = torch.zeros_like(sources[0])
    for tok in range(t):
        logits = torch.stack([
            (w * g * v[tok] / torch.sqrt((v[tok] ** 2).mean() + eps)).sum() for v in sources])
        e = torch.exp(logits - logits.max())
        a = e / e.sum()
        out[tok] = sum(a[i] * v[tok] for i, v in enumerate(sources))
    return out


def attnres_stream(blocks: int | None) -> Callable[..., Tensor]:
    def stream(sd: SD, cfg: Any, x0: Tensor) -> Tensor:
        eps, n_sub = cfg.norm_eps, 2 * cfg.n_layers
        if blocks is None:  # full: v_0 .. v_k
            sources = [x0]
            for k, i, s in sublayers(cfg):
                h = depth_attention(sd, f"stream.ops.{k}.", sources, eps)
                sources.append(branch(sd, cfg, i, s, h))
            return depth_attention(sd, f"stream.ops.{n_sub}.", sources, eps)
        size = -(-n_sub // blocks)  # the test uses shapes where the blocks are equal
        assert n_sub % blocks == 0
        done, partial = [x0], None
        for k, i, s in sublayers(cfg):
            if k % size == 0 and partial is not None:
                done, partial = [*done, partial], None
            srcs = done if partial is None else [*done, partial]
            out = branch(sd, cfg, i, s, depth_attention(sd, f"stream.ops.{k}.", srcs, eps))
            partial = out if partial is None else partial + out
        return depth_attention(sd, f"stream.ops.{n_sub}.", [*done, partial], eps)

    return stream


@pytest.mark.parametrize("method,blocks", [
    ("attnres", None), ("attnres(variant=block,blocks=2)", 2),
    ("attnres(variant=block,blocks=3)", 3)])
@pytest.mark.parametrize("zero_queries", [True, False])
def test_attnres_equations(method: str, blocks: int | None, zero_queries: bool) -> None:
    """With zero pseudo-queries every op is the uniform mean of its sources (whatever the
    key gains); with random ones, the softmax over depth of the RMSNorm'd sources."""
    model, cfg = random_model(method)
    if zero_queries:
        with torch.no_grad():
            for op in model.stream.ops:
                op.query.zero_()
    ref = reference(model, cfg, attnres_stream(blocks))
    torch.testing.assert_close(model(IDX), ref, rtol=1e-10, atol=1e-10)
    if zero_queries:  # and the reference's op really is the mean there
        srcs = [torch.randn(5, cfg.d_model, dtype=torch.float64) for _ in range(3)]
        torch.testing.assert_close(depth_attention(model.state_dict(), "stream.ops.0.", srcs, 1e-5),
                                   sum(srcs) / 3)


def test_attnres_block_partition() -> None:
    assert block_sizes(8, 3) == [3, 3, 2]
    assert block_sizes(4, 8) == [1, 1, 1, 1]  # capped at one sublayer per block
    assert source_counts(4, "full", 8) == [1, 2, 3, 4, 5]
    assert source_counts(4, "block", 2) == [1, 2, 2, 3, 3]
    assert source_counts(4, "block", 8) == source_counts(4, "full", 8)


@pytest.mark.parametrize("method", [
    "attnres(variant=block,blocks=2)", "hyper_connections(n=2,dynamic=false)",
    "denseformer(dilation=2,period=2)"])
def test_option_overheads_as_documented(method: str) -> None:
    """Non-default options: parameters against the built model, FLOPs against the counter."""
    cfg = small_cfg(method, n_layers=4)
    base = small_cfg("baseline", n_layers=4)
    (m,) = parse_methods(method)
    assert m.extra_params(cfg) == count_params(cfg) - count_params(base)
    extra = measure_flops(build_model(cfg), 16) - measure_flops(build_model(base), 16)
    assert extra == pytest.approx(m.extra_flops(cfg, 16), rel=1e-9)


# ---------------------------------------------------------------- causality, conflicts


@pytest.mark.parametrize("method", [
    "denseformer(dilation=2)", "hyper_connections", "hyper_connections_2lane",
    "attnres", "attnres(variant=block,blocks=2)"])
@pytest.mark.parametrize("train", [False, True])
def test_causal_with_random_stream_weights(method: str, train: bool) -> None:
    """A later token never changes an earlier output, with every stream parameter random
    (identity inits would hide a leak), in training and evaluation mode."""
    model, cfg = random_model(method)
    if method.startswith("hyper_connections("):
        with torch.no_grad():
            for c in model.stream.conns:
                c.dynamic_fn.normal_(0, 1.0)
    model.train(train)
    changed = IDX.clone()
    changed[:, 8:] = (changed[:, 8:] + 5) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(IDX), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


@pytest.mark.parametrize("method,pattern", [
    ("hyper_connections+layerscale", r"'hyper_connections' and 'layerscale'.*merge"),
    ("deepnorm+hyper_connections", r"'deepnorm' and 'hyper_connections'.*merge"),
    ("attnres+layerscale", r"'attnres' and 'layerscale'.*merge"),
    ("denseformer+attnres", r"'denseformer' and 'attnres'.*stream"),
    ("hyper_connections_2lane+hyper_connections", r"both set the stream slot"),
    ("hyper_connections(n=0)", r"n=0 .*must be >= 1"),
    ("hyper_connections_2lane(rate=1.5)", r"rate=1.5 .*between 0 and 1"),
    ("attnres(variant=blocks)", r"variant='blocks'.*must be one of: full, block"),
    ("attnres(blocks=4)", r"applies to the block variant; write attnres\(variant=block"),
    ("attnres(variant=block,blocks=0)", r"blocks=0 .*>= 1"),
    ("denseformer(period=4)", r"period=4 .*1\.\.n_layers \(3\)"),
    ("denseformer(dilation=0)", r"dilation=0 .*1\.\.n_layers"),
])
def test_bad_combinations_and_options_are_refused(method: str, pattern: str) -> None:
    msg = one_line_error(method)
    assert re.search(pattern, msg), msg


@pytest.mark.parametrize("method,owner", [("attnres+post_ln", "post_ln"),
                                          ("mix_ln(fraction=0.5)+attnres", "mix_ln")])
def test_attnres_refuses_post_residual_norms(method: str, owner: str) -> None:
    msg = one_line_error(method, build=True)
    assert f"'{owner}'" in msg and "pre-norm placement" in msg


def test_attnres_composes_with_pre_norm_placements() -> None:
    model = build_model(small_cfg("attnres+sandwich"), seed=0)
    assert torch.isfinite(model(IDX)).all()


# ----------------------------------------------------------------------------- memory


def _bytes(method: str) -> int:
    cfg = small_cfg(method, n_layers=4)
    return saved_activation_bytes(build_model(cfg, seed=0), IDX)


def test_activation_memory_ordering() -> None:
    """Block AttnRes keeps fewer stacked sources than full; more lanes keep more memory."""
    base = _bytes("baseline")
    assert _bytes("baseline") == base  # deterministic
    full, block = _bytes("attnres"), _bytes("attnres(variant=block,blocks=2)")
    assert base < block < full
    n2, n4 = _bytes("hyper_connections(n=2,dynamic=false)"), _bytes(
        "hyper_connections(n=4,dynamic=false)")
    assert base < n2 < n4
    # DenseFormer's weighted sum keeps references, not a stacked copy per average: at most
    # one extra float32 d-vector per token and block over the baseline
    assert base < _bytes("denseformer") <= base + 4 * IDX.numel() * 32 * 4
