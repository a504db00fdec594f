"""The error rule of docs/errors.md, walked for every op of tests/op_table.py: each rule of the
table, on every argument it applies to, raises the exception the table names, with a message
that starts with the argument's name, and changes none of the inputs."""

import builtins
import pathlib
import re

import numpy as np
import pytest
import torch

import brrr
from dlpack_producers import RawProducer
from op_table import OPS, OPS_BY_NAME

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def rule_table():
    """{rule: exception class} from the table in docs/errors.md."""
    rows = re.findall(r"^\| `([a-z ]+)` \| `(\w+)` \|", DOC.read_text(), re.M)
    return {rule: getattr(builtins, exc) for rule, exc in rows}


RULES = rule_table()


def test_the_table_names_every_rule_once():
    assert list(RULES) == ["wrong type", "wrong dtype", "mismatch", "bad value", "protocol", "runtime"]
    assert RULES["wrong type"] is TypeError and RULES["protocol"] is BufferError


def _replaced(args, name, value):
    changed = dict(args)
    changed[name] = value
    return changed


def _shorter(t):
    """t with one element fewer along its last dim (a 0-d t gets one dim)."""
    return t[..., :-1] if t.dim() else t.reshape(1)


def cases(op, rule):
    """(argument name, arguments) for each way `op` breaks `rule`."""
    args = op.make(torch.float32, "cpu")
    tensors = [name for name, value in args.items() if isinstance(value, torch.Tensor)]
    first = op.floats[0]
    if rule == "wrong type":
        for name in tensors:
            yield name, _replaced(args, name, [1.0, 2.0])
            if name != first:  # the call's x is a torch tensor: the others must be too
                yield name, _replaced(args, name, args[name].numpy())
        for name, value in op.bad_type.items():
            yield name, _replaced(args, name, value)
    elif rule == "wrong dtype":
        for name in op.floats:
            yield name, _replaced(args, name, args[name].to(torch.int32))
            yield name, _replaced(args, name, args[name].to(torch.complex64))
        if "target" in args:
            yield "target", _replaced(args, "target", args["target"].float())
        if op.out:
            yield "out", _replaced(args, "out", torch.zeros(op.call(args).shape, dtype=torch.int64))
        yield first, _replaced(args, first, args[first].to_sparse())
    elif rule == "mismatch":
        for name in [n for n in op.floats if n != first] + (["target"] if "target" in args else []):
            if name != "target":
                yield name, _replaced(args, name, args[name].double())
            yield name, _replaced(args, name, _shorter(args[name]))
        if op.out:
            result = op.call(args)
            yield "out", _replaced(args, "out", torch.zeros(result.shape, dtype=torch.float64))
            yield "out", _replaced(args, "out", torch.zeros(*result.shape[:-1], result.shape[-1] + 1))
    elif rule == "bad value":
        for name, value in op.bad_value.items():
            yield name, _replaced(args, name, value)
        if op.out:
            shape = op.call(args).shape
            yield "out", _replaced(args, "out", torch.zeros(shape[-1]).expand(shape))  # elements overlap
            neg = torch.complex(torch.zeros(shape), torch.ones(shape)).conj().imag  # its negative bit set
            yield "out", _replaced(args, "out", neg)
            yield first, _replaced(args, first, args[first].to("meta"))
    elif rule == "protocol" and rule not in op.no_case:
        # The NumPy path reads other arguments through __dlpack__: a producer of a capsule of
        # another name, in the second tensor argument's place (or out's).
        numpy = {name: value.numpy() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
        name = next((n for n in tensors if n != first), "out" if op.out else first)
        like = numpy[name] if name in numpy else np.empty(op.call(args).shape, np.float32)
        yield name, _replaced(numpy, name, RawProducer(like, capsule_name=b"not_a_tensor", shape=like.shape))


OP_RULES = ["wrong type", "wrong dtype", "mismatch", "bad value", "protocol"]


def test_every_op_rule_is_walked():
    """Every rule of the table is checked here per op, but for runtime: tests/test_double_backward.py
    (second derivatives) and the CUDA tests (a CUDA build's devices) check that one."""
    assert set(OP_RULES) | {"runtime"} == set(RULES)


@pytest.mark.parametrize("rule", OP_RULES)
@pytest.mark.parametrize("op", [op.name for op in OPS])
def test_error_rule(op, rule):
    op = OPS_BY_NAME[op]
    seen = 0
    for name, args in cases(op, rule):
        before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"
                  and v.layout == torch.strided and not v.is_neg()}
        with pytest.raises(RULES[rule], match=rf"^argument {re.escape(name)}(?![\w\[])") as raised:
            op.call(args)
        assert len(str(raised.value).splitlines()) == 1, raised.value
        for k, v in before.items():
            assert torch.equal(args[k], v), f"{op.name}: argument {k} changed by a call that failed"
        seen += 1
    assert seen or rule == "bad value" or rule in op.no_case, f"no {rule} case for {op.name}"


