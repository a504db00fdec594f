"""brrr.patch's fused residual add of pre-norm decoder layers: the add that hands a sublayer's sum
to the layer's next norm, and that norm, as one add_rms_norm or add_layer_norm (brrr/_patch.py).
Layers written in each form the rewrite takes (and some it must leave, with the reason), against
the unpatched layers: outputs and every gradient; the fused call against the add and the norm,
bitwise where brrr's kernels compute both; hooks, gradient checkpointing, remat, torch.compile
(fullgraph) and the residual adds left in a transformers Llama's training step. The add that ends a
layer, with the norm that reads its sum next (the next layer's first, the model's last): the
calls, and the layer boundaries (hooks, output_hidden_states, gradient checkpointing)."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import brrr
from brrr import registry
from brrr._patch import residual_norm
from helpers import reset_registry

HIDDEN = 24
FUSED = "the residual add fused into post_attention_layernorm"
ENDS = "the add that ends it fused into {}"
NO_SITE = ("its forward has no `h = residual + x; residual = h; h = self.norm(h)` with a norm brrr swapped: the "
           "residual adds are left")


class RMSNorm(nn.Module):
    """Llama's RMSNorm, written out."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class ClampedRMSNorm(RMSNorm):
    """An RMSNorm of its input clamped to [-9, 9]: on the norm's probe (values within it) an RMSNorm,
    on the sum of two such probes not."""

    def forward(self, x):
        return super().forward(x.clamp(-9, 9))


