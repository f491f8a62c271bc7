"""Scale ladders (config.Ladder, ladder_shape, ladder presets) and ``scales: ladder(NAME[, K])``
in study specs (issue 31, item 1)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from modbench.config import (
    LADDERS,
    PRESETS,
    RECIPES,
    ModelConfig,
    ladder_scales,
    ladder_shape,
    non_embedding_params,
    resolve,
)
from modbench.errors import ModbenchError
from modbench.measure.flops import baseline_params
from modbench.study.spec import expand, load_spec


def tokens(name: str) -> int:
    t = PRESETS[name].train
    return int(t["steps"] * t["batch_size"] * t["seq_len"])


@pytest.mark.parametrize("name", list(PRESETS))
def test_non_embedding_params_is_the_count_less_the_embedding(name: str) -> None:
    m = PRESETS[name].model
    emb = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    assert non_embedding_params(m) == baseline_params(m) - emb


@pytest.mark.parametrize("ladder", list(LADDERS))
def test_rungs_follow_the_rule(ladder: str) -> None:
    lad = LADDERS[ladder]
    names = lad.rung_names()
    assert len(names) == lad.rungs and names[-1] == lad.top
    top = PRESETS[lad.top]
    n_top = non_embedding_params(top.model)
    ratio = tokens(lad.top) / n_top
    g = top.model.n_heads // top.model.n_kv_heads
    ns = [non_embedding_params(PRESETS[n].model) for n in names]
    assert ns == sorted(ns) and len(set(ns)) == len(ns)  # strictly growing
    for k, name in enumerate(names[:-1]):
        p = PRESETS[name]
        m, size = p.model, lad.factor ** -(lad.rungs - 1 - k)
        c = size ** (1 / 3)
        # width, depth and heads scaled together (whole GQA groups, even head size)
        assert m.n_heads // m.n_kv_heads == g and m.n_heads % g == 0 and m.head_dim % 2 == 0
        assert m.d_model == m.n_heads * m.head_dim
        assert m.n_layers == max(1, round(c * top.model.n_layers))
        assert abs(m.d_model / top.model.d_model - c) < 0.25 * c
        assert (m.vocab_size, m.max_seq_len, m.tie_embeddings) == (
            top.model.vocab_size, top.model.max_seq_len, top.model.tie_embeddings)
        # about the asked size (rounding to whole heads, layers and widths: within 2x)
        assert 0.5 < ns[k] / (size * n_top) < 2.0
        # tokens per parameter held, to one step of rounding
        t = p.train
        assert abs(tokens(name) / ns[k] - ratio) <= t["batch_size"] * t["seq_len"] / ns[k]
        # batch ~ C^(1/3), a power of two, at least min_batch and at most the top's
        assert lad.min_batch <= t["batch_size"] <= top.train["batch_size"]
        assert t["batch_size"] & (t["batch_size"] - 1) == 0
        # as many validations, the same warm-up fraction
        if top.train.get("eval_every"):
            val_top = top.train["steps"] / top.train["eval_every"]
            assert abs(t["steps"] / t["eval_every"] - val_top) <= 0.2 * val_top + 1
        warm = RECIPES[top.recipe].warmup_steps
        if warm is not None:
            w = p.recipe_keys["warmup_steps"]
            assert abs(w / t["steps"] - warm / top.train["steps"]) < 0.01
            assert resolve(name).recipe.warmup_steps == w
        resolve(name)  # every rung is a valid preset


def test_the_presets_the_issue_asks_for() -> None:
    cpu = [non_embedding_params(PRESETS[n].model) for n in LADDERS["cpu"].rung_names()]
    assert 0.15e6 < cpu[0] < 0.25e6 and 7e6 < cpu[-1] < 10e6
    # ladder-cpu's: four rungs ending at the cpu ladder's third (a ladder may end at another
    # ladder's rung), each about 1.8 times the one before, the top's tokens per parameter
    short = LADDERS["cpu-short"].rung_names()
    assert short[-1] == "cpu-ladder-3" and PRESETS[short[-1]] is PRESETS["cpu-ladder-3"]
    ns = [non_embedding_params(PRESETS[x].model) for x in short]
    assert 0.12e6 < ns[0] < 0.2e6 and ns[-1] == cpu[2]
    assert all(1.5 < b / a < 2.2 for a, b in itertools.pairwise(ns)), ns
    for x, n in zip(short, ns, strict=True):
        t = PRESETS[x].train
        assert t["steps"] * t["batch_size"] * t["seq_len"] / n == pytest.approx(0.294, abs=0.01)
    assert load_spec("ladder-cpu").scales == short
    gpu = LADDERS["gpu"].rung_names()
    assert gpu[-1] == "climb-1.2b"
    n = [non_embedding_params(PRESETS[x].model) for x in gpu]
    assert 10e6 < n[0] < 30e6 and 1.0e9 < n[-1] < 1.1e9


def test_ladder_shape_of_size_one_is_the_top() -> None:
    top = PRESETS["climb-1.2b"].model
    assert ladder_shape(top, 1.0) == top
    with pytest.raises(ModbenchError, match=r"size factor must be in \(0, 1\]"):
        ladder_shape(top, 1.5)
    tiny = ladder_shape(ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    d_ff=176), 1e-6)
    assert (tiny.n_layers, tiny.n_heads, tiny.n_kv_heads) == (1, 2, 1) and tiny.d_ff >= 8


def test_ladder_scales_syntax() -> None:
    cpu = LADDERS["cpu"].rung_names()
    assert ladder_scales("ladder(cpu, 4)") == cpu[:4]
    assert ladder_scales(" ladder( cpu ) ") == cpu
    assert ladder_scales("cpu-small") is None
    with pytest.raises(ModbenchError, match=r"unknown ladder 'cpus'.*did you mean 'cpu'"):
        ladder_scales("ladder(cpus, 4)")
    with pytest.raises(ModbenchError, match=r"ladder\(cpu, 9\): the cpu ladder has 6 rungs"):
        ladder_scales("ladder(cpu, 9)")
    with pytest.raises(ModbenchError, match="ladder has"):
        ladder_scales("ladder(gpu, 0)")


def write_spec(tmp_path: Path, scales: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(f"name: lad\nmethods: [qknorm]\nseeds: {{default: [0]}}\n"
                    f"scales: {scales}\n", encoding="utf-8")
    return path


def test_specs_take_a_ladder_or_a_list_with_ladders(tmp_path: Path) -> None:
    smoke = LADDERS["smoke"].rung_names()
    s = load_spec(write_spec(tmp_path, "ladder(smoke, 3)"))
    assert s.scales == smoke[:3]
    s = load_spec(write_spec(tmp_path, "[tiny, 'ladder(smoke)', smoke-top]"))
    assert s.scales == ["tiny", *smoke]  # a rung named twice is kept once
    runs = expand(s)
    assert sorted({r.scale for r in runs}) == sorted(s.scales)
    cfg = next(r.config for r in runs if r.scale == smoke[0])
    assert cfg.train.steps == PRESETS[smoke[0]].train["steps"]
    with pytest.raises(ModbenchError, match="unknown ladder"):
        load_spec(write_spec(tmp_path, "ladder(nope)"))
    with pytest.raises(ModbenchError, match="'scales' must be a list"):
        load_spec(write_spec(tmp_path, "ladder(smoke, x)"))


def test_builtin_ladder_specs() -> None:
    s = load_spec("ladder-cpu")
    assert s.scales == LADDERS["cpu-short"].rung_names()
    assert len(s.methods) >= 4 and s.seeds.default == [0, 1, 2]
    g = load_spec("ladder-gpu")
    assert g.scales[-1] == "climb-1.2b" and len(g.scales) >= 3
    assert math.isclose(tokens(g.scales[0]) / non_embedding_params(PRESETS[g.scales[0]].model),
                        tokens("climb-1.2b") / non_embedding_params(PRESETS["climb-1.2b"].model),
                        rel_tol=0.01)
