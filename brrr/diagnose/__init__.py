"""Which regime is a function in: overhead, memory bandwidth or compute?

    report = brrr.diagnose(fn, x, w)             # runs fn(x, w), prints nothing
    print(report)                                # readable terminal report
    report.verdict                               # "overhead-bound", "memory-bound" or "compute-bound"
    report.to_json()                             # machine-readable; Diagnosis.from_json() reads it back

Time goes to one of three things ("Making Deep Learning Go Brrrr From First Principles"), and each
has its own test and its own remedies:

overhead   Scaling the input (x2, x4, x8) barely changes the time, and the GPU sits idle much of
           the wall time. Remedies: tracing / CUDA graphs / less Python per call, bigger batches.
memory     The bytes take longer than the FLOPs: arithmetic intensity (FLOPs per byte) is below the
           ridge point of the roofline (peak FLOP/s over copy bandwidth), and the achieved
           bandwidth is the figure to push towards the copy bandwidth. Remedy: operator fusion.
compute    Achieved FLOP/s near the peak matrix throughput (>= 80% counts), or intensity above the
           ridge point. Remedies: tensor cores, lower precision, less work.

The ceilings (copy bandwidth counting bytes read and written, matrix throughput per dtype, host
time per launch of a trivial op) are measured once per device and torch version, and cached in
memory and under $BRRR_CACHE_DIR (default ~/.cache/brrr). On a machine without a GPU everything
runs on the CPU against the CPU's own ceilings. A ceiling is the best the device does: the copy
runs on buffers past the caches, each rate is its fastest call's, and on the CPU the better of
the threaded and the one-thread run (`python -m brrr ceilings` shows them; --refresh measures
again). Arrays that fit in the last-level cache can move faster than the copy bandwidth; the
report says when they do.

Work per call: `flops=` and `bytes=` when given. Otherwise FLOPs come from the PyTorch profiler
(`with_flops`, which counts matmuls, convolutions and elementwise add/mul), and bytes are the
floor: every tensor argument read once and every returned tensor written once. Against that floor
an unfused chain shows as a low fraction of the copy bandwidth, which is the room fusion can win.

A whole training step (forward, backward, optimizer): `diagnose(step, step=True)` reports host
time, GPU busy time and launches per step, and where the GPU waits, the step captured in a CUDA
graph and timed (brrr/diagnose/step.py); it returns a StepDiagnosis.

Under autocast, matmuls are judged against the peak of autocast's dtype; the ceilings are always
measured without it. Not inside a running torch profiler (RuntimeError): diagnose profiles fn,
and a profiler nested in the caller's would stop it.

Keyword arguments other than flops, bytes, scale and step are passed to fn. The default overhead
test repeats tensor arguments along their leading dimension; pass `scale(args, factor) -> args`
when that does not fit fn, or `scale=False` to skip it.
"""

import copy
import dataclasses
import functools
import json
import math
import numbers
import os
import re
import statistics
import sys
import time
import types
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .common import (COMPUTE_BOUND, FIXED_SHARE_OVERHEAD, GPU_BUSY_OVERHEAD, MEMORY_BOUND, OVERHEAD_BOUND,
    PROFILED_CALLS, REMEDIES, UNDETERMINED, KernelStat, Report, arrays_in, construct, device_name, device_of,
    duration, import_torch, is_numpy_array, is_torch_tensor, kernel_stats, line, name_of, on_device, percent,
    refuse_nesting_a_profiler, report_end, sync, top_level_ops, union_us)

SCALE_FACTORS = (2, 4, 8)
# The essay's rule of thumb: at 80% of the peak matrix throughput you are compute-bound.
COMPUTE_BOUND_FRACTION = 0.8
# Below this fraction of the binding ceiling, the report says the time goes somewhere else too.
LOW_CEILING_FRACTION = 0.3

# Timing: warm up for at least this long (first calls compile, allocate, tune), then time enough
# calls to fill the target, within bounds. A function's time is the median of its calls; a
# ceiling's is the best call, since load from elsewhere on the machine only ever slows a call.
WARMUP_S = 0.05
WARMUP_MAX_CALLS = 50
TIMING_TARGET_S = 0.25
MIN_REPS, MAX_REPS = 3, 1000
# x1 and the largest input are timed again in alternating rounds, so that load which comes and
# goes during the timing slows both alike instead of reading as time that does not grow.
INTERLEAVED_ROUNDS = 5

# Ceilings: sizes big enough to leave the caches and fill the machine, small enough to stay fast.
# The copy bandwidth is the bandwidth of memory: each buffer is past the caches, for on data that
# fits in a cache a copy runs faster than memory allows. Past the caches is at least 4x the
# last-level cache the system reports, and at least 256 MiB: the CPUs of a VM can sit on more
# cache than it reports (a 2-vCPU VM reporting 32 MiB copied 64 MiB buffers 2x faster than
# 256 MiB ones, 2026-12-02).
PAST_CACHE_FACTOR = 4
PAST_CACHE_MIN_BYTES = 256 << 20
GPU_COPY_ELEMENTS = 1 << 28            # 1 GiB per fp32 buffer, as in benchmarks/harness.py
CPU_COPY_MAX_BYTES = 1 << 30           # a VM on a large host can report its host's whole L3 (480 MiB
                                       # here): a GiB is past it, and 4x would take seconds a copy
