"""brrr.patch on models of a popular model library (transformers, pinned for CI in
requirements-test.txt), built from small configs with random weights on the CPU: what it swaps
and leaves, and logits, loss and every parameter gradient against the unpatched model, in float32
and, for a Llama, a GPT-2, a Gemma and a Cohere, bfloat16 (the dtype's rounding: the RMSNorm cast
order is the model's);
and torch.compile(fullgraph=True) of each patched model without a graph break. A patched causal LM
computes its training loss with brrr's fused linear cross-entropy and returns no logits then: its
logits are compared from a call without labels."""

import copy
import io
import pickle

import pytest
import torch

import brrr

transformers = pytest.importorskip("transformers")

DECODER = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8)
SMALL = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
LOSS_BUILT_IN_FORWARD = "brrr.nn.CrossEntropyLoss (its forward's CrossEntropyLoss)"
FUSED = "fused linear cross-entropy (training with labels: the loss from the head's input, logits None)"
FUSED_PREFIX = "fused linear cross-entropy ("  # with the softcap or logit scale it takes in, where any
# the decoder layer's add before its second norm, and (the last layer's) the add that ends it with the model's norm
RESIDUAL = "the residual add fused into post_attention_layernorm; the add that ends it fused into model.norm"
HEAD_NORM = "LayerNorm without bias over each head (a weight row per head, applied after brrr's norm)"
# name: (config, model class, config arguments, what patch must swap, what it must leave)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", DECODER,
              {"RMSNorm (llama cast order)", "gated MLP (swiglu)", "brrr rotary (its forward's apply_rotary_pos_emb)",
               "loss_function: brrr causal-LM cross_entropy", FUSED, RESIDUAL}, set()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", DECODER,
              {"RMSNorm (llama cast order)", "gated MLP (swiglu)", "brrr rotary (its forward's apply_rotary_pos_emb)",
               FUSED, RESIDUAL}, set()),
    # Gemma's RMSNorm scales by (1 + weight), in float32: brrr's rms_norm with offset=1.
    "gemma": ("GemmaConfig", "GemmaForCausalLM", DECODER,
              {"RMSNorm (torch cast order, scaled by 1 + weight)", "gated MLP (geglu)", FUSED, RESIDUAL}, set()),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(DECODER, pad_token_id=0),
             {"RMSNorm (llama cast order)", "gated MLP (swiglu, one gate_up projection)", FUSED, RESIDUAL}, set()),
    # OLMo's LayerNorm has no parameters; Cohere's no bias, and its rotary pairs interleaved features,
    # its logits scaled, its q and k normalised per head (use_qk_norm: a weight row per head); GLM's rotary pairs interleaved features of half the head, angles from the first half.
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(DECODER, pad_token_id=0),
             {"LayerNorm without weight or bias (eps 1e-05 in its forward)", "gated MLP (swiglu)",
              "brrr rotary (its forward's apply_rotary_pos_emb)", FUSED, RESIDUAL}, set()),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(DECODER, pad_token_id=0, use_qk_norm=True),
               {"LayerNorm without bias", "gated MLP (swiglu)", HEAD_NORM,
                "brrr rotary (its forward's apply_rotary_pos_emb, interleaved pairs)",
                FUSED.replace(", logits None", ", its logit scale 0.0625 on the head's input, logits None"),
                "the residual add that ends it fused into model.norm"}, set()),  # attention and MLP in parallel
    "glm": ("GlmConfig", "GlmForCausalLM", dict(DECODER, pad_token_id=0),
            {"RMSNorm (llama cast order)", "gated MLP (swiglu, one gate_up projection)",
             "brrr rotary (its forward's apply_rotary_pos_emb, interleaved pairs, angles from their first half, "
             "partial rotary)", FUSED, RESIDUAL}, set()),
    # Mixtral's experts: their gate (transformers' _apply_gate, all routed tokens at once) brrr's swiglu.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(DECODER, num_local_experts=4, num_experts_per_tok=2),
                {"gated MLP of the experts (swiglu of the gate_up projection, in their _apply_gate)", FUSED, RESIDUAL},
                set()),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=101, n_embd=32, n_layer=2, n_head=4),
             {"brrr.nn.LayerNorm", "gelu (approximate='tanh')", "loss_function: brrr causal-LM cross_entropy", FUSED,
              "the residual add fused into ln_2; the add that ends it fused into transformer.ln_f"},  # (the last
             set()),  # block's; the add before ln_2 fused where the cross-attention's branch between them is skipped)
    # Partial rotary (a quarter of each head): brrr's rotary_dim.
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", SMALL,
                 {"brrr.nn.LayerNorm", "brrr rotary (its forward's apply_rotary_pos_emb, partial rotary)", FUSED},
                 set()),
    "bert": ("BertConfig", "BertForMaskedLM", SMALL,
             {"brrr.nn.LayerNorm", "gelu", "LayerNorm with its residual add (add_layer_norm)", LOSS_BUILT_IN_FORWARD},
             {("BertForMaskedLM", "loss_function behaves like no causal-LM cross-entropy")}),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(vocab_size=101, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                           num_heads=4),
           {"RMSNorm (llama cast order)", "brrr.nn.ReLU", LOSS_BUILT_IN_FORWARD}, set()),
}
DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
            "attention_dropout", "dropout_rate", "hidden_dropout")


