"""LayerNorm and RMSNorm (brrr.layer_norm, rms_norm, add_layer_norm, add_rms_norm): outputs and
every gradient against float64 torch.nn.functional on fresh random inputs; odd sizes, row counts
that leave partial blocks, non-contiguous views, inputs offset by 1e4, fp32 weights for half
inputs, the Llama cast order, RMSNorm's weight offset (Gemma's 1 + weight); gradcheck,
determinism, opcheck, torch.compile, argument errors.

On CUDA the sizes cover every kernel: the register-row path with 16-byte packs (768, 16384) and
with single elements (3, 127, 4097), the generic path (65536, 8193, strided columns).
"""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode

import brrr
from brrr import _C
from dlpack_producers import Producer
from helpers import DEVICES, DTYPES, HALF_DTYPES, TOLERANCE, poisoned_like, random

KINDS = ["layer_norm", "rms_norm"]
# (columns, rows when "many"): odd row counts leave partial blocks and partial slices.
SIZES = {1: 1001, 3: 999, 127: 601, 768: 301, 4097: 51, 8193: 13, 16384: 9, 65536: 5}
AFFINE = {"layer_norm": ["none", "weight", "bias", "both"], "rms_norm": ["none", "weight"]}


# ---- references -------------------------------------------------------------------------------

def straight_round(t, dtype):
    """t rounded to dtype (as brrr stores it), with the identity as its gradient."""
    return t + (t.to(dtype).to(t.dtype) - t).detach()


def default_eps(kind, dtype):
    """torch's eps=None: 1e-5 for layer_norm; for rms_norm the compute dtype's machine epsilon."""
    if kind == "layer_norm":
        return 1e-5
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def reference(kind, dtype, x, residual, normalized_shape, weight=None, bias=None, eps=None, llama=False, offset=0.0):
    """brrr's op in float64 on float64 leaves holding the same values: (out, h), where h is the
    normalised input (x + residual rounded to dtype for the fused forms, else x). offset: added to
    the weight (RMSNorm)."""
    if offset:
        weight = weight + offset
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    h = x if residual is None else straight_round(x + residual, dtype)
    eps = default_eps(kind, dtype) if eps is None else eps
    if kind == "layer_norm":
        # LayerNorm is invariant to shifting a row: minus its (detached) first element, exact in
        # float64, the reference keeps its own rounding small for rows with a large offset.
        k = len(normalized_shape)
        first = h.detach().flatten(h.dim() - k)[..., :1].reshape(h.shape[:h.dim() - k] + (1,) * k)
        return F.layer_norm(h - first, normalized_shape, weight, bias, eps), h
    if not llama:
        return F.rms_norm(h, normalized_shape, weight, eps), h
    dims = tuple(range(-len(normalized_shape), 0))
    y = straight_round(h * torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + eps), dtype)
    return (y if weight is None else y * weight), h


def call(kind, x, residual, normalized_shape, weight=None, bias=None, eps=None, cast_order="torch", offset=0.0):
    """brrr's op: (out, h) with h = None for the plain forms; offset only where given (RMSNorm)."""
    if offset:
        if residual is None:
            return brrr.rms_norm(x, normalized_shape, weight, eps, cast_order=cast_order, offset=offset), None
        return brrr.add_rms_norm(x, residual, normalized_shape, weight, eps, cast_order=cast_order, offset=offset)
    if kind == "layer_norm":
        eps = 1e-5 if eps is None else eps
        if residual is None:
            return brrr.layer_norm(x, normalized_shape, weight, bias, eps), None
        return brrr.add_layer_norm(x, residual, normalized_shape, weight, bias, eps)
    if residual is None:
        return brrr.rms_norm(x, normalized_shape, weight, eps, cast_order=cast_order), None
    return brrr.add_rms_norm(x, residual, normalized_shape, weight, eps, cast_order=cast_order)


def check(name, actual, expected, dtype, slack=1.0, scale=0.0):
    """Elementwise against the float64 reference with the storage dtype's tolerance, its absolute
    part relative to the larger of the reference's largest value and `scale`, the size of the
    terms the result is made of (a rounding error of any fp32 evaluation is relative to those)."""
    tol = TOLERANCE[dtype]
    actual64, expected64 = actual.detach().to("cpu", torch.float64), expected.detach().to("cpu", torch.float64)
    assert actual64.shape == expected64.shape, (name, actual64.shape, expected64.shape)
    assert not torch.isnan(actual64).any(), f"{name}: NaN in brrr's result"
    magnitude = max(expected64.abs().max().item() if expected64.numel() else 0.0, float(scale), 1.0)
    torch.testing.assert_close(actual64, expected64, rtol=tol["rtol"] * slack, atol=tol["atol"] * slack * magnitude,
                               msg=lambda m: f"{name}: {m}")


def gradient_scales(kind, dtype, h, ns, weight, eps, upstream):
    """The size of the terms of each gradient (x, residual, weight, bias): rstd * |g * w| (+ |g_h|)
    for grad_x, whose terms cancel when g is nearly parallel to xhat (as with one column); sums over
    rows of |g * xhat| and |g| for grad_weight and grad_bias."""
    dims = tuple(range(-(1 if isinstance(ns, int) else len(ns)), 0))
    eps = default_eps(kind, dtype) if eps is None else eps
    centred = h - h.mean(dims, keepdim=True) if kind == "layer_norm" else h
    rstd = (centred.pow(2).mean(dims, keepdim=True) + eps).rsqrt()
    g = upstream[0] * (1.0 if weight is None else weight.detach())
    dx = (rstd * g.abs() + (upstream[1].abs() if len(upstream) > 1 else 0.0)).max().item()
    rows = tuple(range(h.dim() - len(dims)))
    dw = (upstream[0] * centred * rstd).abs().sum(rows).max().item() if rows else 0.0
    db = upstream[0].abs().sum(rows).max().item() if rows else 0.0
    return dx, dx, dw, db


def params(kind, affine, cols_shape, dtype, device, param_dtype=None):
    pd = param_dtype or dtype
    w = random(cols_shape, pd, device) if affine in ("weight", "both") else None
    b = random(cols_shape, pd, device) if affine in ("bias", "both") and kind == "layer_norm" else None
    return w, b


def compare(kind, dtype, x, residual, ns, weight, bias, eps=None, cast_order="torch", slack=1.0, grads=True, offset=0.0):
    """Run brrr and the reference on the same values; compare outputs and every gradient."""
    # detach() keeps each view's strides (clone() would densify strided views)
    leaves = [t if t is None else t.detach().requires_grad_(grads) for t in (x, residual, weight, bias)]
    refs = [t if t is None else t.detach().to("cpu", torch.float64).requires_grad_(grads)
            for t in (x, residual, weight, bias)]
    out, h = call(kind, leaves[0], leaves[1], ns, leaves[2], leaves[3], eps, cast_order, offset)
    ref_out, ref_h = reference(kind, dtype, refs[0], refs[1], ns, refs[2], refs[3], eps, cast_order == "llama", offset)
    check("out", out, ref_out, dtype, slack)
    assert out.dtype == x.dtype and out.shape == x.shape
    if h is not None:
        assert torch.equal(h.cpu(), (x + residual).cpu()), "residual_out differs from x + residual"
    if not grads:
        return
    g_out = random(x.shape, dtype, x.device)
    outputs, ref_outputs, upstream = [out], [ref_out], [g_out]
    if h is not None:
        g_h = random(x.shape, dtype, x.device)
        outputs.append(h)
        ref_outputs.append(ref_h)
        upstream.append(g_h)
    torch.autograd.backward(outputs, upstream)
    torch.autograd.backward(ref_outputs, [g.to("cpu", torch.float64) for g in upstream])
    scales = gradient_scales(kind, dtype, ref_h.detach(), ns, None if refs[2] is None else refs[2] + offset, eps,
                             [g.to("cpu", torch.float64) for g in upstream])
    for name, leaf, ref, scale in zip(("grad_x", "grad_residual", "grad_weight", "grad_bias"), leaves, refs, scales):
        if leaf is not None:
            check(name, leaf.grad, ref.grad, dtype, slack, scale)
            assert leaf.grad.dtype == leaf.dtype


# ---- outputs and gradients ---------------------------------------------------------------------

def _cases():
    for kind in KINDS:
        for cols, many in SIZES.items():
            for rows in (1, many):
                for affine in AFFINE[kind]:
                    yield kind, cols, rows, affine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,cols,rows,affine", list(_cases()))
def test_matches_torch(device, dtype, kind, cols, rows, affine):
    x = random((rows, cols), dtype, device)
    w, b = params(kind, affine, (cols,), dtype, device)
    compare(kind, dtype, x, None, (cols,), w, b)


# The CUDA backward's block shapes switch with the row length: the lanes of its summation order
# halve past 1024, 2048 and 4096 columns (brrr_norm_lanes), the threads of a row round up to 32s
# past 32 packs, a thread holds 16 elements past 8192 (bfloat16; float32 past 4096 at 4 a pack),
# and rows past 1024 threads at that go to the generic kernels. Rows: 37 leave the last chunk
# of 8 rows short of the lanes; 3001 make 251 chunks of 12.
EDGE_COLS = [1, 3, 8, 9, 127, 256, 257, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192,
             8200, 16384, 16392, 65537]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", EDGE_COLS)
def test_backward_block_shape_edges(device, dtype, kind, cols):
    for rows in (37, 3001) if device == "cuda" and cols <= 16392 else (37,):
        x = random((rows, cols), dtype, device)
        w, b = params(kind, "both", (cols,), dtype, device)
        compare(kind, dtype, x, None, (cols,), w, b)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", [9, 768, 1024, 1025, 2049, 4096, 4097, 8192, 16384])
