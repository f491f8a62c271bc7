"""The slot table: the code's `SLOTS` (model/spec.py), the factory Protocols, the table in
docs/architecture.md and what the methods really fill agree; a wrongly shaped factory is
refused when it is filled; the built model's `parts` index names its components."""

from __future__ import annotations

import copy
import functools
import inspect
import re
from pathlib import Path

import pytest
from torch import nn

from modbench.config import ModelConfig, resolve
from modbench.errors import ModbenchError
from modbench.methods import load_all
from modbench.methods.build import Plan, build_model, plan
from modbench.model.spec import (
    ADDITIVE_SLOTS,
    EXCLUSIVE_SLOTS,
    LINEAR_ROLES,
    NORM_SITES,
    SLOTS,
    ModelSpec,
    parts_of,
)
from modbench.model.transformer import baseline_spec

DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
METHODS = sorted(load_all())


def render(protocol: type) -> str:
    """``(name: annotation, ...) -> return`` of a Protocol's ``__call__``, without ``self``."""
    sig = inspect.signature(protocol.__call__)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    args = ", ".join(f"{p.name}: {p.annotation}" for p in params)
    return f"({args}) -> {sig.return_annotation}"


def docs_table() -> list[list[str]]:
    """The rows (cells) of the table in the ``## Slots`` section of docs/architecture.md."""
    text = DOCS.read_text()
    section = text.split("\n## Slots\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header, rule, *rows = lines
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "slot", "meaning", "factory signature", "baseline", "filled by"]
    assert set(rule) <= set("|-")
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]


def unquote(cell: str) -> str:
    assert cell.startswith("`") and cell.endswith("`") and cell.count("`") == 2, cell
    return cell[1:-1]


def method_plan(name: str) -> Plan:
    return plan(resolve("tiny", method=name).model)


@functools.cache
def fillers() -> dict[str, set[str]]:
    """Slot -> the registered methods that fill it, each configured alone (default options)."""
    out: dict[str, set[str]] = {s: set() for s in SLOTS}
    for name in METHODS:
        spec = method_plan(name).spec
        for slot, f in spec.fills.items():
            if f.owner != "baseline":
                out[slot].add(name)
        for slot, items in spec.additive.items():
            out[slot].update(name for _, _ in items)
    return out


# ------------------------------------------------------------------ the table


def test_slot_names_derive_from_the_table() -> None:
    assert tuple(SLOTS) == EXCLUSIVE_SLOTS + ADDITIVE_SLOTS
    assert all(SLOTS[s].additive for s in ADDITIVE_SLOTS)
    assert not any(SLOTS[s].additive for s in EXCLUSIVE_SLOTS)
    assert set(ModelSpec().additive) == set(ADDITIVE_SLOTS)


@pytest.mark.parametrize("slot", list(SLOTS))
def test_factory_protocols_are_positional_only(slot: str) -> None:
    info = SLOTS[slot]
    params = list(inspect.signature(info.protocol.__call__).parameters.values())
    assert params[0].name == "self"
    assert params[1:] and all(p.kind is p.POSITIONAL_ONLY for p in params[1:])
    assert info.arity == len(params) - 1
    assert info.signature == render(info.protocol)


def test_docs_table_matches_the_code() -> None:
    rows = docs_table()
    assert all(len(r) == 5 for r in rows), rows
    names = []
    for slot_cell, meaning, signature, baseline, _ in rows:
        m = re.fullmatch(r"`([a-z_.]+)`( \(additive\))?", slot_cell)
        assert m, slot_cell
        name = m.group(1)
        names.append(name)
        info = SLOTS.get(name)
        assert info is not None, f"docs list slot {name!r}, which spec.SLOTS does not have"
        assert bool(m.group(2)) == info.additive, name
        assert meaning == info.meaning, name
        assert unquote(signature) == render(info.protocol), name
        assert baseline == info.baseline, name
    assert names == list(SLOTS)


def test_docs_name_the_methods_that_fill_each_slot() -> None:
    """The "filled by" column names (in backticks) exactly the methods that fill the slot."""
    registry = load_all()
    actual = fillers()
    for row in docs_table():
        name = unquote(row[0].split(" ")[0])
        named = set(re.findall(r"`([^`]+)`", row[4]))
        assert named <= set(registry), f"{name}: not methods: {sorted(named - set(registry))}"
        assert named == actual[name], (
            f"{name}: docs name {sorted(named)}, the methods filling it are "
            f"{sorted(actual[name])}")


