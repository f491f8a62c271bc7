"""Bad configuration, generated: random config trees (``--config``), random ``--set`` items
and random method strings go through ``modbench train`` (``run_cli``, in process). Each is
accepted (exit 0: a complete run folder, trained one step) or refused (exit 2: exactly one
``error:`` line on stderr, and no run folder). Never a traceback, never another exit code,
never a half-written run folder.

Values are drawn from pools around each key's limits (zero, negatives, wrong types, nesting,
non-finite numbers, malformed YAML) and kept small where they are valid, so an accepted run
trains in well under a second. ``derandomize=True``: CI tries the same examples every time.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tests.helpers import cli_built_once, torch_threads  # noqa: E402
from tests.reliability.conftest import long_points, long_variant  # noqa: E402

from modbench.cli import run_cli  # noqa: E402
from modbench.config import valid_keys  # noqa: E402
from modbench.methods import load_all  # noqa: E402
from modbench.runtime.checkpoint import load_checkpoint  # noqa: E402

EXAMPLES = {"tree": 100, "set": 150, "method": 150}
BASE = ["train", "--preset", "tiny", "--steps", "1", "--no-progress"]
# kept before the generated items, which may override them
SMALL = ["--set", "train.eval_sequences=2", "--set", "train.batch_size=2"]

# Values around each key's limits; the valid ones keep a run tiny.
POOLS: dict[str, list[Any]] = {
    "preset": ["tiny", "nope", 3, None, ["tiny"]],
    "seed": [0, 1, -1, 2**70, "one", 1.5, None],
    "model.vocab_size": [512, 0, -1, 100, 23857, 512.0, "512", 511.5],
    "model.d_model": [64, 32, 48, 0, -1, 63, 66],
    "model.n_layers": [1, 2, 0, -1],
    "model.n_heads": [1, 2, 4, 8, 0, 3],
    "model.n_kv_heads": [1, 2, 4, 0, 3],
    "model.d_ff": [16, 176, 0, -1],
    "model.max_seq_len": [64, 128, 0, -3, 63],
    "model.rope_theta": [10000.0, 0, -1, ".inf"],
    "model.norm_eps": [1e-5, 0, -1e-5, ".nan"],
    "model.tie_embeddings": [True, False, "yes", 0],
    "model.init_std": [0.02, 0, -1, 1e30],
    "model.attn_head_dim": [None, 8, 16, 0, -2, 7],
    "model.train_seq_len": [None, 32, 64, 0, 1000],
    "recipe.name": ["cpu", "seed002", "nope", None],
    "recipe.optimizer": ["adam", "adamw", "muon", "sgd", 1],
    "recipe.lr": [1e-3, 0, -1, 1e30, ".inf", "fast", None, "1e-3"],
    "recipe.betas": [[0.9, 0.95], [0.9], [2, 3], ["a", "b"], [0.9, ".nan"], 0.9, [0, 0]],
    "recipe.eps": [1e-8, 0, -1],
    "recipe.weight_decay": [0, 0.1, -0.1],
    "recipe.grad_clip": [0, 1, -1],
    "recipe.warmup_steps": [None, 0, 1, -3, 1.5],
    "recipe.warmup_frac": [0, 0.05, 1.5, -0.1],
    "recipe.schedule": ["cosine", "linear", "constant", "step"],
    "recipe.min_lr_ratio": [0.1, -1, 2],
    "recipe.precision": ["auto", "fp32", "bf16", "fp16"],
    "recipe.muon_momentum": [0.95, 0, 1, -0.1, ".nan"],
    "recipe.muon_nesterov": [True, False, "yes", None],
    "recipe.muon_ns_steps": [5, 1, 0, 100, 1.5],
    "recipe.muon_adjust_lr": ["match_rms_adamw", "original", "moonshot", 1],
    "recipe.muon_lr_ratio": [1.0, 20, 0, -1, ".inf"],
    "recipe.muon_layerwise_lr": ["none", "noise", "lanton", 1],
    "recipe.muon_noise_beta": [0.99, 0, 1, -0.1, ".nan"],
    "recipe.muon_noise_max_ratio": [10.0, 1, 0.5, ".inf"],
    "recipe.note": ["x", 3, {"a": 1}],
    "train.steps": [1, 2, 0, -1, 1.0, 1.5],
    "train.batch_size": [1, 2, 4, 0, -1],
    "train.micro_batch_size": [None, 1, 2, 3, 0, "auto", "most"],
    "train.device_memory_gb": [None, 2, 0.5, 0, -1, ".nan", "x"],
    "train.seq_len": [64, 32, 0, 1, 65, 128],
    "train.eval_every": [0, 1, 5, -1],
    "train.eval_sequences": [1, 4, 0, -2],
    "train.eval_probes": [0, 1, -1],
    "train.checkpoint_every": [0, 1, -1],
    "train.log_every": [0, 1, 2, -1],
    "train.device": ["auto", "cpu", "cuda", "cuda:0", "gpu", "", "cpu:0"],
    # true (and YAML's yes) is valid but compiles for minutes; auto is eager on the CPU
    "train.compile": [False, "auto", "always", 1, None],
    "train.threads": [0, 1, -1],
    "train.onednn": [True, False, "yes", 1, None],
    "train.init_from": [None, "/nonexistent/run", 5, "", ["a"]],
    "train.parallel": ["ddp", "fsdp", "zero", "", 1],
    "train.dist_timeout": [1800, 0.5, 0, -5, "x", True, ".inf", None],
    "train.dist_step_timeout": [300, 0.5, 0, -5, "x", True, ".inf", ".nan", None],
    "train.max_restarts": [0, 1, 3, -1, 101, 1.5, True, "x", None],
    "train.fsdp_param_dtype": ["auto", "bf16", "fp32", "fp16", "", 1, None],
    "train.activation_checkpointing": [False, True, "yes", None],
    "train.log_layers": [False, True, "yes", None],
    "train.log_layers_every": [0, 2, -1, 1.5],
    # a real tracker would write or log in; these are refused before that, or are empty
    "train.trackers": [[], ["nope"], ["tensorboard", "tensorboard"], 3, "[x"],
    "train.stall_margin": [0.1, 0, -0.1, ".nan", "x"],
    "train.stall_patience": [0.5, 0, 1, 1.5, -0.5],
    "train.stall_min_steps": [100, 0, -1, 1.5],
    "train.stop_stalled_after": [None, 300, 1, 0, -1, 1.5, True, "x"],
    "train.stop_stalled_margin": [0.05, 0.0, 0.2, -0.1, "x", None, True],
    "train.stop_stalled_every": [None, 100, 1, 0, -1, 1.5, True, "x"],
    "data.source": ["builtin", "/nonexistent/data", "", 3],
    "data.data_seed": [0, 1234, -1, 2**64, "x"],
    "data.verify": [True, False, "no"],
    "data.probe_mix": [0, 0.25, 1, -0.5],
    "data.probe_loss": ["all", "answers", "keys"],
    "recipe_exceptions": [{}, {"lr": 1}, "x", []],
}
assert set(POOLS) | {"model.method"} == set(valid_keys())
BAD_KEYS = ["model.d_modle", "model.head_dim", "model", "recipe", "model.validate",
            "__class__", "model.__dict__", "train.steps.x", "x", "", "model.", ".model",
            "model..d_model", "recipe.warmup_for", "data.source.x", "meta",
            "recipe_exceptions.lr", "seed.x", "Model.d_model", "model.d_model "]
ODD_VALUES: list[Any] = [None, "", "[", "{a", "]", "!!python/object:os.system", "1e999",
                         "\u00e9t\u00e9", "a\nb", [[1]], {"x": {"y": 1}}, True]

REGISTRY = load_all()

OUTCOMES: Counter[str] = Counter()


# ----------------------------------------------------------------------- strategies

def _value_for(key: str) -> st.SearchStrategy[Any]:
    pool = POOLS.get(key, [])
    return st.one_of(st.sampled_from(pool), st.sampled_from(ODD_VALUES)) if pool else \
        st.sampled_from(ODD_VALUES)


def _raw(value: Any) -> str:
    """How a value is written after ``--set key=``."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _plain_option(cls: Any, key: str) -> str:
    """A value of the option's type that is not at a limit (its default, or 2 / 0.5)."""
    default = cls.info()["options"][key]
    if isinstance(default, bool) or default is None:
        return {True: "true", False: "false", None: "null"}[default]
    if isinstance(default, int):
        return "2"
    if isinstance(default, float):
        return "0.5"
    return str(default)