@pytest.mark.parametrize("residual", [False, True])
def test_parameter_gradients_are_the_same_bits_on_every_path(kind, cols, residual):
    """grad_weight and grad_bias are summed in an order fixed by the shape (brrr_cuda.h): on the
    16-byte fast path, its single-element form (rows misaligned by one element) and the generic
    kernels (strided columns) each run gives the same bits as the last, and the paths agree to
    rounding (not bitwise: each forward path sums the row statistics in its own order, and the
    backward reads them)."""
    dtype, rows = torch.bfloat16, 2053
    x, g = random((rows, cols), dtype, "cuda"), random((rows, cols), dtype, "cuda")
    r = random((rows, cols), dtype, "cuda") if residual else None
    w, b = params(kind, "both", (cols,), torch.float32, "cuda")

    def grads(layout):
        def place(t):
            if t is None or layout == "aligned":
                return t
            if layout == "misaligned":  # rows one element off 16 bytes
                return torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].view(t.shape).copy_(t)
            return torch.empty(rows, 2 * cols, dtype=t.dtype, device="cuda")[:, ::2].copy_(t)  # strided columns
        leaves = [t if t is None else t.detach().requires_grad_() for t in (place(x), place(r), w, b)]
        out, h = call(kind, leaves[0], leaves[1], (cols,), leaves[2], leaves[3])
        torch.autograd.backward([out] + ([h] if h is not None else []), [place(g)] + ([place(g)] if h is not None else []))
        return [t.grad for t in leaves[2:] if t is not None]

    expected = grads("aligned")
    for layout in ("aligned", "misaligned", "strided"):
        first = grads(layout)
        for got, again, want in zip(first, grads(layout), expected):
            assert torch.equal(got, again), layout
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()), msg=layout)


def _gradients_under(monkeypatch, env, kind, x, r, w, b, g):
    """Every gradient (x, residual, weight, bias; None where absent) of one forward+backward on
    CUDA with the environment variables of `env` set around the calls."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        leaves = [t if t is None else t.detach().requires_grad_() for t in (x, r, w, b)]
        out, h = call(kind, leaves[0], leaves[1], (x.shape[-1],), leaves[2], leaves[3])
        torch.autograd.backward([out] + ([h] if h is not None else []), [g] + ([g * 0.5] if h is not None else []))
        torch.cuda.synchronize()
        return [None if t is None else t.grad for t in leaves]
    finally:
        for name in env:
            monkeypatch.delenv(name)


def _assert_same_bits(got, want, what):
    for name, a, e in zip(("grad_x", "grad_residual", "grad_weight", "grad_bias"), got, want):
        assert (a is None) == (e is None), (what, name)
        if a is not None:
            assert torch.equal(a, e), (what, name, (a.double() - e.double()).abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", [8196, 12288, 16384])
def test_backward_weight_from_global_memory(monkeypatch, kind, residual, cols):
    """float32 rows past 8192 columns: where the backward's ring and its copy of the weight leave
    no room for one stage of the ring in shared memory (the fused forms' three rows at 16384
    columns), the fast path reads the weight from global memory. Against the float64 reference,
    with the default (unset, = auto); BRRR_NORM_BWD_WEIGHT=global (every width here) gives the same
    weight and bias gradient bits as auto (the same order, brrr_cuda.h), grad_x to rounding; =smem
    keeps the copy (the generic kernels where none fits): the same."""
    dtype = torch.float32
    monkeypatch.delenv("BRRR_NORM_BWD_WEIGHT", raising=False)
    for rows in (3, 37):
        x = random((rows, cols), dtype, "cuda")
        r = random((rows, cols), dtype, "cuda") if residual else None
        w, b = params(kind, "both", (cols,), dtype, "cuda")
        compare(kind, dtype, x, r, (cols,), w, b)
    x, g = random((203, cols), dtype, "cuda"), random((203, cols), dtype, "cuda")
    r = random((203, cols), dtype, "cuda") if residual else None
    w, b = params(kind, "both", (cols,), dtype, "cuda")
    default = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_WEIGHT": "auto"}, kind, x, r, w, b, g)
    for place in ("global", "smem"):
        other = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_WEIGHT": place}, kind, x, r, w, b, g)
        _assert_same_bits(other[2:], default[2:], place)
        for a, e in zip(other[:2], default[:2]):
            if a is not None:
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * float(e.abs().max()))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", [8192, 8200, 12296, 16376, 16384])
def test_backward_split_over_a_cluster(monkeypatch, dtype, kind, residual, cols):
    """Rows past 8192 columns (one summation lane): on sm_90 two blocks of a cluster share each
    row, rank 0 taking the first half rounded up to a 16-byte pack (8200, 12296 and 16376 leave
    the halves unequal) with BRRR_NORM_BWD_SPLIT=1 (unset: float32 rows with a bias gradient); =0
    runs one 1024-thread block. Against the float64 reference, for row counts that leave one chunk
    (1, 3) and many; the weight and bias gradients the same bits either way (the same order),
    grad_x to rounding (its row sums are added in another order). BRRR_NORM_BWD_KERNEL=ring: the
    half rows here go to norm_bwd_bulk_kernel's wide rows otherwise (test_bwd_bulk_wide_rows)."""
    monkeypatch.setenv("BRRR_NORM_BWD_KERNEL", "ring")
    monkeypatch.setenv("BRRR_NORM_BWD_SPLIT", "1")
    for rows in (1, 3, 37):
        x = random((rows, cols), dtype, "cuda")
        r = random((rows, cols), dtype, "cuda") if residual else None
        w, b = params(kind, "both", (cols,), dtype, "cuda")
        compare(kind, dtype, x, r, (cols,), w, b)
    x, g = random((301, cols), dtype, "cuda"), random((301, cols), dtype, "cuda")
    r = random((301, cols), dtype, "cuda") if residual else None
    w, b = params(kind, "both", (cols,), dtype, "cuda")
    split = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_SPLIT": "1"}, kind, x, r, w, b, g)
    whole = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_SPLIT": "0"}, kind, x, r, w, b, g)
    _assert_same_bits(split[2:], whole[2:], "split")
    for a, e in zip(split[:2], whole[:2]):
        if a is not None:
            torch.testing.assert_close(a.float(), e.float(), rtol=TOLERANCE[dtype]["rtol"],
                                       atol=TOLERANCE[dtype]["atol"] * float(e.float().abs().max()))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", [8, 768, 1024, 4096, 16384])
def test_layer_norm_backward_shift_word(monkeypatch, dtype, residual, cols):
    """The half LayerNorm backward copies each row's shift (its first element) as the 4-byte word
    that holds it, asynchronously (the default, = word); BRRR_NORM_BWD_SHIFT=load copies the
    element itself: the same bits. The shift is the row's first element, not its neighbour: rows whose first two
    elements differ, against the float64 reference too."""
    x, g = random((301, cols), dtype, "cuda"), random((301, cols), dtype, "cuda")
    x[:, 1] = x[:, 0] + 2.0
    r = random((301, cols), dtype, "cuda") if residual else None
    w, b = params("layer_norm", "both", (cols,), dtype, "cuda")
    word = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_SHIFT": "word"}, "layer_norm", x, r, w, b, g)
    load = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_SHIFT": "load"}, "layer_norm", x, r, w, b, g)
    _assert_same_bits(word, load, "shift")
    monkeypatch.delenv("BRRR_NORM_BWD_SHIFT", raising=False)
    compare("layer_norm", dtype, x, r, (cols,), w, b)


# The kernels behind the switches, each value forced: BRRR_NORM_BWD_KERNEL=bulk
# (norm_bwd_bulk_kernel, sm_90; the float16 and bfloat16 default) and =ring (norm_bwd_kernel; the
# float32 and float64 default) for every dtype; BRRR_NORM_FWD_KERNEL=bulk (norm_fwd_bulk_kernel,
# sm_90) and =rows (norm_fwd_kernel, the fused forms' default) for float16 and bfloat16,
# where they differ (float32 and float64 run norm_fwd_kernel either way). Widths: bfloat16 rows
# whose backward group is one warp (256), two warps with the second one's packs partly past the
# row (768), three and nine warps (1032, 4104: group sums over warp counts that are not powers of
# two), whole rows (5120, 8192; 4096 in the bits tests below), forward rows of 1, 3, 4 and 5 packs
# a thread (the bulk forward's of 1, 3, 3 with packs partly past the row, 3 and 4); and a width
# where none applies and the defaults run (4097: single elements).
BULK_COLS = [256, 768, 1032, 4104, 5120, 8192, 4097]
CANDIDATES = {"bwd_bulk": ("BRRR_NORM_BWD_KERNEL", "bulk"), "bwd_ring": ("BRRR_NORM_BWD_KERNEL", "ring"),
              "fwd_bulk": ("BRRR_NORM_FWD_KERNEL", "bulk"), "fwd_rows": ("BRRR_NORM_FWD_KERNEL", "rows"),
              "fwd_flat": ("BRRR_NORM_FWD_KERNEL", "flat")}


def _candidate_cases():
    """(candidate, dtype) pairs: the forward's values only where they differ (bulk and rows:
    float16, bfloat16; flat: every dtype but float64, which it leaves to norm_fwd_kernel)."""
    for candidate in CANDIDATES:
        for dtype in DTYPES:
            if (not candidate.startswith("fwd_") or dtype in HALF_DTYPES
                    or (candidate == "fwd_flat" and dtype != torch.float64)):
                yield pytest.param(candidate, dtype, id=f"{candidate}-{dtype}")


def _bulk_kinds():
    yield "layer_norm", "torch"
    yield "rms_norm", "torch"
    yield "rms_norm", "llama"


@pytest.mark.cuda
@pytest.mark.parametrize("candidate,dtype", list(_candidate_cases()))
@pytest.mark.parametrize("kind,cast_order", list(_bulk_kinds()))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", BULK_COLS)
def test_candidate_kernels(monkeypatch, candidate, dtype, kind, cast_order, residual, cols):
    """Both backward kernels and both forward kernels against the float64 reference: row counts
    that leave one chunk shorter than the lanes (1, 3), several chunks (37) and many (301); every
    affine form, float32 parameters for half inputs, RMSNorm's weight offset, rows with padding
    between them."""
    monkeypatch.setenv(*CANDIDATES[candidate])
    _compare_every_form(kind, cast_order, dtype, residual, cols, (1, 3, 37, 301))


