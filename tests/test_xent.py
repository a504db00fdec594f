"""brrr.cross_entropy (class-index targets): the loss and the input gradient against float64
torch.nn.functional.cross_entropy on fresh random inputs, for every dtype, reduction, label
smoothing and ignore_index; class counts on both sides of the CUDA kernels' switches (8 threads,
a warp, a block per row), rows that are and are not 16-byte aligned, unbatched and (N, C, d1, d2)
inputs, non-contiguous inputs, targets and upstream gradients, int32 / uint8 targets; rows offset
by +-1e4 (a naive exp overflows), +-inf and NaN logits, all rows ignored, zero rows; NumPy arrays;
the torch.library op (its saved log-sum-exp and count, opcheck), torch.compile without graph
breaks, gradcheck, determinism, what autograd saves, the C entry points with NaN-poisoned
outputs, and argument errors. CUDA only: CPU against CUDA, and an out-of-range target giving a
NaN row (it is not checked there).
"""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import brrr
from helpers import DEVICES, DTYPES, TOLERANCE, random

REDUCTIONS = ["mean", "sum", "none"]
# classes -> row counts. The CUDA kernels give a row 8 threads up to 64 classes, a warp up to 4096,
# a block above; odd class counts leave rows that start off a 16-byte boundary (their heads are
# peeled), 64, 1000, 2048, 4096 and 32000 keep every row aligned.
ROWS = {1: (1, 3, 257), 2: (1, 3, 257), 7: (1, 3, 257), 33: (1, 3, 257), 64: (3, 257), 65: (3, 257),
        1000: (1, 3, 257), 1001: (1, 3, 257), 2048: (1, 3, 65), 2049: (1, 3, 65), 4096: (1, 3, 257),
        4097: (1, 3, 257), 32000: (1, 3)}
SHAPES = [(c, n) for c, rows in ROWS.items() for n in rows]
# (name, ignore_index): the default with some targets set to it, one inside [0, C), one negative.
IGNORE = [("default", -100), ("in range", 3), ("negative", -1)]


# ---- references -------------------------------------------------------------------------------

def reference(x, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0):
    """(leaf, loss): F.cross_entropy in float64 on a CPU float64 leaf holding x's values, of
    softcap * tanh(x / softcap) with a softcap, plus z_loss * logsumexp^2 for each counted row."""
    leaf = x.detach().to("cpu", torch.float64).requires_grad_()
    return leaf, reference_loss(leaf, target, ignore_index, reduction, label_smoothing, softcap, z_loss)


