"""``modbench methods new`` (modbench.conformance.scaffold): each slot's template, as written,
is a method the conformance kit passes in full (loaded as a plugin by the test file written
beside it, which is what runs here), and bad requests are refused in one line with nothing
written."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from modbench.conformance.scaffold import SCAFFOLD_SLOTS, write_method
from modbench.errors import ModbenchError
from modbench.methods import plugins
from modbench.methods.base import REGISTRY
from tests.helpers import plugins_restored

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def no_plugins_after(tmp_path: Path) -> Iterator[None]:
    """No plugin left loaded after the test (tests.helpers.plugins_restored)."""
    with plugins_restored(tmp_path):
        yield


@pytest.mark.parametrize("slot", sorted(SCAFFOLD_SLOTS))
def test_the_template_passes_the_kit(slot: str, tmp_path: Path, no_plugins_after: None) -> None:
    """The written test file, run as pytest would run it: it loads the method file as a plugin
    and asserts that every check of the kit passes (compile and export included)."""
    name = "zz_" + slot.replace(".", "_")
    method_file, test_file = write_method(name, slot, tmp_path / "lab")
    assert (method_file.name, test_file.name) == (f"{name}.py", f"test_{name}.py")
    spec = importlib.util.spec_from_file_location(f"test_{name}", test_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, f"test_{name}_conforms")()  # raises with the kit's table on a failure
    cls = REGISTRY[name]
    assert cls.starts_as_baseline and plugins.origin(name)["origin"] == "plugin"
    # it fills what the slot says
    from modbench.conformance.kit import slot_uses
    from modbench.methods.base import MethodSpec
    from tests.helpers import tiny

    (use,) = slot_uses(list(MethodSpec.parse(name).methods), tiny().model)
    assert set(use.exclusive) == set(SCAFFOLD_SLOTS[slot][0])


def test_refusals_write_nothing(tmp_path: Path) -> None:
    out = tmp_path / "lab"
    for name, slot, message in (
            ("MyGate", "merge", "must be lower_snake_case"),
            ("1gate", "merge", "must be lower_snake_case"),
            ("class", "merge", "not a Python keyword"),
            ("qknorm", "merge", "'qknorm' is a built-in method"),
            ("my_gate", "kernel", "unknown slot 'kernel' for a new method; the slots are: "
                                  "attn.qk (attention: per-head")):
        with pytest.raises(ModbenchError, match=message.replace("(", r"\(")) as e:
            write_method(name, slot, out)
        assert "\n" not in str(e.value)
    assert not out.exists()
    out.mkdir()
    (out / "test_my_gate.py").write_text("# mine\n")
    with pytest.raises(ModbenchError, match=r"test_my_gate.py exists; choose another"):
        write_method("my_gate", "merge", out)
    assert sorted(p.name for p in out.iterdir()) == ["test_my_gate.py"]
    assert (out / "test_my_gate.py").read_text() == "# mine\n"
    for slot in SCAFFOLD_SLOTS:  # every slot is named in the refusal
        with pytest.raises(ModbenchError, match=f"{slot} "):
            write_method("my_gate", "nope", out)
