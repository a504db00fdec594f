"""Norm and softmax kernels against the memory floor and torch.compile, in device time, in one
run of a few minutes on one GPU:

    python3 benchmarks/probes/floor_probe.py                   # every row below
    python3 benchmarks/probes/floor_probe.py --only softmax --no-compile
    python3 benchmarks/probes/floor_probe.py --variant NAME=a,b
    python3 benchmarks/probes/floor_probe.py --device cpu --rows 64 --hidden 256 --cols 384  # smoke run

Rows: 16384 rows; LayerNorm, RMSNorm, add_layer_norm, add_rms_norm at hidden 768, 1024, 2048,
4096, 5120, 8192, 16384; softmax and log_softmax at 1024, 4096, 32768, 131072 columns; bfloat16
and float32; forward (no grad) and forward+backward (torch.autograd.grad for every input).

Device time: the summed time of the GPU activities (kernels, copies, memsets) of one call, from
torch.profiler: each implementation's calls run in a window of their own (a record_function
range closed by a synchronize) and every GPU activity counts for the window it started in. Host
time does not count. Floor: the fewest bytes a pass must move (as benchmarks/test_bench_norm.py
and test_bench_softmax.py count them) over the bandwidth of a 1 GiB device-to-device copy, timed
the same way in the same run. torch.compile: default mode, dynamic=False; worker processes
compile every shape first (filling inductor's on-disk caches), so that this process's compiles
are cache hits (it prints how many). Liger-Kernel joins where it is importable.

--variant NAME=a,b times brrr once per value of the environment variable NAME (set in this
process before each of brrr's windows), for kernels that read such a switch at launch.
Each row prints as soon as it is measured; --json writes them all at the end.
"""

import argparse
import json
import os
import sys
import time

# Inductor's caches on disk, in one place for this process and its workers (set before torch is
# imported, which reads them). TORCHINDUCTOR_COMPILE_THREADS=1 made every lookup here miss.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/brrr-floor-probe-inductor")
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/brrr-floor-probe-triton")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the source tree's brrr

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import brrr  # noqa: E402

NORM_HIDDEN = [768, 1024, 2048, 4096, 5120, 8192, 16384]
NORM_OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]
SOFTMAX_COLS = [1024, 4096, 32768, 131072]
SOFTMAX_OPS = ["softmax", "log_softmax"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
EPS = 1e-6
WINDOW_MS = 15.0  # GPU time per implementation and pass in the profiled window
BIG_BYTES = 3 << 30  # rows with an input this large warm up one at a time (memory)
SETTINGS = {"rows": 16384, "device": "cuda"}  # --rows, --device (handed to the workers too)


def cuda():
    return SETTINGS["device"] == "cuda"


def sync():
    if cuda():
        torch.cuda.synchronize()


def randn(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, device=SETTINGS["device"], dtype=dtype, requires_grad=grad)


# ---- the rows: inputs, implementations, bytes -----------------------------------------------------

def norm_fns(op, hidden):
    """(brrr, eager, parameter count, input activations, passes forward, passes forward+backward)."""
    ns = (hidden,)
    if op == "layer_norm":
        return (lambda x, w, b: brrr.layer_norm(x, ns, w, b, EPS), lambda x, w, b: F.layer_norm(x, ns, w, b, EPS),
                2, 1, 2, 5)
    if op == "rms_norm":
        return lambda x, w: brrr.rms_norm(x, ns, w, EPS), lambda x, w: F.rms_norm(x, ns, w, EPS), 1, 1, 2, 5
    if op == "add_layer_norm":
        def eager_add_layer_norm(x, r, w, b):
            h = x + r
            return F.layer_norm(h, ns, w, b, EPS), h
        return lambda x, r, w, b: brrr.add_layer_norm(x, r, ns, w, b, EPS), eager_add_layer_norm, 2, 2, 4, 8

    def eager_add_rms_norm(x, r, w):
        h = x + r
        return F.rms_norm(h, ns, w, EPS), h
    return lambda x, r, w: brrr.add_rms_norm(x, r, ns, w, EPS), eager_add_rms_norm, 1, 2, 4, 8


def liger_norm(op, hidden, dtype):
    """Liger-Kernel's function for op (casting in float32 throughout, as torch and brrr do), as a
    function of op's inputs, or None where Liger lacks it or its API differs."""
    if not cuda():
        return None
    try:
        if op == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            fn = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)  # noqa: E731
        elif op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            fn = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", False)  # noqa: E731
        elif op == "add_rms_norm":
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
            fn = lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "gemma", False)  # noqa: E731
        else:
            return None
        # a small call first: does this version take these arguments?
        acts = [randn(2, hidden, dtype=dtype) for _ in range(2 if op == "add_rms_norm" else 1)]
        fn(*acts, *[torch.ones_like(acts[0][0]) for _ in range(2 if op == "layer_norm" else 1)])
        return fn
    except Exception:  # noqa: BLE001 - absent, or an API this probe does not know
        return None


