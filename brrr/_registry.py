"""The op registry: every fused op once by name, with its implementations per device.

    from brrr import registry
    registry.names()                         # ('bias_gelu', 'gelu', 'layer_norm', ...)
    registry("gelu", x, approximate="tanh")  # brrr's kernel where it supports x, else PyTorch's
    registry.override("gelu", my_gelu)       # your implementation instead of brrr's (all devices)
    registry.override("gelu", my_gelu, device="cuda")
    registry.reset("gelu")                   # back to brrr's
    registry.on_unsupported("gelu", "raise") # unsupported input: UnsupportedError, not a fallback
    registry.under_compile("rms_norm", "kernel")  # brrr's kernel in compiled graphs too
    registry.on_cpu("gelu", "kernel")        # brrr's CPU kernel for CPU tensors (default: the faster, measured)

Under torch.compile an op runs one of two ways. "kernel": brrr's custom op sits in the graph as
one opaque node. "inductor": the PyTorch function it replaces is traced instead, so that inductor
fuses it with its neighbours, as it does in an unpatched model. The defaults follow what was
measured in compiled training steps of transformers' Llama and GPT-2 on an H200
(benchmarks/results/h200-2026-12-01-e130eba/): norms, activations and GLUs default to "inductor"
(inductor folds the residual adds and casts around them into its own kernels, which an opaque op
prevents, and its SwiGLU backward took 108 us a layer against brrr's 191 us); cross_entropy (its
forward reads the logits once, inductor's twice), linear_cross_entropy (inductor's would hold the
logits whole) and bias_dropout_add (its reference draws its mask from torch's generator, not from
the seed) to "kernel".

On CPU tensors each op runs brrr's CPU kernel or the PyTorch function it replaces, whichever
measured faster on this project's 2-core CPU machine (benchmarks/cpu_twins.py, numbers in
benchmarks/results/cpu-2026-12-02.md; ops a user registers run their implementation there, as on
any device they list): brrr's kernel for the ops in _KERNEL_ON_CPU below, where it won both on
one thread and on two; PyTorch's for the rest (the erf GELU, ReLU, SiLU, sigmoid and LayerNorm,
where PyTorch's CPU kernels were as fast or faster; ops not measured there keep PyTorch's).
registry.on_cpu(name, "kernel" | "pytorch") changes it.

An input brrr does not support (a dtype or device it has no kernel for, mixed dtypes that
PyTorch would promote, a CUDA tensor in a build without CUDA) goes to the PyTorch function the op
replaces, unless the op is set to raise. brrr.nn, brrr.patch and brrr.use_fused all dispatch
through here, so overrides and fallbacks apply to them too.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from . import _C, _torch
from .rotary import _torch as _rotary_family
from .chain import _GELU, _GELU_TANH, _RELU, _SIGMOID, _SILU, _TANH
from .dropout import bias_dropout_add
from .glu import _gelu_name, bias_gelu, bias_silu
from .norm import _torch as _norm_family, llama_order
from .softmax import _torch as _softmax_family
from .xent import REDUCTIONS, cross_entropy, linear_cross_entropy


class UnsupportedError(TypeError):
    """brrr has no kernel for these arguments and the op is set to raise instead of falling back."""


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_CUDA = _C.cuda_available()  # asked once: torch.compile must not meet a C call in the dispatch
_softmax_torch = _softmax_family()
_norm_torch = _norm_family()
_brrr_rotary, _brrr_rotary_qk = _rotary_family().rotary, _rotary_family().rotary_qk


def _device_ok(t):
    # is_cpu / is_cuda: no torch.device object made (these checks run on every registry call)
    return t.is_cpu or (t.is_cuda and _CUDA)


def _tensor_ok(x):
    return (isinstance(x, torch.Tensor) and x.dtype in _FLOATS and _device_ok(x) and x.layout == torch.strided
            and not x.is_nested)


def _same_kind(x, *others):
    return all(o is None or (isinstance(o, torch.Tensor) and o.dtype == x.dtype and o.device == x.device)
               for o in others)


_HALF = (torch.float16, torch.bfloat16)


def _norm_params_ok(x, *params):
    # Weight and bias in x's dtype, or float32 for half inputs (as autocast leaves them).
    device = None
    for p in params:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor) or not (p.dtype == x.dtype or (p.dtype == torch.float32 and x.dtype in _HALF)):
            return False
        device = x.device if device is None else device
        if p.device != device:
            return False
    return True


def _unary_ok(x, *args, **kwargs):
    return _tensor_ok(x)


def _gelu_ok(x, approximate="none"):
    return _tensor_ok(x) and approximate in ("none", "tanh")


def _bias_ok(x, bias, *args, **kwargs):
    return _tensor_ok(x) and _same_kind(x, bias) and x.dim() >= 1 and bias.shape in (x.shape[-1:], x.shape)


def _glu_ok(gate, up=None, *args, **kwargs):
    if not _tensor_ok(gate) or not _same_kind(gate, up):
        return False
    return gate.shape[-1] % 2 == 0 if up is None else up.shape == gate.shape


def _bias_dropout_add_ok(x, bias, residual, *args, **kwargs):
    return (_tensor_ok(x) and _same_kind(x, bias, residual) and isinstance(residual, torch.Tensor) and
            residual.shape == x.shape and (bias is None or (x.dim() >= 1 and bias.shape == x.shape[-1:])))


def _layer_norm_ok(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _tensor_ok(x) and _norm_params_ok(x, weight, bias)


def _rms_norm_ok(x, normalized_shape, weight=None, eps=None, **kwargs):
    return _tensor_ok(x) and _norm_params_ok(x, weight)


def _add_norm_ok(x, residual, normalized_shape, weight=None, bias=None, *args, **kwargs):
    return _tensor_ok(x) and _same_kind(x, residual) and residual.shape == x.shape and _norm_params_ok(x, weight, bias)


def _add_rms_norm_ok(x, residual, normalized_shape, weight=None, *args, **kwargs):
    return _tensor_ok(x) and _same_kind(x, residual) and residual.shape == x.shape and _norm_params_ok(x, weight)


# brrr's implementations for the torch tensors the checks above let through: the torch layer of
# brrr.gelu, brrr.layer_norm, ... called directly, without the public functions' framework
# dispatch (host time: the registry sits on every patched module's forward).

def _unary(chain):
    return lambda x: _torch.chain(chain, x, (), None, None)


def _gelu(x, approximate="none"):
    return _torch.chain(_GELU_TANH if approximate == "tanh" else _GELU, x, (), None, None)


def _glu(activation):
    return lambda gate, up=None: _torch.glu(activation, gate, up, None)


def _geglu(gate, up=None, approximate="none"):
    return _torch.glu(_gelu_name(approximate), gate, up, None)


def _rms_norm(x, normalized_shape, weight=None, eps=None, *, cast_order="torch", offset=0.0):
    return _norm_torch.rms_norm(x, normalized_shape, weight, eps, llama_order(cast_order), offset)


def _add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, *, cast_order="torch", offset=0.0):
    return _norm_torch.add_rms_norm(x, residual, normalized_shape, weight, eps, llama_order(cast_order), offset)


_CLASS_INDICES = (torch.int64, torch.int32, torch.uint8)
# torch.nn.functional's own functions, bound at import: brrr.use_fused rebinds these names of F to
# routes into this registry, so a reference that looked them up at call time would route back
# into the registry, without end where it is the op's own fallback.
TORCH_FUNCTIONS = {name: getattr(F, name) for name in ("gelu", "silu", "layer_norm", "rms_norm", "cross_entropy",
                                                       "softmax", "log_softmax")}


def _cross_entropy_ok(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                      dtype=None, **options):
    if not _tensor_ok(input) or input.dim() == 0 or weight is not None or reduction not in REDUCTIONS:
        return False
    rows = input.shape[:1] + input.shape[2:] if input.dim() >= 2 else ()
    return _targets_ok(input, target, rows) and dtype in (None, torch.float32, torch.float64, input.dtype)


def _targets_ok(input, target, rows):
    return (isinstance(target, torch.Tensor) and target.dtype in _CLASS_INDICES and target.device == input.device
            and target.shape == rows)


def _torch_cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                         softcap=None, z_loss=0.0, dtype=None):
    """dtype: the loss's dtype, as brrr.cross_entropy takes it (the input is cast to it first);
    softcap and z_loss as brrr.cross_entropy defines them (the z-loss's mean over the counted
    rows, also with per-class weights)."""
    x = input if dtype is None else input.to(dtype)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    loss = TORCH_FUNCTIONS["cross_entropy"](x, target, weight, ignore_index=ignore_index,
                                            reduction="none" if z_loss else reduction, label_smoothing=label_smoothing)
    if not z_loss:
        return loss
    counted = target.long() != ignore_index  # in int64: a uint8 target would wrap a negative ignore_index
    loss = loss + torch.where(counted, z_loss * torch.logsumexp(x, dim=1 if x.dim() >= 2 else 0) ** 2, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() / counted.sum() if reduction == "mean" else loss.sum()


def _linear_cross_entropy_ok(input, weight, target, bias=None, *, reduction="mean", dtype=None, **options):
    return (_tensor_ok(input) and input.dim() >= 1 and isinstance(weight, torch.Tensor) and _same_kind(input, weight, bias)
            and weight.dim() == 2 and weight.shape[1] == input.shape[-1] and weight.shape[0] > 0
            and (bias is None or bias.shape == weight.shape[:1]) and reduction in REDUCTIONS
            and _targets_ok(input, target, input.shape[:-1]) and dtype in (None, torch.float32, torch.float64, input.dtype))


def _torch_linear_cross_entropy(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                                label_smoothing=0.0, softcap=None, z_loss=0.0, dtype=None, logits_budget=None):
    """The logits in full (logits_budget is brrr's alone)."""
    logits = F.linear(input, weight, bias)
    loss = _torch_cross_entropy(logits.reshape(-1, weight.shape[0]), target.reshape(-1), ignore_index=ignore_index,
                                reduction=reduction, label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                                dtype=dtype)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _softmax_ok(input, dim=None, _stacklevel=3, dtype=None):
    return _tensor_ok(input) and isinstance(dim, int) and -max(input.dim(), 1) <= dim < max(input.dim(), 1) and \
        dtype in (None,) + _FLOATS


def _softmax(log):
    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        return _softmax_torch.softmax(input, dim % max(input.dim(), 1), dtype, log)
    return softmax


def _rotated(x, cos, rotary_dim):
    """The features rotary rotates (rotary_dim, or cos's last dim), or None where they do not fit x."""
    r = (cos.shape[-1] if cos.dim() else 0) if rotary_dim is None else rotary_dim
    return r if type(r) is int and r % 2 == 0 and 2 <= r <= x.shape[-1] else None


def _rotary_ok(x, cos, sin, *, interleaved=False, rotary_dim=None):
    if not _tensor_ok(x) or not _same_kind(x, cos, sin) or x.dim() == 0 or type(interleaved) is not bool:
        return False
    r = _rotated(x, cos, rotary_dim)
    if r is None:
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False  # brrr gives cos and sin no gradient
    return _angles_fit(cos, sin, x.shape, r)


def _rotary_qk_ok(q, k, cos, sin, *, interleaved=False, rotary_dim=None):
    return (_rotary_ok(q, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim) and _tensor_ok(k) and
            k.dtype == q.dtype and k.device == q.device and
            (k.shape == q.shape or (k.dim() == q.dim() and k.shape[-1] == q.shape[-1] and
                                    _angles_fit(cos, sin, k.shape, _rotated(q, cos, rotary_dim)))))


def _angles_fit(cos, sin, shape, rotated):
    """cos and sin broadcast to x's shape with last dim `rotated` (an angle per feature) or half
    of it (one per pair), both alike."""
    last = cos.shape[-1] if cos.dim() and cos.shape[-1] in (rotated, rotated // 2) else rotated
    return _angle_fits(cos, shape, last) and (sin.shape == cos.shape or _angle_fits(sin, shape, last))


def _angle_fits(angle, shape, last):
    """Whether cos or sin broadcasts to x's shape with last dim `last` (NumPy's rules, from the
    right). Written out: torch.broadcast_shapes took 20 us of the 24 this check cost per call
    (CPU, torch 2.13), twice per attention layer."""
    n = angle.dim()
    if n == 0 or n > len(shape) or angle.shape[-1] != last:
        return False
    return all(a == b or a == 1 for a, b in zip(angle.shape[:-1], shape[len(shape) - n:-1]))


def _brrr_rotary_entry(x, cos, sin, *, interleaved=False, rotary_dim=None):
    return _brrr_rotary(x, cos, sin, interleaved, rotary_dim or 0)


def _brrr_rotary_qk_entry(q, k, cos, sin, *, interleaved=False, rotary_dim=None):
    return _brrr_rotary_qk(q, k, cos, sin, interleaved, rotary_dim or 0)


def _torch_rotary(x, cos, sin, *, interleaved=False, rotary_dim=None):
    """brrr.rotary in PyTorch ops: transformers' rotate_half forms, the angles per pair repeated."""
    r = cos.shape[-1] if rotary_dim is None else rotary_dim
    if cos.shape[-1] == r // 2:  # an angle per pair: per feature, as the pairs lie
        cos, sin = ((a.repeat_interleave(2, dim=-1) if interleaved else torch.cat((a, a), dim=-1)) for a in (cos, sin))
    rot = x[..., :r]
    if interleaved:
        turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        turned = torch.cat((-rot[..., r // 2:], rot[..., :r // 2]), dim=-1)
    out = rot * cos + turned * sin
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


def _torch_rotary_qk(q, k, cos, sin, *, interleaved=False, rotary_dim=None):
    return (_torch_rotary(q, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim),
            _torch_rotary(k, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim))


def _torch_rms_norm(x, normalized_shape, weight=None, eps=None, *, cast_order="torch", offset=0.0):
    if cast_order == "torch" and not offset:
        return TORCH_FUNCTIONS["rms_norm"](x, normalized_shape, weight, eps)
    dims = tuple(range(-(1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape))), 0))
    if offset:
        # Gemma's form: normalised in fp32 (fp64 for float64), scaled by offset + weight in that
        # dtype, one cast at the end (Llama's order: the normalised input rounded to x's dtype first).
        if weight is None:
            raise ValueError("argument offset: nonzero without weight (it is added to the weight)")
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        h = x.to(acc)
        h = h * torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + (torch.finfo(acc).eps if eps is None else eps))
        if cast_order == "llama":
            h = h.to(x.dtype).to(acc)
        return (h * (weight.to(acc) + offset)).to(x.dtype)
    # Llama's order: normalise in fp32, round to x's dtype, then scale.
    h = x.float()
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    h = (h * torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + eps)).to(x.dtype)
    return h if weight is None else weight * h


def _torch_add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    h = x + residual
    return TORCH_FUNCTIONS["layer_norm"](h, normalized_shape, weight, bias, eps), h


def _torch_add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, *, cast_order="torch", offset=0.0):
    h = x + residual
    return _torch_rms_norm(h, normalized_shape, weight, eps, cast_order=cast_order, offset=offset), h


