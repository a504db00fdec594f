"""The softmax kernels for ncu to read, brrr's (the kernel BRRR_SOFTMAX_KERNEL names) or
Liger-Kernel's, at 16384 rows: bf16 4096, fp32 4096, bf16 32768 and fp32 32768 columns, forward
and backward, each run twice (read the second):

    BRRR_SOFTMAX_KERNEL=flat ncu --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --section SchedulerStats \
        --metrics smsp__thread_inst_executed.sum -k regex:softmax python3 benchmarks/probes/ncu_softmax.py brrr
    ncu ... -k regex:softmax python3 benchmarks/probes/ncu_softmax.py liger

Instructions an element: smsp__thread_inst_executed.sum / (16384 * columns).
"""
import sys

import torch

import brrr


def main():
    who = sys.argv[1] if len(sys.argv) > 1 else "brrr"
    if who == "liger":
        from liger_kernel.ops.softmax import LigerSoftmaxFunction

        softmax = LigerSoftmaxFunction.apply
    else:
        def softmax(x):
            return brrr.softmax(x, -1)

    for dtype, cols in [(torch.bfloat16, 4096), (torch.float32, 4096), (torch.bfloat16, 32768), (torch.float32, 32768)]:
        x = torch.randn(16384, cols, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn(16384, cols, device="cuda", dtype=dtype)
        for _ in range(2):
            softmax(x).backward(g)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
