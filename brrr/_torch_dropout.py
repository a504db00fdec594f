"""PyTorch integration of bias_dropout_add: torch.library operators with fake kernels and
registered autograd (brrr._op) (torch.compile traces them without graph breaks), an eager autograd.Function,
and the direct call into brrr._C when autograd records nothing.

Nothing is saved for the backward but p, seed and offset: brrr::bias_dropout_add_backward draws
the mask again and returns [grad_x] (+ [grad_bias]); grad_residual is the incoming gradient itself.
"""

from typing import Optional

import torch

from . import _C, _op
from ._op import check_torch, define, lean_apply, lean_once_differentiable, needs_autograd, out_like, stream

Tensor = torch.Tensor


def _forward_impl(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float, seed: int, offset: int) -> Tensor:
    return _C.dropout_fwd(x, bias, residual, out_like(x), p=p, seed=seed, offset=offset, stream=stream(x))[0]


def _backward_impl(grad: Tensor, p: float, seed: int, offset: int, bias_grad: bool) -> list[Tensor]:
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


def _forward_fake(x, bias, residual, p, seed, offset):
    return torch.empty_like(x)


def _backward_fake(grad, p, seed, offset, bias_grad):
    return [torch.empty_like(grad)] + ([grad.new_empty(grad.shape[-1:])] if bias_grad else [])


backward_op = define("bias_dropout_add_backward", _backward_impl, _backward_fake)


def _setup_context(ctx, inputs, output):
    _, _, _, ctx.p, ctx.seed, ctx.offset = inputs


def _grads(ctx, grad, backward):
    """The gradients of (x, bias, residual); None where none is asked for."""
    need_x, need_bias, need_residual = ctx.needs_input_grad[:3]
    grad_x = grad_bias = None
    if need_x or need_bias:
        grads = backward(grad, ctx.p, ctx.seed, ctx.offset, need_bias)
        grad_x, grad_bias = grads[0] if need_x else None, grads[1] if need_bias else None
    return grad_x, grad_bias, grad if need_residual else None


def _backward(ctx, grad):
    return (*_grads(ctx, grad, backward_op), None, None, None)


_bias_dropout_add = define("bias_dropout_add", _forward_impl, _forward_fake, _backward, _setup_context)


class _BiasDropoutAddFunction(torch.autograd.Function):
    """Eager autograd without the custom op's dispatcher and Python layers (see _ChainFunction)."""

    @staticmethod
    def forward(ctx, x, bias, residual, p, seed, offset):
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        return _forward_impl(x, bias, residual, p, seed, offset)

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad):
        return (*_grads(ctx, grad, _backward_impl), None, None, None)


_apply_bias_dropout_add = lean_apply(_BiasDropoutAddFunction)


def bias_dropout_add(x, bias, residual, p, seed, offset):
    """brrr.bias_dropout_add on torch tensors (arguments checked): the custom op under
    torch.compile, the autograd.Function when autograd records, else straight to brrr._C."""
    check_torch((bias, residual), ("bias", "residual"))
    if seed is None:
        if x.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("argument seed: None while a CUDA graph is being captured: the seed drawn now would "
                               "be part of the graph, and every replay would drop the same elements. In a captured "
                               "step use torch.nn.functional.dropout (PyTorch's generator is graph-safe), or pass "
                               "seed= knowing that every replay reuses it")
        # torch's default CPU generator, so that torch.manual_seed makes runs reproducible.
        seed = int(torch.randint(2**63 - 1, (1,)).item())
    if torch.compiler.is_compiling():
        return _bias_dropout_add(x, bias, residual, p, seed, offset)
    if needs_autograd(x, (bias, residual)):
        return _apply_bias_dropout_add(x, bias, residual, p, seed, offset)
    return _forward_impl(x, bias, residual, p, seed, offset)
