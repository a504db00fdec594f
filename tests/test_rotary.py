"""brrr.rotary and brrr.apply_rotary_pos_emb: outputs and gradients against a float64 reference
(x * cos + rotate_half(x) * sin) on fresh random inputs, broadcast cos/sin, strided views (the
transposed heads of an attention block), head dims whose half is not a multiple of a 16-byte
pack (scalar path on CUDA), NumPy, errors, opcheck, torch.compile, and brrr.patch giving a
model's attention modules brrr's rotary in place of their library's apply_rotary_pos_emb
(tests/rope_model.py) without touching the library, and unpatch restoring them."""

import copy
import functools

import numpy as np
import pytest
import torch

import brrr
import rope_model
import rope_variants
from brrr import _C, _patch
from helpers import DEVICES, DTYPES, TOLERANCE, random


def reference(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def check(actual, expected, dtype, scale=1.0):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.detach().to("cpu", torch.float64), expected.detach().to("cpu", torch.float64),
                               rtol=tol["rtol"] * 4, atol=tol["atol"] * 4 * scale)


CASES = [  # x shape, cos/sin shape
    ((2, 3, 5, 8), (2, 1, 5, 8)),
    ((2, 4, 7, 64), (2, 1, 7, 64)),
    ((3, 130), (130,)),
    ((1, 2, 9, 2), (9, 2)),
    ((4, 6, 128), (6, 128)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,angle_shape", CASES)
def test_matches_reference(device, dtype, shape, angle_shape):
    x = random(shape, dtype, device)
    cos, sin = random(angle_shape, dtype, device, -1, 1), random(angle_shape, dtype, device, -1, 1)
    leaf = x.clone().requires_grad_()
    out = brrr.rotary(leaf, cos, sin)
    ref_leaf = x.double().cpu().requires_grad_()
    ref = reference(ref_leaf, cos.double().cpu(), sin.double().cpu())
    check(out, ref, dtype, scale=3)
    g = random(shape, dtype, device)
    out.backward(g)
    ref.backward(g.double().cpu())
    check(leaf.grad, ref_leaf.grad, dtype, scale=3)
    with torch.no_grad():
        assert torch.equal(brrr.rotary(x, cos, sin), out.detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_heads_and_apply_rotary_pos_emb(device, dtype):
    """q and k as attention blocks make them (a transposed view), against transformers' code."""
    b, t, h, d = 2, 9, 4, 16
    qkv = random((b, t, 3, h, d), dtype, device)
    q, k, _ = qkv.transpose(1, 3).unbind(2)  # (b, h, t, d), strided
    angles = random((b, t, d), torch.float32, device, -5, 5)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    ours = brrr.apply_rotary_pos_emb(ql, kl, cos, sin)
    theirs = rope_model.apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    for a, e in zip(ours, theirs):
        check(a, e, dtype, scale=3)
    assert not q.is_contiguous()
    torch.testing.assert_close(brrr.rotary(q, cos[:, None], sin[:, None]),
                               brrr.rotary(q.contiguous(), cos[:, None], sin[:, None]), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("k_heads", [4, 2, 1])  # grouped-query attention: fewer key heads
@pytest.mark.parametrize("needs", ["both", "q", "k", "q only used"])
def test_apply_rotary_pos_emb_gradients(device, dtype, k_heads, needs):
    """q and k share one autograd node where both need gradients: each gradient against the
    float64 reference, including an output that takes no part in the loss (its gradient None)."""
    b, t, d = 2, 7, 16
    q, k = random((b, 4, t, d), dtype, device), random((b, k_heads, t, d), dtype, device)
    angles = random((b, t, d), torch.float32, device, -5, 5)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ql, kl = q.clone().requires_grad_(needs != "k"), k.clone().requires_grad_(needs != "q")
    ours = brrr.apply_rotary_pos_emb(ql, kl, cos, sin)
    rq, rk = q.double().cpu().requires_grad_(), k.double().cpu().requires_grad_()
    theirs = rope_model.apply_rotary_pos_emb(rq, rk, cos.double().cpu(), sin.double().cpu())
    for a, e, leaf in zip(ours, theirs, (ql, kl)):
        check(a, e, dtype, scale=3)
        assert a.requires_grad == leaf.requires_grad
    used = [i for i, leaf in enumerate((ql, kl)) if leaf.requires_grad][:1 if needs == "q only used" else 2]
    grads = [random(ours[i].shape, dtype, device) for i in used]
    torch.autograd.backward([ours[i] for i in used], grads)
    torch.autograd.backward([theirs[i] for i in used], [g.double().cpu() for g in grads])
    for leaf, ref in zip((ql, kl), (rq, rk)):
        if leaf.requires_grad and ref.grad is not None:
            check(leaf.grad, ref.grad, dtype, scale=3)
        else:
            assert leaf.grad is None
    if needs == "q only used":
        assert kl.grad is None and ql.grad is not None


def test_rotary_qk_registry_op():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    op = brrr.registry.lookup("rotary_qk")
    assert op.resolve(q, k, cos, sin) is op.implementation
    assert op.resolve(q, k.double(), cos, sin) is op.reference  # mixed dtypes: PyTorch promotes them
    assert op.resolve(q, k[..., :4], cos, sin) is op.reference  # k's head dim differs from the angles'
    assert op.resolve(q, torch.randn(2, 2, 3, 8), cos, sin) is op.reference  # the angles do not fit k
    for a, e in zip(brrr.registry("rotary_qk", q, k, cos, sin), op.reference(q, k, cos, sin)):
        torch.testing.assert_close(a, e)
    torch._dynamo.reset()
    f = lambda q, k: sum(t.square().sum() for t in brrr.apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0]))  # noqa: E731
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    assert torch._dynamo.explain(f)(ql, kl).graph_break_count == 0
    out = torch.compile(f, fullgraph=True)(ql, kl)
    torch.testing.assert_close(out, f(ql, kl))
    for a, e in zip(torch.autograd.grad(out, (ql, kl)), torch.autograd.grad(f(ql, kl), (ql, kl))):
        torch.testing.assert_close(a, e)
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_c_layer_writes_every_element_and_in_place(device):
    x = random((3, 5, 12), torch.float32, device)
    cos, sin = random((5, 12), torch.float32, device), random((5, 12), torch.float32, device)
    out = torch.full_like(x, float("nan"))
    _C.rotary(x, cos, sin, out, False)
    check(out, reference(x.double(), cos.double(), sin.double()), torch.float32)
    buffer = torch.full((3, 5, 24), float("nan"), device=device)
    _C.rotary(x, cos, sin, buffer[..., ::2], True)  # the transpose, into a strided view
    assert torch.isnan(buffer[..., 1::2]).all()
    y = x.clone()
    _C.rotary(y, cos, sin, y, backward=False)  # in place
    torch.testing.assert_close(y, out, rtol=0, atol=0)
    # backward(forward(x)) = x where j and j + h share an angle (as transformers builds them): a
    # rotation's transpose is its inverse
    half_angles = random((5, 6), torch.float32, device, -3, 3)
    angles = torch.cat((half_angles, half_angles), dim=-1)
    c, s = angles.cos(), angles.sin()
    back = _C.rotary(_C.rotary(x, c, s, backward=False)[0], c, s, backward=True)[0]
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_numpy():
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64, np.float16):
        x = rng.standard_normal((3, 4, 10)).astype(dtype)
        cos, sin = rng.standard_normal((4, 10)).astype(dtype), rng.standard_normal((4, 10)).astype(dtype)
        out = brrr.rotary(x, cos, sin)
        assert isinstance(out, np.ndarray) and out.dtype == dtype
        expected = reference(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(cos.astype(np.float64)),
                             torch.from_numpy(sin.astype(np.float64))).numpy()
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=4e-3 if dtype == np.float16 else 1e-5,
                                   atol=4e-3 if dtype == np.float16 else 1e-5)


