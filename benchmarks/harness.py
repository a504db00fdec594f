"""Measurement helpers for brrr's benchmarks (see METHOD: events, warm-up, medians, floors).

Every row records its time, the fewest bytes the op must move, the floor (those bytes over the
copy bandwidth measured in the same run) and the fraction of the floor reached. Peers (eager,
torch.compile) are timed in the same process, on the same inputs, so ratios are like for like.
"""

import contextlib
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch


def on_gpu():
    return torch.cuda.is_available()


def device():
    return "cuda" if on_gpu() else "cpu"


def _sync():
    if on_gpu():
        torch.cuda.synchronize()


def time_ms(fn, warmup=10, reps=50, max_time_s=2.0):
    """Median milliseconds per call of fn(): CUDA events on the GPU, perf_counter on the CPU.

    Slow functions get fewer warm-ups and repetitions (at least 5), so a sweep stays in budget."""
    fn()
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    once = max(time.perf_counter() - t0, 1e-7)
    warmup = max(1, min(warmup, int(0.2 * max_time_s / once)))
    reps = max(5, min(reps, int(max_time_s / once)))
    for _ in range(warmup):
        fn()
    _sync()
    samples = []
    if on_gpu():
        # As triton's do_bench: events around each call, calls enqueued back to back with one
        # sync at the end, so the host's own per-call cost hides behind the GPU's where it can.
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        samples = [start.elapsed_time(end) for start, end in zip(starts, ends)]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def host_us_per_call(fn, calls=2000, rounds=5):
    """Host time per call (µs) for back-to-back calls, the overhead regime: median over rounds."""
    for _ in range(100):
        fn()
    if on_gpu():
        torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if on_gpu():
            torch.cuda.synchronize()
        per_round.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(per_round)


def kernel_ms(fn):
    """The summed device time of the kernels one call of fn() launches (torch.profiler; GPU only;
    call it warm, after time_ms). Where a call's host time exceeds its kernels', time_ms measures
    the host: this does not."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


_COPY_GBPS = None


def copy_gbps():
    """Device-to-device copy bandwidth, bytes read plus written, measured once per run."""
    global _COPY_GBPS
    if _COPY_GBPS is None:
        n = (1 << 28) if on_gpu() else (1 << 24)
        src = torch.randn(n, device=device())
        dst = torch.empty_like(src)
        ms = time_ms(lambda: dst.copy_(src), warmup=5, reps=20)
        _COPY_GBPS = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
    return _COPY_GBPS


def compiled(fn):
    """torch.compile(fn) with static shapes, its best case: dynamic-shape kernels ran up to 2x
    slower on the H200 (cos.cos, fp32, 2^28). Sweeps recompile per shape, so dynamo's recompile
    limits are raised: past them it would fall back to eager without saying so."""
    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 1024))
    return torch.compile(fn, dynamic=False)


def environment():
    env = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    if on_gpu():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["cpu"] = platform.processor() or platform.machine()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    env["copy_GBps"] = round(copy_gbps(), 1)
    return env


class Recorder:
    """Collects rows and writes them as JSON and a markdown table."""

    def __init__(self):
        self.rows = []

    def add(self, **row):
        self.rows.append(row)
        return row

    def add_timing(self, *, family, op, dtype, shape, pass_, impl, ms, bytes_moved, **extra):
        floor_ms = bytes_moved / (copy_gbps() * 1e9) * 1e3
        return self.add(family=family, op=op, dtype=str(dtype).replace("torch.", ""), shape=list(shape), pass_=pass_,
                        impl=impl, ms=ms, GBps=bytes_moved / (ms * 1e-3) / 1e9 if ms else None,
                        floor_ms=floor_ms, frac_floor=floor_ms / ms if ms else None, **extra)

    def write(self, path_base):
        os.makedirs(os.path.dirname(path_base) or ".", exist_ok=True)
        with open(path_base + ".json", "w") as f:
            json.dump({"env": environment(), "rows": self.rows}, f, indent=1)
        with open(path_base + ".md", "w") as f:
            f.write(markdown_table(self.rows))


def markdown_table(rows):
    """One line per (op, dtype, shape, pass): each impl's time, brrr's fraction of floor and ratios."""
    groups = {}
    for r in rows:
        if "ms" not in r or "pass_" not in r:
            continue
        key = (r["family"], r["op"], r["dtype"], tuple(r["shape"]), r["pass_"])
        groups.setdefault(key, {})[r["impl"]] = r
    lines = ["| op | dtype | shape | pass | brrr ms | eager ms | compile ms | brrr % of floor | vs eager | vs compile |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (family, op, dtype, shape, pass_), impls in groups.items():
        b, e, c = impls.get("brrr"), impls.get("eager"), impls.get("compile")

        def ms(r):
            return f"{r['ms']:.4f}" if r and r.get("ms") else "-"

        def ratio(peer):
            return f"{peer['ms'] / b['ms']:.2f}x" if b and peer and peer.get("ms") and b.get("ms") else "-"

        frac = f"{100 * b['frac_floor']:.0f}%" if b and b.get("frac_floor") else "-"
        if b and b.get("kernel_frac_floor"):
            frac += f" (kernels {100 * b['kernel_frac_floor']:.0f}%)"
        lines.append(f"| {op} | {dtype} | {'x'.join(map(str, shape))} | {pass_} | {ms(b)} | {ms(e)} | {ms(c)} | "
                     f"{frac} | {ratio(e)} | {ratio(c)} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def module_names_restored(module):
    """Every name of `module` as it was before the block (a peer's patch, Liger-Kernel's, rebinds
    names in transformers' modeling modules for every model in the process)."""
    saved = dict(vars(module))
    try:
        yield
    finally:
        for key in set(vars(module)) - set(saved):
            delattr(module, key)
        for key, value in saved.items():
            if getattr(module, key, None) is not value:
                setattr(module, key, value)
