"""Every memory-bound op against the memory floor, eager PyTorch, torch.compile and Liger-Kernel,
in device time and wall time, forward and forward+backward, in one run of under 200 s on one GPU:

    python3 benchmarks/probes/floor_probe.py --out DIR                  # every row below
    python3 benchmarks/probes/floor_probe.py --out DIR --only norms,softmax --no-compile
    python3 benchmarks/probes/floor_probe.py --out DIR --only norms --ops rms_norm,rms_norm_llama --dtypes bf16
    python3 benchmarks/probes/floor_probe.py --out DIR --only softmax --variant BRRR_SOFTMAX_KERNEL=rows,smem
    python3 benchmarks/probes/floor_probe.py --out DIR --device cpu --smoke   # the code paths, tiny sizes

Sections (--only; --ops picks ops within them): norms (layer_norm, rms_norm in torch's and in
Llama's cast order, add_layer_norm, add_rms_norm), softmax (softmax, log_softmax at 1024, 4096,
32768, 131072 columns), activations (bias_gelu erf and tanh, bias_silu), chains (cos.cos, a
12-step mixed chain), glu (swiglu and geglu with tanh, Liger's form, each as two tensors and as
the halves of one), dropout (bias_dropout_add, p 0.1), rotary (apply_rotary_pos_emb on q and k,
head_dim 128, q and k laid out as Llama's projections leave them). 16384 rows (tokens) x hidden
768, 1024, 2048, 4096, 5120, 8192, 16384; bfloat16 and float32 (float16 where --dtypes names fp16).

Device time: harness.device_ms, the GPU's kernels, copies and fills of each implementation's
calls in a profiler window of their own, divided by the calls (host time does not count). Wall
time: harness.time_ms, the median of warm calls between CUDA events. Floor: the fewest bytes a
pass must move (inputs read once, outputs written once; forward+backward adds the backward's
grad_out, the inputs it saves or recomputes from, and the gradients) over the bandwidth of a
1 GiB device-to-device copy measured in the same run, by both clocks (the faster counts). "% of
floor" is floor / time. Two checks of the device-time count: the copy's two bandwidths must agree
within 10% (else a line says so), and no cell's device time may pass its wall time by 10% (else
the cell says DEVICE > WALL). torch.compile: default mode, dynamic=False. Liger-Kernel joins where it
is importable and has the op. A cell that fails (a peer refusing a shape, a compile error) holds
its error; the run goes on.

Processes: --workers processes (default: the cores less two, at most 14) share the rows. They
compile their rows' torch.compile functions and run Liger's once all at the same time, then time
their rows one worker after another, so that the GPU runs one process's calls while it is timed
(run_workers). A cost of compiling at the same time: inductor's reductions pick their kernel
configs (benchmarking them at their first call) on a busy GPU. --workers 1 does everything in
this process.
On the CPU (--device cpu), device time is the time of the operators torch's profiler sees
(brrr's forward calls into its extension are none of them): for exercising the code only.

--variant NAME=a,b times brrr once per value of the environment variable NAME, set in this
process before that value's calls. That serves switches that brrr's C code reads with getenv at
every launch, as BRRR_SOFTMAX_KERNEL is (cuda/softmax.cuh, launch_typed; its value auto names the
default choice, which an empty value does not: that forces the streaming kernel). A switch read
once (at import, or cached in the module state as BRRR_NUM_THREADS is, csrc/cpu.c) needs a
process per value: run the probe once per value with NAME set outside.

Writes DIR/floor.txt (markdown tables, one per section and dtype) and DIR/floor.json (every
cell, and each row's timing seconds), and prints each row as it is measured, then the seconds
spent preparing (compiling) and timing each section.
"""

import argparse
import importlib
import json
import os
import sys
import time

# Inductor's and Triton's caches on disk, in one place (set before torch is imported, which reads
# them): a second run on the same machine compiles from them.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/brrr-floor-probe-inductor")
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/brrr-floor-probe-triton")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the source tree's brrr
sys.path.insert(0, os.path.join(HERE, ".."))  # harness

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import brrr  # noqa: E402
import harness  # noqa: E402

