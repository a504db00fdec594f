"""Every op that takes arrays, on the arrays of other frameworks: NumPy, JAX on the CPU, and (on a
GPU) JAX and CuPy arrays on the device. Each result is checked against a float64 NumPy reference
of the same rounded inputs, comes back as an array of the input's framework on its device, and
leaves the inputs as they were.

JAX is a test requirement (requirements-test.txt), so these run in CI; this file needs neither
PyTorch nor a GPU for its CPU cases.
"""

import array
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import brrr

TOLERANCE = {
    "float64": dict(rtol=1e-10, atol=1e-12),
    "float32": dict(rtol=2e-5, atol=2e-6),
    "float16": dict(rtol=2e-3, atol=2e-4),
    "bfloat16": dict(rtol=1.6e-2, atol=2e-3),
}
SIZES = [(1,), (3, 5), (4097,)]


# The dtypes each framework's arrays are tested in: JAX has float64 only with jax_enable_x64,
# NumPy and CuPy have no bfloat16.
DTYPES = {
    "numpy": ("float32", "float16", "float64"),
    "jax-cpu": ("float32", "float16", "bfloat16"),
    "jax-gpu": ("float32", "float16", "bfloat16"),
    "cupy": ("float32", "float16", "float64"),
}
ON_GPU = ("jax-gpu", "cupy")


class Framework:
    """Moves NumPy arrays into one framework (and device) and back."""

    def __init__(self, name, to_native, to_numpy, array_type, device_of):
        self.name, self.to_native, self.to_numpy = name, to_native, to_numpy
        self.array_type, self.device_of = array_type, device_of


def framework(name):
    if name == "numpy":
        return Framework(name, np.asarray, np.asarray, np.ndarray, lambda a: "cpu")
    if name == "cupy":
        import cupy

        return Framework(name, cupy.asarray, cupy.asnumpy, cupy.ndarray, lambda a: a.device.id)
    device = jax.devices(name.split("-")[1])[0]
    return Framework(name, lambda a: jax.device_put(a, device), lambda a: np.asarray(jax.device_get(a)), jax.Array,
                     lambda a: a.devices())


def pytest_generate_tests(metafunc):
    if "inputs" in metafunc.fixturenames:
        metafunc.parametrize("inputs", [
            pytest.param((name, dtype), id=f"{name}-{dtype}", marks=[pytest.mark.cuda] if name in ON_GPU else [])
            for name, dtypes in DTYPES.items() for dtype in dtypes], indirect=True)


def numpy_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


class Inputs:
    """Fresh random inputs, rounded to the dtype, in the framework; their float64 values for the
    references; and a check that no op wrote into them."""

    def __init__(self, fw, dtype, seed):
        self.fw, self.dtype, self.rng = fw, dtype, np.random.default_rng(seed)
        self.made = []

    def __call__(self, shape, low=-3.0, high=3.0):
        rounded = self.rng.uniform(low, high, shape).astype(numpy_dtype(self.dtype))
        native = self.fw.to_native(rounded)
        self.made.append((native, rounded.astype(np.float64)))
        return native, rounded.astype(np.float64)

    def assert_unchanged(self):
        for native, values in self.made:
            np.testing.assert_array_equal(self.fw.to_numpy(native).astype(np.float64), values)


@pytest.fixture
def inputs(request):
    name, dtype = request.param
    made = Inputs(framework(name), dtype, seed=len(request.node.name))
    yield made
    made.assert_unchanged()


@pytest.fixture
def fw(inputs):
    return inputs.fw


def check(fw, dtype, result, expected, like, scale=1.0):
    """result is an array of fw on like's device, equal to expected within dtype's tolerance."""
    assert isinstance(result, fw.array_type), type(result)
    assert fw.device_of(result) == fw.device_of(like)
    got = fw.to_numpy(result)
    assert got.dtype == numpy_dtype(dtype), (got.dtype, dtype)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=tol["rtol"] * scale, atol=tol["atol"] * scale)


# --- float64 references --------------------------------------------------------------------------

erf = np.vectorize(math.erf)


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def layer_norm(h, w, b, eps=1e-5):
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return (h - mean) / np.sqrt(var + eps) * w + b


