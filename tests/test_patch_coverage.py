"""brrr.patch across the causal-LM families of transformers (pinned in requirements-test.txt):
each family built from a tiny config with random weights, float32 on the CPU (brrr's CPU kernels
on, as the suite's conftest sets them). Per family: the exact set of module classes patch swaps
(with what each became) and leaves (with its reason), the registry ops whose brrr kernel then
runs in a training step, and the loss, every parameter gradient and the logits against the
unpatched model. A causal-LM family of the installed transformers that this file does not know
fails, by name: add it to FAMILIES (built here) or to NOT_BUILT.

docs/patch-coverage.md is the table of FAMILIES: `python tests/test_patch_coverage.py` writes it,
and a test fails when the file and the expectations here differ.
"""

import copy
import pathlib
import re
import sys
from dataclasses import dataclass

import pytest
import torch

if __name__ == "__main__":  # run as a script: this checkout's brrr
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import brrr  # noqa: E402

transformers = pytest.importorskip("transformers")

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "patch-coverage.md"

# ---- what patch reports ---------------------------------------------------------------------------

LOSS = "loss_function: brrr causal-LM cross_entropy"
FUSED = "fused linear cross-entropy (training with labels: the loss from the head's input{}, logits None)"
HEAD = ("Linear", "its logits left to the fused linear cross-entropy in training with labels")
ROTARY = "brrr rotary (its forward's apply_rotary_pos_emb{})"
ROTARY_INTERLEAVE = "brrr rotary (its forward's apply_rotary_pos_emb_interleave{})"  # DeepSeek V3's
LLAMA_RMS = "RMSNorm (llama cast order)"
GEMMA_RMS = "RMSNorm (torch cast order, scaled by 1 + weight)"
SWIGLU, GEGLU = "gated MLP (swiglu)", "gated MLP (geglu)"
SWIGLU_FUSED = "gated MLP (swiglu, one gate_up projection)"
EXPERTS = "gated MLP of the experts (swiglu of the gate_up projection, in their _apply_gate)"
COMPUTED = "computed by its parent's brrr forward ({})"
LAYER_NORM = "brrr.nn.LayerNorm"
HEAD_NORM = "LayerNorm without bias over each head (a weight row per head, applied after brrr's norm)"
RESIDUAL = "the residual add fused into {}"
ENDS = "the add that ends it fused into {}"
FUSED_RESIDUAL = "post_attention_layernorm"
NO_RESIDUAL = ("its forward has no `h = residual + x; residual = h; h = self.norm(h)` with a norm brrr swapped: the "
               "residual adds are left")


def causal_lm(model, fused=""):
    """The model's loss and, in training with labels, its head fused into brrr's linear cross-entropy."""
    return {(model, LOSS), (model, FUSED.format(fused)), HEAD}


PRE_NORM_ENDS = ("model.layers.N.input_layernorm", "model.norm")  # the norms the adds that end layers feed
POST_NORM_ENDS = ("model.norm",)  # layers that begin with no norm: the last layer's add feeds the model's


def layers(cls, residual=FUSED_RESIDUAL, ends=PRE_NORM_ENDS):
    """(swapped, left) of the decoder layers `cls`: the residual add fused into the norm `residual`
    (None: none), and the add that ends each into the norm that reads its sum next, `ends` (a norm
    each layer but the last feeds, and the one the last feeds; a layer with neither is left, with no
    such add: only the last layer's add is fused where the layers begin with no norm)."""
    if residual:
        return {(cls, f"{RESIDUAL.format(residual)}; {ENDS.format(norm)}") for norm in ends}, set()
    swapped = {(cls, f"the residual {ENDS[4:].format(norm)}") for norm in ends}
    return swapped, set() if len(ends) == 2 else {(cls, NO_RESIDUAL)}


