"""Relaxed Recursive Transformers: the LoRA forward on plain tensors, the CYCLE / SEQUENCE tie
patterns by module identity, the whole tied-and-relaxed model against an untied baseline with
the per-layer weights W'_{u(l)} + s B_l A_l written in, the paper's parameter formula, and
the initialisation from a trained full-size run (average / stepwise / lower + the truncated
SVD of each layer's residual: exact at full rank, better with every rank)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.build import build_model, count_params, plan
from modbench.methods.relaxed_recursive import LoRALinear, stepwise_layers
from modbench.model.spec import parts_of
from modbench.runtime.checkpoint import load_checkpoint
from modbench.train.optim import muon_split
from modbench.train.trainer import load_initial_weights, train, train_seeds
from tests.helpers import tiny

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
SITES = ("attn.pre", "ffn.pre")
G = torch.Generator().manual_seed(0)


def cfg_of(method: str, *over: str) -> ModelConfig:
    return tiny(method, 0, 30, *over).model


def widths(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each projection, from the model's shape (GQA: k, v are narrower)."""
    d, dh, f = cfg.d_model, cfg.d_model // cfg.n_heads, cfg.d_ff
    q, kv = cfg.n_heads * dh, cfg.n_kv_heads * dh
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d),
            "gate": (d, f), "up": (d, f), "down": (f, d)}


# ------------------------------------------------------------------ the LoRA forward


def test_lora_forward_matches_the_equation_on_plain_tensors() -> None:
    """y = W x + (alpha / r) B A x, computed directly."""
    d_in, d_out, r, alpha = 12, 7, 3, 6.0
    w = torch.randn(d_out, d_in, generator=G, dtype=torch.float64)
    a = torch.randn(r, d_in, generator=G, dtype=torch.float64)
    b = torch.randn(d_out, r, generator=G, dtype=torch.float64)
    x = torch.randn(2, 5, d_in, generator=G, dtype=torch.float64)
    base = nn.Linear(d_in, d_out, bias=False).double()
    lora = LoRALinear(base, d_in, d_out, r, alpha / r, 0.02).double()
    with torch.no_grad():
        base.weight.copy_(w)
        lora.lora_A.copy_(a)
        lora.lora_B.copy_(b)
    want = torch.einsum("oi,bti->bto", w, x) + (alpha / r) * torch.einsum(
        "or,ri,bti->bto", b, a, x)
    torch.testing.assert_close(lora(x), want, rtol=0, atol=1e-12)
    # fresh: B = 0, A random, so the wrapper computes its base exactly
    lora.modbench_init()
    assert torch.count_nonzero(lora.lora_B) == 0 and lora.lora_A.abs().sum() > 0
    torch.testing.assert_close(lora(x), base(x), rtol=0, atol=0)


# ------------------------------------------------------------------ the tie pattern


@pytest.mark.parametrize("method,layers,unique", [
    ("relaxed_recursive(blocks=3)", 6, [0, 1, 2, 0, 1, 2]),
    ("relaxed_recursive(blocks=3,strategy=sequence)", 6, [0, 0, 1, 1, 2, 2]),
    ("relaxed_recursive(blocks=2,strategy=sequence,rank=0)", 4, [0, 0, 1, 1]),
    ("relaxed_recursive", 4, [0, 1, 0, 1]),  # default: two loops of L/2 layers, cycle
    ("relaxed_recursive", 3, [0, 0, 0]),  # odd L: L / 3 = 1 unique layer
])
def test_tie_pattern_by_module_identity(method: str, layers: int, unique: list[int]) -> None:
    cfg = cfg_of(method, f"model.n_layers={layers}", "model.tie_embeddings=false")
    model = build_model(cfg)
    parts = parts_of(model)
    relaxed = "rank=0" not in method

    def base(role: str, layer: int) -> nn.Module:
        m = parts.linear(role, layer)
        return m.inner if relaxed else m

    for role in ROLES:
        for i in range(layers):
            for j in range(layers):
                assert (base(role, i) is base(role, j)) is (unique[i] == unique[j]), (role, i, j)
                if relaxed and i != j:  # the LoRA stays per layer
                    assert parts.linear(role, i) is not parts.linear(role, j)
            assert isinstance(base(role, i), nn.Linear)
            assert isinstance(parts.linear(role, i), LoRALinear) is relaxed
    for site in SITES:
        for i in range(layers):
            for j in range(layers):
                assert (parts.norm(site, i) is parts.norm(site, j)) is (unique[i] == unique[j])
    # the head, the final norm and the embedding are never shared nor relaxed
    assert type(parts.linear("head", layers)) is nn.Linear
    assert all(parts.norm("final", layers) is not parts.norm(s, 0) for s in SITES)
    assert all(parts.core("attn", i) is not parts.core("attn", 0) for i in range(1, layers))


