"""``modbench export --hf``: a self-contained Hugging Face checkpoint.

The export must load with ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``
where modbench is not installed and give modbench's own logits; its tokenizer must encode as
modbench's does; its model card must state the run and, for a run of a study, the study's
verdict; ``--push-to-hub`` must upload it through huggingface_hub.

"Where modbench is not installed" is a fresh virtual environment (``python -m venv``) into
whose site-packages only torch, transformers and the packages they require are linked (the
requirement closure read from their installed metadata), run with a clean environment.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from modbench.cli import run_cli
from modbench.config import dump_yaml
from modbench.errors import ModbenchError
from modbench.eval import hf_bundle
from modbench.eval.export import export_hf, push_to_hub
from modbench.eval.run import load_run
from modbench.methods import parse_methods
from modbench.methods.build import build_model
from modbench.runtime.checkpoint import save_checkpoint
from modbench.runtime.data import open_data
from modbench.train.trainer import train
from tests.helpers import tiny

TEXT = "Return the number of items in a container."

# Structurally different methods for the test without modbench: attention (qknorm, diff_attn),
# a multi-lane residual stream (hyper_connections), cross-layer mixing (denseformer), a
# non-persistent buffer (value_residual), the whole architecture (ngpt, tokenformer), and a
# placement composed with an architecture change (post_ln+comt).
BARE_METHODS = ("baseline", "qknorm", "diff_attn", "hyper_connections", "denseformer",
                "value_residual", "ngpt", "tokenformer", "post_ln+comt")


def make_run(folder: Path, method: str) -> tuple[Path, torch.nn.Module]:
    """A run folder of ``method`` on the tiny preset whose weights are the initial ones plus
    noise, so that every parameter (zero-initialised gates too) shapes the logits."""
    cfg = tiny(method)
    model = build_model(cfg.model, seed=1)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(dump_yaml(cfg))
    save_checkpoint(folder / "checkpoints" / "last.pt", {"model": model.state_dict(), "step": 0})
    return folder, model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "run"
    train(tiny("qknorm", 0, 4), out, progress=False)
    return out


# ------------------------------------------------------------------ in this environment


# Every registered method exports with equal logits: the conformance kit's export check
# (modbench.conformance.kit), run on every method by tests/methods/test_registry.py on the
# method's trained tiny run: the decoder loaded is the export's bundled copy
# (transformers_modules...modbench_model_transformer), the logits modbench's within 1e-6.


def test_bundle_is_what_transformers_copies_and_imports_nothing_else(trained: Path,
                                                                     tmp_path: Path) -> None:
    """transformers' own resolver, from ``modeling_modbench.py``, reaches exactly the bundled
    files, and its own import scan finds nothing but torch, transformers, yaml and the
    standard library in any of them (what it checks before loading code from the Hub)."""
    from transformers.dynamic_module_utils import get_imports, get_relative_import_files

    out = export_hf(trained, tmp_path / "hf")
    reached = {Path(f).name for f in get_relative_import_files(str(out / "modeling_modbench.py"))}
    shipped = {p.name for p in out.glob("*.py")} - {"modeling_modbench.py"}
    assert reached == shipped
    assert {"modbench_model_transformer.py", "modbench_methods_qknorm.py",
            "configuration_modbench.py"} <= shipped
    for f in out.glob("*.py"):
        outside = [m for m in get_imports(str(f)) if m not in sys.stdlib_module_names]
        assert set(outside) <= {"torch", "transformers", "yaml"}, (f.name, outside)
        assert "modbench" not in outside


def test_config_tokenizer_and_generation(trained: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    out = export_hf(trained, tmp_path / "hf")
    cfg, model, _ = load_run(trained)
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert config.model_type == "modbench" == json.loads((out / "config.json").read_text())[
        "model_type"]
    assert config.modbench["method"] == cfg.model.method == "qknorm"
    (parsed,) = parse_methods(cfg.model.method)
    assert config.modbench_methods == [{"name": "qknorm", "options": asdict(parsed.opts)}]
    data = open_data(cfg, progress=False)
    want = data.tokenizer().encode(TEXT).ids
    tok = PreTrainedTokenizerFast.from_pretrained(out)  # no remote code, no config read
    assert tok(TEXT).input_ids == want
    assert tok.eos_token_id == data.eos_id and tok.decode(want) == TEXT
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = torch.tensor([want[:8]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-6)
        got = hf.generate(ids, max_new_tokens=6, do_sample=False)
        greedy = ids
        for _ in range(6):  # greedy decoding with modbench's own model
            greedy = torch.cat([greedy, model(greedy)[:, -1].argmax(-1, keepdim=True)], 1)
    assert got.tolist() == greedy.tolist()


def test_refusals_leave_nothing(trained: Path, tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("")
    assert run_cli(["export", str(trained), "--hf", str(tmp_path / "x")]) == 2
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["keep"]
    assert run_cli(["export", str(tmp_path / "nope"), "--hf", str(tmp_path / "y")]) == 2
    assert run_cli(["export", str(trained), "--hf", str(tmp_path / "z"),
                    "--push-to-hub", "a/b/c"]) == 2
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no temporary folder left


def test_push_without_token_is_refused_before_exporting(trained: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str],
                                                        ) -> None:
    import huggingface_hub.constants as hc

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    capsys.readouterr()
    assert run_cli(["export", str(trained), "--hf", str(tmp_path / "hf"),
                    "--push-to-hub", "alice/m"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a token" in err and "\n" not in err
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------ the model card


def test_card_states_the_run(trained: Path, tmp_path: Path) -> None:
    out = export_hf(trained, tmp_path / "hf", repo_id="alice/m")
    card = (out / "README.md").read_text()
    cfg, _, _ = load_run(trained)
    summary = json.loads((trained / "summary.json").read_text())
    meta = yaml.safe_load((trained / "config.yaml").read_text())["meta"]
    head = yaml.safe_load(card.split("---")[1])
    assert head["library_name"] == "transformers" and "qknorm" in head["tags"]
    for fact in ("`qknorm`", cfg.recipe.name, f"lr {cfg.recipe.lr:g}", "`builtin`",
                 meta["data"]["fingerprint"], f"init {cfg.seed}, data {cfg.data.data_seed}",
                 f"{summary['steps']:,} of {summary['steps_planned']:,}",
                 f"{summary['tokens']:,}", f"{summary['final_val_loss']:.4f}",
                 "not part of a study", "from_pretrained('alice/m', trust_remote_code=True)"):
        assert fact in card, fact


def test_card_states_the_study_verdict(tmp_path: Path) -> None:
    """A run in a study folder: the card gives the verdict the study's own results give its
    method, and whether the study's claim predicted it."""
    from modbench.study.reporting import write_study_report
    from modbench.study.results import load_results
    from tests.study.test_study import fake_study

    (tmp_path / "study").mkdir()
    folder = fake_study(tmp_path / "study")
    tree = yaml.safe_load((folder / "spec.yaml").read_text())
    tree["claim"] = {"source": "a paper", "text": "qknorm helps",
                     "expect": {"qknorm": ["improver"], "post_ln": ["degrader"],
                                "layerscale": ["within_noise"]}}
    (folder / "spec.yaml").write_text(yaml.safe_dump(tree))
    run, _ = make_run(folder / "runs" / "qknorm-0", "qknorm")
    out = tmp_path / "hf"
    export_hf(run, out)
    assert "No verdict yet" in (out / "README.md").read_text()  # no report written yet
    write_study_report(folder)
    (want,) = [r for r in load_results(folder).comparisons["tiny"] if r.method == "qknorm"]
    export_hf(run, tmp_path / "hf2")
    card = (tmp_path / "hf2" / "README.md").read_text()
    assert f"at scale `tiny`: **{want.verdict}**" in card
    agrees = "agrees with" if want.verdict == "improver" else "does not agree with"
    assert f"the verdict {agrees} it" in card and "qknorm helps" in card
    assert f"| seeds (method / baseline) | {want.n} / {want.floor.n} |" in card