COPY_CALLS = 10                        # at least: the best of more calls is the steadier on a busy machine
MATMUL_SIDES = {"cpu": (256, 512, 1024, 2048), "cuda": (2048, 4096, 8192)}
MATMUL_ENOUGH_MS = {"cpu": 10.0, "cuda": 1.0}   # stop growing the matrix once a call takes this long
LAUNCH_BURST = 200
LAUNCH_ROUNDS = 5
CEILINGS_FORMAT = 2                     # 2: best-of timings, copy buffers sized past the cache

_BRRR_ALREADY = {
    REMEDIES[OVERHEAD_BOUND][1]: "less Python per call: fewer, larger ops (more of the work in each brrr op)",
    REMEDIES[MEMORY_BOUND][0]: ("fuse further: this runs brrr's fused kernels already; fold the ops around them in "
                                 "(a longer brrr.chain, a norm fused with its residual add), or compile the whole "
                                 "step with torch.compile"),
}
_BRRR_ON_CPU = ("on the CPU, brrr's kernels are the twins of its CUDA kernels: the registry runs, op by op, whichever "
                "of brrr's and PyTorch's measured faster there (docs/cpu.md); brrr.registry.on_cpu(name, ...) "
                "chooses")


@dataclass
class Ceilings:
    """What the device can do at best; the yardstick for a diagnosis."""

    device_name: str
    torch_version: str
    copy_GBps: float                 # copy bandwidth, bytes read + bytes written
    matmul_GFLOPs: dict              # dtype name ("float32", "tf32", "bfloat16", ...) -> GFLOP/s
    launch_us: float                 # host time per call of a trivial op, back to back
    measured_at: str
    measure_s: float                 # how long measuring took
    notes: list = field(default_factory=list)

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data):
        return construct(cls, data)


@dataclass
class ScalePoint:
    factor: int
    ms: float


@dataclass
class Diagnosis(Report):
    """The outcome of `diagnose`: measurements, the ceilings they are judged against, the verdict."""

    name: str
    device: str
    device_name: str
    timer: str
    ms: float                        # median time per call
    reps: int
    flops: float | None              # per call
    flops_source: str | None
    bytes: float | None              # per call
    bytes_source: str | None
    compute_dtype: str               # whose matmul peak the FLOP/s are judged against
    GBps: float | None
    GFLOPs: float | None
    bandwidth_fraction: float | None     # of the copy bandwidth
    compute_fraction: float | None       # of the matmul peak for compute_dtype
    intensity: float | None              # FLOPs per byte
    ridge: float | None                  # peak FLOP/s over copy bandwidth: FLOPs per byte where the roofline bends
    scaling: list                        # ScalePoint per input scale factor, x1 first
    scaling_method: str | None
    fixed_share: float | None            # share of the x1 time that does not grow with the input
    gpu_busy_fraction: float | None      # kernel time over wall time, GPU only
    ops_per_call: float | None           # top-level framework ops per call (profiler)
    dispatch_share: float | None         # ops_per_call x launch cost over the time per call
    kernels: list                        # KernelStat, the costliest first
    verdict: str
    reasons: list
    remedies: list
    notes: list
    ceilings: Ceilings

    NESTED = {"scaling": ScalePoint, "kernels": KernelStat, "ceilings": Ceilings}

    def report(self):
        return _format_report(self)


