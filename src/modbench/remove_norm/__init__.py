"""LayerNorm removal (``modbench remove-norm``), its own package: it fine-tunes a trained
model, never through the trainer. This front module picks the source and checks the options;
the work is in

* :mod:`modbench.remove_norm.core`: the fake norm, the published schedule, the fine-tuning
  loop, the checks and the report, whatever the model (method: docs/sources.md#remove-norm);
* :mod:`modbench.remove_norm.modbench_source`: a modbench run folder whose norms are LayerNorm
  or RMSNorm (other methods refused with the reason), fine-tuned on its own data;
* :mod:`modbench.remove_norm.gpt2`: a Hugging Face GPT-2 folder (the papers' models).

What is written (:func:`remove_norm`)::

    OUT/remove_norm.json        validation loss before, after each stage, after and exported;
                                every frozen norm's averages; the schedule; the linearity check
    OUT/diagnostics/before/diagnostics.json, OUT/diagnostics/after/diagnostics.json
    modbench run:  OUT/config.yaml (the source run's), OUT/model.pt (weights with 1/sigma
                   folded into each norm's gain, and the frozen norms' state; load it with
                   :func:`modbench.remove_norm.modbench_source.load_norm_free`)
    GPT-2:         a Hugging Face folder loadable with GPT2LMHeadModel, norms folded
                   (:func:`modbench.remove_norm.gpt2.export_folded`)

docs/remove_norm.md describes the command, the choices of our own and the figures.
"""

from __future__ import annotations

from pathlib import Path

from modbench.errors import ModbenchError
from modbench.remove_norm.core import DEFAULT_LR, FineTuneSettings, Outcome


def is_hf_folder(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model folder (it has a ``config.json``)."""
    return (path / "config.json").is_file()


def remove_norm(source: str | Path, out: str | Path, *, steps: int = 300,
                batch_size: int | None = None, lr: float = DEFAULT_LR,
                aux_weight: float = 0.0, diagnostics_batches: int = 4, control: bool = False,
                data: str | None = None, seq_len: int | None = None,
                val_sequences: int | None = None, device: str = "auto",
                progress: bool = True) -> Outcome:
    """``modbench remove-norm``: a modbench run folder or a Hugging Face GPT-2 folder in,
    the norm-free model and ``remove_norm.json`` out (module docstring). ``batch_size``: the
    run's batch size (modbench) or 8 (GPT-2). ``data``, ``seq_len``, ``val_sequences`` and
    ``device`` apply to GPT-2 (a modbench run uses its own data, validation set and device)."""
    src, target = Path(source), Path(out)
    if not src.is_dir():
        raise ModbenchError(f"{src} does not exist; pass a modbench run folder or a Hugging "
                            "Face GPT-2 folder")
    if diagnostics_batches < 0:
        raise ModbenchError(f"--diagnostics-batches must be 0 or more, got "
                            f"{diagnostics_batches}")
    if target.resolve() == src.resolve():
        raise ModbenchError("--out must be a new folder, not the source itself")
    if is_hf_folder(src):
        from modbench.remove_norm.gpt2 import remove_norm_gpt2

        ft = FineTuneSettings(steps=steps, batch_size=batch_size or 8, lr=lr,
                              aux_weight=aux_weight)
        ft.validate()
        return remove_norm_gpt2(src, target, ft, data=data, seq_len=seq_len,
                                val_sequences=val_sequences, device=device,
                                diagnostics_batches=diagnostics_batches, control=control,
                                progress=progress)
    for name, value in (("--data", data), ("--seq-len", seq_len),
                        ("--val-sequences", val_sequences)):
        if value is not None:
            raise ModbenchError(f"{name} applies to GPT-2 sources; a modbench run fine-tunes on "
                                "its own data and validation set")
    from modbench.remove_norm.modbench_source import remove_norm_modbench
    from modbench.runtime.runfolder import CONFIG

    bs = batch_size
    if bs is None and (src / CONFIG).is_file():
        from modbench.config import resolve

        bs = resolve(yaml_file=src / CONFIG).train.batch_size
    ft = FineTuneSettings(steps=steps, batch_size=bs or 8, lr=lr, aux_weight=aux_weight)
    ft.validate()
    return remove_norm_modbench(src, target, ft, diagnostics_batches=diagnostics_batches,
                                control=control, progress=progress)
