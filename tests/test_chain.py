"""Elementwise chains, forward: every op and random chains against float64 references."""

import math
import random as pyrandom

import numpy as np
import pytest
import torch

import brrr
from helpers import DEVICES, DTYPES, TOLERANCE, assert_close, poisoned_like, random

UNARY = ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "cos", "sin"]


def reference_step(name, y, scalar=None, operand=None):
    """One chain step in float64 with PyTorch's formulas."""
    if name == "relu":
        return torch.relu(y)
    if name == "gelu":
        return torch.nn.functional.gelu(y)
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(y, approximate="tanh")
    if name == "silu":
        return torch.nn.functional.silu(y)
    if name in ("sigmoid", "tanh", "exp", "cos", "sin"):
        return getattr(torch, name)(y)
    if name == "add":
        return y + scalar
    if name == "mul":
        return y * scalar
    if name == "add_tensor":
        return y + operand
    if name == "mul_tensor":
        return y * operand
    raise AssertionError(name)


def reference_chain(steps, x, operands=()):
    """The chain in float64 on the CPU (operands broadcast as brrr broadcasts them)."""
    y = x.to("cpu", torch.float64)
    ops = iter(o.to("cpu", torch.float64) for o in operands)
    for step in steps:
        name, scalar = (step, None) if isinstance(step, str) else step
        operand = next(ops) if name in ("add_tensor", "mul_tensor") else None
        y = reference_step(name, y, scalar, operand)
    return y


def run(f, x, *operands):
    """Call f with a NaN-poisoned out, so that an unwritten element fails the comparison."""
    out = poisoned_like(x)
    result = f(x, *operands, out=out)
    assert result is out
    return out


