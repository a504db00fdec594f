"""Fuzzing brrr as a hostile caller would, on a fixed budget in CI:

- forged DLPack producers: every attribute brrr reads (the C exchange table, __dlpack_device__,
  __dlpack__ and the capsule's fields) of the wrong type, lying, or raising, in every argument
  position of three entry points;
- PyTorch views with the lazy negative bit, strided views and mixed frameworks (a NumPy array, a
  list or a Python number next to a torch tensor) in every argument of every op, with gradients;
- second derivatives of every op.

Each case is either computed right (against a float64 reference, gradients too) or refused with
a one-line TypeError, ValueError, BufferError (or the producer's own exception) whose message
starts with the argument's name; every capsule brrr takes is deleted exactly once; outputs of
refused calls are untouched. BRRR_FUZZ_EXAMPLES=N runs N random cases per test instead of the
fixed CI set (--hypothesis-show-statistics prints how they ended); test_fuzz_does_not_leak then
runs N rounds too."""

import gc
import os
import re
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import brrr
from brrr import _C
from dlpack_producers import ExchangeTable, RawProducer
from op_table import OPS, OPS_BY_NAME

CAMPAIGN = "BRRR_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("BRRR_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not CAMPAIGN,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
REFUSALS = (TypeError, ValueError, BufferError)
CUDA_BUILD = _C.build_info()["cuda_compiled"]
REFUSED_TWICE = "differentiate twice brrr's|has no derivative"


def assert_refusal(error, names):
    """One line, naming one of the arguments `names`."""
    text = str(error)
    assert len(text.splitlines()) == 1, text
    assert re.match(r"argument (" + "|".join(map(re.escape, names)) + r")(?![\w\[])", text), text


# ---- forged DLPack producers ----------------------------------------------------------------------

class Raising:
    def __get__(self, instance, owner):
        raise RuntimeError("descriptor failed")


TABLES = {  # what __dlpack_c_exchange_api__ holds (made when drawn): brrr must ignore every one
    "int": lambda: 1234, "huge int": lambda: 2**80, "str": lambda: "x", "None": lambda: None, "float": lambda: 0.5,
    "object": object, "raising": Raising, "wrong capsule": lambda: ExchangeTable(name=b"not_a_tensor"),
    "version 2": lambda: ExchangeTable(major=2), "incomplete": lambda: ExchangeTable(complete=False),
}
DEVICES = {  # what __dlpack_device__ returns (a callable: raises)
    "right": (1, 0), "lying cuda": (2, 0), "lying id": (2, 3), "list": [1, 0], "str": "cpu", "short": (1,),
    "long": (1, 0, 0), "float": (1.0, 0), "bool": (True, 0), "huge": (1, 2**80), "negative huge": (-2**40, 0),
    "None": None, "raises": ValueError("device failed"),
}
EXPORTS = ["versioned", "legacy", "legacy only", "used capsule", "int", "None", "str", "raises", "wrong name"]
CAPSULE_FIELDS = st.fixed_dictionaries({
    "major": st.sampled_from([1] * 6 + [0, 2]),
    "flags": st.sampled_from([0, 0, 1, 2, 3, 4]),
    "device_type": st.sampled_from([1] * 6 + [2, 3, 4, 13]),
    "device_id": st.sampled_from([0, 0, 1, -1]),
    "dtype": st.sampled_from([(2, 32, 1)] * 9 + [(2, 64, 1), (0, 64, 1), (2, 32, 2), (5, 64, 1), (6, 8, 1),
                                                 (2, 16, 1), (9, 8, 1), (2, 0, 1), (2, 32, 0)]),
    "null_strides": st.sampled_from([False] * 9 + [True]),
    "null_shape": st.sampled_from([False] * 9 + [True]),
    # a claimed layout (shape, strides) instead of the array's: none that reads outside it
    "layout": st.sampled_from([None] * 14 + [((-1,), (1,)), ((2**62, 4), (4, 1)), ((0,), (1,)), ((3, 0), (0, 1)),
                                            ((11,), (2**62,)), ((11,), (-2**63,)), ((11,), (0,))]),
})

SANE_FIELDS = dict(major=1, flags=0, device_type=1, device_id=0, dtype=(2, 32, 1), null_strides=False,
                   null_shape=False, layout=None)


