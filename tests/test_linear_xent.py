"""brrr.linear_cross_entropy: the loss and the gradients of input, weight and bias against
F.cross_entropy(input.double() @ weight.double().T + bias) (with the softcap and z-loss written
out) on fresh random inputs: rows that are not a multiple of the chunk, class counts on both sides
of the kernels' switches, every reduction, ignore_index (all rows ignored too), label smoothing,
softcap, z_loss, every dtype, 3-d, unbatched, empty and non-contiguous inputs, frozen parameters,
both accumulations of the weight's gradient; the weight gradient bitwise the same run to run;
central differences (gradcheck for "none"); a second backward refused; what autograd saves (no
logits); the peak bytes of each accumulation (CPU: a counter of live storages, CUDA:
max_memory_allocated) and the weight gradient's error against float64 at 32 chunks; the
torch.library op (opcheck, torch.compile without graph breaks); argument errors; the registry
entry and brrr.nn module. brrr.patch on transformers' Llama, Gemma 2 (its softcap) and Cohere
(its logit scale): the patched model's loss and every gradient against the unpatched model's.
CUDA only: a vocabulary of 32000, the peak memory, and CUDA graph captures of the op's and of a
patched model's training step.
"""

import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import brrr
from brrr import _C
from brrr.xent import ACCUMULATIONS, LOGITS_BUDGET, auto_chunk_rows, chunk_rows
from helpers import DEVICES, DTYPES, TOLERANCE, captured_in_a_graph, random
from test_xent import IGNORE, make_targets, reference_loss

REDUCTIONS = ["mean", "sum", "none"]
# (rows, hidden, classes): class counts that take each of the kernels' row widths (8 threads up
# to 64 classes, a warp up to 4096, a block above), odd ones (unaligned rows), one row, one class.
SHAPES = [(1, 3, 1), (3, 1, 7), (257, 16, 7), (257, 8, 65), (129, 24, 1001), (65, 5, 4097)]


def reference(x, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
              z_loss=0.0):
    """(leaves, logits, loss): the float64 reference on CPU leaves holding the values of x, weight,
    bias, and its logits (for the size of the terms each gradient sums)."""
    leaves = [None if p is None else p.detach().to("cpu", torch.float64).requires_grad_() for p in (x, weight, bias)]
    logits = F.linear(leaves[0], leaves[1], leaves[2])
    loss = reference_loss(logits.reshape(-1, weight.shape[0]), target.reshape(-1).cpu(), ignore_index,
                          reduction, label_smoothing, softcap, z_loss)
    return leaves, logits, loss.reshape(target.shape) if reduction == "none" else loss


def check(name, actual, expected, terms, dtype, roundings=1):
    """Elementwise: |actual - expected| <= rtol * terms + atol * max(terms), with the storage
    dtype's tolerance; `terms` is the sum of the absolute values of the terms each element adds up
    (the gradients are sums over classes or rows, rounded in the storage dtype term by term).
    roundings: how often a partial sum (at most terms) is rounded to the dtype: each one past the
    first may add half a unit in the last place of it."""
    tol = TOLERANCE[dtype]
    actual64 = actual.detach().to("cpu", torch.float64)
    assert actual64.shape == expected.shape, (name, actual64.shape, expected.shape)
    # never below the spacing of the dtype's subnormals (the result itself is rounded to them)
    subnormal = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    rtol = tol["rtol"] + (roundings - 1) * torch.finfo(dtype).eps / 2
    bound = rtol * terms + max(tol["atol"] * (terms.max().item() if terms.numel() else 0.0), subnormal)
    error = (actual64 - expected).abs()
    bad = ~(error <= bound) & ~(actual64.isnan() & expected.isnan())
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.numel()} elements off, the worst by "
                           f"{(error - bound)[bad].max().item():.3g} (error {error[bad].max().item():.3g})")


