"""Swap an existing model's norms, activations and gated MLPs for brrr's fused ops, in place.

    report = brrr.patch(model)    # what was swapped, what was left and why
    print(report)
    brrr.unpatch(model)           # the original modules again

A module is swapped by changing its class to a subclass whose forward calls the registry, so its
parameters, buffers, hooks and state_dict stay exactly as they were. torch.nn's own classes are
matched by type. Other modules (the norm, activation and gated-MLP classes of model libraries:
RMSNorms in Llama's or torch's cast order, Gemma's of (1 + weight), LayerNorms without bias
(Cohere's) or without parameters (OLMo's), Cohere's QK-norm (a LayerNorm over each head with a
weight row per head: brrr's norm in float32, then the weight); the gate of mixture-of-experts
experts (transformers' _apply_gate: act(gate) * up, brrr's swiglu or geglu); gated MLPs with one gate and one up projection or
Phi-3's single gate_up projection; BERT's post-norm residual LayerNorm(dropout(dense(h)) + input),
which runs brrr's add_layer_norm) are matched by behaviour: their forward is run once on a random
probe and compared with the candidate formulas (the nearest of those within the probe dtype's
tolerance: in bfloat16, tanh and erf GELU or Llama's and torch's RMSNorm cast orders are all within
it; activations are probed in float32), so a look-alike that computes something else is left alone.
The children such a module's new forward computes itself (a gated MLP's activation, the residual
block's LayerNorm) are left as they are, and the report says so.

A pre-norm decoder layer whose forward adds a sublayer's output to its residual stream and hands
the sum straight to one of its norms that brrr swapped (`h = residual + x; residual = h; h =
self.post_attention_layernorm(h)`, as transformers writes Llama's and some 20 other families'
layers; or `residual = residual + x; y = self.mlp(self.post_attention_layernorm(residual))`, as
StableLM's; or with an `if` between the add and the norm whose test calls nothing, as GPT-2's
optional cross-attention: fused where the branch is skipped, as written where it runs) gets a
forward in which that add and norm are one add_rms_norm or add_layer_norm:
the layer's own source with only those statements replaced, compiled against a copy of its
module's globals, its decorators rebuilt around it. The sum is rounded to the model's dtype and
then normalised, as the unpatched statements compute it, and each such norm's fused form is
checked against the original norm on a probe (outputs and gradients). A layer that keeps a
`residual` but has no such add (attention and MLP in parallel, norms after the sublayers) is
reported as left. The add that ends a layer (`h = residual + x; return h`) feeds the norm the next
layer (or the model) applies first: it runs as that norm's residual form, the layer still returns
h, and the norm's own call on that h returns the output computed with it (the norm that reads each
layer's sum seen on a probe of the model; the add and the norm as before under torch.compile,
checkpointing, saved-tensor hooks and hooks: see "the add that ends a layer" below).

Some globals a module's forward uses are replaced for that module alone: a global
`apply_rotary_pos_emb(q, k, cos, sin, ...)` (transformers' attention) that behaves like a rotary
embedding on a probe becomes brrr's rotary in the layout the probe showed (Llama's halves, the
interleaved pairs of Cohere, GLM's and ERNIE 4.5's interleaved pairs with each pair's angle from
the first half; partial rotary where the function takes angles over part of the head, as GPT-NeoX's
and GLM's do; DeepSeek V3's apply_rotary_pos_emb_interleave, GLM's pairs and angles with the results
in halves, as brrr's interleaved rotary and one copy into halves), and torch's `CrossEntropyLoss`,
which transformers' masked-LM, sequence-to-sequence and classification heads build inside their
forward, becomes brrr.nn.CrossEntropyLoss. The module gets a subclass whose forward is the same
code run with a copy of its globals in which only those names differ (and decorators that hold the
function they wrap in a closure, such as transformers' can_return_tuple, rebuilt around it). The
model library's module is not touched, so other models of that library keep their own. The copy
is taken when patching, so rebinding one of its globals in the library afterwards does not reach a
patched module until it is unpatched and patched again.

A model whose forward takes `labels` and whose `loss_function` behaves like a causal language
model's loss (Hugging Face's ForCausalLMLoss: shift the labels by one, cross-entropy over the
vocabulary in float32, mean over the counted tokens or sum / num_items_in_batch; checked on a
probe) gets brrr's instead: the same loss without the float32 copy of the logits. Where its output
embeddings are a torch.nn.Linear whose output the forward returns as the logits (or softcaps, as
Gemma 2 does by config.final_logit_softcapping, or scales, as Cohere does by its logit_scale;
probed), a training call with `labels` computes that loss from the head's input with
brrr.linear_cross_entropy, never the logits, and returns logits None
(docs/linear-cross-entropy.md); eval mode or no labels returns them as before. patch(model,
fused_linear_cross_entropy=False) keeps them in training too. patch(model) has the backward
recompute the swapped norms' and GLUs' outputs of at least brrr.remat.AUTO_MIN_BYTES instead of
their linear layers saving them (remat="auto"; True: every output; False: none; brrr.remat,
docs/remat.md).

    with brrr.use_fused():        # route torch.nn.functional's gelu/silu/layer_norm/rms_norm
        y = model(x)              # and cross_entropy through brrr for the inputs it supports

A patched model pickles only after unpatch (its classes are made at run time); state_dicts are
unaffected.
"""

import __future__
import ast
import collections
import contextlib
import copy
import dis
import functools
import inspect
import math
import operator
import textwrap
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import nn as brrr_nn
from . import remat as brrr_remat
from .rotary import apply_rotary_pos_emb as brrr_apply_rotary_pos_emb
from ._op import INTEGRATIONS
from ._registry import registry
from .xent import check_chunking

_ORIGINAL = brrr_nn.ORIGINAL_CLASS
_ORIGINAL_LOSS = brrr_nn.ORIGINAL_LOSS  # what setting loss_function changed in __dict__
_ROTARY_NAME = "apply_rotary_pos_emb"
_ROTARY_INTERLEAVE_NAME = "apply_rotary_pos_emb_interleave"  # DeepSeek V3's (config.rope_interleave)
_LOSS_CLASS_NAME = "CrossEntropyLoss"
_MISSING = brrr_nn.MISSING
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


@dataclass
class PatchReport:
    swapped: list = field(default_factory=list)  # (module name, original class, replacement)
    left: list = field(default_factory=list)  # (module name, class, reason)
    notes: list = field(default_factory=list)  # what else the user should know, as sentences

    def __str__(self):
        lines = [f"brrr.patch: swapped {len(self.swapped)} module(s), left {len(self.left)}"]
        lines += [f"  swapped {name or '<root>'}: {cls} -> {new}" for name, cls, new in self.swapped]
        lines += [f"  left    {name or '<root>'}: {cls} ({why})" for name, cls, why in self.left]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _swap(module, new_class):
    module.__dict__[_ORIGINAL] = type(module)
    module.__class__ = new_class


_SUBCLASSES = {}


def _patched_class(cls, namespace):
    """A subclass of cls with `namespace`, under cls's own name: libraries find classes by name
    (transformers' save_pretrained writes it into config.architectures, accelerate's and FSDP's
    layer-wrapping options name the decoder layer's class). Its modules pickle as cls (a class made
    here cannot be found by pickle), copies stay patched."""
    return brrr_nn.pickles_as_original(
        type(cls.__name__, (cls,), {"__module__": __name__, "__qualname__": cls.__qualname__, **namespace}))


def _subclass(cls, tag, forward, **attrs):
    """A subclass of a model library's class with brrr's forward (one per class and behaviour)."""
    key = (cls, tag, tuple(sorted(attrs.items())))
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = _patched_class(cls, {"forward": forward, **attrs})
    return _SUBCLASSES[key]


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def _hooks_put_aside(model):
    """A block in which model's modules and torch.nn's global hooks hold no hooks (the user's are
    back after it): patch's probes run the model's modules on inputs of their own, which the user's
    hooks should neither see nor change. Hooks registered inside the block (the probes' own) go
    into the block's dicts, and their handles remove them from there."""
    hooks = torch.nn.modules.module
    kept = [(m.__dict__, name, m.__dict__[name]) for m in model.modules() for name in _HOOK_DICTS if name in m.__dict__]
    kept += [(vars(hooks), f"_global{name}", getattr(hooks, f"_global{name}")) for name in _HOOK_DICTS]
    try:
        for where, name, _ in kept:
            where[name] = collections.OrderedDict()
        yield
    finally:
        for where, name, value in kept:
            where[name] = value


def _probe_tolerance(dtype):
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def _close(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    tol = _probe_tolerance(a.dtype)
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _probe_generator():
    """A private generator for probe inputs, seeded: patching draws nothing from the user's random
    streams, and probes the same way every time."""
    return torch.Generator().manual_seed(0)


def _randn(generator, *shape, device, dtype=None):
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def _rng_states_kept():
    """A block after which the global CPU and CUDA generators are as they were before it: a
    module's own forward, run on a probe, may draw from them (a dropout in training mode)."""
    return torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else [])


def _probe(module, *inputs, eval_mode=False):
    """module's output on the probe inputs, None when it raises or returns no tensor. eval_mode: with
    dropout off (every submodule's mode restored after), for a module whose dropout brrr keeps."""
    modes = [(m, m.training) for m in module.modules()] if eval_mode else []
    if eval_mode:
        module.eval()
    try:
        with torch.no_grad():
            y = module(*inputs)
    except Exception:  # noqa: BLE001 - a module that cannot take the probe is simply not a match
        return None
    finally:
        for m, training in modes:
            m.training = training
    return y if isinstance(y, torch.Tensor) else None


def _eps_attribute(module):
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return name
    return None


def _remat(self, out, fn, *inputs):
    """out, tagged to be recomputed as fn(*inputs) by the linear layers it feeds where the swapped
    module has remat on (_brrr_remat: the smallest output it recomputes, None for off)."""
    return out if self._brrr_remat is None else brrr_remat.tag(out, fn, *inputs, min_bytes=self._brrr_remat)


