"""LAUREL (laurel_rw, laurel_lr, laurel_pa and their combinations) against an independent
float64 computation of the paper's equations, identity at init, combination and conflict
rules, parameter and FLOP overheads."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from modbench.errors import ModbenchError
from modbench.measure import flop_report, measure_flops
from modbench.methods import parse_methods
from modbench.methods.build import build_model, count_params
from modbench.methods.laurel import LaurelMerge
from modbench.model.stream import StreamState
from modbench.runtime.loss import lm_loss
from tests.helpers import run_capturing, tiny
from tests.methods.attn_reference import IDX, small_cfg

VARIANTS = [
    "laurel_rw", "laurel_rw(norm=sigmoid)", "laurel_rw(norm=none)",
    "laurel_lr", "laurel_lr(rank=4)",
    "laurel_pa", "laurel_pa(rank=0)", "laurel_pa(rank=8,k=null)", "laurel_pa(k=1)",
    "laurel_rw+laurel_lr", "laurel_rw+laurel_pa(k=2)", "laurel_lr(rank=4)+laurel_pa",
    "laurel_rw(norm=sigmoid)+laurel_lr(rank=8)+laurel_pa(rank=4,k=null)",
]


def randomize_merges(model: torch.nn.Module, seed: int = 3) -> None:
    """Random values for every LAUREL parameter (B and gamma included), so no term is trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".merge." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))


def flags(method: str) -> dict[str, Any]:
    """What the method string asks for, read independently of the code under test."""
    out: dict[str, Any] = {"rw": None, "lr": False, "pa": None}
    for m in parse_methods(method):
        if m.name == "laurel_rw":
            out["rw"] = m.opts.norm
        elif m.name == "laurel_lr":
            out["lr"] = True
        elif m.name == "laurel_pa":
            out["pa"] = (m.opts.rank, m.opts.k)
    return out


def reference_after(state: StreamState, i: int, sd: dict[str, torch.Tensor],
                    f: dict[str, Any]) -> torch.Tensor:
    """x_{i+1} = alpha f(x_i) + beta (x_i + B A x_i + sum_{j=1..k} gamma_j B_p A_p x_{i-j}),
    written per token from the paper's equations (plain float64, loops)."""
    rec = state.history[i]
    layer, sub = divmod(i, 2)
    p = f"blocks.{layer}.{'ffn' if sub else 'attn'}.merge."
    x, fx = rec.input, rec.output
    lin = x.clone()
    if f["lr"]:
        a, b = sd[p + "lr_down"], sd[p + "lr_up"]
        for bi in range(x.shape[0]):
            for t in range(x.shape[1]):
                lin[bi, t] += b @ (a @ x[bi, t])
    if f["pa"] is not None:
        rank, k = f["pa"]
        n = i if k is None else min(k, i)
        for j in range(1, n + 1):
            prev = state.history[i - j].input
            gamma = sd[p + "pa_gamma"][j - 1]
            if rank:
                a, b = sd[p + "pa_down"], sd[p + "pa_up"]
                term = torch.stack([torch.stack([b @ (a @ prev[bi, t])
                                                 for t in range(prev.shape[1])])
                                    for bi in range(prev.shape[0])])
            else:
                term = prev
            lin = lin + gamma * term
    if f["rw"] is None:
        return fx + lin
    w = sd[p + "rw_weight"]
    if f["rw"] == "softmax":
        e = [math.exp(float(w[0])), math.exp(float(w[1]))]
        alpha, beta = 2 * e[0] / (e[0] + e[1]), 2 * e[1] / (e[0] + e[1])
    elif f["rw"] == "sigmoid":
        alpha, beta = (2 / (1 + math.exp(-float(v))) for v in w)
    else:
        alpha, beta = float(w[0]), float(w[1])
    return alpha * fx + beta * lin


