"""PyTorch integration: brrr's ops as torch.library custom operators with fake kernels and
registered autograd (defined by brrr._op), so that torch.compile traces them without graph breaks.

Eager calls that need no gradient skip the dispatcher and go straight to brrr._C (the overhead
regime: a custom-op round trip costs more host time than the kernel it launches on small
tensors). Outputs are allocated by PyTorch's caching allocator: with torch, or by brrr._C
through the DLPack exchange table's allocator (torch 2.10+, outputs like a contiguous input).
"""

import functools
import importlib
import sys

import torch

from . import _C, _op
from ._args import last_dim
from ._frameworks import torch_integration_loaded
from ._op import check_torch, define, lean_apply, lean_once_differentiable, needs_autograd, out_like, stream
from .chain import OPERAND_NAMES, SCALAR_OPS


@functools.lru_cache(maxsize=1024)
def _program(ops, scalars):
    """ops: the chain's op names joined by commas (custom-op schemas take no list of str)."""
    names = ops.split(",") if ops else []
    return _C.chain_program([(o, s) if o in SCALAR_OPS else o for o, s in zip(names, scalars)])


def _chain_impl(x: torch.Tensor, operands: list[torch.Tensor], ops: str, scalars: list[float]) -> torch.Tensor:
    return _C.chain_fwd(x, out_like(x), _program(ops, tuple(scalars)), tuple(operands), stream(x))[0]


def _chain_fake(x, operands, ops, scalars):
    return torch.empty_like(x)


def _chain_grads(program, x, grad, operands, needs):
    """(grad_x, [grad of each operand, or None where needs is False]) in one backward kernel."""
    grad_x = torch.empty_like(x)
    # With no rows, a bias gradient is a sum of nothing: zeros (the kernels never run).
    new_grad = torch.zeros_like if x.numel() == 0 else torch.empty_like
    grad_operands = tuple(new_grad(o) if need else None for o, need in zip(operands, needs))
    partials = None
    vector_grad = any(need and o.shape != x.shape for o, need in zip(operands, needs))
    if x.is_cuda and vector_grad and x.numel() > 0:
        cols = x.shape[-1]
        rows = x.numel() // cols
        partials = torch.empty(len(operands) * _C.chain_partial_rows(rows) * cols, device=x.device,
                               dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    _C.chain_bwd(x, grad, grad_x, partials, program, tuple(operands), grad_operands, stream(x))
    return grad_x, grad_operands


def _chain_backward_impl(x: torch.Tensor, grad: torch.Tensor, operands: list[torch.Tensor], ops: str,
                         scalars: list[float], operand_needs_grad: list[bool]) -> list[torch.Tensor]:
    grad_x, grad_operands = _chain_grads(_program(ops, tuple(scalars)), x, grad, operands, operand_needs_grad)
    return [grad_x] + [g for g in grad_operands if g is not None]


def _chain_backward_fake(x, grad, operands, ops, scalars, operand_needs_grad):
    return [torch.empty_like(x)] + [torch.empty_like(o) for o, need in zip(operands, operand_needs_grad) if need]


def _chain_setup_context(ctx, inputs, output):
    x, operands, ops, scalars = inputs
    ctx.save_for_backward(x, *operands)
    ctx.ops, ctx.scalars = ops, scalars
    ctx.operand_needs_grad = [o.requires_grad for o in operands]


def _chain_backward(ctx, grad):
    x, *operands = ctx.saved_tensors
    grads = chain_backward_op(x, grad, operands, ctx.ops, ctx.scalars, ctx.operand_needs_grad)
    it = iter(grads[1:])
    grad_operands = [next(it) if need else None for need in ctx.operand_needs_grad]
    return grads[0], grad_operands, None, None


chain_backward_op = define("chain_backward", _chain_backward_impl, _chain_backward_fake)
_chain_default = define("chain", _chain_impl, _chain_fake, _chain_backward, _chain_setup_context)


class _ChainFunction(torch.autograd.Function):
    """Eager autograd for a chain, without the custom op's dispatcher and Python layers: they cost
    about 200 µs of host time per forward+backward (measured on this project's CPU machine), more
    than the kernels of a 16384 x 4096 tensor take on the H200. torch.compile takes the custom op."""

    @staticmethod
    def forward(ctx, c, x, *operands):
        ctx.save_for_backward(x, *operands)
        ctx.program = c.program
        return _C.chain_fwd(x, out_like(x), c.program, operands, stream(x))[0]

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad):
        x, *operands = ctx.saved_tensors
        grad_x, grad_operands = _chain_grads(ctx.program, x, grad, operands, ctx.needs_input_grad[2:])
        return (None, grad_x, *grad_operands)


_apply_chain = lean_apply(_ChainFunction)


