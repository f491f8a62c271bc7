"""The method registry: one class per modification, registered by name, composable with ``+``.

A method string is ``name`` or ``name(key=value, ...)`` terms joined by ``+``, e.g.
``post_ln+qknorm`` or ``layerscale(init=1e-4)+qknorm(scope=full)``. Values are read as YAML
scalars (``1e-4``, ``true``, ``full``). ``baseline`` means no method.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, get_type_hints

import yaml
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError, suggest
from modbench.methods import plugins
from modbench.methods import registry as _registry
from modbench.model.spec import ModelSpec

CATEGORIES = ("attention", "ffn", "norm", "placement", "residual", "architecture")


class Undocumented(ModbenchError, NotImplementedError):
    """A method that does not define what was asked of it (``configure``, ``extra_params``,
    ``extra_flops``: a method from outside modbench may leave the last two out). A
    ``NotImplementedError`` to the code that goes on without it (the trainer's compile
    estimate, the conformance kit), one ``error:`` line where a command needs it."""


@dataclass
class NoOptions:
    pass


class Method:
    """Base class. Subclasses set the class attributes and override :meth:`configure`.

    - ``configure(spec, cfg)`` fills slots of the :class:`ModelSpec` (never edits the block,
      the attention core or the trainer);
    - ``edit_config(cfg)`` may change the model config before the model is built;
    - ``post_init(model)`` runs after the weights are initialised (e.g. init rescaling);
    - ``recipe_exceptions`` are recipe keys the trainer overrides for this method (recorded in
      the run's config);
    - ``callbacks()`` returns trainer callbacks (e.g. a weight renormalisation after each
      optimizer step).
    """

    name: ClassVar[str] = ""
    category: ClassVar[str] = ""
    citation: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    recipe_exceptions: ClassVar[dict[str, Any]] = {}
    # True for batch-statistic methods (PowerNorm, PRepBN): in training mode a token's output
    # depends on other positions (future ones included); shown by `modbench methods`.
    leaks_across_positions: ClassVar[bool] = False
    # False for a method whose forward cannot run vmapped over stacked seeds (it updates
    # buffers during the forward, reads a tensor's value in Python, or uses an op without a
    # vmap rule); ``stack_note`` says why. Such a method's seeds train one at a time.
    stackable: ClassVar[bool] = True
    stack_note: ClassVar[str] = ""
    # Non-empty for a method whose training forward torch.compile cannot trace as one graph:
    # why (e.g. a data-dependent host read). Shown by `modbench methods`; `modbench bench
    # --compile-check` reports its breaks as expected, and tests/model/test_compile_graphs.py
    # checks that it does break (an empty one: that it gives one graph).
    compile_graph_breaks: ClassVar[str] = ""
    # True where, with its default options, the freshly initialised model computes the
    # baseline's logits at the same seed (an identity at init: a zero gate, a unit
    # scale); the conformance kit (modbench.conformance, check "init") holds it.
    starts_as_baseline: ClassVar[bool] = False

    def __init__(self, options: Any = None) -> None:
        self.opts = options if options is not None else self.Options()

    def edit_config(self, cfg: ModelConfig) -> None:
        """Change the model config in place before building (default: nothing)."""

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        """Fill or add to the model spec's slots (every method defines it)."""
        raise Undocumented(f"method {self.name} defines no configure (the slots it fills); "
                           "define it (docs/methods.md, 'Your own method')")

    def post_init(self, model: nn.Module) -> None:
        """Adjust the freshly initialised model (default: nothing)."""

    def callbacks(self) -> list[Any]:
        return []

    def grow_state_dict(self, state: dict[str, Any], old_cfg: ModelConfig,
                        new_cfg: ModelConfig, target: dict[str, Any] | None = None,
                        ) -> dict[str, Any]:
        """Adapt model weights trained under ``old_cfg`` to this model (``train.init_from``).

        ``target`` is the new model's freshly initialised state dict. The default passes
        ``state`` through unchanged; after every method's hook the trainer requires the same
        parameter names and shapes as the new model. A method whose shapes may change (e.g.
        TokenFormer's parameter tokens) maps the old weights onto the new shapes here.
        """
        return state

    def reads_train_seq_len(self) -> bool:
        """Whether this method, with its options, reads ``cfg.trained_seq_len`` (a constant
        the source ties to the training sequence length). Where it does, a run's key and
        resume check include ``model.train_seq_len``; elsewhere that key changes nothing."""
        return False

    def extra_params(self, cfg: ModelConfig) -> int:
        """Documented parameter overhead over the baseline for this config (the formula in the
        docstring). The shared registry test checks it against the built model."""
        raise Undocumented(f"method {self.name} does not document its parameter overhead; "
                           "define its extra_params (docs/methods.md, 'Your own method')")

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        """Documented extra *forward* FLOPs per token over the baseline, at this config and
        training sequence length. Convention (arXiv 2605.20798 Appendix C, and what
        ``torch.utils.flop_counter`` counts): matrix multiplications only, 2 FLOPs per
        multiply-add, attention scores and mixing included, element-wise ops not counted.
        Training FLOPs are 3x forward."""
        raise Undocumented(f"method {self.name} does not document its FLOP overhead; "
                           "define its extra_flops (docs/methods.md, 'Your own method')")

    @property
    def label(self) -> str:
        """Canonical term: name plus the options that differ from their defaults."""
        default = self.Options()
        changed = [
            f"{f.name}={getattr(self.opts, f.name)}"
            for f in dataclasses.fields(self.opts)
            if getattr(self.opts, f.name) != getattr(default, f.name)
        ]
        return f"{self.name}({','.join(changed)})" if changed else self.name

    @classmethod
    def info(cls) -> dict[str, Any]:
        return {
            "name": cls.name,
            "category": cls.category,
            "citation": cls.citation,
            "summary": cls.summary,
            "options": {
                f.name: _default_of(f) for f in dataclasses.fields(cls.Options)
            },
            "recipe_exceptions": dict(cls.recipe_exceptions),
            "leaks_across_positions": cls.leaks_across_positions,
            "stackable": cls.stackable,
            "compile_graph_breaks": cls.compile_graph_breaks,
            "starts_as_baseline": cls.starts_as_baseline,
        }


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


#: every registered method, by name (:mod:`modbench.methods.registry`)
REGISTRY: dict[str, type[Method]] = _registry.REGISTRY


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: add a method to the registry under ``cls.name``."""
    if not cls.name or not re.fullmatch(r"[a-z][a-z0-9_]*", cls.name):
        raise ValueError(f"method name {cls.name!r} must be lower_snake_case")
    if cls.category not in CATEGORIES:
        raise ValueError(f"method {cls.name}: category must be one of {CATEGORIES}")
    existing = REGISTRY.get(cls.name)
    # an outside method taking a built-in's or another plugin's name: a one-line error
    if existing is not None and not plugins.check_registration(cls.name, cls, existing):
        raise ValueError(f"method {cls.name!r} is registered twice")
    REGISTRY[cls.name] = cls
    plugins.record_origin(cls.name, cls)  # an outside method: where from, its code's hash
    return cls


def load_all() -> dict[str, type[Method]]:
    """Import every module of ``modbench.methods`` (each registers its methods), then the
    plugins asked for outside the package: installed ``modbench.methods`` entry points and
    ``MODBENCH_METHODS_FROM`` (:mod:`modbench.methods.plugins`; a command's
    ``--methods-from`` loads its own through :func:`~modbench.methods.plugins.load_plugins`)."""
    return plugins.load_everything()


_TERM = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*(?:\((.*)\))?\s*$")


def split_top(s: str, sep: str) -> list[str]:
    """Split ``s`` on ``sep`` outside parentheses (method strings, option lists)."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def parse_methods(text: str) -> list[Method]:
    """The methods of a method string, in order (``baseline`` gives ``[]``): a new list of
    :meth:`MethodSpec.parse`'s (cached) instances."""
    return list(MethodSpec.parse(text).methods)


def _parse(text: str) -> list[Method]:
    """Parse a method string into new method instances (what :meth:`MethodSpec.parse`
    caches)."""
    registry = load_all()
    text = (text or "baseline").strip()
    if text == "baseline":
        return []
    methods: list[Method] = []
    for term in split_top(text, "+"):
        m = _TERM.match(term)
        if not m or not term.strip():
            raise ModbenchError(
                f"cannot read method term {term!r} in {text!r}; write name or name(key=value)"
                " joined by '+', e.g. post_ln+qknorm"
            )
        name, args = m.group(1), m.group(2)
        if name == "baseline":
            raise ModbenchError("'baseline' means no method and cannot be combined with others")
        if name not in registry:
            raise ModbenchError(
                f"unknown method '{name}'{suggest(name, registry)}; "
                f"run `modbench methods` to list them{plugins.unknown_method_hint(name)}"
            )
        if any(x.name == name for x in methods):
            raise ModbenchError(f"method '{name}' is listed twice in {text!r}")
        cls = registry[name]
        methods.append(cls(_parse_options(cls, args or "")))
    return methods


def _parse_options(cls: type[Method], args: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    hints = get_type_hints(cls.Options)
    values: dict[str, Any] = {}
    for item in (a for a in split_top(args, ",") if a.strip()):
        if "=" not in item:
            raise ModbenchError(
                f"method option {item.strip()!r} of '{cls.name}' must be key=value"
            )
        key, raw = (s.strip() for s in item.split("=", 1))
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise ModbenchError(
                f"unknown option '{key}' for method '{cls.name}'{suggest(key, fields)}; "
                f"its options are: {known}"
            )
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ModbenchError(f"option {key}={raw!r} of method '{cls.name}' cannot be read "
                                f"({e.__class__.__name__}); give a plain value such as 1e-4, "
                                "true or full") from None
        values[key] = _check_option(cls.name, key, value, hints[key])
    return cls.Options(**values)


def _check_option(method: str, key: str, value: Any, hint: Any) -> Any:
    # a plain class reads "float", not "<class 'float'>"; unions as written (float | None)
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    if value is None and "None" in text:
        return None
    if "float" in text and isinstance(value, int | float | str) and not isinstance(value, bool):
        try:  # YAML 1.1 reads 1e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if "int" in text and isinstance(value, int) and not isinstance(value, bool):
        return value
    if "bool" in text and isinstance(value, bool):
        return value
    if "str" in text and isinstance(value, str):
        return value
    raise ModbenchError(f"option {key}={value!r} of method '{method}' should be {text}")


def canonical(methods: Sequence[Method]) -> str:
    """The canonical method string of parsed methods (each term's :attr:`Method.label`)."""
    return "+".join(m.label for m in methods) or "baseline"


@dataclass(frozen=True)
class MethodSpec:
    """A method string parsed once: its terms as :class:`Method` instances, in order, and
    their canonical string (names, and the options that differ from their defaults).

    ``MethodSpec.parse(text)`` parses each distinct ``text`` once per process and hands back
    the same spec afterwards, so the study's planning, the trainer and the FLOP and compile
    checks share one parse; the methods in it are shared too, and like every method instance
    they are never changed after parsing (a method keeps its options and nothing else). A
    cached spec whose method names no longer map to the same registered classes (a test that
    registered a throw-away method and removed it) is parsed again.

    ``canonical`` is what a run records as ``model.method`` (``plan_run``); a study's run key
    hashes the config with the method string as the spec wrote it
    (:func:`modbench.study.spec.config_key`), so existing stores keep their keys.
    """

    text: str
    methods: tuple[Method, ...]
    canonical: str

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """The spec of ``text`` (``baseline`` or empty: no method). Raises
        :class:`~modbench.errors.ModbenchError` for an unknown method, option or term."""
        spec = _SPECS.get(text)
        if spec is None or any(REGISTRY.get(m.name) is not type(m) for m in spec.methods):
            methods = tuple(_parse(text))
            spec = cls(text, methods, canonical(methods))
            if len(_SPECS) >= _MAX_SPECS:
                _SPECS.clear()
            _SPECS[text] = spec
        return spec

    @property
    def names(self) -> tuple[str, ...]:
        """The methods' registered names, in order (``()`` for the baseline)."""
        return tuple(m.name for m in self.methods)


#: the parsed specs of this process, by text (:meth:`MethodSpec.parse`); cleared when it
#: would exceed ``_MAX_SPECS`` entries (a study names tens of method strings)
_SPECS: dict[str, MethodSpec] = {}
_MAX_SPECS = 4096


def method_spec(cfg: ModelConfig) -> MethodSpec:
    """The parsed spec of ``cfg.method`` (:meth:`MethodSpec.parse`: parsed once per text)."""
    return MethodSpec.parse(cfg.method)


def collect_recipe_exceptions(methods: list[Method]) -> dict[str, Any]:
    """Union of the methods' recipe exceptions; two methods disagreeing is an error."""
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for m in methods:
        for k, v in m.recipe_exceptions.items():
            if k in out and out[k] != v:
                raise ModbenchError(
                    f"methods '{owner[k]}' and '{m.name}' need different recipe.{k} "
                    f"({out[k]!r} vs {v!r}); they cannot be combined"
                )
            out[k], owner[k] = v, m.name
    return out


def option_choice(method: str, key: str, value: str, choices: tuple[str, ...]) -> str:
    """Validate a string option against its allowed values."""
    if value not in choices:
        raise ModbenchError(
            f"option {key}={value!r} of method '{method}' must be one of: {', '.join(choices)}"
        )
    return value

