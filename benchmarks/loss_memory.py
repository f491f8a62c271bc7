"""Peak memory of one training step's loss: the full (B, T, V) logits against the loss in
pieces (``Transformer.forward(idx, loss=True)``, modbench.model.head).

Each variant runs in a fresh process: build the model and a batch, note the resident set
(VmRSS), take one forward and backward, and report the peak resident set (VmHWM) over that
baseline, with the bytes autograd keeps for the backward (a count, independent of the
allocator). Same model, same batch, same loss to rounding (printed).

    python benchmarks/loss_memory.py                      # llama-60m shape, vocab 32,000
    python benchmarks/loss_memory.py --rows 16 --seq 256 --vocab 32000 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _one(variant: str, rows: int, seq: int, vocab: int, preset: str) -> dict[str, float]:
    import torch

    from modbench.config import resolve
    from modbench.methods.build import plan
    from modbench.runtime.loss import lm_loss

    torch.set_num_threads(1)
    cfg = resolve(preset=preset, overrides=[f"model.vocab_size={vocab}",
                                            f"model.max_seq_len={max(seq, 2)}"])
    model = plan(cfg.model).build(0, torch.device("cpu"))
    idx = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().nbytes())
        return t

    base = _status_kib("VmRSS")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if variant == "full":
            loss = lm_loss(model(idx), idx)
        else:
            loss = model(idx, loss=True) / (rows * (seq - 1))
    loss.backward()
    peak = _status_kib("VmHWM")
    return {"loss": loss.item(), "peak_over_baseline_mib": (peak - base) / 1024,
            "saved_mib": sum(saved) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-60m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--variant", choices=("full", "pieces"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(_one(a.variant, a.rows, a.seq, a.vocab, a.preset)))
        return
    out = {}
    for variant in ("full", "pieces"):
        res = subprocess.run([sys.executable, __file__, "--variant", variant, "--preset",
                              a.preset, "--rows", str(a.rows), "--seq", str(a.seq),
                              "--vocab", str(a.vocab)], capture_output=True, text=True,
                             check=True)
        out[variant] = json.loads(res.stdout.strip().splitlines()[-1])
    logits_mib = a.rows * a.seq * a.vocab * 4 / 2**20
    out["shape"] = {"preset": a.preset, "rows": a.rows, "seq": a.seq, "vocab": a.vocab,
                    "fp32_logits_mib": logits_mib}
    out["peak_ratio"] = (out["pieces"]["peak_over_baseline_mib"]
                         / out["full"]["peak_over_baseline_mib"])
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{a.preset} at vocab {a.vocab}, {a.rows} x {a.seq} tokens "
          f"(fp32 logits {logits_mib:.0f} MiB)")
    for v in ("full", "pieces"):
        r = out[v]
        print(f"  {v:<7} loss {r['loss']:.6f}  peak over baseline "
              f"{r['peak_over_baseline_mib']:8.1f} MiB  kept for backward "
              f"{r['saved_mib']:8.1f} MiB")
    print(f"  pieces / full peak: {out['peak_ratio']:.2f}")


if __name__ == "__main__":
    main()
