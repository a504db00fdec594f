"""brrr's ops under PyTorch's tracers and transforms (CPU): make_fx and FakeTensorMode see brrr's
operators (a brrr._C call would be a constant to them); forward-mode AD raises where it would
drop a tangent; autocast gives cross_entropy torch's float32 loss; a chain built inside a compiled
function compiles whole; tensor subclasses that hold no readable memory are refused by name (and
the registry sends them, and torch.func's wrapped tensors, to PyTorch)."""

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

import brrr


def brrr_nodes(graph_module):
    return [str(n.target) for n in graph_module.graph.nodes if str(n.target).startswith("brrr.")]


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_make_fx_records_brrrs_operators(tracing_mode):
    """The traced graph holds brrr's operators, forward and backward, and computes the eager
    results on other inputs (it held the first call's result as a constant)."""
    def step(x, w):
        y = brrr.rms_norm(x, (8,), w) * 2 + brrr.softmax(x)
        return y, torch.autograd.grad(y.sum(), (x, w))

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    graph = make_fx(step, tracing_mode=tracing_mode)(x, w)
    nodes = brrr_nodes(graph)
    assert "brrr.rms_norm.default" in nodes and "brrr.softmax.default" in nodes, nodes
    assert any("backward" in n for n in nodes), nodes
    x2, w2 = torch.randn(4, 8, requires_grad=True) * 10, torch.randn(8, requires_grad=True)
    (y, grads), (y_eager, grads_eager) = graph(x2, w2), step(x2, w2)
    torch.testing.assert_close(y, y_eager)
    for a, b in zip(grads, grads_eager):
        torch.testing.assert_close(a, b)


def test_other_dispatch_modes_see_an_ops_pytorch_calls():
    """A mode that neither traces nor fakes tensors (a FLOP counter) sees what brrr's ops run in
    PyTorch as before: linear_cross_entropy's GEMMs count."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w, target = torch.randn(6, 4), torch.randn(10, 4), torch.randint(0, 10, (6,))
    with FlopCounterMode(display=False) as counter:
        brrr.linear_cross_entropy(x, w, target)
    assert counter.get_total_flops() >= 2 * 6 * 4 * 10


def test_fake_tensor_mode_runs_the_fake_kernels():
    with FakeTensorMode():
        x = torch.randn(4, 8)
        assert brrr.nn.RMSNorm(8)(x).shape == (4, 8)
        assert brrr.layer_norm(x, (8,)).shape == (4, 8)
        assert brrr.gelu(x).shape == (4, 8)


@pytest.mark.parametrize("call", [brrr.tanh, brrr.chain("cos", ("mul", 2.0)), lambda x: brrr.softmax(x),
                                  lambda x: torch.ops.brrr.softmax(x, -1, None, False)[0],
                                  brrr.nn.Softmax(dim=-1), lambda x: brrr.rms_norm(x, (6,))],
                         ids=["tanh", "chain", "softmax", "operator", "module", "rms_norm"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_forward_mode_ad_raises_where_a_tangent_would_be_dropped(call, requires_grad):
    x, tangent = torch.randn(4, 6, dtype=torch.float64, requires_grad=requires_grad), torch.randn(4, 6, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        with pytest.raises(NotImplementedError, match="forward AD"):
            call(dual)
        # no tangent at this level: the op as usual
        torch.testing.assert_close(call(x), call(x.detach()))


def test_use_fused_routes_refuse_forward_mode_ad():
    x, tangent = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    with brrr.use_fused(), fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="forward AD"):
            F.softmax(fwAD.make_dual(x, tangent), -1)


def test_cross_entropy_under_autocast_is_float32_as_torchs():
    torch.manual_seed(0)
    linear, x, target = torch.nn.Linear(8, 8), torch.randn(4, 8), torch.randint(0, 8, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = linear(x)
        expected = torch.nn.CrossEntropyLoss()(logits, target)
        losses = [brrr.nn.CrossEntropyLoss()(logits, target), brrr.cross_entropy(logits, target)]
        with brrr.use_fused():
            losses.append(F.cross_entropy(logits, target))
    assert logits.dtype == torch.bfloat16 and expected.dtype == torch.float32
    for loss in losses:
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_a_chain_built_in_a_compiled_function_compiles_whole():
    def f(x):
        return brrr.chain("cos", ("mul", 2.0), "tanh")(x)

    x = torch.randn(4, 8, requires_grad=True)
    y = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(y, torch.tanh(torch.cos(x) * 2))


def test_compiled_cross_entropy_gradient_keeps_float64_with_label_smoothing():
    """The compiled backward's PyTorch formula: the one-hot term in the logits' dtype (a bool times
    0.9 was float32: 3e-9 errors in a float64 gradient)."""
    x, target = torch.randn(7, 6, dtype=torch.float64, requires_grad=True), torch.arange(7) % 6
    expected = torch.autograd.grad(F.cross_entropy(x, target, label_smoothing=0.1), x)[0]
    compiled = torch.compile(lambda x: brrr.cross_entropy(x, target, label_smoothing=0.1), backend="aot_eager")
    torch.testing.assert_close(torch.autograd.grad(compiled(x), x)[0], expected, rtol=1e-12, atol=1e-15)


def test_the_linear_cross_entropy_operators_outputs_are_left_as_returned():
    """Called directly, the operator's backward must not scale its outputs (the gradients its
    forward computed) in place: they are the caller's."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 5, dtype=torch.bfloat16, requires_grad=True)
    b, target = torch.randn(8, dtype=torch.bfloat16, requires_grad=True), torch.randint(0, 8, (3,))
    outputs = torch.ops.brrr.linear_cross_entropy(x, w, target, b, -100, 0.0, None, 0.0, "sum", 2, "weight",
                                                  [True, True, True])
    before = [o.detach().clone() for o in outputs]
    (outputs[0] * 3).backward()
    for output, kept in zip(outputs, before):
        assert torch.equal(output.detach(), kept)
    expected = [3 * g.float() for g in before[1:]]
    for got, e in zip((x.grad, w.grad, b.grad), expected):
        torch.testing.assert_close(got.float(), e, rtol=1e-2, atol=1e-2)