def _compare_every_form(kind, cast_order, dtype, residual, cols, row_counts):
    """Against the float64 reference on CUDA: rows of each count, then at 37 rows every affine
    form, float32 parameters for half inputs, RMSNorm's weight offset, rows 64 elements apart, and
    a weight not 16-byte aligned."""
    for rows in row_counts:
        x = random((rows, cols), dtype, "cuda")
        r = random((rows, cols), dtype, "cuda") if residual else None
        w, b = params(kind, "both", (cols,), dtype, "cuda")
        compare(kind, dtype, x, r, (cols,), w, b, cast_order=cast_order)
    x = random((37, cols), dtype, "cuda")
    r = random((37, cols), dtype, "cuda") if residual else None
    for affine in AFFINE[kind]:
        w, b = params(kind, affine, (cols,), dtype, "cuda")
        compare(kind, dtype, x, r, (cols,), w, b, cast_order=cast_order)
    if dtype in HALF_DTYPES:
        w, b = params(kind, "both", (cols,), dtype, "cuda", param_dtype=torch.float32)
        compare(kind, dtype, x, r, (cols,), w, b, cast_order=cast_order)
    if kind == "rms_norm":
        w = random((cols,), dtype, "cuda", -0.5, 0.5)
        compare(kind, dtype, x, r, (cols,), w, None, cast_order=cast_order, offset=1.0)
    w, b = params(kind, "both", (cols,), dtype, "cuda")
    padded = torch.empty(37, cols + 64, dtype=dtype, device="cuda")[:, :cols].copy_(x)
    compare(kind, dtype, padded, r, (cols,), w, b, cast_order=cast_order)
    unaligned = torch.empty(cols + 1, dtype=w.dtype, device="cuda")[1:].copy_(w)
    compare(kind, dtype, x, r, (cols,), unaligned, b, cast_order=cast_order)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", [256, 768, 1032, 4096, 5120, 8192])
def test_candidate_bwd_bulk_bits(monkeypatch, dtype, kind, residual, cols):
    """BRRR_NORM_BWD_KERNEL=bulk gives the same bits run to run and with BRRR_NORM_BWD_REFILL=own,
    and the same weight and bias gradient bits as the default (=ring: the same order,
    brrr_cuda.h); grad_x and grad_residual agree to rounding (the row sums are added in another
    order). 2053 rows: 229 chunks of 9 rows, the last one short."""
    rows = 2053
    x, g = random((rows, cols), dtype, "cuda"), random((rows, cols), dtype, "cuda")
    r = random((rows, cols), dtype, "cuda") if residual else None
    w, b = params(kind, "both", (cols,), dtype, "cuda")
    bulk = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_KERNEL": "bulk"}, kind, x, r, w, b, g)
    again = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_KERNEL": "bulk"}, kind, x, r, w, b, g)
    own = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_KERNEL": "bulk", "BRRR_NORM_BWD_REFILL": "own"},
                           kind, x, r, w, b, g)
    ring = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_KERNEL": "ring"}, kind, x, r, w, b, g)
    _assert_same_bits(again, bulk, "bulk, run to run")
    _assert_same_bits(own, bulk, "bulk, each stage refilled past its own row")
    _assert_same_bits(bulk[2:], ring[2:], "bulk against ring")
    for a, e in zip(bulk[:2], ring[:2]):
        if a is not None:
            torch.testing.assert_close(a.float(), e.float(), rtol=TOLERANCE[dtype]["rtol"],
                                       atol=TOLERANCE[dtype]["atol"] * float(e.float().abs().max()))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_bwd_kernel_default(monkeypatch, dtype, kind):
    """Unset, BRRR_NORM_BWD_KERNEL means bulk for float16 and bfloat16 and ring for float32 and
    float64: the default's gradients have that value's bits. At 4096 columns a row's group has
    several warps, whose row sums the two kernels add in different orders, so grad_x tells them
    apart (checked too)."""
    monkeypatch.delenv("BRRR_NORM_BWD_KERNEL", raising=False)
    x, g = random((2053, 4096), dtype, "cuda"), random((2053, 4096), dtype, "cuda")
    w, b = params(kind, "both", (4096,), dtype, "cuda")
    default = _gradients_under(monkeypatch, {}, kind, x, None, w, b, g)
    bulk = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_KERNEL": "bulk"}, kind, x, None, w, b, g)
    ring = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_KERNEL": "ring"}, kind, x, None, w, b, g)
    if dtype != torch.float64:  # float64's launch at 4096 columns is not one bulk_applies to: ring either way
        assert not torch.equal(bulk[0], ring[0]), "bulk and ring gave the same grad_x: the test cannot tell them apart"
    chosen = bulk if dtype in HALF_DTYPES else ring
    _assert_same_bits(default, chosen, "default")


# Half rows of one summation lane past the 2-pack layout's 512 threads: norm_bwd_bulk_kernel's wide
# rows, 4 packs a thread. The first and last widths (8200: 1025 packs over 288 threads, the last
# thread's packs past the row; 16384: 512 threads, every pack in the row), and two between.
WIDE_COLS = [8200, 12296, 16376, 16384]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("kind,cast_order", list(_bulk_kinds()))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", WIDE_COLS)
def test_bwd_bulk_wide_rows(monkeypatch, dtype, kind, cast_order, residual, cols):
    """Unset (= bulk for halves), BRRR_NORM_BWD_KERNEL runs the wide rows in norm_bwd_bulk_kernel
    on sm_90, xhat and g recomputed in its second pass, the weight from its copy in shared memory
    or from global memory (where the copy does not fit, and with BRRR_NORM_BWD_WEIGHT=global: the
    same bits): against the float64 reference for row counts of one chunk and several, every
    affine form, float32 parameters, RMSNorm's weight offset, padded rows and a weight not 16-byte
    aligned (which leaves the launch to norm_bwd_kernel); the same bits run to run and with
    BRRR_NORM_BWD_REFILL=own and =sum, and the same weight and bias gradient bits as =ring
    (norm_bwd_kernel's 1024 threads: the same order, brrr_cuda.h), grad_x to rounding."""
    monkeypatch.delenv("BRRR_NORM_BWD_KERNEL", raising=False)
    _compare_every_form(kind, cast_order, dtype, residual, cols, (1, 3, 37))
    if cast_order != "torch":
        return
    x, g = random((301, cols), dtype, "cuda"), random((301, cols), dtype, "cuda")
    r = random((301, cols), dtype, "cuda") if residual else None
    w, b = params(kind, "both", (cols,), dtype, "cuda")
    default = _gradients_under(monkeypatch, {}, kind, x, r, w, b, g)
    again = _gradients_under(monkeypatch, {}, kind, x, r, w, b, g)
    ring = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_KERNEL": "ring"}, kind, x, r, w, b, g)
    from_l2 = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_WEIGHT": "global"}, kind, x, r, w, b, g)
    own = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_REFILL": "own"}, kind, x, r, w, b, g)
    by_sum = _gradients_under(monkeypatch, {"BRRR_NORM_BWD_REFILL": "sum"}, kind, x, r, w, b, g)
    _assert_same_bits(again, default, "wide rows, run to run")
    _assert_same_bits(from_l2, default, "wide rows, the weight from global memory")
    _assert_same_bits(own, default, "wide rows, each stage refilled past its own row")
    _assert_same_bits(by_sum, default, "wide rows, each stage refilled past the next row's sum")
    _assert_same_bits(default[2:], ring[2:], "wide rows against ring")
    for a, e in zip(default[:2], ring[:2]):
        if a is not None:
            torch.testing.assert_close(a.float(), e.float(), rtol=TOLERANCE[dtype]["rtol"],
                                       atol=TOLERANCE[dtype]["atol"] * float(e.float().abs().max()))
    if torch.cuda.get_device_capability()[0] >= 9:
        names = _kernels_launched(lambda: _gradients_under(monkeypatch, {}, kind, x, r, w, b, g), "norm_bwd")
        assert any("norm_bwd_bulk_kernel" in n for n in names), names
        assert not any("norm_bwd_kernel" in n for n in names), names


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("residual,cols,own", [(False, 16384, True), (True, 16384, False), (False, 12288, False),
                                               (False, 4096, False)])