@st.composite
def method_strings(draw: Any) -> str:
    """Names joined by '+': registered (with real, unknown or malformed options), unknown,
    duplicated, conflicting; sometimes mangled. A third are plain compositions of registered
    methods with plain options (most are accepted, the conflicting ones refused)."""
    names = sorted(REGISTRY)
    if draw(st.integers(0, 2)) == 0:
        terms = []
        for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=2)):
            cls = REGISTRY[name]
            keys = draw(st.lists(st.sampled_from(sorted(cls.info()["options"]) or [""]),
                                 max_size=1, unique=True))
            opts = ",".join(f"{k}={_plain_option(cls, k)}" for k in keys if k)
            terms.append(f"{name}({opts})" if opts else name)
        return "+".join(terms)
    terms = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.one_of(st.sampled_from(names), st.sampled_from(
            ["baseline", "qk_norm", "QKNorm", "", "post-ln", "x" * 3, "post_ln "])))
        cls = REGISTRY.get(name.strip())
        opts = []
        if draw(st.booleans()):
            real = list(cls.info()["options"]) if cls else []
            for _ in range(draw(st.integers(0, 2))):
                key = draw(st.sampled_from([*real, "bogus", "", "init init"]) if real
                           else st.sampled_from(["bogus", "", "scope"]))
                value = draw(st.sampled_from(["1e-4", "0", "-1", "2", "full", "head", "true",
                                              "null", ".nan", "[", "(a)", "a=b", "", "1,2",
                                              "hard", "all", "4"]))
                opts.append(draw(st.sampled_from([f"{key}={value}", key, f"{key}=="])))
            term = f"{name}({','.join(opts)})"
            term = draw(st.sampled_from([term, term, term[:-1], term + ")", term + "(x)"]))
        else:
            term = name
        terms.append(term)
    text = "+".join(terms)
    return draw(st.sampled_from([text, text, text, text + "+", " " + text, text.upper()]))


