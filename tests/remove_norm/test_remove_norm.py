"""``modbench remove-norm``: the frozen statistic against a hand computation, the published
schedule, every method classified, and end to end on a tiny modbench run and a tiny GPT-2
folder saved locally (no network)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modbench.cli import run_cli
from modbench.config import dump_yaml, resolve
from modbench.errors import ModbenchError
from modbench.methods import load_all
from modbench.methods.build import build_model
from modbench.remove_norm import remove_norm
from modbench.remove_norm.core import (
    EMA_MOMENTUM,
    SUPPORTED_NORMS,
    FakeNorm,
    TokenContext,
    _aux_loss,
    apply_event,
    final_fake_norm,
    linearity_error,
    norm_free_check,
    schedule,
    track_tokens,
)
from modbench.remove_norm.modbench_source import (
    UNSUPPORTED,
    check_method,
    convert_modbench,
    load_norm_free,
)
from modbench.train.trainer import train

# ------------------------------------------------------------- the frozen statistic


def _std(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_fake_norm_against_hand_computation(kind: str) -> None:
    torch.manual_seed(0)
    d, eps, eot = 6, 1e-5, 3
    w = nn.Parameter(torch.rand(d) + 0.5)
    b = nn.Parameter(torch.randn(d)) if kind == "layernorm" else None
    tokens = TokenContext(eot)
    norm = FakeNorm(kind, d, w, b, eps, tokens)
    stat = _std if kind == "layernorm" else _rms

    def centred(x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True) if kind == "layernorm" else x

    idx1 = torch.tensor([[5, 1, eot, 2], [7, 2, 2, 1]])
    idx2 = torch.tensor([[1, eot, 1, 1], [4, 4, 4, eot]])
    x1, x2 = torch.randn(2, 4, d) * 3, torch.randn(2, 4, d) * 0.5 + 1
    # live: the real norm
    tokens.set(idx1)
    ref = (F.layer_norm(x1, (d,), w, b, eps) if kind == "layernorm"
           else x1 / _rms(x1, eps) * w)
    torch.testing.assert_close(norm(x1), ref.detach())
    # two training batches: moving averages of ordinary and special (position 0, EOT) tokens
    norm.train()
    norm(x1)
    tokens.set(idx2)
    norm(x2)
    special1 = torch.zeros(2, 4, dtype=torch.bool)
    special1[:, 0] = True
    special1 |= idx1 == eot
    special2 = torch.zeros(2, 4, dtype=torch.bool)
    special2[:, 0] = True
    special2 |= idx2 == eot
    s1, s2 = stat(x1, eps)[..., 0], stat(x2, eps)[..., 0]
    rest = EMA_MOMENTUM * s1[~special1].mean() + (1 - EMA_MOMENTUM) * s2[~special2].mean()
    spec = EMA_MOMENTUM * s1[special1].mean() + (1 - EMA_MOMENTUM) * s2[special2].mean()
    norm.freeze(0, step=7)
    assert norm.sigma[0] == pytest.approx(float(rest), rel=1e-6)
    assert norm.sigma_special[0] == pytest.approx(float(spec), rel=1e-6)
    assert norm.frozen_at == [7]
    # frozen: (x - mean) / sigma * g + b, the special tokens with their own sigma
    x3 = torch.randn(2, 4, d) * 2
    sigma = torch.where(special2[..., None], spec, rest)
    expect = centred(x3) / sigma * w + (b if b is not None else 0)
    norm.eval()
    torch.testing.assert_close(norm(x3), expect.detach(), rtol=1e-5, atol=1e-6)
    # dropping the special averages leaves one scalar: a fixed linear map
    norm.special_eot = norm.special_first = False
    expect = centred(x3) / rest * w + (b if b is not None else 0)
    torch.testing.assert_close(norm(x3), expect.detach(), rtol=1e-5, atol=1e-6)
    assert linearity_error(norm, 0) < 1e-5
    # the auxiliary loss: squared distance of each token's statistic from the ordinary mean
    tokens.set(idx1)
    s1x = stat(x1, eps)
    aux = ((s1x - s1x[~special1[..., None]].mean()) ** 2).mean()
    assert float(_aux_loss(norm, x1)) == pytest.approx(float(aux), rel=1e-5)
    # a live norm is not linear
    live = FakeNorm(kind, d, w, b, eps, TokenContext(None))
    assert linearity_error(live, 0) > 0.1


def test_published_schedule() -> None:
    # submarat/removing-layer-norm config.py, gpt2_standard: 12 layers, 300 steps
    start_ln2 = 20
    start_ln1qk = start_ln2 + 12 * 2
    start_ln1v = start_ln1qk + 12 * 2
    start_lnf = start_ln1v + 12 * 3
    start_eot = start_lnf + 2
    start_bos = start_eot + 10
    expect = ([(start_ln2 + 2 * i, "ffn", i) for i in range(12)]
              + [(start_ln1qk + 2 * i, "attn_qk", i) for i in range(12)]
              + [(start_ln1v + 3 * i, "attn_v", i) for i in range(12)]
              + [(start_lnf, "final", -1), (start_eot, "eot", -1), (start_bos, "bos", -1)])
    got = [(e.step, e.stage, e.layer) for e in schedule(12, 300)]
    assert got == expect
    # scaled down: same order, inside the budget, proportional
    small = schedule(2, 20)
    steps = [e.step for e in small]
    assert steps == sorted(steps) and steps[-1] < 20
    assert [e.stage for e in small] == ["ffn", "ffn", "attn_qk", "attn_qk", "attn_v", "attn_v",
                                       "final", "eot", "bos"]
    assert schedule(12, 600)[-1].step == 2 * start_bos
    assert {e.step for e in schedule(4, 1)} == {0}


# --------------------------------------------------------------- every method


def _freeze_all(model: nn.Module, sites: list, batch: torch.Tensor) -> None:
    model.train()
    with torch.no_grad():
        model(batch)
    for e in schedule(len(model.blocks), 10):
        apply_event(e, sites)
    model.eval()


def test_every_method_is_removable_or_refused() -> None:
    torch.manual_seed(0)
    batch = torch.randint(0, 512, (2, 8))
    for name in sorted(load_all()):
        if name in UNSUPPORTED:
            with pytest.raises(ModbenchError, match=f"does not apply to method '{name}'"):
                check_method(f"{name}")
            continue
        check_method(name)
        model = build_model(resolve("tiny", method=name).model).eval()
        with torch.no_grad():
            ref = model(batch)
        tokens = TokenContext(0)
        sites = convert_modbench(model, tokens)
        track_tokens(model, tokens)
        with torch.no_grad():
            torch.testing.assert_close(model(batch), ref, msg=f"{name}: live differs")
        _freeze_all(model, sites, batch)
        check = norm_free_check(model, sites)
        assert check["normalization_free"], (name, check)
        with torch.no_grad():
            assert torch.isfinite(model(batch)).all(), name
    with pytest.raises(ModbenchError, match="does not apply to method 'dyt'"):
        check_method("post_ln+dyt")


def test_attention_pre_norm_split_into_two_paths() -> None:
    model = build_model(resolve("tiny").model)
    sites = convert_modbench(model, TokenContext(None))
    pre = [s for s in sites if s.name == "blocks.0.attn.pre_norm"]
    assert [(s.path, s.stage) for s in pre] == [(0, "attn_qk"), (1, "attn_v")]
    assert pre[0].norm is pre[1].norm
    assert [s.stage for s in sites if s.name == "final_norm"] == ["final"]
    assert not any(isinstance(m, SUPPORTED_NORMS) for m in model.modules())


# ----------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("rn") / "run"
    train(resolve("tiny", method="layernorm", steps=8), run)
    return run


def test_modbench_run_end_to_end(tiny_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "nonorm"
    o = remove_norm(tiny_run, out, steps=10, diagnostics_batches=0, control=True,
                    progress=False)
    report = json.loads((out / "remove_norm.json").read_text())
    assert report == json.loads(json.dumps(o.report))
    v, check = report["validation"], report["check"]
    assert check["normalization_free"] and check["live_paths"] == []
    assert check["max_linearity_error"] < 1e-5
    assert math.isfinite(v["change"]) and v["change"] != 0.0
    assert v["after"] == pytest.approx(v["before"] + v["change"])
    assert v["exported"] == pytest.approx(v["after"], abs=1e-4)  # folding 1/sigma is exact
    assert [s["stage"] for s in v["stages"]] == ["ffn", "attn_qk", "attn_v", "final", "eot",
                                                "bos"]
    assert v["removal_cost"] == pytest.approx(v["after"] - v["control_after"])
    assert {n["name"] for n in report["norms"]} == {
        "blocks.0.attn.pre_norm", "blocks.1.attn.pre_norm", "blocks.0.ffn.pre_norm",
        "blocks.1.ffn.pre_norm", "final_norm"}
    assert all(n["frozen_at"] is not None and n["sigma"] > 0 for n in report["norms"])
    # the saved model: loads, has no norm, and gives the reported loss
    from modbench.runtime.data import open_data
    from modbench.runtime.loss import validation_loss

    cfg, model = load_norm_free(out)
    assert not any(isinstance(m, SUPPORTED_NORMS) for m in model.modules())
    fakes = [m for m in model.modules() if isinstance(m, FakeNorm)]
    assert fakes and not any(any(f.live) or f.special_first or f.special_eot for f in fakes)
    data = open_data(cfg, progress=False)
    loss = validation_loss(model, data, cfg.train.eval_sequences, cfg.train.batch_size,
                           torch.device("cpu"))
    assert loss == pytest.approx(v["exported"], abs=1e-5)
    # a frozen norm is linear: twice its (centred) input gives twice its output minus bias
    final = model.final_norm
    x = torch.randn(1, 3, final.dim)
    with torch.no_grad():
        y1, y2 = final(x) - final.bias, final(2 * x) - final.bias
    torch.testing.assert_close(y2, 2 * y1)


def test_cli_remove_norm_with_diagnostics(tiny_run: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import modbench.report.diagnostics as rd

    drawn: list[tuple[str, Path]] = []  # the PNGs are modbench diagnose's own, tested there
    monkeypatch.setattr(rd, "diagnostics_figures",
                        lambda result, folder: drawn.append((result["method"], folder)))
    out = tmp_path / "cli"
    assert run_cli(["remove-norm", str(tiny_run), "--out", str(out), "--steps", "3",
                    "--diagnostics-batches", "1", "--aux-weight", "0.1", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "norm-free:  yes" in text and "after bos" in text
    report = json.loads((out / "remove_norm.json").read_text())
    assert report["settings"]["aux_weight"] == 0.1 and report["settings"]["steps"] == 3
    for when in ("before", "after"):
        diag = json.loads((out / "diagnostics" / when / "diagnostics.json").read_text())
        assert len(diag["layers"]) == 2 and diag["weights"] and diag["quantization"]
    assert [(m, f.name) for m, f in drawn] == [("layernorm", "before"),
                                               ("layernorm (norms removed)", "after")]


def test_refusals_leave_nothing(tiny_run: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    dyt = tmp_path / "dyt"
    (dyt / "checkpoints").mkdir(parents=True)
    (dyt / "config.yaml").write_text(dump_yaml(resolve("tiny", method="dyt")))
    (dyt / "checkpoints" / "last.pt").write_bytes(b"")
    out = tmp_path / "o"
    assert run_cli(["remove-norm", str(dyt), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "does not apply to method 'dyt'" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".o.*"))
    with pytest.raises(ModbenchError, match="exists and is not empty"):
        remove_norm(tiny_run, tiny_run.parent, steps=2, progress=False)
    with pytest.raises(ModbenchError, match="does not exist"):
        remove_norm(tmp_path / "missing", out, progress=False)
    with pytest.raises(ModbenchError, match="applies to GPT-2 sources"):
        remove_norm(tiny_run, out, data="x", progress=False)
    with pytest.raises(ModbenchError, match="--steps must be at least 1"):
        remove_norm(tiny_run, out, steps=0, progress=False)
    assert not out.exists()


# -------------------------------------------------------------------------- GPT-2


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    from modbench.data import builtin_tokenizer, find_eos_id

    folder = tmp_path_factory.mktemp("gpt2") / "tiny-gpt2"
    torch.manual_seed(0)
    eos = find_eos_id(builtin_tokenizer(512))
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=eos, eos_token_id=eos)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(folder))
    builtin_tokenizer(512).save(str(folder / "tokenizer.json"))
    return folder


def test_gpt2_end_to_end(gpt2_folder: Path, tmp_path: Path) -> None:
    import transformers

    from modbench.data import builtin_dataset

    out = tmp_path / "gpt2-nonorm"
    o = remove_norm(gpt2_folder, out, steps=12, batch_size=4, val_sequences=8,
                    data=str(builtin_dataset(512, 64, progress=False)),
                    diagnostics_batches=1, progress=False)
    v, check = o.report["validation"], o.report["check"]
    assert o.kind == "gpt2" and check["normalization_free"]
    assert math.isfinite(v["change"]) and v["change"] != 0.0
    assert check["export_max_logit_difference"] < 1e-3
    assert v["exported"] == pytest.approx(v["after"], abs=1e-3)
    assert len(o.report["norms"]) == 2 * 3 + 1  # ln_1 QK and V, ln_2 per block; ln_f
    for when in ("before", "after"):
        diag = json.loads((out / "diagnostics" / when / "diagnostics.json").read_text())
        assert len(diag["layers"]) == 2 and diag["quantization"]["w4_per_channel"]["delta"]
    assert (out / "tokenizer.json").is_file()
    # the export is a plain GPT-2 whose LayerNorms no longer normalise: each is linear
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    assert hf.config.layer_norm_epsilon == 1e12
    x = torch.randn(2, 5, 32) * 10
    for ln in [m for m in hf.modules() if isinstance(m, nn.LayerNorm)]:
        with torch.no_grad():
            y1, y2 = ln(x) - ln.bias, ln(3 * x) - ln.bias
        torch.testing.assert_close(y2, 3 * y1, rtol=1e-5, atol=1e-4)


def test_gpt2_builtin_corpus_retokenised(gpt2_folder: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import modbench.data as data
    from modbench.remove_norm.gpt2 import gpt2_data

    docs = data.builtin_documents()[:400]
    monkeypatch.setattr(data, "builtin_documents", lambda: docs)
    monkeypatch.setattr(data, "builtin_corpus_fingerprint", lambda: "test-subset-0000")
    ds = gpt2_data(gpt2_folder, None, 32, 512, 64, progress=False)
    assert ds.seq_len == 32 and ds.vocab_size == 512
    assert ds.num_sequences("train") > 0 and ds.num_sequences("val") > 0
    with pytest.raises(ModbenchError, match="embeddings"):
        gpt2_data(gpt2_folder, None, 32, 256, 64, progress=False)
    with pytest.raises(ModbenchError, match="context"):
        gpt2_data(gpt2_folder, str(ds.path), None, 512, 16, progress=False)


def test_gpt2_refusals(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModbenchError, match="takes GPT-2 folders"):
        remove_norm(folder, tmp_path / "o", steps=2, progress=False)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("method", ["baseline", "peri_ln", "embproj", "osp+peri_ln"])
def test_the_auxiliary_loss_finds_the_final_norm_inside_a_wrapper(method: str) -> None:
    """The auxiliary loss reads the final site's fake norm: the final norm itself, inside
    embproj's P_out wrapper, and never Peri-LN's embedding norm (also stage final)."""
    model = build_model(resolve("tiny", method=method).model).eval()
    sites = convert_modbench(model, TokenContext(0))
    final = final_fake_norm(sites)
    inner = getattr(model.final_norm, "module", model.final_norm)
    assert isinstance(final, FakeNorm) and final is inner
    assert final is not getattr(model.embed_norm, "module", model.embed_norm)
