"""bias+activation and GLUs: outputs and every gradient against float64 PyTorch autograd."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import brrr
from helpers import DEVICES, DTYPES, assert_close, random


def ref_glu(activation, gate, up):
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    return act(gate) * up


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def leaves64(*tensors):
    return [t.detach().to("cpu", torch.float64).requires_grad_() for t in tensors]


GLUS = {"silu": brrr.swiglu, "gelu": brrr.geglu, "gelu_tanh": lambda g, u=None: brrr.geglu(g, u, approximate="tanh")}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(GLUS))
@pytest.mark.parametrize("shape", [(1, 2), (3, 130), (5, 7, 4096 + 16)], ids=str)
def test_split_glu_forward_backward(device, dtype, activation, shape):
    x = random(shape, dtype, device)
    d = shape[-1] // 2
    grad = random((*shape[:-1], d), dtype, device)
    (xb,) = leaves(x)
    y = GLUS[activation](xb)
    y.backward(grad)
    (x64,) = leaves64(x)
    y_ref = ref_glu(activation, x64[..., :d], x64[..., d:])
    y_ref.backward(grad.double().cpu())
    assert y.shape == y_ref.shape and y.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(xb.grad, x64.grad, dtype, scale=2.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(GLUS))
def test_two_input_glu(device, dtype, activation):
    gate, up = random((33, 257), dtype, device), random((33, 257), dtype, device)
    grad = random((33, 257), dtype, device)
    g, u = leaves(gate, up)
    GLUS[activation](g, u).backward(grad)
    g64, u64 = leaves64(gate, up)
    ref = ref_glu(activation, g64, u64)
    ref.backward(grad.double().cpu())
    assert_close(GLUS[activation](gate, up), ref, dtype)
    assert_close(g.grad, g64.grad, dtype, scale=2.0)
    assert_close(u.grad, u64.grad, dtype, scale=2.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(GLUS))
@pytest.mark.parametrize("up_grad", [True, False])
def test_glu_kernels_match_the_generic_chain_bitwise(device, dtype, activation, up_grad):
    """The GLU's own kernels (on CPU, its backward's one loop) against the generic chain kernels
    (the same program with a trailing multiply by 1, which changes no value but is not a GLU),
    over several blocks and a tail that is not a whole pack."""
    n = 3 * 256 * 2 * 8 + 5
    gate, up, grad = (random((n,), dtype, device) for _ in range(3))
    generic = brrr.chain(activation, "mul_tensor", ("mul", 1.0))
    results = []
    for fn in (GLUS[activation], generic):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_(up_grad)
        out = fn(g, u)
        out.backward(grad)
        results.append((out, g.grad, u.grad))
    (out, gg, ug), (out_ref, gg_ref, ug_ref) = results
    assert torch.equal(out, out_ref) and torch.equal(gg, gg_ref)
    assert (ug is None and ug_ref is None) if not up_grad else torch.equal(ug, ug_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(GLUS))
def test_glu_backward_in_place_of_gate(dtype, activation):
    """grad_gate written over gate (the one overlap allowed): the same bits as into new memory."""
    from brrr.chain import torch_layer

    program = torch_layer().program(activation + ",mul_tensor", (0.0, 0.0))
    gate, up, grad = (random((7, 1100), dtype, "cpu") for _ in range(3))
    grad_up, grad_up_in_place, x = torch.empty_like(up), torch.empty_like(up), gate.clone()
    grad_gate = brrr._C.chain_bwd(gate, grad, None, None, program, (up,), (grad_up,))[0]
    brrr._C.chain_bwd(x, grad, x, None, program, (up,), (grad_up_in_place,))
    assert torch.equal(x, grad_gate) and torch.equal(grad_up_in_place, grad_up)
    assert not torch.equal(x, gate)


@pytest.mark.parametrize("device", DEVICES)
def test_glu_of_non_contiguous_input(device):
    base = random((8, 40, 3), torch.float32, device)
    x = base.permute(2, 0, 1)  # last dim strided
    (xb,) = leaves(x)
    brrr.swiglu(xb).sum().backward()
    (x64,) = leaves64(x)
    ref_glu("silu", x64[..., :20], x64[..., 20:]).sum().backward()
    assert_close(brrr.swiglu(x), ref_glu("silu", x64[..., :20], x64[..., 20:]), torch.float32)
    assert_close(xb.grad, x64.grad, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("shape", [(7, 3), (64, 1000), (2, 3, 768)], ids=str)
def test_bias_activation(device, dtype, op, shape):
    fn = {"gelu": brrr.bias_gelu, "gelu_tanh": lambda x, b: brrr.bias_gelu(x, b, approximate="tanh"),
          "silu": brrr.bias_silu}[op]
    ref_act = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}[op]
    x, bias, grad = random(shape, dtype, device), random(shape[-1:], dtype, device), random(shape, dtype, device)
    xb, bb = leaves(x, bias)
    y = fn(xb, bb)
    y.backward(grad)
    x64, b64 = leaves64(x, bias)
    ref = ref_act(x64 + b64)
    ref.backward(grad.double().cpu())
    rows = x.numel() // shape[-1]
    assert_close(y, ref, dtype)
    assert_close(xb.grad, x64.grad, dtype, scale=2.0)
    assert_close(bb.grad, b64.grad, dtype, scale=max(2.0, rows ** 0.5))


BIAS_ACTS = {"gelu": brrr.bias_gelu, "gelu_tanh": lambda x, b: brrr.bias_gelu(x, b, approximate="tanh"),
             "silu": brrr.bias_silu}


def _bias_act_under(monkeypatch, value, fn, x, bias, grad):
    """out, grad_x, grad_bias of one forward+backward with BRRR_CHAIN_ROWS_READ=value."""
    monkeypatch.setenv("BRRR_CHAIN_ROWS_READ", value)
    try:
        xb, bb = x.detach().requires_grad_(), bias.detach().requires_grad_()  # x keeps its strides
        out = fn(xb, bb)
        out.backward(grad)
        torch.cuda.synchronize()
        return out, xb.grad, bb.grad
    finally:
        monkeypatch.delenv("BRRR_CHAIN_ROWS_READ")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(BIAS_ACTS))
@pytest.mark.parametrize("shape", [(1, 64), (3, 72), (37, 65), (2053, 1032), (5, 4097), (129, 5120)], ids=str)
@pytest.mark.parametrize("layout", ["dense", "padded rows"])
def test_bias_activation_row_reads(monkeypatch, dtype, op, shape, layout):
    """The row kernels (bias+activation, rows of 64 columns or more) read their staged packs back
    from shared memory whole (unset, BRRR_CHAIN_ROWS_READ=pack) or element by element
    (=element): the same values, so the same bits, in the output and both gradients; against
    the float64 reference too. 64 and 72 columns are whole packs, 65 and 4097 take the
    one-column kernels, rows padded to a multiple of 16 bytes keep the packs; one row and many."""
    rows, cols = shape
    fn = BIAS_ACTS[op]

    def place(t):
        if layout == "dense":
            return t
        pad = 16 // t.element_size()
        return torch.empty(rows, cols + pad, dtype=dtype, device="cuda")[:, :cols].copy_(t)

    x, grad = place(random(shape, dtype, "cuda")), place(random(shape, dtype, "cuda"))
    bias = random((cols,), dtype, "cuda")
    whole = _bias_act_under(monkeypatch, "pack", fn, x, bias, grad)
    again = _bias_act_under(monkeypatch, "pack", fn, x, bias, grad)
    element = _bias_act_under(monkeypatch, "element", fn, x, bias, grad)
    for name, a, b, c in zip(("out", "grad_x", "grad_bias"), whole, again, element):
        assert torch.equal(a, b) and torch.equal(a, c), name
    x64, b64 = leaves64(x, bias)
    ref_act = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}[op]
    ref = ref_act(x64 + b64)
    ref.backward(grad.double().cpu())
    assert_close(whole[0], ref, dtype)
    assert_close(whole[1], x64.grad, dtype, scale=2.0)
    assert_close(whole[2], b64.grad, dtype, scale=max(2.0, rows ** 0.5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [64, 130, 4096 + 16])
def test_split_glu_row_reads(monkeypatch, dtype, cols):
    """swiglu on the halves of x runs the row kernels with an x-shaped operand: the same bits with
    its staged packs read whole or element by element (BRRR_CHAIN_ROWS_READ)."""
    x, grad = random((37, 2 * cols), dtype, "cuda"), random((37, cols), dtype, "cuda")
    results = []
    for value in ("pack", "element"):
        monkeypatch.setenv("BRRR_CHAIN_ROWS_READ", value)
        (xb,) = leaves(x)
        y = brrr.swiglu(xb)
        y.backward(grad)
        torch.cuda.synchronize()
        results.append((y, xb.grad))
    monkeypatch.delenv("BRRR_CHAIN_ROWS_READ")
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    (x64,) = leaves64(x)
    ref = ref_glu("silu", x64[:, :cols], x64[:, cols:])
    ref.backward(grad.double().cpu())
    assert_close(results[0][0], ref, dtype)
    assert_close(results[0][1], x64.grad, dtype, scale=2.0)


def _under_program(monkeypatch, value, run):
    """run() with BRRR_CHAIN_ROWS_PROGRAM=value (None: unset), synchronised."""
    if value is None:
        monkeypatch.delenv("BRRR_CHAIN_ROWS_PROGRAM", raising=False)
    else:
        monkeypatch.setenv("BRRR_CHAIN_ROWS_PROGRAM", value)
    try:
        result = run()
        torch.cuda.synchronize()
        return result
    finally:
        monkeypatch.delenv("BRRR_CHAIN_ROWS_PROGRAM", raising=False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(BIAS_ACTS))
@pytest.mark.parametrize("shape", [(1, 64), (37, 72), (2053, 1032), (5, 4097), (129, 4096 + 16)], ids=str)
@pytest.mark.parametrize("layout", ["dense", "padded rows"])
@pytest.mark.parametrize("bias_grad", [True, False])
def test_bias_activation_row_programs(monkeypatch, dtype, op, shape, layout, bias_grad):
    """BRRR_CHAIN_ROWS_PROGRAM: the row kernels' program interpreted (unset, `interpret`) or
    fixed at compile time (`fixed`: the same arithmetic, so the same bits, in the output and
    both gradients; `lean`: gelu's constants folded, so only silu and gelu_tanh keep the bits;
    `lean2`: `lean`'s arithmetic in other kernels, so `lean`'s bits), each against the float64
    reference. 4097 columns take the one-column kernels, which always interpret; padded rows keep
    the 16-byte packs; 1 and 37 rows leave threads fewer rows than pipeline stages."""
    rows, cols = shape
    fn = BIAS_ACTS[op]

    def place(t):
        if layout == "dense":
            return t
        pad = 16 // t.element_size()
        return torch.empty(rows, cols + pad, dtype=dtype, device="cuda")[:, :cols].copy_(t)

    x, grad = place(random(shape, dtype, "cuda")), place(random(shape, dtype, "cuda"))
    bias = random((cols,), dtype, "cuda")

    def run():
        xb, bb = x.detach().requires_grad_(), bias.detach().requires_grad_(bias_grad)
        out = fn(xb, bb)
        out.backward(grad)
        return out, xb.grad, bb.grad

    results = {v: _under_program(monkeypatch, v, run) for v in (None, "interpret", "fixed", "lean", "lean2")}
    x64, b64 = leaves64(x, bias)
    ref_act = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}[op]
    ref = ref_act(x64 + b64)
    ref.backward(grad.double().cpu())
    half = dtype in (torch.float16, torch.bfloat16)
    same_bits = ("interpret", "fixed") if op == "gelu" and half else ("interpret", "fixed", "lean", "lean2")
    # Unset is lean2 in half storage, the interpreter in float32 and float64.
    default = results["lean2"] if half else results["interpret"]
    assert all(torch.equal(a, b) for a, b in zip(results[None], default) if a is not None), "unset"
    # float32 and float64 gelu: the fixed programs' derivative is contracted into FMAs where the
    # interpreter's is not (H200, nvcc 13.0): the same output bits, gradients to rounding.
    grad_bits = not (op == "gelu" and not half)
    for value, (out, grad_x, grad_bias) in results.items():
        assert (grad_bias is None) == (not bias_grad), value
        if value == "lean2":
            lean = results["lean"]
            assert torch.equal(out, lean[0]) and torch.equal(grad_x, lean[1]), value
            assert not bias_grad or torch.equal(grad_bias, lean[2]), value
        if value in same_bits:
            base = results["interpret"]
            assert torch.equal(out, base[0]), value
            assert not grad_bits or torch.equal(grad_x, base[1]), value
            assert not bias_grad or not grad_bits or torch.equal(grad_bias, base[2]), value
        assert_close(out, ref, dtype)
        assert_close(grad_x, x64.grad, dtype, scale=2.0)
        if bias_grad:
            assert_close(grad_bias, b64.grad, dtype, scale=max(2.0, rows ** 0.5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(BIAS_ACTS))
@pytest.mark.parametrize("layout", ["dense", "gaps between batches"])
def test_bias_activation_lean2_batched(monkeypatch, dtype, op, layout):
    """BRRR_CHAIN_ROWS_PROGRAM=lean2 on (batch, seq, hidden) x: dense, it coalesces to the 2-d
    rows the lean2 kernels take; with gaps between batches it stays 3-d and runs as `lean`.
    Either way `lean`'s bits, and the float64 reference."""
    batch, seq, cols = 3, 67, 136
    x = random((batch, seq + (5 if layout != "dense" else 0), cols), dtype, "cuda")[:, :seq]
    grad, bias = random((batch, seq, cols), dtype, "cuda"), random((cols,), dtype, "cuda")

    def run():
        xb, bb = x.detach().requires_grad_(), bias.detach().requires_grad_()
        out = BIAS_ACTS[op](xb, bb)
        out.backward(grad)
        return out, xb.grad, bb.grad

    results = {v: _under_program(monkeypatch, v, run) for v in ("lean", "lean2")}
    for a, b in zip(results["lean"], results["lean2"]):
        assert torch.equal(a, b)
    x64, b64 = leaves64(x, bias)
    ref_act = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}[op]
    ref = ref_act(x64 + b64)
    ref.backward(grad.double().cpu())
    out, grad_x, grad_bias = results["lean2"]
    assert_close(out, ref, dtype)
    assert_close(grad_x, x64.grad, dtype, scale=2.0)
    assert_close(grad_bias, b64.grad, dtype, scale=max(2.0, (batch * seq) ** 0.5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(GLUS))
@pytest.mark.parametrize("cols", [64, 136, 4096 + 16])
def test_split_glu_row_programs(monkeypatch, dtype, activation, cols):
    """The GLUs on the halves of x (row kernels, an x-shaped operand) under every
    BRRR_CHAIN_ROWS_PROGRAM value: `fixed` the interpreter's bits, `lean` too but for gelu in
    half storage, `lean2` `lean`'s bits; all against the float64 reference."""
    x, grad = random((37, 2 * cols), dtype, "cuda"), random((37, cols), dtype, "cuda")

    def run():
        (xb,) = leaves(x)
        y = GLUS[activation](xb)
        y.backward(grad)
        return y, xb.grad

    results = {v: _under_program(monkeypatch, v, run) for v in (None, "interpret", "fixed", "lean", "lean2")}
    (x64,) = leaves64(x)
    ref = ref_glu(activation, x64[:, :cols], x64[:, cols:])
    ref.backward(grad.double().cpu())
    half = dtype in (torch.float16, torch.bfloat16)
    default = results["lean2"] if half else results["interpret"]  # unset
    assert torch.equal(results[None][0], default[0]) and torch.equal(results[None][1], default[1])
    lean_differs = activation == "gelu" and half
    grad_bits = not (activation == "gelu" and not half)  # as in test_bias_activation_row_programs
    base = results["interpret"]
    for value, (y, grad_x) in results.items():
        if value == "fixed" or (value in ("lean", "lean2") and not lean_differs):
            assert torch.equal(y, base[0]) and (not grad_bits or torch.equal(grad_x, base[1])), value
        if value == "lean2":
            assert torch.equal(y, results["lean"][0]) and torch.equal(grad_x, results["lean"][1]), value
        assert_close(y, ref, dtype)
        assert_close(grad_x, x64.grad, dtype, scale=2.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(GLUS))
@pytest.mark.parametrize("up_grad", [True, False])
def test_glu_row_programs_with_padded_gate(monkeypatch, dtype, activation, up_grad):
    """A GLU of a gate with padded rows and a dense up (row kernels; the two row strides differ):
    `lean2` gives `lean`'s bits, and both gradients match the float64 reference."""
    rows, cols = 45, 136
    pad = 16 // torch.empty((), dtype=dtype).element_size()
    gate = random((rows, cols + pad), dtype, "cuda")[:, :cols]
    up, grad = random((rows, cols), dtype, "cuda"), random((rows, cols), dtype, "cuda")

    def run():
        gb, ub = gate.detach().requires_grad_(), up.detach().requires_grad_(up_grad)
        y = GLUS[activation](gb, ub)
        y.backward(grad)
        return y, gb.grad, ub.grad

    results = {v: _under_program(monkeypatch, v, run) for v in ("lean", "lean2")}
    for a, b in zip(results["lean"], results["lean2"]):
        assert (a is None and b is None) or torch.equal(a, b)
    g64, u64 = leaves64(gate, up)
    ref = ref_glu(activation, g64, u64)
    ref.backward(grad.double().cpu())
    y, grad_gate, grad_up = results["lean2"]
    assert (grad_up is None) == (not up_grad)
    assert_close(y, ref, dtype)
    assert_close(grad_gate, g64.grad, dtype, scale=2.0)
    if up_grad:
        assert_close(grad_up, u64.grad, dtype, scale=2.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("value", [None, "fixed", "lean", "lean2"], ids=str)
def test_bias_gelu_row_programs_at_every_value(monkeypatch, dtype, value):
    """Every float16 and bfloat16 in [-10, 10] through bias_gelu's fixed row kernels (zero bias,
    rows of 64): gelu and its derivative (grad_x under a unit gradient) the correctly rounded
    value or a neighbour, within the smallest normal."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    x = bits[torch.isfinite(bits) & (bits >= -10) & (bits <= 10)]
    x = torch.cat([x, x.new_zeros(-x.numel() % 64)])
    x64 = x.double()
    ref = 0.5 * x64 * torch.special.erfc(-x64 / math.sqrt(2))
    ref_grad = 0.5 * torch.special.erfc(-x64 / math.sqrt(2)) + x64 * torch.exp(-0.5 * x64 * x64) / math.sqrt(2 * math.pi)
    xd = x.to("cuda").view(-1, 64)
    bias = torch.zeros(64, dtype=dtype, device="cuda")

    def run():
        xb, bb = xd.detach().requires_grad_(), bias.detach().requires_grad_()
        y = brrr.bias_gelu(xb, bb)
        y.backward(torch.ones_like(y))
        return y, xb.grad

    y, grad = _under_program(monkeypatch, value, run)
    ulp, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    for name, got, want in (("gelu", y, ref), ("grad", grad, ref_grad)):
        err = (got.detach().reshape(-1).cpu().double() - want).abs()
        bad = ~(err <= ulp * want.abs() + tiny)
        assert not bool(bad.any()), (name, x64[bad][:8].tolist())


def test_glu_with_numpy():
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    y = brrr.swiglu(x)
    a, b = x[:, :4].astype(np.float64), x[:, 4:].astype(np.float64)
    np.testing.assert_allclose(y, a / (1 + np.exp(-a)) * b, rtol=2e-6, atol=2e-6)


def test_glu_errors():
    with pytest.raises(ValueError, match="argument x: the last dim must be even"):
        brrr.swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="argument approximate"):
        brrr.geglu(torch.randn(3, 4), approximate="erf")
    with pytest.raises(ValueError, match=r"argument up has shape \(3, 5\) but gate has shape \(3, 4\)"):
        brrr.swiglu(torch.randn(3, 4), torch.randn(3, 5))


def test_glu_saves_only_its_input():
    saved = []
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = brrr.swiglu(x)
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr()
    y.sum().backward()


def test_glu_opcheck():
    x = torch.randn(4, 10, requires_grad=True)
    torch.library.opcheck(torch.ops.brrr.glu.default, (x, None, "silu"))
    torch.library.opcheck(torch.ops.brrr.glu.default, (x, torch.randn(4, 10, requires_grad=True), "gelu"))


@pytest.mark.parametrize("module", [brrr.nn.SwiGLU, brrr.nn.GeGLU])
def test_modules_name_x_for_a_0d_x_or_an_odd_last_dim(module):
    """As brrr.swiglu and brrr.geglu do (an IndexError from the registry's check, and torch's
    shape error from the reference, before)."""
    with pytest.raises(ValueError, match="^argument x: expected a tensor with at least one dim"):
        module()(torch.tensor(1.0))
    with pytest.raises(ValueError, match="^argument x: the last dim must be even to split into gate and up halves, got 7"):
        module()(torch.randn(4, 7))


@pytest.mark.parametrize("device", DEVICES)
def test_glu_backward_of_a_transposed_gate_has_the_fake_kernels_strides(device):
    """The backward allocated a contiguous gradient for a transposed gate where its fake kernel
    said gate's strides: inductor's compiled backward failed its stride assertion."""
    gate = random((16, 4), torch.float32, device).t()
    up, grad = random((4, 16), torch.float32, device), random((4, 16), torch.float32, device)
    for needs in ([True, False], [True, True]):
        torch.library.opcheck(torch.ops.brrr.glu_backward.default, (gate, up, grad, "silu", needs))
        got = torch.ops.brrr.glu_backward.default(gate, up, grad, "silu", needs)
        assert got[0].stride() == gate.stride()
        g64 = gate.double().requires_grad_()
        assert_close(got[0], torch.autograd.grad(F.silu(g64) * up.double(), g64, grad.double())[0], torch.float32)


def test_registry_sends_what_brrr_cannot_read_to_pytorch():
    """An up, bias, residual or weight that is sparse or a subclass went to brrr's kernel, which
    refused it (naming operands[0]), even with on_unsupported('fallback')."""
    gate, up = torch.randn(4, 8), torch.randn(4, 8)

    class Sub(torch.Tensor):
        pass

    got = brrr.registry("swiglu", gate, up.to_sparse())
    assert got.is_sparse  # as F.silu(gate) * up.to_sparse() is
    torch.testing.assert_close(got.to_dense(), F.silu(gate) * up)
    got = brrr.registry("swiglu", gate, up.as_subclass(Sub))
    assert type(got) is Sub
    torch.testing.assert_close(got.as_subclass(torch.Tensor), F.silu(gate) * up)
    x, w = torch.randn(4, 8), torch.randn(8)
    torch.testing.assert_close(brrr.registry("rms_norm", x, (8,), w.as_subclass(Sub)).as_subclass(torch.Tensor),
                               F.rms_norm(x, (8,), w))
    brrr.registry.on_unsupported("swiglu", "raise")
    try:
        with pytest.raises(brrr.UnsupportedError, match="no brrr kernel"):
            brrr.registry("swiglu", gate, up.to_sparse())
    finally:
        brrr.registry.reset("swiglu")


def test_registry_references_take_approximate_positionally():
    """As brrr's implementations do: the fallback passed it to F.gelu by position (a TypeError)."""
    gate, up = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(brrr.registry("geglu", gate.float(), up, "tanh"), want)  # mixed dtypes: PyTorch's
    torch.testing.assert_close(brrr.registry("geglu", gate, up, "tanh"), want)
    torch.testing.assert_close(brrr.registry("bias_gelu", gate, up[0], "tanh"), F.gelu(gate + up[0], approximate="tanh"))


@pytest.mark.parametrize("name", ["tanh", "relu", "gelu", "silu", "sigmoid", "layer_norm", "rms_norm", "softmax",
                                  "log_softmax"])
def test_registry_takes_the_pytorch_functions_keywords(name):
    """registry(name, input=x), as the function it replaces is called: once the device came from
    keywords too, the checks (which name x otherwise) raised a TypeError; rms_norm's reference
    named its input x, where F.rms_norm names it input."""
    x = torch.randn(4, 8)
    kwargs = {"normalized_shape": (8,)} if name.endswith("norm") else {"dim": -1} if "softmax" in name else {}
    want = brrr.registry.lookup(name).reference(x, **kwargs)
    brrr.registry.on_cpu(name, "kernel")
    try:
        torch.testing.assert_close(brrr.registry(name, input=x, **kwargs), want)
    finally:
        brrr.registry.reset(name)


def test_registry_finds_the_device_of_tensors_passed_by_keyword():
    gate = torch.randn(4, 16)
    brrr.registry.override("swiglu", lambda *args, **kwargs: "override", device="cpu")
    try:
        assert brrr.registry("swiglu", gate=gate) == "override"
    finally:
        brrr.registry.reset("swiglu")
    brrr.registry.on_unsupported("swiglu", "raise")
    try:
        torch.testing.assert_close(brrr.registry("swiglu", gate=gate), F.silu(gate[:, :8]) * gate[:, 8:])
    finally:
        brrr.registry.reset("swiglu")


@pytest.mark.parametrize("device", DEVICES)
def test_split_form_errors_name_the_halves_of_x(device):
    base = torch.randn(17, device=device)
    with pytest.raises(ValueError, match=r"argument out overlaps input x \(up half\)"):
        brrr.swiglu(base[:16], out=base[9:17])
    with pytest.raises(ValueError, match=r"argument out has shape \(4, 9\) but x \(gate half\) has shape \(4, 8\)"):
        brrr.swiglu(torch.randn(4, 16, device=device), out=torch.empty(4, 9, device=device))
    with pytest.raises(ValueError, match=r"^argument x: the last dim must be even"):
        brrr.swiglu(torch.randn(4, 15, device=device))
