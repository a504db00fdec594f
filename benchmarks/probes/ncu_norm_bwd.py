"""Kernels for ncu to read: the norm backward at the narrow rows of the model benchmarks, bf16
LayerNorm 16384 x 768 (GPT-2) and RMSNorm 16384 x 1024 (Llama), weight (and bias) gradients
asked for, each run twice (ncu -k regex:norm_bwd_kernel -c 2 reads the second of each: -s 1)."""
import torch

import brrr

for cols, kind in ((768, "layer_norm"), (1024, "rms_norm")):
    x = torch.randn(16384, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    for _ in range(2):
        y = brrr.layer_norm(x, (cols,), w, b) if kind == "layer_norm" else brrr.rms_norm(x, (cols,), w)
        y.backward(g)
torch.cuda.synchronize()
