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
inputs, and the backward recomputes the chain per element from x (relu, sigmoid and tanh alone
save their output, as torch's do).
"""

import math

from . import _C, _frameworks
from ._args import bad_choice, refuse_kinds
from ._frameworks import check_torch, compiling, empty_like, torch_if_tensor
from ._integration import torch_integration

SCALAR_OPS = ("add", "mul", "pow", "clamp_min", "clamp_max", "leaky_relu")
TENSOR_OPS = ("add_tensor", "mul_tensor")
OPERAND_NAMES = tuple(f"operands[{i}]" for i in range(_C.MAX_CHAIN_OPERANDS))  # as brrr._C names them


class Chain:
    """A compiled chain of elementwise steps; call it like a function."""

    # jax.jit keeps weak references; torch_op and torch_args: set on the public functions' chains by
    # brrr's PyTorch layer (_unary)
    __slots__ = ("steps", "op_names", "scalars", "program", "n_operands", "torch_op", "torch_args", "__weakref__")

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
        # The program brrr._C runs outside PyTorch (NumPy, CuPy, JAX; out=): not made while
        # torch.compile traces a chain built in the compiled function (a C call would break the
        # graph), where the steps are checked when the operator makes its program.
        self.program = None if compiling() else _C.chain_program(
            [o if s is None else (o, s) for o, s in zip(ops, scalars)])
        self.steps = tuple(o if s is None else (o, float(s)) for o, s in zip(ops, scalars))
        self.op_names = ",".join(ops)
        self.scalars = [0.0 if s is None else float(s) for s in scalars]
        self.n_operands = sum(op in TENSOR_OPS for op in ops)

    def __call__(self, x, *operands, out=None, stream=None):
        if len(operands) != self.n_operands:
            raise TypeError(f"argument operands: {self!r} takes {self.n_operands} tensor operand(s) after x, got "
                            f"{len(operands)}")
        if torch_if_tensor(x) is not None:
            try:
                return torch_layer().chain(self, x, operands, out, stream)
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

    def _key(self):
        # -0.0 == 0.0 as floats, not as steps: ("mul", -0.0) then "reciprocal" gives -inf.
        return tuple(s if isinstance(s, str) else (*s, math.copysign(1.0, s[1])) for s in self.steps)

    def __eq__(self, other):
        return isinstance(other, Chain) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


def _is_numpy(x):
    return type(x).__module__ == "numpy"


def chain(*steps) -> Chain:
    """Compile `steps` into one fused elementwise op (see the module docstring)."""
    return Chain(*steps)


_RELU, _GELU, _GELU_TANH = Chain("relu"), Chain("gelu"), Chain("gelu_tanh")
_SILU, _SIGMOID, _TANH = Chain("silu"), Chain("sigmoid"), Chain("tanh")
_EXP, _COS, _SIN = Chain("exp"), Chain("cos"), Chain("sin")
# sigmoid'(x) and tanh'(x) as chains of y = sigmoid(x) or tanh(x) times the incoming gradient:
# y (1 - y) grad (operands y, grad) and (1 - y^2) grad (operand grad).
_DERIVATIVE_OF_SIGMOID = Chain(("mul", -1.0), ("add", 1.0), "mul_tensor", "mul_tensor")
_DERIVATIVE_OF_TANH = Chain("square", ("mul", -1.0), ("add", 1.0), "mul_tensor")


def _unary(c, name, doc):
    """The public function of chain c of one step. A plain torch tensor without out goes straight
    to the step's op (c.torch_op, which brrr's PyTorch layer sets): Chain.__call__'s framework
    dispatch costs a tiny tensor's forward about a third of its host time."""

    def function(x, *, out=None):
        if out is None and x.__class__ in _frameworks.TORCH_PLAIN:
            try:
                return c.torch_op(x, *c.torch_args)
            except RuntimeError:  # as Chain.__call__: a kind of tensor brrr refuses (sparse), by name
                refuse_kinds(("x", x))
                raise
        return c(x, out=out)

    function.__name__ = function.__qualname__ = name
    function.__doc__ = doc
    return function


