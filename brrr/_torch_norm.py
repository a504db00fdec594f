"""PyTorch integration of the norm family: torch.library custom operators with fake kernels and
registered autograd (torch.compile traces them without graph breaks), and the eager fast path
that calls brrr._C directly when autograd records nothing.

The forward ops return, besides their results, what the backward needs per row (mean relative to
the row's first element, and rstd; float32, float64 for float64 x) as non-differentiable
outputs. brrr::norm_backward takes the saved normalised input (x, or the new residual h of the
fused forms) and returns [grad_x, grad_weight (if asked), grad_bias (if asked)]; the fused forms'
backward adds the gradient of h and hands the sum to both x and residual.
"""

import math
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import _C
from ._torch import _EXCHANGE_API, _needs_autograd, _stream
from .norm import default_rms_eps, normalized_ndim

Tensor = torch.Tensor


def _stats(x, k):
    return x.new_empty(x.shape[:x.dim() - k], dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)


def _shape_list(normalized_shape):
    return [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)


def _eager_out(x):
    """An output for the eager path: None lets brrr._C allocate it through torch's C exchange table."""
    return None if _EXCHANGE_API else torch.empty_like(x)


# ---- forward ops --------------------------------------------------------------------------------

def _layer_norm_impl(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], bias: Optional[Tensor],
                  eps: float) -> tuple[Tensor, Tensor, Tensor]:
    k = normalized_ndim(x.shape, normalized_shape)
    out, mean, rstd = torch.empty_like(x), _stats(x, k), _stats(x, k)
    _C.layer_norm_fwd(x, k, weight, bias, eps, out, mean, rstd, None, None, _stream(x, None))
    return out, mean, rstd


layer_norm_op = torch.library.custom_op("brrr::layer_norm", mutates_args=())(_layer_norm_impl)


@layer_norm_op.register_fake
def _layer_norm_fake(x, normalized_shape, weight, bias, eps):
    k = len(normalized_shape)
    return torch.empty_like(x), _stats(x, k), _stats(x, k)


def _add_layer_norm_impl(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                      bias: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    k = normalized_ndim(x.shape, normalized_shape)
    out, h, mean, rstd = torch.empty_like(x), torch.empty_like(x), _stats(x, k), _stats(x, k)
    _C.layer_norm_fwd(x, k, weight, bias, eps, out, mean, rstd, residual, h, _stream(x, None))
    return out, h, mean, rstd


add_layer_norm_op = torch.library.custom_op("brrr::add_layer_norm", mutates_args=())(_add_layer_norm_impl)


@add_layer_norm_op.register_fake
def _add_layer_norm_fake(x, residual, normalized_shape, weight, bias, eps):
    k = len(normalized_shape)
    return torch.empty_like(x), torch.empty_like(x), _stats(x, k), _stats(x, k)


def _rms_norm_impl(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], eps: float,
                llama: bool) -> tuple[Tensor, Tensor]:
    k = normalized_ndim(x.shape, normalized_shape)
    out, rstd = torch.empty_like(x), _stats(x, k)
    _C.rms_norm_fwd(x, k, weight, eps, llama, out, rstd, None, None, _stream(x, None))
    return out, rstd


rms_norm_op = torch.library.custom_op("brrr::rms_norm", mutates_args=())(_rms_norm_impl)


@rms_norm_op.register_fake
def _rms_norm_fake(x, normalized_shape, weight, eps, llama):
    return torch.empty_like(x), _stats(x, len(normalized_shape))


def _add_rms_norm_impl(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor], eps: float,
                    llama: bool) -> tuple[Tensor, Tensor, Tensor]:
    k = normalized_ndim(x.shape, normalized_shape)
    out, h, rstd = torch.empty_like(x), torch.empty_like(x), _stats(x, k)
    _C.rms_norm_fwd(x, k, weight, eps, llama, out, rstd, residual, h, _stream(x, None))
    return out, h, rstd


add_rms_norm_op = torch.library.custom_op("brrr::add_rms_norm", mutates_args=())(_add_rms_norm_impl)


@add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, residual, normalized_shape, weight, eps, llama):
    return torch.empty_like(x), torch.empty_like(x), _stats(x, len(normalized_shape))


# ---- backward -----------------------------------------------------------------------------------

