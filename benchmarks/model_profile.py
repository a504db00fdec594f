"""Where a model's training step spends its time: host or GPU, and in which kernels.

For transformers' Llama and GPT-2 (the configs of test_bench_models.py), unpatched and patched by
brrr.patch, eager and torch.compile: the step time (CUDA events, median), the host time of one
step measured while a sleep kernel holds the GPU (so the host never waits for it), the summed
kernel time of one step from the profiler, graph breaks, and the kernels and host-side ops that
cost the most. A step is host-bound when its host time reaches its step time.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/model_profile.py [llama] [gpt2]
"""

import copy
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import brrr
from harness import compiled, time_ms
from test_bench_models import BATCH, MODELS, SEQ, step_fn


def host_ms(step, reps=5):
    """Host time of one step while the GPU is held busy (median of reps)."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~200 ms at the H200's clock: longer than any step's host time
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(samples)


def kernel_profile(step):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    top_gpu = sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]
    cpu_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    top_cpu = sorted(cpu_ops, key=lambda e: -e.self_cpu_time_total)[:10]
    brrr_cpu = [e for e in cpu_ops if e.key.startswith("brrr::")]
    return gpu_us, launches, top_gpu, top_cpu, brrr_cpu


def main(names):
    for name in names:
        torch.manual_seed(0)
        base = MODELS[name]().to("cuda", torch.bfloat16)
        base.train()
        for m in base.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        patched = copy.deepcopy(base)
        brrr.patch(patched)
        tokens = torch.randint(0, 32000, (BATCH, SEQ), device="cuda")
        for label, model in (("unpatched", base), ("patched", patched)):
            for mode in ("eager", "compile"):
                torch._dynamo.utils.counters.clear()
                step = step_fn(model if mode == "eager" else compiled(model), tokens)
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
                ms = time_ms(step, warmup=3, reps=20)
                host = host_ms(step)
                gpu_us, launches, top_gpu, top_cpu, brrr_cpu = kernel_profile(step)
                print(f"\n== {name} {label} {mode}: step {ms:.3f} ms, host {host:.3f} ms, kernels {gpu_us / 1e3:.3f} ms "
                      f"in {launches} launches, graph breaks {breaks}")
                for e in top_gpu:
                    print(f"   gpu {e.self_device_time_total:9.1f} us  x{e.count:<4d} {e.key[:100]}")
                for e in top_cpu:
                    print(f"   cpu {e.self_cpu_time_total:9.1f} us  x{e.count:<4d} {e.key[:100]}")
                for e in brrr_cpu:
                    print(f"   brrr op {e.cpu_time_total:9.1f} us total  x{e.count:<4d} {e.key}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