def _rms_norm_forward(self, x):
    out = registry("rms_norm", x, self.weight.shape, self.weight, getattr(self, self._brrr_eps),
                   cast_order=self._brrr_cast_order, offset=self._brrr_offset)
    return _remat(self, out, self.forward, x)


def _layer_norm_forward(self, x):
    out = registry("layer_norm", x, self.weight.shape, self.weight, self.bias if self._brrr_bias else None,
                   getattr(self, self._brrr_eps))
    return _remat(self, out, self.forward, x)


def _plain_norm_forward(self, x):
    """A norm without parameters: its eps an attribute (_brrr_eps) or a constant (_brrr_eps_value)."""
    out = registry(self._brrr_op, x, self.normalized_shape, eps=_plain_norm_eps(self))
    return _remat(self, out, self.forward, x)


def _head_norm_forward(self, x):
    """Cohere's QK-norm: a LayerNorm over the last dim whose weight holds a row per head, in float32
    and cast once, as the original computes it. brrr's norm kernels read one weight row for every
    row of x, so the statistics are brrr's LayerNorm without parameters (in float32: the input's
    copy, as the original makes it) and the weight is one broadcast product after it."""
    xhat = registry("layer_norm", x.float(), self.weight.shape[-1:], eps=getattr(self, self._brrr_eps))
    return (self.weight.float() * xhat).to(x.dtype)


def _plain_norm_eps(self):
    return getattr(self, self._brrr_eps) if self._brrr_eps else self._brrr_eps_value


# The residual forms of the swapped norms: residual_forward(x, residual) is (norm(residual + x),
# residual + x) in one pass (the sum rounded to x's dtype, then normalised), which a decoder
# layer's rewritten forward calls (residual_norm). On a GPU its output is the norm's forward of the
# sum, bitwise (brrr's kernels: the same row math on the rounded sum), so remat recomputes it by
# that forward. On CPU tensors the registry runs PyTorch's add_rms_norm and brrr's rms_norm by
# default, whose bits differ (the gradients of the linear layers it feeds differed from those of
# remat=False): there remat recomputes it by the residual form itself, of (-0.0, h), -0.0 + h being
# h bitwise.
def _residual_remat(self, out, h):
    if self._brrr_remat is None or torch.compiler.is_compiling() or h.is_cuda:
        return _remat(self, out, self.forward, h)
    return _remat(self, out, types.MethodType(_residual_norm_of, self), h)


def _residual_norm_of(self, h):
    return type(self).residual_forward(self, torch.full_like(h, -0.0), h)[0]


def _rms_norm_residual_forward(self, x, residual):
    out, h = registry("add_rms_norm", x, residual, self.weight.shape, self.weight, getattr(self, self._brrr_eps),
                      cast_order=self._brrr_cast_order, offset=self._brrr_offset)
    return _residual_remat(self, out, h), h


def _layer_norm_residual_forward(self, x, residual):
    out, h = registry("add_layer_norm", x, residual, self.weight.shape, self.weight,
                      self.bias if self._brrr_bias else None, getattr(self, self._brrr_eps))
    return _residual_remat(self, out, h), h


def _plain_norm_residual_forward(self, x, residual):
    out, h = registry("add_" + self._brrr_op, x, residual, self.normalized_shape, eps=_plain_norm_eps(self))
    return _residual_remat(self, out, h), h


def _activation_forward(self, x):
    return registry(self._brrr_op, x, **dict(self._brrr_kwargs))


def _glu_of(self, *gate_up):
    return registry(self._brrr_op, *gate_up, **dict(self._brrr_kwargs))


def _down_of_glu(self, *gate_up):
    """down_proj(act(gate) * up); with remat, the product tagged to be recomputed, not saved."""
    out = _glu_of(self, *gate_up)
    return self.down_proj(_remat(self, out, self._brrr_glu, *gate_up))


def _computed_hooked(self):
    """Whether a child that self's forward computes itself (_brrr_computes) has hooks, which only
    its own call would run: then self's original forward runs instead."""
    return any(_has_hooks(getattr(self, name)) for name in self._brrr_computes)


def _glu_mlp_forward(self, x):
    if _computed_hooked(self):
        return self.__dict__[_ORIGINAL].forward(self, x)
    return _down_of_glu(self, self.gate_proj(x), self.up_proj(x))


def _residual_layer_norm_forward(self, hidden_states, input_tensor):
    if _computed_hooked(self):
        return self.__dict__[_ORIGINAL].forward(self, hidden_states, input_tensor)
    norm = self.LayerNorm
    return registry("add_layer_norm", self.dropout(self.dense(hidden_states)), input_tensor, norm.normalized_shape,
                    norm.weight, norm.bias, norm.eps)[0]


def _fused_glu_mlp_forward(self, x):
    if _computed_hooked(self):
        return self.__dict__[_ORIGINAL].forward(self, x)
    return _down_of_glu(self, self.gate_up_proj(x))


_ACTIVATIONS = [  # (op, kwargs, reference)
    ("gelu", (), lambda t: F.gelu(t)),
    ("gelu", (("approximate", "tanh"),), lambda t: F.gelu(t, approximate="tanh")),
    ("silu", (), F.silu),
    ("relu", (), torch.relu),
    ("sigmoid", (), torch.sigmoid),
    ("tanh", (), torch.tanh),
]
_GLU_OF = {("silu", ()): ("swiglu", ()), ("gelu", ()): ("geglu", ()),
           ("gelu", (("approximate", "tanh"),)): ("geglu", (("approximate", "tanh"),))}


def _closest(y, candidates):
    """The key of the (key, expected) candidate that is _close to y and nearest it, the first on
    a tie; None when none is close. A low-precision probe can be close to several: Llama's and
    torch's RMSNorm cast orders differ only in rounding."""
    best, best_error = None, None
    for key, expected in candidates:
        if _close(y, expected):
            error = (y.float() - expected.float()).abs().max().item()
            if best_error is None or error < best_error:
                best, best_error = key, error
    return best


def _match_activation(fn, device):
    """(op, kwargs) of the activation fn computes, or None. Probed in float32, where erf and tanh
    GELU differ by more than the tolerance (in bfloat16 they are within its rounding)."""
    x = _randn(_probe_generator(), 257, device=device) * 3
    y = _probe(fn, x)
    if y is None:
        return None
    return _closest(y, (((op, kwargs), ref(x)) for op, kwargs, ref in _ACTIVATIONS))


def _activation_name(op, kwargs):
    return op + "".join(f" ({key}={value!r})" for key, value in kwargs)


# The norms with a weight and no bias that _try_norm tells apart: (kind, cast order, weight offset).
# Gemma's RMSNorm scales by (1 + weight) in float32; Cohere's LayerNorm has no bias.
_WEIGHT_ONLY_NORMS = [("rms_norm", "llama", 0.0), ("rms_norm", "torch", 0.0), ("rms_norm", "torch", 1.0),
                      ("layer_norm", None, 0.0)]


def _weight_only_norm(x, weight, eps, kind, order, offset):
    if kind == "layer_norm":
        return F.layer_norm(x, weight.shape, weight, None, eps)
    return registry.lookup("rms_norm").reference(x, weight.shape, weight, eps, cast_order=order, offset=offset)


def _try_norm(module, remat):
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() == 0 or list(module.children()):
        return None, "not a norm (needs a weight and no children)"
    eps = _eps_attribute(module)
    if eps is None:
        return None, "no eps attribute (variance_epsilon, eps, epsilon)"
    bias = getattr(module, "bias", None)
    if weight.dim() > 1:
        return _try_head_norm(module, eps, bias)
    x = _randn(_probe_generator(), 3, 5, weight.numel(), device=weight.device, dtype=weight.dtype) * 2 + 0.5
    y = _probe(module, x)
    if y is None:
        return None, "forward did not take a (3, 5, hidden) probe"
    e = getattr(module, eps)
    if isinstance(bias, torch.nn.Parameter):
        if _close(y, F.layer_norm(x, weight.shape, weight, bias, e)):
            return (_subclass(type(module), "layer_norm", _layer_norm_forward, _brrr_eps=eps, _brrr_bias=True,
                              _brrr_remat=remat, residual_forward=_layer_norm_residual_forward), "LayerNorm")
        return None, "behaves like no LayerNorm"
    found = _closest(y, ((form, _weight_only_norm(x, weight, e, *form)) for form in _WEIGHT_ONLY_NORMS))
    if found is None:
        return None, "behaves like no RMSNorm (of weight or 1 + weight) and no LayerNorm without bias"
    kind, order, offset = found
    if kind == "layer_norm":
        return (_subclass(type(module), "layer_norm", _layer_norm_forward, _brrr_eps=eps, _brrr_bias=False,
                          _brrr_remat=remat, residual_forward=_layer_norm_residual_forward), "LayerNorm without bias")
    scale = f", scaled by {offset:g} + weight" if offset else ""
    return (_subclass(type(module), "rms_norm", _rms_norm_forward, _brrr_eps=eps, _brrr_cast_order=order,
                      _brrr_offset=offset, _brrr_remat=remat, residual_forward=_rms_norm_residual_forward),
            f"RMSNorm ({order} cast order{scale})")


def _try_head_norm(module, eps, bias):
    """A norm whose weight has more than one dim, each row a head's (Cohere's QK-norm: a (heads,
    head_dim) weight over inputs (..., heads, head_dim)): the LayerNorm over the last dim without
    bias, computed in float32 and cast once, is the one brrr takes (_head_norm_forward)."""
    weight = module.weight
    if isinstance(bias, torch.Tensor):
        return None, "a norm with a weight per head and a bias"
    x = _randn(_probe_generator(), 3, 5, *weight.shape, device=weight.device, dtype=weight.dtype) * 2 + 0.5
    y = _probe(module, x)
    if y is None:
        return None, f"forward did not take a (3, 5, {', '.join(map(str, weight.shape))}) probe"
    e = getattr(module, eps)
    expected = (weight.float() * F.layer_norm(x.float(), weight.shape[-1:], None, None, e)).to(x.dtype)
    if not _close(y, expected):
        return None, "a weight per head, and behaves like no LayerNorm over the last dim in float32 without bias"
    return (_subclass(type(module), "head layer_norm", _head_norm_forward, _brrr_eps=eps),
            "LayerNorm without bias over each head (a weight row per head, applied after brrr's norm)")


