"""The registry, brrr.nn, brrr.patch and use_fused on a small GPT-style model (and its causal-LM
loss, as Hugging Face models compute it)."""

import copy
import functools
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import CrossEntropyLoss

import brrr
from brrr import registry
from brrr import causal_lm_loss
from helpers import DEVICES, reset_registry


class LlamaStyleRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, written out: normalise in fp32, cast, then scale."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class GemmaStyleRMSNorm(LlamaStyleRMSNorm):
    """Scales by (1 + weight), as Gemma's RMSNorm does."""

    def forward(self, x):
        return super().forward(x) / self.weight * (1 + self.weight)


class TwoPlusWeightRMSNorm(LlamaStyleRMSNorm):
    """Scales by (2 + weight): looks like an RMSNorm, computes something else."""

    def forward(self, x):
        return super().forward(x) / self.weight * (2 + self.weight)


class NewGELU(nn.Module):
    """transformers' NewGELUActivation: the tanh form, written out."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


class GatedMLP(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """Phi-3's: one projection for gate and up; `swap` multiplies the halves the other way round."""

    def __init__(self, hidden, inner, swap=False):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.activation_fn = nn.GELU(approximate="tanh")
        self.swap = swap

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.swap:
            gate, up = up, gate
        return self.down_proj(up * self.activation_fn(gate))


class PostNormResidual(nn.Module):
    """BERT's BertSelfOutput; `norm_first` adds the residual after the norm (a look-alike)."""

    def __init__(self, inner, hidden, p=0.1, norm_first=False):
        super().__init__()
        self.dense = nn.Linear(inner, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(p)
        self.norm_first = norm_first

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        if self.norm_first:
            return self.LayerNorm(hidden_states) + input_tensor
        return self.LayerNorm(hidden_states + input_tensor)


class GeluMLP(nn.Module):
    def __init__(self, hidden, inner, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(hidden, inner), act, nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden, heads, style):
        super().__init__()
        llama = style == "llama"
        self.norm1 = LlamaStyleRMSNorm(hidden) if llama else nn.LayerNorm(hidden)
        self.norm2 = LlamaStyleRMSNorm(hidden) if llama else nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=not llama)
        self.proj = nn.Linear(hidden, hidden, bias=not llama)
        self.mlp = GatedMLP(hidden, 2 * hidden) if llama else GeluMLP(hidden, 4 * hidden, NewGELU() if style == "gpt2" else nn.GELU())
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, style, vocab=97, hidden=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, style) for _ in range(layers))
        self.norm = LlamaStyleRMSNorm(hidden) if style == "llama" else nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def hf_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                      **kwargs):
    """transformers' ForCausalLMLoss, written out: upcast, shift, cross-entropy, mean or sum / n."""
    logits = logits.float()
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits, shift_labels = logits.view(-1, vocab_size), shift_labels.view(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if reduction == "sum" else loss


def unshifted_loss(logits, labels, vocab_size, **kwargs):
    """A token-level loss (no shift): not a causal-LM loss, which patch must leave alone."""
    return F.cross_entropy(logits.float().view(-1, vocab_size), labels.view(-1))


class TinyCausalLM(nn.Module):
    """TinyGPT with a Hugging Face-style loss: forward(tokens, labels) -> (logits, loss), the loss
    from a `loss_function` property whose setter keeps the new value in `_loss_function`."""

    def __init__(self, style, default_loss=hf_causal_lm_loss):
        super().__init__()
        self.model = TinyGPT(style)
        self.default_loss = default_loss

    @property
    def loss_function(self):
        return self._loss_function if "_loss_function" in self.__dict__ else self.default_loss

    @loss_function.setter
    def loss_function(self, value):
        self._loss_function = value

    def forward(self, tokens, labels=None, num_items_in_batch=None):
        logits = self.model(tokens)
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels, vocab_size=97,
                                                                 num_items_in_batch=num_items_in_batch)
        return logits, loss