def _torch_bias_dropout_add(x, bias, residual, p, training=True, seed=None, offset=0):
    """PyTorch's own dropout, which draws from torch's generator: seed and offset are ignored."""
    return residual + F.dropout(x if bias is None else x + bias, p, training)


def _torch_bias_act(act):
    return lambda x, bias, *args, **kwargs: act(x + bias, *args, **kwargs)


def _torch_glu(act):
    def glu(gate, up=None, *args, **kwargs):
        if up is None:
            gate, up = gate.chunk(2, dim=-1)
        return act(gate, *args, **kwargs) * up
    return glu


@dataclass
class Op:
    """One registered op: what it replaces, brrr's implementation, and the user's choices."""

    name: str
    reference: Callable  # the PyTorch function it replaces, and the fallback
    implementation: Callable
    supports: Callable  # same signature as the op: does brrr's implementation take these args?
    devices: tuple = ("cpu", "cuda")
    unsupported: str = "fallback"  # or "raise"
    overrides: dict = field(default_factory=dict)  # device type (or None for all) -> callable
    compiled: str = "kernel"  # under torch.compile: "kernel" (brrr's op) or "inductor" (the reference)
    default_compiled: str = "kernel"
    cpu: str = "kernel"  # on CPU tensors: "kernel" (the implementation) or "pytorch" (the reference)
    default_cpu: str = "kernel"

    def resolve(self, *args, **kwargs):
        """The callable that will run for these arguments."""
        device = _device_of(args)
        if self.overrides:
            override = self.overrides.get(device, self.overrides.get(None))
            if override is not None:
                return override
        if self.compiled == "inductor" and torch.compiler.is_compiling():
            return self.reference
        if device == "cpu" and self.cpu == "pytorch":
            return self.reference
        if device in self.devices and self.supports(*args, **kwargs):
            return self.implementation
        if self.unsupported == "raise":
            raise UnsupportedError(f"brrr.{self.name}: no brrr kernel for these arguments "
                                   f"({_describe(args)}); registry.on_unsupported({self.name!r}, 'fallback') "
                                   "sends them to PyTorch instead")
        return self.reference


