"""brrr.patch on models from Hugging Face transformers, built from configs with random weights
(no downloads): logits and gradients against the unpatched model, and a training step's time,
the summed time of its kernels and its peak memory for unpatched/patched x eager/torch.compile,
at 4096 and 16384 tokens per step (and a wider Llama at 16384). A step whose time exceeds its
kernels' by far waits on the host (Python, dispatch, launches): at 4096 tokens every variant does
on the H200's host. GPU only (tests/test_model_libraries.py checks patched models on the CPU).

test_wide_model_step: Gemma 2 and Cohere from their configs (vocabulary 256000; Gemma 2's
final-logit softcap, Cohere's logit scale and QK-norm), 2 layers at hidden 2048, bf16, 16384 tokens per step:
brrr.patch eager and compiled against unpatched eager, torch.compile and Liger-Kernel (Gemma 2,
where liger_kernel is importable), step time and peak memory; first the patched model's logits,
loss and every gradient against the unpatched model's, at 2048 tokens. Sized to run in about 3
minutes on an H200 (not measured yet), most of it compiling:
`python -m pytest benchmarks/test_bench_models.py -k wide -s`."""

import contextlib
import copy
import gc

import pytest
import torch

import brrr
from brrr import registry
from harness import compiled, host_us_per_call, kernel_ms, module_names_restored, on_gpu, time_ms

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not on_gpu(), reason="model benchmarks run on the GPU")
try:
    import liger_kernel.transformers as liger
except ImportError:
    liger = None

SEQ = 512
BATCHES = (8, 32)


def llama():
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


def llama_2048():
    """Llama at TinyLlama's width (hidden 2048, MLP 5632, 32 query heads of 64 sharing 4 key/value
    heads), 2 layers: more GPU work per token, the same host work per step."""
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                                   num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=32000, n_embd=768, n_layer=2, n_head=12, n_positions=SEQ,
                                  attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


def bert():
    """BERT-base's width, 2 layers: post-norm blocks, where brrr.patch fuses each residual add into
    its LayerNorm (add_layer_norm); masked-LM loss over every token (transformers' own)."""
    cfg = transformers.BertConfig(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                                  num_attention_heads=12, max_position_embeddings=SEQ, attn_implementation="sdpa")
    return transformers.BertForMaskedLM(cfg)


MODELS = {"llama": llama, "gpt2": gpt2, "llama_2048": llama_2048, "bert": bert}
TRAINING = [(name, batch) for name in ("llama", "gpt2") for batch in BATCHES] + [("llama_2048", BATCHES[-1]),
                                                                                ("bert", BATCHES[-1])]


def build(name):
    """The model and a copy to patch (not patched yet: see set_patched)."""
    torch.manual_seed(0)
    base = MODELS[name]().to("cuda", torch.bfloat16)
    base.train()
    for m in base.modules():  # dropout off: the comparison must be deterministic
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return base, copy.deepcopy(base)


def set_patched(model, on):
    """Patch or unpatch `model` (the copy); the report when patching."""
    patched = getattr(model, "_bench_patched", False)
    report = None
    if on and not patched:
        report = brrr.patch(model)
    elif not on and patched:
        brrr.unpatch(model)
    model._bench_patched = on
    return report


