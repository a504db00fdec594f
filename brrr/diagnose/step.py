"""brrr.diagnose(step, step=True): the regime of a whole training step.

    report = brrr.diagnose(train_step, step=True)   # runs train_step() many times, side effects too
    print(report)                 # host time, GPU busy time, launches per step, verdict, the cure
    report.verdict                # "overhead-bound", "memory-bound" or "compute-bound"
    report.captured_ms            # the step replayed as one CUDA graph, where that was tried

A small model's step issues hundreds of launches. When issuing them takes the host longer than
the GPU takes to run them, the GPU waits: fusion cannot help there, less host work per step can,
and a CUDA graph of the whole step removes nearly all of it. The numbers:

time per step   steps run back to back, as a training loop runs them (CUDA events on the GPU)
host time       one call with the GPU drained first: what issuing the step costs the host
GPU busy        the union of the step's kernels, copies and fills on the GPU timeline (profiler)
launches        the GPU work items of one step (kernels, copies, fills)

Verdict: overhead-bound when the GPU is busy less than half of the step; otherwise compute-bound
when matrix multiplies take most of the GPU time, else memory-bound. On the CPU: overhead-bound
when its op count times the cost of a tiny autograd op is half the step or more.
Where the GPU idles a fifth of the step or more, the step is captured in a CUDA graph after a
side-stream warm-up (brrr.graphs.capture) and replayed, and the report gives both times: the gain
measured there and then. A step that synchronises with the host (loss.item() each step, say)
fails the capture, and the report names the syncs instead; the capture is tried all the same,
since a sync seen eagerly may be skipped under capture (transformers checks the position ids of
a training step called without a cache on the host, except while a graph is captured).
"""

import re
import statistics
import time
import warnings
from dataclasses import dataclass

from .common import (COMPUTE_BOUND, FIXED_SHARE_OVERHEAD, GPU_BUSY_OVERHEAD, MEMORY_BOUND, OVERHEAD_BOUND,
    PROFILED_CALLS, REMEDIES, UNDETERMINED, KernelStat, Report, device_name, device_of, duration, import_torch,
    kernel_stats, line, name_of, on_device, percent, refuse_nesting_a_profiler, report_end, sync, top_level_ops,
    union_us)

# The GPU idle share of a step from which a CUDA graph is worth trying.
CAPTURE_IDLE_SHARE = 0.2
# Matrix multiplies take at least this share of the device time: compute-bound.
MATMUL_SHARE_COMPUTE = 0.5
STEP_WARMUP = 3
STEP_TARGET_S = 0.3              # time this long per round
STEP_ROUNDS = 3
MIN_STEPS, MAX_STEPS = 3, 200
HOST_SAMPLES = 10
# cuBLAS/CUTLASS kernel names on the GPU; matmul ops and their backward nodes on the CPU.
_MATMUL = re.compile(r"gemm|cutlass|cublas|xmma|gmma|nvjet|\b(?:aten::)?(?:mm|addmm|bmm|baddbmm|matmul|linear)\b"
                     r"|(?:Mm|Addmm|Bmm|Baddbmm)Backward", re.IGNORECASE)


@dataclass
class StepDiagnosis(Report):
    """The outcome of `diagnose(step, step=True)`: one training step's times, the verdict, the cure."""

    name: str
    device: str
    device_name: str
    torch_version: str
    timer: str
    ms: float                            # per step, steps back to back
    steps: int                           # steps timed per round
    host_ms: float                       # one call with the device drained first
    gpu_busy_ms: float | None            # union of the device work of one step
    gpu_busy_fraction: float | None      # gpu_busy_ms / ms
    launches_per_step: float | None      # device work items (kernels, copies, fills)
    ops_per_step: float                  # framework ops at the top level (profiler)
    dispatch_share: float | None         # CPU: ops_per_step x the cost of a tiny autograd op, over the fastest round's ms
    matmul_share: float | None           # of the device time (CPU: of the op time)
    syncs_per_step: int | None           # host syncs one step makes (GPU)
    captured_ms: float | None            # the step replayed as a CUDA graph, back to back
    kernels: list                        # KernelStat, the costliest first
    verdict: str
    reasons: list
    remedies: list
    notes: list

    NESTED = {"kernels": KernelStat}

    def report(self):
        return _format_report(self)