def _norm_backward_impl(x: Tensor, grad_out: Tensor, grad_residual: Optional[Tensor], weight: Optional[Tensor],
                     bias: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor, norm_ndim: int, llama: bool,
                     weight_grad: bool, bias_grad: bool) -> list[Tensor]:
    """mean None: RMSNorm. x: the normalised input the forward saved."""
    grad_x = torch.empty_like(x)
    grad_weight = torch.empty_like(weight) if weight_grad else None
    grad_bias = torch.empty_like(bias) if bias_grad else None
    partials = None
    n_grads = int(weight_grad) + int(bias_grad)
    if n_grads and x.is_cuda:
        lead = x.dim() - norm_ndim
        rows, cols = math.prod(x.shape[:lead]), math.prod(x.shape[lead:])
        partials = torch.empty(n_grads * _C.norm_partial_rows(rows, cols) * cols, dtype=rstd.dtype, device=x.device)
    stream = _stream(x, None)
    if mean is None:
        _C.rms_norm_bwd(x, norm_ndim, grad_out, grad_residual, weight, rstd, llama, grad_x, grad_weight, partials, stream)
    else:
        _C.layer_norm_bwd(x, norm_ndim, grad_out, grad_residual, weight, mean, rstd, grad_x, grad_weight, grad_bias,
                          partials, stream)
    return [grad_x] + [g for g in (grad_weight, grad_bias) if g is not None]


norm_backward_op = torch.library.custom_op("brrr::norm_backward", mutates_args=())(_norm_backward_impl)


@norm_backward_op.register_fake
def _norm_backward_fake(x, grad_out, grad_residual, weight, bias, mean, rstd, norm_ndim, llama, weight_grad,
                        bias_grad):
    return [torch.empty_like(x)] + [torch.empty_like(t) for t, need in ((weight, weight_grad), (bias, bias_grad))
                                    if need]


def _grads(ctx, x, grad_out, grad_residual, weight, bias, mean, rstd, need_weight, need_bias):
    """(gradient of the normalised input, grad_weight, grad_bias); Nones where nothing flows. The
    eager autograd.Functions call the backward's implementation, the custom ops the custom op."""
    if grad_out is None:
        return grad_residual, None, None
    backward = _norm_backward_impl if getattr(ctx, "eager", False) else norm_backward_op
    grads = backward(x, grad_out, grad_residual, weight, bias, mean, rstd, ctx.norm_ndim, ctx.llama,
                             need_weight, need_bias)
    rest = iter(grads[1:])
    return grads[0], next(rest) if need_weight else None, next(rest) if need_bias else None


def _setup(ctx, saved, stats, norm_ndim, llama=False):
    ctx.save_for_backward(*saved, *stats)
    ctx.norm_ndim, ctx.llama = norm_ndim, llama
    ctx.mark_non_differentiable(*stats)
    ctx.set_materialize_grads(False)


def _layer_norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, bias, _ = inputs
    _setup(ctx, (x, weight, bias), output[1:], len(normalized_shape))


