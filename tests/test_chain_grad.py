"""Chains under autograd: gradcheck, gradients against PyTorch autograd, what is saved."""

import random as pyrandom

import pytest
import torch

import brrr
from helpers import DEVICES, DTYPES, assert_close, random
from test_chain import UNARY, reference_chain, random_chain


def reference_grads(steps, x, operands, grad_out):
    """Gradients of the float64 reference chain, by PyTorch autograd."""
    leaves = [t.detach().to("cpu", torch.float64).requires_grad_() for t in (x, *operands)]
    y = reference_chain(steps, leaves[0], leaves[1:])
    y.backward(grad_out.detach().to("cpu", torch.float64))
    return y.detach(), [leaf.grad for leaf in leaves]


def brrr_grads(steps, x, operands, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (x, *operands)]
    y = brrr.chain(*steps)(*leaves)
    y.backward(grad_out)
    return y.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("name", UNARY)
def test_gradcheck_unary(name):
    x = random((3, 7), torch.float64, "cpu", -2.0, 2.0).requires_grad_()
    assert torch.autograd.gradcheck(brrr.chain(name), (x,))


@pytest.mark.parametrize("seed", range(8))
def test_gradcheck_random_chains_with_operands(seed):
    rng = pyrandom.Random(seed)
    steps = random_chain(rng, rng.randint(2, 10))
    tensor_steps = [s for s in steps if s in ("add_tensor", "mul_tensor")][:4]
    steps = [s for s in steps if s not in ("add_tensor", "mul_tensor")] + tensor_steps
    rng.shuffle(steps)
    x = random((4, 6), torch.float64, "cpu", -1.5, 1.5).requires_grad_()
    operands = [random((6,) if i % 2 else (4, 6), torch.float64, "cpu", -1.5, 1.5).requires_grad_()
                for i in range(len(tensor_steps))]
    assert torch.autograd.gradcheck(brrr.chain(*steps), (x, *operands))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("steps", [["cos", "cos"], ["add_tensor", "gelu"], ["add_tensor", "gelu_tanh"],
                                   ["add_tensor", "silu"], ["mul_tensor", ("add", 0.5), "tanh", "mul_tensor"],
                                   ["sin", "add_tensor", "sigmoid", ("mul", -2.0), "exp"]], ids=str)