def reference_loss(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
                   z_loss=0.0):
    """The loss brrr.cross_entropy computes, written out in PyTorch ops (class dim 1 as torch's)."""
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    target = target.to(z.device, torch.int64)
    if z_loss == 0.0:
        return F.cross_entropy(z, target, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    rows = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    counted = target != ignore_index
    rows = rows + torch.where(counted, z_loss * torch.logsumexp(z, dim=0 if z.dim() == 1 else 1) ** 2, 0.0)
    if reduction == "none":
        return rows
    return rows.sum() / counted.sum() if reduction == "mean" else rows.sum()


def check(name, actual, expected, dtype, slack=1.0, scale=None, extra=0.0):
    """Elementwise against the float64 reference with the storage dtype's tolerance (times slack,
    plus `extra`, a relative error the computation cannot avoid); the absolute part is relative
    to `scale`, the size of the terms the result is made of (by default the reference's largest
    value, at least 1). NaN must be exactly where the reference has NaN."""
    tol = TOLERANCE[dtype]
    actual64 = actual.detach().to("cpu", torch.float64)
    expected64 = expected.detach().to("cpu", torch.float64)
    assert actual64.shape == expected64.shape, (name, actual64.shape, expected64.shape)
    if scale is None:
        finite = expected64[torch.isfinite(expected64)]
        scale = max(finite.abs().max().item() if finite.numel() else 0.0, 1.0)
    # never below the spacing of the dtype's subnormals (float16 gradients of mean losses reach them)
    subnormal = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    torch.testing.assert_close(actual64, expected64, rtol=tol["rtol"] * slack + extra,
                               atol=max((tol["atol"] * slack + extra) * scale, subnormal), equal_nan=True,
                               msg=lambda m: f"{name}: {m}")


def make_targets(shape, classes, device, ignore, dtype=torch.int64):
    """Random targets in [0, classes), some of them set to the ignore_index: every fourth row
    (from the second) for -100 / -1, every fifth (from the third) for an index inside [0, C)."""
    name, ignore_index = ignore
    t = torch.randint(0, classes, shape, dtype=torch.int64).flatten()
    if ignore_index < 0:
        t[1::4] = ignore_index
    elif ignore_index < classes:
        t[2::5] = ignore_index
    return t.reshape(shape).to(device=device, dtype=dtype)


def saved_lse(x, target):
    """What the forward saves per row (class dim last): the log-sum-exp less the target's logit
    where that is finite (brrr._C's convention: exact for rows with a large common offset)."""
    x64 = x.detach().to("cpu", torch.float64)
    x_t = x64.gather(-1, target.to("cpu", torch.int64).clamp_min(0)[..., None])[..., 0]
    return torch.logsumexp(x64, -1) - torch.where(torch.isfinite(x_t), x_t, torch.zeros_like(x_t))


def counted(target, ignore_index):
    return int((target != ignore_index).sum().item())


def compare(x, target, reduction="mean", label_smoothing=0.0, ignore_index=-100, slack=1.0, what="", g=None,
            extra=0.0, softcap=None, z_loss=0.0):
    """brrr and the reference on the same values: the loss, and the input gradient for the upstream
    gradient g (random by default); ignored rows must be exactly 0 in both (reduction none)."""
    dtype = x.dtype
    leaf = x.detach().requires_grad_()  # keeps x's strides
    loss = brrr.cross_entropy(leaf, target, ignore_index=ignore_index, reduction=reduction,
                              label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss)
    ref_leaf, ref = reference(x, target, ignore_index, reduction, label_smoothing, softcap, z_loss)
    where = (f"{what} reduction={reduction} label_smoothing={label_smoothing} ignore_index={ignore_index} "
             f"softcap={softcap} z_loss={z_loss}")
    assert isinstance(loss, torch.Tensor) and loss.dtype == dtype and loss.device == x.device, where
    assert loss.shape == ref.shape, (where, loss.shape, ref.shape)
    check(f"loss ({where})", loss, ref, dtype, slack, extra=extra)

    g = random(loss.shape, dtype, x.device) if g is None else g
    loss.backward(g)
    ref.backward(g.to("cpu", torch.float64))
    n = counted(target, ignore_index)
    grad_scale = g.abs().max().item() / (max(n, 1) if reduction == "mean" else 1)
    assert leaf.grad.shape == x.shape and leaf.grad.dtype == dtype, where
    check(f"grad ({where})", leaf.grad, ref_leaf.grad, dtype, slack, scale=grad_scale, extra=extra)

    ignored = (target == ignore_index).to(x.device)
    if ignored.any():
        class_dim = 0 if x.dim() == 1 else 1
        grad_rows = leaf.grad.movedim(class_dim, -1)[ignored]
        assert not grad_rows.any(), f"{where}: gradient of an ignored row is not 0"
        if reduction == "none":
            assert not loss[ignored].any(), f"{where}: loss of an ignored row is not 0"
    return loss, leaf.grad


# ---- loss and gradient against torch -----------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes,rows", SHAPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_torch(device, dtype, classes, rows, reduction):
    for label_smoothing in (0.0, 0.1):
        for ignore in IGNORE:
            x = random((rows, classes), dtype, device, low=-10.0, high=10.0)
            t = make_targets((rows,), classes, device, ignore)
            compare(x, t, reduction, label_smoothing, ignore[1], what=f"({rows}, {classes}) {ignore[0]}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [1, 7, 1001, 4096])
def test_full_label_smoothing(device, dtype, classes):
    """label_smoothing = 1: the mean over the classes of -log_softmax, the target only selects
    whether the row counts."""
    for reduction in REDUCTIONS:
        x = random((9, classes), dtype, device, low=-10.0, high=10.0)
        compare(x, make_targets((9,), classes, device, IGNORE[0]), reduction, 1.0)


# (softcap, z_loss): Gemma 2's final-logit cap (30) and a tight one (3: most logits of [-10, 10]
# saturate, the gradient through tanh is small), PaLM's z-loss coefficient (1e-4) and a large one.
CAPS = [(30.0, 0.0), (3.0, 0.0), (None, 1e-4), (None, 0.3), (3.0, 0.3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes,rows", [(1, 3), (7, 257), (65, 3), (1001, 257), (4097, 65)])
@pytest.mark.parametrize("softcap,z_loss", CAPS)
def test_softcap_and_z_loss_match_torch(device, dtype, classes, rows, softcap, z_loss):
    """softcap and z_loss against F.cross_entropy of softcap * tanh(x / softcap) plus z_loss times
    each counted row's squared logsumexp, in float64: every reduction, with and without label
    smoothing, ignored rows (their gradient exactly 0)."""
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.1):
            x = random((rows, classes), dtype, device, low=-10.0, high=10.0)
            t = make_targets((rows,), classes, device, IGNORE[0])
            compare(x, t, reduction, label_smoothing, softcap=softcap, z_loss=z_loss, what=f"({rows}, {classes})")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softcap_and_z_loss_on_views_and_spatial_inputs(device, dtype):
    """The transformed logits through every layout the kernels read: strided classes, unaligned
    row heads, (N, C, d) inputs; and +-inf logits, which the softcap maps to +-softcap."""
    for name, x in _views(dtype, device):
        x2 = x if x.dim() == 2 else x.movedim(-1, 1)
        lead = x.shape[:-1]
        t = make_targets(lead if x.dim() == 2 else (lead[0],) + lead[1:], x.shape[-1], device, IGNORE[0])
        compare(x2, t, "mean", 0.1, softcap=5.0, z_loss=0.01, what=name)
    x = random((6, 33), torch.float64, "cpu", low=-10.0, high=10.0)
    x[1, 4], x[2, 9] = float("inf"), -float("inf")
    t = torch.randint(0, 33, (6,))
    for reduction in REDUCTIONS:
        loss, grad = compare(x.to(device, dtype), t.to(device), reduction, 0.0, softcap=5.0, z_loss=0.01, what="inf")
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("softcap,z_loss", CAPS)
def test_softcap_and_z_loss_gradcheck(softcap, z_loss):
    x = random((5, 7), torch.float64, "cpu").requires_grad_()
    t = torch.tensor([1, -100, 6, 0, 3])
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(lambda x: brrr.cross_entropy(
            x, t, reduction=reduction, label_smoothing=0.2, softcap=softcap, z_loss=z_loss), (x,))


def test_softcap_of_none_and_zero_z_loss_change_nothing():
    """softcap=None and z_loss=0 are the plain loss, bitwise."""
    x = random((33, 1001), torch.float32, "cpu", low=-10.0, high=10.0).requires_grad_()
    t = make_targets((33,), 1001, "cpu", IGNORE[0])
    plain = brrr.cross_entropy(x, t, label_smoothing=0.1)
    explicit = brrr.cross_entropy(x, t, label_smoothing=0.1, softcap=None, z_loss=0.0)
    assert torch.equal(plain, explicit)
    assert torch.equal(torch.autograd.grad(plain, x)[0], torch.autograd.grad(explicit, x)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [7, 1000, 4097])
def test_large_offset_is_stable(device, dtype, classes):
    """Rows offset by +-1e4 (float32 / float64; +-100 for the half types, which exp overflows in
    float32 too): a naive exp overflows or underflows. The saved lse is rounded to the compute
    dtype, so x - lse, and with it every softmax value, is only known to about eps * |x|: that
    is added to the tolerance (it shows where the target's softmax is close to 1, and its gradient
    1 - softmax cancels)."""
    offset = 1e4 if dtype in (torch.float32, torch.float64) else 100.0
    x = random((12, classes), torch.float64, "cpu", low=-10.0, high=10.0)
    x[0::3] += offset
    x[1::3] -= offset
    x = x.to(device=device, dtype=dtype)
    precision = 2 * torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps * (offset + 10)
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.1):
            t = make_targets((12,), classes, device, IGNORE[0])
            compare(x, t, reduction, label_smoothing, extra=precision, what=f"offset {offset}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("classes", [64, 1024])
def test_label_smoothing_of_logits_near_the_dtype_max(device, dtype, classes):
    """Logits of +-0.9 times the dtype's largest value with label smoothing: the smoothing term's
    mean of the logits is finite (0 here), and so is each row's loss, as in float64. A sum of
    the logits overflowed: -inf where it reached inf (row 0), NaN where partial sums reached
    +inf and -inf (row 1)."""
    big = 0.9 * torch.finfo(dtype).max
    sign = torch.ones(2, classes, dtype=torch.float64)
    sign[0, classes // 2:] = -1  # the positive half first
    sign[1, torch.arange(classes) % 16 >= 8] = -1  # interleaved
    x = (sign * big).to(device=device, dtype=dtype)
    t = torch.tensor([0, 0], device=device)  # a largest logit
    # lse = z_t + log(classes / 2) and the mean logit is 0: the loss is log(classes / 2) + 0.1 z_t
    # (written out: torch's float64 reference overflows at float64's largest values)
    row = math.log(classes / 2) + 0.1 * x[0, 0].item()
    for reduction, expected in (("none", torch.tensor([row, row], dtype=torch.float64)),
                                ("mean", torch.tensor(row, dtype=torch.float64))):
        loss = brrr.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
        check(f"loss ({reduction})", loss, expected, dtype)


# ---- shapes and layouts -------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [1, 7, 4097])
def test_unbatched(device, dtype, classes):
    """Input (C,), target 0-d; an ignored target gives NaN (mean), 0 (sum, none)."""
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.1):
            x = random((classes,), dtype, device, low=-10.0, high=10.0)
            t = torch.randint(0, classes, (), device=device)
            loss, _ = compare(x, t, reduction, label_smoothing, what="unbatched")
            assert loss.shape == ()
            compare(x, torch.tensor(-100, device=device), reduction, label_smoothing, what="unbatched, ignored")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 7, 5), (2, 33, 4, 3), (2, 1001, 3, 2), (2, 4097, 3)], ids=str)