def _layer_norm_backward(ctx, grad_out, _grad_mean, _grad_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    _, _, need_weight, need_bias, _ = ctx.needs_input_grad
    dx, dw, db = _grads(ctx, x, grad_out, None, weight, bias, mean, rstd, need_weight, need_bias)
    return dx, None, dw, db, None


def _add_layer_norm_setup(ctx, inputs, output):
    _, _, normalized_shape, weight, bias, _ = inputs
    _setup(ctx, (output[1], weight, bias), output[2:], len(normalized_shape))


def _add_layer_norm_backward(ctx, grad_out, grad_h, _grad_mean, _grad_rstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    _, _, _, need_weight, need_bias, _ = ctx.needs_input_grad
    dh, dw, db = _grads(ctx, h, grad_out, grad_h, weight, bias, mean, rstd, need_weight, need_bias)
    return dh, dh, None, dw, db, None


def _rms_norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, _, llama = inputs
    _setup(ctx, (x, weight), output[1:], len(normalized_shape), llama)


def _rms_norm_backward(ctx, grad_out, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw, _ = _grads(ctx, x, grad_out, None, weight, None, None, rstd, ctx.needs_input_grad[2], False)
    return dx, None, dw, None, None


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, normalized_shape, weight, _, llama = inputs
    _setup(ctx, (output[1], weight), output[2:], len(normalized_shape), llama)


def _add_rms_norm_backward(ctx, grad_out, grad_h, _grad_rstd):
    h, weight, rstd = ctx.saved_tensors
    dh, dw, _ = _grads(ctx, h, grad_out, grad_h, weight, None, None, rstd, ctx.needs_input_grad[3], False)
    return dh, dh, None, dw, None, None


torch.library.register_autograd("brrr::layer_norm", _layer_norm_backward, setup_context=_layer_norm_setup)
torch.library.register_autograd("brrr::add_layer_norm", _add_layer_norm_backward, setup_context=_add_layer_norm_setup)
torch.library.register_autograd("brrr::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
torch.library.register_autograd("brrr::add_rms_norm", _add_rms_norm_backward, setup_context=_add_rms_norm_setup)

_layer_norm = torch.ops.brrr.layer_norm.default
_add_layer_norm = torch.ops.brrr.add_layer_norm.default
_rms_norm = torch.ops.brrr.rms_norm.default
_add_rms_norm = torch.ops.brrr.add_rms_norm.default


def _eager_function(name, impl, setup, backward):
    """The op's implementation, setup and backward as a plain autograd.Function for eager
    training: the custom op's dispatcher and Python layers cost about 200 µs of host time per
    forward+backward (measured on this project's CPU machine), more than a 16384 x 4096 norm's
    kernels take on the H200. Its inputs are the custom op's, so needs_input_grad lines up."""

    def forward(ctx, *inputs):
        outputs = impl(*inputs)
        setup(ctx, inputs, outputs)
        ctx.eager = True
        return outputs

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(once_differentiable(backward))})


_EagerLayerNorm = _eager_function("_EagerLayerNorm", _layer_norm_impl, _layer_norm_setup, _layer_norm_backward)
_EagerAddLayerNorm = _eager_function("_EagerAddLayerNorm", _add_layer_norm_impl, _add_layer_norm_setup,
                                     _add_layer_norm_backward)
_EagerRMSNorm = _eager_function("_EagerRMSNorm", _rms_norm_impl, _rms_norm_setup, _rms_norm_backward)
_EagerAddRMSNorm = _eager_function("_EagerAddRMSNorm", _add_rms_norm_impl, _add_rms_norm_setup, _add_rms_norm_backward)


# ---- entry points (brrr.norm dispatches torch tensors here) ---------------------------------------
# torch.compile takes the custom ops, eager autograd the Functions, and everything else goes
# straight to brrr._C.

def layer_norm(x, normalized_shape, weight, bias, eps):
    if torch.compiler.is_compiling():
        return _layer_norm(x, _shape_list(normalized_shape), weight, bias, float(eps))[0]
    if _needs_autograd(x, (weight, bias)):
        return _EagerLayerNorm.apply(x, _shape_list(normalized_shape), weight, bias, float(eps))[0]
    k = normalized_ndim(x.shape, normalized_shape)
    return _C.layer_norm_fwd(x, k, weight, bias, float(eps), _eager_out(x), None, None, None, None, _stream(x, None))


def add_layer_norm(x, residual, normalized_shape, weight, bias, eps):
    if torch.compiler.is_compiling():
        return tuple(_add_layer_norm(x, residual, _shape_list(normalized_shape), weight, bias, float(eps))[:2])
    if _needs_autograd(x, (residual, weight, bias)):
        return tuple(_EagerAddLayerNorm.apply(x, residual, _shape_list(normalized_shape), weight, bias, float(eps))[:2])
    k = normalized_ndim(x.shape, normalized_shape)
    return _C.layer_norm_fwd(x, k, weight, bias, float(eps), _eager_out(x), None, None, residual, _eager_out(x),
                             _stream(x, None))


def rms_norm(x, normalized_shape, weight, eps, llama):
    eps = default_rms_eps(x.dtype) if eps is None else float(eps)
    if torch.compiler.is_compiling():
        return _rms_norm(x, _shape_list(normalized_shape), weight, eps, llama)[0]
    if _needs_autograd(x, (weight,)):
        return _EagerRMSNorm.apply(x, _shape_list(normalized_shape), weight, eps, llama)[0]
    k = normalized_ndim(x.shape, normalized_shape)
    return _C.rms_norm_fwd(x, k, weight, eps, llama, _eager_out(x), None, None, None, _stream(x, None))


def add_rms_norm(x, residual, normalized_shape, weight, eps, llama):
    eps = default_rms_eps(x.dtype) if eps is None else float(eps)
    if torch.compiler.is_compiling():
        return tuple(_add_rms_norm(x, residual, _shape_list(normalized_shape), weight, eps, llama)[:2])
    if _needs_autograd(x, (residual, weight)):
        return tuple(_EagerAddRMSNorm.apply(x, residual, _shape_list(normalized_shape), weight, eps, llama)[:2])
    k = normalized_ndim(x.shape, normalized_shape)
    return _C.rms_norm_fwd(x, k, weight, eps, llama, _eager_out(x), None, residual, _eager_out(x), _stream(x, None))
