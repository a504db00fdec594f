"""Elementwise chains: any sequence of elementwise steps in one pass over memory.

    f = brrr.chain("cos", "cos")              # cos(cos(x)) in one kernel
    g = brrr.chain(("mul", 2.0), "gelu")      # gelu(2 x)
    h = brrr.chain("add_tensor", "gelu")      # gelu(x + bias), bias of shape x.shape[-1:] or x.shape
    y = f(x)                                  # torch.Tensor, numpy.ndarray or any DLPack array

Steps: relu, gelu (erf form), gelu_tanh, silu, sigmoid, tanh, exp, cos, sin, abs, neg, square,
sqrt, rsqrt, log, log1p, expm1, reciprocal, softplus (beta 1, threshold 20), mish, hardswish;
with a Python number c: ("add", c), ("mul", c), ("pow", c), ("clamp_min", c) (max with c),
("clamp_max", c) (min with c), ("leaky_relu", c) (c: the negative slope); and add_tensor /
mul_tensor, which take the chain's next positional tensor argument (at most 4 of them). Math
runs in fp32 for float16/bfloat16/float32 (fp64 for float64).

On CUDA a chain runs as a kernel compiled for its exact steps on first use (NVRTC; any number of
steps in one pass), else interpreted by precompiled kernels (at most 16 steps): docs/chains.md.
With PyTorch tensors that require grad the chain is differentiable: the forward saves only its
inputs, and the backward recomputes the chain per element from x.
"""

from . import _C
from ._args import bad_choice, refuse_kinds
from ._frameworks import empty_like, torch_ops_if_tensor

SCALAR_OPS = ("add", "mul", "pow", "clamp_min", "clamp_max", "leaky_relu")
TENSOR_OPS = ("add_tensor", "mul_tensor")
OPERAND_NAMES = tuple(f"operands[{i}]" for i in range(_C.MAX_CHAIN_OPERANDS))  # as brrr._C names them


class Chain:
    """A compiled chain of elementwise steps; call it like a function."""

    __slots__ = ("steps", "op_names", "scalars", "program", "n_operands")

    def __init__(self, *steps):
        ops, scalars = [], []
        for i, step in enumerate(steps):
            if isinstance(step, str):
                name, scalar = step, None
            elif isinstance(step, tuple) and len(step) == 2:
                name, scalar = step
            else:
                raise TypeError(f"argument steps[{i}]: expected an op name or a (name, scalar) pair, got {step!r}")
            ops.append(name)
            scalars.append(scalar)
        self.program = _C.chain_program([o if s is None else (o, s) for o, s in zip(ops, scalars)])
        self.steps = tuple(o if s is None else (o, float(s)) for o, s in zip(ops, scalars))
        self.op_names = ",".join(ops)
        self.scalars = [0.0 if s is None else float(s) for s in scalars]
        self.n_operands = sum(op in TENSOR_OPS for op in ops)

    def __call__(self, x, *operands, out=None, stream=None):
        if len(operands) != self.n_operands:
            raise TypeError(f"{self!r} takes {self.n_operands} tensor operand(s) after x, got {len(operands)}")
        torch_ops = torch_ops_if_tensor(x)
        if torch_ops is not None:
            try:
                return torch_ops.chain(self, x, operands, out, stream)
            except RuntimeError:
                refuse_kinds(("x", x), *zip(OPERAND_NAMES, operands), ("out", out))
                raise
        if out is None and not _is_numpy(x):
            if not hasattr(x, "__dlpack__"):
                raise TypeError(f"argument x: expected a tensor or array implementing __dlpack__, got {type(x).__name__}")
            out = empty_like(x)
            if out is None:
                raise TypeError(f"argument out: required for inputs of type {type(x).__name__} "
                                "(it has no __array_namespace__ to allocate with)")
        return _C.chain_fwd(x, out, self.program, operands, -1 if stream is None else stream)[0]

    def __repr__(self):
        return "brrr.chain(" + ", ".join(repr(s) for s in self.steps) + ")"

    def __eq__(self, other):
        return isinstance(other, Chain) and self.steps == other.steps

    def __hash__(self):
        return hash(self.steps)


def _is_numpy(x):
    return type(x).__module__ == "numpy"


def chain(*steps) -> Chain:
    """Compile `steps` into one fused elementwise op (see the module docstring)."""
    return Chain(*steps)


_RELU, _GELU, _GELU_TANH = Chain("relu"), Chain("gelu"), Chain("gelu_tanh")
_SILU, _SIGMOID, _TANH = Chain("silu"), Chain("sigmoid"), Chain("tanh")
_EXP, _COS, _SIN = Chain("exp"), Chain("cos"), Chain("sin")


def relu(x, *, out=None):
    """max(x, 0), NaN propagating as in torch.relu."""
    return _RELU(x, out=out)


def gelu_step(approximate):
    """The chain step of torch's gelu(approximate=...): "gelu" (the erf form) or "gelu_tanh"."""
    if isinstance(approximate, str):
        if approximate == "none":
            return "gelu"
        if approximate == "tanh":
            return "gelu_tanh"
    raise bad_choice("approximate", approximate, ("none", "tanh"))


def gelu(x, approximate="none", *, out=None):
    """x * Phi(x); approximate='tanh' uses the tanh form, as torch.nn.functional.gelu does."""
    return (_GELU if gelu_step(approximate) == "gelu" else _GELU_TANH)(x, out=out)


def silu(x, *, out=None):
    """x * sigmoid(x)."""
    return _SILU(x, out=out)


def sigmoid(x, *, out=None):
    """1 / (1 + exp(-x))."""
    return _SIGMOID(x, out=out)


def tanh(x, *, out=None):
    return _TANH(x, out=out)


def exp(x, *, out=None):
    return _EXP(x, out=out)


def cos(x, *, out=None):
    return _COS(x, out=out)


def sin(x, *, out=None):
    return _SIN(x, out=out)
