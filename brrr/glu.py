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

from ._args import last_dim, named, refuse_kinds, shape_of
from .chain import Chain, gelu_step as _gelu_name
from ._frameworks import torch_ops_if_tensor

_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}
_BIAS = {name: Chain("add_tensor", op) for name, op in _ACTIVATIONS.items()}
_GLU = {name: Chain(op, "mul_tensor") for name, op in _ACTIVATIONS.items()}


_BIAS_NAMES = {"operands[0]": "bias"}  # the chain's name for it
_GLU_NAMES = {"x": "gate", "operands[0]": "up"}


def bias_gelu(x, bias, approximate="none", *, out=None):
    """gelu(x + bias) in one pass; bias has shape x.shape[-1:] (or x.shape)."""
    return named(_BIAS_NAMES, _BIAS[_gelu_name(approximate)], x, bias, out=out)


def bias_silu(x, bias, *, out=None):
    """silu(x + bias) in one pass; bias has shape x.shape[-1:] (or x.shape)."""
    return named(_BIAS_NAMES, _BIAS["silu"], x, bias, out=out)


def _halves(x):
    d = last_dim("x", x, "its last is split into gate and up halves")
    if d % 2:
        raise ValueError(f"argument x: the last dim must be even to split into gate and up halves, got {d}")
    return x[..., : d // 2], x[..., d // 2:]


def _glu(activation, gate, up, out):
    if up is None:
        torch_ops = torch_ops_if_tensor(gate)
        if torch_ops is None:
            return _GLU[activation](*_halves(gate), out=out)
        try:
            return torch_ops.glu(activation, gate, None, out)
        except RuntimeError:
            refuse_kinds(("x", gate))
            raise
    try:
        if tuple(shape_of("up", up)) != tuple(shape_of("gate", gate)):
            raise ValueError(f"argument up has shape {tuple(up.shape)} but gate has shape {tuple(gate.shape)}")
        torch_ops = torch_ops_if_tensor(gate)
        if torch_ops is not None:
            return named(_GLU_NAMES, torch_ops.glu, activation, gate, up, out)
    except RuntimeError:
        refuse_kinds(("gate", gate), ("up", up))
        raise
    return named(_GLU_NAMES, _GLU[activation], gate, up, out=out)


def swiglu(gate, up=None, *, out=None):
    """silu(gate) * up; with up=None, gate is split in halves along its last dim (gate first)."""
    return _glu("silu", gate, up, out)


def geglu(gate, up=None, approximate="none", *, out=None):
    """gelu(gate) * up; with up=None, gate is split in halves along its last dim (gate first)."""
    return _glu(_gelu_name(approximate), gate, up, out)
