"""brrr's CPU code against PyTorch's CPU kernels, one thread: why the registry runs PyTorch's
functions on CPU tensors by default (brrr's CPU code is the reference twin of its CUDA kernels).

    PYTHONPATH=$PWD python benchmarks/cpu_twins.py
"""

import time

import torch
import torch.nn.functional as F

import brrr


def interleaved_min_us(cases, calls=5, rounds=10):
    """The fastest call of each case over interleaved rounds (a shared machine's noise only adds)."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def main():
    torch.set_num_threads(1)
    x = torch.randn(256, 1024)
    w, b = torch.randn(1024), torch.randn(1024)
    pairs = {
        "gelu tanh f32": (lambda: brrr.gelu(x, approximate="tanh"), lambda: F.gelu(x, approximate="tanh")),
        "silu f32": (lambda: brrr.silu(x), lambda: F.silu(x)),
        "layer_norm f32": (lambda: brrr.layer_norm(x, (1024,), w, b), lambda: F.layer_norm(x, (1024,), w, b)),
        "gelu bf16": (lambda: brrr.gelu(x.bfloat16()), lambda: F.gelu(x.bfloat16())),
    }
    cases = {f"{n} {who}": fn for n, fns in pairs.items() for who, fn in zip(("brrr", "torch"), fns)}
    best = interleaved_min_us(cases)
    print(f"256 x 1024, one thread, torch {torch.__version__}: us per call (min of interleaved rounds)")
    for n in pairs:
        ours, theirs = best[f"{n} brrr"], best[f"{n} torch"]
        print(f"  {n:16s} brrr {ours:9.1f}  torch {theirs:8.1f}  ratio {ours / theirs:5.1f}")


if __name__ == "__main__":
    main()