def llama_like(prefix, rotary="", mlp=SWIGLU, norm=LLAMA_RMS, act="SiLUActivation", fused="",
               residual=FUSED_RESIDUAL, ends=PRE_NORM_ENDS):
    """(swapped, left) of a Llama-style decoder: RMSNorm, gated MLP (its activation computed by the
    MLP's brrr forward), rotary, its layers' residual adds as `layers` says; class names from
    `prefix`."""
    swapped, left = layers(f"{prefix}DecoderLayer", residual, ends)
    swapped |= causal_lm(f"{prefix}ForCausalLM", fused) | {
        (f"{prefix}Attention", ROTARY.format(rotary)), (f"{prefix}MLP", mlp), (f"{prefix}RMSNorm", norm)}
    return swapped, left | {(act, COMPUTED.format("model.layers.N.mlp"))}


@dataclass
class Family:
    model: str  # the causal LM's class
    config: dict  # config arguments besides TINY
    swapped: set  # (module class, what it became)
    left: set  # (module class, why)
    ops: set  # the registry ops whose brrr kernel runs in a training step and a forward without labels
    note: str = ""  # for docs/patch-coverage.md


TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
MOE_NOTE = ("the routed experts' gate, act(gate) * up of their batched gate_up projection (transformers' _apply_gate, "
            "which its default grouped_mm experts call on all routed tokens at once), is brrr's swiglu; the "
            "eager experts' loop calls their SiLU (brrr's silu) itself")
LLAMA_OPS = {"rms_norm", "add_rms_norm", "swiglu", "rotary_qk", "linear_cross_entropy"}
POST_NORM_OPS = LLAMA_OPS - {"add_rms_norm"}  # norms after the sublayers: no norm in a layer reads a residual sum


def _family(model, config, swapped_left, ops, note=""):
    swapped, left = swapped_left
    return Family(model, config, swapped, left, ops, note)


