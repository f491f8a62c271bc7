"""lm-evaluation-harness, in process: an ``LM`` adapter over a modbench model and tokenizer.

Needs the optional extra ``modbench[eval]`` (``lm_eval``). The adapter builds on the harness's
``TemplateLM`` so that context/continuation splitting is the harness's own (the same code path
``--model hf`` takes), which is what lets the in-process numbers equal those of an exported
checkpoint evaluated with ``lm_eval --model hf``.

Suites: ``climb12`` is the twelve tasks of seeds/002_* §3.4 at the harness's default few-shot
settings; ``climb_avg`` is their unweighted macro-average (per task: ``acc_norm`` where the
harness reports it, else ``acc``; LAMBADA ``acc``; TruthfulQA-MC2 ``acc``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

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
              num_fewshot: int | None = None) -> dict[str, Any]:
    """Run harness tasks (names, suites or local YAML files) through ``lm``.

    Returns ``{task: {"metrics": {...}, "n": items, "items": [per-item results]}}`` plus
    ``climb_avg`` when the whole ``climb12`` suite ran.
    """
    lm_eval = _require_lm_eval()
    from lm_eval.tasks import TaskManager

    tasks, files = expand_tasks(names)
    include = sorted({str(Path(f).resolve().parent) for f in files})
    manager = TaskManager(include_path=include or None)
    for f in files:
        import yaml

        spec = yaml.safe_load(Path(f).read_text()) or {}
        if "task" not in spec:
            raise ModbenchError(f"task file {f} has no 'task:' name")
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
