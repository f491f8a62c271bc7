"""BHyT (arXiv 2601.09719): the default ``form=abstract`` unchanged bit for bit, the paper's
form (kappa, per-site lambda, RMSNorm final norm, the FFN-input norm from the block's exact
statistic plus the variance approximation) against an independent float64 decoder written from
the equations, its parameter overhead, option and placement checks, and stacked seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

from modbench.errors import ModbenchError
from modbench.methods import parse_methods
from modbench.methods.bhyt import BoundedTanh
from modbench.methods.build import build_model, count_params
from modbench.model.norms import RMSNorm
from modbench.train.trainer import train
from tests.helpers import tiny, train_losses
from tests.methods.attn_reference import IDX, built, small_cfg, standard_attention, swiglu
from tests.reference import rms

# ----------------------------------------------------------------- reference equations


def bhyt_ref(x: torch.Tensor, lam: torch.Tensor, g: torch.Tensor, kappa: float,
             var: torch.Tensor, eps: float) -> torch.Tensor:
    """g * tanh(lambda * x / (kappa * sqrt(var + eps)))."""
    return g * torch.tanh(lam * x / (kappa * torch.sqrt(var + eps)))


def c_attn_ref(w_v: torch.Tensor, w_o: torch.Tensor, n_heads: int, head_dim: int,
               seq_len: int) -> torch.Tensor:
    """||W_V^paper W_O^paper||_F^2 / (T d) as the official code writes it: W_V's rows repeated
    for the query heads of each KV group, then W_V_expanded^T @ W_O^T."""
    d = w_o.shape[0]
    n_kv = w_v.shape[0] // head_dim
    w_v_exp = w_v.reshape(n_kv, head_dim, d).repeat_interleave(n_heads // n_kv, dim=0)
    w_v_exp = w_v_exp.reshape(n_heads * head_dim, d)
    combined = w_v_exp.T @ w_o.T
    return (combined * combined).sum() / (seq_len * d)


def paper_decoder(model: torch.nn.Module, idx: torch.Tensor, cfg: Any, *, share: bool = True,
                  kappa: float = 10.0, drop_c: bool = False) -> torch.Tensor:
    """The Pre-LN decoder with BHyT at attn.pre / ffn.pre and RMSNorm at the end, on plain
    float64 tensors from the state dict. ``share``: the FFN-input norm's variance is the block
    input's mean square + c lambda_1^2 / kappa^2 (``drop_c``: without the c term)."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    eps, t_train = cfg.norm_eps, cfg.trained_seq_len
    out = []
    for row in idx:
        x = sd["embed.weight"][row]
        for layer in range(cfg.n_layers):
            p = f"blocks.{layer}."
            lam1, g1 = sd[p + "attn.pre_norm.alpha"], sd[p + "attn.pre_norm.weight"]
            lam2, g2 = sd[p + "ffn.pre_norm.alpha"], sd[p + "ffn.pre_norm.weight"]
            s = (x * x).mean(-1, keepdim=True)
            a = standard_attention(bhyt_ref(x, lam1, g1, kappa, s, eps), sd, p + "attn.core.",
                                   cfg)
            h = x + a
            if share:
                c = c_attn_ref(sd[p + "attn.core.v_proj.weight"],
                               sd[p + "attn.core.o_proj.weight"], cfg.n_heads,
                               cfg.d_model // cfg.n_heads, t_train)
                var = s + (0.0 if drop_c else c * lam1 ** 2 / kappa ** 2)
            else:
                var = (h * h).mean(-1, keepdim=True)
            x = h + swiglu(bhyt_ref(h, lam2, g2, kappa, var, eps), sd, p + "ffn.core.", layer)
        out.append(rms(x, sd["final_norm.weight"], eps) @ sd["embed.weight"].T)
    return torch.stack(out)


def paper_model(method: str, w_scale: float = 5.0, **kw: Any) -> tuple[Any, Any]:
    """A float64 model with random gains and lambdas, W_V and W_O scaled up so that the
    approximation's c term is of the order of the block input's mean square."""
    model, cfg = built(method, scale=2.0, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("v_proj.weight", "o_proj.weight")):
                p.mul_(w_scale)
    return model, cfg


# ----------------------------------------------------------------- the default form


def test_default_form_is_the_abstract_reconstruction_bit_for_bit() -> None:
    (m,) = parse_methods("bhyt")
    assert m.label == "bhyt" and m.opts.form == "abstract"
    assert parse_methods("bhyt(form=abstract,bound=2.0,alpha=1.0)")[0].label == "bhyt"
    cfg = tiny("bhyt").model
    model = build_model(cfg, seed=0)
    norms = [mod for mod in model.modules() if isinstance(mod, BoundedTanh)]
    assert len(norms) == 2 * cfg.n_layers + 1  # final norm included
    assert all(type(mod) is BoundedTanh for mod in norms)
    g = torch.Generator().manual_seed(0)
    for i, mod in enumerate(norms):
        with torch.no_grad():
            mod.alpha.fill_(0.5 + 0.1 * i)
            mod.weight.copy_(torch.rand(cfg.d_model, generator=g) + 0.5)
        for dtype in (torch.float32, torch.bfloat16):
            x = (3 * torch.randn(2, 7, cfg.d_model, generator=g)).to(dtype)
            # the formula of the docstring, in the operation order of the original module
            xf = x.float()
            u = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) / 2.0
            want = (torch.tanh(mod.alpha.float() * u) * mod.weight.float()).to(dtype)
            assert torch.equal(mod(x), want)
    assert m.extra_params(cfg) == 2 * cfg.n_layers + 1


