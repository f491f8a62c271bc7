"""`modbench diagnose` (modbench.eval.diagnostics, modbench.report.diagnostics): each figure
against a constructed case whose answer is known independently of the code under test, the
command end to end, and every registered method (finite figures or nulls with reasons)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.stats
import torch
from torch import nn

from modbench.cli import run_cli
from modbench.eval.diagnostics import (
    Missing,
    Moments,
    Unavailable,
    angular_distance,
    attention_weights,
    compute_diagnostics,
    condition_number,
    entropy_and_sink,
    finalise,
    powerlaw_alpha,
    quantize_per_token,
    rtn_quantize,
)
from modbench.methods import load_all
from modbench.methods.build import build_model
from modbench.model.attention import SDPAKernel
from modbench.model.stream import ForwardContext
from modbench.report.diagnostics import FIGURES
from modbench.runtime.loss import lm_loss
from modbench.train.trainer import train
from tests.helpers import run_capturing, tiny

VOCAB, T = 512, 24  # the tiny preset's vocabulary; a short sequence keeps the tests quick


pytestmark = pytest.mark.usefixtures("one_thread")


def model_of(method: str = "baseline", seed: int = 0) -> nn.Module:
    return build_model(tiny(method).model, seed=seed).eval()


def batches(n: int = 1, rows: int = 2, t: int = T, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, t), generator=g) for _ in range(n)]


def diagnose(model: nn.Module, bs: list[torch.Tensor]) -> tuple[dict[str, Any], dict[str, str]]:
    return finalise(compute_diagnostics(model, bs))


def zero_(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()


# ------------------------------------------------------------------ moments and kurtosis


def test_planted_outlier_channel_kurtosis_by_hand_and_scipy() -> None:
    # one channel of d holds c, all others 0: a two-point distribution with p = 1/d, whose
    # excess kurtosis is (1 - 3p + 3p^2) / (p (1 - p)) - 3 whatever c is
    d, c = 64, 7.5
    x = torch.zeros(3, 10, d)
    x[..., 5] = c
    m = Moments()
    m.add(x[:1])
    m.add(x[1:])  # two chunks of different sizes, merged
    p = 1.0 / d
    by_hand = (1 - 3 * p + 3 * p * p) / (p * (1 - p)) - 3
    assert m.excess_kurtosis() == pytest.approx(by_hand, rel=1e-12)
    assert m.max_abs == c
    assert m.rms == pytest.approx(math.sqrt(c * c / d), rel=1e-12)
    # Gaussian noise with one outlier channel, in three chunks: scipy on the pooled values
    g = torch.Generator().manual_seed(1)
    y = torch.randn(6, 16, 32, generator=g)
    y[..., 3] *= 40.0
    y += 3.0  # a mean far from 0 (the merge must not cancel catastrophically)
    m = Moments()
    for chunk in (y[:1], y[1:4], y[4:]):
        m.add(chunk)
    flat = y.double().numpy().ravel()
    assert m.excess_kurtosis() == pytest.approx(scipy.stats.kurtosis(flat), rel=1e-9)
    assert m.variance == pytest.approx(flat.var(), rel=1e-12)
    assert m.rms == pytest.approx(math.sqrt((flat ** 2).mean()), rel=1e-12)
    assert isinstance(Moments().excess_kurtosis(), Missing)


def test_planted_outlier_channel_in_the_model() -> None:
    # Pre-LN: the first sublayer reads the embedding itself; plant every token's embedding
    # as c on channel 5 and 0 elsewhere
    model = model_of()
    c, d = 3.0, model.cfg.d_model
    with torch.no_grad():
        model.embed.weight.zero_()
        model.embed.weight[:, 5] = c
    r, _ = diagnose(model, batches())
    first = r["layers"][0]["attn"]
    p = 1.0 / d
    assert first["excess_kurtosis"] == pytest.approx((1 - 3 * p + 3 * p * p) / (p * (1 - p)) - 3,
                                                     rel=1e-9)
    assert first["max_abs"] == c
    assert first["rms"] == pytest.approx(c / math.sqrt(d), rel=1e-6)
    assert first["variance"] == pytest.approx(c * c * p * (1 - p), rel=1e-6)


# ------------------------------------------------------------------ angular distance


def test_angular_distance_against_arccos() -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 7, 32, generator=g), torch.randn(4, 7, 32, generator=g)
    an, bn = a.double().numpy(), b.double().numpy()
    cos = (an * bn).sum(-1) / (np.linalg.norm(an, axis=-1) * np.linalg.norm(bn, axis=-1))
    ref = np.arccos(cos) / np.pi
    np.testing.assert_allclose(angular_distance(a, b).numpy(), ref, rtol=1e-10, atol=1e-12)
    assert float(angular_distance(a, a).abs().max()) == 0.0
    assert float(angular_distance(a, 2.5 * a).abs().max()) < 1e-7
    np.testing.assert_allclose(angular_distance(a, -a).numpy(), 1.0, atol=1e-12)


# ------------------------------------------------------------------ an identity layer


def test_identity_layer_has_zero_distance_and_zero_skip_loss() -> None:
    model = model_of()
    parts = model.parts
    zero_(parts.linear("o", 1))  # layer 1 adds nothing: its branch outputs are exactly 0
    zero_(parts.linear("down", 1))
    r, reasons = diagnose(model, batches(2))
    one = r["layers"][1]
    assert one["angular_distance"] == 0.0
    assert one["attn"]["angular_distance"] == 0.0 and one["ffn"]["angular_distance"] == 0.0
    assert one["attn"]["update_norm"] == 0.0 and one["ffn"]["update_norm"] == 0.0
    assert one["skip_delta_loss"] == 0.0 and one["skip_mode"] == "restore"
    assert one["attn"]["update_share"] is None
    assert "changes nothing" in reasons["layers.1.attn.update_share"]
    # the live layer 0 is not an identity
    zero = r["layers"][0]
    assert zero["angular_distance"] > 0.01 and zero["skip_delta_loss"] != 0.0


@pytest.mark.parametrize("method", ["baseline", "post_ln", "hyper_connections",
                                    "hyper_connections_2lane", "attnres"])
def test_skip_loss_equals_the_model_without_the_block(method: str) -> None:
    # the reference deletes the block from the model: the stream then never sees it (each
    # remaining block keeps its own index, so its per-sublayer stream weights are unchanged)
    model = model_of(method, seed=3)
    bs = batches(2, seed=3)
    r, _ = diagnose(model, bs)
    for layer in range(model.cfg.n_layers):
        assert r["layers"][layer]["skip_mode"] == "restore"
        cut = copy.deepcopy(model)
        del cut.blocks[layer]
        with torch.no_grad():
            full = [float(lm_loss(model(b), b)) for b in bs]
            skipped = [float(lm_loss(cut(b), b)) for b in bs]
        ref = sum(s - f for s, f in zip(skipped, full, strict=True)) / len(bs)
        assert r["layers"][layer]["skip_delta_loss"] == pytest.approx(ref, abs=1e-6)


def test_skip_falls_back_to_zero_branches_where_the_stream_needs_the_block() -> None:
    # DenseFormer's depth averages index every block's output, so a block whose stream state
    # is restored leaves them one short: the block's branch outputs are zeroed instead, which
    # equals the model with that block's output projections (o, down) set to zero
    model = model_of("denseformer", seed=11)
    bs = batches(2, seed=11)
    r, _ = diagnose(model, bs)
    assert r["layers"][0]["skip_mode"] == "zero"
    assert any("zeroed" in n for n in r["notes"])
    cut = copy.deepcopy(model)
    zero_(cut.parts.linear("o", 0))
    zero_(cut.parts.linear("down", 0))
    with torch.no_grad():
        ref = sum(float(lm_loss(cut(b), b) - lm_loss(model(b), b)) for b in bs) / len(bs)
    assert r["layers"][0]["skip_delta_loss"] == pytest.approx(ref, abs=1e-6)


# ------------------------------------------------------------------ stream figures


@pytest.mark.parametrize("method", ["baseline", "relaxed_recursive", "widenet(moe=false)"])
def test_stream_figures_match_the_streams_own_records(method: str) -> None:
    """Also where layers share their norms or cores (the tie slot): a shared module's hook
    keeps only its own layer's call."""
    model = model_of(method, seed=4)
    (b,) = batches(1, seed=4)
    r, _ = diagnose(model, [b])
    with torch.no_grad():
        _, state = run_capturing(model, b)
    assert r["stream_is_single_lane"] is True
    for rec in state.history:
        got = r["layers"][rec.layer][rec.sublayer]
        x = rec.input.double().numpy().ravel()
        assert got["rms"] == pytest.approx(math.sqrt((x ** 2).mean()), rel=1e-9)
        assert got["variance"] == pytest.approx(x.var(), rel=1e-9)
        assert got["max_abs"] == pytest.approx(np.abs(x).max(), rel=1e-12)
        assert got["excess_kurtosis"] == pytest.approx(scipy.stats.kurtosis(x), rel=1e-7)
        delta = (rec.after.double() - rec.input.double()).norm(dim=-1)
        assert got["update_norm"] == pytest.approx(float(delta.mean()), rel=1e-9)
        rel = delta / rec.input.double().norm(dim=-1)
        assert got["relative_update"] == pytest.approx(float(rel.mean()), rel=1e-9)
        a, c = rec.input.double().numpy(), rec.after.double().numpy()
        cos = (a * c).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(c, axis=-1))
        ref = np.arccos(np.clip(cos, -1, 1)).mean() / np.pi
        assert got["angular_distance"] == pytest.approx(ref, rel=1e-6)
    last = state.history[-1].after.double().numpy().ravel()
    assert r["final"]["rms"] == pytest.approx(math.sqrt((last ** 2).mean()), rel=1e-9)


