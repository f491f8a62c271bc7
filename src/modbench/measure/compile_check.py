"""``modbench bench --compile-check``: how many graphs ``torch.compile`` makes of each method's
training forward, with its graph breaks (and why) and its recompiles.

A graph break inside the block loop is silent: Dynamo compiles the pieces around it and runs
the rest eagerly, so a compiled GPU step can run near eager speed with no warning (issue 28,
"One graph"). This check makes it visible, per method and per activation-checkpointing mode.

What is traced is the trainer's forward (:func:`modbench.runtime.loss.micro_loss`:
``model(idx, with_aux=True, loss=True)`` in training mode, fp32 unless ``bf16``), built at a
preset (``tiny`` by default: 2 layers, so a method's per-layer code is seen in a first and a
later block). The backend only records the FX graphs Dynamo hands it and returns
``gm.forward``: no code is generated, so a method takes a second or two, not the minutes of
Inductor. Counted (:class:`CompileRow`):

- ``graphs``: the graphs compiled by the first call;
- ``graph_breaks``: the graph breaks Dynamo took on that call, one for each record on its
  ``graph_breaks`` log (so a break that left an empty graph counts too, and so does a break
  inside a loop or a checkpointed block, after which Dynamo runs the whole frame eagerly and
  compiles only the small functions it calls), with ``reasons``: each distinct reason's first
  line and the user code line (``file:line``) where it broke;
- ``recompiles``: graphs compiled by two more calls, each on another batch **of the same
  shape** (new token values) and one optimizer step later (the steps are told to the model as
  the trainer's step callback tells them: ``modbench_set_step``, mid-run). A trainer's steps
  all have one shape, so anything recompiled here (a guard on a Python value the forward or
  the step schedule changed, a ``self.layer`` guard over the recompile limit) recompiles as
  training goes on; two later calls tell a one-off recompile (1) from one at every step (2).

A method that cannot be traced whole says so (``Method.compile_graph_breaks``, shown by
``modbench methods``); its rows carry that note as ``expected``. Activation checkpointing is
applied by the trainer's own function, passed in by the caller
(``modbench.train.recompute.apply_activation_checkpointing``; this layer cannot import it);
a method it refuses (a forward that updates buffers) gets a row with ``graphs`` None and the
refusal in ``note``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.methods._common import set_step
from modbench.methods.build import plan

#: ``(model, method) -> ...``: makes the model's blocks recompute their activations in the
#: backward (``modbench.train.recompute.apply_activation_checkpointing``, passed in).
Checkpointing = Callable[..., Any]

#: the calls after the first, each a later optimizer step on a new batch of the same shape
LATER_STEPS = 2

#: the rows' keys, in the order the JSON and the table give them
ROW_KEYS = ("method", "checkpointing", "graphs", "graph_breaks", "recompiles", "reasons",
            "expected", "note")


@dataclass
class CompileRow:
    """One method in one checkpointing mode (the module docstring says what is counted)."""

    method: str
    checkpointing: bool
    graphs: int | None
    graph_breaks: int | None
    recompiles: int | None
    reasons: list[str] = field(default_factory=list)
    expected: str = ""  # the method's declared reason for breaking (compile_graph_breaks)
    note: str = ""  # why nothing was counted (checkpointing refused, compilation failed)
    seconds: float = 0.0

    @property
    def one_graph(self) -> bool:
        """One graph, no break and no recompile."""
        return self.graphs == 1 and self.graph_breaks == 0 and self.recompiles == 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: d[k] for k in (*ROW_KEYS, "seconds")}


def _where(filename: str, lineno: int) -> str:
    """``modbench/methods/softcap.py:118``: the path from the package folder on, or the
    file's name outside it."""
    name = filename.replace("\\", "/")
    cut = name.rfind("/modbench/")
    return f"{name[cut + 1:] if cut >= 0 else name.rsplit('/', 1)[-1]}:{lineno}"


