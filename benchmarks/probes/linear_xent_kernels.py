"""Where one forward+backward of the fused linear cross-entropy spends its device time, kernel by
kernel (torch.profiler, one warm call), for brrr at several chunk sizes, torch.compile of the plain
formula and Liger-Kernel's fused linear cross-entropy (where importable), at 16384 x 4096 x 128256
bf16 with 10% of the targets ignored, as benchmarks/test_bench_linear_xent.py measures them:

    python3 benchmarks/probes/linear_xent_kernels.py [--rows 16384 --hidden 4096 --vocab 128256]

Prints per implementation: the kernels' summed time, the span from the first kernel's start to the
last one's end (the gaps between kernels count there), and the kernels grouped by name (count,
total ms), largest first.
"""

import argparse
import collections
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import brrr  # noqa: E402
from harness import compiled, device_activities, time_ms  # noqa: E402


def kernels(fn):
    """[(name, start_ns, end_ns)] of the device work of one call of fn()."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name(), e.start_ns(), e.end_ns())
            for e in device_activities(prof.profiler.kineto_results.events(), torch.autograd.DeviceType.CUDA)]


def short(name):
    return name if len(name) <= 90 else name[:87] + "..."


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, args.hidden, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g) / args.hidden**0.5).to(
        torch.bfloat16).requires_grad_()
    t = torch.randint(0, args.vocab, (args.rows,), device="cuda", generator=g)
    t[torch.rand(args.rows, device="cuda", generator=g) < 0.1] = -100

    def plain(x, w, t):
        return F.cross_entropy(F.linear(x, w).float(), t)

    impls = {}
    for budget in (2**27, 2**28, 2**29):
        impls[f"brrr weight accumulation, {budget >> 20} MiB chunks"] = (
            lambda x, w, t, budget=budget: brrr.linear_cross_entropy(
                x, w, t, dtype=torch.float32, accumulation="weight", logits_budget=budget))
    impls["compile"] = compiled(plain)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        impls["liger"] = lambda x, w, t: liger(w, x, t)
    except ImportError:
        pass
    for name, loss in impls.items():
        def step():
            torch.autograd.grad(loss(x, w, t), (x, w))

        wall = time_ms(step, warmup=3, reps=10, max_time_s=2.0)
        ks = kernels(step)
        busy = sum(e - s for _, s, e in ks) / 1e6
        span = (max(e for _, _, e in ks) - min(s for _, s, _ in ks)) / 1e6
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for n, s, e in ks:
            by_name[n][0] += 1
            by_name[n][1] += (e - s) / 1e6
        print(f"{name}: wall {wall:.2f} ms, kernels {busy:.2f} ms summed, span {span:.2f} ms, {len(ks)} kernels")
        for n, (count, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"    {ms:8.3f} ms {count:4d}x  {short(n)}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
