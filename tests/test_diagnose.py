"""brrr.diagnose: each regime is recognised, the reports round-trip, the CLI runs; and the
benchmark plots (benchmarks/plot.py, benchmarks/run.py) come out of results files.

The regime tests run real workloads on the CPU (and on the GPU when there is one): many tiny ops
(overhead-bound), one large elementwise add (memory-bound), one large matmul (compute-bound). The
verdict rules are also checked on synthetic evidence, so a change in the thresholds shows here.

The real workloads are sized so that their verdicts hold on a machine shared with other work:
arrays past the last-level cache, ceilings timed by their best call, and the overhead test's x1
and x8 timed in alternating rounds. What a verdict rests on (the add's bandwidth against a copy
timed in the same test) is checked against measurements of the same moment.
"""

import contextlib
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import brrr  # noqa: E402
from brrr.diagnose import (  # noqa: E402 - after the torch check
    COMPUTE_BOUND,
    MEMORY_BOUND,
    OVERHEAD_BOUND,
    UNDETERMINED,
    Diagnosis,
    ScalePoint,
    _Evidence,
    _fixed_share,
    _judge,
    _measure_copy_GBps,
    cache_dir,
    device_ceilings,
    diagnose,
    last_level_cache_bytes,
    past_cache_bytes,
    past_cache_elements,
)
from helpers import DEVICES  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")


@pytest.fixture(scope="module", autouse=True)
def ceilings_cache(tmp_path_factory):
    """Ceilings cached in a fresh folder (never the user's ~/.cache), measured once for the module;
    subprocesses inherit the folder through the environment and reuse them."""
    folder = str(tmp_path_factory.mktemp("brrr-cache"))
    saved = os.environ.get("BRRR_CACHE_DIR")
    os.environ["BRRR_CACHE_DIR"] = folder
    device_ceilings("cpu")
    yield folder
    if saved is None:
        del os.environ["BRRR_CACHE_DIR"]
    else:
        os.environ["BRRR_CACHE_DIR"] = saved


def tiny_ops(x):
    for _ in range(32):
        x = x + 1.0
    return x


def add(x, y):
    return x + y


def matmul(a, b):
    return a @ b


@pytest.fixture(scope="module")
def overhead_report():
    return diagnose(tiny_ops, torch.randn(64))


# --- the caller's state and errors -------------------------------------------------------------

STEP = importlib.import_module("brrr.diagnose.step")
DIAGNOSE = importlib.import_module("brrr.diagnose")


@pytest.mark.parametrize("step", [False, True])
def test_a_running_profiler_is_refused_and_keeps_its_events(step):
    """Nested in the caller's profiler, diagnose's own would stop it on exit and empty its events."""
    args = () if step else (torch.randn(8),)
    fn = (lambda: tiny_ops(torch.randn(8))) if step else tiny_ops
    with torch.profiler.profile() as prof:
        torch.ones(3).add_(1)
        with pytest.raises(RuntimeError, match="a torch profiler is running"):
            diagnose(fn, *args, step=step)
        torch.ones(3).mul_(2)
    names = {e.name for e in prof.events()}
    assert {"aten::add_", "aten::mul_"} <= names


def step_with(record_function, backward=True):
    w = torch.randn(8, requires_grad=True)

    def step():
        with torch.autograd.profiler.record_function("user block") if record_function else contextlib.nullcontext():
            loss = tiny_ops(w).sum()
            if backward:
                loss.backward()
    return step


def test_ops_inside_record_function_blocks_are_counted():
    """torch.optim's step and zero_grad, and any user annotation, parent their ops in the profile:
    they are the step's ops still (they were counted as none, and the step judged memory-bound)."""
    plain = diagnose(step_with(False), step=True)
    annotated = diagnose(step_with(True), step=True)
    assert plain.ops_per_step > 32 and annotated.ops_per_step == plain.ops_per_step
    assert annotated.verdict == plain.verdict == OVERHEAD_BOUND

    def annotated(x):
        with torch.autograd.profiler.record_function("user block"):
            return tiny_ops(x)

    assert diagnose(annotated, torch.randn(8), scale=False).ops_per_call >= 32