FAMILIES = {
    "llama": _family("LlamaForCausalLM", {}, llama_like("Llama"), LLAMA_OPS),
    "mistral": _family("MistralForCausalLM", {}, llama_like("Mistral"), LLAMA_OPS),
    "qwen2": _family("Qwen2ForCausalLM", {}, llama_like("Qwen2"), LLAMA_OPS),
    "qwen3": _family("Qwen3ForCausalLM", {}, llama_like("Qwen3"), LLAMA_OPS,
                     "the per-head q and k norms are the same RMSNorm class"),
    "gemma": _family("GemmaForCausalLM", {}, llama_like("Gemma", mlp=GEGLU, norm=GEMMA_RMS, act="GELUTanh"),
                     {"rms_norm", "add_rms_norm", "geglu", "rotary_qk", "linear_cross_entropy"},
                     "RMSNorm of (1 + weight) in float32: brrr.rms_norm(offset=1.0)"),
    "gemma2": _family("Gemma2ForCausalLM", {},
                      llama_like("Gemma2", mlp=GEGLU, norm=GEMMA_RMS, act="GELUTanh", fused=", its softcap 30 fused",
                                 residual="pre_feedforward_layernorm"),
                      {"rms_norm", "add_rms_norm", "geglu", "rotary_qk", "linear_cross_entropy"},
                      "the final-logit softcap (30) inside brrr's linear cross-entropy; norms after the sublayers "
                      "too: the add before the MLP's norm fused"),
    "gemma3_text": _family("Gemma3ForCausalLM", {},
                           llama_like("Gemma3", mlp=GEGLU, norm=GEMMA_RMS, act="GELUTanh",
                                      residual="pre_feedforward_layernorm"),
                           {"rms_norm", "add_rms_norm", "geglu", "rotary_qk", "linear_cross_entropy"}),
    "phi3": _family("Phi3ForCausalLM", {}, llama_like("Phi3", rotary=", partial rotary", mlp=SWIGLU_FUSED),
                    LLAMA_OPS, "one gate_up projection split by brrr's swiglu"),
    "olmo": _family("OlmoForCausalLM", {}, (
        llama_like("Olmo")[0] - {("OlmoRMSNorm", LLAMA_RMS)}
        | {("OlmoLayerNorm", "LayerNorm without weight or bias (eps 1e-05 in its forward)")},
        llama_like("Olmo")[1]), {"layer_norm", "add_layer_norm", "swiglu", "rotary_qk", "linear_cross_entropy"},
        "LayerNorm without parameters: brrr.layer_norm(weight=None, bias=None)"),
    "olmo2": _family("Olmo2ForCausalLM", {}, llama_like("Olmo2", residual=None, ends=POST_NORM_ENDS),
                     POST_NORM_OPS | {"add_rms_norm"},
                     "norms after the sublayers: the adds inside a layer stay separate, the last layer's with the "
                     "model's norm"),
    "granite": _family("GraniteForCausalLM", {}, llama_like("Granite"), LLAMA_OPS),
    "stablelm": _family("StableLmForCausalLM", {}, (
        llama_like("StableLm")[0] - {("StableLmRMSNorm", LLAMA_RMS)} | {("LayerNorm", LAYER_NORM)},
        llama_like("StableLm")[1]), {"layer_norm", "add_layer_norm", "swiglu", "rotary_qk", "linear_cross_entropy"},
        "partial rotary split off in the attention's forward: brrr rotates the rotated part; the residual sum "
        "normalised inside the MLP's call (`self.mlp(self.post_attention_layernorm(residual))`)"),
    "starcoder2": _family("Starcoder2ForCausalLM", {}, (
        causal_lm("Starcoder2ForCausalLM") | {("Starcoder2Attention", ROTARY.format("")),
                                              ("GELUTanh", "gelu (approximate='tanh')"), ("LayerNorm", LAYER_NORM)}
        | layers("Starcoder2DecoderLayer")[0], set()),
        {"layer_norm", "add_layer_norm", "gelu", "rotary_qk", "linear_cross_entropy"}),
    "cohere": _family("CohereForCausalLM", dict(use_qk_norm=True), (
        llama_like("Cohere", rotary=", interleaved pairs", fused=", its logit scale 0.0625 on the head's input",
                   residual=None)[0] - {("CohereRMSNorm", LLAMA_RMS)} | {("CohereLayerNorm", "LayerNorm without bias"),
                                                                         ("CohereLayerNorm", HEAD_NORM)},
        llama_like("Cohere", residual=None)[1]),
        {"layer_norm", "add_layer_norm", "swiglu", "rotary_qk", "linear_cross_entropy"},
        "LayerNorm without bias; its QK-norm (use_qk_norm, on here) a LayerNorm over each head with a weight row per "
        "head: brrr's norm in float32, then the weight, one cast (brrr's kernels read one weight row for all rows); "
        "rotary of interleaved pairs; logits times logit_scale: the head's input scaled; attention and MLP in "
        "parallel: the add of both to the residual, which ends the layer, fused into the next norm"),
    "smollm3": _family("SmolLM3ForCausalLM", {}, llama_like("SmolLM3"), LLAMA_OPS),
    "glm": _family("GlmForCausalLM", {}, llama_like(
        "Glm", rotary=", interleaved pairs, angles from their first half, partial rotary", mlp=SWIGLU_FUSED), LLAMA_OPS,
        "rotary of interleaved pairs over half the head, each pair's angle read in place (no repeat_interleave)"),
    "mixtral": _family("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), (
        causal_lm("MixtralForCausalLM") | {("MixtralAttention", ROTARY.format("")),
                                           ("MixtralRMSNorm", LLAMA_RMS), ("SiLUActivation", "silu"),
                                           ("MixtralExperts", EXPERTS)}
        | layers("MixtralDecoderLayer")[0], set()),
        {"rms_norm", "add_rms_norm", "swiglu", "rotary_qk", "linear_cross_entropy"}, MOE_NOTE),
    "qwen2_moe": _family("Qwen2MoeForCausalLM", dict(MOE, shared_expert_intermediate_size=32), (
        llama_like("Qwen2Moe")[0] | {("SiLUActivation", "silu"), ("Qwen2MoeExperts", EXPERTS)},
        {("SiLUActivation", COMPUTED.format("model.layers.N.mlp.shared_expert"))}),
        {"rms_norm", "add_rms_norm", "swiglu", "rotary_qk", "linear_cross_entropy"},
        "the shared expert is a gated MLP; " + MOE_NOTE),
    "qwen3_moe": _family("Qwen3MoeForCausalLM", MOE, (
        causal_lm("Qwen3MoeForCausalLM") | {("Qwen3MoeAttention", ROTARY.format("")),
                                            ("Qwen3MoeRMSNorm", LLAMA_RMS), ("SiLUActivation", "silu"),
                                            ("Qwen3MoeExperts", EXPERTS)}
        | layers("Qwen3MoeDecoderLayer")[0], set()),
        {"rms_norm", "add_rms_norm", "swiglu", "rotary_qk", "linear_cross_entropy"}, MOE_NOTE),
    "deepseek_v3": _family("DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
        first_k_dense_replace=1), (
        llama_like("DeepseekV3")[0] - {("DeepseekV3Attention", ROTARY.format(""))} | {
            ("SiLUActivation", "silu"), ("DeepseekV3Experts", EXPERTS),
            ("DeepseekV3Attention", ROTARY.format("") + "; " + ROTARY_INTERLEAVE.format(
                ", interleaved pairs, angles from their first half, halves out"))},
        llama_like("DeepseekV3")[1] | {("SiLUActivation", COMPUTED.format("model.layers.N.mlp.shared_experts"))}),
        {"rms_norm", "add_rms_norm", "swiglu", "rotary_qk", "linear_cross_entropy"},
        "config.rope_interleave (its default) rotates through apply_rotary_pos_emb_interleave (interleaved pairs "
        "in, halves out): brrr's interleaved rotary, then the halves as one copy (its own torch.cat)"),
    "falcon": _family("FalconForCausalLM", dict(head_dim=None), (
        causal_lm("FalconForCausalLM") | {("FalconAttention", ROTARY.format("")), ("GELUActivation", "gelu"),
                                          ("LayerNorm", LAYER_NORM)},
        {("FalconDecoderLayer", NO_RESIDUAL)}), {"layer_norm", "gelu", "rotary_qk", "linear_cross_entropy"},
        "attention and MLP in parallel: the residual add stays separate"),
    "gpt_neox": _family("GPTNeoXForCausalLM", {}, (
        causal_lm("GPTNeoXForCausalLM") | {("GPTNeoXAttention", ROTARY.format(", partial rotary")),
                                           ("GELUActivation", "gelu"), ("LayerNorm", LAYER_NORM)}
        | layers("GPTNeoXLayer", ends=("gpt_neox.layers.N.input_layernorm", "gpt_neox.final_layer_norm"))[0], set()),
        {"layer_norm", "add_layer_norm", "gelu", "rotary_qk", "linear_cross_entropy"},
        "partial rotary: brrr's rotary_dim; the residual add fused in its sequential branch "
        "(use_parallel_residual=False; the default runs the parallel one)"),
    "gpt2": _family("GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_inner=64), (
        causal_lm("GPT2LMHeadModel") | {("NewGELUActivation", "gelu (approximate='tanh')"), ("LayerNorm", LAYER_NORM)}
        | layers("GPT2Block", "ln_2", ("transformer.h.N.ln_1", "transformer.ln_f"))[0], set()),
        {"layer_norm", "add_layer_norm", "gelu", "linear_cross_entropy"},
        "learned positions: no rotary; the add before ln_2 fused where the cross-attention's branch between them "
        "is skipped; the add that ends a block fused into the next ln_1 (ln_f after the last)"),
    "phi": _family("PhiForCausalLM", {}, (
        causal_lm("PhiForCausalLM") | {("PhiAttention", ROTARY.format("")),
                                       ("NewGELUActivation", "gelu (approximate='tanh')"), ("LayerNorm", LAYER_NORM)}
        | layers("PhiDecoderLayer", None, ("model.layers.N.input_layernorm", "model.final_layernorm"))[0], set()),
        {"layer_norm", "add_layer_norm", "gelu", "rotary_qk", "linear_cross_entropy"},
        "partial rotary split off in the attention's forward: brrr rotates the rotated part; attention and MLP in "
        "parallel: their sum and the residual, the add that ends the layer, fused into the next norm"),
    "exaone4": _family("Exaone4ForCausalLM", {}, llama_like("Exaone4", residual=None, ends=POST_NORM_ENDS),
                       POST_NORM_OPS | {"add_rms_norm"},
                       "norms after the sublayers: the adds inside a layer stay separate, the last layer's with the "
                       "model's norm"),
    "ernie4_5": _family("Ernie4_5ForCausalLM", {}, llama_like(
        "Ernie4_5", rotary=", interleaved pairs, angles from their first half"), LLAMA_OPS,
        "rotary of interleaved pairs, each pair's angle read in place (no repeat_interleave)"),
    "apertus": _family("ApertusForCausalLM", {}, (
        causal_lm("ApertusForCausalLM") | {("ApertusAttention", ROTARY.format("")), ("ApertusRMSNorm", LLAMA_RMS)}
        | layers("ApertusDecoderLayer", "feedforward_layernorm",
                 ("model.layers.N.attention_layernorm", "model.norm"))[0],
        set()), {"rms_norm", "add_rms_norm", "rotary_qk", "linear_cross_entropy"},
        "its MLP is up, xIELU (an activation with parameters), down: left, unreported"),
    "seed_oss": _family("SeedOssForCausalLM", {}, llama_like("SeedOss"), LLAMA_OPS,
                        "a gated MLP with a dropout after it: swapped only with that dropout off (here)"),
    "hunyuan_v1_dense": _family("HunYuanDenseV1ForCausalLM", {}, llama_like("HunYuanDenseV1"), LLAMA_OPS),
}