class Layer(nn.Module):
    """A pre-norm decoder layer in Llama's layout: the residual add, the copy, the norm."""

    def __init__(self, norm=RMSNorm, sequential=True):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = norm(HIDDEN), norm(HIDDEN)
        self.attn, self.mlp = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.sequential = sequential

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(self.input_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class SumFirstLayer(Layer):
    """The sublayer's output first, and an expression (Granite's residual_multiplier)."""

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(self.input_layernorm(hidden_states))
        hidden_states = hidden_states * 0.5 + residual
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class BranchLayer(Layer):
    """The add inside a branch (GPT-NeoX's use_parallel_residual): fused there, the other branch kept."""

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.sequential:
            hidden_states = residual + self.attn(hidden_states)
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            return residual + self.mlp(hidden_states)
        return residual + self.attn(hidden_states) + self.mlp(self.post_attention_layernorm(residual))


class CrossBranchLayer(Layer):
    """GPT-2's: an optional branch (its cross-attention) between the add and the norm, with a test
    of names and attributes only: fused where the branch is skipped; where it runs, the add, the
    branch and the norm as written."""

    def __init__(self):
        super().__init__()
        self.cross = None

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(self.input_layernorm(hidden_states))
        hidden_states = hidden_states + residual
        if self.cross is not None and self.sequential:
            residual = hidden_states
            hidden_states = residual + self.cross(hidden_states)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class CalledBranchLayer(CrossBranchLayer):
    """The branch's test calls a function, which must then run after the add, as written: left."""

    def has_cross(self):
        return self.cross is not None

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(self.input_layernorm(hidden_states))
        hidden_states = hidden_states + residual
        if self.has_cross():
            residual = hidden_states
            hidden_states = residual + self.cross(hidden_states)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class NestedLayer(Layer):
    """StableLM's: the sum is the residual, its norm the argument of the next call."""

    def forward(self, hidden_states):
        residual = hidden_states
        attn_output = self.attn(self.input_layernorm(hidden_states))
        residual = residual + attn_output
        mlp_output = self.mlp(self.post_attention_layernorm(residual))
        return residual + mlp_output


class DropoutLayer(Layer):
    """Both operands of the add draw a dropout mask: the fused call must evaluate them in the add's order."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(self.input_layernorm(hidden_states))
        hidden_states = self.drop(residual) + self.drop(hidden_states)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


def test_the_fused_call_evaluates_the_operands_in_the_adds_order():
    model = stack(DropoutLayer).train()
    unpatched = copy.deepcopy(model)
    report = brrr.patch(model)
    assert sum(what == FUSED for _, _, what in report.swapped) == 2, str(report)
    x, grad = torch.randn(3, 5, HIDDEN), torch.randn(3, 5, HIDDEN)
    results = []
    for m in (model, unpatched):
        torch.manual_seed(11)
        results.append(outputs_and_grads(m, x, grad))
    (y, grads), (expected_y, expected_grads) = results
    torch.testing.assert_close(y, expected_y, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


DECORATED_CALLS = []


def counted(forward):
    """A decorator holding the function it wraps in a closure cell (as transformers' do)."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        DECORATED_CALLS.append(type(self))
        return forward(self, *args, **kwargs)
    return wrapper


class DecoratedLayer(Layer):
    @counted
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = residual + self.attn(self.input_layernorm(hidden_states))
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


def opaque(forward):
    """A decorator that calls what it wraps through a default argument, not a closure cell."""
    @functools.wraps(forward)
    def wrapper(self, *args, _forward=forward, **kwargs):
        return _forward(self, *args, **kwargs)
    return wrapper


class OpaqueDecoratedLayer(Layer):
    @opaque
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = residual + self.attn(self.input_layernorm(hidden_states))
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class SuperLayer(Layer):
    """Its forward calls super(): a closure over __class__, which a recompiled copy cannot keep."""

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = residual + super().forward(hidden_states) * 0
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class ParallelLayer(Layer):
    """Cohere's and Falcon's: attention and MLP on one norm, both added at once."""

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        return residual + self.attn(hidden_states) + self.mlp(self.post_attention_layernorm(hidden_states))


class SubtractingLayer(Layer):
    """A look-alike: the sublayer's output subtracted."""

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = residual - self.attn(self.input_layernorm(hidden_states))
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class StaleSourceLayer(Layer):
    """SubtractingLayer's code with Layer.forward's lines as its place in the file: its source (read
    from those lines) is not its code, as after a file changed since it was imported."""

    forward = type(Layer.forward)(SubtractingLayer.forward.__code__.replace(
        co_firstlineno=Layer.forward.__code__.co_firstlineno), globals())


def stack(layer, *args, **kwargs):
    torch.manual_seed(0)
    return nn.Sequential(layer(*args, **kwargs), layer(*args, **kwargs))


def outputs_and_grads(model, x, grad):
    x = x.detach().requires_grad_()
    y = model(x)
    params = list(model.parameters())
    grads = torch.autograd.grad(y, [x, *params], grad)
    return y.detach(), grads


def recording(names):
    """Overrides of the registry's `names` that note each call, then run brrr's function."""
    calls = []
    for name in names:
        fn = getattr(brrr, name)
        registry.override(name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    return calls


@pytest.mark.parametrize("layer", [Layer, SumFirstLayer, BranchLayer, NestedLayer, DecoratedLayer, CrossBranchLayer])
def test_patch_fuses_the_residual_add_of_pre_norm_layers(layer):
    model = stack(layer)
    unpatched = copy.deepcopy(model)
    report = brrr.patch(model)
    assert {(n, what) for n, _, what in report.swapped if what.startswith("the residual")} == {
        ("0", FUSED), ("1", FUSED)}, str(report)
    x, grad = torch.randn(3, 5, HIDDEN), torch.randn(3, 5, HIDDEN)
    DECORATED_CALLS.clear()
    try:
        calls = recording(["add_rms_norm"])
        y, grads = outputs_and_grads(model, x, grad)
    finally:
        reset_registry()
    assert calls == ["add_rms_norm"] * 2
    # the decorator, rebuilt around the new forward, still runs (the patched class: a subclass under
    # the layer's own name)
    assert DECORATED_CALLS == ([type(model[0])] * 2 if layer is DecoratedLayer else [])
    assert type(model[0]) is not layer and type(model[0]).__name__ == layer.__name__
    expected_y, expected_grads = outputs_and_grads(unpatched, x, grad)
    torch.testing.assert_close(y, expected_y, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if layer is BranchLayer:  # the other branch unchanged
        for m in (model, unpatched):
            for part in m:
                part.sequential = False
        torch.testing.assert_close(outputs_and_grads(model, x, grad)[0], outputs_and_grads(unpatched, x, grad)[0],
                                   rtol=1e-5, atol=1e-5)
    if layer is CrossBranchLayer:  # the branch taken: the add, the branch and the norm as written
        cross = nn.Linear(HIDDEN, HIDDEN)
        for m in (model, unpatched):
            for part in m:
                part.cross = cross
        try:
            calls = recording(["add_rms_norm"])
            y, grads = outputs_and_grads(model, x, grad)
        finally:
            reset_registry()
        assert calls == []
        expected_y, expected_grads = outputs_and_grads(unpatched, x, grad)
        torch.testing.assert_close(y, expected_y, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, expected_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert brrr.unpatch(model) > 0 and type(model[0]) is layer


@pytest.mark.parametrize("layer,why", [
    (ParallelLayer, NO_SITE),
    (SubtractingLayer, NO_SITE),
    (CalledBranchLayer, NO_SITE),
    (OpaqueDecoratedLayer,
     "its forward is wrapped by a decorator that brrr cannot rebuild: the residual adds are left"),
    (SuperLayer, "its forward uses a closure (super() or an enclosing function's names): the residual adds are left"),
    (functools.partial(Layer, ClampedRMSNorm),
     "the residual form of post_attention_layernorm does not match its norm on a probe: the residual adds are left"),
], ids=["parallel", "subtracting", "called-branch-test", "opaque-decorator", "super", "clamped-norm"])
def test_patch_leaves_a_layer_it_cannot_fuse_with_the_reason(layer, why):
    model = stack(layer)
    unpatched = copy.deepcopy(model)
    report = brrr.patch(model)
    assert [(n, w) for n, _, w in report.left if "residual" in w] == [("0", why), ("1", why)], str(report)
    assert not any(w.startswith("the residual") for _, _, w in report.swapped), str(report)
    assert all(type(part).forward is type(original).forward for part, original in zip(model, unpatched))
    x, grad = torch.randn(3, 5, HIDDEN), torch.randn(3, 5, HIDDEN)
    torch.testing.assert_close(outputs_and_grads(model, x, grad)[0], outputs_and_grads(unpatched, x, grad)[0],
                               rtol=1e-5, atol=1e-5)


def test_patch_leaves_a_layer_whose_source_is_not_its_code():
    model = stack(StaleSourceLayer)
    unpatched = copy.deepcopy(model)
    report = brrr.patch(model)
    assert not any("residual" in what for _, _, what in report.swapped + report.left), str(report)
    x, grad = torch.randn(3, 5, HIDDEN), torch.randn(3, 5, HIDDEN)
    torch.testing.assert_close(outputs_and_grads(model, x, grad)[0], outputs_and_grads(unpatched, x, grad)[0],
                               rtol=1e-5, atol=1e-5)


def transformers_norms():
    transformers = pytest.importorskip("transformers")
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    assert transformers
    return {"llama": LlamaRMSNorm(HIDDEN, eps=1e-6), "gemma": GemmaRMSNorm(HIDDEN, eps=1e-6),
            "olmo": OlmoLayerNorm(HIDDEN), "cohere": CohereLayerNorm(HIDDEN, eps=1e-5),
            "layer_norm": nn.LayerNorm(HIDDEN), "rms_norm": nn.RMSNorm(HIDDEN, eps=1e-6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["llama", "gemma", "olmo", "cohere", "layer_norm", "rms_norm"])
def test_the_fused_call_is_the_add_then_the_norm(kind, dtype):
    """residual_norm(norm, x, residual): the sum bitwise residual + x in the model's dtype, the
    output bitwise the swapped norm of it (remat recomputes it so), near the unpatched norm's;
    gradients of x, residual and the parameters those of the add and the norm."""
    torch.manual_seed(1)
    norm = transformers_norms()[kind]
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    norm = norm.to(dtype)
    original = copy.deepcopy(norm)
    assert len(brrr.patch(norm).swapped) == 1
    shape = (3, 7, HIDDEN)
    x, residual, grad_y, grad_h = (torch.randn(shape).to(dtype) * 2 for _ in range(4))
    x.requires_grad_(), residual.requires_grad_()
    params = list(norm.parameters())
    y, h = residual_norm(norm, x, residual)
    assert torch.equal(h, residual + x)
    assert torch.equal(y, norm(residual + x))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, original(residual + x), **tol)
    grads = torch.autograd.grad((y, h), [x, residual, *params], (grad_y, grad_h))
    h_ref = residual + x
    expected = torch.autograd.grad((norm(h_ref), h_ref), [x, residual, *params], (grad_y, grad_h))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, **tol)


def test_a_norm_with_hooks_is_called_as_before():
    """A hook on the norm sees its call: residual_norm runs the add and the norm's own call then."""
    model = stack(Layer)
    unpatched = copy.deepcopy(model)
    brrr.patch(model)
    seen = []

    def hook(module, args, output):
        seen.append(args[0].shape)
        return output * 2

    for m in (model, unpatched):
        m[1].post_attention_layernorm.register_forward_hook(hook)
    x, grad = torch.randn(3, 5, HIDDEN), torch.randn(3, 5, HIDDEN)
    y, grads = outputs_and_grads(model, x, grad)
    assert seen == [(3, 5, HIDDEN)]
    expected_y, expected_grads = outputs_and_grads(unpatched, x, grad)
    torch.testing.assert_close(y, expected_y, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def llama(layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def loss_and_grads(model, tokens):
    loss = model(input_ids=tokens, labels=tokens).loss
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def assert_same_training_step(patched, base, tokens):
    """The patched model's loss and every gradient, the unpatched model's."""
    loss, grads = loss_and_grads(patched, tokens)
    expected_loss, expected_grads = loss_and_grads(base, tokens)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_the_fused_layer(reentrant):
    """Each layer's forward runs again in the backward: its inner add fused each time; the add that
    ends it a plain add in a checkpointed layer (the non-reentrant form would find the next norm's
    saved tensors in one run of the layer and not the other; the reentrant form runs the layer
    without grad, and the next norm would compute its output anew)."""
    base = llama()
    patched = copy.deepcopy(base)
    report = brrr.patch(patched)
    assert sum(what.startswith(FUSED) for _, _, what in report.swapped) == 2
    for m in (base, patched):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    def loss_and_grads(model, tokens):  # .backward(): the reentrant form takes no autograd.grad
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return loss, [p.grad for p in model.parameters()]

    try:
        calls = recording(["add_rms_norm"])
        loss, grads = loss_and_grads(patched, tokens)
    finally:
        reset_registry()
    assert calls == ["add_rms_norm"] * 4  # each layer's inner add, in its forward and again in the backward
    expected_loss, expected_grads = loss_and_grads(base, tokens)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_add_that_ends_a_layer_runs_with_the_next_norm():
    """Llama: each layer's last add is the residual form of the norm that reads its sum next (the
    next layer's input_layernorm, the model's norm after the last), and that norm's own call
    returns the output computed with it: one rms_norm in a step's forward (the first layer's
    input norm), two add_rms_norm per layer; the loss and every gradient as unpatched."""
    base = llama(layers=3)
    patched = copy.deepcopy(base)
    report = brrr.patch(patched)
    ends = {n: what for n, _, what in report.swapped if what.startswith(FUSED)}
    assert ends == {f"model.layers.{i}": f"{FUSED}; {ENDS.format(nxt)}" for i, nxt in
                    enumerate(["model.layers.1.input_layernorm", "model.layers.2.input_layernorm", "model.norm"])}
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    try:
        calls = recording(["rms_norm", "add_rms_norm"])
        loss, grads = loss_and_grads(patched, tokens)
    finally:
        reset_registry()
    assert sorted(calls) == ["add_rms_norm"] * 6 + ["rms_norm"], calls
    assert not any("_brrr_ahead" in m.__dict__ for m in patched.modules())  # each taken
    clone = copy.deepcopy(patched)  # its layers' links to its own norms
    layers = clone.model.layers
    # each norm, with the modules that hold it but not the layer: the next layer, none for the model's norm
    assert [layer.__dict__["_brrr_next_norm"] for layer in layers] == [
        (layers[1].input_layernorm, (layers[1],)), (layers[2].input_layernorm, (layers[2],)), (clone.model.norm, ())]
    expected_loss, expected_grads = loss_and_grads(base, tokens)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert brrr.unpatch(patched) > 0
    assert not any(k.startswith("_brrr") for m in patched.modules() for k in m.__dict__)


def _scale_output(module, args, output):
    return output * 1.5


def _pre_hook_on_norm(module, args):
    return (args[0] * 0.5,)


def _steer_in_place(module, args):
    args[0].add_(0.25)


@pytest.mark.parametrize("case", ["hidden states", "layer hook", "norm pre-hook", "next layer steered in place",
                                  "no grad", "inference mode", "twice"])
def test_the_layer_boundaries_hold_with_the_add_that_ends_a_layer(case):
    """Each layer still returns its whole sum: output_hidden_states as unpatched; a hook on a layer
    or on the norm that changes what the norm reads, forward and backward as unpatched, also a
    pre-hook of the next layer that changes its input in place (which the fused call would have
    saved for its backward); a forward without grad, and one in inference mode (its tensors keep
    no version: the adds as before); a second step."""
    base = llama(layers=3)
    patched = copy.deepcopy(base)
    brrr.patch(patched)
    for m in (base, patched):
        if case == "layer hook":
            m.model.layers[0].register_forward_hook(_scale_output)
        if case == "norm pre-hook":
            m.model.layers[2].input_layernorm.register_forward_pre_hook(_pre_hook_on_norm)
        if case == "next layer steered in place":
            m.model.layers[1].register_forward_pre_hook(_steer_in_place)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(4))
    if case == "hidden states":
        for m in (base, patched):
            m.eval()
        with torch.no_grad():
            got, expected = (m(input_ids=tokens, output_hidden_states=True).hidden_states for m in (patched, base))
        assert len(got) == len(expected) == 4
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # transformers keeps its output recorders on the layers: the adds that end them still fused
        try:
            calls = recording(["rms_norm"])
            loss_and_grads(patched.train(), tokens)
        finally:
            reset_registry()
        assert calls == ["rms_norm"], calls
        return
    if case in ("no grad", "inference mode"):
        with torch.no_grad() if case == "no grad" else torch.inference_mode():
            torch.testing.assert_close(patched(input_ids=tokens).logits, base(input_ids=tokens).logits,
                                       rtol=1e-4, atol=1e-5)
        return
    for _ in range(2 if case == "twice" else 1):
        loss, grads = loss_and_grads(patched, tokens)
        expected_loss, expected_grads = loss_and_grads(base, tokens)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, expected_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_user_hooks_see_no_probe_and_a_hooked_child_runs_its_own_call():
    """patch's probes run with the user's hooks (module and global) put aside, and back after; a
    hook on a child that the patched parent computes itself (the MLP's activation, inside the
    fused GLU) makes the parent run its original forward, so the hook fires and its change
    counts, forward and backward as unpatched."""
    base = llama()
    patched = copy.deepcopy(base)
    seen = []

    def temperature(module, args, output):
        seen.append(tuple(output.shape))
        return output * 0.5

    for m in (base, patched):
        m.model.layers[0].mlp.act_fn.register_forward_hook(temperature)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: seen.append("global"))
    try:
        report = brrr.patch(patched)
    finally:
        handle.remove()
    assert seen == [], seen
    assert ("model.layers.0.mlp", "LlamaMLP", "gated MLP (swiglu)") in report.swapped, str(report)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(6))
    assert_same_training_step(patched, base, tokens)
    assert seen == [(2, 9, 64)] * 2  # the patched model's hook, then the unpatched one's


def test_a_second_patch_swaps_nothing_more():
    """Patching a patched model again: nothing swapped (a GLU's activation, which its MLP computes,
    left as the first patch left it), and a note that the first patch's options stay."""
    model = llama()
    brrr.patch(model)
    classes = [type(m) for m in model.modules()]
    again = brrr.patch(model, remat=False)
    assert again.swapped == [] and [type(m) for m in model.modules()] == classes, str(again)
    assert any("keep the options of the patch that swapped them" in note for note in again.notes)


def test_patch_under_inference_mode_fuses_as_outside_it():
    outside, inside = llama(), llama()
    expected = brrr.patch(outside)
    with torch.inference_mode():
        got = brrr.patch(inside)
    assert got.swapped == expected.swapped and got.left == expected.left, str(got)
    with pytest.raises(TypeError, match="^argument model: expected a torch.nn.Module, got NoneType"):
        brrr.unpatch(None)


@pytest.mark.parametrize("part", ["model.norm", "model.layers.1", "model.layers.1.input_layernorm"])
def test_a_model_with_a_part_unpatched_runs_as_before(part):
    """brrr.unpatch of one module (and what it holds): the layer before it no longer finds a
    swapped norm to run its last add with, and adds as before; loss and gradients as unpatched."""
    base = llama(layers=3)
    patched = copy.deepcopy(base)
    brrr.patch(patched)
    assert brrr.unpatch(patched.get_submodule(part)) > 0
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5))
    assert_same_training_step(patched, base, tokens)


def test_a_layer_checkpointed_by_torch_alone_runs_the_norm_before_it_itself():
    """torch.utils.checkpoint (non-reentrant) around one layer, not through transformers: that layer
    runs under saved-tensor hooks, so its first norm computes its output itself, as it will again
    when the backward recomputes the layer (the fused call's output left unused would make the two
    runs save different tensors, which checkpoint refuses); the loss and every gradient as unpatched."""
    base = llama(layers=3)
    patched = copy.deepcopy(base)
    brrr.patch(patched)
    for m in (base, patched):
        layer = m.model.layers[1]
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5))
    assert_same_training_step(patched, base, tokens)


