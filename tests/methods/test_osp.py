"""``embproj`` and ``osp`` (Outlier-Safe Pre-Training): the projections against their equation
on plain tensors, the orthogonal init, the exact fold (tied: untied), Muon training the
projections, OSP's recipe exception and its composition rules."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from modbench.config import ModelConfig, resolve
from modbench.errors import ModbenchError
from modbench.methods import parse_methods
from modbench.methods.base import canonical
from modbench.methods.basic_norms import SingleScaleRMSNorm
from modbench.methods.build import build_model, count_params, plan, plan_run
from modbench.methods.embproj import EmbedProjection, HeadProjection, fold_embedding_projection
from modbench.model.norms import RMSNorm
from modbench.runtime.loss import lm_loss
from modbench.train.optim import MuonAdamW, build_optimizer, muon_split
from tests.helpers import tiny
from tests.train.test_muon import newton_schulz


def small(method: str, tied: bool, **kw: object) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40,
                max_seq_len=16, method=method, tie_embeddings=tied)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def tokens(cfg: ModelConfig, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g)


def scramble(model: nn.Module, seed: int = 3) -> None:
    """Give every parameter a random value (P_in, P_out no longer orthogonal, gains not 1),
    as after training; the fold must not rely on the init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3
                    + (1.0 if p.ndim < 2 else 0.0))


# ------------------------------------------------------------------ the equation