def diagnose_step(fn, args, kwargs, step, flops, bytes, scale):  # noqa: A002 - diagnose's names
    """diagnose(fn, *args, step=True, **kwargs): fn(*args, **kwargs) is one whole training step."""
    if step is not True:
        raise TypeError(f"argument step: expected True or False, got {step!r}")
    if not callable(fn):
        raise TypeError(f"argument fn: expected a callable (one training step), got {type(fn).__name__}")
    given = [name for name, value in (("flops", flops), ("bytes", bytes), ("scale", scale)) if value is not None]
    if given:
        raise ValueError(f"argument step: {', '.join(given)} describe a single op's work; with step=True they do "
                         f"not apply")
    torch = import_torch()
    refuse_nesting_a_profiler(torch)
    device = device_of(args, kwargs)
    notes = []

    def call():
        fn(*args, **kwargs)

    with on_device(torch, device):
        for _ in range(STEP_WARMUP):
            call()
        ms, fastest_ms, steps = _steps_ms(call, device)
        host_ms = _host_ms(call, device)
        profile = _profile_step(call, device)
        if device.type == "cuda" and not profile.launches:
            notes.append("the profiler saw no GPU work in the step: it is judged as a CPU step")
            device = torch.device("cpu")
            profile = _profile_step(call, device)
        syncs = _syncs_per_step(torch, call, device) if device.type == "cuda" else None
        busy_fraction = min(1.0, profile.busy_us * 1e-3 / ms) if profile.busy_us is not None else None
        captured_ms = None
        if busy_fraction is not None and 1.0 - busy_fraction >= CAPTURE_IDLE_SHARE:
            captured_ms = _capture_trial(torch, call, device, steps, syncs, notes)
        elif busy_fraction is not None:
            notes.append(f"not captured in a CUDA graph: the GPU is busy {percent(busy_fraction)} of the "
                         f"step, so a graph could save at most the rest")

    dispatch_share = None
    if device.type == "cpu":
        # A ratio of two timings made apart (the op cost once a process): each from its fastest
        # round, the one that carries the least of other processes' time on a shared machine (from
        # the medians, a load that came between the two moved the verdict).
        dispatch_share = min(1.0, profile.ops * _cpu_op_us(torch) * 1e-3 / fastest_ms)
    matmul_share = profile.matmul_us / profile.total_us if profile.total_us > 0 else None
    verdict, reasons = _judge(ms, host_ms, profile, busy_fraction, dispatch_share, matmul_share)
    return StepDiagnosis(
        name=name_of(fn), device=str(device), device_name=device_name(torch, device),
        torch_version=torch.__version__, timer="CUDA events" if device.type == "cuda" else "perf_counter",
        ms=ms, steps=steps, host_ms=host_ms,
        gpu_busy_ms=profile.busy_us * 1e-3 if profile.busy_us is not None else None,
        gpu_busy_fraction=busy_fraction, launches_per_step=profile.launches, ops_per_step=profile.ops,
        dispatch_share=dispatch_share, matmul_share=matmul_share, syncs_per_step=syncs, captured_ms=captured_ms,
        kernels=profile.kernels, verdict=verdict, reasons=reasons,
        remedies=_remedies(verdict, device, ms, captured_ms, syncs), notes=notes)


# ---------------------------------------------------------------------------------------------
# Measurements


def _steps_ms(call, device):
    """(median ms per step over rounds of steps run back to back, the fastest round's, steps per
    round)."""
    t0 = time.perf_counter()
    call()
    sync(device)
    once_s = max(time.perf_counter() - t0, 1e-6)
    steps = min(MAX_STEPS, max(MIN_STEPS, round(STEP_TARGET_S / once_s)))
    rounds = [_burst_ms(call, device, steps) / steps for _ in range(STEP_ROUNDS)]
    return statistics.median(rounds), min(rounds), steps


def _burst_ms(call, device, steps):
    if device.type == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    for _ in range(steps):
        call()
    return (time.perf_counter() - t0) * 1e3


def _host_ms(call, device):
    """Median ms of one call returning, the device drained before each: the host's share alone
    (unless the step waits on the device itself)."""
    samples = []
    for _ in range(HOST_SAMPLES):
        sync(device)
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    return statistics.median(samples)