def test_default_form_matches_the_formula_in_float64() -> None:
    model, cfg = built("bhyt", scale=2.0)
    sd = {k: v.double() for k, v in model.state_dict().items()}
    eps = cfg.norm_eps

    def norm(x: torch.Tensor, p: str) -> torch.Tensor:
        return bhyt_ref(x, sd[p + ".alpha"], sd[p + ".weight"], 2.0,
                        (x * x).mean(-1, keepdim=True), eps)

    out = []
    for row in IDX:
        x = sd["embed.weight"][row]
        for layer in range(cfg.n_layers):
            p = f"blocks.{layer}."
            x = x + standard_attention(norm(x, p + "attn.pre_norm"), sd, p + "attn.core.", cfg)
            x = x + swiglu(norm(x, p + "ffn.pre_norm"), sd, p + "ffn.core.", layer)
        out.append(norm(x, "final_norm") @ sd["embed.weight"].T)
    torch.testing.assert_close(model(IDX), torch.stack(out), rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------- the paper's form


def test_paper_init_values() -> None:
    cfg = small_cfg("bhyt(form=paper)")
    model = build_model(cfg, seed=0)
    for layer in range(cfg.n_layers):
        a = model.parts.norm("attn.pre", layer)
        f = model.parts.norm("ffn.pre", layer)
        assert a.alpha.item() == 2.0 and f.alpha.item() == 1.0
        assert a.bound == f.bound == 10.0
        assert torch.equal(a.weight, torch.ones(cfg.d_model))
    assert type(model.parts.norm("final", cfg.n_layers)) is RMSNorm
    model = build_model(small_cfg("bhyt(form=paper,lam_final=1.5,lam_attn=3,lam_ffn=3)"))
    fin = model.parts.norm("final", 3)
    assert type(fin) is BoundedTanh and fin.alpha.item() == 1.5 and fin.bound == 10.0
    assert model.parts.norm("ffn.pre", 0).alpha.item() == 3.0


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_heads=1), dict(n_kv_heads=4),
                                dict(train_seq_len=8)])
def test_paper_form_whole_model_matches_reference(kw: dict[str, Any]) -> None:
    model, cfg = paper_model("bhyt(form=paper)", **kw)
    torch.testing.assert_close(model(IDX), paper_decoder(model, IDX, cfg), rtol=1e-9,
                               atol=1e-9)
    # the test can fail: neither the exact statistic nor the approximation without c matches
    for other in (paper_decoder(model, IDX, cfg, share=False),
                  paper_decoder(model, IDX, cfg, drop_c=True)):
        assert not torch.allclose(model(IDX), other, rtol=1e-6, atol=1e-6)


def test_paper_form_block_output_matches_direct_computation() -> None:
    """One block on its own: the FFN-input norm reads the attention-input norm's statistic."""
    model, cfg = paper_model("bhyt(form=paper)")
    sd = {k: v.double() for k, v in model.state_dict().items()}
    p = "blocks.1."
    x = torch.randn(2, 9, cfg.d_model, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(4)) * 0.3
    from modbench.model.rope import rope_tables

    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, dtype=torch.float64)
    state = model.blocks[1](model.stream.start(x).replace(cos=cos[:9], sin=sin[:9]))
    want = []
    for row in x:
        s = (row * row).mean(-1, keepdim=True)
        lam1 = sd[p + "attn.pre_norm.alpha"]
        h = row + standard_attention(bhyt_ref(row, lam1, sd[p + "attn.pre_norm.weight"], 10.0,
                                              s, cfg.norm_eps), sd, p + "attn.core.", cfg)
        c = c_attn_ref(sd[p + "attn.core.v_proj.weight"], sd[p + "attn.core.o_proj.weight"],
                       cfg.n_heads, cfg.head_dim, cfg.trained_seq_len)
        a2 = bhyt_ref(h, sd[p + "ffn.pre_norm.alpha"], sd[p + "ffn.pre_norm.weight"], 10.0,
                      s + c * lam1 ** 2 / 100.0, cfg.norm_eps)
        want.append(h + swiglu(a2, sd, p + "ffn.core.", 1))
    torch.testing.assert_close(state.x, torch.stack(want), rtol=1e-9, atol=1e-9)