SECTIONS = {
    "norms": ["layer_norm", "rms_norm", "rms_norm_llama", "add_layer_norm", "add_rms_norm"],
    "softmax": ["softmax", "log_softmax"],
    "activations": ["bias_gelu", "bias_gelu_tanh", "bias_silu"],
    "chains": ["cos.cos", "chain12"],
    "glu": ["swiglu", "geglu_tanh", "swiglu_split", "geglu_tanh_split"],
    "dropout": ["bias_dropout_add"],
    "rotary": ["rotary"],
}
HIDDEN = [768, 1024, 2048, 4096, 5120, 8192, 16384]
SOFTMAX_COLS = [1024, 4096, 32768, 131072]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLS = ["brrr", "eager", "compile", "liger"]
PASSES = ["fwd", "fwd+bwd"]
EPS = 1e-6
P_DROP = 0.1
HEAD_DIM = 128
# The twelve steps of the mixed chain, as brrr.chain takes them and as eager PyTorch runs them.
CHAIN12 = [(("mul", 1.5), lambda t: t * 1.5), ("sin", torch.sin), (("add", 0.25), lambda t: t + 0.25),
           ("tanh", torch.tanh), ("square", torch.square), (("mul", 0.7), lambda t: t * 0.7), ("exp", torch.exp),
           (("clamp_max", 4.0), lambda t: t.clamp_max(4.0)), ("silu", F.silu), (("add", -0.3), lambda t: t - 0.3),
           ("cos", torch.cos), ("sigmoid", torch.sigmoid)]
TOL = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}  # brrr's forward against eager's, relative
# Timing: wall time is the median of up to REPS calls (at least 5) within about MAX_WALL_S; the
# device window runs as many calls as fill about WINDOW_MS of GPU time, between 2 and REPS.
REPS, MAX_WALL_S, WINDOW_MS = 20, 0.03, 10.0
SETTINGS = {"rows": 16384, "device": "cuda", "head_dim": HEAD_DIM}


def cuda():
    return SETTINGS["device"] == "cuda"


def randn(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, device=SETTINGS["device"], dtype=dtype, requires_grad=grad)


def error_text(e):
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# ---- the rows: inputs, implementations, bytes -----------------------------------------------------
#
# A case: inputs (all of them, in call order), grads_of (the indices of those that get gradients),
# brrr, eager, liger (a function, or None where Liger lacks the op or is not installed), bytes
# {"fwd", "fwd+bwd"}, and check: the (brrr, eager) pair compared before timing (the timed pair
# itself unless it is random).


def liger(module, name):
    """Liger-Kernel's liger_kernel.<module>.<name> (an autograd Function's apply) on the GPU; None
    where Liger is not installed; where it is but fails to load, a function raising that error
    (for the cells to show)."""
    if not cuda():
        return None
    try:
        fn = getattr(importlib.import_module("liger_kernel." + module), name)
        return fn.apply if isinstance(fn, type) else fn
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - e.g. a Liger built for another triton
        text = error_text(e)

        def broken(*args):
            raise RuntimeError(f"Liger-Kernel failed to load: {text}")
        return broken


