"""Where a small Llama's training step spends its time: eager brrr.patch, brrr.capture_step's
replay and torch.compile(mode="reduce-overhead"), kernel by kernel, in one run of under 180 s:

    PYTHONPATH=. python3 benchmarks/probes/graph_probe.py --out DIR
    PYTHONPATH=. python3 benchmarks/probes/graph_probe.py --out DIR --device cpu --smoke   # the code paths

The model and its steps are benchmarks/test_bench_graphs.py's: its Llama (2 layers, hidden 1024,
MLP 2816, 16 heads, vocabulary 32000, bfloat16, dropout off), at batch 2 and 32 of 512 tokens
(--batches). Parts, in
this order, each in a try/except of its own (a failure prints its error and the run goes on):

  step        per batch: eager brrr.patch, capture_step of the patched model (its loss checked
              against the eager step's), capture_step of the unpatched model. For each: ms per
              step (CUDA events, median), wall per step (back-to-back steps, perf_counter), GPU
              busy per step (the union of its kernels, copies and fills), device work items and
              host launch calls per step, the top kernels by total device time.
  overhead    per batch: the wall of one capture_step call against that of its graph's bare
              replay (both synchronised), i.e. what capture_step adds per step.
  sdpa        eager brrr.patch with scaled_dot_product_attention forced to one backend (cudnn,
              flash, efficient) at each batch: ms per step and the attention kernels' device time.
  cudnn       whether cuDNN attention's backward captures today: SDPA alone (fwd+bwd in a graph);
              then the patched step captured without cuDNN attention (capture_step's fallback,
              forced), its loss against eager's and its timing, against the step part's (which
              captures with SDPA's default backends, cuDNN first).
  compile     torch.compile(mode="reduce-overhead") of the unpatched model at batch 2, in a
              subprocess given the time left (a compile that overruns is cut off, not the run).

The budget (--budget, seconds) is checked before each part; a part that would start too late is
skipped with a line saying so. Every line goes to DIR/graph_probe.txt as it is written (an early
end leaves what was measured), and DIR/graph_probe.json holds the measured numbers.
"""

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/brrr-graph-probe-inductor")
os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/brrr-graph-probe-triton")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the source tree's brrr
sys.path.insert(0, os.path.join(HERE, ".."))  # harness

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import brrr  # noqa: E402
import brrr.graphs  # noqa: E402
import harness  # noqa: E402
from test_bench_graphs import eager_step, loss_fn_of, without_dropout  # noqa: E402
from test_bench_graphs import llama as llama_of  # noqa: E402

FULL = dict(seq=512, vocab=32000, width=1024, heads=16, dtype=torch.bfloat16)
SMOKE = dict(seq=32, vocab=256, width=64, heads=4, dtype=torch.float32)
TOP = 25
PROFILED_STEPS = 5
# Kernel-name fragments of each SDPA backend's kernels (and the math backend's softmax), to sum
# the attention's device time and see which backend ran.
ATTENTION_NAMES = ("fmha", "flash", "attention", "sdpa", "cudnn", "mha", "efficient")
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


class Report:
    """Lines printed and appended to DIR/graph_probe.txt at once; numbers kept for the JSON."""

    def __init__(self, out, name="graph_probe"):
        os.makedirs(out, exist_ok=True)
        self.txt = os.path.join(out, name + ".txt")
        self.json = os.path.join(out, name + ".json")
        self.numbers = {}
        open(self.txt, "w").close()

    def line(self, text=""):
        print(text, flush=True)
        with open(self.txt, "a") as f:
            f.write(text + "\n")

    def record(self, key, value):
        self.numbers[key] = value
        with open(self.json, "w") as f:
            json.dump(self.numbers, f, indent=1, default=str)

    @contextlib.contextmanager
    def part(self, title, deadline, needs_s):
        """A part run in its own try/except, skipped when fewer than needs_s seconds are left."""
        left = deadline - time.perf_counter()
        self.line(f"\n=== {title}   ({left:.0f} s of budget left)")
        if left < needs_s:
            self.line(f"SKIPPED: needs about {needs_s:.0f} s")
            yield False
            return
        started = time.perf_counter()
        try:
            yield True
        except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
            self.line(f"FAILED: {error_text(e)}")
            self.line("".join(traceback.format_exception(e)[-6:]).rstrip())
        finally:
            self.line(f"--- {title}: {time.perf_counter() - started:.1f} s")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def error_text(e):
    return f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"


