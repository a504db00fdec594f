"""Softmax and log-softmax, as torch.nn.functional has them, forward and backward in one pass each:

    y = brrr.softmax(x, dim=-1)                          # exp(x - max) / sum(exp(x - max))
    y = brrr.log_softmax(x, dim=-1)                      # x - max - log(sum(exp(x - max)))
    y = brrr.softmax(x, dim=-1, dtype=torch.float32)     # of a bfloat16 x: y in float32, one pass

Math in float32 (float64 for float64), rounded once. dtype: as torch's, x is taken as that dtype
first; a float32 result of a float16/bfloat16 torch tensor is written straight from x (the arrays of
other frameworks are converted first). The backward saves
only y and rematerialises nothing else: grad_x = y * (grad_y - sum(grad_y * y)), or for
log_softmax grad_x = grad_y - exp(y) * sum(grad_y), one read of y and grad_y and one write.
Any dim (the kernels see it as the last dim of a view), any strides, rows of any length.
"""

from . import _C
from ._args import dim_in_range, refuse_kinds
from ._frameworks import as_float_dtype, empty_like, torch_if_tensor
from ._integration import torch_integration


def _public(log):
    """softmax or log_softmax (log), one form for both. A torch tensor goes to the op from the
    public function itself, and the usual dim (-1 of a tensor of 1 dim or more) is taken without
    dim_in_range's frame: each frame less is about 0.05 to 0.1 us of a tiny softmax's 2 on this project's
    CPU machine (a shared function below both cost about 900 instructions a call)."""

    def function(x, dim=-1, dtype=None):
        if torch_if_tensor(x) is not None:
            ndim = x.ndim
            try:
                return torch_layer().softmax(x, ndim - 1 if dim.__class__ is int and dim == -1 and ndim else
                                             dim_in_range("dim", ndim, dim), dtype, log)
            except RuntimeError:
                refuse_kinds(("x", x))
                raise
        return _softmax(x, dim, dtype, log)

    function.__name__ = function.__qualname__ = "log_softmax" if log else "softmax"
    function.__doc__ = (f"torch.nn.functional.{function.__name__}(x, dim, dtype=dtype) in one pass (see the "
                        "module).")
    return function


softmax, log_softmax = _public(False), _public(True)


def reference(x, dim=-1, dtype=None, log=False):
    """The function, in PyTorch's own ops (the tests' float64 reference, the registry's fallback)."""
    import torch

    return (torch.log_softmax if log else torch.softmax)(x, dim, dtype=dtype)


def _softmax(x, dim, dtype, log):
    """softmax of an array of a framework other than PyTorch."""
    ndim = getattr(x, "ndim", None)
    if ndim is None:
        if hasattr(x, "__dlpack__"):  # a bare DLPack producer: its own errors first (a broken capsule: BufferError)
            _C.check_tensor(x, "x")
        raise TypeError(f"argument x: expected a tensor or array with ndim (the dims to move), got {type(x).__name__}")
    dim = dim_in_range("dim", ndim, dim)
    if dtype is not None:
        x = as_float_dtype(None, x, dtype)
    xp = x.__array_namespace__() if hasattr(x, "__array_namespace__") else None
    moved = ndim > 1 and dim != ndim - 1
    if moved:
        if xp is None:
            raise TypeError(f"argument x: {type(x).__name__} has no __array_namespace__ to move dim {dim} last with "
                            "(softmax of such an array takes its last dim)")
        x = xp.moveaxis(x, dim, -1)
    out = None  # brrr._C allocates NumPy outputs
    if type(x).__module__ != "numpy":
        out = empty_like(x)
        if out is None:
            _C.check_tensor(x, "x")  # a broken producer: its own error first
            raise TypeError(f"argument x: brrr allocates softmax's output only for PyTorch tensors, NumPy arrays and "
                            f"arrays with __array_namespace__, got {type(x).__name__}")
    y = _C.softmax_fwd(x, out, log=log)[0]
    return xp.moveaxis(y, -1, dim) if moved else y


# ---- PyTorch ---------------------------------------------------------------------------------------

