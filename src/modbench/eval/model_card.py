"""The model card (``README.md``) of an exported run: what was trained, how, on what, and
what the study it belongs to concluded about its method.

The study is found from the run folder's place: a study keeps its runs in
``DIR/runs/<key>/`` next to ``DIR/spec.yaml``, so a run folder there belongs to study ``DIR``.
Its verdict is read from the study's report (``DIR/report/results.csv`` gives the run's scale
and method, ``DIR/report/results.json`` the verdict of that method at that scale), as
``modbench study report`` last wrote it; without a report the card says so. A run trained
outside a study gets no verdict: one run says nothing about whether its method helps.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import yaml

from modbench.config import RunConfig
from modbench.eval.hf_bundle import flat_name


def study_of(run: Path) -> Path | None:
    """The study folder ``run`` belongs to (``DIR/runs/<key>``), or None."""
    run = run.resolve()
    study = run.parent.parent
    if run.parent.name == "runs" and (study / "spec.yaml").is_file():
        return study
    return None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return tree if isinstance(tree, dict) else {}


def study_verdict(run: Path) -> dict[str, Any] | None:
    """What the study of ``run`` (if any) says about the run's method: ``study``, ``folder``,
    ``claim`` (the spec's, or None) and, when the study's report covers the run, ``scale``,
    ``method``, ``verdict`` and the comparison's numbers (``result``); ``note`` says why
    a verdict is missing."""
    study = study_of(run)
    if study is None:
        return None
    spec = _read_yaml(study / "spec.yaml")
    out: dict[str, Any] = {"study": spec.get("name") or study.name, "folder": str(study),
                           "claim": spec.get("claim") or None,
                           "baseline": spec.get("baseline") or "baseline",
                           "primary": (spec.get("evaluation") or {}).get("primary")}
    report = study / "report"
    try:
        with (report / "results.csv").open(newline="", encoding="utf-8") as f:
            row = next((r for r in csv.DictReader(f) if r.get("key") == run.resolve().name),
                       None)
        results = json.loads((report / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        out["note"] = (f"the study's report has not been written; `modbench study report "
                       f"{study}` writes it")
        return out
    if row is None:
        out["note"] = (f"the study's report predates this run; `modbench study report {study}` "
                       "brings it up to date")
        return out
    out["scale"], out["method"] = row["scale"], row["method"]
    found = [r for r in results.get(row["scale"], []) if r.get("method") == row["method"]]
    if not found:
        out["note"] = (f"the report has no comparison for {row['method']} at {row['scale']} "
                       "(no finished baseline run at that scale?)")
        return out
    out["result"] = found[0]
    out["verdict"] = found[0].get("verdict")
    return out


def _num(v: Any, digits: int = 4) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.{digits}g}" if abs(v) < 1e-3 or abs(v) >= 1e5 else f"{v:.{digits}f}"
    return "n/a" if v is None else str(v)


def _study_section(info: dict[str, Any] | None, method: str) -> list[str]:
    lines = ["## Study verdict", ""]
    if info is None:
        return [*lines, "This run is not part of a study. One training run says nothing about "
                "whether its method helps; a modbench study (`modbench study run`) compares "
                "it with the baseline over several seeds against the baseline's noise floor.",
                ""]
    lines.append(f"This run belongs to the study **{info['study']}** (`{info['folder']}`).")
    claim = info.get("claim")
    if isinstance(claim, dict) and claim.get("text"):
        src = f" ({claim['source']})" if claim.get("source") else ""
        lines += ["", f"The claim it tests{src}: {' '.join(str(claim['text']).split())}"]
    if "verdict" not in info:
        return [*lines, "", f"No verdict yet: {info['note']}.", ""]
    r = info["result"]
    metric = info.get("primary") or "the study's primary metric"
    lines += ["", f"Verdict for `{info['method']}` at scale `{info['scale']}`: "
              f"**{info['verdict']}**."]
    if not r.get("is_baseline"):
        floor = r.get("floor") or {}
        holm = (r.get("p_adjusted") or {}).get("holm")
        lines += [
            "",
            "| | |", "|---|---|",
            f"| metric | {metric} |",
            f"| seeds (method / baseline) | {r.get('n')} / {floor.get('n', 'n/a')} |",
            f"| mean | {_num(r.get('mean'))} (baseline {_num(floor.get('mean'))}) |",
            f"| Δ against the baseline | {_num(r.get('delta'))} (noise floor σ "
            f"{_num(floor.get('sigma'))}) |",
            f"| test, Holm-corrected p | {r.get('test')}, {_num(holm, 3)} |",
        ]
    expect = (claim or {}).get("expect", {}) if isinstance(claim, dict) else {}
    if isinstance(expect, dict) and info["method"] in expect:
        wanted = list(expect[info["method"]])
        agrees = "agrees with" if info["verdict"] in wanted else "does not agree with"
        lines += ["", f"The claim predicts {' or '.join(map(str, wanted))}; the verdict "
                  f"{agrees} it."]
    lines += ["", f"The full report: `{info['folder']}/report/report.md`."]
    if method != info["method"]:
        lines += ["", f"(The study names the method `{info['method']}`; this model's "
                  f"canonical method string is `{method}`.)"]
    return [*lines, ""]


def _origin_text(rec: dict[str, Any]) -> str:
    """Where a method came from, for the card: built in, or its plugin, module and code
    hash (the files the hash covers)."""
    if rec.get("origin") == "builtin":
        return "built into modbench"
    src = f"methods plugin `{rec['plugin']}`" if rec.get("plugin") else "outside modbench"
    files = ", ".join(f"`{f}`" for f in sorted(rec.get("files") or {}))
    return (f"{src}, module `{rec.get('module')}`"
            + (f", code sha256 `{rec['sha256']}` (over {files})" if rec.get("sha256") else "")
            + f"; bundled in this folder as `{flat_name(str(rec.get('module')))}.py`, with "
            "the modules of its package that it imports")


def _front(cfg: RunConfig, run: Path, step: int, methods: list[Any], plugins: bool) -> list[str]:
    """The Hub's YAML header (library, pipeline, tags), the title and what the folder is."""
    method = cfg.model.method or "baseline"
    tags = ["modbench", "custom_code", *sorted({x.name for x in methods} or {"baseline"})]
    return ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:",
            *[f"- {x}" for x in tags], "---", "",
            f"# modbench `{method}` on `{cfg.preset}`, seed {cfg.seed}", "",
            f"A decoder trained by modbench under one frozen recipe, "
            f"exported from the run folder `{run}` at step {step:,}. The folder carries "
            "modbench's own model code (`modbench_*.py`)"
            + (" and the code of the methods plugins it uses (`plugin_*.py`)" if plugins
               else "")
            + ", so it loads with torch and transformers alone, and gives modbench's "
            "logits.", ""]