def test_update_share_when_attention_adds_nothing() -> None:
    model = model_of(seed=5)
    zero_(model.parts.linear("o", 0))
    r, _ = diagnose(model, batches(1, seed=5))
    assert r["layers"][0]["attn"]["update_share"] == 0.0
    assert r["layers"][0]["ffn"]["update_share"] == 1.0
    shares = r["layers"][1]["attn"]["update_share"] + r["layers"][1]["ffn"]["update_share"]
    assert shares == pytest.approx(1.0, abs=1e-12)


def test_gradient_norm_per_layer_against_autograd() -> None:
    model = model_of(seed=6)
    bs = batches(2, seed=6)
    r, _ = diagnose(model, bs)
    for layer, block in enumerate(model.blocks):
        params = list(block.parameters())
        norms = []
        for b in bs:
            grads = torch.autograd.grad(lm_loss(model(b), b), params)
            norms.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)))
        assert r["layers"][layer]["grad_norm"] == pytest.approx(sum(norms) / len(norms),
                                                                rel=1e-5)
    assert all(p.grad is None for p in model.parameters())  # left as found


# ------------------------------------------------------------------ attention


def qkv(b: int = 2, h: int = 4, h_kv: int = 2, t: int = 12, d: int = 16
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardContext]:
    g = torch.Generator().manual_seed(7)
    v = torch.randn(b, h_kv, t, d, generator=g)
    ctx = ForwardContext(cos=torch.ones(t, d), sin=torch.zeros(t, d), seq_len=t)
    return torch.zeros(b, h, t, d), torch.zeros(b, h_kv, t, d), v, ctx


