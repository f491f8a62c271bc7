"""``modbench bench``: the Hugging Face model it compares against is modbench's baseline
(same function given the same weights), and the command's tables and JSON hold together."""

from __future__ import annotations

import json

import pytest
import torch

from modbench.analysis import bench
from modbench.cli import run_cli
from modbench.config import resolve
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
    md = bench.markdown(report)
    assert "| tiny | 8 x 64 |" in md and "| `softpick` | explicit |" in md
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
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
