"""LayerNorm removal from a modbench run (the ``modbench remove-norm RUN_DIR`` source).

Every LayerNorm/RMSNorm site of a modbench decoder becomes a live
:class:`~modbench.remove_norm.core.FakeNorm` (:func:`convert_modbench`): the attention
pre-norm split into a query/key and a value path where the attention core reads its input only
through its q/k/v projections, each other norm whole, each assigned the stage of the published
schedule that freezes it (:mod:`modbench.remove_norm.core`). Methods that normalise another way
are refused with the reason (:data:`UNSUPPORTED`). The run is fine-tuned on its own data from
the step where its training stopped (:func:`remove_norm_modbench`), and written as::

    OUT/config.yaml (the source run's), OUT/model.pt (weights with 1/sigma folded into each
    norm's gain, and the frozen norms' state; load it with :func:`load_norm_free`)
"""

from __future__ import annotations

import copy
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modbench.errors import ModbenchError
from modbench.model.attention import Attention, PassGate
from modbench.remove_norm.core import (
    DIAGNOSTICS_DIR,
    REPORT,
    STAGES,
    SUPPORTED_NORMS,
    FineTuneSettings,
    NormedInput,
    NormHolder,
    Outcome,
    Site,
    Task,
    TokenContext,
    fake_from,
    fake_norms,
    final_fake_norm,
    finetune,
    finite_before,
    norm_free_check,
    replace_module,
    run_report,
    schedule,
    staged_output,
    track_tokens,
    write_json,
)

MODEL_FILE = "model.pt"

# Methods whose normalization is not a LayerNorm/RMSNorm statistic at a norm site.
UNSUPPORTED: dict[str, str] = {
    "dyt": "DyT replaces each norm by the element-wise tanh(alpha x): there is no per-token "
           "statistic to freeze",
    "bhyt": "its norms are a bounded element-wise tanh with no per-token statistic to freeze",
    "seednorm": "SeeDNorm's gain depends on the input, a nonlinearity a frozen statistic does "
                "not remove",
    "adaptive_rmsnorm": "adaptive RMSNorm's gain depends on the input, a nonlinearity a frozen "
                        "statistic does not remove",
    "se_token_mix": "it uses adaptive RMSNorm, whose gain depends on the input",
    "powernorm": "PowerNorm normalises by running batch statistics, not a per-token "
                 "LayerNorm/RMSNorm statistic",
    "prepbn": "PRepBN normalises by batch statistics (BatchNorm), not a per-token statistic",
    "unified_norm": "Unified Normalization normalises by (smoothed) batch statistics, not a "
                    "per-token statistic; in evaluation it is already a fixed affine map "
                    "(fuse_unified_norms folds it into the next linear layers)",
    "crmsnorm": "CRMSNorm works on a compressed stream with its own norm, not LayerNorm or "
                "RMSNorm",
    "ngpt": "nGPT normalises hidden states and weights to the unit sphere everywhere, not at "
            "norm sites",
    "hyper_connections": "its dynamic connection weights divide by the stream's RMS inside the "
                         "residual stream",
    "attnres": "its depth attention divides by each source's RMS inside the residual stream",
    "tokenformer": "Pattention L2-normalises its scores per token inside the core",
    "relaxed_recursive": "its layers share their norms and projections (the tie slot), so a "
                         "norm frozen for one layer would be frozen for every layer tied to it",
    "widenet": "its layers share one attention and one FFN core (the tie slot), which the "
               "per-layer split of the attention norm would wrap once per layer",
    "three_phase": "its per-channel RMSNorm divides each of the N channels by its own RMS, "
                   "not one LayerNorm/RMSNorm statistic per token",
}



def check_method(method: str) -> None:
    """Refuse a method string with a method whose normalization cannot be removed this way."""
    from modbench.methods.base import MethodSpec

    for m in MethodSpec.parse(method).methods:
        if m.name in UNSUPPORTED:
            raise ModbenchError(
                f"remove-norm does not apply to method '{m.name}': {UNSUPPORTED[m.name]}; it "
                "works on runs whose norms are LayerNorm or RMSNorm (e.g. baseline, layernorm, "
                "post_ln, sandwich)")


