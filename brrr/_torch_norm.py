"""PyTorch integration of the norm family: torch.library operators with fake kernels and
registered autograd (brrr._ops; torch.compile traces them without graph breaks), and the eager
fast path that calls brrr._C directly when autograd records nothing.

The forward ops return, besides their results, what the backward needs per row (mean relative to
the row's first element, and rstd; float32, float64 for float64 x) as non-differentiable
outputs. brrr::norm_backward takes the saved normalised input (x, or the new residual h of the
fused forms) and returns [grad_x, grad_weight (if asked), grad_bias (if asked)]; the fused forms'
backward adds the gradient of h and hands the sum to both x and residual.
"""

import math
from typing import Optional

import torch

from . import _C
from ._ops import define
from ._args import as_float
from ._torch import _EXCHANGE_API, _eager_out, _needs_autograd, _stream, check_torch, lean_apply, lean_once_differentiable
from .norm import normalized_ndim, rms_eps

Tensor = torch.Tensor


def _stats(x, k):
    """A per-row statistic: float32, float64 for float64 x."""
    lead, dtype = x.shape[:x.dim() - k], torch.float64 if x.dtype == torch.float64 else torch.float32
    # as ints: torch.empty parses a torch.Size argument a microsecond slower (CPU, torch 2.13)
    return torch.empty(*lead, dtype=dtype, device=x.device) if lead else torch.empty((), dtype=dtype, device=x.device)


def _shape_list(normalized_shape):
    return [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)


# ---- forward ops --------------------------------------------------------------------------------

def _stat_args(x, k, n):
    """The statistics arguments of a forward: True (brrr._C allocates and returns them: each
    torch.empty is a few microseconds of Python), or new tensors where it cannot (no exchange
    table: torch before 2.10)."""
    return (True,) * n if _EXCHANGE_API else tuple(_stats(x, k) for _ in range(n))


def _with_stats(result, stats):
    """A forward's result with its statistics after it: (out, [h,] *stats)."""
    if _EXCHANGE_API:
        return result
    return (*result, *stats) if isinstance(result, tuple) else (result, *stats)


def _layer_norm_fwd(x, k, weight, bias, eps, residual):
    """(out, [h,] mean, rstd): LayerNorm of x (of h = x + residual) over its last k dims."""
    stats = _stat_args(x, k, 2)
    h = None if residual is None else _eager_out(x)
    return _with_stats(_C.layer_norm_fwd(x, k, weight, bias, eps, _eager_out(x), *stats, residual, h,
                                         _stream(x, None)), stats)


def _rms_norm_fwd(x, k, weight, eps, llama, residual):
    """(out, [h,] rstd): RMSNorm of x (of h = x + residual) over its last k dims."""
    stats = _stat_args(x, k, 1)
    h = None if residual is None else _eager_out(x)
    return _with_stats(_C.rms_norm_fwd(x, k, weight, eps, llama, _eager_out(x), *stats, residual, h,
                                       _stream(x, None)), stats)


def _layer_norm_impl(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], bias: Optional[Tensor],
                  eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _layer_norm_fwd(x, normalized_ndim(x.shape, normalized_shape), weight, bias, eps, None)


def _layer_norm_fake(x, normalized_shape, weight, bias, eps):
    k = len(normalized_shape)
    return torch.empty_like(x), _stats(x, k), _stats(x, k)


def _add_layer_norm_impl(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                      bias: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _layer_norm_fwd(x, normalized_ndim(x.shape, normalized_shape), weight, bias, eps, residual)


def _add_layer_norm_fake(x, residual, normalized_shape, weight, bias, eps):
    k = len(normalized_shape)
    return torch.empty_like(x), torch.empty_like(x), _stats(x, k), _stats(x, k)


def _rms_norm_impl(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], eps: float,
                llama: bool) -> tuple[Tensor, Tensor]:
    return _rms_norm_fwd(x, normalized_ndim(x.shape, normalized_shape), weight, eps, llama, None)


def _rms_norm_fake(x, normalized_shape, weight, eps, llama):
    return torch.empty_like(x), _stats(x, len(normalized_shape))


def _add_rms_norm_impl(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor], eps: float,
                    llama: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _rms_norm_fwd(x, normalized_ndim(x.shape, normalized_shape), weight, eps, llama, residual)


def _add_rms_norm_fake(x, residual, normalized_shape, weight, eps, llama):
    return torch.empty_like(x), torch.empty_like(x), _stats(x, len(normalized_shape))


# ---- backward -----------------------------------------------------------------------------------