@dataclass
class _StepProfile:
    busy_us: float | None    # GPU: union of the device work per step
    launches: float | None   # GPU: device work items per step
    ops: float               # top-level framework ops per step
    matmul_us: float         # matmul time per step: device (GPU) or op (CPU) time
    total_us: float          # all device (GPU) or top-level op (CPU) time per step
    kernels: list


def _profile_step(call, device):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_CALLS):
            call()
        sync(device)
    events = list(prof.events())
    per_step = 1.0 / PROFILED_CALLS
    host = [e for e in events if e.device_type == DeviceType.CPU and not e.is_user_annotation]
    top_level = top_level_ops(host)
    busy_us = launches = None
    if device.type == "cuda":
        work = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        timed = [(e.name, e.time_range.elapsed_us()) for e in work]
        busy_us = union_us([(e.time_range.start, e.time_range.end) for e in work]) * per_step
        launches = len(work) * per_step
    else:
        timed = [(e.name, e.cpu_time_total) for e in top_level]
    return _StepProfile(busy_us=busy_us, launches=launches, ops=len(top_level) * per_step,
                        matmul_us=sum(us for name, us in timed if _MATMUL.search(name)) * per_step,
                        total_us=sum(us for _, us in timed) * per_step, kernels=kernel_stats(timed))


_CPU_OP_US = []


def _cpu_op_us(torch):
    """Host µs per op (forward ops and backward nodes, as _profile_step counts them) of a chain of
    tiny autograd ops: the fixed cost of an op in a CPU training step, measured once per process."""
    if not _CPU_OP_US:
        with torch.inference_mode(False), torch.enable_grad():  # whatever grad mode the caller's step runs in
            _CPU_OP_US.append(_measure_cpu_op_us(torch))
    return _CPU_OP_US[0]


def _measure_cpu_op_us(torch):
    leaf = torch.ones(1, requires_grad=True)

    def tiny_step():
        y = leaf
        for _ in range(32):
            y = y * 1.0
        y.backward()

    cpu = torch.device("cpu")
    for _ in range(STEP_WARMUP):
        tiny_step()
    _, fastest_ms, _ = _steps_ms(tiny_step, cpu)
    return fastest_ms * 1e3 / _profile_step(tiny_step, cpu).ops


