"""Where a model's training step spends its time: host or GPU, and in which kernels.

For transformers' Llama and GPT-2 (the configs of test_bench_models.py, 4096 tokens per step),
unpatched and patched by brrr.patch, eager and torch.compile: the step time (CUDA events,
median), the summed kernel time of one step from the profiler (a step far longer than its
kernels waits on the host), graph breaks, the calls that synchronise with the GPU, and the
kernels and host-side ops that cost the most.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/model_profile.py [llama] [gpt2]
"""

import sys
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from harness import compiled, time_ms
from test_bench_models import BATCHES, MODELS, SEQ, build, step_fn


def synchronising_calls(step):
    """The warnings of torch's sync debug mode for one step: the calls that wait for the GPU."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted({str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message)})


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
        base, patched, _ = build(name)
        tokens = torch.randint(0, 32000, (BATCHES[0], SEQ), device="cuda")
        for label, model in (("unpatched", base), ("patched", patched)):
            for mode in ("eager", "compile"):
                torch._dynamo.utils.counters.clear()
                step = step_fn(model if mode == "eager" else compiled(model), tokens)
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
                ms = time_ms(step, warmup=3, reps=20)
                gpu_us, launches, top_gpu, top_cpu, brrr_cpu = kernel_profile(step)
                print(f"\n== {name} {label} {mode}: step {ms:.3f} ms, kernels {gpu_us / 1e3:.3f} ms in {launches} "
                      f"launches, graph breaks {breaks}")
                for message in synchronising_calls(step):
                    print(f"   syncs: {message}")
                for e in top_gpu:
                    print(f"   gpu {e.self_device_time_total:9.1f} us  x{e.count:<4d} {e.key[:100]}")
                for e in top_cpu:
                    print(f"   cpu {e.self_cpu_time_total:9.1f} us  x{e.count:<4d} {e.key[:100]}")
                for e in brrr_cpu:
                    print(f"   brrr op {e.cpu_time_total:9.1f} us total  x{e.count:<4d} {e.key}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
