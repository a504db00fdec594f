"""Fused bias + dropout + residual add, the op transformer blocks run after their attention and
MLP output projections:

    out = brrr.bias_dropout_add(x, bias, residual, p)   # residual + dropout(x + bias, p)

One pass forward (reads x, bias, residual; writes out) and one backward (reads grad_out, writes
grad_x; grad_residual is grad_out itself, and grad_bias is summed over rows in a fixed order,
bitwise reproducible). Nothing is saved for the backward but three numbers: the mask is drawn from
a counter-based generator (Philox4x32-10), so the backward draws it again.

The mask. Element i, its row-major index in x's shape (a strided view gets the mask of its
contiguous copy), is kept iff word i % 4 of Philox4x32-10(counter = (i // 4, offset), key = seed)
is >= floor(p * 2**32); kept elements are scaled by 1 / (1 - p). The CPU and the CUDA kernels keep
the same elements for the same (seed, offset, shape). As in torch.nn.functional.dropout, every
element is multiplied by its mask value (scale or 0): a dropped inf or NaN gives NaN, and so does a
dropped inf or NaN in the backward's grad_out.

seed=None draws a seed from PyTorch's default CPU generator (torch.randint(2**63 - 1, (1,))), so
torch.manual_seed makes runs reproducible; NumPy and other arrays need an explicit seed. Under
torch.compile that draw is a host value (.item()): dynamo breaks the graph there unless
torch._dynamo.config.capture_scalar_outputs is set, and an explicit seed keeps one graph. Inside a
CUDA-graph capture seed=None is refused: a seed drawn on the host would be replayed with the graph,
one mask for every step (docs/graphs.md).
Different offsets with one seed give independent masks (a layer index or a step, say). seed and
offset are ints in [0, 2**63), as torch.library's int arguments are int64.
"""

import numbers

from . import _C
from ._args import refuse_kinds
from ._frameworks import empty_like, torch_if_tensor

_INT64_LIMIT = 2**63


def check_args(p, training, seed, offset):
    """The dropout probability in effect (0 when not training), after checking the arguments."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"argument p: expected a float, got {type(p).__name__}")
    if not 0.0 <= p <= 1.0:  # NaN too
        raise ValueError(f"argument p: dropout probability has to be between 0 and 1, got {p}")
    if not isinstance(training, bool):
        raise TypeError(f"argument training: expected a bool, got {type(training).__name__}")
    for name, value in (("seed", seed), ("offset", offset)):
        if value is None and name == "seed":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"argument {name}: expected an int, got {type(value).__name__}")
        if not 0 <= value < _INT64_LIMIT:
            raise ValueError(f"argument {name}: expected an int in [0, 2**63), got {value}")
    return float(p) if training else 0.0


def bias_dropout_add(x, bias, residual, p, training=True, seed=None, offset=0):
    """residual + dropout(x + bias, p) in one pass; bias is None or of shape x.shape[-1:],
    residual has x's shape. training=False or p=0: x + bias + residual; p=1: residual + (x + bias) * 0
    (residual where x + bias is finite). See the module for the mask, seed and offset."""
    p = check_args(p, training, seed, offset)
    if residual is None:
        raise TypeError("argument residual: expected a tensor of x's shape, got None")
    torch = torch_if_tensor(x)
    if torch is not None:
        from . import _torch_dropout

        try:
            return _torch_dropout.bias_dropout_add(x, bias, residual, p, None if seed is None else int(seed),
                                                   int(offset))
        except RuntimeError:
            refuse_kinds(("x", x), ("bias", bias), ("residual", residual))
            raise
    if seed is None:
        raise TypeError("argument seed: required for inputs that are not PyTorch tensors")
    out = None if type(x).__module__ == "numpy" else empty_like(x)  # brrr._C allocates NumPy outputs
    return _C.dropout_fwd(x, bias, residual, out, p=p, seed=int(seed), offset=int(offset))[0]