def test_the_examples_that_broke_the_rule():
    """Each refused as the rule says, with the message it gives now (they raised AttributeError,
    IndexError, or errors naming no argument)."""
    x, w = torch.randn(4, 6), torch.randn(6)
    cases = [
        (lambda: brrr.bias_gelu(x, w.numpy()), TypeError,
         "argument bias: expected a torch.Tensor like the call's first tensor (the tensors of one call come from one "
         "framework), got ndarray"),
        (lambda: brrr.layer_norm(x, (6,), w, 1.0), TypeError,
         "argument bias: expected a tensor or array implementing __dlpack__, got float"),
        (lambda: brrr.swiglu(torch.tensor(1.0)), ValueError,
         "argument x: expected a tensor with at least one dim (its last is split into gate and up halves), got a 0-d "
         "one"),
        (lambda: brrr.swiglu([1.0, 2.0]), TypeError,
         "argument x: expected a tensor or array implementing __dlpack__, got list"),
        (lambda: brrr.layer_norm(x, 4.0), TypeError,
         "argument normalized_shape: expected an int or a sequence of ints, got 4.0"),
        (lambda: brrr.layer_norm(x, (6,), eps="a"), TypeError, "argument eps: expected a float, got str"),
        (lambda: brrr.bias_gelu(torch.tensor(1.0), torch.tensor([1.0])), ValueError,
         "argument bias: shape must be x's shape () (x is 0-d)"),
        (lambda: brrr.gelu(torch.ones(3, dtype=torch.int64)), TypeError,
         "argument x: dtype int64 is not supported; expected float32, float16, bfloat16 or float64"),
        (lambda: brrr.bias_gelu(x, w.double()), ValueError, "argument bias has dtype float64 but x has dtype float32"),
        (lambda: brrr.rotary(x, w.double(), w), ValueError, "argument cos has dtype float64 but x has dtype float32"),
        (lambda: brrr.layer_norm(x, (6,), w.double()), ValueError,
         "argument weight: dtype float64 does not go with x of dtype float32 (expected float32)"),
        (lambda: brrr.chain(("add", True)), TypeError,
         "argument steps[0]: 'add' needs a real scalar: ('add', value), not a bool"),
        (lambda: brrr.chain(("mul", 2**2000)), ValueError,
         "argument steps[0]: 1148130695274254524232833201177681984... does not fit a float64"),
        (lambda: brrr.apply_rotary_pos_emb(x, x.double(), w, w, unsqueeze_dim=0), ValueError,
         "argument k has dtype float64 but q has dtype float32"),
        (lambda: brrr.cross_entropy(x, torch.tensor([0, 1, 2, 3]), reduction=None), TypeError,
         "argument reduction: expected 'mean', 'sum' or 'none', got NoneType"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc) as raised:
            call()
        assert str(raised.value) == message
