"""``modbench export RUN_DIR --hf OUT [--push-to-hub REPO]``: a self-contained Hugging Face
checkpoint of a trained run.

``OUT`` holds:

- ``config.json``: ``model_type`` ``modbench``, ``auto_map`` to the two remote-code files,
  modbench's model config under ``modbench``, the methods with their options under
  ``modbench_methods`` and where each came from (built in, or a plugin's module and the
  sha256 of its code) under ``modbench_method_origins``;
- ``configuration_modbench.py``, ``modeling_modbench.py`` (:mod:`modbench.eval.hf_remote`)
  and the modbench source they build the model from, ``modbench_*.py``
  (:mod:`modbench.eval.hf_bundle`): the decoder, the planner and the model's methods, which
  import only torch, PyYAML and each other; a methods plugin's modules as ``plugin_*.py``;
- ``model.safetensors`` (the modbench state dict under ``model.``);
- the tokenizer: ``tokenizer.json`` (the data's own), ``tokenizer_config.json`` for
  ``PreTrainedTokenizerFast``, ``special_tokens_map.json``; ``generation_config.json``;
- ``README.md``, the model card (:mod:`modbench.eval.model_card`).

``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` then gives modbench's
logits where modbench is not installed, and ``lm_eval --model hf --model_args
pretrained=OUT,trust_remote_code=True`` runs. A method that declares ``exportable = False``
is refused. The folder is written next to ``OUT`` and renamed into place, so a failed export
leaves nothing; ``--push-to-hub`` then uploads it in one commit with ``huggingface_hub``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from modbench.data._fs import make_tmp_dir_next_to, remove_tree, sha256_file
from modbench.errors import ModbenchError
from modbench.eval.hf_bundle import bundle
from modbench.eval.model_card import model_card, study_verdict
from modbench.eval.run import load_run
from modbench.fsutil import umask
from modbench.methods.plugins import origins as method_origins
from modbench.runtime.data import open_data
from modbench.runtime.runfolder import CONFIG, SUMMARY, code_version

REMOTE_FILES = ("configuration_modbench.py", "modeling_modbench.py")


def check_push(repo_id: str, token: str | None = None) -> None:
    """Refuse ``--push-to-hub REPO`` before any work when it cannot succeed: no
    huggingface_hub, a malformed repo id, or no token."""
    try:
        import huggingface_hub
    except ImportError as e:
        raise ModbenchError("--push-to-hub needs huggingface_hub; install it with "
                            "`pip install huggingface_hub` (transformers brings it)") from e
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ModbenchError(f"--push-to-hub {repo_id!r} is not a Hub repo id; write "
                            "NAME or OWNER/NAME, e.g. --push-to-hub alice/modbench-qknorm"
                            ) from None
    if (token or huggingface_hub.get_token()) is None:
        raise ModbenchError("pushing to the Hub needs a token; run `hf auth login` or set "
                            "HF_TOKEN, then export again")


def push_to_hub(folder: str | Path, repo_id: str, *, token: str | None = None,
                private: bool | None = None, endpoint: str | None = None,
                message: str = "modbench export") -> str:
    """Upload an exported folder to the Hub repo ``repo_id`` (created if missing) in one
    commit; returns the commit's URL. ``endpoint``: another Hub than ``HF_ENDPOINT``'s."""
    check_push(repo_id, token)
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    try:
        repo = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo.repo_id,
                                 repo_type="model", commit_message=message)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModbenchError(f"pushing {folder} to {repo_id} failed ({first}); the export is "
                            f"complete in {folder}: upload it again with `hf upload "
                            f"{repo_id} {folder} .`") from e
    return str(info.commit_url)


def _template(name: str) -> str:
    return resources.files("modbench.eval.hf_remote").joinpath(name).read_text(
        encoding="utf-8")


def _remote_files(bundled: dict[str, str]) -> dict[str, str]:
    """The two remote-code files; the config file stamped with the sha256 of the model code.

    transformers maps a remote config class to the model class first loaded with it, and
    the config file alone is the same in every export: without the stamp, a process that
    loaded one export would build a second, of other methods, with the first one's code."""
    files = {name: _template(name) for name in REMOTE_FILES}
    code = {**bundled, "modeling_modbench.py": files["modeling_modbench.py"]}
    digest = hashlib.sha256(json.dumps(sorted(code.items())).encode()).hexdigest()
    files["configuration_modbench.py"] += (
        "\n\n# The model code this config belongs to (sha256 of modeling_modbench.py and the\n"
        "# modbench_*.py files): exports of different code get different config classes.\n"
        f'MODEL_CODE_SHA256 = "{digest}"\n')
    return files