# The causal-LM families of transformers 5.17.0 not built here: outside issue 24's list (the encoder
# and sequence-to-sequence families with a causal-LM head among them; BERT and T5 are built in
# tests/test_model_libraries.py), or multimodal.
NOT_BUILT = frozenset("""
afmoe arcee aria_text axk1 axk2 bamba bart bert bert-generation big_bird bigbird_pegasus biogpt bitnet blenderbot
blenderbot-small bloom blt camembert codegen cohere2 cohere2_moe cohere_compass_text cpmant ctrl cwm data2vec-text
dbrx deepseek_v2 deepseek_v32 deepseek_v4 diffllama doge dots1 electra emu3 ernie ernie4_5_moe exaone_moe falcon_h1
falcon_mamba flex_olmo fuyu gemma3 gemma3n gemma3n_text gemma4 gemma4_assistant gemma4_text gemma4_unified
gemma4_unified_assistant gemma4_unified_text git glm4 glm4_moe glm4_moe_lite glm_moe_dsa got_ocr2 gpt-sw3 gpt_bigcode
gpt_neo gpt_neox_japanese gpt_oss gptj granite_swa granitemoe granitemoe_swa granitemoehybrid granitemoeshared helium
hrm_text hunyuan_v1_moe hy_v3 hy_v4 hyperclovax inkling_text jais2 jamba jetmoe kimi_linear laguna lfm2 lfm2_moe
llama4 llama4_text longcat_flash mamba mamba2 marian mbart megatron-bert mellum mimo_v2_flash minicpm3 minimax
minimax_m2 minimax_m3_vl_text ministral ministral3 mllama modernbert-decoder moshi mpt musicgen musicgen_melody mvp
nanochat nemotron nemotron_h olmo3 olmo_hybrid olmoe openai-gpt opt pegasus persimmon phi4_multimodal phimoe plbart
prophetnet qwen2 qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text qwen3_next qwen4_exp qwen4_exp_text recurrent_gemma
reformer rembert roberta roberta-prelayernorm roc_bert roformer rwkv solar_open trocr vaultgemma whisper xglm xlm
xlm-roberta xlm-roberta-xl xlnet xlstm xmod youtu zamba zamba2 zaya
""".split()) - set(FAMILIES)

DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
            "residual_dropout", "mlp_dropout")


def build(name):
    family = FAMILIES[name]
    options = {k: v for k, v in dict(TINY, **family.config).items() if v is not None}
    config = transformers.AutoConfig.for_model(name, **options)
    for attribute in DROPOUTS:  # off: the comparison must be deterministic
        if isinstance(getattr(config, attribute, None), float):
            setattr(config, attribute, 0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    with torch.no_grad():  # norm weights away from 1 (Gemma's from 0) and biases from 0, so that ignoring them shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def reported(entries):
    """{(class, what)} of a report's swapped or left entries, layer indices in module paths as N."""
    return {(cls, re.sub(r"\.\d+(?=[.)])", ".N", what)) for _, cls, what in entries}


def step(model, tokens):
    """(loss, gradients of every parameter) of a training step with labels, and the logits of a
    forward without them (a patched causal LM returns none with labels)."""
    out = model(input_ids=tokens, labels=tokens)
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return out.loss, grads, logits


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_patch_swaps_exactly_what_it_should_and_matches_the_unpatched_model(name, monkeypatch):
    family = FAMILIES[name]
    base = build(name)
    assert type(base).__name__ == family.model
    patched = copy.deepcopy(base)
    report = brrr.patch(patched)
    assert reported(report.swapped) == family.swapped, str(report)
    assert reported(report.left) == family.left, str(report)
    ran = set()
    for op_name in brrr.registry.names():
        op = brrr.registry.lookup(op_name)
        monkeypatch.setattr(op, "implementation",
                            lambda *a, _fn=op.implementation, _name=op_name, **k: ran.add(_name) or _fn(*a, **k))
    tokens = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(1))
    loss, grads, logits = step(base, tokens)
    p_loss, p_grads, p_logits = step(patched, tokens)
    assert ran == family.ops
    torch.testing.assert_close(p_loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p_logits, logits, rtol=1e-4, atol=1e-5)
    for (n, _), a, b in zip(base.named_parameters(), p_grads, grads):
        if b is None:
            assert a is None, n
        else:  # sums over tokens: the tolerance relative to the gradient's largest element
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(b.abs().max().item(), 1e-2), msg=n)
    assert brrr.unpatch(patched) > 0
    assert [type(m) for m in patched.modules()] == [type(m) for m in base.modules()]


