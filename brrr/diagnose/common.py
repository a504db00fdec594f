"""What brrr.diagnose's two diagnoses share (one call, brrr/diagnose/__init__.py; a whole
training step, brrr/diagnose/step.py): the verdicts and their thresholds, the remedies, the
devices, the profiler's kernel summaries and the report's number formats."""

import contextlib
import dataclasses
import json
import math
import platform
import sys
from dataclasses import dataclass

OVERHEAD_BOUND = "overhead-bound"
MEMORY_BOUND = "memory-bound"
COMPUTE_BOUND = "compute-bound"
UNDETERMINED = "undetermined"

# The time that does not grow with the input is fixed cost; past half of the time it dominates.
FIXED_SHARE_OVERHEAD = 0.5
# A GPU busy less than half the wall time is waiting on the host.
GPU_BUSY_OVERHEAD = 0.5
PROFILED_CALLS = 3
TOP_KERNELS = 8

REMEDIES = {
    OVERHEAD_BOUND: (
        ("trace the Python away: torch.compile, or capture a CUDA graph (torch.cuda.graphs, "
         "torch.compile(mode='reduce-overhead')) so one launch replays the whole call"),
        "less Python per call: fewer, larger ops (a brrr fused op is one launch for a whole chain)",
        "bigger batches: the fixed cost per call stays while the useful work per call grows",
    ),
    MEMORY_BOUND: (
        ("operator fusion: run chains of elementwise and normalisation ops as one pass over memory "
         "(brrr.chain and brrr's fused ops, or torch.compile)"),
        "rematerialise in the backward: recompute cheap values from the input instead of saving and re-reading them",
        "move fewer bytes: bf16/fp16 storage halves the traffic of fp32",
    ),
    COMPUTE_BOUND: (
        ("use the tensor cores: bf16/fp16 matmuls (TF32 for fp32: torch.set_float32_matmul_precision('high')) "
         "with dimensions that are multiples of 16"),
        "lower precision: each halving of the operand width raises the peak (fp8 where supported)",
        "less work: a cheaper algorithm, or skip computing what is thrown away",
    ),
    UNDETERMINED: (
        "pass flops= and/or bytes= (the work of one call) so the rates can be compared with the ceilings",
    ),
}


@dataclass
class KernelStat:
    """One GPU kernel (or, on the CPU, one top-level op) as the profiler saw it."""

    name: str
    calls_per_call: float
    us_per_call: float