# ------------------------------------------------------------------ the bundler itself

MODULE = textwrap.dedent('''\
    from __future__ import annotations

    from typing import TYPE_CHECKING

    from modbench.model.spec import (
        ModelSpec,
        Parts,
    )

    if TYPE_CHECKING:
        from modbench.train.trainer import Trainer


    def later():
        import modbench.methods as pkg
        return pkg


    def rope():
        from modbench.model.rope import rope_tables
        return rope_tables
''')


def test_rewrite_keeps_every_line_and_runs_as_a_package(tmp_path: Path) -> None:
    src = hf_bundle._Source("modbench.fake", tmp_path / "fake.py", MODULE)
    assert {(i.target, i.when) for i in src.imports} == {
        ("modbench.model.spec", "load"), ("modbench.train.trainer", "never"),
        ("modbench.methods", "call"), ("modbench.model.rope", "call")}
    text = hf_bundle._rewrite(src, {"modbench.model.spec", "modbench.model.rope"})
    old, new = MODULE.splitlines(), text.splitlines()
    assert len(new) == len(old)
    changed = {i: (a, b) for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b}
    assert changed[4][1] == "from .modbench_model_spec import ("
    assert new[5:8] == old[5:8]  # the names and the closing parenthesis stay as they were
    assert new[10] == "    pass"
    assert new[14].startswith("    raise ImportError(") and "modbench.methods" in new[14]
    assert new[19] == "    from .modbench_model_rope import rope_tables"
    assert set(changed) == {4, 10, 14, 19}
    # the rewritten module runs as a package of flat files
    pkg = tmp_path / "flatpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(text)
    (pkg / "modbench_model_spec.py").write_text("ModelSpec = Parts = object\n")
    (pkg / "modbench_model_rope.py").write_text("def rope_tables():\n    return 1\n")
    code = ("import flatpkg.mod as m\nassert m.rope()() == 1\ntry:\n    m.later()\n"
            "except ImportError as e:\n    print(e)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "modbench.methods is not part of this exported model" in res.stdout


@pytest.mark.parametrize(("source", "message"), [
    ("import modbench.model.spec as spec\n", "imports module modbench.model.spec as a whole"),
    ("from modbench import errors\n", "imports names from package modbench"),
])
def test_unsupported_import_forms_are_refused(source: str, message: str,
                                              tmp_path: Path) -> None:
    with pytest.raises(ModbenchError, match=re.escape(message)):
        src = hf_bundle._Source("modbench.fake", tmp_path / "fake.py", source)
        hf_bundle._rewrite(src, {"modbench.model.spec"})


def test_heavy_imports_are_refused() -> None:
    hf_bundle._check("ok.py", "import math\nimport torch\nimport yaml\n", {"ok.py"})
    with pytest.raises(ModbenchError, match=r"imports scipy \(x.py line 2\)"):
        hf_bundle._check("x.py", "import torch\nfrom scipy import stats\n", {"x.py"})
    with pytest.raises(ModbenchError, match="not in the bundle"):
        hf_bundle._check("x.py", "from .missing import y\n", {"x.py"})


def test_importing_from_a_package_init_is_refused(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A package's ``__init__`` is not bundled, so a module that needs a name from one on
    import cannot be."""
    fake = hf_bundle._Source("modbench.fake", tmp_path / "fake.py",
                             "from modbench.methods import REGISTRY\n")
    real = hf_bundle._Source.of
    monkeypatch.setattr(hf_bundle._Source, "of", classmethod(
        lambda cls, m: fake if m == "modbench.fake" else real(m)))
    with pytest.raises(ModbenchError, match=r"imports from package modbench\.methods"):
        hf_bundle._closure(["modbench.fake"])


# ------------------------------------------------------------------ without modbench


def _requirement_closure(roots: tuple[str, ...]) -> dict[str, Any]:
    """The installed distributions ``roots`` need, by normalized name (no extras)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        dist = md.distribution(name)
        found[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh venv with only torch, transformers and their requirements."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    res = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                         capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        pytest.skip(f"cannot create a virtual environment: {res.stderr.strip()[-200:]}")
    (site,) = venv.glob("lib/python*/site-packages")
    for dist in _requirement_closure(("torch", "transformers")).values():
        base = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files or []
                if f.parts[0] not in ("..", "__pycache__") and not f.parts[0].endswith(".pth")}
        for top in tops:
            if not (site / top).exists():
                os.symlink(base / top, site / top)
    return venv / "bin" / "python"


BARE_SCRIPT = textwrap.dedent('''\
    import importlib.util, json, sys
    import torch
    assert importlib.util.find_spec("modbench") is None, "modbench is importable"
    assert importlib.util.find_spec("scipy") is None, "not a bare environment"
    from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast)
    jobs = json.loads(sys.argv[1])
    out = {}
    for name, path in jobs.items():
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        fast = PreTrainedTokenizerFast.from_pretrained(path)
        ids = torch.load(path + "/../ids.pt")
        with torch.no_grad():
            logits = model(ids).logits
        out[name] = {"logits": logits, "tok": tok(%(text)r).input_ids,
                     "fast": fast(%(text)r).input_ids, "type": type(model).__module__}
    out["modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "modbench")
    torch.save(out, sys.argv[2])
''') % {"text": TEXT}


def test_export_loads_without_modbench(bare_python: Path, tmp_path: Path) -> None:
    """In a fresh venv without modbench: each export loads, its tokenizer loads (with the
    flag and as a plain PreTrainedTokenizerFast) and encodes as modbench does, transformers
    does not warn about the config, and the logits are modbench's (float32, CPU)."""
    jobs, models = {}, {}
    gen = torch.Generator().manual_seed(5)
    for method in BARE_METHODS:
        folder = tmp_path / method.replace("+", "_")
        run, model = make_run(folder / "run", method)
        ids = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=gen)
        torch.save(ids, folder / "ids.pt")
        jobs[method] = str(export_hf(run, folder / "hf"))
        models[method] = (model, ids)
    home = tmp_path / "home"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "HF_HOME": str(home / "hf"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    res = subprocess.run([str(bare_python), "-c", BARE_SCRIPT, json.dumps(jobs),
                          str(tmp_path / "out.pt")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "You are using a model of type" not in res.stderr
    assert "trust_remote_code" not in res.stderr  # no prompt, no warning about it
    got = torch.load(tmp_path / "out.pt")
    assert got["modules"] == []
    cfg = tiny()
    want_ids = open_data(cfg, progress=False).tokenizer().encode(TEXT).ids
    worst = 0.0
    for method, (model, ids) in models.items():
        r = got[method]
        assert r["type"].startswith("transformers_modules.")
        assert r["tok"] == r["fast"] == want_ids
        with torch.no_grad():
            want = model(ids)
        torch.testing.assert_close(r["logits"], want, rtol=0, atol=1e-6)
        worst = max(worst, (r["logits"] - want).abs().max().item())
    print(f"largest |logit difference| over {len(models)} methods: {worst:.3g}")


# ------------------------------------------------------------------ --push-to-hub


class _Hub(BaseHTTPRequestHandler):
    """The few Hub API routes an upload of regular (non-LFS) files uses; it records every
    request and the files of each commit."""

    requests: list[tuple[str, str, dict[str, str]]] = []  # noqa: RUF012
    files: dict[str, bytes] = {}  # noqa: RUF012

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.requests.append(("POST", self.path, dict(self.headers)))
        host = f"http://{self.headers['Host']}"
        if self.path == "/api/repos/create":
            req = json.loads(body)
            repo = f"{req['organization']}/{req['name']}" if req.get("organization") \
                else req["name"]
            return self._reply({"url": f"{host}/{repo}"})
        if self.path == "/api/validate-yaml":
            return self._reply({"warnings": []})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._reply({"files": [{"path": f["path"], "uploadMode": "regular",
                                           "shouldIgnore": False} for f in files]})
        if "/commit/" in self.path:
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(
                        item["value"]["content"])
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            return self._reply({"commitUrl": f"{host}/{repo}/commit/{'a' * 40}",
                                "commitOid": "a" * 40, "pullRequestUrl": None})
        self.send_error(404)
        return None


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import huggingface_hub.constants as hc

    _Hub.requests, _Hub.files = [], {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)  # conftest sets offline mode
    monkeypatch.setattr(hc, "ENDPOINT", url)  # what HF_ENDPOINT sets
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


def test_push_to_hub_uploads_the_folder(trained: Path, tmp_path: Path, hub: str) -> None:
    """huggingface_hub's own client (create_repo, upload_folder) against a local stub of the
    Hub: every file of the export arrives byte for byte, in one commit, with the token. (The
    stub asks for every file inline, "regular"; the LFS / Xet upload of large files that the
    real Hub asks for is not exercised here.)"""
    out = tmp_path / "hf"
    assert run_cli(["export", str(trained), "--hf", str(out), "--push-to-hub", "alice/m"]) == 0
    sent = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.iterdir()}
    assert _Hub.files == sent
    paths = [p for _, p, _ in _Hub.requests]
    assert paths[0] == "/api/repos/create"
    assert sum("/commit/" in p for p in paths) == 1
    assert paths[-1] == "/api/models/alice/m/commit/main"
    assert [{k.lower(): v for k, v in h.items()}.get("authorization") for _, _, h in
            _Hub.requests] == ["Bearer hf_test_token"] * len(paths), _Hub.requests
    assert "from_pretrained('alice/m', trust_remote_code=True)" in sent["README.md"].decode()
    # and the function, with an explicit endpoint and token
    _Hub.files = {}
    url = push_to_hub(out, "bob/m", token="hf_other", endpoint=hub)
    assert url.endswith("/bob/m/commit/" + "a" * 40) and _Hub.files == sent
    assert {k.lower(): v for k, v in _Hub.requests[-1][2].items()}["authorization"] == \
        "Bearer hf_other"