def test_planted_sink_gives_mass_one_and_entropy_zero() -> None:
    q, k, v, ctx = qkv()
    q[..., 0] = 50.0  # every query points along e_0 ...
    k[:, :, 0, 0] = 50.0  # ... and only the first key does: logit 625 against 0
    kernel = SDPAKernel()
    w = attention_weights(kernel, q, k, v, ctx, kernel(q, k, v, ctx))
    ent, sink = entropy_and_sink(w)
    assert float(sink.min()) == 1.0
    assert float(ent.abs().max()) == 0.0


def test_uniform_attention_gives_entropy_log_t() -> None:
    q, k, v, ctx = qkv()  # all logits 0: query i spreads evenly over its i + 1 keys
    kernel = SDPAKernel()
    w = attention_weights(kernel, q, k, v, ctx, kernel(q, k, v, ctx))
    ent, sink = entropy_and_sink(w)
    t = q.shape[-2]
    for i in range(1, t):  # row i - 1 of the figures is query i
        assert torch.allclose(ent[..., i - 1], torch.tensor(math.log(i + 1), dtype=ent.dtype))
        assert torch.allclose(sink[..., i - 1], torch.tensor(1.0 / (i + 1), dtype=sink.dtype))


def test_uniform_attention_in_the_model() -> None:
    model = model_of(seed=8)
    zero_(model.parts.linear("q", 0))  # q = 0: every logit of layer 0 is 0
    r, _ = diagnose(model, batches(1, seed=8))
    ref_entropy = sum(math.log(i + 1) for i in range(1, T)) / (T - 1)
    ref_sink = sum(1.0 / (i + 1) for i in range(1, T)) / (T - 1)
    assert r["layers"][0]["attn"]["attn_entropy"] == pytest.approx(ref_entropy, rel=1e-6)
    assert r["layers"][0]["attn"]["attn_sink"] == pytest.approx(ref_sink, rel=1e-6)