@pytest.mark.parametrize("shape", [(1,), (3, 5), (257, 33), (2, 3, 4096 + 8)], ids=str)
def test_gradients_match_autograd(device, dtype, steps, shape):
    x = random(shape, dtype, device, -2.0, 2.0)
    n = sum(s in ("add_tensor", "mul_tensor") for s in steps)
    # The first operand is a bias (last dim) wherever x has leading dims; the rest are full.
    operands = [random(shape[-1:] if i == 0 and len(shape) > 1 else shape, dtype, device, -1.0, 1.0) for i in range(n)]
    grad_out = random(shape, dtype, device, -1.0, 1.0)
    y, grads = brrr_grads(steps, x, operands, grad_out)
    y_ref, grads_ref = reference_grads(steps, x, operands, grad_out)
    assert_close(y, y_ref, dtype)
    rows = max(1, x.numel() // shape[-1])
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
        # A bias gradient sums `rows` products, each rounded once: scale the bound with sqrt(rows).
        summed = i == 1 and len(shape) > 1
        assert g.dtype == dtype and g.shape == g_ref.shape
        assert_close(g, g_ref, dtype, scale=max(2.0, rows ** 0.5) if summed else 2.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_of_non_contiguous_views(device, dtype):
    base = random((40, 66), dtype, device, -2.0, 2.0)
    x = base[:, 1::2].t()  # (33, 40), strided both ways
    bias = random((80,), dtype, device, -1.0, 1.0)[::2]
    other = random((40, 33), dtype, device, -1.0, 1.0).t()
    grad_out = random((40, 33), dtype, device).t()  # non-contiguous incoming gradient
    steps = ["add_tensor", "gelu", "mul_tensor"]
    y, grads = brrr_grads(steps, x, [bias, other], grad_out)
    y_ref, grads_ref = reference_grads(steps, x, [bias, other], grad_out)
    assert_close(y, y_ref, dtype)
    assert_close(grads[0], grads_ref[0], dtype, scale=2.0)
    assert_close(grads[1], grads_ref[1], dtype, scale=8.0)
    assert_close(grads[2], grads_ref[2], dtype, scale=2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_incoming_gradient(device):
    # y.sum().backward() hands the backward a stride-0 gradient.
    x = random((64, 48), torch.float32, device).requires_grad_()
    bias = random((48,), torch.float32, device).requires_grad_()
    brrr.chain("add_tensor", "silu")(x, bias).sum().backward()
    x_ref, b_ref = x.detach().double().cpu().requires_grad_(), bias.detach().double().cpu().requires_grad_()
    torch.nn.functional.silu(x_ref + b_ref).sum().backward()
    assert_close(x.grad, x_ref.grad, torch.float32)
    assert_close(bias.grad, b_ref.grad, torch.float32, scale=8.0)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gradient_is_bitwise_reproducible(device):
    x = random((4096, 512), torch.float32, device)
    bias = random((512,), torch.float32, device)
    grad_out = random((4096, 512), torch.float32, device)
    runs = [brrr_grads(["add_tensor", "gelu"], x, [bias], grad_out)[1][1] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("device", DEVICES)
def test_only_the_inputs_are_saved(device):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = random((128, 64), torch.float32, device).requires_grad_()
    bias = random((64,), torch.float32, device).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = brrr.chain("add_tensor", "gelu", "cos", ("mul", 3.0), "tanh")(x, bias)
    assert len(saved) == 2
    assert {t.data_ptr() for t in saved} == {x.data_ptr(), bias.data_ptr()}
    y.sum().backward()
    assert x.grad is not None and bias.grad is not None


def test_grad_only_for_operands_that_need_it():
    x = torch.randn(5, 4, requires_grad=True)
    bias = torch.randn(4)  # no grad
    y = brrr.chain("add_tensor", "relu")(x, bias)
    y.sum().backward()
    assert bias.grad is None
    torch.testing.assert_close(x.grad, ((x + bias) > 0).float())
    w = torch.randn(5, 4, requires_grad=True)
    brrr.chain("mul_tensor")(torch.randn(5, 4), w).sum().backward()
    assert w.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["relu", "sigmoid", "tanh"])
@pytest.mark.parametrize("call", ["function", "chain", "module"])
def test_relu_sigmoid_tanh_save_their_output(device, dtype, name, call):
    """As torch's do: one saved tensor, the output, which the Linear after them saves anyway (their
    input would be one activation more); the gradient from it against float64 autograd."""
    module = getattr(brrr.nn, {"relu": "ReLU", "sigmoid": "Sigmoid", "tanh": "Tanh"}[name])()
    f = {"function": getattr(brrr, name), "chain": brrr.chain(name), "module": module}[call]
    x = random((67, 33), dtype, device, -3.0, 3.0).requires_grad_()
    saved = []
    brrr.registry.on_cpu(name, "kernel")  # (the module's default on CPU tensors for relu and sigmoid: torch's)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = f(x)
    finally:
        brrr.registry.reset(name)
    assert y.grad_fn.name().startswith(f"brrr_{name}_"), y.grad_fn.name()
    assert len(saved) == 1 and saved[0].data_ptr() == y.data_ptr()
    grad_out = random(y.shape, dtype, device, -1.0, 1.0)
    (got,) = torch.autograd.grad(y, x, grad_out)
    # The derivative in float64 of y as stored (rounded to dtype), which torch's backward reads
    # too: near |y| = 1, 1 - y^2 of a rounded y is far from 1 - tanh(x)^2 in half precision.
    y64, g64 = y.detach().cpu().double(), grad_out.cpu().double()
    assert_close(y64, getattr(torch, name)(x.detach().cpu().double()), dtype)
    derivative = {"relu": (x.detach().cpu() > 0).double(), "sigmoid": y64 * (1 - y64), "tanh": 1 - y64 * y64}[name]
    assert_close(got, g64 * derivative, dtype)


def test_opcheck():
    x = torch.randn(6, 10, requires_grad=True)
    b = torch.randn(10, requires_grad=True)
    torch.library.opcheck(torch.ops.brrr.chain.default, (x, [b], "add_tensor,gelu", [0.0, 0.0]))
    torch.library.opcheck(torch.ops.brrr.chain.default, (x, [], "cos,mul", [0.0, 2.0]))
    for name in ("relu", "sigmoid", "tanh"):
        torch.library.opcheck(getattr(torch.ops.brrr, name).default, (x,))
    y = torch.randn(6, 10)
    torch.library.opcheck(torch.ops.brrr.chain_of_output.default, (y, [y, x.detach()], "mul,add,mul_tensor,mul_tensor",
                                                                    [-1.0, 1.0, 0.0, 0.0]))


def test_eager_autograd_records_a_function_and_refuses_double_backward():
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = brrr.chain("sin", "tanh")(x)
    assert y.grad_fn.name() == "brrr_chain_eagerBackward"
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad|once_differentiable"):  # never a silent 0
        g.sum().backward()
    z = brrr.swiglu(torch.randn(3, 8, requires_grad=True))
    assert z.grad_fn.name() == "brrr_glu_eagerBackward"


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gradient_of_zero_rows_is_zero(device):
    x = torch.randn(0, 5, device=device, requires_grad=True)
    bias = torch.randn(5, device=device, requires_grad=True)
    y = brrr.bias_gelu(x, bias)
    grad_x, grad_bias = torch.autograd.grad(y, (x, bias), torch.ones_like(y))
    assert grad_x.shape == (0, 5)
    assert torch.equal(grad_bias, torch.zeros(5, device=device))