def test_spatial_dims(device, dtype, shape):
    """(N, C, d1, ..., dk): class dim 1, target (N, d1, ..., dk); also from channels-last storage."""
    target_shape = (shape[0],) + shape[2:]
    for reduction in REDUCTIONS:
        for ignore in IGNORE[:2]:
            x = random(shape, dtype, device, low=-10.0, high=10.0)
            t = make_targets(target_shape, shape[1], device, ignore)
            compare(x, t, reduction, 0.1, ignore[1], what=f"{shape}")
            channels_last = random(shape[:1] + shape[2:] + shape[1:2], dtype, device, low=-10.0, high=10.0)
            compare(channels_last.movedim(-1, 1), t, reduction, 0.0, ignore[1], what=f"{shape} channels last")


def _views(dtype, device):
    """(name, x): views of fresh storage, non-contiguous or starting off a 16-byte boundary."""
    big = lambda *s: random(s, dtype, device, low=-10.0, high=10.0)  # noqa: E731
    yield "transposed (class stride N)", big(1001, 37).t()
    yield "strided classes x[:, ::2]", big(37, 2002)[:, ::2]
    yield "strided classes, a block per row", big(5, 8194)[:, ::2]
    yield "offset start x[1:] (contiguous)", big(38, 1001)[1:]
    yield "unaligned row heads x[:, 1:]", big(37, 4098)[:, 1:]
    yield "row stride x[::2]", big(74, 4096)[::2]
    yield "offset start (contiguous)", big(37 * 33 + 1).flatten()[1:].view(37, 33)
    yield "3-d permuted rows", big(7, 5, 33).transpose(0, 1)  # (5, 7, 33): rows out of order


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(device, dtype):
    """Strided and offset views give the reference's result and that of their contiguous copy."""
    for name, x in _views(dtype, device):
        assert x.is_contiguous() == name.endswith("(contiguous)"), name
        classes = x.shape[-1]
        lead = x.shape[:-1]
        x2 = x if x.dim() == 2 else x.movedim(-1, 1)  # (N, C) or (N, C, d)
        t = make_targets(lead if x.dim() == 2 else (lead[0],) + lead[1:], classes, device, IGNORE[0])
        for reduction in REDUCTIONS:
            g = random(t.shape if reduction == "none" else (), dtype, device)
            loss, grad = compare(x2, t, reduction, 0.1, what=name, g=g)
            dense_loss, dense_grad = compare(x2.contiguous(), t, reduction, 0.1, what=name + " (contiguous copy)", g=g)
            torch.testing.assert_close(loss, dense_loss, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(grad, dense_grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_targets(device):
    dtype = torch.float32
    x = random((40, 33), dtype, device, low=-10.0, high=10.0)
    for reduction in REDUCTIONS:
        t = make_targets((80,), 33, device, IGNORE[0])[::2]
        assert not t.is_contiguous()
        compare(x, t, reduction, 0.1, what="t[::2]")
        x3 = random((4, 33, 6), dtype, device, low=-10.0, high=10.0)
        t3 = make_targets((6, 4), 33, device, IGNORE[0]).t()
        compare(x3, t3, reduction, 0.0, what="transposed target")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32, torch.uint8], ids=str)
def test_target_dtypes(device, target_dtype):
    """int32 and uint8 targets give what int64 ones do (uint8 cannot hold -100: ignore_index 255)."""
    x = random((65, 200), torch.float32, device, low=-10.0, high=10.0)
    ignore = ("uint8", 255) if target_dtype == torch.uint8 else IGNORE[0]
    t = make_targets((65,), 200, device, ignore)
    if target_dtype == torch.uint8:
        t[1::4] = 255
    t = t.to(target_dtype)
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.1):
            loss, grad = compare(x, t, reduction, label_smoothing, ignore[1], what=str(target_dtype))
            loss64 = brrr.cross_entropy(x, t.long(), ignore_index=ignore[1], reduction=reduction,
                                        label_smoothing=label_smoothing)
            assert torch.equal(loss.detach(), loss64)


