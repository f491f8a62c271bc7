"""``modbench remove-norm`` on a Hugging Face GPT-2 folder (the 2024 and 2025 papers' models).

The GPT-2 source of :mod:`modbench.remove_norm` (its core: :mod:`modbench.remove_norm.core`):
the folder is loaded with ``GPT2LMHeadModel.from_pretrained`` (transformers, in the ``eval``
extra), each block's ``ln_2`` and the final ``ln_f`` become
:class:`~modbench.remove_norm.core.FakeNorm`, and ``ln_1`` is split into a query/key and a
value path as in the 2025 code: ``ln_1`` passes the stream through
and ``attn.c_attn`` applies the norm's query/key path to the columns that make q and k and its
value path to the columns that make v.

Data: ``--data DIR``, a dataset prepared with ``modbench data prepare`` whose token ids fit the
model's vocabulary; without it, the built-in corpus re-tokenised with the tokenizer saved in the
GPT-2 folder (``tokenizer.json``, or the vocab/merges files transformers converts), cached like
the built-in dataset. Validation: the first ``--val-sequences`` (default 64) rows of its
validation split.

Export (:func:`export_folded`): the fine-tuned model is written back as a plain GPT-2 folder.
Each frozen norm is ``(x - mean x) * a + b`` with ``a = g / sigma``. For ``ln_1`` and ``ln_2``,
``diag(a)`` and ``b`` are folded into the weights and biases of ``c_attn`` (its q/k columns with
the query/key path's ``a``, its v columns with the value path's) and ``c_fc``, and the norm
keeps only the centering; ``ln_f`` (whose output meets the tied embedding matrix, so nothing
can absorb it) keeps ``a`` and ``b`` as its own gain and bias. A Hugging Face LayerNorm cannot
drop its statistic, so the folder sets ``layer_norm_epsilon = 1e12`` and scales the gains by
``sqrt(1e12)``: ``(x - mean x) / sqrt(var(x) + 1e12) * 1e6 = (x - mean x) (1 + var/1e12)^-1/2``,
the centering to float32 rounding for any stream variance below about 1e5 (the trick of the
2025 code's "LN-free transformers model"). The export is reloaded and its validation loss
reported next to the fine-tuned model's.

Diagnostics of GPT-2 (a subset of ``modbench diagnose``, whose hooks need a modbench decoder):
validation loss; per block the residual stream's RMS, variance, max |x| and excess kurtosis at
its input, the angular distance between its input and output and its gradient norm; the same
stream figures before ``ln_f``; condition number and power-law alpha of every weight matrix;
the loss under 4-bit round-to-nearest per-channel weight quantization of the blocks' matrices.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modbench.errors import ModbenchError
from modbench.model.head import cross_entropy_sum, next_token_targets
from modbench.remove_norm.core import (
    DIAGNOSTICS_DIR,
    REPORT,
    FakeNorm,
    FineTuneResult,
    FineTuneSettings,
    NormHolder,
    Outcome,
    Site,
    Task,
    TokenContext,
    fake_from,
    fake_norms,
    finetune,
    finite_before,
    norm_free_check,
    run_report,
    schedule,
    staged_output,
    track_tokens,
    write_json,
)
from modbench.runtime.loss import lm_loss

EXPORT_EPS = 1e12
DEFAULT_VAL_SEQUENCES = 64
DEFAULT_SEQ_LEN = 128
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "special_tokens_map.json")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ModbenchError("remove-norm on a GPT-2 folder needs transformers; install "
                            "`pip install 'modbench[eval]'`") from e
    return transformers


class LogitsOf(nn.Module):
    """A Hugging Face causal LM as ``idx -> logits`` (what modbench's losses take)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, idx: torch.Tensor, *, loss: bool = False) -> torch.Tensor:
        """Logits, or with ``loss`` their summed next-token cross-entropy (as a modbench
        model's ``forward(idx, loss=True)``, which validation takes)."""
        logits = self.hf(input_ids=idx, use_cache=False).logits
        if not loss:
            return logits
        return cross_entropy_sum(nn.Identity(), logits, next_token_targets(idx),
                                 logits.shape[-1], chunk_bytes=logits.numel() * 4)


class SplitQKV(nn.Module):
    """GPT-2's ``c_attn`` (a Conv1D, ``x W + c`` with ``W`` of shape (d, 3d)) on two views of
    the input: the norm's query/key path for the q and k columns, its value path for v."""

    def __init__(self, conv: nn.Module, norm: FakeNorm) -> None:
        super().__init__()
        self.conv = conv
        object.__setattr__(self, "norm_ref", norm)  # owned by the ln_1 NormHolder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, c = self.conv.weight, self.conv.bias
        d2 = 2 * x.shape[-1]
        qk = self.norm_ref(x, path=0) @ w[:, :d2] + c[:d2]
        v = self.norm_ref(x, path=1, record=True) @ w[:, d2:] + c[d2:]
        return torch.cat([qk, v], dim=-1)


def _refuse_custom_code(folder: Path) -> None:
    """A config.json that asks transformers to run the folder's Python (``auto_map``) is
    refused in one line: remove-norm takes plain GPT-2 folders (docs/reliability.md)."""
    try:
        tree = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # AutoConfig's own one-line refusal follows
    if isinstance(tree, dict) and tree.get("auto_map"):
        raise ModbenchError(f"{folder}/config.json asks to run the folder's own Python code "
                            "(auto_map); remove-norm never runs a folder's code and takes plain "
                            "GPT-2 folders (model_type gpt2) or modbench runs")


def load_gpt2(folder: Path) -> nn.Module:
    """``GPT2LMHeadModel`` from a local folder, refused with a reason if it is not one."""
    transformers = _transformers()
    _refuse_custom_code(folder)
    try:  # never a folder's own code: transformers would prompt to run it (auto_map)
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True,
                                                         trust_remote_code=False)
    except Exception as e:
        raise ModbenchError(f"{folder}/config.json cannot be read as a Hugging Face config "
                            f"({type(e).__name__}); pass a GPT-2 folder saved with "
                            "save_pretrained") from e
    if getattr(config, "model_type", None) != "gpt2":
        raise ModbenchError(f"{folder} holds a '{getattr(config, 'model_type', '?')}' model; "
                            "remove-norm takes GPT-2 folders (model_type gpt2) or modbench runs")
    if getattr(config, "add_cross_attention", False):
        raise ModbenchError(f"{folder} is a GPT-2 with cross-attention; remove-norm takes "
                            "decoder-only GPT-2 models")
    try:
        model = transformers.GPT2LMHeadModel.from_pretrained(str(folder), local_files_only=True,
                                                             trust_remote_code=False)
    except Exception as e:
        raise ModbenchError(f"the GPT-2 weights in {folder} cannot be loaded "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); check the "
                            "folder's model.safetensors / pytorch_model.bin") from e
    return model.float()


