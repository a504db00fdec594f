"""Hostile arguments, out-of-bounds writes, threads and leaks (the CPU side of robustness)."""

import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import brrr
from brrr import _C
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_chain import UNARY, reference_chain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ERRORS = (TypeError, ValueError, BufferError)
GUARD = 7.25  # a value no op below produces from the inputs drawn


def guarded_view(dtype, shape, strides):
    """A view with the given shape and element strides inside a buffer whose every other element
    holds GUARD, so a write outside the view shows. Returns (buffer, view)."""
    shape, strides = list(shape), list(strides)
    itemsize = np.dtype(dtype).itemsize
    low = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides)) if all(shape) else 0
    high = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides)) if all(shape) else 0
    size = high - low + 1 + 16
    buffer = np.full(size, GUARD, dtype=dtype)
    view = np.lib.stride_tricks.as_strided(buffer[8 - low:], shape=shape, strides=[s * itemsize for s in strides])
    return buffer, view


def strided(draw, ndim):
    shape = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    strides = draw(st.lists(st.integers(-6, 6), min_size=ndim, max_size=ndim))
    return shape, strides


@st.composite
def chain_cases(draw):
    ndim = draw(st.integers(0, 3))
    shape, x_strides = strided(draw, ndim)
    out_strides = draw(st.lists(st.integers(-6, 6), min_size=ndim, max_size=ndim))
    # exp is left out: chains of it are ill-conditioned, and fp32 would rightly differ from fp64.
    bounded = [op for op in UNARY if op != "exp"]
    steps = draw(st.lists(st.sampled_from(bounded + ["add_tensor", "mul_tensor"]), min_size=0, max_size=6))
    dtype = draw(st.sampled_from([np.float32, np.float64, np.float16, np.int32]))
    operand_is_vector = draw(st.lists(st.booleans(), min_size=6, max_size=6))
    return shape, x_strides, out_strides, steps, dtype, operand_is_vector, draw(st.integers(0, 2**32 - 1))


