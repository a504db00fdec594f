"""brrr's CPU kernels against PyTorch's CPU kernels and NumPy, in one process.

    PYTHONPATH=$PWD python benchmarks/cpu_twins.py            # full: the sizes of issue 23
    PYTHONPATH=$PWD python benchmarks/cpu_twins.py --smoke    # seconds (CI runs it: test_cpu_twins.py)
    PYTHONPATH=$PWD python benchmarks/cpu_twins.py --markdown out.md
    PYTHONPATH=$PWD python benchmarks/cpu_twins.py --threads 1 --clock cpu   # a loaded machine
    PYTHONPATH=$PWD python benchmarks/cpu_twins.py --only cross_entropy      # the cases naming it

Cases: chain("cos", "cos") on 2^24 float32 against x.cos().cos() and np.cos(np.cos(x)); each single
activation on 2^24 elements; LayerNorm, RMSNorm, SwiGLU, GeGLU, cross-entropy and softmax at 4096 x
{1024, 4096}, forward and forward+backward, float32 and bfloat16. Every implementation of a case
runs in the same round, one call each in turn, for many rounds (a shared machine's noise hits
them alike); a case reports the median time of each and the spread (interquartile range over
the median). brrr runs on its default thread count: torch.get_num_threads() for torch tensors,
os.cpu_count() for NumPy arrays; NumPy's ufuncs run on one thread. --threads N sets both torch's
and brrr's count; --clock cpu times the process's CPU time instead of the wall clock, which on a
machine shared with other work measures one thread's work without the waits for a core (with
several threads it would add up their spinning too).
"""

import argparse
import os
import statistics
import subprocess
import time

import numpy as np
import torch
import torch.nn.functional as F

import brrr