relu = _unary(_RELU, "relu", "max(x, 0), NaN propagating as in torch.relu.")
silu = _unary(_SILU, "silu", "x * sigmoid(x).")
sigmoid = _unary(_SIGMOID, "sigmoid", "1 / (1 + exp(-x)).")
tanh = _unary(_TANH, "tanh", "tanh(x).")
exp = _unary(_EXP, "exp", "exp(x).")
cos = _unary(_COS, "cos", "cos(x).")
sin = _unary(_SIN, "sin", "sin(x).")


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
    if approximate.__class__ is str and approximate == "none":  # the usual call, without gelu_step's frame
        if out is None and x.__class__ in _frameworks.TORCH_PLAIN:  # as _unary's functions do
            try:
                return _GELU.torch_op(x, *_GELU.torch_args)
            except RuntimeError:
                refuse_kinds(("x", x))
                raise
        return _GELU(x, out=out)
    return (_GELU if gelu_step(approximate) == "gelu" else _GELU_TANH)(x, out=out)


# ---- PyTorch: the custom ops brrr::chain (a chain by its op names, joined by commas, and scalars;
# its tensor operands in a list) and brrr::chain_backward ([grad_x] + the gradients of the operands
# asked for, in one kernel), the registry's elementwise ops and their brrr.nn modules.