# CI runs a fixed, reproducible budget; BRRR_FUZZ_EXAMPLES=N runs a longer random campaign
# (with --hypothesis-show-statistics for its figures).
FUZZ_EXAMPLES = int(os.environ.get("BRRR_FUZZ_EXAMPLES", "400"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize="BRRR_FUZZ_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.too_slow])
@given(chain_cases())
def test_fuzz_chain_entry_point(case):
    shape, x_strides, out_strides, steps, dtype, vector_flags, seed = case
    steps = steps[:]
    n_tensor = sum(s in ("add_tensor", "mul_tensor") for s in steps)
    while n_tensor > 4:
        steps.remove(next(s for s in steps if s in ("add_tensor", "mul_tensor")))
        n_tensor -= 1
    rng = np.random.default_rng(seed)
    x_buf, x = guarded_view(dtype, shape, x_strides)
    x[...] = rng.uniform(-2, 2, size=x.shape).astype(dtype) if x.size else x
    out_buf, out = guarded_view(dtype, shape, out_strides)
    operands = []
    for i in range(n_tensor):
        vec = vector_flags[i] and len(shape) >= 1
        operands.append(rng.uniform(-1, 1, size=shape[-1:] if vec else shape).astype(dtype))
    x_before, ops_before = x_buf.copy(), [o.copy() for o in operands]
    program = _C.chain_program(steps)
    try:
        result = _C.chain_fwd(x, out, program, tuple(operands))[0]
    except ERRORS as error:
        event(f"refused with {type(error).__name__}")
        assert "argument" in str(error) or "views with more than" in str(error), error
        np.testing.assert_array_equal(out_buf, np.full_like(out_buf, GUARD))
        result = None
    np.testing.assert_array_equal(x_buf, x_before)  # inputs are never touched ...
    for o, before in zip(operands, ops_before):
        np.testing.assert_array_equal(o, before)
    if result is None:
        return
    event("computed")
    assert result is out
    # ... nothing outside the output view is written, and every element of it is right.
    written = np.zeros(out_buf.shape, bool)
    base = out.__array_interface__["data"][0]
    start = out_buf.__array_interface__["data"][0]
    for index in np.ndindex(*out.shape):
        offset = sum(i * s for i, s in zip(index, out.strides))
        written[(base - start + offset) // out.itemsize] = True
    assert np.all(out_buf[~written] == GUARD)
    if x.size:
        ref = reference_chain(steps, torch.from_numpy(x.copy()).double(),
                              [torch.from_numpy(o).double() for o in operands]).numpy().astype(dtype)
        tol = {np.float64: 1e-10, np.float32: 1e-4, np.float16: 2e-2}[dtype]
        np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol, atol=tol)


def test_misaligned_and_hostile_arguments_are_refused():
    raw = np.zeros(17, np.uint8)
    misaligned = np.frombuffer(raw.data, dtype=np.float32, count=4, offset=1)
    with pytest.raises(ValueError, match="argument x: data pointer is not aligned to its 4-byte elements"):
        brrr.cos(misaligned, out=np.zeros(4, np.float32))
    x = np.ones(4, np.float32)
    for bad in (None, 3, "x", [1.0], object(), np.ones(4, np.complex64), np.ones(4, np.int8)):
        with pytest.raises(ERRORS):
            _C.chain_fwd(bad, x, brrr.chain("cos").program, ())
        if bad is not None:  # out=None means "allocate one"
            with pytest.raises(ERRORS):
                _C.chain_fwd(x, bad, brrr.chain("cos").program, ())
    np.testing.assert_array_equal(x, np.ones(4, np.float32))


def test_threads_get_correct_results():
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(50_000).astype(np.float32) for _ in range(8)]
    expected = [np.cos(np.sin(a.astype(np.float64))) for a in inputs]
    f = brrr.chain("sin", "cos")
    failures = []

    def work(i):
        for _ in range(20):
            y = f(inputs[i])
            if not np.allclose(y, expected[i], rtol=1e-5, atol=1e-6):
                failures.append(i)
        t = torch.from_numpy(inputs[i])
        if not torch.allclose(brrr.layer_norm(t.view(50, 1000), (1000,)),
                              torch.nn.functional.layer_norm(t.view(50, 1000), (1000,)), atol=1e-5):
            failures.append(("norm", i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer's quarantine keeps freed memory resident (its own leak check runs)")
def test_no_leak_over_100k_calls():
    x_np = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    out_np = np.empty_like(x_np)
    x_t = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    f = brrr.chain("gelu", ("mul", 2.0))
    program = f.program

    def calls(n):
        for _ in range(n):
            _C.chain_fwd(x_np, out_np, program, ())
            f(x_np)
            f(x_t.detach())
        for _ in range(n // 20):  # autograd paths: forward and backward of a chain and a norm
            (f(x_t).sum() + brrr.rms_norm(x_t, (8,), w).sum()).backward()

    calls(2000)
    gc.collect()
    refs = (sys.getrefcount(x_np), sys.getrefcount(out_np), sys.getrefcount(x_t), sys.getrefcount(program))
    before = rss_bytes()
    calls(100_000)
    gc.collect()
    grown = rss_bytes() - before
    assert (sys.getrefcount(x_np), sys.getrefcount(out_np), sys.getrefcount(x_t), sys.getrefcount(program)) == refs
    assert grown < 8 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over 100k calls"


@pytest.mark.cuda
def test_ops_on_several_streams_at_once():
    f = brrr.chain("sin", ("mul", 3.0), "tanh")
    streams = [torch.cuda.Stream() for _ in range(4)]
    inputs = [torch.randn(1 << 20, device="cuda") for _ in streams]
    outputs = [None] * len(streams)
    for _ in range(5):
        for i, (stream, x) in enumerate(zip(streams, inputs)):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                outputs[i] = f(x)
                outputs[i] = brrr.layer_norm(outputs[i].view(1024, 1024), (1024,))
    torch.cuda.synchronize()
    for x, y in zip(inputs, outputs):
        ref = torch.nn.functional.layer_norm(torch.tanh(torch.sin(x.double()) * 3).view(1024, 1024), (1024,))
        torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_tensors_on_another_device_than_the_current_one():
    x = torch.randn(1000, device="cuda")
    with pytest.raises(ValueError, match="argument out is on cpu but x is on cuda:0"):
        brrr.cos(x, out=torch.empty(1000))
    last = torch.cuda.device_count() - 1
    y = torch.randn(1000, device=f"cuda:{last}")
    with torch.cuda.device(0):
        out = brrr.cos(y)
        assert torch.cuda.current_device() == 0  # left as it was
    torch.testing.assert_close(out, torch.cos(y))


def test_chain_program_holds_its_steps_while_it_reads_them():
    """A scalar's __float__ runs Python code in the middle of chain_program: one that empties the
    list of steps must not leave the loop reading freed items (it crashed the interpreter). Run in
    a child process, so that a crash fails the test rather than the suite."""
    code = ("from brrr import _C\n"
            "steps = []\n"
            "class Evil:\n"
            "    def __float__(self):\n"
            "        steps.clear()\n"
            "        return 1.0\n"
            "steps += [('add', Evil())] + ['cos'] * 8\n"
            "p = _C.chain_program(steps)\n"
            "assert p == _C.chain_program([('add', 1.0)] + ['cos'] * 8), p\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])