def test_every_causal_lm_family_of_transformers_is_known():
    """A family a newer transformers adds fails here rather than go untested."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    unknown = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(FAMILIES) - NOT_BUILT)
    assert not unknown, (f"transformers {transformers.__version__} has causal-LM families that "
                         f"tests/test_patch_coverage.py does not know: {', '.join(unknown)}. Build each in FAMILIES "
                         "(what brrr.patch swaps and leaves in it) or name it in NOT_BUILT.")
    assert not set(FAMILIES) & NOT_BUILT


# ---- docs/patch-coverage.md -----------------------------------------------------------------------

def _short(cls, what):
    """A swap as the table shows it: the rotary by its layout (and the function, where a forward
    has two), the loss by what is fused into it."""
    rotaries = [re.fullmatch(re.escape(ROTARY.format("")[:-1]) + r"(_interleave)?(.*)\)", part)
                for part in what.split("; ")]
    if all(rotaries):
        layouts = [r.group(2)[2:] or "halves (rotate_half)" for r in rotaries]
        if len(layouts) > 1:
            layouts = [f"apply_rotary_pos_emb{r.group(1) or ''}: {layout}" for r, layout in zip(rotaries, layouts)]
        return f"{cls}: " + "; ".join(layouts)
    fused = re.fullmatch(re.escape(FUSED.format("")[:-len(", logits None)")]) + r"(.*), logits None\)", what)
    if fused:
        return "head and loss: brrr linear cross-entropy" + (f" ({fused.group(1)[2:]})" if fused.group(1) else "")
    if what == LOSS:
        return "loss_function: brrr cross-entropy"
    return f"{cls}: {what}"


_COLUMNS = [("norms", lambda w: w.startswith(("RMSNorm", "LayerNorm", "brrr.nn.LayerNorm"))),
            ("residual add", lambda w: w.startswith("the residual add")),
            ("MLP and activations", lambda w: w.startswith(("gated MLP", "gelu", "silu", "relu"))),
            ("rotary", lambda w: w.startswith("brrr rotary")),
            ("loss", lambda w: w in (LOSS, HEAD[1]) or w.startswith("fused linear"))]


def _cell(pairs):
    shown = sorted({_short(cls, what) for cls, what in pairs if (cls, what) != HEAD})
    return "<br>".join(shown) or "-"


def coverage_table():
    """docs/patch-coverage.md, from FAMILIES."""
    lines = ["# What brrr.patch fuses in each causal-LM family", "",
             "Generated by `python tests/test_patch_coverage.py` from that test's expectations, for transformers "
             f"{transformers.__version__}: each family is built from a tiny config, patched, and its loss, every "
             "gradient and its logits compared with the unpatched model's (float32, brrr's CPU kernels). The test fails "
             "when what patch swaps or leaves in a family, or the ops that run, differ from this table, and when this "
             "file differs from what it generates.", "",
             "Cells read `module class: what brrr.patch made of it` (as its report says). Residual add: the decoder "
             "layer's add whose sum its next norm reads, one add_rms_norm or add_layer_norm with that norm; and the "
             "add that ends a layer, one add_rms_norm or add_layer_norm with the norm that reads its sum next (the "
             "next layer's first, the model's last after the last layer), seen on a probe of the model: the layer "
             "still returns its whole sum, and that norm's own call returns the output computed with it "
             "(the section at the end says when it does not). Rotary: the layout of the "
             "model's apply_rotary_pos_emb that brrr's kernel runs. Loss: the model's loss_function is brrr's "
             "cross-entropy; in training with labels the head and the loss are one brrr linear cross-entropy, the "
             "logits never held whole (docs/linear-cross-entropy.md). *brrr kernels*: the registry ops whose brrr "
             "kernel runs in the family's training step and its forward without labels.", "",
             "| family | model | " + " | ".join(c for c, _ in _COLUMNS) + " | left as they are | brrr kernels | note |",
             "|" + "---|" * (len(_COLUMNS) + 5)]
    for name in sorted(FAMILIES):
        family = FAMILIES[name]
        cells, rest = [], set(family.swapped)
        for _, belongs in _COLUMNS:
            mine = {(cls, what) for cls, what in rest if belongs(what)}
            rest -= mine
            cells.append(_cell(mine))
        assert not rest, f"{name}: swaps in no column: {rest}"
        lines.append(f"| {name} | {family.model} | " + " | ".join(cells) +
                     f" | {_cell(family.left)} | {', '.join(sorted(family.ops))} | {family.note or '-'} |")
    lines += ["", f"Not built by the test: the other {len(NOT_BUILT)} causal-LM families of transformers "
              f"{transformers.__version__} (the encoder and sequence-to-sequence families with a causal-LM head "
              "among them; BERT and T5 are built in tests/test_model_libraries.py).", ""] + ENDING_A_LAYER + WHAT_IT_KEEPS
    return "\n".join(lines)


ENDING_A_LAYER = [
    "## The add that ends a layer", "",
    "A decoder layer's last add (`h = residual + mlp(...); return h`) feeds the norm the next layer applies first, "
    "or the model's final norm after the last layer. The layer must still return h whole: forward hooks, "
    "output_hidden_states (recorded by hooks on the layers), gradient checkpointing (which runs and recomputes "
    "each layer as a unit) and a caller's own loop over the layers see each layer's output. So brrr.patch "
    "leaves the boundary where it is and computes the next norm early: the add runs as that norm's residual "
    "form (add_rms_norm or add_layer_norm: the sum, rounded to the model's dtype, and the norm of it, in one "
    "pass), the layer returns the sum, and the norm's own call, given that very tensor unchanged since (its "
    "version), returns the output computed with it. The output is the norm's of the sum bitwise, and its "
    "gradient reaches the sum through the fused call's backward, which also adds the residual stream's "
    "gradient: the backward's separate sum goes too. Which norm reads a layer's sum is seen on a probe of the "
    "model (a forward of 2 tokens), and that norm's residual form is checked against it as the inner add's is.",
    "",
    "The add and the norm run as the unpatched model runs them (nothing computed ahead) under torch.compile "
    "(inductor fuses them itself), in a layer transformers checkpoints, under saved-tensor hooks (torch's "
    "non-reentrant checkpoint around a layer would find the next norm's saved tensors in one of the layer's two "
    "runs and not the other, and refuse; activation offloading), where the layer, the norm or the next layer "
    "that holds it has hooks (a pre-hook of the next layer may steer its input in place; transformers' output "
    "recorders, which only keep a layer's output, aside), where the norm is no longer swapped (`brrr.unpatch` of "
    "it or of its layer), and where "
    "the norm's output and the sum differ in requires_grad (torch's reentrant checkpoint runs a layer without "
    "grad). A sum changed in place between the layer and the norm (by code other than hooks) is normalised "
    "anew, and the fused call's backward then refuses the changed tensor it saved, where the unpatched add "
    "saved none: `brrr.unpatch` such a model. Falcon's layers return a tuple, and the add that ends them "
    "stays separate.", ""]

WHAT_IT_KEEPS = [
    "## What a patched model keeps", "",
    "- Its classes' names: each swapped module's class is a subclass of its own under the same name",
    "  (`type(m).__name__`), which `save_pretrained` writes into `config.architectures` and which",
    "  accelerate's and FSDP's layer-wrapping options name; the exceptions are torch.nn modules swapped",
    "  for their `brrr.nn` twins (`torch.nn.Linear` becomes `brrr.nn.RematLinear` under remat), which",
    "  are subclasses under their own names.",
    "- Its forward's signature: the fused loss's forward is `functools.wraps` of the model's, so",
    "  Trainer (`remove_unused_columns`) keeps the batch's columns.",
    "- The user's hooks: `patch` probes modules with the user's hooks (the modules' and torch.nn's",
    "  global ones) put aside, and puts them back after; a hook on a child that a swapped parent",
    "  computes itself (a gated MLP's activation, BERT's residual LayerNorm) makes that parent run its",
    "  original forward, so the hook fires and its change counts; a hook on the head, or a head",
    "  replaced since the patch (`resize_token_embeddings` with untied weights,",
    "  `set_output_embeddings`), gets the unfused loss and the logits.",
    "- With `return_dict=False` and labels in training, the tuple keeps the logits' place: `(loss, None,",
    "  ...)`.", ""]


def test_the_coverage_doc_is_the_table_of_these_expectations():
    assert DOC.read_text() == coverage_table(), "docs/patch-coverage.md is stale: python tests/test_patch_coverage.py"


if __name__ == "__main__":
    DOC.write_text(coverage_table())
    print(f"wrote {DOC}")