def norm_case(op, dtype, hidden):
    ns = (hidden,)
    add = op.startswith("add_")
    n_params = 2 if op.endswith("layer_norm") else 1
    acts = [randn(SETTINGS["rows"], hidden, dtype=dtype, grad=True) for _ in range(2 if add else 1)]
    params = [randn(hidden, dtype=dtype, grad=True) for _ in range(n_params)]
    if op == "layer_norm":
        ours, eager = (lambda x, w, b: brrr.layer_norm(x, ns, w, b, EPS)), (lambda x, w, b: F.layer_norm(x, ns, w, b, EPS))
        peer = liger("ops.layer_norm", "LigerLayerNormFunction")
        lig = peer and (lambda x, w, b: peer(x, w, b, EPS))
    elif op == "rms_norm":
        ours, eager = (lambda x, w: brrr.rms_norm(x, ns, w, EPS)), (lambda x, w: F.rms_norm(x, ns, w, EPS))
        # casting in float32 throughout, as torch and brrr do: Liger's "gemma" casting mode
        peer = liger("ops.rms_norm", "LigerRMSNormFunction")
        lig = peer and (lambda x, w: peer(x, w, EPS, 0.0, "gemma", False))
    elif op == "rms_norm_llama":
        def eager(x, w):  # Hugging Face's LlamaRMSNorm: x * rstd rounded to x's dtype, then the weight
            h = x.float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
        ours = lambda x, w: brrr.rms_norm(x, ns, w, EPS, cast_order="llama")  # noqa: E731
        peer = liger("ops.rms_norm", "LigerRMSNormFunction")
        lig = peer and (lambda x, w: peer(x, w, EPS, 0.0, "llama", False))
    elif op == "add_layer_norm":
        def eager(x, r, w, b):
            h = x + r
            return F.layer_norm(h, ns, w, b, EPS), h
        ours, lig = (lambda x, r, w, b: brrr.add_layer_norm(x, r, ns, w, b, EPS)), None
    else:
        def eager(x, r, w):
            h = x + r
            return F.rms_norm(h, ns, w, EPS), h
        ours = lambda x, r, w: brrr.add_rms_norm(x, r, ns, w, EPS)  # noqa: E731
        peer = liger("ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
        lig = peer and (lambda x, r, w: peer(x, r, w, EPS, 0.0, "gemma", False))
    u, v = acts[0].numel() * acts[0].element_size(), hidden * params[0].element_size()
    # forward: the activations read, the outputs (normed, and the sum for the add_ forms) written;
    # backward: grad_out (and the sum's gradient) and x (or the sum) read, grad_x written (the
    # residual's gradient is the same tensor); the parameters read, their gradients written
    fwd = (4 if add else 2) * u + n_params * v
    return dict(inputs=acts + params, grads_of=range(len(acts) + n_params), brrr=ours, eager=eager, liger=lig,
                bytes={"fwd": fwd, "fwd+bwd": fwd + (4 if add else 3) * u + (n_params + 1) * v})


def softmax_case(op, dtype, cols):
    x = randn(SETTINGS["rows"], cols, dtype=dtype, grad=True)
    u = x.numel() * x.element_size()
    if op == "log_softmax":
        ours, eager, lig = (lambda x: brrr.log_softmax(x, -1)), (lambda x: torch.log_softmax(x, -1)), None  # Liger has none
    else:
        ours, eager = (lambda x: brrr.softmax(x, -1)), (lambda x: torch.softmax(x, -1))
        lig = liger("ops.softmax", "LigerSoftmaxFunction")
    # backward: y and grad_y read, grad_x written
    return dict(inputs=[x], grads_of=[0], brrr=ours, eager=eager, liger=lig, bytes={"fwd": 2 * u, "fwd+bwd": 5 * u})


def activation_case(op, dtype, hidden):
    x, bias = randn(SETTINGS["rows"], hidden, dtype=dtype, grad=True), randn(hidden, dtype=dtype, grad=True)
    if op == "bias_silu":
        ours, eager = brrr.bias_silu, (lambda x, b: F.silu(x + b))
    else:
        approximate = "tanh" if op == "bias_gelu_tanh" else "none"
        ours = lambda x, b: brrr.bias_gelu(x, b, approximate)  # noqa: E731
        eager = lambda x, b: F.gelu(x + b, approximate=approximate)  # noqa: E731
    u, v = x.numel() * x.element_size(), bias.numel() * bias.element_size()
    # backward: grad_out, x and bias read (the activation recomputed), grad_x and grad_bias written
    return dict(inputs=[x, bias], grads_of=[0, 1], brrr=ours, eager=eager, liger=None,
                bytes={"fwd": 2 * u + v, "fwd+bwd": 5 * u + 3 * v})


def chain_case(op, dtype, hidden):
    x = randn(SETTINGS["rows"], hidden, dtype=dtype, grad=True)
    if op == "cos.cos":
        ours, eager = brrr.chain("cos", "cos"), (lambda x: x.cos().cos())
    else:
        ours = brrr.chain(*(step for step, _ in CHAIN12))

        def eager(x):
            for _, fn in CHAIN12:
                x = fn(x)
            return x
    u = x.numel() * x.element_size()
    # backward: grad_out and x read (the chain recomputed), grad_x written
    return dict(inputs=[x], grads_of=[0], brrr=ours, eager=eager, liger=None, bytes={"fwd": 2 * u, "fwd+bwd": 5 * u})


def glu_case(op, dtype, hidden):
    tanh = op.startswith("geglu")
    act = (lambda t: F.gelu(t, approximate="tanh")) if tanh else F.silu
    if op.endswith("_split"):
        inputs = [randn(SETTINGS["rows"], 2 * hidden, dtype=dtype, grad=True)]
        ours = (lambda x: brrr.geglu(x, approximate="tanh")) if tanh else brrr.swiglu

        def eager(x):
            gate, up = x.chunk(2, -1)
            return act(gate) * up
        lig = None  # Liger's GLUs take two tensors
    else:
        inputs = [randn(SETTINGS["rows"], hidden, dtype=dtype, grad=True) for _ in range(2)]
        ours = (lambda g, u: brrr.geglu(g, u, approximate="tanh")) if tanh else brrr.swiglu
        eager = lambda g, u: act(g) * u  # noqa: E731
        lig = liger("ops.geglu", "LigerGELUMulFunction") if tanh else liger("ops.swiglu", "LigerSiLUMulFunction")
    u = SETTINGS["rows"] * hidden * inputs[0].element_size()
    # forward: gate and up read, out written; backward: grad_out, gate and up read, their grads written
    return dict(inputs=inputs, grads_of=range(len(inputs)), brrr=ours, eager=eager, liger=lig,
                bytes={"fwd": 3 * u, "fwd+bwd": 8 * u})


def dropout_case(op, dtype, hidden):
    x, r = (randn(SETTINGS["rows"], hidden, dtype=dtype, grad=True) for _ in range(2))
    bias = randn(hidden, dtype=dtype, grad=True)

    def ours(x, b, r, p=P_DROP):
        return brrr.bias_dropout_add(x, b, r, p)

    def eager(x, b, r, p=P_DROP):
        return r + F.dropout(x + b, p, training=True)
    u, v = x.numel() * x.element_size(), bias.numel() * bias.element_size()
    # backward: grad_out read, grad_x (the mask drawn again from the seed) and grad_bias written;
    # grad_residual is grad_out itself
    return dict(inputs=[x, bias, r], grads_of=[0, 1, 2], brrr=ours, eager=eager, liger=None,
                check=(lambda x, b, r: ours(x, b, r, 0.0), lambda x, b, r: eager(x, b, r, 0.0)),
                bytes={"fwd": 3 * u + v, "fwd+bwd": 5 * u + 2 * v})


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_case(op, dtype, hidden):
    d = SETTINGS["head_dim"]
    if hidden % d:
        raise ValueError(f"hidden {hidden} is not a multiple of head_dim {d}")
    batch = 4 if SETTINGS["rows"] % 4 == 0 else 1
    seq, heads = SETTINGS["rows"] // batch, hidden // d
    # q and k as a Llama attention's projections leave them: (batch, seq, heads, d) viewed as
    # (batch, heads, seq, d)
    q, k = (randn(batch, seq, heads, d, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(2))
    angles = randn(batch, seq, d // 2).repeat(1, 1, 2) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def eager(q, k, cos, sin):  # transformers' Llama apply_rotary_pos_emb
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    lig = liger("transformers.rope", "liger_rotary_pos_emb")
    u, a = q.numel() * q.element_size(), cos.numel() * cos.element_size()
    # forward: q, k, cos and sin read, both outputs written; backward: the same with the grads
    return dict(inputs=[q, k, cos, sin], grads_of=[0, 1], brrr=brrr.apply_rotary_pos_emb, eager=eager, liger=lig,
                bytes={"fwd": 4 * u + 2 * a, "fwd+bwd": 8 * u + 4 * a})


BUILDERS = {"norms": norm_case, "softmax": softmax_case, "activations": activation_case, "chains": chain_case,
            "glu": glu_case, "dropout": dropout_case, "rotary": rotary_case}


def rows(sections, hidden, cols, dtypes, ops=None):
    """Every (section, op, dtype name, size) of this run, section by section (only the ops named in
    ops, when given)."""
    return [(s, op, d, n) for s in sections for n in (cols if s == "softmax" else hidden)
            for d in dtypes for op in SECTIONS[s] if ops is None or op in ops]


def make_case(row):
    section, op, dname, size = row
    return BUILDERS[section](op, DTYPES[dname], size)


def input_bytes(row):
    _, op, dname, size = row
    return SETTINGS["rows"] * size * DTYPES[dname].itemsize * (2 if op.endswith("_split") else 1)


def outputs(y):
    return list(y) if isinstance(y, (tuple, list)) else [y]


def passes(fn, case):
    """{pass: a callable} of fn on the case's inputs: the forward without autograd, and the forward
    with the gradients of every differentiable input. Calls fn once (for the output's shapes)."""
    inputs = case["inputs"]
    wrt = [inputs[i] for i in case["grads_of"]]
    with torch.no_grad():
        grads = [torch.randn_like(y) for y in outputs(fn(*inputs))]

    def fwd():
        with torch.no_grad():
            return fn(*inputs)

    def fwd_bwd():
        return torch.autograd.grad(outputs(fn(*inputs)), wrt, grads)
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def compiled(fn):
    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 4096))
    return torch.compile(fn, dynamic=False)


COMPILED = {}  # row -> its torch.compile function, compiled once in this process


def implementations(row, case, with_compile):
    """{impl: function, or None where the impl does not apply}. The torch.compile function is the
    one made when the row was first prepared (eager functions close over no tensor), so its
    compiled graphs and guards serve every case of the row without compiling again."""
    if with_compile and row not in COMPILED:
        COMPILED[row] = compiled(case["eager"])
    return {"brrr": case["brrr"], "eager": case["eager"], "compile": COMPILED.get(row) if with_compile else None,
            "liger": case["liger"]}


def rel_err(a, b):
    a, b = a.float(), b.float()  # not double: a 16384 x 131072 float32 output would take 16 GiB more
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---- processes: compiling in parallel, timing one at a time --------------------------------------
#
# torch.compile costs seconds of host time per row and shape (dynamo's trace, inductor, Triton),
# and even a cache hit costs a trace and a load: too much for one process over some 230 rows.
# So `workers` processes share the rows. Each first runs its rows' compiled functions and Liger's
# once (compiling them, or loading them from inductor's and Triton's caches on disk), all workers
# at once; then, when every worker is ready, they time their rows one worker after the other, so
# the GPU times one process's calls at a time. A worker's files in the sync folder: ready-K, then
# part-K.json and done-K; the parent stands in for a worker that died.


def prepare(todo, with_compile):
    """Run each row's functions but eager's once, forward and forward+backward: torch.compile's,
    Liger's Triton kernels and brrr's compiled chains compile now, not while timed. A failure is
    measure()'s to report."""
    for row in todo:
        try:
            case = make_case(row)
            for impl, fn in implementations(row, case, with_compile).items():
                if impl != "eager" and fn is not None:
                    try:
                        for p in passes(fn, case).values():
                            p()
                    except Exception:  # noqa: BLE001 - recorded in its cell by measure()
                        pass
            del case
        except Exception:  # noqa: BLE001 - e.g. out of memory: measure() meets it again
            pass
        if cuda():
            torch.cuda.empty_cache()


def frames_compiled():
    """How many frames dynamo has compiled in this process (to see that timing compiled none)."""
    from torch._dynamo.utils import counters
    return counters["frames"]["ok"]


def measure_rows(todo, with_compile, gbps, variant):
    """Every row's records (each with the seconds it took), printed as they are measured; a row
    that fails as a whole (out of memory) is recorded as failed and the run goes on."""
    records = []
    for row in todo:
        t0 = time.perf_counter()
        try:
            recs = measure(row, with_compile, gbps, variant)
        except Exception as e:  # noqa: BLE001 - the row says why
            recs = failed_row(row, error_text(e))
        for rec in recs:
            rec["measure_s"] = (time.perf_counter() - t0) / len(recs)
            print(console_line(rec, labels_of(recs)), flush=True)
        records += recs
        if cuda():
            torch.cuda.empty_cache()
    return records


def failed_row(row, error):
    section, op, dname, size = row
    return [dict(section=section, op=op, dtype=dname, rows=SETTINGS["rows"], size=size, pass_=p, bytes=None,
                 floor_ms=float("nan"), brrr_fwd_rel_err=None, cells={"brrr": {"error": error}}) for p in PASSES]


def shares(todo, workers):
    """The rows split over at most `workers` workers, largest first in each, bounding the GPU
    memory that preparing them at once takes: with 5 workers or more, rows whose inputs take 2 GiB
    or more go to one worker, 512 MiB or more to three, the rest to the others."""
    def split(tier, n):
        tier = sorted(tier, key=input_bytes, reverse=True)
        n = min(n, len(tier))
        return [tier[k::n] for k in range(n)]
    if workers < 5:
        return split(todo, workers)
    sizes = [input_bytes(r) for r in todo]
    return (split([r for r, b in zip(todo, sizes) if b >= 2 << 30], 1)
            + split([r for r, b in zip(todo, sizes) if 512 << 20 <= b < 2 << 30], 3)
            + split([r for r, b in zip(todo, sizes) if b < 512 << 20], workers - 4))


def wait_for(condition):
    while not condition():
        time.sleep(0.05)


def worker(todo, index, count, sync, with_compile, gbps, variant):
    """One worker's rows: prepared at once with the others, timed in its turn (see above)."""
    t0 = time.perf_counter()
    prepare(todo, with_compile)
    prepare_s = time.perf_counter() - t0
    open(os.path.join(sync, f"ready-{index}"), "w").close()
    wait_for(lambda: all(os.path.exists(os.path.join(sync, f"ready-{k}")) for k in range(count)))
    wait_for(lambda: index == 0 or os.path.exists(os.path.join(sync, f"done-{index - 1}")))
    frames = frames_compiled()
    records = measure_rows(todo, with_compile, gbps, variant)
    with open(os.path.join(sync, f"part-{index}.json"), "w") as f:
        json.dump({"prepare_s": prepare_s, "records": records, "recompiled": frames_compiled() - frames}, f)
    open(os.path.join(sync, f"done-{index}"), "w").close()


def run_workers(todo, workers, with_compile, gbps, variant, argv):
    """(records in todo's order, the longest worker's preparing seconds, the frames compiled while
    timing)."""
    import subprocess
    import tempfile

    parts = shares(todo, workers)
    sync = tempfile.mkdtemp(prefix="brrr-floor-probe-")
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")  # the workers are the parallelism
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--part", json.dumps(part),
                               "--index", str(k), "--count", str(len(parts)), "--sync", sync, "--gbps", repr(gbps)],
                              env=env)
             for k, part in enumerate(parts)]
    print(f"# {len(todo)} rows over {len(procs)} worker processes (preparing at once, timing in turn)", flush=True)
    running = set(range(len(procs)))
    while running:
        for k in list(running):
            if procs[k].poll() is not None:
                running.discard(k)
                for mark in ("ready", "done"):  # a worker that died: the others go on without it
                    path = os.path.join(sync, f"{mark}-{k}")
                    if not os.path.exists(path):
                        open(path, "w").close()
        time.sleep(0.1)
    by_row, prepare_s, recompiled = {}, 0.0, 0
    for k, part in enumerate(parts):
        try:
            with open(os.path.join(sync, f"part-{k}.json")) as f:
                data = json.load(f)
        except OSError:
            data = {"prepare_s": 0.0, "recompiled": 0, "records": [
                r for row in part for r in failed_row(row, f"worker {k} exited with {procs[k].returncode}")]}
        prepare_s, recompiled = max(prepare_s, data["prepare_s"]), recompiled + data["recompiled"]
        for rec in data["records"]:
            by_row.setdefault((rec["section"], rec["op"], rec["dtype"], rec["size"]), []).append(rec)
    return [rec for row in todo for rec in by_row.get(tuple(row), [])], prepare_s, recompiled


