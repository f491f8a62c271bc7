"""Unified Normalization: the training forward/backward (window smoothing, gradient
compensation, outlier filtration) against a direct recomputation of the equations, the
evaluation form, and the inference fusion into the next linear layers."""

from __future__ import annotations

import math

import pytest
import torch

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods import load_all
from modbench.methods.build import build_model, plan
from modbench.methods.unified_norm import UnifiedNormLayer, fuse_unified_norms
from modbench.runtime.loss import lm_loss

G = torch.Generator().manual_seed(5)
EPS = 1e-5


def layer(dim: int = 8, **opts: object) -> UnifiedNormLayer:
    text = ",".join(f"{k}={v}" for k, v in opts.items())
    cfg = ModelConfig(vocab_size=61, d_model=dim, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16,
                      max_seq_len=16, method=f"unified_norm({text})" if text else "unified_norm")
    m = plan(cfg).spec.get("norm")(dim, EPS, "ffn.pre", 0)
    assert isinstance(m, UnifiedNormLayer)
    m.double()
    with torch.no_grad():
        m.weight.copy_(torch.rand(dim, generator=G, dtype=torch.float64) + 0.5)
        m.bias.copy_(torch.randn(dim, generator=G, dtype=torch.float64))
    return m


class Ref:
    """The equations of the module docstring, on plain tensors (products, not logs)."""

    def __init__(self, m: UnifiedNormLayer) -> None:
        self.t = int(m.iters)
        self.run, self.gam = m.running_var.clone(), m.ema_gz.clone()
        self.buf, self.gbuf = m.buffer_x2.clone(), m.buffer_gz.clone()
        self.w, self.b = m.weight.detach().clone(), m.bias.detach().clone()
        self.W, self.warm, self.filt = m.window, m.warmup, m.filtration
        self.skips = 0

    def step(self, x: torch.Tensor, gout: torch.Tensor) -> tuple[torch.Tensor, ...]:
        W, mom = self.W, 0.9
        self.t += 1
        t, k = self.t, self.t % W
        x2 = (x * x).sum(0) / x.shape[0]
        flat = self.buf.sqrt().flatten()
        v = ((flat - flat.mean()) ** 2).sum() / (flat.numel() - 1)
        self.buf[k] = x2
        skip = False
        if self.filt and t >= self.warm:
            am = self.buf.sum(0) / W
            gm = self.buf.prod(0) ** (1.0 / W)
            if (am - gm > W * v).any():
                self.buf[k] = self.run
                skip = True
                self.skips += 1
        early = t <= W or t < self.warm or skip
        psi = x2 if early else self.buf.prod(0) ** (1.0 / W)
        r = torch.sqrt(psi + EPS) / torch.sqrt(self.run + EPS)
        r = torch.ones_like(r) if (t <= max(1000, self.warm) or skip) else r.clamp(0.2, 5.0)
        z = x / torch.sqrt(psi + EPS)
        y = self.w * z + self.b
        self.run = mom * self.run + (1 - mom) * psi
        g = gout * self.w * r
        gz = (g * z).sum(0) / x.shape[0]
        self.gbuf[k] = self.gam if skip else gz
        mu = gz if early else self.gbuf.sum(0) / W
        self.gam = mom * self.gam + (1 - mom) * mu
        gx = (g - (mu if skip else self.gam) * z) / torch.sqrt(psi + EPS)
        return y, gx, (gout * r * z).sum(0), gout.sum(0)


def run_both(m: UnifiedNormLayer, steps: int, scale: list[float] | None = None) -> Ref:
    ref = Ref(m)
    m.train()
    for i in range(steps):
        x = torch.randn(3, 5, m.dim, generator=G, dtype=torch.float64) * 2 + 0.3
        if scale is not None:
            x = x * scale[i]
        gout = torch.randn(3, 5, m.dim, generator=G, dtype=torch.float64)
        xr = x.clone().requires_grad_()
        m.zero_grad()
        y = m(xr)
        y.backward(gout)
        ey, egx, egw, egb = ref.step(x.reshape(-1, m.dim), gout.reshape(-1, m.dim))
        torch.testing.assert_close(y.reshape(-1, m.dim), ey)
        torch.testing.assert_close(xr.grad.reshape(-1, m.dim), egx)
        torch.testing.assert_close(m.weight.grad, egw)
        torch.testing.assert_close(m.bias.grad, egb)
        torch.testing.assert_close(m.running_var, ref.run)
        torch.testing.assert_close(m.ema_gz, ref.gam)
        torch.testing.assert_close(m.buffer_x2, ref.buf)
    assert int(m.iters) == ref.t and int(m.skips) == ref.skips
    return ref


def test_registered_as_a_leaking_unstackable_norm() -> None:
    cls = load_all()["unified_norm"]
    assert cls.category == "norm" and cls.leaks_across_positions and not cls.stackable