def _stage_of(name: str, n_layers: int) -> tuple[str, int]:
    m = re.match(r"^blocks\.(\d+)\.(attn|ffn)\.(.*)$", name)
    if m is None:
        return "final", n_layers
    layer, sub, rest = int(m.group(1)), m.group(2), m.group(3)
    if sub == "ffn":
        return "ffn", layer
    if rest.startswith("pre_norm") or (rest.startswith("core.") and
                                       ("q_norm" in rest or "k_norm" in rest)):
        return "attn_qk", layer
    return "attn_v", layer


def _splittable(sub: nn.Module) -> bool:
    core = sub.core
    return (type(core) is Attention and isinstance(core.out_gate, PassGate)
            and type(sub.pre_norm) in SUPPORTED_NORMS)


def convert_modbench(model: nn.Module, tokens: TokenContext) -> list[Site]:
    """Replace every norm of a modbench decoder by a live :class:`FakeNorm` (in place; the
    model computes the same function) and return the sites in model order."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ModbenchError("remove-norm works on models built by modbench (no `blocks`)")
    n_layers = len(blocks)
    sites: list[Site] = []
    for i, block in enumerate(blocks):
        sub = block.attn
        if _splittable(sub):
            fake = fake_from(sub.pre_norm, tokens, paths=2)
            sub.pre_norm = NormHolder(fake)
            core = sub.core
            core.q_proj = NormedInput(core.q_proj, fake, 0, True)
            core.k_proj = NormedInput(core.k_proj, fake, 0, False)
            core.v_proj = NormedInput(core.v_proj, fake, 1, True)
            name = f"blocks.{i}.attn.pre_norm"
            sites += [Site(name, fake, 0, "attn_qk", i), Site(name, fake, 1, "attn_v", i)]
    for name, module in list(model.named_modules()):
        if type(module) in SUPPORTED_NORMS:
            fake = fake_from(module, tokens)
            replace_module(model, name, fake)
            stage, layer = _stage_of(name, n_layers)
            sites.append(Site(name, fake, 0, stage, layer))
    if not sites:
        raise ModbenchError("the model has no LayerNorm or RMSNorm to remove; remove-norm needs "
                            "a run with normalization layers")
    order = {s: k for k, s in enumerate(STAGES)}
    sites.sort(key=lambda s: (order[s.stage], s.layer, s.name, s.path))
    return sites


# -------------------------------------------------------------------- modbench source


def _modbench_val(data: Any, n: int, bs: int, device: torch.device) -> Callable[[nn.Module],
                                                                                float]:
    from modbench.runtime.loss import validation_loss

    def val(model: nn.Module) -> float:
        return validation_loss(model, data, n, bs, device)

    return val


def _eot_of(data: Any) -> int | None:
    from modbench.data import find_eos_id

    try:
        return find_eos_id(data.tokenizer())
    except ModbenchError:
        return None


def _diagnose_modbench(model: nn.Module, batches: list[torch.Tensor], info: dict[str, Any]
                       ) -> dict[str, Any]:
    from modbench.eval.diagnostics import compute_diagnostics, finalise

    result, reasons = finalise({**info, **compute_diagnostics(model, batches)})
    result["null_reasons"] = reasons
    return result


def remove_norm_modbench(run_dir: Path, out: Path, ft: FineTuneSettings, *,
                         diagnostics_batches: int = 4, control: bool = False,
                         progress: bool = True) -> Outcome:
    """Remove the norms of a modbench run (see the module docstring); writes ``out``."""
    from modbench.eval.run import check_run_folder, load_run
    from modbench.runtime.data import open_data
    from modbench.runtime.device import resolve_device
    from modbench.runtime.runfolder import CONFIG

    started = time.time()
    if not (run_dir / CONFIG).is_file():
        raise ModbenchError(f"{run_dir} is neither a modbench run folder (no config.yaml) nor a "
                            "Hugging Face GPT-2 folder (no config.json); pass one of them")
    check_run_folder(run_dir)
    from modbench.config import resolve

    check_method(resolve(yaml_file=run_dir / CONFIG).model.method)
    cfg, model, step = load_run(run_dir)
    device = resolve_device(cfg.train.device)
    model.to(device)
    data = open_data(cfg, progress=progress)
    bs = cfg.train.forward_rows()
    n_val = cfg.train.eval_sequences
    val = _modbench_val(data, n_val, bs, device)
    diag_batches = ([b.to(device) for b in data.val_batches(diagnostics_batches * bs, bs)]
                    if diagnostics_batches > 0 else [])
    info = {"method": cfg.model.method, "preset": cfg.preset, "seed": cfg.seed}
    with staged_output(out) as tmp:
        model.eval()
        before = finite_before(val(model))
        if diag_batches:
            write_json(tmp / DIAGNOSTICS_DIR / "before" / "diagnostics.json",
                        _diagnose_modbench(model, diag_batches, {**info, "step": step}))
        control_res = None
        if control:
            twin = copy.deepcopy(model)
            ctl = Task(twin, [], TokenContext(None), lambda s: data.train_batch(
                step + s, ft.batch_size, cfg.data.data_seed), val, device)
            control_res = finetune(ctl, ft, [], progress=progress, desc="control (with norms)")
            del twin
        tokens = TokenContext(_eot_of(data))
        sites = convert_modbench(model, tokens)
        handle = track_tokens(model, tokens)
        final = final_fake_norm(sites)
        task = Task(model, sites, tokens,
                    lambda s: data.train_batch(step + s, ft.batch_size, cfg.data.data_seed),
                    val, device, final)
        events = schedule(len(model.blocks), ft.steps)
        res = finetune(task, ft, events, progress=progress)
        records = [s.record() for s in sites]  # the averages before folding
        folded = [n.fold() for n in fake_norms(sites)]
        model.eval()
        exported = val(model)
        check = norm_free_check(model, sites)
        check["folded_norms"] = sum(folded)
        if diag_batches:
            write_json(tmp / DIAGNOSTICS_DIR / "after" / "diagnostics.json",
                        _diagnose_modbench(model, diag_batches,
                                           {**info, "step": step + ft.steps,
                                            "method": f"{cfg.model.method} (norms removed)"}))
        handle.remove()
        state = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                 "step": step + ft.steps,
                 "remove_norm": {"source_step": step, "steps": ft.steps,
                                 "norms": {s.name: s.norm.state() for s in sites}}}
        torch.save(state, tmp / MODEL_FILE)
        shutil.copyfile(run_dir / CONFIG, tmp / "config.yaml")
        report = run_report("modbench", run_dir, ft, events, before, res, exported, sites, check,
                         control_res, {"method": cfg.model.method, "preset": cfg.preset,
                                       "source_step": step}, n_val, started)
        report["norms"] = records
        write_json(tmp / REPORT, report)
    return Outcome(out, report, "modbench")


def load_norm_free(out_dir: str | Path, device: str | torch.device = "cpu"
                   ) -> tuple[Any, nn.Module]:
    """The config and the norm-free model that :func:`remove_norm` wrote for a modbench run
    (its norms are fixed linear maps; ``model(idx)`` gives logits)."""
    from modbench.config import resolve
    from modbench.methods.build import build_model
    from modbench.runtime.checkpoint import load_checkpoint, load_weights

    out = Path(out_dir)
    if not (out / MODEL_FILE).is_file() or not (out / "config.yaml").is_file():
        raise ModbenchError(f"{out} is not a remove-norm output of a modbench run (no "
                            f"{MODEL_FILE} and config.yaml)")
    cfg = resolve(yaml_file=out / "config.yaml")
    state = load_checkpoint(out / MODEL_FILE)
    model = build_model(cfg.model, seed=cfg.seed)
    tokens = TokenContext(None)
    sites = convert_modbench(model, tokens)
    saved = state["remove_norm"]["norms"]
    for s in sites:
        if s.name not in saved:
            raise ModbenchError(f"{out}/{MODEL_FILE} has no state for norm {s.name}; it was "
                                "written for another model")
        s.norm.load_state(saved[s.name])
    load_weights(model, state["model"], out / MODEL_FILE, what="the model of its config.yaml")
    track_tokens(model, tokens)
    return cfg, model.to(device).eval()
