"""Which framework an argument belongs to, decided without importing any framework, and the
allocations brrr makes with a framework other than PyTorch. The first torch tensor loads brrr's
PyTorch layer (brrr._op)."""

import sys

_torch_tensor = _torch = None  # torch.Tensor and torch, once brrr's PyTorch layer has loaded
# The classes of torch tensors that public functions may hand straight to their op (torch.Tensor,
# nn.Parameter), once brrr's PyTorch layer has loaded; empty before (brrr.chain's functions).
TORCH_PLAIN = ()


def torch_if_tensor(x):
    """The torch module when x is a torch.Tensor, else None; cheap on the hot path. torch is never
    imported here: a torch tensor means it is. The first one loads brrr's PyTorch layer."""
    if _torch_tensor is not None:
        return _torch if isinstance(x, _torch_tensor) else None
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    load_torch_layer()
    return torch


def compiling():
    """Whether torch.compile traces this code (False where torch is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def load_torch_layer():
    """Load brrr._op, which builds every family's PyTorch integration, and remember torch.Tensor.
    Not while torch.compile traces: dynamo guards on the value it read (None), and setting it
    from a traced call would fail that guard on the next call and compile the whole model again.
    The import runs for real also then (dynamo runs imports), so no build is ever traced."""
    global _torch_tensor, _torch, TORCH_PLAIN
    from . import _op  # noqa: F401 - for what loading it does
    from ._registry import PLAIN_TENSORS

    torch = sys.modules["torch"]
    if not torch.compiler.is_compiling():
        _torch_tensor, _torch, TORCH_PLAIN = torch.Tensor, torch, PLAIN_TENSORS


def check_torch(values, names):
    """The other tensor arguments of a call whose x is a torch tensor: torch tensors or None, as
    the tensors of one call come from one framework (docs/errors.md). TypeError naming the first
    that is not."""
    tensor = _torch_tensor or sys.modules["torch"].Tensor
    for value in values:  # the names zipped in only for an error: a third of the check's time
        if value is not None and not isinstance(value, tensor):
            break
    else:
        return
    for value, name in zip(values, names):
        if value is not None and not isinstance(value, tensor):
            if not hasattr(value, "__dlpack__"):
                raise TypeError(f"argument {name}: expected a tensor or array implementing __dlpack__, got "
                                f"{type(value).__name__}")
            raise TypeError(f"argument {name}: expected a torch.Tensor like the call's first tensor (the tensors "
                            f"of one call come from one framework), got {type(value).__name__}")


def empty_like(x):
    """A new uninitialised array like x, from x's own framework and on x's device, or None when x
    has no Array API namespace."""
    cupy = _cupy_for(x)
    if cupy is not None:
        with x.device:
            return cupy.empty_like(x)
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is None:
        return None
    return namespace().empty_like(x, device=_device(x, "x"))


def _device(x, name):
    """x.device; TypeError naming the argument for an array without one: inside jax.jit the
    arrays are tracers, with no data to hand over."""
    try:
        return x.device
    except AttributeError:
        raise TypeError(f"argument {name}: {type(x).__name__} has no device and no data to hand over (inside jax.jit "
                        "the arrays are tracers: call brrr's ops on concrete arrays)") from None
    except RuntimeError as error:  # a deleted (donated) JAX array
        raise RuntimeError(f"argument {name}: {error}") from None


def _is_numpy(x):
    return type(x).__module__ == "numpy"


def _cupy_for(x):
    """The cupy module for a CuPy array (before CuPy 14 they have no __array_namespace__), else None."""
    if type(x).__module__.partition(".")[0] != "cupy":
        return None
    import cupy

    return cupy


def array_namespace(x, name="input"):
    """The Array API namespace of a NumPy, CuPy, JAX (...) array x; TypeError naming the argument
    for anything else."""
    if _is_numpy(x):
        import numpy

        return numpy  # NumPy 1.x arrays have no __array_namespace__
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is None:
        cupy = _cupy_for(x)
        if cupy is not None:
            return cupy
        raise TypeError(f"argument {name}: expected a PyTorch tensor or an array with __array_namespace__ (NumPy, "
                        f"CuPy, JAX), got {type(x).__name__}")
    return namespace()


def empty(xp, shape, dtype, like, name="input"):
    """An uninitialised array from namespace xp on like's device (like: the argument `name`)."""
    if _is_numpy(like):
        return xp.empty(shape, dtype)
    if _cupy_for(like) is not None:
        with like.device:
            return xp.empty(shape, dtype)
    try:
        return xp.empty(shape, dtype=dtype, device=_device(like, name))
    except (IndexError, ValueError):  # a device brrr could not take anyway (a sharded JAX array's): its error
        from . import _C

        _C.check_tensor(like, name)
        raise


def astype(xp, x, dtype):
    """x in dtype (x itself for NumPy and CuPy arrays that have it already)."""
    if _is_numpy(x) or _cupy_for(x) is not None:
        return x.astype(dtype, copy=False)
    return xp.astype(x, dtype)


def as_float_dtype(xp, x, dtype):
    """x in the floating dtype of a `dtype` argument (xp None: through x's astype method):
    TypeError naming dtype for one x's framework does not know, ValueError for one not floating."""
    try:
        x = x.astype(dtype) if xp is None else astype(xp, x, dtype)
    except TypeError as error:
        raise TypeError(f"argument dtype: {error}") from None
    if str(x.dtype) not in ("float32", "float16", "bfloat16", "float64"):
        raise ValueError(f"argument dtype: expected float32, float16, bfloat16 or float64, got {x.dtype}")
    return x