def _try_plain_norm(module, device, remat):
    """A LayerNorm or RMSNorm without weight or bias (OLMo's LayerNorm): a module with a
    normalized_shape of ints and no parameters, buffers or children; its eps an attribute, or
    torch's default 1e-5 written into its forward (checked: on a second probe of small values
    the eps is most of the variance). (None, None) for a module that is not such a candidate."""
    shape = getattr(module, "normalized_shape", None)
    shape = (shape,) if type(shape) is int else shape
    if not (isinstance(shape, (tuple, list)) and shape and all(type(n) is int and n > 0 for n in shape)) or any(
            True for _ in module.parameters()) or any(True for _ in module.buffers()) or list(module.children()):
        return None, None
    eps = _eps_attribute(module)
    e = getattr(module, eps) if eps else 1e-5
    g = _probe_generator()
    x = _randn(g, 3, 5, *shape, device=device) * 2 + 0.5
    probes = (x, x * 3e-3)
    ys = [_probe(module, p) for p in probes]
    if any(y is None for y in ys):
        return None, f"forward did not take a (3, 5, {', '.join(map(str, shape))}) probe"
    for op, reference in (("layer_norm", F.layer_norm), ("rms_norm", F.rms_norm)):
        if all(_close(y, reference(p, shape, None, None, e) if op == "layer_norm" else reference(p, shape, None, e))
               for y, p in zip(ys, probes)):
            name = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm"}[op]
            return (_subclass(type(module), "plain " + op, _plain_norm_forward, _brrr_op=op, _brrr_eps=eps,
                              _brrr_eps_value=e, _brrr_remat=remat,
                              residual_forward=_plain_norm_residual_forward),
                    f"{name} without weight or bias" + ("" if eps else f" (eps {e:g} in its forward)"))
    return None, (f"behaves like no LayerNorm or RMSNorm without weight (eps {e:g}, "
                  f"{'its ' + eps if eps else 'no eps attribute: torch default'})")


def _try_glu_mlp(module, remat):
    """Llama's gated MLP, down(act(gate(x)) * up(x)), or Phi-3's with one projection for both,
    down(up * act(gate)) where gate, up = gate_up(x).chunk(2, -1)."""
    gate, up, down, gate_up = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"))
    act_name = next((n for n in ("act_fn", "activation_fn") if getattr(module, n, None) is not None), None)
    act = getattr(module, act_name) if act_name else None
    fused = isinstance(gate_up, torch.nn.Linear) and gate is None and up is None
    projections = (gate_up, down) if fused else (gate, up, down)
    if not all(isinstance(m, torch.nn.Linear) for m in projections) or act is None:
        return None, None
    first = projections[0]
    activation = _match_activation(act, first.weight.device)
    if activation not in _GLU_OF:
        return None, "gated MLP whose activation is not silu or gelu"
    x = _randn(_probe_generator(), 2, 3, first.in_features, device=first.weight.device, dtype=first.weight.dtype)
    y = _probe(module, x)
    with torch.no_grad():
        if y is None:
            expected = None
        elif fused:
            g, u = gate_up(x).chunk(2, dim=-1)
            expected = down(u * act(g))
        else:
            expected = down(act(gate(x)) * up(x))
    if y is None or not _close(y, expected):
        formula = "down(up * act(gate)) of gate_up(x)" if fused else "down(act(gate(x)) * up(x))"
        return None, f"gated MLP whose forward is not {formula}"
    op, kwargs = _GLU_OF[activation]
    forward = _fused_glu_mlp_forward if fused else _glu_mlp_forward
    return (_subclass(type(module), op + (" fused" if fused else ""), forward, _brrr_op=op, _brrr_kwargs=kwargs,
                      _brrr_computes=(act_name,), _brrr_remat=remat, _brrr_glu=_glu_of),
            f"gated MLP ({op}{', one gate_up projection' if fused else ''})")


def _try_experts_gate(module):
    """Mixture-of-experts experts as transformers' use_experts_implementation builds them: their
    _apply_gate(gate_up) (which the grouped and batched matmul forms call on all routed tokens at
    once) is act(gate) * up of its input's halves, brrr's swiglu or geglu of that one tensor. Their
    act_fn stays their own (swapped as an activation): the eager form's loop calls it itself.
    (None, None) for a module without those parts."""
    apply_gate, act = getattr(type(module), "_apply_gate", None), getattr(module, "act_fn", None)
    weight = getattr(module, "gate_up_proj", None)
    if not callable(apply_gate) or act is None or not isinstance(weight, torch.Tensor):
        return None, None
    activation = _match_activation(act, weight.device)
    if activation not in _GLU_OF:
        return None, "experts whose activation is not silu or gelu"
    x = _randn(_probe_generator(), 2, 3, 16, device=weight.device, dtype=weight.dtype)
    y = _probe(functools.partial(apply_gate, module), x)
    with torch.no_grad():
        gate, up = x.chunk(2, dim=-1)
        expected = act(gate) * up
    if y is None or not _close(y, expected):
        return None, "experts whose _apply_gate is not act(gate) * up of its input's halves"
    op, kwargs = _GLU_OF[activation]
    return (_subclass(type(module), op + " experts", type(module).forward, _brrr_op=op, _brrr_kwargs=kwargs,
                      _apply_gate=_glu_of),
            f"gated MLP of the experts ({op} of the gate_up projection, in their _apply_gate)")


def _try_residual_layer_norm(module):
    """BERT's post-norm residual (BertSelfOutput, BertOutput and their copies in some 45 of
    transformers' models): LayerNorm(dropout(dense(h)) + input), the add and the norm in one pass.
    (None, None) for a module without those three parts."""
    dense, norm, dropout = (getattr(module, n, None) for n in ("dense", "LayerNorm", "dropout"))
    if not (isinstance(dense, torch.nn.Linear) and isinstance(norm, torch.nn.LayerNorm)
            and isinstance(dropout, torch.nn.Dropout)):
        return None, None
    w = dense.weight
    g = _probe_generator()
    h = _randn(g, 2, 3, dense.in_features, device=w.device, dtype=w.dtype)
    residual = _randn(g, 2, 3, dense.out_features, device=w.device, dtype=w.dtype)
    y = _probe(module, h, residual, eval_mode=True)
    with torch.no_grad():
        expected = F.layer_norm(dense(h) + residual, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    if y is None or not _close(y, expected):
        return None, "behaves like no LayerNorm(dropout(dense(h)) + input)"
    return (_subclass(type(module), "residual_layer_norm", _residual_layer_norm_forward, _brrr_computes=("LayerNorm",)),
            "LayerNorm with its residual add (add_layer_norm)")


def _try_activation(module, device):
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)) \
            or list(module.children()):
        return None
    match = _match_activation(module, device)
    if match is None:
        return None
    op, kwargs = match
    return _subclass(type(module), op, _activation_forward, _brrr_op=op, _brrr_kwargs=kwargs), _activation_name(op, kwargs)


def _shifted_labels(labels, ignore_index, shift_labels):
    """The targets of a causal LM: each position's next label (the last position ignored)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _per_item(loss, num_items_in_batch):
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """Hugging Face's ForCausalLMLoss through brrr's cross_entropy: labels shifted by one (the last
    position ignored), the loss in float32 without a float32 copy of the logits, the mean over
    counted tokens, or the sum divided by num_items_in_batch when that is given."""
    logits = logits.reshape(-1, vocab_size)
    shift_labels = _shifted_labels(labels, ignore_index, shift_labels).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = registry("cross_entropy", logits, shift_labels, ignore_index=ignore_index, reduction=reduction,
                    dtype=torch.float32)
    return _per_item(loss, num_items_in_batch)


def causal_lm_linear_loss(hidden_states, head, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                          softcap=None, logit_scale=None, **options):
    """causal_lm_loss of the logits head(hidden_states) (softcapped as Gemma 2 caps them, or times
    logit_scale as Cohere scales them: the head's input scaled instead, its width rather than the
    vocabulary's), through brrr's linear_cross_entropy: the logits are never held whole. options:
    linear_cross_entropy's logits_budget and accumulation."""
    hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
    if logit_scale is not None:
        hidden_states = hidden_states * logit_scale
    shift_labels = _shifted_labels(labels, ignore_index, shift_labels).to(hidden_states.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = registry("linear_cross_entropy", hidden_states, head.weight, shift_labels, head.bias,
                    ignore_index=ignore_index, reduction=reduction, softcap=softcap, dtype=torch.float32, **options)
    return _per_item(loss, num_items_in_batch)


def _behaves_like_causal_lm_loss(fn, device):
    """fn's loss on a probe, against the causal-LM loss written out in PyTorch."""
    g = _probe_generator()
    vocab = 11
    logits = _randn(g, 2, 5, vocab, device=device)
    labels = torch.randint(0, vocab, (2, 5), generator=g)
    labels[0, 2] = -100
    labels = labels.to(device)
    flat_logits, flat_labels = logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1)
    for items in (None, 7):
        try:
            with torch.no_grad():
                got = fn(logits=logits, labels=labels, vocab_size=vocab, num_items_in_batch=items)
        except Exception:  # noqa: BLE001 - a loss that cannot take the probe is simply not a match
            return False
        if items is None:
            expected = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100)
        else:
            expected = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum") / items
        if not isinstance(got, torch.Tensor) or not _close(got.float(), expected):
            return False
    return True


