"""bias_dropout_add: the mask against an independent Philox4x32-10 (checked on Random123's known
answers), outputs and gradients against float64 math built from that mask, keep rates, seeds,
offsets and layouts, inf and NaN as torch's x * mask * scale (forward and backward), the autograd
machinery (nothing saved, gradcheck, opcheck, torch.compile), CPU against CUDA bitwise, and
argument errors."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import brrr
from brrr import _C, registry
from helpers import DEVICES, DTYPES, assert_close, random

# ---- an independent Philox4x32-10 (NumPy, vectorised over counters) ----------------------------

_MASK = np.uint64(0xFFFFFFFF)


def philox4x32_10(ctr, key):
    """Random123's philox4x32_10 on uint32 words: ctr is 4 arrays (or ints), key 2 ints."""
    c = [np.asarray(v, dtype=np.uint64) for v in ctr]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for r in range(10):
        if r:
            k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _MASK, (k1 + np.uint64(0xBB67AE85)) & _MASK
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _MASK, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _MASK]
    return [v.astype(np.uint32) for v in c]


@pytest.mark.parametrize("ctr,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_reference_philox_known_answers(ctr, key, expected):
    """Random123's known-answer vectors for philox4x32_10."""
    assert tuple(int(w) for w in philox4x32_10(ctr, key)) == expected


def reference_keep(shape, p, seed, offset=0):
    """The mask by the documented rule: element i (row-major) keeps iff word i % 4 of
    Philox(counter = (i // 4, offset), key = seed) >= floor(p * 2**32)."""
    i = np.arange(math.prod(shape), dtype=np.uint64)
    group, o, s = i >> np.uint64(2), np.uint64(offset), np.uint64(seed)
    words = philox4x32_10((group & _MASK, group >> np.uint64(32), o & _MASK, o >> np.uint64(32)),
                          (s & _MASK, s >> np.uint64(32)))
    r = np.stack(words)[(i & np.uint64(3)).astype(np.int64), np.arange(i.size)].astype(np.uint64)
    threshold = 2**32 if p >= 1 else math.floor(p * 2**32)
    return torch.from_numpy(r >= np.uint64(threshold)).reshape(shape)


def brrr_keep(shape, p, seed, offset=0, device="cpu", x=None):
    """brrr's mask, read off the output for x = 1 (or a given view of ones) and residual = 0."""
    x = torch.ones(shape, device=device) if x is None else x
    out = brrr.bias_dropout_add(x, None, torch.zeros_like(x), p, seed=seed, offset=offset)
    return (out != 0).cpu()


def torch_dropout_product(h, keep, p):
    """torch's dropout of h with the mask keep: h * keep * (1 / (1 - p)) (scale 0 for p = 1), so a
    dropped inf or NaN gives NaN, and so does its gradient for an inf or NaN grad_out."""
    return h * keep.to(h.dtype) * (0.0 if p >= 1 else 1.0 / (1.0 - p))


def reference_out(x, bias, residual, keep, p):
    """float64: residual + torch's dropout of x + bias with the mask keep."""
    h = x.detach().double().cpu()
    if bias is not None:
        h = h + bias.detach().double().cpu()
    d = torch_dropout_product(h, keep, p)
    return d if residual is None else residual.detach().double().cpu() + d


SHAPES = [(), (1,), (3,), (5, 7), (2, 3, 130), (4097,), (64, 256)]
SEEDS = [0, 1234, 2**40 + 17, 2**63 - 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_mask_matches_reference_philox(device, shape, p):
    for seed, offset in [(SEEDS[0], 0), (SEEDS[1], 5), (SEEDS[2], 2**33 + 3), (SEEDS[3], 2**63 - 1)]:
        assert torch.equal(brrr_keep(shape, p, seed, offset, device), reference_keep(shape, p, seed, offset)), (seed, offset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (33, 130), (2, 3, 4096 + 8)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_matches_float64(device, dtype, shape, with_bias):
    p, seed = 0.3, 99
    x, residual = random(shape, dtype, device), random(shape, dtype, device)
    bias = random(shape[-1:], dtype, device) if with_bias else None
    out = brrr.bias_dropout_add(x, bias, residual, p, seed=seed)
    assert out.dtype == dtype and out.shape == x.shape and out.device == x.device
    assert_close(out, reference_out(x, bias, residual, reference_keep(shape, p, seed), p), dtype, scale=2.0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    """Within 5 sigma of 1 - p over 2^20 elements, and for each of the 4 words of a Philox call."""
    n = 1 << 20
    keep = brrr_keep((n,), p, seed=2024).numpy()
    for part, count in ((keep, n), *((keep[k::4], n // 4) for k in range(4))):
        sigma = math.sqrt(p * (1 - p) / count)
        assert abs(part.mean() - (1 - p)) < 5 * sigma, (p, part.mean())


@pytest.mark.parametrize("device", DEVICES)
def test_backward_uses_the_forward_mask(device):
    x = torch.ones(37, 130, device=device, requires_grad=True)
    residual = torch.zeros(37, 130, device=device)
    out = brrr.bias_dropout_add(x, None, residual, 0.4, seed=7, offset=3)
    (grad_x,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert torch.equal(grad_x != 0, out != 0)
    assert torch.equal((grad_x != 0).cpu(), reference_keep((37, 130), 0.4, 7, 3))
    torch.testing.assert_close(grad_x[grad_x != 0], torch.full_like(grad_x[grad_x != 0], 1 / 0.6))


def test_masks_differ_by_seed_and_offset():
    """Every (seed, offset) pair gives its own mask, also pairs that differ only in the high
    32 bits; two masks agree on about p^2 + (1-p)^2 of the elements, as independent ones do."""
    p, n, s = 0.5, 1 << 16, 77
    pairs = [(s, 0), (s, 1), (s + 1, 0), (s + 2**32, 0), (s, 2**32), (s, 4)]
    masks = [brrr_keep((n,), p, seed, offset) for seed, offset in pairs]
    for a in range(len(masks)):
        for b in range(a):
            agree = (masks[a] == masks[b]).double().mean().item()
            assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / n), (pairs[a], pairs[b], agree)
    assert torch.equal(brrr_keep((n,), p, s, 1), masks[1])  # and the same pair, the same mask


VIEWS = {  # non-contiguous views of a (40, 66) base, each of x's own shape
    "transposed": lambda t: t.t()[:, :40],
    "column_slice": lambda t: t[:, ::2],
    "row_slice": lambda t: t[1:, 3:],
    "offset_start": lambda t: t.flatten()[1:2575].view(39, 66),  # dense, not 16-byte aligned
    "3d_permuted": lambda t: t[:, :64].reshape(40, 8, 8).permute(1, 0, 2),
    "expanded": lambda t: t[:1].expand(40, 66),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(VIEWS))
def test_strided_views_get_the_mask_of_their_contiguous_copy(device, layout):
    view = VIEWS[layout]
    x = view(random((40, 66), torch.float32, device))
    shape = tuple(x.shape)
    assert torch.equal(brrr_keep(shape, 0.5, 11, 2, device, x=view(torch.ones(40, 66, device=device))),
                       reference_keep(shape, 0.5, 11, 2))
    bias = random((2 * shape[-1],), torch.float32, device)[::2]
    residual = random(shape[::-1], torch.float32, device).permute(*reversed(range(len(shape))))
    out = brrr.bias_dropout_add(x, bias, residual, 0.5, seed=11, offset=2)
    dense = brrr.bias_dropout_add(x.contiguous(), bias.contiguous(), residual.contiguous(), 0.5, seed=11, offset=2)
    assert torch.equal(out, dense)
    # The backward, from a strided gradient (residual's layout) and a dense one.
    xs, bs = x.detach().requires_grad_(), bias.detach().requires_grad_()
    grads = torch.autograd.grad(brrr.bias_dropout_add(xs, bs, residual, 0.5, seed=11, offset=2), (xs, bs), residual)
    xc, bc = x.contiguous().requires_grad_(), bias.contiguous().requires_grad_()
    dense_grads = torch.autograd.grad(brrr.bias_dropout_add(xc, bc, residual, 0.5, seed=11, offset=2), (xc, bc),
                                      residual.contiguous())
    assert torch.equal(grads[0], dense_grads[0])
    torch.testing.assert_close(grads[1], dense_grads[1], rtol=1e-6, atol=1e-6)


def test_seed_none_is_reproducible_under_manual_seed():
    x, r = torch.randn(64, 64), torch.randn(64, 64)
    torch.manual_seed(5)
    a = brrr.bias_dropout_add(x, None, r, 0.5)
    b = brrr.bias_dropout_add(x, None, r, 0.5)
    torch.manual_seed(5)
    assert torch.equal(brrr.bias_dropout_add(x, None, r, 0.5), a)
    assert not torch.equal(a, b)  # the next call draws the next seed
    torch.manual_seed(5)
    seed = int(torch.randint(2**63 - 1, (1,)).item())  # the documented draw
    assert torch.equal(brrr.bias_dropout_add(x, None, r, 0.5, seed=seed), a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p,training,shape", [(0.5, False, (4, 8)), (0.0, True, (4, 8)), (1.0, True, (4, 8)),
                                              (0.5, True, (0, 8))], ids=str)
def test_seed_none_without_a_mask_leaves_the_generator_alone(device, p, training, shape):
    """training=False, p 0 or 1, no elements: no mask, so seed=None draws no seed, as
    F.dropout draws nothing then (an eval-mode model advanced the global generator, and
    every later draw, sampling or shuffling, differed from the unpatched composition's)."""
    x, r = torch.randn(shape, device=device), torch.randn(shape, device=device)
    torch.manual_seed(3)
    out = brrr.bias_dropout_add(x, None, r, p, training)
    after = torch.rand(4)
    torch.manual_seed(3)
    expected = r + F.dropout(x, p, training)
    assert torch.equal(torch.rand(4), after)
    assert torch.equal(out, expected)


# ---- gradients ------------------------------------------------------------------------------------

@pytest.mark.parametrize("p,training", [(0.3, True), (0.0, True), (1.0, True), (0.7, False)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gradcheck(p, training, with_bias):
    x = random((4, 6), torch.float64, "cpu").requires_grad_()
    b = random((6,), torch.float64, "cpu").requires_grad_()
    r = random((4, 6), torch.float64, "cpu").requires_grad_()
    f = lambda x, b, r: brrr.bias_dropout_add(x, b if with_bias else None, r, p, training, seed=3, offset=1)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, b, r))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (257, 33), (2, 3, 4096 + 8)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_gradients_match_reference(device, dtype, shape, with_bias):
    p, seed = 0.25, 31
    x, r, g = (random(shape, dtype, device) for _ in range(3))
    b = random(shape[-1:], dtype, device) if with_bias else None
    leaves = [t.detach().clone().requires_grad_() for t in (x, b, r) if t is not None]
    xb, rb = leaves[0], leaves[-1]
    bb = leaves[1] if with_bias else None
    grads = torch.autograd.grad(brrr.bias_dropout_add(xb, bb, rb, p, seed=seed), leaves, g)
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in (x, b, r) if t is not None]
    h = ref_leaves[0] + ref_leaves[1] if with_bias else ref_leaves[0]
    ref = ref_leaves[-1] + torch.where(reference_keep(shape, p, seed), h / (1 - p), torch.zeros_like(h))
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.double().cpu())
    rows = x.numel() // shape[-1]
    assert_close(grads[0], ref_grads[0], dtype)
    if with_bias:
        assert_close(grads[1], ref_grads[1], dtype, scale=max(2.0, rows**0.5))
    assert grads[-1] is g or torch.equal(grads[-1], g)


def test_grad_residual_is_grad_out_itself():
    x, r = torch.randn(8, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    g = torch.randn(8, 16)
    grad_r = torch.autograd.grad(brrr.bias_dropout_add(x, None, r, 0.5, seed=1), r, g)[0]
    assert grad_r is g


@pytest.mark.parametrize("device", DEVICES)
def test_p_zero_one_and_eval(device):
    x, r = random((9, 20), torch.float32, device), random((9, 20), torch.float32, device)
    b = random((20,), torch.float32, device)
    plain = (x.double() + b.double() + r.double())
    assert_close(brrr.bias_dropout_add(x, b, r, 0.0, seed=1), plain)
    assert_close(brrr.bias_dropout_add(x, b, r, 0.9, training=False, seed=1), plain)
    assert_close(brrr.bias_dropout_add(x, b, r, 0.9, training=False), plain)
    assert torch.equal(brrr.bias_dropout_add(x, b, r, 1.0, seed=1), r)
    assert torch.isnan(brrr.bias_dropout_add(x * float("inf"), b, r, 1.0, seed=1)).all()  # inf * 0, as torch
    xb, bb = x.clone().requires_grad_(), b.clone().requires_grad_()
    gx, gb = torch.autograd.grad(brrr.bias_dropout_add(xb, bb, r, 1.0, seed=1), (xb, bb), torch.ones_like(x))
    assert not gx.any() and not gb.any()
    gx, gb = torch.autograd.grad(brrr.bias_dropout_add(xb, bb, r, 0.5, training=False), (xb, bb), torch.ones_like(x))
    assert torch.equal(gx, torch.ones_like(x)) and torch.equal(gb, torch.full_like(b, 9.0))


# ---- inf and NaN: torch's x * mask * scale, forward and backward --------------------------------

def nonfinite(shape, dtype, device, seed, every):
    """random() values with one in `every` (flat, row-major) replaced by inf, NaN, -inf in turn."""
    t = random(shape, torch.float64, "cpu", generator=torch.Generator().manual_seed(seed)).flatten()
    for k, v in enumerate((float("inf"), float("nan"), -float("inf"))):
        t[k * every::3 * every] = v
    return t.reshape(shape).to(device=device, dtype=dtype)


def assert_same_but_nan_bits(actual, expected, what):
    """NaN at the same places; everything else bitwise equal (values and zero signs). NaN payloads
    and signs are the hardware's (x86 and NVIDIA GPUs make different default NaNs)."""
    a, e = actual.cpu(), expected.cpu()
    assert a.dtype == e.dtype and a.shape == e.shape, what
    nan = torch.isnan(e)
    assert torch.equal(torch.isnan(a), nan), what
    assert torch.equal(a[~nan], e[~nan]), what
    assert torch.equal(torch.signbit(a[~nan]), torch.signbit(e[~nan])), what


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.5, 0.2, 1.0])
def test_nonfinite_forward_matches_torch_product(device, dtype, p):
    """A dropped inf or NaN in x + bias gives NaN ((x + bias) * 0), as torch's dropout; kept ones
    stay inf or NaN; finite dropped elements are +-0 (a negative one -0, as x * 0)."""
    shape, seed = (6, 40), 21
    x = nonfinite(shape, dtype, device, 1, every=4)
    b = random(shape[-1:], dtype, device)
    b[5], b[17], b[30] = float("nan"), float("inf"), -float("inf")
    r = random(shape, dtype, device)
    keep = brrr_keep(shape, p, seed, device=device)
    assert torch.equal(keep, reference_keep(shape, p, seed))
    h = x.double().cpu() + b.double().cpu()
    bad = ~torch.isfinite(h)
    if p < 1:  # the mask keeps some of the non-finite elements and drops others
        assert (bad & keep).any() and (bad & ~keep).any()
    out = brrr.bias_dropout_add(x, b, r, p, seed=seed)
    ref = reference_out(x, b, r, keep, p)
    assert torch.isnan(ref[bad & ~keep]).all()
    assert_close(out, ref, dtype, scale=2.0)
    assert torch.equal(torch.isnan(out.cpu()), torch.isnan(ref)) and torch.equal(torch.isinf(out.cpu()), torch.isinf(ref))
    # Without a residual the dropped finite elements keep x's sign, as x * 0 does.
    plain = _C.dropout_fwd(x, b, p=p, seed=seed, offset=0)[0]
    ref = reference_out(x, b, None, keep, p)
    assert_close(plain, ref, dtype, scale=2.0)
    zeros = ref == 0
    assert torch.equal(torch.signbit(plain.cpu()[zeros]), torch.signbit(ref[zeros]))
    if p == 1.0:  # torch's own dropout draws no mask at p = 1: compare with it directly
        expected = r.double().cpu() + F.dropout(h, p=1.0, training=True)
        assert torch.isnan(expected[bad]).all()
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.5, 1.0])
@pytest.mark.parametrize("with_bias", [True, False])
def test_nonfinite_backward_matches_torch_product(device, dtype, p, with_bias):
    """grad_x = grad_out * keep * scale: an inf or NaN grad_out at a dropped element gives NaN, as
    torch's dropout backward; grad_bias sums those (NaN or inf in the columns that have them)."""
    shape, seed = (9, 24), 8
    x = nonfinite(shape, dtype, device, 2, every=5).requires_grad_()
    b = random(shape[-1:], dtype, device).requires_grad_() if with_bias else None
    r = random(shape, dtype, device)
    g = nonfinite(shape, dtype, device, 3, every=7)
    g[:, 3] = 1.0  # columns without inf and NaN too, for a finite grad_bias
    g[:, 11] = -2.0
    leaves = [t for t in (x, b) if t is not None]
    grads = torch.autograd.grad(brrr.bias_dropout_add(x, b, r, p, seed=seed), leaves, g)
    keep = reference_keep(shape, p, seed)
    bad = ~torch.isfinite(g.cpu())
    if p < 1:
        assert (bad & keep).any() and (bad & ~keep).any()
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    ref = torch_dropout_product(ref_leaves[0] + ref_leaves[1] if with_bias else ref_leaves[0], keep, p)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.double().cpu())
    assert torch.isnan(ref_grads[0][bad & ~keep]).all()
    assert_close(grads[0], ref_grads[0], dtype)
    assert torch.equal(torch.isnan(grads[0].cpu()), torch.isnan(ref_grads[0]))
    zeros = ref_grads[0] == 0
    assert torch.equal(torch.signbit(grads[0].cpu()[zeros]), torch.signbit(ref_grads[0][zeros]))
    if with_bias:
        assert_close(grads[1], ref_grads[1], dtype, scale=3.0)
        assert torch.equal(torch.isnan(grads[1].cpu()), torch.isnan(ref_grads[1]))
        assert torch.isfinite(grads[1][[3, 11]]).all() and not torch.isfinite(grads[1]).all()
    if p == 1.0:  # against torch's own dropout, which needs no mask at p = 1
        h = x.detach().double().cpu().requires_grad_()
        (expected,) = torch.autograd.grad(F.dropout(h, p=1.0, training=True), h, g.double().cpu())
        assert torch.isnan(expected[bad]).all()
        assert_close(grads[0], expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0,)], ids=str)
