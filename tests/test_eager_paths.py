"""The eager paths' host-side shortcuts: brrr._C allocating statistics, parameter gradients and
loss outputs when asked with True; lean_apply (autograd.Function.apply less torch's Python
wrapper) and its fall-back for functorch's tensors; and the same results from the paths torch
before 2.10 takes (no DLPack exchange table: Python allocates what brrr._C cannot).
"""

import numpy as np
import pytest
import torch

import brrr
from brrr import _C, _op
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
    expected = _C.layer_norm_fwd(x, w, b, res, None, None, *given, norm_ndim=1, eps=1e-5)
    got = _C.layer_norm_fwd(x, w, b, res, mean=True, rstd=True, norm_ndim=1, eps=1e-5)
    assert len(got) == len(expected) == 4 and (got[1] is None) == (not residual) and expected[2:] == tuple(given)
    for a, e in zip(got, expected):
        assert a is e is None or (a.shape == e.shape and a.dtype == e.dtype and a.device == e.device
                                  and torch.equal(a, e))
    rstd = torch.full((3, 5), float("nan"), dtype=_stat_dtype(dtype), device=device)
    expected = _C.rms_norm_fwd(x, w, res, None, None, rstd, norm_ndim=1, eps=1e-6, llama=False)
    got = _C.rms_norm_fwd(x, w, res, rstd=True, norm_ndim=1, eps=1e-6, llama=False)
    assert len(got) == len(expected) == 3 and expected[2] is rstd
    assert all(a is e is None or torch.equal(a, e) for a, e in zip(got, expected))


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
    gx = _C.layer_norm_bwd(x, g, None, w, mean, rstd, None, gw, gb, partials, norm_ndim=1)[0]
    for asked in [(True, True), (True, None), (None, True)]:
        got = _C.layer_norm_bwd(x, g, None, w, mean, rstd, None, *asked, partials, norm_ndim=1)
        assert torch.equal(got[0], gx)
        for a, e, want in zip(got[1:], (gw, gb), asked):
            assert a is None if not want else (a.dtype == pd and a.shape == (40,) and torch.equal(a, e))
    got_x, got_w = _C.rms_norm_bwd(x, g, None, w, rstd, None, True, partials, norm_ndim=1, llama=False)
    assert got_w.dtype == pd and torch.equal(got_x, _C.rms_norm_bwd(x, g, None, w, rstd, norm_ndim=1,
                                                                     llama=False)[0])


def test_norm_allocation_errors():
    x = random((4, 8), torch.float32, "cpu")
    _, mean, rstd = torch.ops.brrr.layer_norm(x, [8], None, None, 1e-5)
    with pytest.raises(TypeError, match="argument out: True .* not taken for this argument"):
        _C.layer_norm_fwd(x, out=True, norm_ndim=1, eps=1e-5)
    with pytest.raises(TypeError, match="argument mean: expected a tensor or array implementing __dlpack__, got bool"):
        _C.layer_norm_bwd(x, x, None, None, True, rstd, norm_ndim=1)
    with pytest.raises(ValueError, match="argument grad_bias: cannot be allocated here without a parameter"):
        _C.layer_norm_bwd(x, x, None, None, mean, rstd, grad_bias=True, norm_ndim=1)
    with pytest.raises(TypeError, match="argument rstd: brrr._C allocates outputs only for NumPy arrays and tensors "
                                        "of frameworks with DLPack's C exchange table"):
        _C.rms_norm_fwd(Producer(x), out=Producer(torch.empty_like(x)), rstd=True, norm_ndim=1, eps=1e-5, llama=False)
    # NumPy arrays get their statistics allocated too, with NumPy
    out, _, mean_np, rstd_np = _C.layer_norm_fwd(x.numpy(), mean=True, rstd=True, norm_ndim=1, eps=1e-5)
    assert isinstance(mean_np, np.ndarray) and mean_np.dtype == np.float32 and mean_np.shape == (4,)
    np.testing.assert_array_equal(rstd_np, rstd.numpy())
    np.testing.assert_array_equal(out, torch.ops.brrr.layer_norm(x, [8], None, None, 1e-5)[0].numpy())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_forward_allocates_outputs(device, reduction):
    logits = random((9, 33), torch.bfloat16, device)
    target = torch.randint(0, 33, (9,), device=device)
    target[2] = -100
    nan = dict(dtype=torch.float32, device=device)
    given = [torch.full((9,), float("nan"), **nan), torch.full((9,), float("nan"), **nan),
             None if reduction == "none" else torch.full((), float("nan"), **nan), torch.full((), float("nan"), **nan)]
    args = dict(ignore_index=-100, label_smoothing=0.1, reduction=reduction)
    assert all(a is e for a, e in zip(_C.cross_entropy_fwd(logits, target, *given, **args), given))
    asked = [None, None, None if reduction == "none" else True, True]  # None: a required output
    got = _C.cross_entropy_fwd(logits, target, *asked, **args)
    assert len(got) == 4
    for a, e in zip(got, given):
        assert (a is None) == (e is None)
        if e is not None:
            assert a.dtype == e.dtype and a.shape == e.shape and a.device == e.device and torch.equal(a, e)
    # Given and allocated mixed: the given one is returned as it was.
    mixed = _C.cross_entropy_fwd(logits, target, given[0], None, asked[2], True, **args)
    assert mixed[0] is given[0]
    with pytest.raises(TypeError, match="argument lse: True .* not taken"):
        _C.cross_entropy_fwd(logits, target, True, **args)
    with pytest.raises(TypeError, match="argument lse: brrr._C allocates outputs only for NumPy arrays and tensors "
                                        "of frameworks with DLPack's C exchange table"):
        _C.cross_entropy_fwd(Producer(logits.float().cpu()), Producer(target.cpu()), None, None, asked[2], True, **args)


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
    if not _op.EXCHANGE_API:
        pytest.skip("this torch has no exchange table: its tests run that path throughout")
    steps = list(_steps(device))
    expected = {name: _run(fn, leaves) for name, fn, leaves in steps}
    monkeypatch.setattr(_op, "EXCHANGE_API", False)
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


