"""brrr._op: the torch.library operators' own autograd kernel, called through torch.ops (as
compiled code calls them): gradients, the refusal of double backward, and the direct call to the
kernel never bypassing what sits below autograd (dispatch modes, fake tensors)."""

import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import brrr
from helpers import DEVICES, random

ops = torch.ops.brrr
REPO = os.path.join(os.path.dirname(__file__), "..")


def run_python(code):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_ops_exist_once_brrr_is_imported_after_torch():
    result = run_python("import torch, brrr\n"
                        "for name in ('chain', 'glu', 'rms_norm', 'norm_backward', 'bias_dropout_add'):\n"
                        "    getattr(torch.ops.brrr, name).default")
    assert result.returncode == 0, result.stderr


def test_importing_brrr_alone_does_not_import_torch():
    result = run_python("import sys, brrr\nassert 'torch' not in sys.modules")
    assert result.returncode == 0, result.stderr


def test_public_names_survive_any_first_use():
    """brrr.registry is the registry and brrr.patch the function whichever is touched first
    (importing a submodule of the same name would rebind them)."""
    for first in ("brrr.patch", "brrr.registry", "brrr.causal_lm_loss", "brrr.nn.LayerNorm"):
        result = run_python(f"import torch, brrr\n{first}\nimport brrr.nn\n"
                            "assert callable(brrr.patch) and hasattr(brrr.registry, 'names'), "
                            "(brrr.patch, brrr.registry)")
        assert result.returncode == 0, (first, result.stderr)


@pytest.mark.parametrize("device", DEVICES)
def test_op_gradients_match_the_eager_path(device):
    x = random((7, 33), torch.float64, device).requires_grad_()
    w = random((33,), torch.float64, device).requires_grad_()
    b = random((33,), torch.float64, device).requires_grad_()
    g = random((7, 33), torch.float64, device)
    through_ops = ops.layer_norm.default(x, [33], w, b, 1e-5)[0] + ops.chain.default(x, [b], "add_tensor,gelu", [0.0, 0.0])
    eager = brrr.layer_norm(x, (33,), w, b) + brrr.bias_gelu(x, b)
    ref = torch.nn.functional.layer_norm(x, (33,), w, b) + torch.nn.functional.gelu(x + b)
    inputs = (x, w, b)
    for got, same, want in zip(torch.autograd.grad(through_ops, inputs, g), torch.autograd.grad(eager, inputs, g),
                               torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(got, same, rtol=0, atol=0)
        torch.testing.assert_close(got, want)


def test_double_backward_through_an_op_raises():
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    y = ops.rms_norm.default(x, [8], w, 1e-6, False, 0.0)[0]
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    assert gx.requires_grad  # recorded, so that a second backward reaches the refusal
    with pytest.raises(RuntimeError, match="no derivative"):
        torch.autograd.grad(gx.sum(), x)


def test_a_list_argument_gets_its_gradients():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    m = torch.randn(4, 6, dtype=torch.float64)  # in the list, needing no gradient
    y = ops.chain.default(x, [b, m], "add_tensor,mul_tensor", [0.0, 0.0])
    gx, gb = torch.autograd.grad(y.sum(), (x, b))
    torch.testing.assert_close(gx, m)
    torch.testing.assert_close(gb, m.sum(0))


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad", [False, True])
def test_dispatch_modes_still_see_the_op(grad):
    x = torch.randn(4, 6, requires_grad=grad)
    with Recorder() as mode:
        y = ops.chain.default(x, [], "cos", [0.0])
    assert "brrr.chain.default" in mode.seen
    torch.testing.assert_close(y, torch.cos(x))


def test_fake_tensors_take_the_fake_kernel():
    with FakeTensorMode():
        x = torch.empty(3, 5, 16)
        out, rstd = ops.rms_norm.default(x, [16], None, 1e-6, False, 0.0)
    assert out.shape == (3, 5, 16) and rstd.shape == (3, 5)


class Logged(torch.Tensor):
    """A subclass with its own __torch_function__, as tracers and tensor wrappers have."""
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(func))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("op", ["softmax", "rms_norm", "gelu", "chain", "cross_entropy"])
def test_a_subclass_sees_the_op_and_gets_its_class_back(op, grad):
    """As torch's own functions do: the subclass's __torch_function__ is called with brrr's
    operator and wraps the result (brrr called its kernel past it before)."""
    plain = torch.randn(5, 8, dtype=torch.float64)
    calls = {"softmax": lambda x: brrr.softmax(x), "rms_norm": lambda x: brrr.rms_norm(x, 8),
             "gelu": lambda x: brrr.gelu(x), "chain": lambda x: brrr.chain("cos", ("mul", 3.0))(x),
             "cross_entropy": lambda x: brrr.cross_entropy(x, torch.arange(5) % 8)}
    Logged.seen.clear()
    x = plain.clone().as_subclass(Logged).requires_grad_(grad)
    y = calls[op](x)
    assert type(y) is Logged and any(name.startswith("brrr.") for name in Logged.seen), (type(y), Logged.seen)
    torch.testing.assert_close(y.as_subclass(torch.Tensor), calls[op](plain))
    if grad:
        weights = torch.randn(y.shape, dtype=y.dtype)
        (g,) = torch.autograd.grad((y * weights).sum(), x)
        again = plain.clone().requires_grad_()
        (want,) = torch.autograd.grad((calls[op](again) * weights).sum(), again)
        torch.testing.assert_close(g.as_subclass(torch.Tensor), want)


def test_a_subclass_gets_no_silent_second_derivative():
    """cross_entropy's backward in PyTorch ops (for inductor) ran on a subclass's tensors, and its
    second derivative left out lse's: a wrong Hessian where plain tensors raise."""
    x = torch.randn(4, 6, dtype=torch.float64).as_subclass(Logged).requires_grad_()
    (g,) = torch.autograd.grad(brrr.cross_entropy(x, torch.arange(4)), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice|no derivative"):
        torch.autograd.grad(g[:, 0].sum(), x)


def test_plain_tensors_keep_the_direct_path_under_a_torch_function_mode():
    """torch.set_default_device's mode makes has_torch_function say True of every tensor: the
    op's operator ran every call (1.7-2x the host time)."""
    x = torch.randn(4, 8, requires_grad=True)
    with torch.device("cpu"):
        assert brrr.relu(x).grad_fn.name().startswith("brrr_relu_eager")
        assert brrr.rms_norm(x, 8).grad_fn.name().startswith("brrr_rms_norm_eager")