def test_wrappers_compute_the_equation_on_plain_tensors() -> None:
    torch.manual_seed(0)
    d = 12
    x = torch.randn(3, 5, d, dtype=torch.float64)
    first = EmbedProjection(nn.Identity(), d).double()
    norm = RMSNorm(d, 1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d) + 0.5)
    last = HeadProjection(norm, d).double()
    p_in, p_out, g = first.proj.weight.detach(), last.proj.weight.detach(), norm.weight.detach()
    torch.testing.assert_close(first(x), x @ p_in.T, rtol=0, atol=1e-12)
    rms = (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(last(x), (x / rms * g) @ p_out.T, rtol=0, atol=1e-12)
    # the order matters: P_in before the site's module (an embedding norm), P_out after it
    normed = EmbedProjection(norm, d).double()
    p_n = normed.proj.weight.detach()
    y = x @ p_n.T
    ref = y / (y.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * g
    torch.testing.assert_close(normed(x), ref, rtol=0, atol=1e-12)
    assert (normed(x) - norm(x) @ p_n.T).abs().max() > 1e-3
    assert (HeadProjection(norm, d).double()(x) - norm(x @ p_out.T)).abs().max() > 1e-3


@pytest.mark.parametrize("tied", [True, False])
def test_model_equals_the_baseline_with_projected_embedding_and_head(tied: bool) -> None:
    """logits(embproj) = the baseline's logits with E[t] P_in^T as its input and W P_out as
    its head, both formed here on plain tensors (the blocks' weights copied over)."""
    cfg = small("embproj", tied)
    model = build_model(cfg).double()
    scramble(model)
    base = build_model(small("baseline", False)).double()
    state = {k.replace("final_norm.module.", "final_norm."): v
             for k, v in model.state_dict().items() if ".proj." not in k}
    e = model.embed.weight.detach()
    p_in = model.embed_norm.proj.weight.detach()
    p_out = model.final_norm.proj.weight.detach()
    w = e if tied else model.head.weight.detach()
    state["embed.weight"] = e @ p_in.T
    state["head.weight"] = w @ p_out
    base.load_state_dict(state)
    idx = tokens(cfg)
    torch.testing.assert_close(model(idx), base(idx), rtol=0, atol=1e-10)


def test_init_is_orthogonal_and_seeded() -> None:
    cfg = resolve("tiny", method="embproj").model
    model = build_model(cfg, seed=0)
    d = cfg.d_model
    eye = torch.eye(d)
    p_in, p_out = model.embed_norm.proj.weight, model.final_norm.proj.weight
    for p in (p_in, p_out):  # orthogonal, not the generic N(0, 0.02^2)
        torch.testing.assert_close(p @ p.T, eye, rtol=0, atol=1e-5)
    assert not torch.equal(p_in, p_out)
    again, other = build_model(cfg, seed=0), build_model(cfg, seed=1)
    assert torch.equal(again.embed_norm.proj.weight, p_in)
    assert not torch.equal(other.embed_norm.proj.weight, p_in)
    # an orthogonal P_in keeps each embedding row's length
    e = model.embed.weight
    torch.testing.assert_close((e @ p_in.T).norm(dim=1), e.norm(dim=1), rtol=1e-4, atol=0)


# ------------------------------------------------------------------ the fold


@pytest.mark.parametrize("method", ["embproj", "osp", "osp+peri_ln",
                                    "embproj+dyt(embed_scale=false)"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_fold_keeps_the_logits(method: str, tied: bool, dtype: torch.dtype, tol: float) -> None:
    cfg = small(method, tied)
    model = build_model(cfg).to(dtype)
    if dtype == torch.float64:
        model.double()  # RoPE tables in float64 too
    scramble(model)
    idx = tokens(cfg)
    before = model(idx).detach()
    fold_embedding_projection(model)
    after = model(idx).detach()
    assert (after - before).abs().max().item() <= tol * max(1.0, before.abs().max().item())
    # the projections are gone; the sites hold the modules they wrapped
    assert not any(isinstance(m, EmbedProjection | HeadProjection) for m in model.modules())
    assert model.parts.norm("embed", -1) is model.embed_norm
    assert model.parts.norm("final", cfg.n_layers) is model.final_norm
    assert model.parts.linear("head", cfg.n_layers) is model.head
    assert not model.cfg.tie_embeddings and model.head is not None
    # the folded model is the model of the folded config: same parameter count, and its
    # state dict loads there (strictly) and gives the same logits
    folded = {"embproj": "baseline", "osp": "ssnorm", "osp+peri_ln": "ssnorm+peri_ln",
              "embproj+dyt(embed_scale=false)": "dyt(embed_scale=false)"}[method]
    assert model.cfg.method == canonical(parse_methods(folded))
    n_params = sum(p.numel() for p in model.parameters())
    untied = small(folded, False)
    assert n_params == count_params(untied)
    assert n_params == count_params(small(folded, tied)) + (
        cfg.vocab_size * cfg.d_model if tied else 0)  # untying adds the head
    rebuilt = build_model(model.cfg).to(dtype)
    if dtype == torch.float64:
        rebuilt.double()
    rebuilt.load_state_dict(model.state_dict())
    torch.testing.assert_close(rebuilt(idx), after, rtol=0, atol=0)


def test_fold_refusals() -> None:
    with pytest.raises(ModbenchError, match="no embedding projection to fold") as err:
        fold_embedding_projection(build_model(small("baseline", True)))
    assert "\n" not in str(err.value)
    model = build_model(small("embproj", True))
    fold_embedding_projection(model)
    with pytest.raises(ModbenchError, match="folded already"):
        fold_embedding_projection(model)
    # a wrapper listed after embproj applies the embedding scale before P_in
    with pytest.raises(ModbenchError, match="applied to the embedding before P_in") as err:
        fold_embedding_projection(build_model(small("embproj+dyt", False)))
    assert "\n" not in str(err.value) and "EmbedScale" in str(err.value)
    model = build_model(small("embproj", False))
    model.head = nn.Linear(32, 61, bias=True)  # a head the fold cannot absorb P_out into
    with pytest.raises(ModbenchError, match="not a plain linear layer"):
        fold_embedding_projection(model)
    assert isinstance(model.embed_norm, EmbedProjection)  # refused before anything changed


# ------------------------------------------------------------------ training: Muon


@pytest.mark.parametrize("method", ["embproj", "osp"])
def test_muon_trains_the_projections(method: str) -> None:
    cfg = tiny(method, 0, 2, "recipe.optimizer=muon")
    model = build_model(cfg.model)
    muon, _ = muon_split(model)
    on_muon = {id(p) for p in muon}
    for site in (model.embed_norm, model.final_norm):
        assert id(site.proj.weight) in on_muon
    assert id(model.embed.weight) not in on_muon
    opt = build_optimizer(model, cfg.recipe)
    assert isinstance(opt, MuonAdamW)
    r = cfg.recipe
    idx = tokens(cfg.model)
    lm_loss(model(idx), idx).backward()
    projections = [model.embed_norm.proj.weight, model.final_norm.proj.weight]
    seen = [(p.grad.detach().clone(), p.detach().clone()) for p in projections]
    opt.step()
    mu, d = r.muon_momentum, cfg.model.d_model
    for p, (g, before) in zip(projections, seen, strict=True):
        # Muon's first step: lr' NS((1 - mu) g + mu (1 - mu) g), lr' = 0.2 sqrt(d) lr
        decayed = before.double() * (1 - r.lr * r.weight_decay)
        applied = (decayed - p.detach().double()) / (r.lr * 0.2 * math.sqrt(d))
        nesterov = (1 - mu) * g + mu * (1 - mu) * g
        torch.testing.assert_close(applied, newton_schulz(nesterov), rtol=0, atol=0.04)


def test_osp_imposes_muon_and_sums_its_parts() -> None:
    run, p = plan_run(tiny("osp", 0, 2))
    assert run.recipe.optimizer == "muon"
    assert run.recipe_exceptions == {"optimizer": "muon"}
    assert isinstance(build_optimizer(p.build(), run.recipe), MuonAdamW)
    (osp,), (ss,), (ep,) = (parse_methods(m) for m in ("osp", "ssnorm", "embproj"))
    for cfg in (small("osp", True), small("osp", False, n_layers=3)):
        assert osp.extra_params(cfg) == ss.extra_params(cfg) + ep.extra_params(cfg)
        assert ep.extra_params(cfg) == 2 * cfg.d_model ** 2
        assert osp.extra_flops(cfg, 16) == ep.extra_flops(cfg, 16) == 4 * cfg.d_model ** 2
    # embproj alone keeps the recipe
    assert plan_run(tiny("embproj", 0, 2))[0].recipe.optimizer == "adamw"


def test_osp_norms_are_single_scale_everywhere() -> None:
    model = build_model(small("osp", True))
    norms = [m for m in model.modules() if isinstance(m, SingleScaleRMSNorm)]
    assert len(norms) == 2 * 2 + 1  # Pre-LN: two per block and the final one
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    assert isinstance(model.final_norm.module, SingleScaleRMSNorm)


@pytest.mark.parametrize("method, match", [
    ("osp+layernorm", "methods 'osp' and 'layernorm' both set the norm slot"),
    ("rmsnorm+osp", "methods 'rmsnorm' and 'osp' both set the norm slot"),
    ("osp+dyt", "methods 'osp' and 'dyt' both set the norm slot"),
    ("osp+embproj", "methods 'osp' and 'embproj' both add the embedding projection"),
    ("embproj+osp", "methods 'embproj' and 'osp' both add the embedding projection"),
])
def test_conflicts_are_refused_in_one_line(method: str, match: str) -> None:
    with pytest.raises(ModbenchError, match=re.escape(match)) as err:
        plan(small(method, True))
    assert "\n" not in str(err.value)


def test_compositions() -> None:
    # ssnorm alongside osp is the same norm twice: accepted, the same model
    one, two = build_model(small("osp", True)), build_model(small("osp+ssnorm", True))
    assert [k for k, _ in one.named_parameters()] == [k for k, _ in two.named_parameters()]
    # a placement composes: Post-LN's norms are single-scale, the projections stay
    model = build_model(small("osp+post_ln", True))
    assert isinstance(model.blocks[0].attn.residual_norm, SingleScaleRMSNorm)
    assert isinstance(model.blocks[0].attn.pre_norm, nn.Identity)
    assert isinstance(model.embed_norm, EmbedProjection)
    # Peri-LN's embedding norm sits after P_in
    model = build_model(small("osp+peri_ln", True))
    assert isinstance(model.embed_norm.module, SingleScaleRMSNorm)
    spec = plan(small("osp+post_ln", True)).spec.describe()
    assert spec["norm"] == "osp" and spec["placement"] == "post_ln"
    assert spec["norm_wrappers"] == "osp"
