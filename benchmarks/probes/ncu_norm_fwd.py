"""The bf16 norm forward kernels for ncu to read, brrr's (the kernel BRRR_NORM_FWD_KERNEL names)
or Liger-Kernel's, at 16384 rows: LayerNorm 4096, RMSNorm 4096 and LayerNorm 1024 columns, each
run twice (read the second):

    BRRR_NORM_FWD_KERNEL=bulk ncu --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --section SchedulerStats \
        --metrics smsp__thread_inst_executed.sum -k regex:norm_fwd python3 benchmarks/probes/ncu_norm_fwd.py brrr
    ncu ... -k regex:_forward python3 benchmarks/probes/ncu_norm_fwd.py liger
"""
import sys

import torch

import brrr


def main():
    who = sys.argv[1] if len(sys.argv) > 1 else "brrr"
    if who == "liger":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    for cols, kind in [(4096, "layer_norm"), (4096, "rms_norm"), (1024, "layer_norm")]:
        x = torch.randn(16384, cols, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            if who == "brrr":
                brrr.layer_norm(x, (cols,), w, b) if kind == "layer_norm" else brrr.rms_norm(x, (cols,), w)
            elif kind == "layer_norm":
                LigerLayerNormFunction.apply(x, w, b, 1e-5)
            else:
                LigerRMSNormFunction.apply(x, w, 1e-6)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
