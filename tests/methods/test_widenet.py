"""WideNet: every layer shares one attention core and one (MoE) FFN core, norms stay per layer;
the parameter count from the paper's formula, written out from the shapes; the balance loss
summed over the L routing calls against a direct computation; it trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from modbench.errors import ModbenchError
from modbench.measure import measure_flops
from modbench.methods import parse_methods
from modbench.methods.build import build_model, count_params, plan
from modbench.methods.moe import MoEFFN
from modbench.model.spec import parts_of
from modbench.train.trainer import train
from tests.helpers import read_metrics, run_capturing, tiny

SHAPES: list[dict[str, Any]] = [dict(), dict(n_layers=3, n_kv_heads=4, tie_embeddings=False),
                                dict(n_layers=4, d_ff=96)]


def shaped(method: str, shape: dict[str, Any]) -> Any:
    cfg = tiny(method).model
    for k, v in shape.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("method", ["widenet", "widenet(moe=false)"])
def test_every_layer_shares_the_cores_and_keeps_its_norms(method: str) -> None:
    cfg = shaped(method, SHAPES[2])
    model = build_model(cfg, seed=0)
    parts = parts_of(model)
    for sub in ("attn", "ffn"):
        for layer in range(1, cfg.n_layers):
            assert parts.core(sub, layer) is parts.core(sub, 0)
    assert isinstance(parts.core("ffn", 0), MoEFFN) == (method == "widenet")
    for site in ("attn.pre", "ffn.pre"):
        norms = parts.norms(site)
        assert len({id(m) for m in norms.values()}) == cfg.n_layers
        assert all(next(m.parameters()).data_ptr() != next(norms[0].parameters()).data_ptr()
                   for i, m in norms.items() if i)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method,experts", [("widenet", 4), ("widenet(experts=3,top_k=1)", 3),
                                            ("widenet(moe=false)", 0)])
def test_parameter_count_is_the_papers_formula(method: str, experts: int,
                                               shape: dict[str, Any]) -> None:
    """V d (embedding) [+ d V (untied head)] + (2L + 1) d (per-layer RMSNorms and the final
    one) + ONE attention core (W_q, W_k, W_v, W_o) + ONE FFN: E SwiGLU experts and a d x E
    router, or the plain SwiGLU."""
    cfg = shaped(method, shape)
    d, v, n_layers, ff = cfg.d_model, cfg.vocab_size, cfg.n_layers, cfg.d_ff
    dh = cfg.head_dim
    attn = d * cfg.n_heads * dh + 2 * d * cfg.n_kv_heads * dh + cfg.n_heads * dh * d
    ffn = experts * 3 * d * ff + d * experts if experts else 3 * d * ff
    want = v * d + (0 if cfg.tie_embeddings else d * v) + (2 * n_layers + 1) * d + attn + ffn
    assert count_params(cfg) == want
    assert sum(p.numel() for p in build_model(cfg, seed=0).parameters()) == want
    (m,) = parse_methods(method)
    base = shaped("baseline", shape)
    assert m.extra_params(cfg) == want - count_params(base)


def test_balance_loss_is_summed_over_the_layers_routing_calls() -> None:
    """aux = lambda sum_l E sum_e f_e^l P_e^l, each layer's f and P from the shared router on
    that layer's FFN input (the stream's record, through the layer's own pre-norm)."""
    cfg = shaped("widenet(balance=0.5)", SHAPES[2])
    model = build_model(cfg, seed=0).double()
    parts = parts_of(model)
    w_r = parts.core("ffn", 0).router.weight
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    _, state = run_capturing(model, idx)
    _, aux = model(idx, with_aux=True)
    want = torch.zeros((), dtype=torch.float64)
    for layer in range(cfg.n_layers):
        rec = state.history[2 * layer + 1]
        assert (rec.layer, rec.sublayer) == (layer, "ffn")
        h = parts.norm("ffn.pre", layer)(rec.input).reshape(-1, cfg.d_model)
        p = torch.softmax(h @ w_r.T, dim=-1)
        top = p.topk(2, dim=-1).indices
        f = torch.stack([(top == e).sum() for e in range(4)]).double() / (h.shape[0] * 2)
        want = want + 4 * (f * p.mean(0)).sum()
    torch.testing.assert_close(aux, 0.5 * want, rtol=1e-10, atol=1e-12)


def test_flops_are_the_moe_flops() -> None:
    cfg, base = tiny("widenet").model, tiny().model
    (m,) = parse_methods(cfg.method)
    extra = measure_flops(build_model(cfg), 32) - measure_flops(build_model(base), 32)
    assert extra == pytest.approx(m.extra_flops(cfg, 32), rel=1e-9)
    (plain,) = parse_methods("widenet(moe=false)")
    assert plain.extra_flops(cfg, 32) == 0.0
    same = measure_flops(build_model(tiny("widenet(moe=false)").model), 32)
    assert same == pytest.approx(measure_flops(build_model(base), 32), rel=1e-12)


def test_moe_false_fills_only_the_tie_slot() -> None:
    spec = plan(tiny("widenet(moe=false)").model).spec
    assert spec.owner("tie") == "widenet" and spec.owner("ffn") == "baseline"
    assert plan(tiny("widenet").model).spec.owner("ffn") == "widenet"
    (m,) = parse_methods("widenet(moe=false)")
    assert m.callbacks() == []


def test_bad_options_are_refused() -> None:
    with pytest.raises(ModbenchError, match="top_k=3"):
        plan(tiny("widenet(experts=2,top_k=3)").model)


@pytest.mark.parametrize("method", ["widenet", "widenet(moe=false)"])
def test_it_trains(method: str, tmp_path: Path) -> None:
    summary = train(tiny(method, 0, 30), tmp_path / "run", progress=False)
    assert summary["status"] == "completed"
    records = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.3
    assert ("moe_balance" in records[-1]) == (method == "widenet")
    if method == "widenet":  # one shared core serving L layers: lambda L mean
        r = records[-1]
        assert r["moe_balance_loss"] == pytest.approx(0.01 * 2 * r["moe_balance"], rel=1e-5)