def compare(x, weight, target, bias=None, what="", g=None, budget=None, accumulation="weight", **options):
    """brrr and the reference: the loss, and the gradients of x, weight and bias (those that
    require grad) for the upstream gradient g (random by default). Returns (loss, grads). budget:
    bytes of logits, None for LOGITS_BUDGET, "auto" to leave the chunks to linear_cross_entropy."""
    dtype = x.dtype
    leaves = [None if p is None else p.detach().requires_grad_(p.requires_grad) for p in (x, weight, bias)]
    budget = LOGITS_BUDGET if budget is None else budget
    chunking = {} if budget == "auto" else {"logits_budget": budget}
    loss = brrr.linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], **options, **chunking,
                                     accumulation=accumulation)
    # Accumulated in a half-precision weight's dtype, its gradient is rounded once per chunk.
    rows = target.numel()
    if budget == "auto":
        acc_itemsize = x.element_size() if accumulation == "weight" else max(4, x.element_size())
        per_chunk = auto_chunk_rows(*weight.shape, x.element_size(), acc_itemsize)
    else:
        per_chunk = chunk_rows(weight.shape[0], x.element_size(), budget, 128)
    chunks = -(-rows // per_chunk) if rows else 1
    roundings = {"weight": chunks if accumulation == "weight" and x.element_size() == 2 else 1}
    ref_leaves, logits, ref = reference(x, weight, target, bias, **options)
    where = f"{what} {options} {accumulation}"
    assert loss.dtype == dtype and loss.device == x.device and loss.shape == ref.shape, where
    finite = ref[torch.isfinite(ref)]
    scale = max(finite.abs().max().item() if finite.numel() else 0.0, 1.0)
    check(f"loss ({where})", loss, ref.detach(), torch.full_like(ref, scale), dtype)
    wanted = [(name, a, r) for name, a, r in zip(("input", "weight", "bias"), leaves, ref_leaves)
              if a is not None and a.requires_grad]
    if not wanted:
        return loss, ()
    g = random(loss.shape, dtype, x.device) if g is None else g
    grads = torch.autograd.grad(loss, [a for _, a, _ in wanted], g)
    ref_grads = torch.autograd.grad(ref, [logits] + [r for _, _, r in wanted], g.double().cpu(), allow_unused=True)
    # Each logit's gradient is rounded to the storage dtype: for float16 below its normal range, to
    # a spacing of 2^-24 (the gradient of a mean over many rows is there, as in torch's float16).
    g_logits = ref_grads[0].abs().reshape(-1, weight.shape[0])
    # A logit's gradient is a difference, upstream * (p - y) (+ the z-loss term): where p and y
    # nearly cancel (one class, say) it is rounded on the scale of p, not of the difference.
    g_logits = g_logits + upstream_per_row(target, g, options).unsqueeze(1) * capped_softmax(logits, options)
    if dtype == torch.float16:
        g_logits = g_logits + 2.0**-24 / TOLERANCE[dtype]["rtol"]
    x64, w64 = (p.detach().to("cpu", torch.float64).abs() for p in (x.reshape(-1, x.shape[-1]), weight))
    terms = {"input": (g_logits @ w64).reshape(x.shape), "weight": g_logits.t() @ x64, "bias": g_logits.sum(0)}
    for (name, a, _), grad, ref_grad in zip(wanted, grads, ref_grads[1:]):
        assert grad.dtype == a.dtype and grad.shape == a.shape, (where, name)
        check(f"grad of {name} ({where})", grad, torch.zeros(a.shape, dtype=torch.float64) if ref_grad is None
              else ref_grad, terms[name], dtype, roundings.get(name, 1))
    return loss, grads


def upstream_per_row(target, g, options):
    """Each row's factor in the gradient of its logits: |g| (reduction "none"), |g| / the rows kept
    ("mean") or |g| ("sum"), 0 on ignored rows; times 1 + 2 z |lse| bounded by 1 + 2 z * 100."""
    kept = (target.reshape(-1).cpu() != options.get("ignore_index", -100)).double()
    upstream = g.detach().double().cpu().abs().reshape(-1) * kept
    if options.get("reduction", "mean") == "mean":
        upstream = upstream / kept.sum().clamp(min=1.0)
    return upstream * (1.0 + 200.0 * options.get("z_loss", 0.0))


def capped_softmax(logits, options):
    z = logits.detach().reshape(-1, logits.shape[-1])
    cap = options.get("softcap")
    return torch.softmax(z if cap is None else cap * torch.tanh(z / cap), dim=-1)


def make(rows, hidden, classes, dtype, device, bias=True):
    """x, weight, bias with logits of a few units: x in [-1, 1], weight scaled by 3 / sqrt(hidden)."""
    x = random((rows, hidden), dtype, device, low=-1.0, high=1.0).requires_grad_()
    w = (random((classes, hidden), torch.float64, "cpu", low=-1.0, high=1.0) * 3 / hidden**0.5).to(device, dtype)
    b = random((classes,), dtype, device, low=-1.0, high=1.0).requires_grad_() if bias else None
    return x, w.requires_grad_(), b


def chunk_budget(rows_per_chunk, classes, dtype):
    return rows_per_chunk * classes * torch.finfo(dtype).bits // 8


# ---- loss and gradients against torch ---------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden,classes", SHAPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_torch(device, dtype, rows, hidden, classes, reduction):
    """Chunks of 7 rows (the row counts are not multiples of it) and of 1, every option; for half
    precision both accumulations of the weight's gradient (float32 and float64 have one)."""
    x, w, b = make(rows, hidden, classes, dtype, device)
    for accumulation in ACCUMULATIONS if x.element_size() == 2 else ACCUMULATIONS[:1]:
        for budget_rows, options in [(7, {}), (7, dict(label_smoothing=0.1)), (1, dict(softcap=2.0)),
                                     (7, dict(z_loss=0.1, label_smoothing=0.1)), (7, dict(softcap=30.0, z_loss=1e-4))]:
            t = make_targets((rows,), classes, device, IGNORE[0])
            compare(x, w, t, b, what=f"{rows}x{hidden}x{classes}", budget=chunk_budget(budget_rows, classes, dtype),
                    reduction=reduction, accumulation=accumulation, **options)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ignore", IGNORE, ids=[name for name, _ in IGNORE])
def test_ignore_index(device, dtype, ignore):
    x, w, b = make(37, 8, 33, dtype, device)
    for reduction in REDUCTIONS:
        t = make_targets((37,), 33, device, ignore)
        compare(x, w, t, b, budget=chunk_budget(5, 33, dtype), reduction=reduction, ignore_index=ignore[1],
                label_smoothing=0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_all_rows_ignored(device, dtype):
    """mean over no counted rows: NaN (as torch), gradients 0; sum and none: 0."""
    x, w, b = make(9, 8, 33, dtype, device)
    t = torch.full((9,), -100, device=device)
    for reduction in REDUCTIONS:
        loss = brrr.linear_cross_entropy(x, w, t, b, reduction=reduction, z_loss=0.1, logits_budget=4 * 33 * 4)
        assert torch.isnan(loss).all() if reduction == "mean" else not loss.detach().any()
        grads = torch.autograd.grad(loss, (x, w, b), torch.ones_like(loss))
        assert all(not g.any() for g in grads), reduction


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes_layouts_and_frozen_parameters(device, dtype):
    """(batch, seq, hidden) inputs, non-contiguous inputs, weights and targets, no bias, a frozen
    weight (its gradient is never computed) or a frozen input, int32 and uint8 targets."""
    x, w, b = make(24, 16, 65, dtype, device)
    t = make_targets((24,), 65, device, IGNORE[0])
    budget = chunk_budget(5, 65, dtype)
    for reduction in REDUCTIONS:
        compare(x.reshape(4, 6, 16), w, t.reshape(4, 6), b, what="3-d", budget=budget, reduction=reduction)
        compare(x.t().contiguous().t(), w.t().contiguous().t(), t, None, what="transposed storage, no bias",
                budget=budget, reduction=reduction)
        wide = random((24, 32), dtype, device, low=-1.0, high=1.0)
        compare(wide[:, ::2].requires_grad_(), w, make_targets((48,), 65, device, IGNORE[0])[::2], b,
                what="strided x and target", budget=budget, reduction=reduction)
        compare(x, w.detach(), t, b, what="frozen weight", budget=budget, reduction=reduction)
        compare(x.detach(), w, t, b.detach(), what="frozen input and bias", budget=budget, reduction=reduction)
        compare(x, w, t.to(torch.int32), b, what="int32 target", budget=budget, reduction=reduction)
    t8 = t.clone()
    t8[t8 == -100] = 255
    compare(x, w, t8.to(torch.uint8), b, what="uint8 target", budget=budget, ignore_index=255)


@pytest.mark.parametrize("device", DEVICES)
def test_unbatched_input_and_no_rows(device):
    """input (H,) with a 0-d target, as F.linear and F.cross_entropy take them; no rows: mean NaN
    (as torch), sum 0, gradients zero."""
    x, w, b = make(1, 8, 33, torch.float32, device)
    for reduction in REDUCTIONS:
        compare(x[0].detach().requires_grad_(), w, torch.tensor(5, device=device), b, what="unbatched",
                reduction=reduction, label_smoothing=0.1)
        empty = x[:0].detach().requires_grad_()
        loss = brrr.linear_cross_entropy(empty, w, torch.zeros(0, dtype=torch.int64, device=device), b,
                                         reduction=reduction)
        assert loss.shape == ((0,) if reduction == "none" else ()) and (reduction != "mean" or torch.isnan(loss))
        grads = torch.autograd.grad(loss.sum(), (empty, w, b))
        assert grads[0].shape == (0, 8) and not grads[1].any() and not grads[2].any()


@pytest.mark.parametrize("device", DEVICES)
def test_loss_dtype_and_no_grad_path(device):
    """dtype= gives the loss in float32 for a bf16 input; without autograd the loss is the same bits."""
    x, w, b = make(33, 8, 101, torch.bfloat16, device)
    t = make_targets((33,), 101, device, IGNORE[0])
    for reduction in REDUCTIONS:
        loss = brrr.linear_cross_entropy(x, w, t, b, reduction=reduction, dtype=torch.float32, softcap=5.0,
                                         logits_budget=4000)
        assert loss.dtype == torch.float32
        with torch.no_grad():
            quiet = brrr.linear_cross_entropy(x, w, t, b, reduction=reduction, dtype=torch.float32, softcap=5.0,
                                              logits_budget=4000)
        assert torch.equal(loss.detach(), quiet), reduction
        _, _, ref = reference(x, w, t, b, reduction=reduction, softcap=5.0)
        torch.testing.assert_close(loss.detach().double().cpu(), ref.detach(), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_deterministic(device, dtype, accumulation):
    """Two calls: bitwise the same loss and gradients (the weight's summed over many chunks)."""
    rows, hidden, classes = (4099, 256, 32000) if device == "cuda" else (301, 32, 1001)
    x, w, b = make(rows, hidden, classes, dtype, device)
    t = make_targets((rows,), classes, device, IGNORE[0])
    for chunking in ({"logits_budget": chunk_budget(97, classes, dtype)}, {}):  # {}: the default chunks
        runs = []
        for _ in range(2):
            loss = brrr.linear_cross_entropy(x, w, t, b, label_smoothing=0.1, z_loss=1e-4, accumulation=accumulation,
                                             **chunking)
            runs.append((loss.detach(),) + torch.autograd.grad(loss, (x, w, b)))
        for a, c in zip(*runs):
            assert torch.equal(a, c), chunking


def test_gradcheck():
    """Reduction "none" (its backward runs the chunks): torch's gradcheck, which runs each backward
    twice through one graph."""
    x, w, b = make(5, 3, 7, torch.float64, "cpu")
    t = torch.tensor([1, -100, 6, 0, 3])
    assert torch.autograd.gradcheck(lambda x, w, b: brrr.linear_cross_entropy(
        x, w, t, b, reduction="none", label_smoothing=0.2, softcap=2.0, z_loss=0.1, logits_budget=2 * 7 * 8),
        (x, w, b))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_against_finite_differences(reduction):
    """Reductions "mean" and "sum", whose backward scales the forward's gradients in place (so
    one backward per forward, which gradcheck does not do): the derivative along random
    directions of the inputs against central differences, in float64."""
    x, w, b = make(5, 3, 7, torch.float64, "cpu")
    t = torch.tensor([1, -100, 6, 0, 3])

    def f(x, w, b):
        return brrr.linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=0.2, softcap=2.0,
                                         z_loss=0.1, logits_budget=2 * 7 * 8)

    grads = torch.autograd.grad(f(x, w, b), (x, w, b))
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        d = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in (x, w, b)]
        eps = 1e-6
        with torch.no_grad():
            plus = f(*(p + eps * e for p, e in zip((x, w, b), d)))
            minus = f(*(p - eps * e for p, e in zip((x, w, b), d)))
        numeric = ((plus - minus) / (2 * eps)).item()
        analytic = sum((gr * e).sum() for gr, e in zip(grads, d)).item()
        assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(numeric)), (numeric, analytic)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_backward_scaling_rounds_once_over_several_slices(device, accumulation):
    """The backward's scaling of a bf16 weight's gradient of 8.6M elements (five slices of the
    backward, the last of 0.2M elements) by a float32 upstream gradient: right against float64, and
    with a bf16 accumulator bitwise bf16(float32(unscaled) * g): the factor is not rounded to
    bf16 first (1/3 is not a bf16)."""
    x, w, b = make(5, 4096, 2100, torch.bfloat16, device)
    t = make_targets((5,), 2100, device, IGNORE[0])
    g = torch.tensor(1 / 3, device=device)
    compare(x, w, t, b, what="several slices", accumulation=accumulation)
    grads = []
    for upstream in (torch.ones((), device=device), g):
        loss = brrr.linear_cross_entropy(x, w, t, b, dtype=torch.float32, accumulation=accumulation)
        grads.append(torch.autograd.grad(loss, (x, w, b), upstream))
    if accumulation == "weight":
        assert torch.equal(grads[1][1], (grads[0][1].float() * g).bfloat16())
    assert torch.equal(grads[1][0], (grads[0][0].float() * g).bfloat16())


