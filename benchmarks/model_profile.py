"""Where a model's training step spends its time: host or GPU, and in which kernels.

For transformers' Llama and GPT-2 (the configs of test_bench_models.py, 512 tokens per sequence),
unpatched and patched by brrr.patch, eager and torch.compile: the step time (CUDA events,
median), the summed kernel time of one step from the profiler (a step far longer than its
kernels waits on the host), graph breaks, the first call that synchronises with the GPU (where
in Python it was made), and the kernels and host-side ops that cost the most.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/model_profile.py [--batch 8] [--variants
        "unpatched eager,patched compile"] [llama] [gpt2]

--host-phases: instead, for eager steps at each --batch (comma-separated), the host's time in the
forward call and in backward() (the GPU synchronised before each step, so neither waits on an
earlier step) and the GPU's tail after backward() returns, unpatched, patched, and patched with
one group of swaps (norms, activations, gated MLPs, the loss, rotary) reverted: what each group
adds to or takes from the host's time.

--host-modules: for eager steps, unpatched and patched, at each --batch: the host's time inside
each module's forward call and every call in a step that synchronises with the GPU; a module whose
host time grows with the batch waits for the GPU there.
"""

import argparse
import statistics
import sys
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from harness import busy_ms, compiled, device_activities, time_ms
import brrr
from brrr import _patch
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
    # the step's device time as every benchmark counts it (harness.device_activities: without the
    # GPU-side ranges of record_function annotations, which torch.compile opens around its graphs)
    gpu_us = 1e3 * busy_ms([(e.start_ns(), e.end_ns()) for e in
                            device_activities(prof.profiler.kineto_results.events(), torch.autograd.DeviceType.CUDA)])
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
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
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.is_user_annotation), key=lambda e: e.time_range.start)
    gaps, busy_until, previous = [], None, None
    for e in kernels:
        if busy_until is not None and e.time_range.start > busy_until:
            gaps.append((e.time_range.start - busy_until, previous.name, e.name))
        if busy_until is None or e.time_range.end > busy_until:
            busy_until, previous = e.time_range.end, e
    idle = sum(g for g, _, _ in gaps) / 2
    return idle, sorted(gaps, reverse=True)[:top]


def host_phases(model, tokens, reps=30):
    """Median host ms in the forward call and in backward(), and the GPU's ms after backward()
    returns, each step starting on an idle GPU."""
    fwd, bwd, tail = [], [], []
    for i in range(reps + 5):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=tokens, labels=tokens, use_cache=False)
        t1 = time.perf_counter()
        out.loss.backward()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i >= 5:
            fwd.append(t1 - t0), bwd.append(t2 - t1), tail.append(t3 - t2)
    return tuple(statistics.median(v) * 1e3 for v in (fwd, bwd, tail))


_GROUPS = {"norms": ("RMSNorm", "LayerNorm"), "activations": ("gelu", "silu", "relu", "sigmoid", "tanh"),
           "gated MLPs": ("gated MLP",), "rotary": ("brrr rotary",)}


def revert(model, report, group):
    """Undo one group of brrr.patch's swaps on `model` (a benchmark's ablation, not an API); how
    many it undid."""
    undone = 0
    names = {name for name, _, new in report.swapped if any(new.startswith(p) or new.startswith("brrr.nn." + p)
                                                          for p in _GROUPS.get(group, ()))}
    for name, module in model.named_modules():
        if name in names and _patch._ORIGINAL in module.__dict__:
            module.__class__ = module.__dict__.pop(_patch._ORIGINAL)
            undone += 1
        if group == "the loss" and _patch._ORIGINAL_LOSS in module.__dict__:
            for key, value in module.__dict__.pop(_patch._ORIGINAL_LOSS).items():
                if value is _patch._MISSING:
                    del module.__dict__[key]
                else:
                    module.__dict__[key] = value
            undone += 1
    return undone


