"""Second derivatives through brrr's ops are right or refused with a clear error, never silently
zero, on every path: the eager autograd.Functions (brrr.gelu, brrr.layer_norm, ...), the custom
ops (torch.ops.brrr.*, what torch.compile calls), the registry, brrr.nn and patched models.

brrr's kernels have one backward. Where a second derivative needs more than that (a Hessian, a
gradient penalty, gradgradcheck), it raises. The ops that are linear in x (rotary, and dropout
for a fixed mask) have a second derivative of 0 with respect to x, which a Hessian of their sum
gives exactly."""

import pytest
import torch
import torch.nn.functional as F

import brrr
from helpers import DEVICES, reset_registry

REFUSED = "differentiate twice brrr's|has no derivative"


def double(*shape, device="cpu"):
    return torch.randn(*shape, dtype=torch.float64, device=device)


# name -> (function of x, x's shape, whether it is linear in x)
def eager_ops(device):
    w, b = double(6, device=device), double(6, device=device)
    cos, sin = double(6, device=device), double(6, device=device)
    target = torch.tensor([0, 5, 2, 1], device=device)
    return {
        "gelu": (lambda x: brrr.gelu(x), False),
        "chain": (lambda x: brrr.chain("sin", ("mul", 2.0), "tanh")(x), False),
        "bias_gelu": (lambda x: brrr.bias_gelu(x, b), False),
        "bias_silu": (lambda x: brrr.bias_silu(x, b), False),
        "swiglu": (lambda x: brrr.swiglu(x), False),
        "geglu (gate, up)": (lambda x: brrr.geglu(x, x.flip(-1)), False),
        "layer_norm": (lambda x: brrr.layer_norm(x, (6,), w, b), False),
        "rms_norm": (lambda x: brrr.rms_norm(x, (6,), w), False),
        "rms_norm llama": (lambda x: brrr.rms_norm(x, (6,), w, cast_order="llama"), False),
        "add_layer_norm": (lambda x: brrr.add_layer_norm(x, x.flip(-1), (6,), w, b)[0], False),
        "add_rms_norm": (lambda x: brrr.add_rms_norm(x, x.flip(-1), (6,), w)[0], False),
        "cross_entropy": (lambda x: brrr.cross_entropy(x, target), False),
        "bias_dropout_add": (lambda x: brrr.bias_dropout_add(x, b, x.flip(-1), 0.5, seed=3), True),
        "rotary": (lambda x: brrr.rotary(x, cos, sin), True),
        "apply_rotary_pos_emb": (lambda x: brrr.apply_rotary_pos_emb(x, x.flip(-1), cos, sin, unsqueeze_dim=0)[0], True),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(eager_ops("cpu")))
def test_hessian_of_an_eager_op_is_right_or_refused(name, device):
    fn, linear = eager_ops(device)[name]
    x = double(4, 6, device=device).requires_grad_()
    if not linear:
        with pytest.raises(RuntimeError, match=REFUSED):
            torch.autograd.functional.hessian(lambda t: fn(t).sum(), x)
        return
    # out = A x + c for a fixed A: the Hessian of its sum is 0, and so is PyTorch's
    hessian = torch.autograd.functional.hessian(lambda t: fn(t).sum(), x)
    assert torch.equal(hessian, torch.zeros(4, 6, 4, 6, dtype=torch.float64, device=device))


@pytest.mark.parametrize("name", list(eager_ops("cpu")))
def test_gradgradcheck_of_an_eager_op_is_refused(name):
    fn, _ = eager_ops("cpu")[name]
    x = double(4, 6).requires_grad_()
    with pytest.raises(RuntimeError, match=REFUSED):
        torch.autograd.gradgradcheck(fn, (x,))


def test_hessian_with_respect_to_a_parameter_alone_is_refused():
    x, w, b = double(4, 6), double(6).requires_grad_(), double(6).requires_grad_()
    for fn, param in [(lambda t: brrr.layer_norm(x, (6,), t).square().sum(), w),
                      (lambda t: brrr.rms_norm(x, (6,), t).square().sum(), w),
                      (lambda t: brrr.bias_gelu(x, t).sum(), b)]:
        with pytest.raises(RuntimeError, match=REFUSED):
            torch.autograd.functional.hessian(fn, param)