def rms_norm(h, w, eps):
    return h / np.sqrt((h**2).mean(-1, keepdims=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def log_softmax(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def rounded(x, dtype):
    """x rounded to dtype, as a fused op's stored intermediate (h = x + residual) is."""
    return x.astype(numpy_dtype(dtype)).astype(np.float64)


# --- the ops -------------------------------------------------------------------------------------

ACTIVATIONS = {
    "relu": (brrr.relu, lambda x: np.maximum(x, 0.0)),
    "gelu": (brrr.gelu, gelu),
    "gelu_tanh": (lambda x: brrr.gelu(x, approximate="tanh"), gelu_tanh),
    "silu": (brrr.silu, silu),
    "sigmoid": (brrr.sigmoid, sigmoid),
    "tanh": (brrr.tanh, np.tanh),
    "exp": (brrr.exp, np.exp),
    "cos": (brrr.cos, np.cos),
    "sin": (brrr.sin, np.sin),
}


@pytest.mark.parametrize("shape", SIZES, ids=str)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activations(fw, inputs, name, shape):
    op, reference = ACTIVATIONS[name]
    x, x64 = inputs(shape)
    check(fw, inputs.dtype, op(x), reference(x64), x)


@pytest.mark.parametrize("shape", SIZES, ids=str)
def test_chain_with_scalars_and_tensor_operands(fw, inputs, shape):
    x, x64 = inputs(shape)
    bias, bias64 = inputs(shape[-1:])
    scale, scale64 = inputs(shape)
    f = brrr.chain(("mul", 0.5), "add_tensor", "cos", "mul_tensor", ("add", 1.0))
    check(fw, inputs.dtype, f(x, bias, scale), np.cos(0.5 * x64 + bias64) * scale64 + 1.0, x, scale=4)


def test_chain_into_an_out_array(fw, inputs):
    x, x64 = inputs((3, 7))
    out = fw.to_native(np.full((3, 7), np.nan, numpy_dtype(inputs.dtype)))
    result = brrr.chain("sin", "exp")(x, out=out)
    check(fw, inputs.dtype, result, np.exp(np.sin(x64)), x, scale=4)
    check(fw, inputs.dtype, out, np.exp(np.sin(x64)), x, scale=4)


@pytest.mark.parametrize("shape", SIZES, ids=str)
def test_bias_activations(fw, inputs, shape):
    x, x64 = inputs(shape)
    b, b64 = inputs(shape[-1:])
    check(fw, inputs.dtype, brrr.bias_gelu(x, b), gelu(x64 + b64), x, scale=2)
    check(fw, inputs.dtype, brrr.bias_gelu(x, b, approximate="tanh"), gelu_tanh(x64 + b64), x, scale=2)
    check(fw, inputs.dtype, brrr.bias_silu(x, b), silu(x64 + b64), x, scale=2)


@pytest.mark.parametrize("shape", [(1, 2), (3, 10), (2, 4098)], ids=str)
def test_gated_linear_units(fw, inputs, shape):
    x, x64 = inputs(shape)
    up, up64 = inputs(shape)
    half = shape[-1] // 2
    check(fw, inputs.dtype, brrr.swiglu(x, up), silu(x64) * up64, x, scale=4)
    check(fw, inputs.dtype, brrr.geglu(x, up, approximate="tanh"), gelu_tanh(x64) * up64, x, scale=4)
    check(fw, inputs.dtype, brrr.swiglu(x), silu(x64[..., :half]) * x64[..., half:], x, scale=4)
    check(fw, inputs.dtype, brrr.geglu(x), gelu(x64[..., :half]) * x64[..., half:], x, scale=4)


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, 4097)], ids=str)
def test_norms(fw, inputs, shape):
    dtype, n = inputs.dtype, shape[-1]
    x, x64 = inputs(shape)
    residual, residual64 = inputs(shape)
    w, w64 = inputs((n,))
    b, b64 = inputs((n,))
    eps = 1e-6
    check(fw, dtype, brrr.layer_norm(x, (n,), w, b), layer_norm(x64, w64, b64), x, scale=8)
    check(fw, dtype, brrr.rms_norm(x, (n,), w, eps=eps), rms_norm(x64, w64, eps), x, scale=8)
    h64 = rounded(x64 + residual64, dtype)
    y, h = brrr.add_layer_norm(x, residual, (n,), w, b)
    check(fw, dtype, y, layer_norm(h64, w64, b64), x, scale=8)
    check(fw, dtype, h, h64, x)
    y, h = brrr.add_rms_norm(x, residual, (n,), w, eps=eps)
    check(fw, dtype, y, rms_norm(h64, w64, eps), x, scale=8)
    check(fw, dtype, h, h64, x)