def synchronising_calls(step):
    """Every call in one step that synchronises with the GPU (torch's sync debug mode set to warn):
    [(Python location, count)]."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    counts = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}"
            counts[where] = counts.get(where, 0) + 1
    return sorted(counts.items())


def host_by_module(model, tokens, reps=20):
    """Mean host ms per step inside each module's forward call (hooks around it, inclusive of its
    children), and in the model library's create_causal_mask, over eager steps each starting on an
    idle GPU: where the forward's host time goes, and which calls wait for the GPU."""
    spans, starts = {}, {}
    handles = []
    for name, module in model.named_modules():
        def pre(mod, args, name=name):
            starts[name] = time.perf_counter()

        def post(mod, args, out, name=name):
            spans.setdefault(name, []).append(time.perf_counter() - starts[name])
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    library = sys.modules[type(model).__module__]
    original_mask = getattr(library, "create_causal_mask", None)
    if original_mask is not None:
        def timed_mask(*a, **k):
            t0 = time.perf_counter()
            try:
                return original_mask(*a, **k)
            finally:
                spans.setdefault("<create_causal_mask>", []).append(time.perf_counter() - t0)
        library.create_causal_mask = timed_mask
    step = step_fn(model, tokens)
    try:
        for i in range(reps + 5):
            if i == 5:
                spans.clear()
            torch.cuda.synchronize()
            step()
    finally:
        for h in handles:
            h.remove()
        if original_mask is not None:
            library.create_causal_mask = original_mask
    torch.cuda.synchronize()
    return {name: sum(v) / reps * 1e3 for name, v in spans.items()}


def main_host_modules(args):
    for name in args.models:
        base, patched = build(name)
        for label, model in (("unpatched", base), ("patched", patched)):
            set_patched(patched, label == "patched")
            per_batch = {}
            for batch in (int(b) for b in args.batch.split(",")):
                tokens = torch.randint(0, 32000, (batch, SEQ), device="cuda")
                per_batch[batch] = host_by_module(model, tokens)
                syncs = synchronising_calls(step_fn(model, tokens))
                print(f"\n{name} {label} eager {batch}x{SEQ}: synchronising calls per step: {syncs or 'none'}")
            batches = list(per_batch)
            print(f"== {name} {label} eager: host ms per step inside each module's forward (inclusive), "
                  f"batches {batches}")
            for module_name in sorted(per_batch[batches[0]], key=lambda n: -per_batch[batches[-1]].get(n, 0)):
                if per_batch[batches[-1]].get(module_name, 0) < 0.02:
                    continue
                times = "  ".join(f"{per_batch[b].get(module_name, 0):7.3f}" for b in batches)
                print(f"   {module_name or '<root>':40s} {times}")
        set_patched(patched, False)


def main_host_phases(args):
    for name in args.models:
        for batch in (int(b) for b in args.batch.split(",")):
            tokens = torch.randint(0, 32000, (batch, SEQ), device="cuda")
            base, patched = build(name)
            rows = [("unpatched", base, None)] + [("patched" + (f" without {g}" if g else ""), patched, g)
                                                 for g in (None, "norms", "activations", "gated MLPs", "the loss",
                                                           "rotary")]
            print(f"\n== {name} {batch}x{SEQ} eager, host ms per step (medians): forward call, backward(), "
                  "GPU tail after backward()")
            for label, model, group in rows:
                if model is patched:
                    report = brrr.patch(patched)
                    if group is not None and not revert(patched, report, group):
                        brrr.unpatch(patched)
                        continue  # nothing of that group in this model
                f, b, t = host_phases(model, tokens)
                print(f"   {label:30s} fwd {f:7.3f}  bwd {b:7.3f}  tail {t:7.3f}  total {f + b + t:7.3f}")
                if model is patched:
                    brrr.unpatch(patched)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--batch", default=str(BATCHES[0]))
    parser.add_argument("--host-phases", action="store_true")
    parser.add_argument("--host-modules", action="store_true")
    parser.add_argument("--variants", default="unpatched eager,unpatched compile,patched eager,patched compile")
    args = parser.parse_args()
    if args.host_phases:
        return main_host_phases(args)
    if args.host_modules:
        return main_host_modules(args)
    args.batch = int(args.batch)
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
