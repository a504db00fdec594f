"""Chains, bias+activation and GLUs against PyTorch eager and torch.compile, in one run.

GPU: the seed's sizes (2^10 .. 2^28 elements, 16384 x 4096 rows). CPU: a quick smoke version.
Each op's output is checked against eager before it is timed.
"""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import brrr
import harness
from harness import compiled, device, host_us_per_call, on_gpu, time_ms

QUICK = not on_gpu()
DTYPES = [torch.float32, torch.bfloat16]
SIZES = [1 << k for k in (range(10, 29, 2) if not QUICK else (10, 14, 18))]
ROWS, HIDDEN = (16384, 4096) if not QUICK else (256, 512)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def check(ours, theirs, dtype):
    for a, b in zip(ours if isinstance(ours, (tuple, list)) else [ours], theirs if isinstance(theirs, (tuple, list)) else [theirs]):
        err = (a.float() - b.float()).norm() / max(b.float().norm().item(), 1e-30)
        assert err < TOL[dtype], f"brrr disagrees with eager: relative error {err:.2e}"


def record(recorder, impl, ms, **row):
    recorder.add_timing(impl=impl, ms=ms, **row)


def test_cos_cos_sizes(recorder):
    brrr_f = brrr.chain("cos", "cos")
    for dtype in DTYPES:
        eager = lambda x: x.cos().cos()  # noqa: E731
        comp = compiled(lambda x: x.cos().cos()) if not QUICK or dtype == torch.float32 else None
        for n in SIZES:
            x = torch.randn(n, device=device(), dtype=dtype)
            check(brrr_f(x), eager(x), dtype)
            row = dict(family="chain", op="cos.cos", dtype=dtype, shape=(n,), pass_="fwd",
                       bytes_moved=2 * n * x.element_size())
            record(recorder, "brrr", time_ms(lambda: brrr_f(x)), **row)
            record(recorder, "eager", time_ms(lambda: eager(x)), **row)
            if comp is not None:
                check(comp(x), eager(x), dtype)
                record(recorder, "compile", time_ms(lambda: comp(x)), **row)


UNARY = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
         "sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp, "cos": torch.cos, "sin": torch.sin}


def test_unary_ops(recorder):
    """Each op alone at the largest size: which ones stay memory-bound."""
    n = SIZES[-1]
    for dtype in DTYPES:
        x = torch.randn(n, device=device(), dtype=dtype)
        for name, eager in UNARY.items():
            ours = brrr.chain(name)
            check(ours(x), eager(x), dtype)
            row = dict(family="unary", op=name, dtype=dtype, shape=(n,), pass_="fwd", bytes_moved=2 * n * x.element_size())
            record(recorder, "brrr", time_ms(lambda: ours(x)), **row)
            record(recorder, "eager", time_ms(lambda: eager(x)), **row)
            if not QUICK:
                comp = compiled(eager)
                record(recorder, "compile", time_ms(lambda: comp(x)), **row)


def _mul_chain(repeats):
    def f(x):
        for _ in range(repeats):
            x = x * 1.0001
        return x
    return f


def _interpreted(fn):
    """fn run through the precompiled kernels that interpret a chain (16 steps a pass)."""
    def run():
        previous = brrr._C.chain_jit_enable(False)
        try:
            return fn()
        finally:
            brrr._C.chain_jit_enable(previous)
    return run


# BRRR_BENCH_CHAIN_VARIANT=NAME=a,b (e.g. BRRR_CHAIN_JIT_BLOCKS=2,8): the repeat sweep times brrr
# once per value of the switch NAME (one that brrr's C code reads at every launch;
# docs/kernel-switches.md) as impl "brrr[NAME=value]", in one run with one torch.compile per row;
# unset, brrr as it runs by default.
SWITCH, _, _values = os.environ.get("BRRR_BENCH_CHAIN_VARIANT", "").partition("=")
SWITCH_VALUES = [v for v in _values.split(",") if v]


class _switch:
    """The environment variable SWITCH set to `value` inside the block (None: left as it is)."""

    def __init__(self, value):
        self.value, self.previous = value, None

    def __enter__(self):
        self.previous = os.environ.get(SWITCH)
        if self.value is not None:
            os.environ[SWITCH] = self.value

    def __exit__(self, *exc):
        if self.value is None:
            return
        if self.previous is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = self.previous


