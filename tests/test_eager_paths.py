"""The eager paths' host-side shortcuts: brrr._C allocating statistics, parameter gradients and
loss outputs when asked with True; lean_apply (autograd.Function.apply less torch's Python
wrapper) and its fall-back for functorch's tensors; and the same results from the paths torch
before 2.10 takes (no DLPack exchange table: Python allocates what brrr._C cannot).
"""

import pytest
import torch

import brrr
from brrr import _C, _torch, _torch_norm, _torch_xent
from dlpack_producers import Producer
from helpers import DEVICES, HALF_DTYPES, random

def _stat_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("residual", [False, True])
def test_norm_forward_allocates_statistics(device, dtype, residual):
    x, r = random((3, 5, 24), dtype, device), random((3, 5, 24), dtype, device)
    w, b = random((24,), dtype, device), random((24,), dtype, device)
    res = r if residual else None
    given = [torch.full((3, 5), float("nan"), dtype=_stat_dtype(dtype), device=device) for _ in range(2)]
    expected = _C.layer_norm_fwd(x, 1, w, b, 1e-5, None, *given, res, None, -1)
    got = _C.layer_norm_fwd(x, 1, w, b, 1e-5, None, True, True, res, None, -1)
    expected = (expected if residual else (expected,)) + tuple(given)
    assert len(got) == len(expected)
    for a, e in zip(got, expected):
        assert a.shape == e.shape and a.dtype == e.dtype and a.device == e.device and torch.equal(a, e)
    rstd = torch.full((3, 5), float("nan"), dtype=_stat_dtype(dtype), device=device)
    expected = _C.rms_norm_fwd(x, 1, w, 1e-6, False, None, rstd, res, None, -1)
    got = _C.rms_norm_fwd(x, 1, w, 1e-6, False, None, True, res, None, -1)
    expected = (expected if residual else (expected,)) + (rstd,)
    assert len(got) == len(expected) and all(torch.equal(a, e) for a, e in zip(got, expected))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("param_dtype", ["same", "float32"])
def test_norm_backward_allocates_parameter_gradients(device, dtype, param_dtype):
    pd = dtype if param_dtype == "same" else torch.float32
    x, g = random((7, 40), dtype, device), random((7, 40), dtype, device)
    w, b = random((40,), pd, device), random((40,), pd, device)
    _, mean, rstd = torch.ops.brrr.layer_norm(x, [40], w, b, 1e-5)
    gw, gb = torch.full_like(w, float("nan")), torch.full_like(b, float("nan"))
    partials = None
    if device == "cuda":
        partials = torch.empty(2 * _C.norm_partial_rows(7, 40) * 40, device=device)
    gx = _C.layer_norm_bwd(x, 1, g, None, w, mean, rstd, None, gw, gb, partials, -1)
    for asked in [(True, True), (True, None), (None, True)]:
        got = _C.layer_norm_bwd(x, 1, g, None, w, mean, rstd, None, *asked, partials, -1)
        assert torch.equal(got[0], gx)
        for a, e in zip(got[1:], [e for e, want in zip((gw, gb), asked) if want]):
            assert a.dtype == pd and a.shape == (40,) and torch.equal(a, e)
    got_x, got_w = _C.rms_norm_bwd(x, 1, g, None, w, rstd, False, None, True, partials, -1)
    assert got_w.dtype == pd and torch.equal(got_x, _C.rms_norm_bwd(x, 1, g, None, w, rstd, False, None, None,
                                                                     None, -1))