def _try_loss_function(module, device):
    """(True, why) when module's loss_function was swapped for causal_lm_loss, (False, why) when it
    has one that was left, None when it has none (or its forward takes no labels)."""
    if not hasattr(type(module), "loss_function"):
        return None
    if _ORIGINAL_LOSS in module.__dict__:
        return False, "loss_function already patched"
    try:
        takes_labels = "labels" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        takes_labels = False
    if not takes_labels:
        return None
    if not _behaves_like_causal_lm_loss(module.loss_function, device):
        return False, "loss_function behaves like no causal-LM cross-entropy"
    before = dict(module.__dict__)
    module.loss_function = causal_lm_loss  # a model library's property setter may store it elsewhere
    module.__dict__[_ORIGINAL_LOSS] = {k: before.get(k, _MISSING) for k, v in module.__dict__.items()
                                       if before.get(k, _MISSING) is not v}
    return True, "loss_function: brrr causal-LM cross_entropy"


# A causal LM's training step with labels, fused (patch's fused_linear_cross_entropy): its head
# only hands its input over, and the loss comes from brrr's linear_cross_entropy. The head holds a
# list that the model's forward arms (appends None) around its own forward; an armed head puts its
# input there and returns logits of width 0, which the model's forward passes through as usual.
_PENDING = "_brrr_pending"
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


def _deferring_head_forward(self, x):
    pending = self.__dict__[_PENDING]
    if not pending:
        return F.linear(x, self.weight, self.bias)
    pending[-1] = x
    return x.new_empty(x.shape[:-1] + (0,))


def _fused_linear_loss_forward(original):
    """The model's forward: unchanged unless training with labels (a keyword, as Hugging Face's
    Trainer passes them); then run without labels with the head deferring, and the loss of the
    head's input through causal_lm_linear_loss. The output has that loss and no logits (None).
    Unchanged too where the head is not the one patched (replaced since, as resize_token_embeddings
    does with untied weights) or has hooks (which would see no logits). Its signature is the
    original's (functools.wraps), which Trainer reads to keep the batch's columns."""
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        if labels is None or not self.training:
            return original(self, *args, **kwargs)
        head = self.get_output_embeddings()
        pending = head.__dict__.get(_PENDING)
        if pending is None or _has_hooks(head):
            return original(self, *args, **kwargs)
        pending.append(None)
        try:
            out = original(self, *args, **dict(kwargs, labels=None))
            hidden_states = pending[-1]
        finally:
            pending.clear()
        if hidden_states is None:
            raise RuntimeError(f"brrr.patch: {type(self).__name__}'s forward did not call its output embeddings "
                               "(brrr.unpatch the model, or patch it with fused_linear_cross_entropy=False)")
        loss = causal_lm_linear_loss(hidden_states, head, labels, softcap=self._brrr_softcap,
                                     logit_scale=self._brrr_logit_scale, **dict(self._brrr_loss_options),
                                     **{k: kwargs[k] for k in _LOSS_KWARGS if k in kwargs})
        if isinstance(out, tuple):  # return_dict=False: the logits' place kept, None
            return (loss, None) + out[1:]
        return type(out)(**{k: v for k, v in out.items() if k != "logits"}, loss=loss)
    return forward


