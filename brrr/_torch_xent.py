"""PyTorch integration of cross_entropy: a torch.library operator with a fake kernel and
registered autograd (brrr._op; torch.compile traces it without graph breaks), an eager
autograd.Function, and the direct call into brrr._C when autograd records nothing.

brrr::cross_entropy takes logits with the class dim last (and softcap, None for none, and z_loss:
brrr.xent) and returns [loss, lse, count]: the
loss (float32, float64 for float64 logits; 0-d for mean and sum, per row for none), and, as
non-differentiable outputs for the backward, each row's log-sum-exp (less the target's logit
where that is finite: brrr_cuda.h) and the number of rows counted.
brrr::cross_entropy_backward rematerialises the softmax from logits and lse. Under
torch.compile the forward is brrr's kernel (one read of the logits; inductor's reads them more
than once) and the backward the same formula in PyTorch ops, which inductor fuses.
"""

from typing import Optional

import torch

from . import _C, _op
from ._op import check_torch, define, lean_apply, lean_once_differentiable, needs_autograd, out_like, stream
from .xent import check_rank

Tensor = torch.Tensor


def _acc(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _forward_impl(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float,
                  softcap: Optional[float], z_loss: float, reduction: str) -> list[Tensor]:
    total = None if reduction == "none" else True
    if _op.EXCHANGE_API:  # brrr._C allocates the outputs (None, True): no torch.empty per output
        lse = rows = None
        count = True
    else:
        acc, shape, device = _acc(logits), target.shape, logits.device
        lse, rows = torch.empty(shape, dtype=acc, device=device), torch.empty(shape, dtype=acc, device=device)
        total = None if total is None else torch.empty((), dtype=acc, device=device)
        count = torch.empty((), dtype=acc, device=device)
    lse, rows, total, count = _C.cross_entropy_fwd(logits, target, lse, rows, total, count, ignore_index=ignore_index,
                                                   label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                                                   reduction=reduction, stream=stream(logits))
    return [rows if total is None else total, lse, count]


def _forward_fake(logits, target, ignore_index, label_smoothing, softcap, z_loss, reduction):
    acc = _acc(logits)
    loss = logits.new_empty(target.shape if reduction == "none" else (), dtype=acc)
    return [loss, logits.new_empty(target.shape, dtype=acc), logits.new_empty((), dtype=acc)]


def _backward_impl(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Optional[Tensor],
                   ignore_index: int, label_smoothing: float, softcap: Optional[float], z_loss: float) -> Tensor:
    grad_logits = None if _op.EXCHANGE_API and logits.is_contiguous() else torch.empty_like(logits)
    return _C.cross_entropy_bwd(logits, target, lse, grad, count, grad_logits, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                                stream=stream(logits))[0]


def _backward_fake(grad, logits, target, lse, count, ignore_index, label_smoothing, softcap, z_loss):
    return torch.empty_like(logits)


backward_op = define("cross_entropy_backward", _backward_impl, _backward_fake)


def _setup_context(ctx, inputs, output):
    logits, target, ctx.ignore_index, ctx.label_smoothing, ctx.softcap, ctx.z_loss, ctx.reduction = inputs
    _, lse, count = output
    ctx.save_for_backward(logits, target, lse, count)
    ctx.mark_non_differentiable(lse, count)
    ctx.set_materialize_grads(False)


def _backward_in_torch_ops(grad, logits, target, lse, count, ignore_index, label_smoothing, softcap, z_loss):
    """brrr::cross_entropy_backward's formula (brrr_cuda.h) in PyTorch ops, for compiled graphs:
    inductor fuses it with its neighbours (in a model, with the gradient that flows into the
    logits from elsewhere, at least a zero tangent: as an opaque op, that add took another pass
    over the logits)."""
    classes = logits.shape[-1]
    target = target.long()  # compared in int64, as the kernel does (a uint8 target would wrap -100)
    counted = target != ignore_index
    index = torch.where(counted & (target >= 0) & (target < classes), target, 0)  # lse is NaN where invalid
    z = logits.to(lse.dtype)
    if softcap is not None:
        th = torch.tanh(z / softcap)
        z = softcap * th
    z_t = z.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    shift = torch.where(torch.isfinite(z_t), z_t, 0.0)
    p = torch.exp((z - shift.unsqueeze(-1)) - lse.unsqueeze(-1))
    if z_loss != 0.0:
        p = p * (1.0 + 2.0 * z_loss * (lse + shift)).unsqueeze(-1)
    scale = torch.where(counted, grad if count is None else grad / count, 0.0).unsqueeze(-1)
    hot = torch.arange(classes, device=logits.device) == index.unsqueeze(-1)
    grad = scale * (p - label_smoothing / classes - (1.0 - label_smoothing) * hot)
    if softcap is not None:
        grad = grad * (1.0 - th * th)
    # Ignored rows exactly 0, as the kernel writes them (their p may overflow: 0 * inf is NaN).
    return torch.where(counted.unsqueeze(-1), grad, 0.0).to(logits.dtype)


def _backward(ctx, grad, _grad_lse, _grad_count):
    if grad is None or not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None, None
    logits, target, lse, count = ctx.saved_tensors
    args = (grad, logits, target, lse, count if ctx.reduction == "mean" else None, ctx.ignore_index,
            ctx.label_smoothing, ctx.softcap, ctx.z_loss)
    # Traced by torch.compile (AOTAutograd traces this formula; torch 2.11 does not report that as
    # compiling, but its tensors are functional or fake ones) or on a tensor subclass: PyTorch
    # ops, for inductor; brrr's kernel for plain tensors.
    traced = torch.compiler.is_compiling() or type(grad) is not torch.Tensor or type(logits) is not torch.Tensor
    grad_logits = _backward_in_torch_ops(*args) if traced else backward_op(*args)
    return grad_logits, None, None, None, None, None, None


_cross_entropy = define("cross_entropy", _forward_impl, _forward_fake, _backward, _setup_context)


class _CrossEntropyFunction(torch.autograd.Function):
    """Eager autograd without the custom op's dispatcher and Python layers (see _ChainFunction)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, softcap, z_loss, reduction):
        loss, lse, count = _forward_impl(logits, target, ignore_index, label_smoothing, softcap, z_loss, reduction)
        ctx.save_for_backward(logits, target, lse, count if reduction == "mean" else None)
        ctx.ignore_index, ctx.label_smoothing, ctx.softcap, ctx.z_loss = ignore_index, label_smoothing, softcap, z_loss
        return loss

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad):
        logits, target, lse, count = ctx.saved_tensors
        return (_backward_impl(grad, logits, target, lse, count, ctx.ignore_index, ctx.label_smoothing, ctx.softcap,
                               ctx.z_loss), None, None, None, None, None, None)


_apply_cross_entropy = lean_apply(_CrossEntropyFunction)


def cross_entropy(input, target, ignore_index, reduction, label_smoothing, dtype, softcap=None, z_loss=0.0):
    """brrr.cross_entropy on torch tensors (arguments checked): the custom op under torch.compile,
    the autograd.Function when autograd records, else straight to brrr._C."""
    check_rank(input.dim())
    check_torch((target,), ("target",))
    logits = input if input.dim() <= 2 else input.movedim(1, -1)
    args = (logits, target, ignore_index, label_smoothing, softcap, z_loss, reduction)
    if torch.compiler.is_compiling():
        loss = _cross_entropy(*args)[0]
    elif needs_autograd(logits):
        loss = _apply_cross_entropy(*args)
    else:
        loss = _forward_impl(*args)[0]
    dtype = input.dtype if dtype is None else dtype
    return loss if loss.dtype == dtype else loss.to(dtype)
