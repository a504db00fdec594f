"""The accuracy of the CPU kernels' vectorised float32 transcendentals (csrc/cpu_math.h), measured
through the chain ops on dense sweeps of their whole range against float64 references: a few
float32 ulps (2^-24 = 6e-8 relative) where the function is well conditioned, and the tails,
overflow, underflow, infinities, NaN and huge trig arguments (libm's reduction) right."""

import numpy as np
import pytest
import torch

import brrr
from helpers import DEVICES, assert_close

ULP = 2.0 ** -24


def _run(name, x32):
    return brrr.chain(name)(torch.from_numpy(x32)).numpy().astype(np.float64)


def _max_rel(actual, expected, floor):
    return float(np.max(np.abs(actual - expected) / np.maximum(np.abs(expected), floor)))


@pytest.mark.parametrize("name, ref, low, high, ulps", [
    ("exp", np.exp, -87.0, 88.5, 4),
    ("tanh", np.tanh, -12.0, 12.0, 4),
    ("sigmoid", lambda x: 1 / (1 + np.exp(-x)), -80.0, 80.0, 6),
    ("silu", lambda x: x / (1 + np.exp(-x)), -80.0, 80.0, 6),
])
def test_relative_accuracy_over_the_range(name, ref, low, high, ulps):
    x = np.linspace(low, high, 1_000_003).astype(np.float32)
    assert _max_rel(_run(name, x), ref(x.astype(np.float64)), 1e-30) < ulps * ULP


def test_gelu_erf_is_accurate_in_the_left_tail():
    """gelu(x) = x/2 erfc(-x/sqrt 2): relative accuracy down to where it underflows, not 1 + erf's
    cancellation. Rounding x/sqrt(2) to float32 alone moves e^(-x^2/2) by about x^2 ulps."""
    from math import erfc, sqrt

    x = np.linspace(-13.0, 8.0, 200_003).astype(np.float32)
    expected = np.array([0.5 * v * erfc(-v / sqrt(2.0)) for v in x.astype(np.float64)])
    normal = np.abs(expected) > 1e-37
    error = np.abs(_run("gelu", x) - expected) / np.maximum(np.abs(expected), 1e-30)
    assert np.all(error[normal] < 8 * ULP * (1 + x[normal].astype(np.float64) ** 2))


@pytest.mark.parametrize("name", ["sin", "cos"])
def test_trig_within_the_reduced_range_and_beyond(name):
    ref = getattr(np, name)
    near = np.linspace(-8192.0, 8192.0, 1_000_003).astype(np.float32)
    assert np.max(np.abs(_run(name, near) - ref(near.astype(np.float64)))) < 4 * ULP
    rng = np.random.default_rng(0)
    far = (rng.uniform(-1, 1, 100_003) * 10.0 ** rng.uniform(3.9, 38, 100_003)).astype(np.float32)
    far[::2] = np.nextafter(np.float32(8192.0), np.float32(np.inf))  # the first argument past the fast path
    assert np.max(np.abs(_run(name, far) - ref(far.astype(np.float64)))) < 4 * ULP


@pytest.mark.parametrize("name", ["exp", "tanh", "sigmoid", "silu", "gelu", "gelu_tanh", "sin", "cos"])
def test_special_values(name):
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -1e-40, 200.0, -200.0, 3e38, -3e38], dtype=np.float32)
    ref = {"exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
           "gelu": torch.nn.functional.gelu, "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
           "sin": torch.sin, "cos": torch.cos}[name](torch.from_numpy(x).double()).numpy()
    got = _run(name, x)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), (got, ref)
    finite = ~np.isnan(ref)
    np.testing.assert_allclose(got[finite], ref[finite].astype(np.float32), rtol=8 * ULP, atol=1e-44)


def _every_half_value(dtype, low, high):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x) & (x >= low) & (x <= high)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gelu_half_storage_every_value_through_geglu(dtype):
    """Half storage takes its own erfc (no division, shorter polynomials: csrc/cpu_math.h). Every
    float16 and bfloat16 gate in [-10, 10], as a strided view, through GeGLU with fresh random up
    values: the output and both gradients against float64 within the dtype's tolerance, and gelu
    and its derivative (up = 1) within one ulp of the float64 values."""
    from math import pi, sqrt

    values = _every_half_value(dtype, -10.0, 10.0)
    gate = torch.stack([values, torch.zeros_like(values)], 1)[:, 0]  # stride 2
    x64 = gate.double()
    cdf = 0.5 * torch.special.erfc(-x64 / sqrt(2.0))
    ref, ref_grad = x64 * cdf, cdf + x64 * torch.exp(-0.5 * x64 * x64) / sqrt(2 * pi)
    for up in (torch.ones_like(gate), torch.randn(gate.shape, dtype=torch.float64).to(dtype)):
        g = gate.detach().requires_grad_()
        u = up.detach().requires_grad_()
        grad_out = torch.randn(gate.shape, dtype=torch.float64).to(dtype)
        y = brrr.geglu(g, u)
        grad_gate, grad_up = torch.autograd.grad(y, (g, u), grad_out)
        up64, go64 = up.double(), grad_out.double()
        assert_close(y, ref * up64)
        assert_close(grad_gate, go64 * up64 * ref_grad)
        assert_close(grad_up, go64 * ref)
    ulp, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    g = gate.detach().requires_grad_()
    y = brrr.gelu(g)
    (grad,) = torch.autograd.grad(y, g, torch.ones_like(y))
    for name, got, want in (("gelu", y, ref), ("grad", grad, ref_grad)):
        bad = ~((got.detach().double() - want).abs() <= ulp * want.abs() + tiny)
        assert not bool(bad.any()), (name, x64[bad][:8].tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gelu_half_storage_special_values(dtype):
    """Infinities, NaN, signed zeros and the largest values: torch's gelu and its derivative
    (their NaN where x * pdf is inf * 0)."""
    big = torch.finfo(dtype).max
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 200.0, -200.0, big, -big], dtype=dtype)
    x64 = x.double().requires_grad_()
    ref = torch.nn.functional.gelu(x64)
    (ref_grad,) = torch.autograd.grad(ref, x64, torch.ones_like(ref))
    g = x.clone().requires_grad_()
    y = brrr.gelu(g)
    (grad,) = torch.autograd.grad(y, g, torch.ones_like(y))
    for got, want in ((y, ref.detach().to(dtype)), (grad, ref_grad.to(dtype))):
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite], want[finite]), (got, want)