def _number(value):
    """value where it is a finite float or int other than a bool, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _logits_transform(module, head, device):
    """(True, softcap or None, logit_scale or None) when module's forward returns its head's output
    as the logits, or capped as Gemma 2 caps them (config.final_logit_softcapping), or scaled as
    Cohere scales them (its logit_scale, or config's); (False, why, None) otherwise. Probed: a
    forward of 2 tokens (in eval mode, every submodule's mode restored) whose head returns logits
    that a softcap of 30 or a scale other than 1 changes by far more than rounding."""
    config = getattr(module, "config", None)
    cap = _number(getattr(config, "final_logit_softcapping", None))
    scale = _number(getattr(module, "logit_scale", getattr(config, "logit_scale", None)))
    probe = {}

    def replace_logits(_module, _inputs, output):
        rows = output.shape[:-1].numel()
        probe["logits"] = torch.linspace(-60.0, 60.0, rows * 7, device=output.device).reshape(
            *output.shape[:-1], 7).to(output.dtype)
        return probe["logits"]

    handle = head.register_forward_hook(replace_logits)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            out = module(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device))
    except Exception:  # noqa: BLE001 - a model that cannot take the probe is simply not a match
        return False, "its forward did not take a probe of 2 input_ids", None
    finally:
        handle.remove()
        for m, training in modes:
            m.training = training
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or "logits" not in probe:
        return False, "its forward returned no logits from its output embeddings", None
    p = probe["logits"]
    candidates = [((True, None, None), p)]
    if cap is not None and cap > 0:
        candidates.append(((True, cap, None), (cap * torch.tanh(p.float() / cap)).to(p.dtype)))
    if scale is not None and scale != 1.0:
        candidates.append(((True, None, scale), p * scale))
    found = _closest(logits, candidates)
    return found or (False, "its logits are not its head's output (nor softcapped by config.final_logit_softcapping, "
                     "nor scaled by logit_scale)", None)


def _try_fused_linear_loss(module, device, options):
    """(model class, head, head class, what) for a causal LM whose loss was swapped and whose head
    brrr's linear_cross_entropy can take (with the keywords `options`), else (None, None, None, why)."""
    get_head = getattr(module, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not torch.nn.Linear:
        return None, None, None, "fused linear cross-entropy: no torch.nn.Linear output embeddings"
    fits, softcap, scale = _logits_transform(module, head, device)
    if not fits:
        return None, None, None, f"fused linear cross-entropy: {softcap}"
    cls = type(module)
    model_class = _subclass(cls, "fused_linear_loss", _fused_linear_loss_forward(cls.forward), _brrr_softcap=softcap,
                            _brrr_logit_scale=scale, _brrr_loss_options=tuple(sorted(options.items())))
    head_class = _subclass(type(head), "deferring_head", _deferring_head_forward)
    cap = "" if softcap is None else f", its softcap {softcap:g} fused"
    cap += "" if scale is None else f", its logit scale {scale:g} on the head's input"
    return (model_class, head, head_class,
            f"fused linear cross-entropy (training with labels: the loss from the head's input{cap}, logits None)")


@dataclass(frozen=True)
class RotaryLayout:
    """How a library's apply_rotary_pos_emb(q, k, cos, sin) rotates, as its probe showed."""

    interleaved: bool  # pairs (2p, 2p + 1) (Cohere, GLM, ERNIE 4.5), not (j, j + r/2) (Llama)
    first_half: bool  # each pair's angle at p of the given ones (GLM's cos[..., :r/2].repeat_interleave(2))
    halves_out: bool  # pair p's results at p and p + r/2 (DeepSeek V3's interleaved pairs in, halves out)
    partial: bool  # angles over r < head dim features rotate those, the rest passed through (GPT-NeoX)

    def describe(self):
        return "".join((", interleaved pairs" if self.interleaved else "",
                        ", angles from their first half" if self.first_half else "",
                        ", halves out" if self.halves_out else "",
                        ", partial rotary" if self.partial else ""))


# (interleaved, first_half, halves_out): the forms transformers' models write.
_ROTARY_FORMS = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]


def _rotary_of(q, k, cos, sin, interleaved, first_half, halves_out):
    """(q, k) rotated as a library's function of that form rotates them: rotary_dim cos's last dim."""
    r = cos.shape[-1]
    if first_half:
        cos, sin = cos[..., :r // 2], sin[..., :r // 2]
    kw = dict(interleaved=interleaved, rotary_dim=r)
    out = registry.lookup("rotary_qk").reference(q, k, cos, sin, **kw)
    return tuple(_halves(t, r) for t in out) if halves_out else out


def _halves(t, r):
    """t with its first r features' pairs (2p, 2p + 1) moved to (p, p + r/2): one copy."""
    return torch.cat([t[..., 0:r:2], t[..., 1:r:2], t[..., r:]], dim=-1)


def _rotary_layout(fn, device):
    """The RotaryLayout fn computes on a probe (angles over the whole head dim, then over half of
    it: the partial rotary it may take too), or None when it behaves like no rotary embedding."""
    g = _probe_generator()
    q, k = _randn(g, 2, 3, 5, 8, device=device), _randn(g, 2, 2, 5, 8, device=device)
    cos, sin = _randn(g, 2, 5, 8, device=device), _randn(g, 2, 5, 8, device=device)

    def rotated(c, s):
        try:
            with torch.no_grad():
                got = fn(q, k, c, s)
        except Exception:  # noqa: BLE001 - a function that cannot take the probe is simply not a match
            return None
        ok = isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)
        return torch.cat([t.flatten() for t in got]) if ok else None

    def candidates(c, s):
        for form in _ROTARY_FORMS:
            yield form, torch.cat([t.flatten() for t in _rotary_of(q, k, c[:, None], s[:, None], *form)])

    got = rotated(cos, sin)
    form = None if got is None else _closest(got, candidates(cos, sin))
    if form is None:
        return None
    part = rotated(cos[..., :4], sin[..., :4])
    partial = part is not None and _closest(part, candidates(cos[..., :4], sin[..., :4])) == form
    return RotaryLayout(*form, partial)


def _rotary_through_brrr(original, layout):
    """A replacement for a library's apply_rotary_pos_emb(q, k, cos, sin, ...) that rotated a
    probe by `layout`: brrr's rotary_qk (through the registry) for the calls it takes, and
    `original` itself for the rest: arguments other than unsqueeze_dim (or a position_ids of
    None), angles over part of the head dim where the original did not take them on the probe,
    inputs the registry sends to PyTorch. The extra arguments are read by the original's own
    signature: most of transformers' take unsqueeze_dim fifth, some position_ids."""
    extra = list(inspect.signature(original).parameters.values())[4:]
    names = [p.name for p in extra]
    default_dim = next((p.default for p in extra if p.name == "unsqueeze_dim"), 1)
    op = registry.lookup("rotary_qk")

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        given = dict(zip(names, args)) if len(args) <= len(names) else None
        if given is not None and not kwargs.keys() - {"unsqueeze_dim", "position_ids"}:
            given.update(kwargs)
            dim = given.get("unsqueeze_dim", default_dim)
            if given.get("position_ids") is None and given.keys() <= {"unsqueeze_dim", "position_ids"} \
                    and isinstance(dim, int) and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) \
                    and isinstance(q, torch.Tensor) and (cos.shape[-1] == q.shape[-1] or layout.partial):
                c, s = cos.unsqueeze(dim), sin.unsqueeze(dim)
                r = c.shape[-1]
                if layout.first_half:  # each pair's angle, without GLM's repeat_interleave copy
                    c, s = c[..., :r // 2], s[..., :r // 2]
                options = dict(interleaved=layout.interleaved, rotary_dim=r)
                fn = op.resolve(q, k, c, s, **options)
                if fn is not op.reference:
                    out = fn(q, k, c, s, **options)
                    # DeepSeek V3's halves out: the permutation its own torch.cat makes, as one copy
                    return tuple(_halves(t, cos.shape[-1]) for t in out) if layout.halves_out else out
        return original(q, k, cos, sin, *args, **kwargs)

    return apply_rotary_pos_emb


def _calls_global(function, name):
    return any(ins.opname == "LOAD_GLOBAL" and ins.argval == name for ins in dis.get_instructions(function))


def _copy_function(function, scope, closure, code=None):
    """function's code (or `code`, made from its source) run with the globals `scope` and the
    closure cells `closure`."""
    copy = types.FunctionType(code or function.__code__, scope, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__, copy.__annotations__ = function.__kwdefaults__, function.__annotations__
    copy.__qualname__, copy.__doc__ = function.__qualname__, function.__doc__
    copy.__dict__.update(function.__dict__)
    return copy


def _decorators(forward):
    """[forward, what it wraps, ..., the innermost function] (functools.wraps's __wrapped__), or
    None when a layer is no plain function or does not hold the next in one of its closure cells
    (then brrr cannot rebuild it around a new innermost function)."""
    chain = [forward]
    while "__wrapped__" in getattr(chain[-1], "__dict__", {}):
        chain.append(chain[-1].__wrapped__)
    if not all(isinstance(f, types.FunctionType) for f in chain):
        return None
    for wrapper, wrapped in zip(chain, chain[1:]):
        if [_cell_holds(c, wrapped) for c in wrapper.__closure__ or ()].count(True) != 1:
            return None
    return chain


def _cell_holds(cell, value):
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _rebuild_forward(chain, replacements, code=None):
    """The forward whose decorator chain is `chain`, with `replacements` in its innermost
    function's globals (a copy of them; the model library's module is not touched), its code
    replaced by `code` where given, and each decorator rebuilt around the new function."""
    inner = chain[-1]
    scope = dict(inner.__globals__)
    scope.update(replacements)
    # Without the module's name torch.compile reads these globals from this dict, not from the
    # module it would import by that name (which holds the library's own functions).
    scope.pop("__name__", None)
    rebuilt = _copy_function(inner, scope, inner.__closure__, code)
    for wrapper, wrapped in zip(reversed(chain[:-1]), reversed(chain[1:])):
        closure = tuple(types.CellType(rebuilt) if _cell_holds(c, wrapped) else c for c in wrapper.__closure__)
        outer = _copy_function(wrapper, wrapper.__globals__, closure)
        outer.__wrapped__ = rebuilt
        rebuilt = outer
    return rebuilt


def _rotary_replacement(fn, device, name):
    """(brrr's replacement for the library's apply_rotary_pos_emb `fn`, the global `name`, what)
    or (None, why)."""
    if fn is brrr_apply_rotary_pos_emb:
        return None, f"its forward's {name} is already brrr's"
    if device.type not in registry.lookup("rotary_qk").devices:
        return None, f"brrr's rotary has no {device.type} kernel"
    layout = _rotary_layout(fn, device) if callable(fn) else None
    if layout is None:
        return None, f"its forward's {name} behaves like no rotary embedding"
    try:
        return _rotary_through_brrr(fn, layout), f"brrr rotary (its forward's {name}{layout.describe()})"
    except (TypeError, ValueError):  # no signature to read its extra arguments by
        return None, f"its forward's {name} has no signature brrr can read"


def _loss_class_replacement(cls, device, name):
    """brrr.nn.CrossEntropyLoss for a forward that builds torch's CrossEntropyLoss (as
    transformers' masked-LM, sequence-to-sequence and classification heads do)."""
    if cls is not torch.nn.CrossEntropyLoss:
        return None, None
    return brrr_nn.CrossEntropyLoss, f"brrr.nn.CrossEntropyLoss (its forward's {_LOSS_CLASS_NAME})"


# The globals of a forward brrr can replace: name -> (replacement, what) or (None, why) or (None, None).
_FORWARD_GLOBALS = {_ROTARY_NAME: _rotary_replacement, _ROTARY_INTERLEAVE_NAME: _rotary_replacement,
                    _LOSS_CLASS_NAME: _loss_class_replacement}


def _try_forward_globals(module, device, made):
    """(subclass, what) when module's forward uses a global brrr can replace (apply_rotary_pos_emb
    or CrossEntropyLoss), (None, why) when it uses one that is left, (None, None) when it uses
    none. The subclasses are made anew by each patch (their forward's globals are copied then) and
    shared through `made` by the modules of one class."""
    cls = type(module)
    if cls in made:
        return made[cls]
    chain = _decorators(cls.forward)
    inner = chain[-1] if chain else inspect.unwrap(cls.forward)
    used = [name for name in _FORWARD_GLOBALS if isinstance(inner, types.FunctionType) and _calls_global(inner, name)]
    if not used:
        return None, None
    if chain is None:
        made[cls] = None, (f"its forward uses {' and '.join(used)} but is wrapped by a decorator that brrr cannot "
                           "rebuild (one that does not hold the function it wraps in a closure cell)")
        return made[cls]
    replacements, whats, whys = {}, [], []
    for name in used:
        replacement, what = _FORWARD_GLOBALS[name](inner.__globals__.get(name), device, name)
        if replacement is not None:
            replacements[name] = replacement
            whats.append(what)
        elif what is not None:
            whys.append(what)
    if not replacements:
        made[cls] = (None, "; ".join(whys)) if whys else (None, None)
        return made[cls]
    rebuilt = _rebuild_forward(chain, replacements)
    made[cls] = _patched_class(cls, {"forward": rebuilt}), "; ".join(whats)
    return made[cls]


# ---- the residual add of pre-norm decoder layers --------------------------------------------------
# A pre-norm decoder layer adds each sublayer's output to the residual stream and hands the sum to
# its next norm, which transformers writes (in Llama and some 20 other families) as
#
#     hidden_states = residual + hidden_states      # any expression in place of hidden_states
#     residual = hidden_states
#     hidden_states = self.post_attention_layernorm(hidden_states)
#
# (or StableLM's `residual = residual + x; y = self.mlp(self.post_attention_layernorm(residual))`:
# _residual_norm_site says which forms). Where that norm was swapped and its residual form
# (residual_forward: add_rms_norm or add_layer_norm, the sum rounded to the model's dtype and then
# normalised, as those statements compute it) matches the original norm on a probe, outputs and
# gradients, the add and the norm become one call of residual_norm. The layer's new forward is its own source with only those
# statements replaced, compiled against a copy of its module's globals, its decorators rebuilt
# around it. The add that ends a layer is fused with the norm that reads its sum next (below).

_RESIDUAL_NORM = "_brrr_residual_norm"
_NORMED = "_brrr_normed"  # a rewritten forward's local: the norm's output on its way into the call that reads it
_RESIDUAL = "residual"  # the name transformers' layers keep the residual stream in
_FUTURE_FLAGS = functools.reduce(operator.or_, (getattr(__future__, name).compiler_flag
                                                for name in __future__.all_feature_names))


def residual_norm(norm, x, residual):
    """(norm(residual + x), residual + x): one pass of the swapped norm's residual form, or the
    add and the norm's own call where norm has none or has hooks (which that call runs)."""
    fused = getattr(type(norm), "residual_forward", None)
    if fused is None or _has_hooks(norm):
        h = residual + x  # a tensor sum, the same bits in either order
        return norm(h), h
    return fused(norm, x, residual)


# transformers' output recorders (output_hidden_states: installed on the layers the first time it is
# asked for, and kept): forward hooks that only keep the output
_RECORDERS = "transformers.utils.output_capturing"


def _has_hooks(module, ignoring=None):
    """Whether module or every module has hooks; ignoring: the module of forward hooks not counted."""
    hooks = torch.nn.modules.module
    forward = [h for h in module._forward_hooks.values() if getattr(h, "__module__", None) != ignoring or not ignoring]
    return bool(forward or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


# ---- the add that ends a layer ---------------------------------------------------------------------
# A decoder layer's last add (`h = residual + x; return h`) feeds the norm that the next layer (or
# the model, after the last layer) applies first. The layer must still return h, whole: hooks,
# gradient checkpointing and output_hidden_states see each layer's output. So the add runs as that
# norm's residual form, which computes the norm's output in the same pass and leaves it on the
# norm, keyed to h; the norm's forward, called on that very h (unchanged since: its version),
# returns it instead of reading h again. The norm that reads a layer's sum was seen on a probe of
# the model (_link_layer_ends). Wherever the two calls might not pair up as one forward computes
# them, the add and the norm run as before:
# - under torch.compile (it fuses them itself);
# - under saved-tensor hooks: torch.utils.checkpoint's non-reentrant form saves and recomputes a
#   layer's tensors, and would find the norm's saved in one run and not the other; offloading;
# - in a layer transformers checkpoints (its gradient_checkpointing): the reentrant form runs it
#   without grad, and the norm would compute its output anew (requires_grad differs: checked);
# - where the layer, the norm or a module that holds the norm but not the layer (the next layer)
#   has hooks: one may change h in place (a pre-hook of the next layer steering its input), and the
#   fused call saved h for its backward, which would then refuse it (transformers' output
#   recorders, which only keep h, aside);
# - where the norm is no longer swapped (brrr.unpatch of it, or of the next layer).
# - under torch.inference_mode: its tensors keep no version, which the norm's check reads.
# Other code that changes a layer's output in place before the next layer reads it gets the norm
# computed anew (h's version differs), and the backward's error.

_NEXT_NORM = "_brrr_next_norm"  # a layer's: (the norm that reads the sum that ends it, the modules between)
_AHEAD = "_brrr_ahead"  # a norm's: (a weak reference to h, h's version, the norm's output of h)
_PROBING = object()  # _NEXT_NORM while _link_layer_ends probes: the layer keeps its sum in _PROBED
_PROBED = "_brrr_probed_sum"
_RESIDUAL_NORM_AHEAD = "_brrr_residual_norm_ahead"
_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _saved_tensors_hooked():
    """Whether saved-tensor hooks are active (a torch without the query counts as hooked)."""
    return _top_saved_tensors_hooks is None or _top_saved_tensors_hooks(False) is not None


def residual_norm_ahead(layer, x, residual):
    """residual + x, the sum that ends `layer`; with the norm that reads it next computed from it in
    the same pass (its residual form) and left for that norm's forward (_taken_ahead)."""
    if torch.compiler.is_compiling():
        return residual + x
    link = layer.__dict__.get(_NEXT_NORM)
    norm, between = (None, ()) if link is None or link is _PROBING else link
    fused = getattr(type(norm), "residual_forward", None)
    if fused is None or _saved_tensors_hooked() or torch.is_inference_mode_enabled() \
            or _has_hooks(layer, _RECORDERS) or _has_hooks(norm) or any(_has_hooks(m, _RECORDERS) for m in between) \
            or (layer.training and getattr(layer, "gradient_checkpointing", False) is True):
        h = residual + x  # a tensor sum, the same bits in either order
        if link is _PROBING:
            layer.__dict__[_PROBED] = h
        return h
    out, h = fused(norm, x, residual)
    norm.__dict__[_AHEAD] = (weakref.ref(h), h._version, out)
    return h


def _taken_ahead(norm, x):
    """The output residual_norm_ahead left on `norm` for x, or None where it left none for this x
    or x changed since; taken once."""
    if torch.compiler.is_compiling():
        return None
    left = norm.__dict__.pop(_AHEAD, None)
    if left is None:
        return None
    h, version, out = left
    if h() is not x or x._version != version or out.requires_grad != x.requires_grad or _saved_tensors_hooked():
        return None
    return out


def _ahead_forward(base_forward):
    def forward(self, x):
        out = _taken_ahead(self, x)
        return base_forward(self, x) if out is None else out
    return forward


def _link_layer_ends(model, device, layers):
    """{layer: (norm, its name, the modules that hold the norm but not the layer)} for each of
    `layers` (rewritten with residual_norm_ahead) whose sum a swapped norm then reads, as a probe
    of the model shows (a forward of 2 input_ids, in eval mode, every submodule's mode restored),
    where that norm's residual form matches it."""
    names = {m: n for n, m in model.named_modules()}
    norms = [m for m in names if _ORIGINAL in m.__dict__ and hasattr(type(m), "residual_forward")]
    found = {}

    def reads(norm, args):
        for layer in layers:
            if layer not in found and args and layer.__dict__.get(_PROBED) is args[0]:
                found[layer] = norm

    for layer in layers:
        layer.__dict__[_NEXT_NORM] = _PROBING
    handles = [norm.register_forward_pre_hook(reads) for norm in norms]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device))
    except Exception:  # noqa: BLE001 - a model that cannot take the probe links nothing
        found.clear()
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes:
            m.training = training
        for layer in layers:
            layer.__dict__.pop(_NEXT_NORM, None)
            layer.__dict__.pop(_PROBED, None)
    matches = {norm: _residual_form_matches(norm, device) for norm in set(found.values())}

    def holds(outer, inner):  # by name: "model.layers.1" holds "model.layers.1.input_layernorm"
        return not outer or inner == outer or inner.startswith(f"{outer}.")

    def between(layer, norm):
        return tuple(m for m, n in names.items()
                     if m is not norm and holds(n, names[norm]) and not holds(n, names[layer]))

    return {layer: (norm, names[norm], between(layer, norm)) for layer, norm in found.items() if matches[norm]}


def _assignment(statement):
    """(name, value) of the statement `name = value`, else (None, None)."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
        return statement.targets[0].id, statement.value
    return None, None


def _is_name(node, name):
    return isinstance(node, ast.Name) and node.id == name


def _single_call(node):
    """The argument of `f(arg)` where f is a name or a chain of attributes of one (self.mlp), else None."""
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], ast.Starred)):
        return None
    f = node.func
    while isinstance(f, ast.Attribute):
        f = f.value
    return node.args[0] if isinstance(f, ast.Name) else None


def _operands(add):
    """The keyword arguments residual= and x= of the add `residual + x`, in its order: evaluated as
    the add evaluates them (a sublayer's dropout draws in the same order)."""
    return [ast.keyword("residual", add.left), ast.keyword("x", add.right)]


def _residual_norm_site(statements, self_name):
    """_adjacent_residual_norm_site, or the same add and norm with an optional branch between them
    (GPT-2's cross-attention):

        total = a + b
        if encoder_hidden_states is not None:    # a test without calls that does not read total
            ...                                  # (no else)
        residual = total
        out = self.norm(total)

    which becomes the branch with the add, its body and the copy and norm as they were, and an
    else with them fused: the test is evaluated before the add instead of after it, which only a
    test that reads no name the add binds, and calls nothing, allows."""
    site = _adjacent_residual_norm_site(statements, self_name)
    if site is not None or len(statements) < 3:
        return site
    total, add = _assignment(statements[0])
    branch = statements[1]
    if not (total and isinstance(branch, ast.If) and not branch.orelse and _plain_test(branch.test, total)):
        return None
    site = _adjacent_residual_norm_site(statements[:1] + statements[2:], self_name)
    if site is None:
        return None
    norm, n, fused = site
    kept = copy.deepcopy([statements[0], *branch.body, *statements[2:n + 1]])
    new = ast.copy_location(ast.If(copy.deepcopy(branch.test), kept, fused), branch)
    return norm, n + 1, [ast.fix_missing_locations(new)]


_PLAIN_TEST_NODES = (ast.Name, ast.Constant, ast.Attribute, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Load, ast.Is,
                     ast.IsNot, ast.Eq, ast.NotEq, ast.Not, ast.And, ast.Or)


def _plain_test(test, total):
    """Whether an if statement's test may be evaluated before the add that binds `total`: names,
    constants, attributes, comparisons and boolean operators only (no call, no subscript), and
    not `total`."""
    return all(isinstance(node, _PLAIN_TEST_NODES) and not (isinstance(node, ast.Name) and node.id == total)
               for node in ast.walk(test))


def _adjacent_residual_norm_site(statements, self_name):
    """(the norm's attribute, how many statements, what replaces them) where `statements` begin
    with a residual add whose sum a norm of self's reads next:

        total = a + b
        residual = total                  # where the sum is kept apart (Llama), else in total (StableLM)
        out = self.norm(total)            # or out = f(self.norm(total)): self.mlp, say

    and the sum is kept (out is not total, or the copy is there); else None. The sum and the norm
    become one call of residual_norm, its results bound to the same names."""
    total, add = _assignment(statements[0])
    if not (total and isinstance(add, ast.BinOp) and isinstance(add.op, ast.Add)):
        return None
    rest, copy_ = statements[1:], []
    residual, value = _assignment(rest[0]) if rest else (None, None)
    if residual and residual != total and _is_name(value, total):
        rest, copy_ = rest[1:], rest[:1]
    else:
        residual = None
    out, value = _assignment(rest[0]) if rest else (None, None)
    outer = None
    if _single_call(value) is not None and not _is_name(_single_call(value), total):
        outer, value = value, _single_call(value)
    norm = value.func if _is_name(_single_call(value), total) else None
    if not (out and isinstance(norm, ast.Attribute) and _is_name(norm.value, self_name)) or out == residual \
            or (out == total and not copy_):
        return None
    call = ast.Call(ast.Name(_RESIDUAL_NORM, ast.Load()), [norm], _operands(add))

    def assign(names, value):
        target = ast.Tuple([ast.Name(n, ast.Store()) for n in names], ast.Store()) if len(names) > 1 else \
            ast.Name(names[0], ast.Store())
        return ast.Assign([target], value)

    if outer is None and out == total:  # Llama's: the copy folded in
        new = [assign((total, residual), call)]
    elif outer is None:
        new = [assign((out, total), call)] + copy_
    else:
        outer = ast.Call(outer.func, [ast.Name(_NORMED, ast.Load())], [])
        new = [assign((_NORMED, total), call)] + copy_ + [assign((out,), outer),
                                                           ast.Delete([ast.Name(_NORMED, ast.Del())])]
    for statement in new:
        ast.fix_missing_locations(ast.copy_location(statement, statements[0]))
    return norm.attr, len(statements) - len(rest) + 1, new


def _residual_norm_sites(definition):
    """{norm attribute: [(block, index, statements replaced, what replaces them)]} of the residual
    adds in a function's blocks."""
    self_name = definition.args.args[0].arg if definition.args.args else None
    sites = {}
    for node in ast.walk(definition):
        for block in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
            if isinstance(block, list):
                for i in range(len(block) - 1):
                    site = _residual_norm_site(block[i:i + 4], self_name)
                    if site is not None:
                        sites.setdefault(site[0], []).append((block, i, *site[1:]))
    if self_name is not None:
        for block, i in _end_adds(definition):
            total, add = _assignment(block[i])
            call = ast.Call(ast.Name(_RESIDUAL_NORM_AHEAD, ast.Load()), [ast.Name(self_name, ast.Load())],
                            _operands(add))
            new = ast.fix_missing_locations(ast.copy_location(ast.Assign([ast.Name(total, ast.Store())], call),
                                                              block[i]))
            sites.setdefault(_END, []).append((block, i, 1, [new]))
    return sites


_END = None  # _residual_norm_sites' key of the adds that end the function


def _end_adds(definition):
    """(block, index) of each `total = a + b` whose sum the function returns next: `return total`
    after it, or after the if statement whose branch it ends (GPT-NeoX's two residual forms)."""
    def is_add(statement, name=None):
        total, value = _assignment(statement)
        return total is not None and (name is None or total == name) and isinstance(value, ast.BinOp) \
            and isinstance(value.op, ast.Add)

    def returned(statement):
        return statement.value.id if isinstance(statement, ast.Return) and isinstance(statement.value, ast.Name) \
            else None

    ends = []
    for node in ast.walk(definition):
        for block in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
            if not isinstance(block, list):
                continue
            for i in range(len(block) - 1):
                name = returned(block[i + 1])
                if name is None:
                    continue
                if is_add(block[i], name):
                    ends.append((block, i))
                elif isinstance(block[i], ast.If) and block[i].orelse:
                    branches = (block[i].body, block[i].orelse)
                    if all(b and is_add(b[-1], name) for b in branches):
                        ends += [(b, len(b) - 1) for b in branches]
    return ends


def _residual_form_matches(norm, device):
    """Whether the swapped norm's residual_forward(x, residual) is its original class's forward of
    residual + x, and that sum, on a probe: the outputs and the gradients of x, residual and the
    norm's parameters."""
    original = norm.__dict__[_ORIGINAL]
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        shape, dtype, device = tuple(weight.shape), weight.dtype, weight.device
    else:
        shape, dtype = norm.normalized_shape, torch.get_default_dtype()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
    g = _probe_generator()
    x, residual, grad_y, grad_h = (_randn(g, 3, 5, *shape, device=device, dtype=dtype) * 2 + 0.5 for _ in range(4))
    inputs = [x.requires_grad_(), residual.requires_grad_()] + [p for p in norm.parameters() if p.requires_grad]
    try:
        with torch.enable_grad():
            got = type(norm).residual_forward(norm, x, residual)
            h = residual + x
            expected = (original.forward(norm, h), h)
            got, expected = ([*outs, *torch.autograd.grad(outs, inputs, (grad_y, grad_h), allow_unused=True)]
                             for outs in (got, expected))
    except Exception:  # noqa: BLE001 - a norm whose residual form fails on the probe is simply not a match
        return False
    return all(a is None and b is None or a is not None and b is not None and _close_in_scale(a, b)
               for a, b in zip(got, expected))


def _close_in_scale(a, b):
    """_close with the absolute tolerance scaled by b's largest magnitude: a parameter's gradient
    sums over the probe's rows, and an element that cancels to near 0 keeps the rounding of the
    large terms (a half-precision reference rounds each product before summing; brrr does not)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    tol = _probe_tolerance(a.dtype)
    scale = max(b.float().abs().max().item(), 1.0) if b.numel() else 1.0
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * scale)


def _try_residual_norms(module, device, made):
    """(subclass, what, ends) for a module whose forward adds a residual and hands the sum to a norm
    brrr swapped (see above), or ends with an add (ends: True; what is None where it fuses no other
    add), its forward rewritten for both; (None, why, False) for one that keeps a `residual` and
    calls a swapped norm but has no such add brrr fuses; (None, None, False) for any other. `made`
    keeps, for one patch, each class's parsed forward and sites (by class) and its subclasses (by
    class, norms fused and ends)."""
    norms = {name for name, child in module.named_children() if hasattr(type(child), "residual_forward")}
    if not norms:
        return None, None, False
    cls = type(module)
    chain = _decorators(cls.forward)
    inner = chain[-1] if chain else inspect.unwrap(cls.forward)
    if cls not in made:
        made[cls] = _residual_norm_source(inner)
    definition, sites = made[cls]
    fused, ends = sorted(norms & sites.keys()), _END in sites
    rewritable = chain is not None and not inner.__code__.co_freevars
    if not fused:
        left = _no_residual_site(definition)
    elif chain is None:
        left = "its forward is wrapped by a decorator that brrr cannot rebuild: the residual adds are left"
    elif not rewritable:
        left = "its forward uses a closure (super() or an enclosing function's names): the residual adds are left"
    else:
        wrong = [name for name in fused if not _residual_form_matches(getattr(module, name), device)]
        left = wrong and (f"the residual form of {', '.join(wrong)} does not match its norm on a probe: the residual "
                          "adds are left")
    fused = [] if left else fused
    ends = ends and rewritable
    if not fused and not ends:
        return None, left or None, False
    key = (cls, tuple(fused), ends)
    if key not in made:
        made[key] = _residual_norm_class(cls, chain, definition, fused + [_END] * ends)
    return made[key], (f"the residual add fused into {', '.join(fused)}" if fused else left or None), ends


def _no_residual_site(definition):
    """Why a layer with a swapped norm is left: it keeps a `residual` but has no add brrr fuses."""
    if definition is None or not any(isinstance(n, ast.Name) and n.id == _RESIDUAL and isinstance(n.ctx, ast.Store)
                                     for n in ast.walk(definition)):
        return None
    return (f"{_NO_SITE} `h = {_RESIDUAL} + x; {_RESIDUAL} = h; h = self.norm(h)` with a norm brrr swapped: the "
            "residual adds are left")


_NO_SITE = "its forward has no"


def _residual_norm_source(inner):
    """(the function definition, its residual-add sites) parsed from inner's source, or (None, {})
    where it has none that parses, or the source compiles to other code than inner's (a file
    changed since it was imported)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inner)))
    except (OSError, TypeError, SyntaxError):
        return None, {}
    definition = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(definition, ast.FunctionDef) or definition.name != inner.__name__:
        return None, {}
    # (A forward with a closure is left as it is, for that reason: compiled alone it has none.)
    same = None if inner.__code__.co_freevars else _compiled(inner, copy.deepcopy(definition))
    if same and (same.co_code, same.co_names, same.co_varnames) != (inner.__code__.co_code, inner.__code__.co_names,
                                                                    inner.__code__.co_varnames):
        return None, {}
    return definition, _residual_norm_sites(definition)


