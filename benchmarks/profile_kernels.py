"""Per-kernel view of brrr's fused ops on the GPU: one warmed-up forward+backward of each, under
torch.profiler (kernel names and durations), meant to run under ncu as well:

    ncu --clock-control none -k regex:chain_ --section SpeedOfLight python3 benchmarks/profile_kernels.py

then host times: brrr.cos per call, and one eager forward+backward of each norm on a tensor small
enough that only the host's work shows (host_steps).
"""

import sys
import time

import torch
import torch.nn.functional as F

import brrr

ROWS, HIDDEN = 16384, 4096
CASES = {
    "cos.cos": (lambda x: brrr.chain("cos", "cos")(x), lambda: [(ROWS, HIDDEN)]),
    "bias_gelu": (lambda x, b: brrr.bias_gelu(x, b), lambda: [(ROWS, HIDDEN), (HIDDEN,)]),
    "bias_gelu_tanh": (lambda x, b: brrr.bias_gelu(x, b, approximate="tanh"), lambda: [(ROWS, HIDDEN), (HIDDEN,)]),
    "bias_silu": (lambda x, b: brrr.bias_silu(x, b), lambda: [(ROWS, HIDDEN), (HIDDEN,)]),
    "swiglu": (lambda x: brrr.swiglu(x), lambda: [(ROWS, 2 * HIDDEN)]),
    "layer_norm 768": (lambda x, w, b: brrr.layer_norm(x, (768,), w, b), lambda: [(ROWS, 768), (768,), (768,)]),
    "layer_norm": (lambda x, w, b: brrr.layer_norm(x, (HIDDEN,), w, b), lambda: [(ROWS, HIDDEN), (HIDDEN,), (HIDDEN,)]),
    "rms_norm 768": (lambda x, w: brrr.rms_norm(x, (768,), w), lambda: [(ROWS, 768), (768,)]),
    "rms_norm": (lambda x, w: brrr.rms_norm(x, (HIDDEN,), w), lambda: [(ROWS, HIDDEN), (HIDDEN,)]),
}


def step(fn, inputs, grad):
    y = fn(*inputs)
    return torch.autograd.grad(y, inputs, grad)


def main(profile=True, only=None):
    for dtype in (torch.bfloat16, torch.float32):
        for name, (fn, shapes) in CASES.items():
            if only and not any(name.startswith(o) for o in only):
                continue
            inputs = [torch.randn(s, device="cuda", dtype=dtype, requires_grad=True) for s in shapes()]
            with torch.no_grad():
                grad = torch.randn_like(fn(*inputs))
            for _ in range(3):
                step(fn, inputs, grad)
            torch.cuda.synchronize()
            if not profile:
                step(fn, inputs, grad)
                continue
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                    torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step(fn, inputs, grad)
                torch.cuda.synchronize()
            print(f"== {name} {dtype}")
            for evt in prof.key_averages():
                if evt.device_time_total > 0 and ("brrr" in evt.key or "chain" in evt.key or "norm" in evt.key or "kernel" in evt.key.lower()):
                    print(f"  {evt.key[:90]:90s} n={evt.count:3d} avg_device_us={evt.device_time_total / evt.count:9.1f}")
    x = torch.randn(1024, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(200):
            brrr.cos(x)
        torch.cuda.synchronize()
    print("== host: 200 x brrr.cos on 1024 elements")
    for evt in prof.key_averages():
        if evt.count >= 200:
            print(f"  {evt.key[:60]:60s} n={evt.count:4d} avg_cpu_us={evt.cpu_time_total / evt.count:7.2f}")
    host_steps()


def host_steps(rows=8, hidden=768, steps=2000):
    """Host time of one eager forward+backward (torch.autograd.grad) of each norm on a tensor small
    enough that the GPU idles: what a small-hidden training step pays per norm beyond its kernels."""
    ns = (hidden,)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, b = (torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn_like(x)
    cases = {"brrr.layer_norm": (lambda: brrr.layer_norm(x, ns, w, b), (x, w, b)),
             "F.layer_norm": (lambda: F.layer_norm(x, ns, w, b), (x, w, b)),
             "brrr.rms_norm": (lambda: brrr.rms_norm(x, ns, w), (x, w)),
             "F.rms_norm": (lambda: F.rms_norm(x, ns, w), (x, w))}
    print(f"== host: eager forward+backward of a {rows}x{hidden} bfloat16 norm, us per step (best of 5)")
    for name, (fn, inputs) in cases.items():
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                torch.autograd.grad(fn(), inputs, g)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) * 1e6 / steps)
        print(f"  {name:20s} {best:7.1f}")


if __name__ == "__main__":
    main(profile="--no-profile" not in sys.argv, only=[a for a in sys.argv[1:] if not a.startswith("--")])
