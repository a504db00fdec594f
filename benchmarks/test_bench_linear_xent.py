"""brrr.linear_cross_entropy, alone and in training steps, against eager, torch.compile and
Liger-Kernel (when liger_kernel is importable), in one run: time and peak memory.

- The op: hidden states 16384 x 4096 bf16 and a vocabulary of 128256 (Llama 3), forward and
  backward (the gradients of the input and the weight), the mean loss as Hugging Face's causal-LM
  loss computes it: F.cross_entropy(F.linear(x, w).float(), t) for eager and torch.compile,
  LigerFusedLinearCrossEntropyLoss, brrr.linear_cross_entropy(..., dtype=torch.float32) with
  each accumulation of the weight's gradient (float32, the default, and "weight", in bf16) in its
  default chunks (from the accumulator's arithmetic: 2048 and 1024 rows here) and in chunks of
  128 MiB of logits (512 rows, Liger-Kernel's chunk and the default before), and "weight" in
  chunks of 512 MiB (2048 rows); and two of them with the input-gradient GEMMs on a second
  stream (brrr.xent.INPUT_GRAD_STREAM), two skipping the ignored rows (brrr.xent.SKIP_IGNORED_ROWS:
  10% of the rows here).
- A training step (forward and backward, bf16 weights) of a Llama-style model from transformers'
  config (2 layers, hidden 2048, random weights) at vocabularies 32000, 128256 and 256000 and
  4 x 2048 and 2 x 8192 tokens: unpatched eager, brrr.patch eager (and with remat=True: the
  norms' and GLUs' outputs recomputed in the backward, docs/remat.md; remat with the loss's
  accumulation="weight" in its default chunks; and remat with the leanest loss:
  accumulation="weight" in 128 MiB chunks), Liger-Kernel's Llama patch
  with its cross-entropy and with its fused linear cross-entropy; brrr.patch eager with the
  loss's chunks of 128 MiB (the default before); unpatched torch.compile (compiling takes most
  of the benchmark's time; brrr.patch under torch.compile is tests/test_linear_xent.py's and
  benchmarks/test_bench_models.py's).
Each row has the median time (CUDA events: wall time, host gaps included), the device time of one
warm call (device_ms: the sum of its kernels' times under torch.profiler, harness.kernel_ms) and
the step's peak memory above the model's weights (torch.cuda.max_memory_allocated, gradients freed
before the step: the peak counts the gradients and what they keep allocated). The
op's rows also have each implementation's gradients' relative error against float64
(input_grad_error, weight_grad_error); the steps' loss and gradients are checked against eager
first. CPU, or BRRR_BENCH_QUICK=1: a quick smoke version at small sizes, without torch.compile.

    python -m pytest benchmarks/test_bench_linear_xent.py -q -s

Subsets: `-k test_linear_cross_entropy` (the op alone, about 60 s on an H200), `-k "test_training_step
and 128256"` (one vocabulary), and BRRR_BENCH_IMPLS, a comma-separated list of the names of the
implementations to run (a name's prefix runs all that start with it: "brrr,liger,compile").
"""

import contextlib
import copy
import functools
import os

import pytest
import torch
import torch.nn.functional as F

import brrr
from harness import compiled, device, kernel_ms, on_gpu, time_ms

QUICK = not on_gpu() or os.environ.get("BRRR_BENCH_QUICK") == "1"
DTYPE = torch.bfloat16 if on_gpu() else torch.float32
OP_CASES = [(16384, 4096, 128256)] if not QUICK else [(256, 64, 1000)]
STEP_CASES = ([(v, b, s) for v in (32000, 128256, 256000) for b, s in ((4, 2048), (2, 8192))] if not QUICK
              else [(1000, 2, 64)])
MAX_TIME_S = 2.0 if not QUICK else 0.2
IMPLS = [name for name in os.environ.get("BRRR_BENCH_IMPLS", "").split(",") if name]


def wanted(impl):
    """Whether BRRR_BENCH_IMPLS (unset: all) names the implementation, or a prefix of its name."""
    return not IMPLS or any(impl.startswith(name) for name in IMPLS)

try:
    import liger_kernel.transformers as liger
except ImportError:
    liger = None
try:
    import transformers
except ImportError:
    transformers = None