def test_a_load_during_the_steps_rounds_leaves_the_dispatch_share(monkeypatch):
    """The dispatch share divides the op cost (timed once a process) by the step's time, two
    timings made apart: each is its fastest round's, so another process's load in some rounds
    does not move the verdict. Here two of the step's three rounds run 4x slower and the op cost's
    none: from the medians the share was a quarter of the step and the step memory-bound."""
    monkeypatch.setattr(STEP, "_CPU_OP_US", [])
    real, rounds = STEP._burst_ms, []

    def loaded(call, device, steps):
        rounds.append(real(call, device, steps))
        return rounds[-1] * (4 if len(rounds) in (2, 3) else 1)  # the step's rounds come first

    monkeypatch.setattr(STEP, "_burst_ms", loaded)
    report = diagnose(step_with(False), step=True)
    assert len(rounds) == 2 * STEP.STEP_ROUNDS and STEP._CPU_OP_US
    assert report.ms > 2 * min(rounds[:3]) / report.steps  # the median carries the load
    assert report.dispatch_share > 0.5 and report.verdict == OVERHEAD_BOUND, report.report()


def test_a_step_without_torch_ops_is_undetermined():
    report = diagnose(lambda: time.sleep(0.001), step=True)
    assert report.verdict == UNDETERMINED and "no PyTorch op" in report.reasons[0]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_step_mode_under_no_grad_runs(monkeypatch, mode):
    """The per-op calibration (a tiny backward, once a process) runs whatever the caller's grad mode."""
    monkeypatch.setattr(STEP, "_CPU_OP_US", [])
    with getattr(torch, mode)():
        report = diagnose(step_with(False, backward=False), step=True)
    assert report.ops_per_step >= 32 and STEP._CPU_OP_US


def test_autocast_sets_the_compute_dtype_and_never_the_ceilings(monkeypatch):
    """Ceilings are the device's: measured with autocast off whatever the caller's; an autocast
    call's matmuls are judged against its dtype's peak."""
    seen = []
    monkeypatch.setattr(DIAGNOSE, "_measure_ceilings",
                        lambda torch, device: seen.append(torch.is_autocast_enabled("cpu")) or DIAGNOSE.Ceilings(
                            device_name="x", torch_version="x", copy_GBps=1.0, launch_us=1.0,
                            matmul_GFLOPs={"float32": 1.0, "bfloat16": 1.0}, measured_at="x", measure_s=0.0, notes=[]))
    monkeypatch.setattr(DIAGNOSE, "_write_cached_ceilings", lambda path, ceilings: None)
    monkeypatch.setattr(DIAGNOSE, "_CEILINGS_IN_MEMORY", {})  # the module's cache is left as it was
    with torch.autocast("cpu", dtype=torch.bfloat16):
        device_ceilings("cpu", refresh=True)
    assert seen == [False]
    monkeypatch.setattr(DIAGNOSE, "_CEILINGS_IN_MEMORY", {})
    a = torch.randn(64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = diagnose(matmul, a, a, scale=False)
    assert report.compute_dtype == "bfloat16"


def test_measuring_the_ceilings_leaves_the_random_state():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    DIAGNOSE._best_matmul_GFLOPs(torch, torch.device("cpu"), torch.float32)
    assert torch.equal(torch.rand(3), expected)


def test_an_error_of_fn_while_profiled_is_raised():
    def fails_when_profiled(x):
        if torch.autograd._profiler_enabled():
            raise ValueError("bad batch")
        return x + 1

    with pytest.raises(ValueError, match="bad batch"):
        diagnose(fails_when_profiled, torch.randn(8), scale=False)


def test_a_cpu_allocation_failure_stops_the_overhead_test(monkeypatch):
    def scale(args, factor):
        if factor >= 4:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
        return args[0].repeat(factor), args[1]

    report = diagnose(add, torch.randn(64), 1.0, scale=scale)
    assert [p.factor for p in report.scaling] == [1, 2]
    assert any("overhead test stopped before x4: out of memory" in n for n in report.notes)
    def fails(args, factor):
        raise RuntimeError("another failure")

    with pytest.raises(RuntimeError, match="another failure"):
        diagnose(add, torch.randn(64), 1.0, scale=fails)


def test_broadcast_and_sparse_arguments_in_the_byte_floor():
    """A broadcast dimension is read once; a sparse argument is not counted (noted)."""
    x = torch.randn(1).expand(1 << 20)
    report = diagnose(lambda x: x.sum(), x, scale=False)
    assert report.bytes == 4 + 4  # one element read, one written
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.ones(2), (20000,))
    report = diagnose(lambda s: s.coalesce().values().sum(), sparse, scale=False)
    assert report.bytes == 4 and any("sparse_coo are not counted" in n for n in report.notes)