def diagnose(fn, *args, flops=None, bytes=None, scale=None, step=False, **kwargs):  # noqa: A002 - the documented name
    """Run fn(*args, **kwargs), time it, and say whether it is overhead-, memory- or compute-bound.

    flops, bytes: the work of one call, when you know it (otherwise profiler FLOPs and the byte
    floor of the arguments and outputs are used). scale: `scale(args, factor) -> args` for the
    overhead test, or False to skip it. Returns a Diagnosis. step=True: fn is a whole training
    step; returns a StepDiagnosis (brrr/diagnose/step.py).
    """
    if step is not False:
        from .step import diagnose_step

        return diagnose_step(fn, args, kwargs, step, flops, bytes, scale)
    if not callable(fn):
        raise TypeError(f"argument fn: expected a callable, got {type(fn).__name__}")
    user_flops = _positive_count("flops", flops)
    user_bytes = _positive_count("bytes", bytes)
    if scale is not None and scale is not False and not callable(scale):
        raise TypeError(f"argument scale: expected a callable scale(args, factor), False or None, got {scale!r}")
    torch = import_torch()
    refuse_nesting_a_profiler(torch)
    device = device_of(args, kwargs)
    notes = []

    def call():
        return fn(*args, **kwargs)

    with on_device(torch, device):
        ceilings = device_ceilings(device)
        output_bytes = _nbytes([call()])  # counted now, so the output is not held through the timing
        ms, reps = _median_ms(call, device)
        profile = _profile(call, device, notes)
        scaling, scaling_method = _scaling_sweep(fn, args, kwargs, device, scale, ms, notes)
    ms = scaling[0].ms

    floor_bytes = _nbytes(args, kwargs.values()) + output_bytes
    uncounted = _uncounted_layouts(args, kwargs)
    if uncounted and user_bytes is None:
        notes.append(f"arguments of layout {', '.join(uncounted)} are not counted in the byte floor: pass bytes=")
    if user_bytes is not None:
        work_bytes, bytes_source = user_bytes, "user"
    elif floor_bytes:
        work_bytes, bytes_source = float(floor_bytes), "floor: array arguments read once + outputs written once"
    else:
        work_bytes, bytes_source = None, None
    if user_flops is not None:
        work_flops, flops_source = user_flops, "user"
    elif profile and profile.flops_per_call:
        work_flops, flops_source = profile.flops_per_call, "profiler (with_flops: matmul, conv, add, mul)"
    else:
        work_flops, flops_source = None, None
        notes.append("no FLOP count: the profiler counted none; pass flops= if the call computes much")

    compute_dtype = _compute_dtype(torch, device, args, kwargs, ceilings, notes)
    peak_flops = ceilings.matmul_GFLOPs[compute_dtype] * 1e9
    copy_bps = ceilings.copy_GBps * 1e9
    seconds = max(ms, 1e-9) * 1e-3
    bytes_per_s = work_bytes / seconds if work_bytes else None
    flops_per_s = work_flops / seconds if work_flops else None
    fixed_share = _fixed_share(scaling)
    ops_per_call = profile.ops_per_call if profile else None
    dispatch_share = (min(1.0, ops_per_call * ceilings.launch_us * 1e-3 / ms)
                      if ops_per_call and ms > 0 else None)
    gpu_busy = (min(1.0, profile.device_busy_us_per_call * 1e-3 / ms)
                if profile and profile.device_busy_us_per_call is not None and ms > 0 else None)

    evidence = _Evidence(
        ms=ms, scaling=scaling, fixed_share=fixed_share, gpu_busy=gpu_busy, dispatch_share=dispatch_share,
        ops_per_call=ops_per_call, launch_us=ceilings.launch_us,
        memory_ms=work_bytes / copy_bps * 1e3 if work_bytes else None,
        compute_ms=work_flops / peak_flops * 1e3 if work_flops else None,
        bandwidth_fraction=bytes_per_s / copy_bps if bytes_per_s else None,
        compute_fraction=flops_per_s / peak_flops if flops_per_s else None,
        intensity=work_flops / work_bytes if work_flops and work_bytes else None,
        ridge=peak_flops / copy_bps, compute_dtype=compute_dtype, bytes_is_floor=bytes_source != "user")
    verdict, reasons = _judge(evidence)
    kernels = profile.kernels if profile else []
    cache = last_level_cache_bytes(device)
    if cache and floor_bytes and floor_bytes <= 2 * cache:
        notes.append(f"the arrays ({_si(floor_bytes, 'B')}) fit within twice the last-level cache "
                     f"({_si(cache, 'B')}): part of their traffic may stay in the cache, faster than the copy "
                     "bandwidth, which is measured past it")
    return Diagnosis(
        name=name_of(fn), device=str(device), device_name=ceilings.device_name,
        timer="CUDA events" if device.type == "cuda" else "perf_counter", ms=ms, reps=reps,
        flops=work_flops, flops_source=flops_source, bytes=work_bytes, bytes_source=bytes_source,
        compute_dtype=compute_dtype,
        GBps=bytes_per_s / 1e9 if bytes_per_s else None, GFLOPs=flops_per_s / 1e9 if flops_per_s else None,
        bandwidth_fraction=evidence.bandwidth_fraction, compute_fraction=evidence.compute_fraction,
        intensity=evidence.intensity, ridge=evidence.ridge, scaling=scaling, scaling_method=scaling_method,
        fixed_share=fixed_share, gpu_busy_fraction=gpu_busy, ops_per_call=ops_per_call,
        dispatch_share=dispatch_share, kernels=kernels, verdict=verdict, reasons=reasons,
        remedies=_remedies(verdict, device, _uses_brrr(fn, kernels)), notes=notes, ceilings=ceilings)


# ---------------------------------------------------------------------------------------------
# Arguments