class _Recorder:
    """A Dynamo backend that counts the graphs it is given and runs each as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return gm.forward


_BREAK_AT = re.compile(r"in user code at (.+?):(\d+)")
_FRAME_SKIPPED = re.compile(r"frame skipped: (\w+) \((.+?) line (\d+)\)")
# lines of a record that wrap the reason rather than give it
_SKIP_LINES = ("Failed to handle graph break gracefully", "Graph break encountered",
               "Encountered graph break when attempting to trace")


def break_reason(message: str) -> str:
    """One graph-break log record of Dynamo (the ``graph_breaks`` artifact) as one line:
    the reason's first line and where in the user's code it broke (``file:line``, from the
    package folder on), plus the frame Dynamo then ran eagerly where it gave up on a whole
    frame (a break inside a loop or a checkpointed block)."""
    where = ""
    m = _BREAK_AT.search(message)
    if m:
        where = f" ({_where(m.group(1), int(m.group(2)))})"
    _, _, after = message.partition("Graph Break Reason:")
    lines = [line.strip() for line in (after or message).splitlines() if line.strip()]
    first = next((line for line in lines if not line.startswith(_SKIP_LINES)), "")
    skipped = _FRAME_SKIPPED.search(message)
    if skipped:
        name, file, line = skipped.groups()
        return f"{first}{where}; {name} ({_where(file, int(line))}) run eagerly"
    return first + where


class _BreakLog(logging.Handler):
    """Collects Dynamo's graph-break records (one a break, logged at DEBUG on the
    ``graph_breaks`` artifact logger) while :func:`_breaks_logged` is active."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _breaks_logged() -> Iterator[_BreakLog]:
    """Route Dynamo's graph-break records to a :class:`_BreakLog` (not to stderr), and keep
    Dynamo's other warnings (``.item()``, checkpointing under compile) off stderr: the rows
    report them."""
    handler = _BreakLog()
    artifact = torch._logging.getArtifactLogger("torch._dynamo.symbolic_convert",
                                                "graph_breaks")
    quiet = [logging.getLogger(n) for n in ("torch._dynamo", "torch._logging",
                                            "torch._higher_order_ops", "torch.utils.checkpoint")]
    saved = ([(lg, lg.level) for lg in (artifact, *quiet)], artifact.propagate)
    artifact.setLevel(logging.DEBUG)
    artifact.propagate = False
    artifact.addHandler(handler)
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        yield handler
    finally:
        artifact.removeHandler(handler)
        artifact.propagate = saved[1]
        for lg, level in saved[0]:
            lg.setLevel(level)


def _distinct(reasons: Iterable[str]) -> list[str]:
    """Reasons in order of first appearance, a repeated one once with ``(xN)``."""
    counts: dict[str, int] = {}
    for r in reasons:
        counts[r] = counts.get(r, 0) + 1
    return [r if n == 1 else f"{r} (x{n})" for r, n in counts.items()]


def declared_breaks(method: str) -> str:
    """The method's declared reason for graph breaks (``Method.compile_graph_breaks`` of each
    term, ``name: why`` joined by ``; ``), empty when it declares none."""
    from modbench.methods.base import MethodSpec

    return "; ".join(f"{m.name}: {m.compile_graph_breaks}"
                     for m in MethodSpec.parse(method).methods if m.compile_graph_breaks)


def check_method(method: str, *, preset: str = "tiny", checkpointing: bool = False,
                 apply_checkpointing: Checkpointing | None = None, batch: int = 2,
                 bf16: bool = False, device: str | torch.device = "cpu") -> CompileRow:
    """Trace one method's training forward as the module docstring says and count its graphs,
    graph breaks and recompiles. ``checkpointing`` applies ``apply_checkpointing`` (the
    trainer's, required then) to the model first. Raises :class:`ModbenchError` for an
    unknown method or preset."""
    if checkpointing and apply_checkpointing is None:
        raise ModbenchError("the compile check with checkpointing needs the trainer's "
                            "checkpointing function (modbench bench passes it)")
    cfg = resolve(preset, method=method)
    p = plan(cfg.model)
    label = p.method
    expected = declared_breaks(label)
    start = time.perf_counter()
    model = p.build(seed=0, device=device).train()
    if checkpointing:
        assert apply_checkpointing is not None
        try:
            apply_checkpointing(model, label)
        except ModbenchError as e:
            return CompileRow(label, True, None, None, None, expected=expected,
                              note="checkpointing refused: "
                              + str(e).split("': ", 1)[-1].split("; set ")[0])
    gen = torch.Generator().manual_seed(0)
    shape = (batch, cfg.train.seq_len)
    batches = [torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device)
               for _ in range(1 + LATER_STEPS)]
    mid = cfg.train.steps // 2  # a step mid-run, where step schedules (PRepBN's) move
    recorder = _Recorder()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recorder)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)
    graphs, breaks = 0, []
    try:
        with _breaks_logged() as log, autocast:
            for i, idx in enumerate(batches):
                set_step(model, mid + i, cfg.train.steps)  # what the trainer's callback does
                compiled(idx, with_aux=True, loss=True)
                if i == 0:
                    graphs, breaks = recorder.graphs, list(log.messages)
    except torch._dynamo.exc.TorchDynamoException as e:  # a failure, not a graph break
        why = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        return CompileRow(label, checkpointing, None, None, None, expected=expected,
                          note=f"compile failed: {type(e).__name__}: {why}",
                          seconds=time.perf_counter() - start)
    finally:
        torch._dynamo.reset()
    recompiles = recorder.graphs - graphs
    return CompileRow(label, checkpointing, graphs, len(breaks), recompiles,
                      _distinct(break_reason(b) for b in breaks), expected=expected,
                      seconds=time.perf_counter() - start)