def test_nested_outputs_count_in_the_byte_floor():
    x = torch.randn(1024)
    flat = diagnose(lambda x: (x + 1, x + 2, x + 3), x, scale=False)
    nested = diagnose(lambda x: ((x + 1, x + 2), {"c": [x + 3]}), x, scale=False)
    assert nested.bytes == flat.bytes == 4 * 4096


@pytest.mark.parametrize("field, value", [("ceilings", None), ("kernels", 3), ("kernels", [1]), ("scaling", None)])
def test_a_record_with_a_bad_field_names_it(overhead_report, field, value):
    data = dict(overhead_report.to_dict(), **{field: value})
    with pytest.raises(ValueError, match=f"^argument data: field '{field}': "):
        Diagnosis.from_dict(data)


def test_work_counts_take_any_real_number_and_name_the_argument():
    assert diagnose(add, torch.randn(64), 1.0, flops=np.int64(100), scale=False).flops == 100.0
    with pytest.raises(ValueError, match="^argument flops: expected a positive finite number"):
        diagnose(add, torch.randn(64), 1.0, flops=10 ** 400)


# --- ceilings ------------------------------------------------------------------------------


def test_ceilings_are_measured_once_and_cached_on_disk(ceilings_cache):
    ceilings = device_ceilings("cpu")
    assert ceilings.copy_GBps > 0.1
    assert ceilings.matmul_GFLOPs["float32"] > 0.1
    assert 0 < ceilings.launch_us < 1000
    # 5-10 s on an idle 2-core machine, 11.4 s once with the test suite itself running beside it at
    # a load average of 2; other work stretches wall time by its load
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    assert ceilings.measure_s < 20 * busy, f"measuring the CPU's ceilings must stay fast (load x{busy:.1f})"
    started = time.perf_counter()
    again = device_ceilings("cpu")
    assert again == ceilings and time.perf_counter() - started < 0.1, "the second call must come from memory"
    again.matmul_GFLOPs["float32"] /= 1000  # each caller's own copy: the cache keeps its values
    assert device_ceilings("cpu") == ceilings and again is not ceilings
    assert cache_dir() == ceilings_cache
    (cached,) = [name for name in os.listdir(ceilings_cache) if name.startswith("ceilings-cpu-")]
    with open(os.path.join(ceilings_cache, cached)) as f:
        assert json.load(f)["ceilings"] == ceilings.to_dict()


def test_ceilings_reject_unknown_devices():
    with pytest.raises(ValueError, match="device"):
        device_ceilings("tpu")


def best_copy_GBps(src, dst, calls=5):
    """Bytes read + written per second of the fastest of `calls` copies of src into dst."""
    import time

    fastest = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        dst.copy_(src)
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / fastest / 1e9