class ResidualAdds(TorchDispatchMode):
    """Counts the adds of two (rows..., hidden) tensors the dispatcher runs: the residual adds."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden, self.count = hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor) and all(
                isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[-1] == self.hidden for a in args[:2]):
            self.count += 1
        return out


def test_a_patched_llama_step_runs_its_residual_adds_in_its_norms():
    """Forward: the unpatched layer's two residual adds, none in the patched one (the inner one
    inside add_rms_norm with the layer's second norm, the one that ends it with the next layer's
    first norm or the model's last); the backward's sums of the residual stream's gradients
    likewise."""
    base = llama(layers=3)
    patched = copy.deepcopy(base)
    brrr.patch(patched)
    tokens = torch.randint(0, 101, (2, 9))
    counts = {}
    for name, model in (("unpatched", base), ("patched", patched)):
        with ResidualAdds(32) as forward:
            loss = model(input_ids=tokens, labels=tokens).loss
        with ResidualAdds(32) as backward:
            loss.backward()
        counts[name] = forward.count, backward.count
    assert counts["unpatched"][0] == 2 * 3 and counts["patched"][0] == 0, counts
    assert counts["patched"][1] <= counts["unpatched"][1] - 2 * 3, counts


def test_the_fused_layer_compiles_without_graph_breaks_to_brrrs_op():
    """torch.compile(fullgraph=True) of a patched Llama's training loss with brrr's kernels under
    compile: brrr::add_rms_norm in the graph, eager's loss and gradients (aot_eager)."""
    model = llama()
    brrr.patch(model)
    tokens = torch.randint(0, 101, (2, 7))
    params = list(model.parameters())

    def loss_of(tokens):
        return model(input_ids=tokens, labels=tokens).loss

    torch._dynamo.reset()
    try:
        registry.under_compile("add_rms_norm", "kernel")
        explanation = torch._dynamo.explain(loss_of)(tokens)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        ops = {str(n.target) for g in explanation.graphs for n in g.graph.nodes}
        assert "brrr.add_rms_norm.default" in ops, ops
        compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")(tokens)
        eager = loss_of(tokens)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(compiled, params), torch.autograd.grad(eager, params)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    finally:
        reset_registry()
        torch._dynamo.reset()


