"""The overhead regime and its cure: a small model's training step (forward + backward, bf16)
eager, patched with brrr, under torch.compile (default mode and mode="reduce-overhead"), and
captured whole in one CUDA graph by brrr.capture_step, patched and unpatched (and patched with
unpadded=True: SDPA's is_causal inside the graph, as eagerly, where transformers' default under
capture is the full causal mask); Liger-Kernel's
patched Llama too when liger_kernel is importable (last, at the Llama's sizes).

GPU: a Llama (transformers config: 2 layers, hidden 1024, MLP 2816, 16 heads, vocabulary 32000)
and a GPT-2 and a BERT (masked LM, labels the input ids) of the same width, at 2 x 512 tokens,
where the step waits on the host; then the Llama
from 512 to 32768 tokens per step (batch 1 to 64 of 512): step time against tokens, where each
regime begins (benchmarks/plot.py draws it: step-sweep.png; BRRR_BENCH_GRAPH_BATCHES=2,32 runs
those batches alone; BRRR_BENCH_GRAPH_REMAT=1 adds brrr.patch(remat=True) and remat=False). Every captured step's loss and
gradients are checked against the eager step's at every size before it is timed. Each compile
mode compiles the Llama once for the sweep with the batch dimension dynamic (batch 1 compiles again:
dynamo specialises size 1; rows say dynamic_batch) and the GPT-2 and the BERT once with static shapes; first
steps are timed apart (first_step_s: compiling, or recording graphs). brrr.diagnose(step, step=True) of the
patched eager step at 2 x 512 says which regime it finds and what the graph gains there.
CPU, or BRRR_BENCH_QUICK=1: a tiny smoke run, without torch.compile (and on the CPU without the
captured variants, which need CUDA).
"""

import copy
import os
import time

import pytest
import torch

import brrr
from harness import module_names_restored, on_gpu, time_ms

transformers = pytest.importorskip("transformers")

QUICK = not on_gpu() or os.environ.get("BRRR_BENCH_QUICK") == "1"
DEVICE = "cuda" if on_gpu() else "cpu"
DTYPE = torch.bfloat16 if on_gpu() else torch.float32
SEQ, VOCAB, WIDTH, HEADS = (512, 32000, 1024, 16) if not QUICK else (32, 256, 64, 4)
BASE_BATCH = 2
SWEEP_BATCHES = (2, 4, 8, 16, 32, 64, 1) if not QUICK else (2, 1)   # batch 1 last: it compiles again
# BRRR_BENCH_GRAPH_BATCHES=2,32: the Llama's batches of 512 tokens, a subset of the sweep's.
if os.environ.get("BRRR_BENCH_GRAPH_BATCHES"):
    SWEEP_BATCHES = tuple(int(b) for b in os.environ["BRRR_BENCH_GRAPH_BATCHES"].split(","))
# BRRR_BENCH_GRAPH_REMAT=1: also brrr.patch(remat=True), eager and captured ("brrr remat ..."), and
# brrr.patch(remat=False) eager ("brrr no remat"): what remat costs a step where the host, not the
# GPU, sets the time, and what its default ("auto", the "brrr" rows) costs.
REMAT = os.environ.get("BRRR_BENCH_GRAPH_REMAT") == "1"
MAX_TIME_S = 0.5 if not QUICK else 0.05
CAPTURE = on_gpu()
COMPILE = on_gpu() and not QUICK
# The captured step against eager, same dtype: the same kernels, so only reduction order differs.
LOSS_TOL, GRAD_TOL = 1e-2, 5e-2


def llama(seq=SEQ, vocab=VOCAB, width=WIDTH, heads=HEADS):
    """The benchmark's Llama; benchmarks/probes/graph_probe.py builds it at its own sizes."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 11 // 4,
                                   num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                                   max_position_embeddings=seq)
    return transformers.LlamaForCausalLM(cfg)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=HEADS, n_positions=SEQ,
                                  attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


def bert():
    """BERT's masked LM at the same size (MLP 4 x hidden, as GPT-2's), trained on labels = the input ids."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS,
                                  intermediate_size=4 * WIDTH, max_position_embeddings=SEQ,
                                  attn_implementation="sdpa")
    return transformers.BertForMaskedLM(cfg)


MODELS = {"llama": llama, "gpt2": gpt2, "bert": bert}
CASES = [("llama", SWEEP_BATCHES), ("gpt2", (BASE_BATCH,)), ("bert", (BASE_BATCH,))]


def build(name, remat="auto"):
    """The unpatched model and a patched copy."""
    base = unpatched(name)
    patched = copy.deepcopy(base)
    print(f"\n{name}: {brrr.patch(patched, remat=remat)}")
    return base, patched


def unpatched(name):
    torch.manual_seed(0)
    return without_dropout(MODELS[name]().to(DEVICE, DTYPE).train())


