"""Fused bias+activation and gated linear units.

    brrr.bias_gelu(x, bias)          gelu(x + bias), bias along the last dim (erf or tanh form)
    brrr.bias_silu(x, bias)          silu(x + bias)
    brrr.swiglu(gate, up)            silu(gate) * up
    brrr.swiglu(x)                   the same on the halves of x's last dim: gate = x[..., :d], up = x[..., d:]
    brrr.geglu(gate, up=None, approximate="none")   gelu(gate) * up, likewise

All are single chains (one read of each input, one write of the output); their backward
recomputes the activation from the saved inputs. The split form's backward writes both halves
of grad_x in the same kernel, so no slice-gradient buffers are zero-filled and added.
"""

from . import _C
from ._args import ERRORS, last_dim, named, refuse_kinds, renamed, shape_of
from ._frameworks import check_torch, torch_if_tensor
from ._integration import torch_integration
from .chain import OUT_REFUSED, Chain, gelu_step
from .chain import torch_layer as chain_layer

_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}
_BIAS = {name: Chain("add_tensor", op) for name, op in _ACTIVATIONS.items()}
_GLU = {name: Chain(op, "mul_tensor") for name, op in _ACTIVATIONS.items()}


_BIAS_NAMES = {"operands[0]": "bias"}  # the chain's name for it
_GLU_NAMES = {"x": "gate", "operands[0]": "up"}


def bias_gelu(x, bias, approximate="none", *, out=None):
    """gelu(x + bias) in one pass; bias has shape x.shape[-1:] (or x.shape)."""
    return named(_BIAS_NAMES, _BIAS[gelu_step(approximate)], x, bias, out=out)


def bias_silu(x, bias, *, out=None):
    """silu(x + bias) in one pass; bias has shape x.shape[-1:] (or x.shape)."""
    return named(_BIAS_NAMES, _BIAS["silu"], x, bias, out=out)