def test_bwd_refill_default(monkeypatch, kind, residual, cols, own):
    """Unset, BRRR_NORM_BWD_REFILL means `own` for the bulk backward's rings of two stages of x and
    dy (bf16 rows of 16384 columns: two stages beside the weight's copy), `sum` for three stages
    (12288, 4096) or three rows (a residual gradient); the variable overrides it. Read from the
    kernel's last template argument (kRefillOwn) in the profiler's names."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk backward runs on sm_90 and later")
    monkeypatch.delenv("BRRR_NORM_BWD_KERNEL", raising=False)
    monkeypatch.delenv("BRRR_NORM_BWD_REFILL", raising=False)
    dtype = torch.bfloat16
    x, g = random((64, cols), dtype, "cuda"), random((64, cols), dtype, "cuda")
    r = random((64, cols), dtype, "cuda") if residual else None
    w, b = params(kind, "both", (cols,), dtype, "cuda")

    def refill_own(env):
        names = _kernels_launched(lambda: _gradients_under(monkeypatch, env, kind, x, r, w, b, g), "norm_bwd")
        flags = {re.search(r"norm_bwd_bulk_kernel<.*, (true|false)>", n).group(1) for n in names
                 if "norm_bwd_bulk_kernel" in n}
        assert len(flags) == 1, names
        return flags.pop() == "true"

    assert refill_own({}) == own
    assert refill_own({"BRRR_NORM_BWD_REFILL": "own"})
    assert not refill_own({"BRRR_NORM_BWD_REFILL": "sum"})


_FORWARD_NAMES = ("out", "residual_out", "grad_x", "grad_residual", "grad_weight", "grad_bias")


def _forward_under(monkeypatch, env, kind, cast_order, x, r, w, b, g):
    """out, residual_out (None for the plain forms) and every gradient (x, residual, weight,
    bias) of one forward+backward on CUDA with the environment variables of `env` set around the
    calls (BRRR_NORM_FWD_KERNEL unset unless `env` names it)."""
    monkeypatch.delenv("BRRR_NORM_FWD_KERNEL", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        leaves = [t if t is None else t.detach().requires_grad_() for t in (x, r, w, b)]
        out, h = call(kind, leaves[0], leaves[1], (x.shape[-1],), leaves[2], leaves[3], cast_order=cast_order)
        torch.autograd.backward([out] + ([h] if h is not None else []), [g] + ([g * 0.5] if h is not None else []))
        torch.cuda.synchronize()
        return [out.detach(), h] + [None if t is None else t.grad for t in leaves]
    finally:
        for name in env:
            monkeypatch.delenv(name)


def _assert_same_forward(got, want, what, names=_FORWARD_NAMES):
    for name, a, e in zip(names, got, want):
        assert (a is None) == (e is None), (what, name)
        if a is not None:
            assert torch.equal(a, e), (what, name, (a.double() - e.double()).abs().max().item())


# Half rows that norm_fwd_kernel's default layout gives 5 packs a thread (kHalfFivePacks; bfloat16
# 1032, 4104, 5120 and 8200 columns: 129, 513, 640 and 1025 packs of 8) run in norm_fwd_bulk_kernel
# at twice the threads and 3 packs a thread, BRRR_NORM_FWD_PACKS=pow2's layout: the row's sums
# group its elements otherwise, so there BRRR_NORM_FWD_KERNEL=bulk's bits differ from the
# default's (rows). Bulk's rows that fill every thread's packs (its kFull kernels: 256, 768, 8192,
# 12288 and 16384 columns below) and rows with packs partly past the row (the five-pack widths)
# are both among the widths of the bits test.
FIVE_PACK_COLS = [1032, 4104, 5120, 8200]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("kind,cast_order", list(_bulk_kinds()))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", [256, 768] + FIVE_PACK_COLS + [8192, 12288, 16384])
def test_fwd_bulk_has_the_bits_of_rows_at_its_layout(monkeypatch, dtype, kind, cast_order, residual, cols):
    """BRRR_NORM_FWD_KERNEL=bulk does norm_fwd_kernel's arithmetic in its order at the same row
    layout: the same bits as =rows with BRRR_NORM_FWD_PACKS=pow2 (bulk's layout at every width) in
    out, residual_out and, through the saved statistics, every gradient, and the same bits run to
    run; with a bias and without (its own instance), float32 parameters. 20011 rows up to 1032
    columns and 2053 past that: several rows a block at every width, each block's ring reused."""
    rows = 20011 if cols <= 1032 else 2053
    x, g = random((rows, cols), dtype, "cuda"), random((rows, cols), dtype, "cuda")
    r = random((rows, cols), dtype, "cuda") if residual else None
    forms = [("weight", None), ("both", None), ("both", torch.float32)] if kind == "layer_norm" else [("weight", None)]
    for affine, param_dtype in forms:
        w, b = params(kind, affine, (cols,), dtype, "cuda", param_dtype=param_dtype)
        args = (kind, cast_order, x, r, w, b, g)
        bulk = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "bulk"}, *args)
        again = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "bulk"}, *args)
        rows_ = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "rows", "BRRR_NORM_FWD_PACKS": "pow2"}, *args)
        _assert_same_forward(again, bulk, (affine, "bulk, run to run"))
        _assert_same_forward(bulk, rows_, (affine, "bulk against rows at pow2's layout"))


# BRRR_NORM_FWD_VALUES=16, a measuring switch: half rows of 16-byte packs at 2 packs a thread where
# 512 threads hold them (up to 8192 columns). Widths: 768 and 1032 (packs partly past the row, one
# of them at a group of 128), 4096 and 8192 (whole rows: bulk's kFull kernels), 12288 (past 512
# threads of 2 packs: the default's layout, which both kernels share there; not 8200, a five-pack
# width, where they differ by design: see FIVE_PACK_COLS).
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("kind,cast_order", list(_bulk_kinds()))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", [768, 1032, 4096, 8192, 12288])
def test_fwd_at_sixteen_values_a_thread(monkeypatch, dtype, kind, cast_order, residual, cols):
    """Under BRRR_NORM_FWD_VALUES=16 bulk and rows run one layout: the same bits in out,
    residual_out and every gradient, run to run; and the float64 reference's values."""
    rows = 2053
    x, g = random((rows, cols), dtype, "cuda"), random((rows, cols), dtype, "cuda")
    r = random((rows, cols), dtype, "cuda") if residual else None
    w, b = params(kind, "both", (cols,), dtype, "cuda")
    args = (kind, cast_order, x, r, w, b, g)
    bulk = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "bulk", "BRRR_NORM_FWD_VALUES": "16"}, *args)
    again = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "bulk", "BRRR_NORM_FWD_VALUES": "16"}, *args)
    rows_ = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "rows", "BRRR_NORM_FWD_VALUES": "16"}, *args)
    _assert_same_forward(again, bulk, "bulk at 16 values, run to run")
    _assert_same_forward(bulk, rows_, "bulk against rows at 16 values")
    monkeypatch.setenv("BRRR_NORM_FWD_VALUES", "16")
    compare(kind, dtype, x, r, (cols,), w, b, cast_order=cast_order)


# norm_fwd_bulk_kernel's grid and ring under BRRR_NORM_FWD_WAVES and BRRR_NORM_FWD_STAGES: a grid
# of several waves, one stage, stages past the default's 4 (at 8192 columns with a residual, 8 are
# more than shared memory holds: an H200's 227 KB a block take 7).
BULK_GRID_AND_RING = {"waves3": {"BRRR_NORM_FWD_WAVES": "3"}, "stages1": {"BRRR_NORM_FWD_STAGES": "1"},
                      "stages5": {"BRRR_NORM_FWD_STAGES": "5"},
                      "stages8-waves2": {"BRRR_NORM_FWD_STAGES": "8", "BRRR_NORM_FWD_WAVES": "2"}}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", [768, 4104, 8192])
@pytest.mark.parametrize("env", list(BULK_GRID_AND_RING))
def test_fwd_bulk_grid_and_ring(monkeypatch, dtype, residual, cols, env):
    """The bulk forward's grid and ring change no row's arithmetic: under each setting of
    BULK_GRID_AND_RING, LayerNorm (weight and bias) and RMSNorm have the bits of =rows at pow2's
    layout in out, residual_out and, through the saved statistics, every gradient. 20011 rows at
    768 columns and 4099 past that: every block reuses its ring's stages."""
    rows = 20011 if cols <= 1032 else 4099
    x, g = random((rows, cols), dtype, "cuda"), random((rows, cols), dtype, "cuda")
    r = random((rows, cols), dtype, "cuda") if residual else None
    for kind in ("layer_norm", "rms_norm"):
        w, b = params(kind, "both", (cols,), dtype, "cuda")
        args = (kind, "torch", x, r, w, b, g)
        bulk = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "bulk", **BULK_GRID_AND_RING[env]}, *args)
        rows_ = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "rows", "BRRR_NORM_FWD_PACKS": "pow2"}, *args)
        _assert_same_forward(bulk, rows_, (kind, env, "bulk against rows at pow2's layout"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_fwd_kernel_default(monkeypatch, dtype, kind):
    """Unset, BRRR_NORM_FWD_KERNEL means rows (norm_fwd_kernel) at 5120 columns (float32 too:
    test_float32_forward_default); float32 and float64 run norm_fwd_kernel under =bulk. The default's outputs and gradients have that kernel's
    bits. At 5120 columns (FIVE_PACK_COLS) the two half kernels group a row's sums differently, so
    their results tell them apart (checked too)."""
    x, g = random((2053, 5120), dtype, "cuda"), random((2053, 5120), dtype, "cuda")
    w, b = params(kind, "both", (5120,), dtype, "cuda")
    args = (kind, "torch", x, None, w, b, g)
    default = _forward_under(monkeypatch, {}, *args)
    bulk = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "bulk"}, *args)
    rows_ = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "rows"}, *args)
    if dtype in HALF_DTYPES:
        assert not all(torch.equal(a, e) for a, e in zip(bulk[:3], rows_[:3]) if a is not None), \
            "bulk and rows gave the same bits: the test cannot tell them apart"
        _assert_same_forward(default, rows_, "default")
    else:
        _assert_same_forward(bulk, rows_, "bulk against rows")
        _assert_same_forward(default, rows_, "default")


_OP_NAMES = ("out", "residual_out", "mean", "rstd")


def _kernels_launched(fn, part):
    """The names of the kernels holding `part` (norm_fwd, norm_bwd) that fn() launches, from the
    profiler's device events."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name() for e in prof.profiler.kineto_results.events()
             if e.device_type() == torch.autograd.DeviceType.CUDA and part in e.name()}
    assert names, f"the profiler saw no {part} kernel"
    return names


# Half widths of every forward layout class: one-warp groups (256), 3 packs a thread (768), 4
# (2048, 4096, 8192, 16384), a thread's last pack past the row (776: 97 packs over 32 threads of
# 4), and the five-pack widths (FIVE_PACK_COLS), where the plain forms stay on norm_fwd_kernel.
HALF_DEFAULT_COLS = [256, 768, 776, 2048, 4096, 8192, 12288, 16384] + FIVE_PACK_COLS


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("kind,cast_order", list(_bulk_kinds()))
@pytest.mark.parametrize("cols", HALF_DEFAULT_COLS)
def test_half_forward_default(monkeypatch, dtype, kind, cast_order, cols):
    """Unset, BRRR_NORM_FWD_KERNEL runs the plain half forms in norm_fwd_bulk_kernel (on sm_90)
    but at the five-pack widths, and the fused residual forms there too past 8192 columns, else in
    norm_fwd_kernel; the fused form's
    out, residual_out and statistics have the bits of the plain form on its sum (remat's
    recompute relies on it), and the plain form's out is right against float64."""
    monkeypatch.delenv("BRRR_NORM_FWD_KERNEL", raising=False)
    eps = 1e-5 if kind == "layer_norm" else 1e-6
    x, r = random((301, cols), dtype, "cuda"), random((301, cols), dtype, "cuda")
    w, b = params(kind, "both", (cols,), dtype, "cuda")
    fused = _op_forward(kind, cast_order, x, r, w, b, eps)
    out, h, mean, rstd = fused
    plain = _op_forward(kind, cast_order, h, None, w, b, eps)
    _assert_same_forward(plain, (out, None, mean, rstd), "the plain form on the sum", _OP_NAMES)
    refs = [t.to("cpu", torch.float64) for t in (h, w)] + [None if b is None else b.to("cpu", torch.float64)]
    check("out", plain[0], reference(kind, dtype, refs[0], None, (cols,), refs[1], refs[2], eps,
                                     cast_order == "llama")[0], dtype)
    if torch.cuda.get_device_capability()[0] < 9:
        return
    five = cols in FIVE_PACK_COLS
    plain_kernels = _kernels_launched(lambda: _op_forward(kind, cast_order, h, None, w, b, eps), "norm_fwd")
    fused_kernels = _kernels_launched(lambda: _op_forward(kind, cast_order, x, r, w, b, eps), "norm_fwd")
    want = "norm_fwd_kernel" if five else "norm_fwd_bulk_kernel"
    assert all(want in n for n in plain_kernels), (cols, plain_kernels)
    want = "norm_fwd_bulk_kernel" if not five and cols > 8192 else "norm_fwd_kernel"
    assert all(want in n for n in fused_kernels), (cols, fused_kernels)


