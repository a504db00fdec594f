"""Kernels for ncu to read: brrr rotary on Llama-shaped transposed q (bf16) and the SwiGLU backward
of a Llama MLP (bf16 16384 x 2816). Run under ncu -k regex:"rotary|glu_bwd"."""
import torch, brrr
q, k = (torch.randn(32, 512, 16, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
cos, sin = (torch.randn(32, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(2):
    brrr.apply_rotary_pos_emb(q, k, cos, sin)
g = torch.randn(16384, 2816, device="cuda", dtype=torch.bfloat16, requires_grad=True)
u = torch.randn(16384, 2816, device="cuda", dtype=torch.bfloat16, requires_grad=True)
brrr.swiglu(g, u).backward(torch.randn_like(g))
torch.cuda.synchronize()
