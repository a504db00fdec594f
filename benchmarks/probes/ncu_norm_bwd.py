"""Kernels for ncu to read: the norm forward and backward, bf16, 16384 rows, at GPT-2's, Llama's
and the 4096-column widths (LayerNorm 768 and 4096, RMSNorm 1024 and 4096), weight (and bias)
gradients asked for, each width run twice: read each width's second forward, backward and
finalize kernels (the first pass pays for first-touch allocation).

    ncu --clock-control none -k regex:norm_ python3 benchmarks/probes/ncu_norm_bwd.py [768:layer_norm ...]
"""
import sys

import torch

import brrr

cases = [arg.split(":") for arg in sys.argv[1:]] or [
    ("768", "layer_norm"), ("1024", "rms_norm"), ("4096", "layer_norm"), ("4096", "rms_norm")]
for cols, kind in cases:
    cols = int(cols)
    x = torch.randn(16384, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    for _ in range(2):
        y = brrr.layer_norm(x, (cols,), w, b) if kind == "layer_norm" else brrr.rms_norm(x, (cols,), w)
        y.backward(g)
torch.cuda.synchronize()