def input_range(name):
    # exp and the sigmoid family saturate or overflow far out; keep inputs where the storage
    # type still resolves the answer (the kernels are also checked at the extremes below).
    return (-4.0, 4.0) if name in ("exp",) else (-8.0, 8.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("numel", [0, 1, 3, 4097, (1 << 20) + 1])
def test_unary_matches_float64(device, dtype, name, numel):
    low, high = input_range(name)
    x = random((numel,), dtype, device, low, high)
    out = run(brrr.chain(name), x)
    assert_close(out, reference_chain([name], x), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_named_functions(device, dtype):
    x = random((3, 257), dtype, device)
    for fn, ref in [(brrr.relu, torch.relu), (brrr.silu, torch.nn.functional.silu), (brrr.sigmoid, torch.sigmoid),
                    (brrr.tanh, torch.tanh), (brrr.cos, torch.cos), (brrr.sin, torch.sin),
                    (lambda t: brrr.gelu(t, approximate="tanh"), lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
                    (brrr.gelu, torch.nn.functional.gelu)]:
        y = fn(x)
        assert y.dtype == dtype and y.device == x.device and y.shape == x.shape
        assert_close(y, ref(x.double().cpu()), dtype)
    assert_close(brrr.exp(x), torch.exp(x.double().cpu()), dtype)


def random_chain(rng, n_steps):
    """Up to n_steps random steps whose values stay bounded (exp only after a tanh)."""
    steps = []
    for _ in range(n_steps):
        kind = rng.random()
        if kind < 0.6:
            steps.append(rng.choice([op for op in UNARY if op != "exp"]))
        elif kind < 0.8:
            steps.append((rng.choice(["add", "mul"]), round(rng.uniform(-1.5, 1.5), 3)))
        else:
            steps.append(rng.choice(["add_tensor", "mul_tensor"]))
    if rng.random() < 0.3:
        steps[-2:] = ["tanh", "exp"]
    return steps


def operands_for(steps, x, rng, vector_every=2):
    n = sum(1 for s in steps if s in ("add_tensor", "mul_tensor"))
    shapes = [x.shape[-1:] if (i % vector_every == 1 and x.dim() > 1) else x.shape for i in range(n)]
    return [random(shape, x.dtype, x.device, -1.5, 1.5) for shape in shapes[:brrr._C.MAX_CHAIN_OPERANDS]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(12))
def test_random_chains(device, dtype, seed):
    rng = pyrandom.Random(seed)
    steps = random_chain(rng, rng.randint(1, 16))
    while sum(s in ("add_tensor", "mul_tensor") for s in steps) > 4:
        steps.remove(next(s for s in steps if s in ("add_tensor", "mul_tensor")))
    shape = rng.choice([(4097,), (7, 33), (2, 3, 64), (1, 1, 5)])
    x = random(shape, dtype, device, -2.0, 2.0)
    operands = operands_for(steps, x, rng)
    out = run(brrr.chain(*steps), x, *operands)
    # fp32 rounding compounds over up to 16 steps (amplified by each step's derivative); half
    # types round once at the end. A wrong step is off by O(1), far outside either bound.
    assert_close(out, reference_chain(steps, x, operands), dtype, scale=20.0 if dtype == torch.float32 else 1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_max_length_chain(device, dtype):
    steps = ["cos", ("mul", 1.1)] * 8
    x = random((1000,), dtype, device)
    assert_close(run(brrr.chain(*steps), x), reference_chain(steps, x), dtype, scale=4.0)


VIEWS = {
    "transposed": lambda t: t.t(),
    "column_slice": lambda t: t[:, 1::3],
    "row_slice": lambda t: t[::2],
    "offset": lambda t: t[1:, 2:],
    "broadcast_input": lambda t: t[:1].expand(t.shape[0], -1),
    "permuted_3d": lambda t: t.reshape(4, -1, 6).permute(2, 0, 1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("view", list(VIEWS))
def test_non_contiguous_inputs(device, dtype, view):
    base = random((24, 30), dtype, device)
    x = VIEWS[view](base)
    steps = ["gelu", ("mul", 0.5), "cos"]
    before = base.clone()
    out = run(brrr.chain(*steps), x)
    assert_close(out, reference_chain(steps, x), dtype)
    assert torch.equal(base, before), "the input was modified"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_output_and_operands(device, dtype):
    x = random((30, 24), dtype, device).t()
    bias = random((60,), dtype, device)[::2]  # a strided bias vector
    other = random((24, 30), dtype, device)  # contiguous while x is transposed
    out = torch.full((30, 48), float("nan"), dtype=dtype, device=device)[:, ::2].t()
    steps = ["add_tensor", "silu", "mul_tensor"]
    brrr.chain(*steps)(x, bias, other, out=out)
    assert_close(out, reference_chain(steps, x, [bias, other]), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 3), (4, 1), (2, 3, 8), (16, 4096 + 8)])
def test_bias_vector_operand(device, dtype, shape):
    x = random(shape, dtype, device)
    bias = random(shape[-1:], dtype, device)
    out = run(brrr.chain("add_tensor", "gelu"), x, bias)
    assert_close(out, reference_chain(["add_tensor", "gelu"], x, [bias]), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_is_allowed_for_an_identical_view(device):
    x = random((1000,), torch.float32, device)
    expected = reference_chain(["relu", ("add", 1.0)], x)
    result = brrr.chain("relu", ("add", 1.0))(x, out=x)
    assert result is x
    assert_close(x, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_values(device):
    values = [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, 3e38, -3e38,
              float("inf"), float("-inf"), float("nan")]
    x = torch.tensor(values, dtype=torch.float32, device=device)
    for name in UNARY:
        out = run(brrr.chain(name), x)
        ref = reference_chain([name], x).to(torch.float32)  # overflow as float32 overflows
        torch.testing.assert_close(out.cpu(), ref, rtol=2e-5, atol=1e-6, equal_nan=True, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("relu", [brrr.relu, brrr.chain("relu")], ids=["relu", "chain"])
def test_relu_gradient_at_special_values_is_torchs(device, relu):
    """torch's threshold_backward passes the gradient where the output is not <= 0: at NaN too."""
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 2.0, -2.0], device=device,
                     requires_grad=True)
    (got,) = torch.autograd.grad(relu(x).sum(), x)
    (expected,) = torch.autograd.grad(torch.relu(x).sum(), x)
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_trig_of_large_half_arguments(device, dtype):
    # Range reduction must stay exact far beyond pi: the half-type fast path reduces by pi/2
    # itself and hands |x| > 1e5 to the exact routine.
    x = (torch.rand(20000, dtype=torch.float64) * 2 - 1) * torch.logspace(0, 38 if dtype == torch.bfloat16 else 4.8, 20000,
                                                                          dtype=torch.float64)
    x = x.to(dtype).to(device)
    for name in ("cos", "sin"):
        assert_close(run(brrr.chain(name), x), reference_chain([name], x), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_trig_of_large_float32_arguments(device):
    # Beyond 105615 the CUDA kernels reduce by pi/2 with Payne-Hanek (trig_reduce.h).
    gen = torch.Generator().manual_seed(3)
    magnitude = torch.logspace(0, 38, 50000, dtype=torch.float64)
    x = ((torch.rand(50000, generator=gen, dtype=torch.float64) * 2 - 1) * magnitude).to(torch.float32).to(device)
    for name in ("cos", "sin"):
        assert_close(run(brrr.chain(name), x), reference_chain([name], x), torch.float32)
    grad_x = x.detach().clone().requires_grad_()
    brrr.chain("sin")(grad_x).backward(torch.ones_like(x))
    assert_close(grad_x.grad, torch.cos(x.double().cpu()), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("steps", [["cos"], ["sin"], [("mul", 2.0), "cos", "sin"], [("mul", -1.0), "sin", ("mul", 2.0), "cos"]],
                         ids=str)
def test_trig_steps_on_packs_mixing_small_large_and_special_arguments(device, dtype, steps):
    # Compiled chains check a trig step's range once for all the values a thread holds: a pack
    # with one large, infinite or NaN value among small ones sends every value through the
    # general path, and each must come out as exact as in an all-small pack. Multiplying by 2
    # and by -1 is exact, so the float64 reference sees the same arguments.
    gen = torch.Generator().manual_seed(5)
    n = 4099
    x = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * 3
    x[::7] = torch.logspace(0, 38 if dtype != torch.float16 else 4.8, len(range(0, n, 7)), dtype=torch.float64)
    x[3::7] *= -1
    x[5::97], x[11::101], x[13::103] = float("inf"), float("-inf"), float("nan")
    x = x.to(dtype).to(device)
    assert_close(run(brrr.chain(*steps), x), reference_chain(steps, x), dtype)
    leaf, g = x.detach().clone().requires_grad_(), random((n,), dtype, device)
    brrr.chain(*steps)(leaf).backward(g)
    want = x.detach().to("cpu", torch.float64).requires_grad_()
    reference_chain(steps, want).backward(g.to("cpu", torch.float64))
    assert_close(leaf.grad, want.grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cpu_half_rounding_is_round_to_nearest_even(dtype):
    # x + c is exact in fp32, so the only rounding is the store back to the half type; it must
    # agree bit for bit with PyTorch's own conversion, subnormals and overflow included.
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 1 << 16, (200000,), generator=gen, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    x = x[torch.isfinite(x)]
    for c in (0.0, 2.0 ** -20, 1.0 / 3.0, -7.5, 1e4):
        ours = brrr.chain(("add", c))(x)
        theirs = (x.float() + torch.tensor(c, dtype=torch.float32)).to(dtype)
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), c


def test_numpy_arrays_in_and_out():
    x = np.random.default_rng(0).standard_normal((33, 65)).astype(np.float32)
    y = brrr.chain("sin", ("mul", 3.0))(x)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, np.sin(x.astype(np.float64)) * 3.0, rtol=2e-6, atol=2e-6)
    reversed_view = x[::-1, ::-2]  # negative strides: NumPy only
    y = brrr.chain("tanh")(reversed_view)
    np.testing.assert_allclose(y, np.tanh(reversed_view.astype(np.float64)), rtol=2e-6, atol=2e-6)
    out = np.full_like(x, np.nan)
    assert brrr.chain("exp")(x / 4, out=out) is out
    np.testing.assert_allclose(out, np.exp(x.astype(np.float64) / 4), rtol=2e-6)


def test_numpy_float16_and_float64():
    rng = np.random.default_rng(1)
    for dtype, rtol in ((np.float16, 2e-3), (np.float64, 1e-12)):
        x = rng.uniform(-3, 3, 4097).astype(dtype)
        y = brrr.chain("gelu")(x)
        assert y.dtype == dtype
        ref = torch.nn.functional.gelu(torch.from_numpy(x.astype(np.float64))).numpy()
        np.testing.assert_allclose(y.astype(np.float64), ref, rtol=rtol, atol=rtol / 10)


@pytest.mark.parametrize("device", DEVICES)
def test_high_rank_views(device):
    x = torch.randn([2] * 20, device=device)  # 20 dims that merge into one
    assert_close(brrr.cos(x), torch.cos(x.double().cpu()), torch.float32)
    y = x.permute(*range(19, -1, -1))
    assert_close(brrr.cos(y), torch.cos(y.double().cpu()), torch.float32)  # out has y's layout: merges
    out = torch.empty(y.shape, device=device)  # row-major: 20 dims that cannot merge with y's
    if device == "cpu":  # the CPU twin walks any rank
        assert_close(brrr.cos(y, out=out), torch.cos(y.double().cpu()), torch.float32)
    else:
        with pytest.raises(ValueError, match="more than 16 non-mergeable dims"):
            brrr.cos(y, out=out)


def test_chain_repr_and_equality():
    a = brrr.chain("cos", ("mul", 2))
    assert repr(a) == "brrr.chain('cos', ('mul', 2.0))"
    assert a == brrr.chain("cos", ("mul", 2.0)) and hash(a) == hash(brrr.chain("cos", ("mul", 2.0)))
    assert a != brrr.chain("cos")
    assert math.isclose(a(torch.tensor([0.0])).item(), 2.0)


def test_tolerance_table_covers_every_dtype():
    assert set(TOLERANCE) == set(DTYPES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gelu_half_storage_within_one_ulp_at_every_value(device, dtype):
    """Every finite float16 and bfloat16 from -13 up (all 65536 bit patterns, less NaN, infinity
    and the tail below, where the CUDA math's exp flushes values under 2^-126 to zero): gelu and
    its derivative the correctly rounded value or a neighbour, within the smallest normal."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x) & (x >= -13)]
    x64 = x.double()
    ref = 0.5 * x64 * torch.special.erfc(-x64 / math.sqrt(2))
    ref_grad = 0.5 * torch.special.erfc(-x64 / math.sqrt(2)) + x64 * torch.exp(-0.5 * x64 * x64) / math.sqrt(2 * math.pi)
    ulp = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).smallest_normal
    xd = x.to(device).requires_grad_()
    y = brrr.gelu(xd)
    (grad,) = torch.autograd.grad(y, xd, torch.ones_like(y))
    for name, got, want in (("gelu", y, ref), ("grad", grad, ref_grad)):
        err = (got.detach().cpu().double() - want).abs()
        bad = ~(err <= ulp * want.abs() + tiny)
        assert not bool(bad.any()), (name, x64[bad][:8].tolist())


def test_negative_zero_scalar_is_its_own_chain():
    """0.0 and -0.0 compare equal as floats, not as steps: (("mul", -0.0), "reciprocal") of ones
    is -inf, as in torch, also right after the chain with 0.0 ran."""
    x = torch.ones(5)
    assert torch.equal(brrr.chain(("mul", 0.0), "reciprocal")(x), torch.full((5,), math.inf))
    assert torch.equal(brrr.chain(("mul", -0.0), "reciprocal")(x), torch.full((5,), -math.inf))
    assert brrr.chain(("mul", 0.0)) != brrr.chain(("mul", -0.0))
    assert brrr.chain(("mul", 0.0)) == brrr.chain(("mul", 0))


def test_the_chain_operator_refuses_scalars_that_do_not_match_its_steps():
    """torch.ops.brrr.chain takes one scalar per step (a placeholder for steps without one): a
    shorter or longer list is refused, naming the argument, rather than dropping steps."""
    x = torch.randn(5)
    torch.testing.assert_close(torch.ops.brrr.chain(x, [], "mul,add", [2.0, 1.0]), x * 2 + 1)
    torch.testing.assert_close(torch.ops.brrr.chain(x, [], "relu,sigmoid", [0.0, 0.0]), x.relu().sigmoid())
    for ops, scalars in (("mul,add", [2.0]), ("mul,add", [2.0, 1.0, 3.0]), ("relu,sigmoid", [0.0])):
        with pytest.raises(ValueError, match="argument scalars: expected one per step of ops"):
            torch.ops.brrr.chain(x, [], ops, scalars)