# ---- measuring ------------------------------------------------------------------------------------

def copy_gbps():
    """(device-time, wall-time) bandwidth of a device-to-device copy, bytes read plus written."""
    src = randn(1 << (28 if cuda() else 22))
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    wall = harness.time_ms(copy, warmup=3, reps=REPS, max_time_s=0.2)
    dev = harness.device_ms([("copy", copy, 10)], SETTINGS["device"])["copy"]
    moved = 2 * src.numel() * src.element_size()
    return moved / (dev * 1e-3) / 1e9, moved / (wall * 1e-3) / 1e9


def time_cells(fns):
    """{key: {"wall_ms", "device_ms"} or {"error"}} for {key: fn}: each fn's wall time, then all
    their device times in one profiler session."""
    cells, windows = {}, []
    for k, (key, fn) in enumerate(fns.items()):
        try:
            wall = harness.time_ms(fn, warmup=2, reps=REPS, max_time_s=MAX_WALL_S)
        except Exception as e:  # noqa: BLE001 - a peer refusing a shape, a compile failing
            cells[key] = {"error": error_text(e)}
            continue
        cells[key] = {"wall_ms": wall}
        windows.append((str(k), key, fn, max(2, min(REPS, int(WINDOW_MS / max(wall, 1e-3))))))
    if windows:
        try:
            ms = harness.device_ms([(name, fn, reps) for name, _, fn, reps in windows], SETTINGS["device"])
        except Exception as e:  # noqa: BLE001 - the profiler failing: the wall times stand
            ms = {name: None for name, _, _, _ in windows}
            for _, key, _, _ in windows:
                cells[key]["device_error"] = error_text(e)
        for name, key, _, _ in windows:
            cells[key]["device_ms"] = ms[name]
    return cells