def scaling_values(n, dtype, device, generator):
    """n float32 or float64 values for the backward's scaling: normal ones over a wide range of
    magnitudes (overflowing and subnormal in the half types), halfway between two bf16 and two
    float16 values (ties to even), and, at every 97th element and around the scaling's slice
    boundaries (1M, 2M, 4M elements), +-0, +-inf and NaN."""
    exponents = torch.randint(-20, 20, (n,), generator=generator)
    exponents[::5] = torch.randint(-150, 130, (len(exponents[::5]),), generator=generator)
    v = (torch.randn(n, dtype=torch.float64, generator=generator) * torch.exp2(exponents.double())).to(dtype)
    if dtype == torch.float32:  # bf16 ties: the low 16 bits 0x8000; float16 ties: the low 13 bits 0x1000
        bits = v.view(torch.int32)
        bits[1::7] = (bits[1::7] & ~0xFFFF) | 0x8000
        bits[2::7] = (bits[2::7] & ~0x1FFF) | 0x1000
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")], dtype=dtype)
    v[::97] = special.repeat(n // 97 // 5 + 1)[:len(v[::97])]
    for boundary in (2**20, 2**21, 2**22):
        for i, value in zip(range(boundary - 2, boundary + 3), special):
            if 0 <= i < n:
                v[i] = value
    return v.to(device)


def assert_same_bits(actual, expected, what):
    """The same dtype, and bits, but for NaN's (PyTorch's CPU and CUDA conversions themselves write
    different NaNs)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), what
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    a, e = actual.view(width), expected.view(width)
    bad = (a != e) & ~nan
    assert not bad.any(), (what, int(bad.sum()), actual[bad][:4], expected[bad][:4])


# (acc dtype, out dtype): what linear_cross_entropy's backward rounds (a float32 or float64
# accumulator into the parameter's dtype, a gradient in its own dtype in place).
SCALE_PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float32, torch.float32),
               (torch.float64, torch.float64), (torch.float64, torch.float32), (torch.float64, torch.bfloat16),
               (torch.float64, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("acc_dtype,out_dtype", SCALE_PAIRS, ids=str)
def test_scale_kernel_bits_match_torch(device, acc_dtype, out_dtype):
    """_C.linear_cross_entropy_scale against torch.mul(acc, factor.reshape(1)).to(out's dtype),
    bitwise: odd sizes, starts on and off a 16-byte boundary (acc and out at the same offset from
    one, which the kernel packs, and at different ones, which it takes element by element), in
    place, factors of one element (shape (1,) or 0-d) in float32, bfloat16, float16 (float64
    with a float64 acc), of any size and non-finite, and None (a conversion)."""
    gen = torch.Generator().manual_seed(25)
    factors = [None, 1 / 3, 3e38, 1e-40, float("inf"), -float("nan"), -2.5]
    factor_dtypes = [torch.float32, torch.bfloat16, torch.float16] + ([torch.float64] if acc_dtype == torch.float64
                                                                       else [])
    for n in (1, 7, 8, 9, 31, 4097, 100003):
        base = scaling_values(n + 16, acc_dtype if acc_dtype.itemsize >= 4 else torch.float32, device, gen)
        base = base.to(acc_dtype)
        for acc_offset, out_offset in ((0, 0), (3, 3), (1, 0), (5, 2)):
            acc = base[acc_offset:acc_offset + n]
            for i, value in enumerate(factors):
                fdtype = factor_dtypes[i % len(factor_dtypes)]
                factor = None if value is None else torch.tensor([value], dtype=fdtype, device=device)
                if factor is not None and i % 2:
                    factor = factor[0]  # 0-d: the same product
                if factor is None:
                    expected = acc.to(out_dtype)
                else:
                    expected = torch.mul(acc, factor.reshape(1)).to(out_dtype)
                what = (n, acc_offset, out_offset, value, fdtype)
                out = torch.full((n + 16,), 7.0, dtype=out_dtype, device=device)
                _C.linear_cross_entropy_scale(acc, factor, out[out_offset:out_offset + n])
                assert_same_bits(out[out_offset:out_offset + n], expected, what)
                assert (out[:out_offset] == 7).all() and (out[out_offset + n:] == 7).all(), what
                if acc_dtype == out_dtype:
                    in_place = acc.clone()
                    _C.linear_cross_entropy_scale(in_place, factor, in_place)
                    assert_same_bits(in_place, expected, what + ("in place",))


def test_scale_kernel_argument_errors():
    """The dtypes that go together, one-element factors, contiguous tensors."""
    acc, g = torch.ones(10), torch.tensor(0.5)
    with pytest.raises(ValueError, match="argument out: dtype float32 does not go with acc of dtype bfloat16"):
        _C.linear_cross_entropy_scale(acc.bfloat16(), g, acc)
    with pytest.raises(ValueError, match="argument out: dtype float64 does not go with acc of dtype float32"):
        _C.linear_cross_entropy_scale(acc, g, acc.double())
    with pytest.raises(ValueError, match="argument factor: dtype float64 goes only with a float64 acc"):
        _C.linear_cross_entropy_scale(acc, g.double(), acc)
    with pytest.raises(ValueError, match="argument factor: expected a tensor of one element, got 2"):
        _C.linear_cross_entropy_scale(acc, torch.ones(2), acc)
    with pytest.raises(ValueError, match="argument acc: must be contiguous"):
        _C.linear_cross_entropy_scale(torch.ones(20)[::2], g, acc)
    with pytest.raises(ValueError, match="argument out: must be contiguous"):
        _C.linear_cross_entropy_scale(acc, g, torch.ones(20)[::2])
    with pytest.raises(ValueError, match="argument out overlaps input acc"):  # in place only as the same view
        _C.linear_cross_entropy_scale(acc, g, acc.view(torch.bfloat16)[:10])


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_in_place_bits_match_torch_over_the_slices(device):
    """The backward's scaling (scaled_in_place) bitwise torch.mul(acc, g.reshape(1)).to(dtype), with
    non-finite values and ties around its slices' boundaries: a float32 accumulator of 1M elements
    less one and more one, and of 4M and some (2-d, odd sides), into bf16 and float16 over its
    own storage (the result a view of it), and gradients in their own dtype in place (one of them
    transposed, as empty_like gives the gradient of a transposed input); g of one element in
    float32 (0-d, as autograd hands it, and (1,)), bfloat16, non-finite, and None."""
    scaled_in_place = brrr.xent.torch_layer().scaled_in_place
    gen = torch.Generator().manual_seed(22)
    factors = [None, torch.tensor(1 / 3), torch.tensor([-1e-40]), torch.tensor([3.0], dtype=torch.bfloat16),
               torch.tensor(float("inf")), torch.tensor(float("nan"))]
    for shape in ((2**20 - 1,), (2**20 + 1,), (1031, 4099)):
        acc = scaling_values(math.prod(shape), torch.float32, device, gen).view(shape)
        for g in factors:
            g = None if g is None else g.to(device)
            for dtype in (torch.bfloat16, torch.float16):
                expected = acc.to(dtype) if g is None else torch.mul(acc, g.reshape(1)).to(dtype)
                work = acc.clone()
                got = scaled_in_place(work, g, dtype)
                assert got.data_ptr() == work.data_ptr() and got.shape == work.shape
                assert_same_bits(got, expected, (shape, g, dtype))
            if g is None:
                continue
            for grad in (acc.clone(), acc.bfloat16(), acc.bfloat16().t().contiguous().t()):
                expected = torch.mul(grad, g.reshape(1)).to(grad.dtype)
                assert scaled_in_place(grad, g, grad.dtype) is grad
                assert_same_bits(grad, expected, (shape, g, grad.dtype, grad.stride()))


def test_second_backward_through_the_graph_raises():
    """The backward scales the forward's gradients in place: a second one (retain_graph) would
    scale them twice, so it raises, after a first that is right."""
    x, w, b = make(9, 4, 11, torch.float32, "cpu")
    t = make_targets((9,), 11, "cpu", IGNORE[0])
    loss = brrr.linear_cross_entropy(x, w, t, b)
    first = torch.autograd.grad(loss, (x, w, b), retain_graph=True)
    leaves, _, ref = reference(x, w, t, b)
    for a, e in zip(first, torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss, (x, w, b))


def test_chunk_size_follows_the_budget():
    """The rows per chunk are the budget over a row of logits, at least 1, rounded down to whole
    128-row tiles where at least 128 rows fit."""
    assert chunk_rows(128256, 2, 2**28) == 2**28 // (128256 * 2) == 1046
    assert chunk_rows(128256, 2, 2**28, 128) == 1024
    assert chunk_rows(128256, 2, 2**27, 128) == 512  # 16384 rows: 32 chunks
    assert chunk_rows(32000, 4, 2**28, 128) == 2048
    assert chunk_rows(32000, 2, 32000 * 2 * 100, 128) == 100  # fewer than 128 rows: as many as fit
    assert chunk_rows(32000, 2, 10, 128) == 1


def test_default_chunks_follow_the_accumulators_arithmetic():
    """Without a budget: 1024 rows of half-precision logits per 2 bytes of accumulator (its read
    and write per chunk against the chunk's GEMMs), logits capped at half the accumulator's bytes
    but not below LOGITS_BUDGET; float32 logits 1024 rows."""
    assert auto_chunk_rows(128256, 4096, 2, 2) == 1024  # bf16 accumulator: 256 MiB of logits
    assert auto_chunk_rows(128256, 4096, 2, 4) == 2048  # float32 accumulator
    assert auto_chunk_rows(256000, 2048, 2, 4) == 2048  # the cap, half of 2 GB, is just 2048 rows
    assert auto_chunk_rows(256000, 1024, 2, 4) == 1024  # capped at half the accumulator
    assert auto_chunk_rows(256000, 256, 2, 2) == 256  # LOGITS_BUDGET's rows, above the cap's 128
    assert auto_chunk_rows(32000, 64, 2, 2) == 1024  # LOGITS_BUDGET holds 2097 rows
    assert auto_chunk_rows(128256, 4096, 4, 4) == 1024
    assert auto_chunk_rows(300, 16, 2, 4) == 2048


@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("grad_enabled", [True, False])
def test_default_chunks_follow_the_weight_gradient(monkeypatch, weight_grad, grad_enabled):
    """The accumulator's arithmetic sizes the default chunks only when the weight's gradient is
    accumulated; a frozen head or no_grad takes LOGITS_BUDGET's chunks (at vocab 256000 the
    accumulator's would hold about 1 GB of logits for nothing)."""
    sized = []
    monkeypatch.setattr(brrr.xent, "auto_chunk_rows", lambda *a: sized.append(a) or auto_chunk_rows(*a))
    budgets = []
    monkeypatch.setattr(brrr.xent, "chunk_rows", lambda *a: budgets.append(a[2]) or chunk_rows(*a))
    x, w, b = make(300, 16, 301, torch.float32, "cpu")
    w.requires_grad_(weight_grad)
    with torch.set_grad_enabled(grad_enabled):
        brrr.linear_cross_entropy(x, w, torch.randint(0, 301, (300,)))
    accumulated = weight_grad and grad_enabled
    assert bool(sized) == accumulated
    assert accumulated or budgets == [LOGITS_BUDGET]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_default_chunks_match_torch(dtype, accumulation, reduction):
    """The default chunking over 2500 rows (chunks of 1024, the last of 452 rows; of 2048 for
    16-bit logits with a float32 accumulator) and 301 classes: every option, each ignore_index,
    all rows ignored."""
    x, w, b = make(2500, 16, 301, dtype, "cpu")
    for ignore, options in [(IGNORE[0], dict(label_smoothing=0.1)), (IGNORE[1], dict(softcap=2.0, z_loss=0.1)),
                            (IGNORE[2], dict(softcap=30.0, z_loss=1e-4, label_smoothing=0.2))]:
        t = make_targets((2500,), 301, "cpu", ignore)
        compare(x, w, t, b, what="default chunks", budget="auto", reduction=reduction, accumulation=accumulation,
                ignore_index=ignore[1], **options)
    t = torch.full((2500,), -100)
    loss = brrr.linear_cross_entropy(x, w, t, b, reduction=reduction, z_loss=0.1, accumulation=accumulation)
    assert torch.isnan(loss).all() if reduction == "mean" else not loss.detach().any()
    grads = torch.autograd.grad(loss, (x, w, b), torch.ones_like(loss))
    assert all(not g.any() for g in grads), reduction


class GemmRows(TorchDispatchMode):
    """The rows of the first operand of every torch.mm / torch.addmm that runs while it is active."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.rows.append(args[0 if func.overloadpacket is torch.ops.aten.mm else 1].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_skipping_ignored_rows(monkeypatch, dtype, reduction):
    """brrr.xent.SKIP_IGNORED_ROWS: the logits' GEMMs run over the counted rows only (chunks of
    100 rows, the last one short), and the loss and gradients are right: each ignore_index, every
    option, both accumulations, a frozen weight, without autograd, all rows ignored; the same
    bits run to run."""
    monkeypatch.setattr(brrr.xent, "SKIP_IGNORED_ROWS", True)
    x, w, b = make(1001, 16, 301, dtype, "cpu")
    budget = chunk_budget(100, 301, dtype)
    for accumulation in ACCUMULATIONS:
        for ignore, options in [(IGNORE[0], dict(label_smoothing=0.1)), (IGNORE[1], dict(softcap=2.0, z_loss=0.1)),
                                (IGNORE[2], dict(softcap=30.0, z_loss=1e-4, label_smoothing=0.2))]:
            t = make_targets((1001,), 301, "cpu", ignore)
            compare(x, w, t, b, what="skipping ignored rows", budget=budget, reduction=reduction,
                    accumulation=accumulation, ignore_index=ignore[1], **options)
        compare(x, w.detach(), t, b, what="skipping ignored rows, frozen weight", budget=budget, reduction=reduction,
                accumulation=accumulation, ignore_index=ignore[1])
    t = make_targets((1001,), 301, "cpu", IGNORE[0])
    counted = int((t != -100).sum())
    with GemmRows() as gemms, torch.no_grad():
        quiet = brrr.linear_cross_entropy(x, w, t, b, reduction=reduction, logits_budget=budget)
    assert sum(gemms.rows) == counted < 1001, gemms.rows
    runs = []
    for _ in range(2):
        loss = brrr.linear_cross_entropy(x, w, t, b, reduction=reduction, logits_budget=budget)
        runs.append((loss.detach(),) + torch.autograd.grad(loss, (x, w, b), torch.ones_like(loss)))
    assert all(torch.equal(a, c) for a, c in zip(*runs)) and torch.equal(quiet, runs[0][0])
    t = torch.full((1001,), -100)
    loss = brrr.linear_cross_entropy(x, w, t, b, reduction=reduction, logits_budget=budget)
    assert torch.isnan(loss).all() if reduction == "mean" else not loss.detach().any()
    grads = torch.autograd.grad(loss, (x, w, b), torch.ones_like(loss))
    assert all(not g.any() for g in grads), reduction


def test_skipping_ignored_rows_places_the_input_gradient_in_blocks(monkeypatch):
    """Hidden 4096: the packed gradients of 2251 kept rows go to their rows in two blocks (2048
    rows of 4096 float64s, then 203), the ignored rows zeros."""
    monkeypatch.setattr(brrr.xent, "SKIP_IGNORED_ROWS", True)
    x, w, b = make(3001, 4096, 7, torch.bfloat16, "cpu")
    t = make_targets((3001,), 7, "cpu", IGNORE[0])
    assert int((t != -100).sum()) == 2251
    for reduction in REDUCTIONS:
        _, (grad_x, *_) = compare(x, w, t, b, what="two blocks", budget=chunk_budget(512, 7, torch.bfloat16),
                                  reduction=reduction)
        assert not grad_x[t == -100].any() and grad_x[t != -100].abs().sum(1).all()


def test_saves_no_logits():
    """Only the gradients (input's size, weight's in float32) are saved, nothing of the logits' size."""
    rows, hidden, classes = 256, 8, 1000
    x, w, b = make(rows, hidden, classes, torch.float32, "cpu")
    t = make_targets((rows,), classes, "cpu", IGNORE[0])
    for reduction in REDUCTIONS:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
            loss = brrr.linear_cross_entropy(x, w, t, b, reduction=reduction, logits_budget=16 * classes * 4)
        assert saved and max(s.numel() for s in saved) < rows * classes // 8, [s.shape for s in saved]
        assert sum(s.numel() for s in saved if s.is_floating_point()) <= x.numel() + w.numel() + b.numel() + 1
        torch.autograd.grad(loss, (x, w, b), torch.ones_like(loss))


# ---- memory and precision of the two accumulations ----------------------------------------------

class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that PyTorch ops allocate while it is active (each counted from
    the op that made it until it is freed), their peak, and the shapes and dtypes allocated: the
    CPU's torch.cuda.max_memory_allocated, for tensors. Storages of the `existing` tensors (the
    inputs) are not counted."""

    def __init__(self, *existing):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.current = self.peak = 0
        self.allocated = []  # (shape, dtype) of each new storage's first tensor

    def _freed(self, pointer, size):
        self.known.discard(pointer)
        self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                storage = t.untyped_storage()
                pointer, size = storage.data_ptr(), storage.nbytes()
                self.known.add(pointer)
                self.current += size
                self.peak = max(self.peak, self.current)
                self.allocated.append((tuple(t.shape), t.dtype))
                weakref.finalize(storage, self._freed, pointer, size)
        return out


def test_peak_memory_of_each_accumulation():
    """Forward and backward on the CPU, bf16, 4 chunks: with accumulation "weight" the peak above
    the inputs is the weight's gradient, the input's and one chunk of logits (and some row-sized
    vectors), and the forward (which computes the gradients) allocates nothing of the weight's
    shape in float32; with "float32" it does: the accumulator, twice the weight's bytes, held
    by the gradient it is rounded into. (The backward's scaling goes through float32 slices of at
    most 32 MiB, here the whole weight.)"""
    rows, hidden, classes, chunk = 2048, 64, 4096, 512
    x, w, _ = make(rows, hidden, classes, torch.bfloat16, "cpu", bias=False)
    t = make_targets((rows,), classes, "cpu", IGNORE[0])
    w_bytes, x_bytes, chunk_bytes = w.numel() * 2, x.numel() * 2, chunk * classes * 2
    for accumulation in ACCUMULATIONS:
        with LiveBytes(x, w, t) as live:
            loss = brrr.linear_cross_entropy(x, w, t, logits_budget=chunk_bytes, accumulation=accumulation)
            weight_shaped_float32 = ((classes, hidden), torch.float32) in live.allocated
            grads = torch.autograd.grad(loss, (x, w))
            del loss
            held = live.current
        if accumulation == "weight":
            assert live.peak <= w_bytes + x_bytes + chunk_bytes + 16 * rows, (live.peak, live.allocated)
            assert held == w_bytes + x_bytes and not weight_shaped_float32, live.allocated
        else:
            assert live.peak >= 2 * w_bytes + x_bytes + chunk_bytes and weight_shaped_float32
            assert held == 2 * w_bytes + x_bytes and grads[1].dtype == torch.bfloat16
        assert grads[1].untyped_storage().nbytes() == held - x_bytes


def test_weight_gradient_precision():
    """bf16, 8192 rows in 32 chunks (as 16384 rows in chunks of 512), the weight's gradient against
    float64 (relative Frobenius norm of the error), next to that of the exact gradient rounded once
    to bf16 (0.17%): accumulated in float32 and rounded once, about that (0.19% measured);
    accumulated in bf16, each chunk's sum rounded (Liger-Kernel's choice), 0.67% measured (4x, as
    a random walk of 32 roundings of growing partial sums predicts: sqrt(32 / 2))."""
    rows, hidden, classes = 8192, 64, 1024
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(classes, hidden, generator=g) / hidden**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, classes, (rows,), generator=g)
    x64, w64 = (p.detach().double().requires_grad_() for p in (x, w))
    exact = torch.autograd.grad(F.cross_entropy(x64 @ w64.T, t), w64)[0]

    def error(a):
        return ((a.double() - exact).norm() / exact.norm()).item()

    best = error(exact.bfloat16())
    errors = {}
    for accumulation in ACCUMULATIONS:
        loss = brrr.linear_cross_entropy(x, w, t, logits_budget=256 * classes * 2, accumulation=accumulation)
        errors[accumulation] = error(torch.autograd.grad(loss, w)[0])
    assert errors["float32"] <= 1.25 * best and errors["weight"] <= 5 * best, (best, errors)


# ---- the torch.library op ---------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    op = torch.ops.brrr.linear_cross_entropy.default
    x, w, b = make(9, 4, 11, torch.float32, device)
    t = make_targets((9,), 11, device, IGNORE[0])
    for reduction in REDUCTIONS:
        for options, accumulation in [((-100, 0.0, None, 0.0), "weight"), ((-100, 0.1, 3.0, 0.1), "float32")]:
            torch.library.opcheck(op, (x, w, t, b, *options, reduction, 4, accumulation, [True, True, True]),
                                  test_utils=utils)
        torch.library.opcheck(op, (x, w.detach(), t, None, -100, 0.0, None, 0.0, reduction, 2, "weight",
                                   [True, False, False]), test_utils=utils)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_torch_compile_without_graph_breaks(reduction):
    """fullgraph compile (aot_eager and inductor): the same loss and gradients as eager, and the
    op in the graph once."""
    torch._dynamo.reset()
    x, w, b = make(21, 8, 37, torch.float32, "cpu")
    t = make_targets((3, 7), 37, "cpu", IGNORE[0])

    def f(x, w, b):
        return brrr.linear_cross_entropy(x.reshape(3, 7, 8), w, t, b, reduction=reduction, softcap=5.0,
                                         z_loss=1e-3, logits_budget=8 * 37 * 4).sum()

    explained = torch._dynamo.explain(f)(x, w, b)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert "brrr.linear_cross_entropy.default" in ops
    eager = f(x, w, b)
    eager_grads = torch.autograd.grad(eager, (x, w, b))
    for backend in ("aot_eager", "inductor"):
        compiled = torch.compile(f, backend=backend, fullgraph=True)
        out = compiled(x, w, b)
        torch.testing.assert_close(out, eager)
        for a, e in zip(torch.autograd.grad(out, (x, w, b)), eager_grads):
            torch.testing.assert_close(a, e)
        torch._dynamo.reset()


# ---- argument errors ------------------------------------------------------------------------------

def test_argument_errors():
    x, w, b = make(4, 3, 5, torch.float32, "cpu")
    t = torch.tensor([0, 4, -100, 2])
    lce = brrr.linear_cross_entropy
    cases = [
        (lambda: lce(x, w, t, reduction="avg"), ValueError, "reduction"),
        (lambda: lce(x, w, t, label_smoothing=1.5), ValueError, "label_smoothing"),
        (lambda: lce(x, w, t, softcap=0.0), ValueError, "softcap"),
        (lambda: lce(x, w, t, softcap=-30.0), ValueError, "softcap"),
        (lambda: lce(x, w, t, softcap=float("nan")), ValueError, "softcap"),
        (lambda: lce(x, w, t, softcap="30"), TypeError, "softcap"),
        (lambda: lce(x, w, t, z_loss=-1e-4), ValueError, "z_loss"),
        (lambda: lce(x, w, t, z_loss=float("inf")), ValueError, "z_loss"),
        (lambda: lce(x, w, t, ignore_index=1.0), TypeError, "ignore_index"),
        (lambda: lce(x, w, t, logits_budget=0), ValueError, "logits_budget"),
        (lambda: lce(x, w, t, accumulation="bf16"), ValueError, "accumulation"),
        (lambda: lce(x, w, t, accumulation=torch.float32), TypeError, "accumulation"),
        (lambda: lce(x.numpy(force=True), w, t), TypeError, "input"),
        (lambda: lce(x, w.numpy(force=True), t), TypeError, "weight"),
        (lambda: lce(x, w[:, :2], t), ValueError, "weight"),
        (lambda: lce(x, w[0], t), ValueError, "weight"),
        (lambda: lce(x, w, t, b[:4]), ValueError, "bias"),
        (lambda: lce(x, w.double(), t), ValueError, "weight"),  # a mismatch (docs/errors.md)
        (lambda: lce(x, w, t, b.double()), ValueError, "bias"),
        (lambda: lce(x, w, t, dtype="float32"), TypeError, "dtype"),
        (lambda: lce(x, w, t, dtype=torch.int64), ValueError, "dtype"),
        (lambda: lce(x.int(), w, t), TypeError, "input"),
        (lambda: lce(x[0, 0], w, t), ValueError, "input"),
        (lambda: lce(x, w, t.float()), TypeError, "target"),
        (lambda: lce(x, w, t[:3]), ValueError, "target"),
        (lambda: lce(x, w, torch.tensor([0, 5, 1, 2])), ValueError, "target"),  # out of range: the CPU checks
        # named by its row in target, not in the chunk of rows brrr._C sees (here 1 row a chunk)
        (lambda: lce(x, w, torch.tensor([0, 1, 2, 9]), logits_budget=1), ValueError,
         r"target: class index 9 \(row 3\)"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=f"^argument {message}"):
            call()


def test_registry_and_module():
    """The registry's linear_cross_entropy and brrr.nn.LinearCrossEntropyLoss: brrr's op, and its
    PyTorch reference as the fallback, the same loss."""
    from brrr import registry

    x, w, b = make(9, 4, 11, torch.float32, "cpu")
    t = make_targets((9,), 11, "cpu", IGNORE[0])
    op = registry.lookup("linear_cross_entropy")
    options = dict(reduction="sum", label_smoothing=0.1, softcap=3.0, z_loss=0.01)
    fused = registry("linear_cross_entropy", x, w, t, b, **options)
    torch.testing.assert_close(fused, op.reference(x, w, t, b, **options))
    assert op.resolve(x, w, t, b, **options) is brrr.linear_cross_entropy
    assert op.resolve(x, w.double(), t, b, **options) is op.reference  # mixed dtypes: PyTorch's
    module = brrr.nn.LinearCrossEntropyLoss(**options)
    torch.testing.assert_close(module(x, w, t, b), fused)


def test_narrow_targets_of_a_vocabulary_over_255():
    """uint8 class indices with 300 classes, and an out-of-range one named by its row in target:
    the CPU's check compares in int64 (in uint8, 300 wraps to 44, so that classes 44.. were
    refused, and -100 to 156, which escaped the check to brrr._C's, naming the row in its chunk)."""
    x, w, b = make(6, 4, 300, torch.float32, "cpu")
    t = torch.tensor([100, 3, 200, 44, 255, 7], dtype=torch.uint8)
    for reduction in REDUCTIONS:
        compare(x, w, t, b, what="uint8 target, 300 classes", reduction=reduction)
    x, w, b = make(6, 4, 10, torch.float32, "cpu")
    t = torch.tensor([0, 1, 2, 3, 156, 5], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^argument target: class index 156 \(row 4\)"):
        brrr.linear_cross_entropy(x, w, t, b, logits_budget=1)


def test_registry_reference_takes_int32_targets():
    """On CPU tensors the registry's linear_cross_entropy (and brrr.nn.LinearCrossEntropyLoss) runs
    its PyTorch reference by default: int32 and uint8 targets, which brrr.linear_cross_entropy takes
    and F.cross_entropy refuses in int32, as int64 there."""
    from brrr import registry

    x, w, b = make(9, 4, 11, torch.float64, "cpu")
    t = make_targets((9,), 11, "cpu", IGNORE[0])
    registry.on_cpu("linear_cross_entropy", "pytorch")
    expected = brrr.linear_cross_entropy(x, w, t, b, reduction="none")
    for target in (t.to(torch.int32), t.clamp(min=0).to(torch.uint8)):
        assert registry.lookup("linear_cross_entropy").resolve(x, w, target, b) is not brrr.linear_cross_entropy
        got = brrr.nn.LinearCrossEntropyLoss(reduction="none")(x, w, target, b)
        torch.testing.assert_close(got, brrr.linear_cross_entropy(x, w, target, b, reduction="none"))
    torch.testing.assert_close(registry("linear_cross_entropy", x, w, t.to(torch.int32), b, reduction="none"),
                               expected)


# ---- CUDA -----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cuda_matches_cpu_at_size(dtype):
    """A vocabulary of 32000 (a block per row), rows that do not fill the last chunk."""
    x, w, b = make(1031, 64, 32000, dtype, "cpu")
    t = make_targets((1031,), 32000, "cpu", IGNORE[0])
    for reduction in REDUCTIONS:
        compare(x.cuda(), w.cuda(), t.cuda(), b.cuda(), what="cuda", budget=chunk_budget(256, 32000, dtype),
                reduction=reduction, softcap=30.0, z_loss=1e-4, label_smoothing=0.1)


@pytest.mark.cuda
@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_cuda_input_gradient_on_a_second_stream(monkeypatch, accumulation):
    """brrr.xent.INPUT_GRAD_STREAM: the same bits as one stream (each GEMM alone computes its
    output), right against float64, in a CUDA graph too; off without an input gradient."""
    x, w, b = make(3001, 64, 4097, torch.bfloat16, "cuda")
    t = make_targets((3001,), 4097, "cuda", IGNORE[0])
    budget = chunk_budget(384, 4097, torch.bfloat16)  # 8 chunks, the last of 313 rows

    def grads():
        loss = brrr.linear_cross_entropy(x, w, t, b, softcap=30.0, logits_budget=budget, accumulation=accumulation)
        return (loss.detach(),) + torch.autograd.grad(loss, (x, w, b))

    one = grads()
    monkeypatch.setattr(brrr.xent, "INPUT_GRAD_STREAM", True)
    two = grads()
    assert all(torch.equal(a, c) for a, c in zip(one, two))
    compare(x, w, t, b, what="two streams", budget=budget, accumulation=accumulation, softcap=30.0)
    compare(x.detach(), w, t, b, what="two streams, no input gradient", budget=budget, accumulation=accumulation)
    graph, captured = captured_in_a_graph(grads)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, c) for a, c in zip(one, captured))