def test_errors():
    x, c = torch.randn(2, 3, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="argument x"):
        brrr.rotary(torch.randn(2, 7), torch.randn(7), torch.randn(7))
    with pytest.raises(ValueError, match="argument cos"):
        brrr.rotary(x, torch.randn(4, 8), c)
    with pytest.raises(ValueError, match="argument sin"):
        brrr.rotary(x, c, torch.randn(3, 6))
    with pytest.raises(ValueError, match="argument cos has dtype"):
        brrr.rotary(x, c.double(), c)
    with pytest.raises(ValueError, match="argument cos: brrr.rotary gives no gradient"):
        brrr.rotary(x, c.clone().requires_grad_(), c)
    with pytest.raises(TypeError, match="argument x"):
        brrr.rotary(torch.zeros(2, 4, dtype=torch.int32), c[:1, :4], c[:1, :4])
    op = brrr.registry.lookup("rotary")
    assert op.resolve(x, c.clone().requires_grad_(), c) is op.reference  # PyTorch's, which has the gradient


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device):
    x = torch.randn(2, 3, 4, 6, device=device, requires_grad=True)
    cos, sin = torch.randn(3, 1, 6, device=device), torch.randn(3, 1, 6, device=device)
    for backward in (False, True):
        torch.library.opcheck(torch.ops.brrr.rotary.default, (x, cos, sin, backward))
    torch._dynamo.reset()
    f = lambda x: brrr.rotary(x, cos, sin).square().sum()  # noqa: E731
    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    out = torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(torch.autograd.grad(out, x)[0], torch.autograd.grad(f(x), x)[0])
    torch._dynamo.reset()


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    """Forward and backward captured once, replayed on new inputs copied into the static ones."""
    q = torch.randn(2, 4, 16, 64, device="cuda", requires_grad=True)
    cos, sin = torch.randn(2, 16, 64, device="cuda"), torch.randn(2, 16, 64, device="cuda")
    grad = torch.randn(2, 4, 16, 64, device="cuda")

    def step():
        out, _ = brrr.apply_rotary_pos_emb(q, q, cos, sin)
        return out, torch.autograd.grad(out, q, grad)[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_grad = step()
    for _ in range(2):
        with torch.no_grad():
            q.copy_(torch.randn_like(q))
            cos.copy_(torch.randn_like(cos))
            sin.copy_(torch.randn_like(sin))
            grad.copy_(torch.randn_like(grad))
        graph.replay()
        out, grad_q = step()
        assert torch.equal(static_out, out) and torch.equal(static_grad, grad_q)


@pytest.mark.parametrize("device", DEVICES)
def test_patch_gives_the_models_attention_brrrs_rotary_and_leaves_the_library(device, monkeypatch):
    torch.manual_seed(0)
    model = rope_model.RopeModel().to(device)
    reference_model = copy.deepcopy(model)
    other_model = copy.deepcopy(model)  # never patched: it must keep the library's function
    tokens = torch.randint(0, 61, (2, 11), device=device)
    expected = reference_model(tokens)
    original = rope_model.apply_rotary_pos_emb
    calls = []
    op = brrr.registry.lookup("rotary_qk")
    monkeypatch.setattr(op, "implementation", _counting(op.implementation, calls))
    report = brrr.patch(model)
    try:
        swapped = [(name, why) for name, cls, why in report.swapped if cls == "RopeAttention"]
        assert swapped == [(f"layers.{i}", "brrr rotary (its forward's apply_rotary_pos_emb)") for i in range(2)], \
            str(report)
        assert rope_model.apply_rotary_pos_emb is original
        out = model(tokens)
        assert len(calls) == 2  # once a layer: the patched forward runs brrr's
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
        ref_grads = torch.autograd.grad(expected.square().sum(), list(reference_model.parameters()))
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        other_model(tokens)
        assert len(calls) == 2, "a model that was not patched ran brrr's rotary"
        again = brrr.patch(model)
        assert [why for name, _, why in again.left if name == "layers.0"] == ["already patched"]
    finally:
        brrr.unpatch(model)
    assert type(model.layers[0]) is rope_model.RopeAttention
    model(tokens)
    assert len(calls) == 2
    # A look-alike with the other rotation sense is left alone.
    monkeypatch.setattr(rope_model, "apply_rotary_pos_emb", lambda q, k, cos, sin, *a, **kw: (
        q * cos[:, None] - rope_model.rotate_half(q) * sin[:, None], k * cos[:, None] - rope_model.rotate_half(k) * sin[:, None]))
    report = brrr.patch(model)
    assert ("layers.0", "RopeAttention", "its forward's apply_rotary_pos_emb behaves like no rotary embedding") \
        in report.left, str(report)
    brrr.unpatch(model)


@pytest.mark.parametrize("device", DEVICES)
def test_patched_rope_model_compiles_without_graph_breaks(device):
    torch.manual_seed(0)
    model = rope_model.RopeModel().to(device)
    tokens = torch.randint(0, 61, (2, 11), device=device)
    expected = model(tokens)
    brrr.patch(model)
    try:
        torch._dynamo.reset()
        assert torch._dynamo.explain(model)(tokens).graph_break_count == 0
        graphs = []
        counted = torch.compile(model, fullgraph=True, backend=lambda gm, inputs: graphs.append(gm) or gm.forward)
        for _ in range(3):
            torch.testing.assert_close(counted(tokens), expected, rtol=1e-5, atol=1e-5)
        assert len(graphs) == 1  # its guards hold from call to call: no recompilation
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(tokens), expected, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(compiled(tokens).square().sum(), list(model.parameters()))
        ref_grads = torch.autograd.grad(expected.square().sum(), list(model.parameters()))
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    finally:
        brrr.unpatch(model)
        torch._dynamo.reset()


@pytest.mark.parametrize("rotary_dims,heads_dim,brrrs", [(8, 1, True), (8, 2, True), (4, 1, False)])
def test_patched_rotary_follows_the_librarys_signature_and_falls_back_to_it(rotary_dims, heads_dim, brrrs,
                                                                            monkeypatch):
    """unsqueeze_dim passed by position is read by the library function's signature; angles over
    part of the head dim (GPT-NeoX's partial rotary) go to the library's own function."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(rope_variants.VariantAttention(rotary_dims, heads_dim))
    x = torch.randn(2, 5, 32)
    expected = model(x)
    calls = []
    op = brrr.registry.lookup("rotary_qk")
    monkeypatch.setattr(op, "implementation", _counting(op.implementation, calls))
    report = brrr.patch(model)
    try:
        assert [why for _, _, why in report.swapped] == ["brrr rotary (its forward's apply_rotary_pos_emb)"]
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
        assert len(calls) == (1 if brrrs else 0)
    finally:
        brrr.unpatch(model)


def test_patched_rotary_gives_calls_it_cannot_read_to_the_library():
    seen = []

    def library_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        seen.append(position_ids)
        return rope_model.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    replacement = _patch._rotary_through_brrr(library_rotary)
    q, k, cos, sin = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    expected = rope_model.apply_rotary_pos_emb(q, k, cos, sin)
    for args, kwargs, library_called in [((), {}, False), ((None, 1), {}, False), ((), {"unsqueeze_dim": 1}, False),
                                         ((torch.arange(5),), {}, True), ((), {"position_ids": torch.arange(5)}, True),
                                         ((None, 1, "extra"), {}, True)]:
        seen.clear()
        if len(args) > 2:  # more arguments than the library takes: its own error, not a silent drop
            with pytest.raises(TypeError):
                replacement(q, k, cos, sin, *args, **kwargs)
            assert not seen
            continue
        for a, e in zip(replacement(q, k, cos, sin, *args, **kwargs), expected):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        assert bool(seen) == library_called, (args, kwargs)


def _counting(fn, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return counted


def test_patch_leaves_a_decorated_forward_that_calls_the_rotary():
    class Wrapped(rope_model.RopeAttention):
        @functools.wraps(rope_model.RopeAttention.forward)
        def forward(self, *args, **kwargs):
            return rope_model.RopeAttention.forward(self, *args, **kwargs)

    model = torch.nn.Sequential(Wrapped())
    report = brrr.patch(model)
    assert ("0", "Wrapped", "its forward uses apply_rotary_pos_emb but is wrapped by a decorator that brrr cannot "
            "rebuild (one that does not hold the function it wraps in a closure cell)") in report.left, str(report)
    assert type(model[0]) is Wrapped


@pytest.mark.parametrize("angle_shape,supported", [((1, 1, 5, 8), True), ((5, 8), True), ((2, 3, 5, 8), True),
                                                   ((4, 5, 8), False), ((1, 3, 5, 4), False), ((1, 2, 3, 5, 8), False),
                                                   ((1, 5, 1), False)])
def test_registry_takes_only_angles_that_broadcast_to_x(angle_shape, supported):
    x = torch.randn(2, 3, 5, 8)
    angle = torch.randn(angle_shape)
    op = brrr.registry.lookup("rotary")
    assert (op.resolve(x, angle, angle) is op.implementation) == supported
    if supported:
        torch.testing.assert_close(brrr.registry("rotary", x, angle, angle),
                                   reference(x.double(), angle.double(), angle.double()).float())
