"""LayerNorm and RMSNorm, alone or fused with the residual add of pre-norm transformer blocks.

    y = brrr.layer_norm(x, (hidden,), weight, bias)           # torch.nn.functional.layer_norm
    y = brrr.rms_norm(x, (hidden,), weight)                    # torch.nn.functional.rms_norm
    y = brrr.rms_norm(x, (hidden,), weight, cast_order="llama")  # Llama's RMSNorm
    y, h = brrr.add_layer_norm(x, residual, (hidden,), weight, bias)  # h = x + residual, y = LN(h)
    y, h = brrr.add_rms_norm(x, residual, (hidden,), weight)

Each is one pass over memory forward and one backward. Math runs in fp32 (fp64 for float64) with
the output in x's dtype; weight and bias have x's dtype, or float32 for float16/bfloat16 x (as
autocast leaves them). The forward saves x (for the fused forms: the new residual h) and two
numbers per row, in fp32; the backward rematerialises the normalised input from them. Weight
and bias gradients are reduced in a fixed order: bitwise identical from run to run.

cast_order (RMSNorm): "torch" computes x * rstd * weight in fp32 and rounds once, as
torch.nn.functional.rms_norm does; "llama" rounds x * rstd to x's dtype before multiplying by
the weight, as Hugging Face's LlamaRMSNorm does (`weight * hidden.to(input_dtype)`), with the
result in x's dtype.
"""

import numbers

from . import _C
from ._args import as_float, bad_choice, refuse_kinds, shape_of
from ._frameworks import empty_like, torch_if_tensor

CAST_ORDERS = ("torch", "llama")


def normalized_ndim(shape, normalized_shape):
    """len(normalized_shape), after checking that it is an int or a sequence of ints, the trailing
    part of `shape`."""
    ns = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else (normalized_shape,)
    for n in ns:
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, numbers.Integral)):
            raise TypeError(f"argument normalized_shape: expected an int or a sequence of ints, got "
                            f"{normalized_shape!r:.80}")
    shape = tuple(shape)
    if not ns or len(ns) > len(shape) or shape[len(shape) - len(ns):] != ns:
        raise ValueError(f"argument normalized_shape: {list(ns)} must be non-empty and the trailing dims of the "
                         f"input's shape {list(shape)}")
    return len(ns)


def default_rms_eps(dtype):
    """rms_norm's eps=None as torch computes it: the machine epsilon of the compute dtype, float32
    for float16/bfloat16/float32 and float64 for float64 (torch's documentation says
    torch.finfo(x.dtype).eps; its kernels and decompositions use the compute dtype's)."""
    return 2.0**-52 if dtype.itemsize == 8 else 2.0**-23


def llama_order(cast_order):
    if not isinstance(cast_order, str) or cast_order not in CAST_ORDERS:
        raise bad_choice("cast_order", cast_order, CAST_ORDERS)
    return cast_order == "llama"


def rms_eps(x, eps):
    """rms_norm's eps as a float: None for default_rms_eps(x.dtype)."""
    return default_rms_eps(x.dtype) if eps is None else as_float("eps", eps)


def _out_like(x):
    if type(x).__module__ == "numpy":
        return None  # brrr._C allocates NumPy outputs
    out = empty_like(x)
    if out is None:
        raise TypeError(f"argument x: brrr cannot allocate outputs for {type(x).__name__} (it has no "
                        "__array_namespace__)")
    return out


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.layer_norm: (x - mean) / sqrt(var + eps) * weight + bias over the
    trailing dims `normalized_shape` (biased variance)."""
    if torch_if_tensor(x) is not None:
        from . import _torch_norm

        try:
            return _torch_norm.layer_norm(x, normalized_shape, weight, bias, eps)
        except RuntimeError:
            refuse_kinds(("x", x), ("weight", weight), ("bias", bias))
            raise
    k = normalized_ndim(shape_of("x", x), normalized_shape)
    return _C.layer_norm_fwd(x, k, weight, bias, as_float("eps", eps), _out_like(x), None, None, None, None, -1)


def rms_norm(x, normalized_shape, weight=None, eps=None, *, cast_order="torch"):
    """torch.nn.functional.rms_norm: x / sqrt(mean(x^2) + eps) * weight over the trailing dims
    `normalized_shape`; eps=None: see default_rms_eps. cast_order: see the module."""
    llama = llama_order(cast_order)
    if torch_if_tensor(x) is not None:
        from . import _torch_norm

        try:
            return _torch_norm.rms_norm(x, normalized_shape, weight, eps, llama)
        except RuntimeError:
            refuse_kinds(("x", x), ("weight", weight))
            raise
    k = normalized_ndim(shape_of("x", x), normalized_shape)
    return _C.rms_norm_fwd(x, k, weight, rms_eps(x, eps), llama, _out_like(x), None, None, None, -1)


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """(layer_norm(h), h) with h = x + residual (rounded to x's dtype), in one pass: the pre-norm
    block's residual add and norm. Gradients flow into x and residual through both outputs."""
    if torch_if_tensor(x) is not None:
        from . import _torch_norm

        try:
            return _torch_norm.add_layer_norm(x, residual, normalized_shape, weight, bias, eps)
        except RuntimeError:
            refuse_kinds(("x", x), ("residual", residual), ("weight", weight), ("bias", bias))
            raise
    k = normalized_ndim(shape_of("x", x), normalized_shape)
    return _C.layer_norm_fwd(x, k, weight, bias, as_float("eps", eps), _out_like(x), None, None, residual,
                             _out_like(x), -1)


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, *, cast_order="torch"):
    """(rms_norm(h), h) with h = x + residual (rounded to x's dtype), in one pass."""
    llama = llama_order(cast_order)
    if torch_if_tensor(x) is not None:
        from . import _torch_norm

        try:
            return _torch_norm.add_rms_norm(x, residual, normalized_shape, weight, eps, llama)
        except RuntimeError:
            refuse_kinds(("x", x), ("residual", residual), ("weight", weight))
            raise
    k = normalized_ndim(shape_of("x", x), normalized_shape)
    return _C.rms_norm_fwd(x, k, weight, rms_eps(x, eps), llama, _out_like(x), None, residual, _out_like(x), -1)
