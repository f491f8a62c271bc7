"""The unigram level of a prepared dataset: what a model that learned only how often each
token occurs would score.

A run that *stalls* (docs/runs.md, "Statuses") ends with a validation loss at this level:
it learned the token frequencies and nothing about context. Two numbers, in nats per token:

* ``entropy``: the entropy ``H = -sum_i p_i log p_i`` of the training split's token
  distribution ``p`` (the training loss of the unigram predictor);
* ``val_loss``: the cross-entropy of the first ``val_sequences`` validation rows (the fixed
  validation set a run scores) under ``p``: the *validation* loss of the unigram predictor,
  the number a stalled run's validation loss sits at. The two differ by how much the
  validation documents' token mix differs from the training documents' (on the built-in
  corpus, which splits by document, ``val_loss`` is 0.05 – 0.13 nats below ``entropy``).

Only predicted tokens count, as in the loss: every column of a row but the first. ``p`` is
smoothed by adding :data:`SMOOTHING` to every id's count over the tokenizer's vocabulary (a
validation token never seen in training would otherwise cost infinitely many nats; a trained
model gives it a small probability too).

A training split of more than :data:`MAX_TOKENS` predicted tokens is counted on an evenly
spaced sample of its rows (the same rows every time), and the result is cached in the cache
directory by the dataset's fingerprint; smaller splits (the built-in corpus: under a million
tokens, a few milliseconds) are counted whole each time.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from modbench.data._fs import cache_dir
from modbench.fsutil import atomic_write_text

#: Largest number of training tokens counted; a bigger split is sampled (rows evenly spaced).
MAX_TOKENS = 1 << 24
#: Pseudo-count added to every token id's count before normalising (Krichevsky–Trofimov).
SMOOTHING = 0.5
_ROWS_PER_READ = 4096  # rows gathered at a time while counting (bounds the memory used)
_CACHE_VERSION = 1


@dataclass(frozen=True)
class UnigramLevel:
    """The unigram level of a dataset (nats per token; see the module docstring)."""

    entropy: float  # H of the training split's (unsmoothed) token distribution
    val_loss: float  # cross-entropy of the validation rows under the smoothed distribution
    train_tokens: int  # predicted training tokens counted
    sampled: bool  # True when the training split was counted on a sample of its rows
    val_sequences: int  # validation rows scored


def token_counts(ds: Any, split: str, rows: np.ndarray | None = None) -> np.ndarray:
    """Counts of each token id (``ds.vocab_size`` entries) among the predicted tokens (all
    columns but the first) of ``rows`` of ``split`` (default: every row)."""
    n = ds.num_sequences(split)
    idx = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    counts = np.zeros(ds.vocab_size, dtype=np.int64)
    for start in range(0, idx.size, _ROWS_PER_READ):
        block = ds._rows(split, idx[start:start + _ROWS_PER_READ])[:, 1:]
        counts += np.bincount(block.ravel(), minlength=ds.vocab_size)[:ds.vocab_size]
    return counts


def entropy(counts: np.ndarray) -> float:
    """Entropy in nats of the distribution ``counts / counts.sum()`` (0 log 0 = 0)."""
    total = float(counts.sum())
    if total <= 0:
        return math.nan
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def cross_entropy(counts: np.ndarray, of: np.ndarray, smoothing: float = SMOOTHING) -> float:
    """Mean nats per token of the tokens counted in ``of`` under the distribution of
    ``counts`` with ``smoothing`` added to every id."""
    q = (counts + smoothing) / (float(counts.sum()) + smoothing * counts.size)
    total = float(of.sum())
    if total <= 0:
        return math.nan
    return float(-(of * np.log(q)).sum() / total)


def sample_rows(n: int, seq_len: int, max_tokens: int = MAX_TOKENS) -> np.ndarray | None:
    """The training rows counted: None (all) when ``n`` rows hold at most ``max_tokens``
    predicted tokens, else that many rows' worth, evenly spaced from the first to the last."""
    per_row = max(seq_len - 1, 1)
    if n * per_row <= max_tokens:
        return None
    k = max(1, max_tokens // per_row)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def unigram_level(ds: Any, val_sequences: int | None,
                  max_tokens: int = MAX_TOKENS) -> UnigramLevel:
    """The unigram level of ``ds`` (a :class:`~modbench.data.dataset.TokenDataset`, or a
    dataset that delegates to one) for a run that validates on its first ``val_sequences``
    validation rows (None: all). Deterministic; cached when the training split is sampled."""
    n_val = ds.num_sequences("val")
    n_val = n_val if val_sequences is None else min(n_val, int(val_sequences))
    rows = sample_rows(ds.num_sequences("train"), ds.seq_len, max_tokens)
    cache = None
    if rows is not None:
        cache = cache_dir() / "unigram" / (
            f"{ds.fingerprint()[:24]}-v{n_val}-m{max_tokens}-{_CACHE_VERSION}.json")
        try:
            return UnigramLevel(**json.loads(cache.read_text()))
        except (OSError, ValueError, TypeError):
            pass  # not cached yet (or unreadable): count again
    train = token_counts(ds, "train", rows)
    val = token_counts(ds, "val", np.arange(n_val, dtype=np.int64))
    level = UnigramLevel(entropy=entropy(train), val_loss=cross_entropy(train, val),
                         train_tokens=int(train.sum()), sampled=rows is not None,
                         val_sequences=n_val)
    if cache is not None:
        atomic_write_text(cache, json.dumps(asdict(level)) + "\n")
    return level


__all__ = ["MAX_TOKENS", "SMOOTHING", "UnigramLevel", "cross_entropy", "entropy",
           "sample_rows", "token_counts", "unigram_level"]