@pytest.mark.cuda
@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_cuda_skipping_ignored_rows(monkeypatch, accumulation):
    """brrr.xent.SKIP_IGNORED_ROWS on CUDA: right against float64 (a vocabulary of 32000, chunks
    of 256 of the kept rows); under CUDA-graph capture it runs every row (no host sync) and gives
    what it gives without the switch."""
    monkeypatch.setattr(brrr.xent, "SKIP_IGNORED_ROWS", True)
    x, w, b = make(1031, 64, 32000, torch.bfloat16, "cuda")
    t = make_targets((1031,), 32000, "cuda", IGNORE[0])
    budget = chunk_budget(256, 32000, torch.bfloat16)
    for reduction in REDUCTIONS:
        compare(x, w, t, b, what="cuda, skipping", budget=budget, reduction=reduction, accumulation=accumulation,
                softcap=30.0, z_loss=1e-4, label_smoothing=0.1)

    def grads():
        loss = brrr.linear_cross_entropy(x, w, t, b, logits_budget=budget, accumulation=accumulation)
        return (loss.detach(),) + torch.autograd.grad(loss, (x, w, b))

    graph, captured = captured_in_a_graph(grads)
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(brrr.xent, "SKIP_IGNORED_ROWS", False)
    assert all(torch.equal(a, c) for a, c in zip(grads(), captured))