@pytest.mark.parametrize("method", VARIANTS)
def test_merge_matches_reference_equation(method: str) -> None:
    cfg = small_cfg(method)
    model = build_model(cfg, seed=1).double()
    randomize_merges(model)
    sd = {k: v.double() for k, v in model.state_dict().items()}
    _, state = run_capturing(model, IDX)
    assert len(state.history) == 2 * cfg.n_layers
    for i in range(len(state.history)):
        ref = reference_after(state, i, sd, flags(method))
        torch.testing.assert_close(state.history[i].after, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method", VARIANTS)
def test_identity_at_init_gives_the_baseline_exactly(method: str) -> None:
    """Same seed, same baseline weights (LAUREL's own parameters are not drawn), and every
    variant starts at x + f(x): the logits are bit-identical to the baseline's."""
    idx = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    base = build_model(tiny().model, seed=5)
    model = build_model(tiny(method).model, seed=5)
    with torch.no_grad():
        assert torch.equal(model(idx), base(idx))


def test_init_values() -> None:
    """B = 0, A = the paper's footnote-2 init, gamma = 1 (0 for identity h), alpha = beta = 1."""
    r, d = 4, 10
    m = LaurelMerge(d, "softmax", r, (r, 2))
    assert torch.equal(m.lr_up, torch.zeros(d, r)) and torch.equal(m.pa_up, torch.zeros(d, r))
    for a in (m.lr_down, m.pa_down):
        for j in range(r):
            for c in range(d):
                want = 1 / math.sqrt(r * d) if c % r == j else 0.0
                assert a[j, c].item() == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert m.pa_gamma.tolist() == [1.0, 1.0]
    assert m.residual_weights().tolist() == [1.0, 1.0]
    assert LaurelMerge(d, "sigmoid", None, (0, 3)).pa_gamma.tolist() == [0.0, 0.0, 0.0]
    assert LaurelMerge(d, "sigmoid", None, None).residual_weights().tolist() == [1.0, 1.0]
    assert LaurelMerge(d, "none", None, None).residual_weights().tolist() == [1.0, 1.0]


def test_every_learnable_piece_gets_gradient_at_init() -> None:
    """B (zero at init) must receive gradient, and so must the RW logits, so training can
    leave the identity."""
    cfg = tiny("laurel_rw+laurel_lr+laurel_pa").model
    model = build_model(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    lm_loss(model(idx), idx).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".merge." in n}
    for suffix in ("lr_up", "pa_up", "rw_weight"):
        some = [g for n, g in grads.items() if n.endswith(suffix)]
        assert some and all(g is not None and g.abs().sum() > 0 for g in some), suffix


def test_combination_is_order_independent_and_recorded() -> None:
    a = build_model(tiny("laurel_rw+laurel_lr+laurel_pa").model, seed=2)
    b = build_model(tiny("laurel_pa+laurel_lr+laurel_rw").model, seed=2)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert a.spec.describe()["merge"] == "laurel_rw+laurel_lr+laurel_pa"
    randomize_merges(a)
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(a(idx), b(idx), rtol=0, atol=0)


def test_pa_uses_only_existing_earlier_activations() -> None:
    """Sublayer i has min(k, i) gammas; the first sublayer has no PA parameters at all."""
    model = build_model(small_cfg("laurel_pa(k=2)"), seed=0)
    counts = [sub.merge.pa_terms for blk in model.blocks for sub in (blk.attn, blk.ffn)]
    assert counts == [0, 1, 2, 2, 2, 2]
    assert not hasattr(model.blocks[0].attn.merge, "pa_gamma")


@pytest.mark.parametrize("text", ["laurel_rw+layerscale", "layerscale+laurel_lr",
                                  "laurel_pa+deepnorm", "laurel_rw+laurel_lr+layerscale"])
def test_conflicts_with_other_merges(text: str) -> None:
    with pytest.raises(ModbenchError, match=r"both set the merge slot differently") as err:
        build_model(tiny(text).model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text,msg", [
    ("laurel_rw(norm=tanh)", "must be one of: softmax, sigmoid, none"),
    ("laurel_lr(rank=0)", "rank=0 of method 'laurel_lr' must be between 1 and d_model=64"),
    ("laurel_lr(rank=65)", "must be between 1 and d_model=64"),
    ("laurel_pa(rank=-1)", "must be between 0 and d_model=64"),
    ("laurel_pa(k=0)", "k=0 of method 'laurel_pa' must be at least 1"),
])
def test_bad_options(text: str, msg: str) -> None:
    with pytest.raises(ModbenchError, match=msg):
        build_model(tiny(text).model)


def test_pa_refuses_a_stream_without_history() -> None:
    m = LaurelMerge(8, None, None, (2, 2))
    x = torch.zeros(1, 3, 8)
    with pytest.raises(ModbenchError, match="previous sublayers"):
        m(x, x, StreamState(x=x, embedding=x))


@pytest.mark.parametrize("method", VARIANTS)
@pytest.mark.parametrize("shape", [dict(), dict(n_layers=3, n_kv_heads=4, tie_embeddings=False)])
def test_parameter_overhead_of_variants_and_combinations(method: str,
                                                         shape: dict[str, Any]) -> None:
    cfg = tiny().model
    for k, v in shape.items():
        setattr(cfg, k, v)
    base = count_params(cfg)
    cfg.method = method
    assert count_params(cfg) - base == sum(m.extra_params(cfg) for m in parse_methods(method))


def test_parameter_overhead_formula_by_hand() -> None:
    """Tiny (L=2, d=64): RW 2 per sublayer; LR 2 r d per sublayer; PA sum over sublayers
    1..3 of min(k, i) gammas + 2 r d."""
    cfg = tiny().model
    base = count_params(cfg)
    for method, extra in [("laurel_rw", 8), ("laurel_lr(rank=4)", 4 * 2 * 4 * 64),
                          ("laurel_pa(rank=4,k=2)", (1 + 2 + 2) + 3 * 2 * 4 * 64),
                          ("laurel_pa(rank=0,k=null)", 1 + 2 + 3)]:
        cfg.method = method
        assert count_params(cfg) - base == extra, method


@pytest.mark.parametrize("method", ["laurel_rw+laurel_lr+laurel_pa",
                                    "laurel_pa(rank=8,k=null)+laurel_lr(rank=4)"])
def test_flops_of_combinations_match_the_counter(method: str) -> None:
    cfg = tiny(method).model
    report = flop_report(cfg, 64)
    assert report.forward_flops_per_token == pytest.approx(
        measure_flops(build_model(cfg, seed=0), 64), rel=1e-6)
    base = flop_report(tiny().model, 64).forward_flops_per_token
    assert report.forward_flops_per_token > base