def _compiled(inner, definition):
    """The code of `definition` (inner's, maybe rewritten) compiled as inner was: its file, lines
    and __future__ flags; its decorators left out (they are rebuilt around it as objects)."""
    definition.decorator_list = []
    module = ast.Module([definition], [])
    ast.increment_lineno(module, inner.__code__.co_firstlineno - 1)  # the source began at the decorators
    code = compile(module, inspect.getsourcefile(inner) or "<brrr>", "exec",
                   flags=inner.__code__.co_flags & _FUTURE_FLAGS, dont_inherit=True)
    return next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == inner.__name__)


def _residual_norm_class(cls, chain, definition, keys):
    """cls's subclass whose forward is its own with the residual adds of the sites of `keys` (norm
    attributes, and _END for the adds that end it) fused."""
    definition = copy.deepcopy(definition)
    fresh = _residual_norm_sites(definition)  # the same sites, in the copy
    # Each block from its last site back, so that a replacement moves none still to be made.
    for block, i, n, statements in sorted((site for key in keys for site in fresh[key]), key=lambda s: -s[1]):
        block[i:i + n] = statements
    forward = _rebuild_forward(chain, {_RESIDUAL_NORM: residual_norm, _RESIDUAL_NORM_AHEAD: residual_norm_ahead},
                               _compiled(chain[-1], definition))
    return _patched_class(cls, {"forward": forward})