def perturb(model):
    """Random norm weights and biases, so that a patched norm that ignored them would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)


def loss_and_grads(model, tokens):
    model.zero_grad()
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


EXPECTED_SWAPS = {
    "llama": {"LlamaStyleRMSNorm": 5, "GatedMLP": 2},  # each GatedMLP's act_fn is left: its brrr forward fuses it
    "gpt2": {"LayerNorm": 5, "NewGELU": 2},
    "gelu": {"LayerNorm": 5, "GELU": 2},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("style", list(EXPECTED_SWAPS))
def test_patched_model_matches(device, style):
    torch.manual_seed(0)
    model = TinyGPT(style).to(device)
    perturb(model)
    tokens = torch.randint(0, 97, (3, 17), device=device)
    reference = copy.deepcopy(model)
    report = brrr.patch(model)
    counts = {}
    for _, cls, _ in report.swapped:
        counts[cls] = counts.get(cls, 0) + 1
    assert counts == EXPECTED_SWAPS[style], str(report)
    if style == "llama":
        assert ("blocks.0.mlp.act_fn", "SiLU", "computed by its parent's brrr forward (blocks.0.mlp)") in report.left
        assert type(model.blocks[0].mlp.act_fn) is nn.SiLU
    logits, loss, grads = loss_and_grads(model, tokens)
    ref_logits, ref_loss, ref_grads = loss_and_grads(reference, tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_items", [None, 40])
def test_patched_causal_lm_loss_matches(device, num_items):
    torch.manual_seed(5)
    model = TinyCausalLM("llama").to(device)
    perturb(model)
    reference = copy.deepcopy(model)
    report = brrr.patch(model)
    assert ("", "TinyCausalLM", "loss_function: brrr causal-LM cross_entropy") in report.swapped, str(report)
    assert model.loss_function is causal_lm_loss
    tokens = torch.randint(0, 97, (3, 17), device=device)
    labels = tokens.clone()
    labels[0, 3:7] = -100
    results = []
    for m in (model, reference):
        m.zero_grad()
        logits, loss = m(tokens, labels, num_items)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (loss, grads), (ref_loss, ref_grads) = results
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-5, msg=name)


def test_patch_leaves_other_losses_and_unpatch_restores_the_loss_function():
    model = TinyCausalLM("gelu", default_loss=unshifted_loss)
    report = brrr.patch(model)
    assert ("", "TinyCausalLM", "loss_function behaves like no causal-LM cross-entropy") in report.left
    assert model.loss_function is unshifted_loss
    model = TinyCausalLM("gelu")
    brrr.patch(model)
    assert "_loss_function" in model.__dict__
    again = brrr.patch(model)
    assert ("", "TinyCausalLM", "loss_function already patched") in again.left
    linears = sum(type(m) is brrr.nn.RematLinear for m in model.modules())  # remat="auto"'s
    assert linears == sum(isinstance(m, nn.Linear) for m in TinyCausalLM("gelu").modules()) > 0
    assert brrr.unpatch(model) == 1 + 5 + 2 + linears  # the loss function, 5 LayerNorms, 2 GELUs, the Linears
    assert "_loss_function" not in model.__dict__ and model.loss_function is hf_causal_lm_loss


def test_patch_report_leaves_look_alikes_and_unpatch_restores():
    model = nn.Sequential(TwoPlusWeightRMSNorm(16), LlamaStyleRMSNorm(16), nn.Identity(), nn.Dropout(0.1),
                          GemmaStyleRMSNorm(16))
    with torch.no_grad():
        model[0].weight.add_(0.5)
        model[4].weight.add_(0.5)
    classes = [type(m) for m in model.eval()]  # eval: the dropout off, for the comparison below
    x = torch.randn(3, 16)
    expected = model(x)
    report = brrr.patch(model)
    assert [name for name, _, _ in report.swapped] == ["1", "4"]
    assert ("0", "TwoPlusWeightRMSNorm", "behaves like no RMSNorm (of weight or 1 + weight) and no LayerNorm without "
            "bias") in report.left
    assert "RMSNorm (llama cast order)" in str(report)
    assert ("4", "GemmaStyleRMSNorm", "RMSNorm (torch cast order, scaled by 1 + weight)") in report.swapped
    torch.testing.assert_close(model(x), expected)
    again = brrr.patch(model)
    assert not again.swapped and ("1", "LlamaStyleRMSNorm", "already patched") in again.left
    assert brrr.unpatch(model) == 2
    assert [type(m) for m in model] == classes


class TorchOrderRMSNorm(LlamaStyleRMSNorm):
    """An RMSNorm with torch's cast order: scaled before the result is rounded to x's dtype."""

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_patch_matches_the_exact_formula_in_low_precision(dtype):
    """In bfloat16 tanh and erf GELU, and Llama's and torch's RMSNorm cast orders, are within
    the dtype's rounding of each other: patch must still take the model's own."""
    torch.manual_seed(12)
    model = nn.Sequential(NewGELU(), LlamaStyleRMSNorm(64), TorchOrderRMSNorm(64)).to(dtype)
    with torch.no_grad():
        for norm in model[1:]:
            norm.weight.copy_(torch.randn(64) * 2)
    report = brrr.patch(model)
    assert ("0", "NewGELU", "gelu (approximate='tanh')") in report.swapped, str(report)
    assert ("1", "LlamaStyleRMSNorm", "RMSNorm (llama cast order)") in report.swapped, str(report)
    assert ("2", "TorchOrderRMSNorm", "RMSNorm (torch cast order)") in report.swapped or dtype == torch.float32, \
        str(report)  # in float32 the two orders are one function, and the first is taken
    assert model[0]._brrr_kwargs == (("approximate", "tanh"),) and model[2]._brrr_cast_order == (
        "llama" if dtype == torch.float32 else "torch")


class OlmoStyleLayerNorm(nn.Module):
    """OLMo's LayerNorm: no weight, no bias, torch's default eps written into the forward, in float32."""

    def __init__(self, hidden, eps_in_forward=1e-5):
        super().__init__()
        self.normalized_shape, self.eps_in_forward = (hidden,), eps_in_forward

    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, None, None, eps=self.eps_in_forward).to(x.dtype)


class PlainRMSNorm(nn.Module):
    """An RMSNorm without weight, its eps an attribute."""

    def __init__(self, hidden, eps=1e-4):
        super().__init__()
        self.normalized_shape, self.eps = hidden, eps

    def forward(self, x):
        return F.rms_norm(x, (self.normalized_shape,), None, self.eps)


class CohereStyleLayerNorm(nn.Module):
    """Cohere's LayerNorm: a weight, no bias, the statistics in float32."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x):
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt((h - mean).pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * h).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("remat", [False, True])
def test_patch_takes_norms_without_weight_or_bias(dtype, remat):
    """OLMo's LayerNorm (no parameters, its eps in the forward), an RMSNorm without weight and
    Cohere's LayerNorm without bias run brrr's norms: outputs and gradients as before; a
    parameter-free LayerNorm whose eps brrr cannot know (not an attribute, not torch's default)
    is left."""
    reset_registry()  # the suite's setting: brrr's CPU code on CPU tensors
    torch.manual_seed(4)
    model = nn.Sequential(OlmoStyleLayerNorm(48), nn.Linear(48, 48), PlainRMSNorm(48), nn.Linear(48, 48),
                          CohereStyleLayerNorm(48), nn.Linear(48, 48), OlmoStyleLayerNorm(48, eps_in_forward=1e-6),
                          nn.Linear(48, 48))
    with torch.no_grad():
        model[4].weight.add_(torch.randn(48) * 0.3)
    model = model.to(dtype)
    reference = copy.deepcopy(model)
    report = brrr.patch(model, remat=remat)
    swapped = [(name, why) for name, _, why in report.swapped if name in ("0", "2", "4")]
    assert swapped == [("0", "LayerNorm without weight or bias (eps 1e-05 in its forward)"),
                       ("2", "RMSNorm without weight or bias"), ("4", "LayerNorm without bias")], str(report)
    assert ("6", "OlmoStyleLayerNorm", "behaves like no LayerNorm or RMSNorm without weight (eps 1e-05, no eps "
            "attribute: torch default)") in report.left
    if remat:  # three norms' outputs of 48 features
        assert f"recomputes the outputs of 3 norms and 0 gated MLPs' GLUs instead of saving them for their linear " \
               f"layers: {3 * 48 * model[1].weight.element_size()} bytes per token" in str(report), str(report)
    x, g = torch.randn(5, 7, 48, dtype=dtype) * 2 + 1, torch.randn(5, 7, 48, dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    outs = []
    for m in (model, reference):
        leaf = x.clone().requires_grad_()
        out = m(leaf)
        grads = torch.autograd.grad(out, [leaf, *m.parameters()], g)
        outs.append((out, grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], **tol)
    for a, b in zip(outs[0][1], outs[1][1]):  # sums over rows: the tolerance relative to the largest
        torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * b.abs().max().item())
    brrr.unpatch(model)
    assert [type(m) for m in model] == [type(m) for m in reference]


