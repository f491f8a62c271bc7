"""lm-evaluation-harness, in process: an ``LM`` adapter over a modbench model and tokenizer.

Needs the optional extra ``modbench[eval]`` (``lm_eval``). The adapter builds on the harness's
``TemplateLM`` so that context/continuation splitting is the harness's own (the same code path
``--model hf`` takes), which is what lets the in-process numbers equal those of an exported
checkpoint evaluated with ``lm_eval --model hf``.

Suites: ``climb12`` is the twelve tasks of arXiv 2605.20798 §3.4 at the harness's default few-shot
settings; ``climb_avg`` is their unweighted macro-average (per task: ``acc_norm`` where the
harness reports it, else ``acc``; LAMBADA ``acc``; TruthfulQA-MC2 ``acc``).

The trust boundary (docs/reliability.md): a local task YAML can make the harness run code
(a ``!function`` tag, a Jinja template reaching Python attributes, a metric that lm-eval
hands to ``evaluate.load``, a dataset loading script, ...), and the harness loads any YAML in
the named file's folder by task name. :func:`check_task_files` reads the named files,
everything they include and every YAML in their folders without constructing a tag, and
refuses each such route unless the user trusts it (``modbench eval --trust-task-code``, a
study's ``evaluation.trust_task_code: true``); untrusted, :func:`run_tasks` also renders the
templates in Jinja's sandbox. :func:`check_tasks` does that and checks every task name before
``modbench eval`` loads a model.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import importlib.util
import math
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from modbench.config import yaml_nodes
from modbench.errors import ModbenchError

SUITES: dict[str, list[str]] = {
    "climb12": [
        "piqa", "arc_challenge", "arc_easy", "hellaswag", "winogrande", "social_iqa", "mmlu",
        "openbookqa", "boolq", "race", "lambada_openai", "truthfulqa_mc2",
    ],
}
PRIMARY_METRICS = ("acc_norm,none", "acc,none", "exact_match,none", "word_perplexity,none")


def _require_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError as e:
        raise ModbenchError(
            "lm-evaluation-harness is not installed; install it with "
            "`pip install 'modbench[eval]'`"
        ) from e
    return lm_eval


class _AdapterMethods:
    """The ``lm_eval`` LM methods over a modbench model and a ``tokenizers.Tokenizer``;
    :func:`make_adapter` puts them on lm-eval's ``TemplateLM`` (imported only there, lm-eval
    being optional)."""

    backend = "causal"
    cache_hook: Any  # set by lm-eval's LM.__init__

    def __init__(self, model: torch.nn.Module, tokenizer: Any, batch_size: int,
                 device: str | torch.device, max_length: int | None) -> None:
        super().__init__()
        self.model = model.to(device).eval()
        self.tok = tokenizer
        self.batch_size = batch_size
        self._device = torch.device(device)
        self.max_length = max_length or model.cfg.max_seq_len
        self._eot = tokenizer.token_to_id("<|endoftext|>")
        if self._eot is None:
            self._eot = 0

    @property
    def eot_token_id(self) -> int:
        return int(self._eot)

    @property
    def prefix_token_id(self) -> int:
        return int(self._eot)

    @property
    def tokenizer_name(self) -> str:
        return "modbench"

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        return list(self.tok.encode(string).ids)

    def tok_decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Log-softmax over the vocabulary for each (unpadded) row, in float32."""
        out: list[torch.Tensor] = []
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i: i + self.batch_size]
            width = max(len(r) for r in chunk)
            x = torch.full((len(chunk), width), self.eot_token_id, dtype=torch.long)
            for j, r in enumerate(chunk):
                x[j, : len(r)] = torch.tensor(r)  # right padding: causal, harmless
            logp = F.log_softmax(self.model(x.to(self._device)).float(), dim=-1).cpu()
            out += [logp[j, : len(r)] for j, r in enumerate(chunk)]
        return out

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        rows, spans = [], []
        for _, ctx, cont in requests:
            whole = (ctx + cont)[-(self.max_length + 1):]
            inp = whole[:-1]
            rows.append(inp)
            spans.append((len(inp) - len(cont), cont))
        results = []
        for logp, (start, cont) in zip(self._logprobs(rows), spans, strict=True):
            sl = logp[start: start + len(cont)]
            target = torch.tensor(cont)
            total = float(sl.gather(-1, target[:, None]).sum())
            greedy = bool((sl.argmax(-1) == target).all())
            results.append((total, greedy))
            self.cache_hook.add_partial("loglikelihood", None, (total, greedy))
        return results

    def loglikelihood_rolling(self, requests: list[Any],
                              disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for (string,) in [r.args for r in requests]:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            reqs = [(None, ctx, cont) for ctx, cont in windows]
            out.append(sum(ll for ll, _ in self._loglikelihood_tokens(reqs)))
        return out

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        outs = []
        for context, gen_kwargs in [r.args for r in requests]:
            until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", 256))
            ids = self.tok_encode(context)
            new: list[int] = []
            text = ""
            for _ in range(max_new):
                x = torch.tensor([(ids + new)[-self.max_length:]], device=self._device)
                nxt = int(self.model(x)[0, -1].argmax())
                if nxt == self.eot_token_id:
                    break
                new.append(nxt)
                text = self.tok_decode(new)
                if any(u in text for u in until):
                    break
            for u in until:
                text = text.split(u)[0]
            outs.append(text)
        return outs


def make_adapter(model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 8,
                 device: str | torch.device = "cpu", max_length: int | None = None) -> Any:
    """An ``lm_eval`` LM over a modbench model (``tokenizer``: a ``tokenizers.Tokenizer``)."""
    _require_lm_eval()
    from lm_eval.api.model import TemplateLM

    class ModbenchLM(_AdapterMethods, TemplateLM):  # type: ignore[misc]
        pass

    return ModbenchLM(model, tokenizer, batch_size, device, max_length)


_TRUST_TASK_CODE = contextvars.ContextVar("modbench_trust_task_code", default=False)
_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints", ".git"}
MAX_TASK_YAMLS = 2000  # YAML files read in the task files' folders
TRUST_HINT = ("pass --trust-task-code (a study: evaluation.trust_task_code: true) only if you "
              "trust it and its folder")

# What a task file may hold without --trust-task-code (docs/reliability.md, the trust
# boundary). lm-eval renders these fields as Jinja templates (lm_eval.utils.apply_template, an
# unsandboxed environment) when they are not the name of a document field.
TEMPLATED_FIELDS = frozenset({
    "doc_to_text", "doc_to_target", "doc_to_choice", "doc_to_image", "doc_to_audio",
    "gen_prefix", "description", "doc_to_decontamination_query"})
# Fields whose only values besides null are Python (a !function in lm-eval's loader).
CODE_FIELDS = ("process_docs", "process_results", "custom_dataset", "class")
# Methods a template may call on a document's values (str, list and dict methods that read),
# and the helpers it may call: Jinja's own globals and its loop / macro callables.
TEMPLATE_METHODS = frozenset({
    "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "replace", "lower", "upper",
    "title", "capitalize", "casefold", "swapcase", "startswith", "endswith", "join", "index",
    "rindex", "find", "rfind", "count", "partition", "rpartition", "center", "ljust", "rjust",
    "zfill", "removeprefix", "removesuffix", "expandtabs", "isdigit", "isalpha", "isalnum",
    "isspace", "isupper", "islower", "isnumeric", "isdecimal", "istitle", "keys", "values",
    "items", "get", "cycle", "changed"})
TEMPLATE_HELPERS = frozenset({"range", "dict", "namespace", "lipsum", "cycler", "joiner",
                              "loop", "caller", "super"})
# Jinja filters that look up attributes or other filters by a name given as an argument.
_NAMING_FILTERS = frozenset({"map", "select", "reject", "selectattr", "rejectattr", "sort",
                             "groupby", "unique", "min", "max", "sum"})
# lm-eval 0.4.13's registries, for when lm_eval is not importable (a spec checked where it is
# not installed): metrics, filters, prompt categories
_FALLBACK_NAMES = (
    frozenset({"acc", "acc_all", "acc_bytes", "acc_mutual_info", "acc_norm", "bits_per_byte",
               "bleu", "brier_score", "bypass", "byte_perplexity", "chrf", "chrf++",
               "exact_match", "f1", "likelihood", "mcc", "perplexity", "ter",
               "word_perplexity"}),
    frozenset({"custom", "format_span", "lowercase", "majority_vote", "map",
               "multi_choice_regex", "regex", "regex_pos", "remove_whitespace", "take_first",
               "take_first_k", "uppercase"}),
    frozenset({"qa-basic"}))


@contextlib.contextmanager
def trusting_task_code(trust: bool) -> Iterator[None]:
    """Within this block, :func:`run_tasks` lets task files run Python when ``trust``."""
    token = _TRUST_TASK_CODE.set(bool(trust))
    try:
        yield
    finally:
        _TRUST_TASK_CODE.reset(token)


class _Tagged:
    """A value under a tag the harness would act on (``!function``, a Python tag)."""

    def __init__(self, tag: str, value: str | None) -> None:
        self.tag = tag
        self.value = value

    def __repr__(self) -> str:
        return f"{self.tag} {self.value}" if self.value else self.tag


class _InertLoader(yaml.SafeLoader):
    """Safe YAML that turns any unknown tag into :class:`_Tagged` instead of failing."""


def _tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> _Tagged:
    value = node.value if isinstance(node, yaml.ScalarNode) else None
    return _Tagged(node.tag, value if isinstance(value, str) else None)


_InertLoader.add_multi_constructor("!", _tagged)
_InertLoader.add_multi_constructor("tag:", _tagged)


def read_task_yaml(path: Path) -> Any:
    """A task YAML as data, its tags inert (one-line errors for unreadable or bad YAML)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModbenchError(f"cannot read task file {path} ({e}); pass a readable YAML "
                            "file") from None
    try:
        loader = _InertLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None and yaml_nodes(node, 100_001) > 100_000:
                raise ModbenchError(f"task file {path} is too large once its aliases are "
                                    "expanded; write it without nested aliases")
            return loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ModbenchError(f"task file {path} is not valid YAML{line}: "
                            f"{getattr(e, 'problem', None) or e}; fix the file") from None


@functools.cache
def _installed_tasks() -> Path | None:
    """lm-eval's own task folder (installed code, like lm-eval itself), if it is installed."""
    try:
        spec = importlib.util.find_spec("lm_eval")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return (Path(spec.origin).parent / "tasks").resolve()


def _is_installed(real: Path) -> bool:
    root = _installed_tasks()
    return root is not None and real.is_relative_to(root)


def _installed_function(tag: _Tagged, real: Path) -> bool:
    """A ``!function`` of an installed lm-eval task file naming a module beside it (lm-eval
    imports that module first: installed code)."""
    if tag.tag != "!function" or not tag.value or not _is_installed(real):
        return False
    module = tag.value.rpartition(".")[0]
    if not module:
        return False
    py = (real.parent / (module.replace(".", "/") + ".py")).resolve()
    if py.is_file():  # lm-eval's first choice: a module file beside the task file
        return _is_installed(py)
    root = _installed_tasks()  # else an importable module: lm-eval's own, by its full name
    if root is None or not module.startswith("lm_eval."):
        return False
    py = (root.parent.parent / (module.replace(".", "/") + ".py")).resolve()
    return _is_installed(py) and py.is_file()


@functools.cache
def _lm_eval_names() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """The metric, filter and prompt-category names of the installed lm-eval's registries."""
    try:
        import lm_eval.api.metrics  # noqa: F401  (registers the metrics)
        import lm_eval.api.registry as reg
        import lm_eval.filters as filters
        from lm_eval.prompts import PROMPT_REGISTRY

        metrics = getattr(reg, "metric_registry", None) or reg.METRIC_REGISTRY
        found = (getattr(reg, "filter_registry", None) or getattr(reg, "FILTER_REGISTRY", None)
                 or filters.FILTER_REGISTRY)
        return frozenset(metrics), frozenset(found), frozenset(PROMPT_REGISTRY)
    except (ImportError, AttributeError):
        return _FALLBACK_NAMES


def _code_in(data: Any, real: Path) -> str | None:
    """A tag or ``trust_remote_code`` anywhere in a task file's data (None: none). Tags act
    wherever they are (lm-eval's loader imports a ``!function`` as it reads the file); a
    ``!function`` of an installed lm-eval task file is installed code."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        x, key = stack.pop()
        if isinstance(x, _Tagged):
            if _installed_function(x, real):
                continue
            return f"{key + ': ' if key else ''}a {x!r} tag"
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "trust_remote_code" and v not in (False, None):
                    return "trust_remote_code"
                stack += [(k, key), (v, str(k))]
        elif isinstance(x, list):
            stack += [(v, key) for v in x]
    return None


@functools.cache
def _template_env() -> Any:
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(loader=BaseLoader(), undefined=StrictUndefined,
                                        keep_trailing_newline=True)
    env.filters["regex_replace"] = _regex_replace
    return env


def _regex_replace(string: str, pattern: str, repl: str, count: int = 0) -> str:
    """lm-eval's own template filter (lm_eval.utils.regex_replace)."""
    import re

    return re.sub(pattern, repl, string, count=count)


def template_problem(source: str) -> str | None:
    """What in a Jinja template reaches beyond the document (None: nothing). A template may
    read the document's fields and their items and attributes (no name starting with ``_``),
    call the plain methods of :data:`TEMPLATE_METHODS`, Jinja's helpers and its own macros,
    and use Jinja's filters and tests and lm-eval's ``regex_replace`` (not ``attr``, nor a
    computed attribute or filter name); it may not load another template."""
    if not any(m in source for m in ("{{", "{%", "{#")):
        return None  # plain text or a field name
    from jinja2 import TemplateSyntaxError, nodes

    env = _template_env()
    try:
        tree = env.parse(source)
    except TemplateSyntaxError as e:
        return f"is not a valid Jinja template (line {e.lineno}: {e.message})"
    macros = {m.name for m in tree.find_all(nodes.Macro)}
    filters = set(env.filters) - {"attr"}
    reach = []  # first, as it says most: what a template reaches
    for node in tree.find_all(nodes.Getattr | nodes.NSRef | nodes.Getitem):
        name = node.arg.value if isinstance(node, nodes.Getitem) and isinstance(
            node.arg, nodes.Const) else getattr(node, "attr", None)
        if isinstance(name, str) and name.startswith("_"):
            reach.append((source.find(name), name, node.lineno))
    if reach:
        _, name, line = min(reach)
        return f"reaches the attribute {name!r} at line {line}"
    for node in tree.find_all(nodes.Node):
        at = f" at line {node.lineno}"
        if isinstance(node, nodes.Call):
            f = node.node
            if isinstance(f, nodes.Name) and (f.name in TEMPLATE_HELPERS or f.name in macros):
                continue
            if isinstance(f, nodes.Getattr) and f.attr in TEMPLATE_METHODS:
                continue
            what = (f"{f.name}()" if isinstance(f, nodes.Name) else
                    f".{f.attr}()" if isinstance(f, nodes.Getattr) else "a computed callable")
            return f"calls {what}{at}"
        if isinstance(node, nodes.Filter):
            if node.name not in filters:
                return f"uses the filter {node.name!r}{at}"
            if node.name in _NAMING_FILTERS:
                for arg in [*node.args, *(k.value for k in node.kwargs)]:
                    if not isinstance(arg, nodes.Const):
                        return f"gives the filter {node.name!r} a computed name{at}"
                    v = arg.value
                    if isinstance(v, str) and any(p.startswith("_") for p in v.split(".")):
                        return f"reaches the attribute {v!r}{at}"
                    if (node.name == "map" and arg is (node.args or [None])[0]
                            and isinstance(v, str) and v not in filters):
                        return f"maps the filter {v!r}{at}"
        if isinstance(node, nodes.Test) and node.name not in env.tests:
            return f"uses the test {node.name!r}{at}"
        if isinstance(node, nodes.Include | nodes.Import | nodes.FromImport | nodes.Extends):
            return f"loads another template{at}"
    return None


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _metric_problem(config: dict[str, Any]) -> str | None:
    """A metric of ``config`` that lm-eval would hand to ``evaluate.load`` (which imports the
    script of a local folder, or fetches one from the Hub): any name not in lm-eval's own
    registry, or ``hf_evaluate: true``. Unless ``process_results`` scores the task, where
    lm-eval looks no metric up."""
    metrics = config.get("metric_list")
    if config.get("process_results") is not None or not isinstance(metrics, list):
        return None
    known = _lm_eval_names()[0]
    for m in metrics:
        if not isinstance(m, dict) or isinstance(m.get("metric"), _Tagged):
            continue  # lm-eval's own error / a tag, refused as such
        name = m.get("metric")
        if m.get("hf_evaluate") is True:
            return f"metric_list: the metric {name!r} is loaded with evaluate.load " \
                   "(hf_evaluate: true), which runs its script"
        if name not in known:
            return (f"metric_list: {name!r} is not one of lm-eval's metrics, so lm-eval "
                    "would hand it to evaluate.load, which runs the script of a local folder "
                    "or of the Hub")
    return None


def _dataset_problem(value: str, real: Path) -> str | None:
    if not value:
        return None
    if value.endswith(".py"):
        return f"dataset_path {value!r} is a dataset loading script"
    for base in (Path.cwd(), real.parent):
        try:
            p = (base / Path(value).expanduser())
            if p.is_dir() and any(p.glob("*.py")):
                return f"dataset_path {value!r} is a folder holding a loading script"
        except OSError:
            continue
    return None


def _field_problem(d: dict[str, Any], real: Path, top: bool) -> str | None:
    """What a task config ``d`` (a file's top level, a fewshot_config, an inline task of a
    group) would run besides lm-eval's own code (None: nothing)."""
    _, known_filters, prompts = _lm_eval_names()
    installed = _is_installed(real)
    for k in CODE_FIELDS:
        v = d.get(k)
        if v is not None and not isinstance(v, _Tagged):  # tags: _code_in
            return f"{k}: {v!r} names Python"
    for k in sorted(TEMPLATED_FIELDS & {str(x) for x in d}):
        for s in _strings(d[k]):
            problem = template_problem(s)
            if problem is not None:
                return f"the template {k} {problem}"
    if not top:  # a file's own metrics are judged with what it includes (_merged)
        problem = _metric_problem(d)
        if problem is not None:
            return problem
    for f in d.get("filter_list") or [] if isinstance(d.get("filter_list"), list) else []:
        steps = f.get("filter") if isinstance(f, dict) else None
        for step in steps if isinstance(steps, list) else []:
            fn = step.get("function") if isinstance(step, dict) else None
            if isinstance(fn, str) and fn not in known_filters and not installed:
                return (f"filter_list: {fn!r} is not one of lm-eval's filters "
                        f"({', '.join(sorted(known_filters))})")
    prompt = d.get("use_prompt")
    if isinstance(prompt, str) and prompt.split(":")[0] not in prompts:
        return (f"use_prompt {prompt!r} takes its templates from outside the task file, "
                "unchecked")
    if d.get("unsafe_code") not in (None, False):
        return "unsafe_code: the task runs code the model writes"
    path = d.get("dataset_path")
    if isinstance(path, str):
        return _dataset_problem(path, real)
    return None


def _config_problem(data: Any, real: Path) -> str | None:
    """The first field problem (:func:`_field_problem`) of any dict of the file but its
    ``metadata`` (free-form)."""
    stack: list[tuple[Any, bool]] = [(data, True)]
    while stack:
        x, top = stack.pop()
        if isinstance(x, dict):
            problem = _field_problem(x, real, top)
            if problem is not None:
                return problem
            stack += [(v, False) for k, v in reversed(list(x.items())) if k != "metadata"]
        elif isinstance(x, list):
            stack += [(v, False) for v in reversed(x)]
    return None


def _includes(data: Any, path: Path) -> list[Path]:
    inc = data.get("include") if isinstance(data, dict) else None
    items = inc if isinstance(inc, list) else [] if inc is None else [inc]
    return [path.parent / str(i) if not Path(str(i)).is_absolute() else Path(str(i))
            for i in items]


def _merged(real: Path, read: dict[Path, Any], seen: frozenset[Path] = frozenset()) -> Any:
    """A task file's data with what it includes, as lm-eval merges them (included first, the
    file's own keys win), from the files already read."""
    data = read.get(real)
    if not isinstance(data, dict) or "include" not in data or real in seen:
        return data
    out: dict[str, Any] = {}
    for inc in _includes(data, real):
        part = _merged(inc.resolve(), read, seen | {real})
        if isinstance(part, dict):
            out.update({k: v for k, v in part.items() if k != "task_list"})
    out.update({k: v for k, v in data.items() if k != "include"})
    return out


def _task_yamls(folder: Path) -> Iterator[Path]:
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for n in sorted(names):
            if n.endswith((".yaml", ".yml")):
                yield Path(root) / n


def check_task_files(files: list[str], trust: bool) -> None:
    """Refuse, in one line, task files that would run code unless ``trust``: a tag such as
    ``!function``, ``trust_remote_code``, an include of anything but a YAML file, a template
    that reaches beyond the document (:func:`template_problem`), a metric lm-eval would load
    with ``evaluate.load``, a filter outside lm-eval's registry, ``process_docs`` /
    ``process_results`` / ``custom_dataset`` / ``class``, a prompt from another file,
    ``unsafe_code``, a dataset loading script; in the named files, what they include
    (recursively) and every YAML in their folders (which the harness indexes and may load by
    name). Installed lm-eval task files may name Python beside them (installed code).
    Malformed files are refused either way."""
    todo = [Path(f) for f in files]
    todo += [y for folder in sorted({Path(f).resolve().parent for f in files})
             for y in _task_yamls(folder)]
    if len(todo) > MAX_TASK_YAMLS:
        raise ModbenchError(f"the folders of the task files hold more than {MAX_TASK_YAMLS} "
                            "YAML files; put your task files in a folder of their own")
    read: dict[Path, Any] = {}
    shown: dict[Path, Path] = {}  # real path: the path as the user wrote it
    while todo:
        path = todo.pop()
        real = path.resolve()
        if real in read:
            continue
        if not real.name.endswith((".yaml", ".yml")) and not _is_installed(real):
            if trust:
                read[real] = None
                continue  # the user vouches for it; the harness reads it as it will
            raise ModbenchError(f"task file {path} is included but is not YAML (it may be "
                                f"code); {TRUST_HINT}")
        if not real.is_file():
            raise ModbenchError(f"task file {path} does not exist (included by a task "
                                "file); fix the include: line")
        data = read[real] = read_task_yaml(real)
        shown[real] = path
        if not trust:
            what = _code_in(data, real) or _config_problem(data, real)
            if what is not None:
                raise ModbenchError(f"task file {path} would run code ({what}); {TRUST_HINT}")
        todo += _includes(data, real)
    if trust:
        return
    for real in sorted(shown):
        what = _metric_problem(m) if isinstance(m := _merged(real, read), dict) else None
        if what is not None:
            raise ModbenchError(f"task file {shown[real]} would run code ({what}); "
                                f"{TRUST_HINT}")


def task_file_name(path: str) -> str:
    """The name lm-eval registers a task file under (its group, else its task)."""
    spec = _merged(Path(path).resolve(), _read_with_includes(Path(path)))
    name = spec.get("group") or spec.get("task") if isinstance(spec, dict) else None
    if not isinstance(name, str) or not name:
        raise ModbenchError(f"task file {path} has no 'task:' name; add one")
    return name


def _read_with_includes(path: Path) -> dict[Path, Any]:
    read: dict[Path, Any] = {}
    todo = [path.resolve()]
    while todo:
        real = todo.pop().resolve()
        if real in read or not real.name.endswith((".yaml", ".yml")) or not real.is_file():
            continue
        read[real] = read_task_yaml(real)
        todo += _includes(read[real], real)
    return read


def expand_tasks(names: list[str]) -> tuple[list[str], list[str]]:
    """Split ``--tasks`` values into harness task names and YAML files (suites expanded)."""
    tasks, files = [], []
    for n in names:
        if n in SUITES:
            tasks += SUITES[n]
        elif n.endswith((".yaml", ".yml")):
            p = Path(n)
            if not p.is_file():
                raise ModbenchError(f"task file {p} does not exist")
            files.append(str(p))
        else:
            tasks.append(n)
    return tasks, files


def primary_metric(metrics: dict[str, Any]) -> tuple[str | None, float | None]:
    for key in PRIMARY_METRICS:
        v = metrics.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return key.split(",")[0], float(v)
    return None, None


_PREPARED: dict[tuple[tuple[str, ...], bool], Any] = {}  # check_tasks' manager, for run_tasks
_DEFAULT_MANAGER: dict[Any, Any] = {}  # TaskManager class: its manager of lm-eval's tasks


def _manager_key(tasks: list[str], files: list[str]) -> tuple[tuple[str, ...], bool]:
    include = tuple(sorted({str(Path(f).resolve().parent) for f in files}))
    # only local files named: index their folders alone, not the harness's thousands of
    # built-in task files (10-25 s a manager on the 2-core machine, 2026-11-26)
    return include, bool(tasks) or not files


def _make_manager(key: tuple[tuple[str, ...], bool]) -> Any:
    """A task manager indexing ``key``'s folders (and lm-eval's own tasks if ``key[1]``). One
    of lm-eval's own tasks alone is kept for the process: its index depends only on the
    installed lm-eval, and a study evaluating run after run would rebuild it each time."""
    from lm_eval.tasks import TaskManager

    include, defaults = key
    cached = _DEFAULT_MANAGER.get(TaskManager)
    if key == ((), True) and cached is not None:
        return cached
    manager = TaskManager(include_path=list(include) or None, include_defaults=defaults)
    if key == ((), True):
        _DEFAULT_MANAGER.clear()
        _DEFAULT_MANAGER[TaskManager] = manager
    return manager


def check_task_names(tasks: list[str], files: list[str], manager: Any) -> list[str]:
    """The names lm-eval is to load (``tasks``, then the task files' own), each one it knows;
    refuses in one line a name it does not know, with the closest names it does. lm-eval
    reads a name it does not know as the path of a task file: refused here too."""
    known = set(manager.all_tasks)
    out = list(tasks)
    for f in files:
        name = task_file_name(f)
        if name not in known:
            raise ModbenchError(f"task file {f} (task {name!r}) is not indexed by lm-eval, "
                                "which reads the task files ending in .yaml in its folder; "
                                "rename it to end in .yaml")
        out.append(name)
    for n in tasks:
        if n in known:
            continue
        p = Path(n)
        if p.is_dir():
            found = sorted(str(y) for y in p.glob("*.yaml"))
            more = f" (e.g. {', '.join(found[:3])})" if found else ""
            raise ModbenchError(f"--tasks {n} is a folder, not a task; name a task or one of "
                                f"its task YAML files{more}" if found else
                                f"--tasks {n} is a folder that holds no task YAML file; name "
                                "a task or a task YAML file")
        if p.exists():
            raise ModbenchError(f"--tasks {n} is a file but not a task file (those end in "
                                ".yaml); rename it, or name a task")
        close = difflib.get_close_matches(n, sorted(known), n=3)
        hint = (f"close names: {', '.join(close)}" if close else
                "name an lm-evaluation-harness task, group or tag, a suite (climb12) or a task "
                "YAML file")
        raise ModbenchError(f"unknown task {n!r} (not an lm-evaluation-harness task, group or "
                            f"tag); {hint}")
    return out


def check_tasks(names: list[str], trust: bool) -> None:
    """All that ``modbench eval --tasks`` can check before it loads a model: the task files
    (:func:`check_task_files`) and every name (:func:`check_task_names`). The task manager
    built for it is handed on to the next :func:`run_tasks` of the same tasks."""
    if not names:
        return
    tasks, files = expand_tasks(names)
    check_task_files(files, trust)
    _require_lm_eval()
    key = _manager_key(tasks, files)
    manager = _make_manager(key)
    check_task_names(tasks, files, manager)
    _PREPARED.clear()
    _PREPARED[key] = manager


def _quiet_git_hash() -> str | None:
    """lm-eval's record of the working folder's git commit (lm_eval.loggers.utils.
    get_git_commit_hash), without git's "fatal: not a git repository" on stderr."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True,
                              timeout=30, check=False)
        if done.returncode == 0:
            return done.stdout.decode(errors="replace").strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from lm_eval.loggers.utils import get_commit_from_path
    except ImportError:
        return None
    return get_commit_from_path(os.getcwd())  # type: ignore[no-any-return]


@contextlib.contextmanager
def _harness_guards(trust: bool) -> Iterator[None]:
    """Around lm-eval's run: git's complaint outside a repository silenced; unless ``trust``,
    task templates rendered in Jinja's sandbox (a template that passed
    :func:`template_problem` and reaches an attribute through a computed name still stops)
    and, with ``datasets`` before 4, no dataset loading script run."""
    import lm_eval.evaluator
    import lm_eval.utils

    saved: list[tuple[Any, str, Any]] = []

    def swap(obj: Any, name: str, value: Any) -> None:
        if hasattr(obj, name):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

    swap(lm_eval.evaluator, "get_git_commit_hash", _quiet_git_hash)
    if not trust:
        from jinja2 import BaseLoader, StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(loader=BaseLoader(), undefined=StrictUndefined,
                                            keep_trailing_newline=True)
        real = getattr(lm_eval.utils, "env", None)
        env.filters.update({k: v for k, v in getattr(real, "filters", {}).items()
                            if k not in env.filters})
        swap(lm_eval.utils, "env", env)
        with contextlib.suppress(ImportError):
            import datasets.config

            swap(datasets.config, "HF_DATASETS_TRUST_REMOTE_CODE", False)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def run_tasks(lm: Any, names: list[str], *, limit: int | None = None,
              num_fewshot: int | None = None, trust_code: bool | None = None) -> dict[str, Any]:
    """Run harness tasks (names, suites or local YAML files) through ``lm``. Task files that
    would run Python are refused unless ``trust_code`` (None: as :func:`trusting_task_code`
    says; :func:`check_task_files`).

    Returns ``{task: {"metrics": {...}, "n": items, "items": [per-item results]}}`` plus
    ``climb_avg`` when the whole ``climb12`` suite ran.
    """
    lm_eval = _require_lm_eval()
    from jinja2.exceptions import SecurityError

    trust = _TRUST_TASK_CODE.get() if trust_code is None else trust_code
    tasks, files = expand_tasks(names)
    check_task_files(files, trust)
    key = _manager_key(tasks, files)
    manager = _PREPARED.pop(key, None) or _make_manager(key)
    tasks = check_task_names(tasks, files, manager)
    try:
        with _harness_guards(trust):
            res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager,
                                          limit=limit, num_fewshot=num_fewshot,
                                          log_samples=True, bootstrap_iters=0)
    except SecurityError as e:
        raise ModbenchError(f"a task template reached beyond the document as it was rendered "
                            f"({e}); {TRUST_HINT}") from None
    out: dict[str, Any] = {}
    for task, metrics in res["results"].items():
        clean = {k: v for k, v in metrics.items() if k != "alias" and not (
            isinstance(v, float) and math.isnan(v)) and v != "N/A"}
        samples = res.get("samples", {}).get(task, [])
        items = [{"doc_id": s.get("doc_id"),
                  **{k.split(",")[0]: s[k.split(",")[0]] for k in clean
                     if k.split(",")[0] in s and isinstance(s[k.split(",")[0]], int | float)}}
                 for s in samples]
        name, value = primary_metric(clean)
        out[task] = {"metrics": clean, "primary": name, "score": value, "n": len(samples),
                     "items": items}
    climb = SUITES["climb12"]
    if all(t in out and out[t]["score"] is not None for t in climb):
        out["climb_avg"] = sum(out[t]["score"] for t in climb) / len(climb)
    return out
