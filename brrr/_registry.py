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

Each family registers its ops as its PyTorch integration builds (brrr/<family>.py), with its
defaults under torch.compile and on CPU tensors, chosen by what was measured:

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
benchmarks/results/cpu-2026-12-02-simd.md to cpu-2026-12-04.md, docs/cpu.md; ops a user registers
run their implementation there, as on any device they list): brrr's kernel for tanh, rms_norm,
cross_entropy, swiglu, geglu and softmax, where it won at every size measured; PyTorch's for the
rest (the erf GELU, ReLU, SiLU, sigmoid and LayerNorm, where PyTorch's CPU kernels were as fast or
faster at some size measured, or brrr's won only through huge pages for outputs of 32 MiB and
more; ops not measured there, log_softmax among them).
registry.on_cpu(name, "kernel" | "pytorch") changes it.

An input brrr does not support (a dtype or device it has no kernel for, mixed dtypes that
PyTorch would promote, a CUDA tensor in a build without CUDA, the wrapped tensors of a torch.func
transform, a half one under CUDA autocast for layer_norm, which autocast runs in float32) goes to
the PyTorch function the op replaces, unless the op is set to raise. Under CUDA autocast softmax and
log_softmax of half tensors return float32, as autocast makes torch's. brrr.nn, brrr.patch and brrr.use_fused all dispatch
through here, so overrides and fallbacks apply to them too.
"""

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import _C


class UnsupportedError(TypeError):
    """brrr has no kernel for these arguments and the op is set to raise instead of falling back."""


FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def float_dtype(name, dtype, default):
    """An op's dtype argument (softmax's result, a loss's): default where it is None, else a
    floating dtype of FLOATS; TypeError for what is not a torch.dtype, ValueError for another."""
    if dtype is None:
        return default
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"argument {name}: expected a torch.dtype or None, got {type(dtype).__name__}")
    if dtype not in FLOATS:
        raise ValueError(f"argument {name}: expected float32, float16, bfloat16 or float64, got "
                         f"{str(dtype).removeprefix('torch.')}")
    return dtype


_CUDA = _C.cuda_available()  # asked once: torch.compile must not meet a C call in the dispatch
# brrr._C's kernels take views of at most this many dims once mergeable ones are merged; a view of
# more dims may have more that do not merge, and goes to PyTorch.
_MAX_DIMS = _C.MAX_DIMS
_functorch_active = torch._C._are_functorch_transforms_active


# What the families' `supports` checks share (they run on every registry call).

PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# How many Python dispatch modes are active, and which (torch has no public query of its mode stack).
dispatch_modes = torch._C._len_torch_dispatch_stack
# The modes that trace or fake tensors, by (module, class): make_fx's, FakeTensorMode, functionalization.
_TRACING_MODES = (("torch.fx.experimental.proxy_tensor", "ProxyTorchDispatchMode"),
                  ("torch._subclasses.fake_tensor", "FakeTensorMode"),
                  ("torch._subclasses.functional_tensor", "FunctionalTensorMode"))


def traced_by_a_mode():
    """Whether a Python dispatch mode that traces or fakes tensors is active: to it a brrr._C call
    would be invisible (a constant in make_fx's graph) or impossible (a fake tensor has no memory),
    so brrr's ops go to their operators, which it sees. Other modes (a FLOP counter, a memory probe)
    see an op's PyTorch calls and kernels as before. A mode's class is looked up only where its
    module is loaded (no instance of it can exist before)."""
    if not dispatch_modes():
        return False
    classes = tuple(getattr(sys.modules[m], c) for m, c in _TRACING_MODES if m in sys.modules)
    return any(isinstance(mode, classes) for mode in torch.utils._python_dispatch._get_current_dispatch_mode_stack())


def tensor_ok(x):
    """x is a strided, non-nested torch tensor of a float dtype brrr has kernels for, on the CPU or
    on CUDA in a CUDA build (is_cpu / is_cuda: no torch.device object made), of at most _MAX_DIMS
    dims. Of a subclass (a
    wrapper, a fake tensor) only under a tracing mode (traced_by_a_mode), where the op goes to
    brrr's operator, which the mode handles; elsewhere such a tensor holds no memory brrr can read,
    and goes to PyTorch."""
    return ((type(x) in PLAIN_TENSORS or (isinstance(x, torch.Tensor) and traced_by_a_mode())) and x.dtype in FLOATS
            and (x.is_cpu or (x.is_cuda and _CUDA)) and x.layout == torch.strided and not x.is_nested
            and x.dim() <= _MAX_DIMS)


def cuda_autocast_upcasts(x):
    """Whether CUDA autocast is on for a float16/bfloat16 CUDA tensor x: torch's ops on its float32
    list (layer_norm; softmax and log_softmax without a dtype) then compute in float32 and return
    float32, where brrr's kernels return x's dtype (CPU autocast leaves those ops alone)."""
    return x.dtype in _HALVES and x.is_cuda and torch.is_autocast_enabled("cuda")


_HALVES = (torch.float16, torch.bfloat16)


def same_kind(x, *others):
    """Each of `others` is None or a torch tensor of x's dtype on x's device that brrr can read
    (readable)."""
    return all(o is None or (isinstance(o, torch.Tensor) and o.dtype == x.dtype and o.device == x.device and
                             readable(o)) for o in others)


def readable(t):
    """A torch tensor t is one whose memory brrr reads (strided, not nested; of a subclass only
    under a tracing mode, as tensor_ok says): another (a sparse bias, a wrapper subclass) sends the
    op to PyTorch. tensor_ok tests the same of x inline: a frame less on every registry call."""
    return (type(t) in PLAIN_TENSORS or traced_by_a_mode()) and t.layout == torch.strided and not t.is_nested


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
        device = _device_of(args) or (_device_of(kwargs.values()) if kwargs else None)
        if self.overrides:
            override = self.overrides.get(device, self.overrides.get(None))
            if override is not None:
                return override
        if self.compiled == "inductor" and torch.compiler.is_compiling():
            return self.reference
        if device == "cpu" and self.cpu == "pytorch":
            return self.reference
        if device in self.devices:
            try:
                if self.supports(*args, **kwargs):
                    return self.implementation
            except TypeError:
                if not kwargs:
                    raise
                # arguments by the names of the PyTorch function (input=): it takes them, or says why not
        if self.unsupported == "raise":
            raise UnsupportedError(f"brrr.{self.name}: no brrr kernel for these arguments "
                                   f"({_describe((*args, *kwargs.values()))}); "
                                   f"registry.on_unsupported({self.name!r}, 'fallback') sends them to PyTorch instead")
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
        """Drop overrides, restore falling back and the op's defaults under torch.compile and on
        CPU tensors (for one op, or every op)."""
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
        """'pytorch' (the PyTorch function) or 'kernel' (the op's implementation: brrr's CPU code,
        the twin of its CUDA kernels; the default of ops a user registers) for `name` on CPU
        tensors. brrr's ops default to whichever measured faster (the module says which)."""
        _check_choice("mode", mode, _CPU_MODES)
        self.lookup(name).cpu = mode

    def on_unsupported(self, name, mode):
        """'fallback' (to the PyTorch function) or 'raise' (UnsupportedError) for inputs brrr lacks."""
        _check_choice("mode", mode, ("fallback", "raise"))
        self.lookup(name).unsupported = mode

    def __call__(self, name, *args, **kwargs):
        op = self._ops.get(name) or self.lookup(name)  # lookup raises the error for an unknown name
        implementation = op.resolve(*args, **kwargs)
        try:
            return implementation(*args, **kwargs)
        except RuntimeError as error:
            # Inside a torch.func transform (vmap, grad, jacrev, jvp) brrr's implementation cannot
            # read the transform's wrapped tensors (they hold no memory; autograd.Function refuses
            # them first under grad): they are inputs brrr does not support, and go to PyTorch.
            # Found by the failure, which comes before anything runs, so that the usual call pays
            # no test (asking torch whether a transform is active costs about 0.15 us).
            if implementation is not op.implementation or not _functorch_active():
                raise
            if op.unsupported == "raise":
                raise UnsupportedError(f"brrr.{name}: no brrr kernel for the tensors of a torch.func transform; "
                                       f"registry.on_unsupported({name!r}, 'fallback') sends them to "
                                       "PyTorch instead") from error
            return op.reference(*args, **kwargs)


_COMPILED_MODES = ("kernel", "inductor")
_CPU_MODES = ("pytorch", "kernel")


def _check_choice(argument, value, choices):
    if value not in choices:
        raise ValueError(f"argument {argument}: expected {' or '.join(map(repr, choices))}, got {value!r}")


registry = Registry()


def dispatch(name, *args, **kwargs):
    """registry(name, *args, **kwargs), for the brrr.nn modules and torch.nn.functional routes the
    families define, which hold it in a closure: torch.compile traces a function found there, but
    not the registry object itself, where nothing names it for dynamo (a module built inside the
    compiled code, as BERT builds its CrossEntropyLoss: a graph break)."""
    return registry(name, *args, **kwargs)

