"""The built-in specs for the CoMT preprint's Tables 3-5 (docs/sources.md#comt) exist, expand
(every method string parses, every preset and recipe exists) and hold the published grid."""

from __future__ import annotations

from modbench.study.spec import builtin_specs, expand, load_spec


def _grid(name: str) -> tuple[set[str], set[str]]:
    runs = expand(load_spec(name))
    return {r.method for r in runs}, {r.scale for r in runs}


def test_table3_placements_by_scale() -> None:
    assert {"comt-table3", "comt-table3-1b", "comt-table4", "comt-table5"} <= set(builtin_specs())
    methods, scales = _grid("comt-table3")
    assert methods == {"baseline", "post_ln", "deepnorm", "post_ln+comt", "mix_ln", "ln_scaling",
                       "comt"}
    assert scales == {"llama-130m", "llama-250m", "llama-350m"}
    runs = expand(load_spec("comt-table3-1b"))
    assert {r.scale for r in runs} == {"llama-1b"}
    assert all(r.config.recipe.lr == 5e-4 and r.config.recipe.name == "c4-mixln" for r in runs)


def test_table4_modules() -> None:
    methods, scales = _grid("comt-table4")
    assert methods == {"baseline", "comt", *(f"comt(modules={m})" for m in (
        "self_attention", "mlp", "only_last", "only_first", "only_qk"))}
    assert scales == {"llama-60m", "llama-130m"}


def test_table5_hidden_sizes() -> None:
    methods, _ = _grid("comt-table5")
    assert methods == {"baseline", "comt", *(f"comt(hidden={h})" for h in (4, 8, 16, 32))}
