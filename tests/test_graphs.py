"""brrr.capture_step (a training step replayed as one CUDA graph), brrr's ops under
torch.compile(mode="reduce-overhead"), and brrr.diagnose(step, step=True).

CPU: capture_step's argument checks and its eager fallback (against float64 steps), diagnose's
step verdicts on the CPU. CUDA: capture and replay of the patched training step of every model
family in test_model_libraries (loss and gradients those of eager, over several replays and a new
input), the gradients each replay writes (fresh each call, float64's, zeros where unreached, no
zeroing or accumulating kernels beyond eager's), the fallback without cuDNN attention when a
capture fails, dropout drawing fresh masks on each replay (the masks of eager under the same seed),
the optimizer inside the graph, shape changes, a capture that fails leaving the process usable,
reduce-overhead compile of a patched model without graph breaks or re-recording, and diagnose's
verdict on an overhead-bound and a GPU-bound step.
"""

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import brrr
from brrr import registry
from brrr.diagnose import COMPUTE_BOUND, OVERHEAD_BOUND, diagnose
from brrr.diagnose.step import StepDiagnosis
from helpers import TOLERANCE, reset_registry

transformers = pytest.importorskip("transformers")
from test_model_libraries import MODELS, build  # noqa: E402 - needs transformers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlp(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3)).to(device, dtype)


def mse_step(model):
    return lambda x, y: F.mse_loss(model(x), y)


# --- capture_step: arguments (CPU) ---------------------------------------------------------


def test_import_brrr_does_not_import_torch_and_capture_step_loads_lazily():
    code = ("import sys, brrr; assert 'torch' not in sys.modules; from brrr.graphs import CapturedStep; "
            "assert brrr.capture_step.__module__ == 'brrr.graphs'; assert brrr.graphs.CapturedStep is CapturedStep")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(loss_fn=3), TypeError, "argument loss_fn: expected a callable"),
    (dict(parameters=3), TypeError, "argument parameters: expected a torch.nn.Module or an iterable"),
    (dict(parameters=torch.ones(2, requires_grad=True)), TypeError, "argument parameters"),
    (dict(parameters=[torch.ones(2, requires_grad=True), "w"]), TypeError, "argument parameters: item 1 is a str"),
    (dict(parameters=[torch.ones(2)]), ValueError, "argument parameters: item 0 does not require grad"),
    (dict(optimizer="sgd"), TypeError, "argument optimizer: expected a torch.optim.Optimizer"),
    (dict(warmup=0), ValueError, "argument warmup: expected an int >= 1, got 0"),
    (dict(warmup=True), TypeError, "argument warmup: expected an int"),
    (dict(warmup=1.5), TypeError, "argument warmup: expected an int"),
    (dict(max_graphs=-1), ValueError, "argument max_graphs: expected an int >= 0"),
    (dict(generators=torch.Generator()), TypeError, "argument generators: expected an iterable"),
    (dict(generators=[torch.Generator()]), ValueError, "argument generators: item 0 is a cpu generator"),
    (dict(generators=[None]), TypeError, "argument generators: item 0 is a NoneType"),
    (dict(unpadded=1), TypeError, "argument unpadded: expected True or False, got int"),
])
def test_capture_step_rejects_bad_arguments(kwargs, error, match):
    model = mlp()
    arguments = dict(loss_fn=mse_step(model), parameters=model)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        brrr.capture_step(arguments.pop("loss_fn"), arguments.pop("parameters"), **arguments)


@pytest.mark.cuda
def test_an_optimizer_stepped_inside_the_graph_must_be_capturable():
    model = mlp(device="cuda")
    with pytest.raises(ValueError, match=r"argument optimizer: this AdamW was made with capturable=False.*"
                                         r"capturable=True"):
        brrr.capture_step(mse_step(model), model, torch.optim.AdamW(model.parameters()))
    brrr.capture_step(mse_step(model), model, torch.optim.AdamW(model.parameters(), capturable=True))
    brrr.capture_step(mse_step(model), model, torch.optim.SGD(model.parameters(), lr=0.1))  # no such option


