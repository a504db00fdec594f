"""Rematerialisation across op boundaries: the input of a linear layer recomputed in the backward
from tensors that are saved anyway, instead of being saved by the linear layer itself.

    q, k, v = brrr.norm_linear(norm, x, [w_q, w_k, w_v])   # linear(norm(x), w) for each w
    y = brrr.glu_linear(gate, up, w_down)                   # linear(silu(gate) * up, w_down)

A linear layer saves its input for its weight gradient. In a pre-norm decoder layer that input
is a norm's output (the q/k/v and gate/up projections' inputs) or a GLU's output (the down
projection's), a tensor of its own that nothing else saves: the norm's backward needs its input
and statistics, the GLU's its gate and up. Here the linear layers save those instead, which are
held anyway, and the backward recomputes the norm's or the GLU's output from them once (one
memory-bound pass), shared by every linear layer it feeds, and drops it when the last of them is
done. The results and gradients are those of the plain composition: brrr's kernels compute the
same bits again.

norm: a deterministic function of x alone (e.g. functools.partial(brrr.rms_norm,
normalized_shape=..., weight=w, eps=...) or a norm module). Under torch.compile these are the
plain composition: AOTAutograd's partitioner decides what to recompute there.
"""

import functools

import torch
import torch.nn.functional as F

from . import _op  # noqa: F401 - loading it registers the families' ops
from ._registry import registry


class Recompute:
    """How a linear layer's input is made again in the backward: fn(*inputs), where the inputs are
    tensors the producer's backward saves anyway; the value while the consumers' backward need it.
    The tensors fn holds itself (a norm module's weight, a partial's) are not saved: their
    versions are, so that one changed in place before the backward raises as autograd does for a
    saved tensor, instead of giving the gradient of another h. fn runs again in the autocast state
    it ran in (device: the output's), which need not be that of the linear layers it feeds."""

    def __init__(self, fn, device):
        self.fn = fn
        self.autocast = _autocast_state(device)
        self.value = None
        self.pending = 0  # consumers whose backward has not run yet
        self.held = [(t, t._version) for t in _held_tensors(fn)]

    def check_held(self):
        for t, version in self.held:
            if t._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a tensor of shape {tuple(t.shape)} that brrr.remat recomputes a linear layer's "
                    f"input with (held by its norm or GLU) is at version {t._version}; expected version {version}")