def test_norm_allocation_errors():
    x = random((4, 8), torch.float32, "cpu")
    _, mean, rstd = torch.ops.brrr.layer_norm(x, [8], None, None, 1e-5)
    with pytest.raises(TypeError, match="argument out: True .* taken only for mean and rstd"):
        _C.layer_norm_fwd(x, 1, None, None, 1e-5, True, None, None, None, None, -1)
    with pytest.raises(TypeError, match="argument mean: True .* taken only for mean and rstd in the forward"):
        _C.layer_norm_bwd(x, 1, x, None, None, True, rstd, None, None, None, None, -1)
    with pytest.raises(ValueError, match="argument grad_bias: True .* needs weight"):
        _C.layer_norm_bwd(x, 1, x, None, None, mean, rstd, None, None, True, None, -1)
    with pytest.raises(TypeError, match="argument rstd: True .* frameworks with DLPack's C exchange table"):
        _C.rms_norm_fwd(Producer(x), 1, None, 1e-5, False, torch.empty_like(x), True, None, None, -1)
    with pytest.raises(TypeError, match="argument mean: True .* frameworks with DLPack's C exchange table"):
        _C.layer_norm_fwd(x.numpy(), 1, None, None, 1e-5, None, True, None, None, None, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_forward_allocates_outputs(device, reduction):
    logits = random((9, 33), torch.bfloat16, device)
    target = torch.randint(0, 33, (9,), device=device)
    target[2] = -100
    nan = dict(dtype=torch.float32, device=device)
    given = [torch.full((9,), float("nan"), **nan), torch.full((9,), float("nan"), **nan),
             None if reduction == "none" else torch.full((), float("nan"), **nan), torch.full((), float("nan"), **nan)]
    assert _C.cross_entropy_fwd(logits, target, -100, 0.1, None, 0.0, reduction, *given, -1) is None
    asked = [True, True, None if reduction == "none" else True, True]
    got = _C.cross_entropy_fwd(logits, target, -100, 0.1, None, 0.0, reduction, *asked, -1)
    assert len(got) == 4
    for a, e in zip(got, given):
        assert (a is None) == (e is None)
        if e is not None:
            assert a.dtype == e.dtype and a.shape == e.shape and a.device == e.device and torch.equal(a, e)
    # Given and allocated mixed: the given one is returned as it was.
    mixed = _C.cross_entropy_fwd(logits, target, -100, 0.1, None, 0.0, reduction, given[0], True, asked[2], True, -1)
    assert mixed[0] is given[0]
    with pytest.raises(TypeError, match="argument lse: True .* frameworks with DLPack's C exchange table"):
        _C.cross_entropy_fwd(Producer(logits.float().cpu()), target.cpu(), -100, 0.0, None, 0.0, reduction, True,
                             True, asked[2], True, -1)


def test_lean_apply_takes_functorch_tensors_to_function_apply():
    """A tensor leaked from a finished torch.func transform is a dead functorch wrapper: torch's
    Function.apply unwraps it, brrr._C could not read it; lean_apply hands it to Function.apply."""
    leaked = []

    def f(t):
        leaked.append(t)
        return t.sum()

    torch.func.grad(f)(torch.randn(3, 8))
    dead = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    w = torch.randn(8, requires_grad=True)
    y = brrr.layer_norm(dead, (8,), w, None)
    expected = torch.nn.functional.layer_norm(torch._C._functorch.unwrap_if_dead(dead), (8,), w.detach())
    torch.testing.assert_close(y.detach(), expected)
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == (8,)


def _steps(device):
    """(name, fn of fresh leaves -> outputs, leaves): ops whose eager paths allocate differently
    without the exchange table."""
    x = random((6, 40), torch.bfloat16, device)
    r, w, b = random((6, 40), torch.bfloat16, device), random((40,), torch.float32, device), random((40,), torch.float32, device)
    logits, target = random((6, 40), torch.float32, device), torch.randint(0, 40, (6,), device=device)
    yield "layer_norm", lambda x, w, b: brrr.layer_norm(x, (40,), w, b), (x, w, b)
    yield "add_layer_norm", lambda x, r, w, b: brrr.add_layer_norm(x, r, (40,), w, b), (x, r, w, b)
    yield "rms_norm", lambda x, w: brrr.rms_norm(x, (40,), w, cast_order="llama"), (x, w)
    yield "add_rms_norm", lambda x, r, w: brrr.add_rms_norm(x, r, (40,), w), (x, r, w)
    yield "cross_entropy", lambda z: brrr.cross_entropy(z, target), (logits,)
    yield "swiglu", lambda x: brrr.swiglu(x), (x,)
    yield "gelu", lambda x: brrr.gelu(x[:, 1:], approximate="tanh"), (x,)


def _run(fn, leaves):
    leaves = [t.detach().requires_grad_() for t in leaves]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    return [o.detach() for o in outputs] + [t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
def test_without_exchange_table_same_results(device, monkeypatch):
    """torch before 2.10 has no DLPack exchange table: Python allocates the outputs, statistics
    and gradients brrr._C otherwise does, and passes the stream. Same values, bitwise."""
    if not _torch._EXCHANGE_API:
        pytest.skip("this torch has no exchange table: its tests run that path throughout")
    steps = list(_steps(device))
    expected = {name: _run(fn, leaves) for name, fn, leaves in steps}
    for module in (_torch, _torch_norm, _torch_xent):
        monkeypatch.setattr(module, "_EXCHANGE_API", False)
    for name, fn, leaves in steps:
        got = _run(fn, leaves)
        assert len(got) == len(expected[name])
        for a, e in zip(got, expected[name]):
            assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e), name


@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "cross_entropy",
                                  "swiglu", "gelu"])
def test_eager_backward_refuses_double_backward(name):
    """With create_graph=True each backward runs under torch's once_differentiable: given an
    upstream gradient that requires grad (here, of a square), its gradients record an error node,
    so a second backward raises instead of silently missing terms."""
    fn, leaves = next((f, ls) for n, f, ls in _steps("cpu") if n == name)
    leaves = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in leaves]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    (g,) = torch.autograd.grad(sum(o.square().sum() for o in outputs), leaves[:1], create_graph=True)
    assert g.requires_grad  # recorded (the error node), not an untracked result
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


def test_rotary_backward_refuses_double_backward():
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    (g,) = torch.autograd.grad(brrr.rotary(x, cos, sin).square().sum(), x, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


def test_rotary_pair_backward_refuses_double_backward():
    q, k = (torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cos, sin = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    rq, rk = brrr.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
    assert rq.grad_fn is rk.grad_fn  # one node for both
    (g,) = torch.autograd.grad((rq.square() + rk.square()).sum(), q, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()