def test_a_cpu_step_takes_an_optimizer_made_without_capturable():
    """On the CPU the step runs eagerly, where torch's AdamW refuses capturable=True: one made
    without it (refused before, so that no AdamW could be used there) steps as plain AdamW."""
    model, batches = mlp(), [(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(3)]
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        optimizer.step()
    step = brrr.capture_step(mse_step(model), model, torch.optim.AdamW(model.parameters(), lr=0.01))
    with pytest.warns(UserWarning, match="running the step eagerly"):
        for batch in batches:
            step(*batch)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("args, loss_fn, error, match", [
    ((torch.ones(4, 6, requires_grad=True), torch.ones(4, 3)), None, ValueError,
     "argument 0: a captured step takes data, not tensors that require grad"),
    ((torch.ones(4, 6), [1.0, 2.0]), None, TypeError, "argument 1: a list; a captured step takes tensors and hashable"),
    ((torch.ones(4, 6), torch.ones(4, 3)), lambda m: lambda x, y: m(x) - y, TypeError,
     r"argument loss_fn: must return the loss \(a one-element tensor\).*got a tensor of shape \(4, 3\)"),
    ((torch.ones(4, 6), torch.ones(4, 3)), lambda m: lambda x, y: (F.mse_loss(m(x), y), "logits"), TypeError,
     "argument loss_fn: output 1 is a str"),
    ((torch.ones(4, 6), torch.ones(4, 3)), lambda m: lambda x, y: (x - x).sum(), ValueError,
     "argument loss_fn: the loss it returned does not require grad"),
])
def test_capture_step_rejects_bad_calls(args, loss_fn, error, match):
    model = mlp()
    step = brrr.capture_step((loss_fn or mse_step)(model), model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's eager-fallback warning
        with pytest.raises(error, match=match):
            step(*args)


# --- capture_step: the eager fallback on the CPU -------------------------------------------


def float64_sgd_steps(model, batches, lr, momentum):
    """Plain eager training steps of a float64 copy: the reference."""
    reference = copy.deepcopy(model).double()
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr, momentum=momentum)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.mse_loss(reference(x.double()), y.double())
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return reference, losses


def test_cpu_steps_run_eagerly_with_one_warning_and_match_float64_steps():
    model = mlp()
    for p in model.parameters():  # stale gradients from elsewhere: each step's gradients are its own
        p.grad = torch.full_like(p, 7.0)
    batches = [(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(5)] + [(torch.randn(1, 6), torch.randn(1, 3))]
    reference, expected_losses = float64_sgd_steps(copy.deepcopy(model), batches, lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = brrr.capture_step(mse_step(model), model, optimizer)
    with pytest.warns(UserWarning, match="CUDA graphs need the parameters and the tensor arguments on a CUDA device "
                                         r"\(found \['cpu'\]\): running the step eagerly"):
        losses = [step(*batches[0])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not on every step
        for i, batch in enumerate(batches[1:]):
            if i == 2:
                optimizer.zero_grad()  # gradients set to None between steps
            losses.append(step(*batch))
    assert step.graphs == 0 and "graphs=0" in repr(step)
    tol = TOLERANCE[torch.float32]
    for loss, expected in zip(losses, expected_losses):
        assert loss.dtype == torch.float32 and not loss.requires_grad
        torch.testing.assert_close(loss.double(), expected, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach(), rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)


def test_cpu_step_returns_every_output_of_the_loss_function():
    model = mlp()
    step = brrr.capture_step(lambda x: (model(x).square().mean(), model(x)), [p for p in model.parameters()])
    x = torch.randn(3, 6)
    with pytest.warns(UserWarning):
        loss, out = step(x)
    torch.testing.assert_close(out, model(x).detach())
    torch.testing.assert_close(loss, out.square().mean())
    w = model[0].weight.detach().double().requires_grad_()
    expected = F.linear(F.gelu(F.linear(x.double(), w, model[0].bias.double())), model[2].weight.double(),
                        model[2].bias.double()).square().mean()
    (expected_grad,) = torch.autograd.grad(expected, w)
    torch.testing.assert_close(model[0].weight.grad.double(), expected_grad, rtol=1e-5, atol=1e-6)


def test_a_compiled_brrr_op_is_traced_once_in_a_fresh_process():
    """brrr's dispatch cache (brrr/_frameworks.py) is set when its PyTorch integration loads, not
    by the first call: set by a first call under torch.compile, it failed dynamo's guard on the
    next call and the whole model compiled again (seen as a recompile of a patched Llama's
    step under reduce-overhead on an H200)."""
    code = ("import torch, brrr\n"
            "graphs = []\n"
            "f = torch.compile(lambda x, t: brrr.cross_entropy(x, t), fullgraph=True,\n"
            "                  backend=lambda gm, example: graphs.append(gm) or gm.forward)\n"
            "x, t = torch.randn(4, 10), torch.randint(0, 10, (4,))\n"
            "f(x, t); f(x, t); brrr.cross_entropy(x, t); f(x, t)\n"
            "assert len(graphs) == 1, len(graphs)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- diagnose(step, step=True) on the CPU ---------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(step="yes"), TypeError, "argument step: expected True or False"),
    (dict(step=True, flops=1e9), ValueError, "argument step: flops describe a single op's work"),
    (dict(step=True, bytes=1e6, scale=False), ValueError, "argument step: bytes, scale describe"),
])
def test_diagnose_step_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        diagnose(lambda: None, **kwargs)
    with pytest.raises(TypeError, match="argument fn: expected a callable"):
        diagnose(3, step=True)


def tiny_ops_step(leaf):
    def step():
        leaf.grad = None
        y = leaf
        for _ in range(48):
            y = y * 1.001 + 0.5
        y.sum().backward()
    return step


def matmul_step(x, w):
    def step():
        w.grad = None
        (x @ w).sum().backward()
    return step


def test_diagnose_step_on_the_cpu_tells_overhead_from_compute():
    overhead = diagnose(tiny_ops_step(torch.ones(4, requires_grad=True)), step=True)
    assert overhead.verdict == OVERHEAD_BOUND, overhead.report()
    assert overhead.device == "cpu" and overhead.gpu_busy_ms is None and overhead.captured_ms is None
    assert overhead.ops_per_step >= 96 and overhead.dispatch_share >= 0.5
    assert "torch.compile" in overhead.remedies[0]
    assert StepDiagnosis.from_json(overhead.to_json()) == overhead

    side = 512
    compute = diagnose(matmul_step(torch.randn(side, side), torch.randn(side, side, requires_grad=True)), step=True)
    assert compute.verdict == COMPUTE_BOUND, compute.report()
    assert compute.matmul_share >= 0.5 and compute.dispatch_share < 0.5
    report = compute.report()
    for text in ("(training step)", "time per step", "op calls per step", "COMPUTE-BOUND", "matrix multiplies take"):
        assert text in report
    assert compute.ms > overhead.ms
    with pytest.raises(ValueError, match="not a StepDiagnosis record"):
        StepDiagnosis.from_dict(dict(compute.to_dict(), extra=1))


@pytest.mark.parametrize("syncs", [0, 2])
@pytest.mark.parametrize("replay_ms", [1.5, None], ids=["captured", "capture fails"])
def test_diagnose_tries_the_capture_of_a_step_that_synchronised_eagerly(monkeypatch, syncs, replay_ms):
    """A sync seen in the eager step does not stop diagnose from capturing it (transformers checks
    position ids on the host in an eager training step without a cache, and skips the check under
    capture): the capture is tried, the remedy gives its time where it worked, and where it failed
    after syncs the note and the remedy name the syncs. The capture itself is stood in for here."""
    from brrr.diagnose import step as step_module

    tried = []

    def captured_ms(torch_, call, device, steps, notes):
        tried.append(steps)
        if replay_ms is None:
            notes.append("brrr: capturing the step in a CUDA graph failed (RuntimeError: operation not permitted)")
        return replay_ms

    monkeypatch.setattr(step_module, "_captured_ms", captured_ms)
    notes = []
    got = step_module._capture_trial(torch, None, torch.device("cuda"), 7, syncs, notes)
    assert tried == [7] and got == replay_ms
    first = step_module._remedies(OVERHEAD_BOUND, torch.device("cuda"), 4.5, got, syncs)[0]
    if replay_ms is not None:
        assert "captured: 1.5 ms against 4.5 ms eager (3.00x), measured here" in first
        assert bool(notes) == bool(syncs) and all(f"synchronises with the host {syncs} time(s)" in n and
                                                  "captured and replayed all the same" in n for n in notes)
    elif syncs:
        assert first.startswith("remove the step's 2 host sync(s)")
        assert len(notes) == 1 and "synchronises with the host 2 time(s)" in notes[0] and "not permitted" in notes[0]
    else:
        assert first.startswith("capture the whole step") and "measured here" not in first
        assert len(notes) == 1 and notes[0].startswith("brrr: capturing the step")


# --- the benchmark's chart -------------------------------------------------------------------


def test_plot_draws_step_time_against_tokens_and_leaves_those_rows_out_of_the_speedups(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import plot
    finally:
        sys.path.pop(0)
    rows = [dict(family="graphs", op="llama", dtype="bfloat16", shape=[batch, 512], tokens=batch * 512,
                 pass_="fwd+bwd", impl=impl, ms=max(fixed, batch * 0.4))
            for batch in (1, 2, 4, 8, 16, 32, 64)
            for impl, fixed in (("eager", 8.0), ("compile", 4.2), ("compile reduce-overhead", 2.2), ("brrr", 5.6),
                                ("brrr captured", 1.1))]
    rows.append(dict(family="graphs", op="llama", check="diagnose, brrr eager step", verdict="overhead-bound"))
    (tmp_path / "graphs.json").write_text(json.dumps({"env": {}, "rows": rows}))
    written, messages = plot.plot_results([str(tmp_path)], str(tmp_path / "plots"))
    assert [os.path.basename(path) for path in written] == ["step-sweep.png"], messages
    assert os.path.getsize(written[0]) > 1000
    assert any("skip speedup plots" in m for m in messages)


# --- CUDA: capture and replay of patched model families ------------------------------------

GRAPH_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def loss_fn_of(model, name):
    def loss_fn(tokens):
        extra = {"decoder_input_ids": tokens} if name == "t5" else {}
        return model(input_ids=tokens, labels=tokens, **extra).loss
    return loss_fn


def eager_loss_and_grads(model, loss_fn, *inputs):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(*inputs)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_step_matches(model, loss, expected, dtype, what):
    expected_loss, expected_grads = expected
    torch.testing.assert_close(loss, expected_loss, **GRAPH_TOL[dtype], msg=what)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected_grads.keys(), what
    for n, g in grads.items():
        torch.testing.assert_close(g, expected_grads[n], **GRAPH_TOL[dtype], msg=f"{what}: {n}")


def patched_cuda_model(name, dtype):
    model = build(name, dtype).cuda()
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm" and dtype == torch.float32:
        # torch's float32 grouped_mm copies the group offsets to the host (docs/graphs.md): the
        # batched form computes the same experts without a copy.
        model.config._experts_implementation = "batched_mm"
    brrr.patch(model)
    return model


@pytest.mark.cuda
@pytest.mark.parametrize("name,dtype", [(n, torch.float32) for n in MODELS] +
                         [("llama", torch.bfloat16), ("gpt2", torch.bfloat16), ("bert", torch.bfloat16)], ids=str)
def test_patched_training_step_captures_and_replays_like_eager(name, dtype):
    model = patched_cuda_model(name, dtype)
    loss_fn = loss_fn_of(model, name)
    a, b = (torch.randint(0, 101, (2, 16), device="cuda") for _ in range(2))
    expected_a, expected_b = eager_loss_and_grads(model, loss_fn, a), eager_loss_and_grads(model, loss_fn, b)
    step = brrr.capture_step(loss_fn, model, warmup=2)
    for call, (tokens, expected) in enumerate([(a, expected_a)] * 3 + [(b, expected_b), (a, expected_a),
                                                                        (b, expected_b)]):
        loss = step(tokens)
        assert step.graphs == (0 if call < 2 else 1)
        assert_step_matches(model, loss, expected, dtype, f"{name} call {call}")
    assert step(b) is step(a), "a replay returns the graph's own output buffer"


def test_unpadded_gives_sdpa_no_causal_mask_while_transformers_counts_itself_tracing(monkeypatch):
    """What capture_step(unpadded=True) sets up around a capture, seen from transformers' mask
    builder on the CPU, with transformers told a CUDA graph is being captured: no mask (SDPA's
    is_causal) for plain causal masks, where transformers alone builds one; its own masks for a
    padding mask, an offset (cached keys) and a sliding window; everything back afterwards."""
    from transformers import masking_utils
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                      intermediate_size=64, vocab_size=101)
    config._attn_implementation = "sdpa"
    embeds = torch.randn(2, 16, 32)
    positions = torch.arange(16).unsqueeze(0)
    padded = torch.ones(2, 16, dtype=torch.long)
    padded[0, -3:] = 0

    def masks():
        return (masking_utils.create_causal_mask(config, embeds, None, None, position_ids=positions),
                masking_utils.create_causal_mask(config, embeds, padded, None, position_ids=positions),
                masking_utils.sdpa_mask(batch_size=2, q_length=16, kv_length=16, q_offset=0, kv_offset=0,
                                        mask_function=masking_utils.causal_mask_function, attention_mask=None,
                                        local_size=4),
                masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](
                    batch_size=2, q_length=4, kv_length=16, q_offset=12, kv_offset=0,
                    mask_function=masking_utils.causal_mask_function, attention_mask=None))

    alone = masks()
    assert all(isinstance(mask, torch.Tensor) for mask in alone), "transformers builds every mask under capture"
    with brrr.graphs._unpadded_causal_masks(True):
        plain, padded_mask, windowed, offset = masks()
    assert plain is None
    for mine, theirs in zip((padded_mask, windowed, offset), alone[1:]):
        assert torch.equal(mine, theirs)
    with brrr.graphs._unpadded_causal_masks(False):
        assert all(torch.equal(a, b) for a, b in zip(masks(), alone))
    assert all(torch.equal(a, b) for a, b in zip(masks(), alone)), "restored after the block"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_an_unpadded_captured_step_matches_eager_and_builds_no_mask(monkeypatch, name):
    """capture_step(unpadded=True) replays eager's loss and gradients, and its graph's attention
    takes no mask (is_causal instead), where the default capture gives SDPA transformers' full
    causal mask."""
    model = patched_cuda_model(name, torch.float32)
    loss_fn = loss_fn_of(model, name)
    tokens = torch.randint(0, 101, (2, 16), device="cuda")
    expected = eager_loss_and_grads(model, loss_fn, tokens)
    sdpa, masks = F.scaled_dot_product_attention, []

    def recording_sdpa(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            masks.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    for unpadded in (False, True):
        masks.clear()
        step = brrr.capture_step(loss_fn, model, warmup=1, unpadded=unpadded)
        for call in range(3):
            assert_step_matches(model, step(tokens), expected, torch.float32, f"{name} unpadded={unpadded} {call}")
        assert step.graphs == 1 and masks, "SDPA was not called while capturing"
        if unpadded:
            assert all(mask is None and causal for mask, causal in masks), masks
        else:
            assert all(isinstance(mask, torch.Tensor) for mask, _ in masks)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_a_captured_step_takes_a_new_attention_mask(name):
    """transformers reads the mask on the host in eager mode but builds it blind while a graph is
    captured: a replay with another padding gives eager's loss and gradients for that padding."""
    model = patched_cuda_model(name, torch.float32)

    def loss_fn(tokens, mask):
        return model(input_ids=tokens, attention_mask=mask, labels=tokens).loss

    tokens = torch.randint(0, 101, (2, 16), device="cuda")
    full, padded = torch.ones_like(tokens), torch.ones_like(tokens)
    padded[0, -5:] = 0
    padded[1, -2:] = 0
    expected = {"full": eager_loss_and_grads(model, loss_fn, tokens, full),
                "padded": eager_loss_and_grads(model, loss_fn, tokens, padded)}
    step = brrr.capture_step(loss_fn, model, warmup=1)
    for which, mask in [("full", full), ("full", full), ("padded", padded), ("full", full.clone())]:
        assert_step_matches(model, step(tokens, mask), expected[which], torch.float32, f"{name}, {which} mask")
    assert step.graphs == 1


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_dropout_draws_fresh_masks_on_each_replay(name):
    """PyTorch's generator is registered with the graph: each replay draws new masks. BERT's
    dropout here is its nn.Dropout modules' (hidden_dropout_prob), whose draws do not depend on the
    attention path transformers takes while capturing: a replay draws what an eager step from the
    same seed draws. The Llama's is its attention's (attention_dropout)."""
    config_name, model_name, kwargs, _, _ = MODELS[name]
    config = getattr(transformers, config_name)(**kwargs)
    for attribute in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout"):
        if hasattr(config, attribute):
            setattr(config, attribute, 0.0 if attribute == "attention_probs_dropout_prob" else 0.2)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).train().cuda()
    brrr.patch(model)
    loss_fn = loss_fn_of(model, name)
    tokens = torch.randint(0, 101, (2, 16), device="cuda")
    step = brrr.capture_step(loss_fn, model, warmup=1)
    step(tokens)
    first = step(tokens).clone()
    assert step.graphs == 1
    second = step(tokens).clone()
    assert torch.isfinite(first) and first != second, "a replay drew the masks of the one before"
    if name == "bert":
        torch.cuda.manual_seed(11)
        expected = eager_loss_and_grads(model, loss_fn, tokens)
        torch.cuda.manual_seed(11)
        assert_step_matches(model, step(tokens), expected, torch.float32, "bert with dropout")


@pytest.mark.cuda
def test_optimizer_step_inside_the_graph_trains_like_eager():
    model = patched_cuda_model("llama", torch.float32)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = brrr.capture_step(loss_fn_of(model, "llama"), model, optimizer, warmup=2)
    reference_loss_fn = loss_fn_of(reference, "llama")
    for i in range(7):
        tokens = torch.randint(0, 101, (2, 16), device="cuda")
        if i == 4:
            optimizer.zero_grad()  # sets the gradients to None: the graph's own come back
        loss = step(tokens)
        reference_optimizer.zero_grad()
        expected = reference_loss_fn(tokens)
        expected.backward()
        reference_optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-4, atol=1e-5, msg=f"step {i}")
    assert step.graphs == 1
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=n)



