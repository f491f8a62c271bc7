"""The loss computed in pieces (modbench.model.head): the value and gradients of the plain
cross-entropy on full logits, without ever holding the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import modbench.model.transformer as transformer
from modbench.config import resolve
from modbench.methods.build import plan
from modbench.model.head import IGNORE, cross_entropy_sum, next_token_targets
from modbench.runtime.loss import lm_loss, micro_loss

CPU = torch.device("cpu")


def _model(method: str = "baseline", vocab: int = 512) -> torch.nn.Module:
    cfg = resolve(preset="tiny", method=method, overrides=[f"model.vocab_size={vocab}"])
    return plan(cfg.model).build(0, CPU).double()


def _small_pieces(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    """Make the model's loss use pieces of ``tokens`` tokens."""
    orig = transformer.cross_entropy_sum

    def pieces(project, h, target, vocab_size, **_):  # type: ignore[no-untyped-def]
        return orig(project, h, target, vocab_size, chunk_bytes=4 * vocab_size * tokens)

    monkeypatch.setattr(transformer, "cross_entropy_sum", pieces)


def test_targets_shift_and_mask() -> None:
    idx = torch.tensor([[5, 6, 7, 8]])
    mask = torch.tensor([[True, False, True]])
    assert next_token_targets(idx).tolist() == [[6, 7, 8, IGNORE]]
    assert next_token_targets(idx, mask).tolist() == [[6, IGNORE, 8, IGNORE]]


@pytest.mark.parametrize("tokens", [1, 7, 24, 10_000])
def test_pieces_sum_to_the_full_cross_entropy(tokens: int) -> None:
    """Any piece size, rows split or not, gives the reference: F.cross_entropy of the whole
    (B, T, V) logits, summed; and the same gradient of the hidden states and the head."""
    torch.manual_seed(0)
    b, t, d, v = 3, 16, 8, 50
    h = torch.randn(b, t, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, v, (b, t))
    target[1, 3] = IGNORE

    def project(x: torch.Tensor) -> torch.Tensor:
        return 3.0 * torch.tanh(x @ w.T / 3.0)  # a logits transform as well as the head

    got = cross_entropy_sum(project, h, target, v, chunk_bytes=4 * v * tokens)
    (gh, gw) = torch.autograd.grad(got, (h, w))
    want = F.cross_entropy(project(h).reshape(-1, v), target.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    (wh, ww) = torch.autograd.grad(want, (h, w))
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(gh, wh, rtol=1e-10, atol=1e-12)
    assert torch.allclose(gw, ww, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["baseline", "ngpt", "softcap"])
@pytest.mark.parametrize("masked", [False, True])
def test_model_loss_equals_lm_loss_of_its_logits(monkeypatch: pytest.MonkeyPatch, method: str,
                                                 masked: bool) -> None:
    """``micro_loss`` through ``forward(loss=True)`` in pieces equals ``lm_loss`` of the
    model's full logits (the loss the engines took before), value and parameter gradients,
    with the methods' logits transforms (nGPT's scale) and with a loss mask."""
    model = _model(method)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 512, (4, 32), generator=g)
    mask = torch.rand(4, 31, generator=g) > 0.3 if masked else None
    count = int(mask.sum()) if mask is not None else 0

    ref = lm_loss(model(idx), idx, mask, count if masked else None) / (1 if masked else 2)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    _small_pieces(monkeypatch, tokens=10)
    got, aux = micro_loss(model, idx, mask, count, n_micro=1 if masked else 2)
    grads = torch.autograd.grad(got, list(model.parameters()))
    assert float(aux) == 0.0
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-13)


def test_no_full_logits_are_kept_for_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """With pieces, nothing autograd keeps is as large as a tenth of the (B, T, V) logits,
    and the hidden states are what the backward recomputes them from; the full-logits loss
    keeps at least the whole fp32 logits."""
    model = _model(vocab=2048).float()
    idx = torch.randint(0, 2048, (4, 64))
    full = 4 * 64 * 2048

    def largest_saved(loss_of: object) -> int:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_of()  # type: ignore[operator]
        return max(sizes)

    assert largest_saved(lambda: lm_loss(model(idx), idx)) >= full
    _small_pieces(monkeypatch, tokens=16)
    assert largest_saved(lambda: model(idx, loss=True)) < full // 10


def test_validation_loss_is_the_mean_of_the_full_logits_loss() -> None:
    from modbench.runtime.loss import validation_loss

    model = _model()

    class Rows:
        def val_batches(self, n: int, bs: int):  # type: ignore[no-untyped-def]
            g = torch.Generator().manual_seed(2)
            rows = torch.randint(0, 512, (n, 32), generator=g)
            return rows.split(bs)

    got = validation_loss(model, Rows(), 6, 4, CPU)
    rows = torch.cat(list(Rows().val_batches(6, 6)))
    with torch.no_grad():
        want = lm_loss(model(rows), rows).item()
    assert got == pytest.approx(want, rel=1e-12)