# ---- gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_gradcheck(reduction, label_smoothing):
    x = random((5, 7), torch.float64, "cpu").requires_grad_()
    t = torch.tensor([1, -100, 6, 0, 3])
    assert torch.autograd.gradcheck(
        lambda x: brrr.cross_entropy(x, t, reduction=reduction, label_smoothing=label_smoothing), (x,))
    x3 = random((2, 4, 3), torch.float64, "cpu").requires_grad_()
    t3 = torch.tensor([[0, 3, 3], [1, 2, 0]])
    assert torch.autograd.gradcheck(
        lambda x: brrr.cross_entropy(x, t3, ignore_index=3, reduction=reduction, label_smoothing=label_smoothing),
        (x3,))


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_formula(device):
    """grad = g * (softmax - (1 - eps) * onehot - eps / C) (divided by the count for mean),
    written out directly in float64."""
    x = random((6, 11), torch.float64, device, low=-10.0, high=10.0).requires_grad_()
    t = torch.tensor([3, -100, 0, 10, -100, 5], device=device)
    eps, g = 0.2, 1.7
    brrr.cross_entropy(x, t, reduction="mean", label_smoothing=eps).backward(torch.tensor(g, dtype=torch.float64,
                                                                                         device=device))
    keep = (t != -100).cpu()
    onehot = F.one_hot(t.cpu().clamp_min(0), 11).double()
    expected = g / keep.sum().item() * (torch.softmax(x.detach().cpu(), -1) - (1 - eps) * onehot - eps / 11)
    expected[~keep] = 0
    check("grad", x.grad, expected, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_upstream_gradient_layouts(device, dtype):
    """reduction none: the upstream gradient of loss.sum() (expanded, stride 0), a strided one, and
    a transposed one for (N, C, d) inputs."""
    x = random((33, 1001), dtype, device, low=-10.0, high=10.0)
    t = make_targets((33,), 1001, device, IGNORE[0])
    compare(x, t, "none", 0.1, g=torch.ones((), dtype=dtype, device=device).expand(33), what="expanded g")
    compare(x, t, "none", 0.1, g=random((66,), dtype, device)[::2], what="strided g")
    x3 = random((4, 65, 6), dtype, device, low=-10.0, high=10.0)
    t3 = make_targets((4, 6), 65, device, IGNORE[0])
    compare(x3, t3, "none", 0.0, g=random((6, 4), dtype, device).t(), what="transposed g")
    leaf = x.detach().requires_grad_()
    brrr.cross_entropy(leaf, t, reduction="none").sum().backward()
    ref_leaf, ref = reference(x, t, reduction="none")
    ref.sum().backward()
    check("grad of loss.sum()", leaf.grad, ref_leaf.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_loss_dtype_argument(device):
    """dtype= (brrr's addition): the loss in that dtype, as F.cross_entropy(logits.float(), target)."""
    x = random((9, 130), torch.bfloat16, device, low=-10.0, high=10.0).requires_grad_()
    t = make_targets((9,), 130, device, IGNORE[0])
    for reduction in REDUCTIONS:
        loss = brrr.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1, dtype=torch.float32)
        assert loss.dtype == torch.float32
        ref_leaf, ref = reference(x, t, -100, reduction, 0.1)
        check("loss", loss, ref, torch.float32)
        (grad,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
        ref.backward(torch.ones_like(ref))
        assert grad.dtype == torch.bfloat16
        check("grad", grad, ref_leaf.grad, torch.bfloat16)
    out = brrr.cross_entropy(x.detach().float().cpu().numpy().astype(np.float16), t.cpu().numpy(), dtype=np.float32)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32


# ---- the C entry points with NaN-poisoned outputs -------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [7, 65, 1001, 4097])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_output_element_is_written(device, dtype, classes, reduction):
    """brrr._C with every output full of NaN: the forward's per-row lse and loss (0 where ignored),
    total and count; the backward's gradient into a strided view of a NaN buffer, whose other
    elements must stay NaN, and in place over a copy of the logits."""
    from brrr import _C

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rows, eps = 37, 0.1
    x = random((rows, classes), dtype, device, low=-10.0, high=10.0)
    t = make_targets((rows,), classes, device, IGNORE[0])
    keep = t != -100

    def nan(shape, dt=acc):
        return torch.full(shape, float("nan"), dtype=dt, device=device)

    lse, loss, total, count = nan((rows,)), nan((rows,)), nan(()), nan(())
    _C.cross_entropy_fwd(x, t, lse, loss, None if reduction == "none" else total, count, ignore_index=-100,
                         label_smoothing=eps, reduction=reduction)
    check("lse", lse[keep], saved_lse(x, t)[keep.cpu()], acc)
    assert not lse[~keep].any() and not loss[~keep].any(), "lse or loss of an ignored row is not 0"
    check("loss", loss, reference(x, t, -100, "none", eps)[1], acc)
    assert int(count.item()) == int(keep.sum().item())
    if reduction != "none":
        check("total", total, reference(x, t, -100, reduction, eps)[1], acc)

    g = random((rows,) if reduction == "none" else (), acc, device)
    divisor = count if reduction == "mean" else None
    buffer = nan((rows, 2 * classes), dtype)
    _C.cross_entropy_bwd(x, t, lse, g, divisor, buffer[:, ::2], ignore_index=-100, label_smoothing=eps)
    ref_leaf, ref = reference(x, t, -100, reduction, eps)
    ref.backward(g.double().cpu())
    scale = g.abs().max().item() / (int(keep.sum().item()) if reduction == "mean" else 1)
    check("grad", buffer[:, ::2], ref_leaf.grad, dtype, scale=scale)
    assert torch.isnan(buffer[:, 1::2]).all(), "the backward wrote outside grad_logits"
    dense = nan((rows, classes), dtype)
    _C.cross_entropy_bwd(x, t, lse, g, divisor, dense, ignore_index=-100, label_smoothing=eps)
    check("grad (contiguous)", dense, ref_leaf.grad, dtype, scale=scale)
    # Not in place: every element of a row needs the row's target logit, read by other threads.
    with pytest.raises(ValueError, match="argument grad_logits"):
        _C.cross_entropy_bwd(x, t, lse, g, divisor, x, ignore_index=-100, label_smoothing=eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [7, 65, 1001, 4097])
def test_forward_with_gradient_entry(device, dtype, classes):
    """_C.cross_entropy_fwd_bwd: each row's loss and its gradient in one pass (grad_loss None: 1
    per row; a 0-d or per-row grad_loss; the count or none), into a strided view of a NaN buffer
    (its other elements stay NaN), into a dense one, and in place over a copy of the logits
    (bitwise the dense result); with softcap and z_loss. A grad_logits that overlaps the logits
    without being them raises, as does an output over an input."""
    from brrr import _C

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rows, eps = 37, 0.1
    x = random((rows, classes), dtype, device, low=-10.0, high=10.0)
    t = make_targets((rows,), classes, device, IGNORE[0])
    keep = t != -100

    def nan(shape, dt=acc):
        return torch.full(shape, float("nan"), dtype=dt, device=device)

    count = keep.sum().to(acc)
    for softcap, z_loss in [(None, 0.0), (3.0, 0.3)]:
        for g, divisor in [(None, None), (None, count), (random((), acc, device), count), (random((rows,), acc, device), None)]:
            what = f"softcap={softcap} z_loss={z_loss} grad_loss={None if g is None else tuple(g.shape)}"
            args = dict(ignore_index=-100, label_smoothing=eps, softcap=softcap, z_loss=z_loss)
            loss, buffer = nan((rows,)), nan((rows, 2 * classes), dtype)
            _C.cross_entropy_fwd_bwd(x, t, loss, g, divisor, buffer[:, ::2], **args)
            ref_leaf, ref = reference(x, t, -100, "none", eps, softcap, z_loss)
            check(f"loss ({what})", loss, ref, acc)
            weights = torch.ones(rows, dtype=torch.float64) if g is None else g.double().cpu().expand(rows)
            if divisor is not None:
                weights = weights / divisor.item()
            ref.backward(weights)
            check(f"grad ({what})", buffer[:, ::2], ref_leaf.grad, dtype, scale=weights.abs().max().item())
            assert torch.isnan(buffer[:, 1::2]).all(), "the forward wrote outside grad_logits"
            dense, dense_loss = nan((rows, classes), dtype), nan((rows,))
            _C.cross_entropy_fwd_bwd(x, t, dense_loss, g, divisor, dense, **args)
            in_place, in_place_loss = x.clone(), nan((rows,))
            _C.cross_entropy_fwd_bwd(in_place, t, in_place_loss, g, divisor, in_place, **args)
            assert torch.equal(in_place, dense) and torch.equal(in_place_loss, dense_loss), what
    strided = random((rows, 2 * classes), dtype, device, low=-10.0, high=10.0)[:, ::2]
    expected = nan((rows, classes), dtype)
    capped = dict(ignore_index=-100, label_smoothing=eps, softcap=3.0, z_loss=0.3)
    _C.cross_entropy_fwd_bwd(strided, t, nan((rows,)), None, count, expected, **capped)
    _C.cross_entropy_fwd_bwd(strided, t, nan((rows,)), None, count, strided, **capped)
    assert torch.equal(strided, expected), "in place over a strided view"
    shifted = random((rows + 1, classes), dtype, device)
    with pytest.raises(ValueError, match="argument grad_logits"):
        _C.cross_entropy_fwd_bwd(shifted[:-1], t, nan((rows,)), None, None, shifted[1:], ignore_index=-100,
                                 label_smoothing=eps)
    if dtype == acc:  # an output over an input: the loss over the logits' first elements
        with pytest.raises(ValueError, match="argument loss"):
            _C.cross_entropy_fwd_bwd(x, t, x.flatten()[:rows], None, None, nan((rows, classes), dtype),
                                     ignore_index=-100, label_smoothing=eps)


# ---- inf, NaN, all ignored, no rows -------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [5, 1001, 4097])
def test_minus_inf_logits(device, dtype, classes):
    """-inf at non-target classes: a finite loss (label_smoothing 0) and a finite gradient, as
    torch's; with label smoothing the loss is inf, as torch's."""
    x = random((6, classes), torch.float64, "cpu", low=-10.0, high=10.0)
    t = torch.randint(0, classes, (6,))
    for r in range(6):
        banned = torch.arange(classes) != t[r]
        x[r, banned & (torch.arange(classes) % (r + 2) == 0)] = -float("inf")
    x[3, t[3] != torch.arange(classes)] = -float("inf")  # only the target is finite
    x, t = x.to(device=device, dtype=dtype), t.to(device)
    for reduction in REDUCTIONS:
        loss, grad = compare(x, t, reduction, 0.0, what="-inf")
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        loss, grad = compare(x, t, reduction, 0.1, what="-inf, smoothed")
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [5, 1001, 4097])
def test_other_infinities_as_torch(device, dtype, classes):
    """As torch: +inf at a non-target class or at the target gives NaN, -inf at the target gives
    inf (its gradient stays finite), a row all -inf gives NaN; the other rows are untouched."""
    x = random((6, classes), torch.float64, "cpu", low=-10.0, high=10.0)
    t = torch.randint(0, classes, (6,))
    x[0, (t[0] + 1) % classes] = float("inf")
    x[1, t[1]] = float("inf")
    x[2, t[2]] = -float("inf")
    x[3] = -float("inf")
    x, t = x.to(device=device, dtype=dtype), t.to(device)
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.1):
            loss, grad = compare(x, t, reduction, label_smoothing, what="inf")
            assert torch.isfinite(grad[[2, 4, 5]]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [5, 1001, 4097])