def peak_bytes(fn, model=None):
    """Bytes allocated at the peak of fn() above those allocated before it (None off the GPU); with
    a model, its gradients freed first, so that the peak counts the step's gradients (and all that
    they keep allocated: a gradient that is a view of a larger buffer counts the buffer)."""
    if not on_gpu():
        fn()
        return None
    if model is not None:
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def eager_loss(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def brrr_loss(x, w, t, switches=None, **options):
    """brrr's loss; switches: brrr.xent's module switches set for the call ({"INPUT_GRAD_STREAM":
    True}; its forward computes the gradients)."""
    switches = switches or {}
    saved = {name: getattr(brrr.xent, name) for name in switches}
    try:
        for name, value in switches.items():
            setattr(brrr.xent, name, value)
        return brrr.linear_cross_entropy(x, w, t, dtype=torch.float32, **options)
    finally:
        for name, value in saved.items():
            setattr(brrr.xent, name, value)


BRRR_OPTIONS = {"brrr": {}, "brrr 128 MiB chunks": {"logits_budget": 2**27},
                "brrr weight accumulation": {"accumulation": "weight"},
                "brrr weight accumulation, 128 MiB chunks": {"accumulation": "weight", "logits_budget": 2**27},
                "brrr weight accumulation, 512 MiB chunks": {"accumulation": "weight", "logits_budget": 2**29},
                "brrr, two streams": {"switches": {"INPUT_GRAD_STREAM": True}},
                "brrr weight accumulation, 128 MiB chunks, two streams": {
                    "accumulation": "weight", "logits_budget": 2**27, "switches": {"INPUT_GRAD_STREAM": True}},
                "brrr, skipping ignored rows": {"switches": {"SKIP_IGNORED_ROWS": True}},
                "brrr weight accumulation, 128 MiB chunks, skipping ignored rows": {
                    "accumulation": "weight", "logits_budget": 2**27, "switches": {"SKIP_IGNORED_ROWS": True}}}


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def exact_grads(x, w, t, rows_per_chunk=2048):
    """The gradients of the mean loss with respect to x and w in float64, a chunk of rows at a
    time (2 GiB of float64 logits at 128256 words)."""
    x64, w64 = x.detach().double(), w.detach().double()
    kept = t != -100
    scale = 1.0 / kept.sum().double()
    grad_x, grad_w = torch.empty_like(x64), torch.zeros_like(w64)
    for start in range(0, x.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        xs, ts, ks = x64[rows], t[rows], kept[rows]
        p = torch.softmax(xs @ w64.T, dim=-1)
        p[torch.arange(len(ts), device=p.device)[ks], ts[ks]] -= 1.0
        p *= (ks.double() * scale).unsqueeze(1)
        grad_x[rows] = p @ w64
        grad_w += p.T @ xs
    return grad_x, grad_w


@pytest.mark.parametrize("rows,hidden,vocab", OP_CASES, ids=lambda v: str(v))
def test_linear_cross_entropy(recorder, rows, hidden, vocab):
    """Each implementation's gradients against float64 (relative error, Frobenius norm), then its
    time and peak memory."""
    g = torch.Generator(device=device()).manual_seed(0)
    x = (torch.randn(rows, hidden, device=device(), generator=g)).to(DTYPE).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device(), generator=g) / hidden**0.5).to(DTYPE).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device=device(), generator=g)
    t[torch.rand(rows, device=device(), generator=g) < 0.1] = -100
    impls = {name: functools.partial(brrr_loss, **options) for name, options in BRRR_OPTIONS.items()}
    impls["eager"] = eager_loss
    if not QUICK:
        impls["compile"] = compiled(eager_loss)
    if liger is not None and on_gpu():
        liger_module = liger.LigerFusedLinearCrossEntropyLoss()
        impls["liger"] = lambda x, w, t: liger_module(w, x, t)
    impls = {impl: fn for impl, fn in impls.items() if wanted(impl)}

    expected = eager_loss(x, w, t).item()
    exact = exact_grads(x, w, t)
    errors = {}
    for impl, fn in impls.items():
        loss = fn(x, w, t)
        grads = torch.autograd.grad(loss, (x, w))
        errors[impl] = [relative_error(a, e) for a, e in zip(grads, exact)]
        print(f"{impl}: gradients off float64's by {errors[impl][0]:.2e} (input), {errors[impl][1]:.2e} (weight) "
              f"(relative, Frobenius norm)")
        assert abs(loss.item() - expected) <= 1e-2 * abs(expected), impl
        assert max(errors[impl]) < 2e-2, impl
        del loss, grads
    del exact

    for impl, fn in impls.items():
        def step():
            torch.autograd.grad(fn(x, w, t), (x, w))

        peak = peak_bytes(step)
        ms = time_ms(step, warmup=3, reps=20, max_time_s=MAX_TIME_S)
        device_ms = kernel_ms(step)
        recorder.add(family="linear_xent", op="linear_cross_entropy", dtype=str(DTYPE).replace("torch.", ""),
                     shape=[rows, hidden, vocab], pass_="fwd+bwd", impl=impl, ms=ms, device_ms=device_ms,
                     peak_bytes=peak, input_grad_error=errors[impl][0], weight_grad_error=errors[impl][1])
        print(f"linear_cross_entropy {rows}x{hidden}x{vocab} {impl:42s} {ms:9.3f} ms (device {device_ms:9.3f} ms)  "
              f"peak {'-' if peak is None else f'{peak / 2**30:.2f} GiB'}")


