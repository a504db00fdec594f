"""A loop of one brrr._C forward call (or torch's op) on tiny tensors, for perf record of its host cost.

    PYTHONPATH=$PWD python benchmarks/probes/c_call_perf.py gelu|softmax|torch_gelu|torch_softmax|empty [calls] [device]
"""
import sys
import time

import torch

from brrr import _C

which, calls = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200000
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
x = torch.randn(2, 16, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
gelu = _C.chain_program(["gelu"])
step = {"gelu": lambda: _C.chain_fwd(x, None, gelu, ()), "softmax": lambda: _C.softmax_fwd(x, None, log=False),
        "torch_gelu": lambda: torch.nn.functional.gelu(x), "torch_softmax": lambda: torch.softmax(x, -1),
        "empty": lambda: torch.empty_like(x)}[which]
for _ in range(2000):
    step()
t0 = time.perf_counter()
for _ in range(calls):
    step()
if device == "cuda":
    torch.cuda.synchronize()
print(which, f"{(time.perf_counter() - t0) / calls * 1e6:.2f} us")
