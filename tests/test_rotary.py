"""brrr.rotary and brrr.apply_rotary_pos_emb: outputs and gradients against a float64 reference
(x * cos + rotate_half(x) * sin) on fresh random inputs, broadcast cos/sin, strided views (the
transposed heads of an attention block), head dims whose half is not a multiple of a 16-byte
pack (scalar path on CUDA), NumPy, errors, opcheck, torch.compile, and brrr.patch giving a
model's attention modules brrr's rotary in place of their library's apply_rotary_pos_emb
(tests/rope_model.py) without touching the library, and unpatch restoring them. The layouts:
interleaved pairs and partial rotary (rotary_dim), with an angle per feature or per pair, against
a float64 reference and transformers' own Cohere, GLM, ERNIE 4.5 and GPT-NeoX functions."""

import copy
import functools

import numpy as np
import pytest
import torch

import brrr
import rope_model
import rope_variants
from brrr import _C, _patch
from helpers import DEVICES, DTYPES, TOLERANCE, captured_in_a_graph, random


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


def test_registry_reference_broadcasts_one_angle_as_transformers():
    """cos and sin of last dim 1 (which brrr's kernel refuses: one feature to rotate): the
    registry's fallback is transformers' formula, the angle broadcast over the head dim, not a
    rotation of the first feature alone."""
    q, k = torch.randn(2, 3, 5, 8, dtype=torch.float64), torch.randn(2, 3, 5, 8, dtype=torch.float64)
    cos, sin = torch.randn(2, 1, 5, 1, dtype=torch.float64), torch.randn(2, 1, 5, 1, dtype=torch.float64)
    for got, x in zip(brrr.registry("rotary_qk", q, k, cos, sin), (q, k)):
        torch.testing.assert_close(got, x * cos + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * sin)


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
        torch.library.opcheck(torch.ops.brrr.rotary.default, (x, cos, sin, backward, False, 0))
        torch.library.opcheck(torch.ops.brrr.rotary.default, (x, cos[..., :2], sin[..., :2], backward, True, 4))
    q = torch.randn(2, 3, 4, 6, device=device, requires_grad=True)
    for backward in (False, True):
        torch.library.opcheck(torch.ops.brrr.rotary_qk.default, (x, q, cos[..., :1], sin[..., :1], backward, True, 2))
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

    graph, (static_out, static_grad) = captured_in_a_graph(step)
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