def llama(vocab, seq):
    hidden, inner, heads, kv_heads = (2048, 5632, 32, 8) if not QUICK else (64, 128, 4, 2)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device(), DTYPE).train()


@contextlib.contextmanager
def liger_patched(model, fused):
    """Liger-Kernel's Llama patch on `model` (its fused linear cross-entropy, or its cross-entropy),
    undone after: it also rebinds names in transformers' Llama module and torch.nn.functional."""
    from transformers.models.llama import modeling_llama

    saved_module = dict(vars(modeling_llama))
    saved_forward = modeling_llama.LlamaForCausalLM.forward
    saved_cross_entropy = F.cross_entropy
    try:
        liger.apply_liger_kernel_to_llama(cross_entropy=not fused, fused_linear_cross_entropy=fused, model=model)
        yield model
    finally:
        vars(modeling_llama).update(saved_module)
        modeling_llama.LlamaForCausalLM.forward = saved_forward
        F.cross_entropy = saved_cross_entropy


def step_fn(model, tokens):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=tokens, labels=tokens, use_cache=False)
        out.loss.backward()
        return out.loss
    return step


def measure(recorder, case, impl, model, tokens, compile_it=False):
    if not wanted(impl):
        return
    torch._dynamo.reset()
    step = step_fn(compiled(model) if compile_it else model, tokens)
    step()  # warm-up (and compilation)
    peak = peak_bytes(step, model)
    ms = time_ms(step, warmup=2, reps=10, max_time_s=MAX_TIME_S)
    device_ms = kernel_ms(step)
    vocab, batch, seq = case
    recorder.add(family="linear_xent", op="llama training step", dtype=str(DTYPE).replace("torch.", ""),
                 shape=[batch, seq, vocab], pass_="step", impl=impl, ms=ms, device_ms=device_ms, peak_bytes=peak)
    print(f"llama step vocab {vocab} {batch}x{seq} {impl:32s} {ms:9.3f} ms (device {device_ms:9.3f} ms)  peak "
          f"{'-' if peak is None else f'{peak / 2**30:.2f} GiB'}")


@pytest.mark.skipif(transformers is None, reason="needs transformers")
@pytest.mark.parametrize("vocab,batch,seq", STEP_CASES, ids=lambda v: str(v))
def test_training_step(recorder, vocab, batch, seq):
    base = llama(vocab, seq)
    tokens = torch.randint(0, vocab, (batch, seq), device=device())
    patched = copy.deepcopy(base)
    brrr.patch(patched, remat=False)

    # The patched step's loss and gradients against the unpatched one's.
    losses, grads = [], []
    for model in (base, patched):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad for p in model.parameters()])
    assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[0])
    assert max(relative_error(b, a) for a, b in zip(*grads)) < 5e-2
    del grads

    case = (vocab, batch, seq)
    measure(recorder, case, "unpatched eager", base, tokens)
    measure(recorder, case, "brrr.patch eager", patched, tokens)
    del patched
    # brrr.patch's settings: remat (its gradients are the patched model's bitwise: tests/test_remat.py)
    # and the fused loss's options, the weight's gradient summed in its own dtype (as Liger-Kernel's)
    # in the default chunks (auto_chunk_rows) or in 128 MiB of logits a chunk.
    settings = {"brrr.patch eager, 128 MiB chunks": ({"logits_budget": 2**27}, False),
                "brrr.patch eager remat": (True, True),
                "brrr.patch eager remat, weight accumulation": ({"accumulation": "weight"}, True),
                "brrr.patch eager remat, lean loss": ({"accumulation": "weight", "logits_budget": 2**27}, True)}
    for impl, (loss_options, remat) in settings.items():
        if wanted(impl):
            model = copy.deepcopy(base)
            brrr.patch(model, fused_linear_cross_entropy=loss_options, remat=remat)
            measure(recorder, case, impl, model, tokens)
            del model
    if not QUICK:
        measure(recorder, case, "unpatched compile", base, tokens, compile_it=True)
    if liger is not None and on_gpu():
        for fused, impl in ((False, "liger cross_entropy"), (True, "liger fused linear CE")):
            with liger_patched(copy.deepcopy(base), fused) as model:
                measure(recorder, case, impl, model, tokens)
