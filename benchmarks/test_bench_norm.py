"""LayerNorm and RMSNorm against PyTorch eager and torch.compile, in one run.

GPU: rows x hidden = 16384 x {768, 1024, 4096, 8192, 16384}, bfloat16 and float32, forward (no
grad) and forward+backward (torch.autograd.grad for x, weight and bias, so no .grad accumulation
pass is timed), plus the fused residual forms at hidden 4096. CPU, or BRRR_BENCH_QUICK=1: a quick
smoke version of a few seconds, without torch.compile.

bytes_moved is the fewest bytes a pass must move, the floor being those bytes at the copy
bandwidth measured in the same run: forward reads x and writes y (2 passes over rows x hidden),
forward+backward also reads x and dy and writes dx (5 passes); the fused forms read x and the
residual and write y and h (4), and their backward reads h, dy and dh and writes dx (8 in all).
The parameters and their gradients are counted too. brrr's results are checked against eager,
and its rows against the float64 reference of tests/test_norm.py, before anything is timed.
"""

import os

import pytest
import torch
import torch.nn.functional as F

import brrr
from harness import compiled, device, on_gpu, time_ms
from test_norm import check, reference

QUICK = not on_gpu() or os.environ.get("BRRR_BENCH_QUICK") == "1"
ROWS = 16384 if not QUICK else 64
HIDDEN = [768, 1024, 4096, 8192, 16384] if not QUICK else [256]
FUSED_HIDDEN = 4096 if not QUICK else 256
DTYPES = [torch.bfloat16, torch.float32]
MAX_TIME_S = 2.0 if not QUICK else 0.1
EPS = 1e-6
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative error (norm) of brrr against eager


def _ops(op, hidden):
    """(brrr, eager, parameter count, passes fwd, passes fwd+bwd) for one op."""
    ns = (hidden,)
    if op == "layer_norm":
        return (lambda x, w, b: brrr.layer_norm(x, ns, w, b, EPS),
                lambda x, w, b: F.layer_norm(x, ns, w, b, EPS), 2, 2, 5)
    if op == "rms_norm":
        return (lambda x, w: brrr.rms_norm(x, ns, w, EPS), lambda x, w: F.rms_norm(x, ns, w, EPS), 1, 2, 5)
    if op == "add_layer_norm":
        def eager_add_layer_norm(x, r, w, b):
            h = x + r
            return F.layer_norm(h, ns, w, b, EPS), h

        return lambda x, r, w, b: brrr.add_layer_norm(x, r, ns, w, b, EPS), eager_add_layer_norm, 2, 4, 8

    def eager_add_rms_norm(x, r, w):
        h = x + r
        return F.rms_norm(h, ns, w, EPS), h

    return lambda x, r, w: brrr.add_rms_norm(x, r, ns, w, EPS), eager_add_rms_norm, 1, 4, 8


def _outputs(y):
    return list(y) if isinstance(y, (tuple, list)) else [y]


def _agree(ours, theirs, dtype, what):
    for a, b in zip(ours, theirs):
        err = ((a.float() - b.float()).norm() / max(b.float().norm().item(), 1e-30)).item()
        assert err < TOL[dtype], f"{what}: brrr disagrees with eager, relative error {err:.2e}"


def _check_rows_against_reference(kind, fn, inputs, n_params, dtype):
    """The first rows through brrr against the float64 reference (rows are independent)."""
    head = [t[:8] for t in inputs[:len(inputs) - n_params]]
    params = inputs[len(inputs) - n_params:]
    with torch.no_grad():
        ours = _outputs(fn(*head, *params))
    refs = [t.detach().to("cpu", torch.float64) for t in (*head, *params)]
    residual = refs[1] if len(head) == 2 else None
    weight = refs[len(head)]
    bias = refs[len(head) + 1] if n_params == 2 else None
    expected, _ = reference(kind, dtype, refs[0], residual, (inputs[0].shape[-1],), weight, bias, EPS)
    check("out", ours[0], expected, dtype)


def _grad_step(fn, inputs, grads):
    def step():
        return torch.autograd.grad(_outputs(fn(*inputs)), inputs, grads)
    return step


def _bench(recorder, op, dtype, hidden):
    ours, eager, n_params, fwd_passes, all_passes = _ops(op, hidden)
    n_act = 2 if op.startswith("add_") else 1
    acts = [torch.randn(ROWS, hidden, device=device(), dtype=dtype, requires_grad=True) for _ in range(n_act)]
    params = [torch.randn(hidden, device=device(), dtype=dtype, requires_grad=True) for _ in range(n_params)]
    inputs = acts + params
    with torch.no_grad():
        grads = [torch.randn_like(y) for y in _outputs(eager(*inputs))]
    _check_rows_against_reference(op.removeprefix("add_"), ours, inputs, n_params, dtype)
    impls = {"brrr": ours, "eager": eager, "compile": None if QUICK else compiled(eager)}
    unit = ROWS * hidden * acts[0].element_size()  # one pass over a rows x hidden tensor
    param_bytes = hidden * params[0].element_size()  # one parameter vector
    expected = _grad_step(eager, inputs, grads)()
    with torch.no_grad():
        expected_out = _outputs(eager(*inputs))
    for impl, fn in impls.items():
        if fn is None:
            continue
        with torch.no_grad():
            _agree(_outputs(fn(*inputs)), expected_out, dtype, f"{op} {impl} forward")
            fwd_ms = time_ms(lambda: fn(*inputs), max_time_s=MAX_TIME_S)
        step = _grad_step(fn, inputs, grads)
        _agree(step(), expected, dtype, f"{op} {impl} gradients")
        common = dict(family="norm", op=op, dtype=dtype, shape=(ROWS, hidden), impl=impl)
        # parameters: read forward; the weight read again and every gradient written backward
        recorder.add_timing(pass_="fwd", ms=fwd_ms, bytes_moved=fwd_passes * unit + n_params * param_bytes, **common)
        recorder.add_timing(pass_="fwd+bwd", ms=time_ms(step, max_time_s=MAX_TIME_S),
                            bytes_moved=all_passes * unit + (2 * n_params + 1) * param_bytes, **common)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm(recorder, op, dtype, hidden):
    _bench(recorder, op, dtype, hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_fused_residual_norm(recorder, op, dtype):
    _bench(recorder, op, dtype, FUSED_HIDDEN)