def _held_tensors(fn):
    """The tensors fn reads besides its arguments, where they can be seen: a module's parameters and
    buffers (fn a module or its bound method), a functools.partial's tensor arguments."""
    if isinstance(fn, functools.partial):
        return [t for t in (*fn.args, *fn.keywords.values()) if isinstance(t, torch.Tensor)] + _held_tensors(fn.func)
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    return [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []


# brrr.patch(remat="auto") recomputes an output of at least this many bytes (16 MiB: 4096 tokens
# of a 2048-wide bf16 model). Below it the recompute's kernel launches cost more than its bytes
# (a memory-bound pass over 16 MiB takes about 8 us on an H200, a launch from Python about as
# long), and the bytes saved are few: on an H200 (c62e08c), remat of every output cost a small
# Llama's host-bound step (1024 tokens, hidden 1024) 7.8% eager and 2.2% captured.
AUTO_MIN_BYTES = 2**24


def tag(output, fn, *inputs, min_bytes=0):
    """Mark `output` (= fn(*inputs), bitwise) as recomputable for the linear layers it feeds
    (linear()); where autograd records it, outside torch.compile, if it holds at least min_bytes."""
    if (output.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and output.numel() * output.element_size() >= min_bytes):
        output._brrr_recompute = (Recompute(fn, output.device.type), inputs, output._version)
    return output


def _autocast_state(device):
    """(device, autocast's dtype there, or None where it is off): what _in_autocast_state restores."""
    return device, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _in_autocast_state(state):
    device, dtype = state
    return torch.autocast(device, dtype=dtype, enabled=dtype is not None)


class _RematLinear(torch.autograd.Function):
    """F.linear(h, weight, bias) that saves the inputs of h's recomputation, not h."""

    @staticmethod
    def forward(ctx, h, weight, bias, recompute, *inputs):
        ctx.recompute, ctx.has_bias = recompute, bias is not None
        # The backward runs in the forward's autocast state, as F.linear's would: its matmuls in
        # autocast's dtype (the engine casts the gradients back to the inputs' dtypes), h recomputed
        # as the forward made it.
        ctx.autocast = _autocast_state(h.device.type)
        recompute.pending += 1
        ctx.save_for_backward(weight, *inputs)
        return F.linear(h, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        with _in_autocast_state(ctx.autocast):
            return _RematLinear._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        weight, *inputs = ctx.saved_tensors
        recompute = ctx.recompute
        recompute.check_held()
        with _in_autocast_state(recompute.autocast):
            if torch.is_grad_enabled():
                # create_graph: h recomputed with its graph, so that the gradients depend on the inputs
                # as the plain composition's do (a second derivative is then its fn's own, or its error).
                h = recompute.fn(*inputs)
            else:
                if recompute.value is None:
                    with torch.no_grad():
                        recompute.value = recompute.fn(*inputs)
                h = recompute.value
        recompute.pending -= 1
        if recompute.pending == 0:
            recompute.value = None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_h = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = rows.t().mm(h.reshape(-1, h.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (grad_h, grad_weight, grad_bias, None) + (None,) * len(inputs)


def linear(h, weight, bias=None):
    """F.linear(h, weight, bias), saving the inputs of h's recomputation instead of h where h was
    tagged (and autograd records the call, outside torch.compile)."""
    recipe = getattr(h, "_brrr_recompute", None)
    # h changed in place since it was tagged (its version): fn(*inputs) would not make it again.
    if recipe is None or recipe[2] != h._version or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return F.linear(h, weight, bias)
    recompute, inputs, _ = recipe
    return _RematLinear.apply(h, weight, bias, recompute, *inputs)


def _check_linear_param(names, weight, bias, features, input_of):
    """weight (out, features) and bias (out,) or None, of the input's dtype (but under autocast,
    which casts them), for F.linear on `features` inputs; names: theirs, as the public function
    spells them; input_of: (the argument the input comes from, the input F.linear gets)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"argument {names[0]}: expected a torch.Tensor, got {type(weight).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"argument {names[1]}: expected a torch.Tensor, got {type(bias).__name__}")
    if weight.dim() != 2 or weight.shape[1] != features:
        raise ValueError(f"argument {names[0]}: expected shape (out, {features}), got {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"argument {names[1]}: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    source, h = input_of
    if torch.is_autocast_enabled(h.device.type):
        return
    for name, t in zip(names, (weight, bias)):
        if t is not None and t.dtype != h.dtype:
            raise ValueError(f"argument {name} has dtype {str(t.dtype).removeprefix('torch.')} but {source} has dtype "
                             f"{str(h.dtype).removeprefix('torch.')}")


def norm_linear(norm, x, weights, biases=None):
    """[F.linear(norm(x), w, b) for each weight w (and bias b)], norm(x) recomputed in the
    backward (once, for all of them) instead of saved; saved where norm is a module with hooks,
    which a recompute would run again."""
    if not callable(norm):
        raise TypeError(f"argument norm: expected a callable (a norm module or function), got {type(norm).__name__}")
    # Lists: a tensor would be iterated by its rows.
    if not isinstance(weights, (list, tuple)):
        raise TypeError(f"argument weights: expected a list or tuple of tensors, got {type(weights).__name__}")
    if biases is not None and not isinstance(biases, (list, tuple)):
        raise TypeError(f"argument biases: expected a list or tuple of tensors, got {type(biases).__name__}")
    biases = [None] * len(weights) if biases is None else biases
    if len(biases) != len(weights):
        raise ValueError(f"argument biases: expected {len(weights)} (one per weight), got {len(biases)}")
    h = norm(x)
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"argument norm: expected a callable returning a tensor, got a {type(h).__name__} from it")
    features = h.shape[-1] if h.dim() else 1
    for i, (w, b) in enumerate(zip(weights, biases)):
        _check_linear_param((f"weights[{i}]", f"biases[{i}]"), w, b, features, ("x", h))
    if not _runs_hooks(norm):  # a recompute would run them again, in the backward
        h = tag(h, norm, x)
    return [linear(h, w, b) for w, b in zip(weights, biases)]


def _runs_hooks(fn):
    """Whether calling fn, a module, runs hooks besides its forward (its own or global ones)."""
    hooks = torch.nn.modules.module
    return isinstance(fn, torch.nn.Module) and bool(
        fn._forward_hooks or fn._forward_pre_hooks or fn._backward_hooks or fn._backward_pre_hooks
        or hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks)


def glu_linear(gate, up, weight, bias=None, *, activation="silu"):
    """F.linear(act(gate) * up, weight, bias) (act: "silu", "gelu" or "gelu_tanh"; up None: gate
    split in halves along its last dim), the GLU's output recomputed in the backward from gate and
    up (which the GLU's backward saves) instead of saved by the linear layer."""
    if not isinstance(activation, str):
        raise TypeError(f"argument activation: expected 'silu', 'gelu' or 'gelu_tanh', got {type(activation).__name__}")
    if activation not in _GLUS:
        raise ValueError(f"argument activation: expected 'silu', 'gelu' or 'gelu_tanh', got {activation!r}")
    op, kwargs = _GLUS[activation]

    def act(*gate_up):
        return registry(op, *gate_up, **kwargs)

    inputs = (gate,) if up is None else (gate, up)
    for name, t in zip(("gate", "up"), inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument {name}: expected a torch.Tensor, got {type(t).__name__}")
    if up is not None and up.shape != gate.shape:
        raise ValueError(f"argument up: expected gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up is None and (gate.dim() == 0 or gate.shape[-1] % 2):
        raise ValueError(f"argument gate: expected a last dim of even size to split in halves (up None), "
                         f"got shape {tuple(gate.shape)}")
    h = act(*inputs)
    _check_linear_param(("weight", "bias"), weight, bias, h.shape[-1] if h.dim() else 1, ("gate", h))
    return linear(tag(h, act, *inputs), weight, bias)


_GLUS = {"silu": ("swiglu", {}), "gelu": ("geglu", {}), "gelu_tanh": ("geglu", {"approximate": "tanh"})}
