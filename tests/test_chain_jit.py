"""Chains compiled for their exact steps (csrc/chain_jit.c): the generated CUDA source compiled by
NVRTC for many chains (no GPU needed), the disk cache across processes, and on CUDA the compiled
kernels against the interpreted ones."""

import os
import random as pyrandom
import re
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

import brrr
from brrr import _C
from helpers import assert_close, random
from test_chain_ops import _operands, away_from_kinks, random_long_chain, reference, reference_grads

HAVE_NVRTC = _C.chain_jit_info()["nvrtc"] is not None
# CI installs NVRTC (requirements-test.txt) so that generated code that does not compile fails there.
needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC and not os.environ.get("CI"),
                                 reason=f"NVRTC not found ({_C.chain_jit_info()['nvrtc_error']})")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("BRRR_CACHE_DIR", str(folder))
    return folder


def compile_in_subprocess(steps, cache, dtype="float32", env=None):
    """Start a process that compiles `steps` through the cache folder; returns it (running)."""
    code = f"from brrr import _C; print(_C.chain_jit_compile({steps!r}, {dtype!r})[2])"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "BRRR_CACHE_DIR": str(cache), **(env or {})})


def finish(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return out.strip()


MIXED = ["gelu", "add_tensor", "silu", ("mul", 2.0), "tanh", "exp", "sin", ("add", 1.0), "mul_tensor", "sigmoid",
         "log1p", ("pow", 3.0)]


@needs_nvrtc
@pytest.mark.parametrize("seed", range(6))
def test_generated_sources_compile(cache_dir, seed):
    """Random chains of every op, each dtype, layout and direction, compiled to sm_90 cubins."""
    rng = pyrandom.Random(seed)
    steps = random_long_chain(rng, rng.randint(1, 64))
    n = sum(s in ("add_tensor", "mul_tensor") for s in steps)
    vector = rng.randrange(1 << n) if n else 0
    dtype = ["float32", "float16", "bfloat16", "float64"][seed % 4]
    layouts = [("contiguous", 1), ("strided", 1 + seed % 3)] + ([("rows", 2 + seed % 2)] if vector else [])
    for layout, ndim in layouts:
        for backward in (False, True) if layout != "rows" else (True,):
            grads = rng.randrange(1 << n) if backward and n else 0
            grads = grads | vector if layout == "rows" else grads & ~vector  # bias gradients: the row layout
            source, cubin, origin = _C.chain_jit_compile(steps, dtype, backward=backward, layout=layout, ndim=ndim,
                                                         vector_mask=vector, grad_mask=grads, index32=seed % 2 == 0)
            assert origin == "compiled" and cubin[:4] == b"\x7fELF", (layout, backward)


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_packed_chains_with_operands_compile(cache_dir, dtype):
    """Chains of few heavy steps with a trig step get the pack function: with tensor operands
    (dense and vector), every layout, both directions and every gradient mask."""
    steps = ["add_tensor", "cos", ("mul", 2.0), "mul_tensor", "sin", "relu"]
    for vector in range(4):
        for layout, ndim in [("contiguous", 1), ("strided", 2)] + ([("rows", 2)] if vector else []):
            for backward in (False, True) if layout != "rows" else (True,):
                for grads in range(4) if backward else (0,):
                    grads = grads | vector if layout == "rows" else grads & ~vector
                    source, cubin, _ = _C.chain_jit_compile(steps, dtype, backward=backward, layout=layout, ndim=ndim,
                                                            vector_mask=vector, grad_mask=grads)
                    assert "chain_%s_n" % ("bwd" if backward else "fwd") in source and cubin[:4] == b"\x7fELF"


@needs_nvrtc
def test_the_source_is_specialised(cache_dir):
    source, _, _ = _C.chain_jit_compile([("mul", 1.0001)] * 64, "float32")
    assert source.count("y = y * (A)0x1.00068db8bac71p+0;") == 64  # unrolled, the scalar an immediate
    source, _, _ = _C.chain_jit_compile(MIXED, "bfloat16", backward=True, grad_mask=3, vector_mask=1, layout="rows", ndim=3)
    assert "M::gelu_fwd_grad(y, &d)" in source and "M::pow_fwd_grad(y, (A)0x1.8p+1, &d)" in source
    assert "L.partials" in source and "__shared__" in source
    assert "__noinline__ Grads chain_bwd" in source  # ten elementary functions: one copy, called
    source = _C.chain_jit_compile(["cos", "cos"], "float16")[0]
    assert "__forceinline__ A chain_fwd" in source  # two trig steps: inlined, each on the whole pack
    assert source.count("if (M::pack_in_trig_range(y))") == 2 and source.count("M::cos_fwd_in_range(y[j])") == 2
    assert "M::cos_fwd_grad_in_range(y[j], &d)" in _C.chain_jit_compile(["cos", "cos"], "float32", backward=True)[0]
    source, _, _ = _C.chain_jit_compile(["relu", ("add", float("inf")), ("mul", float("nan"))], "float64")
    assert "__longlong_as_double(0x7ff0000000000000LL)" in source
    # A thread owns 2 packs, 1 where the copies of an inlined chain would hold more than 1024 steps
    # (a rolled run's copy counts its loop's 64: BRRR_CHAIN_JIT_FORM's tests).
    assert "constexpr int U = 2," in _C.chain_jit_compile([("mul", 1.0001)] * 128, "float32")[0]
    assert "constexpr int U = 1," in _C.chain_jit_compile([("mul", 1.0001), ("add", 0.5)] * 65, "float32")[0]
    assert "constexpr int U = 1," in _C.chain_jit_compile([("mul", 1.0001)] * 65, "bfloat16", backward=True)[0]
    heavy = [s for s in MIXED if s not in ("add_tensor", "mul_tensor")] * 20
    assert "constexpr int U = 2," in _C.chain_jit_compile(heavy, "bfloat16")[0]  # called, not inlined


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_a_forward_rolls_runs_of_more_than_64_identical_steps(cache_dir, dtype):
    """Into loops of 64 unrolled steps over all the thread's values; shorter runs, other steps and
    backward kernels (whose constant derivatives fold) stay unrolled."""
    step = "y[j] = y[j] * (A)0x1.00068db8bac71p+0;"
    source = _C.chain_jit_compile([("mul", 1.0001)] * 256, dtype)[0]
    assert source.count("#pragma unroll 1\n    for (int r = 0; r < 4; ++r)") == 1 and source.count(step) == 64
    steps = [("mul", 1.0001)] * 130 + ["relu"] + [("add", 0.5)] * 64 + [("add", 0.25)] * 65 + ["sin"]
    source = _C.chain_jit_compile(steps, dtype)[0]
    assert "for (int r = 0; r < 2; ++r)" in source and source.count(step) == 64 + 2  # 2 loops of 64, then 2
    assert "for (int r = 0; r < 1; ++r)" in source and source.count("y[j] = y[j] + (A)0x1p-2;") == 64 + 1
    assert source.count("y[j] = y[j] + (A)0x1p-1;") == 64 and source.count("#pragma unroll 1") == 2
    for layout, ndim in (("contiguous", 1), ("strided", 2)):
        source = _C.chain_jit_compile(steps, dtype, backward=True, layout=layout, ndim=ndim)[0]
        assert "#pragma unroll 1" not in source and source.count("d = (A)0x1.00068db8bac71p+0;") == 130
    assert "#pragma unroll 1" not in _C.chain_jit_compile([("mul", 1.0001)] * 64 + [("mul", 1.0002)] * 64, dtype)[0]
    assert "for (int r = 0; r < 1; ++r)" in _C.chain_jit_compile(["relu"] * 65, dtype)[0]  # a function's run too
    assert "#pragma unroll 1" not in _C.chain_jit_compile(["tanh"] * 65, dtype)[0]  # called, not inlined


def _stack_frames(cubin, attributes=(0x11, 0x12)):
    """{attribute: [bytes of stack]} read from a cubin's .nv.info section (ELF64): every
    function's frame (EIATTR_FRAME_SIZE, 0x11) and the kernel's minimum stack (EIATTR_MIN_STACK_SIZE,
    0x12), as cuobjdump --dump-elf shows them; other format 4 attributes of a (symbol, value) pair
    likewise (EIATTR_REGCOUNT, 0x2f: every function's registers). Entries are 4 bytes (format,
    attribute, value) except the format 4 ones, which carry a 16-bit size and that many bytes."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3a)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    strings = headers[names][4]
    info = [h for h in headers if cubin[strings + h[0]:].split(b"\0", 1)[0] == b".nv.info"]
    assert len(info) == 1, "a cubin without its .nv.info section"
    data, frames, i = cubin[info[0][4]:info[0][4] + info[0][5]], {a: [] for a in attributes}, 0
    while i < len(data):
        fmt, attribute = data[i], data[i + 1]
        size = struct.unpack_from("<H", data, i + 2)[0] if fmt == 4 else 0
        if attribute in frames:
            frames[attribute].append(struct.unpack_from("<I", data, i + 8)[0])
        i += 4 + size
    return frames


MIXED12 = ["sin", ("mul", 1.5), "tanh", ("add", 0.5), "exp", "log1p", ("mul", 0.7), "cos", "sigmoid", ("pow", 2.0),
           "softplus", "gelu"]  # the first-call benchmark's chain


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_compiled_kernels_have_no_stack_frame(cache_dir, monkeypatch, dtype):
    """Every value stays in registers: no function of a forward or backward program has a stack
    frame (spills or a local array), whether the chain is inlined, called, packed, rolled or takes
    operands, in either order. float64 sin and cos are left out: libdevice's reduction of large
    arguments keeps a 40-byte array on the stack."""
    chains = [[("mul", 1.0001)] * 256, ["add_tensor", "gelu", ("mul", 0.5), "mul_tensor", ("pow", 3.0), "softplus",
                                        "tanh", "exp", "log1p", "sigmoid"]]
    if dtype != "float64":
        chains += [MIXED12, ["cos", "cos"], MIXED]
    for steps in chains:
        n = sum(s in ("add_tensor", "mul_tensor") for s in steps)
        for order, form, layout, ndim in (("interleaved", "wide", "contiguous", 1), ("packwise", "wide", "contiguous", 1),
                                          ("interleaved", "lean", "contiguous", 1), ("packwise", "lean", "contiguous", 1),
                                          ("interleaved", "wide", "strided", 2)):
            monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", order)
            monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", form)
            for backward in (False, True):
                cubin = _C.chain_jit_compile(steps, dtype, backward=backward, layout=layout, ndim=ndim,
                                             grad_mask=(1 << n) - 1 if backward else 0, index32=True)[1]
                frames = _stack_frames(cubin)
                assert frames[0x11] and frames[0x12], "no frame size read"
                assert set(frames[0x11]) == set(frames[0x12]) == {0}, (steps, order, form, layout, backward, frames)


# BRRR_CHAIN_JIT_ORDER: a contiguous kernel without the pack function computes every value of a
# thread, then stores its packs (unset, `interleaved`), or computes and stores each pack in turn
# (`packwise`); every other kernel is generated interleaved under both values.
PACKWISE_STORE = "if (p >= n_packs) break;"


def _store_guards(source):
    """The last arguments of a kernel's st_pack_if calls: `p < n_packs` where the stores come after
    all the values (interleaved), `true` where each follows its pack's break (packwise)."""
    return {line.rsplit(",", 1)[1].strip() for line in source.splitlines() if line.strip().startswith("st_pack_if(")}


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_the_order_switch_reorders_contiguous_kernels_without_a_pack_function(cache_dir, monkeypatch, dtype):
    """Light chains (the repeat sweep's x * c), with dense and vector operands, and a chain of many
    heavy steps (called, not packed, a trig step among them), forward and backward: both orders
    compile, to different programs, each its own file in the disk cache."""
    cases = [([("mul", 1.0001)] * 64, {}),
             (["add_tensor", ("mul", 0.5), "relu", "mul_tensor"], dict(backward=True, grad_mask=3)),
             (["add_tensor", ("mul", 0.5), "relu", "mul_tensor"], dict(vector_mask=1)),
             (MIXED, {}),
             (MIXED, dict(backward=True, grad_mask=1))]
    for steps, kw in cases:
        monkeypatch.delenv("BRRR_CHAIN_JIT_ORDER", raising=False)
        default, cubin, origin = _C.chain_jit_compile(steps, dtype, **kw)
        monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", "interleaved")
        assert _C.chain_jit_compile(steps, dtype, **kw) == (default, cubin, "disk")
        monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", "packwise")
        packwise, packwise_cubin, packwise_origin = _C.chain_jit_compile(steps, dtype, **kw)
        assert origin == packwise_origin == "compiled" and packwise_cubin[:4] == b"\x7fELF", (steps, kw)
        assert _store_guards(default) == {"p < n_packs);"} and PACKWISE_STORE not in default
        assert _store_guards(packwise) == {"true);"} and PACKWISE_STORE in packwise
        assert _C.chain_jit_compile(steps, dtype, **kw)[2] == "disk"
    assert len(os.listdir(cache_dir)) == 2 * len(cases)


@needs_nvrtc
def test_the_order_switch_leaves_other_kernels_alone(cache_dir, monkeypatch):
    """Chains with the pack function (a trig step, a rolled run), strided and row kernels: one
    program under both values, which the second finds on disk."""
    cases = [(["cos", "cos"], "float32", {}), (["cos", ("mul", 1.5), "cos"], "bfloat16", dict(backward=True)),
             ([("mul", 1.0001)] * 256, "float32", {}),
             ([("mul", 1.0001)] * 64, "float32", dict(layout="strided", ndim=2)),
             (MIXED, "bfloat16", dict(backward=True, grad_mask=3, vector_mask=1, layout="rows", ndim=3))]
    for steps, dtype, kw in cases:
        monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", "packwise")
        source, cubin, origin = _C.chain_jit_compile(steps, dtype, **kw)
        assert origin == "compiled" and PACKWISE_STORE not in source
        monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", "interleaved")
        assert _C.chain_jit_compile(steps, dtype, **kw) == (source, cubin, "disk")


@needs_nvrtc
def test_a_forward_built_with_its_backward_takes_the_order(cache_dir, monkeypatch):
    steps = [("mul", 1.0001)] * 16
    monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", "packwise")
    assert PACKWISE_STORE in _C.chain_jit_compile(steps, "float32", with_backward=True)[0]
    backward, _, origin = _C.chain_jit_compile(steps, "float32", backward=True, grad_mask=0)
    assert origin == "disk" and PACKWISE_STORE in backward  # built packwise, beside the forward
    monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", "interleaved")
    assert _C.chain_jit_compile(steps, "float32", backward=True)[2] == "compiled"


def test_an_unknown_order_is_refused(monkeypatch):
    monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", "Packwise")
    with pytest.raises(ValueError, match="BRRR_CHAIN_JIT_ORDER: expected interleaved or packwise, got 'Packwise'"):
        _C.chain_jit_compile(["relu"], "float32")


# BRRR_CHAIN_JIT_FORM: a contiguous kernel indexes in long long and loads each pack at its own
# address (`wide`), or indexes in 32 bits where the launch allows (index32) and loads its packs
# predicated at one address (unset, `lean`); strided and row kernels are one program under both.
LEAN_LOAD = "ld_pack_if(static_cast<const T *>(a.x) + (unsigned long long)first * VEC + u * THREADS * VEC, y + u * VEC, p < n_packs);"
WIDE_LOAD = "ld_pack(static_cast<const T *>(a.x) + p * VEC, y + u * VEC);"


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_the_form_switch_rewrites_contiguous_kernels(cache_dir, monkeypatch, dtype):
    """Light chains, rolled runs, operands (dense and vector), a trig pack and many heavy steps,
    forward and backward, in both orders: the lean form compiles to another program (its own file
    in the disk cache) that loads through ld_pack_if, indexed in 32 bits under index32 and in 64
    without."""
    cases = [([("mul", 1.0001)] * 64, {}),
             ([("mul", 1.0001)] * 256, {}),
             (["add_tensor", ("mul", 0.5), "relu", "mul_tensor"], dict(backward=True, grad_mask=3)),
             (["add_tensor", ("mul", 0.5), "relu", "mul_tensor"], dict(vector_mask=1)),
             (["cos", ("mul", 1.5), "cos"], dict(backward=True)),
             (MIXED, dict(backward=True, grad_mask=1))]
    files = 0
    for order in ("interleaved", "packwise"):
        monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", order)
        for steps, kw in cases:
            monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", "wide")
            wide, cubin, origin = _C.chain_jit_compile(steps, dtype, index32=True, **kw)
            assert _C.chain_jit_compile(steps, dtype, **kw) == (wide, cubin, "disk")  # index32 left out
            monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", "lean")
            lean, lean_cubin, lean_origin = _C.chain_jit_compile(steps, dtype, index32=True, **kw)
            monkeypatch.delenv("BRRR_CHAIN_JIT_FORM")  # unset: the lean form, found on disk
            assert _C.chain_jit_compile(steps, dtype, index32=True, **kw) == (lean, lean_cubin, "disk")
            lean64, lean64_cubin, lean64_origin = _C.chain_jit_compile(steps, dtype, **kw)
            assert lean_cubin[:4] == lean64_cubin[:4] == b"\x7fELF", (steps, kw)
            # a chain with the pack function: one program for both orders in either form
            assert origin == lean_origin == lean64_origin == ("compiled" if order == "interleaved" else origin), kw
            files += 3 * (origin == "compiled")
            load = LEAN_LOAD.replace("a.x", "a.grad_out").replace("y + u", "gr + u") if kw.get("backward") else LEAN_LOAD
            assert load in lean and load in lean64 and "ld_pack(" not in lean and WIDE_LOAD in wide, (steps, kw)
            assert "typedef unsigned I; // index" in lean and "typedef unsigned long long I; // index" in lean64
            assert "I; // index" not in wide and "ld_pack_if" not in wide
            assert (PACKWISE_STORE in lean) == (PACKWISE_STORE in wide), (steps, kw)
    assert len(os.listdir(cache_dir)) == files


@needs_nvrtc
def test_the_lean_form_keeps_two_packs_a_thread_for_rolled_runs(cache_dir, monkeypatch):
    """The wide form gives 256 multiplies forward 1 pack a thread (its 256 steps, 8 or 16 copies,
    are more than 1024), the lean form 2 (a copy of the rolled loop is 64 steps); the backward,
    unrolled, and 256 heavy-free steps that are no run keep 1 in both."""
    def packs(steps, dtype, **kw):
        return int(re.search(r"constexpr int U = (\d+)", _C.chain_jit_compile(steps, dtype, **kw)[0]).group(1))

    run, mixed = [("mul", 1.0001)] * 256, [("mul", 1.0001), ("add", 0.5)] * 128
    for dtype in ("float32", "bfloat16"):
        monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", "wide")
        assert packs(run, dtype) == packs(mixed, dtype) == packs(run, dtype, backward=True) == 1
        monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", "lean")
        assert packs(run, dtype) == 2 and packs(run[:128], dtype) == 2
        assert packs(mixed, dtype) == packs(run, dtype, backward=True) == 1


@needs_nvrtc
def test_the_form_switch_leaves_strided_and_row_kernels_alone(cache_dir, monkeypatch):
    cases = [([("mul", 1.0001)] * 64, "float32", dict(layout="strided", ndim=2)),
             (MIXED, "bfloat16", dict(backward=True, grad_mask=3, vector_mask=1, layout="rows", ndim=3))]
    for steps, dtype, kw in cases:
        monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", "lean")
        source, cubin, origin = _C.chain_jit_compile(steps, dtype, **kw)
        assert origin == "compiled" and "ld_pack_if" not in source
        monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", "wide")
        assert _C.chain_jit_compile(steps, dtype, **kw) == (source, cubin, "disk")


@needs_nvrtc
def test_the_threads_switch_halves_contiguous_kernels_blocks(cache_dir, monkeypatch):
    """BRRR_CHAIN_JIT_THREADS=256: contiguous kernels of 256-thread blocks (half the blocks of the
    default's 128 in their launch bounds, the same registers a thread), each its own program on
    disk, in either form and direction; 128 is the default's program; strided and row kernels are
    one program under every value; other values raise."""
    for form in ("wide", "lean"):
        monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", form)
        for steps, kw in (([("mul", 1.0001)] * 64, {}), (MIXED12, dict(backward=True))):
            monkeypatch.delenv("BRRR_CHAIN_JIT_THREADS", raising=False)
            default, cubin, _ = _C.chain_jit_compile(steps, "bfloat16", index32=True, **kw)
            monkeypatch.setenv("BRRR_CHAIN_JIT_THREADS", "128")
            assert _C.chain_jit_compile(steps, "bfloat16", index32=True, **kw) == (default, cubin, "disk")
            monkeypatch.setenv("BRRR_CHAIN_JIT_THREADS", "256")
            large, large_cubin, origin = _C.chain_jit_compile(steps, "bfloat16", index32=True, **kw)
            bounds = re.search(r"__launch_bounds__\((\d+), (\d+)\)", large).groups()
            assert bounds[0] == "256" and "THREADS = 256;" in large, large
            assert origin == "compiled" and large_cubin[:4] == b"\x7fELF" and "THREADS = 128;" in default
            assert f"__launch_bounds__(128, {2 * int(bounds[1])})" in default
    for steps, dtype, kw in (([("mul", 1.0001)] * 64, "float32", dict(layout="strided", ndim=2)),
                             (MIXED, "bfloat16", dict(backward=True, grad_mask=3, vector_mask=1, layout="rows", ndim=3))):
        monkeypatch.setenv("BRRR_CHAIN_JIT_THREADS", "128")
        source, cubin, origin = _C.chain_jit_compile(steps, dtype, **kw)
        assert origin == "compiled" and "THREADS" not in source
        monkeypatch.setenv("BRRR_CHAIN_JIT_THREADS", "256")
        assert _C.chain_jit_compile(steps, dtype, **kw) == (source, cubin, "disk")
    monkeypatch.setenv("BRRR_CHAIN_JIT_THREADS", "64")
    with pytest.raises(ValueError, match="BRRR_CHAIN_JIT_THREADS: expected 128 or 256, got '64'"):
        _C.chain_jit_compile(["relu"], "float32")


@needs_nvrtc
def test_the_blocks_switch_bounds_contiguous_kernels_registers(cache_dir, monkeypatch):
    """BRRR_CHAIN_JIT_BLOCKS=8 asks for 8 blocks of 256 threads' worth an SM (16 of 128):
    gelu.cos's float32 forward (45 registers wide, 40 lean at 2 blocks; cos.cos, 32-35 since
    sin(-0)'s select, no longer shows the bound) fits 32 registers, in either form; strided
    kernels keep their bounds; values outside 2 to 8 raise."""
    for form in ("wide", "lean"):
        monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", form)
        monkeypatch.setenv("BRRR_CHAIN_JIT_BLOCKS", "2")
        two, cubin, _ = _C.chain_jit_compile(["gelu", "cos"], "float32", index32=True)
        assert max(_stack_frames(cubin, (0x2f,))[0x2f]) > 32 and "__launch_bounds__(128, 4)" in two
        monkeypatch.setenv("BRRR_CHAIN_JIT_BLOCKS", "8")
        bounded, cubin, origin = _C.chain_jit_compile(["gelu", "cos"], "float32", index32=True)
        assert origin == "compiled" and "__launch_bounds__(128, 16)" in bounded
        frames = _stack_frames(cubin, (0x11, 0x2f))
        # at most 8 bytes of frame: the calls of the out-of-range copies may keep a register there
        # (in the sm_90 SASS no local load or store is left in the kernel itself)
        assert frames[0x2f] and max(frames[0x2f]) <= 32 and max(frames[0x11]) <= 8, frames
        strided = _C.chain_jit_compile(["gelu", "cos"], "float32", layout="strided", ndim=2)
        assert "__launch_bounds__(256)" in strided[0]
    monkeypatch.setenv("BRRR_CHAIN_JIT_BLOCKS", "9")
    with pytest.raises(ValueError, match="BRRR_CHAIN_JIT_BLOCKS: expected 2 to 8, got '9'"):
        _C.chain_jit_compile(["relu"], "float32")


def _kernel_frame(cubin):
    """The kernel's own stack frame (bytes): the last function's EIATTR_FRAME_SIZE in .nv.info,
    where ptxas lists the entry after the functions it calls."""
    return _stack_frames(cubin, (0x11,))[0x11][-1]


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,steps", [("cos.cos", ["cos", "cos"]), ("mixed12", MIXED12), ("mul x64", [("mul", 1.5)] * 64)],
                         ids=["cos.cos", "mixed12", "mulx64"])
