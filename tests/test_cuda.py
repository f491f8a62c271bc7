"""The CUDA path, on a GPU only (skipped elsewhere; CI has none): every registered method
gives the CPU's logits on CUDA in fp32, trains with finite gradients under bf16 autocast
with a loss close to fp32's, and compiles; the trainer and ``modbench eval`` run on CUDA."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from modbench.eval.run import evaluate_run
from modbench.methods import load_all
from modbench.methods.build import build_model
from modbench.runtime.loss import lm_loss
from modbench.train.trainer import train
from tests.helpers import read_metrics, tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ALL = sorted(load_all())
COMBOS = ["selective+qknorm", "gated_attn+qknorm", "post_ln+qknorm+layerscale"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _batch(vocab: int, seed: int = 0, shape: tuple[int, int] = (4, 48)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", ALL + COMBOS)
def test_cuda_fp32_matches_cpu(method: str) -> None:  # pragma: no cover - GPU only
    cfg = tiny(method).model
    idx = _batch(cfg.vocab_size)
    cpu = build_model(cfg, seed=0).eval()
    gpu = build_model(cfg, seed=0, device="cuda").eval()
    with torch.no_grad():
        want = cpu(idx)
        got = gpu(idx.cuda()).cpu()
    assert torch.isfinite(got).all()
    assert _rel(got, want) < 1e-4, f"{method}: CUDA fp32 logits differ from CPU"


@pytest.mark.parametrize("method", ALL + COMBOS)
def test_cuda_bf16_autocast_trains(method: str) -> None:  # pragma: no cover - GPU only
    cfg = tiny(method).model
    idx = _batch(cfg.vocab_size).cuda()
    model = build_model(cfg, seed=0, device="cuda")
    with torch.no_grad():
        ref = float(lm_loss(model(idx), idx))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = lm_loss(model(idx), idx)
    assert math.isfinite(float(loss))
    assert abs(float(loss) - ref) / ref < 2e-2, f"{method}: bf16 loss {float(loss)} vs fp32 {ref}"
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{method}: {name}"


@pytest.mark.parametrize("method", ["baseline", "qknorm", "softcap", "sigmoid", "diff_attn",
                                    "ngpt", "hyper_connections", "comt"])
def test_compiled_matches_eager_on_cuda(method: str) -> None:  # pragma: no cover - GPU only
    cfg = tiny(method).model
    idx = _batch(cfg.vocab_size).cuda()
    model = build_model(cfg, seed=0, device="cuda").eval()
    compiled = torch.compile(model)
    with torch.no_grad():
        want = model(idx)
        got = compiled(idx)
    assert _rel(got, want) < 1e-3, f"{method}: compiled logits differ from eager"


@pytest.mark.parametrize("compile_", [False, True])
def test_trainer_and_eval_on_cuda(compile_: bool, tmp_path: Path) -> None:  # pragma: no cover
    cfg = tiny("qknorm", 0, 30, "train.device=cuda", f"train.compile={str(compile_).lower()}",
               "data.probe_mix=0.5", "train.eval_probes=8")
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["status"] == "completed" and summary["device"].startswith("cuda")
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.3
    assert {"mqar", "induction", "cloze"} <= set(summary["final_probes"])
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    result = evaluate_run(tmp_path / "run", probes=True, limit=8, progress=False)
    assert result["validation"]["loss"] == pytest.approx(summary["final_val_loss"], rel=2e-2)
    assert result["tasks"]["mqar"]["n"] == 8