def convert_gpt2(hf: nn.Module, tokens: TokenContext) -> list[Site]:
    """Replace GPT-2's LayerNorms by live fake norms (in place; same function), ``ln_1`` split
    into query/key and value paths. The sites in schedule order."""
    blocks = hf.transformer.h
    n_layers = len(blocks)
    sites: list[Site] = []
    for i, block in enumerate(blocks):
        ln1 = fake_from(block.ln_1, tokens, paths=2)
        block.ln_1 = NormHolder(ln1)
        block.attn.c_attn = SplitQKV(block.attn.c_attn, ln1)
        ln2 = fake_from(block.ln_2, tokens)
        block.ln_2 = ln2
        name = f"transformer.h.{i}"
        sites += [Site(f"{name}.ln_1", ln1, 0, "attn_qk", i),
                  Site(f"{name}.ln_1", ln1, 1, "attn_v", i),
                  Site(f"{name}.ln_2", ln2, 0, "ffn", i)]
    lnf = fake_from(hf.transformer.ln_f, tokens)
    hf.transformer.ln_f = lnf
    sites.append(Site("transformer.ln_f", lnf, 0, "final", n_layers))
    order = {"ffn": 0, "attn_qk": 1, "attn_v": 2, "final": 3}
    sites.sort(key=lambda s: (order[s.stage], s.layer, s.path))
    return sites