def test_repeat_sweep(recorder):
    """x * c applied r times: memory-bound while the arithmetic hides under the loads, then
    compute-bound (the seed's experiment). brrr compiles one kernel for the r steps, one pass;
    "brrr interpreted" is the precompiled kernels, 16 steps a pass (ceil(r / 16) passes)."""
    repeats = [1, 4, 16, 32, 64, 128, 256] if not QUICK else [1, 16, 64]
    n = 1 << 28 if not QUICK else 1 << 16
    for dtype in DTYPES if not QUICK else [torch.float32]:
        x = torch.randn(n, device=device(), dtype=dtype)
        for r in repeats:
            chain = brrr.chain(*[("mul", 1.0001)] * r)
            passes = math.ceil(r / 16)
            piece = brrr.chain(*[("mul", 1.0001)] * (r // passes))

            def interpreted(x=x, piece=piece, passes=passes):
                y = piece(x)
                for _ in range(passes - 1):
                    y = piece(y)
                return y

            eager = _mul_chain(r)
            comp = compiled(_mul_chain(r)) if not QUICK else None
            row = dict(family="repeat", op=f"mul x{r}", dtype=dtype, shape=(n,), pass_="fwd",
                       bytes_moved=2 * n * x.element_size(), repeats=r, flops=r * n)
            impls = ({f"brrr[{SWITCH}={v}]": (v, lambda: chain(x)) for v in SWITCH_VALUES}
                     or {"brrr": (None, lambda: chain(x))})
            for value, fn in impls.values():
                # Against float64: eager rounds to bfloat16 after every multiply (1.0001 is lost),
                # brrr and torch.compile once at the end.
                with _switch(value):
                    check(fn(), x.double() * 1.0001 ** r, dtype)
            impls.update({"brrr interpreted": (None, _interpreted(interpreted) if on_gpu() else None),
                          "eager": (None, lambda: eager(x)), "compile": (None, comp and (lambda: comp(x)))})
            for impl, (value, fn) in impls.items():
                if fn is None:
                    continue
                with _switch(value):
                    ms = time_ms(fn, max_time_s=0.5)
                rec = recorder.add_timing(impl=impl, ms=ms, brrr_passes=passes if impl == "brrr interpreted" else 1, **row)
                rec["GFLOPs"] = r * n / (ms * 1e-3) / 1e9


# What the first call of a chain costs, in fresh processes sharing an empty cache folder: the
# first process compiles and loads each chain's programs, the second reads them from the disk
# cache. CUDA, brrr's PyTorch layer, NVRTC and (for "fwd+bwd") the autograd engine's CUDA thread are
# warmed up on a relu chain before the timed calls, which run on 2^16 elements: the forward alone
# (argv[3] "fwd"), or forward and backward through autograd ("fwd+bwd": the forward's call builds
# both programs at once); fwd_ms is the forward's share.
FIRST_CALL = """
import json, sys, time, torch, brrr
dtype, backward = getattr(torch, sys.argv[1]), sys.argv[3] == "fwd+bwd"
x = torch.randn(1 << 16, device="cuda", dtype=dtype, requires_grad=backward)
grad = torch.randn_like(x)
# Gradients through torch.autograd.grad, not added into x.grad: the second backward of a process
# would otherwise load torch's add kernel, 11-17 ms on an H200, and count it as the chain's.
warm = brrr.chain("relu")(x)
if backward:
    torch.autograd.grad(warm, x, grad)
for name, steps in json.loads(sys.argv[2]):
    chain = brrr.chain(*[s if isinstance(s, str) else tuple(s) for s in steps])
    before = brrr._C.chain_jit_info()
    torch.cuda.synchronize()
    started = time.perf_counter()
    y = chain(x)
    torch.cuda.synchronize()
    forward_done = time.perf_counter()
    if backward:
        torch.autograd.grad(y, x, grad)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - started) * 1e3
    info = brrr._C.chain_jit_info()
    print(json.dumps(dict(op=name, ms=ms, fwd_ms=(forward_done - started) * 1e3, build_ms=info["last_seconds"] * 1e3,
                          compiled=info["compiled"] - before["compiled"],
                          from_disk=info["from_disk"] - before["from_disk"])))
"""


def test_first_call(recorder, tmp_path):
    """First call of a new chain (compile + load) and of a cached one in a new process, forward
    alone and forward with backward."""
    chains = [("cos.cos", ["cos", "cos"]), ("mixed12", MIXED12), ("mul x256", [("mul", 1.0001)] * 256)]
    # NVRTC alone, where it is installed (no GPU needed): each program compiled into an empty cache folder.
    if brrr._C.chain_jit_info()["nvrtc"] is not None:
        brrr._C.chain_jit_compile(["relu"], "float32")  # NVRTC loaded
        try:
            for dtype in DTYPES:
                name = str(dtype).replace("torch.", "")
                for i, (op, steps) in enumerate(chains):
                    for pass_ in ("fwd", "fwd+bwd"):
                        os.environ["BRRR_CACHE_DIR"] = str(tmp_path / f"nvrtc-{name}-{i}{pass_}")
                        started = time.perf_counter()
                        brrr._C.chain_jit_compile(steps, name, arch=90, with_backward=pass_ == "fwd+bwd")
                        recorder.add(family="first_call", op=op, dtype=name, impl="brrr", calls=pass_,
                                     phase="compile only", ms=(time.perf_counter() - started) * 1e3,
                                     nvrtc=brrr._C.chain_jit_info()["nvrtc_version"], cpus=os.cpu_count())
        finally:
            del os.environ["BRRR_CACHE_DIR"]
    if not on_gpu():
        return
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        for pass_ in ("fwd", "fwd+bwd"):
            env = {**os.environ, "BRRR_CACHE_DIR": str(tmp_path / f"{name}{pass_}")}
            for phase in ("compile + load", "cached, new process"):
                out = subprocess.run([sys.executable, "-c", FIRST_CALL, name, json.dumps(chains), pass_], env=env,
                                     capture_output=True, text=True, timeout=300, check=True).stdout
                for line in out.splitlines():
                    r = json.loads(line)
                    recorder.add(family="first_call", op=r["op"], dtype=name, impl="brrr", calls=pass_, phase=phase,
                                 ms=r["ms"], fwd_ms=r["fwd_ms"], build_ms=r["build_ms"], compiled=r["compiled"],
                                 from_disk=r["from_disk"])


def test_host_overhead(recorder):
    """Host time per call, back to back (the overhead regime), against size."""
    sizes = [1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20] if not QUICK else [1 << 10]
    brrr_f = brrr.chain("cos", "cos")
    comp = compiled(lambda x: x.cos().cos()) if not QUICK else None
    for n in sizes:
        x = torch.randn(n, device=device())
        out = torch.empty_like(x)
        program = brrr_f.program
        impls = {
            "eager cos": lambda: torch.cos(x),
            "eager": lambda: x.cos().cos(),
            "brrr cos": lambda: brrr.cos(x),
            "brrr": lambda: brrr_f(x),
            "brrr out=": lambda: brrr_f(x, out=out),
            # The pieces of brrr's call path, to see where host time goes.
            "piece: torch.empty_like": lambda: torch.empty_like(x),
            "piece: brrr._C.chain_fwd": lambda: brrr._C.chain_fwd(x, out, program, ()),
        }
        if comp is not None:
            comp(x)
            impls["compile"] = lambda: comp(x)
        if on_gpu():
            for name, body in (("graph", lambda: x.cos().cos()), ("brrr graph", lambda: brrr_f(x))):
                graph = torch.cuda.CUDAGraph()
                body()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    captured = body()
                graph.replay()
                torch.cuda.synchronize()
                check(captured, x.cos().cos(), torch.float32)
                impls[name] = graph.replay
        for impl, fn in impls.items():
            recorder.add(family="overhead", op="cos.cos", dtype="float32", shape=[n], impl=impl,
                         host_us=host_us_per_call(fn, calls=2000 if not QUICK else 200))


MIXED12 = ["sin", ("mul", 1.5), "tanh", ("add", 0.5), "exp", "log1p", ("mul", 0.7), "cos", "sigmoid", ("pow", 2.0),
           "softplus", "gelu"]
_MIXED12 = brrr.chain(*MIXED12)


def _mixed12_eager(x):
    y = torch.exp(torch.tanh(torch.sin(x) * 1.5) + 0.5)
    y = torch.sigmoid(torch.cos(torch.log1p(y) * 0.7)) ** 2.0
    return F.gelu(F.softplus(y))


def _fwd_bwd(fn, inputs, grad):
    def step():
        y = fn(*inputs)
        return torch.autograd.grad(y, inputs, grad)
    return step


def _held_bytes(fn, inputs):
    """Bytes the forward keeps alive for the backward (beyond its inputs and output)."""
    if not on_gpu():
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fn(*inputs)
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return held


FUSED = {
    "cos.cos": dict(brrr=lambda x: brrr.chain("cos", "cos")(x), eager=lambda x: x.cos().cos(),
                    shapes=lambda r, h: [(r, h)], passes=(2, 5)),
    # Twelve steps, transcendentals and scalars: read x, write y; the backward reads x and grad.
    "mixed12": dict(brrr=lambda x: _MIXED12(x), eager=lambda x: _mixed12_eager(x), shapes=lambda r, h: [(r, h)],
                    passes=(2, 5)),
    "bias_gelu": dict(brrr=lambda x, b: brrr.bias_gelu(x, b), eager=lambda x, b: F.gelu(x + b),
                      shapes=lambda r, h: [(r, h), (h,)], passes=(2, 5)),
    "bias_gelu_tanh": dict(brrr=lambda x, b: brrr.bias_gelu(x, b, approximate="tanh"),
                           eager=lambda x, b: F.gelu(x + b, approximate="tanh"), shapes=lambda r, h: [(r, h), (h,)],
                           passes=(2, 5)),
    "bias_silu": dict(brrr=lambda x, b: brrr.bias_silu(x, b), eager=lambda x, b: F.silu(x + b),
                      shapes=lambda r, h: [(r, h), (h,)], passes=(2, 5)),
    # SwiGLU on a fused gate_up projection [rows, 2h] -> [rows, h]: 3 passes forward, 8 in all.
    "swiglu": dict(brrr=lambda x: brrr.swiglu(x), eager=lambda x: F.silu(x[..., :x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:],
                   shapes=lambda r, h: [(r, 2 * h)], passes=(3, 8)),
    "geglu": dict(brrr=lambda x: brrr.geglu(x), eager=lambda x: F.gelu(x[..., :x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:],
                  shapes=lambda r, h: [(r, 2 * h)], passes=(3, 8)),
    # Separate gate and up projections (Llama's MLP): the same passes, through the GLU backward kernel.
    "swiglu_two_inputs": dict(brrr=lambda g, u: brrr.swiglu(g, u), eager=lambda g, u: F.silu(g) * u,
                              shapes=lambda r, h: [(r, h), (r, h)], passes=(3, 8)),
    "geglu_tanh_two_inputs": dict(brrr=lambda g, u: brrr.geglu(g, u, approximate="tanh"),
                                  eager=lambda g, u: F.gelu(g, approximate="tanh") * u,
                                  shapes=lambda r, h: [(r, h), (r, h)], passes=(3, 8)),
}


@pytest.mark.parametrize("op", list(FUSED))
def test_fused_forward_backward(recorder, op):
    spec = FUSED[op]
    for dtype in DTYPES:
        shapes = spec["shapes"](ROWS, HIDDEN)
        inputs = [torch.randn(s, device=device(), dtype=dtype, requires_grad=True) for s in shapes]
        comp = compiled(spec["eager"]) if not QUICK else None
        with torch.no_grad():
            out_shape = spec["eager"](*inputs).shape
        grad = torch.randn(out_shape, device=device(), dtype=dtype)
        unit = ROWS * HIDDEN * inputs[0].element_size()  # one pass over a [rows, hidden] tensor
        fwd_passes, all_passes = spec["passes"]
        impls = {"brrr": spec["brrr"], "eager": spec["eager"], "compile": comp}
        reference = _fwd_bwd(spec["eager"], inputs, grad)()
        for impl, fn in impls.items():
            if fn is None:
                continue
            check(_fwd_bwd(fn, inputs, grad)(), reference, dtype)
            with torch.no_grad():
                fwd_ms = time_ms(lambda: fn(*inputs))
            held = _held_bytes(fn, inputs)
            common = dict(family="fused", op=op, dtype=dtype, shape=shapes[0], impl=impl)
            recorder.add_timing(pass_="fwd", ms=fwd_ms, bytes_moved=fwd_passes * unit, **common)
            recorder.add_timing(pass_="fwd+bwd", ms=time_ms(_fwd_bwd(fn, inputs, grad)), bytes_moved=all_passes * unit,
                                saved_bytes=held, input_bytes=sum(t.numel() * t.element_size() for t in inputs), **common)


def test_backward_kernel_alone(recorder):
    """The chain backward's kernel alone (brrr._C.chain_bwd, no autograd): x and grad in, grad_x out,
    3 passes; and the forward's and backward's kernels back to back, 5 passes. Beside the fused
    rows' fwd+bwd through autograd, this says whether a backward short of the floor loses its time
    in the kernel or around it."""
    for name, steps, eager in (("cos.cos", ["cos", "cos"], lambda t: t.cos().cos()), ("mixed12", MIXED12, _mixed12_eager)):
        chain = brrr.chain(*steps)
        for dtype in DTYPES:
            x = torch.randn(ROWS, HIDDEN, device=device(), dtype=dtype)
            grad = torch.randn_like(x)
            y, grad_x = torch.empty_like(x), torch.empty_like(x)
            leaf = x.detach().requires_grad_()
            want = torch.autograd.grad(eager(leaf), leaf, grad)[0]
            bwd = lambda: brrr._C.chain_bwd(x, grad, grad_x, None, chain.program, (), ())  # noqa: E731
            both = lambda: (brrr._C.chain_fwd(x, y, chain.program, ()), bwd())  # noqa: E731
            unit = x.numel() * x.element_size()
            common = dict(family="backward", op=name, dtype=dtype, shape=x.shape)
            for impl, fn in (("brrr", bwd), ("brrr interpreted", _interpreted(bwd) if on_gpu() else None)):
                if fn is None:
                    continue
                fn()
                check(grad_x, want, dtype)
                recorder.add_timing(impl=impl, pass_="bwd kernel", ms=time_ms(fn), bytes_moved=3 * unit, **common)
            recorder.add_timing(impl="brrr", pass_="fwd+bwd kernels", ms=time_ms(both), bytes_moved=5 * unit, **common)


def test_bias_dropout_add(recorder):
    """residual + dropout(x + bias, p) against eager and torch.compile of the same expression.
    The masks differ (each draws its own), so brrr is checked against float math on its own mask,
    read off a call with x = 1, residual = 0 and the same seed. Floor: the forward reads x,
    residual and bias and writes out; forward+backward also reads grad and writes grad_x and
    grad_bias (grad_residual is grad itself)."""
    p, seed = 0.1, 1234
    ours = lambda x, b, r: brrr.bias_dropout_add(x, b, r, p, seed=seed)  # noqa: E731
    eager = lambda x, b, r: r + F.dropout(x + b, p)  # noqa: E731
    for dtype in DTYPES:
        x, r = (torch.randn(ROWS, HIDDEN, device=device(), dtype=dtype, requires_grad=True) for _ in range(2))
        b = torch.randn(HIDDEN, device=device(), dtype=dtype, requires_grad=True)
        grad = torch.randn(ROWS, HIDDEN, device=device(), dtype=dtype)
        with torch.no_grad():
            keep = brrr.bias_dropout_add(torch.ones_like(x), None, torch.zeros_like(r), p, seed=seed) != 0
            check(ours(x, b, r), torch.where(keep, (x.float() + b.float()) / (1 - p), 0.0) + r.float(), dtype)
        assert abs(keep.float().mean().item() - (1 - p)) < 1e-2
        unit, vector = ROWS * HIDDEN * x.element_size(), HIDDEN * x.element_size()
        inputs = [x, b, r]
        impls = {"brrr": ours, "eager": eager, "compile": compiled(eager) if not QUICK else None}
        for impl, fn in impls.items():
            if fn is None:
                continue
            with torch.no_grad():
                fwd_ms = time_ms(lambda: fn(*inputs))
            common = dict(family="fused", op="bias_dropout_add", dtype=dtype, shape=(ROWS, HIDDEN), impl=impl)
            recorder.add_timing(pass_="fwd", ms=fwd_ms, bytes_moved=3 * unit + vector, **common)
            recorder.add_timing(pass_="fwd+bwd", ms=time_ms(_fwd_bwd(fn, inputs, grad)), bytes_moved=5 * unit + 2 * vector,
                                saved_bytes=_held_bytes(fn, inputs), input_bytes=2 * unit + vector, **common)