@st.composite
def set_items(draw: Any) -> list[str]:
    items = []
    keys = [*POOLS, "model.method"]
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["valid", "valid", "valid", "bad-key", "malformed"]))
        if kind == "malformed":
            items.append(draw(st.sampled_from(["", "=", "key", "=5", "a=b=c", "model.d_model",
                                               "model.d_model==64", "recipe.lr:=1"])))
            continue
        key = draw(st.sampled_from(keys if kind == "valid" else BAD_KEYS))
        value = draw(method_strings()) if key == "model.method" else draw(_value_for(key))
        items.append(f"{key}={_raw(value)}")
    return items


@st.composite
def config_trees(draw: Any) -> Any:
    """A YAML config tree: sections with valid and unknown keys, wrong types, nesting; or
    something that is not a mapping at all."""
    shape = draw(st.sampled_from(["tree"] * 6 + ["list", "scalar", "none", "int-keys"]))
    if shape == "list":
        return [1, {"model": {}}]
    if shape == "scalar":
        return draw(st.sampled_from(["model", 3, 1.5]))
    if shape == "none":
        return None
    if shape == "int-keys":
        return {1: 2, "model": {3: 4}}
    tree: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from([*POOLS, "model.method", *BAD_KEYS[:6]]),
                             max_size=5, unique=True)):
        value = draw(method_strings()) if key == "model.method" else draw(_value_for(key))
        section, _, leaf = key.partition(".")
        if leaf:
            sub = tree.setdefault(section, {})
            if isinstance(sub, dict):
                sub[leaf] = value
        else:
            tree[section] = value
    if draw(st.integers(0, 9)) == 0:  # a section given as a scalar or list
        tree[draw(st.sampled_from(["model", "recipe", "train", "data"]))] = \
            draw(st.sampled_from([3, "x", [1, 2], None]))
    return tree


# ----------------------------------------------------------------------- the property


@pytest.fixture(scope="module", autouse=True)
def _cli_built_once() -> Iterator[None]:
    """The CLI's typer command built once for the ~400 cases, each run on a fresh copy."""
    with cli_built_once():
        yield


