"""lm-evaluation-harness, in process: an ``LM`` adapter over a modbench model and tokenizer.

Needs the optional extra ``modbench[eval]`` (``lm_eval``). The adapter builds on the harness's
``TemplateLM`` so that context/continuation splitting is the harness's own (the same code path
``--model hf`` takes), which is what lets the in-process numbers equal those of an exported
checkpoint evaluated with ``lm_eval --model hf``.

Suites: ``climb12`` is the twelve tasks of arXiv 2605.20798 §3.4 at the harness's default few-shot
settings; ``climb_avg`` is their unweighted macro-average (per task: ``acc_norm`` where the
harness reports it, else ``acc``; LAMBADA ``acc``; TruthfulQA-MC2 ``acc``).

The trust boundary (docs/reliability.md): a local task YAML can make the harness import
Python (a ``!function`` tag, an ``include:`` of a ``.py`` file, a dataset loaded with
``trust_remote_code``), and the harness loads any YAML in the named file's folder by task
name. :func:`check_task_files` reads the named files, everything they include and every YAML
in their folders without constructing a tag, and refuses code unless the user trusts it
(``modbench eval --trust-task-code``, a study's ``evaluation.trust_task_code: true``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
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


def make_adapter(model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 8,
                 device: str | torch.device = "cpu", max_length: int | None = None) -> Any:
    """An ``lm_eval`` LM over a modbench model (``tokenizer``: a ``tokenizers.Tokenizer``)."""
    _require_lm_eval()
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class ModbenchLM(TemplateLM):  # type: ignore[misc]
        backend = "causal"

        def __init__(self) -> None:
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

    return ModbenchLM()


_TRUST_TASK_CODE = contextvars.ContextVar("modbench_trust_task_code", default=False)
_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints", ".git"}
MAX_TASK_YAMLS = 2000  # YAML files read in the task files' folders


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

    def __init__(self, tag: str) -> None:
        self.tag = tag


class _InertLoader(yaml.SafeLoader):
    """Safe YAML that turns any unknown tag into :class:`_Tagged` instead of failing."""


def _tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> _Tagged:
    return _Tagged(node.tag)


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


def _code_in(data: Any) -> str | None:
    """What in a task file's data would run Python (None: nothing)."""
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, _Tagged):
            return f"a {x.tag} tag"
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "trust_remote_code" and v not in (False, None):
                    return "trust_remote_code"
                stack += [k, v]
        elif isinstance(x, list):
            stack += x
    return None


def _includes(data: Any, path: Path) -> list[Path]:
    inc = data.get("include") if isinstance(data, dict) else None
    items = inc if isinstance(inc, list) else [] if inc is None else [inc]
    return [path.parent / str(i) if not Path(str(i)).is_absolute() else Path(str(i))
            for i in items]


def _task_yamls(folder: Path) -> Iterator[Path]:
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for n in sorted(names):
            if n.endswith((".yaml", ".yml")):
                yield Path(root) / n


def check_task_files(files: list[str], trust: bool) -> None:
    """Refuse, in one line, task files that would run Python unless ``trust``: a tag such as
    ``!function``, ``trust_remote_code``, an include of anything but a YAML file, in the
    named files, what they include (recursively) and every YAML in their folders (which the
    harness indexes and may load by name). Malformed files are refused either way."""
    todo = [Path(f) for f in files]
    todo += [y for folder in sorted({Path(f).resolve().parent for f in files})
             for y in _task_yamls(folder)]
    if len(todo) > MAX_TASK_YAMLS:
        raise ModbenchError(f"the folders of the task files hold more than {MAX_TASK_YAMLS} "
                            "YAML files; put your task files in a folder of their own")
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        real = path.resolve()
        if real in seen:
            continue
        seen.add(real)
        if not real.name.endswith((".yaml", ".yml")):
            if trust:
                continue  # the user vouches for it; the harness reads it as it will
            raise ModbenchError(f"task file {path} is included but is not YAML (it may be "
                                "code); pass --trust-task-code (a study: "
                                "evaluation.trust_task_code: true) if you trust it")
        if not real.is_file():
            raise ModbenchError(f"task file {path} does not exist (included by a task "
                                "file); fix the include: line")
        data = read_task_yaml(real)
        what = _code_in(data)
        if what is not None and not trust:
            raise ModbenchError(f"task file {path} would run Python ({what}); pass "
                                "--trust-task-code (a study: evaluation.trust_task_code: "
                                "true) only if you trust it and its folder")
        todo += _includes(data, real)


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


def run_tasks(lm: Any, names: list[str], *, limit: int | None = None,
              num_fewshot: int | None = None, trust_code: bool | None = None) -> dict[str, Any]:
    """Run harness tasks (names, suites or local YAML files) through ``lm``. Task files that
    would run Python are refused unless ``trust_code`` (None: as :func:`trusting_task_code`
    says; :func:`check_task_files`).

    Returns ``{task: {"metrics": {...}, "n": items, "items": [per-item results]}}`` plus
    ``climb_avg`` when the whole ``climb12`` suite ran.
    """
    lm_eval = _require_lm_eval()
    from lm_eval.tasks import TaskManager

    tasks, files = expand_tasks(names)
    check_task_files(files, _TRUST_TASK_CODE.get() if trust_code is None else trust_code)
    include = sorted({str(Path(f).resolve().parent) for f in files})
    # only local files named: index their folders alone, not the harness's thousands of
    # built-in task files (10-25 s a manager on the 2-core machine, 2026-11-26)
    manager = TaskManager(include_path=include or None, include_defaults=bool(tasks) or not files)
    for f in files:
        spec = read_task_yaml(Path(f))
        if not isinstance(spec, dict) or "task" not in spec:
            raise ModbenchError(f"task file {f} has no 'task:' name; add one")
        tasks.append(str(spec["task"]))
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=True,
                                  bootstrap_iters=0)
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
