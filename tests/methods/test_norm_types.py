"""Reference tests of the norm types: each formula recomputed on plain tensors, identity at
initialisation where promised, the composition matrix (every norm type x every placement),
causality of adaptive RMSNorm, and the batch-statistic norms' train/eval behaviour."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from modbench.config import ModelConfig
from modbench.methods import load_all, parse_methods
from modbench.methods.build import build_model, plan
from modbench.model.transformer import Builder
from tests.helpers import tiny
from tests.methods.norm_reference import reference_logits
from tests.reference import randomize_gains, rms

NORM_TYPES = ["layernorm", "rmsnorm", "dyt", "seednorm", "bhyt", "crmsnorm", "ssnorm",
              "powernorm", "prepbn", "adaptive_rmsnorm", "unified_norm"]
PLACEMENTS = ["baseline", "post_ln", "sandwich", "peri_ln", "hybrid_norm", "hybrid_norm_star",
              "mix_ln(fraction=0.5)", "deepnorm", "ln_scaling"]

G = torch.Generator().manual_seed(11)
X = torch.randn(3, 5, 16, generator=G, dtype=torch.float64) * 3 + 0.5


def cfg_for(method: str, **kw: object) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40,
                max_seq_len=16, method=method, tie_embeddings=False)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def norm_module(method: str, site: str = "ffn.pre", dim: int = 16, eps: float = 1e-5,
                layer: int = 0) -> torch.nn.Module:
    """The module the method's norm type puts at one site."""
    cfg = cfg_for(method, d_model=dim, n_heads=2, n_kv_heads=1, norm_eps=eps)
    p = plan(cfg)
    m = p.spec.get("norm")(dim, eps, site, layer)
    if hasattr(m, "modbench_init"):
        m.modbench_init()
    return m.double()


def randomize(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=G, dtype=p.dtype) * 0.7 + 0.3)


def test_every_norm_type_is_registered_as_norm() -> None:
    reg = load_all()
    for name in NORM_TYPES:
        assert reg[name].category == "norm"


@pytest.mark.parametrize("norm", NORM_TYPES)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_norm_type_composes_with_every_placement(norm: str, placement: str) -> None:
    method = norm if placement == "baseline" else f"{placement}+{norm}"
    cfg = cfg_for(method)
    model = build_model(cfg, seed=0)
    idx = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(idx)
    assert out.shape == (2, 8, 61) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------- formulas


def test_layernorm_formula() -> None:
    m = norm_module("layernorm")
    randomize(m)
    mu = X.mean(-1, keepdim=True)
    var = ((X - mu) ** 2).mean(-1, keepdim=True)
    ref = (X - mu) / torch.sqrt(var + 1e-5) * m.weight + m.bias
    torch.testing.assert_close(m(X), ref)
    assert norm_module("layernorm(bias=false)").bias is None


def test_rmsnorm_is_the_baseline_norm() -> None:
    m = norm_module("rmsnorm")
    randomize(m)
    torch.testing.assert_close(m(X), rms(X, m.weight, 1e-5))


def test_ssnorm_formula() -> None:
    m = norm_module("ssnorm")
    assert [p.numel() for p in m.parameters()] == [1]  # a single scalar
    randomize(m)
    (s,) = list(m.parameters())
    torch.testing.assert_close(m(X), X / torch.sqrt((X * X).mean(-1, keepdim=True) + 1e-5) * s)


def test_dyt_formula_and_alpha_per_site() -> None:
    m = norm_module("dyt(alpha_attn=0.8,alpha_other=0.2)", site="attn.pre")
    assert m.alpha.item() == pytest.approx(0.8)
    assert norm_module("dyt(alpha_attn=0.8,alpha_other=0.2)", site="final").alpha.item() == \
        pytest.approx(0.2)
    randomize(m)
    torch.testing.assert_close(m(X), m.weight * torch.tanh(m.alpha * X))
    mb = norm_module("dyt(bias=true)")
    randomize(mb)
    torch.testing.assert_close(mb(X), mb.weight * torch.tanh(mb.alpha * X) + mb.bias)


def test_dyt_embedding_scale_initialised_to_sqrt_d() -> None:
    model = build_model(cfg_for("dyt"))
    assert model.embed_norm.scale.item() == pytest.approx(math.sqrt(32))
    assert not hasattr(build_model(cfg_for("dyt(embed_scale=false)")).embed_norm, "scale")


@pytest.mark.parametrize("heads", [1, 4])
def test_seednorm_formula(heads: int) -> None:
    m = norm_module(f"seednorm(heads={heads})")
    randomize(m)
    d = X.shape[-1]
    xhat = X / torch.sqrt((X * X).mean(-1, keepdim=True) + 1e-5)
    scale = torch.empty_like(X)
    c = d // heads
    for h in range(heads):  # one scalar x_c . beta_c per chunk, spread by alpha_c
        sl = slice(h * c, (h + 1) * c)
        s = (X[..., sl] * m.beta[sl]).sum(-1, keepdim=True)
        scale[..., sl] = torch.tanh(s) * m.alpha[sl] + m.gamma[sl]
    torch.testing.assert_close(m(X), scale * xhat)


