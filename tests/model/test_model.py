"""The shared decoder against an independent reference of the Llama-2 equations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modbench.config import ModelConfig, resolve
from modbench.methods.build import build_model, count_params
from modbench.model.attention import ExplicitKernel, SDPAKernel
from modbench.model.stream import ForwardContext
from modbench.runtime.loss import lm_loss
from tests.reference import attention, rms, swiglu

torch.set_default_dtype(torch.float32)


def small_cfg(**kw: object) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                max_seq_len=16, tie_embeddings=True)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def reference_baseline_logits(model: torch.nn.Module, idx: torch.Tensor,
                              cfg: ModelConfig) -> torch.Tensor:
    """Pre-LN Llama: h = x + Attn(N(x)); y = h + SwiGLU(N(h)); logits = E N(y)."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    out = []
    for row in idx:
        x = sd["embed.weight"][row]
        for i in range(cfg.n_layers):
            p = f"blocks.{i}."
            x = x + attention(rms(x, sd[p + "attn.pre_norm.weight"], cfg.norm_eps), sd,
                              p + "attn.core.", cfg.n_heads, cfg.n_kv_heads)
            x = x + swiglu(rms(x, sd[p + "ffn.pre_norm.weight"], cfg.norm_eps), sd,
                           p + "ffn.core.")
        h = rms(x, sd["final_norm.weight"], cfg.norm_eps)
        head = sd["embed.weight"] if cfg.tie_embeddings else sd["head.weight"]
        out.append(h @ head.T)
    return torch.stack(out)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_baseline_matches_reference(tie: bool, n_kv: int) -> None:
    cfg = small_cfg(tie_embeddings=tie, n_kv_heads=n_kv)
    model = build_model(cfg, seed=3).double()
    with torch.no_grad():  # non-trivial gains so the norm weights are really checked
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    idx = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    ref = reference_baseline_logits(model, idx, cfg)
    torch.testing.assert_close(model(idx), ref, rtol=1e-9, atol=1e-9)
    assert ("head.weight" in model.state_dict()) is (not tie)


@pytest.mark.parametrize("h,h_kv", [(4, 4), (4, 2), (6, 1)])
def test_explicit_path_equals_fast_path(h: int, h_kv: int) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, h, 9, 8, generator=g)
    k = torch.randn(2, h_kv, 9, 8, generator=g)
    v = torch.randn(2, h_kv, 9, 8, generator=g)
    ctx = ForwardContext(cos=torch.ones(9, 8), sin=torch.zeros(9, 8), seq_len=9)
    torch.testing.assert_close(ExplicitKernel()(q, k, v, ctx), SDPAKernel()(q, k, v, ctx),
                               rtol=1e-5, atol=1e-5)


def test_causal() -> None:
    cfg = small_cfg()
    model = build_model(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % cfg.vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_init_depends_on_seed_only() -> None:
    cfg = small_cfg()
    torch.manual_seed(123)
    a = build_model(cfg, seed=5).state_dict()
    torch.manual_seed(999)  # the global RNG must not matter
    b = build_model(cfg, seed=5).state_dict()
    c = build_model(cfg, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.core.q_proj.weight"],
                           c["blocks.0.attn.core.q_proj.weight"])
    w = a["blocks.0.attn.core.q_proj.weight"]
    assert abs(w.std().item() - cfg.init_std) < 0.005


@pytest.mark.parametrize("preset", ["tiny", "cpu-small"])
def test_count_params_matches_allocated(preset: str) -> None:
    cfg = resolve(preset).model
    assert count_params(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_lm_loss_is_shifted_cross_entropy() -> None:
    logits = torch.randn(2, 5, 7)
    idx = torch.randint(0, 7, (2, 5))
    manual = -torch.log_softmax(logits, -1)[:, :-1].gather(-1, idx[:, 1:, None]).mean()
    torch.testing.assert_close(lm_loss(logits, idx), manual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_loss_and_its_gradient_equal_the_sliced_form(dtype: torch.dtype) -> None:
    """lm_loss shifts the targets instead of slicing the logits (no (B, T, V) copy); value and
    gradient equal the sliced form's: the mean cross-entropy of positions 0..T-2 (tolerance:
    float32 summation order, 1e-6 relative; the last position's gradient is exactly 0)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 11, generator=g).to(dtype).requires_grad_()
    idx = torch.randint(0, 11, (3, 9), generator=g)
    loss = lm_loss(logits, idx)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_logits[:, :-1].reshape(-1, 11).float(),
                                            idx[:, 1:].reshape(-1))
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(grad[:, -1]) == 0


def test_stream_records_every_sublayer_and_keeps_none() -> None:
    """Each merge sees the state the stream left: the value it merges into and the embedding,
    no record of earlier sublayers; the stream hands every sublayer's record (its input, its
    output and the stream value after it) to its recorders, in order, once each."""
    from modbench.model.spec import ModelSpec
    from modbench.model.stream import Record, StreamState
    from modbench.model.transformer import Transformer, baseline_spec

    seen: list[tuple[int, str, int]] = []
    records: list[Record] = []

    class Probe(torch.nn.Module):
        def __init__(self, layer: int, sub: str) -> None:
            super().__init__()
            self.layer, self.sub = layer, sub

        def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
            seen.append((self.layer, self.sub, len(records)))
            assert x is state.x and state.inputs == () and not state.kept
            if len(seen) > 6:  # the second forward, with no recorder
                return x + out
            for r in records:  # plain addition: after = input + output
                torch.testing.assert_close(r.after, r.input + r.output)
            if records:
                assert records[-1].after is x
            else:
                assert x is state.embedding
            return x + out

    cfg = small_cfg(n_layers=3)
    spec: ModelSpec = baseline_spec()
    spec.fill("merge", lambda c, layer, sub: Probe(layer, sub), by="probe")
    model = Transformer(cfg, spec)
    model.init_weights()
    handle = model.stream.add_recorder(records.append)
    model(torch.randint(0, cfg.vocab_size, (1, 5)))
    handle.remove()
    model(torch.randint(0, cfg.vocab_size, (1, 5)))
    assert len(records) == 6
    assert seen == [(0, "attn", 0), (0, "ffn", 1), (1, "attn", 2), (1, "ffn", 3),
                    (2, "attn", 4), (2, "ffn", 5)] + [(i // 2, ("attn", "ffn")[i % 2], 6)
                                                      for i in range(6)]


def test_bf16_autocast_path_trains(tmp_path: Path) -> None:
    """recipe.precision=bf16 runs the autocast path (on CPU here; on CUDA by default)."""
    from modbench.train.trainer import train
    from tests.helpers import tiny

    s = train(tiny("qknorm", 0, 6, "recipe.precision=bf16"), tmp_path / "r",
              progress=False)
    assert s["status"] == "completed" and s["final_val_loss"] < s["initial_val_loss"]
