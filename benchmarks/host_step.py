"""Host cost of one forward+backward step of brrr's fused ops against eager PyTorch, on the GPU.

Tiny tensors make the GPU time negligible, so steady-state wall time per step is the host's cost
(Python, autograd, allocation, launches). Then, at the benchmark size, the CPU-side profile of a
few steps (which runtime calls they make), to see whether a step is host-bound there.

    PYTHONPATH=$PWD python3 benchmarks/host_step.py
"""

import time

import torch
import torch.nn.functional as F

import brrr

HIDDEN = 4096


def cases(rows, dtype):
    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)

    x, b, x2 = leaf(rows, HIDDEN), leaf(HIDDEN), leaf(rows, 2 * HIDDEN)
    w = leaf(HIDDEN)
    return {
        "brrr cos.cos": (lambda: brrr.chain("cos", "cos")(x), [x]),
        "eager cos.cos": (lambda: torch.cos(torch.cos(x)), [x]),
        "brrr bias_gelu_tanh": (lambda: brrr.bias_gelu(x, b, approximate="tanh"), [x, b]),
        "eager bias_gelu_tanh": (lambda: F.gelu(x + b, approximate="tanh"), [x, b]),
        "brrr swiglu": (lambda: brrr.swiglu(x2), [x2]),
        "eager swiglu": (lambda: F.silu(x2[:, :HIDDEN]) * x2[:, HIDDEN:], [x2]),
        "brrr rms_norm": (lambda: brrr.rms_norm(x, (HIDDEN,), w), [x, w]),
        "eager rms_norm": (lambda: F.rms_norm(x, (HIDDEN,), w), [x, w]),
        "brrr layer_norm": (lambda: brrr.layer_norm(x, (HIDDEN,), w, b), [x, w, b]),
        "eager layer_norm": (lambda: F.layer_norm(x, (HIDDEN,), w, b), [x, w, b]),
    }


def step_fn(fn, inputs):
    grad = torch.ones_like(fn())
    return lambda: torch.autograd.grad(fn(), inputs, grad)


def host_us(step, n=2000):
    for _ in range(100):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    print("== host us per fwd+bwd step, 8 rows (GPU time negligible)")
    for name, (fn, inputs) in cases(8, torch.bfloat16).items():
        print(f"  {name:24s} {host_us(step_fn(fn, inputs)):8.1f}")
    print("== CPU-side profile of 5 steps at 16384 rows, bf16 (self CPU us per step)")
    for name, (fn, inputs) in cases(16384, torch.bfloat16).items():
        if not name.startswith("brrr"):
            continue
        step = step_fn(fn, inputs)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(f"-- {name}")
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        for evt in events[:8]:
            print(f"  {evt.key[:50]:50s} n/step={evt.count / 5:5.1f} self_us/step={evt.self_cpu_time_total / 5:8.1f}")


if __name__ == "__main__":
    main()