def build(name, dtype):
    config_name, model_name, kwargs, _, _ = MODELS[name]
    config = getattr(transformers, config_name)(**kwargs)
    for attribute in DROPOUTS:  # off: the comparison must be deterministic
        if hasattr(config, attribute):
            setattr(config, attribute, 0.0)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).train()
    with torch.no_grad():  # norm weights away from 1 and biases away from 0, so that ignoring them shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype)


def run(model, name, tokens):
    """(logits, loss, gradients, the logits of the training call with labels): the logits of a
    training call without labels, as a patched causal LM returns none with labels."""
    extra = {"decoder_input_ids": tokens} if name == "t5" else {}
    out = model(input_ids=tokens, labels=tokens, **extra)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    with torch.no_grad():
        logits = model(input_ids=tokens, **extra).logits
    return logits, out.loss, grads, out.logits


@pytest.mark.parametrize("name,dtype", [(n, torch.float32) for n in MODELS] +
                         [(n, torch.bfloat16) for n in ("llama", "gpt2", "gemma", "cohere")], ids=str)
def test_patched_model_matches_the_unpatched_one(name, dtype):
    base = build(name, dtype)
    patched = copy.deepcopy(base)
    report = brrr.patch(patched)
    _, _, _, must_swap, must_leave = MODELS[name]
    assert must_swap <= {what for _, _, what in report.swapped}, str(report)
    assert must_leave <= {(cls, why) for _, cls, why in report.left}, str(report)
    tokens = torch.randint(0, 101, (2, 7))
    logits, loss, grads, with_labels = run(base, name, tokens)
    p_logits, p_loss, p_grads, p_with_labels = run(patched, name, tokens)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(p_logits, logits, **tol)
    fused = any(what.startswith(FUSED_PREFIX) for _, _, what in report.swapped)
    assert (p_with_labels is None) == fused and with_labels is not None
    if not fused:
        torch.testing.assert_close(p_with_labels, with_labels, **tol)
    torch.testing.assert_close(p_loss, loss, **tol)
    for (n, _), a, b in zip(base.named_parameters(), p_grads, grads):
        if b is None:
            assert a is None, n
        else:
            torch.testing.assert_close(a, b, **tol, msg=n)
    brrr.unpatch(patched)
    assert [type(m) for m in patched.modules()] == [type(m) for m in base.modules()]


def _brrr_keys(model):
    return [(n, k) for n, m in model.named_modules() for k in vars(m) if k.startswith("_brrr_")]