def construct(cls, data):
    """cls(**data) for a record read back (from_json): ValueError for fields it does not have."""
    if not isinstance(data, dict):
        raise ValueError(f"not a {cls.__name__} record: expected a dict, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = set(data) - names, required - set(data)
    if unknown or missing:
        raise ValueError(f"not a {cls.__name__} record: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
    return cls(**data)


class Report:
    """A diagnosis (a dataclass) as data and as text: to_dict/to_json, from_dict/from_json to read
    one back, str() its report. NESTED: field -> the dataclass of each item of its list, or of its
    value (a dataclass with from_dict)."""

    NESTED = {}

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_json(self, indent=2):
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data):
        if not isinstance(data, dict):
            raise TypeError(f"argument data: expected a dict, got {type(data).__name__}")
        data = dict(data)
        for key, kind in cls.NESTED.items():
            if key not in data:
                raise ValueError(f"argument data: missing field {key!r}")
            value = data[key]
            try:
                if hasattr(kind, "from_dict"):
                    data[key] = kind.from_dict(value)
                elif isinstance(value, list):
                    data[key] = [construct(kind, v) for v in value]
                else:
                    raise ValueError(f"expected a list, got {type(value).__name__}")
            except (TypeError, ValueError) as error:
                raise ValueError(f"argument data: field {key!r}: {error}") from None
        return construct(cls, data)

    @classmethod
    def from_json(cls, text):
        return cls.from_dict(json.loads(text))

    def __str__(self):
        return self.report()


def import_torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError("brrr.diagnose needs PyTorch (pip install torch)") from e
    return torch


def is_torch_tensor(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_numpy_array(x):
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(x, numpy.ndarray)


def arrays_in(values, _containers=None):
    """Tensors and NumPy arrays among values, looking into lists, tuples and dicts at any depth
    (each container once)."""
    containers = set() if _containers is None else _containers
    for value in values:
        if is_torch_tensor(value) or is_numpy_array(value):
            yield value
        elif isinstance(value, (list, tuple, dict)) and id(value) not in containers:
            containers.add(id(value))
            yield from arrays_in(value.values() if isinstance(value, dict) else value, containers)


def device_of(args, kwargs):
    """Where the work runs: the device of the CUDA tensor arguments, else the CPU when there are
    array arguments, else the GPU when there is one (fn closes over its data)."""
    import torch

    arrays = list(arrays_in(list(args) + list(kwargs.values())))
    for array in arrays:
        if is_torch_tensor(array) and array.device.type == "cuda":
            return array.device
    if not arrays and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def on_device(torch, device):
    """Make `device` the current CUDA device for the duration (nothing to do on the CPU)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def name_of(fn):
    """'Model.forward' for a method, 'step' for a function defined inside another, a callable
    object's repr when it is short (brrr.chain('cos', 'cos')), else its class name."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name:
        return name.rsplit("<locals>.", 1)[-1]
    text = repr(fn)
    return text if len(text) <= 60 and "\n" not in text and " at 0x" not in text else type(fn).__name__


def sync(device):
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def device_name(torch, device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def top_level_ops(host_events):
    """The framework ops a profiled call made itself (not the ops they call in turn), also those
    inside a record_function block (torch.optim's step and zero_grad are such blocks), whose
    annotation parents them but is no op; runtime API events (cudaLaunchKernel) carry no namespace
    and are left out."""
    def outermost(event):
        parent = event.cpu_parent
        while parent is not None and parent.is_user_annotation:
            parent = parent.cpu_parent
        return parent is None

    return [e for e in host_events if "::" in e.name and not e.is_user_annotation and outermost(e)]


def refuse_nesting_a_profiler(torch):
    """RuntimeError when a torch profiler is running: a profiler started inside it stops it on
    exit, and the user's profile loses every event."""
    if torch.autograd._profiler_enabled():
        raise RuntimeError("brrr.diagnose: a torch profiler is running; brrr's own, nested in it, would stop it and "
                           "empty its events: diagnose outside the profiler's block")


def kernel_stats(name_and_us):
    totals = {}
    for name, us in name_and_us:
        count, total = totals.get(name, (0, 0.0))
        totals[name] = (count + 1, total + us)
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    return [KernelStat(name=name, calls_per_call=count / PROFILED_CALLS, us_per_call=total / PROFILED_CALLS)
            for name, (count, total) in ranked]


def union_us(intervals):
    """Length of the union of intervals: kernels overlapping on several streams count once."""
    busy, end_so_far = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > end_so_far:
            busy += end - max(start, end_so_far)
            end_so_far = end
    return busy


def duration(ms):
    if ms >= 1000:
        return f"{ms / 1000:.3g} s"
    if ms >= 1:
        return f"{ms:.3g} ms"
    return f"{ms * 1000:.3g} µs"


def percent(fraction):
    if fraction is None:
        return "-"
    return f"{100 * fraction:.0f}%" if fraction >= 0.1 else f"{100 * fraction:.2g}%"


def line(key, text):
    """A line of a report: the key in its column, then the text."""
    return f"  {key:<21}{text}"


def report_end(title, d):
    """The lines every report ends with: the kernels (their column titled `title`), the verdict,
    why, the remedies and the notes of the diagnosis d."""
    lines = [line(title if i == 0 else "", f"{duration(k.us_per_call / 1000):>9}  x{k.calls_per_call:g}  {k.name[:80]}")
             for i, k in enumerate(d.kernels)]
    lines.append(line("verdict", d.verdict.upper()))
    for key, items in (("why", d.reasons), ("remedies", d.remedies), ("notes", d.notes)):
        lines += [line(key if i == 0 else "", f"- {item}") for i, item in enumerate(items)]
    return lines