def set_env(name, value):
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def measure(row, with_compile, gbps, variant=None):
    """The row's records, one per pass: its floor, and a cell per implementation (brrr's once per
    value of the variant's environment variable, labelled brrr[value]; the peers once)."""
    section, op, dname, size = row
    case = make_case(row)
    cells = {p: {} for p in PASSES}
    timed = {}  # impl -> {pass: fn}
    for impl, fn in implementations(row, case, with_compile).items():
        if fn is None:
            continue
        try:
            timed[impl] = passes(fn, case)
        except Exception as e:  # noqa: BLE001 - the cell says why
            for p in PASSES:
                cells[p][impl] = {"error": error_text(e)}
    err = None
    if "brrr" in timed and "eager" in timed:  # brrr against eager before timing: a broken kernel shows
        ours, theirs = case.get("check", (case["brrr"], case["eager"]))
        with torch.no_grad():
            err = rel_err(outputs(ours(*case["inputs"]))[0], outputs(theirs(*case["inputs"]))[0])
    name, values = variant or (None, [None])
    saved = os.environ.get(name) if name else None
    for k, value in enumerate(values):
        fns = {}
        for impl, fs in timed.items():
            if impl == "brrr" or k == 0:
                label = f"brrr[{value}]" if impl == "brrr" and name else impl
                fns.update({(label, p): f for p, f in fs.items()})
        if name:
            set_env(name, value)
        try:
            measured = time_cells(fns)
        finally:
            if name:
                set_env(name, saved)
        for (label, p), c in measured.items():
            cells[p][label] = c
    records = []
    for p in PASSES:
        floor = case["bytes"][p] / (gbps * 1e9) * 1e3
        for c in cells[p].values():
            if "error" in c:
                continue
            for clock in ("device", "wall"):
                if c.get(clock + "_ms"):
                    c[clock + "_pct"] = 100 * floor / c[clock + "_ms"]
            # a call's device work fits between the CUDA events around it: more is a miscount
            c["device_over_wall"] = cuda() and (c.get("device_ms") or 0) > 1.1 * c["wall_ms"]
        records.append(dict(section=section, op=op, dtype=dname, rows=SETTINGS["rows"], size=size, pass_=p,
                            bytes=case["bytes"][p], floor_ms=floor, brrr_fwd_rel_err=err, cells=cells[p]))
    return records