# ---- the model and its steps --------------------------------------------------------------------


def llama(cfg, device):
    """benchmarks/test_bench_graphs.py's Llama at the probe's sizes (--smoke: tiny)."""
    torch.manual_seed(0)
    model = llama_of(seq=cfg["seq"], vocab=cfg["vocab"], width=cfg["width"], heads=cfg["heads"])
    return without_dropout(model.to(device, cfg["dtype"]).train())


def captured(model, tokens):
    """(step, capture_step object): capture_step of the model's step, warmed up and captured."""
    capture = brrr.capture_step(loss_fn_of(model), model)
    for _ in range(brrr.graphs.DEFAULT_WARMUP + 1):
        capture(tokens)
    return (lambda: capture(tokens)), capture


def rel_loss_err(loss, expected):
    return abs(float(loss) - expected) / max(abs(expected), 1e-30)


# ---- measuring ----------------------------------------------------------------------------------


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def wall_ms(step, device, steps=20):
    """Wall milliseconds per step of back-to-back steps, one synchronize at the end."""
    step()
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - started) * 1e3 / steps


def synced_wall_ms(fn, device, calls=20):
    """Median wall milliseconds of fn() followed by a synchronize (no overlap of host and GPU)."""
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def host_launch(name):
    """A CUDA runtime or driver call that puts work on the GPU."""
    return name.startswith("cu") and any(k in name for k in ("Launch", "Memcpy", "Memset"))