def without_dropout(model):
    """The model with its dropout off: the captured step is checked against eager."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def loss_fn_of(model):
    return lambda tokens: model(input_ids=tokens, labels=tokens, use_cache=False).loss


def eager_step(model, tokens):
    loss_fn = loss_fn_of(model)

    def step():
        model.zero_grad(set_to_none=True)
        loss = loss_fn(tokens)
        loss.backward()
        return loss
    return step


def compiled_step(model, compiled_loss, tokens, mode):
    def step():
        model.zero_grad(set_to_none=True)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        loss = compiled_loss(tokens)
        loss.backward()
        return loss
    return step


def captured_step(model, tokens, reference, unpadded=False):
    """brrr.capture_step of the model's step, checked against the eager step's (loss, grads)."""
    step = brrr.capture_step(loss_fn_of(model), model, unpadded=unpadded)
    for _ in range(4):  # three eager warm-up steps, then the capture and its first replay
        loss = step(tokens)
    expected_loss, expected_grads = reference
    largest = max(g.float().norm() for g in expected_grads.values())
    grad_err = max(((p.grad.float() - expected_grads[n].float()).norm()
                    / torch.maximum(expected_grads[n].float().norm(), 1e-3 * largest)).item()
                   for n, p in model.named_parameters())
    loss_err = abs(loss.item() - expected_loss) / abs(expected_loss)
    assert step.graphs == 1 and loss_err < LOSS_TOL and grad_err < GRAD_TOL, (loss_err, grad_err)
    return (lambda: step(tokens)), dict(loss_rel_err=loss_err, max_grad_rel_err=grad_err)


def reference_of(model, tokens):
    loss = eager_step(model, tokens)()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,batches", CASES, ids=[name for name, _ in CASES])
def test_training_step_regimes(recorder, name, batches):
    base, patched = build(name)
    # The captured steps run on models of their own (the same weights): the compiled steps' outputs
    # keep autograd graphs of base made on the default stream, which a capture of the same
    # parameters cannot join (docs/graphs.md).
    captured = build(name) if CAPTURE else None
    # remat's eager model, and its own for capture (as above)
    remat = (build(name, remat=True), build(name, remat=True) if CAPTURE else None,
             build(name, remat=False)) if REMAT else None
    compiled = {mode: torch.compile(loss_fn_of(base), mode=mode) for mode in ("default", "reduce-overhead")} \
        if COMPILE else {}
    dynamic_batch = len(batches) > 1  # one compile for the sweep; a single size compiles static
    for batch in batches:
        tokens = torch.randint(0, VOCAB, (batch, SEQ), device=DEVICE)
        if dynamic_batch and batch > 1:
            torch._dynamo.mark_dynamic(tokens, 0)
        variants = {"eager": eager_step(base, tokens), "brrr": eager_step(patched, tokens)}
        if REMAT:
            variants["brrr remat"] = eager_step(remat[0][1], tokens)
            variants["brrr no remat"] = eager_step(remat[2][1], tokens)
        checks = {}
        for mode, compiled_loss in compiled.items():
            impl = "compile" if mode == "default" else "compile reduce-overhead"
            variants[impl] = compiled_step(base, compiled_loss, tokens, mode)
            checks[impl] = dict(dynamic_batch=dynamic_batch and batch > 1)
        if CAPTURE:
            cases = [("captured", captured[0], False), ("brrr captured", captured[1], False),
                     ("brrr captured unpadded", captured[1], True)]
            if REMAT:
                cases.append(("brrr remat captured", remat[1][1], False))
            for impl, model, unpadded in cases:
                variants[impl], checks[impl] = captured_step(model, tokens, reference_of(model, tokens), unpadded)
        for impl, step in variants.items():
            record(recorder, name, batch, impl, step, **checks.get(impl, {}))
        del variants
        if on_gpu():
            torch.cuda.empty_cache()
    if on_gpu():
        diagnosed(recorder, name, patched)


def record(recorder, name, batch, impl, step, **extra):
    """Time step (its first call, which compiles or records a graph, timed apart) and record it."""
    started = time.perf_counter()
    step()
    if on_gpu():
        torch.cuda.synchronize()
    first_step_s = time.perf_counter() - started
    ms = time_ms(step, warmup=3, reps=15, max_time_s=MAX_TIME_S)
    recorder.add(family="graphs", op=name, dtype=str(DTYPE).removeprefix("torch."), shape=[batch, SEQ],
                 tokens=batch * SEQ, pass_="fwd+bwd", impl=impl, ms=ms, tokens_per_s=batch * SEQ / (ms * 1e-3),
                 first_step_s=first_step_s, **extra)
    print(f"{name} {batch}x{SEQ} {impl:24s} {ms:9.3f} ms/step  (first step {first_step_s:.2f} s)")


def diagnosed(recorder, name, patched):
    """brrr.diagnose of the patched eager step at the base size: its regime and measured cure."""
    tokens = torch.randint(0, VOCAB, (BASE_BATCH, SEQ), device=DEVICE)
    report = brrr.diagnose(eager_step(patched, tokens), step=True)
    print(report)
    recorder.add(family="graphs", op=name, check="diagnose, brrr eager step", shape=[BASE_BATCH, SEQ],
                 verdict=report.verdict, step_ms=report.ms, host_ms=report.host_ms, gpu_busy_ms=report.gpu_busy_ms,
                 launches_per_step=report.launches_per_step, syncs_per_step=report.syncs_per_step,
                 captured_ms=report.captured_ms, notes=report.notes)


def test_liger_kernel_llama(recorder):
    """Liger-Kernel's patched Llama, eager, at the Llama's sizes. Liger replaces the rotary
    function of transformers' Llama module for every Llama in the process, so it runs last and
    the module's names are restored after."""
    liger = pytest.importorskip("liger_kernel.transformers")
    from transformers.models.llama import modeling_llama

    with module_names_restored(modeling_llama):
        model = unpatched("llama")
        liger.apply_liger_kernel_to_llama(model=model)
        for batch in SWEEP_BATCHES:
            tokens = torch.randint(0, VOCAB, (batch, SEQ), device=DEVICE)
            record(recorder, "llama", batch, "liger", eager_step(model, tokens))