def recording_calls(name):
    """An override of the registry's `name` that notes each call, then runs brrr's function."""
    calls, fn = [], getattr(brrr, name)
    registry.override(name, lambda *a, **k: calls.append(name) or fn(*a, **k))
    return calls


class PerHeadRMSNorm(CohereStyleLayerNorm):
    """A look-alike of Cohere's QK-norm: a weight per head, but an RMSNorm (no mean taken)."""

    def forward(self, x):
        h = x.float()
        return (self.weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(
            x.dtype)


class WholeLayerNorm(CohereStyleLayerNorm):
    """A look-alike: a 2-d weight, the statistics over both its dims (torch's LayerNorm of that shape)."""

    def forward(self, x):
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), None, self.variance_epsilon).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_patch_takes_a_layer_norm_with_a_weight_per_head(dtype, device):
    """Cohere's QK-norm: its LayerNorm with a (heads, head_dim) weight over (..., heads, head_dim),
    the statistics over head_dim in float32, cast once: brrr's, output and gradients against the
    float64 formula and the unpatched module; an RMSNorm per head and a LayerNorm over both of the
    weight's dims are left."""
    reset_registry()
    torch.manual_seed(6)
    model = nn.ModuleList([CohereStyleLayerNorm((4, 24)), PerHeadRMSNorm((4, 24)), WholeLayerNorm((4, 24))])
    with torch.no_grad():
        for m in model:
            m.weight.add_(torch.randn(4, 24) * 0.3)
    model = model.to(device, dtype)
    reference = copy.deepcopy(model)
    report = brrr.patch(model)
    assert [(name, why) for name, _, why in report.swapped] == [
        ("0", "LayerNorm without bias over each head (a weight row per head, applied after brrr's norm)")], str(report)
    why = "a weight per head, and behaves like no LayerNorm over the last dim in float32 without bias"
    assert [(name, why) for name, _, why in report.left] == [("1", why), ("2", why)], str(report)
    x = (torch.randn(9, 5, 4, 24, dtype=torch.float64, device=device) * 2 + 1)[:, ::2].to(dtype)  # odd rows, strided
    g = torch.randn(x.shape, dtype=dtype, device=device)
    leaf = x.clone().requires_grad_()
    try:
        calls = recording_calls("layer_norm")
        out = model[0](leaf)
    finally:
        reset_registry()
    assert calls == ["layer_norm"]
    grads = torch.autograd.grad(out, [leaf, model[0].weight], g)
    x64, w64 = leaf.detach().double().requires_grad_(), model[0].weight.detach().double().requires_grad_()
    out64 = w64 * F.layer_norm(x64, (24,), None, None, 1e-5)
    grads64 = torch.autograd.grad(out64, [x64, w64], g.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, out64.to(dtype), **tol)
    for a, b in zip(grads, grads64):  # the weight's gradient sums over rows: relative to its largest
        torch.testing.assert_close(a.double(), b, rtol=tol["rtol"], atol=tol["atol"] * b.abs().max().item())
    leaf = x.clone().requires_grad_()
    expected = reference[0](leaf)
    torch.testing.assert_close(out, expected, **tol)  # the same cast order: within the last bit of dtype
    for a, b in zip(grads, torch.autograd.grad(expected, [leaf, reference[0].weight], g)):
        torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * b.abs().max().item())
    brrr.unpatch(model)
    assert [type(m) for m in model] == [type(m) for m in reference]