def _method_section(methods: list[Any], origins: dict[str, dict[str, Any]] | None) -> list[str]:
    """Each method, its category, summary and citation, and where it came from."""
    lines = ["## Method", ""]
    if not methods:
        lines.append("`baseline`: the shared Llama-2-style decoder (RMSNorm, RoPE, GQA, "
                     "SwiGLU, pre-norm), with no modification.")
    for x in methods:
        label = getattr(x, "label", x.name)
        lines.append(f"- `{label}` ({x.category}): {' '.join(str(x.summary).split())}"
                     + (f" — {x.citation}" if x.citation else ""))
        if origins is not None and x.name in origins:
            lines.append(f"  - origin: {_origin_text(origins[x.name])}")
    return lines


def _setup_sections(cfg: RunConfig, params: int, meta: dict[str, Any]) -> list[str]:
    """The model's shape, the training recipe and the data."""
    m, r, t, d = cfg.model, cfg.recipe, cfg.train, cfg.data
    return [
        "", "## Model", "",
        f"Preset `{cfg.preset}`: {m.n_layers} layers, width {m.d_model}, {m.n_heads} heads "
        f"({m.n_kv_heads} key/value), FFN {m.d_ff}, vocabulary {m.vocab_size:,}, context "
        f"{m.max_seq_len} tokens, {'tied' if m.tie_embeddings else 'untied'} embeddings; "
        f"{params:,} parameters.", "",
        "## Recipe", "",
        f"`{r.name}`: {r.optimizer} (lr {r.lr:g}, betas {tuple(r.betas)}, eps {r.eps:g}, "
        f"weight decay {r.weight_decay:g}), gradient clip {r.grad_clip:g}, {r.schedule} "
        f"schedule to {r.min_lr_ratio:g}× lr after "
        + (f"{r.warmup_steps} warm-up steps" if r.warmup_steps is not None
           else f"{r.warmup_frac:g} of the steps as warm-up")
        + f"; batch {t.batch_size} × {t.seq_len} tokens; precision {r.precision}."
        + (f" Recipe exceptions the method declares: {cfg.recipe_exceptions}."
           if cfg.recipe_exceptions else ""), "",
        "## Data", "",
        f"Source `{d.source}`" + (" (modbench's built-in English corpus from Python's "
                                   "documentation)" if d.source == "builtin" else "")
        + f", data seed {d.data_seed} (the batch order), fingerprint "
          f"`{(meta.get('data') or {}).get('fingerprint', 'n/a')}`"
        + (f", probe rows mixed in: {d.probe_mix:g}" if d.probe_mix else "") + ".", "",
    ]


