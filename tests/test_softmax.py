"""brrr.softmax and brrr.log_softmax: outputs and gradients against float64 PyTorch on fresh random
inputs (every dim, odd row lengths, rows that take each CUDA kernel and each block shape of the
tile and group kernels, every BRRR_SOFTMAX_KERNEL value on every dtype pair, the flat kernel at
the edges of its range with the kernel that ran read from the profiler, strided views,
dtype=), rows with -inf, NumPy, the C op's argument checks, opcheck, torch.compile, the registry,
brrr.nn and torch.nn.functional routing."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import brrr
from brrr import _C
from helpers import DEVICES, DTYPES, TOLERANCE, assert_close, poisoned_like, random

FUNCTIONS = {False: brrr.softmax, True: brrr.log_softmax}


def reference(x, dim, dtype, log):
    """float64 PyTorch on the CPU of x taken as dtype first (as torch does)."""
    x = x.detach().cpu()
    if dtype is not None:
        x = x.to(dtype)
    leaf = x.double().requires_grad_()
    return leaf, (torch.log_softmax if log else torch.softmax)(leaf, dim)


def check_op(x, dim, log, dtype=None, grad_scale=4.0):
    leaf = x.detach().requires_grad_()  # x's own layout: a strided view stays one
    y = FUNCTIONS[log](leaf, dim, dtype=dtype)
    out_dtype = x.dtype if dtype is None else dtype
    assert y.dtype == out_dtype and y.shape == x.shape and y.device == x.device
    ref_leaf, ref = reference(x, dim, dtype, log)
    assert_close(y, ref, out_dtype, scale=4)
    g = random(x.shape, out_dtype, x.device)
    y.backward(g)
    ref.backward(g.double().cpu())
    assert leaf.grad.dtype == x.dtype
    # The gradient's largest terms are O(|g|), with cancellation in the row sums.
    assert_close(leaf.grad, ref_leaf.grad, x.dtype if dtype is None else max(dtype, x.dtype, key=_coarseness),
                 scale=grad_scale * (x.shape[dim] if x.dim() else 1) ** 0.5)
    with torch.no_grad():  # the same bits again (NaN where the row is all -inf)
        again = FUNCTIONS[log](x, dim, dtype=dtype)
        assert torch.equal(again.isnan(), y.isnan()) and torch.equal(again.nan_to_num(), y.detach().nan_to_num())


def _coarseness(dtype):
    return TOLERANCE[dtype]["rtol"]


SHAPES = [(3, 5), (4, 1), (2, 3, 4097), (1, 7), (6, 1024), (2, 8192), (5,), ()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("log", [False, True])
def test_matches_reference(device, dtype, shape, log):
    x = random(shape, dtype, device, -4, 4)
    check_op(x, -1, log)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [0, 1, 2, -2])
@pytest.mark.parametrize("log", [False, True])
def test_every_dim(device, dim, log):
    check_op(random((4, 6, 33), torch.float32, device), dim, log)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("log", [False, True])
def test_dtype_float32_of_half_input(device, dtype, log):
    """dtype=float32 of a half x: a float32 result, as torch gives, and a half gradient."""
    check_op(random((7, 1000), dtype, device), -1, log, dtype=torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("log", [False, True])
def test_dtype_narrowing_and_widening(device, log):
    check_op(random((5, 64), torch.float32, device), -1, log, dtype=torch.float16)
    check_op(random((5, 64), torch.float32, device), 0, log, dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("log", [False, True])
def test_strided_views(device, log):
    base = random((6, 40, 3), torch.float32, device)
    check_op(base[:, ::2, 1], -1, log)        # column stride 3 * 2, row stride 120
    check_op(base.transpose(0, 1)[:, :, 0], 0, log)
    check_op(base[1:5, 3:35:4], 1, log)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [1, 3, 255, 256, 257, 4095, 4096, 4097, 8192, 8200, 16384, 16385, 32768, 40000,
                                  131072, 262144])
def test_row_lengths_around_the_kernel_switches(device, dtype, cols):
    """Contiguous rows that fill 16-byte packs: the tile kernel while a row's inputs take up to
    32 KB, then the shared-memory kernel, over clusters of 2 to 8 blocks on sm_90 from 64 KB
    (float32 backward at 262144 columns: more than 8 blocks hold, the streaming kernel); the
    streaming kernel for the rest."""
    check_op(random((3, cols), dtype, device, -6, 6), -1, False, grad_scale=8.0)
    check_op(random((2, cols), dtype, device, -6, 6), -1, True, grad_scale=8.0)


KERNELS = ["tile", "rows", "smem", "stream", "group", "group1", "group2", "group4", "group8", "flat", "auto"]
# (x's dtype, dtype=): y of x's dtype, and float32 y of half x.
DTYPE_PAIRS = [(torch.float32, None), (torch.float16, None), (torch.bfloat16, None), (torch.float16, torch.float32),
               (torch.bfloat16, torch.float32)]


def check_rows_with_minus_inf(dtypes, cols):
    """Three rows of `cols` columns of x's dtype on the GPU, every third value of the middle one
    -inf: softmax and log_softmax (with dtype= where given) and their gradients against the
    reference."""
    x_dtype, dtype = dtypes
    x = random((3, cols), x_dtype, "cuda", -6, 6)
    x[1, ::3] = float("-inf")
    for log in (False, True):
        check_op(x, -1, log, dtype=dtype, grad_scale=8.0)


def _layout(shape, dtype, layout):
    """A view of random values of rows x cols laid out as named: rows padded (a row stride past
    cols, 16-byte aligned); rows x 2 x cols, whose two row dims do not merge; unaligned (one element
    past a 16-byte boundary, which no kernel's packs take); columns strided."""
    rows, cols = shape
    if layout == "padded":
        return random((rows, cols + 24), dtype, "cuda", -6, 6)[:, 8:cols + 8]
    if layout == "two_row_dims":
        return random((rows, 3, cols), dtype, "cuda", -6, 6)[:, 1:]
    if layout == "unaligned":
        return random((rows * cols + 1,), dtype, "cuda", -6, 6)[1:].view(rows, cols)
    return random((rows, cols, 2), dtype, "cuda", -6, 6)[..., 0]


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("cols", [1, 3, 8, 1000, 1023, 1024, 4096, 4097, 4104, 32768, 262145])
def test_every_kernel_where_it_applies(monkeypatch, kernel, dtypes, cols):
    """BRRR_SOFTMAX_KERNEL picks a kernel where it applies (else the streaming kernel): each against
    the reference for every dtype pair, on rows that the default choice would give to another, odd
    lengths (no packs: the streaming kernel) and rows that leave a group kernel's last packs
    empty, -inf included."""
    monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", kernel)
    check_rows_with_minus_inf(dtypes, cols)


@pytest.mark.cuda
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, None), (torch.float16, torch.float32)], ids=str)
@pytest.mark.parametrize("cols", [5000, 40000, 65544, 131080, 262152])
def test_smem_kernel_clusters(monkeypatch, dtypes, cols):
    """The shared-memory kernel on clusters of 1, 2, 4 and 8 blocks (a forward's half row of 5000,
    40000, 65544 and 131080 columns) and past 8 (262152: slices over 64 KB), the last block's slice
    short, its forward's four load groups uneven, -inf in a row."""
    monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", "smem")
    check_rows_with_minus_inf(dtypes, cols)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["padded", "two_row_dims", "unaligned", "strided"])