def test_kernels_that_are_not_softmax_give_reasons() -> None:
    bs = batches(1)
    r, reasons = diagnose(model_of("softpick"), bs)
    assert r["layers"][0]["attn"]["attn_entropy"] is None
    assert "not a probability distribution" in reasons["layers.0.attn.attn_entropy"]
    assert 0.0 <= r["layers"][0]["attn"]["attn_sink"] <= 1.0  # the weight on key 0 itself
    r, reasons = diagnose(model_of("diff_attn"), bs)
    assert r["layers"][0]["attn"]["attn_sink"] is None
    assert "DiffKernel" in reasons["layers.0.attn.attn_sink"]


def test_a_kernel_that_is_not_a_mixing_raises() -> None:
    class Squash(nn.Module):  # a norm after the mixing: no A with y = A v
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    ctx: ForwardContext) -> torch.Tensor:
            y = SDPAKernel()(q, k, v, ctx)
            return y / (y.norm(dim=-1, keepdim=True) + 1e-6)

    q, k, v, ctx = qkv(h=2, h_kv=2)
    with pytest.raises(Unavailable, match="not a weighted sum"):
        attention_weights(Squash(), q, k, v, ctx, Squash()(q, k, v, ctx))


# ------------------------------------------------------------------ weight spectra


def orthogonal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]


def test_condition_number_of_known_singular_values() -> None:
    s = torch.tensor([10.0, 5.0, 2.0, 0.5], dtype=torch.float64)
    w = orthogonal(6, 0)[:, :4] @ torch.diag(s) @ orthogonal(4, 1).T
    assert condition_number(torch.linalg.svdvals(w)) == pytest.approx(20.0, rel=1e-10)
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)  # rank 1
    eps = 2 * torch.finfo(torch.float64).eps
    assert isinstance(condition_number(torch.linalg.svdvals(singular), eps), Missing)
    assert isinstance(condition_number(torch.zeros(3)), Missing)
    assert isinstance(condition_number(torch.tensor([3.0, 0.0])), Missing)


@pytest.mark.parametrize("alpha", [2.5, 3.5])
def test_powerlaw_alpha_of_a_synthetic_spectrum(alpha: float) -> None:
    # W^T W with eigenvalues at the exact quantiles of a Pareto law p(x) ~ x^-alpha: the
    # estimator must find alpha within 0.05 (n = 256 eigenvalues, tail of 128)
    n = 256
    u = (torch.arange(1, n + 1, dtype=torch.float64) - 0.5) / n
    lam = u ** (-1.0 / (alpha - 1.0))
    w = orthogonal(384, 2)[:, :n] @ torch.diag(lam.sqrt()) @ orthogonal(n, 3).T
    est, k = powerlaw_alpha(torch.linalg.svdvals(w) ** 2)
    assert k == n // 2
    assert est == pytest.approx(alpha, abs=0.05)
    assert isinstance(powerlaw_alpha(torch.ones(40))[0], Missing)  # flat: no power law
    assert isinstance(powerlaw_alpha(torch.ones(4))[0], Missing)  # too few eigenvalues


# ------------------------------------------------------------------ quantization