def test_zero_size(device, shape):
    x, r = torch.randn(shape, device=device, requires_grad=True), torch.randn(shape, device=device)
    b = torch.randn(shape[-1:], device=device, requires_grad=True)
    out = brrr.bias_dropout_add(x, b, r, 0.5, seed=1)
    assert out.shape == x.shape
    gx, gb = torch.autograd.grad(out, (x, b), torch.ones_like(out))
    assert gx.shape == x.shape and gb.shape == b.shape and not gb.any()


def test_nothing_is_saved_for_backward():
    saved = []
    x, b = torch.randn(16, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    r = torch.randn(16, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = brrr.bias_dropout_add(x, b, r, 0.5, seed=1)
    assert saved == [] and y.grad_fn.name() == "brrr_bias_dropout_add_eagerBackward"
    y.sum().backward()
    assert x.grad is not None and b.grad is not None and r.grad is not None


def test_double_backward_raises():
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(brrr.bias_dropout_add(x, None, torch.zeros_like(x), 0.5, seed=1).sum(), x,
                               create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, r = (random((6, 5, 32), torch.float32, device).requires_grad_() for _ in range(2))
    b = random((32,), torch.float32, device).requires_grad_()
    ops = torch.ops.brrr
    torch.library.opcheck(ops.bias_dropout_add.default, (x, b, r, 0.5, 3, 4))
    torch.library.opcheck(ops.bias_dropout_add.default, (x, None, r, 0.1, 2**62, 0))
    g = random((6, 5, 32), torch.float32, device)
    torch.library.opcheck(ops.bias_dropout_add_backward.default, (g, 0.5, 3, 4, True))
    torch.library.opcheck(ops.bias_dropout_add_backward.default, (g, 0.5, 3, 4, False))


def test_torch_compile_traces_without_graph_breaks():
    x, r = (random((8, 64), torch.float32, "cpu").requires_grad_() for _ in range(2))
    b = random((64,), torch.float32, "cpu").requires_grad_()

    def block(x, b, r, seed=None):
        h = brrr.bias_dropout_add(x, b, r, 0.2, seed=seed if seed is not None else 17, offset=1)
        return brrr.bias_dropout_add(h, None, r, 0.1, seed=seed if seed is not None else 18) * 2

    explained = torch._dynamo.explain(block)(x, b, r)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(x, b, r)
    assert torch.equal(out, block(x, b, r))
    for a, e in zip(torch.autograd.grad(out.sum(), (x, b, r)), torch.autograd.grad(block(x, b, r).sum(), (x, b, r))):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_torch_compile_with_a_drawn_seed():
    """seed=None draws on the host: one graph when dynamo captures scalar outputs, and the same
    mask as eager under the same torch.manual_seed."""
    x, r = torch.randn(8, 64), torch.randn(8, 64)
    f = lambda x, r: brrr.bias_dropout_add(x, None, r, 0.5)  # noqa: E731
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch._dynamo.reset()
        assert torch._dynamo.explain(f)(x, r).graph_break_count == 0
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        torch.manual_seed(3)
        out = compiled(x, r)
        assert not torch.equal(compiled(x, r), out)
    torch.manual_seed(3)
    assert torch.equal(out, f(x, r))
    torch._dynamo.reset()


def test_numpy_arrays():
    x = np.random.default_rng(0).standard_normal((5, 12)).astype(np.float32)
    b, r = x[0].copy(), x[::-1].copy()
    out = brrr.bias_dropout_add(x, b, r, 0.5, seed=8)
    expected = brrr.bias_dropout_add(torch.from_numpy(x), torch.from_numpy(b), torch.from_numpy(r), 0.5, seed=8)
    assert isinstance(out, np.ndarray) and np.array_equal(out, expected.numpy())
    with pytest.raises(TypeError, match="argument seed: required"):
        brrr.bias_dropout_add(x, b, r, 0.5)


def test_registry():
    x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    op = registry.lookup("bias_dropout_add")
    assert op.resolve(x, b, r, 0.5) is brrr.bias_dropout_add
    assert torch.equal(registry("bias_dropout_add", x, b, r, 0.5, seed=2), brrr.bias_dropout_add(x, b, r, 0.5, seed=2))
    xi = torch.ones(4, 8, dtype=torch.int32)
    assert op.resolve(xi, None, xi, 0.5) is not brrr.bias_dropout_add  # falls back to PyTorch
    assert torch.equal(registry("bias_dropout_add", xi, None, xi, 0.5, training=False), 2 * xi)


# ---- errors ---------------------------------------------------------------------------------------

def test_argument_errors():
    x, r, b = torch.randn(4, 5), torch.randn(4, 5), torch.randn(5)
    snapshot = (x.clone(), r.clone())
    cases = [
        (dict(p=-0.1), ValueError, "argument p: dropout probability has to be between 0 and 1, got -0.1"),
        (dict(p=1.5), ValueError, "argument p: dropout probability"),
        (dict(p=float("nan")), ValueError, "argument p: dropout probability"),
        (dict(p="0.5"), TypeError, "argument p: expected a float"),
        (dict(p=True), TypeError, "argument p: expected a float"),
        (dict(training=1), TypeError, "argument training: expected a bool"),
        (dict(seed=-1), ValueError, r"argument seed: expected an int in \[0, 2\*\*63\)"),
        (dict(seed=2**63), ValueError, "argument seed"),
        (dict(seed=1.0), TypeError, "argument seed: expected an int"),
        (dict(offset=-3), ValueError, "argument offset"),
        (dict(offset=None), TypeError, "argument offset: expected an int"),
        (dict(bias=torch.randn(4)), ValueError, r"argument bias has shape \(4,\) but x.shape\[-1:\] has shape \(5,\)"),
        (dict(bias=torch.randn(4, 5)), ValueError, r"argument bias has shape \(4, 5\)"),
        (dict(bias=b.double()), ValueError, "argument bias has dtype float64 but x has dtype float32"),
        (dict(residual=torch.randn(4, 6)), ValueError, r"argument residual has shape \(4, 6\) but x has shape \(4, 5\)"),
        (dict(residual=torch.randn(5)), ValueError, "argument residual has shape"),
        (dict(residual=r.half()), ValueError, "argument residual has dtype float16"),
        (dict(residual=None), TypeError, "argument residual: expected a tensor"),
        (dict(x=torch.tensor(1.0), residual=torch.tensor(2.0), bias=torch.randn(1)), ValueError,
         "argument bias: x is 0-d"),
        (dict(x=x.int(), residual=r.int()), TypeError, "argument x: dtype int32 is not supported"),
    ]
    for kwargs, exc, message in cases:
        args = dict(x=x, bias=b, residual=r, p=0.5, seed=1)
        args.update(kwargs)
        with pytest.raises(exc, match=message):
            brrr.bias_dropout_add(**args)
    assert torch.equal(x, snapshot[0]) and torch.equal(r, snapshot[1])


def test_c_argument_errors():
    x, r, b = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    out = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="argument p: expected a dropout probability between 0 and 1"):
        _C.dropout_fwd(x, b, r, out, 2.0, 1, 0)
    with pytest.raises(ValueError, match=r"argument seed: expected an int in \[0, 2\*\*64\)"):
        _C.dropout_fwd(x, b, r, out, 0.5, -1, 0)
    with pytest.raises(TypeError, match="argument offset: expected an int"):
        _C.dropout_fwd(x, b, r, out, 0.5, 1, 0.0)
    with pytest.raises(TypeError, match="argument stream"):
        _C.dropout_fwd(x, b, r, out, 0.5, 1, 0, "default")
    with pytest.raises(TypeError, match="missing argument 'offset'"):
        _C.dropout_fwd(x, b, r, out, 0.5, 1)
    with pytest.raises(TypeError, match="takes at most 8 arguments"):
        _C.dropout_fwd(x, b, r, out, 0.5, 1, 0, -1, None)
    base = torch.randn(40)
    with pytest.raises(ValueError, match="argument out overlaps input x"):
        _C.dropout_fwd(base[:32].view(4, 8), b, r, base[1:33].view(4, 8), 0.5, 1, 0)
    with pytest.raises(ValueError, match="argument out overlaps input bias"):
        _C.dropout_fwd(x, base[:8], r, base[:32].view(4, 8), 0.5, 1, 0)
    with pytest.raises(ValueError, match="argument out: output has overlapping elements"):
        _C.dropout_fwd(x, b, r, torch.zeros(8).expand(4, 8), 0.5, 1, 0)
    with pytest.raises(ValueError, match="argument grad_bias has shape"):
        _C.dropout_bwd(x, out, torch.zeros(7), None, 0.5, 1, 0)
    with pytest.raises(ValueError, match="argument grad_bias overlaps input grad_out"):
        _C.dropout_bwd(x, out, x[0], None, 0.5, 1, 0)
    read_only = np.zeros((4, 8), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="argument out: output is read-only"):
        _C.dropout_fwd(np.ones((4, 8), np.float32), None, None, read_only, 0.5, 1, 0)
    assert not out.any(), "an output was written by a call that failed"
    # In place into the residual (an identical view), and no residual at all, are allowed.
    expected = brrr.bias_dropout_add(x, b, r, 0.5, seed=1)
    assert _C.dropout_fwd(x, b, r, r, 0.5, 1, 0)[0] is r and torch.equal(r, expected)
    assert torch.equal(_C.dropout_fwd(x, b, None, None, 0.5, 1, 0)[0],
                       brrr.bias_dropout_add(x, b, torch.zeros_like(x), 0.5, seed=1))


@pytest.mark.cuda
def test_cuda_argument_errors():
    x, r, b = (random(s, torch.float32, "cuda") for s in ((4, 8), (4, 8), (8,)))
    with pytest.raises(ValueError, match="argument residual is on cpu but x is on cuda"):
        brrr.bias_dropout_add(x, b, r.cpu(), 0.5, seed=1)
    with pytest.raises(ValueError, match="argument bias is on cpu but x is on cuda"):
        brrr.bias_dropout_add(x, b.cpu(), r, 0.5, seed=1)
    # partials=None: allocated by brrr._C on torch's current stream, required on any other
    grad_x, grad_b = _C.dropout_bwd(x, None, True, None, 0.5, 1, 0)
    given = torch.empty(_C.chain_partial_rows(4) * 8, device="cuda")
    assert torch.equal(grad_b, _C.dropout_bwd(x, None, True, given, 0.5, 1, 0)[1])
    with pytest.raises(TypeError, match="argument partials: required on CUDA"):
        _C.dropout_bwd(x, torch.empty_like(x), torch.empty_like(b), None, 0.5, 1, 0,
                       torch.cuda.current_stream().cuda_stream)
    with pytest.raises(ValueError, match="argument partials: expected a contiguous 1-D tensor"):
        _C.dropout_bwd(x, torch.empty_like(x), torch.empty_like(b), torch.empty(3, device="cuda"), 0.5, 1, 0)


# ---- CUDA against the CPU twin ------------------------------------------------------------------------

def _cuda_layouts():
    """Views that, with the shapes below, reach every CUDA path: packed chunks with and without a
    tail, a bias packed or not, misaligned pointers, strided views, vectorised and scalar rows
    (of one leading dim and of two that do not merge)."""
    return {
        "dense": lambda t: t,
        "tail": lambda t: t.flatten()[: t.numel() - 3],
        "misaligned": lambda t: t.flatten()[1:],
        "column_slice": lambda t: t[..., ::2],
        "row_slice": lambda t: t[..., 1:, :],
        "transposed": lambda t: t.transpose(-1, -2),
    }


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 4096), (257, 136), (5, 7, 136), (2, 1031)], ids=str)
@pytest.mark.parametrize("layout", list(_cuda_layouts()))
def test_cuda_matches_cpu_bitwise(dtype, shape, layout):
    view = _cuda_layouts()[layout]
    base_x, base_r, base_g = (random(shape, dtype, "cpu") for _ in range(3))
    x, r = view(base_x), view(base_r)
    cols = x.shape[-1]
    b = random((cols,), dtype, "cpu") if x.dim() > 1 else None
    for p, seed, offset in [(0.3, 42, 0), (0.9, 2**40 + 1, 2**35), (0.0, 1, 1), (1.0, 1, 1)]:
        results = []
        for device in ("cpu", "cuda"):
            xd = view(base_x.to(device)).requires_grad_()
            bd = b.to(device).requires_grad_() if b is not None else None
            rd = view(base_r.to(device))
            out = brrr.bias_dropout_add(xd, bd, rd, p, seed=seed, offset=offset)
            grads = torch.autograd.grad(out, [t for t in (xd, bd) if t is not None], view(base_g.to(device)))
            results.append([out, *grads])
        cpu, cuda = results
        assert torch.equal(cuda[0].cpu(), cpu[0]), (p, "out")
        assert torch.equal(cuda[1].cpu(), cpu[1]), (p, "grad_x")
        if b is not None:  # summed in another order on the GPU
            assert_close(cuda[2], cpu[2].double(), dtype, scale=max(2.0, (x.numel() // cols) ** 0.5))
        assert_close(cuda[0], reference_out(x, b, r, reference_keep(tuple(x.shape), p, seed, offset), p), dtype,
                     scale=2.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 4096), (257, 136), (2, 1031)], ids=str)
@pytest.mark.parametrize("layout", list(_cuda_layouts()))
def test_cuda_nonfinite_matches_cpu(dtype, shape, layout):
    """inf and NaN in x, bias and grad_out through every CUDA path: the same NaN, inf and zero
    (sign included) as the CPU twin, the rest bitwise; grad_bias NaN where the CPU's is."""
    view = _cuda_layouts()[layout]
    base_x, base_g = nonfinite(shape, dtype, "cpu", 4, every=5), nonfinite(shape, dtype, "cpu", 5, every=6)
    base_r = random(shape, dtype, "cpu")
    cols = view(base_x).shape[-1]
    b = random((cols,), dtype, "cpu") if view(base_x).dim() > 1 else None
    if b is not None:
        b[0], b[cols // 2], b[cols - 1] = float("nan"), float("inf"), -float("inf")
    for p, seed, offset in [(0.3, 42, 0), (0.9, 2**40 + 1, 2**35), (1.0, 1, 1)]:
        results = []
        for device in ("cpu", "cuda"):
            xd = view(base_x.to(device)).requires_grad_()
            bd = b.to(device).requires_grad_() if b is not None else None
            out = brrr.bias_dropout_add(xd, bd, view(base_r.to(device)), p, seed=seed, offset=offset)
            grads = torch.autograd.grad(out, [t for t in (xd, bd) if t is not None], view(base_g.to(device)))
            plain = _C.dropout_fwd(xd.detach(), bd.detach() if bd is not None else None, p=p, seed=seed, offset=offset)[0]
            results.append([out, plain, *grads])
        cpu, cuda = results
        for name, a, e in zip(("out", "no residual", "grad_x"), cuda, cpu):
            assert_same_but_nan_bits(a, e, (p, name))
        if b is not None:  # summed in another order on the GPU
            assert torch.equal(torch.isnan(cuda[3].cpu()), torch.isnan(cpu[3])), p
            assert_close(cuda[3], cpu[3].double(), dtype, scale=max(2.0, (base_x.numel() // cols) ** 0.5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape,cols_slice", [((20011, 768), None), ((4096, 4100), None), ((2049, 4097), None),
                                              ((4001, 3072), slice(None, None, 2))], ids=str)
def test_cuda_bias_grad_is_deterministic(dtype, shape, cols_slice):
    """Two backward runs give bitwise identical grad_bias (fixed partial rows, no atomics)."""
    x = random(shape, dtype, "cuda")
    if cols_slice is not None:
        x = x[:, cols_slice]
    x.requires_grad_()
    b = random(x.shape[-1:], dtype, "cuda").requires_grad_()
    r, g = random(x.shape, dtype, "cuda"), random(x.shape, dtype, "cuda")
    runs = [torch.autograd.grad(brrr.bias_dropout_add(x, b, r, 0.1, seed=5), (x, b), g) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    keep = brrr_keep(tuple(x.shape), 0.1, 5).cuda()  # the CPU twin's mask (checked against Philox above)
    ref_b = torch.where(keep, g.double() / 0.9, 0.0).sum(0)
    assert_close(runs[0][1], ref_b, dtype, scale=shape[0] ** 0.5)


@pytest.mark.cuda
def test_cuda_keep_rate_and_large_offsets():
    n = 1 << 22
    for p in (0.1, 0.5, 0.9):
        keep = brrr_keep((n,), p, seed=9, offset=2**40, device="cuda")
        assert abs(keep.double().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(brrr_keep((1 << 16,), 0.5, 2**63 - 1, 2**63 - 1, "cuda"),
                       reference_keep((1 << 16,), 0.5, 2**63 - 1, 2**63 - 1))