class Partly(torch.nn.Module):
    """An MLP of odd sizes with a parameter no step reaches and one that only the warm-up reaches."""

    def __init__(self):
        super().__init__()
        self.mlp = mlp()
        self.never = torch.nn.Parameter(torch.randn(3))
        self.warmup_only = torch.nn.Parameter(torch.randn(3))
        self.warming_up = True

    def forward(self, x):
        y = self.mlp(x)
        return y + self.warmup_only if self.warming_up else y


def float64_grads(model, x, y):
    reference = copy.deepcopy(model).double()
    F.mse_loss(reference(x.double()), y.double()).backward()
    return {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}


@pytest.mark.cuda
def test_captured_gradients_are_each_steps_own_match_float64_and_unreached_ones_are_zeros():
    model = Partly().cuda()
    step = brrr.capture_step(mse_step(model), model, warmup=2)
    x0, y0 = torch.randn(2, 8, 6, device="cuda"), torch.randn(2, 8, 3, device="cuda")
    step(x0[:, ::2], y0[:, ::2])  # strided views: copied into the graph's own buffers
    step(x0[:, ::2], y0[:, ::2])
    model.warming_up = False
    grads = None
    for call in range(4):
        x, y = torch.randn(2, 8, 6, device="cuda")[:, 1::2], torch.randn(2, 8, 3, device="cuda")[:, 1::2]  # x0's shape
        if call == 2:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(5.0)  # a replay writes the gradients, it does not add to them
        if call == 3:
            model.zero_grad(set_to_none=True)  # the graph's gradients come back
        loss = step(x, y)
        assert step.graphs == 1
        torch.testing.assert_close(loss.double(), F.mse_loss(model(x).double(), y.double()), rtol=1e-5, atol=1e-6)
        expected = float64_grads(model, x, y)
        assert model.never.grad is None, "never reached: no gradient, as in eager"
        assert torch.equal(model.warmup_only.grad, torch.zeros(3, device="cuda")), f"call {call}"
        for n, p in model.mlp.named_parameters():
            torch.testing.assert_close(p.grad.double(), expected["mlp." + n], rtol=1e-5, atol=1e-6,
                                       msg=f"call {call}: {n}")
        now = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads is None or all(a is b for a, b in zip(grads, now)), "one graph, the same gradient tensors"
        grads = now