@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 4097)], ids=str)
def test_bias_dropout_add(fw, inputs, shape):
    dtype, p = inputs.dtype, 0.25
    x, x64 = inputs(shape)
    b, b64 = inputs(shape[-1:])
    residual, residual64 = inputs(shape)
    check(fw, dtype, brrr.bias_dropout_add(x, b, residual, p, training=False, seed=0), x64 + b64 + residual64, x,
          scale=4)
    out = brrr.bias_dropout_add(x, b, residual, p, seed=1234, offset=7)
    assert isinstance(out, fw.array_type) and fw.device_of(out) == fw.device_of(x)
    got = fw.to_numpy(out).astype(np.float64)
    tol = dict(rtol=4 * TOLERANCE[dtype]["rtol"], atol=4 * TOLERANCE[dtype]["atol"])
    kept = np.isclose(got, residual64 + (x64 + b64) / (1 - p), **tol)
    dropped = np.isclose(got, residual64, **tol)
    assert (kept | dropped).all(), "each element is residual + (x + bias) / (1 - p), or residual alone"
    assert 0 < dropped.mean() < 1 or got.size < 8
    # The mask depends on the seed, the offset and the shape only: the one NumPy arrays get, read
    # exactly from ones (out = 0 where dropped).
    ones = np.ones(shape, np.float32)
    numpy_dropped = brrr.bias_dropout_add(ones, None, np.zeros_like(ones), p, seed=1234, offset=7) == 0
    decided = kept != dropped
    np.testing.assert_array_equal(dropped[decided], numpy_dropped[decided])


@pytest.mark.parametrize("seq, head_dim", [(1, 2), (3, 8), (5, 130)])
def test_rotary(fw, inputs, seq, head_dim):
    dtype = inputs.dtype
    q, q64 = inputs((2, 3, seq, head_dim))
    k, k64 = inputs((2, 1, seq, head_dim))
    cos, cos64 = inputs((2, seq, head_dim), -1.0, 1.0)
    sin, sin64 = inputs((2, seq, head_dim), -1.0, 1.0)
    c64, s64 = cos64[:, None], sin64[:, None]
    check(fw, dtype, brrr.rotary(q, cos[:, None], sin[:, None]), q64 * c64 + rotate_half(q64) * s64, q, scale=4)
    q_out, k_out = brrr.apply_rotary_pos_emb(q, k, cos, sin)
    check(fw, dtype, q_out, q64 * c64 + rotate_half(q64) * s64, q, scale=4)
    check(fw, dtype, k_out, k64 * c64 + rotate_half(k64) * s64, k, scale=4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 4097), (2, 5, 3)], ids=str)
def test_cross_entropy(fw, inputs, shape, reduction):
    dtype = inputs.dtype
    logits, logits64 = inputs(shape, -4.0, 4.0)
    classes = shape[0] if len(shape) == 1 else shape[1]
    target_shape = () if len(shape) == 1 else shape[:1] + shape[2:]
    target64 = np.random.default_rng(len(shape)).integers(0, classes, target_shape)
    target64.flat[0] = -100  # ignored
    target = fw.to_native(target64)
    picked = np.moveaxis(logits64, 1, -1) if len(shape) > 2 else logits64
    nll = -np.take_along_axis(log_softmax(picked), np.maximum(target64, 0)[..., None], -1)[..., 0]
    nll = np.where(target64 == -100, 0.0, nll)
    expected = {"none": nll, "sum": nll.sum(), "mean": nll.sum() / max(1, (target64 != -100).sum())}[reduction]
    if reduction == "mean" and (target64 != -100).sum() == 0:
        expected = np.nan
    result = brrr.cross_entropy(logits, target, reduction=reduction)
    assert np.shape(fw.to_numpy(result)) == np.shape(expected)
    if np.isnan(expected).all():
        assert np.isnan(fw.to_numpy(result).astype(np.float64)).all()
        return
    check(fw, dtype, result, expected, logits, scale=8)


