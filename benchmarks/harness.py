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
from torch.autograd import DeviceType


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


# ---- device time: one definition for every benchmark ---------------------------------------------
#
# A profile with CPU activity holds, besides the kernels, copies and fills, the GPU-side range of
# every record_function annotation that launched GPU work (kineto's gpu_user_annotation): an event
# of device type CUDA spanning the kernels it encloses. torch.compile opens such annotations itself
# ("## Call CompiledFxGraph ... ##"), and device_ms opens one per window. Summing every CUDA event
# therefore counted each kernel twice (h200-2026-12-02-97cae4b/floor.txt: a copy at half its
# bandwidth); device work is the CUDA events that are not user annotations.

WINDOW = "device_window::"  # the record_function name of a device_ms window


def device_activities(events, device_type):
    """The device work among raw profiler events (torch's KinetoEvent: name(), device_type(),
    start_ns(), end_ns(), is_user_annotation()): kernels, copies and fills on the GPU
    (device_type CUDA), or the operators on the CPU (device_type CPU, for CPU runs), never a
    user annotation's range, which only encloses such work (torch's own table totals leave them
    out the same way)."""
    return [e for e in events if e.device_type() == device_type and not e.is_user_annotation()]


def busy_ms(intervals):
    """Milliseconds covered by the union of (start_ns, end_ns) intervals: on one stream the sum of
    its kernels' times; on the CPU, nested operators count once."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e6


def window_device_ms(events, device_type):
    """{window name: device milliseconds} from one profile's raw events: every device activity
    counts for the last window (a record_function named WINDOW + name, opened on the CPU) that
    began before the activity did; device_ms closes each window with a synchronize, so nothing
    spills into the next one. Work before the first window counts nowhere."""
    import bisect

    starts = sorted((e.start_ns(), e.name()[len(WINDOW):]) for e in events
                    if e.device_type() == DeviceType.CPU and e.name().startswith(WINDOW))
    times = [t for t, _ in starts]
    spans = {name: [] for _, name in starts}
    for e in device_activities(events, device_type):
        k = bisect.bisect_right(times, e.start_ns()) - 1
        if k >= 0:
            spans[starts[k][1]].append((e.start_ns(), e.end_ns()))
    return {name: busy_ms(s) for name, s in spans.items()}


def device_ms(windows, where=None):
    """Device milliseconds per call of each (name, fn, reps) in windows, in one profiler session:
    fn runs reps times in a window of its own, closed by a synchronize, and its device work is
    divided by reps. where="cuda" (the default on a GPU machine): the kernels, copies and fills
    (host time does not count); "cpu": the operators' time. Call fn warm (after a timing run)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    names = [name for name, _, _ in windows]
    if len(set(names)) != len(names) or any(n.startswith(WINDOW) for n in names):
        raise ValueError(f"window names must be distinct: {names}")
    gpu = (where or device()) == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        for name, fn, reps in windows:
            with record_function(WINDOW + name):
                for _ in range(reps):
                    fn()
                sync()
    ms = window_device_ms(prof.profiler.kineto_results.events(), DeviceType.CUDA if gpu else DeviceType.CPU)
    return {name: ms.get(name, 0.0) / reps for name, _, reps in windows}


def kernel_ms(fn):
    """The device time of one call of fn() (device_ms; call it warm, after time_ms). Where a call's
    host time exceeds its kernels', time_ms measures the host: this does not."""
    return device_ms([("call", fn, 1)])["call"]


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
