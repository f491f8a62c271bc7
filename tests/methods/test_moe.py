"""The mixture-of-experts FFN (``moe``) against a per-token, per-expert float64 computation of
its equations (output, balance loss and the balance loss's gradient), its FLOPs (only the
chosen experts run), options, conflicts, logging and training."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from modbench.errors import ModbenchError
from modbench.measure import measure_flops
from modbench.methods import parse_methods
from modbench.methods.build import build_model, plan
from modbench.methods.moe import MoEFFN
from modbench.model.spec import parts_of
from modbench.model.stream import ForwardContext
from modbench.train.trainer import train, train_seeds
from tests.helpers import read_metrics, tiny


def moe_core(method: str = "moe", seed: int = 0, layer: int = 0) -> MoEFFN:
    model = build_model(tiny(method).model, seed=seed).double()
    core = parts_of(model).core("ffn", layer)
    assert isinstance(core, MoEFFN)
    with torch.no_grad():  # a router of some strength, so the choices are not near-ties
        core.router.weight.mul_(20.0)
    return core


def context(t: int) -> ForwardContext:
    return ForwardContext(cos=torch.zeros(t, 2), sin=torch.zeros(t, 2), seq_len=t)


def reference(x: torch.Tensor, core: MoEFFN, k: int, coef: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE(x) = sum_{e in top-k} p_e FFN_e(x) per token, l = E sum_e f_e P_e, written as
    loops over tokens and experts on the plain weight tensors (float64)."""
    w_r = core.router.weight
    experts = [(e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight) for e in core.experts]
    n_e = len(experts)
    tokens = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(tokens)
    routed = [0] * n_e
    prob_sum = torch.zeros(n_e, dtype=x.dtype)
    for i, v in enumerate(tokens):
        z = torch.stack([w_r[e] @ v for e in range(n_e)])
        p = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
        prob_sum = prob_sum + p
        top = sorted(range(n_e), key=lambda e: -float(p[e].detach()))[:k]
        for e in top:
            g, u, d = experts[e]
            a = g @ v
            out[i] = out[i] + p[e] * (d @ (a / (1 + torch.exp(-a)) * (u @ v)))
            routed[e] += 1
    n = tokens.shape[0]
    frac = torch.tensor([r / (n * k) for r in routed], dtype=x.dtype)
    balance = n_e * sum(frac[e] * prob_sum[e] / n for e in range(n_e))
    return out.reshape(x.shape), coef * balance


@pytest.mark.parametrize("method,k,coef", [("moe", 2, 0.01), ("moe(experts=5,top_k=3)", 3, 0.01),
                                           ("moe(top_k=1,balance=0.5)", 1, 0.5)])