def _syncs_per_step(torch, call, device):
    """Host syncs of one step, from torch.cuda's sync debug mode (item(), .cpu(), nonzero, ...)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sync(device)
    return sum(str(w.message).startswith("called a synchronizing CUDA operation") for w in caught)


def _capture_trial(torch, call, device, steps, syncs, notes):
    """_captured_ms, tried also where the eager step synchronised with the host: code that checks
    values on the host may skip the check while a graph is captured (transformers' look at the
    position ids for packed sequences and at the padding mask, in every eager training step of its
    models called without a cache, is skipped then), so the syncs seen eagerly do not say that the
    capture fails. Where it fails after syncs were seen, the note names them as the likely cause."""
    failures = []
    captured_ms = _captured_ms(torch, call, device, steps, failures)
    if captured_ms is None and syncs:
        notes.append(f"not captured in a CUDA graph: the step synchronises with the host {syncs} time(s) per step, "
                     f"which a capture cannot hold ({'; '.join(failures)})")
    elif captured_ms is None:
        notes.extend(failures)
    elif syncs:
        notes.append(f"the eager step synchronises with the host {syncs} time(s) per step; the captured one was "
                     f"captured and replayed all the same (the code that syncs skips its host check while a graph "
                     f"is captured, as transformers' mask and position-id checks do)")
    return captured_ms


def _captured_ms(torch, call, device, steps, notes):
    """ms per step of the step replayed as one CUDA graph (side-stream warm-up, capture, replays
    back to back, as the eager steps were timed); None, with a note, if the capture fails."""
    from ..graphs import capture

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(STEP_WARMUP):
            call()
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph, _ = capture(call)
    except RuntimeError as e:
        notes.append(str(e))
        return None
    graph.replay()
    ms = statistics.median(_burst_ms(graph.replay, device, steps) / steps for _ in range(STEP_ROUNDS))
    del graph
    torch.cuda.empty_cache()  # the graph's memory pool back to the rest of the process
    return ms


# ---------------------------------------------------------------------------------------------
# The verdict


def _judge(ms, host_ms, profile, busy_fraction, dispatch_share, matmul_share):
    reasons = []
    if busy_fraction is not None:
        overhead = busy_fraction < GPU_BUSY_OVERHEAD
        waits = "it waits on the host the rest" if overhead else "the GPU is the bottleneck"
        reasons.append(f"the GPU is busy {percent(busy_fraction)} of the step ({duration(profile.busy_us * 1e-3)} "
                       f"of {duration(ms)}): {waits}")
        if profile.launches:
            reasons.append(f"the host takes {duration(host_ms)} to issue the step's {profile.launches:g} launches "
                           f"({duration(host_ms / profile.launches)} each)")
    elif not profile.ops:
        return UNDETERMINED, ["the profiler saw no PyTorch op in the step: its time goes to work outside PyTorch "
                              "(Python, I/O, other libraries)"]
    else:
        reasons.append(f"{profile.ops:g} op calls per step at the cost of a tiny autograd op are "
                       f"{percent(dispatch_share)} of the step")
        overhead = dispatch_share >= FIXED_SHARE_OVERHEAD
    if overhead:
        return OVERHEAD_BOUND, reasons
    where = "GPU" if busy_fraction is not None else "op"
    if matmul_share is not None:
        reasons.append(f"matrix multiplies take {percent(matmul_share)} of the {where} time")
    if matmul_share is not None and matmul_share >= MATMUL_SHARE_COMPUTE:
        return COMPUTE_BOUND, reasons
    reasons.append(f"the rest of the {where} time goes to elementwise, normalisation, softmax and copies: "
                   f"memory-bound work")
    return MEMORY_BOUND, reasons


def _remedies(verdict, device, ms, captured_ms, syncs):
    capture = "capture the whole step in one CUDA graph (brrr.capture_step, or torch.cuda.graph; docs/graphs.md)"
    if captured_ms is not None:
        capture += (f": captured: {duration(captured_ms)} against {duration(ms)} eager "
                    f"({ms / captured_ms:.2f}x), measured here")
    elif syncs:
        capture = f"remove the step's {syncs} host sync(s) (a loss.item() for logging, say), then " + capture
    if verdict != OVERHEAD_BOUND:
        remedies = list(REMEDIES[verdict])
        return remedies + [capture] if captured_ms is not None else remedies
    if device.type != "cuda":
        return ["trace the Python away: torch.compile (CUDA graphs help on the GPU)",
                "more work per step (larger batches): the host cost per step stays while the work grows"]
    return [capture,
            "torch.compile(mode='reduce-overhead'): compiled and replayed in CUDA graphs (its first steps compile)",
            "more work per step (larger batches or sequences): the host cost per step stays while the GPU work grows"]


# ---------------------------------------------------------------------------------------------
# The terminal report


def _format_report(d):
    lines = [f"brrr.diagnose (training step): {d.name} on {d.device} ({d.device_name}), torch {d.torch_version}",
             line("time per step", f"{duration(d.ms)}  (steps back to back, median of {STEP_ROUNDS} rounds of "
                                   f"{d.steps}, {d.timer})")]
    if d.gpu_busy_ms is not None:
        lines.append(line("host time per step", f"{duration(d.host_ms)}  (one call, the GPU drained first)"))
        lines.append(line("GPU busy", f"{duration(d.gpu_busy_ms)} per step = {percent(d.gpu_busy_fraction)} "
                                      f"of the step"))
        lines.append(line("launches per step", f"{d.launches_per_step:g}  (kernels, copies and fills)"))
    lines.append(line("op calls per step", f"{d.ops_per_step:g}"
                      + (f"  ({percent(d.dispatch_share)} of the step at the cost of a tiny autograd op)"
                         if d.dispatch_share is not None else "")))
    if d.syncs_per_step:
        lines.append(line("host syncs per step", f"{d.syncs_per_step}"))
    if d.captured_ms is not None:
        lines.append(line("captured (CUDA graph)", f"{duration(d.captured_ms)} per step ({d.ms / d.captured_ms:.2f}x)"))
    title = "kernels (profiled)" if d.gpu_busy_ms is not None else "top ops (profiled)"
    return "\n".join(lines + report_end(title, d))