@pytest.mark.parametrize("cols", [64, 4096])
def test_every_kernel_on_views(monkeypatch, kernel, dtype, layout, cols):
    """Each kernel's row offsets (padded rows, rows over two dims) and the fallback of unaligned
    and column-strided views to the streaming kernel."""
    monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", kernel)
    x = _layout((5, cols), dtype, layout)
    for log in (False, True):
        check_op(x, -1, log, grad_scale=8.0)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [8, 512, 4096])
def test_every_kernel_on_rows_of_minus_inf(monkeypatch, kernel, dtype, cols):
    """A row all -inf gives NaN throughout, as torch does, and leaves the other rows of its block
    as they are alone."""
    monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", kernel)
    x = random((9, cols), dtype, "cuda", -6, 6)
    x[4] = float("-inf")
    x[6, 1:] = float("-inf")
    for log in (False, True):
        y = FUNCTIONS[log](x, -1)
        ref = (torch.log_softmax if log else torch.softmax)(x.double().cpu(), -1)
        assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref)) and torch.equal(torch.isinf(y.cpu()), torch.isinf(ref))
        finite = torch.isfinite(ref)
        assert_close(y.cpu().double()[finite], ref[finite], dtype, scale=4)
        assert torch.equal(FUNCTIONS[log](x[5:].clone(), -1), y[5:])


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["group", "group1", "group2", "group4", "group8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [8, 256, 264, 1024, 2048, 2056, 8192, 16384, 32768, 65544, 131072, 262144])
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_group_kernel_groups_and_rows_per_block(monkeypatch, kernel, dtype, cols, rows):
    """The group kernel gives a row a group of 1 to 32 warps and a block up to 8 rows of one warp,
    or past 512 threads a cluster of 2 to 8 blocks (sm_90): row counts that leave the last block
    part-filled, rows that leave a group's (or a cluster's last blocks') packs empty, rows past 8
    blocks of 1024 threads (the streaming kernel). Each row's result must not depend on its
    neighbours in the block."""
    monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", kernel)
    x = random((rows, cols), dtype, "cuda", -6, 6)
    x[0, ::5] = float("-inf")
    for log in (False, True):
        check_op(x, -1, log, grad_scale=8.0)
        alone = FUNCTIONS[log](x[rows - 1:].clone(), -1)
        assert torch.equal(FUNCTIONS[log](x, -1)[rows - 1:], alone)


def _kernel_names(fn):
    """The names of the CUDA kernels that fn() launches, from the profiler's device events
    (demangled: "void brrr::softmax::softmax_flat_kernel<float, float, false, 4>(...)")."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name() for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA and not e.is_user_annotation()]


def _flat_applies(kernel, x_dtype, y_dtype, cols, backward):
    """Whether BRRR_SOFTMAX_KERNEL=kernel runs its flat kernel on contiguous 16-byte aligned rows
    (docs/kernel-switches.md): P values a 16-byte pack of the wider dtype, up to 32 of them a thread
    forward and 4 packs backward, in at most 1024 threads; flat1-flat8 at that many packs a thread."""
    p = 16 // max(x_dtype.itemsize, y_dtype.itemsize)
    most = 4 if backward else 32 // p
    per = int(kernel.removeprefix("flat") or 0)
    return cols % p == 0 and (per or most) <= most and cols // p <= 1024 * (per or most)


def _flat_ran(names, backward):
    """Whether names (_kernel_names) hold softmax_flat_kernel, forward or backward (its third
    template argument)."""
    name = "softmax_flat_kernel<"
    return any(n.split(name, 1)[1].split(",")[2].strip() == str(backward).lower() for n in names if name in n)


# The flat kernel's values: its own layouts on every dtype pair, those of a set number of packs a
# thread on float32 and bfloat16.
FLAT_CASES = ([("flat", d) for d in DTYPE_PAIRS]
              + [(k, d) for k in ("flat1", "flat2", "flat4", "flat8")
                 for d in [(torch.float32, None), (torch.bfloat16, None)]])


@pytest.mark.cuda
@pytest.mark.parametrize("kernel, dtypes", FLAT_CASES, ids=str)
@pytest.mark.parametrize("cols", [8, 264, 1001, 4104, 8192, 8200, 16384, 16392, 32768, 32776])
def test_flat_kernel_at_the_edges_of_its_range(monkeypatch, kernel, dtypes, cols):
    """The flat kernels at each edge of their range: groups of 32 threads (4 rows a block) and 64,
    rows that leave a thread's last packs empty, odd rows (no packs), the largest rows of each
    packs-a-thread value forward and backward and just past them, where they fall back to the
    default choice; -inf included. The profiler's kernel names say which kernel ran, so that a
    fallback where a flat kernel should run (or the reverse) fails. Each row's result must not
    depend on its neighbours in the block."""
    monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", kernel)
    x_dtype, dtype = dtypes
    x = random((5, cols), x_dtype, "cuda", -6, 6)
    x[0, ::5] = float("-inf")
    for log in (False, True):
        check_op(x, -1, log, dtype=dtype, grad_scale=8.0)
        alone = FUNCTIONS[log](x[4:].clone(), -1, dtype=dtype)
        assert torch.equal(FUNCTIONS[log](x, -1, dtype=dtype)[4:], alone)
    leaf = x.detach().requires_grad_()

    def step():
        y = brrr.softmax(leaf, -1, dtype=dtype)
        y.backward(torch.ones_like(y))  # a contiguous gradient, which the flat kernels take

    names = _kernel_names(step)
    for back in (False, True):
        assert _flat_ran(names, back) == _flat_applies(kernel, x_dtype, dtype or x_dtype, cols, back), (
            names, back)


@pytest.mark.cuda
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("cols", [1024, 4096, 4100, 16384, 16392, 32768])
@pytest.mark.parametrize("env", [None, "auto"])
def test_default_takes_the_flat_kernel(monkeypatch, dtypes, cols, env):
    """Unset (or auto), the flat kernel runs wherever it applies (_flat_applies) but for 16-bit
    inputs past 16384 columns and 32-bit inputs of 4097-16384 (the forward's x, the backward's y
    and grad_y), and the result is right either way."""
    if env is None:
        monkeypatch.delenv("BRRR_SOFTMAX_KERNEL", raising=False)
    else:
        monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", env)
    x_dtype, dtype = dtypes
    y_dtype = dtype or x_dtype
    x = random((3, cols), x_dtype, "cuda", -6, 6)
    check_op(x, -1, False, dtype=dtype, grad_scale=8.0)
    leaf = x.detach().requires_grad_()

    def step():
        y = brrr.softmax(leaf, -1, dtype=dtype)
        y.backward(torch.ones_like(y))

    names = _kernel_names(step)
    for back, input_dtype in ((False, x_dtype), (True, y_dtype)):
        want = (_flat_applies("flat", x_dtype, y_dtype, cols, back)
                and not (input_dtype.itemsize == 2 and cols > 16384)
                and not (input_dtype.itemsize == 4 and 4096 < cols <= 16384))
        assert _flat_ran(names, back) == want, (names, back)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["padded", "two_row_dims", "unaligned", "strided"])
def test_flat_kernel_takes_padded_rows_and_leaves_other_views(monkeypatch, dtype, layout):
    """Rows at a row stride past their columns (16-byte aligned) take the flat kernel; rows over two
    dims, unaligned rows and strided columns fall back to the default choice."""
    monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", "flat")
    x = _layout((5, 4096), dtype, layout)
    check_op(x, -1, False, grad_scale=8.0)
    names = _kernel_names(lambda: brrr.softmax(x, -1))
    assert any("softmax_flat_kernel<" in n for n in names) == (layout == "padded"), names


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [8, 1024, 1028, 2048, 2052, 2056, 4096, 4100, 4104, 8192, 8196, 8200, 16384])
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_tile_kernel_rows_per_block(monkeypatch, dtype, cols, rows):
    """The tile kernel puts 4, 2 or 1 rows in a block as a row's inputs take up to 8, 16 or 32 KB
    (forward: x; backward: y and grad_y; float32 and bfloat16 switch at different columns): rows
    at each side of every switch, in numbers that leave the last block part-filled, -inf
    included. Each row's result must not depend on its neighbours in the block."""
    monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", "tile")
    x = random((rows, cols), dtype, "cuda", -6, 6)
    x[0, ::5] = float("-inf")
    for log in (False, True):
        check_op(x, -1, log, grad_scale=8.0)
        alone = FUNCTIONS[log](x[rows - 1:].clone(), -1)
        assert torch.equal(FUNCTIONS[log](x, -1)[rows - 1:], alone)


@pytest.mark.parametrize("device", DEVICES)
def test_minus_inf_and_all_minus_inf_rows(device):
    x = random((3, 9), torch.float32, device)
    x[0, 2] = float("-inf")
    x[1] = float("-inf")  # torch: NaN everywhere in that row
    for log in (False, True):
        y = FUNCTIONS[log](x, -1)
        ref = (torch.log_softmax if log else torch.softmax)(x.double().cpu(), -1)
        assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref)) and torch.equal(torch.isinf(y.cpu()), torch.isinf(ref))
        finite = torch.isfinite(ref)
        torch.testing.assert_close(y.cpu().double()[finite], ref[finite], rtol=1e-5, atol=1e-6)


