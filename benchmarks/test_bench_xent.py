"""Softmax cross-entropy against PyTorch eager and torch.compile, in one run.

The peer is the loss as Hugging Face's causal-LM models compute it, F.cross_entropy(logits.float(),
target), which brrr.cross_entropy(logits, target, dtype=torch.float32) computes without the float32
copy. GPU: rows x vocabulary = 16384 x 32000 (Llama 2), 4096 x 50257 (GPT-2: rows not 16-byte
aligned), 8192 x 128256 (Llama 3), bfloat16, and 16384 x 32000 float32; a tenth of the targets
are ignore_index. Forward (no grad) and forward+backward (torch.autograd.grad for the logits).
CPU, or BRRR_BENCH_QUICK=1: a quick smoke version, without torch.compile.

bytes_moved is the fewest bytes a pass must move: the forward reads the logits once, the
forward+backward reads them twice and writes their gradient (3 passes); the targets are counted
too. brrr's loss and gradient are checked against eager before anything is timed.
"""

import os

import pytest
import torch
import torch.nn.functional as F

import brrr
from harness import compiled, device, on_gpu, time_ms

QUICK = not on_gpu() or os.environ.get("BRRR_BENCH_QUICK") == "1"
CASES = ([(16384, 32000, torch.bfloat16), (4096, 50257, torch.bfloat16), (8192, 128256, torch.bfloat16),
          (16384, 32000, torch.float32)] if not QUICK else [(64, 1000, torch.bfloat16)])
MAX_TIME_S = 2.0 if not QUICK else 0.1
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative error of brrr's gradient against eager


def eager(logits, target):
    return F.cross_entropy(logits.float(), target)


def ours(logits, target):
    return brrr.cross_entropy(logits, target, dtype=torch.float32)


@pytest.mark.parametrize("rows,vocab,dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_cross_entropy(recorder, rows, vocab, dtype):
    g = torch.Generator(device=device()).manual_seed(0)
    logits = (torch.randn(rows, vocab, device=device(), generator=g) * 2).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device=device(), generator=g)
    target[torch.rand(rows, device=device(), generator=g) < 0.1] = -100
    expected_loss = eager(logits, target)
    (expected_grad,) = torch.autograd.grad(expected_loss, logits)
    loss = ours(logits, target)
    (grad,) = torch.autograd.grad(loss, logits)
    assert abs(loss.item() - expected_loss.item()) <= 1e-5 * abs(expected_loss.item())
    err = ((grad.float() - expected_grad.float()).norm() / expected_grad.float().norm()).item()
    assert err < TOL[dtype], f"gradient: brrr disagrees with eager, relative error {err:.2e}"
    del expected_grad, grad

    unit = rows * vocab * logits.element_size()
    impls = {"brrr": ours, "eager": eager, "compile": None if QUICK else compiled(eager)}
    for impl, fn in impls.items():
        if fn is None:
            continue
        common = dict(family="xent", op="cross_entropy", dtype=dtype, shape=(rows, vocab), impl=impl)
        with torch.no_grad():
            ms = time_ms(lambda: fn(logits, target), max_time_s=MAX_TIME_S)
        recorder.add_timing(pass_="fwd", ms=ms, bytes_moved=unit + rows * 8, **common)
        ms = time_ms(lambda: torch.autograd.grad(fn(logits, target), logits), max_time_s=MAX_TIME_S)
        recorder.add_timing(pass_="fwd+bwd", ms=ms, bytes_moved=3 * unit + 2 * rows * 8, **common)
