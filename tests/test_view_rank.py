"""Views of any rank: every op of tests/op_table.py takes a view whose dims merge into at most
brrr._C.MAX_DIMS (16) and computes it right, and refuses one with more with the same error, on
CUDA; on the CPU too, but for the chain family, whose CPU twin walks any rank."""

import pytest
import torch

import brrr
from brrr import _C
from helpers import DEVICES
from op_table import OPS, OPS_BY_NAME

# Ops whose last dim is counted apart (rows by a row length): their other dims reach the limit.
LAST_DIM_APART = {"layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "rotary", "apply_rotary_pos_emb",
                  "cross_entropy", "softmax", "log_softmax", "linear_cross_entropy"}
CPU_WALKS_ANY_RANK = {"relu", "gelu", "silu", "sigmoid", "tanh", "exp", "cos", "sin", "chain", "bias_gelu",
                      "bias_silu", "swiglu split", "swiglu", "geglu"}
# Its rows reach brrr's kernel as the rows of a GEMM's output, which PyTorch computes from a view of
# any rank (a copy of the input where its rows do not merge into one dim, as torch.matmul makes).
ANY_RANK = {"linear_cross_entropy"}


def gapped(shape, device, generator):
    """A view of `shape` no two of whose dims merge: each dim's stride is one more than twice the
    next one's span, so no stride is the product of its neighbour's stride and size."""
    strides, stride = [], 1
    for size in reversed(shape):
        strides.insert(0, stride)
        stride = stride * size + 1
    base = torch.rand(stride, generator=generator, dtype=torch.float64) * 4 - 2
    return base.to(device=device, dtype=torch.float32).as_strided(shape, strides)


def high_rank_args(op, merged, device):
    """op's arguments with its first float input a view that merges into `merged` dims (as the
    op counts them), the others of the matching shapes."""
    g = torch.Generator().manual_seed(merged)
    args = op.make(torch.float32, device)
    first = op.floats[0]
    ndims = {name: args[name].dim() for name in op.floats}
    width = 4 if op.name in ("swiglu split", "rotary", "apply_rotary_pos_emb") else 2  # even halves
    shape = (2,) * merged + (width,) * (op.name in LAST_DIM_APART)
    if op.name == "swiglu split":  # elementwise on the halves: the last dim (halved) is one of them
        shape = (2,) * (merged - 1) + (width,)
    if op.name == "apply_rotary_pos_emb":
        shape = shape[:1] + (1,) + shape[1:]  # a heads dim of 1, where cos and sin get theirs
    if op.name == "cross_entropy":
        args["target"] = torch.randint(0, width, shape[:-1], generator=g).to(device)
    if op.name == "linear_cross_entropy":  # the input's rows; the weight (classes, hidden) and bias as made
        classes = args["weight"].shape[0]
        args["target"] = torch.randint(0, classes, shape[:-1], generator=g).to(device)
        args["weight"] = gapped((classes, width), device, g)
        args["bias"] = gapped((classes,), device, g)
        args["input"] = gapped(shape, device, g)
        return args
    for name in op.floats:
        if ndims[name] == ndims[first]:
            args[name] = gapped(shape, device, g)
        elif name in ("cos", "sin"):
            angle_shape = shape[1:] if op.name == "rotary" else shape[:1] + shape[2:]
            args[name] = gapped(angle_shape, device, g)
        else:  # a vector along the last dim
            args[name] = gapped(shape[-1:], device, g)
    if "normalized_shape" in args:
        args["normalized_shape"] = shape[-1:]
    return args


def results(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", [op.name for op in OPS])
def test_a_view_of_sixteen_non_mergeable_dims_is_computed(op, device):
    op = OPS_BY_NAME[op]
    args = high_rank_args(op, _C.MAX_DIMS, device)
    reference = op.reference({k: v.double().cpu() if torch.is_tensor(v) and v.is_floating_point() else
                              v.cpu() if torch.is_tensor(v) else v for k, v in args.items()})
    for got, want in zip(results(op.call(args)), results(reference)):
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", [op.name for op in OPS])
def test_a_view_of_seventeen_non_mergeable_dims_is_refused_alike(op, device):
    op = OPS_BY_NAME[op]
    args = high_rank_args(op, _C.MAX_DIMS + 1, device)
    if (device == "cpu" and op.name in CPU_WALKS_ANY_RANK) or op.name in ANY_RANK:
        reference = op.reference({k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                                  for k, v in args.items()})
        for got, want in zip(results(op.call(args)), results(reference)):
            torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
        return
    # (the split GLU forms name the half of x: "argument x (gate half)")
    with pytest.raises(ValueError, match=r"^argument (x|x \((gate|up) half\)|gate|q|input): views with more than 16 "
                                         r"non-mergeable dims "
                                         r"are not supported \(got 17; a contiguous copy has one\)$"):
        op.call(args)


def test_the_limit_is_one_constant():
    assert _C.MAX_DIMS == brrr.build_info()["max_dims"] == 16
