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
from ._frameworks import empty_like, torch_if_tensor, torch_integration


def rotary(x, cos, sin):
    """x * cos + rotate_half(x) * sin in one pass (see the module)."""
    if torch_if_tensor(x) is not None:
        return _torch().rotary(x, cos, sin)
    out = None if type(x).__module__ == "numpy" else empty_like(x)  # brrr._C allocates NumPy outputs
    return _C.rotary(x, cos, sin, out, False)[0]


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb: cos and sin (batch, seq, head_dim) get a heads dim at
    unsqueeze_dim, then both q and k are rotated. position_ids is unused, as there."""
    if torch_if_tensor(q) is not None:
        return _torch().rotary_qk(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
    import numpy as np

    cos, sin = np.expand_dims(cos, unsqueeze_dim), np.expand_dims(sin, unsqueeze_dim)
    return rotary(q, cos, sin), rotary(k, cos, sin)


# ---- PyTorch: the custom ops brrr::rotary and brrr::rotary_qk (q and k under one autograd node:
# one Function applied and one backward called per attention layer instead of two). The gradient
# with respect to x is the same op with `backward` flipped.

@torch_integration
def _torch():
    from types import SimpleNamespace

    import torch

    from ._op import TorchOp, out_like, stream

    Tensor = torch.Tensor

    def forward(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
        return _C.rotary(x, cos, sin, out_like(x), backward, stream=stream(x))[0]

    def fake(x, cos, sin, backward):
        return torch.empty_like(x)

    def save(ctx, args, results):
        ctx.backward = args[-1]
        ctx.save_for_backward(*args[-3:-1])

    def formula(ctx, grads, run):
        cos, sin = ctx.saved_tensors
        return (*(None if g is None else run(rotary_op, g, cos, sin, not ctx.backward) for g in grads),
                None, None, None)

    rotary_op = TorchOp("rotary", forward, fake, save=save, backward=formula)

    def pair_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return forward(q, cos, sin, False), forward(k, cos, sin, False)

    def pair_fake(q, k, cos, sin):
        return torch.empty_like(q), torch.empty_like(k)

    def pair_save(ctx, args, results):
        ctx.backward = False
        ctx.save_for_backward(*args[2:])

    pair_op = TorchOp("rotary_qk", pair_forward, pair_fake, save=pair_save, backward=formula, outputs=2,
                      grad_args=(0, 1))

    def refuse_angle_gradients(cos, sin):
        if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
            name = "cos" if cos.requires_grad else "sin"
            raise ValueError(f"argument {name}: brrr.rotary gives no gradient for cos and sin (they require grad "
                             "here; brrr.registry sends such inputs to PyTorch)")

    def rotary(x, cos, sin):
        refuse_angle_gradients(cos, sin)
        return rotary_op(x, cos, sin, False)

    def rotary_qk(q, k, cos, sin):
        refuse_angle_gradients(cos, sin)
        if q.requires_grad and k.requires_grad:  # else each output requires grad as its input does
            return pair_op(q, k, cos, sin)
        return rotary_op(q, cos, sin, False), rotary_op(k, cos, sin, False)

    return SimpleNamespace(rotary=rotary, rotary_qk=rotary_qk)