def test_cpu_copy_bandwidth_is_plausible_against_a_known_size_copy():
    """The ceiling is the bandwidth of memory: against copies of buffers twice as far past the
    caches, timed here in turn with it, it must agree within 1.6x either way (a ceiling measured
    in the cache, or with its bytes miscounted, is off by 2x or more)."""
    cache = last_level_cache_bytes("cpu")
    assert cache is None or cache >= 1 << 20, cache
    src = torch.ones(2 * past_cache_bytes("cpu") // 4)
    dst = src.clone()
    ratios = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core is more often free on a busy machine than two at once
    try:
        for _ in range(5):  # in turn, so that each pair meets the same load from elsewhere
            known = best_copy_GBps(src, dst)
            ratios.append(_measure_copy_GBps(torch, torch.device("cpu")) / known)
    finally:
        torch.set_num_threads(threads)
    assert 1 / 1.6 < statistics.median(ratios) < 1.6, ratios


# --- the three regimes on real workloads ---------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_ops_repeated_are_overhead_bound(device, overhead_report):
    report = overhead_report if device == "cpu" else diagnose(tiny_ops, torch.randn(64, device=device))
    assert report.verdict == OVERHEAD_BOUND, report.report()
    assert [p.factor for p in report.scaling] == [1, 2, 4, 8]
    assert report.fixed_share >= 0.5
    assert report.ops_per_call == pytest.approx(32, abs=1)
    assert any("CUDA graph" in r or "torch.compile" in r for r in report.remedies)
    if device == "cuda":
        assert report.gpu_busy_fraction is not None and report.gpu_busy_fraction < 0.5
        assert report.kernels, "the profiler's kernel list should be reported on the GPU"


@pytest.mark.parametrize("device", DEVICES)
def test_large_elementwise_add_is_memory_bound(device):
    n = (1 << 24) if device == "cpu" else (1 << 26)
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    report = diagnose(add, x, y)
    assert report.verdict == MEMORY_BOUND, report.report()
    assert report.bytes == 3 * n * 4 and report.bytes_source.startswith("floor")
    assert report.flops == n and report.flops_source.startswith("profiler")
    assert report.intensity < report.ridge
    assert report.fixed_share < 0.5
    assert "fusion" in report.remedies[0]


@pytest.mark.parametrize("device", DEVICES)
def test_an_add_past_the_caches_runs_no_faster_than_a_copy(device):
    """The report of 203-212% of the copy bandwidth for an add: past the caches an add moves its
    bytes no faster than a copy does. On a CPU, which reads each written line first, a perfect add
    counts 3 bytes per 4 moved against the copy's 2 per 3: 1.125x at most; 1.5x leaves room for
    noise, below the 2x of a ceiling or a workload in the cache."""
    n = past_cache_elements(device, arrays=3, itemsize=4)
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    copy = [_measure_copy_GBps(torch, x.device)]
    report = diagnose(add, x, y, scale=False)
    copy.append(_measure_copy_GBps(torch, x.device))
    assert report.verdict == MEMORY_BOUND, report.report()
    assert not any("last-level cache" in note for note in report.notes), "past the cache, no cache note"
    assert report.GBps < 1.5 * max(copy), (report.GBps, copy)


def test_arrays_within_the_cache_get_a_note():
    cache = last_level_cache_bytes("cpu")
    assert cache, "the CPU's cache size is readable on Linux"
    x = torch.randn(cache // 16)
    report = diagnose(add, x, x, scale=False)
    assert any("fit within twice the last-level cache" in note for note in report.notes), report.notes


def test_large_matmul_on_cpu_is_compute_bound_not_memory_bound():
    side = 1024
    report = diagnose(matmul, torch.randn(side, side), torch.randn(side, side))
    assert report.verdict == COMPUTE_BOUND, report.report()
    assert report.flops == 2 * side ** 3
    assert report.intensity > report.ridge
    # Both operands share the leading dimension, but a @ b only accepts a scaled a.
    assert report.scaling_method.endswith("argument 0 repeated")
    assert [p.factor for p in report.scaling] == [1, 2, 4, 8]


@pytest.mark.cuda
def test_large_bf16_matmul_on_gpu_is_compute_bound_near_peak():
    side = 8192
    a = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    report = diagnose(matmul, a, b)
    assert report.verdict == COMPUTE_BOUND, report.report()
    assert report.compute_dtype == "bfloat16"
    assert report.compute_fraction >= 0.8
    assert report.gpu_busy_fraction > 0.8


# --- the caller's counts and scaling -------------------------------------------------------


def test_caller_counts_replace_the_profiler_and_the_floor():
    x, y = torch.randn(1 << 16), torch.randn(1 << 16)
    report = diagnose(add, x, y, flops=1e6, bytes=4e6, scale=False)
    assert (report.flops, report.flops_source, report.bytes, report.bytes_source) == (1e6, "user", 4e6, "user")
    assert report.GBps == pytest.approx(4e6 / (report.ms * 1e-3) / 1e9)
    assert report.scaling == [ScalePoint(1, report.ms)] and report.fixed_share is None
    assert any("skipped" in note for note in report.notes)


def test_keyword_arguments_reach_fn_and_scale_is_called_per_factor():
    factors = []

    def scale(args, factor):
        factors.append(factor)
        return (torch.cat([args[0]] * factor),)

    def scaled_add(x, *, alpha):
        return torch.add(x, x, alpha=alpha)

    report = diagnose(scaled_add, torch.randn(1 << 12), alpha=2.0, scale=scale)
    assert factors == [2, 4, 8]
    assert report.scaling_method.startswith("scale()")


def test_numpy_arrays_are_counted_and_scaled():
    numpy = pytest.importorskip("numpy")
    x = numpy.ones(1 << 14, dtype=numpy.float32)
    report = diagnose(numpy.add, x, x)
    assert report.device == "cpu" and report.compute_dtype == "float32"
    assert report.bytes == 2 * x.nbytes, "x passed twice is read once, plus the output written"
    assert [p.factor for p in report.scaling] == [1, 2, 4, 8]


def test_without_array_arguments_the_op_count_stands_in_for_scaling():
    x = torch.randn(16)
    report = diagnose(lambda: tiny_ops(x))
    assert len(report.scaling) == 1 and report.fixed_share is None
    assert report.dispatch_share is not None
    assert any("no positional array argument" in note for note in report.notes)


@pytest.mark.parametrize("kwargs, error", [
    (dict(flops=-1.0), ValueError),
    (dict(bytes=float("nan")), ValueError),
    (dict(flops="many"), TypeError),
    (dict(bytes=True), TypeError),
    (dict(scale=3), TypeError),
])
def test_bad_arguments_raise_clear_errors(kwargs, error):
    with pytest.raises(error, match="argument (flops|bytes|scale)"):
        diagnose(add, torch.randn(4), torch.randn(4), **kwargs)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="argument fn"):
        diagnose(torch.randn(4))


def test_brrr_ops_are_not_told_to_adopt_brrr():
    """diagnose(brrr.chain('cos', 'cos'), x) recommended brrr.chain; on the CPU it now says what is
    true there: brrr's CPU code is a reference twin, and PyTorch's own ops are the fast ones."""
    for fn in (brrr.chain("cos", "cos"), brrr.gelu, functools.partial(brrr.layer_norm, normalized_shape=(256,))):
        report = diagnose(fn, torch.randn(256, 256), scale=False)
        text = " ".join(report.remedies)
        assert "brrr.chain and brrr's fused ops" not in text and "a brrr fused op is one launch" not in text, text
        assert report.remedies[0].startswith("on the CPU, brrr's kernels are the twins"), report.remedies
    plain = diagnose(lambda x: x.cos().cos(), torch.randn(1 << 16), scale=False)
    assert not any("kernels are the twins" in r for r in plain.remedies)


@pytest.mark.cuda
def test_a_function_running_brrr_kernels_on_the_gpu_is_seen_to():
    x = torch.randn(1 << 24, device="cuda")
    report = diagnose(lambda x: brrr.gelu(x) * 2, x)
    assert any("brrr" in k.name for k in report.kernels), report.kernels
    assert not any("brrr.chain and brrr's fused ops" in r for r in report.remedies), report.remedies


def test_scale_must_return_the_arguments():
    with pytest.raises(TypeError, match="must return the positional arguments"):
        diagnose(add, torch.randn(4), torch.randn(4), scale=lambda args, factor: args[0])


# --- the rules, on synthetic evidence ------------------------------------------------------


@pytest.mark.parametrize("times, share", [
    ([1.0, 1.0, 1.0, 1.0], 1.0),        # flat: all fixed cost
    ([1.0, 2.0, 4.0, 8.0], 0.0),        # proportional: none
    ([1.0, 4.0, 16.0, 30.0], 0.0),      # faster than proportional (x1 in cache): none
    ([2.0, 3.0, 5.0, 9.0], 0.5),        # 1 ms fixed + 1 ms per unit
])
def test_fixed_share_is_the_time_that_does_not_grow(times, share):
    points = [ScalePoint(f, t) for f, t in zip((1, 2, 4, 8), times)]
    assert _fixed_share(points) == pytest.approx(share)


def evidence(**changes):
    """Evidence of a clearly memory-bound call, with changes."""
    base = dict(ms=1.0, scaling=[ScalePoint(1, 1.0), ScalePoint(8, 8.0)], fixed_share=0.0, gpu_busy=None,
                dispatch_share=0.01, ops_per_call=1, launch_us=5.0, memory_ms=0.9, compute_ms=0.01,
                bandwidth_fraction=0.9, compute_fraction=0.01, intensity=0.1, ridge=10.0,
                compute_dtype="float32", bytes_is_floor=True)
    return _Evidence(**dict(base, **changes))


@pytest.mark.parametrize("changes, verdict", [
    ({}, MEMORY_BOUND),
    (dict(fixed_share=0.7), OVERHEAD_BOUND),
    (dict(gpu_busy=0.2), OVERHEAD_BOUND),
    (dict(fixed_share=None, dispatch_share=0.9), OVERHEAD_BOUND),
    (dict(compute_fraction=0.85), COMPUTE_BOUND),                       # the 80% rule wins over the roofline
    (dict(compute_ms=0.5, memory_ms=0.1, compute_fraction=0.5, intensity=50.0), COMPUTE_BOUND),
    (dict(memory_ms=None, compute_ms=None, bandwidth_fraction=None, compute_fraction=None,
          intensity=None), UNDETERMINED),
])
def test_verdict_rules(changes, verdict):
    assert _judge(evidence(**changes))[0] == verdict


# --- reports ---------------------------------------------------------------------------------


def test_json_report_round_trips(overhead_report):
    text = overhead_report.to_json()
    data = json.loads(text)
    assert data["verdict"] == OVERHEAD_BOUND
    assert data["ceilings"]["copy_GBps"] == overhead_report.ceilings.copy_GBps
    assert Diagnosis.from_json(text) == overhead_report
    with pytest.raises(ValueError, match="unknown fields"):
        Diagnosis.from_dict(dict(data, colour="blue"))


def test_terminal_report_names_the_verdict_and_the_remedies(overhead_report):
    text = str(overhead_report)
    assert "OVERHEAD-BOUND" in text
    for label in ("time per call", "input scaling", "remedies", "copy bandwidth"):
        assert label in text


# --- the command line ------------------------------------------------------------------------


def run_brrr(*args):
    return subprocess.run([sys.executable, "-m", "brrr", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_importing_brrr_does_not_import_diagnose_and_both_orders_of_use_work():
    code = ("import sys, brrr\n"
            "assert 'brrr.diagnose' not in sys.modules\n"
            "{first}\n"
            "import torch\n"
            "assert brrr.diagnose(lambda x: x + 1, torch.ones(8), scale=False).verdict\n"
            "from brrr.diagnose import Diagnosis, device_ceilings\n")
    for first in ("brrr.diagnose", "from brrr.diagnose import Diagnosis"):
        result = subprocess.run([sys.executable, "-c", code.format(first=first)], cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, (first, result.stderr)


def test_cli_help():
    result = run_brrr("diagnose", "--help")
    assert result.returncode == 0, result.stderr
    assert "TARGET" in result.stdout and "overhead" in result.stdout


def test_cli_runs_a_builtin_example_and_prints_json():
    result = run_brrr("diagnose", "overhead", "--size", "64", "--json", "-")
    assert result.returncode == 0, result.stderr
    report = Diagnosis.from_json(result.stdout)
    assert report.verdict == OVERHEAD_BOUND and report.name == "tiny_ops"


@pytest.mark.parametrize("args, message", [
    (["diagnose", "memory", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["diagnose", "memory", "--device", "cuda:x"], "argument --device"),
    (["diagnose", "memory", "--size", "-5"], "argument --size: expected a positive size, got '-5'"),
    (["diagnose", "memory", "--size", "1e3"], "argument --size: not a whole number"),
    (["diagnose", "compute", "--dtype", "int64"], "argument --dtype: expected a floating-point torch dtype"),
    (["diagnose", "memory", "--flops", "many"], "argument --flops: not a number"),
    (["diagnose", "memory", "--json", "/no/such/folder/report.json"], "argument --json: no such folder"),
    (["ceilings", "--device", "tpu"], "argument --device"),
    (["diagnose"], "the following arguments are required: TARGET"),
    (["bogus"], "argument COMMAND: invalid choice"),
])
def test_cli_refuses_bad_arguments_in_one_line(args, message):
    result = run_brrr(*args)
    assert result.returncode == 2, result
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_cli_errors_found_after_parsing_are_one_line_too():
    for args in (["diagnose", "memory", "--device", "cuda:99"], ["diagnose", "no_such_module:make"],
                 ["diagnose", "not-a-target"]):
        result = run_brrr(*args)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith("brrr diagnose: "), result.stderr


def test_cli_diagnoses_a_factory_from_a_module(tmp_path, monkeypatch, capsys):
    from brrr.__main__ import main

    (tmp_path / "my_workload.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return (lambda x, y: x + y), (torch.randn(1 << 16), torch.randn(1 << 16))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["diagnose", "my_workload:make", "--no-scale", "--json", str(tmp_path / "report.json")]) == 0
    assert "verdict" in capsys.readouterr().out
    assert Diagnosis.from_json((tmp_path / "report.json").read_text()).bytes == 3 * (1 << 16) * 4
    with pytest.raises(SystemExit, match="no callable"):
        main(["diagnose", "my_workload:missing"])
    with pytest.raises(SystemExit, match="built-in examples only"):
        main(["diagnose", "my_workload:make", "--size", "8"])


# --- benchmark plots -------------------------------------------------------------------------


def synthetic_results():
    """A results file as harness.Recorder.write leaves it, with one op that has no peer."""
    rows = []
    for n in (1 << 10, 1 << 14, 1 << 18):
        for impl, ms in (("brrr", 1.0), ("eager", 2.0), ("compile", 1.5)):
            rows.append(dict(family="chain", op="cos.cos", dtype="float32", shape=[n], pass_="fwd", impl=impl,
                             ms=ms * n / 1024, GBps=1.0, floor_ms=0.5, frac_floor=0.5))
        rows.append(dict(family="chain", op="lonely", dtype="float32", shape=[n], pass_="fwd", impl="brrr", ms=1.0))
        for impl, us in (("eager", 12.0), ("compile", 35.0), ("graph", 4.0), ("brrr", 6.0)):
            rows.append(dict(family="overhead", op="cos.cos", dtype="float32", shape=[n], impl=impl, host_us=us))
    for repeats in (1, 16, 64, 256):
        for impl in ("brrr", "compile"):
            rows.append(dict(family="repeat", op=f"mul x{repeats}", dtype="float32", shape=[1 << 24], pass_="fwd",
                             impl=impl, ms=1.0, repeats=repeats, GFLOPs=min(100.0 * repeats, 3000.0),
                             GBps=min(4000.0, 120000.0 / repeats)))
    return {"env": {"copy_GBps": 4250.0, "torch": torch.__version__}, "rows": rows}


def png_files(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(".png"))


def test_plot_writes_every_plot_and_skips_what_is_missing(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, BENCHMARKS)
    try:
        import plot
    finally:
        sys.path.remove(BENCHMARKS)
    (tmp_path / "chain.json").write_text(json.dumps(synthetic_results()))
    (tmp_path / "broken.json").write_text("{not json")
    written, messages = plot.plot_results([str(tmp_path)], str(tmp_path / "plots"))
    assert png_files(tmp_path / "plots") == ["host-overhead.png", "repeat-sweep.png", "speedup-chain.png"]
    assert all(os.path.getsize(path) > 1000 for path in written)
    assert any("broken.json" in m for m in messages)
    assert any("lonely" in m and "no peer" in m for m in messages)

    only_eager = {"env": {}, "rows": [dict(family="chain", op="cos.cos", dtype="float32", shape=[8], pass_="fwd",
                                           impl="eager", ms=1.0)]}
    (tmp_path / "sparse").mkdir()
    (tmp_path / "sparse" / "eager.json").write_text(json.dumps(only_eager))
    written, messages = plot.plot_results([str(tmp_path / "sparse")], str(tmp_path / "sparse" / "plots"))
    assert written == []
    assert any("no brrr rows" in m for m in messages)
    assert any("repeat-sweep.png" in m for m in messages) and any("host-overhead.png" in m for m in messages)


def test_run_py_plots_existing_results(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "chain.json").write_text(json.dumps(synthetic_results()))
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "run.py"), "--out", str(tmp_path),
                             "--plot-only"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert png_files(tmp_path / "plots") == ["host-overhead.png", "repeat-sweep.png", "speedup-chain.png"]