class Experts(nn.Module):
    """Mixture-of-experts experts in transformers' layout: gate_up (experts, 2 * inner, hidden),
    down (experts, hidden, inner), and _apply_gate(gate_up) = act(gate) * up of its halves (swap:
    up first, a look-alike)."""

    def __init__(self, experts=3, hidden=16, inner=24, swap=False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden) / 4)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) / 4)
        self.act_fn, self.swap = nn.SiLU(), swap

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(up) * gate if self.swap else self.act_fn(gate) * up

    def forward(self, x, expert):
        """Each row of x through its expert (batched, as transformers' grouped forms compute it)."""
        h = self._apply_gate(torch.einsum("th,tih->ti", x, self.gate_up_proj[expert]))
        return torch.einsum("ti,thi->th", h, self.down_proj[expert])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_patch_takes_the_gate_of_mixture_of_experts_experts(dtype, device):
    """transformers' experts' _apply_gate (act(gate) * up of the batched gate_up projection) runs
    brrr's swiglu: outputs and gradients against the float64 formula and the unpatched module; a
    look-alike gating the other half is left, with the reason."""
    reset_registry()
    torch.manual_seed(7)
    model = nn.ModuleList([Experts(), Experts(swap=True)]).to(device, dtype)
    reference = copy.deepcopy(model)
    report = brrr.patch(model)
    assert [(n, why) for n, _, why in report.swapped if n in ("0", "1")] == [
        ("0", "gated MLP of the experts (swiglu of the gate_up projection, in their _apply_gate)")], str(report)
    assert ("1", "Experts", "experts whose _apply_gate is not act(gate) * up of its input's halves") in report.left
    x = (torch.randn(2 * 37, 16, dtype=torch.float64, device=device) * 2)[::2].to(dtype)  # odd rows, a strided view
    expert = torch.randint(0, 3, (37,), device=device)
    g = torch.randn(37, 16, dtype=dtype, device=device)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    results = []
    for m in (model[0], reference[0]):
        leaf = x.clone().requires_grad_()
        try:
            calls = recording_calls("swiglu")
            out = m(leaf, expert)
        finally:
            reset_registry()
        results.append((out, torch.autograd.grad(out, [leaf, *m.parameters()], g), len(calls)))
    (out, grads, calls), (ref_out, ref_grads, ref_calls) = results
    assert (calls, ref_calls) == (1, 0)
    x64 = x.double().requires_grad_()
    params64 = [p.detach().double().requires_grad_() for p in reference[0].parameters()]
    gate, up = torch.einsum("th,tih->ti", x64, params64[0][expert]).chunk(2, dim=-1)
    out64 = torch.einsum("ti,thi->th", F.silu(gate) * up, params64[1][expert])
    grads64 = torch.autograd.grad(out64, [x64, *params64], g.double())
    scale = out64.abs().max().item()  # each output sums over the inner features: relative to the largest
    torch.testing.assert_close(out.double(), out64, rtol=tol["rtol"], atol=tol["atol"] * scale)
    torch.testing.assert_close(out, ref_out, rtol=tol["rtol"], atol=tol["atol"] * scale)
    for a, b, c in zip(grads, grads64, ref_grads):  # sums over rows: relative to the largest element
        torch.testing.assert_close(a.double(), b, rtol=tol["rtol"], atol=tol["atol"] * b.abs().max().item())
        torch.testing.assert_close(a, c, rtol=tol["rtol"], atol=tol["atol"] * c.abs().max().item())
    brrr.unpatch(model)
    assert [type(m) for m in model] == [type(m) for m in reference]


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_patch_takes_the_experts_of_a_transformers_mixtral(implementation):
    """A Mixtral's experts in transformers' grouped form run brrr's swiglu in their _apply_gate; in
    the eager form (a loop over the experts, which calls act_fn itself) brrr's silu: the loss and
    every gradient as unpatched either way."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                        num_experts_per_tok=2, experts_implementation=implementation)
    torch.manual_seed(8)
    base = transformers.MixtralForCausalLM(config).train()
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert base.config._experts_implementation == implementation
    patched = copy.deepcopy(base)
    report = brrr.patch(patched)
    assert sum(what.startswith("gated MLP of the experts (swiglu") for _, _, what in report.swapped) == 2, str(report)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(9))
    calls = []
    try:
        for name in ("swiglu", "silu"):
            fn = getattr(brrr, name)
            registry.override(name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
        loss = patched(input_ids=tokens, labels=tokens).loss
        grads = torch.autograd.grad(loss, list(patched.parameters()))
    finally:
        reset_registry()
    assert set(calls) == ({"swiglu"} if implementation == "grouped_mm" else {"silu"}), calls
    expected = base(input_ids=tokens, labels=tokens).loss
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, torch.autograd.grad(expected, list(base.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(b.abs().max().item(), 1e-2))


def test_patch_takes_a_gated_mlp_with_one_gate_up_projection():
    torch.manual_seed(5)
    model = nn.Sequential(FusedGatedMLP(16, 24), FusedGatedMLP(16, 24, swap=True))
    reference = copy.deepcopy(model)
    report = brrr.patch(model)
    assert ("0", "FusedGatedMLP", "gated MLP (geglu, one gate_up projection)") in report.swapped, str(report)
    assert ("1", "FusedGatedMLP", "gated MLP whose forward is not down(up * act(gate)) of gate_up(x)") in report.left
    x = torch.randn(3, 5, 16, requires_grad=True)
    out, expected = model[0](x), reference[0](x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [x, *model[0].parameters()])
    expected_grads = torch.autograd.grad(expected.square().sum(), [x, *reference[0].parameters()])
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    brrr.unpatch(model)
    assert type(model[0]) is FusedGatedMLP


def test_patch_fuses_a_post_norm_residual_add_into_the_layer_norm():
    torch.manual_seed(9)
    model = nn.ModuleList([PostNormResidual(24, 16), PostNormResidual(24, 16, norm_first=True)])
    perturb(model)
    model[0].LayerNorm.weight.data.add_(torch.randn(16) * 0.3)
    reference = copy.deepcopy(model)
    model[0].dropout.eval()  # patch keeps every submodule's mode
    report = brrr.patch(model)
    assert model[0].training and not model[0].dropout.training
    model[0].dropout.train()
    assert ("0", "PostNormResidual", "LayerNorm with its residual add (add_layer_norm)") in report.swapped, str(report)
    assert ("1", "PostNormResidual", "behaves like no LayerNorm(dropout(dense(h)) + input)") in report.left
    h, residual = torch.randn(3, 5, 24, requires_grad=True), torch.randn(3, 5, 16, requires_grad=True)
    torch.manual_seed(10)  # training: the same dropout draws from torch's generator as the original's
    out = model[0](h, residual)
    torch.manual_seed(10)
    expected = reference[0](h, residual)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    inputs = [h, residual]
    grads = torch.autograd.grad(out.square().sum(), inputs + list(model[0].parameters()))
    expected_grads = torch.autograd.grad(expected.square().sum(), inputs + list(reference[0].parameters()))
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert ("0.LayerNorm", "LayerNorm", "computed by its parent's brrr forward (0)") in report.left
    assert type(model[0].LayerNorm) is nn.LayerNorm and type(model[1].LayerNorm) is brrr.nn.LayerNorm
    brrr.unpatch(model)
    assert type(model[0]) is PostNormResidual and type(model[0].LayerNorm) is nn.LayerNorm


def returns_loss_first(forward):
    """A decorator like transformers' can_return_tuple: it holds the forward in its closure."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        logits, loss = forward(self, *args, **kwargs)
        return loss, logits
    return wrapper


