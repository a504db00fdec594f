"""PyTorch tensors that DLPack does not describe fully, on every op of tests/op_table.py: views
with the lazy negative bit (the .imag of a conjugated tensor; DLPack exports their memory, which
holds -x) and ZeroTensors (no memory) are read as their values, and refused as outputs; sparse,
nested, quantized and meta tensors get a one-line error naming the argument."""

import warnings

import pytest
import torch

import brrr
from brrr import _C
from helpers import DEVICES
from op_table import OPS, OPS_BY_NAME

OP_ARGS = [(op.name, name) for op in OPS for name in op.floats]


def negative_bit_view(values):
    """A view of `values`' values whose memory holds their negation (is_neg() is True)."""
    view = torch.complex(torch.zeros_like(values), -values).conj().imag
    assert view.is_neg() and torch.equal(view, values)
    return view


def results(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("op,arg", OP_ARGS, ids=[f"{o}-{a}" for o, a in OP_ARGS])
def test_an_input_with_its_negative_bit_is_read_as_its_values(op, arg, dtype, device):
    op = OPS_BY_NAME[op]
    args = op.make(dtype, device)
    expected = results(op.call(args))
    args[arg] = negative_bit_view(args[arg])  # strided too: every other element of a complex tensor
    for got, want in zip(results(op.call(args)), expected):
        assert torch.equal(got, want), f"{op.name}: {arg} with its negative bit set"
    reference = results(op.reference({k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                                      for k, v in args.items()}))
    for got, want in zip(results(op.call(args)), reference):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", [op.name for op in OPS])
def test_gradients_flow_through_a_negative_bit_view(op):
    op = OPS_BY_NAME[op]
    args = op.make(torch.float64, "cpu")
    first = op.floats[0]
    leaf = args[first].clone().requires_grad_()
    args[first] = negative_bit_view(leaf)
    loss = sum(r.sin().sum() for r in results(op.call(args)))
    (grad,) = torch.autograd.grad(loss, leaf)
    leaf64 = leaf.detach().clone().requires_grad_()
    reference = dict(args, **{first: leaf64})
    (expected,) = torch.autograd.grad(sum(r.sin().sum() for r in results(op.reference(reference))), leaf64)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", [op.name for op in OPS if op.out])
def test_an_output_with_its_negative_bit_is_refused(op):
    op = OPS_BY_NAME[op]
    args = op.make(torch.float32, "cpu")
    out = negative_bit_view(torch.zeros(op.call(args).shape))
    with pytest.raises(ValueError, match="^argument out: a view with its negative bit set"):
        op.call(dict(args, out=out))
    assert torch.equal(out, torch.zeros(out.shape)) and out.is_neg()


@pytest.mark.parametrize("op,arg", OP_ARGS, ids=[f"{o}-{a}" for o, a in OP_ARGS])
def test_a_zero_tensor_input_is_read_as_zeros(op, arg):
    """PyTorch's efficient zeros (_efficientzerotensor, which autograd may hand a backward) have no
    memory: they are read as the zeros they are."""
    op = OPS_BY_NAME[op]
    args = op.make(torch.float32, "cpu")
    expected = results(op.call(dict(args, **{arg: torch.zeros(args[arg].shape)})))
    args[arg] = torch._efficientzerotensor(args[arg].shape)
    for got, want in zip(results(op.call(args)), expected):
        assert torch.equal(got, want)
    if op.out:
        out = torch._efficientzerotensor(expected[0].shape)
        with pytest.raises(ValueError, match=r"^argument out: a ZeroTensor \(_is_zerotensor\(\), lazy zeros with no "
                                             r"memory\) cannot be written in place"):
            op.call(dict(args, out=out))


@pytest.mark.parametrize("op", [op.name for op in OPS])
def test_a_zero_tensor_gradient_is_taken(op):
    op = OPS_BY_NAME[op]
    args = op.make(torch.float64, "cpu")
    leaf = args[op.floats[0]].clone().requires_grad_()
    outputs = [o for o in results(op.call(dict(args, **{op.floats[0]: leaf}))) if o.requires_grad]
    zeros = [torch._efficientzerotensor(o.shape, dtype=o.dtype) for o in outputs]
    (grad,) = torch.autograd.grad(outputs, leaf, zeros)
    assert torch.equal(grad, torch.zeros_like(leaf))


def test_c_outputs_with_their_negative_bit_are_refused():
    x = torch.randn(4, 6)
    out = negative_bit_view(torch.zeros(4, 6))
    for call in (lambda: _C.layer_norm_fwd(x, out=out, norm_ndim=1, eps=1e-5),
                 lambda: _C.rotary(x, x, x, out, False),
                 lambda: _C.dropout_fwd(x, None, x, out, 0.5, 1, 0)):
        with pytest.raises(ValueError, match="^argument out: a view with its negative bit set"):
            call()
    assert torch.equal(out, torch.zeros(4, 6))


def kinds():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested and quantized tensors are prototype / deprecated
        yield "sparse", lambda t: t.to_sparse(), TypeError, "tensors of layout torch.sparse_coo are not supported"
        yield "sparse_csr", lambda t: t.reshape(-1, t.shape[-1]).to_sparse_csr(), TypeError, \
            "tensors of layout torch.sparse_csr are not supported"
        yield "nested", lambda t: torch.nested.nested_tensor(list(t.reshape(-1, t.shape[-1]))), TypeError, \
            "nested tensors are not supported"
        yield "quantized", lambda t: torch.quantize_per_tensor(t.float(), 0.1, 0, torch.qint8), TypeError, \
            "quantized tensors are not supported"
        yield "meta", lambda t: t.to("meta"), ValueError, "tensors on the meta device are not supported"


KINDS = list(kinds())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", [k[0] for k in KINDS])
@pytest.mark.parametrize("op,arg", OP_ARGS, ids=[f"{o}-{a}" for o, a in OP_ARGS])
def test_tensors_dlpack_cannot_carry_get_a_one_line_error(op, arg, kind):
    op = OPS_BY_NAME[op]
    _, make, exc, message = next(k for k in KINDS if k[0] == kind)
    args = op.make(torch.float32, "cpu")
    args[arg] = make(args[arg])
    with pytest.raises((TypeError, ValueError)) as raised:
        op.call(args)
    text = str(raised.value)
    assert len(text.splitlines()) == 1, text
    # The tensor's own error where brrr reads it; a mismatch where another argument is checked
    # against it first (a nested weight has no shape to compare): both name the argument.
    assert text.startswith(f"argument {arg}"), text
    if type(raised.value) is exc and message in text:
        return
    assert isinstance(raised.value, ValueError) and " has " in text or "shape" in text, text


def test_a_complex_conjugate_view_is_refused_by_its_dtype():
    x = torch.randn(4, dtype=torch.complex64).conj()
    assert x.is_conj()
    with pytest.raises(TypeError, match="^argument x: dtype complex64 is not supported"):
        brrr.gelu(x)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", [k[0] for k in KINDS if k[0] != "quantized"])  # no quantized int64 tensors
@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_a_target_of_each_kind_gets_its_error(op, kind):
    """The class indices are checked as indices (brrr._C.check_tensor(..., index=True)): each kind
    gets its own one-line error naming the target, not an error about its integer dtype."""
    op = OPS_BY_NAME[op]
    _, make, exc, message = next(k for k in KINDS if k[0] == kind)
    args = op.make(torch.float32, "cpu")
    args["target"] = make(args["target"])
    with pytest.raises(exc, match=f"^argument target: {message}"):
        op.call(args)