def test_numpy():
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        x = rng.standard_normal((4, 7, 5)).astype(dtype)
        for dim in (0, 1, -1):
            for log in (False, True):
                y = FUNCTIONS[log](x, dim)
                assert type(y) is np.ndarray and y.dtype == dtype
                ref = reference(torch.from_numpy(x), dim, None, log)[1].detach().numpy()
                np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    y = brrr.softmax(rng.standard_normal((3, 4)).astype(np.float32), dtype=np.float64)
    assert y.dtype == np.float64


def test_c_op_writes_every_element_in_place_and_checks_its_arguments():
    x = random((5, 12), torch.float32, "cpu")
    out = poisoned_like(x)
    assert _C.softmax_fwd(x, out, log=False)[0] is out
    assert_close(out, torch.softmax(x.double(), -1))
    y = x.clone()
    _C.softmax_fwd(y, y, log=True)  # in place: each row is read before it is written
    assert_close(y, torch.log_softmax(x.double(), -1))
    g = random((5, 12), torch.float32, "cpu")
    grad = poisoned_like(x)
    _C.softmax_bwd(out, g, grad, log=False)
    leaf = x.double().requires_grad_()
    torch.softmax(leaf, -1).backward(g.double())
    assert_close(grad, leaf.grad, scale=4)
    wide = torch.empty(5, 12)
    _C.softmax_fwd(x.bfloat16(), wide, log=False)
    with pytest.raises(ValueError, match="argument out: dtype float16 does not go with x of dtype float32"):
        _C.softmax_fwd(x, torch.empty(5, 12, dtype=torch.float16), log=False)
    with pytest.raises(ValueError, match="argument grad_x: dtype float64 does not go with y of dtype float32"):
        _C.softmax_bwd(out, g, torch.empty(5, 12, dtype=torch.float64), log=False)
    with pytest.raises(ValueError, match="argument grad_y has shape"):
        _C.softmax_bwd(out, g[:4], log=False)
    with pytest.raises(ValueError, match="argument out overlaps input x"):
        _C.softmax_fwd(x[:4], x.as_strided((4, 12), (12, 1), 1), log=False)
    with pytest.raises(TypeError, match="argument log: expected a bool"):
        _C.softmax_fwd(x, log=1)
    with pytest.raises(TypeError, match="missing argument 'log'"):
        _C.softmax_fwd(x)