def _device_of(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return "cuda" if a.is_cuda else a.device.type  # is_cuda: no torch.device made
    return None


def _describe(args):
    return ", ".join(f"{a.dtype} {tuple(a.shape)} on {a.device}" if isinstance(a, torch.Tensor) else type(a).__name__
                     for a in args)


class Registry:
    """Fused ops by name; call it like a function: registry(name, *args, **kwargs)."""

    def __init__(self):
        self._ops = {}

    def register(self, name, reference, implementation, supports, devices=("cpu", "cuda"), compiled="kernel",
                 cpu="kernel"):
        if name in self._ops:
            raise ValueError(f"argument name: op {name!r} is already registered (override it instead)")
        _check_choice("compiled", compiled, _COMPILED_MODES)
        _check_choice("cpu", cpu, _CPU_MODES)
        self._ops[name] = Op(name, reference, implementation, supports, tuple(devices), compiled=compiled,
                             default_compiled=compiled, cpu=cpu, default_cpu=cpu)
        return self._ops[name]

    def lookup(self, name) -> Op:
        try:
            return self._ops[name]
        except KeyError:
            raise KeyError(f"no op named {name!r} in brrr's registry; known: {', '.join(self.names())}") from None

    def names(self):
        return tuple(sorted(self._ops))

    def __contains__(self, name):
        return name in self._ops

    def __iter__(self):
        return iter(self.names())

    def override(self, name, implementation, device=None):
        """Run `implementation` instead of brrr's for `name` (on one device type, or all)."""
        if not callable(implementation):
            raise TypeError(f"argument implementation: expected a callable, got {type(implementation).__name__}")
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"argument device: expected None, 'cpu' or 'cuda', got {device!r}")
        self.lookup(name).overrides[device] = implementation

    def reset(self, name=None):
        """Drop overrides, restore falling back, the default under torch.compile and PyTorch's
        function on CPU (for one op, or every op)."""
        for op in ([self.lookup(name)] if name is not None else self._ops.values()):
            op.overrides.clear()
            op.unsupported = "fallback"
            op.compiled = op.default_compiled
            op.cpu = op.default_cpu

    def under_compile(self, name, mode):
        """'kernel' (brrr's op in the compiled graph) or 'inductor' (the PyTorch function, for
        inductor to fuse) for `name` under torch.compile. Takes effect at the next compilation."""
        _check_choice("mode", mode, _COMPILED_MODES)
        self.lookup(name).compiled = mode

    def on_cpu(self, name, mode):
        """'pytorch' (the PyTorch function: the default of brrr's ops) or 'kernel' (the op's
        implementation: brrr's CPU code, the twin of its CUDA kernels and many times slower than
        PyTorch's; the default of ops a user registers) for `name` on CPU tensors."""
        _check_choice("mode", mode, _CPU_MODES)
        self.lookup(name).cpu = mode

    def on_unsupported(self, name, mode):
        """'fallback' (to the PyTorch function) or 'raise' (UnsupportedError) for inputs brrr lacks."""
        _check_choice("mode", mode, ("fallback", "raise"))
        self.lookup(name).unsupported = mode

    def __call__(self, name, *args, **kwargs):
        op = self._ops.get(name) or self.lookup(name)  # lookup raises the error for an unknown name
        return op.resolve(*args, **kwargs)(*args, **kwargs)


