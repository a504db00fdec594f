"""brrr's CPU kernels on several threads: the thread count and its settings, results bitwise
identical at 1, 2 and 3 threads (reductions included), odd sizes around the vector width, the
block and the per-thread split, a fork child after the parent used threads, eight Python threads
calling at once, and one OpenMP runtime shared with PyTorch."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import brrr
from brrr import _C
from helpers import assert_close, random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Around the vector widths (4, 8, 16 floats), the 512-element block, and 64 chunks of rows.
SIZES = [1, 3, 15, 17, 511, 513, 1031]
ROWS = [1, 5, 63, 65, 130]


def _at_threads(fn, counts=(1, 2, 3)):
    """fn() with brrr on each thread count (the suite's grain of 1 splits even small inputs)."""
    results = []
    for n in counts:
        previous = brrr.set_num_threads(n)
        try:
            results.append(fn())
        finally:
            brrr.set_num_threads(previous)
    return results


def _assert_bitwise_same(results):
    first = results[0]
    for other in results[1:]:
        for a, b in zip(first, other):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _chain_bias_grads(rows, cols, dtype):
    # Inputs in [-1.5, 1.5]: the gradients of cos(gelu(x + b) * g) carry the float32 rounding of
    # the argument, so on [-3, 3] (arguments up to 18) an element near a zero of sin could miss the
    # float32 tolerance by a hair; this test is about thread counts, test_chain_grad about accuracy.
    x, bias, gate = (random(shape, dtype, "cpu", low=-1.5, high=1.5) for shape in [(rows, cols), (cols,), (rows, cols)])

    def run():
        xs, bs, gs = (t.clone().requires_grad_() for t in (x, bias, gate))
        y = brrr.chain("add_tensor", "gelu_tanh", "mul_tensor", "cos")(xs, bs, gs)
        y.backward(torch.ones_like(y))
        return y.detach(), xs.grad, bs.grad, gs.grad

    return run, (x, bias, gate)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", [3, 513])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_chain_bitwise_same_at_every_thread_count(rows, cols, dtype):
    run, (x, bias, gate) = _chain_bias_grads(rows, cols, dtype)
    results = _at_threads(run)
    _assert_bitwise_same(results)
    x64, b64, g64 = (t.to(torch.float64).requires_grad_() for t in (x, bias, gate))
    ref = torch.cos(torch.nn.functional.gelu(x64 + b64, approximate="tanh") * g64)
    ref.backward(torch.ones_like(ref))
    y, gx, gb, gg = results[0]
    assert_close(y, ref)
    assert_close(gx, x64.grad, scale=4)
    assert_close(gg, g64.grad, scale=4)
    assert_close(gb, b64.grad, scale=4 * rows ** 0.5)


@pytest.mark.parametrize("n", SIZES + [4097, 70001])
@pytest.mark.parametrize("name", ["cos", "exp", "silu", "gelu", "tanh", "sigmoid", "relu", "gelu_tanh", "sin"])
def test_single_activations_split_between_threads(n, name):
    x = random((n,), torch.float32, "cpu", low=-6, high=6)
    results = _at_threads(lambda: (brrr.chain(name)(x),))
    _assert_bitwise_same(results)
    ref = {"cos": torch.cos, "sin": torch.sin, "exp": torch.exp, "silu": torch.nn.functional.silu,
           "gelu": torch.nn.functional.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu,
           "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[name](x.double())
    assert_close(results[0][0], ref)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", [1, 17, 513])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_bitwise_same_at_every_thread_count(rows, cols, rms, dtype):
    x, w, b = random((rows, cols), dtype, "cpu"), random((cols,), dtype, "cpu"), random((cols,), dtype, "cpu")
    grad = random((rows, cols), dtype, "cpu")

    def run():
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = brrr.rms_norm(xs, (cols,), ws, eps=1e-6) if rms else brrr.layer_norm(xs, (cols,), ws, bs)
        y.backward(grad)
        return (y.detach(), xs.grad, ws.grad) + (() if rms else (bs.grad,))

    results = _at_threads(run)
    _assert_bitwise_same(results)
    x64, w64, b64 = (t.to(torch.float64).requires_grad_() for t in (x, w, b))
    if rms:
        ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    else:
        ref = torch.nn.functional.layer_norm(x64, (cols,), w64, b64)
    ref.backward(grad.double())
    scale = 8 if cols > 1 else 1e3  # one column: the gradients are rounding noise around 0
    assert_close(results[0][0], ref, scale=scale)
    assert_close(results[0][1], x64.grad, scale=scale * 4)
    assert_close(results[0][2], w64.grad, scale=scale * rows ** 0.5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("classes", [1, 17, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_bitwise_same_at_every_thread_count(rows, classes, dtype):
    logits = random((rows, classes), dtype, "cpu", low=-8, high=8)
    target = torch.randint(0, classes, (rows,))
    target[::7] = -100

    def run():
        ls = logits.clone().requires_grad_()
        loss = brrr.cross_entropy(ls, target, label_smoothing=0.1)
        loss.backward()
        return loss.detach(), ls.grad

    results = _at_threads(run)
    _assert_bitwise_same(results)
    l64 = logits.to(torch.float64).requires_grad_()
    ref = torch.nn.functional.cross_entropy(l64, target, label_smoothing=0.1)
    ref.backward()
    assert_close(results[0][0], ref, scale=4)
    assert_close(results[0][1], l64.grad, dtype=dtype, scale=4)


@pytest.mark.parametrize("rows", [1, 5, 65])
@pytest.mark.parametrize("classes", [15, 17, 512, 513, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("softcap, z_loss", [(None, 0.0), (15.0, 1e-2)])
def test_fused_cross_entropy_bitwise_same_at_every_thread_count(rows, classes, dtype, softcap, z_loss):
    """The fused forward+backward, its gradient written over the logits (in place), with and
    without softcap and z_loss: bitwise the same at 1, 2 and 3 threads, and the float64
    reference's. Class counts around the vector widths and the 512-class block (a row's maximum
    and sums fold block by block); -inf logits in some rows' later blocks."""
    from brrr import _C

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    logits = random((rows, classes), dtype, "cpu", low=-20, high=20)
    logits[::2, classes // 2:] = -float("inf")
    target = torch.randint(0, max(classes // 2, 1), (rows,))
    target[1::4] = -100
    count = (target != -100).sum().to(acc)
    args = dict(ignore_index=-100, label_smoothing=0.0, softcap=softcap, z_loss=z_loss)

    def run():
        grad, loss = logits.clone(), torch.empty(rows, dtype=acc)
        _C.cross_entropy_fwd_bwd(grad, target, loss, None, count, grad, **args)
        return loss, grad

    results = _at_threads(run)
    _assert_bitwise_same(results)
    x64 = logits.to(torch.float64).requires_grad_()
    z = x64 if softcap is None else softcap * torch.tanh(x64 / softcap)
    keep = target != -100
    rows_loss = torch.nn.functional.cross_entropy(z, target, reduction="none")
    rows_loss = rows_loss + torch.where(keep, z_loss * torch.logsumexp(z, -1) ** 2, 0.0)
    (rows_loss.sum() / count.double()).backward()
    assert_close(results[0][0], rows_loss, dtype=acc, scale=4)
    assert_close(results[0][1], x64.grad, dtype=dtype, scale=4)


@pytest.mark.parametrize("rows", [1, 5, 65])
@pytest.mark.parametrize("cols", [15, 17, 512, 513, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_bitwise_same_at_every_thread_count(rows, cols, dtype, log):
    """softmax and log_softmax, forward and backward: bitwise the same at 1, 2 and 3 threads, and
    the float64 reference's; rows around the vector widths and the 512-column block, with -inf in
    some rows' later blocks and a large offset common to other rows."""
    x = random((rows, cols), dtype, "cpu", low=-10, high=10)
    x[::2, cols // 2:] = -float("inf")
    x[1::3] += 1000
    grad = random((rows, cols), dtype, "cpu")
    fn = brrr.log_softmax if log else brrr.softmax

    def run():
        xs = x.clone().requires_grad_()
        y = fn(xs, -1)
        y.backward(grad)
        return y.detach(), xs.grad

    results = _at_threads(run)
    _assert_bitwise_same(results)
    x64 = x.to(torch.float64).requires_grad_()
    ref = (torch.log_softmax if log else torch.softmax)(x64, -1)
    ref.backward(grad.double())
    assert_close(results[0][0], ref, scale=4)
    # the gradient's terms are O(|grad|) with cancellation in the row sums (as tests/test_softmax.py)
    assert_close(results[0][1], x64.grad, scale=4 * cols ** 0.5)


@pytest.mark.parametrize("shape", [(1, 3), (65, 513), (130, 17)])
def test_dropout_and_rotary_bitwise_same_at_every_thread_count(shape):
    x, bias = random(shape, torch.float32, "cpu"), random(shape[-1:], torch.float32, "cpu")

    def run_dropout():
        xs, bs = x.clone().requires_grad_(), bias.clone().requires_grad_()
        y = brrr.bias_dropout_add(xs, bs, torch.zeros_like(x), p=0.3, training=True, seed=1234)
        y.backward(torch.ones_like(y))
        return y.detach(), xs.grad, bs.grad

    _assert_bitwise_same(_at_threads(run_dropout))
    d = 2 * ((shape[-1] + 1) // 2)
    q = random((shape[0], 2, d), torch.float32, "cpu")
    angles = random((shape[0], 1, d), torch.float64, "cpu")
    cos, sin = angles.cos().float(), angles.sin().float()
    results = _at_threads(lambda: (brrr.rotary(q, cos, sin),))
    _assert_bitwise_same(results)
    half = d // 2
    rotated = torch.cat([-q[..., half:], q[..., :half]], -1).double()
    assert_close(results[0][0], q.double() * cos.double() + rotated * sin.double())


def test_thread_count_settings():
    previous = brrr.set_num_threads(0)
    try:
        x = np.ones(4, np.float32)
        automatic = int(os.environ["OMP_NUM_THREADS"].split(",")[0]) if os.environ.get("OMP_NUM_THREADS") else os.cpu_count()
        assert brrr.get_num_threads() == automatic
        assert _C.num_threads_for(x) == automatic
        torch_threads = torch.get_num_threads()
        try:
            torch.set_num_threads(3)
            assert _C.num_threads_for(torch.ones(4)) == 3  # torch tensors follow torch's setting
            assert _C.num_threads_for(x) == automatic
        finally:
            torch.set_num_threads(torch_threads)
        assert brrr.set_num_threads(5) == 0
        assert brrr.get_num_threads() == 5
        assert _C.num_threads_for(torch.ones(4)) == _C.num_threads_for(x) == 5
    finally:
        brrr.set_num_threads(previous)
    with pytest.raises(ValueError, match="argument n"):
        brrr.set_num_threads(-1)
    with pytest.raises(TypeError, match="argument n"):
        brrr.set_num_threads("two")
    with pytest.raises(ValueError, match="argument elements"):
        _C.set_thread_grain(0)


@pytest.mark.parametrize("env, expected", [({"BRRR_NUM_THREADS": "3"}, 3), ({"OMP_NUM_THREADS": "5,2"}, 5),
                                           ({"BRRR_NUM_THREADS": "2", "OMP_NUM_THREADS": "5"}, 2)])
def test_environment_variables(env, expected):
    clean = {k: v for k, v in os.environ.items() if k not in ("BRRR_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import brrr; print(brrr.get_num_threads())"], env={**clean, **env},
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == expected


@pytest.mark.parametrize("value", ["abc", "-3", "5000", "4x"])
def test_a_bad_brrr_num_threads_is_warned_about_by_name(value):
    """set_num_threads refuses such counts; read at import, they leave the automatic count with a
    RuntimeWarning that names the variable (they were taken as automatic silently)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("BRRR_NUM_THREADS", "OMP_NUM_THREADS")}
    code = "import brrr; print(brrr.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, "BRRR_NUM_THREADS": value, "OMP_NUM_THREADS": "4"},
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and int(out.stdout) == 4, out.stderr
    assert f"RuntimeWarning: BRRR_NUM_THREADS: expected a count of threads from 0 (automatic) to 4096, got '{value}'" \
        in out.stderr


def test_fork_child_after_parent_used_threads():
    x = np.linspace(-50, 50, 200003, dtype=np.float32)
    cos_cos = brrr.chain("cos", "cos")
    previous = brrr.set_num_threads(2)
    try:
        expected = cos_cos(x)  # the parent's OpenMP pool is up
        target = np.arange(400, dtype=np.int64) % 500
        expected_softmax = brrr.softmax(x[:200000].reshape(400, 500), -1)
        expected_loss = brrr.cross_entropy(x[:200000].reshape(400, 500), target, reduction="none")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the same kernel, then report and leave without cleanup
            rows = x[:200000].reshape(400, 500)
            ok = (np.array_equal(cos_cos(x), expected) and np.array_equal(brrr.silu(x), brrr.silu(x))
                  and np.array_equal(brrr.softmax(rows, -1), expected_softmax)
                  and np.array_equal(brrr.cross_entropy(rows, target, reduction="none"), expected_loss)
                  and brrr._C.num_threads_for(x) == 1)  # as it runs
            os.write(write, b"ok" if ok else b"wrong")
            os._exit(0)
        os.close(write)
        finished = threading.Event()
        threading.Thread(target=lambda: (os.read(read, 8), finished.set()), daemon=True).start()
        if not finished.wait(60):
            os.kill(pid, 9)
            pytest.fail("a brrr kernel hung in a fork child")
        os.close(read)
        _, status = os.waitpid(pid, 0)
        assert status == 0
    finally:
        brrr.set_num_threads(previous)


def test_eight_python_threads_at_once():
    inputs = [random((37, 1031), torch.float32, "cpu") for _ in range(8)]
    weight = random((1031,), torch.float32, "cpu")
    gelu = brrr.chain("gelu")

    def work(x):
        return (gelu(x), brrr.layer_norm(x, (1031,), weight), brrr.cross_entropy(x, torch.zeros(37, dtype=torch.long)),
                brrr.softmax(x, -1))

    previous = brrr.set_num_threads(2)
    try:
        expected = [work(x) for x in inputs]
        results = [None] * 8
        barrier = threading.Barrier(8)

        def run(i):
            barrier.wait()
            results[i] = [work(inputs[i]) for _ in range(5)]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
    finally:
        brrr.set_num_threads(previous)
    for i in range(8):
        for got in results[i]:
            _assert_bitwise_same([expected[i], got])


@pytest.mark.parametrize("first", ["torch", "brrr", "numpy"])
def test_one_openmp_runtime_with_torch_and_numpy(first):
    """brrr links libgomp by its soname, which PyTorch's CPU wheels also bundle: whichever loads
    first serves both (NumPy's OpenBLAS uses threads of its own, no OpenMP)."""
    code = (f"import {first}\nimport brrr, numpy, torch\n"
            "x = numpy.ones(100000, numpy.float32); brrr.set_num_threads(2); brrr._C.set_thread_grain(1)\n"
            "brrr.cos(x); torch.ones(1000000).cos(); numpy.ones((300, 300)) @ numpy.ones((300, 300))\n"
            "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'omp' in l.rsplit('/', 1)[-1]}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    runtimes = eval(out.stdout)
    assert len(runtimes) == 1 and "libgomp" in runtimes[0], runtimes