def step_fn(model, tokens):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=tokens, labels=tokens, use_cache=False)
        out.loss.backward()
        return out.loss
    return step


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_patched_model(recorder, name):
    base, patched = build(name)
    tokens = torch.randint(0, 32000, (BATCHES[0], SEQ), device="cuda")

    # Correctness: logits, loss and every gradient against the unpatched model.
    results = {}
    for label, model in (("unpatched", base), ("patched", patched)):
        if label == "patched":
            report = set_patched(patched, True)
            print(f"\n{name}: {report}")
        model.zero_grad(set_to_none=True)
        out = model(input_ids=tokens, labels=tokens, use_cache=False)
        out.loss.backward()
        with torch.no_grad():  # a patched causal LM returns no logits in training with labels
            logits = model(input_ids=tokens, use_cache=False).logits.float()
        results[label] = (logits, out.loss.float(), {n: p.grad.float() for n, p in model.named_parameters()})
    (la, lossa, ga), (lb, lossb, gb) = results["unpatched"], results["patched"]
    logit_err = ((la - lb).norm() / la.norm()).item()
    # Relative to each gradient, but not below a thousandth of the largest: a gradient that is zero
    # in exact arithmetic (BERT's attention key bias: softmax ignores a per-query constant) is
    # rounding noise in either model, and its relative difference means nothing.
    floor = 1e-3 * max(g.norm() for g in ga.values())
    grad_err = max(((ga[n] - gb[n]).norm() / torch.maximum(ga[n].norm(), floor)).item() for n in ga)
    recorder.add(family="model", op=name, check="patched vs unpatched", logits_rel_err=logit_err,
                 loss_unpatched=lossa.item(), loss_patched=lossb.item(), max_grad_rel_err=grad_err,
                 swapped=len(report.swapped), left=len(report.left))
    set_patched(patched, False)
    assert logit_err < 2e-2 and abs(lossa.item() - lossb.item()) < 2e-2 and grad_err < 5e-2


def test_host_speed(recorder):
    """This run's host speed, for comparing runs: each device call gets a machine whose host may
    be faster or slower, and a patched eager step waits on its host. The host time of a tiny eager
    LayerNorm forward+backward (its kernels take microseconds)."""
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    w, b = torch.ones(64, device="cuda", requires_grad=True), torch.zeros(64, device="cuda", requires_grad=True)
    g = torch.ones_like(x)
    us = host_us_per_call(lambda: torch.autograd.grad(torch.nn.functional.layer_norm(x, (64,), w, b), (x, w, b), g),
                          calls=500)
    recorder.add(family="model", op="host probe", impl="eager layer_norm fwd+bwd, 8 x 64", host_us=us)
    print(f"host probe: {us:.1f} us per tiny eager LayerNorm forward+backward")
    assert us > 0


@pytest.mark.parametrize("name,batch", TRAINING)
def test_training_step(recorder, name, batch):
    """Speed and memory of a training step (forward + backward, bf16 weights)."""
    base, patched = build(name)
    tokens = torch.randint(0, 32000, (batch, SEQ), device="cuda")
    variants = [("unpatched", base, "eager"), ("unpatched", base, "compile"), ("patched", patched, "eager"),
                ("patched", patched, "compile"), ("patched", patched, "compile, brrr kernels")]
    for label, model, mode in variants:
        set_patched(patched, label == "patched")
        try:
            # "compile" keeps the registry's defaults (under torch.compile only cross_entropy stays
            # brrr's kernel); "compile, brrr kernels" puts brrr's kernels for every op in the graph.
            if mode == "compile, brrr kernels":
                for op in registry.names():
                    registry.under_compile(op, "kernel")
            torch._dynamo.reset()  # dynamo's cache does not see the registry's choices
            step = step_fn(model if mode == "eager" else compiled(model), tokens)
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
            ms = time_ms(step, warmup=3, reps=20)
            kernels = kernel_ms(step)
            recorder.add(family="model", op=name, impl=f"{label} {mode}", shape=[batch, SEQ], ms=ms,
                         kernel_ms=kernels, tokens_per_s=batch * SEQ / (ms * 1e-3), peak_step_bytes=peak)
            print(f"{name} {batch}x{SEQ} {label:9s} {mode:21s} {ms:8.3f} ms/step  kernels {kernels:8.3f} ms  "
                  f"peak +{peak / 2**20:8.1f} MiB")
        finally:
            registry.reset()
    set_patched(patched, False)

    # CUDA-graph capture of a patched training step is shown on the test suite's model
    # (tests/test_registry.py): capturing these transformers models failed on the H200 inside
    # their own code ("Offset increment outside graph capture", the RNG state of their attention
    # path), which also poisons the process for what follows.


# ---- Gemma 2 and Cohere at hidden 2048 -------------------------------------------------------------

WIDE_BATCH, WIDE_SEQ = 16, 1024  # 16384 tokens per step
CHECK_BATCH = 2  # the correctness check's step: 2048 tokens, so that both models' logits fit in float32


def gemma2_2048():
    """Gemma 2's config (vocabulary 256000, final-logit softcap 30, sliding and global layers) at
    hidden 2048, MLP 8192, 8 query heads of 256 sharing 4 key/value heads, 2 layers."""
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, max_position_embeddings=WIDE_SEQ))