def _training_section(cfg: RunConfig, step: int, summary: dict[str, Any] | None,
                      meta: dict[str, Any], exported_with: dict[str, Any]) -> list[str]:
    """How far training went, its losses and the code that trained and exported it."""
    code = meta.get("code") or {}
    s = summary or {}
    status = s.get("status", "unfinished (no summary.json: the checkpoint of an interrupted "
                             "run)")
    return [
        "## Training", "",
        "| | |", "|---|---|",
        f"| status | {status} |",
        f"| steps | {s.get('steps', step):,} of {s.get('steps_planned', cfg.train.steps):,} |",
        f"| tokens | {s['tokens']:,} |" if isinstance(s.get("tokens"), int) else "| tokens | n/a |",
        f"| seeds | init {cfg.seed}, data {cfg.data.data_seed} |",
        f"| validation loss | {_num(s.get('initial_val_loss'))} → "
        f"{_num(s.get('final_val_loss'))} |",
        f"| trained with | modbench {code.get('modbench', 'n/a')} "
        f"(git {str(code.get('git_commit') or 'n/a')[:12]}), torch {code.get('torch', 'n/a')} |",
        f"| exported with | modbench {exported_with.get('modbench')} "
        f"(git {str(exported_with.get('git_commit') or 'n/a')[:12]}) |",
        "",
    ]


def _use_section(load_as: str, plugins: bool, max_seq_len: int, dtype: str) -> list[str]:
    """How to load it with transformers, what trusting its code means, and evaluating it."""
    return [
        "## Use", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"model = AutoModelForCausalLM.from_pretrained({load_as!r}, trust_remote_code=True)",
        f"tokenizer = AutoTokenizer.from_pretrained({load_as!r}, trust_remote_code=True)",
        "ids = tokenizer(\"Return the number of items in a\", return_tensors=\"pt\").input_ids",
        "logits = model(ids).logits",
        "```", "",
        "`trust_remote_code=True` runs the code in this folder (`modeling_modbench.py` and "
        "the `modbench_*.py`" + (" and `plugin_*.py`" if plugins else "")
        + " files it imports); read it first. The tokenizer needs no remote "
        "code: `PreTrainedTokenizerFast.from_pretrained(...)` loads it without the flag "
        "(transformers 5's `AutoTokenizer` reads the model's config first, which is remote "
        "code, hence the flag there too).", "",
        f"The model attends over at most {max_seq_len} tokens and keeps no key/value cache "
        f"(`generate` recomputes the whole sequence each step). Weights are {dtype}.", "",
        "Evaluate with lm-evaluation-harness: `lm_eval --model hf --model_args "
        f"pretrained={load_as},trust_remote_code=True --tasks ...`.", "",
    ]


def model_card(cfg: RunConfig, *, run: Path, step: int, summary: dict[str, Any] | None,
               meta: dict[str, Any], methods: list[Any], params: int, load_as: str,
               exported_with: dict[str, Any], study: dict[str, Any] | None,
               dtype: str = "float32", origins: dict[str, dict[str, Any]] | None = None,
               ) -> str:
    """The README.md of an export (markdown with the Hub's YAML header). ``origins``: where
    each method came from (:func:`modbench.methods.plugins.origin`), stated under it."""
    plugins = any(o.get("origin") != "builtin" for o in (origins or {}).values())
    lines = [
        *_front(cfg, run, step, methods, plugins),
        *_method_section(methods, origins),
        *_setup_sections(cfg, params, meta),
        *_training_section(cfg, step, summary, meta, exported_with),
        *_study_section(study, cfg.model.method or "baseline"),
        *_use_section(load_as, plugins, cfg.model.max_seq_len, dtype),
    ]
    return "\n".join(lines)
