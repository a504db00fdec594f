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
torch.manual_seed makes runs reproducible (and where no mask is needed, training=False, p 0 or 1
or no elements, nothing is drawn: torch.nn.functional.dropout leaves the generator alone then too);
NumPy and other arrays need an explicit seed. Under torch.compile that draw is a host value
(.item()): dynamo breaks the graph there unless torch._dynamo.config.capture_scalar_outputs is set,
and an explicit seed keeps one graph. Inside a CUDA-graph capture a seed=None that needs a draw is
refused: a seed drawn on the host would be replayed with the graph, one mask for every step
(docs/graphs.md).
Different offsets with one seed give independent masks (a layer index or a step, say). seed and
offset are ints in [0, 2**63), as torch.library's int arguments are int64.
"""

import numbers

from . import _C
from ._args import refuse_kinds, required
from ._frameworks import check_torch, empty_like, torch_if_tensor
from ._integration import torch_integration

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
    required("residual", residual)
    if torch_if_tensor(x) is not None:
        try:
            return torch_layer().bias_dropout_add(x, bias, residual, p, None if seed is None else int(seed),
                                                  int(offset))
        except RuntimeError:
            refuse_kinds(("x", x), ("bias", bias), ("residual", residual))
            raise
    required("x", x)
    if seed is None:
        raise TypeError("argument seed: required for inputs that are not PyTorch tensors")
    out = None if type(x).__module__ == "numpy" else empty_like(x)  # brrr._C allocates NumPy outputs
    return _C.dropout_fwd(x, bias, residual, out, p=p, seed=int(seed), offset=int(offset))[0]


# ---- PyTorch: the custom ops brrr::bias_dropout_add and brrr::bias_dropout_add_backward. Nothing
# is saved for the backward but p, seed and offset: the backward op draws the mask again and
# returns [grad_x] (+ [grad_bias]); grad_residual is the incoming gradient itself.

@torch_integration
def torch_layer():
    from types import SimpleNamespace
    from typing import Optional

    import torch
    import torch.nn.functional as F

    from . import _op
    from ._op import TorchOp, out_like, stream
    from ._registry import registry, same_kind, tensor_ok

    Tensor = torch.Tensor

    def forward(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float, seed: int, offset: int) -> Tensor:
        return _C.dropout_fwd(x, bias, residual, out_like(x), p=p, seed=seed, offset=offset, stream=stream(x))[0]

    def fake(x, bias, residual, p, seed, offset):
        return torch.empty_like(x)

    def backward_forward(grad: Tensor, p: float, seed: int, offset: int, bias_grad: bool) -> list[Tensor]:
        """[grad_x] or [grad_x, grad_bias]: the mask of (p, seed, offset) applied to grad."""
        grad_bias = partials = None
        if bias_grad and _op.EXCHANGE_API:  # brrr._C allocates grad_bias (True) and the CUDA partials
            grad_bias = True
        elif bias_grad:
            grad_bias = grad.new_empty(grad.shape[-1:])
            if grad.is_cuda:
                cols = grad.shape[-1]
                rows = grad.numel() // cols if cols else 0
                partials = grad.new_empty(_C.chain_partial_rows(rows) * cols,
                                          dtype=torch.float64 if grad.dtype == torch.float64 else torch.float32)
        grad_x, grad_bias = _C.dropout_bwd(grad, out_like(grad), grad_bias, partials, p=p, seed=seed, offset=offset,
                                           stream=stream(grad))
        return [grad_x] if grad_bias is None else [grad_x, grad_bias]

    def backward_fake(grad, p, seed, offset, bias_grad):
        return [torch.empty_like(grad)] + ([grad.new_empty(grad.shape[-1:])] if bias_grad else [])

    backward_op = TorchOp("bias_dropout_add_backward", backward_forward, backward_fake)

    def save(ctx, args, results):
        ctx.p, ctx.seed, ctx.offset = args[3:]

    def formula(ctx, grads, run):
        """The gradients of (x, bias, residual); None where none is asked for."""
        (grad,), (need_x, need_bias, need_residual) = grads, ctx.needs_input_grad[:3]
        grad_x = grad_bias = None
        if grad is not None and (need_x or need_bias):
            got = run(backward_op)(grad, ctx.p, ctx.seed, ctx.offset, need_bias)
            grad_x, grad_bias = got[0] if need_x else None, got[1] if need_bias else None
        return grad_x, grad_bias, grad if need_residual else None, None, None, None

    op = TorchOp("bias_dropout_add", forward, fake, save=save, backward=formula, grad_args=(0, 1, 2))

    def bias_dropout_add_(x, bias, residual, p, seed, offset):
        """brrr.bias_dropout_add on torch tensors (arguments checked), seed None drawn here."""
        check_torch((bias, residual), ("bias", "residual"))
        if seed is None and (not 0.0 < p < 1.0 or x.numel() == 0):
            seed = 0  # no mask to draw (p is 0 when not training): torch's dropout draws nothing either
        if seed is None:
            if x.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("argument seed: None while a CUDA graph is being captured: the seed drawn now "
                                   "would be part of the graph, and every replay would drop the same elements. In a "
                                   "captured step use torch.nn.functional.dropout (PyTorch's generator is "
                                   "graph-safe), or pass seed= knowing that every replay reuses it")
            # torch's default CPU generator, so that torch.manual_seed makes runs reproducible.
            seed = int(torch.randint(2**63 - 1, (1,)).item())
        return op(x, bias, residual, p, seed, offset)

    def supports(x, bias, residual, *args, **kwargs):
        return (tensor_ok(x) and same_kind(x, bias, residual) and isinstance(residual, torch.Tensor) and
                residual.shape == x.shape and (bias is None or (x.dim() >= 1 and bias.shape == x.shape[-1:])))

    def reference(x, bias, residual, p, training=True, seed=None, offset=0):
        """PyTorch's own dropout, which draws from torch's generator: seed and offset are ignored."""
        return residual + F.dropout(x if bias is None else x + bias, p, training)

    # Under torch.compile brrr's kernel: the reference draws its mask from torch's generator, not
    # from the seed.
    registry.register("bias_dropout_add", reference, bias_dropout_add, supports, compiled="kernel", cpu="pytorch")
    return SimpleNamespace(bias_dropout_add=bias_dropout_add_, backward=backward_op, modules=[], functional={})
