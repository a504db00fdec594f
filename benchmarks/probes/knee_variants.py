"""The repeat sweep's knee (x * 1.0001 applied r times, 2^28 elements, forward) in every variant that
could separate brrr's compiled chain from torch.compile's kernel there, in one process:

    python3 benchmarks/probes/knee_variants.py --out knee-variants.json

Configurations: 64 and 32 float32 multiplies, 64 bfloat16 ones. Rows of each:

- compile: torch.compile (static shapes), inductor's kernel through its own launcher and output;
- brrr, brrr[exact]: brrr.chain, its output from PyTorch's allocator, by default and with
  BRRR_CHAIN_JIT_BOUNDS=exact (no bounds tests where the blocks are full: docs/kernel-switches.md);
- brrr out=P, brrr[exact] out=P, triton out=P: the output given, at placement P: `fresh`
  (torch.empty_like(x)), or a slice of one larger buffer at 0, 4 KiB, 1 MiB or half the L2 past its
  start; triton is inductor's kernel for the chain written out (XBLOCK 1024, 4 warps, no mask)
  and launched by Triton;
- brrr driver, brrr[exact] driver: brrr's own cubin for the chain (_C.chain_jit_compile, the
  program a launch runs) loaded with cuModuleLoadData and launched with cuLaunchKernel, as
  Triton launches, on a fresh output of its own: the launch path without the runtime's library API.

Each row: the median of 30 calls between CUDA events after 5 warm-up calls (benchmarks/harness.py
time_ms), the device time of 10 calls under torch.profiler (harness.device_ms), the ratio to
compile's events time (above 1: faster than compile), where the output lies against the input
(out - x, bytes) and its check: brrr's and the driver's against brrr's default bits, compile's
and triton's against float64 (relative error of the first 2^22 values); a row whose check or
compile fails is reported and not timed. Prints a table a configuration and writes every row to
--out (JSON). Needs a CUDA GPU; about 30-50 s on an H200, most of it torch.compile and Triton
compiling (--no-compile leaves torch.compile out).
"""

import argparse
import ctypes
import json
import os
import re
import struct
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/brrr-knee-variants-inductor")
os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/brrr-knee-variants-triton")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the source tree's brrr
sys.path.insert(0, os.path.join(HERE, ".."))  # harness

import torch  # noqa: E402

import brrr  # noqa: E402
import harness  # noqa: E402

N = 1 << 28
C = 1.0001
CONFIGS = [(64, torch.float32), (32, torch.float32), (64, torch.bfloat16)]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
SWITCH = "BRRR_CHAIN_JIT_BOUNDS"


def set_switch(value):
    """BRRR_CHAIN_JIT_BOUNDS set to value (None: unset)."""
    if value is None:
        os.environ.pop(SWITCH, None)
    else:
        os.environ[SWITCH] = value


def with_switch(value, fn):
    """fn with BRRR_CHAIN_JIT_BOUNDS set to value at every call: brrr reads it at every launch, so
    the timed calls and the profiled ones run the same kernel."""
    def run():
        set_switch(value)
        return fn()
    return run


def placements(x):
    """name -> an output for x: a fresh tensor, and slices of one larger buffer at offsets."""
    nbytes = x.numel() * x.element_size()
    half_l2 = torch.cuda.get_device_properties(x.device).L2_cache_size // 2 // 4096 * 4096
    offsets = {"buf+0": 0, "buf+4K": 4096, "buf+1M": 1 << 20, f"buf+L2/2({half_l2 >> 20}M)": half_l2}
    buf = torch.empty(nbytes + max(offsets.values()), dtype=torch.uint8, device=x.device)
    outs = {"fresh": torch.empty_like(x)}
    for name, off in offsets.items():
        outs[name] = buf[off:off + nbytes].view(x.dtype)
    return outs


