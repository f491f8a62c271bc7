"""Synthetic token tasks, generated deterministically: multi-query associative recall (mqar)
and induction/copy. Used as held-out capability probes (``modbench.eval.probes``) and, with
``data.probe_mix``, mixed into training batches (``modbench.data.mix``).

- **mqar** (Arora et al. 2023, "Zoology"): an episode is ``EOS k1 v1 … kn vn  ka va  kb vb …``:
  n key–value pairs, then queries of those keys in a random order, each followed by its
  value. Scored: the value after each queried key. Keys and values come from two disjoint
  pools of token ids (values: 64; keys: 64, or as many as one row needs). A key appears in
  at most one episode of a row, so every query has one answer even for a model that looks
  back past the episode's EOS. Chance is 1/64 over the value pool; guessing among the
  episode's own n values gives about 1/n.
- **induction** (Olsson et al. 2022): ``EOS x1 … xm x1 … xm`` with random tokens; scored:
  x2 … xm of the repeat.

Episodes are concatenated until a row of ``seq_len`` tokens is full (then EOS padding).
Training rows and held-out rows come from different RNG streams (namespaces ``train`` and
``eval``).
"""

from __future__ import annotations

import numpy as np

SYNTHETIC = ("mqar", "induction")
NAMESPACE = {"train": 1, "eval": 2, "cloze": 3}
_KIND = {"mqar": 11, "induction": 12}


def pools(vocab_size: int, seq_len: int = 0, first_id: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint key and value pools of token ids (EOS = 0 is never used).

    64 values; 64 keys, or more when a row of ``seq_len`` tokens holds more mqar keys than
    that (keys are unique within a row), up to a quarter of the vocabulary.
    """
    ids = np.arange(first_id, vocab_size)
    size = min(64, len(ids) // 4)
    n = mqar_pairs(seq_len) if seq_len else 0
    row_keys = n * (seq_len // (1 + 4 * n)) if n else 0
    n_keys = min(max(size, row_keys), len(ids) // 4)
    keys = ids[len(ids) // 4: len(ids) // 4 + n_keys]
    values = ids[len(ids) // 2: len(ids) // 2 + size]
    return keys, values


def mqar_pairs(seq_len: int) -> int:
    return max(2, min(8, seq_len // 16))


def induction_len(seq_len: int) -> int:
    return max(4, min(16, seq_len // 8))


def synthetic_row(kind: str, vocab_size: int, seq_len: int, rng: np.random.Generator,
                  eos_id: int = 0) -> tuple[np.ndarray, list[int], list[int]]:
    """One row of ``seq_len`` tokens made of whole episodes, plus scored positions/targets."""
    row: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    keys, values = pools(vocab_size, seq_len)
    # mqar: each key in at most one episode of the row
    unused = list(rng.permutation(keys)) if kind == "mqar" else []
    while True:
        if kind == "mqar":
            n = mqar_pairs(seq_len)
            if len(unused) < n:
                break
            k = [unused.pop() for _ in range(n)]
            v = rng.choice(values, size=n, replace=True)
            order = rng.permutation(n)
            episode = [eos_id] + [int(t) for pair in zip(k, v, strict=True) for t in pair]
            scored = []
            for i in order:
                episode += [int(k[i]), int(v[i])]
                scored.append(len(episode) - 2)  # predict v after k
        elif kind == "induction":
            m = induction_len(seq_len)
            x = rng.integers(1, vocab_size, size=m)
            episode = [eos_id, *map(int, x), *map(int, x)]
            scored = list(range(m + 1, 2 * m))  # predict x2..xm of the repeat
        else:
            raise ValueError(f"unknown synthetic probe {kind!r}")
        if len(row) + len(episode) > seq_len:
            break
        base = len(row)
        row += episode
        positions += [base + p for p in scored]
        targets += [episode[p + 1] for p in scored]
    row += [eos_id] * (seq_len - len(row))
    return np.asarray(row, dtype=np.int64), positions, targets


def probe_rng(namespace: str, kind: str, seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([NAMESPACE[namespace], _KIND[kind], seed, index])




def training_probe_row(data_seed: int, step: int, row: int, vocab_size: int,
                       seq_len: int) -> np.ndarray:
    """The probe row mixed into training batch ``step`` at ``row`` (kinds alternate)."""
    return training_probe_episode(data_seed, step, row, vocab_size, seq_len)[0]


def training_probe_episode(data_seed: int, step: int, row: int, vocab_size: int,
                           seq_len: int) -> tuple[np.ndarray, list[int]]:
    """:func:`training_probe_row` plus its scored positions (the positions whose next token
    is an answer: an mqar value after its queried key, or a copied token of the repeat)."""
    kind = SYNTHETIC[(step + row) % len(SYNTHETIC)]
    index = step * 1_000_003 + row
    tokens, positions, _ = synthetic_row(kind, vocab_size, seq_len,
                                         probe_rng("train", kind, data_seed, index))
    return tokens, positions
