"""PyTorch integration: brrr's ops as torch.library custom operators with fake kernels and
registered autograd (defined by brrr._ops), so that torch.compile traces them without graph breaks.

Eager calls that need no gradient skip the dispatcher and go straight to brrr._C (the overhead
regime: a custom-op round trip costs more host time than the kernel it launches on small
tensors). Outputs are allocated by PyTorch's caching allocator: with torch, or by brrr._C
through the DLPack exchange table's allocator (torch 2.10+, outputs like a contiguous input).
"""

import functools
import re

import torch

from . import _C
from ._args import last_dim
from .chain import OPERAND_NAMES
from ._ops import define

# torch 2.10+ publishes DLPack's C exchange table, from which brrr._C reads tensors and the
# current stream without Python; older releases need the stream passed explicitly.
_EXCHANGE_API = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


@functools.lru_cache(maxsize=1024)
def _program(ops, scalars):
    """ops: the chain's op names joined by commas (custom-op schemas take no list of str)."""
    names = ops.split(",") if ops else []
    return _C.chain_program([(o, s) if o in ("add", "mul") else o for o, s in zip(names, scalars)])


_C_FUNCTION_APPLY = torch._C._FunctionBase.__dict__.get("apply")
_functorch = getattr(torch._C, "_functorch", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_functorch_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None)


def lean_apply(function):
    """function.apply less torch's Python wrapper around its C entry (signature binding, and
    functorch's dead-wrapper unwrapping run over every argument by a generator): about 3 us of the
    ~25 of a norm module's eager forward on this project's CPU machine. Calls inside functorch transforms
    take function.apply. So do tensors leaked from a finished transform (dead functorch wrappers,
    which the wrapper unwraps): brrr._C cannot read one, and its import fails before anything runs,
    so they are looked for only when the direct call raised."""
    if _C_FUNCTION_APPLY is None or _functorch_active is None or _functorch_wrapped is None:
        return function.apply
    direct, wrapped_apply = _C_FUNCTION_APPLY.__get__(None, function), function.apply

    def apply(*args):
        if _functorch_active():
            return wrapped_apply(*args)
        try:
            return direct(*args)
        except RuntimeError:
            if any(isinstance(a, torch.Tensor) and _functorch_wrapped(a) for a in args):
                return wrapped_apply(*args)
            raise
    return apply


def lean_once_differentiable(backward):
    """torch's once_differentiable for the backward of an eager Function run by brrr's kernels,
    which record no graph. Where autograd records the backward (create_graph=True), the gradients
    it returns carry an error node whenever an incoming gradient or a saved tensor requires grad,
    so that a second derivative raises instead of coming out zero (torch's decorator looks at the
    incoming gradients only: the Hessian of layer_norm(x).sum() was silently 0). An op whose
    backward reads no saved tensor that requires grad (dropout, rotary) is linear in x: its
    second derivative with respect to x is 0 indeed. Grad mode off, the usual backward, skips all
    of this (and the no_grad block)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        recorded = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        return _refuse_second_derivative(ctx, outputs, recorded) if recorded else outputs
    return wrapper


def _refuse_second_derivative(ctx, outputs, recorded):
    """outputs behind an autograd node that raises when it is differentiated (as torch's
    once_differentiable builds it), whose inputs are also the tensors `recorded` that the
    gradients depend on: autograd.grad with respect to one of them (a Hessian) must run the node
    to reach it, where torch's node, with the outputs' detached aliases for inputs only, was
    left out of the graph and the result was a silent 0."""
    outputs_ = outputs if isinstance(outputs, tuple) else (outputs,)
    name = getattr(getattr(ctx, "_forward_cls", None), "__name__", "Op").lstrip("_").removeprefix("Eager")
    name = re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name.removesuffix("Function")).lower()
    error = torch._C._functions.DelayedError(
        f"trying to differentiate twice brrr's {name}, whose backward is marked once_differentiable: brrr's kernels "
        "have no second derivative (call PyTorch's function where one is needed, e.g. by brrr.registry.override)"
        .encode(), len(outputs_) + len(recorded))
    aliases = [None if o is None else o.detach().requires_grad_() for o in outputs_]
    guarded = error(*aliases, *recorded)[:len(outputs_)]
    return guarded if isinstance(outputs, tuple) else guarded[0]


def _stream(x, stream):
    if stream is not None:
        return stream
    if _EXCHANGE_API or not x.is_cuda:
        return -1
    return torch.cuda.current_stream(x.device).cuda_stream


def _chain_impl(x: torch.Tensor, operands: list[torch.Tensor], ops: str, scalars: list[float]) -> torch.Tensor:
    return _C.chain_fwd(_program(ops, tuple(scalars)), x, _eager_out(x), tuple(operands), _stream(x, None))


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
    _C.chain_bwd(program, x, grad, grad_x, tuple(operands), grad_operands, partials, _stream(x, None))
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


def check_torch(values, names):
    """The other tensor arguments of a call whose x is a torch tensor: torch tensors or None, as
    the tensors of one call come from one framework (docs/errors.md). TypeError naming the first
    that is not."""
    for value, name in zip(values, names):
        if value is not None and not isinstance(value, torch.Tensor):
            if not hasattr(value, "__dlpack__"):
                raise TypeError(f"argument {name}: expected a tensor or array implementing __dlpack__, got "
                                f"{type(value).__name__}")
            raise TypeError(f"argument {name}: expected a torch.Tensor like the call's first tensor (the tensors "
                            f"of one call come from one framework), got {type(value).__name__}")


def _needs_autograd(x, others=()):
    """Whether autograd records an op on x and `others` (tensors or None, checked by check_torch);
    cheap first, as this is the overhead regime's hot path."""
    return torch.is_grad_enabled() and (x.requires_grad or (
        bool(others) and any(o is not None and o.requires_grad for o in others)))


