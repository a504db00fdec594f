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
from ._args import as_int, dtype_name, is_float, named, refuse_kinds, shape_of
from ._frameworks import check_torch, empty_like, torch_if_tensor
from ._integration import torch_integration


def rotary(x, cos, sin):
    """x * cos + rotate_half(x) * sin in one pass (see the module)."""
    if torch_if_tensor(x) is not None:
        try:
            return torch_layer().rotary(x, cos, sin)
        except RuntimeError:
            refuse_kinds(("x", x), ("cos", cos), ("sin", sin))
            raise
    return _rotary_dlpack(x, cos, sin)


def _rotary_dlpack(x, cos, sin):
    """rotary for anything but PyTorch's autograd: straight to brrr._C, which reads every argument
    through DLPack (NumPy's API for NumPy arrays) and allocates NumPy outputs and those of
    frameworks with DLPack's C exchange table."""
    out = None if type(x).__module__ == "numpy" else empty_like(x)
    return _C.rotary(x, cos, sin, out, False)[0]


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb: cos and sin (batch, seq, head_dim) get a heads dim at
    unsqueeze_dim, then both q and k are rotated. position_ids is unused, as there."""
    try:
        return _apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    except RuntimeError:
        refuse_kinds(("q", q), ("k", k), ("cos", cos), ("sin", sin))
        raise


def _apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim):
    shape_of("q", q)
    shape_of("k", k)
    torch = torch_if_tensor(q)
    if torch is not None:
        check_torch((k, cos, sin), ("k", "cos", "sin"))
    if dtype_name(k) != dtype_name(q) and is_float(k) and is_float(q):  # else brrr._C's error: about cos and k
        raise ValueError(f"argument k has dtype {dtype_name(k)} but q has dtype {dtype_name(q)}")
    unsqueeze_dim = as_int("unsqueeze_dim", unsqueeze_dim)
    for name, angle in (("cos", cos), ("sin", sin)):
        if not -len(shape_of(name, angle)) - 1 <= unsqueeze_dim <= len(angle.shape):
            raise ValueError(f"argument unsqueeze_dim: {unsqueeze_dim} is out of range for {name} of "
                             f"{len(angle.shape)} dims")
    if torch is not None:
        return torch_layer().rotary_qk(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
    # by each angle's own framework: a torch tensor's values are not always its memory (is_neg)
    cos, sin = (a.unsqueeze(unsqueeze_dim) if torch_if_tensor(a) is not None else _unsqueeze(a, unsqueeze_dim)
                for a in (cos, sin))
    return named(Q_NAMES, _rotary_dlpack, q, cos, sin), named(K_NAMES, _rotary_dlpack, k, cos, sin)


def _unsqueeze(a, dim):
    """a with a new axis at dim, as torch.unsqueeze; by indexing, which NumPy, CuPy and JAX arrays
    all take, so that each stays in its framework and on its device."""
    dim = dim if dim >= 0 else dim + a.ndim + 1
    return a[(slice(None),) * dim + (None,)]


Q_NAMES, K_NAMES = {"x": "q"}, {"x": "k"}  # rotary's x, as apply_rotary_pos_emb calls it


# ---- PyTorch: the custom ops brrr::rotary and brrr::rotary_qk (q and k under one autograd node:
# one Function applied and one backward called per attention layer instead of two). The gradient
# with respect to x is the same op with `backward` flipped.

@torch_integration
def torch_layer():
    from types import SimpleNamespace

    import torch

    from ._op import TorchOp, out_like, stream
    from ._registry import registry, same_kind, tensor_ok

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
        check_torch((cos, sin), ("cos", "sin"))
        refuse_angle_gradients(cos, sin)
        return rotary_op(x, cos, sin, False)

    def rotary_qk(q, k, cos, sin):
        check_torch((k, cos, sin), ("k", "cos", "sin"))
        refuse_angle_gradients(cos, sin)
        if q.requires_grad and k.requires_grad:  # else each output requires grad as its input does
            return named(Q_NAMES, pair_op, q, k, cos, sin)
        return named(Q_NAMES, rotary_op, q, cos, sin, False), named(K_NAMES, rotary_op, k, cos, sin, False)

    # ---- the registry
    def rotary_ok(x, cos, sin):
        if not tensor_ok(x) or not same_kind(x, cos, sin) or x.dim() == 0 or x.shape[-1] % 2:
            return False
        if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
            return False  # brrr gives cos and sin no gradient
        return angles_fit(cos, sin, x.shape)

    def rotary_qk_ok(q, k, cos, sin):
        return (rotary_ok(q, cos, sin) and tensor_ok(k) and k.dtype == q.dtype and k.device == q.device and
                (k.shape == q.shape or (k.dim() == q.dim() and k.shape[-1] == q.shape[-1] and
                                        angles_fit(cos, sin, k.shape))))

    def angles_fit(cos, sin, shape):
        return angle_fits(cos, shape) and (sin.shape == cos.shape or angle_fits(sin, shape))

    def angle_fits(angle, shape):
        """Whether cos or sin broadcasts to x's shape with x's last dim (NumPy's rules, from the
        right). Written out: torch.broadcast_shapes took 20 us of the 24 this check cost per call
        (CPU, torch 2.13), twice per attention layer."""
        n = angle.dim()
        if n == 0 or n > len(shape) or angle.shape[-1] != shape[-1]:
            return False
        return all(a == b or a == 1 for a, b in zip(angle.shape, shape[len(shape) - n:]))

    def reference(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def qk_reference(q, k, cos, sin):
        return reference(q, cos, sin), reference(k, cos, sin)

    registry.register("rotary", reference, rotary, rotary_ok, compiled="inductor", cpu="pytorch")
    registry.register("rotary_qk", qk_reference, rotary_qk, rotary_qk_ok, compiled="inductor", cpu="pytorch")
    return SimpleNamespace(rotary=rotary, rotary_qk=rotary_qk, modules=[], functional={})