def test_blocks_must_divide_the_depth() -> None:
    with pytest.raises(ModbenchError, match=r"blocks=3 .* must divide model.n_layers=4") as e:
        build_model(cfg_of("relaxed_recursive(blocks=3)", "model.n_layers=4"))
    assert "\n" not in str(e.value)
    with pytest.raises(ModbenchError, match=r"strategy='ring'.*cycle, sequence"):
        build_model(cfg_of("relaxed_recursive(strategy=ring)"))
    with pytest.raises(ModbenchError, match="rank=-1"):
        build_model(cfg_of("relaxed_recursive(rank=-1)"))
    with pytest.raises(ModbenchError, match="init='upper'"):
        build_model(cfg_of("relaxed_recursive(init=upper)"))


@pytest.mark.parametrize("other", ["moe", "tokenformer"])
def test_a_core_with_its_own_projections_is_refused(other: str) -> None:
    """moe's experts and TokenFormer's Pattention are made by their cores, not through the
    linear slot: neither shared across the loops nor relaxed, so refused in one line."""
    with pytest.raises(ModbenchError, match=r"block 0's FFN has none made through the linear "
                                            r"slot.*cannot be combined") as e:
        build_model(cfg_of(f"relaxed_recursive+{other}"))
    assert "\n" not in str(e.value)
    model = build_model(cfg_of("relaxed_recursive+relu2"))  # a 2-matrix FFN: shared, relaxed
    parts = parts_of(model)
    assert not parts.has_linear("gate", 1)
    assert isinstance(parts.linear("up", 1), LoRALinear)


# ------------------------------------------------------------------ the model's function


def test_fresh_model_is_the_plain_recursive_model() -> None:
    """B = 0 at a fresh start: the relaxed model computes the rank-0 recursive model."""
    over = ("model.n_layers=4",)
    relaxed = build_model(cfg_of("relaxed_recursive(blocks=2)", *over), seed=5)
    plain = build_model(cfg_of("relaxed_recursive(blocks=2,rank=0)", *over), seed=5)
    for role in ROLES:
        for i in range(4):
            torch.testing.assert_close(parts_of(relaxed).linear(role, i).inner.weight,
                                       parts_of(plain).linear(role, i).weight, rtol=0, atol=0)
    idx = torch.randint(0, 512, (2, 16), generator=G)
    with torch.no_grad():
        torch.testing.assert_close(relaxed(idx), plain(idx), rtol=0, atol=0)


@pytest.mark.parametrize("strategy,unique", [("cycle", [0, 1, 0, 1]),
                                             ("sequence", [0, 0, 1, 1])])
def test_relaxed_model_computes_the_untied_model_with_the_relaxed_weights(
        strategy: str, unique: list[int]) -> None:
    """Reference: a baseline model whose layer l holds W'_{u(l)} + (alpha / r) B_l A_l and
    the shared norm gains, every LoRA random (not zero)."""
    over = ("model.n_layers=4", "model.tie_embeddings=false")
    cfg = cfg_of(f"relaxed_recursive(blocks=2,strategy={strategy},rank=4,alpha=12)", *over)
    model = build_model(cfg, seed=1).double()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    ref = build_model(cfg_of("baseline", *over), seed=2).double()
    parts, rparts = parts_of(model), parts_of(ref)
    ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
    shared = {}  # unique layer -> the role's W', read once from the first layer that uses it
    for i in range(4):
        for role in ROLES:
            lora = parts.linear(role, i)
            shared.setdefault((unique[i], role), lora.inner.weight.detach().clone())
            w = shared[(unique[i], role)] + 3.0 * lora.lora_B.detach() @ lora.lora_A.detach()
            rparts.linear(role, i).weight.data.copy_(w)  # alpha / r = 12 / 4
        for site in SITES:
            rparts.norm(site, i).weight.data.copy_(parts.norm(site, i).weight)  # shared
    for key in ("embed.weight", "head.weight", "final_norm.weight"):
        ref.state_dict()[key].copy_(model.state_dict()[key])
    assert not torch.equal(ref.state_dict()["blocks.1.attn.core.q_proj.weight"],
                           ref_state["blocks.1.attn.core.q_proj.weight"])
    idx = torch.randint(0, cfg.vocab_size, (2, 24), generator=G)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), ref(idx), rtol=0, atol=1e-10)