def cohere_2048():
    """Cohere's config (vocabulary 256000, logit scale 1/16, LayerNorm without bias, interleaved
    rotary) at hidden 2048, MLP 8192, 16 query heads of 128 sharing 4 key/value heads, 2 layers,
    with its QK-norm on (use_qk_norm, as Command R+ has it: a LayerNorm per head, a weight row
    per head)."""
    return transformers.CohereForCausalLM(transformers.CohereConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
        max_position_embeddings=WIDE_SEQ, use_qk_norm=True))


WIDE = {"gemma2": gemma2_2048, "cohere": cohere_2048}


def wide(name):
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU: a 256000-word embedding takes seconds on the host
        model = WIDE[name]()
    return model.to(torch.bfloat16).train()


@contextlib.contextmanager
def liger_gemma2(model):
    """Liger-Kernel's Gemma 2 patch on `model` (its defaults: RMSNorm, GeGLU, rotary, fused linear
    cross-entropy), undone after: it also rebinds names in transformers' Gemma 2 module."""
    from transformers.models.gemma2 import modeling_gemma2

    with module_names_restored(modeling_gemma2):
        liger.apply_liger_kernel_to_gemma2(model=model)
        yield model


def check_against_unpatched(recorder, name, base, patched, tokens):
    """The patched model's logits (a forward without labels), loss and every gradient against the
    unpatched model's: within bf16 rounding (norm-wise relative errors, as test_patched_model)."""
    results = {}
    for label, model in (("unpatched", base), ("patched", patched)):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=tokens, labels=tokens, use_cache=False)
        out.loss.backward()
        with torch.no_grad():
            logits = model(input_ids=tokens, use_cache=False).logits.float()
        results[label] = (logits, out.loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()})
        del out
    (la, lossa, ga), (lb, lossb, gb) = results["unpatched"], results["patched"]
    logit_err = ((la - lb).norm() / la.norm()).item()
    floor = 1e-3 * max(g.norm() for g in ga.values())
    grad_err = max(((ga[n] - gb[n]).norm() / torch.maximum(ga[n].norm(), floor)).item() for n in ga)
    recorder.add(family="model", op=name, check="patched vs unpatched", shape=list(tokens.shape),
                 logits_rel_err=logit_err, loss_unpatched=lossa, loss_patched=lossb, max_grad_rel_err=grad_err)
    print(f"{name}: logits rel err {logit_err:.2e}, loss {lossa:.5f} vs {lossb:.5f}, max grad rel err {grad_err:.2e}")
    for model in (base, patched):
        model.zero_grad(set_to_none=True)
    assert logit_err < 2e-2 and abs(lossa - lossb) < 2e-2 * abs(lossa) and grad_err < 5e-2


def measure_step(recorder, name, impl, model, tokens, compile_it=False):
    """Median step time and peak memory (all the process holds on the GPU during a step, the
    weights included) of one variant; its compiled module and graphs dropped after."""
    torch._dynamo.reset()
    step = step_fn(compiled(model) if compile_it else model, tokens)
    step()  # warm-up (and compilation)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    ms = time_ms(step, warmup=2, reps=10, max_time_s=3.0)
    recorder.add(family="model", op=name, impl=impl, shape=[WIDE_BATCH, WIDE_SEQ], ms=ms,
                 tokens_per_s=WIDE_BATCH * WIDE_SEQ / (ms * 1e-3), peak_bytes=peak)
    print(f"{name} {WIDE_BATCH}x{WIDE_SEQ} {impl:22s} {ms:9.2f} ms/step  peak {peak / 2**30:6.2f} GiB")
    model.zero_grad(set_to_none=True)
    del step
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", list(WIDE))
def test_wide_model_step(recorder, name):
    base = wide(name)
    patched = copy.deepcopy(base)
    report = brrr.patch(patched)
    print(f"\n{name}: {report}")
    vocab = base.config.vocab_size
    check_against_unpatched(recorder, name, base, patched,
                            torch.randint(0, vocab, (CHECK_BATCH, WIDE_SEQ), device="cuda"))
    tokens = torch.randint(0, vocab, (WIDE_BATCH, WIDE_SEQ), device="cuda")
    measure_step(recorder, name, "unpatched eager", base, tokens)
    measure_step(recorder, name, "unpatched compile", base, tokens, compile_it=True)
    measure_step(recorder, name, "brrr.patch eager", patched, tokens)
    measure_step(recorder, name, "brrr.patch compile", patched, tokens, compile_it=True)
    if name == "gemma2" and liger is not None:
        del patched
        with liger_gemma2(base) as model:  # last: Liger patches the instance
            measure_step(recorder, name, "liger", model, tokens)


