"""Which framework an argument belongs to, decided without importing any framework."""

import sys

_torch_tensor = None  # torch.Tensor once torch has been imported by someone
_torch_ops = None  # brrr._torch once a torch tensor has been seen


def torch_ops_if_tensor(x):
    """brrr._torch (PyTorch integration) when x is a torch.Tensor, else None; cheap on the hot
    path: the type and the module are looked up once."""
    global _torch_tensor, _torch_ops
    if _torch_tensor is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        _torch_tensor = torch.Tensor
    if not isinstance(x, _torch_tensor):
        return None
    if _torch_ops is None:
        from . import _torch

        _torch_ops = _torch
    return _torch_ops


def torch_if_tensor(x):
    """The torch module when x is a torch.Tensor, else None (torch is never imported here)."""
    return sys.modules["torch"] if torch_ops_if_tensor(x) is not None else None


def empty_like(x):
    """A new uninitialised array like x from x's own framework (Array API), or None."""
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is None:
        return None
    return namespace().empty_like(x)


def torch_integration(build):
    """A family module's PyTorch integration: build() (which imports torch) runs once, on the
    first call of the function this returns, so that `import brrr` never imports torch."""
    built = []

    def get():
        if not built:
            built.append(build())
        return built[0]
    return get
