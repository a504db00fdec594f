"""Per-kernel view of brrr's fused ops on the GPU: one warmed-up forward+backward of each, under
torch.profiler (kernel names and durations), meant to run under ncu as well:

    ncu --clock-control none -k regex:chain_ --section SpeedOfLight python3 benchmarks/profile_kernels.py

then the host's time per brrr.cos call (benchmarks/host_step.py measures whole training steps).
"""

import sys

import torch

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
                if evt.is_user_annotation:  # a range around kernels listed themselves
                    continue
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


if __name__ == "__main__":
    main(profile="--no-profile" not in sys.argv, only=[a for a in sys.argv[1:] if not a.startswith("--")])