def _op_forward(kind, cast_order, x, r, w, b, eps):
    """The forward autograd records (torch.ops.brrr's, which saves the statistics): (out,
    residual_out or None, LayerNorm's mean or None, rstd)."""
    ops, cols, llama = torch.ops.brrr, [x.shape[-1]], cast_order == "llama"
    if kind == "layer_norm":
        if r is None:
            out, mean, rstd = ops.layer_norm(x, cols, w, b, eps)
            return out, None, mean, rstd
        return tuple(ops.add_layer_norm(x, r, cols, w, b, eps))
    if r is None:
        out, rstd = ops.rms_norm(x, cols, w, eps, llama, 0.0)
        return out, None, None, rstd
    out, h, rstd = ops.add_rms_norm(x, r, cols, w, eps, llama, 0.0)
    return out, h, None, rstd


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("kind,cast_order", list(_bulk_kinds()))
@pytest.mark.parametrize("cols", FIVE_PACK_COLS)
@pytest.mark.parametrize("kernel", ["bulk", "rows", "flat"])
def test_fwd_at_five_pack_widths(monkeypatch, dtype, kind, cast_order, cols, kernel):
    """Where =bulk's bits differ from the default's, =rows (FIVE_PACK_COLS), each of the two: out
    and the statistics the backward reads (LayerNorm's mean minus the row's first element, rstd)
    against float64, for the plain and the fused residual forms; the same bits run to run; and the
    same out bits from every path that computes it: the op autograd records (saving the
    statistics), the call without autograd (saving none), the fused residual form and the plain
    form on its sum (as brrr.patch's fused add and remat's recomputation rely on), whose
    statistics are the same bits too. 2053 rows: several a block."""
    if kernel in ("bulk", "flat"):
        monkeypatch.setenv("BRRR_NORM_FWD_KERNEL", kernel)
    else:
        monkeypatch.delenv("BRRR_NORM_FWD_KERNEL", raising=False)
    eps = 1e-5 if kind == "layer_norm" else 1e-6
    x, r = random((2053, cols), dtype, "cuda"), random((2053, cols), dtype, "cuda")
    w, b = params(kind, "both", (cols,), dtype, "cuda")
    for residual in (None, r):
        got = _op_forward(kind, cast_order, x, residual, w, b, eps)
        _assert_same_forward(_op_forward(kind, cast_order, x, residual, w, b, eps), got, "run to run", _OP_NAMES)
        out, h, mean, rstd = got
        refs = [t if t is None else t.to("cpu", torch.float64) for t in (x, residual, w, b)]
        ref_out, ref_h = reference(kind, dtype, refs[0], refs[1], (cols,), refs[2], refs[3], eps, cast_order == "llama")
        check("out", out, ref_out, dtype)
        if kind == "layer_norm":
            check("mean", mean, ref_h.mean(-1) - ref_h[:, 0], torch.float32)
            variance = ref_h.var(-1, unbiased=False)
        else:
            variance = ref_h.pow(2).mean(-1)
        check("rstd", rstd, (variance + eps).rsqrt(), torch.float32)
        leaves = [t if t is None else t.detach().requires_grad_() for t in (x, residual, w, b)]
        recorded, recorded_h = call(kind, leaves[0], leaves[1], (cols,), leaves[2], leaves[3], eps, cast_order)
        with torch.no_grad():
            untracked, untracked_h = call(kind, x, residual, (cols,), w, b, eps, cast_order)
        assert recorded.grad_fn is not None and not untracked.requires_grad
        assert torch.equal(recorded, out) and torch.equal(untracked, out)
        if residual is None:
            continue
        assert torch.equal(h, x + r) and torch.equal(recorded_h, h) and torch.equal(untracked_h, h)
        on_sum = _op_forward(kind, cast_order, h, None, w, b, eps)
        _assert_same_forward(on_sum, (out, None, mean, rstd), "the plain form on the sum", _OP_NAMES)
        with torch.no_grad():
            assert torch.equal(call(kind, h, None, (cols,), w, b, eps, cast_order)[0], out)


# norm_fwd_flat_kernel's layouts (flat_config: 32 to 1024 threads a row, 1 to 4 packs a thread):
# groups of one warp four to a block (bfloat16 8 and 256 columns, float32 128), two to a block
# (264: 33 packs, the second warp's second pack past the row), one warp's group of 3 packs (768),
# 3 packs partly past the row (5120), the widest groups of 2 packs (16384 bfloat16, 8192 float32)
# and of 4 (32768 bfloat16, 16384 float32), one pack past them (32776 bfloat16, 16388 float32:
# norm_fwd_kernel or the generic kernel instead).
FLAT_COLS = {torch.bfloat16: [8, 256, 264, 768, 5120, 16384, 32768, 32776],
             torch.float16: [264, 5120, 16384],
             torch.float32: [128, 264, 768, 5120, 8192, 16384, 16388]}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,cols", [(d, c) for d, cs in FLAT_COLS.items() for c in cs], ids=str)
@pytest.mark.parametrize("kind,cast_order", list(_bulk_kinds()))
def test_fwd_flat_layouts(monkeypatch, dtype, cols, kind, cast_order):
    """BRRR_NORM_FWD_KERNEL=flat against float64 (forward and gradients) at each of its layouts,
    row counts that leave a block's groups partly past the last row (1, 5, 37); the fused residual
    form's out and statistics with the bits of the plain form on its sum."""
    monkeypatch.setenv("BRRR_NORM_FWD_KERNEL", "flat")
    eps = 1e-5 if kind == "layer_norm" else 1e-6
    for rows in (1, 5, 37):
        x, r = random((rows, cols), dtype, "cuda"), random((rows, cols), dtype, "cuda")
        w, b = params(kind, "both", (cols,), dtype, "cuda")
        compare(kind, dtype, x, r if rows == 5 else None, (cols,), w, b, cast_order=cast_order)
    x, r = random((37, cols), dtype, "cuda"), random((37, cols), dtype, "cuda")
    w, b = params(kind, "both", (cols,), dtype, "cuda")
    fused = _op_forward(kind, cast_order, x, r, w, b, eps)
    out, h, mean, rstd = fused
    _assert_same_forward(_op_forward(kind, cast_order, h, None, w, b, eps), (out, None, mean, rstd),
                         "the plain form on the sum", _OP_NAMES)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols,kernel", [(768, "flat"), (2048, "flat"), (4096, "rows"), (5120, "rows")])
def test_float32_forward_default(monkeypatch, kind, cols, kernel):
    """Unset, BRRR_NORM_FWD_KERNEL means flat for float32 rows of groups up to 128 threads (768
    and 2048 columns) and rows past them (4096, 5120): the default's outputs and gradients have
    that kernel's bits, and the two kernels' bits differ at those widths (their groups sum a row
    in other orders), so the test tells them apart."""
    x, g = random((2053, cols), torch.float32, "cuda"), random((2053, cols), torch.float32, "cuda")
    w, b = params(kind, "both", (cols,), torch.float32, "cuda")
    args = (kind, "torch", x, None, w, b, g)
    default = _forward_under(monkeypatch, {}, *args)
    flat = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "flat"}, *args)
    rows_ = _forward_under(monkeypatch, {"BRRR_NORM_FWD_KERNEL": "rows"}, *args)
    assert not torch.equal(flat[0], rows_[0]), "flat and rows gave the same bits: the test cannot tell them apart"
    _assert_same_forward(default, flat if kernel == "flat" else rows_, "default")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", [1, 3, 127, 768, 4097, 65536])
def test_fused_residual_forms(device, dtype, kind, cols):
    rows = max(1, min(SIZES[cols], 200))
    x, residual = random((rows, cols), dtype, device), random((rows, cols), dtype, device)
    w, b = params(kind, "both", (cols,), dtype, device)
    compare(kind, dtype, x, residual, (cols,), w, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [3, 768, 4097, 65536])
@pytest.mark.parametrize("residual", [False, True])
def test_llama_cast_order(device, dtype, cols, residual):
    rows = min(SIZES[cols], 64)
    x = random((rows, cols), dtype, device)
    r = random((rows, cols), dtype, device) if residual else None
    w, _ = params("rms_norm", "weight", (cols,), dtype, device)
    compare("rms_norm", dtype, x, r, (cols,), w, None, cast_order="llama")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_llama_cast_order_is_hugging_faces(device, dtype):
    """Llama's RMSNorm as Hugging Face writes it, computed by torch in the same dtypes."""
    x, w = random((37, 512), dtype, device), random((512,), dtype, device)
    eps = 1e-6
    hidden = x.float()
    hf = w * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    ours = brrr.rms_norm(x, (512,), w, eps, cast_order="llama")
    ulp = torch.finfo(dtype).eps * hf.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((ours.float() - hf.float()).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [1, 3, 127, 768, 4097, 65536])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cast_order", ["torch", "llama"])
