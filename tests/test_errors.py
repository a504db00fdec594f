"""Bad input: a clear exception of the right type, naming the argument, and nothing written."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import brrr
from brrr import _C
from helpers import DEVICES

GELU = brrr.chain("gelu")
BIAS_GELU = brrr.chain("add_tensor", "gelu")


@pytest.mark.parametrize("device", DEVICES)
def test_argument_errors(device):
    x = torch.randn(4, 5, device=device)
    out = torch.zeros(4, 5, device=device)
    snapshot = x.clone()
    cases = [
        (lambda: GELU(None), TypeError, "argument x: expected a tensor or array implementing __dlpack__, got NoneType"),
        (lambda: GELU([1.0, 2.0]), TypeError, "argument x: expected a tensor or array implementing __dlpack__, got list"),
        (lambda: _C.chain_fwd(None, out, GELU.program, ()), TypeError, "argument x: expected a tensor or array, got None"),
        (lambda: GELU(x, out=[0.0]), TypeError, "argument out: expected a tensor or array implementing __dlpack__"),
        (lambda: _C.chain_fwd([1.0], out, GELU.program, ()), TypeError, "argument x: expected a tensor or array implementing __dlpack__, got list"),
        (lambda: GELU(x, out=torch.zeros(4, 6, device=device)), ValueError, r"argument out has shape \(4, 6\) but x has shape \(4, 5\)"),
        (lambda: GELU(x, out=torch.zeros(20, device=device)), ValueError, r"argument out has shape \(20,\)"),
        (lambda: GELU(x, out=torch.zeros(4, 5, device=device, dtype=torch.float64)), ValueError, "argument out has dtype float64 but x has dtype float32"),
        (lambda: GELU(x.to(torch.int32)), TypeError, "argument x: dtype int32 is not supported; expected float32, float16, bfloat16 or float64$"),
        (lambda: GELU(x, out=torch.zeros(1, 5, device=device).expand(4, 5)), ValueError, "argument out: output has overlapping elements"),
        (lambda: GELU(x[:, :4], out=x[:, 1:]), ValueError, "argument out overlaps input x"),
        (lambda: GELU(x.t(), out=x.view(5, 4)), ValueError, "argument out overlaps input x"),
        (lambda: BIAS_GELU(x, torch.zeros(4, device=device)), ValueError, r"argument operands\[0\]: shape must be x's shape or \(5,\)"),
        (lambda: BIAS_GELU(x, torch.zeros(5, device=device, dtype=torch.float64)), ValueError, r"argument operands\[0\] has dtype float64"),
        (lambda: BIAS_GELU(x), TypeError, "argument operands: .* takes 1 tensor operand"),
        (lambda: _C.chain_fwd(x, out, BIAS_GELU.program, ()), ValueError, "argument operands: expected a tuple of 1 tensors"),
        (lambda: _C.chain_fwd(x, out, GELU.program, (), "stream"), TypeError, "argument stream: expected an int"),
        (lambda: _C.chain_fwd(x, out, b"short", ()), TypeError, "argument program: expected the bytes"),
        (lambda: _C.chain_fwd(x, out, b"\xff" * len(GELU.program), ()), ValueError, "argument program: malformed"),
        (lambda: _C.chain_fwd(x, out, GELU.program), TypeError, "missing argument 'operands'"),
        (lambda: brrr.gelu(x, approximate="fast"), ValueError, "argument approximate"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()
    assert torch.equal(x, snapshot)
    assert not out.any(), "an output was written by a call that failed"


def test_out_is_refused_under_autograd():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="argument out: not supported when autograd records"):
        GELU(x, out=torch.empty(3))
    # an out that requires grad: the write would be a recorded in-place op (torch refuses out= there too)
    for call in (lambda o: GELU(torch.randn(3), out=o), lambda o: brrr.swiglu(torch.randn(3), torch.randn(3), out=o)):
        out = torch.zeros(3, requires_grad=True)
        with pytest.raises(ValueError, match="argument out: .*for an out that requires grad"):
            call(out)
        assert not out.any()


@pytest.mark.parametrize("write", [lambda o: brrr.gelu(torch.randn(3), out=o),
                                   lambda o: brrr.bias_gelu(torch.randn(3), torch.randn(3), out=o),
                                   lambda o: brrr.swiglu(torch.randn(3), torch.randn(3), out=o)],
                         ids=["chain", "bias", "glu"])
def test_a_write_into_out_bumps_its_version(write):
    """A tensor that a backward saved, then given as out: the backward raises as after torch's own
    in-place writes, where it read the new values (a silently wrong gradient)."""
    w, buffer = torch.randn(3, requires_grad=True), torch.randn(3)
    y = w * buffer  # saves buffer for w's gradient
    version = buffer._version
    write(buffer)
    assert buffer._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y.sum(), w)


@pytest.mark.parametrize("write", [lambda o: brrr.gelu(torch.randn(3), out=o),
                                   lambda o: brrr.swiglu(torch.randn(3), torch.randn(3), out=o)], ids=["chain", "glu"])
def test_an_inference_tensor_is_written_only_under_inference_mode(write):
    """As torch refuses an in-place update of one outside it (brrr wrote it)."""
    with torch.inference_mode():
        out = torch.zeros(3)
        write(out)
    assert out.any()
    with torch.inference_mode():
        out.zero_()
    with pytest.raises(ValueError, match="argument out: an inference tensor"):
        write(out)
    assert not out.any()


def test_missing_arguments_are_named():
    """None or a wrong kind where a tensor, a name or a count belongs: the argument named, whether
    or not autograd records (a None operand reached requires_grad)."""
    x, x2 = torch.randn(4, 8), np.ones((4, 8), np.float32)
    cases = [
        (lambda: brrr.add_layer_norm(x, None, 8), TypeError, "residual: expected a tensor or array, got None"),
        (lambda: brrr.add_rms_norm(x.requires_grad_(), None, 8), TypeError, "residual: expected a tensor"),
        (lambda: brrr.add_rms_norm(x2, None, 8), TypeError, "residual: expected a tensor"),
        (lambda: brrr.bias_gelu(torch.randn(4, 8), None), TypeError, "bias: expected a tensor or array, got None"),
        (lambda: brrr.chain("add_tensor")(torch.randn(4, 8), None), TypeError, r"operands\[0\]: expected a tensor"),
        (lambda: brrr.chain("add_tensor")(torch.randn(4, 8)), TypeError, "operands: .* takes 1 tensor operand"),
        (lambda: brrr.rotary(torch.randn(2, 4, 8), None, torch.randn(4, 4)), TypeError, "cos: expected a tensor"),
        (lambda: brrr.rotary(x2[None], x2[:, :4], None), TypeError, "sin: expected a tensor"),
        (lambda: brrr.bias_dropout_add(None, None, x2, 0.1), TypeError, "x: expected a tensor or array, got None"),
        (lambda: brrr.cross_entropy(x2, np.zeros(4, np.int64), dtype=torch.float64), TypeError, "dtype: "),
        (lambda: brrr.cross_entropy(x2, np.zeros(4, np.int64), dtype=np.int32), ValueError, "dtype: expected float32"),
        (lambda: brrr.glu_linear(torch.randn(3, 4), torch.randn(3, 4), torch.randn(5, 4).double()), ValueError,
         "weight has dtype float64 but gate has dtype float32"),
        (lambda: brrr.glu_linear(torch.randn(3, 4), None, torch.randn(5, 2), activation=["silu"]), TypeError,
         "activation: expected 'silu', 'gelu' or 'gelu_tanh', got list"),
        (lambda: brrr.set_num_threads(True), TypeError, "n: expected an int"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=f"^argument {message}"):
            call()


def test_program_errors():
    cases = [
        (("nope",), ValueError, r"argument steps\[0\]: unknown op 'nope'"),
        ((("add",),), TypeError, r"expected an op name or a \(name, scalar\) pair"),
        (("add",), TypeError, r"'add' needs a real scalar"),
        ((("add", "x"),), TypeError, "needs a real scalar"),
        ((("cos", 1.0),), ValueError, "'cos' takes no scalar"),
        ((3,), TypeError, r"argument steps\[0\]: expected an op name"),
        ((("pow", True),), TypeError, "'pow' needs a real scalar: \\('pow', value\\), not a bool"),
        (("leaky_relu",), TypeError, "'leaky_relu' needs a real scalar"),
        (("add_tensor",) * 5, ValueError, "at most 4 tensor steps"),
        # float() of these drops the imaginary part or raises without naming the step
        ((("mul", np.complex128(1 + 2j)),), TypeError, r"argument steps\[0\]: 'mul' needs a real scalar"),
        ((("mul", np.complex64(1 + 2j)),), TypeError, r"argument steps\[0\]: 'mul' needs a real scalar"),
        ((("mul", torch.ones(3)),), ValueError, r"^argument steps\[0\]: only one element"),
        ((("mul", torch.tensor(1 + 2j)),), TypeError, r"argument steps\[0\]: 'mul' needs a real scalar"),
        ((("mul", torch.tensor(2 + 0j)),), TypeError, r"argument steps\[0\]: 'mul' needs a real scalar"),
    ]
    for steps, exc, message in cases:
        with pytest.raises(exc, match=message):
            brrr.chain(*steps)
    with pytest.raises(TypeError, match=r"argument steps\[0\]: expected an op name or a \(name, scalar\) pair"):
        brrr.chain(["cos"])
    with pytest.raises(TypeError, match="argument steps: expected a sequence"):
        _C.chain_program(5)
    with pytest.raises(ValueError, match=r"argument steps\[0\]: expected a name or a \(name, scalar\) pair"):
        _C.chain_program([("add",)])


def test_chain_op_names_cover_the_documented_steps():
    assert set(_C.chain_op_names()) == {"relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "cos", "sin",
                                        "add", "mul", "add_tensor", "mul_tensor", "abs", "neg", "square", "sqrt",
                                        "rsqrt", "log", "log1p", "expm1", "reciprocal", "pow", "clamp_min", "clamp_max",
                                        "softplus", "mish", "hardswish", "leaky_relu"}


def test_malformed_programs_are_refused():
    program = bytearray(brrr.chain("cos", "add_tensor").program)
    for bad in (program[:-1], program + b"\0" * 16, program[:8] + b"\xff" * 16 + program[24:]):
        with pytest.raises((TypeError, ValueError), match="argument program"):
            _C.chain_fwd(np.ones(3, np.float32), None, bytes(bad), (np.ones(3, np.float32),))


def test_failed_call_writes_nothing_into_numpy_out():
    x = np.ones((3, 4), np.float32)
    out = np.zeros((3, 5), np.float32)
    with pytest.raises(ValueError, match="argument out has shape"):
        GELU(x, out=out)
    assert not out.any()


def test_zero_size_tensors():
    for shape in [(0,), (3, 0), (0, 5)]:
        x = torch.empty(shape)
        assert GELU(x).shape == shape
        assert BIAS_GELU(x, torch.empty(shape[-1:])).shape == shape
    scalar = torch.tensor(0.5)
    torch.testing.assert_close(brrr.cos(scalar), torch.cos(scalar))


# A torch tensor beside arrays of another framework: brrr's PyTorch layer, which bumps a written
# tensor's version and refuses one that requires grad, takes only the calls whose x is a torch
# tensor, so brrr._C refuses a torch tensor in any other call (and the other way round).
MIXED_CALLS = {
    "out": (lambda x, t: brrr.relu(x, out=t), lambda: torch.zeros(3, 4)),
    "chain out": (lambda x, t: brrr.chain("sin", ("mul", 2.0))(x, out=t), lambda: torch.zeros(3, 4)),
    "operands[0]": (lambda x, t: brrr.chain("add_tensor")(x, t), lambda: torch.zeros(4)),
    "weight": (lambda x, t: brrr.layer_norm(x, (4,), t), lambda: torch.ones(4)),
    "residual": (lambda x, t: brrr.add_rms_norm(x, t, (4,)), lambda: torch.ones(3, 4)),
    "bias": (lambda x, t: brrr.bias_gelu(x, t), lambda: torch.zeros(4)),
    "up": (lambda x, t: brrr.swiglu(x, t), lambda: torch.ones(3, 4)),
    "target": (lambda x, t: brrr.cross_entropy(x, t), lambda: torch.tensor([0, 1, 3])),
}


@pytest.mark.parametrize("framework_name", ["numpy", "jax"])
@pytest.mark.parametrize("what", list(MIXED_CALLS))
def test_a_torch_tensor_beside_another_frameworks_x_is_refused(framework_name, what):
    """Written through NumPy's call, a torch out would keep its version (a backward that saved it
    would then compute with the new values: a wrong gradient, silently) and be written even while
    it requires grad; so every torch tensor beside a non-torch x is refused, naming the argument,
    and nothing is written."""
    call, make = MIXED_CALLS[what]
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    x = jnp.asarray(x) if framework_name == "jax" else x
    t = make()
    before, version = t.clone(), t._version
    name = what.split()[-1]
    with pytest.raises(TypeError, match=rf"^argument {re.escape(name)}: got a torch.Tensor where (x|gate|input) is a "
                                        r".*\(the tensors of one call come from one framework\)"):
        call(x, t)
    assert torch.equal(t, before) and t._version == version


def test_a_numpy_out_beside_a_torch_x_is_refused_by_brrr_c_too():
    """brrr._C called directly (below brrr's PyTorch layer, which refuses it first) refuses the
    other way round as well."""
    x = torch.ones(3, 4)
    out = np.zeros((3, 4), np.float32)
    with pytest.raises(TypeError, match=r"^argument out: expected a torch.Tensor like x .*got numpy.ndarray"):
        brrr._C.chain_fwd(x, out, brrr.chain("sin").program, (), -1)
    assert not out.any()


class _DLPackOnly:
    """A DLPack producer with no __array_namespace__ (its array's dims and dtype only)."""

    def __init__(self, a):
        self.a, self.shape, self.ndim, self.dtype = a, a.shape, a.ndim, a.dtype

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_softmax_of_a_dlpack_only_producer_names_x():
    x = _DLPackOnly(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="^argument x: _DLPackOnly has no __array_namespace__ to move dim 0 last"):
        brrr.softmax(x, 0)
    with pytest.raises(TypeError, match="^argument x: brrr allocates softmax's output only for"):
        brrr.softmax(x)


def test_a_deleted_jax_array_is_named():
    x = jnp.ones((4, 8)) + 0
    x.delete()
    with pytest.raises(RuntimeError, match="^argument x: Array has been deleted"):
        brrr.gelu(x)


def test_the_split_glu_names_the_halves_of_x():
    memory = np.ones((4, 17), np.float32)
    x = memory[:, :16]
    with pytest.raises(ValueError, match=r"^argument out has shape \(4, 16\) but x \(gate half\) has shape \(4, 8\)"):
        brrr.swiglu(x, out=np.empty((4, 16), np.float32))
    with pytest.raises(ValueError, match=r"^argument out overlaps input x \(up half\) in memory"):
        brrr.swiglu(x, out=memory[:, 9:])


@pytest.mark.parametrize("ignore_index", [2**63 - 1, -2**63])
@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_every_int64_is_an_ignore_index(framework, ignore_index):
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    t = np.array([0, 4, 2])
    expected = torch.nn.functional.cross_entropy(torch.from_numpy(x), torch.from_numpy(t), ignore_index=ignore_index)
    if framework == "torch":
        x, t = torch.from_numpy(x), torch.from_numpy(t)
    got = brrr.cross_entropy(x, t, ignore_index=ignore_index)
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="^argument ignore_index: expected an int64"):
        brrr.cross_entropy(x, t, ignore_index=2**63)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_dims_of_any_integer_type(framework):
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    x = torch.from_numpy(x) if framework == "torch" else x
    np.testing.assert_allclose(np.asarray(brrr.softmax(x, np.int64(0))), np.asarray(brrr.softmax(x, 0)))
    with pytest.raises(TypeError, match="^argument dim: expected an int, got float32"):
        brrr.softmax(x, np.float32(0))

