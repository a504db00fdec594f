"""The chain ops beyond the activations, and long random chains of every op, forward and
backward, against float64 references (CPU twin; on CUDA the compiled kernels, and the
interpreted ones where NVRTC is off)."""

import random as pyrandom

import pytest
import torch
import torch.nn.functional as F

import brrr
from helpers import DEVICES, DTYPES, TOLERANCE, assert_close, poisoned_like, random

# name -> (float64 reference, input range where the op and its derivative are well conditioned)
NEW_OPS = {
    "abs": (torch.abs, (-3.0, 3.0)),
    "neg": (torch.neg, (-3.0, 3.0)),
    "square": (torch.square, (-3.0, 3.0)),
    "sqrt": (torch.sqrt, (0.05, 4.0)),
    "rsqrt": (torch.rsqrt, (0.05, 4.0)),
    "log": (torch.log, (0.05, 4.0)),
    "log1p": (torch.log1p, (-0.9, 4.0)),
    "expm1": (torch.expm1, (-4.0, 4.0)),
    "reciprocal": (torch.reciprocal, (0.2, 4.0)),
    "softplus": (F.softplus, (-25.0, 25.0)),
    "mish": (F.mish, (-8.0, 8.0)),
    "hardswish": (F.hardswish, (-5.0, 5.0)),
}
SCALAR_OPS = {
    "pow": (lambda y, c: torch.pow(y, c), (0.1, 3.0), [2.0, 3.0, 0.5, -1.0, 1.7, 0.0]),
    "clamp_min": (lambda y, c: torch.clamp(y, min=c), (-3.0, 3.0), [-0.5, 0.0, 1.25]),
    "clamp_max": (lambda y, c: torch.clamp(y, max=c), (-3.0, 3.0), [-0.5, 0.0, 1.25]),
    "leaky_relu": (lambda y, c: F.leaky_relu(y, c), (-3.0, 3.0), [0.01, 0.2, -0.5]),
}


def reference(steps, x, operands=(), before_step=None):
    """The chain in float64 on the CPU, by PyTorch's own functions; before_step(name, scalar, y)
    sees each step's input."""
    from test_chain import reference_step

    y = x.to("cpu", torch.float64)
    ops = iter(o.to("cpu", torch.float64) for o in operands)
    for step in steps:
        name, scalar = (step, None) if isinstance(step, str) else step
        if before_step is not None:
            before_step(name, scalar, y)
        if name in NEW_OPS:
            y = NEW_OPS[name][0](y)
        elif name in SCALAR_OPS:
            y = SCALAR_OPS[name][0](y, scalar)
        else:
            y = reference_step(name, y, scalar, next(ops) if name in ("add_tensor", "mul_tensor") else None)
    return y


def grads_of(fn, x, operands, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (x, *operands)]
    y = fn(*leaves)
    y.backward(grad_out)
    return y.detach(), [leaf.grad for leaf in leaves]


def reference_grads(steps, x, operands, grad_out):
    leaves = [t.detach().to("cpu", torch.float64).requires_grad_() for t in (x, *operands)]
    y = reference(steps, leaves[0], leaves[1:])
    y.backward(grad_out.detach().to("cpu", torch.float64))
    return y.detach(), [leaf.grad for leaf in leaves]


def assert_near(actual, expected, dtype, scale=1.0):
    """assert_close with the absolute bound taken relative to the reference's largest value: the
    gradients of long chains span many magnitudes, and each is as exact as its largest part."""
    tol = TOLERANCE[dtype]
    expected64 = expected.detach().to("cpu", torch.float64)
    size = max(1.0, float(expected64.abs().max())) if expected64.numel() else 1.0
    torch.testing.assert_close(actual.detach().to("cpu", torch.float64), expected64, rtol=tol["rtol"] * scale,
                               atol=tol["atol"] * scale * size, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(NEW_OPS))
@pytest.mark.parametrize("numel", [1, 7, 4099])
def test_unary_op_forward_and_gradient(device, dtype, name, numel):
    low, high = NEW_OPS[name][1]
    x = random((numel,), dtype, device, low, high)
    assert_close(brrr.chain(name)(x, out=poisoned_like(x)), reference([name], x), dtype)
    g = random((numel,), dtype, device)
    _, (grad,) = grads_of(brrr.chain(name), x, [], g)
    _, (want,) = reference_grads([name], x, [], g)
    assert_near(grad, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SCALAR_OPS))