def test_baseline_fills_the_non_optional_exclusive_slots() -> None:
    spec = baseline_spec()
    expected = {s for s in EXCLUSIVE_SLOTS if not SLOTS[s].optional}
    assert set(spec.fills) == expected
    assert {spec.owner(s) for s in spec.fills} == {"baseline"}
    for s, info in SLOTS.items():
        assert info.optional == info.baseline.startswith("unfilled"), s


# ------------------------------------------------------------------ every method's fills


@pytest.mark.parametrize("name", METHODS)
def test_every_fill_binds_its_slot_arguments(name: str) -> None:
    spec = method_plan(name).spec
    fills = [(s, f.value) for s, f in spec.fills.items()]
    fills += [(s, v) for s, items in spec.additive.items() for _, v in items]
    for slot, value in fills:
        placeholders = [None] * SLOTS[slot].arity
        try:
            inspect.signature(value).bind(*placeholders)
        except TypeError as e:  # pragma: no cover - the message is the point
            pytest.fail(f"{name}: the {slot} factory {value!r} does not take "
                        f"{SLOTS[slot].signature}: {e}")


@pytest.mark.parametrize("name", ["baseline", *METHODS])
def test_parts_index_names_every_built_component(name: str) -> None:
    p = method_plan(name)
    model = p.build(seed=0)
    cfg, parts, n = p.cfg, model.parts, p.cfg.n_layers
    assert parts is parts_of(model)
    built = {id(m) for m in model.modules()}
    for i in range(n):
        for site in NORM_SITES[1:-1]:
            assert id(parts.norm(site, i)) in built, (site, i)
        for role in ("q", "k", "v", "o"):
            assert id(parts.linear(role, i)) in built, (role, i)
    assert id(parts.norm("embed", -1)) in built and id(parts.norm("final", n)) in built
    assert parts.has_linear("head", n) is (not cfg.tie_embeddings)
    for role in LINEAR_ROLES:
        assert all(id(m) in built for m in parts.linears(role).values())
    # a plain attribute: no module, parameter or state-dict key of its own
    assert not isinstance(parts, nn.Module)
    assert all(not k.startswith("parts") for k in model.state_dict())
    assert all(not k.startswith("parts") for k, _ in model.named_modules())


# ------------------------------------------------------------------ fill-time checks


def test_wrongly_shaped_factory_is_refused_at_fill() -> None:
    spec = baseline_spec()
    kernel = spec.get("attn.kernel")

    def kernel_without_layer(cfg: ModelConfig) -> nn.Module:
        return nn.Identity()

    # (a type checker refuses these fills too: no overload of fill/add matches)
    with pytest.raises(ValueError) as err:
        spec.fill("attn.kernel", kernel_without_layer, by="oops")  # type: ignore[call-overload]
    msg = str(err.value)
    assert "\n" not in msg
    assert "attn.kernel" in msg and "'oops'" in msg and "kernel_without_layer" in msg
    assert SLOTS["attn.kernel"].signature in msg  # (cfg: ModelConfig, layer: int) -> nn.Module
    assert spec.get("attn.kernel") is kernel  # the spec is unchanged

    with pytest.raises(ValueError, match=r"the ffn slot takes a factory called as \(cfg"):
        spec.fill("ffn", lambda cfg, layer: nn.Identity(), by="oops")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="not callable"):
        spec.fill("norm", 3, by="oops")  # type: ignore[call-overload]
    def norm_wrapper(module: nn.Module, site: str, layer: int, cfg: ModelConfig) -> nn.Module:
        return module

    with pytest.raises(ValueError, match="linear_wrappers"):
        spec.add("linear_wrappers", norm_wrapper, by="oops")  # type: ignore[call-overload]
    assert spec.wrappers("linear_wrappers") == []

    def needs_keyword(cfg: ModelConfig, layer: int, *, width: int) -> nn.Module:
        return nn.Identity()

    with pytest.raises(ValueError, match=r"attn\.q_norm"):
        spec.fill("attn.q_norm", needs_keyword, by="oops")  # type: ignore[call-overload]


