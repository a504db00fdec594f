"""PyTorch integration: brrr's ops as torch.library custom operators with fake kernels and
registered autograd, so that torch.compile traces them without graph breaks.

Eager calls that need no gradient skip the dispatcher and go straight to brrr._C (the overhead
regime: a custom-op round trip costs more host time than the kernel it launches on small
tensors). Outputs are allocated with torch, so PyTorch's caching allocator owns them.
"""

import functools

import torch

from . import _C

# torch 2.10+ publishes DLPack's C exchange table, from which brrr._C reads tensors and the
# current stream without Python; older releases need the stream passed explicitly.
_EXCHANGE_API = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


@functools.lru_cache(maxsize=1024)
def _program(ops, scalars):
    """ops: the chain's op names joined by commas (custom-op schemas take no list of str)."""
    names = ops.split(",") if ops else []
    return _C.chain_program([(o, s) if o in ("add", "mul") else o for o, s in zip(names, scalars)])


def _stream(x, stream):
    if stream is not None:
        return stream
    if _EXCHANGE_API or not x.is_cuda:
        return -1
    return torch.cuda.current_stream(x.device).cuda_stream


@torch.library.custom_op("brrr::chain", mutates_args=())
def chain_op(x: torch.Tensor, operands: list[torch.Tensor], ops: str, scalars: list[float]) -> torch.Tensor:
    out = torch.empty_like(x)
    _C.chain_fwd(_program(ops, tuple(scalars)), x, out, tuple(operands), _stream(x, None))
    return out


@chain_op.register_fake
def _chain_fake(x, operands, ops, scalars):
    return torch.empty_like(x)


@torch.library.custom_op("brrr::chain_backward", mutates_args=())
def chain_backward_op(x: torch.Tensor, grad: torch.Tensor, operands: list[torch.Tensor], ops: str,
                      scalars: list[float], operand_needs_grad: list[bool]) -> list[torch.Tensor]:
    grad_x = torch.empty_like(x)
    grad_operands = tuple(torch.empty_like(o) if need else None for o, need in zip(operands, operand_needs_grad))
    partials = None
    vector_grad = any(need and o.shape != x.shape for o, need in zip(operands, operand_needs_grad))
    if x.is_cuda and vector_grad and x.numel() > 0:
        cols = x.shape[-1]
        rows = x.numel() // cols
        partials = torch.empty(len(operands) * _C.chain_partial_rows(rows) * cols, dtype=torch.float32, device=x.device)
    _C.chain_bwd(_program(ops, tuple(scalars)), x, grad, grad_x, tuple(operands), grad_operands, partials,
                 _stream(x, None))
    return [grad_x] + [g for g in grad_operands if g is not None]


@chain_backward_op.register_fake
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


torch.library.register_autograd("brrr::chain", _chain_backward, setup_context=_chain_setup_context)

_chain_default = torch.ops.brrr.chain.default


def chain(c, x, operands, out, stream):
    """Apply Chain `c` to torch tensors: custom op when autograd or torch.compile needs one."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            x.requires_grad or any(o.requires_grad for o in operands))):
        if out is not None:
            raise ValueError("argument out: not supported when autograd records the op or under torch.compile")
        return _chain_default(x, list(operands), c.op_names, c.scalars)
    if out is None:
        out = torch.empty_like(x)
    _C.chain_fwd(c.program, x, out, operands, _stream(x, stream))
    return out
