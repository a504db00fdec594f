"""Softmax and log-softmax against PyTorch eager, torch.compile and Liger-Kernel (where it is
importable), in one run.

GPU: rows x cols = 16384 x {1024, 4096, 32768, 131072}, bfloat16 and float32, forward (no grad)
and forward+backward (torch.autograd.grad for x), each timed by CUDA events (wall) and by the
kernels' summed device time under torch.profiler. CPU, or BRRR_BENCH_QUICK=1: a quick smoke run.

bytes_moved is the fewest bytes a pass must move: forward reads x and writes y (2 passes over
rows x cols), forward+backward also reads y and dy and writes dx (5 passes). Every
implementation's results are checked against eager before anything is timed.
"""

import os

import pytest
import torch

import brrr
from harness import compiled, device, kernel_ms, on_gpu, time_ms

QUICK = not on_gpu() or os.environ.get("BRRR_BENCH_QUICK") == "1"
ROWS = 16384 if not QUICK else 64
COLS = [1024, 4096, 32768, 131072] if not QUICK else [257, 4096]
DTYPES = [torch.bfloat16, torch.float32]
MAX_TIME_S = 2.0 if not QUICK else 0.1
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative error (norm) against eager


def _liger(log):
    """Liger-Kernel's softmax as a function of x, or None (it has no log-softmax)."""
    if log:
        return None
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError:
        return None
    return LigerSoftmaxFunction.apply


def _impls(log):
    eager = (lambda x: torch.log_softmax(x, -1)) if log else (lambda x: torch.softmax(x, -1))
    ours = (lambda x: brrr.log_softmax(x, -1)) if log else (lambda x: brrr.softmax(x, -1))
    impls = {"brrr": ours, "eager": eager, "compile": None if QUICK else compiled(eager), "liger": _liger(log)}
    return {name: fn for name, fn in impls.items() if fn is not None}


def _agree(a, b, dtype, what):
    err = ((a.float() - b.float()).norm() / max(b.float().norm().item(), 1e-30)).item()
    assert err < TOL[dtype], f"{what}: disagrees with eager, relative error {err:.2e}"


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax(recorder, log, dtype, cols):
    x = torch.randn(ROWS, cols, device=device(), dtype=dtype, requires_grad=True)
    dy = torch.randn(ROWS, cols, device=device(), dtype=dtype)
    impls = _impls(log)
    eager = impls["eager"]
    with torch.no_grad():
        expected = eager(x)
    (expected_grad,) = torch.autograd.grad(eager(x), x, dy)
    unit = ROWS * cols * x.element_size()
    for impl, fn in impls.items():
        def step():
            return torch.autograd.grad(fn(x), x, dy)

        with torch.no_grad():
            try:
                got = fn(x)
            except RuntimeError as e:  # Liger-Kernel's softmax takes rows of at most 65536
                recorder.add(family="softmax", op="log_softmax" if log else "softmax", dtype=str(dtype),
                             shape=[ROWS, cols], impl=impl, unsupported=str(e)[:200])
                continue
            _agree(got, expected, dtype, f"{impl} forward")
            fwd_ms = time_ms(lambda: fn(x), max_time_s=MAX_TIME_S)
            fwd_kernels = kernel_ms(lambda: fn(x)) if on_gpu() else None
        _agree(step()[0], expected_grad, dtype, f"{impl} gradient")
        all_ms = time_ms(step, max_time_s=MAX_TIME_S)
        all_kernels = kernel_ms(step) if on_gpu() else None
        common = dict(family="softmax", op="log_softmax" if log else "softmax", dtype=dtype, shape=(ROWS, cols),
                      impl=impl)
        for pass_, ms, kernels, passes in (("fwd", fwd_ms, fwd_kernels, 2), ("fwd+bwd", all_ms, all_kernels, 5)):
            row = recorder.add_timing(pass_=pass_, ms=ms, bytes_moved=passes * unit, kernel_ms=kernels, **common)
            if kernels:
                row["kernel_frac_floor"] = row["floor_ms"] / kernels