class Forged:
    """A producer of `array` whose attributes misbehave as drawn. `raw` lists the ctypes-built
    producers behind its capsules, which count their deleter calls."""

    def __init__(self, array, device, export, fields):
        self.array, self.device, self.export, self.fields = array, device, export, fields
        self.raw = []
        if export == "used capsule":  # one brrr has consumed already, handed out again
            raw = self._raw(b"dltensor_versioned", reuse_capsule=True)
            _C.chain_fwd(raw, np.empty(raw.array.shape, np.float32), COS, ())
            self.used = raw.capsule

    def _raw(self, name, **extra):
        fields = dict(self.fields, capsule_name=name, **extra)
        shape, strides = fields.pop("layout") or (None, None)
        self.raw.append(RawProducer(self.array, shape=shape, strides=strides, **fields))
        return self.raw[-1]

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        kind = self.export
        if kind == "legacy only" and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        if kind in ("versioned", "wrong name"):
            return self._raw(b"not_a_tensor" if kind == "wrong name" else b"dltensor_versioned").__dlpack__()
        if kind == "used capsule":
            return self.used
        if kind in ("legacy", "legacy only"):
            return self.array.__dlpack__()
        if kind == "raises":
            raise RuntimeError("export failed")
        return {"int": 42, "None": None, "str": "dltensor"}[kind]

    def __dlpack_device__(self):
        if isinstance(self.device, Exception):
            raise self.device
        return self.device


def forged(table, array, device, export, fields):
    """A Forged instance of a new type, whose __dlpack_c_exchange_api__ is TABLES[table] (none
    for "absent")."""
    attrs = {}
    if table != "absent":
        value = TABLES[table]()
        attrs["__dlpack_c_exchange_api__"] = value.capsule if isinstance(value, ExchangeTable) else value
        attrs["_table"] = value  # a forged table outlives its capsule's use
    return type("Forged", (Forged,), attrs)(array, device, export, fields)


def sane(fields):
    return (fields["major"] == 1 and fields["dtype"] == (2, 32, 1) and fields["device_type"] == 1 and
            not fields["null_strides"] and not fields["null_shape"] and fields["layout"] is None)


COS = brrr.chain("cos").program
ENTRY_POINTS = {  # call(arguments, the forged producer in its position)
    "chain x": lambda a, f: _C.chain_fwd(f, a["out"], COS, ())[0],
    "chain out": lambda a, f: _C.chain_fwd(a["x"], f, COS, ())[0],
    "chain operand": lambda a, f: _C.chain_fwd(a["x"], a["out"], brrr.chain("add_tensor", "cos").program, (f,))[0],
    "norm weight": lambda a, f: _C.layer_norm_fwd(a["x"], f, out=a["out"], norm_ndim=1, eps=1e-5)[0],
}
# the forged argument, and the arguments checked against it (a mismatch names the one checked)
NAMES = {"chain x": ["x", "out"], "chain out": ["out"], "chain operand": ["operands[0]"], "norm weight": ["weight"]}


@FUZZ
@given(st.sampled_from(sorted(ENTRY_POINTS)), st.one_of(st.just("absent"), st.sampled_from(sorted(TABLES))),
       st.one_of(st.just("right"), st.sampled_from(sorted(DEVICES))),
       st.one_of(st.sampled_from(["versioned", "legacy"]), st.sampled_from(EXPORTS)), CAPSULE_FIELDS, st.integers(1, 9))