def outcome(argv: list[str], out: Path, kind: str = "case") -> tuple[int, str]:
    """Run the command in process; check the contract; return (code, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with torch_threads(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = run_cli(argv)
    err = stderr.getvalue()
    assert "Traceback" not in err + stdout.getvalue(), err
    assert code in (0, 2, 3), (code, err)  # 3: the run diverged (checked below)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert not out.exists(), f"refused but left {sorted(out.rglob('*'))}"
        OUTCOMES[f"{kind} refused"] += 1
        return code, lines[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] in ("completed", "diverged", "stalled")
    assert code == (3 if summary["status"] in ("diverged", "stalled") else 0), (
        code, summary["status"])
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    assert (out / "config.yaml").is_file()
    if summary["status"] == "completed":
        load_checkpoint(out / "checkpoints" / "last.pt")
    OUTCOMES[f"{kind} accepted"] += 1
    return code, ""


@contextlib.contextmanager
def scratch() -> Any:
    d = Path(tempfile.mkdtemp(prefix="modbench-prop-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _settings(n: int) -> Any:
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _tree_case(tree: Any, mode: str = "") -> None:
    with scratch() as d:
        cfg = d / "c.yaml"
        cfg.write_text(yaml.safe_dump(tree))
        outcome([*BASE, *SMALL, "--config", str(cfg), "--out", str(d / "run")], d / "run",
                f"config tree{mode}")


def _set_case(items: list[str], mode: str = "") -> None:
    with scratch() as d:
        argv = [*BASE, *SMALL, *[x for item in items for x in ("--set", item)],
                "--out", str(d / "run")]
        outcome(argv, d / "run", f"--set items{mode}")


def _method_case(method: str, mode: str = "") -> None:
    with scratch() as d:
        outcome([*BASE, *SMALL, "--method", method, "--out", str(d / "run")], d / "run",
                f"method string{mode}")


@_settings(EXAMPLES["tree"])
@given(tree=config_trees())
def test_random_config_trees(tree: Any) -> None:
    _tree_case(tree)


@_settings(EXAMPLES["set"])
@given(items=set_items())
def test_random_set_items(items: list[str]) -> None:
    _set_case(items)


@_settings(EXAMPLES["method"])
@given(method=method_strings())
def test_random_method_strings(method: str) -> None:
    _method_case(method)


@pytest.mark.parametrize("text", [b"model: {d_model: [", b"\xff\xfe not utf-8", b"- 1\n- 2",
                                  b"model:\n  d_model: 64\n  d_model: 32", b"", b"42"])
def test_config_files_that_are_not_config_trees(text: bytes, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(text)
    outcome([*BASE, "--config", str(cfg), "--out", str(tmp_path / "run")], tmp_path / "run",
            "config file")


@pytest.mark.parametrize("argv,needle", [
    (["--set", "model.head_dim=4"], "unknown config key 'model.head_dim'"),
    (["--set", "model.n_heads=0"], "model.n_heads must be positive"),
    (["--set", "recipe.lr=["], "not valid YAML"),
    (["--set", "recipe.betas=[a, b]"], "pair of numbers"),
    (["--set", "recipe.betas=[2, 3]"], "recipe.betas[0] must be in [0, 1)"),
    (["--set", "recipe.eps=-1"], "recipe.eps must be at least 0"),
    (["--set", "train.device=banana"], "train.device must be"),
    (["--set", "data.data_seed=-1"], "data.data_seed must be an integer in [0, 2**63)"),
    (["--set", "train.eval_sequences=0"], "train.eval_sequences must be at least 1"),
    (["--set", "preset=nope"], "unknown preset 'nope'"),
    (["--seed", "99999999999999999999"], "seed must be an integer"),
    (["--method", "qknorm(scope=[)"], "cannot be read"),
    (["--set", "model.method=a\nb"], "cannot read method term"),
])
def test_what_the_properties_found_is_refused_in_one_line(argv: list[str], needle: str,
                                                          tmp_path: Path) -> None:
    """Inputs that crashed with a traceback (or, for a negative data seed or zero
    validation sequences, crashed mid-run leaving a half-written folder) before this
    change."""
    code, line = outcome([*BASE, *argv, "--out", str(tmp_path / "run")], tmp_path / "run",
                         "regression")
    assert code == 2 and needle in line, line


@pytest.mark.parametrize("method", ["powernorm(groups=-1)", "sigmoid(n=0)", "sigmoid(n=-1)"])
def test_non_positive_method_options_are_refused(method: str, tmp_path: Path) -> None:
    """Found by the method-string property (they crashed with a RuntimeError or a math
    domain error): PowerNorm's and Sigmoid attention's ``configure`` refuse them now."""
    code, line = outcome([*BASE, "--method", method, "--out", str(tmp_path / "run")],
                         tmp_path / "run")
    assert code == 2 and "must be at least 1" in line, line


LONG = max(1, long_points() // 30)  # the long run: this many times the examples


@long_variant
@_settings(EXAMPLES["tree"] * LONG)
@given(tree=config_trees())
def test_random_config_trees_long(tree: Any) -> None:
    _tree_case(tree, " (long)")


@long_variant
@_settings(EXAMPLES["set"] * LONG)
@given(items=set_items())
def test_random_set_items_long(items: list[str]) -> None:
    _set_case(items, " (long)")


@long_variant
@_settings(EXAMPLES["method"] * LONG)
@given(method=method_strings())
def test_random_method_strings_long(method: str) -> None:
    _method_case(method, " (long)")


def test_record_bad_config_figures(record: Any) -> None:
    """Runs last in this module: how many inputs were tried and how they came out."""
    record({"examples": {k: v for k, v in sorted(OUTCOMES.items()) if "(long)" not in k}})
    for kind in ("config tree", "--set items", "method string"):
        assert OUTCOMES[f"{kind} accepted"] and OUTCOMES[f"{kind} refused"], kind


@long_variant
def test_record_bad_config_figures_long(record: Any) -> None:
    record({"examples": {k: v for k, v in sorted(OUTCOMES.items()) if "(long)" in k}})
    for kind in ("config tree", "--set items", "method string"):
        assert OUTCOMES[f"{kind} (long) accepted"], kind
