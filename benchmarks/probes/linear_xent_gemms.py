"""The three GEMMs of one linear_cross_entropy chunk, timed alone at several chunk sizes, to find
which of them the small chunks (Liger-Kernel's 512 rows at 16384 x 4096 x 128256) slow down:

    logits   [rows, vocab]  = x[rows] @ weight.T          K = hidden
    grad_x   [rows, hidden] = grad_logits @ weight        K = vocab, few output tiles
    grad_w  += grad_logits.T @ x[rows]                    K = rows, the accumulator read and written

and the input gradient's GEMM split over the vocabulary into a batch of two or four (torch.bmm
with float32 outputs, summed), a form with more output tiles for the SMs.

    python3 benchmarks/probes/linear_xent_gemms.py [--hidden 4096 --vocab 128256 --rows 512,1024]

Prints each GEMM's median time (CUDA events, after warm-up) and its TFLOP/s.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from harness import time_ms  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", default="256,512,1024,2048")
    args = p.parse_args()
    h, v = args.hidden, args.vocab
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(v, h, device="cuda", dtype=dt, generator=g) / h**0.5
    grad_w = torch.zeros(v, h, device="cuda", dtype=dt)
    print(f"hidden {h}, vocab {v}, bf16; ms (TFLOP/s)")
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, h, device="cuda", dtype=dt, generator=g)
        logits = torch.empty(rows, v, device="cuda", dtype=dt)
        logits.copy_(torch.randn(rows, v, device="cuda", dtype=dt, generator=g))
        grad_x = torch.empty(rows, h, device="cuda", dtype=dt)
        flops = 2.0 * rows * h * v

        def rate(ms):
            return f"{ms:7.3f} ({flops / ms / 1e9:5.0f})"

        cells = {
            "logits = x @ w.T": lambda: torch.mm(x, w.t(), out=logits),
            "grad_x = grad_logits @ w": lambda: torch.mm(logits, w, out=grad_x),
            "grad_w += grad_logits.T @ x": lambda: grad_w.addmm_(logits.t(), x),
        }
        for parts in (2, 4):
            if v % parts:
                continue
            lp = logits.view(rows, parts, v // parts).transpose(0, 1)  # [parts, rows, v / parts]
            wp = w.view(parts, v // parts, h)
            part_out = torch.empty(parts, rows, h, device="cuda", dtype=torch.float32)

            def split(lp=lp, wp=wp, part_out=part_out):
                torch.bmm(lp, wp, out_dtype=torch.float32, out=part_out)
                torch.sum(part_out, 0, out=grad_x)

            cells[f"grad_x in {parts} vocab parts (bmm fp32, summed)"] = split
        line = []
        for name, fn in cells.items():
            try:
                line.append(f"{name}: {rate(time_ms(fn, warmup=5, reps=30))}")
            except Exception as e:  # a form this torch lacks
                line.append(f"{name}: {type(e).__name__}: {str(e)[:80]}")
        print(f"rows {rows}:\n  " + "\n  ".join(line), flush=True)
        del x, logits, grad_x


if __name__ == "__main__":
    main()