@pytest.mark.parametrize("device", DEVICES)
def test_node_runs_the_backward_itself(device):
    """The eager Function's node calls its backward with no lookup in between (its ctx's apply is
    the backward): called by autograd or directly, the gradient is the formula's."""
    x = random((3, 7), torch.float32, device).requires_grad_()
    g = random((3, 7), torch.float32, device)
    y = brrr.softmax(x, -1)
    assert type(y.grad_fn).apply is not torch.autograd.function.BackwardCFunction.apply
    expected = torch.softmax(x, -1).detach()
    expected = expected * (g - (g * expected).sum(-1, keepdim=True))
    (auto,) = torch.autograd.grad(y, x, g, retain_graph=True)
    direct = y.grad_fn.apply(g)[0]
    torch.testing.assert_close(auto, expected)
    torch.testing.assert_close(direct, expected)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_norm_operators_check_normalized_shape(name):
    """The eager Function's forward leaves normalized_shape to the entry that checked it; the
    operators, which anyone may call through torch.ops.brrr, still check it."""
    x = random((3, 8), torch.float32, "cpu").requires_grad_()
    args = (None, None, 1e-5) if name == "layer_norm" else (None, 1e-6, False, 0.0)
    for shape in ([5], [3, 4]):
        with pytest.raises(ValueError, match="normalized_shape"):
            getattr(torch.ops.brrr, name)(x, shape, *args)
        with pytest.raises(ValueError, match="normalized_shape"):
            getattr(brrr, name)(x, shape)


def test_chain_program_found_by_name_only_without_scalars():
    """A chain whose steps take no scalar is found by its op names; one with a scalar step is not,
    so 0.0 and -0.0 stay two chains, recorded by autograd or not."""
    x = torch.ones(5, requires_grad=True)
    negative, positive = brrr.chain(("mul", -0.0), "reciprocal"), brrr.chain(("mul", 0.0), "reciprocal")
    for _ in range(2):
        assert torch.equal(negative(x), torch.full((5,), -torch.inf))
        assert torch.equal(positive(x), torch.full((5,), torch.inf))
        assert torch.equal(negative(x.detach()), torch.full((5,), -torch.inf))
    y = torch.linspace(-2, 2, 9, requires_grad=True)
    (grad,) = torch.autograd.grad(brrr.chain("cos", "exp")(y).sum(), y)
    torch.testing.assert_close(grad, -torch.sin(y) * torch.exp(torch.cos(y)))