# ------------------------------------------------------------------------------- data


def gpt2_data(folder: Path, data: str | None, seq_len: int | None, vocab: int,
              n_positions: int, progress: bool) -> Any:
    """The token dataset to fine-tune and validate on (module docstring), checked against the
    model's vocabulary and context."""
    from modbench.data import (
        PrepareSettings,
        builtin_corpus_fingerprint,
        builtin_documents,
        cache_dir,
        load_tokenizer,
        open_dataset,
        prepare_dataset,
        tokenizer_sha256,
    )
    from modbench.data.corpus import BUILTIN_VAL_FRACTION

    if data is not None:
        if seq_len is not None:
            raise ModbenchError("--seq-len applies to the re-tokenised built-in corpus; data "
                                "from --data keeps the rows it was prepared with")
        path = Path(data)
        if not path.exists():
            raise ModbenchError(f"--data {path} does not exist; prepare it with `modbench data "
                                f"prepare --tokenizer {folder}`")
        ds = open_dataset(path)
    else:
        has_tok = any((folder / f).is_file() for f in ("tokenizer.json", "vocab.json",
                                                        "tokenizer_config.json"))
        if not has_tok:
            raise ModbenchError(f"{folder} has no tokenizer to re-tokenise the built-in corpus "
                                "with; pass --data DIR (prepared with `modbench data prepare "
                                f"--tokenizer {folder}`) or save the tokenizer in the folder")
        tok = load_tokenizer(str(folder))
        seq = seq_len if seq_len is not None else min(DEFAULT_SEQ_LEN, n_positions)
        if seq < 2:
            raise ModbenchError(f"--seq-len must be at least 2, got {seq}")
        path = (cache_dir() / "data" / f"remove-norm-{tokenizer_sha256(tok)[:12]}-s{seq}-"
                f"{builtin_corpus_fingerprint()[:10]}")
        if not (path / "metadata.json").is_file():
            prepare_dataset(
                builtin_documents(), tok, path,
                PrepareSettings(seq_len=seq, val_fraction=BUILTIN_VAL_FRACTION, progress=progress),
            )
        ds = open_dataset(path)
    if ds.vocab_size > vocab:
        raise ModbenchError(f"the data in {path} has token ids up to {ds.vocab_size - 1} but the "
                            f"GPT-2 model has {vocab} embeddings; prepare the data with the "
                            "model's own tokenizer")
    if ds.seq_len > n_positions:
        raise ModbenchError(f"the data in {path} has rows of {ds.seq_len} tokens but the model's "
                            f"context is {n_positions}; prepare shorter rows (--seq-len)")
    for split in ("train", "val"):
        ds.require_rows(split)
    return ds


# ------------------------------------------------------------------------ diagnostics


class _BlockFigures:
    """Per block, over the batches: the residual stream at its input (pooled moments), the
    angular distance between its input and its output, its gradient norm; and the stream
    entering ``ln_f``."""

    def __init__(self, n: int) -> None:
        from modbench.eval.diagnostics import Moments

        self.n = n
        self.streams = [Moments() for _ in range(n)]
        self.final = Moments()
        self.ang = [[0.0, 0] for _ in range(n)]
        self.grads: list[list[float]] = [[] for _ in range(n)]

    def add(self, blocks: list[nn.Module], seen: dict[int, torch.Tensor]) -> None:
        """One batch, after its backward pass; ``seen[i]``: the input of block ``i`` (``n``:
        of ``ln_f``)."""
        from modbench.eval.diagnostics import _sum_finite, angular_distance

        for i, b in enumerate(blocks):
            sq = sum(float(p.grad.double().pow(2).sum()) for p in b.parameters()
                     if p.grad is not None)
            self.grads[i].append(math.sqrt(sq))
            self.streams[i].add(seen[i])
            s, c = _sum_finite(angular_distance(seen[i], seen[i + 1]))
            self.ang[i][0] += s
            self.ang[i][1] += c
        self.final.add(seen[self.n])

    def layers(self) -> list[dict[str, Any]]:
        ang, grads = self.ang, self.grads
        return [{"layer": i, **self.streams[i].figures(),
                 "angular_distance": ang[i][0] / ang[i][1] if ang[i][1] else None,
                 "grad_norm": sum(grads[i]) / len(grads[i])} for i in range(self.n)]


