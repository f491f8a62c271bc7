"""nGPT against an independent float64 forward written from the equations; unit norm of
weights and hidden states after optimizer steps (and only thanks to the renormalisation
callback); eigen-LR init; recipe exceptions recorded; conflicts."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from modbench.errors import ModbenchError
from modbench.methods import parse_methods
from modbench.methods.build import build_model, count_params
from modbench.runtime.loss import lm_loss
from modbench.train.trainer import Trainer
from tests.helpers import read_metrics, run_capturing, tiny
from tests.methods.attn_reference import IDX, built
from tests.reference import rope

INPUT_SIDE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
OUTPUT_SIDE = ("o_proj", "down_proj")


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True))


def reference_logits(model: torch.nn.Module, idx: torch.Tensor, cfg: object) -> torch.Tensor:
    """nGPT forward from the paper/code equations on float64 state-dict tensors, loops over
    heads; scaling vectors used as stored * (s_init / s_scale) with s_scale = 1/sqrt(d)
    (1 for s_u, s_nu)."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    d, h, h_kv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads  # type: ignore[attr-defined]
    dh, group, rd = d // h, h // h_kv, math.sqrt(d)
    out = []
    for row in idx:
        x = sd["embed.weight"][row]  # (T, d), unit rows
        t = x.shape[0]
        for layer in range(cfg.n_layers):  # type: ignore[attr-defined]
            p = f"blocks.{layer}."
            a = p + "attn.core."
            q = rope((x @ sd[a + "q_proj.weight"].T).view(t, h, dh).transpose(0, 1))
            k = rope((x @ sd[a + "k_proj.weight"].T).view(t, h_kv, dh).transpose(0, 1))
            v = (x @ sd[a + "v_proj.weight"].T).view(t, h_kv, dh).transpose(0, 1)
            s_qk = (sd[a + "qk_post.s_qk.weight"] * (1.0 * rd)).view(h_kv, dh)
            ys = []
            for i in range(h):
                g = i // group
                qi, ki = s_qk[g] * unit(q[i]), s_qk[g] * unit(k[g])
                scores = (qi @ ki.T) * math.sqrt(dh)
                scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
                ys.append(torch.softmax(scores, dim=-1) @ v[g])
            h_a = torch.cat(ys, dim=-1) @ sd[a + "o_proj.weight"].T
            alpha_a = (sd[p + "attn.merge.alpha.weight"] * (0.05 * rd)).abs()
            x = unit(unit(x) + alpha_a * (unit(h_a) - unit(x)))
            f = p + "ffn.core."
            u = (x @ sd[f + "up_proj.weight"].T) * sd[f + "s_u.weight"] * rd
            nu = (x @ sd[f + "gate_proj.weight"].T) * sd[f + "s_nu.weight"] * rd
            h_m = (u * nu * torch.sigmoid(nu)) @ sd[f + "down_proj.weight"].T
            alpha_m = (sd[p + "ffn.merge.alpha.weight"] * (0.05 * rd)).abs()
            x = unit(unit(x) + alpha_m * (unit(h_m) - unit(x)))
        z = (x @ sd["head.weight"].T) * sd["logits_transform.s_z.weight"] * rd
        out.append(z)
    return torch.stack(out)


