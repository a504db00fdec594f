"""PyTorch integration of rotary: a torch.library operator with a fake kernel and registered
autograd (brrr._ops), an eager autograd.Function, and the direct call into brrr._C when autograd
records nothing. The gradient with respect to x is the same op with `backward` flipped."""

import torch

from . import _C
from ._ops import define
from ._args import named
from .rotary import K_NAMES, Q_NAMES
from ._torch import _eager_out, _needs_autograd, _stream, check_torch, lean_apply, lean_once_differentiable

Tensor = torch.Tensor


def _impl(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    return _C.rotary(x, cos, sin, _eager_out(x), backward, _stream(x, None))


def _fake(x, cos, sin, backward):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    _, cos, sin, ctx.backward = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return _rotary(grad, cos, sin, not ctx.backward), None, None, None


_rotary = define("rotary", _impl, _fake, _backward, _setup_context)


class _RotaryFunction(torch.autograd.Function):
    """Eager autograd without the custom op's dispatcher and Python layers (see _ChainFunction)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _impl(x, cos, sin, False)

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _impl(grad, cos, sin, True), None, None


class _RotaryPairFunction(torch.autograd.Function):
    """q and k rotated by the same cos and sin under one autograd node: one Function applied and
    one backward called per attention layer instead of two (host time, the overhead regime)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)
        return named(Q_NAMES, _impl, q, cos, sin, False), named(K_NAMES, _impl, k, cos, sin, False)

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        return (None if grad_q is None else _impl(grad_q, cos, sin, True),
                None if grad_k is None else _impl(grad_k, cos, sin, True), None, None)


_apply_rotary, _apply_rotary_pair = lean_apply(_RotaryFunction), lean_apply(_RotaryPairFunction)


def _refuse_angle_gradients(cos, sin):
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (cos, sin)):
        name = "cos" if cos.requires_grad else "sin"
        raise ValueError(f"argument {name}: brrr.rotary gives no gradient for cos and sin (they require grad here; "
                         "brrr.registry sends such inputs to PyTorch)")


def rotary(x, cos, sin):
    """brrr.rotary on torch tensors: the custom op under torch.compile, the autograd.Function
    when autograd records, else straight to brrr._C."""
    check_torch((cos, sin), ("cos", "sin"))
    _refuse_angle_gradients(cos, sin)
    if torch.compiler.is_compiling():
        return _rotary(x, cos, sin, False)
    if _needs_autograd(x):
        return _apply_rotary(x, cos, sin)
    return _impl(x, cos, sin, False)


def rotary_qk(q, k, cos, sin):
    """(rotary(q, cos, sin), rotary(k, cos, sin)), one autograd node for both where both need one."""
    check_torch((k, cos, sin), ("k", "cos", "sin"))
    _refuse_angle_gradients(cos, sin)
    if not torch.compiler.is_compiling() and _needs_autograd(q) and k.requires_grad:
        return _apply_rotary_pair(q, k, cos, sin)
    return named(Q_NAMES, rotary, q, cos, sin), named(K_NAMES, rotary, k, cos, sin)
