"""Argument checks that every public function shares, by the rule of docs/errors.md: TypeError
for a value of the wrong type (a bool is not a number, a list not a tensor), ValueError for a
value that does not fit or for arguments that do not go together. brrr._C checks tensors and
its own scalar arguments by the same rule; these are the checks the Python layer makes before
it gets there (shapes it needs first, the scalars it converts, argument names brrr._C does not
know)."""

import numbers
import re
import sys

ERRORS = (TypeError, ValueError, BufferError)  # what an argument error is raised as


def _short(value):
    """repr(value) cut to 40 characters (as brrr._C shows values that do not fit)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for CPython to print
        return "an int too long to print"
    return text if len(text) <= 40 else text[:37] + "..."


def as_float(name, value):
    """value as a float; TypeError naming the argument for a non-number (or a bool)."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"argument {name}: expected a float, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"argument {name}: {_short(value)} does not fit a float64") from None


def as_int(name, value):
    """value as an int; TypeError naming the argument for a non-integer (or a bool)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"argument {name}: expected an int, got {type(value).__name__}")
    return int(value)


def bad_choice(name, value, choices):
    """The error for `value`, which is none of the strings `choices`: TypeError for a non-string."""
    expected = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
    if not isinstance(value, str):
        return TypeError(f"argument {name}: expected {expected}, got {type(value).__name__}")
    return ValueError(f"argument {name}: expected {expected}, got {_short(value)}")


def required(name, x):
    """TypeError naming a required tensor argument given as None, in brrr._C's words, where a
    None would otherwise be taken for an optional tensor or reach an attribute read first."""
    if x is None:
        raise TypeError(f"argument {name}: expected a tensor or array, got None")


def shape_of(name, x):
    """x's shape, after checking that x is a tensor or an array (TypeError naming it otherwise)."""
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "__dlpack__"):
        raise TypeError(f"argument {name}: expected a tensor or array implementing __dlpack__, got {type(x).__name__}")
    return shape


def last_dim(name, x, why):
    """x's last dim; ValueError naming the argument for a 0-d x, which has none (`why` it is needed)."""
    shape = shape_of(name, x)
    if len(shape) == 0:
        raise ValueError(f"argument {name}: expected a tensor with at least one dim ({why}), got a 0-d one")
    return shape[-1]


def dtype_name(x):
    """x's dtype as both torch and NumPy would name it: float32, not torch.float32."""
    return str(x.dtype).removeprefix("torch.")


def is_float(x):
    """Whether tensor or array x holds floating-point numbers (torch and NumPy spell it differently)."""
    dtype = x.dtype
    return bool(getattr(dtype, "is_floating_point", False) or getattr(dtype, "kind", "") == "f")


def refuse_kinds(*named, index=None):
    """Where the Python layer failed on a tensor with its framework's own error (PyTorch's
    RuntimeError for a sparse tensor's strides or a nested tensor's shape), brrr._C's error for the
    first of the (name, tensor) pairs it does not take, if any: one line that names the argument.
    index: the (name, tensor) pair of a tensor of class indices (a cross-entropy's target)."""
    from . import _C

    checks = [(name, value, False) for name, value in named] + ([(*index, True)] if index else [])
    for name, value, is_index in checks:
        if value is not None and hasattr(value, "__dlpack__"):
            try:
                _C.check_tensor(value, name, is_index)
            except RuntimeError as error:
                if _in_a_torch_func_transform():
                    raise RuntimeError(
                        f"argument {name}: a tensor of a torch.func transform (vmap, grad, jacrev, jvp), which holds "
                        "no memory brrr's kernels can read; brrr.registry's calls (brrr.use_fused's routes, brrr.nn, "
                        "patched models) run PyTorch's function there") from error
                raise


def _in_a_torch_func_transform():
    """Whether a torch.func transform is active (torch asked only where it is loaded)."""
    torch = sys.modules.get("torch")
    active = getattr(getattr(torch, "_C", None), "_are_functorch_transforms_active", None)
    return bool(active and active())


class DimError(IndexError, ValueError):
    """A dim out of a tensor's range: the IndexError PyTorch raises for it, and by docs/errors.md
    a bad value (ValueError)."""


def dim_in_range(name, ndim, dim):
    """dim (an int, negative counting from the end) as an index of a tensor's ndim dims (a 0-d
    tensor takes 0 and -1, as PyTorch's ops do)."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):  # numpy.int64 too, as PyTorch's ops take
        raise TypeError(f"argument {name}: expected an int, got {type(dim).__name__}")
    dim = int(dim)
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise DimError(f"argument {name}: {dim} is out of range for a tensor of {ndim} dims")
    return dim % rank


def renamed(error, names):
    """`error` with the argument names of brrr._C (names: its name -> the public function's) as the
    public function spells them, and its type kept. brrr._C names the arguments of its own
    signature (x, operands[0], logits); a public function may call the same one gate, up, input."""
    pattern = re.compile(r"(?<![\w.\[\]])(" + "|".join(map(re.escape, names)) + r")(?![\w\[])")
    try:
        return type(error)(pattern.sub(lambda m: names[m.group(1)], str(error)))
    except Exception:  # noqa: BLE001 - an exception type that takes no single message stays as it was
        return error


def named(names, fn, *args, **kwargs):
    """fn(*args, **kwargs), its argument errors spelled with the public function's names (renamed)."""
    try:
        return fn(*args, **kwargs)
    except ERRORS as error:
        raise renamed(error, names) from None
