"""brrr in one minute: a fused chain on NumPy (always), PyTorch (if installed) and the GPU (if any)."""

import time

import numpy as np

import brrr

print("brrr", brrr.__version__, brrr.build_info())

x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
f = brrr.chain("cos", "cos")
y = f(x)
print("NumPy: max |brrr - numpy| =", float(np.abs(y - np.cos(np.cos(x.astype(np.float64)))).max()))

try:
    import torch
except ImportError:
    torch = None
    print("PyTorch is not installed: pip install torch to see brrr under autograd")

if torch is not None:
    t = torch.randn(4096, 1024, requires_grad=True)
    b = torch.randn(1024, requires_grad=True)
    out = brrr.bias_gelu(t, b)  # gelu(t + b) in one pass, differentiable
    out.sum().backward()
    ref_t, ref_b = t.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.nn.functional.gelu(ref_t + ref_b).sum().backward()
    print("PyTorch: bias_gelu grad error", float((t.grad - ref_t.grad).abs().max()), float((b.grad - ref_b.grad).abs().max()))

if torch is not None and brrr.cuda_available():
    x = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)

    def bench(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20 * 1e3

    eager = bench(lambda: x.cos().cos())
    fused = bench(lambda: f(x))
    floor = 4 * x.numel() / 4.25e12 * 1e3
    print(f"CUDA bf16 2^28 cos(cos(x)): eager {eager:.3f} ms, brrr {fused:.3f} ms (floor at 4.25 TB/s: {floor:.3f} ms)")