@pytest.mark.cuda
def test_cuda_peak_memory_of_each_accumulation():
    """bf16, 8192 x 1024, 32768 classes, LOGITS_BUDGET (128 MiB: 4 chunks of 2048 rows):
    forward and backward allocate at their peak (torch.cuda.max_memory_allocated) at most the
    weight's gradient, the input's, one chunk of logits and 8 MiB with accumulation "weight"; with
    "float32" at least the float32 accumulator (twice the weight's bytes), the input's gradient and
    a chunk."""
    rows, hidden, classes = 8192, 1024, 32768
    x, w, _ = make(rows, hidden, classes, torch.bfloat16, "cuda", bias=False)
    t = make_targets((rows,), classes, "cuda", IGNORE[0])
    w_bytes, x_bytes, chunk_bytes = w.numel() * 2, x.numel() * 2, LOGITS_BUDGET
    for accumulation in ACCUMULATIONS:
        def step():
            loss = brrr.linear_cross_entropy(x, w, t, accumulation=accumulation, logits_budget=chunk_bytes)
            return torch.autograd.grad(loss, (x, w))

        step()  # cuBLAS's workspace, allocated once
        # Memory held by garbage in reference cycles (another test's, or the warm-up's) would be
        # freed whenever the collector runs, mid-step too, and hide the step's own peak: among 12
        # workers on an H100 "float32" once measured 128 MiB above `before`.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        grads = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        if accumulation == "weight":
            assert peak <= w_bytes + x_bytes + chunk_bytes + 2**23, peak / 2**20
        else:
            assert peak >= 2 * w_bytes + x_bytes + chunk_bytes, peak / 2**20
        del grads