def weight_norms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Norm of every weight vector along d that nGPT keeps at 1."""
    out = {"embed": model.embed.weight.norm(dim=1),  # type: ignore[union-attr]
           "head": model.head.weight.norm(dim=1)}  # type: ignore[union-attr]
    for name, p in model.named_parameters():
        mod = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if mod in INPUT_SIDE:
            out[name] = p.norm(dim=1)
        elif mod in OUTPUT_SIDE:
            out[name] = p.norm(dim=0)
    return out


def assert_unit(values: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    for name, n in values.items():
        assert torch.allclose(n, torch.ones_like(n), atol=tol), name


def test_forward_matches_reference_equations() -> None:
    model, cfg = built("ngpt", scale=0.2)  # GQA: 4 query heads, 2 KV heads
    torch.testing.assert_close(model(IDX), reference_logits(model, IDX, cfg),
                               rtol=1e-9, atol=1e-9)


def test_effective_scales_at_init_equal_s_init() -> None:
    model = build_model(tiny("ngpt").model, seed=0)
    d = 64
    sub = model.blocks[1]
    for vec, s_init, s_scale in [
        (sub.attn.merge.alpha, 0.05, 1 / math.sqrt(d)),
        (sub.ffn.merge.alpha, 0.05, 1 / math.sqrt(d)),
        (sub.attn.core.qk_post.s_qk, 1.0, 1 / math.sqrt(d)),
        (model.logits_transform.s_z, 1.0, 1 / math.sqrt(d)),
        (sub.ffn.core.s_u, math.sqrt(d), 1.0),  # s_u = 1, used times sqrt(d)
        (sub.ffn.core.s_nu, math.sqrt(d), 1.0),
    ]:
        torch.testing.assert_close(vec.weight, torch.full_like(vec.weight, s_scale))
        torch.testing.assert_close(vec(), torch.full_like(vec.weight, s_init))


def test_no_norm_layers_untied_head_and_sdpa_scale() -> None:
    model = build_model(tiny("ngpt").model, seed=0)
    assert model.cfg.tie_embeddings is False and model.head is not None
    assert not any("norm" in n for n, _ in model.named_parameters())
    assert model.blocks[0].attn.core.kernel.scale == pytest.approx(4.0)  # sqrt(d_h = 16)


def test_unit_norm_weights_and_hidden_states_at_init() -> None:
    model = build_model(tiny("ngpt").model, seed=0)
    assert_unit(weight_norms(model))
    with torch.no_grad():
        _, state = run_capturing(model, IDX % 512)
    assert_unit({"x0": state.embedding.norm(dim=-1)})
    assert_unit({f"after {i}": r.after.norm(dim=-1) for i, r in enumerate(state.history)})


def train_steps(tmp_path: Path, name: str) -> Trainer:
    tr = Trainer(tiny("ngpt", steps=3), tmp_path / name, progress=False)
    tr.run()
    return tr


def test_unit_norm_after_optimizer_steps_and_recipe_exceptions(tmp_path: Path) -> None:
    tr = train_steps(tmp_path, "r")
    model = tr.model
    init = build_model(tiny("ngpt").model, seed=0)
    assert not torch.allclose(model.head.weight, init.head.weight)  # the optimizer moved it
    assert_unit(weight_norms(model))
    with torch.no_grad():
        _, state = run_capturing(model, torch.randint(0, 512, (2, 32)))
    assert_unit({"x0": state.embedding.norm(dim=-1)})
    assert_unit({f"after {i}": r.after.norm(dim=-1) for i, r in enumerate(state.history)})
    # recipe exceptions: applied and recorded in the run's config
    assert all(g["weight_decay"] == 0.0 for g in tr.optimizer.param_groups)
    text = (tmp_path / "r" / "config.yaml").read_text()
    assert "recipe_exceptions:\n  weight_decay: 0.0\n  warmup_steps: 0" in text
    recipe = yaml.safe_load(text.split("\nmeta:")[0])["recipe"]
    assert recipe["weight_decay"] == 0.0 and recipe["warmup_steps"] == 0
    first = read_metrics(tmp_path / "r")[1]
    assert first["kind"] == "train" and first["lr"] == pytest.approx(recipe["lr"])


def test_the_callback_puts_the_weights_back_on_the_sphere() -> None:
    """An optimizer step moves the weights off the sphere; the method's callback (what the
    trainer calls after every step) projects them back."""
    model = build_model(tiny("ngpt").model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    idx = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    lm_loss(model(idx), idx).backward()
    opt.step()
    norms = weight_norms(model)
    assert all(not torch.allclose(n, torch.ones_like(n), atol=1e-5) for n in norms.values())
    (callback,) = parse_methods("ngpt")[0].callbacks()
    callback.after_optimizer_step(SimpleNamespace(model=model), 0)
    assert_unit(weight_norms(model))


def test_parameter_overhead_formula_by_hand() -> None:
    """Tiny: L=2, d=64, H_kv d_h = 32, d_ff = 176, V = 512, tied baseline."""
    cfg = tiny().model
    base = count_params(cfg)
    cfg.method = "ngpt"
    want = 2 * (2 * 64 + 32 + 2 * 176) + 512 + 512 * 64 - (2 * 2 + 1) * 64
    assert count_params(cfg) - base == want
    (m,) = parse_methods("ngpt")
    assert m.extra_params(cfg) == want


@pytest.mark.parametrize("other,slot", [
    ("layerscale", "merge"), ("laurel_rw", "merge"), ("post_ln", "placement"),
    ("dyt", "norm"), ("relu2", "ffn"), ("ssmax", "attn.qk_post"), ("sigmoid", "attn.kernel"),
    ("softcap", "attn.kernel"),
])
def test_conflicts_name_the_slot(other: str, slot: str) -> None:
    for text in (f"ngpt+{other}", f"{other}+ngpt"):
        with pytest.raises(ModbenchError, match=rf"both set the {slot} slot differently") as e:
            build_model(tiny(text).model)
        assert "\n" not in str(e.value)


def test_composes_with_the_activation_slot() -> None:
    """The FFN core reads ``ffn.act`` (SiLU by default), so GeGLU's GELU composes."""
    model = build_model(tiny("ngpt+geglu").model, seed=0)
    assert isinstance(model.blocks[0].ffn.core.act, torch.nn.GELU)
    assert torch.isfinite(model(IDX % 512)).all()