@torch_integration
def torch_layer():
    from types import SimpleNamespace
    from typing import Optional

    import torch
    import torch.nn.functional as F

    from . import _op
    from ._op import TorchOp, stream
    from ._registry import FLOATS, cuda_autocast_upcasts, dispatch, float_dtype, registry, tensor_ok

    Tensor = torch.Tensor
    halves = (torch.float16, torch.bfloat16)

    def last(t, dim):
        return t if dim == t.dim() - 1 or t.dim() == 0 else t.movedim(dim, -1)

    def new(like, dtype):
        """An output of like's shape, contiguous whatever like's layout and dim, as torch.softmax
        returns it; the kernels write it through the view with dim last."""
        return torch.empty(like.shape, dtype=dtype, device=like.device)

    # The usual call (the last dim, no dtype, the exchange table: brrr._C allocates and finds the
    # stream) goes straight to brrr._C: moving no dims and asking nothing was a third of a tiny
    # softmax's host time on this project's CPU machine.
    def forward(x: Tensor, dim: int, dtype: Optional[torch.dtype], log: bool) -> Tensor:
        if dtype is None and dim == x.ndim - 1 and _op.EXCHANGE_API:
            return _C.softmax_fwd(x, None, log=log)[0]
        xt, y = last(x, dim), new(x, float_dtype("dtype", dtype, x.dtype))
        if y.dtype != x.dtype and not (x.dtype in halves and y.dtype == torch.float32):
            xt = xt.to(y.dtype)  # taken as dtype first, as torch does; the kernels fuse only the widening
        _C.softmax_fwd(xt, last(y, dim), log=log, stream=stream(x))
        return y

    def fake(x, dim, dtype, log):
        return x.new_empty(x.shape, dtype=x.dtype if dtype is None else dtype)

    def backward_forward(y: Tensor, grad_y: Tensor, dim: int, x_dtype: torch.dtype, log: bool) -> Tensor:
        if x_dtype == y.dtype and dim == y.ndim - 1 and _op.EXCHANGE_API:
            return _C.softmax_bwd(y, grad_y, None, log=log)[0]
        direct = x_dtype == y.dtype or (x_dtype in halves and y.dtype == torch.float32)
        grad = new(y, x_dtype if direct else y.dtype)
        _C.softmax_bwd(last(y, dim), last(grad_y, dim), last(grad, dim), log=log, stream=stream(y))
        return grad if direct else grad.to(x_dtype)

    def backward_fake(y, grad_y, dim, x_dtype, log):
        return y.new_empty(y.shape, dtype=x_dtype)

    backward_op = TorchOp("softmax_backward", backward_forward, backward_fake)

    def save(ctx, args, results):
        x, dim, _, log = args
        ctx.softmax = (dim, x.dtype, log)  # the backward op's arguments after y and grad_y: one attribute, not three
        ctx.save_for_backward(results[0])

    def formula(ctx, grads, run):
        (y,), (grad_y,) = ctx.saved_tensors, grads
        if grad_y is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        return run(backward_op)(y, grad_y, *ctx.softmax), None, None, None

    softmax_op = TorchOp("softmax", forward, fake, save=save, backward=formula)

    # ---- the registry: torch.nn.functional's signature
    def supports(input, dim=None, _stacklevel=3, dtype=None):
        return tensor_ok(input) and type(dim) is int and -max(input.dim(), 1) <= dim < max(input.dim(), 1) and \
            dtype in (None,) + FLOATS

    def implementation(log):
        def softmax_(input, dim=None, _stacklevel=3, dtype=None):
            if dtype is None and cuda_autocast_upcasts(input):
                dtype = torch.float32  # as CUDA autocast runs torch's: a float32 result, written straight from x
            return softmax_op(input, dim % max(input.dim(), 1), dtype, log)
        return softmax_

    def route(name):
        return lambda input, dim=None, _stacklevel=3, dtype=None: dispatch(name, input, dim, _stacklevel, dtype)

    # torch's, bound before brrr.use_fused can route these names of F here. On CPU tensors brrr's softmax
    # measured faster than PyTorch's at every size measured (docs/cpu.md); log_softmax is not measured.
    registry.register("softmax", F.softmax, implementation(False), supports, compiled="inductor", cpu="kernel")
    registry.register("log_softmax", F.log_softmax, implementation(True), supports, compiled="inductor",
                      cpu="pytorch")

    class Softmax(torch.nn.Softmax):
        def forward(self, input):
            return dispatch("softmax", input, self.dim)

    class LogSoftmax(torch.nn.LogSoftmax):
        def forward(self, input):
            return dispatch("log_softmax", input, self.dim)

    return SimpleNamespace(softmax=softmax_op, backward=backward_op, modules=[Softmax, LogSoftmax],
                           functional={"softmax": route("softmax"), "log_softmax": route("log_softmax")})