def run_compile_check(methods: list[str], *, preset: str = "tiny",
                      modes: tuple[bool, ...] = (False, True),
                      apply_checkpointing: Checkpointing | None = None, bf16: bool = False,
                      device: str | torch.device = "cpu", progress: bool = True,
                      ) -> list[CompileRow]:
    """:func:`check_method` for every method in every checkpointing mode of ``modes``, in that
    order, with a progress bar over the methods. Unknown methods are refused before any is
    traced."""
    from modbench.methods.base import MethodSpec

    if not methods:
        raise ModbenchError("no method to check; give --methods a,b or --methods all")
    resolve(preset)  # an unknown preset fails before the first method
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModbenchError(f"--device must be cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModbenchError(f"--device {device}: no CUDA device is available here; use "
                            "--device cpu") from None
    for m in methods:
        MethodSpec.parse(m)
    rows = []
    bar = tqdm(methods, desc="compile check", unit="method", disable=not progress)
    for m in bar:
        bar.set_postfix_str(m)
        for mode in modes:
            rows.append(check_method(m, preset=preset, checkpointing=mode,
                                     apply_checkpointing=apply_checkpointing, bf16=bf16,
                                     device=device))
    return rows


def summary(rows: list[CompileRow]) -> str:
    """One line: how many methods give one graph, no break and no recompile in every mode
    checked (and in every mode they could run, where checkpointing was refused), which are
    declared to break, and which break without declaring why."""
    by: dict[str, list[CompileRow]] = {}
    for r in rows:
        by.setdefault(r.method, []).append(r)
    every = [m for m, rs in by.items() if all(r.one_graph for r in rs)]
    traced = [m for m, rs in by.items() if m not in every
              and any(r.graphs is not None for r in rs)
              and all(r.one_graph for r in rs if r.graphs is not None)]
    undeclared = [m for m, rs in by.items()
                  if not rs[0].expected and any(r.graphs is not None and not r.one_graph
                                                for r in rs)]
    declared = [m for m, rs in by.items() if rs[0].expected]
    text = f"{len(every)} of {len(by)} methods: 1 graph, 0 breaks, 0 recompiles in every mode"
    if traced:
        text += f"; in every mode they run (checkpointing refused): {', '.join(traced)}"
    if declared:
        text += f"; declared to break: {', '.join(declared)}"
    return text + f"; breaking undeclared: {', '.join(undeclared) if undeclared else 'none'}"


def table_rows(rows: list[CompileRow]) -> list[list[str]]:
    """The table's cells: method, checkpointing, graphs, breaks, recompiles, reasons (the
    declared reason, or the refusal, where there is one)."""
    def num(v: int | None) -> str:
        return "-" if v is None else str(v)

    out = []
    for r in rows:
        why = "; ".join(r.reasons)
        if r.expected and not r.one_graph:  # the declared reason: `modbench methods`
            why = f"expected: {why}" if why else "expected"
        if r.note:
            why = r.note
        out.append([r.method, "yes" if r.checkpointing else "no", num(r.graphs),
                    num(r.graph_breaks), num(r.recompiles), why])
    return out


TABLE_HEADERS = ["method", "ckpt", "graphs", "breaks", "recompiles", "reasons"]
