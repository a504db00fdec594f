"""Run-to-run bits of the chains of tests/test_chain_jit.py::test_exact_bounds_compute_the_default_bits
at (67, 1000), the launch whose last block is part empty: cos.mul.cos (a compiled pack function with
trig range checks, contiguous) and MIXED + mul (13 steps) with each of its 4 combinations of operand
shapes (x-shaped: contiguous, compiled; a row vector: the precompiled row kernels), float16 and
bfloat16, 128 and 256 threads. Each forward+backward is repeated and compared bit for bit with its
first run; a line per launch lists, per output (0 y, 1 x.grad, 2.. the operands' grads), the number
of elements that ever differed and the first few indices ({} where none did):

    python benchmarks/probes/chain_run_to_run.py [repetitions, default 100]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from helpers import random  # noqa: E402
from test_chain_jit import MIXED, _fwd_bwd  # noqa: E402

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
c = 1.0007
for threads in ("128", "256"):
    os.environ["BRRR_CHAIN_JIT_THREADS"] = threads
    for dtype in (torch.float16, torch.bfloat16):
        for steps in (["cos", ("mul", c), "cos"], MIXED + [("mul", c)]):
            n = sum(s in ("add_tensor", "mul_tensor") for s in steps)
            for vector in range(1 << n):
                x = random((67, 1000), dtype, "cuda", -2.0, 2.0)
                operands = [random((1000,) if vector >> b & 1 else (67, 1000), dtype, "cuda", -1.5, 1.5) for b in range(n)]
                g = random((67, 1000), dtype, "cuda")
                first, differ = _fwd_bwd(steps, x, operands, g), {}
                for _ in range(reps):
                    for i, (got, want) in enumerate(zip(_fwd_bwd(steps, x, operands, g), first)):
                        at = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
                        if len(at):
                            differ.setdefault(i, set()).update(map(tuple, at.tolist()))
                name = "cos.mul.cos" if n == 0 else "MIXED " + " ".join(
                    f"{op}:{'row' if vector >> b & 1 else 'full'}" for b, op in enumerate(("add_tensor", "mul_tensor")))
                print(threads, str(dtype)[6:], name, {i: (len(v), sorted(v)[:3]) for i, v in differ.items()}, flush=True)