@pytest.mark.parametrize("rotary_dims,heads_dim", [(8, 1), (8, 2), (4, 1), (4, 2)])
def test_patched_rotary_follows_the_librarys_signature(rotary_dims, heads_dim, monkeypatch):
    """unsqueeze_dim passed by position is read by the library function's signature; angles over
    part of the head dim (GPT-NeoX's partial rotary) rotate that part in brrr's kernel."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(rope_variants.VariantAttention(rotary_dims, heads_dim))
    x = torch.randn(2, 5, 32)
    expected = model(x)
    calls = []
    op = brrr.registry.lookup("rotary_qk")
    monkeypatch.setattr(op, "implementation", _counting(op.implementation, calls))
    report = brrr.patch(model)
    try:
        assert [why for _, _, why in report.swapped] == ["brrr rotary (its forward's apply_rotary_pos_emb, partial "
                                                         "rotary)"]
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
        assert len(calls) == 1
    finally:
        brrr.unpatch(model)


def test_patched_rotary_gives_calls_it_cannot_read_to_the_library():
    seen = []

    def library_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        seen.append(position_ids)
        return rope_model.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    replacement = _patch._rotary_through_brrr(library_rotary, _patch.RotaryLayout(False, False, False, False))
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
                                                   ((4, 5, 8), False), ((1, 3, 5, 4), True), ((1, 2, 3, 5, 8), False),
                                                   ((1, 5, 1), False), ((5, 6), True), ((5, 10), False)])
def test_registry_takes_only_angles_that_broadcast_to_x(angle_shape, supported):
    x = torch.randn(2, 3, 5, 8)
    angle = torch.randn(angle_shape)
    op = brrr.registry.lookup("rotary")
    assert (op.resolve(x, angle, angle) is op.implementation) == supported
    if supported:
        torch.testing.assert_close(brrr.registry("rotary", x, angle, angle),
                                   layout_reference(x.double(), angle.double(), angle.double(), False, None).float())


# ---- layouts: interleaved pairs, partial rotary, angles per pair ------------------------------------

def layout_reference(x, cos, sin, interleaved, rotary_dim):
    """The rotation written as the model libraries write it: rotate_half of the half-split or of
    the interleaved form on the first rotary_dim features (cos's last dim where not given), the
    rest concatenated back; angles given per pair repeated to one per feature, as the pairs lie."""
    r = cos.shape[-1] if rotary_dim is None else rotary_dim
    if cos.shape[-1] == r // 2:
        cos, sin = ((a.repeat_interleave(2, -1) if interleaved else torch.cat((a, a), -1)) for a in (cos, sin))
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:
        turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        turned = torch.cat((-rot[..., r // 2:], rot[..., :r // 2]), dim=-1)
    return torch.cat((rot * cos + turned * sin, rest), dim=-1)


LAYOUT_CASES = [  # x shape, leading dims of cos/sin, the features rotated
    ((2, 3, 5, 10), (2, 1, 5), 6),      # odd pairs: the scalar path on CUDA
    ((2, 4, 7, 64), (2, 1, 7), 32),     # 16-byte packs, half the head passed through
    ((3, 130), (), 128),                # two features passed: scalar path
    ((4, 6, 128), (6,), 128),           # all rotated
    ((2, 9, 9), (9,), 4),               # an odd head dim, partly rotated
]
# angles per feature (rotary_dim given, or taken from cos's last dim) or per pair (rotary_dim given)
ANGLES = [("feature", True), ("feature", False), ("pair", True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,lead,r", LAYOUT_CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("angles,given", ANGLES)
def test_layouts_match_reference(device, dtype, shape, lead, r, interleaved, angles, given):
    rotary_dim = r if given else None
    width = r if angles == "feature" else r // 2
    x = random(shape, dtype, device)
    cos, sin = random(lead + (width,), dtype, device, -1, 1), random(lead + (width,), dtype, device, -1, 1)
    leaf = x.clone().requires_grad_()
    out = brrr.rotary(leaf, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
    ref_leaf = x.double().cpu().requires_grad_()
    ref = layout_reference(ref_leaf, cos.double().cpu(), sin.double().cpu(), interleaved, rotary_dim)
    check(out, ref, dtype, scale=3)
    assert torch.equal(out[..., r:], x[..., r:])  # passed through exactly
    g = random(shape, dtype, device)
    out.backward(g)
    ref.backward(g.double().cpu())
    check(leaf.grad, ref_leaf.grad, dtype, scale=3)
    assert torch.equal(leaf.grad[..., r:], g[..., r:])
    with torch.no_grad():
        assert torch.equal(brrr.rotary(x, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim), out.detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_layouts_on_strided_heads_and_q_k_pairs(device, dtype, interleaved, rotary_dim):
    """Transposed heads (as attention blocks make them), grouped k heads, angles per pair given as
    a slice of the model's angles (GLM's cos[..., :r/2]); q and k share one autograd node."""
    b, t, h, d = 2, 9, 4, 16
    qkv = random((b, t, 3, h, d), dtype, device)
    q, k, _ = qkv.transpose(1, 3).unbind(2)  # (b, h, t, d), strided
    k = k[:, :2]
    r = d if rotary_dim is None else rotary_dim
    angles = random((b, t, r), torch.float32, device, -5, 5)
    cos, sin = angles.cos().to(dtype)[..., :r // 2], angles.sin().to(dtype)[..., :r // 2]  # per pair, strided rows
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    ours = brrr.apply_rotary_pos_emb(ql, kl, cos, sin, interleaved=interleaved, rotary_dim=r)
    rq, rk = q.double().cpu().requires_grad_(), k.double().cpu().requires_grad_()
    c64, s64 = cos.double().cpu()[:, None], sin.double().cpu()[:, None]
    theirs = [layout_reference(t_, c64, s64, interleaved, r) for t_ in (rq, rk)]
    for a, e in zip(ours, theirs):
        check(a, e, dtype, scale=3)
    grads = [random(o.shape, dtype, device) for o in ours]
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(theirs, [g.double().cpu() for g in grads])
    check(ql.grad, rq.grad, dtype, scale=3)
    check(kl.grad, rk.grad, dtype, scale=3)
    assert not q.is_contiguous()
    torch.testing.assert_close(brrr.rotary(q, cos[:, None], sin[:, None], interleaved=interleaved, rotary_dim=r),
                               brrr.rotary(q.contiguous(), cos[:, None].contiguous(), sin[:, None].contiguous(),
                                           interleaved=interleaved, rotary_dim=r), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_layouts_write_every_element_in_place_and_transpose(device, interleaved):
    """Out of place every element is written (the passed features copied), into a strided view
    too; in place the passed features are left as they are; the backward is the transpose
    (<rotary(x), g> = <x, rotary_backward(g)>), and inverts the forward where the two features of
    a pair share their angle."""
    x = random((3, 5, 12), torch.float32, device)
    cos, sin = random((5, 8), torch.float32, device), random((5, 8), torch.float32, device)
    kw = dict(interleaved=interleaved, rotary_dim=8)
    expected = layout_reference(x.double(), cos.double(), sin.double(), interleaved, 8)
    out = torch.full_like(x, float("nan"))
    _C.rotary(x, cos, sin, out, False, **kw)
    check(out, expected, torch.float32)
    buffer = torch.full((3, 5, 24), float("nan"), device=device)
    _C.rotary(x, cos, sin, buffer[..., ::2], False, **kw)
    check(buffer[..., ::2], expected, torch.float32)
    assert torch.isnan(buffer[..., 1::2]).all()
    y = x.clone()
    _C.rotary(y, cos, sin, y, backward=False, **kw)
    torch.testing.assert_close(y, out, rtol=0, atol=0)
    g = random(x.shape, torch.float32, device)
    back = _C.rotary(g, cos, sin, None, True, **kw)[0]
    torch.testing.assert_close((out.double() * g.double()).sum(), (x.double() * back.double()).sum(), rtol=1e-5, atol=1e-4)
    half_angles = random((5, 4), torch.float32, device, -3, 3)
    angles = half_angles.repeat_interleave(2, -1) if interleaved else torch.cat((half_angles, half_angles), dim=-1)
    for c, s_ in ((angles.cos(), angles.sin()), (half_angles.cos(), half_angles.sin())):  # per feature, per pair
        there = _C.rotary(x, c, s_, None, False, **kw)[0]
        torch.testing.assert_close(_C.rotary(there, c, s_, None, True, **kw)[0], x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["cohere", "glm", "ernie4_5", "gpt_neox"])
def test_layouts_are_the_model_librarys(device, dtype, family):
    """transformers' own apply_rotary_pos_emb of Cohere (interleaved, an angle per feature), GLM
    (interleaved from the first half of the angles, partial), ERNIE 4.5 (the same, whole) and
    GPT-NeoX (half-split, partial), against brrr's call for each, on the angles those models build."""
    module = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    b, h, t, d = 2, 4, 7, 32
    r = d // 2 if family in ("glm", "gpt_neox") else d
    q, k = random((b, h, t, d), dtype, device), random((b, 2, t, d), dtype, device)
    freqs = torch.arange(t, dtype=torch.float32, device=device)[:, None] / 10000 ** (
        torch.arange(0, r, 2, dtype=torch.float32, device=device) / r)
    emb = freqs.repeat_interleave(2, -1) if family == "cohere" else torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[None].expand(b, t, r).to(dtype), emb.sin()[None].expand(b, t, r).to(dtype)
    theirs = module.apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    if family in ("glm", "ernie4_5"):
        ours = brrr.apply_rotary_pos_emb(q, k, cos[..., :r // 2], sin[..., :r // 2], interleaved=True, rotary_dim=r)
    else:
        ours = brrr.apply_rotary_pos_emb(q, k, cos, sin, interleaved=family == "cohere", rotary_dim=r)
    for a, e in zip(ours, theirs):
        check(a, e, dtype, scale=3)


def test_layouts_numpy():
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64, np.float16):
        x = rng.standard_normal((3, 4, 10)).astype(dtype)
        cos, sin = rng.standard_normal((4, 3)).astype(dtype), rng.standard_normal((4, 3)).astype(dtype)
        out = brrr.rotary(x, cos, sin, interleaved=True, rotary_dim=6)
        assert isinstance(out, np.ndarray) and out.dtype == dtype
        expected = layout_reference(*(torch.from_numpy(a.astype(np.float64)) for a in (x, cos, sin)), True, 6).numpy()
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=4e-3 if dtype == np.float16 else 1e-5,
                                   atol=4e-3 if dtype == np.float16 else 1e-5)