def test_fuzz_forged_producers(entry, table, device, export, fields, n):
    rng = np.random.default_rng(n)
    weight = entry == "norm weight"
    x = rng.uniform(-2, 2, (3, n)).astype(np.float32)
    value = (rng.uniform(-2, 2, n) if weight else rng.uniform(-2, 2, (3, n))).astype(np.float32)
    out = np.zeros((3, n), np.float32)
    args = {"x": x, "out": out}
    if entry == "chain x":
        value = x
    elif entry == "chain out":
        value = out
    if export == "used capsule":
        fields = dict(fields, **SANE_FIELDS)  # a capsule brrr takes, the first time
    # A producer that says, consistently, that host memory is on a GPU: brrr would hand the
    # pointer to a CUDA kernel, which no check can tell from device memory. A build without CUDA
    # refuses it; in a CUDA build the case is not drawn.
    on_cuda = DEVICES[device] in ((2, 0), (2, 3)) and (fields["device_type"], fields["device_id"]) == DEVICES[device] \
        and export in ("versioned", "used capsule")
    assume(not (on_cuda and CUDA_BUILD))
    producer = forged(table, value, DEVICES[device], export, fields)
    valid = device == "right" and (export in ("legacy", "legacy only") or (export == "versioned" and sane(fields)
                                                                       and not (entry == "chain out" and fields["flags"] & 3)))
    snapshot = x.copy()
    try:
        result = ENTRY_POINTS[entry](args, producer)
    except (*REFUSALS, RuntimeError) as error:
        assert not valid, f"a valid producer was refused: {error}"
        if isinstance(error, RuntimeError):  # the producer's own exception, named, or no CUDA here
            assert "failed" in str(error) or on_cuda and "has no CUDA kernels" in str(error), error
        assert_refusal(error, NAMES[entry])
        event(f"refused: {type(error).__name__}")
        if entry != "chain out":
            assert not out.any(), "a refused call wrote its output"
    else:
        assert valid, "a broken producer was taken"
        event("computed")
        if entry == "chain out":
            result = out
        x64 = torch.from_numpy(x).double()
        expected = {"chain x": lambda: x64.cos(), "chain out": lambda: x64.cos(),
                    "chain operand": lambda: (x64 + torch.from_numpy(value)).cos(),
                    "norm weight": lambda: torch.nn.functional.layer_norm(x64, (n,), torch.from_numpy(value).double()),
                    }[entry]().numpy()
        np.testing.assert_allclose(np.asarray(result, np.float64), expected, rtol=1e-5, atol=1e-5)
    assert np.array_equal(x, snapshot)
    for raw in producer.raw:  # every capsule brrr took is deleted once; the others stay the producer's
        assert raw.deleted <= raw.exported <= 1 + (export == "used capsule"), (raw.deleted, raw.exported)


# ---- torch views with lazy flags, strided views and mixed frameworks, with gradients -----------

FORMS = ["plain", "plain", "negative bit", "strided", "numpy", "list", "float"]


def in_form(t, form):
    """t as a tensor of another form with the same values (or another framework's object)."""
    if form == "negative bit":
        return torch.complex(torch.zeros_like(t), -t).conj().imag
    if form == "strided":  # every other element of a buffer twice as long in the last dim
        view = torch.empty(*t.shape, 2, dtype=t.dtype)[..., 0]
        view.copy_(t)
        return view
    if form == "numpy":
        return t.detach().numpy()
    if form == "list":
        return t.tolist()
    if form == "float":
        return 0.5
    return t


@FUZZ
@given(st.sampled_from([op.name for op in OPS]), st.sampled_from([torch.float32, torch.float64]),
       st.lists(st.sampled_from(FORMS), min_size=4, max_size=4), st.lists(st.booleans(), min_size=4, max_size=4))
def test_fuzz_torch_views_and_mixed_frameworks(op, dtype, forms, grads):
    op = OPS_BY_NAME[op]
    args = op.make(dtype, "cpu")
    first = op.floats[0]
    leaves = {}
    for name, form, grad in zip(op.floats, forms, grads):
        grad = grad and form in ("plain", "negative bit", "strided") and name not in ("cos", "sin")
        if grad:  # a leaf behind the view, so that its gradient is checked
            leaves[name] = args[name].clone().requires_grad_()
            args[name] = in_form(leaves[name], form)
        else:
            args[name] = in_form(args[name], form)
    foreign = [n for n, f in zip(op.floats, forms) if f in ("list", "float") or (f == "numpy" and n != first)]
    if forms[0] == "numpy":  # the NumPy path: no autograd there, and no torch tensor taken beside x
        foreign = [n for n, f in zip(op.floats, forms) if f in ("list", "float", "plain", "negative bit", "strided")]
        leaves = {}
    try:
        result = op.call(args)
    except REFUSALS as error:
        assert foreign, f"{op.name} refused {dict(zip(op.floats, forms))}: {error}"
        assert isinstance(error, TypeError), error
        assert_refusal(error, foreign)
        event("refused")
        return
    assert not foreign, f"{op.name} took {foreign}"
    event("computed" + (" with gradients" if leaves else ""))
    results = result if isinstance(result, tuple) else (result,)
    values = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    values.update({k: v.detach() for k, v in leaves.items()})
    values = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in values.items()}
    for k, leaf in leaves.items():
        values[k] = leaf.detach().double().requires_grad_()
    expected = op.reference(values)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for got, want in zip(results, expected):
        got = torch.from_numpy(got) if isinstance(got, np.ndarray) else got
        torch.testing.assert_close(got.detach().double(), want.detach(), rtol=1e-5, atol=1e-5)
    if leaves:
        weights = [torch.randn(r.shape, dtype=torch.float64) for r in results]
        got = torch.autograd.grad(sum((r.double() * w).sum() for r, w in zip(results, weights)), list(leaves.values()))
        want = torch.autograd.grad(sum((r * w).sum() for r, w in zip(expected, weights)),
                                   [values[k] for k in leaves])
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