def _halves(x):
    d = last_dim("x", x, "its last is split into gate and up halves")
    if d % 2:
        raise ValueError(f"argument x: the last dim must be even to split into gate and up halves, got {d}")
    return x[..., : d // 2], x[..., d // 2:]


_HALF_NAMES = {"x": "x (gate half)", "operands[0]": "x (up half)"}  # the split form's halves


def _glu(activation, gate, up, out):
    if up is None:
        if torch_if_tensor(gate) is None:
            return named(_HALF_NAMES, _GLU[activation], *_halves(gate), out=out)
        try:
            return torch_layer().glu(activation, gate, None, out)
        except RuntimeError:
            refuse_kinds(("x", gate))
            raise
    try:
        if torch_if_tensor(gate) is not None:
            try:  # named() inlined: its frame and argument packing were 0.1 us of a tiny SwiGLU's 2.7
                return torch_layer().glu(activation, gate, up, out)
            except ERRORS as error:
                raise renamed(error, _GLU_NAMES) from None
        if tuple(shape_of("up", up)) != tuple(shape_of("gate", gate)):
            raise ValueError(f"argument up has shape {tuple(up.shape)} but gate has shape {tuple(gate.shape)}")
    except RuntimeError:
        refuse_kinds(("gate", gate), ("up", up))
        raise
    return named(_GLU_NAMES, _GLU[activation], gate, up, out=out)


def swiglu(gate, up=None, *, out=None):
    """silu(gate) * up; with up=None, gate is split in halves along its last dim (gate first)."""
    return _glu("silu", gate, up, out)


def geglu(gate, up=None, approximate="none", *, out=None):
    """gelu(gate) * up; with up=None, gate is split in halves along its last dim (gate first)."""
    return _glu(gelu_step(approximate), gate, up, out)


# ---- PyTorch: the custom ops brrr::glu (act(gate) * up; up None: the halves of x) and
# brrr::glu_backward ([grad_gate, grad_up (if asked)], or [grad_x] for the halves, in one kernel),
# and the registry's bias+activation and GLU ops with their brrr.nn modules.

@torch_integration
def torch_layer():
    from types import SimpleNamespace
    from typing import Optional

    import torch
    import torch.nn.functional as F

    from . import _op
    from ._op import TorchOp, out_like, stream
    from ._registry import dispatch, registry, same_kind, tensor_ok

    Tensor = torch.Tensor
    programs = {a: chain_layer().program(a + ",mul_tensor", (0.0, 0.0)) for a in _ACTIVATIONS}  # act(gate) * up

    def split(x):
        d = x.shape[-1] // 2
        try:
            return x[..., :d], x[..., d:]
        except Exception:  # noqa: BLE001 - a tensor brrr cannot take (sparse, nested): brrr._C's error for it
            _C.check_tensor(x, "x")
            raise

    def glu_forward(activation, gate, up, out):
        g, u = split(gate) if up is None else (gate, up)
        if out is None and not _op.EXCHANGE_API:
            out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        return _C.chain_fwd(g, out, programs[activation], (u,), stream(g))[0]

    backward_wanted = set()  # the activations whose programs said so to the compiled chains

    def forward(x: Tensor, up: Optional[Tensor], activation: str) -> Tensor:
        """Where autograd records the op (and under torch.compile): on CUDA, the two-tensor form's
        forward kernel is compiled in one program with its backward (csrc/chain_jit.c)."""
        if activation not in backward_wanted:
            _C.chain_jit_with_backward(programs[activation])
            backward_wanted.add(activation)
        return inference(x, up, activation)

    def inference(x, up, activation):
        if up is not None and _op.EXCHANGE_API:  # the usual call, straight to brrr._C (allocating, finding the stream)
            return _C.chain_fwd(x, None, programs[activation], (up,))[0]
        return glu_forward(activation, x, up, None)

    def fake(x, up, activation):
        shape = x.shape if up is not None else (*x.shape[:-1], x.shape[-1] // 2)
        return x.new_empty(shape)

    def backward_forward(x: Tensor, up: Optional[Tensor], grad: Tensor, activation: str,
                         needs_grad: list[bool]) -> list[Tensor]:
        program_ = programs[activation]
        if up is None:  # both halves of one gradient, written by one kernel
            grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            (gate, up_half), (grad_gate, grad_up) = split(x), split(grad_x)
            _C.chain_bwd(gate, grad, grad_gate, None, program_, (up_half,), (grad_up,), stream(x))
            return [grad_x]
        grad_up = torch.empty_like(up) if needs_grad[1] else None
        if _op.EXCHANGE_API and x.is_contiguous():  # brrr._C allocates grad_gate and finds the stream
            grad_gate = _C.chain_bwd(x, grad, None, None, program_, (up,), (grad_up,))[0]
        else:
            grad_gate = _C.chain_bwd(x, grad, out_like(x), None, program_, (up,), (grad_up,), stream(x))[0]
        return [grad_gate] if grad_up is None else [grad_gate, grad_up]

    def backward_fake(x, up, grad, activation, needs_grad):
        if up is None:
            return [x.new_empty(x.shape)]
        return [torch.empty_like(x)] + ([torch.empty_like(up)] if needs_grad[1] else [])

    backward_op = TorchOp("glu_backward", backward_forward, backward_fake)

    def save(ctx, args, results):
        x, up, ctx.activation = args
        ctx.save_for_backward(x, up)

    def formula(ctx, grads, run):
        (grad,), (x, up) = grads, ctx.saved_tensors
        if grad is None:
            return None, None, None
        needs = [ctx.needs_input_grad[0], up is not None and ctx.needs_input_grad[1]]
        got = run(backward_op)(x, up, grad, ctx.activation, needs)
        if up is None:
            return got[0], None, None
        return (got[0] if needs[0] else None), (got[1] if needs[1] else None), None

    glu_op = TorchOp("glu", forward, fake, save=save, backward=formula, grad_args=(0, 1), inference=inference)

    def glu(activation, gate, up, out):
        """A gated linear unit on torch tensors (see brrr.glu): its op, or with `out` given,
        straight to brrr._C (refused where autograd records the op or torch.compile traces it)."""
        check_torch((up, out), ("up", "out"))
        if up is not None and up.shape != gate.shape:
            raise ValueError(f"argument up has shape {tuple(up.shape)} but gate has shape {tuple(gate.shape)}")
        if up is None and last_dim("x", gate, "its last is split into gate and up halves") % 2:
            raise ValueError(f"argument x: the last dim must be even to split into gate and up halves, got "
                             f"{gate.shape[-1]}")
        try:
            if out is None:
                return glu_op(gate, up, activation)
            return glu_op.write((gate, up, activation), out, lambda: glu_forward(activation, gate, up, out),
                                OUT_REFUSED)
        except ERRORS as error:
            if up is not None:  # (_glu names gate and up)
                raise
            raise renamed(error, _HALF_NAMES) from None  # brrr._C's x and operands[0] are x's halves

    # ---- the registry
    def glu_(activation):
        return lambda gate, up=None: glu(activation, gate, up, None)

    def geglu_(gate, up=None, approximate="none"):
        return glu(gelu_step(approximate), gate, up, None)

    def bias_ok(x, bias, *args, **kwargs):
        return tensor_ok(x) and same_kind(x, bias) and x.dim() >= 1 and bias.shape in (x.shape[-1:], x.shape)

    def glu_ok(gate, up=None, *args, **kwargs):
        if not tensor_ok(gate) or not same_kind(gate, up):
            return False
        return gate.dim() > 0 and gate.shape[-1] % 2 == 0 if up is None else up.shape == gate.shape

    # The PyTorch functions they replace, with the signatures of brrr's (F.gelu takes approximate by
    # keyword only).
    def bias_gelu_reference(x, bias, approximate="none"):
        return F.gelu(x + bias, approximate=approximate)

    def bias_silu_reference(x, bias):
        return F.silu(x + bias)

    def halves(gate, up):
        return _halves(gate) if up is None else (gate, up)  # ValueError naming x for a 0-d x or an odd last dim

    def swiglu_reference(gate, up=None):
        gate, up = halves(gate, up)
        return F.silu(gate) * up

    def geglu_reference(gate, up=None, approximate="none"):
        gate, up = halves(gate, up)
        return F.gelu(gate, approximate=approximate) * up

    # On CPU tensors brrr's SwiGLU and GeGLU measured faster than PyTorch's act(gate) * up at
    # every size measured (docs/cpu.md); the bias forms are not measured.
    for name, reference, implementation, supports, cpu in [
        ("bias_gelu", bias_gelu_reference, bias_gelu, bias_ok, "pytorch"),
        ("bias_silu", bias_silu_reference, bias_silu, bias_ok, "pytorch"),
        ("swiglu", swiglu_reference, glu_("silu"), glu_ok, "kernel"),
        ("geglu", geglu_reference, geglu_, glu_ok, "kernel"),
    ]:
        registry.register(name, reference, implementation, supports, compiled="inductor", cpu=cpu)

    class SwiGLU(torch.nn.Module):
        """silu(x[..., :d]) * x[..., d:]: the activation of a fused gate/up projection."""

        def forward(self, x):
            return dispatch("swiglu", x)

    class GeGLU(torch.nn.Module):
        """gelu(x[..., :d]) * x[..., d:]."""

        def __init__(self, approximate="none"):
            super().__init__()
            self.approximate = approximate

        def forward(self, x):
            return dispatch("geglu", x, approximate=self.approximate)

        def extra_repr(self):  # as torch.nn.GELU's
            return f"approximate={self.approximate!r}"

    return SimpleNamespace(glu=glu, backward=backward_op, modules=[SwiGLU, GeGLU], functional={})