def test_output_and_balance_loss_match_the_equations(method: str, k: int, coef: float) -> None:
    core = moe_core(method)
    x = torch.randn(2, 7, core.router.weight.shape[1], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    ctx = context(7)
    out = core(x, ctx)
    want_out, want_aux = reference(x, core, k, coef)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    assert len(ctx.aux) == 1
    torch.testing.assert_close(ctx.aux[0], want_aux, rtol=1e-6, atol=1e-6)


def test_balance_loss_gradient_reaches_the_router_through_p() -> None:
    """d(aux)/d(W_r) against the reference's autograd (f_e counts, without gradient)."""
    core = moe_core()
    x = torch.randn(3, 5, core.router.weight.shape[1], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    ctx = context(5)
    core(x, ctx)
    (got,) = torch.autograd.grad(ctx.aux[0], core.router.weight)
    _, ref = reference(x, core, 2, 0.01)
    (want,) = torch.autograd.grad(ref, core.router.weight)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-10)
    assert got.abs().max() > 0


def test_uniform_routing_has_balance_one() -> None:
    """Four tokens, each preferring a different expert pair in turn, with P uniform: l = 1."""
    core = moe_core("moe(top_k=1)")
    with torch.no_grad():
        core.router.weight.zero_()
        core.router.weight[:, :4] = 1e-6 * torch.eye(4, dtype=torch.float64)
    x = torch.zeros(1, 4, core.router.weight.shape[1], dtype=torch.float64)
    x[0, :, :4] = torch.eye(4, dtype=torch.float64)
    ctx = context(4)
    core(x, ctx)
    assert ctx.aux[0].item() == pytest.approx(0.01, rel=1e-5)


def test_only_the_chosen_experts_are_computed() -> None:
    """FlopCounterMode: the MoE model costs the baseline plus (k-1) experts and the router per
    token and layer (extra_flops, exactly), far below running all E experts."""
    cfg, base = tiny("moe(experts=8,top_k=2)").model, tiny().model
    (m,) = parse_methods(cfg.method)
    extra = measure_flops(build_model(cfg), 32) - measure_flops(build_model(base), 32)
    assert extra == pytest.approx(m.extra_flops(cfg, 32), rel=1e-9)
    d, ff, n_layers = cfg.d_model, cfg.d_ff, cfg.n_layers
    assert extra == n_layers * (6 * d * ff + 2 * d * 8)
    assert extra < n_layers * 7 * 6 * d * ff  # all eight experts: seven more FFNs per layer
    one = tiny("moe(experts=8,top_k=1)").model
    extra_one = measure_flops(build_model(one), 32) - measure_flops(build_model(base), 32)
    assert extra_one == pytest.approx(n_layers * 2 * d * 8, rel=1e-9)


def test_every_parameter_has_a_gradient_even_an_idle_expert() -> None:
    model = build_model(tiny("moe(experts=4,top_k=1)").model, seed=0)
    core = parts_of(model).core("ffn", 0)
    with torch.no_grad():  # logits (a.x, -a.x, ., 0): expert 3 never wins
        core.router.weight[1] = -core.router.weight[0]
        core.router.weight[3] = 0.0
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, aux = model(idx, with_aux=True)
    (F.cross_entropy(logits[:, :-1].reshape(-1, 512), idx[:, 1:].reshape(-1)) + aux).backward()
    idle = core.experts[3]
    assert all(p.grad is not None and not p.grad.any() for p in idle.parameters())
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("method,match", [
    ("moe(experts=0)", "experts=0"), ("moe(top_k=5)", "top_k=5"),
    ("moe(top_k=0)", "top_k=0"), ("moe(balance=-1)", "balance=-1"),
])
def test_bad_options_are_refused_in_one_line(method: str, match: str) -> None:
    with pytest.raises(ModbenchError, match=match) as e:
        plan(tiny(method).model)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("method", ["moe+relu2", "moe+widenet", "moe+ngpt"])
def test_other_ffn_cores_conflict(method: str) -> None:
    with pytest.raises(ModbenchError, match="ffn"):
        plan(tiny(method).model)


def test_seeds_cannot_stack(tmp_path: Path) -> None:
    with pytest.raises(ModbenchError, match="cannot stack seeds"):
        train_seeds(tiny("moe", 0, 2), [0, 1], [tmp_path / "a", tmp_path / "b"],
                    progress=False)


def test_records_log_the_balance_and_the_loss_stays_lm(tmp_path: Path) -> None:
    """balance=100 makes the objective ~200 nats above the LM loss: the logged loss is the LM
    loss; moe_balance_loss = balance * L * moe_balance (every layer's core is an MoE), and the
    balance of top-2 over 4 experts lies in [1, E/k] up to its noise."""
    cfg = tiny("moe(balance=100)", 0, 4, "train.micro_batch_size=4")
    summary = train(cfg, tmp_path / "run", progress=False)
    records = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert len(records) == 4
    n_layers = cfg.model.n_layers
    for r in records:
        assert 5.0 < r["loss"] < 7.0
        assert 0.9 < r["moe_balance"] <= 2.0 + 1e-6
        assert r["moe_balance_loss"] == pytest.approx(100 * n_layers * r["moe_balance"],
                                                      rel=1e-5)
    assert 5.0 < summary["final_val_loss"] < 7.0
    assert not any("moe" in k for r in read_metrics(tmp_path / "run") if r["kind"] == "val"
                   for k in r)


def test_balance_log_is_the_step_mean_also_with_activation_checkpointing(tmp_path: Path
                                                                          ) -> None:
    """The recomputed forward neither changes the numbers nor double-counts the log."""
    plain = train(tiny("moe", 0, 3, "train.micro_batch_size=4"), tmp_path / "a",
                  progress=False)
    ckpt = train(tiny("moe", 0, 3, "train.micro_batch_size=4",
                      "train.activation_checkpointing=true"), tmp_path / "b", progress=False)
    a = [r for r in read_metrics(tmp_path / "a") if r["kind"] == "train"]
    b = [r for r in read_metrics(tmp_path / "b") if r["kind"] == "train"]
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "moe_balance", "moe_balance_loss"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5), key
    assert plain["final_val_loss"] == pytest.approx(ckpt["final_val_loss"], rel=1e-5)
    assert math.isfinite(a[-1]["moe_balance"])


def test_parameter_and_flop_formulas() -> None:
    cfg = tiny("moe(experts=6,top_k=3)").model
    (m,) = parse_methods(cfg.method)
    d, ff, n_layers = cfg.d_model, cfg.d_ff, cfg.n_layers
    assert m.extra_params(cfg) == n_layers * (5 * 3 * d * ff + 6 * d)
    assert m.extra_flops(cfg, 64) == n_layers * (2 * 6 * d * ff + 2 * d * 6)