def _partials(x, k, n_grads, dtype):
    """The CUDA backward's scratch for n_grads weight/bias gradients, where brrr._C cannot allocate
    it (no exchange table: torch before 2.10); None elsewhere."""
    if _EXCHANGE_API or not n_grads or not x.is_cuda:
        return None
    cols = math.prod(x.shape[x.dim() - k:])
    rows = x.numel() // cols if cols else 0
    return torch.empty(n_grads * _C.norm_partial_rows(rows, cols) * cols, dtype=dtype, device=x.device)


def _norm_grads(x, k, grad_out, grad_residual, weight, bias, mean, rstd, llama, need_weight, need_bias):
    """(grad of the normalised input, grad_weight or None, grad_bias or None) in one backward
    launch; mean None: RMSNorm. x: the normalised input the forward saved (h for the fused forms)."""
    # True: brrr._C allocates it (like weight, so a bias gradient only where there is a weight).
    grad_weight = (True if _EXCHANGE_API else torch.empty_like(weight)) if need_weight else None
    grad_bias = (True if _EXCHANGE_API and weight is not None else torch.empty_like(bias)) if need_bias else None
    partials = _partials(x, k, need_weight + need_bias, rstd.dtype)
    stream = _stream(x, None)
    if mean is None:
        result = _C.rms_norm_bwd(x, k, grad_out, grad_residual, weight, rstd, llama, _eager_out(x), grad_weight,
                                 partials, stream)
    else:
        result = _C.layer_norm_bwd(x, k, grad_out, grad_residual, weight, mean, rstd, _eager_out(x), grad_weight,
                                   grad_bias, partials, stream)
    if grad_weight is not True and grad_bias is not True:
        return result, grad_weight, grad_bias
    allocated = iter(result[1:])
    grad_weight = next(allocated) if grad_weight is True else grad_weight
    grad_bias = next(allocated) if grad_bias is True else grad_bias
    return result[0], grad_weight, grad_bias


def _norm_backward_impl(x: Tensor, grad_out: Tensor, grad_residual: Optional[Tensor], weight: Optional[Tensor],
                     bias: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor, norm_ndim: int, llama: bool,
                     weight_grad: bool, bias_grad: bool) -> list[Tensor]:
    grads = _norm_grads(x, norm_ndim, grad_out, grad_residual, weight, bias, mean, rstd, llama, weight_grad, bias_grad)
    return [g for g in grads if g is not None]


def _norm_backward_fake(x, grad_out, grad_residual, weight, bias, mean, rstd, norm_ndim, llama, weight_grad,
                        bias_grad):
    return [torch.empty_like(x)] + [torch.empty_like(t) for t, need in ((weight, weight_grad), (bias, bias_grad))
                                    if need]


norm_backward_op = define("norm_backward", _norm_backward_impl, _norm_backward_fake)


def _grads(ctx, x, grad_out, grad_residual, weight, bias, mean, rstd, need_weight, need_bias):
    """(gradient of the normalised input, grad_weight, grad_bias); Nones where nothing flows."""
    if grad_out is None:
        return grad_residual, None, None
    grads = norm_backward_op(x, grad_out, grad_residual, weight, bias, mean, rstd, ctx.norm_ndim, ctx.llama,
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


_layer_norm = define("layer_norm", _layer_norm_impl, _layer_norm_fake, _layer_norm_backward, _layer_norm_setup)
_add_layer_norm = define("add_layer_norm", _add_layer_norm_impl, _add_layer_norm_fake, _add_layer_norm_backward,
                         _add_layer_norm_setup)
_rms_norm = define("rms_norm", _rms_norm_impl, _rms_norm_fake, _rms_norm_backward, _rms_norm_setup)
_add_rms_norm = define("add_rms_norm", _add_rms_norm_impl, _add_rms_norm_fake, _add_rms_norm_backward,
                       _add_rms_norm_setup)


# ---- eager autograd -------------------------------------------------------------------------------
# Plain autograd.Functions for eager training: the custom op's dispatcher and Python layers cost
# about 200 µs of host time per forward+backward (measured on this project's CPU machine), more
# than a 16384 x 4096 norm's kernels take on the H200. They are kept lean, as the chain's are:
# one differentiable output per result (the statistics are saved, not returned, so autograd
# tracks and materialises no gradient for them), the normalised dims as a count, brrr._C
# allocating what it can (outputs like a contiguous x, the statistics, the parameter gradients,
# the CUDA backward's partials), applied through lean_apply.

class _EagerLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, k, eps):
        out, mean, rstd = _layer_norm_fwd(x, k, weight, bias, eps, None)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.k = k
        return out

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad_out):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        _, need_weight, need_bias, _, _ = ctx.needs_input_grad
        gx, gw, gb = _norm_grads(x, ctx.k, grad_out, None, weight, bias, mean, rstd, False, need_weight, need_bias)
        return gx, gw, gb, None, None