def test_cross_entropy_loss_dtype(fw, inputs):
    logits, logits64 = inputs((3, 11))
    target64 = np.array([0, 5, 10])
    expected = -log_softmax(logits64)[np.arange(3), target64].mean()
    result = brrr.cross_entropy(logits, fw.to_native(target64), dtype=np.float32)
    check(fw, "float32", result, expected, logits, scale=4)


def test_jax_buffers_stay_as_jax_made_them():
    """brrr writes its results into arrays it had JAX allocate; arrays JAX makes later, or made
    before, are untouched (no buffer is shared behind JAX's back)."""
    before = jnp.zeros((64, 64), jnp.float32)
    x = jnp.ones((64, 64), jnp.float32)
    for _ in range(3):
        brrr.gelu(x)
        brrr.layer_norm(x, (64,))
        brrr.cross_entropy(x, jnp.zeros(64, jnp.int32), reduction="none")
    after = jnp.zeros((64, 64), jnp.float32)
    assert float(jnp.abs(before).max()) == 0.0 and float(jnp.abs(after).max()) == 0.0
    assert float(jnp.abs(x - 1.0).max()) == 0.0


@pytest.mark.parametrize("call", [brrr.gelu, brrr.chain("sin"), lambda x: brrr.softmax(x), brrr.swiglu,
                                  lambda x: brrr.layer_norm(x, (8,)), lambda x: brrr.rotary(x, x[:, :4], x[:, :4]),
                                  lambda x: brrr.cross_entropy(x, jnp.zeros(4, jnp.int32))],
                         ids=["gelu", "chain", "softmax", "swiglu", "layer_norm", "rotary", "cross_entropy"])
def test_jax_jit_tracers_are_refused_naming_the_argument(call):
    """Inside jax.jit the arrays are tracers, with no data to hand over (docs/interop.md)."""
    with pytest.raises(TypeError, match=r"^argument (x|x \(gate half\)|input): DynamicJaxprTracer has no device"):
        jax.jit(call)(jnp.ones((4, 8), jnp.float32))


def test_arrays_without_a_namespace_are_refused_naming_the_argument():
    with pytest.raises(TypeError, match="argument input"):
        brrr.cross_entropy([[0.5, 1.0]], [0])


@pytest.mark.parametrize("code", ["q", "l", "i"])
def test_numpy_integer_targets_of_every_type_number(code):
    """NumPy's int64 is NPY_LONG or NPY_LONGLONG by how the array was made (array.array('q') gives
    the latter on Linux), int32 NPY_INT: targets are taken by their kind and size."""
    target = np.asarray(array.array(code, [0, 4, 2]))
    assert target.dtype.kind == "i"
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    expected = -log_softmax(x.astype(np.float64))[np.arange(3), [0, 4, 2]].mean()
    np.testing.assert_allclose(brrr.cross_entropy(x, target), expected, rtol=1e-5)


# --- streams -------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("name", ON_GPU)
def test_a_result_is_ready_when_its_framework_reads_it(name):
    """JAX and a CuPy stream of its own read a result on streams brrr cannot know: brrr waits for
    its kernels before returning (csrc/brrr.h, wait_for_kernels). A slow chain (64 cosines over
    2^26 elements, about 2 ms) gives the framework's read time to overtake an unfinished kernel;
    the read comes first, the check after, each of several times."""
    fw = framework(name)
    chain = brrr.chain(*["cos"] * 64)
    values = np.random.default_rng(0).uniform(-3, 3, 1 << 26).astype(np.float32)
    x = fw.to_native(values)
    expected = chain(values[:4096].astype(np.float64))
    if name == "cupy":
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
    for _ in range(5):
        if name == "cupy":
            with stream:
                first = fw.to_numpy(chain(x)[:4096])
        else:
            first = fw.to_numpy(chain(x)[:4096])
        np.testing.assert_allclose(first.astype(np.float64), expected, rtol=1e-4, atol=1e-5)