def test_public_argument_errors():
    x = torch.randn(3, 4)
    for log in (False, True):
        fn = brrr.log_softmax if log else brrr.softmax
        for bad in (2, -3):  # both the IndexError torch raises and the ValueError of docs/errors.md
            with pytest.raises(IndexError, match=f"^argument dim: {bad} is out of range") as raised:
                fn(x, bad)
            assert isinstance(raised.value, ValueError)
        with pytest.raises(TypeError, match="^argument dim: expected an int"):
            fn(x, 1.0)
        with pytest.raises(TypeError, match="^argument x: expected a tensor or array"):
            fn([1.0, 2.0])
        for dim in (0, 1):
            with pytest.raises(TypeError, match="^argument dtype: expected a torch.dtype or None, got str"):
                fn(x, dim, "float32")
            with pytest.raises(ValueError, match="^argument dtype: expected float32, .* got int64"):
                fn(x, dim, torch.int64)
        # a NumPy array's dtype argument, converted by NumPy: the same rule
        with pytest.raises(ValueError, match="^argument dtype: expected float32, .* got int32"):
            fn(x.numpy(), -1, np.int32)
        with pytest.raises(TypeError, match="^argument dtype: .*not understood"):
            fn(x.numpy(), -1, "no such dtype")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device):
    for args in [(random((3, 10), torch.float32, device).requires_grad_(), 1, None, False),
                 (random((4, 3, 5), torch.bfloat16, device).requires_grad_(), 0, torch.float32, True)]:
        torch.library.opcheck(torch.ops.brrr.softmax.default, args)
    x = random((4, 33), torch.float32, device).requires_grad_()
    compiled = torch.compile(lambda t: brrr.log_softmax(t, -1).exp().sum(), fullgraph=True, backend="aot_eager")
    compiled(x).backward()
    leaf = x.detach().clone().requires_grad_()
    torch.log_softmax(leaf, -1).exp().sum().backward()
    torch.testing.assert_close(x.grad, leaf.grad, rtol=1e-5, atol=1e-6)