class _EagerAddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, k, eps):
        out, h, mean, rstd = _layer_norm_fwd(x, k, weight, bias, eps, residual)
        ctx.save_for_backward(h, weight, bias, mean, rstd)
        ctx.k = k
        ctx.set_materialize_grads(False)
        return out, h

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad_out, grad_h):
        if grad_out is None:
            return grad_h, grad_h, None, None, None, None
        h, weight, bias, mean, rstd = ctx.saved_tensors
        _, _, need_weight, need_bias, _, _ = ctx.needs_input_grad
        dh, gw, gb = _norm_grads(h, ctx.k, grad_out, grad_h, weight, bias, mean, rstd, False, need_weight, need_bias)
        return dh, dh, gw, gb, None, None


class _EagerRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, k, eps, llama):
        out, rstd = _rms_norm_fwd(x, k, weight, eps, llama, None)
        ctx.save_for_backward(x, weight, rstd)
        ctx.k, ctx.llama = k, llama
        return out

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        need_weight = ctx.needs_input_grad[1]
        gx, gw, _ = _norm_grads(x, ctx.k, grad_out, None, weight, None, None, rstd, ctx.llama, need_weight, False)
        return gx, gw, None, None, None


class _EagerAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, k, eps, llama):
        out, h, rstd = _rms_norm_fwd(x, k, weight, eps, llama, residual)
        ctx.save_for_backward(h, weight, rstd)
        ctx.k, ctx.llama = k, llama
        ctx.set_materialize_grads(False)
        return out, h

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad_out, grad_h):
        if grad_out is None:
            return grad_h, grad_h, None, None, None, None
        h, weight, rstd = ctx.saved_tensors
        need_weight = ctx.needs_input_grad[2]
        dh, gw, _ = _norm_grads(h, ctx.k, grad_out, grad_h, weight, None, None, rstd, ctx.llama, need_weight, False)
        return dh, dh, gw, None, None, None


_apply_layer_norm, _apply_add_layer_norm = lean_apply(_EagerLayerNorm), lean_apply(_EagerAddLayerNorm)
_apply_rms_norm, _apply_add_rms_norm = lean_apply(_EagerRMSNorm), lean_apply(_EagerAddRMSNorm)


# ---- entry points (brrr.norm and the registry dispatch torch tensors here) ------------------------
# torch.compile takes the custom ops, eager autograd the Functions, and everything else goes
# straight to brrr._C.

_PARAM_NAMES = ("weight", "bias")
_ADD_NAMES = ("residual", "weight", "bias")


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    eps = as_float("eps", eps)
    if torch.compiler.is_compiling():
        return _layer_norm(x, _shape_list(normalized_shape), weight, bias, eps)[0]
    k = normalized_ndim(x.shape, normalized_shape)
    check_torch((weight, bias), _PARAM_NAMES)
    if _needs_autograd(x, (weight, bias)):
        return _apply_layer_norm(x, weight, bias, k, eps)
    return _C.layer_norm_fwd(x, k, weight, bias, eps, _eager_out(x), None, None, None, None, _stream(x, None))


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    eps = as_float("eps", eps)
    if torch.compiler.is_compiling():
        return tuple(_add_layer_norm(x, residual, _shape_list(normalized_shape), weight, bias, eps)[:2])
    k = normalized_ndim(x.shape, normalized_shape)
    check_torch((residual, weight, bias), _ADD_NAMES)
    if _needs_autograd(x, (residual, weight, bias)):
        return _apply_add_layer_norm(x, residual, weight, bias, k, eps)
    return _C.layer_norm_fwd(x, k, weight, bias, eps, _eager_out(x), None, None, residual, _eager_out(x),
                             _stream(x, None))


def rms_norm(x, normalized_shape, weight=None, eps=None, llama=False):
    eps = rms_eps(x, eps)
    if torch.compiler.is_compiling():
        return _rms_norm(x, _shape_list(normalized_shape), weight, eps, llama)[0]
    k = normalized_ndim(x.shape, normalized_shape)
    check_torch((weight,), _PARAM_NAMES)
    if _needs_autograd(x, (weight,)):
        return _apply_rms_norm(x, weight, k, eps, llama)
    return _C.rms_norm_fwd(x, k, weight, eps, llama, _eager_out(x), None, None, None, _stream(x, None))


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, llama=False):
    eps = rms_eps(x, eps)
    if torch.compiler.is_compiling():
        return tuple(_add_rms_norm(x, residual, _shape_list(normalized_shape), weight, eps, llama)[:2])
    k = normalized_ndim(x.shape, normalized_shape)
    check_torch((residual, weight), _ADD_NAMES)
    if _needs_autograd(x, (residual, weight)):
        return _apply_add_rms_norm(x, residual, weight, k, eps, llama)
    return _C.rms_norm_fwd(x, k, weight, eps, llama, _eager_out(x), None, residual, _eager_out(x), _stream(x, None))