def kernel_counts(fn, fragments):
    """How many kernels of fn() (run 3 times) have each name fragment, from the profiler's raw
    device events (they include the kernels of a graph's replay)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    names = [e.name() for e in prof.profiler.kineto_results.events()
             if e.device_type() == torch.autograd.DeviceType.CUDA and not e.is_user_annotation()]
    assert names, "the profiler saw no kernels"
    return {f: sum(f in name for name in names) for f in fragments}


@pytest.mark.cuda
def test_a_replay_launches_no_gradient_zeroing_or_accumulating_kernels_beyond_eager():
    """The graph writes fresh gradients, as an eager step does after zero_grad(set_to_none=True):
    no foreach zero of the gradients, no add kernel per parameter accumulating into them."""
    model = patched_cuda_model("llama", torch.bfloat16)
    loss_fn = loss_fn_of(model, "llama")
    tokens = torch.randint(0, 101, (2, 16), device="cuda")
    step = brrr.capture_step(loss_fn, model, warmup=2)
    for _ in range(3):
        step(tokens)
    assert step.graphs == 1

    def eager():
        model.zero_grad(set_to_none=True)
        loss_fn(tokens).backward()
    fragments = ("CUDAFunctor_add", "multi_tensor_apply")
    assert kernel_counts(lambda: step(tokens), fragments) == kernel_counts(eager, fragments)


@pytest.mark.cuda
def test_a_capture_with_cudnn_attention_that_fails_falls_back_to_the_other_backends_once(monkeypatch):
    model = patched_cuda_model("llama", torch.float32)
    loss_fn = loss_fn_of(model, "llama")
    tokens = torch.randint(0, 101, (2, 16), device="cuda")
    expected = eager_loss_and_grads(model, loss_fn, tokens)
    real_capture, cudnn_at_capture, cudnn_at_loss = brrr.graphs.capture, [], []

    def capture(*args, **kwargs):
        cudnn_at_capture.append(torch.backends.cuda.cudnn_sdp_enabled())
        if cudnn_at_capture[-1]:  # as cuDNN's attention backward failed on torch 2.11 once
            raise RuntimeError("brrr: capturing the step in a CUDA graph failed (RuntimeError: "
                               "mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good())")
        return real_capture(*args, **kwargs)
    monkeypatch.setattr(brrr.graphs, "capture", capture)

    def logged_loss_fn(t):
        cudnn_at_loss.append(torch.backends.cuda.cudnn_sdp_enabled())
        return loss_fn(t)
    step = brrr.capture_step(logged_loss_fn, model, warmup=1)
    assert_step_matches(model, step(tokens), expected, torch.float32, "warm-up")
    with pytest.warns(UserWarning, match=r"mha_graph.*Retrying without SDPA's cuDNN attention backend"):
        loss = step(tokens)
    assert step.graphs == 0
    assert_step_matches(model, loss, expected, torch.float32, "the eager step after the failed capture")
    for call in range(3):
        assert_step_matches(model, step(tokens), expected, torch.float32, f"call {call} after the fallback")
    assert step.graphs == 1
    assert cudnn_at_capture == [True, False]
    assert cudnn_at_loss == [True, False, False], "warm-up with cuDNN, an eager step and the capture without"

@pytest.mark.cuda
def test_a_captured_step_replays_after_reduce_overhead_steps_cleared_cublas_workspaces(monkeypatch):
    """torch.compile(mode="reduce-overhead") frees cuBLAS's workspaces around each recording; a
    graph that captured GEMMs with a workspace from outside its pool would then write into memory
    the allocator hands to other tensors (the graphs benchmark failed so on the H200, "unspecified
    launch failure" at the first replay). capture_step clears the workspaces around its capture,
    so its GEMMs own theirs; after reduce-overhead steps on the same model, fresh tensors the size
    of a workspace keep their values through replays, and the replays match eager."""
    clears = []
    clear = torch._C._cuda_clearCublasWorkspaces
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: clears.append(1) or clear())
    model = patched_cuda_model("llama", torch.bfloat16)
    loss_fn = loss_fn_of(model, "llama")
    tokens = torch.randint(0, 101, (4, 32), device="cuda")
    expected = eager_loss_and_grads(model, loss_fn, tokens)
    step = brrr.capture_step(loss_fn, model, warmup=2)
    for _ in range(3):
        step(tokens)
    assert step.graphs == 1 and len(clears) == 2, clears  # before and after the one capture
    compiled = torch.compile(loss_fn, mode="reduce-overhead")
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        compiled(tokens).backward()
    sentinels = [torch.full((mib << 18,), 7.0, device="cuda") for mib in (1, 2, 4, 8, 16, 32, 64)]
    for _ in range(3):
        assert_step_matches(model, step(tokens), expected, torch.bfloat16, "replay after reduce-overhead")
    torch.cuda.synchronize()
    assert all(bool((t == 7.0).all()) for t in sentinels)


@pytest.mark.cuda
def test_a_graph_kept_alive_from_a_default_stream_step_fails_the_capture_with_the_cure():
    """A loss kept with its autograd graph from an eager step on the default stream keeps the
    parameters' gradient-accumulation nodes, made on that stream: the capture's backward would
    join the legacy stream. capture_step says what to drop; once it is dropped, a new capture_step
    captures and replays like eager."""
    model = patched_cuda_model("llama", torch.float32)
    loss_fn = loss_fn_of(model, "llama")
    tokens = torch.randint(0, 101, (2, 16), device="cuda")
    kept = loss_fn(tokens)
    kept.backward()
    step = brrr.capture_step(loss_fn, model, warmup=1)
    step(tokens)
    with pytest.raises(RuntimeError, match=r"legacy stream.*still alive.*Drop those references"):
        step(tokens)
    del kept
    expected = eager_loss_and_grads(model, loss_fn, tokens)
    step = brrr.capture_step(loss_fn, model, warmup=1)
    for _ in range(3):
        assert_step_matches(model, step(tokens), expected, torch.float32, "after the kept graph was dropped")
    assert step.graphs == 1


@pytest.mark.cuda
def test_new_shapes_capture_up_to_max_graphs_then_run_eagerly():
    model = patched_cuda_model("llama", torch.float32)
    loss_fn = loss_fn_of(model, "llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # outside the graph: reads the gradients
    shapes = [(2, 16), (4, 8), (1, 5)]
    tokens = [torch.randint(0, 101, shape, device="cuda") for shape in shapes]
    expected = [eager_loss_and_grads(model, loss_fn, t) for t in tokens]
    step = brrr.capture_step(loss_fn, model, warmup=1, max_graphs=2)
    for t in tokens[:2]:
        step(t)  # warm-up
    for round_ in range(2):  # the two graphs alternate, each setting p.grad to its own gradient tensors
        for i in (0, 1):
            optimizer.zero_grad()
            assert_step_matches(model, step(tokens[i]), expected[i], torch.float32, f"shape {shapes[i]}")
    assert step.graphs == 2
    with pytest.warns(UserWarning, match=r"a new input signature \(0: int64 \(1, 5\) cuda:0\) past max_graphs=2: "
                                         "running it eagerly"):
        loss = step(tokens[2])
    assert_step_matches(model, loss, expected[2], torch.float32, "eager past max_graphs")
    assert_step_matches(model, step(tokens[0]), expected[0], torch.float32, "graph after the eager step")


@pytest.mark.cuda
def test_a_replay_zeros_the_gradients_another_signatures_graph_reached_and_it_does_not():
    """Two heads, one a step: replaying head a's graph after head b's leaves head b's gradients
    zero, as the eager step does (they held b's graph's last gradient, which an optimizer stepped
    outside the graph would apply again)."""
    torch.manual_seed(0)
    trunk, heads = torch.nn.Linear(6, 5).cuda(), {"a": torch.nn.Linear(5, 3).cuda(), "b": torch.nn.Linear(5, 3).cuda()}
    params = [*trunk.parameters(), *heads["a"].parameters(), *heads["b"].parameters()]
    x, y = torch.randn(4, 6, device="cuda"), torch.randn(4, 3, device="cuda")

    def loss_fn(x, y, head):
        return F.mse_loss(heads[head](trunk(x)), y)

    step = brrr.capture_step(loss_fn, params, warmup=1)
    for head in ("a", "a", "b", "b", "a"):
        step(x, y, head)
    assert step.graphs == 2
    for p in heads["b"].parameters():
        assert p.grad is not None and not p.grad.any()
    expected = torch.autograd.grad(loss_fn(x, y, "a"), list(heads["a"].parameters()))
    for p, e in zip(heads["a"].parameters(), expected):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.cuda
def test_constants_equal_in_value_but_not_in_type_are_signatures_of_their_own():
    """True == 1 == 1.0, but a step may branch on the type: each gets its own graph (the graph
    captured for True was replayed for 1)."""
    model = mlp(device="cuda")
    x, y = torch.randn(4, 6, device="cuda"), torch.randn(4, 3, device="cuda")

    def loss_fn(x, y, flag):
        return F.mse_loss(model(x), y) * (2.0 if flag is True else 3.0)

    step = brrr.capture_step(loss_fn, model, warmup=1)
    for flag in (True, True, 1, 1, 1.0, 1.0):
        expected = loss_fn(x, y, flag).detach()
        torch.testing.assert_close(step(x, y, flag), expected)
    assert step.graphs == 3


@pytest.mark.cuda
def test_a_capture_that_fails_says_why_and_leaves_the_process_usable():
    model = patched_cuda_model("llama", torch.float32)

    def logs_its_loss(tokens):
        loss = model(input_ids=tokens, labels=tokens).loss
        print(f"loss {loss.item():.3f}")  # a host sync: cannot be captured
        return loss

    tokens = torch.randint(0, 101, (2, 16), device="cuda")
    step = brrr.capture_step(logs_its_loss, model, warmup=1)
    stream = torch.cuda.current_stream()
    step(tokens)
    # The first failure falls back to SDPA without cuDNN (an eager step); the second one is raised.
    with pytest.warns(UserWarning, match="capturing the step in a CUDA graph failed .*a host sync.*without SDPA's "
                                         "cuDNN"):
        step(tokens)
    with pytest.raises(RuntimeError, match="capturing the step in a CUDA graph failed .*a host sync"):
        step(tokens)
    assert torch.cuda.current_stream() == stream
    torch.rand(4, device="cuda")  # the generator is out of capture mode ("Offset increment outside graph capture")
    expected = eager_loss_and_grads(model, loss_fn_of(model, "llama"), tokens)
    torch.testing.assert_close(model(input_ids=tokens, labels=tokens).loss.detach(), expected[0])


@pytest.mark.cuda
def test_bias_dropout_add_refuses_a_drawn_seed_under_capture():
    x, r = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    brrr.bias_dropout_add(x, None, r, 0.5)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="argument seed: None while a CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            brrr.bias_dropout_add(x, None, r, 0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # an explicit seed is the caller's choice: one mask on every replay
        out = brrr.bias_dropout_add(x, None, r, 0.5, seed=5)
    graph.replay()
    torch.testing.assert_close(out, brrr.bias_dropout_add(x, None, r, 0.5, seed=5), rtol=0, atol=0)


# --- CUDA: torch.compile(mode="reduce-overhead") ---------------------------------------------


def recorded_cudagraphs():
    """CUDA graphs cudagraph trees has recorded on this device (its tree's nodes)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    nodes = [node for roots in manager.roots.values() for node in roots] if manager is not None else []
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return count


@pytest.mark.cuda
@pytest.mark.parametrize("brrr_kernels", [False, True], ids=["registry-defaults", "every-op-brrr"])
def test_reduce_overhead_compile_of_a_patched_model(brrr_kernels):
    """One graph without breaks, cudagraphs not skipped, recorded once and replayed on later steps
    with new tokens, with eager's loss and gradients."""
    from torch._dynamo.utils import counters

    model = patched_cuda_model("llama", torch.float32)
    loss_fn = loss_fn_of(model, "llama")
    batches = [torch.randint(0, 101, (2, 16), device="cuda") for _ in range(2)]
    expected = [eager_loss_and_grads(model, loss_fn, t) for t in batches]
    torch._dynamo.reset()
    try:
        if brrr_kernels:
            for op in registry.names():
                registry.under_compile(op, "kernel")
        explanation = torch._dynamo.explain(loss_fn)(batches[0])
        assert explanation.graph_break_count == 0, explanation.break_reasons
        ops = {str(n.target) for g in explanation.graphs for n in g.graph.nodes if str(n.target).startswith("brrr.")}
        # the loss: brrr's fused linear cross-entropy (patch swaps the causal LM's head and loss)
        assert "brrr.linear_cross_entropy.default" in ops and (len(ops) > 1) == brrr_kernels, ops
        # the decoder layers' residual add and second norm: one brrr::add_rms_norm where brrr's kernels are asked for
        assert ("brrr.add_rms_norm.default" in ops) == brrr_kernels, ops
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(loss_fn, mode="reduce-overhead", fullgraph=True)
        recorded = []
        for i in range(6):
            torch.compiler.cudagraph_mark_step_begin()
            model.zero_grad(set_to_none=True)
            loss = compiled(batches[i % 2])
            loss.backward()
            assert_step_matches(model, loss.detach(), expected[i % 2], torch.float32, f"step {i}")
            recorded.append(recorded_cudagraphs())
        assert counters["inductor"]["cudagraph_skips"] == 0
        assert recorded[2] >= 2 and recorded[2:] == [recorded[2]] * 4, recorded  # forward and backward, once
    finally:
        reset_registry()
        torch._dynamo.reset()


# --- CUDA: diagnose on whole steps ----------------------------------------------------------


@pytest.mark.cuda
def test_diagnose_finds_a_small_patched_step_overhead_bound_and_measures_the_graph():
    model = patched_cuda_model("llama", torch.float32)
    loss_fn = loss_fn_of(model, "llama")
    tokens = torch.randint(0, 101, (2, 16), device="cuda")

    def train_step():
        model.zero_grad(set_to_none=True)
        loss_fn(tokens).backward()

    report = diagnose(train_step, step=True)
    assert report.verdict == OVERHEAD_BOUND, report.report()
    assert report.gpu_busy_fraction < 0.5 and report.launches_per_step >= 50 and report.syncs_per_step == 0
    assert report.host_ms > report.gpu_busy_ms
    assert report.captured_ms is not None and report.captured_ms < report.ms / 2, report.report()
    assert "captured: " in report.remedies[0] and "measured here" in report.remedies[0]
    assert StepDiagnosis.from_json(report.to_json()) == report
    train_step()  # the process is fine after the trial capture


@pytest.mark.cuda
def test_diagnose_finds_a_large_matmul_step_gpu_bound():
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    layer = torch.nn.Linear(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def train_step():
        layer.zero_grad(set_to_none=True)
        layer(x).float().square().mean().backward()

    report = diagnose(train_step, step=True)
    assert report.gpu_busy_fraction > 0.8 and report.verdict == COMPUTE_BOUND, report.report()
    assert report.matmul_share > 0.5
    assert report.captured_ms is None and any("not captured" in note for note in report.notes)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["syncs outside a capture", "transformers without a cache"])
def test_diagnose_captures_a_step_whose_host_syncs_a_capture_skips(case):
    """A step that syncs eagerly but not while captured (transformers' packed-sequence check of
    the position ids, which a training step without a cache makes on the host) is captured and
    timed: the syncs are counted and the remedy gives the captured time."""
    model = patched_cuda_model("llama", torch.float32)
    tokens = torch.randint(0, 101, (2, 16), device="cuda")

    def train_step():
        model.zero_grad(set_to_none=True)
        if case == "transformers without a cache":
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        else:
            loss = model(input_ids=tokens, labels=tokens).loss
            if not torch.cuda.is_current_stream_capturing():
                assert torch.isfinite(loss).item()
        loss.backward()

    report = diagnose(train_step, step=True)
    assert report.verdict == OVERHEAD_BOUND and report.syncs_per_step >= 1, report.report()
    assert report.captured_ms is not None and report.captured_ms < report.ms / 2, report.report()
    assert "captured: " in report.remedies[0] and "measured here" in report.remedies[0]
    assert any("captured and replayed all the same" in note for note in report.notes)
    train_step()


@pytest.mark.cuda
def test_diagnose_names_the_host_syncs_of_a_step_whose_capture_fails():
    model = patched_cuda_model("llama", torch.float32)
    tokens = torch.randint(0, 101, (2, 16), device="cuda")
    logged = []

    def train_step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        logged.append(loss.item())

    report = diagnose(train_step, step=True)
    assert report.syncs_per_step >= 1 and report.captured_ms is None
    assert report.verdict != OVERHEAD_BOUND or report.remedies[0].startswith("remove the step's")
    assert report.verdict != OVERHEAD_BOUND or any(note.startswith("not captured in a CUDA graph: the step "
                                                                   "synchronises") for note in report.notes)
    train_step()  # the process is fine after the failed trial capture


@pytest.mark.cuda
def test_diagnose_judges_a_step_without_gpu_work_as_a_cpu_step():
    """No tensor arguments and a GPU in the machine: the GPU is assumed, but the step launches
    nothing there, so it is judged on the CPU (and not 'captured' into an empty graph)."""
    report = diagnose(tiny_ops_step(torch.ones(4, requires_grad=True)), step=True)
    assert report.device == "cpu" and report.captured_ms is None and report.gpu_busy_ms is None
    assert report.verdict == OVERHEAD_BOUND and any("no GPU work" in note for note in report.notes)