def test_scalar_op_forward_and_gradient(device, dtype, name):
    _, (low, high), scalars = SCALAR_OPS[name]
    x = random((3, 1031), dtype, device, low, high)
    if name.startswith("clamp"):  # the bound itself, where the derivative is torch's (1)
        x[0, :5] = torch.tensor(scalars[:3] + scalars[:2], dtype=dtype)
    g = random(x.shape, dtype, device)
    for c in scalars:
        steps = [(name, c)]
        assert_close(brrr.chain(*steps)(x, out=poisoned_like(x)), reference(steps, x), dtype)
        _, (grad,) = grads_of(brrr.chain(*steps), x, [], g)
        _, (want,) = reference_grads(steps, x, [], g)
        assert_near(grad, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("c", [2.0, 3.0, 0.5, -0.5, 1.5])
def test_pow_special_exponents_over_every_sign_and_special_value(device, dtype, c):
    # Squares and cubes are computed as products, y ** 0.5 and y ** -0.5 as sqrt and rsqrt, as
    # torch.pow computes them: negative bases, signed zeros, infinities and NaN as torch gives them
    # (sqrt(-inf) is NaN where C's pow gives inf; sqrt(-0) is -0), and the derivative c y ** (c - 1).
    x = random((1031,), dtype, device)
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -1.0], dtype=dtype)
    steps = [("pow", c)]
    got = brrr.chain(*steps)(x, out=poisoned_like(x))
    assert_close(got, reference(steps, x), dtype)
    assert torch.equal(torch.signbit(got[:2].cpu()), torch.tensor([False, c in (3.0, 0.5, -0.5)]))
    g = random((1031,), dtype, device)
    _, (grad,) = grads_of(brrr.chain(*steps), x, [], g)
    _, (want,) = reference_grads(steps, x, [], g)
    assert_near(grad, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_relu_keeps_negative_zero_and_a_nan_bound_is_the_result(device, dtype):
    """As torch: relu(-0) is -0 (NaN stays NaN); clamp_min and clamp_max by a NaN bound give NaN
    everywhere, with a zero gradient."""
    x = torch.tensor([-0.0, 0.0, -1.0, 2.0, float("nan")], dtype=dtype, device=device)
    got = brrr.chain("relu")(x)
    assert torch.equal(torch.signbit(got[:2].cpu()), torch.tensor([True, False]))
    assert torch.equal(got.cpu()[2:4], torch.tensor([0.0, 2.0], dtype=dtype)) and got[4].isnan()
    for name in ("clamp_min", "clamp_max"):
        steps = [(name, float("nan"))]
        assert brrr.chain(*steps)(x).isnan().all(), name
        _, (grad,) = grads_of(brrr.chain(*steps), x, [], torch.ones_like(x))
        assert torch.equal(grad.cpu(), torch.zeros(5, dtype=dtype)), name


@pytest.mark.parametrize("name", list(NEW_OPS) + list(SCALAR_OPS))
def test_gradcheck(name):
    low, high = NEW_OPS[name][1] if name in NEW_OPS else SCALAR_OPS[name][1]
    x = random((4, 5), torch.float64, "cpu", low, high)
    if name in ("clamp_min", "clamp_max", "leaky_relu", "abs"):  # kinks: keep finite differences off them
        x = x + 0.01 * torch.sign(x)
    steps = [name] if name in NEW_OPS else [(name, SCALAR_OPS[name][2][-2 if name == "pow" else 0])]
    assert torch.autograd.gradcheck(brrr.chain(*steps), (x.requires_grad_(),))


def test_nan_propagates_through_clamps_and_activations():
    x = torch.tensor([float("nan"), 1.0, -1.0])
    for steps in ([("clamp_min", 0.0)], [("clamp_max", 0.0)], ["hardswish"], [("leaky_relu", 0.1)], ["softplus"], ["mish"]):
        assert torch.isnan(brrr.chain(*steps)(x)[0]), steps


# Random chains: macro-steps that map values of magnitude <= ~4 to values of that size, so that a
# chain of any length stays where float32 resolves it; every op of the set appears in them.
def _macro(rng):
    c = round(rng.uniform(-1.5, 1.5), 3)
    return rng.choice([
        ["relu"], ["gelu"], ["gelu_tanh"], ["silu"], ["sigmoid"], ["tanh"], ["cos"], ["sin"], ["abs"], ["neg"],
        ["hardswish"], ["mish"], ["softplus", ("add", -1.0)], [("leaky_relu", round(rng.uniform(0.01, 0.5), 3))],
        [("clamp_min", c)], [("clamp_max", c)], [("mul", c)], [("add", c)],
        ["tanh", "exp"], ["tanh", "expm1"], ["sigmoid", "log1p"], ["abs", ("add", 0.25), "sqrt"],
        ["abs", ("add", 0.5), "rsqrt"], ["abs", ("add", 0.5), "log"], ["square", ("add", 1.0), "reciprocal"],
        ["tanh", "square"], ["abs", ("add", 0.5), ("pow", rng.choice([2.0, 0.5, 1.5, -1.0, 3.0]))],
        ["add_tensor"], ["mul_tensor"],
    ])


def random_long_chain(rng, n_steps):
    steps = []
    while len(steps) < n_steps:
        macro = _macro(rng)
        if sum(s in ("add_tensor", "mul_tensor") for s in steps + macro) > brrr._C.MAX_CHAIN_OPERANDS:
            continue
        steps += macro
        if len(steps) % 6 < len(macro):  # keep the running value bounded
            steps += ["tanh", ("mul", 2.5)]
    return steps[:n_steps]


def _operands(steps, x, rng):
    n = sum(s in ("add_tensor", "mul_tensor") for s in steps)
    vector = [x.dim() > 1 and rng.random() < 0.5 for _ in range(n)]
    return [random(x.shape[-1:] if v else x.shape, x.dtype, x.device, -1.5, 1.5) for v in vector]


def _views(x):
    """x itself, and a strided view of the same values."""
    return x, x.t().contiguous().t() if x.dim() == 2 else x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_random_long_chains(device, dtype, seed, strided):
    rng = pyrandom.Random(1000 + seed)
    steps = random_long_chain(rng, rng.randint(1, 64))
    x = random((37, 129), dtype, device, -2.0, 2.0)
    operands = _operands(steps, x, rng)
    x = away_from_kinks(steps, x, operands)
    if strided:
        x = x.t().contiguous().t()  # column-major: the strided kernels
    g = random(x.shape, dtype, device)
    chain = brrr.chain(*steps)
    # float32 rounding compounds over the steps, amplified by their derivatives; half types
    # compute in float32 (fast elementary functions on CUDA) and round once at the end.
    scale = (4.0 + len(steps)) if dtype in (torch.float32, torch.float64) else max(1.0, len(steps) / 16)
    assert_near(chain(x, *operands), reference(steps, x, operands), dtype, scale)
    y, grads = grads_of(chain, x, operands, g)
    want_y, want = reference_grads(steps, x, operands, g)
    # A value that reaches a kink (abs, relu, a clamp) within the float32 functions' error of it
    # may take the other side's derivative: those elements, and the columns a vector operand's
    # gradient sums them into, are not compared. away_from_kinks leaves few of them, so most of
    # each gradient is compared.
    near = near_kinks(steps, x, operands)
    for got, expected in zip(grads, want):
        keep = ~near if got.shape == near.shape else ~near.any(0)
        assert keep.float().mean() > 0.5, steps
        assert_near(got.cpu()[keep], expected[keep], dtype, scale * 2)


def near_kinks(steps, x, operands):
    distance = kink_distance(steps, x, operands)
    return (distance > 0) & (distance < KINK_WIDTH[x.dtype])  # on a kink exactly (after a clamp): both agree


def away_from_kinks(steps, x, operands, tries=16):
    """x with its elements near a kink of the chain's derivative drawn again (a few times)."""
    for _ in range(tries):
        near = near_kinks(steps, x, operands).to(x.device)
        if not near.any():
            break
        x = torch.where(near, random(x.shape, x.dtype, x.device, -2.0, 2.0), x)
    return x


KINK_WIDTH = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
KINKS = {"abs": 0.0, "relu": 0.0, "leaky_relu": 0.0, "hardswish": (-3.0, 3.0)}


def kink_distance(steps, x, operands):
    """Per element of x, the float64 chain's least distance to a kink of its derivative."""
    distance = torch.full(x.shape, float("inf"), dtype=torch.float64)

    def nearest(name, scalar, y):
        nonlocal distance
        kinks = scalar if name in ("clamp_min", "clamp_max") else KINKS.get(name, ())
        for kink in kinks if isinstance(kinks, tuple) else (kinks,):
            distance = torch.minimum(distance, (y - kink).abs())

    reference(steps, x, operands, before_step=nearest)
    return distance


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vector", [False, True], ids=["dense", "vector"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_trig_chains_with_operands(device, dtype, vector, strided):
    # Few heavy steps and a trig step: compiled on CUDA as steps over a thread's whole pack.
    steps = ["add_tensor", "cos", ("mul", 2.0), "mul_tensor", "sin", "relu", ("add", 0.25), "cos"]
    x = random((67, 131), dtype, device)
    if strided:
        x = x.t().contiguous().t()
    operands = [random(x.shape[-1:] if vector else x.shape, dtype, device, -1.5, 1.5) for _ in range(2)]
    assert_near(brrr.chain(*steps)(x, *operands), reference(steps, x, operands), dtype, 4.0)
    g = random(x.shape, dtype, device)
    _, grads = grads_of(brrr.chain(*steps), x, operands, g)
    _, want = reference_grads(steps, x, operands, g)
    for got, expected in zip(grads, want):
        assert_near(got, expected, dtype, 8.0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_chain_of_256_steps_is_one_call(device):
    steps = [("mul", 1.0001)] * 256
    x = random((1 << 12,), torch.float32, device)
    assert_close(brrr.chain(*steps)(x), x.double().cpu() * 1.0001 ** 256, torch.float32, scale=8.0)


def test_opcheck_scalar_ops():
    x = torch.rand(6, 10, dtype=torch.float64, requires_grad=True) + 0.5
    torch.library.opcheck(torch.ops.brrr.chain.default, (x, [], "pow,leaky_relu,clamp_max,clamp_min", [2.0, 0.1, 1.0, 0.3]))