def profile_steps(step, device, steps=PROFILED_STEPS):
    """Per step: the device work's busy ms and item count, the host's launch calls, the profiled
    window's wall ms, and [(kernel name, count per step, total us per step)] by total time."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device == "cuda"
    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        window_ms = (time.perf_counter() - started) * 1e3
    events = prof.profiler.kineto_results.events()
    work = harness.device_activities(events, DeviceType.CUDA if gpu else DeviceType.CPU)
    by_name = {}
    for e in work:
        count, total = by_name.get(e.name(), (0, 0))
        by_name[e.name()] = (count + 1, total + (e.end_ns() - e.start_ns()))
    kernels = sorted(((name, count / steps, ns / 1e3 / steps) for name, (count, ns) in by_name.items()),
                     key=lambda k: -k[2])
    launches = sum(1 for e in events if e.device_type() == DeviceType.CPU and host_launch(e.name()))
    return dict(busy_ms=harness.busy_ms([(e.start_ns(), e.end_ns()) for e in work]) / steps,
                work_items=len(work) / steps, host_launches=launches / steps,
                profiled_wall_ms=window_ms / steps, kernels=kernels)


def attention_us(kernels):
    return sum(us for name, _, us in kernels if any(k in name.lower() for k in ATTENTION_NAMES))


def measure(report, key, step, device, top=TOP):
    """Time and profile step(); print the summary and its top kernels."""
    ms = harness.time_ms(step, warmup=3, reps=15, max_time_s=0.5)
    wall = wall_ms(step, device)
    prof = profile_steps(step, device)
    report.line(f"{key}: {ms:.3f} ms/step (events, median); wall {wall:.3f} ms/step back to back; "
                f"GPU busy {prof['busy_ms']:.3f} ms/step = {100 * prof['busy_ms'] / wall:.0f}% of wall; "
                f"{prof['work_items']:.0f} device work items and {prof['host_launches']:.0f} host launch calls "
                f"per step; profiled wall {prof['profiled_wall_ms']:.3f} ms/step; attention kernels "
                f"{attention_us(prof['kernels']):.0f} us/step")
    kernels(report, prof["kernels"], top)
    report.record(key, dict(ms=ms, wall_ms=wall, **{k: v for k, v in prof.items() if k != "kernels"},
                            attention_us=attention_us(prof["kernels"]), kernels=prof["kernels"]))
    return ms


def kernels(report, table, top):
    total = sum(us for _, _, us in table)
    report.line(f"  {'total us':>10s} {'share':>6s} {'count':>7s}  kernel (per step; {len(table)} names, "
                f"{total:.0f} us in all)")
    for name, count, us in table[:top]:
        report.line(f"  {us:10.1f} {100 * us / max(total, 1e-9):5.1f}% {count:7.1f}  {name[:150]}")


def differences(report, a, b, top=15):
    """The kernels whose device time per step differs most between measured keys a and b."""
    if a not in report.numbers or b not in report.numbers:
        return
    tables = [{name: (count, us) for name, count, us in report.numbers[key]["kernels"]} for key in (a, b)]
    rows = [(name, *tables[0].get(name, (0, 0)), *tables[1].get(name, (0, 0)))
            for name in set(tables[0]) | set(tables[1])]
    rows.sort(key=lambda r: -abs(r[4] - r[2]))
    report.line(f"  kernels differing most, {b} against {a} (per step: count and us in each, difference in us):")
    for name, count_a, us_a, count_b, us_b in rows[:top]:
        report.line(f"  {count_a:6.1f} {us_a:9.1f}  {count_b:6.1f} {us_b:9.1f}  {us_b - us_a:+9.1f}  {name[:140]}")


# ---- the parts ----------------------------------------------------------------------------------


def environment(report, args, cfg):
    import transformers

    report.line(f"torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}")
    if args.device == "cuda":
        report.line(f"GPU {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, "
                    f"cuDNN {torch.backends.cudnn.version()}")
        order = [SDPBackend(b).name for b in torch._C._get_sdp_priority_order()]
        report.line(f"SDPA backend priority: {order}; enabled: flash {torch.backends.cuda.flash_sdp_enabled()}, "
                    f"efficient {torch.backends.cuda.mem_efficient_sdp_enabled()}, "
                    f"cudnn {torch.backends.cuda.cudnn_sdp_enabled()}, math {torch.backends.cuda.math_sdp_enabled()}")
    try:
        commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - a copy of the tree without git
        commit = "?"
    report.line(f"brrr at {commit}; model: Llama 2 layers, {cfg}; batches {args.batches} x {cfg['seq']}")


def steps_part(report, models, batch, tokens, device, deadline):
    """Eager patched, captured patched, eager and captured unpatched at one batch."""
    base, patched = models["base"], models["patched"]
    with report.part(f"batch {batch}: eager brrr.patch", deadline, 5) as go:
        if go:
            measure(report, f"b{batch} eager brrr", eager_step(patched, tokens), device)
    with report.part(f"batch {batch}: brrr captured (capture_step of the patched model)", deadline, 8) as go:
        if go:
            expected = eager_step(patched, tokens)().item()
            step, capture = captured(models["patched_for_capture"], tokens)
            err = rel_loss_err(step().item(), expected)
            report.line(f"graphs {capture.graphs}; loss relative error against eager {err:.2e}")
            measure(report, f"b{batch} brrr captured", step, device)
            differences(report, f"b{batch} eager brrr", f"b{batch} brrr captured")
            with report.part(f"batch {batch}: what capture_step adds to a replay", deadline, 3) as go2:
                if go2 and not capture.graphs:
                    report.line("(no graph captured: capture_step ran eagerly)")
                elif go2:
                    graph = next(e.graph for e in capture._entries.values() if e.graph is not None)
                    replay, call = synced_wall_ms(graph.replay, device), synced_wall_ms(step, device)
                    report.line(f"wall per synchronised call: bare graph.replay() {replay:.3f} ms, capture_step "
                                f"call {call:.3f} ms (adds {1e3 * (call - replay):.0f} us)")
                    report.record(f"b{batch} capture_step overhead", dict(replay_ms=replay, call_ms=call))
            del step, capture
    with report.part(f"batch {batch}: eager unpatched", deadline, 5) as go:
        if go:
            measure(report, f"b{batch} eager unpatched", eager_step(base, tokens), device, top=10)
    # Its own model: the eager steps' losses just measured keep autograd graphs of base, made on the
    # default stream, alive (docs/graphs.md).
    with report.part(f"batch {batch}: captured unpatched", deadline, 8) as go:
        if go:
            step, capture = captured(models["base_for_capture"], tokens)
            measure(report, f"b{batch} captured unpatched", step, device, top=10)
            differences(report, f"b{batch} eager unpatched", f"b{batch} captured unpatched", top=10)
            del step, capture


def sdpa_part(report, model, batches, device, cfg, deadline):
    for batch in batches:
        tokens = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), device=device)
        for name, backend in BACKENDS.items():
            with report.part(f"batch {batch}: eager brrr.patch, SDPA forced to {name}", deadline, 4) as go:
                if go:
                    step = eager_step(model, tokens)

                    def forced(step=step, backend=backend):
                        with sdpa_kernel([backend]):
                            return step()
                    measure(report, f"b{batch} eager brrr sdpa={name}", forced, device, top=8)


def cudnn_part(report, models, batches, device, cfg, deadline):
    """Does cuDNN attention's backward capture? SDPA alone, then the whole patched step."""
    with report.part("cuDNN SDPA fwd+bwd alone in a CUDA graph", deadline, 3) as go:
        if go and device != "cuda":
            report.line("(no CUDA)")
        elif go:
            b, h, s, d = batches[0], cfg["heads"], cfg["seq"], cfg["width"] // cfg["heads"]
            q, k, v = (torch.randn(b, h, s, d, device=device, dtype=cfg["dtype"], requires_grad=True)
                       for _ in range(3))
            grad = torch.randn(b, h, s, d, device=device, dtype=cfg["dtype"])

            def fwd_bwd():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                return torch.autograd.grad(out, (q, k, v), grad)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    eager_grads = fwd_bwd()
            torch.cuda.current_stream().wait_stream(stream)
            try:
                graph, grads = brrr.graphs.capture(fwd_bwd, stream=stream)
                graph.replay()
                torch.cuda.synchronize()
                err = max(((g.float() - e.float()).norm() / e.float().norm()).item()
                          for g, e in zip(grads, eager_grads))
                report.line(f"CAPTURES: replayed, gradients' relative difference from eager {err:.2e}")
            except Exception as e:  # noqa: BLE001 - the answer sought
                report.line(f"DOES NOT CAPTURE: {error_text(e)}")
                if e.__cause__ is not None:
                    report.line(f"  cause: {error_text(e.__cause__)}")
    for batch in batches:
        with report.part(f"batch {batch}: capture_step of the patched model without cuDNN attention (its fallback)",
                         deadline, 8) as go:
            if go:
                tokens = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), device=device)
                expected = eager_step(models["patched"], tokens)().item()
                kept = brrr.graphs._attention_backends
                brrr.graphs._attention_backends = lambda cudnn: kept(False)
                try:
                    step, capture = captured(models["patched_for_capture"], tokens)
                    err = rel_loss_err(step().item(), expected)
                    report.line(f"graphs {capture.graphs}; loss relative error against eager {err:.2e}")
                    measure(report, f"b{batch} brrr captured without cudnn", step, device, top=10)
                finally:
                    brrr.graphs._attention_backends = kept
                del step, capture