def test_a_gradient_penalty_through_an_eager_op_is_refused():
    x = double(4, 6).requires_grad_()
    (g,) = torch.autograd.grad(brrr.layer_norm(x, (6,)).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=REFUSED):
        g.square().sum().backward()
    assert x.grad is None


def test_a_first_derivative_with_create_graph_is_still_right():
    """create_graph=True alone (the second derivative never taken) computes the usual gradient."""
    x = double(4, 6).requires_grad_()
    (g,) = torch.autograd.grad(brrr.gelu(x).sum(), x, create_graph=True)
    (expected,) = torch.autograd.grad(F.gelu(x).sum(), x)
    torch.testing.assert_close(g.detach(), expected)


@pytest.mark.parametrize("name", list(eager_ops("cpu")) + ["linear_cross_entropy"])
def test_first_derivatives_carry_no_graph(name):
    """Without create_graph the gradients come back with no graph, as PyTorch's do: a graph behind
    them would keep the inputs' nodes (and the forward graph up to them) alive as long as the
    caller keeps the gradients."""
    x = double(4, 6).requires_grad_()
    if name == "linear_cross_entropy":
        w, b = double(5, 6).requires_grad_(), double(5).requires_grad_()
        leaves, loss = (x, w, b), brrr.linear_cross_entropy(x, w, torch.tensor([0, 4, 2, 1]), b)
    else:
        leaves, loss = (x,), eager_ops("cpu")[name][0](x).sum()
    for g in torch.autograd.grad(loss, leaves):
        assert g.grad_fn is None and not g.requires_grad


# torch.ops.brrr.*: the custom ops' backward ops have no derivative
CUSTOM_OPS = {
    "chain": lambda x: torch.ops.brrr.chain(x, [], "sin,gelu", [0.0, 0.0]),
    "glu": lambda x: torch.ops.brrr.glu(x, None, "silu"),
    "layer_norm": lambda x: torch.ops.brrr.layer_norm(x, [6], None, None, 1e-5)[0],
    "add_layer_norm": lambda x: torch.ops.brrr.add_layer_norm(x, x.flip(-1), [6], None, None, 1e-5)[0],
    "rms_norm": lambda x: torch.ops.brrr.rms_norm(x, [6], None, 1e-6, False, 0.0)[0],
    "add_rms_norm": lambda x: torch.ops.brrr.add_rms_norm(x, x.flip(-1), [6], None, 1e-6, True, 0.0)[0],
    "cross_entropy": lambda x: torch.ops.brrr.cross_entropy(x, torch.tensor([0, 5, 2, 1]), -100, 0.0, None, 0.0, "mean")[0],
}


@pytest.mark.parametrize("name", list(CUSTOM_OPS))
def test_hessian_of_a_custom_op_is_refused(name):
    x = double(4, 6).requires_grad_()
    with pytest.raises(RuntimeError, match=REFUSED):
        torch.autograd.functional.hessian(lambda t: CUSTOM_OPS[name](t).sum(), x)


def test_linear_custom_ops_have_the_zero_hessian_of_their_sum():
    x, cos, sin = double(4, 6).requires_grad_(), double(6), double(6)
    for fn in (lambda t: torch.ops.brrr.rotary(t, cos, sin, False, False, 0),
               lambda t: torch.ops.brrr.bias_dropout_add(t, None, t.flip(-1), 0.5, 3, 0)):
        hessian = torch.autograd.functional.hessian(lambda t: fn(t).sum(), x)
        assert torch.equal(hessian, torch.zeros(4, 6, 4, 6, dtype=torch.float64))


def test_registry_nn_and_patched_models_refuse_a_hessian():
    reset_registry()  # the suite's setting: brrr's CPU code on CPU tensors
    x = double(4, 6).requires_grad_()
    norm = brrr.nn.LayerNorm(6).double()
    calls = [lambda t: brrr.registry("gelu", t).sum(), lambda t: brrr.registry("rms_norm", t, (6,)).sum(),
             lambda t: norm(t).sum(), lambda t: brrr.nn.SiLU()(t).sum()]
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.LayerNorm(6)).double()
    brrr.patch(model)
    calls.append(lambda t: model(t).sum())
    for call in calls:
        with pytest.raises(RuntimeError, match=REFUSED):
            torch.autograd.functional.hessian(call, x)
    brrr.unpatch(model)  # PyTorch's modules again: their Hessian exists
    assert torch.autograd.functional.hessian(lambda t: model(t).sum(), x).abs().sum() > 0