ACTIVATIONS = {
    "relu": (brrr.relu, torch.relu, lambda x: np.maximum(x, 0)),
    "gelu": (brrr.gelu, F.gelu, None),
    "gelu_tanh": (lambda x: brrr.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh"), None),
    "silu": (brrr.silu, F.silu, None),
    "sigmoid": (brrr.sigmoid, torch.sigmoid, None),
    "tanh": (brrr.tanh, torch.tanh, np.tanh),
    "exp": (brrr.exp, torch.exp, np.exp),
    "cos": (brrr.cos, torch.cos, np.cos),
    "sin": (brrr.sin, torch.sin, np.sin),
}


def measure(impls, rounds, clock=time.perf_counter):
    """Median seconds and spread of each implementation, called in turn, `rounds` times."""
    times = {name: [] for name in impls}
    for fn in impls.values():  # warm-up: first-touch page faults, thread pools, caches
        fn()
    for _ in range(rounds):
        for name, fn in impls.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        median = statistics.median(ts)
        out[name] = (median, (q[2] - q[0]) / median)
    return out


def _fwd_bwd(fn, *inputs):
    """A closure running fn forward and backward on fresh leaf copies' gradients."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    grad = None

    def run():
        nonlocal grad
        for t in leaves:
            t.grad = None
        y = fn(*leaves)
        if grad is None:
            grad = torch.randn_like(y) if y.ndim else torch.ones_like(y)
        y.backward(grad)

    return run


def cases(smoke):
    n = 1 << 14 if smoke else 1 << 24
    rows, widths = (64, [256]) if smoke else (4096, [1024, 4096])
    dtypes = [torch.float32, torch.bfloat16]

    x = torch.randn(n)
    xn = x.numpy()
    cos_cos = brrr.chain("cos", "cos")
    yield f"chain cos.cos 2^{n.bit_length() - 1} float32", {
        "brrr": lambda: cos_cos(x), "torch": lambda: x.cos().cos(), "numpy": lambda: np.cos(np.cos(xn)),
        "brrr numpy": lambda: cos_cos(xn)}
    for dtype in dtypes:
        xd = x.to(dtype)
        for name, (ours, theirs, numpy_fn) in ACTIVATIONS.items():
            impls = {"brrr": lambda o=ours: o(xd), "torch": lambda t=theirs: t(xd)}
            if numpy_fn is not None and dtype == torch.float32:
                impls["numpy"] = lambda f=numpy_fn: f(xn)
            yield f"{name} 2^{n.bit_length() - 1} {str(dtype)[6:]}", impls

    for dtype in dtypes:
        for cols in widths:
            size = f"{rows}x{cols} {str(dtype)[6:]}"
            h = torch.randn(rows, cols, dtype=dtype)
            w, b = torch.randn(cols, dtype=dtype), torch.randn(cols, dtype=dtype)
            g, u = torch.randn(rows, cols, dtype=dtype), torch.randn(rows, cols, dtype=dtype)
            target = torch.randint(0, cols, (rows,))
            norms = {
                "layer_norm": (lambda x, w, b: brrr.layer_norm(x, (cols,), w, b),
                               lambda x, w, b: F.layer_norm(x, (cols,), w, b), (h, w, b)),
                "rms_norm": (lambda x, w: brrr.rms_norm(x, (cols,), w, eps=1e-6),
                             lambda x, w: F.rms_norm(x, (cols,), w, eps=1e-6), (h, w)),
                "swiglu": (brrr.swiglu, lambda a, c: F.silu(a) * c, (g, u)),
                "geglu": (brrr.geglu, lambda a, c: F.gelu(a) * c, (g, u)),
                "cross_entropy": (lambda x: brrr.cross_entropy(x, target), lambda x: F.cross_entropy(x, target), (h,)),
                "softmax": (lambda x: brrr.softmax(x, -1), lambda x: torch.softmax(x, -1), (h,)),
            }
            for name, (ours, theirs, inputs) in norms.items():
                yield f"{name} fwd {size}", {"brrr": lambda o=ours, i=inputs: o(*i), "torch": lambda t=theirs, i=inputs: t(*i)}
                yield f"{name} fwd+bwd {size}", {"brrr": _fwd_bwd(ours, *inputs), "torch": _fwd_bwd(theirs, *inputs)}


def run(smoke=False, rounds=None, markdown=None, threads=None, clock="wall", only=None):
    rounds = rounds or (3 if smoke else 21)
    if threads:
        torch.set_num_threads(threads)
        brrr.set_num_threads(threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    header = (f"brrr {commit}, torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
              f"torch threads {torch.get_num_threads()}, brrr threads {brrr.get_num_threads()} (NumPy inputs); "
              f"median ms ({clock} clock) of {rounds} interleaved rounds (spread: interquartile range / median)")
    lines = [header, "", "| case | brrr ms | torch ms | numpy ms | torch / brrr | numpy / brrr |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    print(header)
    results = {}
    for name, impls in cases(smoke):
        if only and only not in name:
            continue
        r = measure(impls, rounds, time.process_time if clock == "cpu" else time.perf_counter)
        results[name] = r
        ours = r["brrr"][0]
        cell = lambda k: f"{r[k][0] * 1e3:.2f} ±{r[k][1]:.0%}" if k in r else ""
        ratio = lambda k: f"{r[k][0] / ours:.2f}x" if k in r else ""
        row = f"| {name} | {cell('brrr')} | {cell('torch')} | {cell('numpy')} | {ratio('torch')} | {ratio('numpy')} |"
        if "brrr numpy" in r:
            row += f" (brrr on the NumPy array: {cell('brrr numpy')}, numpy / brrr {r['numpy'][0] / r['brrr numpy'][0]:.2f}x)"
        lines.append(row)
        print(row, flush=True)
    if markdown:
        with open(markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes and 3 rounds (seconds)")
    parser.add_argument("--rounds", type=int, help="rounds per case (default 21, smoke 3)")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--threads", type=int, help="torch's and brrr's thread count (default: theirs)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall clock or process CPU time")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    args = parser.parse_args()
    run(args.smoke, args.rounds, args.markdown, args.threads, args.clock, args.only)


if __name__ == "__main__":
    main()
