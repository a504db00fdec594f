"""brrr.remat: a norm's or a GLU's output recomputed in the backward instead of saved by the linear
layers it feeds. brrr.norm_linear and brrr.glu_linear against the plain composition (the same
outputs and gradients, bitwise on the CPU) and float64; the bytes autograd saves, measured with
torch.autograd.graph.saved_tensors_hooks: exactly the recomputed output's fewer; the output
recomputed once per backward, not once per linear layer. brrr.patch(remat=True) on transformers'
Llama: the loss and every gradient of the model patched without it (bitwise) and of the unpatched
model, at least 25% fewer saved bytes per decoder layer, and torch.compile without graph breaks.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import brrr
from helpers import random


def saved_bytes(fn):
    """(fn's result, the bytes of the distinct storages autograd saves while fn runs)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())


def grads_of(outputs, inputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outputs]
    return torch.autograd.grad(outputs, inputs, cotangents)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_norm_linear(dtype):
    """q, k, v of one RMSNorm: the plain composition's outputs and gradients (bitwise), float64's
    within the dtype's tolerance; the norm's output (rows x hidden) not saved."""
    x, norm_w = random((2, 9, 16), dtype, "cpu"), random((16,), dtype, "cpu")
    weights = [random((n, 16), dtype, "cpu") for n in (16, 4, 4)]
    bias = random((4,), dtype, "cpu")

    def plain(x, norm_w, wq, wk, wv, bias):
        h = brrr.rms_norm(x, (16,), norm_w, 1e-6)
        return [F.linear(h, wq), F.linear(h, wk, bias), F.linear(h, wv)]

    def fused(x, norm_w, wq, wk, wv, bias):
        norm = functools.partial(brrr.rms_norm, normalized_shape=(16,), weight=norm_w, eps=1e-6)
        return brrr.norm_linear(norm, x, [wq, wk, wv], [None, bias, None])

    args = leaves(x, norm_w, *weights, bias)
    expected, expected_bytes = saved_bytes(lambda: plain(*args))
    expected_grads = grads_of(expected, args)
    args = leaves(x, norm_w, *weights, bias)
    outputs, got_bytes = saved_bytes(lambda: fused(*args))
    grads = grads_of(outputs, args)
    for a, e in zip(list(outputs) + list(grads), list(expected) + list(expected_grads)):
        assert torch.equal(a, e)
    assert got_bytes == expected_bytes - x.numel() * x.element_size(), (got_bytes, expected_bytes)
    args64 = leaves(*(t.double() for t in (x, norm_w, *weights, bias)))
    reference = plain(*args64)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # relative to each result's largest element
    for a, e in zip(list(outputs) + list(grads), list(reference) + list(grads_of(reference, args64))):
        torch.testing.assert_close(a.double(), e, rtol=tol, atol=tol * e.abs().max().item())


def test_norm_linear_under_autocast_is_the_plain_compositions():
    """Under autocast (float32 parameters, bfloat16 matmuls) the recompute and the backward's
    matmuls run as the forward's did: the plain composition's outputs and gradients, bitwise (the
    backward multiplied a bfloat16 gradient by the float32 weight, and failed)."""
    x, norm_w = random((2, 9, 16), torch.float32, "cpu"), random((16,), torch.float32, "cpu")
    weight, bias = random((8, 16), torch.float32, "cpu"), random((8,), torch.float32, "cpu")

    def run(rematerialised, x, norm_w, weight, bias):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            norm = functools.partial(brrr.rms_norm, normalized_shape=(16,), weight=norm_w, eps=1e-6)
            if rematerialised:
                return brrr.norm_linear(norm, x, [weight], [bias])
            return [F.linear(norm(x), weight, bias)]

    results = []
    for rematerialised in (False, True):
        args = leaves(x, norm_w, weight, bias)
        outputs = run(rematerialised, *args)
        results.append((outputs, grads_of(outputs, args)))
    (expected, expected_grads), (outputs, grads) = results
    assert outputs[0].dtype == torch.bfloat16 and [g.dtype for g in grads] == [torch.float32] * 4
    for a, e in zip(list(outputs) + list(grads), list(expected) + list(expected_grads)):
        assert torch.equal(a, e)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("split", [False, True], ids=["gate, up", "halves"])
def test_glu_linear(activation, split):
    """down(act(gate) * up): the plain composition's outputs and gradients (bitwise); the GLU's
    output not saved."""
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}[activation]
    gate_up, w, b = random((3, 5, 24), torch.float32, "cpu"), random((7, 12), torch.float32, "cpu"), random(
        (7,), torch.float32, "cpu")
    op = {"silu": brrr.swiglu, "gelu": brrr.geglu, "gelu_tanh": functools.partial(brrr.geglu, approximate="tanh")}[
        activation]

    def plain(gate_up, w, b):
        gate, up = gate_up.chunk(2, -1)
        return [F.linear(op(gate_up) if split else op(gate, up), w, b)]

    def fused(gate_up, w, b):
        gate, up = gate_up.chunk(2, -1)
        return [brrr.glu_linear(gate_up, None, w, b, activation=activation) if split else
                brrr.glu_linear(gate, up, w, b, activation=activation)]

    args = leaves(gate_up, w, b)
    expected, expected_bytes = saved_bytes(lambda: plain(*args))
    expected_grads = grads_of(expected, args)
    args = leaves(gate_up, w, b)
    outputs, got_bytes = saved_bytes(lambda: fused(*args))
    for a, e in zip(list(outputs) + list(grads_of(outputs, args)), list(expected) + list(expected_grads)):
        assert torch.equal(a, e)
    assert got_bytes == expected_bytes - 3 * 5 * 12 * 4, (got_bytes, expected_bytes)
    gate, up = gate_up.double().chunk(2, -1)
    reference = F.linear(act(gate) * up, w.double(), b.double())
    torch.testing.assert_close(outputs[0].double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_recomputed_once_per_backward_and_errors():
    """Three linear layers on one norm output: the norm runs once in the forward and once in the
    backward. Without autograd nothing is tagged."""
    calls = []
    x, norm_w = random((4, 8), torch.float32, "cpu").requires_grad_(), random((8,), torch.float32, "cpu")

    def norm(x):
        calls.append(torch.is_grad_enabled())
        return brrr.rms_norm(x, (8,), norm_w)

    outputs = brrr.norm_linear(norm, x, [random((3, 8), torch.float32, "cpu") for _ in range(3)])
    torch.autograd.grad(sum(o.sum() for o in outputs), x)
    assert calls == [True, False]
    with torch.no_grad():
        h = norm(x)
        assert not hasattr(brrr.remat.tag(h, norm, x), "_brrr_recompute")
    with pytest.raises(ValueError, match="biases"):
        brrr.norm_linear(norm, x, [norm_w[None]], [None, None])
    with pytest.raises(ValueError, match="activation"):
        brrr.glu_linear(x, x, norm_w[None], activation="relu")


def test_an_output_changed_in_place_is_saved_as_it_is():
    """A tagged output changed in place before its linear layer (a forward hook scaling a norm's
    output): the recompute would make the unchanged one, so the linear layer saves it as
    F.linear does; the weight's gradient that of the changed output."""
    x, norm_w, w = random((4, 8), torch.float32, "cpu"), random((8,), torch.float32, "cpu"), random((3, 8), torch.float32, "cpu")
    norm = functools.partial(brrr.rms_norm, normalized_shape=(8,), weight=norm_w)
    grads = []
    for remat in (True, False):
        x_, w_ = leaves(x, w)
        h = norm(x_)
        if remat:
            h = brrr.remat.tag(h, norm, x_)
        h.mul_(2)
        grads.append(grads_of([brrr.remat.linear(h, w_)], [x_, w_]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("held", ["partial", "module"])
def test_a_norm_weight_changed_before_the_backward_raises(held):
    """The norm's weight, which the recompute reads but the linear layer does not save, changed in
    place between the forward and the backward: autograd's error for a changed saved tensor, not
    the gradient of another norm output."""
    x, w = leaves(random((4, 8), torch.float32, "cpu"), random((3, 8), torch.float32, "cpu"))
    if held == "module":
        norm = torch.nn.RMSNorm(8)
        weight = norm.weight
    else:
        weight = random((8,), torch.float32, "cpu").requires_grad_()
        norm = functools.partial(brrr.rms_norm, normalized_shape=(8,), weight=weight)
    (y,) = brrr.norm_linear(norm, x, [w])
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y.sum(), [w])


def test_a_norm_modules_hooks_run_once_as_in_the_plain_composition():
    """A norm module with a forward hook (an activation recorder, say): its output is saved, not
    recomputed, so the hook is not run again in the backward (it ran there, without grad)."""
    norm = torch.nn.LayerNorm(8)
    calls = []
    norm.register_forward_hook(lambda module, args, out: calls.append(torch.is_grad_enabled()))
    x, w = leaves(random((4, 8), torch.float32, "cpu"), random((3, 8), torch.float32, "cpu"))
    (y,) = brrr.norm_linear(norm, x, [w])
    grads = torch.autograd.grad(y.sum(), [x, w])
    assert calls == [True]
    x_, w_ = leaves(x, w)
    for a, b in zip(grads, torch.autograd.grad(F.linear(norm(x_), w_).sum(), [x_, w_])):
        assert torch.equal(a, b)


def test_the_recompute_runs_in_the_autocast_state_of_its_norm():
    """A norm computed outside autocast and a linear layer inside it: the backward recomputes
    the norm's output as the norm made it (it ran in the linear layer's autocast state, a
    different h, and the weight's gradient was off by 3e-2 here)."""
    proj = random((8, 8), torch.float32, "cpu")

    def norm(x):  # autocast changes its matmul
        return F.layer_norm(x @ proj, (8,))

    grads = []
    for remat in (False, True):
        x, w = leaves(random((4, 8), torch.float32, "cpu", generator=torch.Generator().manual_seed(1)),
                      random((3, 8), torch.float32, "cpu", generator=torch.Generator().manual_seed(2)))
        h = norm(x)
        if remat:
            h = brrr.remat.tag(h, norm, x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = brrr.remat.linear(h, w)
        grads.append(torch.autograd.grad(y.float().sum(), [x, w]))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_second_derivatives_are_the_plain_compositions():
    """create_graph=True: the backward recomputes the norm's output with its graph, so a gradient
    penalty's gradient is the plain composition's (torch's LayerNorm as the norm: it has one)."""
    ln = torch.nn.LayerNorm(8).double()
    x, w = leaves(random((4, 8), torch.float64, "cpu"), random((5, 8), torch.float64, "cpu"))

    def penalty_grads(linear_of_norm):
        (g,) = torch.autograd.grad(linear_of_norm(x, w).pow(2).sum(), [w], create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), [x, w, ln.weight, ln.bias])

    expected = penalty_grads(lambda x, w: F.linear(ln(x), w))
    got = penalty_grads(lambda x, w: brrr.norm_linear(ln, x, [w])[0])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_argument_errors():
    """Each names its argument; a weight tensor where the list of weights belongs was iterated by
    its rows (a list of 1-d products, silently), shapes reached F.linear's message."""
    x, w, b = (random(s, torch.float32, "cpu") for s in [(4, 8), (3, 8), (3,)])
    norm = functools.partial(brrr.rms_norm, normalized_shape=(8,))
    cases = [
        (lambda: brrr.norm_linear(norm, x, w), TypeError, "weights: expected a list or tuple of tensors, got Tensor"),
        (lambda: brrr.norm_linear(norm, x, [w], b), TypeError, "biases: expected a list or tuple"),
        (lambda: brrr.norm_linear(norm, x, [w, w.numpy()]), TypeError, r"weights\[1\]: expected a torch.Tensor"),
        (lambda: brrr.norm_linear(norm, x, [w, w[:, :7]]), ValueError, r"weights\[1\]: expected shape \(out, 8\)"),
        (lambda: brrr.norm_linear(norm, x, [w], [b[:2]]), ValueError, r"biases\[0\]: expected shape \(3,\)"),
        (lambda: brrr.glu_linear(x, x[:, :7], w), ValueError, "up: expected gate's shape"),
        (lambda: brrr.glu_linear(x.numpy(), x, w), TypeError, "gate: expected a torch.Tensor"),
        (lambda: brrr.glu_linear(x, None, w), ValueError, r"weight: expected shape \(out, 4\)"),  # halves of 8
        (lambda: brrr.glu_linear(x, x, w, [1.0] * 3), TypeError, "bias: expected a torch.Tensor"),
        (lambda: brrr.norm_linear(None, x, [w]), TypeError, "norm: expected a callable"),
        (lambda: brrr.norm_linear(lambda t: (t, t), x, [w]), TypeError,
         "norm: expected a callable returning a tensor, got a tuple"),
        (lambda: brrr.glu_linear(x[:, :7], None, w), ValueError, "gate: expected a last dim of even size"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=f"^argument {message}"):
            call()
    assert brrr.glu_linear(x, None, w[:, :4], b).shape == (4, 3)


transformers = pytest.importorskip("transformers")


def llama():
    """Llama's proportions at a small size: intermediate 2.69 x hidden, a quarter of the heads for
    keys and values."""
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def layer_saved_bytes(model, tokens):
    """(loss, gradients, activation bytes saved by the first decoder layer's forward: the distinct
    storages autograd saves, less the parameters')."""
    layer = model.model.layers[0]
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in parameters:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    handles = [layer.register_forward_pre_hook(lambda *_: hooks.__enter__()),
               layer.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))]
    try:
        loss = model(input_ids=tokens, labels=tokens).loss
    finally:
        for handle in handles:
            handle.remove()
    return loss, torch.autograd.grad(loss, list(model.parameters())), sum(storages.values())


def test_patch_remat_saves_a_quarter_of_a_decoder_layer():
    base = llama()
    plain, rematerialised = copy.deepcopy(base), copy.deepcopy(base)
    brrr.patch(plain, remat=False)
    report = brrr.patch(rematerialised, remat=True)
    assert sum(isinstance(m, brrr.nn.RematLinear) for m in rematerialised.modules()) == 2 * 7
    assert not any(isinstance(m, brrr.nn.RematLinear) for m in plain.modules())
    assert any(note.startswith("remat: the backward recomputes the outputs of 5 norms and 2 gated MLPs' GLUs")
               and note.endswith("its 14 torch.nn.Linear modules are brrr.nn.RematLinear") for note in report.notes), \
        report.notes
    tokens = torch.randint(0, 211, (2, 33))
    loss, grads, plain_bytes = layer_saved_bytes(plain, tokens)
    r_loss, r_grads, remat_bytes = layer_saved_bytes(rematerialised, tokens)
    assert torch.equal(r_loss, loss) and all(torch.equal(a, b) for a, b in zip(r_grads, grads))
    assert remat_bytes <= 0.75 * plain_bytes, (remat_bytes, plain_bytes)
    hidden, inner, rows = 64, 172, tokens.numel()
    assert plain_bytes - remat_bytes == rows * (2 * hidden + inner) * 4  # two norm outputs and the GLU's
    ref_loss = base(input_ids=tokens, labels=tokens).loss
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (n, _), a, b in zip(base.named_parameters(), grads, torch.autograd.grad(ref_loss, list(base.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)
    assert brrr.unpatch(rematerialised) > 0
    assert [type(m) for m in rematerialised.modules()] == [type(m) for m in base.modules()]


def test_patch_remat_on_the_registrys_cpu_defaults_is_remat_false_bitwise():
    """The registry's own CPU defaults (these tests' fixture runs brrr's kernels for every op):
    PyTorch's add_rms_norm and brrr's rms_norm there, whose bits differ. The output of a residual
    form (the adds fused into the norms) is recomputed as that form made it, so remat=True's loss
    and gradients are remat=False's, bitwise (the q/k/v and gate/up weights' differed)."""
    brrr.registry.reset()
    base = llama()
    tokens = torch.randint(0, 211, (2, 33))
    results = []
    for remat in (False, True):
        model = copy.deepcopy(base)
        brrr.patch(model, remat=remat)
        loss = model(input_ids=tokens, labels=tokens).loss
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    (loss, grads), (r_loss, r_grads) = results
    assert torch.equal(r_loss, loss)
    for (name, _), a, b in zip(base.named_parameters(), r_grads, grads):
        assert torch.equal(a, b), name


def test_patch_remat_auto_recomputes_the_outputs_of_at_least_its_bytes(monkeypatch):
    """remat="auto" (patch's default) recomputes the outputs of at least brrr.remat.AUTO_MIN_BYTES,
    as read when patching: the GLU's and not the norms' between their sizes, all at 0, none above
    them; the loss and gradients the same bits in every case."""
    base = llama()
    tokens = torch.randint(0, 211, (2, 33))
    hidden, inner, rows = 64, 172, tokens.numel()
    plain = copy.deepcopy(base)
    brrr.patch(plain, remat=False)
    loss, grads, plain_bytes = layer_saved_bytes(plain, tokens)
    for min_bytes, recomputed in ((0, 2 * hidden + inner), (rows * hidden * 4 + 1, inner), (rows * inner * 4 + 1, 0)):
        monkeypatch.setattr(brrr.remat, "AUTO_MIN_BYTES", min_bytes)
        model = copy.deepcopy(base)
        report = brrr.patch(model)
        assert any(note.startswith("remat: ") for note in report.notes), report.notes
        a_loss, a_grads, auto_bytes = layer_saved_bytes(model, tokens)
        assert torch.equal(a_loss, loss) and all(torch.equal(a, b) for a, b in zip(a_grads, grads))
        assert plain_bytes - auto_bytes == rows * recomputed * 4, (min_bytes, plain_bytes, auto_bytes)
    assert brrr.remat.tag is not None and brrr.patch.__kwdefaults__["remat"] == "auto"


def test_patch_refuses_an_unknown_remat():
    with pytest.raises(ValueError, match="argument remat: expected True, False or 'auto', got 'yes'"):
        brrr.patch(llama(), remat="yes")


def test_patch_remat_compiles_without_graph_breaks():
    """Under torch.compile the remat swaps are the plain composition (the partitioner decides)."""
    model = llama()
    brrr.patch(model, remat=True)
    tokens = torch.randint(0, 211, (2, 9))
    params = list(model.parameters())
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(lambda t: model(input_ids=t, labels=t).loss)(tokens)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        compiled = torch.compile(lambda t: model(input_ids=t, labels=t).loss, fullgraph=True, backend="aot_eager")
        out, eager = compiled(tokens), model(input_ids=tokens, labels=tokens).loss
        torch.testing.assert_close(out, eager)
        for a, b in zip(torch.autograd.grad(out, params), torch.autograd.grad(eager, params)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    finally:
        torch._dynamo.reset()