def _run_files(run: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The run's ``meta`` (code version, data fingerprint) and its summary (None when the
    run has not finished)."""
    tree = yaml.safe_load((run / CONFIG).read_text(encoding="utf-8")) or {}
    summary = None
    if (run / SUMMARY).is_file():
        summary = json.loads((run / SUMMARY).read_text(encoding="utf-8"))
    return dict(tree.get("meta") or {}), summary


def _check_exportable(methods: list[Any]) -> None:
    """Refuse a method that declares ``exportable = False``."""
    for m in methods:
        if not getattr(m, "exportable", True):
            raise ModbenchError(f"method '{m.name}' cannot be exported to Hugging Face format "
                                f"({getattr(m, 'export_note', 'see its docstring')})")


def _run_tokenizer(cfg: Any) -> tuple[Path, int, str]:
    """The run's tokenizer file, checked against the checksum its data records, with the EOS
    id and token."""
    data_cfg = copy.deepcopy(cfg)
    data_cfg.data.verify = False  # only the tokenizer is read; its checksum is checked below
    data = open_data(data_cfg, progress=False)
    tok_file = Path(data.path) / data.meta["tokenizer"].get("file", "tokenizer.json")
    tok = data.tokenizer()  # raises for a missing or corrupt tokenizer.json
    if sha256_file(tok_file) != data.meta["tokenizer"].get("sha256"):
        raise ModbenchError(f"{tok_file} is not the tokenizer the run's data records (its "
                            "sha256 differs); re-prepare the data with `modbench data prepare`")
    eos_id = int(data.eos_id)
    return tok_file, eos_id, tok.id_to_token(eos_id)


def _hf_config(cfg: Any, run: Path, step: int, methods: list[Any],
               origins: dict[str, dict[str, Any]], eos_id: int, dtype: str) -> dict[str, Any]:
    """``config.json``: the remote-code classes, modbench's model config and methods, the
    run it came from."""
    return {
        "model_type": "modbench",
        "architectures": ["ModbenchForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_modbench.ModbenchConfig",
            "AutoModelForCausalLM": "modeling_modbench.ModbenchForCausalLM",
        },
        "modbench": cfg.to_dict()["model"],
        "modbench_methods": [{"name": m.name, "options": _options(m)} for m in methods],
        # where each method came from: built in, or a plugin's module with the sha256 of its
        # code (the modules bundled as plugin_*.py), as the run records them
        "modbench_method_origins": origins,
        "vocab_size": cfg.model.vocab_size,
        "max_position_embeddings": cfg.model.max_seq_len,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "modbench_run": {"run": str(run), "step": step, "seed": cfg.seed,
                         "data_seed": cfg.data.data_seed, "preset": cfg.preset,
                         "method": cfg.model.method},
    }


def _weights(model: Any) -> dict[str, Any]:
    """The state dict under ``model.``, as safetensors takes it.

    A weight shared by several layers (the tie slot) is written under each of its names as
    its own copy: safetensors refuses tensors that share memory; loading writes the equal
    copies into the one shared parameter."""
    tensors: dict[str, Any] = {}
    stored: set[tuple[int, int]] = set()
    for k, v in model.state_dict().items():
        t = v.detach().contiguous().cpu()
        where = (t.untyped_storage().data_ptr(), t.storage_offset())
        tensors[f"model.{k}"] = t.clone() if where in stored else t
        stored.add(where)
    return tensors


def _write_tokenizer_files(folder: Path, tok_file: Path, eos_id: int, eos: str,
                           max_seq_len: int) -> None:
    """``tokenizer.json`` (the data's own), ``tokenizer_config.json``,
    ``special_tokens_map.json`` and ``generation_config.json``: EOS is every special token."""
    special = {"bos_token": eos, "eos_token": eos, "unk_token": eos, "pad_token": eos}
    shutil.copyfile(tok_file, folder / "tokenizer.json")
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_len, "clean_up_tokenization_spaces": False,
        "add_bos_token": False, "add_eos_token": False, **special})
    _write_json(folder / "special_tokens_map.json", special)
    _write_json(folder / "generation_config.json", {
        "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
        "use_cache": False})


def export_hf(run_dir: str | Path, out: str | Path, *, repo_id: str | None = None) -> Path:
    """Write the Hugging Face checkpoint of ``run_dir`` to ``out`` (which must not exist or
    be empty). ``repo_id``: the Hub repo it will be pushed to, named in the model card's
    example (default: ``out``)."""
    run, target = Path(run_dir), Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModbenchError(f"{target} exists and is not an empty folder; choose another "
                            "--hf folder")
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ModbenchError("exporting needs safetensors and transformers; install "
                            "`pip install 'modbench[eval]'`") from e
    cfg, model, step = load_run(run)
    methods = list(getattr(model, "methods", []))
    _check_exportable(methods)
    meta, summary = _run_files(run)
    origins = method_origins(m.name for m in methods)
    tok_file, eos_id, eos = _run_tokenizer(cfg)
    version = code_version()
    dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    files = bundle([type(m) for m in methods],
                   header=f"bundled from modbench {version['modbench']} "
                          f"(git {str(version['git_commit'] or 'n/a')[:12]}) by `modbench "
                          "export`, its modbench imports pointed at this folder's files")
    config = _hf_config(cfg, run, step, methods, origins, eos_id, dtype)
    card = model_card(cfg, run=run, step=step, summary=summary, meta=meta, methods=methods,
                      params=sum(p.numel() for p in model.parameters()),
                      load_as=repo_id or str(target), exported_with=version,
                      study=study_verdict(run), dtype=dtype, origins=origins)
    tmp = make_tmp_dir_next_to(target)
    try:
        for name, text in _remote_files(files).items():
            (tmp / name).write_text(text, encoding="utf-8")
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        save_file(_weights(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        _write_tokenizer_files(tmp, tok_file, eos_id, eos, cfg.model.max_seq_len)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        for f in tmp.iterdir():  # safetensors writes 0600; the folder is for sharing
            os.chmod(f, 0o666 & ~umask())
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        remove_tree(tmp)
        raise
    return target


def _options(method: Any) -> dict[str, Any]:
    opts = getattr(method, "opts", None)
    return dataclasses.asdict(opts) if dataclasses.is_dataclass(opts) else {}


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
