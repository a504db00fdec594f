"""The repeat sweep's kernels at one repeat count, brrr's compiled chain and torch.compile's, for
ncu to compare (the compute knee, where the two kernels' instructions are the same):

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section LaunchStats -k regex:"brrr_chain|triton" python3 benchmarks/probes/knee_ncu.py 64
"""

import sys

import torch

import brrr


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
    x = torch.randn(1 << 28, device="cuda", dtype=dtype)
    chain = brrr.chain(*[("mul", 1.0001)] * repeats)

    def eager(t):
        for _ in range(repeats):
            t = t * 1.0001
        return t

    compiled = torch.compile(eager)
    for fn in (chain, compiled):
        for _ in range(2):
            fn(x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