# ------------------------------------------------------------------ parameter count


@pytest.mark.parametrize("method,layers,k,rank", [
    ("relaxed_recursive(blocks=3,rank=4)", 6, 3, 4),
    ("relaxed_recursive(blocks=2,strategy=sequence,rank=0)", 6, 2, 0),
    ("relaxed_recursive(blocks=1,rank=48)", 6, 1, 48),  # clamped to 32 on k and v
    ("relaxed_recursive", 2, 1, 8),
    ("relaxed_recursive(blocks=2,rank=4,share_norms=false)", 4, 2, 4),
])
def test_parameter_count_is_the_papers_formula(method: str, layers: int, k: int,
                                               rank: int) -> None:
    """K unique layers + L r (d_in + d_out) per relaxed projection + the unshared rest."""
    cfg = cfg_of(method, f"model.n_layers={layers}", "model.tie_embeddings=false")
    d, v = cfg.d_model, cfg.vocab_size
    w = widths(cfg)
    matrices, norms = sum(i * o for i, o in w.values()), 2 * d  # 7 matrices, 2 RMSNorm gains
    lora = layers * sum(min(rank, i, o) * (i + o) for i, o in w.values())
    rest = v * d + d * v + d  # embedding, head, final norm
    if "share_norms=false" in method:
        want = k * matrices + layers * norms + lora + rest
    else:
        want = k * (matrices + norms) + lora + rest
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == want
    assert count_params(cfg) == want
    if rank == 48:
        assert parts_of(model).linear("k", 0).lora_A.shape == (32, 64)


def test_lora_factors_train_under_muon() -> None:
    """Our choice: the LoRA factors are hidden matrices, so Muon takes them (rank >= 2)."""
    model = build_model(cfg_of("relaxed_recursive(blocks=1)"))
    muon, adamw = muon_split(model)
    lora = [p for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))]
    assert lora and all(any(p is q for q in muon) for p in lora)
    assert not any(p is q for p in lora for q in adamw)
    rank1 = build_model(cfg_of("relaxed_recursive(blocks=1,rank=1)"))
    muon, _ = muon_split(rank1)
    assert not any(n.endswith("lora_A") and any(p is q for q in muon)
                   for n, p in rank1.named_parameters())


# ------------------------------------------------------------------ init from a full run