def test_the_default_bounds_take_8_blocks_where_the_forward_keeps_no_frame(cache_dir, monkeypatch, dtype, name, steps):
    """Unset, a contiguous forward kernel is the 8-block program where that kernel has no stack
    frame and the 2-block one where it has (each the program BRRR_CHAIN_JIT_BLOCKS names, with a
    note as its first line); a backward kernel is always the 2-block one; a second process finds
    the choice on disk."""
    monkeypatch.delenv("BRRR_CHAIN_JIT_BLOCKS", raising=False)
    chosen = {bw: _C.chain_jit_compile(steps, dtype, index32=True, backward=bw) for bw in (False, True)}
    programs = {}
    for blocks in ("8", "2"):
        monkeypatch.setenv("BRRR_CHAIN_JIT_BLOCKS", blocks)
        programs[blocks] = {bw: _C.chain_jit_compile(steps, dtype, index32=True, backward=bw) for bw in (False, True)}
    want = "8" if _kernel_frame(programs["8"][False][1]) == 0 else "2"
    # The same program but for its first line (the choice's note): the same registers and frames.
    assert chosen[False][0].endswith(programs[want][False][0]), (name, dtype, want)
    assert _stack_frames(chosen[False][1], (0x11, 0x2f)) == _stack_frames(programs[want][False][1], (0x11, 0x2f))
    assert chosen[True][:2] == programs["2"][True][:2]
    if (name, dtype) in (("cos.cos", "float32"), ("mul x64", "float32"), ("mul x64", "bfloat16")):
        assert want == "8"  # measured without a frame at 8 (docs/kernel-switches.md)
    if (name, dtype) == ("cos.cos", "bfloat16"):
        assert want == "2"
    # A new process finds the choice on disk (the 8-block program the switch compiled is not it).
    monkeypatch.delenv("BRRR_CHAIN_JIT_BLOCKS")
    code = f"from brrr import _C; s, c, o = _C.chain_jit_compile({steps!r}, {dtype!r}, index32=True); print(o, c.hex())"
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == ["disk", chosen[False][1].hex()]


