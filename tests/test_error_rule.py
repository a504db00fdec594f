"""The error rule of docs/errors.md, walked for every op of tests/op_table.py: each rule of the
table, on every argument it applies to, raises the exception the table names, with a message
that starts with the argument's name, and changes none of the inputs."""

import pathlib
import re

import numpy as np
import pytest
import torch

from dlpack_producers import RawProducer
from op_table import OPS, OPS_BY_NAME

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def rule_table():
    """{rule: exception class} from the table in docs/errors.md."""
    rows = re.findall(r"^\| `([a-z ]+)` \| `(\w+)` \|", DOC.read_text(), re.M)
    return {rule: getattr(__builtins__, exc) if isinstance(__builtins__, dict) is False else __builtins__[exc]
            for rule, exc in rows}


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
    elif rule == "protocol":
        # The NumPy path reads other arguments through __dlpack__: a producer of a capsule of
        # another name, in the second tensor argument's place (or out's).
        numpy = {name: value.numpy() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
        name = next((n for n in tensors if n != first), "out")
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
    assert seen or rule == "bad value", f"no {rule} case for {op.name}"