_LOSS_OPTIONS = ("logits_budget", "accumulation")


def patch(model, *, fused_linear_cross_entropy=True, remat="auto"):
    """Swap every module of `model` that brrr fuses, in place; returns a PatchReport.

    fused_linear_cross_entropy: a causal LM whose loss is swapped (see the module) computes that
    loss, in training with labels, from its head's input through brrr.linear_cross_entropy, and
    its output's logits are then None; in eval mode or without labels it returns them as before.
    True, False, or a dict of linear_cross_entropy's keywords logits_budget and accumulation for
    that loss: {"accumulation": "weight"} sums the head's weight gradient in its own dtype, as
    Liger-Kernel does, instead of in a float32 buffer that the gradient then keeps (twice a bf16
    head's bytes: docs/linear-cross-entropy.md).
    remat: the outputs of the norms and gated MLPs it swaps are recomputed in the backward instead
    of saved by the linear layers they feed (brrr.remat; its torch.nn.Linear modules become
    brrr.nn.RematLinear); the report says how many bytes per token that saves. "auto" (the
    default): an output of at least brrr.remat.AUTO_MIN_BYTES, call by call; smaller ones are
    saved, where a recompute's launches would cost more than its bytes save (docs/remat.md: on an
    H200, remat of every output cost a small Llama's host-bound step 8%). True: every output;
    False: none, and no torch.nn.Linear swapped. The global random generators are left as they
    were (the probes draw from a private one).
    Pickling the patched model (torch.save(model), multiprocessing) saves it as it was before the
    patch, so that it loads without brrr: patch it again after loading (a loss_function swapped
    alone, with fused_linear_cross_entropy=False, stays brrr's, in a class of the model's own);
    copy.deepcopy copies it patched; state_dict is the same either way."""
    if remat not in (True, False, "auto"):
        raise ValueError(f"argument remat: expected True, False or 'auto', got {remat!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"argument model: expected a torch.nn.Module, got {type(model).__name__}")
    loss_options = _loss_options(fused_linear_cross_entropy)
    # Outside inference mode: the probes compare gradients (a model used under inference mode is
    # patched as one trained).
    with _rng_states_kept(), _hooks_put_aside(model), torch.inference_mode(False):
        # the smallest output that remat recomputes (None: remat off)
        remat_min_bytes = brrr_remat.AUTO_MIN_BYTES if remat == "auto" else 0 if remat else None
        return _patch(model, fused_linear_cross_entropy is not False, loss_options, remat_min_bytes)


def _loss_options(value):
    """The keywords of patch's fused_linear_cross_entropy argument for linear_cross_entropy,
    checked as linear_cross_entropy checks them."""
    if isinstance(value, bool):
        return {}
    if not isinstance(value, dict) or not set(value) <= set(_LOSS_OPTIONS):
        raise ValueError(f"argument fused_linear_cross_entropy: expected True, False or a dict of "
                         f"{' and '.join(_LOSS_OPTIONS)}, got {value!r}")
    try:
        check_chunking(value.get("logits_budget"), value.get("accumulation", "float32"))
    except (TypeError, ValueError) as error:
        raise type(error)(f"argument fused_linear_cross_entropy: {error}") from None
    return dict(value)


def _patch(model, fused_linear_cross_entropy, loss_options, remat_min_bytes):
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    report = PatchReport()
    forward_classes = {}
    computed_by_parent = {}  # a child a swapped parent's forward computes itself -> the parent's name
    deferring_heads = set()  # the heads of fused linear losses, reported with their model
    remat_bytes = {"norm": [0, 0], "GLU": [0, 0]}  # outputs recomputed, not saved: count, bytes per token
    remat_linears = 0  # torch.nn.Linear modules made brrr.nn.RematLinear
    for name, module in model.named_modules():
        cls = type(module)
        if module in deferring_heads:
            continue
        if name in computed_by_parent:
            report.left.append((name, cls.__name__, f"computed by its parent's brrr forward "
                                                    f"({computed_by_parent[name] or '<root>'})"))
            continue
        loss = _try_loss_function(module, device)
        if loss is not None:
            (report.swapped if loss[0] else report.left).append((name, cls.__name__, loss[1]))
            if loss[0] and fused_linear_cross_entropy and _ORIGINAL not in module.__dict__:
                model_class, head, head_class, what = _try_fused_linear_loss(module, device, loss_options)
                if model_class is None:
                    report.left.append((name, cls.__name__, what))
                else:
                    _swap(module, model_class)
                    _swap(head, head_class)
                    head.__dict__[_PENDING] = []
                    deferring_heads.add(head)
                    head_name = next(n for n, m in module.named_modules() if m is head)
                    report.swapped.append((name, cls.__name__, what))
                    report.swapped.append((f"{name}.{head_name}" if name else head_name, "Linear",
                                           "its logits left to the fused linear cross-entropy in training with "
                                           "labels"))
                    continue
        if _ORIGINAL in module.__dict__:
            report.left.append((name, cls.__name__, "already patched"))
            for child in getattr(cls, "_brrr_computes", ()):
                computed_by_parent[f"{name}.{child}" if name else child] = name
            continue
        if cls in brrr_nn.TWINS:
            twin = brrr_nn.TWINS[cls]
            _swap(module, twin)
            report.swapped.append((name, cls.__name__, f"brrr.nn.{twin.__name__}"))
            continue
        if remat_min_bytes is not None and cls is torch.nn.Linear:
            _swap(module, brrr_nn.RematLinear)  # said in remat's note: no fusion of its own
            remat_linears += 1
            continue
        new_class, what = _try_forward_globals(module, device, forward_classes)
        if new_class is None and what is None:
            new_class, what = _try_glu_mlp(module, remat_min_bytes)
        if new_class is None and what is None:
            new_class, what = _try_experts_gate(module)
        if new_class is None and what is None:
            new_class, what = _try_residual_layer_norm(module)
        if new_class is None and what is None:
            new_class, what = _try_plain_norm(module, device, remat_min_bytes)
        if new_class is None and what is not None:
            report.left.append((name, cls.__name__, what))
            continue
        if new_class is None and hasattr(module, "weight") and _eps_attribute(module) is not None:
            new_class, what = _try_norm(module, remat_min_bytes)
            if new_class is None:
                report.left.append((name, cls.__name__, what))
                continue
        if new_class is None:
            found = _try_activation(module, device)
            if found is not None:
                new_class, what = found
        if new_class is not None:
            _swap(module, new_class)
            report.swapped.append((name, cls.__name__, what))
            for child in getattr(new_class, "_brrr_computes", ()):
                computed_by_parent[f"{name}.{child}" if name else child] = name
            if getattr(new_class, "_brrr_remat", None) is not None:
                kind, out, like = _remat_output(module, first)
                remat_bytes[kind][0] += 1
                remat_bytes[kind][1] += out * like.element_size()
    residual_made = {}  # per class: its forward's source and sites; per class and norms: its subclass
    ending = {}  # a layer rewritten for the add that ends it -> (name, class name, what else, why left)
    for name, module in model.named_modules():
        if _ORIGINAL in module.__dict__:
            continue
        cls = type(module)
        new_class, what, ends = _try_residual_norms(module, device, residual_made)
        if new_class is not None:
            _swap(module, new_class)
        if ends:
            fuses_other = what is not None and what.startswith("the residual add fused")
            ending[module] = (name, cls.__name__, what if fuses_other else None, None if fuses_other else what)
        elif new_class is not None:
            report.swapped.append((name, cls.__name__, what))
        elif what is not None:
            report.left.append((name, cls.__name__, what))
    links = _link_layer_ends(model, device, list(ending)) if ending else {}
    for module, (name, cls_name, what, why) in ending.items():
        if module in links:
            norm, norm_name, between = links[module]
            module.__dict__[_NEXT_NORM] = (norm, between)
            if not getattr(type(norm), "_brrr_takes_ahead", False):
                norm.__class__ = _subclass(type(norm), "ahead", _ahead_forward(type(norm).forward),
                                           _brrr_takes_ahead=True)
            end = f"the add that ends it fused into {norm_name}"
            report.swapped.append((name, cls_name, f"{what}; {end}" if what else f"the residual {end[4:]}"))
            if why is not None and not why.startswith(_NO_SITE):  # its inner adds left for a reason of their own
                report.left.append((name, cls_name, why))
        elif what is not None:
            report.swapped.append((name, cls_name, what))
        else:  # nothing of it fused: its own class again
            module.__class__ = module.__dict__.pop(_ORIGINAL)
            if why is not None:
                report.left.append((name, cls_name, why))
    if any(why == "already patched" for _, _, why in report.left):
        report.notes.append("modules already patched keep the options of the patch that swapped them "
                            "(brrr.unpatch the model first to patch it with others)")
    if remat_min_bytes is not None:
        (norms, norm_bytes), (glus, glu_bytes) = remat_bytes["norm"], remat_bytes["GLU"]
        report.notes.append(f"remat: the backward recomputes the outputs of {norms} norms and {glus} gated MLPs' GLUs "
                            f"instead of saving them for their linear layers: {norm_bytes + glu_bytes} bytes per token "
                            "not held from the forward to the backward" +
                            (f" (outputs of at least {remat_min_bytes} bytes)" if remat_min_bytes else "") +
                            f"; its {remat_linears} torch.nn.Linear modules are brrr.nn.RematLinear")
    if device.type == "cpu" and report.swapped and any(registry.lookup(n).cpu == "pytorch" for n in registry.names()):
        report.notes.append("the model is on the CPU, where the registry runs PyTorch's functions for the ops whose "
                            "CPU kernels measured faster than brrr's, unless told registry.on_cpu(name, 'kernel'), "
                            "and brrr's for the others; on a GPU brrr's kernels run for all.")
    return report


def _remat_output(module, first):
    """(kind, features per token, a tensor of its dtype) of the output a swapped module's remat
    recomputes: a GLU's product, or a norm's output (a norm without weight: in the model's dtype)."""
    if hasattr(module, "down_proj"):
        return "GLU", module.down_proj.in_features, module.down_proj.weight
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return "norm", weight.numel(), weight
    shape = module.normalized_shape
    return ("norm", math.prod((shape,) if isinstance(shape, int) else shape),
            first if first is not None else torch.empty(0))  # a model without parameters: the default dtype


def unpatch(model):
    """Give every module brrr.patch swapped its original class (and loss_function) back; returns
    how many it restored."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"argument model: expected a torch.nn.Module, got {type(model).__name__}")
    restored = 0
    for module in model.modules():
        changed = module.__dict__.pop(_ORIGINAL_LOSS, None)
        for key, value in (changed or {}).items():
            if value is _MISSING:
                del module.__dict__[key]
            else:
                module.__dict__[key] = value
        restored += changed is not None
        original = module.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            module.__class__ = original
            for key in (_PENDING, _NEXT_NORM, _AHEAD):
                module.__dict__.pop(key, None)
            restored += 1
    return restored


# torch.nn.functional's names that brrr.use_fused routes into the registry, and their routes
# (with F's signatures): each family declares its own (the `functional` of its PyTorch integration).
_ROUTES = {name: route for family in INTEGRATIONS for name, route in family.functional.items()}


@contextlib.contextmanager
def use_fused():
    """Within the block, torch.nn.functional.gelu, silu, layer_norm, rms_norm, cross_entropy, softmax and log_softmax
    (and the torch.nn modules that call them) run brrr's kernels for the inputs brrr supports. Not
    thread-safe: it rebinds the functions of torch.nn.functional for the whole process."""
    previous = {name: getattr(F, name) for name in _ROUTES}
    try:
        for name, fn in _ROUTES.items():
            setattr(F, name, fn)
        yield
    finally:
        for name, fn in previous.items():
            setattr(F, name, fn)