# ---- the residual adds of a Llama-style step --------------------------------------------------------

RESIDUAL_LAYERS, RESIDUAL_BATCH, RESIDUAL_SEQ = 4, 16, 1024  # issue 21's step: 4 layers x hidden 2048 x 16384 tokens


def residual_adds(step, shape):
    """(calls, summed device ms) of the adds of two tensors of `shape` (the residual stream's) one
    call of step() runs, forward and backward (torch.profiler's ops by input shape)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    calls, us = 0, 0.0
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in ("aten::add", "aten::add_") and [list(s) for s in e.input_shapes[:2]] == [shape, shape]:
            calls += e.count
            us += e.self_device_time_total
    return calls, us / 1e3


def test_residual_adds_of_a_llama_step(recorder):
    """brrr.patch fuses the residual add before each decoder layer's second norm into it, and the
    add that ends each layer into the norm that reads its sum next (the next layer's first, the
    model's last), each one add_rms_norm: the step's residual adds, their device time, its
    kernels' and its time, for the unpatched model, the patched one with its decoder layers' own
    forward (the adds as before) and the patched one. Expected: the patched step runs no forward
    residual add (2 * RESIDUAL_LAYERS fewer than the other two) and fewer in the backward, in less
    device time."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                   num_hidden_layers=RESIDUAL_LAYERS, num_attention_heads=32, num_key_value_heads=4,
                                   max_position_embeddings=RESIDUAL_SEQ)
    base = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    patched = copy.deepcopy(base)
    report = brrr.patch(patched)
    fused = [name for name, _, what in report.swapped if what.startswith("the residual add fused")]
    assert len(fused) == RESIDUAL_LAYERS, str(report)
    assert sum("the add that ends it fused" in what for _, _, what in report.swapped) == RESIDUAL_LAYERS, str(report)
    tokens = torch.randint(0, 32000, (RESIDUAL_BATCH, RESIDUAL_SEQ), device="cuda")
    shape = [RESIDUAL_BATCH, RESIDUAL_SEQ, cfg.hidden_size]
    counts = {}
    for label in ("unpatched", "patched, layers' own forward", "patched"):
        model = base if label == "unpatched" else patched
        for name in fused:  # a fused layer's class is a subclass of its own: its base runs the adds as before
            layer = patched.get_submodule(name)
            if label == "patched, layers' own forward" and layer.__dict__.get("_bench_fused") is None:
                layer.__dict__["_bench_fused"] = type(layer)
                layer.__class__ = type(layer).__base__
            elif label == "patched" and layer.__dict__.get("_bench_fused") is not None:
                layer.__class__ = layer.__dict__.pop("_bench_fused")
        step = step_fn(model, tokens)
        step()
        ms = time_ms(step, warmup=2, reps=10, max_time_s=3.0)
        kernels = kernel_ms(step)
        calls, add_ms = residual_adds(step, shape)
        counts[label] = calls, add_ms
        recorder.add(family="model", op="llama residual adds", impl=label, shape=shape, layers=RESIDUAL_LAYERS,
                     ms=ms, kernel_ms=kernels, residual_adds=calls, residual_add_ms=add_ms)
        print(f"llama {RESIDUAL_LAYERS} layers {shape}: {label:30s} {ms:8.2f} ms/step  kernels {kernels:8.2f} ms  "
              f"residual adds {calls:3d} in {add_ms:6.3f} ms")
        model.zero_grad(set_to_none=True)
    before, after = counts["patched, layers' own forward"], counts["patched"]
    assert after[0] <= before[0] - 2 * RESIDUAL_LAYERS and after[1] < before[1], counts
