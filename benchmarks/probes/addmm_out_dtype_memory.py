"""Peak memory of the weight-gradient accumulation of linear_cross_entropy (grad_weight float32
+= grad_logits.T @ x in bf16, through cuBLAS's float32 output) by the ways PyTorch can write it,
and of brrr.linear_cross_entropy's forward and backward with each accumulation, on a CUDA device:

    python benchmarks/probes/addmm_out_dtype_memory.py
"""
import torch

import brrr

V, H, ROWS = 128256, 4096, 1024
dev = "cuda"


def peak_above(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


g = torch.randn(ROWS, V, device=dev, dtype=torch.bfloat16)
x = torch.randn(ROWS, H, device=dev, dtype=torch.bfloat16)
gw = torch.zeros(V, H, device=dev, dtype=torch.float32)
print(f"grad_weight float32: {gw.numel() * 4 / 2**30:.2f} GiB")
print(f"addmm(out_dtype, out=aliased): {peak_above(lambda: torch.addmm(gw, g.t(), x, out_dtype=torch.float32, out=gw)):.2f} GiB above")
print(f"addmm_ on float32 copies:       {peak_above(lambda: gw.addmm_(g.t().float(), x.float())):.2f} GiB above")
print(f"mm(out_dtype) then add_:        {peak_above(lambda: gw.add_(torch.mm(g.t(), x, out_dtype=torch.float32))):.2f} GiB above")
del g, x, gw

xs = torch.randn(16384, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, V, (16384,), device=dev)
loss = None


def forward(accumulation):
    global loss
    loss = brrr.linear_cross_entropy(xs, w, t, dtype=torch.float32, accumulation=accumulation)


for accumulation in brrr.xent.ACCUMULATIONS:
    print(f"linear_cross_entropy, accumulation {accumulation!r}, forward (grads computed): "
          f"{peak_above(lambda: forward(accumulation)):.2f} GiB above")
    print(f"  held after it: {torch.cuda.memory_allocated() / 2**30:.2f} GiB in all")
    print(f"  its backward: {peak_above(lambda: loss.backward()):.2f} GiB above")
    loss = xs.grad = w.grad = None