@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_pickles_as_it_was_before_the_patch(name):
    """torch.save of a patched model (pickle) saves it unpatched: it loads as the model's own
    classes with none of brrr's bookkeeping, and computes what the unpatched model computes, bit for
    bit; copy.deepcopy of it stays patched; the patched model itself is left as it was."""
    base = build(name, torch.float32)
    patched = copy.deepcopy(base)
    brrr.patch(patched)
    patched_types = [type(m) for m in patched.modules()]
    assert patched_types != [type(m) for m in base.modules()] and _brrr_keys(patched)
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in base.modules()]
    assert _brrr_keys(loaded) == []
    assert [type(m) for m in patched.modules()] == patched_types  # pickling changed nothing of it
    tokens = torch.randint(0, 101, (2, 7))
    for got, expected in zip(run(loaded, name, tokens), run(base, name, tokens)):
        if isinstance(expected, tuple):
            assert all(torch.equal(a, b) for a, b in zip(got, expected) if b is not None)
        else:
            assert torch.equal(got, expected)
    copied = copy.deepcopy(patched)
    assert [type(m) for m in copied.modules()] == patched_types
    assert [type(copy.copy(m)) for m in patched.modules()] == patched_types
    torch.testing.assert_close(run(copied, name, tokens)[1], run(patched, name, tokens)[1], rtol=0, atol=0)


def test_pickled_loss_function_unpatches_after_loading():
    """A causal LM whose loss_function alone brrr swapped (fused_linear_cross_entropy=False) keeps
    brrr's loss through pickling (its class is the library's own), and brrr.unpatch after loading
    gives its own loss_function back: the bookkeeping's marker for "no such attribute before"
    survives pickling."""
    base = build("gpt2", torch.float32)
    model = copy.deepcopy(base)
    report = brrr.patch(model, fused_linear_cross_entropy=False)
    assert "loss_function: brrr causal-LM cross_entropy" in {what for _, _, what in report.swapped}
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded.loss_function is brrr.causal_lm_loss
    assert brrr.unpatch(loaded) > 0
    assert _brrr_keys(loaded) == [] and vars(loaded).keys() == vars(base).keys()
    assert type(loaded.loss_function) is type(base.loss_function) and loaded.loss_function is not brrr.causal_lm_loss


# Mixtral's experts on the CPU: transformers' grouped_mm fallback's backward does not compile under
# aot_eager (data-dependent guards), unpatched as well
@pytest.mark.parametrize("name", [name for name in MODELS if name != "mixtral"])
def test_patched_model_compiles_without_graph_breaks(name):
    """torch.compile(fullgraph=True) of the patched model's loss: no graph break, and the loss and
    gradients of eager (aot_eager: dynamo and autograd's tracing, without inductor's codegen)."""
    model = build(name, torch.float32)
    report = brrr.patch(model)
    tokens = torch.randint(0, 101, (2, 7))
    extra = {"decoder_input_ids": tokens} if name == "t5" else {}

    def loss_of(tokens):
        return model(input_ids=tokens, labels=tokens, **extra).loss

    params = [p for p in model.parameters() if p.requires_grad]
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(loss_of)(tokens)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        ops = {str(n.target) for g in explanation.graphs for n in g.graph.nodes}
        swapped = {what for _, _, what in report.swapped}
        swaps_loss = any("CrossEntropyLoss" in what or "loss_function" in what for what in swapped)
        fused = any(what.startswith(FUSED_PREFIX) for what in swapped)
        loss_op = "brrr.linear_cross_entropy.default" if fused else "brrr.cross_entropy.default"
        assert (loss_op in ops) == swaps_loss  # brrr's kernel under compile by default
        compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")(tokens)
        eager = loss_of(tokens)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(compiled, params, allow_unused=True),
                        torch.autograd.grad(eager, params, allow_unused=True)):
            if a is None or b is None:
                assert a is None and b is None
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    finally:
        torch._dynamo.reset()