# ---- reporting ------------------------------------------------------------------------------------

def labels_of(records):
    """The implementations' labels in these records, brrr's first, then the peers in IMPLS order."""
    seen = {label for r in records for label in r["cells"]}
    ours = sorted(lab for lab in seen if lab.startswith("brrr"))
    return ours + [impl for impl in IMPLS[1:] if impl in seen]


def best(record, mine, clock):
    times = [c[clock + "_ms"] for lab, c in record["cells"].items()
             if lab.startswith("brrr") == mine and c.get(clock + "_ms")]
    return min(times) if times else None


def ratio(record, clock):
    """The fastest peer's time over brrr's fastest (above 1: brrr ahead), or None."""
    ours, peer = best(record, True, clock), best(record, False, clock)
    return peer / ours if ours and peer else None


def disagrees(record):
    err = record["brrr_fwd_rel_err"]
    return err is not None and not err <= TOL[record["dtype"]]


def cell_text(c, width=None):
    if c is None:
        return "-"
    if "error" in c:
        text = "error: " + c["error"]
        return text if width is None else text[:width]
    return " · ".join(f"{c[k + '_ms']:.4f} ({c[k + '_pct']:.0f}%)" if c.get(k + "_ms") else "-"
                      for k in ("device", "wall")) + (" DEVICE > WALL" if c.get("device_over_wall") else "")