@pytest.mark.cuda
def test_cuda_graph_capture_of_a_training_step():
    """forward and backward captured once and replayed on new data: the gradients of eager."""
    x, w, b = make(515, 64, 4097, torch.bfloat16, "cuda")
    t = make_targets((515,), 4097, "cuda", IGNORE[0])
    static = [x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(),
              b.detach().clone().requires_grad_()]

    def step():
        loss = brrr.linear_cross_entropy(*static[:2], t, static[2], softcap=30.0, logits_budget=2**20)
        return (loss,) + torch.autograd.grad(loss, static)

    graph, outputs = captured_in_a_graph(step)
    for _ in range(2):
        fresh = make(515, 64, 4097, torch.bfloat16, "cuda")
        for s, f in zip(static, fresh):
            s.data.copy_(f)
        t.copy_(make_targets((515,), 4097, "cuda", IGNORE[0]))
        graph.replay()
        expected = brrr.linear_cross_entropy(*fresh[:2], t, fresh[2], softcap=30.0, logits_budget=2**20)
        expected_grads = torch.autograd.grad(expected, fresh)
        for a, e in zip(outputs, (expected,) + expected_grads):
            torch.testing.assert_close(a, e)


# ---- brrr.patch: causal LMs' training loss ---------------------------------------------------------

