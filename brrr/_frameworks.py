"""Which framework an argument belongs to, decided without importing any framework."""

import sys

_torch_tensor = None  # torch.Tensor and brrr._torch (PyTorch integration), set by brrr._torch as
_torch_ops = None  # it loads (torch_integration_loaded)


def torch_ops_if_tensor(x):
    """brrr._torch when x is a torch.Tensor, else None; cheap on the hot path: the type and the
    module are looked up once, and brrr._torch is imported on the first torch tensor."""
    if _torch_ops is None:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.Tensor):
            return None
        from . import _torch

        torch_integration_loaded(_torch)
        return _torch
    return _torch_ops if isinstance(x, _torch_tensor) else None


def torch_integration_loaded(module):
    """Set the two names above to torch.Tensor and brrr._torch; brrr._torch calls this as it loads.
    Not while torch.compile traces: dynamo guards on the values it read (None), and setting them
    from a traced call would fail that guard on the next call and compile the whole model again
    (an import inside a traced call runs for real, so brrr._torch's call is skipped then too)."""
    global _torch_tensor, _torch_ops
    torch = sys.modules["torch"]
    if not torch.compiler.is_compiling():
        _torch_tensor, _torch_ops = torch.Tensor, module


def torch_if_tensor(x):
    """The torch module when x is a torch.Tensor, else None (torch is never imported here)."""
    return sys.modules["torch"] if torch_ops_if_tensor(x) is not None else None


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
    return namespace().empty_like(x, device=x.device)


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


def empty(xp, shape, dtype, like):
    """An uninitialised array from namespace xp on like's device."""
    if _is_numpy(like):
        return xp.empty(shape, dtype)
    if _cupy_for(like) is not None:
        with like.device:
            return xp.empty(shape, dtype)
    return xp.empty(shape, dtype=dtype, device=like.device)


def astype(xp, x, dtype):
    """x in dtype (x itself for NumPy and CuPy arrays that have it already)."""
    if _is_numpy(x) or _cupy_for(x) is not None:
        return x.astype(dtype, copy=False)
    return xp.astype(x, dtype)


def torch_integration(build):
    """A family module's PyTorch integration: build() (which imports torch) runs once, on the
    first call of the function this returns, so that `import brrr` never imports torch."""
    built = []

    def get():
        if not built:
            built.append(build())
        return built[0]
    return get