def liger_softmax(op):
    if not cuda() or op != "softmax":  # Liger has no log-softmax
        return None
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError:
        return None
    return LigerSoftmaxFunction.apply


def norm_case(op, dtype, hidden):
    ours, eager, n_params, n_act, fwd_passes, all_passes = norm_fns(op, hidden)
    acts = [randn(SETTINGS["rows"], hidden, dtype=dtype, grad=True) for _ in range(n_act)]
    params = [randn(hidden, dtype=dtype, grad=True) for _ in range(n_params)]
    unit, pbytes = acts[0].numel() * acts[0].element_size(), hidden * params[0].element_size()
    return dict(inputs=acts + params, brrr=ours, eager=eager, liger=liger_norm(op, hidden, dtype),
                bytes={"fwd": fwd_passes * unit + n_params * pbytes,
                       "fwd+bwd": all_passes * unit + (2 * n_params + 1) * pbytes})


def softmax_case(op, dtype, cols):
    log = op == "log_softmax"
    x = randn(SETTINGS["rows"], cols, dtype=dtype, grad=True)
    unit = x.numel() * x.element_size()
    return dict(inputs=[x], brrr=(lambda x: brrr.log_softmax(x, -1)) if log else (lambda x: brrr.softmax(x, -1)),
                eager=(lambda x: torch.log_softmax(x, -1)) if log else (lambda x: torch.softmax(x, -1)),
                liger=liger_softmax(op), bytes={"fwd": 2 * unit, "fwd+bwd": 5 * unit})


def rows(only, hidden, cols, dtypes):
    """Every (family, op, dtype name, size) of this run."""
    out = []
    if only in (None, "norm"):
        out += [("norm", op, d, h) for h in hidden for d in dtypes for op in NORM_OPS]
    if only in (None, "softmax"):
        out += [("softmax", op, d, c) for c in cols for d in dtypes for op in SOFTMAX_OPS]
    return out


def make_case(row):
    family, op, dname, size = row
    return (norm_case if family == "norm" else softmax_case)(op, DTYPES[dname], size)


def input_bytes(row):
    return SETTINGS["rows"] * row[3] * DTYPES[row[2]].itemsize


def outputs(y):
    return list(y) if isinstance(y, (tuple, list)) else [y]


def passes(fn, inputs):
    """(forward, forward+backward) callables of fn on inputs."""
    with torch.no_grad():
        grads = [torch.randn_like(y) for y in outputs(fn(*inputs))]

    def fwd():
        with torch.no_grad():
            return fn(*inputs)

    def fwd_bwd():
        return torch.autograd.grad(outputs(fn(*inputs)), inputs, grads)
    return fwd, fwd_bwd


def compiled(fn):
    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 4096))
    return torch.compile(fn, dynamic=False)


# ---- compile warm-up in worker processes ----------------------------------------------------------

def warm(todo):
    """Compile each row's eager function with torch.compile, forward and forward+backward, and run
    Liger's (its Triton kernels land in the shared Triton cache). Runs in a worker process."""
    for row in todo:
        case = make_case(row)
        for fn in (compiled(case["eager"]), case["liger"]):
            if fn is None:
                continue
            try:
                for p in passes(fn, case["inputs"]):
                    p()
            except Exception:  # noqa: BLE001 - Liger refusing a shape: measure() reports it
                if fn is not case["liger"]:
                    raise
        del case
        if cuda():
            torch.cuda.empty_cache()