def test_wrapper_subclasses_are_refused_by_name_and_the_registry_sends_them_to_pytorch():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    x = two_tensor.TwoTensor(torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(TypeError, match="^argument x: tensors of subclass TwoTensor are not supported"):
        brrr.gelu(x)
    norm, theirs = brrr.nn.RMSNorm(8), torch.nn.RMSNorm(8)
    torch.testing.assert_close(norm(x).a, theirs(x).a)


def _routed_cases(hidden):
    w = torch.randn(hidden, dtype=torch.float64)
    return {"rms_norm": lambda x: F.rms_norm(x, (hidden,), w), "softmax": lambda x: F.softmax(x, -1),
            "layer_norm": lambda x: F.layer_norm(x, (hidden,), w), "gelu": F.gelu}


@pytest.mark.parametrize("name", ["rms_norm", "softmax", "layer_norm", "gelu"])
@pytest.mark.parametrize("transform", ["grad", "vmap", "jacrev", "jvp"])
def test_use_fused_routes_run_pytorchs_function_inside_torch_func_transforms(name, transform):
    """brrr's kernels cannot read a transform's wrapped tensors: the registry sends them to the
    function it replaces (set to brrr's kernel on CPU tensors, where some default to PyTorch's)."""
    brrr.registry.on_cpu(name, "kernel")
    try:
        x = torch.randn(3, 7, dtype=torch.float64)
        f = _routed_cases(7)[name]
        run = {"grad": lambda f: torch.func.grad(lambda x: (f(x) ** 2).sum())(x),
               "vmap": lambda f: torch.vmap(f)(x),
               "jacrev": lambda f: torch.func.jacrev(f)(x[0]),
               "jvp": lambda f: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1]}[transform]
        expected = run(f)
        with brrr.use_fused():
            got = run(f)
            outside = f(x)  # and brrr's kernel again once the transform is over
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(outside, f(x))
    finally:
        brrr.registry.reset(name)


def test_torch_func_over_a_patched_model_matches_the_unpatched_one():
    """Per-sample gradients (vmap of grad over functional_call), the torch.func recipe, through a
    model whose RMSNorm and softmax brrr.patch swapped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.RMSNorm(6), torch.nn.Softmax(-1)).double()
    patched = copy.deepcopy(model)
    brrr.patch(patched)
    assert type(patched[1]) is not torch.nn.RMSNorm and type(patched[2]) is not torch.nn.Softmax
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 6, dtype=torch.float64)

    def per_sample(m):
        def loss(p, sample):
            return (torch.func.functional_call(m, p, (sample[None],)) ** 2).sum()
        return torch.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    expected, got = per_sample(model), per_sample(patched)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0)
    torch.testing.assert_close(patched(x), model(x))


def test_registry_set_to_raise_refuses_torch_func_tensors():
    brrr.registry.on_unsupported("softmax", "raise")
    try:
        with brrr.use_fused(), pytest.raises(brrr.UnsupportedError, match="torch.func transform"):
            torch.vmap(lambda x: F.softmax(x, -1))(torch.randn(3, 4))
    finally:
        brrr.registry.reset("softmax")


@pytest.mark.parametrize("call", [lambda x: brrr.rms_norm(x, (4,)), brrr.gelu, brrr.softmax, brrr.log_softmax,
                                  lambda x: brrr.swiglu(x, x)], ids=["rms_norm", "gelu", "softmax", "log_softmax",
                                                                     "swiglu"])
@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_brrrs_functions_name_the_transform_of_a_torch_func_tensor(call, transform):
    """brrr's own functions take no transform's tensors: the error names the argument and the
    transform, and where the registry's calls run (softmax under grad raised torch's error about
    setup_context, under vmap one about a data pointer)."""
    x = torch.randn(3, 4)
    run = {"grad": lambda: torch.func.grad(lambda x: call(x).sum())(x), "vmap": lambda: torch.vmap(call)(x)}[transform]
    with pytest.raises(RuntimeError, match=r"^argument (x|gate): a tensor of a torch.func transform .*brrr.registry"):
        run()