def test_stepwise_layers_are_numpys_linspace_rounded() -> None:
    for n in range(1, 40):
        for k in range(1, n + 1):
            if n % k == 0:
                want = [int(x) for x in np.round(np.linspace(0, n - 1, k))]
                assert stepwise_layers(n, k) == want, (n, k)
    assert stepwise_layers(6, 3) == [0, 2, 5] and stepwise_layers(4, 2) == [0, 3]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full-size (untied) baseline with four layers, trained a few steps."""
    out = tmp_path_factory.mktemp("src") / "run"
    train(tiny("baseline", 0, 6, "model.n_layers=4"), out, progress=False)
    return out


def source_model(run: Path) -> nn.Module:
    model = build_model(cfg_of("baseline", "model.n_layers=4")).double()
    model.load_state_dict(load_checkpoint(run / "checkpoints/last.pt")["model"])
    return model


def relaxed_from(run: Path, method: str, *over: str) -> nn.Module:
    cfg = cfg_of(method, "model.n_layers=4", *over)
    model = build_model(cfg, seed=3)
    load_initial_weights(model, plan(cfg).methods, cfg, run / "checkpoints/last.pt")
    return model.double()


# the source layers each unique layer's shared weights come from (L = 4, K = 2)
SOURCES = {
    ("cycle", "average"): [[0, 2], [1, 3]],
    ("sequence", "average"): [[0, 1], [2, 3]],
    ("cycle", "stepwise"): [[0], [3]],  # linspace(0, 3, 2)
    ("sequence", "stepwise"): [[0], [3]],
    ("cycle", "lower"): [[0], [1]],
    ("sequence", "lower"): [[0], [1]],
}
UNIQUE = {"cycle": [0, 1, 0, 1], "sequence": [0, 0, 1, 1]}


@pytest.mark.parametrize("strategy,init", sorted(SOURCES))
def test_init_builds_the_shared_block_and_full_rank_svd_reconstructs(
        strategy: str, init: str, source_run: Path) -> None:
    src = source_model(source_run)
    model = relaxed_from(source_run, f"relaxed_recursive(blocks=2,strategy={strategy},"
                                     f"init={init},rank=1000)")
    sp, parts = parts_of(src), parts_of(model)
    for i in range(4):
        layers = SOURCES[(strategy, init)][UNIQUE[strategy][i]]
        for role in ROLES:
            want = sum(sp.linear(role, j).weight for j in layers) / len(layers)
            torch.testing.assert_close(parts.linear(role, i).inner.weight, want,
                                       rtol=0, atol=1e-6)
        for site in SITES:
            want = sum(sp.norm(site, j).weight for j in layers) / len(layers)
            torch.testing.assert_close(parts.norm(site, i).weight, want, rtol=0, atol=1e-6)
    # every layer's W' + B A is its source layer again (float32 SVD factors)
    for i in range(4):
        for role in ROLES:
            lora = parts.linear(role, i)
            got = lora.inner.weight + lora.scale * lora.lora_B @ lora.lora_A
            torch.testing.assert_close(got, sp.linear(role, i).weight, rtol=0, atol=1e-6)
    # tied norm gains are the rule's (not relaxed): close to the source, not equal; with the
    # norms per layer the full-rank relaxed model is the source model
    idx = torch.randint(0, 512, (2, 32), generator=G)
    exact = relaxed_from(source_run, f"relaxed_recursive(blocks=2,strategy={strategy},"
                                     f"init={init},rank=1000,share_norms=false)")
    with torch.no_grad():
        want = src(idx)
        torch.testing.assert_close(exact(idx), want, rtol=0, atol=1e-4)
        assert 1e-4 < (model(idx) - want).abs().max() < 0.1


def test_svd_init_is_the_truncated_svd_and_the_error_falls_with_rank(
        source_run: Path) -> None:
    src = source_model(source_run)
    sp = parts_of(src)
    idx = torch.randint(0, 512, (2, 32), generator=G)
    with torch.no_grad():
        want = src(idx)
    errors = []
    for rank in (1, 4, 16, 64):
        model = relaxed_from(source_run, f"relaxed_recursive(blocks=2,rank={rank},"
                                         f"alpha={2 * rank},share_norms=false)")  # scale 2
        parts = parts_of(model)
        # layer 3's q: residual to the average of layers 1 and 3, its rank-r truncated SVD
        lora = parts.linear("q", 3)
        resid = sp.linear("q", 3).weight - (sp.linear("q", 1).weight
                                             + sp.linear("q", 3).weight) / 2
        u, s, vh = torch.linalg.svd(resid)
        r = min(rank, 64)
        torch.testing.assert_close(lora.scale * lora.lora_B @ lora.lora_A,
                                   u[:, :r] @ torch.diag(s[:r]) @ vh[:r], rtol=0, atol=1e-6)
        torch.testing.assert_close(lora.lora_A @ lora.lora_A.T, torch.eye(r, dtype=torch.float64),
                                   rtol=0, atol=1e-5)  # A = V_r^T (orthonormal rows)
        with torch.no_grad():
            errors.append((model(idx) - want).abs().max().item())
    assert errors[0] > errors[1] > errors[2] > errors[3], errors
    assert errors[3] < 1e-4 < errors[0]


def test_init_from_a_baseline_run_end_to_end(source_run: Path, tmp_path: Path) -> None:
    """train.init_from: a full-rank relaxed model (norms per layer) starts at the source's
    validation loss; a plain recursive one (rank 0) does not; a continued relaxed run loads
    as it is."""
    src = json.loads((source_run / "summary.json").read_text())
    over = ("model.n_layers=4", f"train.init_from={source_run}")
    method = "relaxed_recursive(blocks=2,rank=64,share_norms=false)"
    full = train(tiny(method, 1, 2, *over), tmp_path / "a", progress=False)
    assert full["status"] == "completed"
    assert full["initial_val_loss"] == pytest.approx(src["final_val_loss"], abs=1e-4)
    meta = yaml.safe_load((tmp_path / "a/config.yaml").read_text())["meta"]["init_from"]
    assert meta["method"] == "baseline" and meta["step"] == 6
    plain = train(tiny("relaxed_recursive(blocks=2,rank=0)", 1, 2, *over), tmp_path / "b",
                  progress=False)
    assert plain["initial_val_loss"] > src["final_val_loss"] + 1e-3
    again = train(tiny(method, 1, 1, "model.n_layers=4", f"train.init_from={tmp_path / 'a'}"),
                  tmp_path / "c", progress=False)
    assert again["initial_val_loss"] == pytest.approx(full["final_val_loss"], abs=1e-6)


def test_init_composes_with_per_layer_parts_of_other_methods(tmp_path: Path) -> None:
    """qknorm's per-head norms are not tied: each layer keeps its own source values."""
    train(tiny("qknorm", 0, 4, "model.n_layers=4"), tmp_path / "src", progress=False)
    cfg = cfg_of("qknorm+relaxed_recursive(blocks=2,rank=1000,share_norms=false)",
                 "model.n_layers=4")
    model = build_model(cfg, seed=3)
    ckpt = tmp_path / "src/checkpoints/last.pt"
    load_initial_weights(model, plan(cfg).methods, cfg, ckpt)
    src = build_model(cfg_of("qknorm", "model.n_layers=4"))
    src.load_state_dict(load_checkpoint(ckpt)["model"])
    idx = torch.randint(0, 512, (2, 32), generator=G)
    with torch.no_grad():
        torch.testing.assert_close(model.double()(idx), src.double()(idx), rtol=0, atol=1e-4)