def test_rtn_leaves_a_matrix_on_the_grid_unchanged() -> None:
    g = torch.Generator().manual_seed(9)
    ints = torch.randint(-7, 8, (5, 300), generator=g).float()
    # every row, and every group of 128 columns (128, 128, 44), reaches +-7 somewhere
    for start in (0, 128, 256):
        ints[:, start] = 7.0
    scales = torch.tensor([2.0 ** -e for e in range(3, 8)])[:, None]  # exact in float
    w = ints * scales
    assert torch.equal(rtn_quantize(w), w)
    assert torch.equal(rtn_quantize(w, group_size=128), w)
    assert torch.equal(rtn_quantize(torch.zeros(3, 8)), torch.zeros(3, 8))
    x = torch.randn(4, 300, generator=g)  # off the grid: within half a step of each row
    q = rtn_quantize(x)
    step = x.abs().amax(dim=1, keepdim=True) / 7
    assert not torch.equal(q, x)
    assert bool(((q - x).abs() <= step / 2 + 1e-6).all())
    assert len(torch.unique(q[0])) <= 15
    a = torch.randint(-127, 128, (2, 3, 16), generator=g).float()
    a[..., 0] = 127.0
    a = a * 2.0 ** -6
    assert torch.equal(quantize_per_token(a), a)


def test_weight_quantization_of_an_on_grid_model_changes_nothing() -> None:
    model = model_of(seed=10)
    with torch.no_grad():
        for m in model.blocks.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(rtn_quantize(m.weight))
    r, _ = diagnose(model, batches(1, seed=10))
    q = r["quantization"]
    assert q["w4_per_channel"]["delta"] == 0.0
    assert q["reference_loss"] == pytest.approx(r["validation_loss"])
    assert q["w4_group"]["group_size"] == 128
    assert math.isfinite(q["a8_per_token"]["delta"])


# ------------------------------------------------------------------ the command


def all_nulls_explained(obj: Any, reasons: dict[str, str], path: str = "") -> list[str]:
    """Paths of a figure that is null without a reason or a number that is not finite."""
    bad: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("layer", "skip_mode") and (v is None or isinstance(v, int | str)):
                continue  # metadata: the layer of a non-block matrix, how a skip was made
            bad += all_nulls_explained(v, reasons, f"{path}.{k}" if path else k)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            bad += all_nulls_explained(v, reasons, f"{path}.{i}" if path else str(i))
    elif (obj is None and not reasons.get(path)) or (isinstance(obj, float)
                                                     and not math.isfinite(obj)):
        bad.append(path)
    return bad


def test_cli_writes_json_and_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    train(tiny(steps=3), run, progress=False)
    out = tmp_path / "diag"
    assert run_cli(["diagnose", str(run), "--batches", "2", "--out", str(out),
                    "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "skip Δloss" in printed and "w4_per_channel" in printed
    result = json.loads((out / "diagnostics.json").read_text())
    assert result["step"] == 3 and result["method"] == "baseline"
    assert result["batches"] == 2 and result["sequences"] == 16
    assert len(result["layers"]) == 2
    assert all_nulls_explained(result, result["null_reasons"]) == []
    for name in FIGURES:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run_cli(["diagnose", "--help"]) == 0
    assert "Example" in capsys.readouterr().out


def test_cli_refuses_a_missing_run_or_checkpoint(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["diagnose", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "modbench train" in err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.yaml").write_text("preset: tiny\n")
    assert run_cli(["diagnose", str(tmp_path / "half")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint" in err
    assert not (tmp_path / "half" / "diagnostics").exists()


# ------------------------------------------------------------------ every method

ALL = ["baseline", *sorted(load_all())]
NOT_SOFTMAX = {"sigmoid", "softpick", "diff_attn"}  # entropy undefined (reasons checked)


@pytest.mark.parametrize("method", ALL)
def test_every_method_gives_figures_or_reasons(method: str) -> None:
    torch.manual_seed(0)
    r, reasons = diagnose(model_of(method), batches(1, rows=2, t=16))
    assert all_nulls_explained(r, reasons) == [], method
    for layer in r["layers"]:
        assert layer["skip_delta_loss"] is not None and layer["grad_norm"] is not None
        assert layer["attn"]["rms"] is not None and layer["attn"]["angular_distance"] is not None
        if method not in NOT_SOFTMAX:
            assert layer["attn"]["attn_entropy"] is not None, method
    assert r["weights"] and r["validation_loss"] > 0