def test_batch_statistic_then_window_smoothing() -> None:
    # window 2, warmup 3: steps 1-2 batch statistic, from step 3 the geometric mean
    run_both(layer(window=2, warmup=3), 6)


def test_gradient_compensation_after_iteration_1000() -> None:
    m = layer(window=3, warmup=0)
    with torch.no_grad():  # a state past iteration 1000, so r is not clamped to 1
        m.iters.fill_(1000)
        m.buffer_x2.copy_(torch.rand(3, 8, generator=G, dtype=torch.float64) * 4 + 0.5)
        m.buffer_gz.copy_(torch.randn(3, 8, generator=G, dtype=torch.float64) * 0.1)
        m.running_var.copy_(torch.rand(8, generator=G, dtype=torch.float64) * 30 + 0.01)
        m.ema_gz.copy_(torch.randn(8, generator=G, dtype=torch.float64) * 0.1)
    run_both(m, 4)


def test_outlier_filtration_skips_an_outlying_batch() -> None:
    m = layer(window=2, warmup=2, filtration="true")
    ref = run_both(m, 6, scale=[1, 1, 1, 1, 30, 1])
    assert ref.skips >= 1  # the x30 batch is filtered: the running statistic fills its slot
    off = layer(window=2, warmup=2)
    assert run_both(off, 6, scale=[1, 1, 1, 1, 30, 1]).skips == 0


def test_eval_is_the_fixed_affine_map_and_causal() -> None:
    m = layer(window=2, warmup=1)
    run_both(m, 4)
    m.eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(2, 6, 8, generator=G, dtype=torch.float64)
    want = x / torch.sqrt(m.running_var + EPS) * m.weight + m.bias
    torch.testing.assert_close(m(x), want)
    x2 = x.clone()
    x2[:, 3:] += 5.0
    torch.testing.assert_close(m(x2)[:, :3], m(x)[:, :3])  # no leak in evaluation
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    m.train()  # training mode: the batch statistic makes earlier outputs depend on later ones
    assert not torch.allclose(m(x2)[:, :3], m(x)[:, :3])


@pytest.mark.parametrize("opts", ["window=0", "warmup=-1", "momentum=1.0"])
def test_bad_options_are_refused(opts: str) -> None:
    cfg = ModelConfig(vocab_size=61, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16,
                      max_seq_len=16, method=f"unified_norm({opts})")
    with pytest.raises(ModbenchError, match="unified_norm"):
        build_model(cfg)


def _trained(method: str, tie: bool) -> tuple[torch.nn.Module, ModelConfig]:
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40,
                      max_seq_len=16, method=method, tie_embeddings=tie)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):  # past warm-up and window: smoothed statistics in play
        idx = torch.randint(0, cfg.vocab_size, (4, 16), generator=G)
        loss = lm_loss(model(idx), idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    return model.eval(), cfg


@pytest.mark.parametrize("tie", [False, True])
def test_fused_and_unfused_forwards_agree(tie: bool) -> None:
    model, cfg = _trained("unified_norm(window=2,warmup=3,filtration=true)", tie)
    probe = torch.randint(0, cfg.vocab_size, (2, 16), generator=G)
    fused, n = fuse_unified_norms(model, probe)
    # untied: every norm (2 per block + final) folds; tied: the final norm feeds the shared
    # embedding weight and stays
    assert n == 2 * cfg.n_layers + (0 if tie else 1)
    idx = torch.randint(0, cfg.vocab_size, (3, 16), generator=G)
    with torch.no_grad():
        # float32: the fold reorders a product, so agreement to ~1e-5 relative
        torch.testing.assert_close(fused(idx), model(idx), rtol=1e-4, atol=1e-4)
        fused64, _ = fuse_unified_norms(model.double(), probe)
        torch.testing.assert_close(fused64(idx), model(idx), rtol=1e-10, atol=1e-10)
    fused.train()
    with pytest.raises(ModbenchError, match="fused"):
        fused(idx)


def test_fusion_keeps_norms_whose_output_feeds_the_residual() -> None:
    model, cfg = _trained("unified_norm(window=2,warmup=3)+post_ln", tie=False)
    probe = torch.randint(0, cfg.vocab_size, (2, 16), generator=G)
    fused, n = fuse_unified_norms(model, probe)
    assert n < 2 * cfg.n_layers + 1  # Post-LN's norm output is the residual stream
    idx = torch.randint(0, cfg.vocab_size, (3, 16), generator=G)
    with torch.no_grad():
        torch.testing.assert_close(fused(idx), model(idx), rtol=1e-4, atol=1e-4)


def test_fusion_needs_eval_mode() -> None:
    model, _ = _trained("unified_norm", tie=False)
    with pytest.raises(ModbenchError, match="eval"):
        fuse_unified_norms(model.train(), torch.zeros(1, 4, dtype=torch.long))