_COMPILED_MODES = ("kernel", "inductor")
_CPU_MODES = ("pytorch", "kernel")


def _check_choice(argument, value, choices):
    if value not in choices:
        raise ValueError(f"argument {argument}: expected {' or '.join(map(repr, choices))}, got {value!r}")


# What stays brrr's kernel under torch.compile (see the module docstring); the rest is inductor's.
_KERNEL_UNDER_COMPILE = {"cross_entropy", "linear_cross_entropy", "bias_dropout_add"}
# What runs brrr's kernel on CPU tensors (see the module docstring): faster than PyTorch's there on
# one thread and on two (benchmarks/results/cpu-2026-12-02.md); the rest runs PyTorch's function.
# cross_entropy measured faster too, but that kernel's threaded version does not take softcap and
# z_loss yet: until it does, the CPU twin is the single-threaded reference, and PyTorch's runs.
_KERNEL_ON_CPU = {"tanh", "rms_norm"}

registry = Registry()
for _name, _ref, _impl, _ok in [
    ("relu", torch.relu, _unary(_RELU), _unary_ok),
    ("gelu", F.gelu, _gelu, _gelu_ok),
    ("silu", F.silu, _unary(_SILU), _unary_ok),
    ("sigmoid", torch.sigmoid, _unary(_SIGMOID), _unary_ok),
    ("tanh", torch.tanh, _unary(_TANH), _unary_ok),
    ("bias_gelu", _torch_bias_act(F.gelu), bias_gelu, _bias_ok),
    ("bias_silu", _torch_bias_act(F.silu), bias_silu, _bias_ok),
    ("bias_dropout_add", _torch_bias_dropout_add, bias_dropout_add, _bias_dropout_add_ok),
    ("swiglu", _torch_glu(F.silu), _glu("silu"), _glu_ok),
    ("geglu", _torch_glu(F.gelu), _geglu, _glu_ok),
    ("layer_norm", F.layer_norm, _norm_torch.layer_norm, _layer_norm_ok),
    ("rms_norm", _torch_rms_norm, _rms_norm, _rms_norm_ok),
    ("add_layer_norm", _torch_add_layer_norm, _norm_torch.add_layer_norm, _add_norm_ok),
    ("add_rms_norm", _torch_add_rms_norm, _add_rms_norm, _add_rms_norm_ok),
    ("cross_entropy", _torch_cross_entropy, cross_entropy, _cross_entropy_ok),
    ("linear_cross_entropy", _torch_linear_cross_entropy, linear_cross_entropy, _linear_cross_entropy_ok),
    ("rotary", _torch_rotary, _brrr_rotary_entry, _rotary_ok),
    ("rotary_qk", _torch_rotary_qk, _brrr_rotary_qk_entry, _rotary_qk_ok),
    ("softmax", TORCH_FUNCTIONS["softmax"], _softmax(False), _softmax_ok),
    ("log_softmax", TORCH_FUNCTIONS["log_softmax"], _softmax(True), _softmax_ok),
]:
    registry.register(_name, _ref, _impl, _ok, compiled="kernel" if _name in _KERNEL_UNDER_COMPILE else "inductor",
                      cpu="kernel" if _name in _KERNEL_ON_CPU else "pytorch")