class MaskedLMHead(nn.Module):
    """A masked-LM head as transformers writes it: torch's CrossEntropyLoss built in the forward,
    which a decorator wraps."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.decoder = nn.Linear(hidden, vocab)

    @returns_loss_first
    def forward(self, h, labels, **loss_options):
        logits = self.decoder(h)
        return logits, CrossEntropyLoss(**loss_options)(logits.view(-1, logits.shape[-1]), labels.view(-1))


class PostNormMaskedLM(nn.Module):
    """BERT's patterns: post-norm residual blocks, and a masked-LM head that builds its loss."""

    def __init__(self, vocab=97, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(PostNormResidual(hidden, hidden, p=0.0) for _ in range(2))
        self.head = MaskedLMHead(hidden, vocab)

    def forward(self, tokens, labels):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, h)
        loss, logits = self.head(h, labels)
        return logits, loss


@pytest.mark.parametrize("loss_options", [{}, {"label_smoothing": 0.1, "reduction": "sum"},
                                          {"weight": torch.rand(23) + 0.5}], ids=["mean", "sum", "class weights"])
def test_patch_swaps_a_cross_entropy_loss_built_in_the_forward(monkeypatch, loss_options):
    torch.manual_seed(11)
    model, unpatched = MaskedLMHead(16, 23), MaskedLMHead(16, 23)
    unpatched.load_state_dict(model.state_dict())
    report = brrr.patch(model)
    assert ("", "MaskedLMHead", "brrr.nn.CrossEntropyLoss (its forward's CrossEntropyLoss)") in report.swapped
    assert globals()["CrossEntropyLoss"] is nn.CrossEntropyLoss  # this module's global is untouched
    h, labels = torch.randn(3, 7, 16, requires_grad=True), torch.randint(0, 23, (3, 7))
    labels[1, 2:5] = -100
    op, calls = registry.lookup("cross_entropy"), []
    kernel = op.implementation
    monkeypatch.setattr(op, "implementation", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    loss, logits = model(h, labels, **loss_options)
    assert calls == ([] if "weight" in loss_options else [1])  # per-class weights: PyTorch's
    expected_loss, expected_logits = unpatched(h, labels, **loss_options)
    assert calls == ([] if "weight" in loss_options else [1])  # the unpatched model's loss is torch's
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(loss, [h, *model.parameters()])
    expected_grads = torch.autograd.grad(expected_loss, [h, *unpatched.parameters()])
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    brrr.unpatch(model)
    assert type(model) is MaskedLMHead


def test_patch_leaves_a_forward_whose_decorator_it_cannot_rebuild():
    class Wrapped(MaskedLMHead):
        @functools.wraps(MaskedLMHead.forward)
        def forward(self, *args, **kwargs):  # calls the forward it wraps through a global, not a closure
            return MaskedLMHead.forward(self, *args, **kwargs)

    model = Wrapped(16, 23)
    report = brrr.patch(model)
    assert ("", "Wrapped", "its forward uses CrossEntropyLoss but is wrapped by a decorator that brrr cannot rebuild "
            "(one that does not hold the function it wraps in a closure cell)") in report.left, str(report)
    assert type(model) is Wrapped


def test_state_dict_round_trips_both_ways():
    torch.manual_seed(1)
    plain = TinyGPT("llama")
    perturb(plain)
    patched = copy.deepcopy(plain)
    brrr.patch(patched)
    assert plain.state_dict().keys() == patched.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, patched.state_dict()[k])
    fresh_plain, fresh_patched = TinyGPT("llama"), TinyGPT("llama")
    brrr.patch(fresh_patched)
    fresh_plain.load_state_dict(patched.state_dict())
    fresh_patched.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(fresh_plain(tokens), plain(tokens))
    torch.testing.assert_close(fresh_patched(tokens), plain(tokens), rtol=1e-4, atol=1e-4)


def test_nn_modules_show_their_settings():
    assert repr(brrr.nn.GeGLU("tanh")) == "GeGLU(approximate='tanh')" and "tanh" in repr(nn.GELU("tanh"))
    assert repr(brrr.nn.LinearCrossEntropyLoss(softcap=3.0, z_loss=1e-4)) == (
        "LinearCrossEntropyLoss(ignore_index=-100, reduction='mean', label_smoothing=0.0, softcap=3.0, z_loss=0.0001)")