def chain(c, x, operands, out, cuda_stream):
    """Apply Chain `c` to torch tensors: the custom op under torch.compile, an autograd.Function
    when autograd records, else straight to brrr._C (the overhead regime's hot path)."""
    if operands:
        check_torch(operands, OPERAND_NAMES)
    if out is not None:
        check_torch((out,), ("out",))
    compiling = torch.compiler.is_compiling()
    if compiling or needs_autograd(x, operands):
        if out is not None:
            raise ValueError("argument out: not supported when autograd records the op or under torch.compile")
        if compiling:
            return _chain_default(x, list(operands), c.op_names, c.scalars)
        return _apply_chain(c, x, *operands)
    if out is None:
        out = out_like(x)  # keeps a strided input's layout; brrr._C allocates contiguous ones
    return _C.chain_fwd(x, out, c.program, operands, stream(x) if cuda_stream is None else cuda_stream)[0]


def _split(x):
    d = x.shape[-1] // 2
    try:
        return x[..., :d], x[..., d:]
    except Exception:  # noqa: BLE001 - a tensor brrr cannot take (sparse, nested): brrr._C's error for it
        _C.check_tensor(x, "x")
        raise


def _glu_impl(x: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    return _glu_forward(activation, x, up, None)


def _glu_fake(x, up, activation):
    shape = x.shape if up is not None else (*x.shape[:-1], x.shape[-1] // 2)
    return x.new_empty(shape)


def _glu_grads(activation, x, up, grad, need_up):
    """Gradients of act(gate) * up: [grad_x] for the split form, else [grad_gate, grad_up or None]."""
    program = _program(activation + ",mul_tensor", (0.0, 0.0))
    if up is None:  # both halves of one gradient, written by one kernel
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        (gate, up_half), (grad_gate, grad_up) = _split(x), _split(grad_x)
        _C.chain_bwd(gate, grad, grad_gate, None, program, (up_half,), (grad_up,), stream(x))
        return [grad_x]
    grad_gate, grad_up = torch.empty_like(x), torch.empty_like(up) if need_up else None
    _C.chain_bwd(x, grad, grad_gate, None, program, (up,), (grad_up,), stream(x))
    return [grad_gate, grad_up]


def _glu_backward_impl(x: torch.Tensor, up: torch.Tensor | None, grad: torch.Tensor, activation: str,
                       needs_grad: list[bool]) -> list[torch.Tensor]:
    return [g for g in _glu_grads(activation, x, up, grad, needs_grad[1]) if g is not None]


def _glu_backward_fake(x, up, grad, activation, needs_grad):
    if up is None:
        return [x.new_empty(x.shape)]
    return [torch.empty_like(x)] + ([torch.empty_like(up)] if needs_grad[1] else [])


def _glu_setup_context(ctx, inputs, output):
    x, up, activation = inputs
    ctx.save_for_backward(x, up)
    ctx.activation = activation
    ctx.needs = [x.requires_grad, up is not None and up.requires_grad]


def _glu_backward(ctx, grad):
    x, up = ctx.saved_tensors
    grads = glu_backward_op(x, up, grad, ctx.activation, ctx.needs)
    if up is None:
        return grads[0], None, None
    return (grads[0] if ctx.needs[0] else None), (grads[1] if ctx.needs[1] else None), None


glu_backward_op = define("glu_backward", _glu_backward_impl, _glu_backward_fake)
_glu_default = define("glu", _glu_impl, _glu_fake, _glu_backward, _glu_setup_context)


def _glu_forward(activation, gate, up, out):
    g, u = _split(gate) if up is None else (gate, up)
    if out is None and not _op.EXCHANGE_API:
        out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    return _C.chain_fwd(g, out, _program(activation + ",mul_tensor", (0.0, 0.0)), (u,), stream(g))[0]


class _GluFunction(torch.autograd.Function):
    """Eager autograd for a GLU (see _ChainFunction for why not the custom op)."""

    @staticmethod
    def forward(ctx, activation, x, up):
        ctx.save_for_backward(x, up)
        ctx.activation = activation
        return _glu_forward(activation, x, up, None)

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad):
        x, up = ctx.saved_tensors
        grads = _glu_grads(ctx.activation, x, up, grad, ctx.needs_input_grad[2])
        return (None, grads[0], None) if up is None else (None, grads[0], grads[1])


_apply_glu = lean_apply(_GluFunction)


def glu(activation, gate, up, out):
    """Gated linear unit on torch tensors (see brrr.glu); the custom op under torch.compile, an
    autograd.Function when autograd records, else straight to brrr._C."""
    check_torch((up, out), ("up", "out"))
    if up is None and last_dim("x", gate, "its last is split into gate and up halves") % 2:
        raise ValueError(f"argument x: the last dim must be even to split into gate and up halves, got {gate.shape[-1]}")
    compiling = torch.compiler.is_compiling()
    if compiling or needs_autograd(gate, (up,) if up is not None else ()):
        if out is not None:
            raise ValueError("argument out: not supported when autograd records the op or under torch.compile")
        if compiling:
            return _glu_default(gate, up, activation)
        return _apply_glu(activation, gate, up)
    return _glu_forward(activation, gate, up, out)


# The families' own PyTorch integrations (their torch.library operators) are built here too, once
# torch is in use, and never while torch.compile traces a first call (see torch_integration_loaded).
for _family in ("norm", "rotary", "softmax"):
    importlib.import_module(f"{__package__}.{_family}")._torch()

torch_integration_loaded(sys.modules[__name__])