def _positive_count(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"argument {name}: expected a number (work per call), got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"argument {name}: expected a positive finite number, got {value!r}")
    return value


def _nbytes(*groups):
    """Bytes of the distinct arrays in the groups (an array passed twice is read once), each the
    bytes its elements take in memory: a broadcast dimension (stride 0) counts once; sparse and
    other layouts but the strided one count nothing (the report says so)."""
    seen, total = set(), 0
    for group in groups:
        for array in arrays_in(group):
            if id(array) not in seen:
                seen.add(id(array))
                total += _distinct_elements(array) * (array.element_size() if is_torch_tensor(array) else array.itemsize)
    return total


def _distinct_elements(array):
    if _uncounted(array):
        return 0
    steps = array.stride() if is_torch_tensor(array) else array.strides
    return math.prod(n for n, step in zip(array.shape, steps) if step != 0)


def _uncounted(array):
    """Whether array is a torch tensor of a layout the byte floor does not count (a sparse one)."""
    return is_torch_tensor(array) and array.layout is not sys.modules["torch"].strided


def _uncounted_layouts(args, kwargs):
    """The layouts of the arguments that the byte floor does not count."""
    return sorted({str(a.layout) for a in arrays_in(list(args) + list(kwargs.values())) if _uncounted(a)})


def _resolve_device(device):
    import torch

    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"argument device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"argument device: {device!r} asked for, but torch sees no CUDA GPU")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    elif resolved.type != "cpu":
        raise ValueError(f"argument device: only 'cpu' and 'cuda' devices are supported, got {device!r}")
    return resolved


def _compute_dtype(torch, device, args, kwargs, ceilings, notes):
    """The dtype of the largest floating-point argument; fp32 runs as TF32 on the GPU when the
    process allows it, and is judged against the TF32 peak then."""
    floating = []   # (elements, dtype name)
    for array in arrays_in(list(args) + list(kwargs.values())):
        if is_torch_tensor(array) and array.dtype.is_floating_point:
            floating.append((array.numel(), str(array.dtype).removeprefix("torch.")))
        elif is_numpy_array(array) and array.dtype.kind == "f":
            floating.append((array.size, array.dtype.name))
    name = max(floating)[1] if floating else "float32"
    if torch.is_autocast_enabled(device.type) and name in ("float32", "float64"):
        name = str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")  # autocast's matmuls run in it
    if name == "float32" and device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        name = "tf32"
    if name not in ceilings.matmul_GFLOPs:
        notes.append(f"no {name} matmul peak measured on this device: FLOP/s judged against float32")
        name = "float32"
    return name


# ---------------------------------------------------------------------------------------------
# Timing


def _call_ms(call, device):
    """Milliseconds for one call, to its end on the device: CUDA events on the GPU (the interval
    includes any time the GPU waits on the host), perf_counter on the CPU."""
    if device.type == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def _warm_up(call, device):
    """Call until warm (at least two calls); the last call's ms."""
    warm_start, warm_calls = time.perf_counter(), 0
    while True:
        last_ms = _call_ms(call, device)
        warm_calls += 1
        if warm_calls >= 2 and (time.perf_counter() - warm_start >= WARMUP_S or warm_calls >= WARMUP_MAX_CALLS):
            return last_ms


def _reps(call_ms, target_s, at_least=MIN_REPS):
    return min(MAX_REPS, max(at_least, math.ceil(target_s * 1e3 / max(call_ms, 1e-3))))


def _median_ms(call, device, target_s=TIMING_TARGET_S):
    """(median ms per call, calls timed)."""
    reps = _reps(_warm_up(call, device), target_s)
    return statistics.median(_call_ms(call, device) for _ in range(reps)), reps


def _best_ms(call, device, target_s, at_least=MIN_REPS):
    """The fastest call's ms: what the device can do when nothing else gets in the way."""
    reps = _reps(_warm_up(call, device), target_s, at_least)
    return min(_call_ms(call, device) for _ in range(reps))


def _interleaved_median_ms(calls, device, target_s=TIMING_TARGET_S):
    """Median ms per call of each of `calls`, timed in alternating rounds (INTERLEAVED_ROUNDS)."""
    reps = [_reps(_warm_up(call, device), target_s / INTERLEAVED_ROUNDS, at_least=1) for call in calls]
    times = [[] for _ in calls]
    for _ in range(INTERLEAVED_ROUNDS):
        for call, n, samples in zip(calls, reps, times):
            samples.extend(_call_ms(call, device) for _ in range(n))
    return [statistics.median(samples) for samples in times]


# ---------------------------------------------------------------------------------------------
# Ceilings

_CEILINGS_IN_MEMORY = {}


def cache_dir():
    """Where measured ceilings are kept: $BRRR_CACHE_DIR, else $XDG_CACHE_HOME/brrr, else ~/.cache/brrr."""
    if os.environ.get("BRRR_CACHE_DIR"):
        return os.environ["BRRR_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "brrr")


def device_ceilings(device=None, refresh=False):
    """The device's ceilings (Ceilings), measured on first use and cached in memory and on disk.

    device: 'cpu', 'cuda', 'cuda:N' or a torch.device; default the current GPU, else the CPU.
    refresh: measure again and overwrite the cache.
    """
    torch = import_torch()
    device = _resolve_device(device)
    key = _ceilings_key(torch, device)
    path = os.path.join(cache_dir(), f"ceilings-{key}.json")
    if not refresh and key not in _CEILINGS_IN_MEMORY:
        cached = _read_cached_ceilings(path)
        if cached is not None:
            _CEILINGS_IN_MEMORY[key] = cached
    if refresh or key not in _CEILINGS_IN_MEMORY:
        # The device's own rates: not those of the caller's autocast dtype
        with on_device(torch, device), torch.autocast(device.type, enabled=False):
            _CEILINGS_IN_MEMORY[key] = _measure_ceilings(torch, device)
        _write_cached_ceilings(path, _CEILINGS_IN_MEMORY[key])
    return copy.deepcopy(_CEILINGS_IN_MEMORY[key])  # the caller's to change: not the cache's


def _ceilings_key(torch, device):
    # CPU throughput depends on the thread count, so it is part of the key there.
    parts = [device.type, device_name(torch, device), "torch" + torch.__version__]
    if device.type == "cpu":
        parts.append(f"{torch.get_num_threads()}threads")
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", "-".join(parts))


def _read_cached_ceilings(path):
    try:
        with open(path) as f:
            record = json.load(f)
        if record.get("format") != CEILINGS_FORMAT:
            return None
        return Ceilings.from_dict(record["ceilings"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # missing or unreadable: measure again


def _write_cached_ceilings(path, ceilings):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            json.dump({"format": CEILINGS_FORMAT, "ceilings": ceilings.to_dict()}, f, indent=1)
        os.replace(partial, path)
    except OSError as e:
        warnings.warn(f"brrr.diagnose: could not cache the ceilings in {path} ({e}); they are kept in memory only",
                      stacklevel=3)


def _measure_ceilings(torch, device):
    started = time.perf_counter()
    matmul, notes = _measure_matmul_GFLOPs(torch, device)
    busy = _busy_note()
    if device.type == "cpu" and busy:
        notes.append(busy)
    copy_GBps = _measure_copy_GBps(torch, device)
    launch_us = _measure_launch_us(torch, device)
    return Ceilings(device_name=device_name(torch, device), torch_version=torch.__version__, copy_GBps=copy_GBps,
                    matmul_GFLOPs=matmul, launch_us=launch_us,
                    measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    measure_s=time.perf_counter() - started, notes=notes)


def _busy_note():
    """A note when other work kept the CPUs busy (load average above their count), else None."""
    try:
        load, cpus = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if load <= cpus:
        return None
    return (f"measured while the machine was busy (load average {load:.1f} on {cpus} CPUs): the ceilings may be "
            "low; `python -m brrr ceilings --refresh` measures them again")


def last_level_cache_bytes(device):
    """Size of the device's last-level cache (the GPU's L2, the CPU's largest), or None if unknown."""
    torch = import_torch()
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size or None
    sizes = []
    folder = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in (name for name in os.listdir(folder) if name.startswith("index")):
            with open(os.path.join(folder, index, "size")) as f:
                text = f.read().strip()
            multiplier = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * multiplier)
    except (OSError, ValueError):
        return None
    return max(sizes, default=None)


def past_cache_bytes(device):
    """Bytes of data that the device's caches cannot hold (see PAST_CACHE_MIN_BYTES)."""
    return max(PAST_CACHE_MIN_BYTES, PAST_CACHE_FACTOR * (last_level_cache_bytes(device) or 0))


def past_cache_elements(device, arrays, itemsize):
    """The smallest power of two n such that `arrays` arrays of n elements of `itemsize` bytes
    together are past the device's caches: sized for memory bandwidth, not cache bandwidth."""
    return 1 << math.ceil(math.log2(past_cache_bytes(device) / (arrays * itemsize)))


def _measure_copy_GBps(torch, device):
    """Bytes read + written per second by the best copy of buffers past the caches; on the CPU,
    the better of the threaded copy and a one-thread copy (see _on_one_thread)."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        elements = min(GPU_COPY_ELEMENTS, free_bytes // 16)   # two fp32 buffers in at most half the free memory
    else:
        elements = min(past_cache_bytes(device), CPU_COPY_MAX_BYTES) // 4
    src = torch.full((elements,), 1.0, device=device)
    dst = torch.empty_like(src)

    # Buffers of a GiB take a fifth of a second a copy on a CPU, each long enough to be steady:
    # the best of a few will do.
    calls = MIN_REPS if device.type == "cpu" and src.numel() * src.element_size() >= CPU_COPY_MAX_BYTES \
        else COPY_CALLS

    def rate():
        ms = _best_ms(lambda: dst.copy_(src), device, target_s=0.2, at_least=calls)
        return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9

    if device.type == "cuda":
        return rate()
    return max(rate(), _on_one_thread(torch, rate))


def _on_one_thread(torch, measure):
    """measure() with PyTorch's CPU ops on one thread. On a machine busy with other work, a
    threaded op waits for its slowest thread at every step (OpenMP spins there), so the best of
    its calls can come out 10-100x below what the CPU does; one thread is not held up so."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure()
    finally:
        torch.set_num_threads(threads)


def _matmul_dtypes(torch, device):
    """(label, dtype, fp32 matmul precision) for each matrix throughput worth knowing here."""
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    if device.type == "cpu":
        return [("float32", f32, "highest"), ("float64", f64, "highest"),
                ("bfloat16", bf16, "highest"), ("float16", f16, "highest")]
    major, _ = torch.cuda.get_device_capability(device)
    dtypes = [("float32", f32, "highest")]
    if major >= 8:
        dtypes.append(("tf32", f32, "high"))
    if torch.cuda.is_bf16_supported():
        dtypes.append(("bfloat16", bf16, "highest"))
    return dtypes + [("float16", f16, "highest"), ("float64", f64, "highest")]


def _measure_matmul_GFLOPs(torch, device):
    rates, notes = {}, []
    saved_precision = torch.get_float32_matmul_precision()
    try:
        for label, dtype, precision in _matmul_dtypes(torch, device):
            torch.set_float32_matmul_precision(precision)
            try:
                rates[label] = _best_matmul_GFLOPs(torch, device, dtype)
            except RuntimeError as e:  # a dtype this build has no matmul kernel for
                notes.append(f"{label} matmul not measured: {e}")
    finally:
        torch.set_float32_matmul_precision(saved_precision)
    if "float32" not in rates:
        raise RuntimeError(f"brrr.diagnose: cannot measure a float32 matmul on {device}: {notes}")
    return rates, notes


def _best_matmul_GFLOPs(torch, device, dtype):
    """Best rate over growing square matmuls; growth stops once a call is long enough to fill the
    machine (slow dtypes, such as fp16 on many CPUs, stop early and stay cheap to measure). On the
    CPU, the better of the threaded rate and the one-thread rate times the threads (see
    _on_one_thread): a matmul's work divides evenly between the cores."""

    generator = torch.Generator(device=device)  # the caller's random state is left as it was
    generator.manual_seed(0)

    def rate():
        best = 0.0
        for side in MATMUL_SIDES[device.type]:
            a = torch.randn(side, side, device=device, generator=generator).to(dtype)
            b = torch.randn(side, side, device=device, generator=generator).to(dtype)
            ms = _best_ms(lambda: a @ b, device, target_s=0.05)
            best = max(best, 2 * side ** 3 / (ms * 1e-3) / 1e9)
            if ms >= MATMUL_ENOUGH_MS[device.type]:
                break
        return best

    if device.type == "cuda":
        return rate()
    return max(rate(), torch.get_num_threads() * _on_one_thread(torch, rate))


def _measure_launch_us(torch, device):
    """Host time per call of a trivial op (an in-place add on one element), back to back, with the
    device drained at the end of each burst: what one op costs when it does no work."""
    x = torch.zeros(1, device=device)

    def burst():
        for _ in range(LAUNCH_BURST):
            x.add_(1.0)

    burst()
    per_round = []
    for _ in range(LAUNCH_ROUNDS):
        sync(device)
        t0 = time.perf_counter()
        burst()
        sync(device)
        per_round.append((time.perf_counter() - t0) * 1e6 / LAUNCH_BURST)
    return statistics.median(per_round)


# ---------------------------------------------------------------------------------------------
# Profiler


@dataclass
class _ProfileSummary:
    flops_per_call: float | None
    ops_per_call: float
    kernels: list
    device_busy_us_per_call: float | None


class _CallFailed(Exception):
    """fn raised while profiled (its cause): re-raised as it was, where the profiler's own
    failures become a note."""


def _profile(call, device, notes):
    """FLOPs, op count and kernel list of a few calls from torch.profiler, or None (with a note)."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sync(device)
        with profile(activities=activities, with_flops=True) as prof:
            for _ in range(PROFILED_CALLS):
                try:
                    call()
                except BaseException as e:
                    raise _CallFailed from e
            sync(device)
        events = list(prof.events())
    except _CallFailed as e:  # fn's own error, not the profiler's
        raise e.__cause__ from None
    except Exception as e:  # noqa: BLE001 - the profiler is optional evidence; the report says it is missing
        notes.append(f"profiler unavailable ({type(e).__name__}: {e}): no FLOP count, op count or kernel list")
        return None

    host_events = [e for e in events if e.device_type == DeviceType.CPU and not e.is_user_annotation]
    flops = sum(e.flops or 0 for e in host_events) / PROFILED_CALLS
    top_level = top_level_ops(host_events)
    if device.type == "cuda":
        device_events = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        kernels = kernel_stats((e.name, e.time_range.elapsed_us()) for e in device_events)
        busy_us = union_us([(e.time_range.start, e.time_range.end) for e in device_events]) / PROFILED_CALLS
    else:
        kernels = kernel_stats((e.name, e.cpu_time_total) for e in top_level)
        busy_us = None
    return _ProfileSummary(flops_per_call=flops or None, ops_per_call=len(top_level) / PROFILED_CALLS,
                           kernels=kernels, device_busy_us_per_call=busy_us)


# ---------------------------------------------------------------------------------------------
# The overhead test: scale the input


def _repeat_leading(args, factor, indices):
    """args with the arrays at `indices` repeated `factor` times along their leading dimension."""
    scaled = list(args)
    for i in indices:
        array = args[i]
        if is_torch_tensor(array):
            repeated = array.detach().repeat(factor, *([1] * (array.dim() - 1)))
            scaled[i] = repeated.requires_grad_(array.requires_grad)
        else:
            import numpy

            scaled[i] = numpy.concatenate([array] * factor, axis=0)
    return tuple(scaled)


def _default_scalers(args):
    """Ways to scale the input, most natural first: every array sharing the first array's leading
    (batch) dimension, then the first array alone (x @ w, where w must keep its shape)."""
    arrays = [i for i, a in enumerate(args)
              if (is_torch_tensor(a) or is_numpy_array(a)) and len(a.shape) >= 1 and a.shape[0] > 0]
    if not arrays:
        return []
    leading = args[arrays[0]].shape[0]
    batch = tuple(i for i in arrays if args[i].shape[0] == leading)
    choices = [batch] if len(batch) == 1 else [batch, (arrays[0],)]
    return [(_describe_indices(indices), functools.partial(_repeat_leading, indices=indices)) for indices in choices]


def _describe_indices(indices):
    which = ", ".join(str(i) for i in indices)
    return f"leading dimension of positional argument{'s' if len(indices) > 1 else ''} {which} repeated"


def _scaled_args(scale, args, factor):
    scaled = scale(args, factor)
    if not isinstance(scaled, (tuple, list)):
        raise TypeError(f"argument scale: scale(args, {factor}) must return the positional arguments as a "
                        f"tuple or list, got {type(scaled).__name__}")
    return tuple(scaled)


def _scaling_sweep(fn, args, kwargs, device, scale, base_ms, notes):
    """[ScalePoint] for x1 and each factor that ran, and how the input was scaled (None if not).

    x1 and the largest factor, whose ratio gives the fixed share, are timed again in alternating
    rounds after the sweep (INTERLEAVED_ROUNDS)."""
    points = [ScalePoint(factor=1, ms=base_ms)]
    if scale is False:
        notes.append("overhead test skipped (scale=False)")
        return points, None
    if callable(scale):
        method, scaler = "scale() given by the caller", functools.partial(_scaled_args, scale)
    else:
        method, scaler = _pick_default_scaler(fn, args, kwargs, notes)
        if scaler is None:
            return points, None
    largest = None  # the inputs of the largest factor timed
    for factor in SCALE_FACTORS:
        largest = None  # dropped before the next, bigger, ones are made
        try:
            scaled = scaler(args, factor)
            ms, _ = _median_ms(lambda: fn(*scaled, **kwargs), device)
        except Exception as e:
            if not _out_of_memory(e):
                raise
            scaled = None
            notes.append(f"overhead test stopped before x{factor}: out of memory ({type(e).__name__})")
            break
        points.append(ScalePoint(factor=factor, ms=ms))
        largest, scaled = scaled, None
    if largest is not None:
        x1_ms, largest_ms = _interleaved_median_ms([lambda: fn(*args, **kwargs), lambda: fn(*largest, **kwargs)],
                                                   device)
        points[0], points[-1] = ScalePoint(1, x1_ms), ScalePoint(points[-1].factor, largest_ms)
        largest = None
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()  # give back the scaled inputs' memory to the rest of the process
    return points, method


def _pick_default_scaler(fn, args, kwargs, notes):
    """The first default way of scaling that fn accepts (one trial call at x2)."""
    scalers = _default_scalers(args)
    if not scalers:
        notes.append("overhead test not run: no positional array argument with a leading dimension to scale; "
                     "pass scale=lambda args, factor: ...")
        return None, None
    rejections = []
    for method, scaler in scalers:
        try:
            fn(*scaler(args, 2), **kwargs)
            return method, scaler
        except Exception as e:  # noqa: BLE001 - fn rejecting a guessed input shape is expected; the next guess follows
            rejections.append(f"{method}: {type(e).__name__}: {e}")
    notes.append("overhead test not run: fn rejected every default scaling (" + "; ".join(rejections)
                 + "); pass scale=lambda args, factor: ...")
    return None, None


def _out_of_memory(error):
    """Whether error is an allocation failure: torch's on the GPU, or its CPU allocator's, which
    raises a plain RuntimeError."""
    import torch

    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def _fixed_share(points):
    """Share of the x1 time that does not grow with the input: where the line through x1 and the
    largest scale meets factor 0, over the x1 time, within [0, 1]. The two extremes give the most
    leverage against timing noise; growth faster than proportional (x1 fitting in a cache) reads
    as no fixed cost."""
    if len(points) < 2 or points[0].ms <= 0:
        return None
    base, last = points[0], points[-1]
    growth = last.ms / base.ms
    return min(1.0, max(0.0, (last.factor - growth) / (last.factor - 1)))


# ---------------------------------------------------------------------------------------------
# The verdict


@dataclass
class _Evidence:
    ms: float
    scaling: list
    fixed_share: float | None
    gpu_busy: float | None
    dispatch_share: float | None
    ops_per_call: float | None
    launch_us: float
    memory_ms: float | None          # the bytes at the copy bandwidth
    compute_ms: float | None         # the FLOPs at the matmul peak
    bandwidth_fraction: float | None
    compute_fraction: float | None
    intensity: float | None
    ridge: float
    compute_dtype: str
    bytes_is_floor: bool


def _judge(ev):
    """(verdict, reasons): overhead first (nothing else matters while the device waits), then the
    80% compute rule, then the side of the roofline the work sits on."""
    reasons = []
    overhead = False
    if ev.fixed_share is not None:
        last = ev.scaling[-1]
        growth = last.ms / ev.scaling[0].ms if ev.scaling[0].ms > 0 else float("nan")
        reasons.append(f"x{last.factor} the input takes {growth:.2f}x the time (proportional would be "
                       f"{last.factor}x): {100 * ev.fixed_share:.0f}% of the time does not grow with the input")
        overhead |= ev.fixed_share >= FIXED_SHARE_OVERHEAD
    elif ev.dispatch_share is not None:
        # Without a scaling test, the count of ops times the cost of an empty op stands in for it.
        reasons.append(f"launch cost: {ev.ops_per_call:g} ops per call x {ev.launch_us:.1f} µs per launch is "
                       f"{percent(ev.dispatch_share)} of the time")
        overhead |= ev.dispatch_share >= FIXED_SHARE_OVERHEAD
    if ev.gpu_busy is not None:
        reasons.append(f"the GPU is busy {percent(ev.gpu_busy)} of the wall time")
        overhead |= ev.gpu_busy < GPU_BUSY_OVERHEAD
    if overhead:
        return OVERHEAD_BOUND, reasons

    if ev.compute_fraction is not None:
        reasons.append(f"FLOP/s reach {percent(ev.compute_fraction)} of the {ev.compute_dtype} matmul peak")
    if ev.bandwidth_fraction is not None:
        counted = "the byte floor" if ev.bytes_is_floor else "the counted bytes"
        reasons.append(f"{counted} moves at {percent(ev.bandwidth_fraction)} of the copy bandwidth")
    if ev.compute_fraction is not None and ev.compute_fraction >= COMPUTE_BOUND_FRACTION:
        return COMPUTE_BOUND, reasons
    if ev.memory_ms is None and ev.compute_ms is None:
        reasons.append("neither bytes nor FLOPs are known, so the roofline cannot place the work")
        return UNDETERMINED, reasons
    if ev.intensity is not None:
        side = "above" if ev.intensity > ev.ridge else "below"
        reasons.append(f"arithmetic intensity {ev.intensity:.3g} FLOP/byte is {side} the ridge point "
                       f"{ev.ridge:.3g} FLOP/byte ({ev.compute_dtype} peak over copy bandwidth)")
    verdict = COMPUTE_BOUND if (ev.compute_ms or 0.0) > (ev.memory_ms or 0.0) else MEMORY_BOUND
    bound_fraction = ev.compute_fraction if verdict == COMPUTE_BOUND else ev.bandwidth_fraction
    if bound_fraction is not None and bound_fraction < LOW_CEILING_FRACTION:
        if verdict == MEMORY_BOUND and ev.compute_ms is None:
            reasons.append("far below the copy bandwidth, and no FLOP count: if the call computes much "
                           "(transcendentals such as cos or exp go uncounted) it may be compute-bound; pass flops=")
        elif verdict == MEMORY_BOUND and ev.bytes_is_floor:
            reasons.append("far below the copy bandwidth against the floor: intermediates go through memory "
                           "(unfused ops), or the kernels are slow")
        else:
            reasons.append("far below that ceiling: the kernels are slow, or overhead the scaling test did not catch")
    return verdict, reasons


def _remedies(verdict, device, uses_brrr):
    """The verdict's remedies; for code that runs brrr's kernels already, the ones that would
    recommend them become what is left to do."""
    remedies = list(REMEDIES[verdict])
    if verdict == OVERHEAD_BOUND and device.type != "cuda":
        remedies[0] = "trace the Python away: torch.compile (CUDA graphs help on the GPU)"
    if uses_brrr:
        remedies = [_BRRR_ALREADY.get(remedy, remedy) for remedy in remedies]
        if device.type == "cpu":
            remedies.insert(0, _BRRR_ON_CPU)
    return remedies


def _uses_brrr(fn, kernels):
    """Whether fn is one of brrr's functions (brrr.chain(...), brrr.layer_norm, ...), or the
    profiler saw brrr's kernels or custom ops run. A brrr.nn module is not counted by its name:
    brrr.registry picks what runs in it (PyTorch's function, by default, on the CPU)."""
    fn = getattr(fn, "func", fn)  # functools.partial
    owner = getattr(fn, "__module__", None) or type(fn).__module__
    return (owner.partition(".")[0] == "brrr" and owner != "brrr.nn") or any("brrr" in k.name for k in kernels)


# ---------------------------------------------------------------------------------------------
# The terminal report


def _si(value, unit):
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _format_report(d):
    c = d.ceilings
    lines = [f"brrr.diagnose: {d.name} on {d.device} ({d.device_name}), torch {c.torch_version}",
             line("time per call", f"{duration(d.ms)}  (median of {d.reps}, {d.timer})")]
    work = []
    if d.flops:
        work.append(f"{_si(d.flops, 'FLOP')} ({d.flops_source})")
    if d.bytes:
        work.append(f"{_si(d.bytes, 'B')} ({d.bytes_source})")
    lines.append(line("work per call", "; ".join(work) or "unknown"))
    peak = c.matmul_GFLOPs[d.compute_dtype] * 1e9
    if d.GFLOPs:
        lines.append(line("compute", f"{_si(d.GFLOPs * 1e9, 'FLOP/s')} = {percent(d.compute_fraction)} of the "
                                     f"{d.compute_dtype} matmul peak {_si(peak, 'FLOP/s')}"))
    if d.GBps:
        lines.append(line("bandwidth", f"{_si(d.GBps * 1e9, 'B/s')} = {percent(d.bandwidth_fraction)} of the "
                                       f"copy bandwidth {_si(c.copy_GBps * 1e9, 'B/s')}"))
    if d.intensity is not None:
        lines.append(line("intensity", f"{d.intensity:.3g} FLOP/byte (ridge point {d.ridge:.3g})"))
    if len(d.scaling) > 1:
        base = d.scaling[0].ms
        steps = " | ".join(f"x{p.factor} {duration(p.ms)}" + (f" ({p.ms / base:.2f}x)" if p.factor > 1 else "")
                           for p in d.scaling)
        lines.append(line("input scaling", steps))
        lines.append(line("", f"fixed share of the time {percent(d.fixed_share)}  ({d.scaling_method})"))
    else:
        lines.append(line("input scaling", "not run (see notes)"))
    if d.gpu_busy_fraction is not None:
        lines.append(line("GPU busy", f"{percent(d.gpu_busy_fraction)} of the wall time"))
    if d.ops_per_call:
        lines.append(line("op calls", f"{d.ops_per_call:g} per call; launch cost {c.launch_us:.2f} µs each "
                                      f"({percent(d.dispatch_share)} of the time)"))
    elif d.ops_per_call == 0:
        lines.append(line("op calls", "none seen by the profiler (the work runs outside PyTorch's dispatcher)"))
    title = "kernels (profiled)" if d.device.startswith("cuda") else "top ops (profiled)"
    return "\n".join(lines + report_end(title, d))


class _CallableModule(types.ModuleType):
    """brrr.diagnose is this module, loaded on first use (`import brrr` does not import it), and
    the function at once: brrr.diagnose(fn, x) calls diagnose(fn, x), whichever of
    `brrr.diagnose(...)` and `from brrr.diagnose import ...` comes first."""

    def __call__(self, fn, *args, **kwargs):
        return diagnose(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