@pytest.mark.parametrize("name", ["ReLU", "SiLU"])
def test_nn_activations_in_place_write_their_input(name):
    """inplace=True, as torch.nn's: the input holds the output after the call, which returns it."""
    x = torch.randn(4, 33)
    expected = getattr(nn, name)()(x)
    y = getattr(brrr.nn, name)(inplace=True)(x)
    assert y is x or y.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("base", list(brrr.nn.TWINS) + [nn.Linear], ids=lambda c: c.__name__)
def test_nn_twins_take_their_bases_argument_names(base):
    """module(input=x) works alike for a torch.nn module and its brrr.nn twin (and RematLinear,
    which patch swaps for torch.nn.Linear)."""
    twin = brrr.nn.TWINS.get(base, brrr.nn.RematLinear)
    assert list(inspect.signature(twin.forward).parameters) == list(inspect.signature(base.forward).parameters)
    assert twin.forward.__qualname__ == f"{twin.__name__}.forward"


def test_nn_modules_are_interchangeable_with_torch_nn():
    torch.manual_seed(2)
    pairs = [(nn.LayerNorm(33), brrr.nn.LayerNorm(33)), (nn.RMSNorm(33, eps=1e-5), brrr.nn.RMSNorm(33, eps=1e-5)),
             (nn.GELU("tanh"), brrr.nn.GELU("tanh")), (nn.SiLU(), brrr.nn.SiLU())]
    x = torch.randn(4, 33)
    for theirs, ours in pairs:
        with torch.no_grad():
            for p in theirs.parameters():
                p.add_(torch.randn_like(p))
        ours.load_state_dict(theirs.state_dict())
        assert isinstance(ours, type(theirs))
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    target = torch.tensor([3, -100, 0, 32])
    for kwargs in ({}, {"label_smoothing": 0.2, "reduction": "sum"}, {"weight": torch.rand(33)}):
        theirs, ours = nn.CrossEntropyLoss(**kwargs), brrr.nn.CrossEntropyLoss(**kwargs)
        ours.load_state_dict(theirs.state_dict())
        torch.testing.assert_close(ours(x, target), theirs(x, target), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(brrr.nn.SwiGLU()(x[:, :32]), F.silu(x[:, :16]) * x[:, 16:32])


def test_registry_lookup_override_and_fallback():
    assert {"gelu", "bias_gelu", "swiglu", "layer_norm", "rms_norm", "add_rms_norm",
            "cross_entropy"} <= set(registry.names())
    with pytest.raises(KeyError, match="no op named 'nope'"):
        registry.lookup("nope")
    x = torch.randn(5, 8)
    calls = []
    try:
        registry.override("gelu", lambda t, approximate="none": calls.append(t) or F.gelu(t, approximate=approximate))
        brrr.nn.GELU()(x)
        assert len(calls) == 1
        reset_registry("gelu")
        brrr.nn.GELU()(x)
        assert len(calls) == 1
        # Mixed dtypes: brrr has no kernel, PyTorch promotes; the registry falls back ...
        bias = torch.randn(8, dtype=torch.float64)
        torch.testing.assert_close(registry("bias_gelu", x, bias), F.gelu(x + bias))
        assert registry.lookup("bias_gelu").resolve(x, bias) is registry.lookup("bias_gelu").reference
        # ... or raises, if asked to.
        registry.on_unsupported("bias_gelu", "raise")
        with pytest.raises(brrr.UnsupportedError, match="brrr.bias_gelu: no brrr kernel"):
            registry("bias_gelu", x, bias)
        assert registry.lookup("bias_gelu").resolve(x, bias.float()) is brrr.bias_gelu
        # cross_entropy: class weights and probability targets are PyTorch's.
        op, target = registry.lookup("cross_entropy"), torch.tensor([1, 0, 7, 2, 5])
        assert op.resolve(x, target) is brrr.cross_entropy
        assert op.resolve(x, target, torch.rand(8)) is op.reference
        assert op.resolve(x, torch.rand(5, 8).softmax(-1)) is op.reference
        torch.testing.assert_close(registry("cross_entropy", x, target, dtype=torch.float64),
                                   F.cross_entropy(x.double(), target))
    finally:
        reset_registry()
    # brrr's implementations check what the support checks leave to them, as brrr's functions do.
    with pytest.raises(ValueError, match="argument approximate"):
        registry("geglu", x, approximate="fast")
    with pytest.raises(ValueError, match="argument cast_order"):
        registry("rms_norm", x, (8,), cast_order="fp32")
    torch.testing.assert_close(registry("geglu", x, approximate="tanh"), brrr.geglu(x, approximate="tanh"), rtol=0,
                               atol=0)
    with pytest.raises(ValueError, match="argument mode"):
        registry.on_unsupported("gelu", "ignore")
    with pytest.raises(TypeError, match="argument implementation"):
        registry.override("gelu", 3)


def test_use_fused_routes_functional_calls():
    x = torch.randn(4, 16)
    seen = []
    original, original_layer_norm = F.gelu, F.layer_norm
    try:
        registry.override("gelu", lambda t, approximate="none": seen.append(1) or original(t, approximate=approximate))
        with brrr.use_fused():
            assert F.gelu is not original
            nn.GELU()(x)  # torch.nn modules call F.gelu
            F.gelu(x.to(torch.int64).float())
        assert F.gelu is original
        assert len(seen) == 2
    finally:
        reset_registry()
    with brrr.use_fused():
        assert F.layer_norm is not original_layer_norm
        torch.testing.assert_close(F.layer_norm(x, (16,)), original_layer_norm(x, (16,)), rtol=1e-5, atol=1e-5)
        y = F.silu(x.clone(), inplace=True)  # in-place stays PyTorch's
    torch.testing.assert_close(y, F.silu(x))
    # Inputs brrr does not take fall back to torch's own functions, not to the routes (which would
    # recurse), also under torch.compile, where rms_norm is left to inductor.
    torch_cross_entropy, torch_rms_norm = F.cross_entropy, F.rms_norm
    weight, half, w, w64 = torch.rand(16), x.to(torch.float16), torch.rand(16), torch.rand(16, dtype=torch.float64)
    target4 = torch.tensor([1, 0, 3, 15])
    with brrr.use_fused():
        torch.testing.assert_close(F.cross_entropy(x, target4, weight), torch_cross_entropy(x, target4, weight))
        torch.testing.assert_close(F.rms_norm(half, (16,), w64), torch_rms_norm(half, (16,), w64))
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: F.rms_norm(t, (16,), w).sum(), fullgraph=True)(x)
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, torch_rms_norm(x, (16,), w).sum())
    original_cross_entropy, target = F.cross_entropy, torch.tensor([1, 0, -100, 15])
    try:
        registry.override("cross_entropy", lambda *a, **k: seen.append(2) or brrr.cross_entropy(*a, **k))
        with brrr.use_fused():
            assert F.cross_entropy is not original_cross_entropy
            loss = nn.CrossEntropyLoss(label_smoothing=0.1)(x, target)  # the module calls F.cross_entropy
        assert seen[-1] == 2 and F.cross_entropy is original_cross_entropy
        torch.testing.assert_close(loss, F.cross_entropy(x, target, label_smoothing=0.1), rtol=1e-5, atol=1e-6)
    finally:
        reset_registry()