def test_seednorm_is_rmsnorm_at_init_and_gets_gradients() -> None:
    m = norm_module("seednorm")
    x = X.clone().requires_grad_()
    y = m(x)
    torch.testing.assert_close(y, rms(X, None, 1e-5))
    y.pow(3).sum().backward()
    assert m.beta.grad.abs().sum() > 0 and m.alpha.grad is not None


def test_bhyt_formula() -> None:
    m = norm_module("bhyt(bound=3)")
    randomize(m)
    u = X / (3 * torch.sqrt((X * X).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(m(X), m.weight * torch.tanh(m.alpha * u))
    assert m(X * 1e4).abs().max() <= m.weight.abs().max() + 1e-12  # bounded output


def test_adaptive_rmsnorm_formula_and_identity_at_init() -> None:
    m = norm_module("adaptive_rmsnorm")
    torch.testing.assert_close(m(X), rms(X, None, 1e-5))  # W = 0: plain RMSNorm
    randomize(m)
    xhat = X / torch.sqrt((X * X).mean(-1, keepdim=True) + 1e-5)
    ctx = torch.stack([xhat[:, : t + 1].mean(1) for t in range(X.shape[1])], dim=1)
    ref = m.weight * (1 + torch.tanh(ctx @ m.context.weight.T)) * xhat
    torch.testing.assert_close(m(X), ref)


def test_adaptive_rmsnorm_is_causal() -> None:
    """Changing a later token never changes an earlier output, in train and eval mode."""
    m = norm_module("adaptive_rmsnorm")
    randomize(m)
    changed = X.clone()
    changed[:, 3:] += torch.randn(3, 2, 16, generator=G, dtype=torch.float64)
    for mode in (True, False):
        m.train(mode)
        a, b = m(X), m(changed)
        torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=0)
        assert not torch.allclose(a[:, 3:], b[:, 3:])
    model = build_model(cfg_for("adaptive_rmsnorm"), seed=0).double()
    randomize_gains(model)
    for mod in model.modules():
        if hasattr(mod, "context"):
            randomize(mod)
    idx = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(2))
    idx2 = idx.clone()
    idx2[0, 7] = (idx2[0, 7] + 1) % 61
    model.train()
    a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-12)