def test_nan_logit(device, dtype, classes):
    """A NaN logit makes its row's loss and gradient NaN (torch's result, equal_nan), the other
    rows are untouched."""
    x = random((5, classes), dtype, device, low=-10.0, high=10.0)
    x[1, classes // 2] = float("nan")
    t = torch.randint(0, classes, (5,), device=device)
    t[3] = -100
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.1):
            loss, grad = compare(x, t, reduction, label_smoothing, what="NaN logit")
            assert torch.isnan(grad[1]).all()
            assert torch.isfinite(grad[[0, 2, 3, 4]]).all()
            if reduction == "none":
                assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3, 4]]).all()
            else:
                assert torch.isnan(loss)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_an_ignored_row(device):
    """An ignored row is never read: its loss is 0 (as torch's) and, by brrr's definition, so is
    its gradient (torch's log_softmax backward gives NaN there)."""
    x = random((4, 9), torch.float32, device).requires_grad_()
    with torch.no_grad():
        x[2, 4] = float("nan")
    t = torch.tensor([1, 2, -100, 8], device=device)
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.1):
            loss = brrr.cross_entropy(x, t, reduction=reduction, label_smoothing=label_smoothing)
            ref = F.cross_entropy(x.detach(), t, reduction=reduction, label_smoothing=label_smoothing)
            check("loss", loss, ref, torch.float32)
            (grad,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
            assert not grad[2].any() and torch.isfinite(grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_rows_ignored(device, dtype):
    """mean over no counted rows: NaN (as torch), gradient 0; sum and none: 0."""
    for classes in (1, 7, 4097):
        x = random((5, classes), dtype, device).requires_grad_()
        for ignore_index in (-100, 0):
            t = torch.full((5,), ignore_index, device=device)
            for label_smoothing in (0.0, 0.1):
                loss = brrr.cross_entropy(x, t, ignore_index=ignore_index, label_smoothing=label_smoothing)
                assert loss.shape == () and torch.isnan(loss), (classes, ignore_index, label_smoothing, loss)
                (grad,) = torch.autograd.grad(loss, x)
                assert torch.equal(grad, torch.zeros_like(x))
                for reduction in ("sum", "none"):
                    loss = brrr.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction,
                                              label_smoothing=label_smoothing)
                    assert torch.equal(loss.detach(), torch.zeros_like(loss))
                    assert loss.shape == (() if reduction == "sum" else (5,))
                    (grad,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
                    assert torch.equal(grad, torch.zeros_like(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,target_shape", [((0, 7), (0,)), ((0, 4097), (0,)), ((3, 7, 0), (3, 0)),
                                                ((0, 5, 2), (0, 2))], ids=str)
def test_no_rows(device, dtype, shape, target_shape):
    """N = 0 (or an empty spatial dim): mean NaN, sum 0, none empty; gradient empty."""
    x = random(shape, dtype, device).requires_grad_()
    t = torch.zeros(target_shape, dtype=torch.int64, device=device)
    loss = brrr.cross_entropy(x, t)
    assert loss.shape == () and loss.dtype == dtype and torch.isnan(loss)
    loss = brrr.cross_entropy(x, t, reduction="sum", label_smoothing=0.1)
    assert loss.shape == () and loss.item() == 0
    (grad,) = torch.autograd.grad(loss, x)
    assert grad.shape == x.shape
    loss = brrr.cross_entropy(x, t, reduction="none")
    assert loss.shape == target_shape and loss.dtype == dtype
    (grad,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    assert grad.shape == x.shape


def test_no_classes_go_to_pytorch():
    """C = 0, which brrr's kernels refuse: brrr.use_fused and the registry give PyTorch's answer (a
    NaN mean where every row is ignored, 0 for the sum), not brrr's error."""
    x, t = torch.randn(3, 0), torch.full((3,), -100)
    assert brrr.registry.lookup("cross_entropy").resolve(x, t) is not brrr.cross_entropy
    with brrr.use_fused():
        mean, total, rows = (F.cross_entropy(x, t, reduction=r) for r in REDUCTIONS)
    assert torch.isnan(mean) and total.item() == 0 and torch.equal(rows, torch.zeros(3))


# ---- NumPy ------------------------------------------------------------------------------------

@pytest.mark.parametrize("np_dtype", [np.float32, np.float16, np.float64], ids=lambda d: d.__name__)
@pytest.mark.parametrize("target_dtype", [np.int64, np.int32, np.uint8], ids=lambda d: d.__name__)
def test_numpy_arrays(np_dtype, target_dtype):
    rng = np.random.default_rng(7)
    torch_dtype = {np.float32: torch.float32, np.float16: torch.float16, np.float64: torch.float64}[np_dtype]
    ignore_index = 255 if target_dtype == np.uint8 else -100
    x = (rng.uniform(-10, 10, (33, 130))).astype(np_dtype)
    t = rng.integers(0, 130, 33).astype(np.int64)
    t[1::4] = ignore_index
    t = t.astype(target_dtype)
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.1):
            for name, xv in (("contiguous", x), ("flipped classes", x[:, ::-1]), ("flipped rows", x[::-1])):
                out = brrr.cross_entropy(xv, t, ignore_index=ignore_index, reduction=reduction,
                                         label_smoothing=label_smoothing)
                assert isinstance(out, np.ndarray), (name, type(out))
                assert out.dtype == np_dtype and out.shape == (() if reduction != "none" else (33,)), name
                _, ref = reference(torch.from_numpy(xv.copy()), torch.from_numpy(t.astype(np.int64)), ignore_index,
                                   reduction, label_smoothing)
                check(f"numpy {name} {reduction} {label_smoothing}", torch.from_numpy(np.asarray(out)), ref,
                      torch_dtype)
    x3 = rng.uniform(-10, 10, (2, 7, 5)).astype(np_dtype)
    t3 = rng.integers(0, 7, (2, 5)).astype(target_dtype)
    out = brrr.cross_entropy(x3, t3, reduction="none")
    assert isinstance(out, np.ndarray) and out.shape == (2, 5)
    _, ref = reference(torch.from_numpy(x3), torch.from_numpy(t3.astype(np.int64)), reduction="none")
    check("numpy (N, C, d)", torch.from_numpy(out), ref, torch_dtype)


# ---- the torch.library op, autograd machinery ---------------------------------------------------

def test_ops_are_registered():
    """The forward's schema as documented (torch.library spells a Python int SymInt)."""
    assert hasattr(torch.ops.brrr, "cross_entropy_backward")
    schema = str(torch.ops.brrr.cross_entropy.default._schema)
    assert re.fullmatch(r"brrr::cross_entropy\(Tensor logits, Tensor target, (Sym)?[Ii]nt ignore_index, "
                        r"float label_smoothing, float\? softcap, float z_loss, str reduction\) -> Tensor\[\]", schema), schema


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_outputs(device, dtype):
    """torch.ops.brrr.cross_entropy on (..., C) logits: [loss in float32 (float64 for float64),
    lse per row (relative to the target's logit), count of counted rows]."""
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    x = random((6, 5, 33), dtype, device, low=-10.0, high=10.0)
    t = make_targets((6, 5), 33, device, IGNORE[0])
    keep = t != -100
    ref_lse = saved_lse(x, t)
    for reduction in REDUCTIONS:
        loss, lse, count = torch.ops.brrr.cross_entropy(x, t, -100, 0.1, None, 0.0, reduction)
        assert loss.dtype == stat and lse.dtype == stat and lse.shape == (6, 5) and count.shape == ()
        assert loss.shape == (() if reduction != "none" else (6, 5))
        assert int(count.item()) == int(keep.sum().item())
        check("lse", lse[keep], ref_lse[keep.cpu()], stat)
        _, ref = reference(x.movedim(-1, 1), t, -100, reduction, 0.1)
        check("loss", loss, ref, stat)  # not rounded to x's dtype


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    op = torch.ops.brrr.cross_entropy.default
    x = random((6, 5, 32), torch.float32, device, low=-10.0, high=10.0).requires_grad_()
    t = make_targets((6, 5), 32, device, IGNORE[0])
    for reduction in REDUCTIONS:
        torch.library.opcheck(op, (x, t, -100, 0.0, None, 0.0, reduction), test_utils=utils)
        torch.library.opcheck(op, (x, t.clamp_min(0), 3, 0.1, None, 0.0, reduction), test_utils=utils)
    x2 = random((9, 7), torch.bfloat16, device).requires_grad_()
    torch.library.opcheck(op, (x2, torch.randint(0, 7, (9,), device=device, dtype=torch.int32), -100, 0.2, None, 0.0,
                                    "mean"),
                          test_utils=utils)


def test_torch_compile_traces_without_graph_breaks():
    """One graph for three calls (class dim 1 of a 3-d input, a 2-d slice, a transposed view)."""
    torch._dynamo.reset()
    x = random((4, 33, 3), torch.float32, "cpu", low=-10.0, high=10.0).requires_grad_()
    t = make_targets((4, 3), 33, "cpu", IGNORE[0])

    def f(x, t):
        return (brrr.cross_entropy(x, t, label_smoothing=0.1) * 2
                + brrr.cross_entropy(x[:, :, 0], t[:, 0], reduction="none").sum()
                + brrr.cross_entropy(x.transpose(0, 2), t.t().clamp_min(0), reduction="sum", ignore_index=3))

    explained = torch._dynamo.explain(f)(x, t)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained
    eager = f(x, t)
    eager_grad = torch.autograd.grad(eager, x)[0]
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(x, t)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(torch.autograd.grad(out, x)[0], eager_grad)
    torch._dynamo.reset()


def test_torch_compile_default_backend():
    """Inductor, as users compile: the same loss and gradient as eager."""
    torch._dynamo.reset()
    x = random((4, 33), torch.float32, "cpu", low=-10.0, high=10.0).requires_grad_()
    t = make_targets((4,), 33, "cpu", IGNORE[0])

    def f(x, t):
        return brrr.cross_entropy(x, t, label_smoothing=0.1) * 2

    out = torch.compile(f, fullgraph=True)(x, t)
    eager = f(x, t)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(torch.autograd.grad(out, x)[0], torch.autograd.grad(eager, x)[0])
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_backward_is_traced_for_inductor(device, dtype):
    """Under torch.compile the forward is brrr's op and the backward its formula in PyTorch ops
    (so inductor can fuse it), with the eager path's gradient: every reduction, smoothing, an
    ignored row, a -inf logit, an out-of-range target (NaN rows; CUDA only, the CPU raises)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"forward": [], "backward": []}

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind].append({str(n.target) for n in gm.graph.nodes})
            return make_boxed_func(gm.forward)
        return compile_graph

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    x = random((9, 37), dtype, device, low=-10.0, high=10.0)
    x[2, 5] = float("-inf")
    t = make_targets((9,), 37, device, IGNORE[0])
    x[1, 7] = 200.0  # row 1 is ignored: exp(x - shift) of it would overflow
    assert t[1] == -100
    if device == "cuda":
        t[4] = 37
    for reduction in REDUCTIONS:
        for smoothing in (0.0, 0.1):
            torch._dynamo.reset()
            leaf = x.clone().requires_grad_()
            f = lambda x: brrr.cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing)  # noqa: E731
            out = torch.compile(f, backend=backend, fullgraph=True)(leaf)
            g = torch.ones_like(out)
            compiled_grad = torch.autograd.grad(out, leaf, g)[0]
            eager = f(leaf)
            torch.testing.assert_close(out, eager, equal_nan=True)
            eager_grad = torch.autograd.grad(eager, leaf, g)[0]
            torch.testing.assert_close(compiled_grad, eager_grad, equal_nan=True, **TOLERANCE[dtype])
            assert "brrr.cross_entropy.default" in graphs["forward"][-1]
            assert not any(name.startswith("brrr.") for name in graphs["backward"][-1]), graphs["backward"][-1]
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_backward_compares_narrow_targets_as_int64(device):
    """uint8 targets against ignore_index -100 and 300 classes: a Python int compared in uint8
    would wrap (to 156, and 44), so 156 would be ignored and classes 44.. invalid."""
    x = random((4, 300), torch.float32, device, low=-3.0, high=3.0)
    t = torch.tensor([156, 200, 7, 255], dtype=torch.uint8, device=device)
    f = lambda x: brrr.cross_entropy(x, t)  # noqa: E731
    leaf = x.clone().requires_grad_()
    torch._dynamo.reset()
    (compiled,) = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(leaf), leaf)
    (eager,) = torch.autograd.grad(f(leaf), leaf)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager)
    (expected,) = torch.autograd.grad(F.cross_entropy(leaf, t.long()), leaf)
    torch.testing.assert_close(eager, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_deterministic(device, dtype):
    """Two calls: bitwise the same loss and gradient."""
    rows, classes = (4099, 32000) if device == "cuda" else (129, 4097)
    x = random((rows, classes), dtype, device, low=-10.0, high=10.0).requires_grad_()
    t = make_targets((rows,), classes, device, IGNORE[0])
    for reduction in REDUCTIONS:
        runs = []
        no_grad = brrr.cross_entropy(x.detach(), t, reduction=reduction, label_smoothing=0.1)
        for _ in range(2):
            loss = brrr.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
            runs.append((loss.detach(), torch.autograd.grad(loss, x, torch.ones_like(loss))[0]))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), reduction
        assert torch.equal(no_grad, runs[0][0]), "the no-grad path differs from the autograd path"


def test_saves_no_log_probabilities():
    """The backward recomputes softmax from the input and the saved lse: nothing of the input's
    size is saved but the input itself."""
    x = random((64, 1000), torch.float32, "cpu").requires_grad_()
    t = make_targets((64,), 1000, "cpu", IGNORE[0])
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = brrr.cross_entropy(x, t, label_smoothing=0.1)
    big = [s for s in saved if s.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr(), [(s.shape, s.dtype) for s in saved]
    assert sum(s.numel() for s in saved if s.is_floating_point()) <= x.numel() + 2 * 64 + 1
    loss.backward()
    assert x.grad is not None


# ---- argument errors --------------------------------------------------------------------------

@pytest.mark.parametrize("requires_grad", [False, True])
def test_argument_errors(requires_grad):
    x = random((4, 5), torch.float32, "cpu").requires_grad_(requires_grad)
    t = torch.tensor([0, 4, -100, 2])
    ce = brrr.cross_entropy
    cases = [
        (lambda: ce(x, t, reduction="avg"), ValueError, "reduction"),
        (lambda: ce(x, t, reduction="Mean"), ValueError, "reduction"),
        (lambda: ce(x, t, dtype="float32"), TypeError, "dtype"),  # it named the target
        (lambda: ce(x, t, dtype=torch.int32), ValueError, "dtype"),  # a loss truncated to ints
        (lambda: ce(x, t, label_smoothing=-0.1), ValueError, "label_smoothing"),
        (lambda: ce(x, t, label_smoothing=1.01), ValueError, "label_smoothing"),
        (lambda: ce(x, t, label_smoothing=float("nan")), ValueError, "label_smoothing"),
        (lambda: ce(x, t, label_smoothing=float("inf")), ValueError, "label_smoothing"),
        (lambda: ce(x, t.float()), TypeError, "target"),
        (lambda: ce(x, t.double()), TypeError, "target"),
        (lambda: ce(x, t[:3]), ValueError, "target"),
        (lambda: ce(x, t[:, None]), ValueError, "target"),
        (lambda: ce(x, torch.tensor(1)), ValueError, "target"),
        (lambda: ce(x[0], torch.tensor([1])), ValueError, "target"),
        (lambda: ce(x.reshape(2, 5, 2), torch.zeros(2, 5, dtype=torch.int64)), ValueError, "target"),
        (lambda: ce(x.reshape(2, 5, 2), torch.zeros(2, 2, 1, dtype=torch.int64)), ValueError, "target"),
        (lambda: ce(x, t, weight=torch.ones(5)), (TypeError, ValueError), "weight"),
        (lambda: ce(x, t, torch.ones(5)), (TypeError, ValueError), "weight"),
        (lambda: ce(x, t, weight=[1.0] * 5), (TypeError, ValueError), "weight"),
        # out of [0, C) and not ignore_index: checked on the CPU
        (lambda: ce(x, torch.tensor([0, 5, 1, 2])), ValueError, "target"),
        (lambda: ce(x, torch.tensor([0, -1, 1, 2])), ValueError, "target"),
        (lambda: ce(x, torch.tensor([0, 1, 2, 2**40])), ValueError, "target"),
        (lambda: ce(x, torch.tensor([0, 1, -100, 2]), ignore_index=-1), ValueError, "target"),
        (lambda: ce(x, torch.tensor([0, 7, 1, 2], dtype=torch.int32)), ValueError, "target"),
        (lambda: ce(x, torch.tensor([0, 200, 1, 2], dtype=torch.uint8)), ValueError, "target"),
        (lambda: ce(x, torch.tensor([0, 9, 1, 2]), reduction="none", label_smoothing=0.1), ValueError, "target"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()
    with pytest.raises(TypeError):
        ce(torch.randint(0, 5, (4, 5)), t)
    with pytest.raises(TypeError):
        ce(torch.randint(0, 5, (4, 5), dtype=torch.int32), t)
    with pytest.raises(ValueError):
        ce(torch.tensor(1.0, requires_grad=requires_grad), torch.tensor(0))
    # the boundaries are valid
    for label_smoothing in (0.0, 1.0):
        assert torch.isfinite(ce(x, t, label_smoothing=label_smoothing))
    assert torch.isfinite(ce(x, t, weight=None))


# ---- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("classes,rows", [(33, 65), (1001, 257), (2049, 33), (4097, 257), (32000, 3)])
def test_cuda_matches_cpu(dtype, classes, rows):
    x = random((rows, classes), dtype, "cpu", low=-10.0, high=10.0)
    t = make_targets((rows,), classes, "cpu", IGNORE[0])
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.1):
            g = random((rows,) if reduction == "none" else (), dtype, "cpu")
            cpu_loss, cpu_grad = compare(x, t, reduction, label_smoothing, what="cpu", g=g)
            cuda_loss, cuda_grad = compare(x.cuda(), t.cuda(), reduction, label_smoothing, what="cuda", g=g.cuda())
            # the two are each within the tolerance of float64; against each other twice that
            check("loss cpu vs cuda", cuda_loss, cpu_loss.double(), dtype, slack=2.0)
            scale = cpu_grad.double().abs().max().item()
            check("grad cpu vs cuda", cuda_grad, cpu_grad.double(), dtype, slack=2.0, scale=scale)


@pytest.mark.cuda
@pytest.mark.parametrize("classes", [7, 4097])
def test_cuda_out_of_range_target_is_nan(classes):
    """On CUDA an out-of-range target is not checked (that would need a sync): its row's loss and
    gradient are NaN; the other rows are as torch's."""
    x = random((6, classes), torch.float32, "cuda", low=-10.0, high=10.0).requires_grad_()
    t = torch.tensor([0, classes, 1, -5, -100, classes - 1], device="cuda")
    bad = torch.tensor([False, True, False, True, False, False], device="cuda")
    loss = brrr.cross_entropy(x, t, reduction="none")
    (grad,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    assert torch.isnan(loss[bad]).all() and torch.isnan(grad[bad]).all()
    good = torch.where(bad, torch.zeros_like(t), t)
    ref_leaf, ref = reference(x, good, reduction="none")
    check("loss", loss[~bad], ref[~bad.cpu()], torch.float32)
    ref.backward(torch.ones_like(ref))
    check("grad", grad[~bad], ref_leaf.grad[~bad.cpu()], torch.float32)
    assert torch.isnan(brrr.cross_entropy(x, t))
    assert torch.isnan(brrr.cross_entropy(x, t, reduction="sum"))


@pytest.mark.cuda
def test_cuda_device_mismatch():
    x = random((4, 5), torch.float32, "cuda")
    t = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError):
        brrr.cross_entropy(x, t)
    with pytest.raises(ValueError):
        brrr.cross_entropy(x.cpu(), t.cuda())
    with pytest.raises(ValueError):
        brrr.cross_entropy(x.requires_grad_(), t)