@pytest.mark.parametrize("style", ["llama", "gelu"])
def test_compile_of_patched_model_has_no_graph_breaks(style):
    torch.manual_seed(3)
    model = TinyGPT(style)
    brrr.patch(model)
    tokens = torch.randint(0, 97, (2, 8))
    explanation = torch._dynamo.explain(model)(tokens)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens), rtol=1e-4, atol=1e-4)


def test_compile_of_patched_causal_lm_with_its_loss_has_no_graph_breaks():
    torch.manual_seed(6)
    model = TinyCausalLM("llama")
    brrr.patch(model)
    tokens = torch.randint(0, 97, (2, 8))
    explanation = torch._dynamo.explain(model)(tokens, tokens)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(tokens, tokens)[1], model(tokens, tokens)[1], rtol=1e-5, atol=1e-5)


def brrr_ops_in_compiled_graph(fn, *args):
    """The brrr ops dynamo puts in fn's graph (torch.compile with a backend that records it)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if str(node.target).startswith("brrr.")}


def test_compiling_before_patching_gives_the_same_results():
    """torch.compile, then brrr.patch, then unpatch, on the same compiled model: dynamo's guards
    on the modules' classes and the loss attribute make it trace again each time, so the compiled
    model runs brrr's ops after patching and PyTorch's after unpatching, with the eager results."""
    torch.manual_seed(8)
    model = TinyCausalLM("llama")
    perturb(model)
    tokens = torch.randint(0, 97, (2, 8))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if str(n.target).startswith("brrr.")})
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    try:
        registry.under_compile("rms_norm", "kernel")
        expected_logits, expected_loss = model(tokens, tokens)
        logits, loss = compiled(tokens, tokens)
        assert graphs == [set()]
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
        brrr.patch(model)
        patched_logits, patched_loss = compiled(tokens, tokens)
        assert len(graphs) == 2 and graphs[1] == {"brrr.rms_norm.default", "brrr.cross_entropy.default"}, graphs
        torch.testing.assert_close(patched_logits, expected_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(patched_loss, expected_loss, rtol=1e-5, atol=1e-5)
        brrr.unpatch(model)
        logits, loss = compiled(tokens, tokens)
        assert all(not ops for ops in graphs[2:])  # the first graph again, or a new one without brrr
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    finally:
        brrr.unpatch(model)
        reset_registry()
        torch._dynamo.reset()


def test_under_compile_chooses_brrr_kernels_or_inductor():
    torch.manual_seed(7)
    model = TinyCausalLM("llama")
    brrr.patch(model)
    tokens = torch.randint(0, 97, (2, 8))
    try:
        # Defaults: norms and GLUs are left to inductor, cross_entropy is brrr's op.
        assert brrr_ops_in_compiled_graph(model, tokens, tokens) == {"brrr.cross_entropy.default"}
        registry.under_compile("rms_norm", "kernel")
        registry.under_compile("swiglu", "kernel")
        registry.under_compile("cross_entropy", "inductor")
        assert brrr_ops_in_compiled_graph(model, tokens, tokens) == {"brrr.glu.default", "brrr.rms_norm.default"}
        reset_registry()
        assert registry.lookup("rms_norm").compiled == "inductor" and registry.lookup("cross_entropy").compiled == "kernel"
    finally:
        reset_registry()
    with pytest.raises(ValueError, match="argument mode"):
        registry.under_compile("gelu", "eager")


@pytest.mark.cuda
@pytest.mark.parametrize("style", ["llama", "bert"])
def test_cuda_graph_capture_of_a_patched_training_step(style):
    """The step of a patched TinyCausalLM (brrr's RMSNorms, gated MLPs and causal-LM loss) or
    PostNormMaskedLM (add_layer_norm, and the loss its forward builds)."""
    torch.manual_seed(4)
    model = (TinyCausalLM("llama") if style == "llama" else PostNormMaskedLM()).cuda()
    perturb(model)
    swapped = {what for _, _, what in brrr.patch(model).swapped}
    assert style == "llama" or {"LayerNorm with its residual add (add_layer_norm)",
                                "brrr.nn.CrossEntropyLoss (its forward's CrossEntropyLoss)"} <= swapped
    tokens = torch.randint(0, 97, (4, 32), device="cuda")
    model.zero_grad()
    eager_loss = model(tokens, tokens)[1]
    eager_loss.backward()
    eager_loss, eager_grads = eager_loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(tokens, tokens)[1].backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = model(tokens, tokens)[1]
        loss.backward()
    for _ in range(2):  # replays give the same result every time
        for p in model.parameters():
            p.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, eager_grads[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routes_under_cuda_autocast_return_torchs_float32(dtype):
    """CUDA autocast runs torch's layer_norm, softmax and log_softmax (without a dtype) in float32
    and returns float32 for half inputs: the routes do too (softmax by brrr's kernel with a float32
    result, layer_norm and add_layer_norm by torch's function), where they returned the half dtype."""
    torch.manual_seed(0)
    x, r = (torch.randn(6, 40, device="cuda", dtype=dtype) for _ in range(2))
    w, b = torch.randn(40, device="cuda"), torch.randn(40, device="cuda")
    calls = {
        "softmax": lambda: F.softmax(x, -1), "log_softmax": lambda: F.log_softmax(x, 0),
        "layer_norm": lambda: F.layer_norm(x, (40,), w, b),
        "add_layer_norm": lambda: registry("add_layer_norm", x, r, (40,), w, b)[0],
        "softmax with a dtype": lambda: F.softmax(x, -1, dtype=torch.float16),
    }
    with torch.autocast("cuda", dtype=dtype):
        expected = {name: call() for name, call in calls.items()}
        expected["add_layer_norm"] = F.layer_norm(x + r, (40,), w, b)
        with brrr.use_fused():
            got = {name: call() for name, call in calls.items()}
    for name in calls:
        assert got[name].dtype == expected[name].dtype, name
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert expected["softmax"].dtype == torch.float32


def test_register_a_users_op():
    """An op registered by the user: its implementation where its check and its devices take the
    arguments, else its reference; a second registration of the name is refused."""
    calls = []

    def double(x):
        calls.append(x.device.type)
        return x + x

    try:
        registry.register("test_double", lambda x: x * 2, double, lambda x: isinstance(x, torch.Tensor),
                          devices=("cpu",))
        x = torch.randn(4)
        torch.testing.assert_close(registry("test_double", x), 2 * x)
        assert calls == ["cpu"]
        meta = torch.empty(4, device="meta")  # a device the op was not registered for
        assert registry.lookup("test_double").resolve(meta) is registry.lookup("test_double").reference
        assert registry("test_double", meta).device.type == "meta" and calls == ["cpu"]
        with pytest.raises(ValueError, match="already registered"):
            registry.register("test_double", lambda x: x, double, lambda x: True)
        with pytest.raises(ValueError, match="argument compiled: expected 'kernel' or 'inductor', got 'eager'"):
            registry.register("test_other", lambda x: x, double, lambda x: True, compiled="eager")
        with pytest.raises(ValueError, match="argument cpu: expected 'pytorch' or 'kernel', got 'fast'"):
            registry.register("test_other", lambda x: x, double, lambda x: True, cpu="fast")
        assert "test_other" not in registry
    finally:
        registry._ops.pop("test_double", None)


def test_cpu_tensors_run_the_faster_kernel_measured_unless_told():
    """The registry's default on CPU tensors is brrr's CPU kernel for the ops where it measured
    faster than PyTorch's (benchmarks/cpu_twins.py; docs/cpu.md), PyTorch's function for the rest;
    the rest of this suite asks for brrr's everywhere (conftest)."""
    registry.reset()  # the defaults, as a user has them
    try:
        x = torch.randn(5, 8)
        faster = {"tanh", "rms_norm", "cross_entropy", "swiglu", "geglu", "softmax"}
        for name in registry.names():
            assert registry.lookup(name).cpu == ("kernel" if name in faster else "pytorch"), name
        rms = registry.lookup("rms_norm")
        assert rms.resolve(x, (8,)) is rms.implementation
        softmax, log_softmax = registry.lookup("softmax"), registry.lookup("log_softmax")
        assert softmax.resolve(x, -1) is softmax.implementation and log_softmax.resolve(x, -1) is log_softmax.reference
        x64 = x.double()
        torch.testing.assert_close(brrr.nn.Softmax(-1)(x).double(), torch.softmax(x64, -1), rtol=2e-6, atol=1e-7)
        geglu = registry.lookup("geglu")
        assert geglu.resolve(x) is geglu.implementation and geglu.resolve(x[:, :4], x[:, 4:]) is geglu.implementation
        torch.testing.assert_close(brrr.nn.GeGLU()(x).double(), F.gelu(x64[:, :4]) * x64[:, 4:], rtol=2e-5, atol=2e-6)
        op = registry.lookup("gelu")
        assert op.resolve(x) is op.reference
        assert torch.equal(brrr.nn.GELU()(x), F.gelu(x))
        model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
        report = brrr.patch(model)
        assert len(report.swapped) == 2 and any("registry.on_cpu(name, 'kernel')" in n for n in report.notes)
        assert "note: the model is on the CPU" in str(report)
        brrr.unpatch(model)
        registry.on_cpu("gelu", "kernel")
        assert op.resolve(x) is op.implementation
        assert op.resolve(x, approximate="fast") is op.reference  # still only what brrr supports
        with pytest.raises(ValueError, match="argument mode"):
            registry.on_cpu("gelu", "fast")
        registry.reset("gelu")
        assert op.cpu == "pytorch"
    finally:
        reset_registry()