@pytest.mark.parametrize("cols", [2, 4097])
def test_softmax_exponential_over_its_range(cols):
    """Softmax takes its own exponential of arguments at most 0 (e^a 2^64, one scaling:
    csrc/cpu_math.h). Rows [0, a, -inf...] for a dense sweep of a in [-110, 0] give e^a / (1 + e^a)
    within 4 ulps, subnormal results within one subnormal ulp (rounded once, not flushed), 0 past
    -104; rows of up to 4096 columns take the three-walk path, longer ones the one-walk path."""
    a = np.linspace(-110.0, 0.0, 400_003 if cols == 2 else 4_003).astype(np.float32)
    x = np.full((a.size, cols), -np.inf, dtype=np.float32)
    x[:, 0], x[:, 1] = 0.0, a
    got = brrr.softmax(torch.from_numpy(x), -1).numpy().astype(np.float64)
    ea = np.exp(a.astype(np.float64))
    for col, want in ((1, ea / (1 + ea)), (0, 1 / (1 + ea))):
        assert np.all(np.abs(got[:, col] - want) <= 4 * ULP * want + 2.0 ** -149), col
    assert np.all(got[:, 2:] == 0)
    assert np.any((got[:, 1] > 0) & (got[:, 1] < 2.0 ** -126))  # subnormal results were reached


@pytest.mark.parametrize("cols", [9, 1024, 4100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_special_rows(cols, dtype):
    """Rows all -inf, all NaN, with one NaN of either sign, with +inf, with -inf in part and with
    an element that underflows: NaN where torch's float64 softmax and log_softmax have it, the rest
    within the dtype's tolerance; and the same bits again."""
    x = torch.randn(8, cols, dtype=torch.float64).to(dtype)
    x[0] = float("-inf")
    x[1] = float("nan")
    x[2, cols // 2] = float("nan")
    x[3, cols // 3] = -float("nan")
    x[4, 1] = float("inf")
    x[5, ::2] = float("-inf")
    x[6, 0] = 100.0
    for fn, ref_fn in ((brrr.softmax, torch.softmax), (brrr.log_softmax, torch.log_softmax)):
        y = fn(x, -1)
        ref = ref_fn(x.double(), -1)
        assert torch.equal(torch.isnan(y), torch.isnan(ref)), (fn, torch.isnan(y).sum(1), torch.isnan(ref).sum(1))
        finite = ~torch.isnan(ref)
        assert_close(y.double()[finite], ref[finite], dtype, scale=4)
        again = fn(x, -1)
        assert torch.equal(again.isnan(), y.isnan()) and torch.equal(again.nan_to_num(), y.nan_to_num())


@pytest.mark.parametrize("scale", [1.0009765625, 1.5, 0.7001953125, 3.0e38])
def test_bfloat16_stores_round_to_nearest_even(scale):
    """Every bfloat16 value times a scale, computed in float32 (exactly, but for the largest
    scale's overflow) and stored as bfloat16: torch's rounding to nearest, ties to even, bit for
    bit, infinities where it overflows; NaN stays NaN."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got = brrr.chain(("mul", scale))(x)
    want = (x.float() * scale).bfloat16()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_sign_of_a_zero_result_is_float64s(dtype, device):
    """-0 and +0 in, each unary chain op: a zero that comes out carries the sign of torch's float64
    result (tanh and sin of -0 gave +0 in float32 and half storage: the polynomial's x + x^3 P
    added +0 to -0). float64, not the dtype's own torch op, which gives gelu(-0) as +0 in float32;
    and on the CPU for every device: brrr's CUDA kernels compute its CPU twins' function, where
    torch's CUDA relu gives relu(-0) as +0 and its CPU relu -0."""
    import torch.nn.functional as F

    ops = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
           "silu": F.silu, "tanh": torch.tanh, "sin": torch.sin, "abs": torch.abs, "neg": torch.neg,
           "square": torch.square, "sqrt": torch.sqrt, "log1p": torch.log1p, "expm1": torch.expm1,
           "mish": F.mish, "hardswish": F.hardswish}
    x = torch.tensor([-0.0, 0.0] * 40, dtype=dtype, device=device)  # longer than a vector, so the vector loop runs too
    # zeros beside values past the fast trig range (|x| > 32) in the same pack, and a strided view:
    # the CUDA kernels' paths that take each element's range (half sin(-0) came out +0 there)
    mixed = torch.tensor([-0.0, 0.0, 100.0, -100.0] * 20, dtype=dtype, device=device)
    strided = torch.stack([mixed, mixed], 1)[:, 0]
    for name, ref in ops.items():
        got, want = brrr.chain(name)(x).cpu(), ref(x.double().cpu()).to(dtype)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), (name, got[:2], want[:2])
        for y in (mixed, strided):
            zeros = (y == 0).cpu()
            got, want = brrr.chain(name)(y).cpu()[zeros], ref(y.double().cpu()).to(dtype)[zeros]
            assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), (name, got[:2])