def test_norm_type_model_equation_post_ln_layernorm() -> None:
    """A norm type inside a placement: the whole decoder for post_ln+layernorm."""
    cfg = cfg_for("post_ln+layernorm")
    model = build_model(cfg, seed=1).double()
    randomize_gains(model)

    def ln(x: torch.Tensor, sd: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + cfg.norm_eps) * sd[key] + sd[key[:-6] + "bias"]

    idx = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    ref = reference_logits(model, idx, cfg, lambda s, i: s in ("attn.residual", "ffn.residual",
                                                              "final"), norm=ln)
    torch.testing.assert_close(model(idx), ref, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------- batch-statistic norms


def test_batch_statistic_norms_declare_their_leak() -> None:
    reg = load_all()
    assert reg["powernorm"].leaks_across_positions and reg["prepbn"].leaks_across_positions
    assert not reg["adaptive_rmsnorm"].leaks_across_positions


def _leaks(m: torch.nn.Module) -> bool:
    changed = X.clone()
    changed[:, 4:] += torch.randn(changed[:, 4:].shape, generator=G, dtype=changed.dtype)
    a, b = m(X), m(changed)
    return not torch.allclose(a[:, :4], b[:, :4])


def test_powernorm_forward_train_and_eval() -> None:
    m = norm_module("powernorm(groups=2,warmup=2)")
    randomize(m)
    m.train()
    eps = 1e-5

    def group_scale(x: torch.Tensor) -> torch.Tensor:
        g = x.view(*x.shape[:-1], 2, 8)
        return (g / torch.sqrt((g * g).mean(-1, keepdim=True) + eps)).view(x.shape)

    xs = group_scale(X).reshape(-1, 16)
    psi2 = (xs * xs).mean(0)
    # warm-up: batch quadratic mean
    torch.testing.assert_close(m(X).reshape(-1, 16), xs / torch.sqrt(psi2 + eps) * m.weight
                               + m.bias)
    # running psi^2 after one update: cumulative mean (= psi2) then EMA with 0.9
    phi = 0.9 * psi2 + 0.1 * psi2
    torch.testing.assert_close(m.running_phi.view(-1), phi)
    assert _leaks(m)  # training mode in warm-up: later tokens change earlier outputs
    m.modbench_set_step(5, 10)  # after warm-up: the running statistic in the forward
    phi_before = m.running_phi.clone().view(-1)
    torch.testing.assert_close(m(X).reshape(-1, 16),
                               xs / torch.sqrt(phi_before + eps) * m.weight + m.bias)
    m.eval()
    phi_now = m.running_phi.clone().view(-1)
    torch.testing.assert_close(m(X).reshape(-1, 16),
                               xs / torch.sqrt(phi_now + eps) * m.weight + m.bias)
    assert not _leaks(m)
    torch.testing.assert_close(m.running_phi.view(-1), phi_now)  # eval never updates


def test_powernorm_approximate_backward() -> None:
    m = norm_module("powernorm(groups=1,warmup=100)")
    randomize(m)
    x = X.clone().reshape(-1, 16)[None].requires_grad_()
    y = m(x)
    gout = torch.randn(y.shape, generator=G, dtype=y.dtype)
    y.backward(gout)
    eps = 1e-5
    xs = x.detach() / torch.sqrt((x.detach() ** 2).mean(-1, keepdim=True) + eps)
    var = (xs * xs).mean(1, keepdim=True)
    z = xs / torch.sqrt(var + eps)
    g = gout * m.weight.detach()  # Gamma = 0 at the first backward: g~ = g
    gxs = g / torch.sqrt(var + eps)  # PowerNorm's dL/d(group-scaled x)
    # chain through the (exact) group scaling
    xr = x.detach().clone().requires_grad_()
    xs2 = xr / torch.sqrt((xr ** 2).mean(-1, keepdim=True) + eps)
    xs2.backward(gxs)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(m.ema_gz.view(-1), (g * z).mean(1).view(-1))


@pytest.mark.parametrize("step,lam", [(0, 1.0), (9, 1.0), (10, 1.0), (25, 0.5), (40, 0.0),
                                      (99, 0.0)])
def test_prepbn_lambda_schedule(step: int, lam: float) -> None:
    m = norm_module("prepbn(warm_steps=10,decay_steps=30)")
    m.modbench_set_step(step, 100)
    assert m.lam == pytest.approx(lam)
    f = norm_module("prepbn(warm_frac=0.1,decay_frac=0.3)")  # the same, as fractions of 100
    f.modbench_set_step(step, 100)
    assert f.lam == pytest.approx(lam)


def test_prepbn_forward_train_and_eval() -> None:
    m = norm_module("prepbn(warm_steps=0,decay_steps=4)")
    randomize(m)
    m.modbench_set_step(1, 100)  # lambda = 0.75
    m.train()
    flat = X.reshape(-1, 16)
    mu, var = flat.mean(0), flat.var(0, unbiased=False)
    bn = m.repbn
    rep = (flat - mu) / torch.sqrt(var + 1e-5) * bn.weight + bn.bias + bn.eta * flat
    ref = 0.75 * rms(flat, m.norm.weight, 1e-5) + 0.25 * rep
    torch.testing.assert_close(m(X).reshape(-1, 16), ref)
    assert _leaks(m)
    m.eval()  # published: RepBN alone with running statistics
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    ev = (flat - rm) / torch.sqrt(rv + 1e-5) * bn.weight + bn.bias + bn.eta * flat
    torch.testing.assert_close(m(X).reshape(-1, 16), ev)
    assert not _leaks(m)


def test_prepbn_keeps_the_final_rmsnorm() -> None:
    model = build_model(cfg_for("prepbn"))
    assert type(model.final_norm).__name__ == "RMSNorm"
    assert type(model.blocks[0].attn.pre_norm).__name__ == "PRepBNLayer"


def test_step_callback_sets_the_step() -> None:
    (m,) = parse_methods("prepbn")
    (cb,) = m.callbacks()
    model = build_model(cfg_for("prepbn"))
    trainer = SimpleNamespace(model=model, cfg=SimpleNamespace(train=SimpleNamespace(steps=50)),
                              step=0)
    cb.on_batch(trainer, 17, None)
    assert model.blocks[1].ffn.pre_norm.step == 17
    assert model.blocks[1].ffn.pre_norm.total == 50


def test_builder_norm_sites_use_the_norm_slot() -> None:
    p = plan(cfg_for("ssnorm"))
    assert type(Builder(p.spec, p.cfg).norm("final", 2)).__name__ == "SingleScaleRMSNorm"


def test_a_loaded_run_computes_what_its_last_validation_did(tmp_path: Path) -> None:
    """``load_run`` (eval, diagnose, export, remove-norm) sets step-dependent modules to the
    step of the run's last batch: the loaded model's validation loss is the summary's. Before,
    PRepBN's lambda stayed at step 0's (1: plain RMSNorm), another function (eval_mix=true; the
    default evaluates RepBN alone, whatever the step)."""
    method = "prepbn(eval_mix=true,warm_steps=2,decay_steps=20)"
    from modbench.eval.run import load_run
    from modbench.runtime.data import open_data
    from modbench.runtime.loss import validation_loss
    from modbench.train.trainer import train

    summary = train(tiny(method, 0, 12, "train.eval_every=0"), tmp_path / "run", progress=False)
    cfg, model, step = load_run(tmp_path / "run")
    assert step == 12
    got = validation_loss(model, open_data(cfg, progress=False), cfg.train.eval_sequences,
                          cfg.train.batch_size, torch.device("cpu"))
    assert got == pytest.approx(summary["final_val_loss"], rel=1e-6)