def test_layout_errors():
    x, c = torch.randn(2, 3, 10), torch.randn(3, 10)
    with pytest.raises(ValueError, match="argument rotary_dim: expected an even int <= x's last dim"):
        brrr.rotary(x, c[:, :5], c[:, :5], rotary_dim=5)
    with pytest.raises(ValueError, match="argument rotary_dim: expected an even int <= x's last dim"):
        brrr.rotary(x, c, c, rotary_dim=12)
    with pytest.raises(ValueError, match="argument rotary_dim: expected None or an even int"):
        brrr.rotary(x, c, c, rotary_dim=0)
    with pytest.raises(TypeError, match="argument rotary_dim"):
        brrr.rotary(x, c, c, rotary_dim=4.0)
    with pytest.raises(TypeError, match="argument interleaved: expected a bool"):
        brrr.rotary(x, c, c, interleaved=1)
    with pytest.raises(ValueError, match="argument cos: shape must broadcast to x's shape with last dim rotary_dim"):
        brrr.rotary(x, c[:, :6], c[:, :6], rotary_dim=8)
    with pytest.raises(ValueError, match="argument sin: shape must broadcast to x's shape with last dim rotary_dim / 2"):
        brrr.rotary(x, c[:, :4], c[:, :8], rotary_dim=8)  # cos per pair, sin per feature
    with pytest.raises(ValueError, match="argument x: expected a tensor of shape"):
        brrr.rotary(torch.randn(2, 9), torch.randn(9), torch.randn(9))
    with pytest.raises(ValueError, match=r"argument cos: its last dim \(the features rotated\) must be even"):
        brrr.rotary(x, c[:, :5], c[:, :5])
    with pytest.raises(ValueError, match=r"argument x: expected a tensor of shape \(\.\.\., D\) with D even and at least "
                       r"cos's last dim \(12\)"):
        brrr.rotary(x, torch.randn(3, 12), torch.randn(3, 12))
    with pytest.raises(ValueError, match="argument rotary_dim"):
        brrr.apply_rotary_pos_emb(x[None], x[None], c[None], c[None], rotary_dim=3)
    with pytest.raises(TypeError, match="argument interleaved"):
        brrr.rotary(x.numpy(), c.numpy(), c.numpy(), interleaved="yes")
    with pytest.raises(ValueError, match="argument rotary_dim"):
        _C.rotary(x, c, c, None, False, rotary_dim=-2)