@contextlib.contextmanager
def _stream_inputs(hf: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """While open, the dict holds the input of each block ``i`` of the last forward pass
    under ``i``, and that of ``ln_f`` under the number of blocks."""
    seen: dict[int, torch.Tensor] = {}

    def reader(k: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            seen[k] = args[0].detach()
        return hook

    blocks = list(hf.transformer.h)
    handles = [b.register_forward_pre_hook(reader(i)) for i, b in enumerate(blocks)]
    handles.append(hf.transformer.ln_f.register_forward_pre_hook(reader(len(blocks))))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _gradients_on(model: nn.Module) -> Iterator[None]:
    """Every parameter takes a gradient while open; afterwards the gradients are dropped and
    each parameter's ``requires_grad`` is what it was."""
    was = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.requires_grad_(True)
        yield
    finally:
        model.zero_grad(set_to_none=True)
        for p, flag in was.items():
            p.requires_grad_(flag)


def _layered_weight_figures(model: nn.Module) -> list[dict[str, Any]]:
    """The weight figures of every matrix, each with the block it belongs to (or None)."""
    from modbench.eval.diagnostics import weight_figures

    weights = weight_figures(model)
    for w in weights:
        m = re.search(r"\.h\.(\d+)\.", w["name"])
        w["layer"] = int(m.group(1)) if m else None
    return weights


def gpt2_diagnostics(model: LogitsOf, batches: list[torch.Tensor]) -> dict[str, Any]:
    """The GPT-2 subset of the diagnostics (module docstring), JSON-ready."""
    from modbench.eval.diagnostics import finalise, rtn_quantize, swapped_weights

    hf = model.hf
    blocks = list(hf.transformer.h)
    figures = _BlockFigures(len(blocks))
    convs = [m for b in blocks for m in b.modules() if type(m).__name__ == "Conv1D"]
    quant = {m.weight: rtn_quantize(m.weight.detach().t()).t().contiguous() for m in convs}
    losses, q_losses, rows = [], [], []
    model.eval()
    with _gradients_on(model), _stream_inputs(hf) as seen:
        for batch in batches:
            model.zero_grad(set_to_none=True)
            seen.clear()
            loss = lm_loss(model(batch), batch)
            loss.backward()
            rows.append(batch.shape[0])
            losses.append(float(loss.detach()))
            figures.add(blocks, seen)
            with torch.no_grad(), swapped_weights(quant):
                q_losses.append(float(lm_loss(model(batch), batch)))
    total = sum(rows)
    ref = sum(v * r for v, r in zip(losses, rows, strict=True)) / total
    q = sum(v * r for v, r in zip(q_losses, rows, strict=True)) / total
    result = {
        "subset": "GPT-2: validation loss, per-block stream figures, angular distance and "
                  "gradient norm, weight spectra, W4 per-channel quantization (the other "
                  "figures of `modbench diagnose` need a modbench decoder)",
        "batches": len(batches), "sequences": total,
        "tokens": sum(int(b.numel()) for b in batches),
        "validation_loss": ref,
        "layers": figures.layers(),
        "final": figures.final.figures(),
        "weights": _layered_weight_figures(model),
        "quantization": {"reference_loss": ref, "weight_bits": 4,
                         "w4_per_channel": {"loss": q, "delta": q - ref}},
    }
    clean, reasons = finalise(result)
    clean["null_reasons"] = reasons
    return clean


# ----------------------------------------------------------------------------- export


@torch.no_grad()
def export_folded(hf: nn.Module, sites: list[Site]) -> None:
    """Turn the fine-tuned model (every norm frozen, no special-token averages) back into a
    plain ``GPT2LMHeadModel`` in place, the fixed maps folded (module docstring)."""
    for s in sites:
        n = s.norm
        if n.live[s.path] or n.special_first or n.special_eot:
            raise ModbenchError(f"norm {s.name} is not fully frozen; the schedule did not "
                                "finish (this is a bug: report it)")
    transformers = _transformers()
    root = math.sqrt(EXPORT_EPS)

    def gain(norm: FakeNorm, path: int) -> torch.Tensor:
        d = norm.dim
        w = norm.weight if norm.weight is not None else torch.ones(d)
        return w.detach().float().expand(d) / norm.sigma[path]

    def shift(norm: FakeNorm) -> torch.Tensor:
        return (norm.bias.detach().float() if norm.bias is not None
                else torch.zeros(norm.dim))

    def centering(d: int, like: torch.Tensor) -> nn.LayerNorm:
        ln = nn.LayerNorm(d, eps=EXPORT_EPS).to(like.device)
        ln.weight.fill_(root)
        ln.bias.zero_()
        return ln

    def fold(conv: nn.Module, cols: slice, a: torch.Tensor, b: torch.Tensor) -> None:
        w = conv.weight[:, cols]
        conv.bias[cols] += b.to(w) @ w
        conv.weight[:, cols] = a.to(w)[:, None] * w

    for block in hf.transformer.h:
        ln1: FakeNorm = block.ln_1.norm
        if ln1.kind != "layernorm":
            raise ModbenchError("export_folded expects GPT-2 LayerNorms")
        conv = block.attn.c_attn.conv
        d = ln1.dim
        b1 = shift(ln1)
        fold(conv, slice(0, 2 * d), gain(ln1, 0), b1)
        fold(conv, slice(2 * d, 3 * d), gain(ln1, 1), b1)
        block.attn.c_attn = conv
        block.ln_1 = centering(d, conv.weight)
        ln2: FakeNorm = block.ln_2
        fold(block.mlp.c_fc, slice(None), gain(ln2, 0), shift(ln2))
        block.ln_2 = centering(d, conv.weight)
    lnf: FakeNorm = hf.transformer.ln_f
    new = nn.LayerNorm(lnf.dim, eps=EXPORT_EPS).to(hf.lm_head.weight.device)
    new.weight.copy_(gain(lnf, 0) * root)
    new.bias.copy_(shift(lnf))
    hf.transformer.ln_f = new
    hf.config.layer_norm_epsilon = EXPORT_EPS
    if not isinstance(hf, transformers.GPT2LMHeadModel):  # pragma: no cover - guarded above
        raise ModbenchError("export_folded expects a GPT2LMHeadModel")


# ------------------------------------------------------------------------------- run


def _eos_id(ds: Any, hf: nn.Module) -> int | None:
    """The end-of-text id: the data's tokenizer's, else the GPT-2 config's (or None)."""
    try:
        from modbench.data import find_eos_id

        return find_eos_id(ds.tokenizer())
    except ModbenchError:
        return getattr(hf.config, "eos_token_id", None)


def _control(model: nn.Module, ft: FineTuneSettings, batch: Callable[[int], torch.Tensor],
             val: Callable[[nn.Module], float], dev: torch.device,
             progress: bool) -> FineTuneResult:
    """The control: a copy of the model fine-tuned the same way with its norms kept."""
    twin = copy.deepcopy(model)
    return finetune(Task(twin, [], TokenContext(None), batch, val, dev), ft, [],
                    progress=progress, desc="control (with norms)")


def _write_folded(hf: nn.Module, sites: list[Site], folder: Path, tmp: Path) -> None:
    """Fold the frozen norms (:func:`export_folded`) and save the model into ``tmp`` as a
    plain GPT-2 folder, with the source folder's tokenizer files."""
    export_folded(hf, sites)
    hf.save_pretrained(str(tmp))
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, tmp / name)


def remove_norm_gpt2(folder: Path, out: Path, ft: FineTuneSettings, *, data: str | None,
                     seq_len: int | None, val_sequences: int | None, device: str,
                     diagnostics_batches: int, control: bool, progress: bool) -> Outcome:
    """Remove the norms of a Hugging Face GPT-2 folder; ``out`` becomes a GPT-2 folder with
    the norms folded, ``remove_norm.json`` and the diagnostics (module docstring)."""
    from modbench.runtime.device import resolve_device
    from modbench.runtime.loss import validation_loss

    started = time.time()
    n_val = DEFAULT_VAL_SEQUENCES if val_sequences is None else val_sequences
    if n_val < 1:
        raise ModbenchError(f"--val-sequences must be at least 1, got {n_val}")
    hf = load_gpt2(folder)
    ds = gpt2_data(folder, data, seq_len, hf.config.vocab_size, hf.config.n_positions, progress)
    dev = resolve_device(device)
    model = LogitsOf(hf).to(dev)
    bs = ft.batch_size
    seed = 1234  # the data order of the fine-tuning batches (modbench's default data seed)

    def val(m: nn.Module) -> float:
        return validation_loss(m, ds, n_val, bs, dev)

    def batch(step: int) -> torch.Tensor:
        return ds.train_batch(step, bs, seed)

    diag = ([b.to(dev) for b in ds.val_batches(diagnostics_batches * bs, bs)]
            if diagnostics_batches > 0 else [])
    eot = _eos_id(ds, hf)
    with staged_output(out) as tmp:
        model.eval()
        before = finite_before(val(model))
        if diag:
            write_json(tmp / DIAGNOSTICS_DIR / "before" / "diagnostics.json",
                        {"model": str(folder), **gpt2_diagnostics(model, diag)})
        control_res = None
        if control:
            control_res = _control(model, ft, batch, val, dev, progress)
        tokens = TokenContext(eot)
        sites = convert_gpt2(hf, tokens)
        handle = track_tokens(model, tokens)
        task = Task(model, sites, tokens, batch, val, dev, hf.transformer.ln_f)
        events = schedule(len(hf.transformer.h), ft.steps)
        res = finetune(task, ft, events, progress=progress)
        check = norm_free_check(model, sites)
        records = [s.record() for s in sites]
        if diag:
            write_json(tmp / DIAGNOSTICS_DIR / "after" / "diagnostics.json",
                        {"model": f"{folder} (norms removed)",
                         **gpt2_diagnostics(model, diag)})
        probe = next(iter(ds.val_batches(min(n_val, bs), bs))).to(dev)
        with torch.no_grad():
            fake_logits = model(probe)
        handle.remove()
        _write_folded(hf, sites, folder, tmp)
        reloaded = LogitsOf(load_gpt2(tmp)).to(dev).eval()
        with torch.no_grad():
            diff = float((reloaded(probe) - fake_logits).abs().max())
        exported = val(reloaded)
        check["export_max_logit_difference"] = diff
        check["export_layer_norm_epsilon"] = EXPORT_EPS
        check["folded_norms"] = len(fake_norms(sites))
        report = run_report("gpt2", folder, ft, events, before, res, exported, sites, check,
                         control_res, {"n_layer": len(hf.transformer.h),
                                       "n_embd": hf.config.n_embd,
                                       "data": str(ds.path), "seq_len": ds.seq_len},
                         n_val, started)
        report["norms"] = records
        write_json(tmp / REPORT, report)
    return Outcome(out, report, "gpt2")


__all__ = ["EXPORT_EPS", "LogitsOf", "SplitQKV", "convert_gpt2", "export_folded",
           "gpt2_data", "gpt2_diagnostics", "load_gpt2", "remove_norm_gpt2"]
