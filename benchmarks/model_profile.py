"""Where a model's training step spends its time: host or GPU, and in which kernels.

For transformers' Llama and GPT-2 (the configs of test_bench_models.py, 512 tokens per sequence),
unpatched and patched by brrr.patch, eager and torch.compile: the step time (CUDA events,
median), the summed kernel time of one step from the profiler (a step far longer than its
kernels waits on the host), graph breaks, the first call that synchronises with the GPU (where
in Python it was made), and the kernels and host-side ops that cost the most.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/model_profile.py [--batch 8] [--variants
        "unpatched eager,patched compile"] [llama] [gpt2]
"""

import argparse
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from harness import compiled, time_ms
from test_bench_models import BATCHES, MODELS, SEQ, build, set_patched, step_fn


def first_synchronising_call(step):
    """Where one step first waits for the GPU: torch's sync debug mode set to raise, and the
    innermost Python frames of what it raised (None when the step never synchronises)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step()
    except RuntimeError as error:
        frames = traceback.extract_tb(error.__traceback__)[-4:]
        return [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}: {f.line}" for f in frames] + [str(error)[:120]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return None


def kernel_profile(step):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    top_gpu = sorted(kernels, key=lambda e: -e.self_device_time_total)[:16]
    cpu_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    top_cpu = sorted(cpu_ops, key=lambda e: -e.self_cpu_time_total)[:10]
    brrr_cpu = [e for e in cpu_ops if e.key.startswith("brrr::")]
    return gpu_us, launches, top_gpu, top_cpu, brrr_cpu


def gpu_gaps(step, top=10):
    """Where the GPU waits between kernels in two back-to-back steps: the idle time per step and
    the largest gaps with the kernels on either side (CUPTI timestamps; CUDA activity only, so
    the profiler adds little host time of its own)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    gaps, busy_until, previous = [], None, None
    for e in kernels:
        if busy_until is not None and e.time_range.start > busy_until:
            gaps.append((e.time_range.start - busy_until, previous.name, e.name))
        if busy_until is None or e.time_range.end > busy_until:
            busy_until, previous = e.time_range.end, e
    idle = sum(g for g, _, _ in gaps) / 2
    return idle, sorted(gaps, reverse=True)[:top]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=BATCHES[0])
    parser.add_argument("--variants", default="unpatched eager,unpatched compile,patched eager,patched compile")
    args = parser.parse_args()
    for name in args.models:
        base, patched = build(name)
        tokens = torch.randint(0, 32000, (args.batch, SEQ), device="cuda")
        for variant in args.variants.split(","):
            label, mode = variant.split()
            report = set_patched(patched, label == "patched")
            if report is not None:
                print(f"\n{name}: {report}")
            model = base if label == "unpatched" else patched
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            step = step_fn(model if mode == "eager" else compiled(model), tokens)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            ms = time_ms(step, warmup=3, reps=20)
            gpu_us, launches, top_gpu, top_cpu, brrr_cpu = kernel_profile(step)
            print(f"\n== {name} {args.batch}x{SEQ} {label} {mode}: step {ms:.3f} ms, kernels {gpu_us / 1e3:.3f} ms "
                  f"in {launches} launches, graph breaks {breaks}")
            for line in first_synchronising_call(step) or ["none"]:
                print(f"   first sync: {line}")
            idle, gaps = gpu_gaps(step)
            print(f"   gpu idle between kernels: {idle:.1f} us per step; largest gaps of two steps:")
            for gap, before, after in gaps:
                print(f"   gap {gap:8.1f} us  after {before[:60]}  before {after[:60]}")
            for e in top_gpu:
                print(f"   gpu {e.self_device_time_total:9.1f} us  x{e.count:<4d} {e.key[:100]}")
            for e in top_cpu:
                print(f"   cpu {e.self_cpu_time_total:9.1f} us  x{e.count:<4d} {e.key[:100]}")
            for e in brrr_cpu:
                print(f"   brrr op {e.cpu_time_total:9.1f} us total  x{e.count:<4d} {e.key}")


if __name__ == "__main__":
    main()