def test_weight_offset(device, dtype, cols, residual, cast_order):
    """RMSNorm of weight + offset (offset 1: Gemma's), every gradient; the weight's is the same
    function of dy and xhat as without it. Every kernel path: packs (768, 65536 is generic),
    single elements (3, 127, 4097)."""
    rows = min(SIZES[cols], 64)
    x = random((rows, cols), dtype, device)
    r = random((rows, cols), dtype, device) if residual else None
    w = random((cols,), dtype, device, -0.5, 0.5)
    for offset in (1.0, -2.5):
        compare("rms_norm", dtype, x, r, (cols,), w, None, cast_order=cast_order, offset=offset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_weight_offset_layouts_and_float32_weights(device, dtype):
    """The offset on strided views and strided weights, and on float32 weights for half inputs."""
    for name, x, ns in _views(device, dtype):
        w = random((3 * math.prod(ns),), dtype, device, -0.5, 0.5)[::3].reshape(ns)
        compare("rms_norm", dtype, x, None, ns, w, None, offset=1.0)
        compare("rms_norm", dtype, x, random(x.shape, dtype, device), ns, w.float(), None, offset=1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_weight_offset_is_gemmas(device, dtype):
    """Gemma's RMSNorm as Hugging Face writes it (x * rsqrt(mean(x^2) + eps) * (1 + weight), all
    in float32, cast once), computed by torch: within one rounding of the storage dtype."""
    x, w = random((37, 512), dtype, device), random((512,), dtype, device, -0.5, 0.5)
    eps = 1e-6
    hidden = x.float()
    gemma = (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(dtype)
    ours = brrr.rms_norm(x, (512,), w, eps, offset=1.0)
    ulp = torch.finfo(dtype).eps * gemma.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((ours.float() - gemma.float()).abs() <= ulp).all()
    assert not torch.equal(ours, brrr.rms_norm(x, (512,), w, eps))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True])
def test_float32_weights_for_half_inputs(device, dtype, kind, residual):
    """Autocast's layout: half activations, float32 parameters (their gradients in float32)."""
    for cols, rows in ((768, 67), (127, 33), (65536, 3)):
        x = random((rows, cols), dtype, device)
        r = random((rows, cols), dtype, device) if residual else None
        w, b = params(kind, "both", (cols,), dtype, device, param_dtype=torch.float32)
        compare(kind, dtype, x, r, (cols,), w, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", [3, 768, 4097, 65536])
@pytest.mark.parametrize("residual", [False, True])
def test_large_offset_is_stable(device, dtype, kind, cols, residual):
    """x = 1e4 + U(-3, 3): E[x^2] - E[x]^2 would lose every digit of the variance in fp32; brrr's
    statistics (shifted by the row's first element) keep the fp32 tolerance."""
    rows = min(SIZES[cols], 64)
    x = random((rows, cols), dtype, device) + 1e4
    r = random((rows, cols), dtype, device) if residual else None
    w, b = params(kind, "both", (cols,), dtype, device)
    compare(kind, dtype, x, r, (cols,), w, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True])
def test_outlier_first_element(device, dtype, kind, residual):
    """The shift is the row's first element; an outlier there must not cost precision."""
    x = random((16, 4096), dtype, device)
    x[:, 0] = 3e3
    r = random((16, 4096), dtype, device) if residual else None
    w, b = params(kind, "both", (4096,), dtype, device)
    compare(kind, dtype, x, r, (4096,), w, b, slack=2.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_saved_statistics(device, dtype, kind):
    """The forward op's saved rows: rstd, and for LayerNorm the mean minus the row's first element."""
    x = random((5, 7, 96), dtype, device)
    x64 = x.double().cpu()
    if kind == "layer_norm":
        _, mean, rstd = torch.ops.brrr.layer_norm(x, [96], None, None, 1e-5)
        var = x64.var(-1, unbiased=False)
        check("mean", mean, x64.mean(-1) - x64[..., 0], torch.float32 if dtype != torch.float64 else dtype)
    else:
        _, rstd = torch.ops.brrr.rms_norm(x, [96], None, 1e-5, False, 0.0)
        var = x64.pow(2).mean(-1)
    assert rstd.shape == (5, 7) and rstd.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    check("rstd", rstd, (var + 1e-5).rsqrt(), torch.float32 if dtype != torch.float64 else dtype)


# ---- layouts ----------------------------------------------------------------------------------

def _views(device, dtype):
    """(name, x, normalized_shape): views of fresh storage, none of them contiguous."""
    yield "strided columns", random((41, 1536), dtype, device)[:, ::2], (768,)
    yield "row stride", random((82, 768), dtype, device)[::2], (768,)
    yield "row stride, odd size", random((66, 127), dtype, device)[1::2], (127,)
    yield "permuted rows", random((6, 7, 768), dtype, device).transpose(0, 1), (768,)
    yield "two normalised dims", random((5, 3, 16, 24), dtype, device), (16, 24)
    yield "permuted normalised dims", random((5, 24, 16), dtype, device).transpose(1, 2), (16, 24)
    yield "offset view", random((40, 770), dtype, device)[3:, 1:769], (768,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_inputs(device, dtype, kind):
    for name, x, ns in _views(device, dtype):
        assert not x.is_contiguous() or len(ns) == 2, name
        w, b = params(kind, "both", ns, dtype, device)
        compare(kind, dtype, x, None, ns, w, b)
        compare(kind, dtype, x, random(x.shape, dtype, device), ns, w, b)
        # residual strided differently from x
        compare(kind, dtype, random(x.shape, dtype, device), x, ns, w, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_parameters_and_gradients(device, kind):
    dtype = torch.bfloat16
    x = random((33, 768), dtype, device)
    w = random((1536,), dtype, device)[::2]
    b = random((768, 2), dtype, device)[:, 1] if kind == "layer_norm" else None
    compare(kind, dtype, x, None, (768,), w, b)
    # an upstream gradient that is a broadcast (stride 0), as out.sum().backward() gives
    leaf = x.detach().requires_grad_()
    wl = w.detach().requires_grad_()
    out, _ = call(kind, leaf, None, (768,), wl, b)
    out.sum().backward()
    ref_x, ref_w = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    ref_out, _ = reference(kind, dtype, ref_x, None, (768,), ref_w, None if b is None else b.double().cpu())
    ref_out.sum().backward()
    check("grad_x", leaf.grad, ref_x.grad, dtype)
    check("grad_weight", wl.grad, ref_w.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_rows(device, dtype):
    x = random((0, 64), dtype, device).requires_grad_()
    w = random((64,), dtype, device).requires_grad_()
    b = random((64,), dtype, device).requires_grad_()
    out = brrr.layer_norm(x, (64,), w, b)
    assert out.shape == (0, 64)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_normalized_shape_as_int_and_high_rank():
    x = random((2, 3, 4, 5, 6), torch.float32, "cpu")
    compare("layer_norm", torch.float32, x, None, 6, None, None)
    compare("rms_norm", torch.float32, x, None, (4, 5, 6), None, None)


# ---- the C entry points with NaN-poisoned outputs -----------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", [3, 768, 4097, 65536])
@pytest.mark.parametrize("strided_out", [False, True])
def test_every_output_element_is_written(device, dtype, kind, cols, strided_out):
    """brrr._C with every output (and the scratch) full of NaN."""
    rows = min(SIZES[cols], 40)
    x, residual, g_out, g_res = (random((rows, cols), dtype, device) for _ in range(4))
    w, b = params(kind, "both", (cols,), dtype, device)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    if strided_out:
        out = poisoned_like(torch.empty((rows, 2 * cols), dtype=dtype, device=device))[:, ::2]
    else:
        out = poisoned_like(x)
    h = poisoned_like(x)
    mean, rstd = (torch.full((rows,), float("nan"), dtype=stat, device=device) for _ in range(2))
    if kind == "layer_norm":
        _C.layer_norm_fwd(x, w, b, residual, out, h, mean, rstd, norm_ndim=1, eps=1e-5)
    else:
        _C.rms_norm_fwd(x, w, residual, out, h, rstd, norm_ndim=1, eps=1e-5, llama=False)
    ref_x, ref_r, ref_w, ref_b = (t if t is None else t.double().cpu().requires_grad_() for t in (x, residual, w, b))
    ref_out, ref_h = reference(kind, dtype, ref_x, ref_r, (cols,), ref_w, ref_b, 1e-5)
    check("out", out, ref_out, dtype)
    assert torch.equal(h, x + residual)

    grad_x, grad_w = poisoned_like(x), poisoned_like(w)
    grad_b = poisoned_like(b) if b is not None else None
    n_grads = 1 + (b is not None)
    partials = torch.full((n_grads * _C.norm_partial_rows(rows, cols) * cols,), float("nan"), dtype=stat, device=device)
    if kind == "layer_norm":
        _C.layer_norm_bwd(h, g_out, g_res, w, mean, rstd, grad_x, grad_w, grad_b, partials, norm_ndim=1)
    else:
        _C.rms_norm_bwd(h, g_out, g_res, w, rstd, grad_x, grad_w, partials, norm_ndim=1, llama=False)
    upstream = [g_out.double().cpu(), g_res.double().cpu()]
    torch.autograd.backward([ref_out, ref_h], upstream)
    scale_x, _, scale_w, scale_b = gradient_scales(kind, dtype, ref_h.detach(), (cols,), ref_w, 1e-5, upstream)
    check("grad_x", grad_x, ref_x.grad, dtype, scale=scale_x)
    check("grad_weight", grad_w, ref_w.grad, dtype, scale=scale_w)
    if b is not None:
        check("grad_bias", grad_b, ref_b.grad, dtype, scale=scale_b)


def test_numpy_arrays():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 130)).astype(np.float32)
    r = rng.standard_normal((9, 130)).astype(np.float32)
    w = rng.standard_normal(130).astype(np.float32)
    b = rng.standard_normal(130).astype(np.float32)
    tx, tr, tw, tb = (torch.from_numpy(a).double() for a in (x, r, w, b))
    y = brrr.layer_norm(x, 130, w, b)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    check("out", torch.from_numpy(y), F.layer_norm(tx, (130,), tw, tb), torch.float32)
    y, h = brrr.add_rms_norm(x, r, (130,), w)
    check("out", torch.from_numpy(y), F.rms_norm((tx + tr).float().double(), (130,), tw, 2.0**-23), torch.float32)
    np.testing.assert_array_equal(h, x + r)
    y16 = brrr.rms_norm(x.astype(np.float16), (130,), cast_order="llama")
    assert y16.dtype == np.float16
    # negative strides (NumPy has them, torch does not)
    flipped = x[::-1, ::-1]
    check("flipped", torch.from_numpy(brrr.layer_norm(flipped, (130,), w[::-1])),
          F.layer_norm(torch.from_numpy(flipped.copy()).double(), (130,), torch.from_numpy(w[::-1].copy()).double()),
          torch.float32)


# ---- autograd machinery ------------------------------------------------------------------------

@pytest.mark.parametrize("kind,cast_order", [("layer_norm", "torch"), ("rms_norm", "torch"), ("rms_norm", "llama")])
@pytest.mark.parametrize("residual", [False, True])
def test_gradcheck(kind, cast_order, residual):
    x = random((3, 4, 10), torch.float64, "cpu").requires_grad_()
    r = random((3, 4, 10), torch.float64, "cpu").requires_grad_()
    w = random((4, 10), torch.float64, "cpu").requires_grad_()
    b = random((4, 10), torch.float64, "cpu").requires_grad_()
    ns = (4, 10)

    def f(x, r, w, b):
        out, h = call(kind, x, r if residual else None, ns, w, b if kind == "layer_norm" else None, 1e-5, cast_order)
        return out if h is None else (out, h)

    assert torch.autograd.gradcheck(f, (x, r, w, b))
    assert torch.autograd.gradcheck(lambda x: call(kind, x, None, ns)[0], (x,))
    if kind == "rms_norm":
        def g(x, r, w):
            out, h = call(kind, x, r if residual else None, ns, w, None, 1e-5, cast_order, offset=1.0)
            return out if h is None else (out, h)
        assert torch.autograd.gradcheck(g, (x, r, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["rows", "odd", "strided", "wide"])
def test_backward_is_deterministic(device, kind, layout):
    """Two backward runs give bitwise identical gradients (no atomics; sums in a fixed order)."""
    dtype = torch.bfloat16
    rows, cols = {"rows": (20011, 768), "odd": (2049, 4097), "strided": (4001, 1536), "wide": (301, 65536)}[layout]
    x = random((rows if device == "cuda" else rows // 32 + 1, cols), dtype, device)
    if layout == "strided":
        x = x[:, ::2]
    cols = x.shape[-1]
    x.requires_grad_()
    w, b = (random((cols,), torch.float32, device).requires_grad_() for _ in range(2))
    if kind == "rms_norm":
        b = None
    g = random(x.shape, dtype, device)
    runs = []
    for _ in range(2):
        out, _ = call(kind, x, None, (cols,), w, b)
        runs.append(torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], g))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = random((6, 5, 32), torch.float32, device).requires_grad_()
    r = random((6, 5, 32), torch.float32, device).requires_grad_()
    w = random((32,), torch.float32, device).requires_grad_()
    b = random((32,), torch.float32, device).requires_grad_()
    ops = torch.ops.brrr
    torch.library.opcheck(ops.layer_norm.default, (x, [32], w, b, 1e-5))
    torch.library.opcheck(ops.layer_norm.default, (x, [5, 32], None, None, 1e-5))
    torch.library.opcheck(ops.add_layer_norm.default, (x, r, [32], w, b, 1e-5))
    torch.library.opcheck(ops.rms_norm.default, (x, [32], w, 1e-6, False, 0.0))
    torch.library.opcheck(ops.rms_norm.default, (x, [32], w, 1e-6, True, 0.0))
    torch.library.opcheck(ops.rms_norm.default, (x, [32], w, 1e-6, False, 1.0))
    torch.library.opcheck(ops.add_rms_norm.default, (x, r, [32], w, 1e-6, False, 1.0))
    with torch.no_grad():
        _, mean, rstd = ops.layer_norm(x, [32], w, b, 1e-5)
        _, rms_rstd = ops.rms_norm(x, [32], w, 1e-6, False, 1.0)
    g = random(x.shape, torch.float32, device)
    torch.library.opcheck(ops.norm_backward.default, (x.detach(), g, None, w.detach(), b.detach(), mean, rstd, 1,
                                                      False, 0.0, True, True))
    torch.library.opcheck(ops.norm_backward.default, (x.detach(), g, g, w.detach(), None, None, rms_rstd, 1, False,
                                                      1.0, True, False))


def test_torch_compile_traces_without_graph_breaks():
    x = random((8, 64), torch.float32, "cpu").requires_grad_()
    r = random((8, 64), torch.float32, "cpu").requires_grad_()
    w = random((64,), torch.float32, "cpu").requires_grad_()

    def block(x, r, w):
        y, h = brrr.add_rms_norm(x, r, (64,), w)
        return brrr.layer_norm(y, (64,), w, None) + h

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    eager_grads = torch.autograd.grad(block(x, r, w).sum(), (x, r, w))
    out = compiled(x, r, w)
    torch.testing.assert_close(out, block(x, r, w))
    for a, e in zip(torch.autograd.grad(out.sum(), (x, r, w)), eager_grads):
        torch.testing.assert_close(a, e)


class _DispatchLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_grad_path_skips_the_dispatcher():
    """Without autograd the op calls brrr._C directly (and allocates only its output); eager
    autograd records a plain autograd.Function, also without the custom op."""
    x = random((4, 16), torch.float32, "cpu")
    with _DispatchLog() as log:
        out = brrr.rms_norm(x, (16,))
    assert not any(op.startswith("brrr.") for op in log.ops), log.ops
    check("out", out, F.rms_norm(x.double(), (16,), eps=2.0**-23), torch.float32)
    with _DispatchLog() as log:
        y = brrr.rms_norm(x.requires_grad_(), (16,))
    assert not any(op.startswith("brrr.") for op in log.ops), log.ops
    assert y.grad_fn.name() == "brrr_rms_norm_eagerBackward"


@pytest.mark.parametrize("device", DEVICES)
def test_default_eps(device):
    """layer_norm's eps defaults to 1e-5; rms_norm's to float32's machine epsilon for float16,
    bfloat16 and float32 inputs, as torch's kernels do (its documentation says x.dtype's), on
    inputs small enough for eps to matter."""
    for dtype in (torch.float32, torch.float16):
        x = random((7, 64), dtype, device, low=-1e-3, high=1e-3)
        ref_x = x.double().cpu()
        check("layer_norm", brrr.layer_norm(x, (64,)), F.layer_norm(ref_x, (64,), eps=1e-5), dtype)
        check("rms_norm", brrr.rms_norm(x, (64,)), F.rms_norm(ref_x, (64,), eps=2.0**-23), dtype)
        check("torch's default", brrr.rms_norm(x, (64,)), F.rms_norm(x, (64,)).double(), dtype, slack=2.0)
        assert not torch.allclose(brrr.rms_norm(x, (64,)).double().cpu(), F.rms_norm(ref_x, (64,), eps=1e-3), rtol=0.05)


# ---- argument errors --------------------------------------------------------------------------

def test_argument_errors():
    x = random((4, 8), torch.float32, "cpu")
    w = random((8,), torch.float32, "cpu")
    with pytest.raises(ValueError, match="normalized_shape"):
        brrr.layer_norm(x, (4,))
    with pytest.raises(ValueError, match="normalized_shape"):
        brrr.rms_norm(x, ())
    with pytest.raises(ValueError, match="argument weight has shape"):
        brrr.layer_norm(x, (8,), random((7,), torch.float32, "cpu"))
    with pytest.raises(ValueError, match="argument weight: dtype float64"):
        brrr.layer_norm(x, (8,), w.double())
    with pytest.raises(ValueError, match="argument bias: dtype float16"):
        brrr.layer_norm(x, (8,), None, w.half())
    xb = x.bfloat16()
    with pytest.raises(ValueError, match="argument bias has dtype bfloat16 but weight has dtype float32"):
        brrr.layer_norm(xb, (8,), w, w.bfloat16())
    with pytest.raises(ValueError, match="argument residual has shape"):
        brrr.add_layer_norm(x, x[:, :4], (8,))
    with pytest.raises(ValueError, match="argument residual has dtype"):
        brrr.add_rms_norm(x, x.double(), (8,))
    with pytest.raises(ValueError, match="cast_order"):
        brrr.rms_norm(x, (8,), cast_order="hf")
    for fn, weight in ((lambda **kw: brrr.rms_norm(x, (8,), **kw), w),
                       (lambda **kw: brrr.add_rms_norm(x, x, (8,), **kw), w),
                       (lambda **kw: brrr.rms_norm(x.numpy(), (8,), **kw), w.numpy())):
        with pytest.raises(ValueError, match="argument offset: nonzero without weight"):
            fn(offset=1.0)
        with pytest.raises(ValueError, match="argument offset: expected a finite float"):
            fn(weight=weight, offset=float("inf"))
        with pytest.raises(TypeError, match="argument offset"):
            fn(weight=weight, offset="1")
    with pytest.raises(TypeError, match="argument x"):
        brrr.layer_norm([[1.0, 2.0]], (2,))


def test_c_argument_errors():
    x = random((4, 8), torch.float32, "cpu")
    out, stats = torch.empty_like(x), torch.empty(4)
    with pytest.raises(ValueError, match="argument norm_ndim"):
        _C.layer_norm_fwd(x, out=out, norm_ndim=0, eps=1e-5)
    with pytest.raises(ValueError, match="argument norm_ndim"):
        _C.rms_norm_fwd(x, out=out, norm_ndim=3, eps=1e-5, llama=False)
    with pytest.raises(ValueError, match="argument out overlaps input x"):
        _C.layer_norm_fwd(x, out=x, norm_ndim=1, eps=1e-5)
    with pytest.raises(ValueError, match="argument mean overlaps input rstd"):
        _C.layer_norm_fwd(x, out=out, mean=stats, rstd=stats, norm_ndim=1, eps=1e-5)
    with pytest.raises(ValueError, match="argument mean: expected dtype float32"):
        _C.layer_norm_fwd(x, out=out, mean=stats.double(), norm_ndim=1, eps=1e-5)
    with pytest.raises(ValueError, match="argument rstd has shape"):
        _C.layer_norm_fwd(x, out=out, rstd=torch.empty(5), norm_ndim=1, eps=1e-5)
    with pytest.raises(ValueError, match="argument residual_out: given without residual"):
        _C.layer_norm_fwd(x, out=out, residual_out=torch.empty_like(x), norm_ndim=1, eps=1e-5)
    with pytest.raises(TypeError, match="argument residual_out: brrr._C allocates outputs only for NumPy arrays"):
        _C.rms_norm_fwd(Producer(x), residual=Producer(x.clone()), out=Producer(out), norm_ndim=1, eps=1e-5, llama=False)
    y, h, _ = _C.rms_norm_fwd(x, residual=x, norm_ndim=1, eps=1e-5, llama=False)  # allocated by torch
    assert torch.equal(h, x + x) and y.shape == x.shape
    with pytest.raises(ValueError, match="argument out: output has overlapping elements"):
        _C.rms_norm_fwd(x, out=torch.empty(8).expand(4, 8), norm_ndim=1, eps=1e-5, llama=False)
    with pytest.raises(TypeError, match="missing argument 'norm_ndim'"):
        _C.layer_norm_fwd(x)
    with pytest.raises(TypeError, match="unexpected keyword argument 'norm_dims'"):
        _C.layer_norm_fwd(x, norm_dims=1, norm_ndim=1, eps=1e-5)
    with pytest.raises(TypeError, match="multiple values for argument 'weight'"):
        _C.layer_norm_fwd(x, None, weight=None, norm_ndim=1, eps=1e-5)
    with pytest.raises(TypeError, match="argument eps"):
        _C.rms_norm_fwd(x, out=out, norm_ndim=1, eps="tiny", llama=False)
    with pytest.raises(TypeError, match="argument stream"):
        _C.rms_norm_fwd(x, out=out, norm_ndim=1, eps=1e-5, llama=False, stream="default")
    _, mean, rstd = torch.ops.brrr.layer_norm(x, [8], None, None, 1e-5)
    with pytest.raises(ValueError, match="argument grad_weight: given without weight"):
        _C.layer_norm_bwd(x, x, None, None, mean, rstd, out, torch.empty(8), norm_ndim=1)
    with pytest.raises(TypeError, match="argument mean: expected a tensor or array, got None"):
        _C.layer_norm_bwd(x, x, None, None, None, rstd, out, norm_ndim=1)
    with pytest.raises(ValueError, match="argument grad_x overlaps input grad_out"):
        _C.layer_norm_bwd(x, out, None, None, mean, rstd, out, norm_ndim=1)
    read_only = np.zeros((4, 8), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="argument out: output is read-only"):
        _C.layer_norm_fwd(np.ones((4, 8), np.float32), out=read_only, norm_ndim=1, eps=1e-5)


@pytest.mark.cuda
def test_cuda_argument_errors():
    x = random((4, 8), torch.float32, "cuda")
    w = random((8,), torch.float32, "cuda")
    _, mean, rstd = torch.ops.brrr.layer_norm(x, [8], w, None, 1e-5)
    grad_x, grad_w = torch.empty_like(x), torch.empty_like(w)
    with pytest.raises(ValueError, match="argument weight is on cpu but x is on cuda"):
        brrr.layer_norm(x, (8,), w.cpu())
    # partials=None: allocated by brrr._C on torch's current stream, required on any other
    torch.testing.assert_close(_C.layer_norm_bwd(x, x, None, w, mean, rstd, None, grad_w, norm_ndim=1)[0],
                               _C.layer_norm_bwd(x, x, None, w, mean, rstd, grad_x, grad_w, None,
                                                 torch.empty(1024, device="cuda"), norm_ndim=1)[0])
    with pytest.raises(TypeError, match="argument partials: required on CUDA"):
        _C.layer_norm_bwd(x, x, None, w, mean, rstd, grad_x, grad_w, norm_ndim=1,
                          stream=torch.cuda.current_stream().cuda_stream)
    with pytest.raises(ValueError, match="argument partials: expected a contiguous 1-D tensor"):
        _C.layer_norm_bwd(x, x, None, w, mean, rstd, grad_x, grad_w, None, torch.empty(3, device="cuda"), norm_ndim=1)
    with pytest.raises(ValueError, match="argument partials: expected dtype float32"):
        _C.layer_norm_bwd(x, x, None, w, mean, rstd, grad_x, grad_w, None,
                          torch.empty(1024, dtype=torch.float64, device="cuda"), norm_ndim=1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cols", [512, 520, 640, 648, 1032, 1280, 1288, 2056, 2560, 2568, 4096, 4104, 5120, 5128, 8200,
                                  10240, 10248])
@pytest.mark.parametrize("layout", ["rows-five", "rows-pow2", "bulk"])
def test_forward_five_packs(monkeypatch, dtype, kind, residual, cols, layout):
    """float16 and bfloat16 rows whose 8-element packs fall just past a power-of-two group of 4
    packs a thread (65-80, 129-160, 257-320, 513-640, 1025-1280 packs): norm_fwd_kernel
    (BRRR_NORM_FWD_KERNEL=rows, the default) takes 5 packs a thread over half the group (BRRR_NORM_FWD_PACKS
    unset, =five) or the doubled group (=pow2); norm_fwd_bulk_kernel (=bulk) the doubled
    group, 3 packs a thread. Against the float64 reference each way, at the first and last width
    of each range and the one past it (520, 640 | 648; 1032, 1280 | 1288; 2056, 2560 | 2568; 4104,
    5120 | 5128; 8200, 10240 | 10248; 512 and 4096 just below a range), one row and many, with the
    weight and bias; the gradients too."""
    kernel, _, packs = layout.partition("-")
    monkeypatch.setenv("BRRR_NORM_FWD_KERNEL", kernel)
    if packs:
        monkeypatch.setenv("BRRR_NORM_FWD_PACKS", packs)
    for rows in (1, 37):
        x = random((rows, cols), dtype, "cuda")
        r = random((rows, cols), dtype, "cuda") if residual else None
        w, b = params(kind, "both", (cols,), dtype, "cuda")
        compare(kind, dtype, x, r, (cols,), w, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_norm_outputs_are_contiguous_as_torchs(device, kind):
    """A norm of a transposed x returns a contiguous output, as torch's layer_norm and rms_norm
    do (x's permuted strides were kept, and .view() failed on them); the residual stream keeps
    x's layout, as torch's x + residual does."""
    x = random((16, 8), torch.float32, device).t()
    w = random((16,), torch.float32, device)
    args = (x, random((8, 16), torch.float32, device)) if kind.startswith("add_") else (x,)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            result = getattr(brrr, kind)(*[a.detach().requires_grad_(grad) for a in args], (16,), w)
        out = result[0] if kind.startswith("add_") else result
        assert out.is_contiguous(), (kind, grad)
        out.view(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_zero_output_keeps_torchs_sign(device, dtype):
    """Rows of -0 (and float32 rows whose squares overflow, which normalise to zeros): RMSNorm and
    LayerNorm without a bias give torch's -0, where the kernels added an absent bias as +0."""
    w = torch.ones(5, device=device, dtype=dtype)
    rows = [torch.full((3, 5), -0.0, device=device, dtype=dtype)]
    if dtype == torch.float32:
        rows.append(torch.full((3, 5), -1e20, device=device))
    for x in rows:
        for ours, want in [(brrr.rms_norm(x, (5,), w, 1e-5), F.rms_norm(x, (5,), w, 1e-5)),
                           (brrr.add_rms_norm(x, torch.full_like(x, -0.0), (5,), w, 1e-5)[0],
                            F.rms_norm(x, (5,), w, 1e-5)),
                           (brrr.layer_norm(x[:1] * 0, (5,), w), F.layer_norm(x[:1] * 0, (5,), w))]:
            assert torch.equal(ours, want) and torch.equal(ours.signbit(), want.signbit()), (ours, want)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_llama_order_with_a_float32_weight_returns_float32_as_the_model_does(dtype):
    """Llama's RMSNorm with a float32 weight over half x returns float32 (weight * h.to(x.dtype)),
    the registry's reference too; its route, brrr.nn.RMSNorm and a patched Hugging Face module
    returned x's dtype."""
    from brrr import registry

    x, w = random((5, 64), dtype, "cpu"), random((64,), torch.float32, "cpu")
    hidden = x.float()
    want = w * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(registry("rms_norm", x, (64,), w, 1e-6, cast_order="llama"), want)
    module = brrr.nn.RMSNorm(64, eps=1e-6)
    module.cast_order = "llama"
    with torch.no_grad():
        module.weight.copy_(w)
    assert torch.equal(module(x), want)
    residual = random((5, 64), dtype, "cpu")
    out, h = registry("add_rms_norm", x, residual, (64,), w, 1e-6, cast_order="llama")
    hidden = (x + residual).float()
    assert out.dtype == torch.float32 and torch.equal(h, x + residual)
    assert torch.equal(out, w * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype))


def test_routed_functions_take_what_torchs_take():
    """Under use_fused, F.rms_norm and F.layer_norm with an eps that is a tensor or negative, or
    dims given as tensors, compute what torch computes, where brrr's argument checks raised."""
    x, w, b = random((3, 4), torch.float32, "cpu"), random((4,), torch.float32, "cpu"), random((4,), torch.float32, "cpu")
    calls = [lambda: F.rms_norm(x, (4,), w, -1.0), lambda: F.rms_norm(x, (4,), w, torch.tensor(1e-5)),
             lambda: F.rms_norm(x, (torch.tensor(4),), w), lambda: F.layer_norm(x, (4,), w, b, -1e-6)]
    wanted = [call() for call in calls]
    with brrr.use_fused():
        for call, want in zip(calls, wanted):
            torch.testing.assert_close(call(), want, rtol=0, atol=0, equal_nan=True)