# ---- CUDA -----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hidden", [64, 1000, 1032, 2048, 4096, 4097, 4104, 5120, 8192])
def test_the_fused_output_is_the_norm_of_the_sum_bitwise_on_cuda(hidden, dtype):
    """What remat relies on: add_rms_norm's and add_layer_norm's output is rms_norm's and
    layer_norm's of their sum, bitwise, and the sum is torch's; at 1032, 4104 and 5120 too, where
    the two half forward kernels (BRRR_NORM_FWD_KERNEL) lay a row's sums out differently."""
    torch.manual_seed(hidden)
    x, residual = (torch.randn(37, hidden, device="cuda").to(dtype) * 2 for _ in range(2))
    weight, bias = (torch.randn(hidden, device="cuda").to(dtype) for _ in range(2))
    for cast_order, offset in (("llama", 0.0), ("torch", 0.0), ("torch", 1.0)):
        y, h = brrr.add_rms_norm(x, residual, (hidden,), weight, 1e-6, cast_order=cast_order, offset=offset)
        assert torch.equal(h, residual + x)
        assert torch.equal(y, brrr.rms_norm(h, (hidden,), weight, 1e-6, cast_order=cast_order, offset=offset))
    y, h = brrr.add_layer_norm(x, residual, (hidden,), weight, bias, 1e-5)
    assert torch.equal(h, residual + x) and torch.equal(y, brrr.layer_norm(h, (hidden,), weight, bias, 1e-5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_patched_llama_on_cuda_runs_the_fused_add_and_matches(dtype):
    base = llama().to("cuda", dtype)
    patched = copy.deepcopy(base)
    brrr.patch(patched)
    tokens = torch.randint(0, 101, (4, 33), device="cuda")
    try:
        calls = recording(["add_rms_norm"])
        loss, grads = loss_and_grads(patched, tokens)
    finally:
        reset_registry()
    assert calls == ["add_rms_norm"] * 4  # each layer's two adds
    expected_loss, expected_grads = loss_and_grads(base, tokens)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, expected_loss, **tol)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("hidden", [1024, 2048])
def test_a_half_precision_llama_layer_is_fused_at_real_widths(hidden):
    """bf16 at widths of real models, brrr's CPU kernels forced: the probe's parameter gradient sums
    15 rows, and where an element cancels to near 0 the unpatched bf16 reference keeps the
    rounding of its rounded products; an elementwise tolerance refused the fused form on the H200
    (Llama, hidden 1024) for that alone."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    try:
        registry.on_cpu("add_rms_norm", "kernel")
        registry.on_cpu("rms_norm", "kernel")
        report = brrr.patch(model)
    finally:
        reset_registry()
    fused = f"{FUSED}; {ENDS.format('model.norm')}"
    assert ("model.layers.0", fused) in {(n, what) for n, _, what in report.swapped}, str(report)