def test_an_unknown_form_is_refused(monkeypatch):
    monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", "Lean")
    with pytest.raises(ValueError, match="BRRR_CHAIN_JIT_FORM: expected wide or lean, got 'Lean'"):
        _C.chain_jit_compile(["relu"], "float32")


# BRRR_CHAIN_JIT_BOUNDS=exact (the default): a lean contiguous kernel for a launch that fills every
# block (full_blocks) loads and stores every pack unpredicated and has no tail; other launches, the
# wide form and strided or row kernels get the program of =checked.
BOUNDS_CHAINS = [([("mul", 1.0001)] * 64, {}), ([("mul", 1.0001)] * 64, dict(backward=True)),
                 ([("mul", 1.0001)] * 256, {}), (["cos", "cos"], {}), (MIXED, dict(backward=True, grad_mask=3)),
                 (MIXED, dict(vector_mask=1))]


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bounds_switch_drops_the_bounds_tests_of_full_launches(cache_dir, monkeypatch, dtype):
    for steps, kw in BOUNDS_CHAINS:
        monkeypatch.setenv("BRRR_CHAIN_JIT_BOUNDS", "checked")
        default, cubin, _ = _C.chain_jit_compile(steps, dtype, index32=True, full_blocks=True, **kw)
        monkeypatch.setenv("BRRR_CHAIN_JIT_BOUNDS", "exact")
        assert _C.chain_jit_compile(steps, dtype, index32=True, **kw) == (default, cubin, "disk")
        exact, exact_cubin, origin = _C.chain_jit_compile(steps, dtype, index32=True, full_blocks=True, **kw)
        assert origin == "compiled" and exact_cubin[:4] == b"\x7fELF" and exact_cubin != cubin
        monkeypatch.delenv("BRRR_CHAIN_JIT_BOUNDS")
        assert _C.chain_jit_compile(steps, dtype, index32=True, full_blocks=True, **kw) == (exact, exact_cubin, "disk")
        assert "n_packs" in default and "blockIdx.x != 0" in default
        assert "n_packs" not in exact and "blockIdx.x != 0" not in exact, exact
        for helper in ("ld_pack_if(", "st_pack_if("):
            calls = re.findall(re.escape(helper) + r".*, (\S+)\);", exact.split("brrr_chain_", 1)[1])
            assert calls and set(calls) == {"true"}, calls
            assert len(calls) == len(re.findall(re.escape(helper) + r".*, p < n_packs\);", default))
    for steps, kw in (([("mul", 1.0001)] * 64, dict(layout="strided", ndim=2)),
                      (MIXED, dict(backward=True, grad_mask=3, vector_mask=1, layout="rows", ndim=3)),
                      ([("mul", 1.0001)] * 64, {})):
        if not kw:
            monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", "wide")
        monkeypatch.setenv("BRRR_CHAIN_JIT_BOUNDS", "checked")
        source, cubin, origin = _C.chain_jit_compile(steps, dtype, full_blocks=True, **kw)
        assert origin == "compiled"
        monkeypatch.setenv("BRRR_CHAIN_JIT_BOUNDS", "exact")
        assert _C.chain_jit_compile(steps, dtype, full_blocks=True, **kw) == (source, cubin, "disk")
    monkeypatch.setenv("BRRR_CHAIN_JIT_BOUNDS", "Exact")
    with pytest.raises(ValueError, match="BRRR_CHAIN_JIT_BOUNDS: expected checked or exact, got 'Exact'"):
        _C.chain_jit_compile(["relu"], "float32")


