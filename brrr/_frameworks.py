"""Which framework an argument belongs to, decided without importing any framework."""

import sys


def torch_if_tensor(x):
    """The torch module when x is a torch.Tensor, else None (torch is never imported here)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    return None


def empty_like(x):
    """A new uninitialised array like x from x's own framework (Array API), or None."""
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is None:
        return None
    return namespace().empty_like(x)