def test_double_backward_is_refused():
    x = torch.randn(3, 5, requires_grad=True)
    (g,) = torch.autograd.grad(brrr.softmax(x, -1).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_registry_nn_and_functional_routing():
    x = torch.randn(4, 9, requires_grad=True)
    for name, module, fn in [("softmax", brrr.nn.Softmax(dim=1), F.softmax),
                             ("log_softmax", brrr.nn.LogSoftmax(dim=1), F.log_softmax)]:
        calls = []
        brrr.registry.override(name, lambda *args, **kwargs: calls.append(args) or fn(*args, **kwargs))
        try:
            expected = fn(x, 1)
            torch.testing.assert_close(module(x), expected)
            with brrr.use_fused():
                torch.testing.assert_close(F.softmax(x, 1) if name == "softmax" else F.log_softmax(x, 1), expected)
            assert len(calls) == 2
        finally:
            brrr.registry.reset(name)
        torch.testing.assert_close(brrr.registry(name, x, 1), expected)
    model = torch.nn.Sequential(torch.nn.Linear(9, 9), torch.nn.Softmax(dim=-1))
    report = brrr.patch(model)
    assert isinstance(model[1], brrr.nn.Softmax), report
    assert brrr.registry("softmax", x, None) is not None  # the legacy implicit dim: PyTorch's


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("log", [False, True])
def test_outputs_are_contiguous_as_torchs(device, log):
    """softmax over a dim other than the last, or of a transposed x, returns a contiguous tensor as
    torch.softmax does (a view of the moved dims was returned, and .view() failed on it), and so
    is the gradient; values and gradients as torch's."""
    fn, theirs = (brrr.log_softmax, torch.log_softmax) if log else (brrr.softmax, torch.softmax)
    for x, dim in [(random((4, 6, 5), torch.float32, device), 0), (random((6, 4), torch.float32, device).t(), 0),
                   (random((6, 4), torch.float32, device).t(), -1)]:
        for dtype in (None, torch.float64):
            x = x.detach().requires_grad_()
            y, expected = fn(x, dim, dtype=dtype), theirs(x, dim, dtype=dtype)
            assert y.is_contiguous() and y.stride() == expected.stride(), (dim, dtype)
            y.view(-1)
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
            g = torch.randn_like(y)
            (grad,), (want,) = torch.autograd.grad(y, x, g), torch.autograd.grad(expected, x, g)
            torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device, kernel", [("cpu", None)] + [pytest.param("cuda", k, marks=pytest.mark.cuda)
                                                               for k in [None] + KERNELS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("cols", [1000, 4097, 40000])
def test_log_softmax_of_rows_far_from_zero(monkeypatch, device, kernel, dtype, cols):
    """Rows of 1e4 + randn: (x - max) - log(sum) keeps log_softmax within a few ulps of its result,
    where the CUDA kernels' x - (max + log(sum)) lost about half an ulp of the max (4.7e-4 in
    float32, 60 times torch's error)."""
    if kernel is not None:
        monkeypatch.setenv("BRRR_SOFTMAX_KERNEL", kernel)
    x = 1e4 + torch.randn(8, cols, dtype=dtype, device=device)
    want = torch.log_softmax(x.double(), -1)
    bound = 8 * torch.finfo(dtype).eps * want.abs().max()
    assert (brrr.log_softmax(x, -1).double() - want).abs().max() <= bound


def test_routing_leaves_to_torch_what_it_refuses_or_brrr_cannot_take():
    """Under use_fused, F.softmax with dim=True raises as torch does (bool is not an int to torch),
    and a view of more dims than brrr's kernels take (17 that do not merge) is computed by torch."""
    x = torch.randn(2, 3)
    with brrr.use_fused(), pytest.raises(TypeError, match="must be int, not bool"):
        F.softmax(x, True)
    many = torch.randn([2] * 18)[..., 0]  # 17 dims, every stride a different power of two
    many = many.as_strided(many.shape, [2 ** (17 - d) for d in range(17)])
    want = F.softmax(many, 3)
    with brrr.use_fused():
        torch.testing.assert_close(F.softmax(many, 3), want, rtol=0, atol=0)
        torch.testing.assert_close(brrr.nn.Softmax(3)(many), want, rtol=0, atol=0)