transformers = pytest.importorskip("transformers")
TINY = dict(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)


def tiny(name, dtype=torch.float32, device="cpu", **config):
    torch.manual_seed(0)
    model = getattr(transformers, name + "ForCausalLM")(getattr(transformers, name + "Config")(**TINY, **config))
    with torch.no_grad():  # norm weights away from 1, so that ignoring them shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(device, dtype).train()


def loss_and_grads(model, tokens, **kwargs):
    out = model(input_ids=tokens, labels=tokens, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    return out, torch.autograd.grad(out.loss, params)


@pytest.mark.parametrize("name,config,what", [
    ("Llama", {}, ""), ("Gemma2", {"final_logit_softcapping": 30.0}, ", its softcap 30 fused"),
    ("Gemma2", {"final_logit_softcapping": 3.0}, ", its softcap 3 fused"),
    ("Cohere", {"logit_scale": 0.5}, ", its logit scale 0.5 on the head's input"),
    ("Cohere", {"logit_scale": 0.3}, ", its logit scale 0.3 on the head's input")])
def test_patched_causal_lm_trains_on_the_fused_loss(name, config, what):
    """Training with labels: the loss and every gradient of the unpatched model (Gemma 2's
    final-logit softcap, 30 and a tight 3, taken into the loss; Cohere's logit scale, a power of
    two and not), also per item (num_items_in_batch) and with return_dict=False; no logits
    returned, none of their size saved for the backward. In eval mode or without labels: the
    unpatched model's logits."""
    import copy

    base = tiny(name, **config)
    patched = copy.deepcopy(base)
    report = brrr.patch(patched)
    fused = f"fused linear cross-entropy (training with labels: the loss from the head's input{what}, logits None)"
    assert fused in {what for _, _, what in report.swapped}, str(report)
    tokens = torch.randint(0, 211, (2, 9))
    tokens[0, 3] = -100
    ids = tokens.clamp_min(0)
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(11)}):
        out, grads = loss_and_grads(base, ids, **kwargs)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s.shape) or s, lambda s: s):
            p_out = patched(input_ids=ids, labels=tokens, **kwargs)
        assert p_out.logits is None
        assert not [s for s in saved if s[-1:] == (211,) and s.numel() >= ids.numel() * 211], saved
        p_grads = torch.autograd.grad(p_out.loss, [p for p in patched.parameters() if p.requires_grad])
        ref = base(input_ids=ids, labels=tokens, **kwargs).loss
        torch.testing.assert_close(p_out.loss, ref, rtol=1e-5, atol=1e-6)
        base_grads = torch.autograd.grad(ref, [p for p in base.parameters() if p.requires_grad])
        for (n, _), a, b in zip(base.named_parameters(), p_grads, base_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)
        del out, grads
    as_tuple = patched(input_ids=ids, labels=tokens, return_dict=False)
    torch.testing.assert_close(as_tuple[0], base(input_ids=ids, labels=tokens).loss, rtol=1e-5, atol=1e-6)
    assert not any(isinstance(o, torch.Tensor) and o.shape[-1:] == (211,) for o in as_tuple)
    # the logits' place kept (None): what follows them where the unpatched tuple has it
    base_tuple = base(input_ids=ids, labels=tokens, return_dict=False, use_cache=True)
    assert as_tuple[1] is None and len(as_tuple) == len(base_tuple)
    assert [type(o) for o in as_tuple[2:]] == [type(o) for o in base_tuple[2:]]
    torch.testing.assert_close(patched(input_ids=ids).logits, base(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    patched.eval()
    base.eval()
    eval_out, ref_out = patched(input_ids=ids, labels=tokens), base(input_ids=ids, labels=tokens)
    torch.testing.assert_close(eval_out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eval_out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    assert brrr.unpatch(patched) > 0
    assert [type(m) for m in patched.modules()] == [type(m) for m in base.modules()]
    assert all("_brrr_pending" not in m.__dict__ for m in patched.modules())


def _halve(module, args, output):
    return output / 2


def test_patched_causal_lm_keeps_what_training_code_reads(tmp_path):
    """What Trainer and user code read of a patched model: its forward's signature (Trainer keeps
    the batch's columns that it names), its class's name (save_pretrained writes it into
    config.architectures); a hook on the head (a temperature) and a head replaced since the patch
    (resize_token_embeddings, set_output_embeddings) get the unfused loss, as unpatched."""
    import copy
    import inspect
    import json

    base = tiny("Llama")
    patched = copy.deepcopy(base)
    brrr.patch(patched)
    assert inspect.signature(patched.forward) == inspect.signature(base.forward)
    assert type(patched).__name__ == "LlamaForCausalLM"
    patched.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tokens = torch.randint(0, 211, (2, 9))

    def same_training_loss():
        out, grads = loss_and_grads(patched, tokens)
        expected, expected_grads = loss_and_grads(base, tokens)
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
        for (n, _), a, b in zip(base.named_parameters(), grads, expected_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)
        return out

    handles = [m.lm_head.register_forward_hook(_halve) for m in (base, patched)]
    assert same_training_loss().logits.shape == (2, 9, 211)
    for h in handles:
        h.remove()
    assert same_training_loss().logits is None  # fused again
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 211, bias=False)
    for m in (base, patched):
        m.set_output_embeddings(copy.deepcopy(head))
    assert same_training_loss().logits.shape == (2, 9, 211)


class DoubledLogits(transformers.LlamaForCausalLM):
    """A Llama whose forward doubles its head's output, with nothing in its config saying so."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits = out.logits * 2
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, self.vocab_size)
        return out


def test_patch_leaves_logits_it_cannot_fuse_and_can_be_told_to_keep_them():
    """Logits the forward transforms in a way brrr does not know: the head is left, the loss
    swapped as before; fused_linear_cross_entropy=False keeps a Llama's logits in training."""
    torch.manual_seed(0)
    doubled = DoubledLogits(transformers.LlamaConfig(**TINY))
    report = brrr.patch(doubled)
    assert ("", "DoubledLogits", "fused linear cross-entropy: its logits are not its head's output (nor softcapped "
            "by config.final_logit_softcapping, nor scaled by logit_scale)") in report.left, str(report)
    tokens = torch.randint(0, 211, (2, 7))
    assert doubled(input_ids=tokens, labels=tokens).logits is not None
    llama = tiny("Llama")
    report = brrr.patch(llama, fused_linear_cross_entropy=False)
    assert not any("fused linear" in what for _, _, what in report.swapped + report.left), str(report)
    assert llama(input_ids=tokens, labels=tokens).logits.shape == (2, 7, 211)


def test_patch_gives_the_fused_loss_its_options(monkeypatch):
    """fused_linear_cross_entropy as a dict of linear_cross_entropy's logits_budget and
    accumulation: brrr's kernel (on the CPU here) gets them in every training step. A bf16 head's
    gradient summed in float32 is a view of that buffer, twice the gradient's bytes; with
    accumulation "weight" it holds its own bytes alone, and the loss and gradients stay those of the
    default within bf16's rounding. Other keys and values raise ValueError naming the argument."""
    import copy

    monkeypatch.setattr(brrr.registry.lookup("linear_cross_entropy"), "cpu", "kernel")
    base = tiny("Llama", dtype=torch.bfloat16)
    tokens = torch.randint(0, 211, (2, 9))
    results = {}
    for options in (True, {"accumulation": "weight"}, {"accumulation": "weight", "logits_budget": 211 * 2 * 5}):
        model = copy.deepcopy(base)
        brrr.patch(model, fused_linear_cross_entropy=options, remat=False)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        head = model.get_output_embeddings().weight.grad
        results[str(options)] = loss, head
        held = head.untyped_storage().nbytes()
        assert held == (head.nbytes if options is not True else 2 * head.nbytes), (options, held, head.nbytes)
    (loss, head), *others = results.values()
    for other_loss, other_head in others:
        torch.testing.assert_close(other_loss, loss, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(other_head.float(), head.float(), rtol=5e-2, atol=2e-3)
    for bad in ({"chunk": 3}, {"accumulation": "bf16"}, {"logits_budget": 0}, {"logits_budget": True}, "weight"):
        with pytest.raises(ValueError, match="argument fused_linear_cross_entropy"):
            brrr.patch(copy.deepcopy(base), fused_linear_cross_entropy=bad)


@pytest.mark.cuda
def test_cuda_graph_capture_of_a_patched_step_with_the_fused_loss():
    """A bf16 Llama's patched training step captured in one CUDA graph: replays give eager's loss
    and gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # cuDNN's attention backward does not capture on torch 2.11 (docs/graphs.md): the others do.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        model = tiny("Llama", torch.bfloat16, "cuda")
        brrr.patch(model)
        tokens = torch.randint(0, 211, (4, 64), device="cuda")
        params = [p for p in model.parameters() if p.requires_grad]
        eager = model(input_ids=tokens, labels=tokens).loss
        eager_grads = torch.autograd.grad(eager, params)
        # Its graph freed: a live one keeps the parameters' gradient-accumulation nodes bound to the
        # default stream, and a backward captured on another stream would then wait on that stream.
        eager = eager.detach()
        for p in params:
            p.grad = torch.zeros_like(p)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(input_ids=tokens, labels=tokens).loss.backward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
        for _ in range(2):
            for p in params:
                p.grad.zero_()
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(loss, eager.detach())
            # flash and memory-efficient attention accumulate their backward with atomics: not
            # bitwise run to run, so each gradient within bf16 rounding of eager's, by its norm
            for p, g in zip(params, eager_grads):
                assert (p.grad.float() - g.float()).norm() <= 2e-2 * g.float().norm() + 1e-6, p.shape
