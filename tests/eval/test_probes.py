"""Offline probes: structure checked against their definitions, held-out separation,
scoring with an oracle, probe mixing, and `modbench eval` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from modbench.cli import run_cli
from modbench.data import builtin_dataset, builtin_tokenizer, open_dataset
from modbench.data.mix import ProbeMixDataset
from modbench.data.synthetic import SYNTHETIC, pools, synthetic_row, training_probe_row
from modbench.errors import ModbenchError
from modbench.eval.probes import (
    CLOZE_ROWS,
    cloze_set,
    held_out_documents,
    in_episode_guess,
    probe_sets,
    score,
    synthetic_set,
)
from modbench.eval.run import evaluate_run
from modbench.methods.build import build_model
from modbench.runtime.data import open_data
from modbench.runtime.loss import lm_loss
from modbench.runtime.runfolder import PROBES
from modbench.train.trainer import train
from tests.helpers import read_metrics, tiny

V, T = 512, 64


def episodes(row: list[int]) -> list[list[int]]:
    """Split a row at EOS (id 0) into episodes, dropping padding."""
    out, cur = [], None
    for t in row:
        if t == 0:
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(t)  # type: ignore[union-attr]
    if cur:
        out.append(cur)
    return out


def test_mqar_rows_follow_the_definition() -> None:
    keys, values = (set(map(int, p)) for p in pools(V, T))
    assert not keys & values and len(values) == 64
    ps = synthetic_set("mqar", 20, V, T)
    for row, pos, tgt in zip(ps.tokens.tolist(), ps.positions, ps.targets, strict=True):
        seen: set[int] = set()
        for ep in episodes(row):
            n = len(ep) // 4  # n pairs then n queries of two tokens each
            pairs = dict(zip(ep[0:2 * n:2], ep[1:2 * n:2], strict=True))
            assert len(pairs) == n and set(pairs) <= keys and set(pairs.values()) <= values
            assert not seen & set(pairs)  # a key belongs to one episode of the row
            seen |= set(pairs)
            queries = ep[2 * n:]
            assert sorted(queries[0::2]) == sorted(pairs)  # every key queried once
            assert all(pairs[k] == v for k, v in zip(queries[0::2], queries[1::2], strict=True))
        for p, t in zip(pos, tgt, strict=True):
            assert row[p] in keys and row[p + 1] == t


def test_induction_rows_repeat() -> None:
    ps = synthetic_set("induction", 10, V, T)
    for row, pos, tgt in zip(ps.tokens.tolist(), ps.positions, ps.targets, strict=True):
        for ep in episodes(row):
            m = len(ep) // 2
            assert ep[:m] == ep[m:]
        assert all(row[p + 1] == t for p, t in zip(pos, tgt, strict=True))


def test_deterministic_and_held_out_never_in_training() -> None:
    a, b = synthetic_set("mqar", 50, V, T), synthetic_set("mqar", 50, V, T)
    assert torch.equal(a.tokens, b.tokens)
    held = {tuple(r) for kind in ("mqar", "induction")
            for r in synthetic_set(kind, 200, V, T).tokens.tolist()}
    trained = {tuple(training_probe_row(1234, s, r, V, T).tolist())
               for s in range(300) for r in range(8)}
    assert len(trained) == 2400 and not held & trained


def test_oracle_scores_one_and_constant_scores_low() -> None:
    ps = synthetic_set("mqar", 8, V, T)

    class Oracle(torch.nn.Module):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            nxt = torch.roll(idx, -1, dims=1)
            return torch.nn.functional.one_hot(nxt, V).float()

    class Constant(torch.nn.Module):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(*idx.shape, V)
            out[..., 5] = 1.0
            return out

    assert score(Oracle(), ps)["accuracy"] == 1.0
    assert score(Constant(), ps)["accuracy"] == 0.0


def test_cloze_items_are_the_next_word_of_held_out_text() -> None:
    tok = builtin_tokenizer(V)
    docs = ["The quick brown fox jumps over the lazy dog while the farmer watches " * 3,
            "Python modules provide namespaces; importing a module executes its code once."]
    ps = cloze_set(tok, docs, T, 10)
    assert len(ps) == 2
    for row, pos, tgt in zip(ps.tokens.tolist(), ps.positions, ps.targets, strict=True):
        word = tok.decode(tgt)
        assert word.startswith(" ") and word.strip().isalpha() and len(word.strip()) >= 3
        context = tok.decode(row[: pos[0] + 1])
        assert any(context + word in d or (context.strip() + word) in d for d in docs)


def test_cloze_reads_a_bounded_prefix_of_the_validation_split() -> None:
    ds = open_dataset(builtin_dataset(V, T, progress=False))
    asked: list[int | None] = []

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(ds, name)

        def val_batches(self, limit: int | None, batch_size: int) -> object:
            asked.append(limit)
            return ds.val_batches(limit, batch_size)

    cfg = tiny()
    made = probe_sets(cfg, Spy(), 10)
    assert tuple(ps.name for ps in made) == PROBES  # the names reports and metrics use
    sets = {ps.name: ps for ps in made}
    assert asked == [CLOZE_ROWS]
    probe_sets(cfg, Spy(), 1000)
    assert asked[-1] == 8000
    # the built-in validation split is smaller than the bound: the same items as reading all
    full = cloze_set(ds.tokenizer(), held_out_documents(ds), T, 10)
    assert torch.equal(sets["cloze"].tokens, full.tokens) and len(full) == 10


def test_probe_mix_replaces_a_fixed_share_of_rows() -> None:
    ds = open_dataset(builtin_dataset(V, T, progress=False))
    mixed = ProbeMixDataset(ds, 0.25)
    for step in (0, 5, 77):
        plain, mix = ds.train_batch(step, 8, 1234), mixed.train_batch(step, 8, 1234)
        changed = [r for r in range(8) if not torch.equal(plain[r], mix[r])]
        assert changed == list(mixed.probe_rows(step, 8, 1234)) and len(changed) == 2
        assert torch.equal(mix, mixed.train_batch(step, 8, 1234))
    assert [torch.equal(a, b) for a, b in zip(ds.val_batches(8, 8), mixed.val_batches(8, 8),
                                              strict=True)] == [True]


def answer_mask_by_structure(row: list[int], kind: str) -> list[bool]:
    """Reference for ``probe_loss=answers``: which next-token predictions of a probe row are
    answers, from the episode layout alone. mqar ``EOS k1 v1 .. kn vn`` + n queries: the value
    after each queried key; induction ``EOS x1..xm x1..xm``: x2..xm of the repeat."""
    mask = [False] * (len(row) - 1)
    start = 0
    for ep in episodes(row):
        if kind == "mqar":
            n = len(ep) // 4
            for j in range(n):
                mask[start + 1 + 2 * n + 2 * j] = True
        else:
            m = len(ep) // 2
            for j in range(1, m):
                mask[start + m + j] = True
        start += len(ep) + 1
    return mask


def test_probe_loss_answers_masks_everything_but_the_answers() -> None:
    ds = open_dataset(builtin_dataset(V, T, progress=False))
    mixed = ProbeMixDataset(ds, 0.5, "answers")
    kinds = set()
    for step in (0, 3, 41):
        batch, mask = mixed.train_batch_and_mask(step, 8, 1234)
        assert mask is not None and mask.shape == (8, T - 1) and mask.dtype == torch.bool
        assert torch.equal(batch, ProbeMixDataset(ds, 0.5).train_batch(step, 8, 1234))
        probe = set(mixed.probe_rows(step, 8, 1234).tolist())
        for r in range(8):
            if r in probe:
                kind = SYNTHETIC[(step + r) % 2]  # kinds alternate by row
                kinds.add(kind)
                assert mask[r].tolist() == answer_mask_by_structure(batch[r].tolist(), kind)
            else:
                assert bool(mask[r].all())  # text rows count in full
    assert kinds == set(SYNTHETIC)  # both kinds were checked
    assert ProbeMixDataset(ds, 0.5).train_batch_and_mask(0, 8, 1234)[1] is None
    with pytest.raises(ModbenchError, match="probe_loss"):
        ProbeMixDataset(ds, 0.5, "keys")


def test_masked_lm_loss_is_the_mean_over_the_kept_predictions() -> None:
    torch.manual_seed(0)
    logits, idx = torch.randn(4, 6, 11), torch.randint(0, 11, (4, 6))
    mask = torch.rand(4, 5) < 0.4
    mask[0, 0] = True
    nll = -torch.log_softmax(logits, -1)[:, :-1].gather(-1, idx[:, 1:, None])[..., 0]
    torch.testing.assert_close(lm_loss(logits, idx, mask), nll[mask].mean())
    # two micro-batches sharing the batch's denominator add up to the whole batch's loss
    count = int(mask.sum())
    halves = sum(lm_loss(logits[i:i + 2], idx[i:i + 2], mask[i:i + 2], count) for i in (0, 2))
    torch.testing.assert_close(halves, nll[mask].mean())


def test_training_with_answer_loss_logs_that_loss(tmp_path: Path) -> None:
    over = ("data.probe_mix=0.5", "data.probe_loss=answers", "train.micro_batch_size=4")
    cfg = tiny("baseline", 0, 3, *over)
    train(cfg, tmp_path / "r", progress=False)
    # the first logged loss is the answer-masked loss of batch 0 under the initial weights
    model = build_model(cfg.model, seed=cfg.seed)
    batch, mask = open_data(cfg, progress=False).train_batch_and_mask(0, 8, cfg.data.data_seed)
    with torch.no_grad():
        expect = float(lm_loss(model(batch), batch, mask))
    first = next(r for r in read_metrics(tmp_path / "r") if r["kind"] == "train")
    assert first["loss"] == pytest.approx(expect, rel=1e-4)
    with pytest.raises(ModbenchError, match="probe_loss"):
        tiny("baseline", 0, 3, "data.probe_loss=some").validate()


def test_eval_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = train(tiny("qknorm", 0, 10, "data.probe_mix=0.25"), tmp_path / "r", progress=False)
    code = run_cli(["eval", str(tmp_path / "r"), "--probes", "--limit", "20", "--no-progress"])
    out, _ = capsys.readouterr()
    assert code == 0 and "mqar:" in out
    ev = json.loads((tmp_path / "r" / "eval.json").read_text())
    # same weights, same fixed validation set: the loss the trainer reported
    assert ev["validation"]["loss"] == pytest.approx(s["final_val_loss"], rel=1e-6)
    assert set(ev["tasks"]) == {"mqar", "induction", "cloze"}
    for t in ev["tasks"].values():
        assert t["n"] == len(t["items"]) > 0 and 0.0 <= t["accuracy"] <= 1.0
        assert t["accuracy"] == pytest.approx(np.mean([i["score"] for i in t["items"]]))


def test_eval_of_a_non_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["eval", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_row_is_whole_episodes() -> None:
    rng = np.random.default_rng(0)
    row, pos, tgt = synthetic_row("mqar", V, T, rng)
    assert len(row) == T and len(pos) == len(tgt) > 0


@pytest.mark.parametrize(("vocab", "seq_len"), [(4096, 1024), (512, 1024)])
def test_long_rows_get_enough_distinct_keys(vocab: int, seq_len: int) -> None:
    """A 1024-token row holds ~31 mqar episodes of 8 pairs: the key pool grows to keep every
    key in one episode, up to a quarter of the vocabulary (then the row ends early)."""
    keys, _ = pools(vocab, seq_len)
    row, pos, _ = synthetic_row("mqar", vocab, seq_len, np.random.default_rng(3))
    queried = [int(row[p]) for p in pos]
    assert len(set(queried)) == len(queried) <= len(keys) <= (vocab - 1) // 4
    assert len(queried) == (248 if vocab == 4096 else 120)


def test_in_episode_guess_by_hand() -> None:
    """1/(distinct values of the query's episode), averaged over the row's queries."""
    # episode 1: 2 pairs with the same value (guess 1); episode 2: 2 distinct values (1/2)
    row = np.array([0, 5, 50, 6, 50, 6, 50, 5, 50, 0, 7, 51, 8, 52, 8, 52, 7, 51, 0, 0])
    positions = [5, 7, 14, 16]
    assert in_episode_guess(row, positions) == pytest.approx((1 + 1 + 0.5 + 0.5) / 4)
    ps = synthetic_set("mqar", 30, V, T)
    assert ps.guess is not None and 1 / 4 <= ps.guess < 1 / 3  # n = 4 pairs at T = 64


def test_probe_curve_during_training_matches_eval(tmp_path: Path) -> None:
    """`train.eval_probes=N` scores the N-item probes at every validation point; the last
    point equals what `modbench eval --probes --limit N` gives for the finished run."""
    s = train(tiny("baseline", 0, 10, "data.probe_mix=0.25", "train.eval_every=5",
                   "train.eval_probes=12"), tmp_path / "r", progress=False)
    vals = [r for r in read_metrics(tmp_path / "r") if r["kind"] == "val"]
    assert [r["step"] for r in vals] == [0, 5, 10]
    assert all(set(r["probes"]) == {"mqar", "induction", "cloze"} for r in vals)
    assert s["final_probes"] == vals[-1]["probes"]
    ev = evaluate_run(tmp_path / "r", probes=True, limit=12, progress=False)
    assert {k: t["accuracy"] for k, t in ev["tasks"].items()} == vals[-1]["probes"]


def test_eval_probes_must_not_be_negative() -> None:
    with pytest.raises(ModbenchError, match=r"train\.eval_probes"):
        tiny("baseline", 0, 10, "train.eval_probes=-1")


def test_eval_of_a_run_without_checkpoint(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The same one-line refusals as `modbench diagnose` (eval.run.check_run_folder)."""
    assert run_cli(["eval", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.yaml").write_text("preset: tiny\n")
    assert run_cli(["eval", str(tmp_path / "half")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint" in err
    assert not (tmp_path / "half" / "eval.json").exists()
