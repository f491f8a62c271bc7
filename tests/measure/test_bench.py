"""``modbench bench``: the Hugging Face model it compares against is modbench's baseline
(same function given the same weights), and the command's tables and JSON hold together."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch

from modbench.cli import run_cli
from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.measure import bench
from modbench.methods.build import build_model

pytest.importorskip("transformers")


def llama_weights(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """modbench baseline state dict -> LlamaForCausalLM names (written from the two layouts,
    not taken from either library)."""
    out = {"model.embed_tokens.weight": state["embed.weight"],
           "model.norm.weight": state["final_norm.weight"]}
    for i in range(n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = state[b + "attn.pre_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = state[b + "ffn.pre_norm.weight"]
        for p in ("q", "k", "v", "o"):
            out[h + f"self_attn.{p}_proj.weight"] = state[b + f"attn.core.{p}_proj.weight"]
        for p in ("gate", "up", "down"):
            out[h + f"mlp.{p}_proj.weight"] = state[b + f"ffn.core.{p}_proj.weight"]
    out["lm_head.weight"] = state.get("head.weight", state["embed.weight"])
    return out


@pytest.mark.parametrize("preset", ["tiny", "cpu-small"])
def test_the_hf_model_is_the_baseline_given_its_weights(preset: str) -> None:
    cfg = resolve(preset).model
    ours = build_model(cfg, seed=3).eval()
    theirs = bench.hf_llama(cfg).eval()
    assert sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for p in theirs.parameters())
    missing, unexpected = theirs.load_state_dict(
        llama_weights(ours.state_dict(), cfg.n_layers), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    idx = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(idx), theirs(input_ids=idx).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and the two losses the bench times are the same objective
    from modbench.runtime.loss import lm_loss

    with torch.no_grad():
        torch.testing.assert_close(lm_loss(a, idx), theirs(input_ids=idx, labels=idx).loss,
                                   rtol=1e-5, atol=1e-5)


def test_run_bench_tables_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    report = bench.run_bench(hf_presets=["tiny"], methods=["qknorm", "softpick"],
                             preset="tiny", rounds=2, steps=1, progress=False)
    (h,) = report.hf
    assert h["preset"] == "tiny" and h["batch"] == [8, 64] and h["params"] > 0
    assert h["ratio"] == pytest.approx(h["modbench"]["tokens_per_s"] / h["hf"]["tokens_per_s"])
    assert [m["method"] for m in report.methods] == ["baseline", "qknorm", "softpick"]
    base = report.methods[0]
    assert base["ratio"] == 1.0 and base["path"] == "fast"
    assert report.methods[2]["path"] == "explicit" and report.methods[2]["aim"] == 2.0
    assert all(m["activation_mib"] > 0 for m in report.methods)
    assert (report.dtype, report.compiled, report.batch_source) == ("fp32", False, "preset")
    assert report.trainer is None  # the trainer's step is timed on CUDA, or when asked
    md = bench.markdown(report)
    assert "| tiny | 8 x 64 |" in md and "| `softpick` | explicit |" in md
    assert "fp32, eager" in md.splitlines()[0]
    json.dumps(report.to_dict())  # plain data
    assert run_cli(["bench", "--json", "--hf-presets", "tiny", "--preset", "tiny",
                    "--methods", "baseline,layerscale(init=1e-4)", "--rounds", "1",
                    "--steps", "1", "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [m["method"] for m in data["methods"]] == ["baseline", "layerscale(init=1e-4)"]
    assert data["hf"][0]["preset"] == "tiny"


def test_bad_bench_input_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["bench", "--dtype", "fp8", "--no-hf", "--methods", "baseline"]) == 2
    assert run_cli(["bench", "--rounds", "0", "--no-hf", "--methods", "baseline"]) == 2
    assert run_cli(["bench", "--no-hf", "--methods", "nosuch", "--rounds", "1"]) == 2
    assert run_cli(["bench", "--no-hf", "--methods", "baseline", "--micro-batch", "-1"]) == 2
    assert run_cli(["bench", "--no-hf", "--methods", "baseline", "--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("error: ") for line in err)


def test_precision_and_compilation_default_by_device() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert bench.resolve_precision(cpu) == ("fp32", False)  # the CPU tables' settings
    assert bench.resolve_precision(gpu) == ("bf16", True)  # how the trainer runs on CUDA
    assert bench.resolve_precision(gpu, "fp32", False) == ("fp32", False)
    assert bench.resolve_precision(cpu, "bf16", True) == ("bf16", True)
    with pytest.raises(ModbenchError, match="--dtype"):
        bench.resolve_precision(cpu, "fp16")


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 PCIe", 756.0),
                                            ("NVIDIA H100 80GB HBM3", 989.4),
                                            ("NVIDIA H100 NVL", 835.0),
                                            ("NVIDIA A100-SXM4-40GB", 312.0),
                                            ("NVIDIA GeForce RTX 4090", None)])
def test_mfu_divides_by_the_exact_gpu_models_peak(name: str, peak: float | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every H100 got the SXM peak before; a PCIe part's MFU was understated by 24 %."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert bench.peak_tflops(torch.device("cuda")) == peak
    assert bench.peak_tflops(torch.device("cpu")) is None


def test_the_table_runs_one_micro_batch_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert bench.table_batch("llama-60m", cpu) == (512, 256, "preset")  # the CPU: as before
    assert bench.table_batch("llama-60m", gpu, micro_batch=24) == (24, 256, "given")
    # no memory plan: the import fails (the package's attribute too, which another test's
    # import of the module sets and `from modbench.measure import plan` reads first)
    import modbench.measure

    monkeypatch.setitem(sys.modules, "modbench.measure.plan", None)
    monkeypatch.delattr(modbench.measure, "plan", raising=False)
    assert bench.table_batch("llama-60m", gpu) == (bench.GPU_TOKENS // 256, 256, "fixed")
    assert bench.table_batch("climb-1.2b", gpu) == (bench.GPU_TOKENS // 1024, 1024, "fixed")


def test_the_micro_batch_on_cuda_is_the_memory_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from modbench.measure import plan as memory_plan
    from modbench.runtime.gpus import lookup

    asked = []

    def choose(cfg: Any, device: object) -> SimpleNamespace:
        asked.append((cfg, device))
        return SimpleNamespace(micro_batch={"baseline": 96, "comt": 48}[cfg.model.method],
                               peak_bytes=1)

    h100 = lookup("h100-pcie")
    monkeypatch.setattr(memory_plan, "choose_micro_batch", choose)
    monkeypatch.setattr(bench, "detect", lambda device: h100)
    gpu = torch.device("cuda")
    assert bench.table_batch("llama-60m", gpu) == (96, 256, "plan")
    (cfg, device), = asked
    assert cfg.preset == "llama-60m" and device == h100  # planned against the exact model
    # the table's methods all fit: the smallest of their plans, each planned beside the
    # others' resident fp32 weights and AdamW moments
    asked.clear()
    assert bench.table_batch("llama-60m", gpu, methods=["baseline", "comt"]) == (48, 256, "plan")
    params = {c.model.method: bench.flop_report(c.model).params for c, _ in asked}
    for c, device in asked:
        other = sum(n for m, n in params.items() if m != c.model.method)
        assert device.key == h100.key
        assert device.memory_bytes == pytest.approx(h100.memory_bytes - 12 * other, abs=1)


def test_the_trainers_timed_steps_are_whole_read_back_windows_on_cuda() -> None:
    with pytest.raises(ModbenchError, match="multiple of 16"):  # refused before any work
        bench.trainer_step("tiny", "baseline", 4, 64, torch.device("cuda"), dtype="bf16",
                           compile=True, steps=20)


def test_log_lines_are_timed_by_when_they_were_whole_on_disk() -> None:
    a, b = json.dumps({"kind": "train", "step": 1}) + "\n", json.dumps({"kind": "val"}) + "\n"
    half = len(a) + 3  # the second line half written at t=2
    samples = [(1.0, 0), (1.5, len(a)), (2.0, half), (3.0, len(a) + len(b))]
    got = bench._appearances(samples, a + b)
    assert [(t, r["kind"]) for t, r in got] == [(1.5, "train"), (3.0, "val")]


def test_the_trainers_step_beside_the_bare_one(capsys: pytest.CaptureFixture[str]) -> None:
    """``--trainer`` on the CPU: modbench train at the table's shape, in its own process."""
    assert run_cli(["bench", "--json", "--no-hf", "--preset", "tiny", "--methods", "baseline",
                    "--trainer", "--trainer-steps", "2", "--micro-batch", "4", "--rounds", "1",
                    "--steps", "1", "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    t, base = data["trainer"], data["methods"][0]
    assert data["batch"] == t["batch"] == [4, 64] and data["batch_source"] == "given"
    assert t["steps_timed"] == 2 and t["eval_every"] == 10 and t["eval_sequences"] == 16
    assert 0 < t["validation_sequences"] <= 16 and t["validation_s"] > 0
    # validation charged at the preset's schedule: a pass of fewer rows scaled up
    charged = t["validation_s"] * 16 / t["validation_sequences"] / 10
    assert t["step_with_validation_ms"] == pytest.approx(t["step_ms"] + 1e3 * charged)
    assert t["tokens_per_s"] == pytest.approx(4 * 64 / (t["step_with_validation_ms"] / 1e3))
    assert t["bare_step_ms"] == base["median_ms"]
    assert t["trainer_over_bare"] == pytest.approx(t["step_with_validation_ms"]
                                                   / base["median_ms"])
    assert "mfu" not in t  # no peak on the CPU
    report = bench.BenchReport(**data)
    md = bench.markdown(report)
    assert "| trainer, validation charged |" in md and "Trainer step / bare step" in md