@pytest.mark.parametrize("kwargs,supported", [({}, True), (dict(interleaved=True), True), (dict(rotary_dim=4), True),
                                              (dict(rotary_dim=4, interleaved=True), True), (dict(rotary_dim=5), False),
                                              (dict(rotary_dim=10), False), (dict(interleaved=1), False)])
def test_registry_takes_the_layouts(kwargs, supported):
    x = torch.randn(2, 3, 5, 8)
    r = kwargs.get("rotary_dim") or 8
    for width in {r, r // 2}:
        angle = torch.randn(5, width)
        for name, args in (("rotary", (x,)), ("rotary_qk", (x, x[:, :1]))):
            op = brrr.registry.lookup(name)
            assert (op.resolve(*args, angle, angle, **kwargs) is op.implementation) == supported, (name, width)
            if supported:
                for a, e in zip(torch.atleast_1d(brrr.registry(name, *args, angle, angle, **kwargs)),
                                torch.atleast_1d(op.reference(*args, angle, angle, **kwargs))):
                    torch.testing.assert_close(a, e)
                for a in args:
                    torch.testing.assert_close(brrr.registry("rotary", a, angle, angle, **kwargs),
                                               layout_reference(a.double(), angle.double(), angle.double(),
                                                                kwargs.get("interleaved", False),
                                                                kwargs.get("rotary_dim")).float())


@pytest.mark.parametrize("style,rotary_dims,what", [
    ("neox", 4, ", partial rotary"), ("cohere", 8, ", interleaved pairs"),
    ("glm", 8, ", interleaved pairs, angles from their first half, partial rotary"),
    ("glm", 4, ", interleaved pairs, angles from their first half, partial rotary"),
    ("deepseek", 8, ", interleaved pairs, angles from their first half, halves out")])
def test_patch_recognises_the_rotary_layouts(style, rotary_dims, what, monkeypatch):
    """A library's apply_rotary_pos_emb in each of transformers' forms, recognised on its probe
    and run by brrr's kernel: the module's output and every gradient as before."""
    monkeypatch.setattr(rope_variants, "apply_rotary_pos_emb", rope_variants.STYLES[style])
    torch.manual_seed(3)
    model = torch.nn.Sequential(rope_variants.VariantAttention(rotary_dims, 1))
    x = torch.randn(2, 5, 32)
    expected = model(x)
    ref_grads = torch.autograd.grad(expected.square().sum(), list(model.parameters()))
    calls = []
    op = brrr.registry.lookup("rotary_qk")
    monkeypatch.setattr(op, "implementation", _counting(op.implementation, calls))
    report = brrr.patch(model)
    try:
        assert report.swapped == [("0", "VariantAttention", f"brrr rotary (its forward's apply_rotary_pos_emb{what})")]
        out = model(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for a, b in zip(torch.autograd.grad(out.square().sum(), list(model.parameters())), ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert len(calls) == 1
    finally:
        brrr.unpatch(model)


def test_patch_leaves_a_rotary_look_alike_and_a_partial_call_a_full_form_cannot_take(monkeypatch):
    """Interleaved pairs turned the other way are left; a form the probe saw take only angles over
    the whole head dim (Cohere's) is given narrower ones by its own function, not brrr's."""
    monkeypatch.setattr(rope_variants, "apply_rotary_pos_emb", rope_variants.STYLES["backwards"])
    model = torch.nn.Sequential(rope_variants.VariantAttention(8, 1))
    report = brrr.patch(model)
    assert report.left == [("0", "VariantAttention", "its forward's apply_rotary_pos_emb behaves like no rotary "
                            "embedding")], str(report)
    seen = []

    def cohere(q, k, cos, sin, unsqueeze_dim=1):
        seen.append(cos.shape[-1])
        return rope_variants.apply_rotary_pos_emb_cohere(q, k, cos, sin, unsqueeze_dim)

    replacement = _patch._rotary_through_brrr(cohere, _patch.RotaryLayout(True, False, False, False))
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    with pytest.raises(RuntimeError):  # its own error: it cannot take them
        replacement(q, k, torch.randn(2, 5, 4), torch.randn(2, 5, 4))
    assert seen == [4]


# ---- BRRR_ROTARY_KERNEL=token: a position's heads on one group of threads (cuda/rotary.cu) ---------

TOKEN_FORMS = [  # head dim, features rotated, interleaved, an angle per pair
    (128, 128, False, False),  # Llama's
    (128, 128, True, False),   # Cohere's
    (64, 32, False, False),    # GPT-NeoX's partial rotary: half the head copied
    (64, 32, True, True),      # GLM's: interleaved, an angle per pair, partial
    (32, 32, False, True),     # half-split with an angle per pair
    (10, 6, False, False),     # no 16-byte units: the units kernel under the switch too
]


def _under(monkeypatch, value, fn):
    """fn() with BRRR_ROTARY_KERNEL=value (None: unset), its launches finished."""
    if value is None:
        monkeypatch.delenv("BRRR_ROTARY_KERNEL", raising=False)
    else:
        monkeypatch.setenv("BRRR_ROTARY_KERNEL", value)
    try:
        out = fn()
        torch.cuda.synchronize()
        return out
    finally:
        monkeypatch.delenv("BRRR_ROTARY_KERNEL", raising=False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,r,interleaved,pairs", TOKEN_FORMS)
@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
@pytest.mark.parametrize("angles", ["per batch", "broadcast"])
def test_token_kernel(monkeypatch, dtype, d, r, interleaved, pairs, layout, angles):
    """apply_rotary_pos_emb on q (5 heads) and k (3 heads) over 7 positions of 2 sequences, laid
    out as attention's projections leave them ((batch, seq, heads, d) viewed as (batch, heads,
    seq, d), the gradients too) or contiguous, with angles per sequence or one set broadcast over
    the batch: outputs and both gradients against float64, and the same bits under `token`,
    `token-ascending` and the units kernel (unset). Under `token` q and k are one launch, as are
    dq and dk."""
    b, t = 2, 7

    def heads(h):
        if layout == "transposed":
            return random((b, t, h, d), dtype, "cuda").transpose(1, 2)
        return random((b, h, t, d), dtype, "cuda")

    q, k, gq, gk = heads(5), heads(3), heads(5), heads(3)
    angle = random((b if angles == "per batch" else 1, t, r // 2 if pairs else r), torch.float64, "cpu", -5, 5)
    cos, sin = angle.cos().to("cuda", dtype), angle.sin().to("cuda", dtype)

    def run():
        ql, kl = q.detach().requires_grad_(), k.detach().requires_grad_()
        out = brrr.apply_rotary_pos_emb(ql, kl, cos, sin, interleaved=interleaved, rotary_dim=r)
        torch.autograd.backward(out, (gq, gk))
        return [t_.detach() for t_ in out] + [ql.grad, kl.grad]

    runs = [_under(monkeypatch, value, run) for value in ("token", "token-ascending", None)]
    for name, token, ascending, units in zip(("q", "k", "grad q", "grad k"), *runs):
        assert torch.equal(token, ascending) and torch.equal(token, units), name
    rq, rk = q.double().cpu().requires_grad_(), k.double().cpu().requires_grad_()
    c64, s64 = cos.double().cpu()[:, None], sin.double().cpu()[:, None]
    theirs = [layout_reference(x, c64, s64, interleaved, r) for x in (rq, rk)]
    torch.autograd.backward(theirs, (gq.double().cpu(), gk.double().cpu()))
    for actual, expected in zip(runs[0], theirs + [rq.grad, rk.grad]):
        check(actual, expected, dtype, scale=3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("seq", [4500, 9001])
@pytest.mark.parametrize("r", [128, 64])
def test_token_kernel_loops_over_heads(monkeypatch, dtype, seq, r):
    """Enough positions that a thread takes several heads of its position (7 heads; on an H200's
    132 SMs: bfloat16 at 4500 positions 2 slots of 4 and 3 heads, at 9001 one slot of all 7, 4
    heads' loads then 3; float32 one slot at both): the forward out of place (the copied features
    too where r < 128), in place, three times on the same angles (from the first position, the
    last, the first), and the backward, against float64."""
    x = random((1, seq, 7, 128), dtype, "cuda").transpose(1, 2)
    angle = random((seq, r), torch.float64, "cpu", -5, 5)
    cos, sin = angle.cos().to("cuda", dtype), angle.sin().to("cuda", dtype)
    outs = _under(monkeypatch, "token", lambda: [brrr.rotary(x, cos, sin) for _ in range(3)])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    x64, c64, s64 = x.double().cpu(), cos.double().cpu(), sin.double().cpu()
    check(outs[0], layout_reference(x64, c64, s64, False, None), dtype, scale=3)
    assert torch.equal(outs[0][..., r:], x[..., r:])
    y = x.clone()
    _under(monkeypatch, "token", lambda: _C.rotary(y, cos, sin, y, False))
    assert torch.equal(y, outs[0])
    g = random(x.shape, dtype, "cuda")
    leaf = x.detach().requires_grad_()
    grad = _under(monkeypatch, "token", lambda: torch.autograd.grad(brrr.rotary(leaf, cos, sin), leaf, g)[0])
    ref_leaf = x.double().cpu().requires_grad_()
    ref_grad = torch.autograd.grad(layout_reference(ref_leaf, c64, s64, False, None), ref_leaf, g.double().cpu())[0]
    check(grad, ref_grad, dtype, scale=3)


PAIR_FORMS = [  # d, rotary_dim (None: cos's last dim), interleaved, angles per pair
    (64, None, False, False),
    (64, None, True, False),
    (64, 32, False, False),    # partial: the rest copied
    (64, 32, True, True),
    (10, 6, False, False),     # no 16-byte units
]


def _pair_inputs(device, dtype, d, r, pairs, q_layout, k_layout):
    """q of 5 heads and k of 2 (GQA) over 7 positions of 2 sequences: (batch, seq, heads, d)
    viewed as (batch, heads, seq, d), contiguous (batch, heads, seq, d), or heads sliced from a
    wider (batch, seq, 7, d) buffer (k of a fused projection); angles per sequence."""
    b, t = 2, 7

    def heads(h, layout):
        if layout == "transposed":
            return random((b, t, h, d), dtype, device).transpose(1, 2)
        if layout == "sliced":
            return random((b, t, 7, d), dtype, device)[:, :, 5 - h:5].transpose(1, 2)
        return random((b, h, t, d), dtype, device)

    q, k = heads(5, q_layout), heads(2, k_layout)
    rot = d if r is None else r
    angle = random((b, 1, t, rot // 2 if pairs else rot), torch.float64, "cpu", -5, 5)
    return q, k, angle.cos().to(device, dtype), angle.sin().to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,r,interleaved,pairs", PAIR_FORMS)
@pytest.mark.parametrize("q_layout,k_layout", [("transposed", "transposed"), ("contiguous", "contiguous"),
                                               ("transposed", "sliced"), ("contiguous", "transposed")])
@pytest.mark.parametrize("backward", [False, True])
def test_rotary_pair(monkeypatch, device, dtype, d, r, interleaved, pairs, q_layout, k_layout, backward):
    """_C.rotary_pair (q and k in one call; k with fewer heads and other strides) against float64
    (the forward, and the backward as the gradient of the forward), the same bits as _C.rotary on
    each alone, out of place (the copied features too) and in place, and the same bits under each
    kernel on CUDA; nothing written outside out and out2."""
    q, k, cos, sin = _pair_inputs(device, dtype, d, r, pairs, q_layout, k_layout)
    kw = dict(interleaved=interleaved, rotary_dim=r or 0)
    alone = [_C.rotary(x, cos, sin, None, backward, **kw)[0] for x in (q, k)]
    values = (None, "token", "token-ascending") if device == "cuda" else (None,)
    for value in values:
        def pair():
            out2 = torch.full_like(k, float("nan"))
            return _C.rotary_pair(q, cos, sin, None, k, out2, backward, **kw)

        out, out2 = pair() if device == "cpu" else _under(monkeypatch, value, pair)
        assert torch.equal(out, alone[0]) and torch.equal(out2, alone[1]), value
        base = (k._base if k._base is not None else k).clone()  # y2: k's view of a copy of its memory
        y, y2 = q.clone(), base.as_strided(k.shape, k.stride(), k.storage_offset())
        before = base.clone()

        def in_place():
            _C.rotary_pair(y, cos, sin, y, y2, y2, backward, **kw)

        in_place() if device == "cpu" else _under(monkeypatch, value, in_place)
        assert torch.equal(y, alone[0]) and torch.equal(y2, alone[1]), value
        untouched = torch.ones_like(base, dtype=torch.bool)
        untouched.as_strided(k.shape, k.stride(), k.storage_offset()).fill_(False)
        assert torch.equal(base[untouched], before[untouched]) and untouched.any() == (k_layout == "sliced")
    c64, s64 = cos.double().cpu(), sin.double().cpu()
    for x, actual in zip((q, k), alone):
        x64 = x.double().cpu().requires_grad_()
        expected = layout_reference(x64, c64, s64, interleaved, r)
        if backward:  # the transpose: the gradient of the forward at grad_out = x
            expected = torch.autograd.grad(expected, x64, x.double().cpu())[0]
        check(actual, expected, dtype, scale=3)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_pair_errors(device):
    q, k, cos, sin = _pair_inputs(device, torch.float32, 8, None, False, "transposed", "contiguous")
    out2 = torch.empty_like(k)
    with pytest.raises(ValueError, match="argument out2: expected x2's shape"):
        _C.rotary_pair(q, cos, sin, None, k, torch.empty_like(q), False)
    with pytest.raises(ValueError, match="argument x2: expected a tensor of shape"):
        _C.rotary_pair(q, cos, sin, None, k[..., :6], out2[..., :6], False)
    with pytest.raises(ValueError, match="argument cos: shape must broadcast to x2's shape"):
        _C.rotary_pair(q, cos, sin, None, k[:1, :, :3], out2[:1, :, :3], False)
    with pytest.raises(ValueError, match="argument out: may be x itself"):
        q2 = q.clone()
        _C.rotary_pair(q, cos, sin, q2, q2, torch.empty_like(q2), False)
    with pytest.raises(ValueError, match="argument out2: may be x2 itself"):
        _C.rotary_pair(q, cos, sin, None, q.detach().clone(), q, False)
    with pytest.raises(TypeError, match="argument out2: required"):
        _C.rotary_pair(q, cos, sin, None, k, None, False)
    # the second pass reads cos and sin again: an output may not be one of them, even exactly
    full_cos, full_sin = cos.expand_as(q).contiguous(), sin.expand_as(q).contiguous()
    for out, out2, name, angle in [(full_cos, torch.empty_like(q), "out", "cos"),
                                   (torch.empty_like(q), full_sin, "out2", "sin")]:
        with pytest.raises(ValueError, match=f"argument {name} overlaps input {angle} in memory"):
            _C.rotary_pair(q, full_cos, full_sin, out, q.clone(), out2, False)
    with pytest.raises(ValueError, match="argument x2 has dtype float64 but x has dtype float32"):
        _C.rotary_pair(q, cos, sin, None, k.double(), out2, False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rotary_pair_loops_over_heads(monkeypatch, dtype):
    """Enough positions (4500 and 9001 of 32 q heads and 8 k heads) that a thread takes several
    heads of both, q's then k's across kAhead's groups: the same bits as _C.rotary on each alone,
    forward and backward, under `token` and units."""
    for seq in (4500, 9001):
        q = random((1, seq, 32, 128), dtype, "cuda").transpose(1, 2)
        k = random((1, seq, 8, 128), dtype, "cuda").transpose(1, 2)
        angle = random((seq, 64), torch.float64, "cpu", -5, 5)
        cos, sin = angle.cos().to("cuda", dtype), angle.sin().to("cuda", dtype)
        for backward in (False, True):
            alone = [_C.rotary(x, cos, sin, None, backward, rotary_dim=128)[0] for x in (q, k)]
            for value in ("token", None):
                out = _under(monkeypatch, value,
                             lambda: _C.rotary_pair(q, cos, sin, None, k, torch.empty_like(k), backward,
                                                    rotary_dim=128))
                assert torch.equal(out[0], alone[0]) and torch.equal(out[1], alone[1]), (seq, backward, value)