def compile_part(report, args, cfg):
    """torch.compile(mode="reduce-overhead") of the unpatched model, at each batch given."""
    model = llama(cfg, args.device)
    compiled = torch.compile(loss_fn_of(model), mode="reduce-overhead")
    for batch in args.batches:
        tokens = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), device=args.device)

        def step():
            model.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
            loss = compiled(tokens)
            loss.backward()
            return loss
        started = time.perf_counter()
        for _ in range(3):
            step()
        sync(args.device)
        report.line(f"batch {batch}: first three steps (compiling, recording) {time.perf_counter() - started:.1f} s")
        measure(report, f"b{batch} compile reduce-overhead", step, args.device)


def compile_in_subprocess(report, args, deadline):
    left = deadline - time.perf_counter()
    command = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--device", args.device,
               "--batches", ",".join(map(str, args.compile_batches)), "--only-compile"]
    if args.smoke:
        command.append("--smoke")
    # Its output goes to a file, not a pipe: inductor's compile workers, its children, could hold a
    # pipe open past its end. A session of its own, so that a cut-off ends them with it.
    with open(os.path.join(args.out, "compile.log"), "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=left)
            if code:
                report.line(f"compile subprocess exited {code}: see compile.log")
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            report.line(f"compile subprocess cut off after {left:.0f} s (the budget); compile.log has its output")
    path = os.path.join(args.out, "compile.txt")
    if os.path.exists(path):
        with open(path) as f:
            for text in f.read().splitlines():
                report.line(text)


# ---- main ---------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, float32: the code paths only")
    parser.add_argument("--batches", default="2,32", help="batches of --seq tokens (default 2,32)")
    parser.add_argument("--compile-batches", default="2")
    parser.add_argument("--budget", type=float, default=160.0, help="seconds for the whole run")
    parser.add_argument("--skip", default="", help="parts to leave out: step,sdpa,cudnn,compile")
    parser.add_argument("--only-compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.compile_batches = [int(b) for b in args.compile_batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    cfg = SMOKE if args.smoke else FULL
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --smoke)")

    if args.only_compile:
        report = Report(args.out, "compile")
        try:
            compile_part(report, args, cfg)
        except Exception as e:  # noqa: BLE001 - reported to the parent through compile.txt
            report.line(f"FAILED: {error_text(e)}")
        return

    deadline = time.perf_counter() + args.budget
    report = Report(args.out)
    with report.part("environment", deadline, 0):
        environment(report, args, cfg)
    models = {}
    with report.part("models", deadline, 0):
        models["base"] = llama(cfg, args.device)
        models["patched"] = llama(cfg, args.device)
        report.line(f"brrr.patch: {brrr.patch(models['patched'])}")
        report.line(f"attention implementation: {models['base'].config._attn_implementation}")
        # capture_step's models are their own: an eager step's autograd graph still alive (made on
        # the default stream) would join the capture's backward to the legacy stream (docs/graphs.md).
        models["patched_for_capture"] = llama(cfg, args.device)
        brrr.patch(models["patched_for_capture"])
        models["base_for_capture"] = llama(cfg, args.device)
    if "step" not in skip:
        for batch in args.batches:
            tokens = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), device=args.device)
            steps_part(report, models, batch, tokens, args.device, deadline)
    if "sdpa" not in skip:
        sdpa_part(report, models["patched"], args.batches[::-1], args.device, cfg, deadline)
    if "cudnn" not in skip:
        cudnn_part(report, models, args.batches, args.device, cfg, deadline)
    if "compile" not in skip:
        with report.part("torch.compile reduce-overhead (subprocess)", deadline, 20) as go:
            if go:
                models.clear()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                compile_in_subprocess(report, args, deadline)
    report.line(f"\ndone in {args.budget - (deadline - time.perf_counter()):.1f} s")


if __name__ == "__main__":
    main()
