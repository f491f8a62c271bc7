"""Offline capability probes (no network): held-out sets and greedy scoring.

- **mqar** and **induction**: synthetic rows (``modbench.data.synthetic``) from the ``eval``
  RNG stream, which training never draws from. One item per row; its score is the fraction
  of the row's queried positions predicted correctly (chance: 1/64 for mqar, 1/V induction).
  mqar also reports ``guess``: the accuracy of guessing uniformly among the values present
  in the query's episode (about 1/n for n pairs), which needs no key matching. Recall is
  shown by accuracy above ``guess``, not merely above ``chance``.
- **cloze**: last-word cloze on held-out built-in text (LAMBADA-like): a passage of a
  validation document ending right before a word of 3+ letters; the item is correct (1) when
  greedy prediction reproduces every token of that word, else 0.

``accuracy`` is the mean item score; per-item results are kept for paired statistics.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from modbench.data.synthetic import NAMESPACE, pools, probe_rng, synthetic_row
from modbench.runtime.callback import Callback, TrainingRun


@dataclass
class ProbeSet:
    """Rows to feed the model and, per item, the positions whose prediction is scored.

    ``tokens`` is ``(N, T)``; item ``i`` is scored at ``positions[i]`` (indices into the row
    at which the *next* token is predicted) against ``targets[i]``. One row may hold several
    items (mqar, induction: one item per row, scored on all its query positions).
    """

    name: str
    tokens: torch.Tensor
    rows: list[int]
    positions: list[list[int]]
    targets: list[list[int]]
    chance: float
    guess: float | None = None  # accuracy of a content-free in-episode guess (mqar only)

    def __len__(self) -> int:
        return len(self.rows)


def synthetic_set(kind: str, n: int, vocab_size: int, seq_len: int, seed: int = 0,
                  namespace: str = "eval") -> ProbeSet:
    rows, pos, tgt = [], [], []
    for i in range(n):
        r, p, t = synthetic_row(kind, vocab_size, seq_len, probe_rng(namespace, kind, seed, i))
        rows.append(r)
        pos.append(p)
        tgt.append(t)
    if kind == "mqar":
        chance = 1.0 / len(pools(vocab_size, seq_len)[1])
        guess = float(np.mean([in_episode_guess(r, p) for r, p in zip(rows, pos, strict=True)]))
    else:
        chance, guess = 1.0 / vocab_size, None
    return ProbeSet(kind, torch.from_numpy(np.stack(rows)), list(range(n)), pos, tgt, chance,
                    guess)


def in_episode_guess(row: np.ndarray, positions: list[int], eos_id: int = 0) -> float:
    """Expected score of an mqar row for a guesser that picks uniformly among the distinct
    values stored in the query's episode (``EOS k1 v1 … kn vn`` + queries) without matching
    the key: the mean over queries of 1/(distinct values of its episode)."""
    starts = np.flatnonzero(np.asarray(row) == eos_id)
    out = []
    for p in positions:
        s = int(starts[starts <= p].max())
        end = starts[starts > s]
        ep = row[s + 1: int(end[0]) if len(end) else len(row)]
        n = len(ep) // 4
        out.append(1.0 / len(set(ep[1:2 * n:2].tolist())))
    return float(np.mean(out))


_WORD = re.compile(r"[A-Za-z]{3,}")


def cloze_set(tokenizer: object, documents: Sequence[str], seq_len: int, n: int,
              seed: int = 0) -> ProbeSet:
    """Last-word cloze items from held-out documents (at most one item per document window).

    For each chosen document, a cut point before a word of 3+ letters is picked at random
    (fixed seed); the context is the text before it (trimmed from the left to fit), the
    target is the word with its leading space.
    """
    enc = tokenizer.encode  # type: ignore[attr-defined]
    rng = np.random.default_rng([NAMESPACE["cloze"], seed])
    rows, pos, tgt = [], [], []
    order = rng.permutation(len(documents))
    for d in order:
        if len(rows) >= n:
            break
        text = documents[int(d)]
        words = [m for m in _WORD.finditer(text) if m.start() > 40 and text[m.start() - 1] == " "]
        if not words:
            continue
        w = words[int(rng.integers(len(words)))]
        context = text[: w.start() - 1]
        ctx_ids = enc(context).ids
        full_ids = enc(context + " " + w.group()).ids
        if full_ids[: len(ctx_ids)] != ctx_ids or len(full_ids) == len(ctx_ids):
            continue  # the word merged with its context: skip the item
        target = full_ids[len(ctx_ids):]
        keep = seq_len - len(target)
        if keep < 16:
            continue
        ctx_ids = ctx_ids[-keep:]
        row = ctx_ids + target
        start = len(ctx_ids) - 1
        rows.append(np.asarray(row + [0] * (seq_len - len(row)), dtype=np.int64))
        pos.append(list(range(start, start + len(target))))
        tgt.append(list(target))
    if not rows:
        return ProbeSet("cloze", torch.zeros(0, seq_len, dtype=torch.long), [], [], [], 0.0)
    return ProbeSet("cloze", torch.from_numpy(np.stack(rows)), list(range(len(rows))), pos, tgt,
                    0.0)


CLOZE_ROWS = 4096  # validation rows decoded for cloze documents (at least; see probe_sets)


def held_out_documents(data: Any, limit: int | None = None) -> list[str]:
    """Held-out text: the first ``limit`` validation rows (all when ``None``) decoded and split
    at EOS (never trained on)."""
    tok = data.tokenizer()
    docs: list[str] = []
    for batch in data.val_batches(limit, 64):
        for row in batch.tolist():
            text = tok.decode(row, skip_special_tokens=False)
            docs += [d.strip() for d in text.split("<|endoftext|>") if len(d.strip()) > 80]
    return docs


def probe_sets(cfg: Any, data: Any, n: int) -> list[ProbeSet]:
    """The n-item mqar, induction and cloze sets. Cloze documents come from at most the first
    ``max(CLOZE_ROWS, 8 n)`` validation rows, so start-up stays bounded on a large prepared
    validation split (the built-in corpus has fewer rows than that: all of them are used)."""
    v, t = cfg.model.vocab_size, cfg.train.seq_len
    return [
        synthetic_set("mqar", n, v, t),
        synthetic_set("induction", n, v, t),
        cloze_set(data.tokenizer(), held_out_documents(data, max(CLOZE_ROWS, 8 * n)), t, n),
    ]


@torch.no_grad()
def score(model: torch.nn.Module, probe: ProbeSet, batch_size: int = 16,
          device: torch.device | str = "cpu") -> dict[str, object]:
    """Greedy scoring. mqar/induction item score: fraction of its scored positions whose
    argmax is the target; cloze: 1 when every token of the word is the argmax, else 0."""
    was_training = model.training
    model.eval()
    preds: list[torch.Tensor] = []
    for i in range(0, len(probe.tokens), batch_size):
        logits = model(probe.tokens[i: i + batch_size].to(device))
        preds.append(logits.argmax(-1).cpu())
    model.train(was_training)
    pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)
    items = []
    for row, positions, targets in zip(probe.rows, probe.positions, probe.targets, strict=True):
        hits = sum(int(pred[row, p]) == t for p, t in zip(positions, targets, strict=True))
        whole_word = probe.name == "cloze"
        item_score = float(hits == len(targets)) if whole_word else hits / len(targets)
        items.append({"score": item_score, "hits": hits, "scored": len(targets)})
    n = len(items)
    return {
        "accuracy": sum(it["score"] for it in items) / n if n else None,
        "n": n,
        "chance": probe.chance,
        **({"guess": probe.guess} if probe.guess is not None else {}),
        "items": items,
    }


class ProbeScoring(Callback):
    """``train.eval_probes=N``: score the probes on their first N held-out items at every
    validation point, as ``modbench eval --probes --limit N`` would. Adds ``probes`` to each
    finite validation record and ``final_probes`` to a completed run's summary."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sets: list[ProbeSet] = []
        self.last: dict[str, float | None] = {}

    def on_train_start(self, run: TrainingRun) -> None:
        self.sets = probe_sets(run.cfg, run.data, self.n)

    def on_eval(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        if record.get("val_loss") is None:
            return
        bs = run.cfg.train.forward_rows()
        self.last.update({ps.name: score(run.model, ps, bs, run.device)["accuracy"]
                          for ps in self.sets})  # type: ignore[misc]
        record["probes"] = dict(self.last)

    def on_train_end(self, run: TrainingRun, summary: dict[str, Any]) -> None:
        if self.last and summary["status"] == "completed":
            summary["final_probes"] = dict(self.last)
