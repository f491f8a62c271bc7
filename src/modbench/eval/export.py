"""``modbench export RUN_DIR --hf OUT``: a Hugging Face checkpoint of a trained run.

``OUT`` holds ``config.json`` (model_type ``modbench``, ``auto_map`` to the two remote-code
files), ``configuration_modbench.py``, ``modeling_modbench.py``, ``model.safetensors`` (the
modbench state dict under ``model.``), and the tokenizer (``tokenizer.json``,
``tokenizer_config.json`` for ``PreTrainedTokenizerFast``, ``special_tokens_map.json``).
``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` then gives modbench's
logits, and ``lm_eval --model hf --model_args pretrained=OUT,trust_remote_code=True`` runs.
The remote code imports ``modbench`` to build the model, so every registered method exports;
a method that declares ``exportable = False`` is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from modbench.data._fs import make_tmp_dir_next_to, remove_tree
from modbench.errors import ModbenchError
from modbench.eval.run import load_run
from modbench.runtime.data import open_data

EOS = "<|endoftext|>"


def export_hf(run_dir: str | Path, out: str | Path) -> Path:
    run, target = Path(run_dir), Path(out)
    if target.exists() and any(target.iterdir()):
        raise ModbenchError(f"{target} exists and is not empty; choose another --hf folder")
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ModbenchError("exporting needs safetensors and transformers; install "
                            "`pip install 'modbench[eval]'`") from e
    cfg, model, step = load_run(run)
    for m in getattr(model, "methods", []):
        if not getattr(m, "exportable", True):
            raise ModbenchError(f"method '{m.name}' cannot be exported to Hugging Face format "
                                f"({getattr(m, 'export_note', 'see its docstring')})")
    tok_file = Path(open_data(cfg, progress=False).path) / "tokenizer.json"
    tmp = make_tmp_dir_next_to(target)
    try:
        for name in ("configuration_modbench.py", "modeling_modbench.py"):
            src = resources.files("modbench.eval.hf_remote").joinpath(name)
            (tmp / name).write_text(src.read_text())
        tensors = {f"model.{k}": v.detach().contiguous().cpu()
                   for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        eos_id = 0
        config: dict[str, Any] = {
            "model_type": "modbench",
            "architectures": ["ModbenchForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_modbench.ModbenchConfig",
                "AutoModelForCausalLM": "modeling_modbench.ModbenchForCausalLM",
            },
            "modbench": cfg.to_dict()["model"],
            "vocab_size": cfg.model.vocab_size,
            "max_position_embeddings": cfg.model.max_seq_len,
            "tie_word_embeddings": False,
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "torch_dtype": "float32",
            "modbench_run": {"run": str(run), "step": step, "seed": cfg.seed,
                             "preset": cfg.preset},
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        shutil.copyfile(tok_file, tmp / "tokenizer.json")
        special = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
            cfg.model.max_seq_len, "clean_up_tokenization_spaces": False,
            "add_bos_token": False, "add_eos_token": False, **special}, indent=2) + "\n")
        (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        remove_tree(tmp)
        raise
    return target