@needs_nvrtc
def test_a_second_process_reads_the_cache(cache_dir):
    steps = ["cos", ("mul", 1.5), "cos"]
    assert _C.chain_jit_compile(steps, "float32")[2] == "compiled"
    assert _C.chain_jit_compile(steps, "float32")[2] == "disk"
    files = os.listdir(cache_dir)
    assert len(files) == 1 and files[0].startswith("chain-") and files[0].endswith(".cubin")
    started = time.perf_counter()
    assert finish(compile_in_subprocess(steps, cache_dir)) == "disk"
    print(f"new process, cached: {time.perf_counter() - started:.2f} s (with Python's start)")
    # A cached kernel needs no NVRTC.
    assert finish(compile_in_subprocess(steps, cache_dir, env={"BRRR_NVRTC": "none"})) == "disk"
    # Another chain, dtype or direction is another kernel.
    assert _C.chain_jit_compile(steps, "float16")[2] == "compiled"
    assert _C.chain_jit_compile(steps, "float32", backward=True)[2] == "compiled"
    assert _C.chain_jit_compile(["cos", ("mul", 1.25), "cos"], "float32")[2] == "compiled"


@needs_nvrtc
def test_a_corrupted_cache_file_is_rebuilt(cache_dir):
    steps = ["sin", "softplus"]
    _, cubin, _ = _C.chain_jit_compile(steps, "float32")
    (path,) = cache_dir.iterdir()
    good = path.read_bytes()
    for damage in (lambda b: b[:-1] + bytes([b[-1] ^ 1]),            # the checksum
                   lambda b: b[:200] + bytes([b[200] ^ 0x40]) + b[201:],  # the identity or the cubin
                   lambda b: b[: len(b) // 2],                        # cut short
                   lambda b: b""):
        path.write_bytes(damage(good))
        _, rebuilt, origin = _C.chain_jit_compile(steps, "float32")
        assert origin == "compiled" and rebuilt == cubin
        assert path.read_bytes() == good  # replaced by a whole file
        assert _C.chain_jit_compile(steps, "float32")[2] == "disk"


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_forward_and_its_backward_build_at_once(cache_dir, dtype):
    """A chain whose backward is wanted builds its forward and its backward (every operand's
    gradient) at once, on two threads: two programs, each the one it would be alone, so a backward
    built with its forward serves a backward needed alone, and the other way round."""
    steps = ["cos", ("mul", 1.75), "mul_tensor", "sin"]
    before = _C.chain_jit_info()["compiled"]
    source, cubin, origin = _C.chain_jit_compile(steps, dtype, with_backward=True)
    assert origin == "compiled" and cubin[:4] == b"\x7fELF" and b"brrr_chain_fwd" in cubin
    assert b"brrr_chain_bwd" not in cubin
    assert _C.chain_jit_info()["compiled"] == before + 2 and len(os.listdir(cache_dir)) == 2
    assert _C.chain_jit_compile(steps, dtype) == (source, cubin, "disk")
    backward_source, backward_cubin, origin = _C.chain_jit_compile(steps, dtype, backward=True, grad_mask=1)
    assert origin == "disk" and b"brrr_chain_bwd" in backward_cubin and backward_source != source
    assert _C.chain_jit_info()["compiled"] == before + 2 and len(os.listdir(cache_dir)) == 2
    assert _C.chain_jit_compile(steps, dtype, with_backward=True)[2] == "disk"
    # A backward of fewer gradients is another program.
    assert _C.chain_jit_compile(steps, dtype, backward=True)[2] == "compiled"


@needs_nvrtc
def test_a_backward_built_alone_serves_a_forward_built_with_its_backward(cache_dir):
    steps = ["tanh", ("pow", 3.0), "add_tensor"]
    _C.chain_jit_compile(steps, "float16", backward=True, grad_mask=1)
    before = _C.chain_jit_info()["compiled"]
    assert _C.chain_jit_compile(steps, "float16", with_backward=True)[2] == "compiled"
    assert _C.chain_jit_info()["compiled"] == before + 1  # the forward; the backward came from disk
    assert len(os.listdir(cache_dir)) == 2


@needs_nvrtc
def test_a_forward_and_backward_corrupted_on_disk_are_rebuilt(cache_dir):
    steps = ["sin", "softplus"]
    _, cubin, _ = _C.chain_jit_compile(steps, "float32", with_backward=True)
    files = sorted(cache_dir.iterdir())
    good = {path: path.read_bytes() for path in files}
    assert len(files) == 2
    for path in files:
        for damage in (lambda b: b[:-1] + bytes([b[-1] ^ 1]), lambda b: b[: len(b) // 3], lambda b: b"BRRRJIT1"):
            path.write_bytes(damage(good[path]))
            before = _C.chain_jit_info()["compiled"]
            _, rebuilt, _ = _C.chain_jit_compile(steps, "float32", with_backward=True)
            assert rebuilt == cubin and _C.chain_jit_info()["compiled"] == before + 1  # the damaged one alone
            assert {p: p.read_bytes() for p in cache_dir.iterdir()} == good


def test_with_backward_without_nvrtc_says_why(tmp_path):
    code = "from brrr import _C; _C.chain_jit_compile(['cos'], 'float32', with_backward=True)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "BRRR_NVRTC": "none", "BRRR_CACHE_DIR": str(tmp_path)})
    assert result.returncode != 0 and "NVRTC not available: BRRR_NVRTC=none" in result.stderr


def test_with_backward_arguments_are_checked():
    with pytest.raises(ValueError, match="argument with_backward"):
        _C.chain_jit_compile(["relu"], "float32", layout="strided", with_backward=True)
    with pytest.raises(ValueError, match="argument with_backward"):
        _C.chain_jit_compile(["add_tensor"], "float32", vector_mask=1, with_backward=True)
    with pytest.raises(ValueError, match="argument with_backward"):
        _C.chain_jit_compile(["relu"], "float32", backward=True, with_backward=True)
    with pytest.raises(TypeError, match="argument program"):
        _C.chain_jit_with_backward(b"short")
    assert _C.chain_jit_with_backward(brrr.chain("cos", "relu").program) is None


@needs_nvrtc
def test_two_processes_compiling_the_same_chain_both_succeed(cache_dir):
    steps = ["mish", ("leaky_relu", 0.1), "cos", ("clamp_max", 0.5)]
    processes = [compile_in_subprocess(steps, cache_dir, "bfloat16") for _ in range(2)]
    assert {finish(p) for p in processes} <= {"compiled", "disk"}
    assert [f for f in os.listdir(cache_dir) if not f.startswith(".")] == os.listdir(cache_dir)
    assert len(os.listdir(cache_dir)) == 1  # no temporary file left behind
    assert _C.chain_jit_compile(steps, "bfloat16")[2] == "disk"


@needs_nvrtc
def test_an_unwritable_cache_folder_still_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("BRRR_CACHE_DIR", str(blocker / "cache"))
    assert _C.chain_jit_compile(["relu", "neg"], "float32")[2] == "compiled"


def test_the_cache_folder(monkeypatch):
    monkeypatch.setenv("BRRR_CACHE_DIR", "/somewhere/brrr-cache")
    assert _C.chain_jit_info()["cache_dir"] == "/somewhere/brrr-cache"
    monkeypatch.delenv("BRRR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert _C.chain_jit_info()["cache_dir"] == "/xdg/brrr"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert _C.chain_jit_info()["cache_dir"] == "/home/someone/.cache/brrr"


def test_without_nvrtc_brrr_imports_and_chains_run_on_the_cpu():
    code = ("import brrr, numpy as np; from brrr import _C; info = _C.chain_jit_info(); "
            "assert info['nvrtc'] is None and info['nvrtc_error'] == 'BRRR_NVRTC=none', info; "
            "x = np.linspace(-1, 1, 100, dtype=np.float32); y = brrr.chain(*['sin'] * 40)(x); "
            "assert abs(float(y[-1]) - 0.29) < 0.05, y[-1]; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "BRRR_NVRTC": "none"})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@needs_nvrtc
def test_an_nvrtc_already_loaded_is_used_with_its_builtins(tmp_path):
    """PyTorch's CUDA wheels load libnvrtc from a folder off the loader's path: brrr finds it by name
    and loads the builtins NVRTC needs from the same folder."""
    path = _C.chain_jit_info()["nvrtc"]
    code = (f"import ctypes; ctypes.CDLL({path!r}, mode=ctypes.RTLD_GLOBAL); from brrr import _C; "
            "print(_C.chain_jit_compile(['cos', ('mul', 3.25)], 'float32')[2], _C.chain_jit_info()['nvrtc'])")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "BRRR_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["compiled", os.path.realpath(path)]


def test_build_info_reports_no_chain_step_limit():
    # Chains have none (the CPU twin, the compiled kernels); the interpreted kernels, which run
    # CUDA chains without NVRTC, take MAX_CHAIN_STEPS.
    info = brrr.build_info()
    assert info["max_chain_steps"] is None and info["max_interpreted_chain_steps"] == _C.MAX_CHAIN_STEPS == 16
    steps = [("mul", 1.0001)] * (2 * _C.MAX_CHAIN_STEPS + 1)
    x = random((1000,), torch.float32, "cpu")
    assert_close(brrr.chain(*steps)(x), x.double() * 1.0001 ** len(steps), torch.float32)


def test_compile_arguments_are_checked():
    with pytest.raises(ValueError, match="argument dtype"):
        _C.chain_jit_compile(["relu"], "int8")
    with pytest.raises(ValueError, match="argument layout"):
        _C.chain_jit_compile(["relu"], "float32", layout="rows")  # rows: backward only
    with pytest.raises(ValueError, match="vector_mask"):
        _C.chain_jit_compile(["relu"], "float32", vector_mask=1)
    with pytest.raises(ValueError, match="argument layout"):
        _C.chain_jit_compile(["add_tensor"], "float32", backward=True, vector_mask=1, grad_mask=1)
    with pytest.raises(ValueError, match=r"steps\[0\]: unknown op"):
        _C.chain_jit_compile(["nope"], "float32")


# ---- CUDA: compiled against interpreted ----------------------------------------------------------

def _interpreted(fn):
    previous = _C.chain_jit_enable(False)
    try:
        return fn()
    finally:
        _C.chain_jit_enable(previous)


def _fwd_bwd(steps, x, operands, g):
    leaves = [t.detach().clone().requires_grad_() for t in (x, *operands)]
    y = brrr.chain(*steps)(*leaves)
    y.backward(g)
    return [y.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("shape", [(4097,), (64, 1000), (3, 5, 40)], ids=str)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_compiled_matches_interpreted(dtype, seed, shape, strided):
    assert HAVE_NVRTC, _C.chain_jit_info()
    rng = pyrandom.Random(seed)
    steps = random_long_chain(rng, rng.randint(1, 16))
    x = random(shape, dtype, "cuda", -2.0, 2.0)
    if strided:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    operands = _operands(steps, x, rng)
    g = random(x.shape, dtype, "cuda")
    compiled = _fwd_bwd(steps, x, operands, g)
    interpreted = _interpreted(lambda: _fwd_bwd(steps, x, operands, g))
    # The same functions in the same order; the compiler may contract a multiply and an add
    # differently in the unrolled code. A wrong step is off by far more.
    for a, b in zip(compiled, interpreted):
        torch.testing.assert_close(a, b, rtol=4 * torch.finfo(dtype).eps * len(steps), atol=1e-6 * len(steps) *
                                   max(1.0, float(b.abs().max())))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_chains_on_cuda_against_float64(dtype):
    rng = pyrandom.Random(7)
    for n in (17, 64, 200):
        steps = random_long_chain(rng, n)
        x = random((333, 65), dtype, "cuda", -2.0, 2.0)
        operands = _operands(steps, x, rng)  # bias-like vectors among them: the rows layout's backward
        g = random(x.shape, dtype, "cuda")
        ours = _fwd_bwd(steps, x, operands, g)
        leaves = [t.detach().to("cpu", torch.float64).requires_grad_() for t in (x, *operands)]
        want = reference(steps, leaves[0], leaves[1:])
        want.backward(g.double().cpu())
        for got, expected in zip(ours, [want.detach()] + [leaf.grad for leaf in leaves]):
            # a chain that clamps to a constant has a gradient of exactly 0: then the error itself
            err = (got.double().cpu() - expected).norm() / (expected.norm() if expected.norm() > 0 else 1.0)
            assert err < (1e-5 if dtype == torch.float32 else 2e-2) * n / 16, (n, float(err))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [4097, 1 << 16, 3])
def test_long_inlined_chains_one_pack_a_thread_against_float64(dtype, n):
    """Light steps only, 200 of them: inlined, one 16-byte pack a thread (packs_per_thread)."""
    steps = [("mul", 1.001), ("add", 0.001), "neg", "abs", ("clamp_max", 5.0)] * 40
    x = random((n,), dtype, "cuda", -2.0, 2.0)
    g = random((n,), dtype, "cuda")
    got = _fwd_bwd(steps, x, [], g)
    want, (want_grad,) = reference_grads(steps, x, [], g)
    assert_close(got[0], want, dtype, scale=8.0)
    assert_close(got[1], want_grad, dtype, scale=8.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [4099, 1 << 16, 5])
def test_rolled_runs_against_float64(dtype, n):
    """Forward kernels roll runs of more than 64 identical steps into loops (the backward keeps
    them unrolled): both against float64, on all the values of a thread and the tail's."""
    steps = [("mul", 1.001)] * 130 + ["relu"] + [("add", 0.001)] * 65 + ["sin"] + [("mul", 0.999)] * 200
    # sin's argument stays below 1.43, away from pi / 2: there cos(y), the gradient's factor, is
    # near 0 and a float32 y rounded ~200 times is off by more than the tolerance allows in any
    # float32 evaluation (a step-by-step NumPy one fails it by 2x at inputs near 1.32).
    x = random((n,), dtype, "cuda", -1.2, 1.2)
    g = random((n,), dtype, "cuda")
    got = _fwd_bwd(steps, x, [], g)
    want, (want_grad,) = reference_grads(steps, x, [], g)
    assert_close(got[0], want, dtype, scale=8.0)
    assert_close(got[1], want_grad, dtype, scale=8.0)
    x64 = random((1 << 12,), torch.float32, "cuda")  # one rounded multiply a step, as torch's own
    want = x64.clone()
    for _ in range(300):
        want = want * 1.001
    torch.testing.assert_close(brrr.chain(*[("mul", 1.001)] * 300)(x64), want, rtol=0, atol=0)


@pytest.mark.cuda
def test_first_call_compiles_then_the_memory_cache_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("BRRR_CACHE_DIR", str(tmp_path))
    x = torch.randn(1 << 20, device="cuda")
    chain = brrr.chain("cos", ("mul", 1.0 + pyrandom.random()), "cos")  # a scalar no other test uses
    before = _C.chain_jit_info()["compiled"]
    torch.cuda.synchronize()
    started = time.perf_counter()
    chain(x)
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    assert _C.chain_jit_info()["compiled"] == before + 1
    started = time.perf_counter()
    for _ in range(10):
        chain(x)
    torch.cuda.synchronize()
    again = (time.perf_counter() - started) / 10
    print(f"first call {first * 1e3:.1f} ms (compile + load {_C.chain_jit_info()['last_seconds'] * 1e3:.1f} ms), "
          f"then {again * 1e3:.3f} ms")
    assert _C.chain_jit_info()["compiled"] == before + 1
    assert first < 5.0 and again < first


def _fresh_chain():
    return brrr.chain("cos", ("mul", 1.0 + pyrandom.random()), "tanh")  # a scalar no other test uses


def _check_grad(chain, x, y, grad):
    want_x = x.detach().double().requires_grad_()
    want = torch.tanh(torch.cos(want_x) * chain.steps[1][1])
    want.backward(grad.double())
    assert_close(y.detach(), want.detach(), x.dtype)
    assert_close(x.grad, want_x.grad, x.dtype)


@pytest.mark.cuda
def test_a_chain_that_autograd_records_compiles_forward_and_backward_once(tmp_path, monkeypatch):
    monkeypatch.setenv("BRRR_CACHE_DIR", str(tmp_path))
    chain = _fresh_chain()
    x = torch.randn(4099, device="cuda", requires_grad=True)  # 4099: a tail past the last 16-byte pack
    grad = torch.randn_like(x)
    before = _C.chain_jit_info()["compiled"]
    y = chain(x)
    y.backward(grad)
    assert _C.chain_jit_info()["compiled"] == before + 2  # forward and backward, built at once
    _check_grad(chain, x, y, grad)
    assert len(os.listdir(tmp_path)) == 2
    code = ("import json, torch, brrr; from brrr import _C; "
            f"x = torch.randn(4099, device='cuda', requires_grad=True); y = brrr.chain(*{list(chain.steps)!r})(x); "
            "y.backward(torch.ones_like(y)); info = _C.chain_jit_info(); print(json.dumps([info['compiled'], info['from_disk']]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "BRRR_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[0, 2]"  # the next process reads both from disk


@pytest.mark.cuda
def test_a_forward_compiled_alone_still_gains_its_backward(tmp_path, monkeypatch):
    monkeypatch.setenv("BRRR_CACHE_DIR", str(tmp_path))
    chain = _fresh_chain()
    x = torch.randn(1 << 12, device="cuda", requires_grad=True)
    grad = torch.randn_like(x)
    before = _C.chain_jit_info()["compiled"]
    with torch.no_grad():
        chain(x)  # the forward alone
    assert _C.chain_jit_info()["compiled"] == before + 1
    y = chain(x)
    y.backward(grad)
    assert _C.chain_jit_info()["compiled"] == before + 2  # the backward, alone
    _check_grad(chain, x, y, grad)


# Chains for both orders: packwise applies to the first three (no pack function), not the last.
ORDER_CHAINS = [[("mul", 1.0001)] * 16, ["add_tensor", ("mul", 0.5), "relu", "mul_tensor", ("add", 0.25)], MIXED,
                ["cos", ("mul", 1.5), "cos"]]
# Relative error (norm) against float64: the compute type's rounding over a few steps, then the
# storage's; a pack computed or stored in the wrong place is off by about 1.
ORDER_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["wide", "lean"])
@pytest.mark.parametrize("order", ["interleaved", "packwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(3603,), (5,), (67, 1000)], ids=str)
def test_every_variant_matches_interpreted_and_float64(monkeypatch, form, order, dtype, shape):
    """3603 elements: the last block's threads own a first pack and only some a second one, and a
    tail past the last pack; 5: no whole pack in half types; (67, 1000): vector operands."""
    assert HAVE_NVRTC, _C.chain_jit_info()
    monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", order)
    monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", form)
    rng = pyrandom.Random(len(shape) * 10007 + shape[0])
    for steps in ORDER_CHAINS:
        x = random(shape, dtype, "cuda", -2.0, 2.0)
        operands = _operands(steps, x, rng)
        x = away_from_kinks(steps, x, operands)  # relu's: the reference's derivative there is a convention
        g = random(x.shape, dtype, "cuda")
        compiled = _fwd_bwd(steps, x, operands, g)
        interpreted = _interpreted(lambda: _fwd_bwd(steps, x, operands, g))
        want, want_grads = reference_grads(steps, x, operands, g)
        for got, same, expected in zip(compiled, interpreted, [want] + want_grads):
            torch.testing.assert_close(got, same, rtol=4 * torch.finfo(dtype).eps * len(steps),
                                       atol=1e-6 * len(steps) * max(1.0, float(same.abs().max())))
            # relu may zero a few elements' gradients entirely: then the error itself
            err = (got.double().cpu() - expected).norm() / (expected.norm() if expected.norm() > 0 else 1.0)
            assert err < ORDER_TOLERANCE[dtype], (steps, float(err))


@pytest.mark.cuda
@pytest.mark.parametrize("n", [5, 3603, (1 << 16) + 3], ids=str)
def test_the_lean_form_against_the_wide_form_torch_and_float64(monkeypatch, n):
    """x * c repeated 1, 64 and 256 times (rolled, 2 packs a thread in the lean form) and a chain
    with a rolled run, a trig pack and a tail: the lean form computes each value as the wide one
    does (the same bits), with its launch bounds at 8 blocks an SM too (BRRR_CHAIN_JIT_BLOCKS) and
    in blocks of 128 and 256 threads (BRRR_CHAIN_JIT_THREADS), float32 x * c as torch's repeated
    multiply, all near float64."""
    chains = [[("mul", 1.001)] * r for r in (1, 64, 256)] + [["cos", ("mul", 1.001)] + [("add", 0.001)] * 70]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = random((n,), dtype, "cuda", -2.0, 2.0)
        for steps in chains:
            got = {}
            for form, blocks, threads in (("wide", "2", "256"), ("lean", "2", "256"), ("lean", "8", "256"),
                                          ("lean", "2", "128"), ("lean", "8", "128")):
                monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", form)
                monkeypatch.setenv("BRRR_CHAIN_JIT_BLOCKS", blocks)
                monkeypatch.setenv("BRRR_CHAIN_JIT_THREADS", threads)
                got[form + blocks + ("" if threads == "256" else "t" + threads)] = brrr.chain(*steps)(x)
            for variant in ("lean2", "lean8", "lean2t128", "lean8t128"):
                torch.testing.assert_close(got[variant], got["wide2"], rtol=0, atol=0)
            got["lean"] = got["lean2"]
            assert_close(got["lean"], reference(steps, x.double(), []), dtype, scale=8.0)
            if dtype == torch.float32 and steps[0] == steps[-1]:
                want = x.clone()
                for _ in steps:
                    want = want * 1.001
                torch.testing.assert_close(got["lean"], want, rtol=0, atol=0)


@pytest.mark.cuda
def test_the_forms_are_cached_apart(tmp_path, monkeypatch):
    """One process, both forms: the contiguous kernel compiled once for each, then found in memory;
    the strided kernel, the same program under both, compiled once."""
    monkeypatch.setenv("BRRR_CACHE_DIR", str(tmp_path))
    x = torch.randn((1 << 16) + 3, device="cuda")
    c = 1.0 + 1e-3 * pyrandom.random()  # a scalar no other test uses
    repeat, strided = brrr.chain(*[("mul", c)] * 64), brrr.chain(("mul", c), "relu")
    xt = torch.randn(300, 400, device="cuda")[:, ::2]  # the strided layout
    for form, built in (("wide", 2), ("lean", 1), ("wide", 0), ("lean", 0)):
        monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", form)
        before = _C.chain_jit_info()["compiled"]
        repeat(x), strided(xt)
        assert _C.chain_jit_info()["compiled"] - before == built, form
    assert len(os.listdir(tmp_path)) == 3


@pytest.mark.cuda
@pytest.mark.parametrize("threads", ["128", "256"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_exact_bounds_compute_the_default_bits(tmp_path, monkeypatch, threads, dtype):
    """BRRR_CHAIN_JIT_BOUNDS=exact: a launch of 64 x 1024 elements fills every block of every dtype
    (1 or 2 packs a thread, 128 or 256 threads) and runs kernels of their own, forward and backward,
    vector operands included, with the default's bits; one of 67 x 1000 does not, and runs the
    default's programs."""
    monkeypatch.setenv("BRRR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BRRR_CHAIN_JIT_THREADS", threads)
    c = 1.0 + 1e-3 * pyrandom.random()  # a scalar no other test uses
    chains = [[("mul", c)] * 64, [("mul", c)] * 256, ["cos", ("mul", c), "cos"],
              ["add_tensor", ("mul", c), "relu", "mul_tensor", ("add", 0.25)], MIXED + [("mul", c)]]
    rng = pyrandom.Random(int(threads) + dtype.itemsize)
    for shape, full in (((64, 1024), True), ((67, 1000), False)):
        for steps in chains:
            x = random(shape, dtype, "cuda", -2.0, 2.0)
            operands = _operands(steps, x, rng)
            x = away_from_kinks(steps, x, operands)
            g = random(x.shape, dtype, "cuda")
            got, built = {}, {}
            for bounds in ("checked", "exact"):
                monkeypatch.setenv("BRRR_CHAIN_JIT_BOUNDS", bounds)
                before = _C.chain_jit_info()["compiled"]
                got[bounds] = _fwd_bwd(steps, x, operands, g)
                built[bounds] = _C.chain_jit_info()["compiled"] - before
            if not operands:  # (a chain with tensor operands may reuse a kernel of another test's scalar)
                assert (built["exact"] >= 1) == full, (steps, shape, built)
            for exact, checked in zip(got["exact"], got["checked"]):
                torch.testing.assert_close(exact, checked, rtol=0, atol=0)
            want, want_grads = reference_grads(steps, x, operands, g)
            for exact, expected in zip(got["exact"], [want] + want_grads):
                err = (exact.double().cpu() - expected).norm() / (expected.norm() if expected.norm() > 0 else 1.0)
                assert err < ORDER_TOLERANCE[dtype] * (4 if len(steps) > 16 else 1), (steps, float(err))


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_packs_past_the_end_are_zeros_where_a_range_check_reads_them(cache_dir, monkeypatch, dtype):
    """The lean form does not load a pack past the end of a launch whose last block is part empty.
    A pack function's trig step checks the range of all of a thread's values at once, so there those
    packs are zeros (in range): left undefined, a register's stale contents chose the fast or the
    full trig path for the thread's packs in bounds, and a half value of the last block came out
    1 ulp apart from run to run. Without the check (no trig step, or a called element function) or
    with every block full they stay unloaded, the programs as before."""
    monkeypatch.setenv("BRRR_CHAIN_JIT_FORM", "lean")
    monkeypatch.setenv("BRRR_CHAIN_JIT_BOUNDS", "exact")
    zeroed = "unsigned w[4] = {0u, 0u, 0u, 0u};"
    for steps, checks in ((["cos", ("mul", 1.5), "cos"], True), (["add_tensor", "sin"], True),
                          ([("mul", 1.5)] * 3, False), (MIXED, False)):
        n = sum(s in ("add_tensor", "mul_tensor") for s in steps)
        for backward in (False, True):
            for full in (False, True):
                source = _C.chain_jit_compile(steps, dtype, backward=backward, grad_mask=(1 << n) - 1 if backward else 0,
                                              index32=True, full_blocks=full)[0]
                assert "ld_pack_if" in source and (zeroed in source) == (checks and not full), (steps, backward, full)


@pytest.mark.cuda
@pytest.mark.parametrize("threads", ["128", "256"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_part_empty_last_block_has_the_bits_of_a_full_one(tmp_path, monkeypatch, threads, dtype):
    """Compiled chains with a trig step (pack functions) over launches whose last block is part
    empty: every value, forward and backward, launch after launch, has the bits of the same values
    in a launch continued with zeros (every block full). Over |x| <= 30 the fast and the full trig
    paths of a half type differ by up to about 1% of a float16 ulp, so a last block whose range
    check read a stale register out of range had values 1 ulp off."""
    monkeypatch.setenv("BRRR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BRRR_CHAIN_JIT_THREADS", threads)
    for steps in (["cos"], ["add_tensor", "sin"]):
        for numel in (67000, 5000, 25800):
            x = random(numel, dtype, "cuda", -15.0, 15.0)
            operands = [random(numel, dtype, "cuda", -15.0, 15.0) for s in steps if s == "add_tensor"]
            g = random(numel, dtype, "cuda")
            whole = -(-numel // 4096) * 4096  # every block full, at every block size and pack count
            padded = [torch.cat([t, torch.zeros(whole - numel, dtype=dtype, device="cuda")]) for t in (x, *operands, g)]
            want = [t[:numel] for t in _fwd_bwd(steps, padded[0], padded[1:-1], padded[-1])]
            for _ in range(20):
                for got, expected in zip(_fwd_bwd(steps, x, operands, g), want):
                    torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{steps} {numel}: {m}")


@pytest.mark.cuda
def test_the_orders_are_cached_apart(tmp_path, monkeypatch):
    """One process, both orders: each order's program is compiled once and then answers from
    memory for its own order only; a chain with a trig pack has one program for both."""
    monkeypatch.setenv("BRRR_CACHE_DIR", str(tmp_path))
    x = torch.randn((1 << 16) + 3, device="cuda")
    c = 1.0 + 1e-3 * pyrandom.random()  # a scalar no other test uses
    repeat, trig = brrr.chain(*[("mul", c)] * 64), brrr.chain("cos", ("mul", c), "cos")
    want = x.clone()
    for _ in range(64):
        want = want * c  # one rounded multiply a step, as the compiled kernels
    for order, built in (("interleaved", 2), ("packwise", 1), ("interleaved", 0), ("packwise", 0)):
        monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", order)
        before = _C.chain_jit_info()["compiled"]
        got, cos = repeat(x), trig(x)
        assert _C.chain_jit_info()["compiled"] - before == built, order
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert_close(cos, torch.cos(torch.cos(x.double()) * c), torch.float32)
    assert len(os.listdir(tmp_path)) == 3
    monkeypatch.setenv("BRRR_CHAIN_JIT_ORDER", "pack")
    with pytest.raises(ValueError, match="BRRR_CHAIN_JIT_ORDER: expected interleaved or packwise, got 'pack'"):
        repeat(x)


@pytest.mark.cuda
def test_a_compiled_chain_is_captured_by_cuda_graphs():
    x = torch.randn(1 << 16, device="cuda")
    chain = brrr.chain(*[("mul", 1.001), "sin"] * 20)  # 40 steps: compiled kernels only
    expected = chain(x)  # the first call, outside capture, compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, expected, rtol=0, atol=0)
    fresh = brrr.chain(*[("mul", 1.002), "sin"] * 20)
    with pytest.raises(RuntimeError, match="run it once before capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fresh(x)


@pytest.mark.cuda
def test_without_nvrtc_long_chains_on_cuda_say_why(tmp_path):
    code = ("import warnings, torch, brrr; x = torch.randn(100, device='cuda');\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); brrr.chain('cos', 'cos')(x); brrr.chain('sin')(x)\n"
            "assert len(w) == 1 and 'NVRTC was not found' in str(w[0].message), [str(m.message) for m in w]\n"
            "try:\n    brrr.chain(*['cos'] * 17)(x)\nexcept ValueError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "BRRR_NVRTC": "none", "BRRR_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "a chain of 17 steps needs NVRTC" in result.stdout


@needs_nvrtc
def test_chain_jit_info_waits_for_a_compile_without_holding_the_gil(cache_dir):
    """chain_jit_info() while another thread compiles waits for that compile's lock; it waited with
    the GIL held, so that every Python thread stalled until the compile ended."""
    steps = ["gelu", "silu", ("mul", 2.0), "tanh", "exp", "sin", ("add", 1.0), "sigmoid", "log1p", ("pow", 3.0),
             "cos"] * 10  # seconds of NVRTC on a 2-core machine
    started, stop, ticks = threading.Event(), threading.Event(), []

    def compile_chain():
        started.set()
        _C.chain_jit_compile(steps, "float64", backward=True)

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    threads = [threading.Thread(target=tick), threading.Thread(target=compile_chain)]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(0.1)
    begin = time.perf_counter()
    _C.chain_jit_info()
    end = time.perf_counter()
    stop.set()
    for thread in threads:
        thread.join()
    assert end - begin > 0.3, "the compile ended before chain_jit_info() was called"
    during = [begin] + [t for t in ticks if begin < t < end] + [end]
    assert max(b - a for a, b in zip(during, during[1:])) < (end - begin) / 3


@needs_nvrtc
def test_a_fork_child_does_not_inherit_a_compile_in_progress(cache_dir):
    """A process that forks while another of its threads compiles chains: each child's
    chain_jit_info() and chain_jit_compile() must not wait for ever on a lock of a thread it does
    not have - brrr's compile_lock (held for the whole of a compile; they did, with the GIL held) or
    NVRTC's own (a child forked inside nvrtcCompileProgram hung in its next compile, 2 in 20 on a
    loaded 2-core machine: a fork now waits for the compile in progress). Six forks at staggered
    moments of the compiles, in a process of its own, each child with a timeout."""
    code = ("import os, threading, time\n"
            "from brrr import _C\n"
            "_C.chain_jit_info()\n"
            "started = threading.Event()\n"
            "def compile_many():\n"
            "    started.set()\n"
            "    for i in range(8):\n"
            "        _C.chain_jit_compile(['cos', ('mul', 1.0 + i), 'sin', 'exp', 'tanh'], 'float32')\n"
            "thread = threading.Thread(target=compile_many)\n"
            "thread.start()\n"
            "started.wait()\n"
            "results = []\n"
            "for child in range(6):\n"
            "    time.sleep(0.15)\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        ok = _C.chain_jit_info()['nvrtc'] is not None\n"
            "        ok = ok and _C.chain_jit_compile(['cos', ('add', 1.0 + child)], 'float32')[2] in ('disk', 'compiled')\n"
            "        os._exit(0 if ok else 3)\n"
            "    for _ in range(600):\n"
            "        done, status = os.waitpid(pid, os.WNOHANG)\n"
            "        if done:\n"
            "            results.append(os.waitstatus_to_exitcode(status))\n"
            "            break\n"
            "        time.sleep(0.1)\n"
            "    else:\n"
            "        os.kill(pid, 9)\n"
            "        os.waitpid(pid, 0)\n"
            "        results.append('hung')\n"
            "thread.join()\n"
            "print(results)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "BRRR_CACHE_DIR": str(cache_dir)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([0] * 6), out.stdout