def ratio_text(record):
    rs = [ratio(record, clock) for clock in ("device", "wall")]
    return " · ".join(f"{r:.2f}x" if r else "-" for r in rs)


def console_line(record, labels):
    cells = [f"{record['op']:16s} {record['dtype']:4s} {record['size']:6d} {record['pass_']:7s} "
             f"floor {record['floor_ms']:8.4f}"]
    cells += [f"{lab} {cell_text(record['cells'].get(lab), 70)}" for lab in labels if lab in record["cells"]]
    cells.append(f"peer/brrr {ratio_text(record)}")
    if disagrees(record):
        cells.append(f"BRRR DISAGREES WITH EAGER (relative error {record['brrr_fwd_rel_err']:.1e})")
    return " | ".join(cells)


def markdown(records, header):
    """One table per section and dtype: every implementation's device and wall time with its % of
    the floor, and the fastest peer over brrr by both clocks."""
    out = [header, "",
           "Each cell: device ms (% of floor) · wall ms (% of floor). Device: the GPU's kernels, copies and "
           "fills of a call (torch.profiler); wall: CUDA events around a call, median. Last column: the "
           "fastest peer's time over brrr's (above 1: brrr faster), device · wall. DEVICE > WALL marks a cell "
           "whose device time exceeds its wall time by over 10%, which only a miscount gives.", ""]
    groups = {}
    for r in records:
        groups.setdefault((r["section"], r["dtype"]), []).append(r)
    for (section, dname), group in groups.items():
        labels = labels_of(group)
        out += [f"## {section}, {dname}, {group[0]['rows']} rows", "",
                "| op | size | pass | floor ms | " + " | ".join(labels) + " | peer / brrr |",
                "| --- | --- | --- | --- | " + " | ".join("---" for _ in labels) + " | --- |"]
        for r in group:
            cells = [cell_text(r["cells"].get(lab), 90).replace("|", "/") for lab in labels]
            note = " **brrr disagrees with eager**" if disagrees(r) else ""
            out.append(f"| {r['op']}{note} | {r['size']} | {r['pass_']} | {r['floor_ms']:.4f} | "
                       + " | ".join(cells) + f" | {ratio_text(r)} |")
        out.append("")
    return "\n".join(out)