def test_paper_form_without_sharing_is_exact_bhyt() -> None:
    model, cfg = paper_model("bhyt(form=paper,share=false)")
    torch.testing.assert_close(model(IDX), paper_decoder(model, IDX, cfg, share=False),
                               rtol=1e-9, atol=1e-9)


def test_gradient_reaches_the_shared_statistic_not_c() -> None:
    model, cfg = paper_model("bhyt(form=paper)", w_scale=1.0)
    x = torch.randn(1, 5, cfg.d_model, dtype=torch.float64, requires_grad=True)
    ffn_norm = model.parts.norm("ffn.pre", 0)
    attn_norm = model.parts.norm("attn.pre", 0)
    attn_norm(x)  # leaves s = mean(x^2) for the FFN norm of its block
    h = torch.randn(1, 5, cfg.d_model, dtype=torch.float64)
    ffn_norm(h).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0  # through s
    assert attn_norm.alpha.grad is None  # lambda_1 enters the approximation detached
    v = model.parts.linear("v", 0)
    assert v.weight.grad is None  # c carries no gradient
    assert attn_norm.cell.ms is None  # read once, then cleared


def test_stacked_members_match_one_at_a_time() -> None:
    """The vmapped forward of the trainer's stacked seeds (functional_call on a meta copy)."""
    import copy

    cfg = small_cfg("bhyt(form=paper)")
    models = [build_model(cfg, seed=s) for s in (0, 1)]
    with torch.no_grad():
        for i, m in enumerate(models):
            for name, p in m.named_parameters():
                if name.endswith(("v_proj.weight", "o_proj.weight")):
                    p.mul_(5.0 + i)
    params, buffers = stack_module_state(models)  # type: ignore[arg-type]
    base = copy.deepcopy(models[0]).to("meta")

    def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(base, (p, b), (IDX,))

    stacked = vmap(one)(params, buffers)
    for i, m in enumerate(models):
        torch.testing.assert_close(stacked[i], m(IDX), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- overhead and options


@pytest.mark.parametrize("method,extra", [
    ("bhyt", lambda L: 2 * L + 1),
    ("bhyt(bound=3)", lambda L: 2 * L + 1),
    ("bhyt(form=paper)", lambda L: 2 * L),
    ("bhyt(form=paper,share=false)", lambda L: 2 * L),
    ("bhyt(form=paper,lam_final=1)", lambda L: 2 * L + 1),
])
@pytest.mark.parametrize("shape", [dict(), dict(n_layers=3, n_kv_heads=4, tie_embeddings=False)])
def test_parameter_overhead(method: str, extra: Any, shape: dict[str, Any]) -> None:
    cfg = tiny().model
    for k, v in shape.items():
        setattr(cfg, k, v)
    base = count_params(cfg)
    cfg.method = method
    (m,) = parse_methods(method)
    assert count_params(cfg) - base == m.extra_params(cfg) == extra(cfg.n_layers)


def test_paper_form_reads_the_training_length() -> None:
    assert parse_methods("bhyt(form=paper)")[0].reads_train_seq_len()
    assert not parse_methods("bhyt(form=paper,share=false)")[0].reads_train_seq_len()
    assert not parse_methods("bhyt")[0].reads_train_seq_len()
    model = build_model(small_cfg("bhyt(form=paper)", train_seq_len=8))
    assert model.parts.norm("ffn.pre", 2).seq_len == 8


@pytest.mark.parametrize("method,msg", [
    ("bhyt(form=mixed)", "must be one of: abstract, paper"),
    ("bhyt(form=paper,bound=3)", "applies to form=abstract"),
    ("bhyt(form=paper,alpha=2)", "applies to form=abstract"),
    ("bhyt(kappa=5)", "applies to form=paper"),
    ("bhyt(share=false)", "applies to form=paper"),
    ("bhyt(bound=0)", "must be positive"),
    ("bhyt(form=paper,kappa=-1)", "must be positive"),
    ("bhyt(form=paper,lam_final=-1)", "must be 0"),
    ("bhyt(form=paper)+sandwich", "puts a norm at attn.post"),
    ("bhyt(form=paper)+post_ln", "puts a norm at attn.residual"),
])
def test_bad_options_and_placements(method: str, msg: str) -> None:
    with pytest.raises(ModbenchError, match=msg):
        build_model(small_cfg(method))


def test_share_false_composes_with_other_placements() -> None:
    model = build_model(small_cfg("bhyt(form=paper,share=false)+sandwich"))
    assert torch.isfinite(model(IDX)).all()


def test_paper_form_trains_on_tiny(tmp_path: Path) -> None:
    """The registry's training check, for the non-default form."""
    summary = train(tiny("bhyt(form=paper)", steps=30), tmp_path / "run", progress=False)
    losses = train_losses(tmp_path / "run")
    assert summary["status"] == "completed" and len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.3