def triton_kernel(repeats):
    """Inductor's pointwise kernel for x * 1.0001 `repeats` times (static size, no mask), or None
    with the reason when Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        return None, str(e)

    @triton.jit
    def triton_poi_fused_mul_0(in_ptr0, out_ptr0, XBLOCK: tl.constexpr, R: tl.constexpr):
        xoffset = tl.program_id(0) * XBLOCK
        xindex = xoffset + tl.arange(0, XBLOCK)[:]
        t = tl.load(in_ptr0 + xindex, None).to(tl.float32)
        for _ in tl.static_range(R):
            t = t * 1.0001
        tl.store(out_ptr0 + xindex, t.to(out_ptr0.dtype.element_ty), None)

    def launch(x, out):
        triton_poi_fused_mul_0[(x.numel() // 1024,)](x, out, XBLOCK=1024, R=repeats, num_warps=4)
        return out
    return launch, None


class Driver:
    """brrr's cubins loaded and launched through the CUDA driver API (ctypes), as Triton does."""

    def __init__(self):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        p, u = ctypes.c_void_p, ctypes.c_uint
        self.cuda.cuLaunchKernel.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
        self.modules = []

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA driver error {rc}")

    def kernel(self, cubin, source):
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        image = ctypes.create_string_buffer(cubin, len(cubin))
        self.check(self.cuda.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        self.modules.append((module, image))
        self.check(self.cuda.cuModuleGetFunction(ctypes.byref(function), module, b"brrr_chain_fwd"), "cuModuleGetFunction")
        packs, threads = map(int, re.search(r"constexpr int U = (\d+), N = VEC \* U, THREADS = (\d+);", source).groups())
        return function, packs, threads

    def launcher(self, kernel, x, out):
        function, packs, threads = kernel
        vec = 16 // x.element_size()
        per_block = threads * packs * vec
        assert x.numel() % per_block == 0
        # brrr_chain_flat (cuda/brrr_cuda.h): x, out, grad_out, operands[4], grad_operands[4], numel, row_length
        param = ctypes.create_string_buffer(struct.pack("<11Qqq", x.data_ptr(), out.data_ptr(), *[0] * 9, x.numel(), 0))
        args = (ctypes.c_void_p * 1)(ctypes.addressof(param))
        grid = x.numel() // per_block

        def launch():
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            self.check(self.cuda.cuLaunchKernel(function, grid, 1, 1, threads, 1, 1, 0, stream, args, None), "cuLaunchKernel")
            return out
        launch.keep = (param, args)
        return launch


def rel_err(got, want):
    return float((got.double() - want).norm() / want.norm())


def measure(repeats, dtype, use_compile, driver, log):
    x = torch.randn(N, device="cuda", dtype=dtype)
    chain = brrr.chain(*[("mul", C)] * repeats)
    rows = {}  # name -> (fn, output it writes)

    def add(name, fn, out=None):
        rows[name] = (fn, out)

    if use_compile:
        def eager(t):
            for _ in range(repeats):
                t = t * C
            return t
        comp = harness.compiled(eager)
        add("compile", lambda: comp(x))
    add("brrr", with_switch(None, lambda: chain(x)))
    add("brrr[exact]", with_switch("exact", lambda: chain(x)))
    outs = placements(x)
    for place, out in outs.items():
        add(f"brrr out={place}", with_switch(None, lambda out=out: chain(x, out=out)), out)
        add(f"brrr[exact] out={place}", with_switch("exact", lambda out=out: chain(x, out=out)), out)
    tri, why = triton_kernel(repeats)
    if tri is not None:
        for place, out in outs.items():
            add(f"triton out={place}", lambda out=out: tri(x, out), out)
    else:
        log(f"  triton rows left out: {why}")
    if driver is not None:
        arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1]
        for name, value in (("brrr driver", None), ("brrr[exact] driver", "exact")):
            set_switch(value)
            source, cubin, _ = brrr._C.chain_jit_compile([("mul", C)] * repeats, str(dtype).split(".")[-1], arch=arch,
                                                         index32=True, full_blocks=True)
            out = torch.empty_like(x)
            add(name, driver.launcher(driver.kernel(cubin, source), x, out), out)
    set_switch(None)

    # Warm (compiles) and check each row's output as it is written (rows share the placed outputs).
    # A row that fails is reported and left out of the timing; the others go on.
    head = slice(0, 1 << 22)
    want = x[head].double() * C ** repeats
    base = chain(x)
    checks = {}
    for name, (fn, _) in rows.items():
        try:
            got = fn()
            if name.startswith("brrr"):
                checks[name] = "bits" if torch.equal(got, base) else "NOT brrr's default bits"
            else:
                err = rel_err(got[head], want)
                checks[name] = f"{err:.1e}" if err < TOL[dtype] else f"FAILED: {err:.1e} from float64"
            del got
        except Exception as e:  # noqa: BLE001 - a peer's compile error, a driver error: reported
            checks[name] = f"FAILED: {type(e).__name__}: {e}"
    checks["brrr"] += f", {rel_err(base[head], want):.1e}"
    del base
    failed = {name: c for name, c in checks.items() if c.startswith("FAILED")}
    for name, c in failed.items():
        log(f"  {name}: {c}")
        del rows[name]
    # Where each output lies while timed: a call's own output is freed before the next call, which
    # PyTorch's allocator then gives the same block.
    ptr = {name: (out if out is not None else fn()).data_ptr() for name, (fn, out) in rows.items()}

    table = []
    for name, (fn, _) in rows.items():
        ms = harness.time_ms(fn, warmup=5, reps=30, max_time_s=1.0)
        table.append(dict(variant=name, ms=ms, out_minus_x=ptr[name] - x.data_ptr(), check=checks[name]))
    dev = harness.device_ms([(name, fn, 10) for name, (fn, _) in rows.items()])
    ref = next((r["ms"] for r in table if r["variant"] == "compile"), None)
    for r in table:
        r["device_ms"] = dev[r["variant"]]
        r["compile_over_this"] = ref / r["ms"] if ref else None
    table += [dict(variant=name, check=c) for name, c in failed.items()]
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for every row")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("knee_variants: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if not brrr.build_info()["cuda_compiled"]:
        print("knee_variants: needs brrr built with CUDA", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        driver = Driver()
    except OSError as e:
        print(f"brrr driver rows left out: {e}")
        driver = None
    report = dict(environment=harness.environment(), n=N, c=C, configs=[])
    for repeats, dtype in CONFIGS:
        t0 = time.perf_counter()
        print(f"\n## x * {C} {repeats} times, {str(dtype).split('.')[-1]}, {N} elements")
        table = measure(repeats, dtype, not args.no_compile, driver, print)
        print("| variant | events ms | device ms | compile / this | out - x (MiB) | check |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in table:
            if "ms" not in r:
                print(f"| {r['variant']} | - | - | - | - | {r['check']} |")
                continue
            ratio = f"{r['compile_over_this']:.3f}" if r["compile_over_this"] else "-"
            print(f"| {r['variant']} | {r['ms']:.4f} | {r['device_ms']:.4f} | {ratio} | {r['out_minus_x'] / 2**20:.3f} "
                  f"| {r['check']} |")
        print(f"({time.perf_counter() - t0:.1f} s)")
        report["configs"].append(dict(repeats=repeats, dtype=str(dtype).split(".")[-1], rows=table))
        torch.cuda.empty_cache()
    report["seconds"] = time.perf_counter() - started
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{report['seconds']:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
