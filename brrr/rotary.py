"""Rotary position embedding, as Llama-style models apply it to their queries and keys:

    y = brrr.rotary(x, cos, sin)                       # x * cos + rotate_half(x) * sin
    q, k = brrr.apply_rotary_pos_emb(q, k, cos, sin)   # transformers' apply_rotary_pos_emb

rotate_half(x) = cat(-x[..., h:], x[..., :h]) for a last dim of 2h. Eager PyTorch takes five
kernels for one tensor (two products, the slices' negation, the concatenation, the sum), each
rounding to the storage dtype; brrr takes one pass, in float32 (float64 for float64), rounding
once. The backward is the same kernel transposed (the op is linear in x). cos and sin have x's
dtype, broadcast to x's shape with x's last dim; they get no gradient (transformers computes them
under no_grad; brrr.registry sends inputs whose cos or sin require grad to PyTorch).
"""

from . import _C
from ._frameworks import empty_like, torch_if_tensor


def rotary(x, cos, sin):
    """x * cos + rotate_half(x) * sin in one pass (see the module)."""
    torch = torch_if_tensor(x)
    if torch is not None:
        from . import _torch_rotary

        return _torch_rotary.rotary(x, cos, sin)
    out = None if type(x).__module__ == "numpy" else empty_like(x)  # brrr._C allocates NumPy outputs
    return _C.rotary(x, cos, sin, out, False, -1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb: cos and sin (batch, seq, head_dim) get a heads dim at
    unsqueeze_dim, then both q and k are rotated. position_ids is unused, as there."""
    torch = torch_if_tensor(q)
    if torch is not None:
        from . import _torch_rotary

        return _torch_rotary.rotary_qk(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
    cos, sin = _unsqueeze(cos, unsqueeze_dim), _unsqueeze(sin, unsqueeze_dim)
    return rotary(q, cos, sin), rotary(k, cos, sin)


def _unsqueeze(a, dim):
    """a with a new axis at dim, as torch.unsqueeze; by indexing, which NumPy, CuPy and JAX arrays
    all take, so that each stays in its framework and on its device."""
    dim = dim if dim >= 0 else dim + a.ndim + 1
    return a[(slice(None),) * dim + (None,)]