class _ChainFunction(torch.autograd.Function):
    """Eager autograd for a chain, without the custom op's dispatcher and Python layers: they cost
    about 200 µs of host time per forward+backward (measured on this project's CPU machine), more
    than the kernels of a 16384 x 4096 tensor take on the H200. torch.compile takes the custom op."""

    @staticmethod
    def forward(ctx, c, x, *operands):
        ctx.save_for_backward(x, *operands)
        ctx.program = c.program
        return _C.chain_fwd(c.program, x, _eager_out(x), operands, _stream(x, None))

    @staticmethod
    @lean_once_differentiable
    def backward(ctx, grad):
        x, *operands = ctx.saved_tensors
        grad_x, grad_operands = _chain_grads(ctx.program, x, grad, operands, ctx.needs_input_grad[2:])
        return (None, grad_x, *grad_operands)


_apply_chain = lean_apply(_ChainFunction)


def _eager_out(x):
    """None where brrr._C can allocate the output itself (contiguous x, exchange table)."""
    return None if _EXCHANGE_API and x.is_contiguous() else torch.empty_like(x)


def chain(c, x, operands, out, stream):
    """Apply Chain `c` to torch tensors: the custom op under torch.compile, an autograd.Function
    when autograd records, else straight to brrr._C (the overhead regime's hot path)."""
    if operands:
        check_torch(operands, OPERAND_NAMES)
    if out is not None:
        check_torch((out,), ("out",))
    compiling = torch.compiler.is_compiling()
    if compiling or _needs_autograd(x, operands):
        if out is not None:
            raise ValueError("argument out: not supported when autograd records the op or under torch.compile")
        if compiling:
            return _chain_default(x, list(operands), c.op_names, c.scalars)
        return _apply_chain(c, x, *operands)
    if out is None:
        out = _eager_out(x)  # keeps a strided input's layout; brrr._C allocates contiguous ones
    return _C.chain_fwd(c.program, x, out, operands, -1 if stream is None and _EXCHANGE_API else _stream(x, stream))


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
        _C.chain_bwd(program, gate, grad, grad_gate, (up_half,), (grad_up,), None, _stream(x, None))
        return [grad_x]
    grad_gate, grad_up = torch.empty_like(x), torch.empty_like(up) if need_up else None
    _C.chain_bwd(program, x, grad, grad_gate, (up,), (grad_up,), None, _stream(x, None))
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
    if out is None and not _EXCHANGE_API:
        out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    return _C.chain_fwd(_program(activation + ",mul_tensor", (0.0, 0.0)), g, out, (u,), _stream(g, None))


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
    if compiling or _needs_autograd(gate, (up,) if up is not None else ()):
        if out is not None:
            raise ValueError("argument out: not supported when autograd records the op or under torch.compile")
        if compiling:
            return _glu_default(gate, up, activation)
        return _apply_glu(activation, gate, up)
    return _glu_forward(activation, gate, up, out)