@torch_integration
def torch_layer():
    import functools
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    from . import _op
    from ._op import TorchOp, out_like, stream
    from ._registry import dispatch, registry, tensor_ok

    Tensor = torch.Tensor

    def signed(scalars):
        """The cache key of scalars: 0.0 and -0.0 are equal as floats but not as steps
        (("mul", -0.0) then "reciprocal" gives -inf)."""
        return tuple((s, math.copysign(1.0, s)) for s in scalars)

    # The programs of chains whose steps take no scalar (every registry activation), by their op
    # names alone: their scalars are placeholders, and signing them for the cache key cost about
    # 0.5 us a call on this project's CPU machine (a generator over them, then a tuple to hash).
    unscaled, unscaled_with_backward = {}, {}

    @functools.lru_cache(maxsize=1024)
    def compiled(ops, signed_scalars):
        names = ops.split(",") if ops else []
        if len(names) != len(signed_scalars):
            raise ValueError(f"brrr::chain: argument scalars: expected one per step of ops ({len(names)}), got "
                             f"{len(signed_scalars)}")
        p = _C.chain_program([(o, s) if o in SCALAR_OPS else o for o, (s, _) in zip(names, signed_scalars)])
        if len(unscaled) < 1024 and not any(o in SCALAR_OPS for o in names):
            unscaled[ops] = p, len(names)
        return p

    def program(ops, scalars):
        """The compiled chain of op names joined by commas (custom-op schemas take no list of str)."""
        hit = unscaled.get(ops)
        return hit[0] if hit is not None and hit[1] == len(scalars) else compiled(ops, signed(scalars))

    @functools.lru_cache(maxsize=1024)
    def compiled_with_backward(ops, signed_scalars):
        p = compiled(ops, signed_scalars)
        _C.chain_jit_with_backward(p)
        if ops in unscaled:
            unscaled_with_backward[ops] = p, len(signed_scalars)
        return p

    def program_with_backward(ops, scalars):
        """program(ops, scalars), its backward said to be wanted: on CUDA its forward kernel and
        its backward are compiled at once, on two threads."""
        hit = unscaled_with_backward.get(ops)
        return (hit[0] if hit is not None and hit[1] == len(scalars) else
                compiled_with_backward(ops, signed(scalars)))

    def run_forward(x, operands, program_):
        if _op.EXCHANGE_API and x.is_contiguous():  # the usual call: brrr._C allocates and finds the stream
            return _C.chain_fwd(x, None, program_, tuple(operands))[0]
        return _C.chain_fwd(x, out_like(x), program_, tuple(operands), stream(x))[0]

    def forward(x: Tensor, operands: list[Tensor], ops: str, scalars: list[float]) -> Tensor:
        """Where autograd records the op (and under torch.compile, which may differentiate it)."""
        return run_forward(x, operands, program_with_backward(ops, scalars))

    def inference(x, operands, ops, scalars):
        # program's and run_forward's lines, without their frames: this is a tiny tensor's whole
        # path below the op's entry where nothing records (the public activations' forward)
        hit = unscaled.get(ops)
        p = hit[0] if hit is not None and hit[1] == len(scalars) else compiled(ops, signed(scalars))
        if _op.EXCHANGE_API and x.is_contiguous():
            return _C.chain_fwd(x, None, p, tuple(operands))[0]
        return _C.chain_fwd(x, out_like(x), p, tuple(operands), stream(x))[0]

    def fake(x, operands, ops, scalars):
        return torch.empty_like(x)

    def backward_forward(x: Tensor, grad: Tensor, operands: list[Tensor], ops: str, scalars: list[float],
                         operand_needs_grad: list[bool]) -> list[Tensor]:
        """[grad_x] + the gradient of each operand whose operand_needs_grad is True, in one kernel."""
        grad_operands, partials = (), None
        if operands:
            # With no rows, a bias gradient is a sum of nothing: zeros (the kernels never run).
            new_grad = torch.zeros_like if x.numel() == 0 else torch.empty_like
            grad_operands = tuple(new_grad(o) if need else None for o, need in zip(operands, operand_needs_grad))
            if x.is_cuda and x.numel() > 0 and any(need and o.shape != x.shape
                                                   for o, need in zip(operands, operand_needs_grad)):
                cols = x.shape[-1]  # a vector operand's gradient: column sums, through partial rows
                partials = torch.empty(len(operands) * _C.chain_partial_rows(x.numel() // cols) * cols,
                                       device=x.device,
                                       dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        if _op.EXCHANGE_API and partials is None and x.is_contiguous():  # as run_forward
            grad_x = _C.chain_bwd(x, grad, None, None, program(ops, scalars), tuple(operands), grad_operands)[0]
        else:
            grad_x = _C.chain_bwd(x, grad, out_like(x), partials, program(ops, scalars), tuple(operands),
                                  grad_operands, stream(x))[0]
        return [grad_x, *(g for g in grad_operands if g is not None)]

    def backward_fake(x, grad, operands, ops, scalars, operand_needs_grad):
        return [torch.empty_like(x)] + [torch.empty_like(o) for o, need in zip(operands, operand_needs_grad) if need]

    backward_op = TorchOp("chain_backward", backward_forward, backward_fake)

    def save(ctx, args, results):
        x, operands, ctx.ops, ctx.scalars = args
        ctx.save_for_backward(x, *operands)

    def formula(ctx, grads, run):
        (grad,), (x, *operands) = grads, ctx.saved_tensors
        if grad is None:
            return None, None, None, None
        needs = list(ctx.needs_input_grad[1]) if operands else []
        got = run(backward_op)(x, grad, operands, ctx.ops, ctx.scalars, needs)
        rest = iter(got[1:])
        return got[0], [next(rest) if need else None for need in needs] if operands else None, None, None

    chain_op = TorchOp("chain", forward, fake, save=save, backward=formula, grad_args=(0, 1), inference=inference)

    # relu, sigmoid and tanh save their output, as torch's do: the op after them (a Linear) saves it
    # anyway, where their input would be one more activation a layer. The derivative is relu's own
    # at y (y > 0 exactly where x > 0), for sigmoid and tanh a chain of y: y (1 - y) and 1 - y^2.
    def derivative_forward(y: Tensor, operands: list[Tensor], ops: str, scalars: list[float]) -> Tensor:
        return run_forward(y, operands, program(ops, scalars))

    derivative_op = TorchOp("chain_of_output", derivative_forward, fake)

    def saving_output(c):
        recording = forward if c is _RELU else inference  # (only relu's backward is the chain's own)

        def forward_(x: Tensor) -> Tensor:
            return recording(x, [], c.op_names, c.scalars)

        def inference_(x):
            return inference(x, [], c.op_names, c.scalars)

        def save_(ctx, args, results):
            ctx.save_for_backward(results[0])

        def formula_(ctx, grads, run):
            (grad,), (y,) = grads, ctx.saved_tensors
            if grad is None:
                return (None,)
            if c is _RELU:
                return (run(backward_op)(y, grad, [], c.op_names, c.scalars, [])[0],)
            d = _DERIVATIVE_OF_SIGMOID if c is _SIGMOID else _DERIVATIVE_OF_TANH
            return (run(derivative_op)(y, [y, grad] if c is _SIGMOID else [grad], d.op_names, d.scalars),)

        return TorchOp(c.op_names, forward_, lambda x: torch.empty_like(x), save=save_, backward=formula_,
                       inference=inference_)

    by_output = {c.op_names: saving_output(c) for c in (_RELU, _SIGMOID, _TANH)}
    # the public functions' ops (_unary): each chain's op and its arguments after x
    for c in (_RELU, _GELU, _SILU, _SIGMOID, _TANH, _EXP, _COS, _SIN):
        op = by_output.get(c.op_names)
        c.torch_op, c.torch_args = (op, ()) if op is not None else (chain_op, ((), c.op_names, c.scalars))

    def chain(c, x, operands, out, cuda_stream):
        """Chain `c` on torch tensors: its op, or with `out` or a stream given, straight to brrr._C
        (refusing `out` where autograd records the op or torch.compile traces it)."""
        if operands:
            check_torch(operands, OPERAND_NAMES)
        args = (x, operands, c.op_names, c.scalars)
        if out is None and cuda_stream is None:
            op = by_output.get(c.op_names)
            return chain_op(*args) if op is None else op(x)
        check_torch((out,), ("out",))
        if out is None and not chain_op.runs_forward(args):
            return chain_op(*args)

        def forward():
            return _C.chain_fwd(x, out_like(x) if out is None else out, c.program, operands,
                                stream(x) if cuda_stream is None else cuda_stream)[0]
        return forward() if out is None else chain_op.write(args, out, forward, OUT_REFUSED)

    # ---- the registry: brrr's implementations for the torch tensors `supports` lets through call
    # the op directly, without the public functions' framework dispatch (host time: the registry
    # sits on every patched module's forward).
    def unary(c):
        op = by_output.get(c.op_names)
        if op is not None:
            return lambda x: op(x)  # (a TorchOp takes its arguments by position only)
        return lambda x: chain_op(x, [], c.op_names, c.scalars)

    def gelu_(x, approximate="none"):
        c = _GELU_TANH if approximate == "tanh" else _GELU
        return chain_op(x, [], c.op_names, c.scalars)

    def unary_ok(x, *args, **kwargs):
        return tensor_ok(x)

    def gelu_ok(x, approximate="none"):
        return tensor_ok(x) and approximate in ("none", "tanh")

    # PyTorch's CPU kernels of the erf GELU, ReLU, SiLU and sigmoid measured as fast as brrr's or
    # faster, tanh's slower (brrr/_registry.py).
    for name, reference, implementation, supports, cpu in [
        ("relu", torch.relu, unary(_RELU), unary_ok, "pytorch"),
        ("gelu", F.gelu, gelu_, gelu_ok, "pytorch"),
        ("silu", F.silu, unary(_SILU), unary_ok, "pytorch"),
        ("sigmoid", torch.sigmoid, unary(_SIGMOID), unary_ok, "pytorch"),
        ("tanh", torch.tanh, unary(_TANH), unary_ok, "kernel"),
    ]:
        registry.register(name, reference, implementation, supports, compiled="inductor", cpu=cpu)

    class GELU(torch.nn.GELU):
        def forward(self, input):  # torch.nn.GELU's argument name, as the twins' below
            return dispatch("gelu", input, approximate=self.approximate)

    def twin(base, name):
        """torch.nn's activation module `base`, its forward the registry's op `name`; with
        inplace=True (ReLU, SiLU) the base's own in-place forward, as silu_route takes it."""
        def forward(self, input):
            return base.forward(self, input) if getattr(self, "inplace", False) else dispatch(name, input)
        return type(base.__name__, (base,), {"forward": forward})

    twins = [twin(base, name) for base, name in
             ((torch.nn.SiLU, "silu"), (torch.nn.ReLU, "relu"), (torch.nn.Sigmoid, "sigmoid"), (torch.nn.Tanh, "tanh"))]

    silu_ = F.silu  # torch's, bound before brrr.use_fused can route F.silu here

    def silu_route(input, inplace=False):
        return dispatch("silu", input) if not inplace else silu_(input, inplace=True)

    return SimpleNamespace(
        chain=chain, program=program, backward=backward_op, modules=[GELU, *twins],
        functional={"gelu": lambda input, approximate="none": dispatch("gelu", input, approximate=approximate),
                    "silu": silu_route})


OUT_REFUSED = ("argument out: not supported when autograd records the op, for an out that requires grad, or under "
               "torch.compile")