def warm_all(todo, workers):
    """Compile the rows in `workers` processes (this script, run with --warm): the largest rows
    (inputs of BIG_BYTES or more: two at once would strain the GPU's memory) in one of them, one
    after the other, the rest spread over the others. The workers are fresh interpreters rather
    than multiprocessing's: with those, inductor's cache keys for the same graph differed from
    this process's (measured: no hits)."""
    import subprocess

    big = [r for r in todo if input_bytes(r) >= BIG_BYTES]
    small = sorted((r for r in todo if input_bytes(r) < BIG_BYTES), key=input_bytes, reverse=True)
    n = max(1, min(workers - (1 if big else 0), len(small)))
    shares = [small[k::n] for k in range(n)] + ([big] if big else [])
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", json.dumps(share),
                               "--rows", str(SETTINGS["rows"]), "--device", SETTINGS["device"]])
             for share in shares if share]
    failed = sum(p.wait() != 0 for p in procs)
    print(f"# torch.compile warm-up: {len(todo)} rows in {len(procs)} processes, {time.perf_counter() - t0:.0f} s"
          + (f", {failed} failed (their rows compile here)" if failed else ""), flush=True)


# ---- device time ----------------------------------------------------------------------------------

def once_ms(fn):
    """Wall milliseconds of one call (CUDA events on the GPU), for choosing repetitions."""
    if not cuda():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def device_ms(windows):
    """Device milliseconds per call of each (name, fn, setup) in windows: the GPU activities of
    one profiler session, each counted for the window it started in. setup() runs before a
    window (host work only, such as setting an environment switch). On the CPU (smoke runs) the
    operators called directly inside a window count instead."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    reps = {}
    for name, fn, setup in windows:
        setup()
        fn()
        fn()  # warm: allocator, lazy initialisation, autotuning
        reps[name] = max(3, min(50, int(WINDOW_MS / max(once_ms(fn), 1e-3))))
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda() else [])
    with profile(activities=activities) as prof:
        for name, fn, setup in windows:
            setup()
            with record_function("probe::" + name):
                for _ in range(reps[name]):
                    fn()
                sync()
    events = prof.events()
    marks = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("probe::")]
    starts = sorted((e.time_range.start, e.name.removeprefix("probe::")) for e in marks)
    if cuda():
        activity = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        activity = [e for e in events if e.cpu_parent in marks]
    total = dict.fromkeys(reps, 0.0)
    for e in activity:
        owner = None
        for t, name in starts:  # the last window that began before this activity did
            if t <= e.time_range.start:
                owner = name
        if owner is not None:
            total[owner] += e.time_range.end - e.time_range.start
    return {name: total[name] / 1e3 / reps[name] for name in reps}


def copy_gbps():
    src = randn(1 << (28 if cuda() else 22))
    dst = torch.empty_like(src)
    ms = device_ms([("copy", lambda: dst.copy_(src), lambda: None)])["copy"]
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---- main -----------------------------------------------------------------------------------------

def measure(row, with_compile, gbps, variant):
    """The row's records (forward, forward+backward) and the labels of what was timed."""
    family, op, dname, size = row
    case = make_case(row)
    impls = {"brrr": case["brrr"], "compile": compiled(case["eager"]) if with_compile else None,
             "liger": case["liger"]}
    name, values = variant or (None, [None])

    def setter(value):
        def setup():
            if value is not None:
                os.environ[name] = value
        return setup

    windows, labels = [], {}
    for impl, fn in impls.items():
        if fn is None:
            continue
        try:
            fwd, fwd_bwd = passes(fn, case["inputs"])
        except Exception as e:  # noqa: BLE001 - e.g. Liger's softmax refuses rows above 65536
            print(f"# {op} {dname} {size}: {impl} refused: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        for value in values if impl == "brrr" else [None]:
            label = impl if value is None else f"{impl}[{value}]"
            labels[label] = impl
            windows += [(f"{label} fwd", fwd, setter(value)), (f"{label} fwd+bwd", fwd_bwd, setter(value))]
    with torch.no_grad():  # brrr against eager before timing: a broken kernel shows here
        err = rel_err(outputs(case["brrr"](*case["inputs"]))[0], outputs(case["eager"](*case["inputs"]))[0])
    ms = device_ms(windows)
    records = []
    for pass_ in ("fwd", "fwd+bwd"):
        rec = dict(family=family, op=op, dtype=dname, rows=SETTINGS["rows"], size=size, pass_=pass_,
                   floor_ms=case["bytes"][pass_] / (gbps * 1e9) * 1e3, brrr_fwd_rel_err=err)
        for label in labels:
            rec[label + "_ms"] = ms[f"{label} {pass_}"]
        records.append(rec)
    return records, labels


def fmt_row(rec, labels):
    cells = [f"{rec['op']:14s} {rec['dtype']:4s} {rec['size']:6d} {rec['pass_']:7s} floor {rec['floor_ms']:8.4f}"]
    for label in labels:
        ms = rec[label + "_ms"]
        cells.append(f"{label} {ms:8.4f} ({100 * rec['floor_ms'] / ms:3.0f}%)" if ms > 0 else f"{label} -")
    ours = [rec[lab + "_ms"] for lab in labels if labels[lab] == "brrr" and rec[lab + "_ms"] > 0]
    peers = [rec[lab + "_ms"] for lab in labels if labels[lab] != "brrr" and rec[lab + "_ms"] > 0]
    if ours and peers:
        cells.append(f"best peer / brrr {min(peers) / min(ours):4.2f}x")
    if rec["brrr_fwd_rel_err"] > (2e-2 if rec["dtype"] == "bf16" else 1e-4):
        cells.append(f"BRRR DISAGREES WITH EAGER (relative error {rec['brrr_fwd_rel_err']:.1e})")
    return " | ".join(cells)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["norm", "softmax"])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--hidden", type=ints, default=NORM_HIDDEN)
    p.add_argument("--cols", type=ints, default=SOFTMAX_COLS)
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES))
    p.add_argument("--rows", type=int, default=SETTINGS["rows"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    p.add_argument("--variant", help="NAME=a,b: time brrr with the environment variable NAME at each value")
    p.add_argument("--json", help="write every row here at the end")
    p.add_argument("--warm", help=argparse.SUPPRESS)  # a worker of warm_all: compile these rows (JSON)
    args = p.parse_args()
    SETTINGS.update(rows=args.rows, device=args.device)
    if args.warm:
        return warm([tuple(r) for r in json.loads(args.warm)])
    variant = None
    if args.variant:
        name, _, values = args.variant.partition("=")
        variant = (name, values.split(","))
    t0 = time.perf_counter()
    todo = rows(args.only, args.hidden, args.cols, args.dtypes)
    gpu = torch.cuda.get_device_name() if cuda() else "CPU (smoke run)"
    print(f"# {gpu}, torch {torch.__version__}, brrr {brrr.__version__}", flush=True)
    if not args.no_compile:
        warm_all(todo, args.workers)
    gbps = copy_gbps()
    print(f"# copy bandwidth {gbps:.0f} GB/s (read + written); device ms per call (% of floor)", flush=True)
    records = []
    for row in todo:
        try:
            recs, labels = measure(row, not args.no_compile, gbps, variant)
        except torch.OutOfMemoryError:
            print(f"# {row}: out of memory", flush=True)
            continue
        for rec in recs:
            print(fmt_row(rec, labels), flush=True)
        records += recs
        if cuda():
            torch.cuda.empty_cache()
    if not args.no_compile:
        from torch._dynamo.utils import counters
        print(f"# this process's compiles: inductor cache {counters['inductor']['fxgraph_cache_hit']} hits, "
              f"{counters['inductor']['fxgraph_cache_miss']} misses; autograd cache "
              f"{counters['aot_autograd']['autograd_cache_hit']} hits", flush=True)
    print(f"# {len(records)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "copy_GBps": gbps, "rows": records}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