# ---- second derivatives ----------------------------------------------------------------------------

@FUZZ
@given(st.sampled_from([op.name for op in OPS]), st.lists(st.booleans(), min_size=4, max_size=4),
       st.sampled_from(["plain", "negative bit", "strided"]), st.sampled_from(["sum", "square"]))
def test_fuzz_second_derivatives(op, wanted, form, upstream):
    """A second derivative is refused, or it is the exact 0 of an op linear in its inputs."""
    op = OPS_BY_NAME[op]
    args = op.make(torch.float64, "cpu")
    names = [n for n, w in zip(op.floats, wanted) if w and n not in ("cos", "sin")] or [op.floats[0]]
    leaves = {n: args[n].clone().requires_grad_() for n in names}
    args.update({n: in_form(leaf, form) for n, leaf in leaves.items()})
    result = op.call(args)
    results = result if isinstance(result, tuple) else (result,)
    loss = sum((r.square() if upstream == "square" else r).sum() for r in results)
    first = torch.autograd.grad(loss, list(leaves.values()), create_graph=True)
    recorded = [g for g in first if g is not None and g.requires_grad]
    linear = op.linear and upstream == "sum"
    if linear and not recorded:  # the first derivative does not depend on the inputs: 0 indeed
        event("exact zero")
        return
    assert recorded, f"{op.name}: a first derivative with no graph would make a silent 0"
    with pytest.raises(RuntimeError, match=REFUSED_TWICE):
        torch.autograd.grad(sum(g.sum() for g in recorded), list(leaves.values()), allow_unused=True)
    event("refused")


# ---- leaks -------------------------------------------------------------------------------------------

def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer's quarantine keeps freed memory resident (its own leak check runs)")
def test_fuzz_does_not_leak():
    """Refused and computed calls of every kind above, round after round: resident memory and the
    reference counts of the arguments stay where they were."""
    x, out, w = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4), np.zeros((3, 4), np.float32), torch.randn(4)
    neg = in_form(torch.randn(3, 4), "negative bit")
    lying = forged("absent", x, (2, 0), "versioned", SANE_FIELDS)
    int_table = forged("int", x, (1, 0), "versioned", SANE_FIELDS)
    calls = [lambda: _C.chain_fwd(x, out, COS, ()),
             lambda: _C.chain_fwd(lying, out, COS, ()),
             lambda: _C.chain_fwd(int_table, out, COS, ()),
             lambda: brrr.gelu(neg),
             lambda: brrr.gelu(neg, out=in_form(torch.zeros(3, 4), "negative bit")),
             lambda: brrr.layer_norm(torch.randn(3, 4), (4,), w.numpy()),
             lambda: brrr.layer_norm(torch.randn(3, 4), (4,), eps="a"),
             lambda: brrr.gelu(torch.randn(3, 4).to_sparse())]

    def rounds(n):
        for _ in range(n):
            for call in calls:
                try:
                    call()
                except (*REFUSALS, RuntimeError):
                    pass
            lying.raw.clear()
            int_table.raw.clear()

    rounds(200)
    gc.collect()
    refs = [sys.getrefcount(o) for o in (x, out, w, neg)]
    before = rss_bytes()
    n = max(EXAMPLES, 2000) if CAMPAIGN else 2000
    rounds(n)
    gc.collect()
    grown = rss_bytes() - before
    print(f"{n} rounds of {len(calls)} calls: resident memory {grown / 2**20:+.2f} MiB")  # the campaign's figure
    assert [sys.getrefcount(o) for o in (x, out, w, neg)] == refs
    assert grown < 8 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"