# ---- main -----------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write floor.txt and floor.json into this folder")
    p.add_argument("--only", type=lambda s: s.split(","), default=list(SECTIONS),
                   help="sections, comma-separated: " + ",".join(SECTIONS))
    p.add_argument("--ops", type=lambda s: s.split(","), help="only these ops of the sections, comma-separated")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--hidden", type=ints, help="default: " + ",".join(map(str, HIDDEN)))
    p.add_argument("--cols", type=ints, help="softmax columns; default: " + ",".join(map(str, SOFTMAX_COLS)))
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["bf16", "fp32"])
    p.add_argument("--rows", type=int)
    p.add_argument("--head-dim", type=int, default=HEAD_DIM)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (64 rows, hidden 64 and 96, 128 and 200 columns, "
                   "head_dim 32): the code paths, not the numbers")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                   help="processes sharing the rows (1: this one alone)")
    p.add_argument("--variant", help="NAME=a,b: time brrr with the environment variable NAME at each value")
    for hidden_arg in ("--part", "--index", "--count", "--sync", "--gbps"):  # a worker's (run_workers)
        p.add_argument(hidden_arg, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = ([s for s in args.only if s not in SECTIONS] + [d for d in args.dtypes if d not in DTYPES]
           + [op for op in args.ops or [] if not any(op in ops for ops in SECTIONS.values())])
    if bad:
        p.error(f"unknown sections, dtypes or ops: {bad}")
    smoke = args.smoke
    SETTINGS.update(rows=args.rows or (64 if smoke else 16384), device=args.device,
                    head_dim=32 if smoke and args.head_dim == HEAD_DIM else args.head_dim)
    variant = None
    if args.variant:
        name, _, values = args.variant.partition("=")
        variant = (name, values.split(","))
    with_compile = not args.no_compile
    if args.part:
        return worker([tuple(r) for r in json.loads(args.part)], int(args.index), int(args.count), args.sync,
                      with_compile, float(args.gbps), variant)
    hidden = args.hidden or ([64, 96] if smoke else HIDDEN)
    cols = args.cols or ([128, 200] if smoke else SOFTMAX_COLS)
    t0 = time.perf_counter()
    todo = rows(args.only, hidden, cols, args.dtypes, args.ops)
    where = torch.cuda.get_device_name() if cuda() else "CPU"
    header = (f"# {where}, torch {torch.__version__}, brrr {brrr.__version__}"
              + (", smoke run (tiny sizes)" if smoke else ""))
    print(header, flush=True)
    dev_gbps, wall_gbps = copy_gbps()
    gbps = max(dev_gbps, wall_gbps)
    if cuda():
        torch.cuda.empty_cache()  # the copy's buffers, before the workers start
    copy_line = (f"copy bandwidth (read + written): {dev_gbps:.0f} GB/s by device time, {wall_gbps:.0f} GB/s by "
                 f"CUDA events; the floor takes {gbps:.0f} GB/s")
    print("# " + copy_line, flush=True)
    if cuda() and not 0.9 < dev_gbps / wall_gbps < 1.1:
        print("# DEVICE TIME AND CUDA EVENTS DISAGREE ON THE COPY: the device-time sum is suspect", flush=True)
    if args.workers > 1 and with_compile:
        records, prepare_s, recompiled = run_workers(todo, args.workers, with_compile, gbps, variant,
                                                     list(argv if argv is not None else sys.argv[1:]))
    else:
        t1 = time.perf_counter()
        prepare(todo, with_compile)
        prepare_s = time.perf_counter() - t1
        frames = frames_compiled()
        records = measure_rows(todo, with_compile, gbps, variant)
        recompiled = frames_compiled() - frames
    sections_s = {s: sum(r.get("measure_s", 0.0) for r in records if r["section"] == s) for s in args.only}
    footer = [f"preparing (torch.compile, Liger's first calls) {prepare_s:.0f} s"
              + (f" in the slowest of {min(args.workers, len(todo))} workers" if args.workers > 1 and with_compile else ""),
              "timing: " + ", ".join(f"{s} {t:.0f} s" for s, t in sections_s.items())
              + f" (frames compiled while timing: {recompiled})",
              f"{len(records)} rows in {time.perf_counter() - t0:.0f} s"]
    for line in footer:
        print("# " + line, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "floor.txt"), "w") as f:
            f.write(markdown(records, header + "\n\n" + copy_line + "; " + "; ".join(footer) + "."))
        with open(os.path.join(args.out, "floor.json"), "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "brrr": brrr.__version__, "smoke": smoke,
                       "copy_GBps": {"device": dev_gbps, "wall": wall_gbps, "floor": gbps},
                       "prepare_s": prepare_s, "sections_s": sections_s, "frames_compiled_while_timing": recompiled,
                       "rows": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