def test_rightly_shaped_factories_of_any_form_are_accepted() -> None:
    spec = baseline_spec()

    class Callable3:
        def __call__(self, c: ModelConfig, layer: int, sub: str, extra: int = 0) -> nn.Module:
            return nn.Identity()

    spec.fill("merge", Callable3(), by="a")  # a callable object, an optional extra argument
    spec.fill("attn.kernel", lambda *args: nn.Identity(), by="b")  # *args
    spec.fill("ffn.act", lambda cfg, layer: nn.GELU(), by="c")
    assert spec.describe()["merge"] == "a"


def test_unknown_slots_and_conflicts_keep_their_messages() -> None:
    spec = baseline_spec()
    with pytest.raises(ValueError, match=r"unknown slot 'norm_wrappers' \(use add\(\)"):
        spec.fill("norm_wrappers", lambda *a: None, by="x")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="unknown additive slot 'norm'"):
        spec.add("norm", lambda *a: None, by="x")  # type: ignore[call-overload]
    spec.fill("ffn.act", lambda cfg, layer: nn.GELU(), by="one")
    msg = ("methods 'one' and 'two' both set the ffn.act slot differently; they cannot be "
           "combined, pick one")
    with pytest.raises(ModbenchError, match=re.escape(msg)):
        spec.fill("ffn.act", lambda cfg, layer: nn.ReLU(), by="two")


# ------------------------------------------------------------------ the parts index


def small(method: str = "baseline", **kw: object) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=40,
                max_seq_len=16, method=method, tie_embeddings=False)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def test_parts_return_the_modules_as_built() -> None:
    model = build_model(small(), seed=0)
    parts = model.parts
    for i, block in enumerate(model.blocks):
        core_a, core_f = block.attn.core, block.ffn.core
        assert parts.linear("q", i) is core_a.q_proj and parts.linear("o", i) is core_a.o_proj
        assert parts.linear("gate", i) is core_f.gate_proj
        assert parts.linear("down", i) is core_f.down_proj
        assert parts.norm("attn.pre", i) is block.attn.pre_norm
        assert parts.norm("ffn.residual", i) is block.ffn.residual_norm
        assert isinstance(parts.norm("attn.post", i), nn.Identity)
    assert parts.norm("embed", -1) is model.embed_norm
    assert parts.norm("final", 3) is model.final_norm
    assert parts.linear("head", 3) is model.head
    assert list(parts.linears("up")) == [0, 1, 2]
    assert list(parts.norms("ffn.pre")) == [0, 1, 2]
    with pytest.raises(KeyError, match="no 'gate' linear layer in layer 7"):
        parts.linear("gate", 7)
    with pytest.raises(ValueError, match="unknown linear role 'w_v'"):
        parts.has_linear("w_v", 0)
    with pytest.raises(ValueError, match="unknown norm site 'pre'"):
        parts.norm("pre", 0)


def test_parts_include_the_wrappers() -> None:
    model = build_model(small("comt+ln_scaling"), seed=0)
    up = model.parts.linear("up", 1)
    assert up is model.blocks[1].ffn.core.up_proj and isinstance(up.inner, nn.Linear)
    pre = model.parts.norm("ffn.pre", 2)
    assert pre is model.blocks[2].ffn.pre_norm and hasattr(pre, "scale")


def test_parts_leave_parameters_and_state_dict_alone() -> None:
    """The same modules in the same order as a model built without the index: state-dict
    keys and parameter order match the registration order of the submodules."""
    model = build_model(small("relu2"), seed=0)
    names = [k for k, _ in model.named_parameters()]
    assert names[:2] == ["embed.weight", "blocks.0.attn.pre_norm.weight"]
    assert list(model.state_dict()) == names  # no buffers persisted, nothing from `parts`
    assert "parts" in vars(model) and "parts" not in model._modules


def test_parts_follow_a_deep_copy() -> None:
    model = build_model(small(), seed=0)
    twin = copy.deepcopy(model)
    assert twin.parts is not model.parts
    assert twin.parts.linear("v", 2) is twin.blocks[2].attn.core.v_proj
    assert twin.parts.norm("final", 3) is twin.final_norm