@pytest.mark.parametrize("method,over,msg", [
    ("relaxed_recursive(blocks=2)", "model.d_ff=64",
     r"source run has model.d_ff=176 and this one 64"),
    ("relaxed_recursive(blocks=1)", "model.n_layers=2",
     r"source run has model.n_layers=4 and this one 2"),
    ("qknorm+relaxed_recursive(blocks=2)", "model.n_layers=4",
     r"lacks parameter 'blocks.0.attn.core.[qk]_norm.weight'"),
])
def test_init_refuses_another_shape(method: str, over: str, msg: str, source_run: Path,
                                    tmp_path: Path) -> None:
    cfg = tiny(method, 0, 2, f"train.init_from={source_run}", "model.n_layers=4", over)
    with pytest.raises(ModbenchError, match=msg) as e:
        train(cfg, tmp_path / "b", progress=False)
    assert "\n" not in str(e.value)


def test_init_refuses_a_relaxed_source_with_another_looping(tmp_path: Path) -> None:
    train(tiny("relaxed_recursive(blocks=2)", 0, 2, "model.n_layers=4"), tmp_path / "a",
          progress=False)
    cfg = tiny("relaxed_recursive(blocks=2,strategy=sequence)", 0, 2, "model.n_layers=4",
               f"train.init_from={tmp_path / 'a'}")
    with pytest.raises(ModbenchError, match=r"from a relaxed_recursive.*strategy=cycle"):
        train(cfg, tmp_path / "b", progress=False)


def test_stacked_seeds_train_like_separate_runs(tmp_path: Path) -> None:
    """Shared weights plus per-layer LoRA under vmapped seeds: a member is its own run."""
    method = "relaxed_recursive(blocks=2,strategy=sequence,rank=4)"
    train_seeds(tiny(method, 0, 4, "model.n_layers=4"), [0, 1],
                [tmp_path / "s0", tmp_path / "s1"], progress=False)
    alone = train(tiny(method, 1, 4, "model.n_layers=4"), tmp_path / "alone", progress=False)
    got = json.loads((tmp_path / "s1" / "summary.json").read_text())
    assert abs(got["final_val_loss"] - alone["final_val_loss"]) < 1e-4
