"""Rotary position embedding, as Llama-style models apply it to their queries and keys:

    y = brrr.rotary(x, cos, sin)                       # x * cos + rotate_half(x) * sin
    q, k = brrr.apply_rotary_pos_emb(q, k, cos, sin)   # transformers' apply_rotary_pos_emb
    y = brrr.rotary(x, cos, sin, interleaved=True)     # GPT-J's, Cohere's and GLM's pairs
    y = brrr.rotary(x, cos, sin, rotary_dim=16)        # partial rotary: the rest of x passes through

rotate_half(x) = cat(-x[..., h:], x[..., :h]) for a last dim of 2h. Eager PyTorch takes five
kernels for one tensor (two products, the slices' negation, the concatenation, the sum), each
rounding to the storage dtype; brrr takes one pass, in float32 (float64 for float64), rounding
once. The backward is the same kernel transposed (the op is linear in x). cos and sin have x's
dtype, broadcast to x's shape; they get no gradient (transformers computes them under no_grad;
brrr.registry sends inputs whose cos or sin require grad to PyTorch).

Layouts. interleaved=False pairs feature j with j + r/2 (rotate_half), interleaved=True feature
2p with 2p + 1 (rotate_half of the interleaved form: stack((-x[1::2], x[0::2]), -1).flatten(-2)).
Only the first r features are rotated, as GPT-NeoX, Phi and GLM do, and the rest copied: r is
cos's last dim (as transformers' apply_rotary_pos_emb takes it: an angle per rotated feature,
x * cos + rotate(x) * sin), or rotary_dim=r where given, with an angle per feature (last dim r)
or one per pair (last dim r/2, as flash-attn takes them: both features of pair p use angle p;
GLM's and ERNIE 4.5's cos[..., :r/2].repeat_interleave(2, -1) is cos[..., :r/2] given per pair
with rotary_dim=r, without the copy).
"""

from . import _C
from ._args import as_int, dtype_name, is_float, named, refuse_kinds, required, shape_of
from ._frameworks import check_torch, empty_like, torch_if_tensor
from ._integration import torch_integration


def layout(interleaved, rotary_dim):
    """(interleaved, rotary_dim as brrr._C takes it: 0 for cos's last dim), checked."""
    if not isinstance(interleaved, bool):
        raise TypeError(f"argument interleaved: expected a bool, got {type(interleaved).__name__}")
    if rotary_dim is None:
        return interleaved, 0
    r = as_int("rotary_dim", rotary_dim)
    if r < 1:
        raise ValueError(f"argument rotary_dim: expected None or an even int in [2, x's last dim], got {r}")
    return interleaved, r


def rotary(x, cos, sin, *, interleaved=False, rotary_dim=None):
    """x * cos + rotate_half(x) * sin in one pass; interleaved pairs, the first rotary_dim features
    only, and angles per pair: see the module."""
    interleaved, rotary_dim = layout(interleaved, rotary_dim)
    if torch_if_tensor(x) is not None:
        try:
            return torch_layer().rotary(x, cos, sin, interleaved, rotary_dim)
        except RuntimeError:
            refuse_kinds(("x", x), ("cos", cos), ("sin", sin))
            raise
    return _rotary_dlpack(x, cos, sin, interleaved, rotary_dim)


def _rotary_dlpack(x, cos, sin, interleaved, rotary_dim):
    """rotary for anything but PyTorch's autograd: straight to brrr._C, which reads every argument
    through DLPack (NumPy's API for NumPy arrays) and allocates NumPy outputs and those of
    frameworks with DLPack's C exchange table."""
    out = None if type(x).__module__ == "numpy" else empty_like(x)
    return _C.rotary(x, cos, sin, out, False, interleaved, rotary_dim)[0]


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *, interleaved=False, rotary_dim=None):
    """transformers' apply_rotary_pos_emb: cos and sin (batch, seq, head_dim) get a heads dim at
    unsqueeze_dim, then both q and k are rotated. position_ids is unused, as there. interleaved
    and rotary_dim: as brrr.rotary takes them."""
    interleaved, rotary_dim = layout(interleaved, rotary_dim)
    try:
        return _apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, interleaved, rotary_dim)
    except RuntimeError:
        refuse_kinds(("q", q), ("k", k), ("cos", cos), ("sin", sin))
        raise


def _apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, interleaved, rotary_dim):
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
        return torch_layer().rotary_qk(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), interleaved,
                                       rotary_dim)
    # by each angle's own framework: a torch tensor's values are not always its memory (is_neg)
    cos, sin = (a.unsqueeze(unsqueeze_dim) if torch_if_tensor(a) is not None else _unsqueeze(a, unsqueeze_dim)
                for a in (cos, sin))
    return (named(Q_NAMES, _rotary_dlpack, q, cos, sin, interleaved, rotary_dim),
            named(K_NAMES, _rotary_dlpack, k, cos, sin, interleaved, rotary_dim))


def _unsqueeze(a, dim):
    """a with a new axis at dim, as torch.unsqueeze; by indexing, which NumPy, CuPy and JAX arrays
    all take, so that each stays in its framework and on its device."""
    dim = dim if dim >= 0 else dim + a.ndim + 1
    return a[(slice(None),) * dim + (None,)]


# rotary's x (rotary_pair's x and x2), as apply_rotary_pos_emb calls it
Q_NAMES, K_NAMES, PAIR_NAMES = {"x": "q"}, {"x": "k"}, {"x": "q", "x2": "k"}


# ---- PyTorch: the custom ops brrr::rotary and brrr::rotary_qk (q and k under one autograd node:
# one Function applied and one backward called per attention layer instead of two, and one
# brrr._C.rotary_pair for both, which reads the angles once where the kernel allows). The
# gradient with respect to x is the same op with `backward` flipped. rotary_dim: 0 for cos's last
# dim.

@torch_integration
def torch_layer():
    from types import SimpleNamespace

    import torch

    from ._op import TorchOp, out_like, stream
    from ._registry import registry, same_kind, tensor_ok

    Tensor = torch.Tensor

    def forward(x: Tensor, cos: Tensor, sin: Tensor, backward: bool, interleaved: bool, rotary_dim: int) -> Tensor:
        return _C.rotary(x, cos, sin, out_like(x), backward, interleaved, rotary_dim, stream=stream(x))[0]

    def fake(x, cos, sin, backward, interleaved, rotary_dim):
        return torch.empty_like(x)

    def save(ctx, args, results):
        ctx.backward, ctx.interleaved, ctx.rotary_dim = args[3:]
        ctx.n_args = len(args)
        ctx.save_for_backward(*args[1:3])

    def formula(ctx, grads, run):
        """The gradients of the rotated inputs (x, or q and k: by one pair where both flow), then None for
        the other arguments."""
        cos, sin = ctx.saved_tensors
        if len(grads) == 2 and grads[0] is not None and grads[1] is not None:
            rotated = tuple(run(pair_op)(*grads, cos, sin, not ctx.backward, ctx.interleaved, ctx.rotary_dim))
        else:
            rotated = tuple(None if g is None else run(rotary_op)(g, cos, sin, not ctx.backward, ctx.interleaved,
                                                       ctx.rotary_dim) for g in grads)
        return rotated + (None,) * (ctx.n_args - len(rotated))

    rotary_op = TorchOp("rotary", forward, fake, save=save, backward=formula)

    def pair_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool, interleaved: bool,
                     rotary_dim: int) -> tuple[Tensor, Tensor]:
        out, out2 = _C.rotary_pair(q, cos, sin, out_like(q), k, torch.empty_like(k), backward, interleaved, rotary_dim,
                                   stream=stream(q))
        return out, out2

    def pair_fake(q, k, cos, sin, backward, interleaved, rotary_dim):
        return torch.empty_like(q), torch.empty_like(k)

    def pair_save(ctx, args, results):
        ctx.backward, ctx.interleaved, ctx.rotary_dim = args[4:]
        ctx.n_args = len(args)
        ctx.save_for_backward(*args[2:4])

    pair_op = TorchOp("rotary_qk", pair_forward, pair_fake, save=pair_save, backward=formula, outputs=2,
                      grad_args=(0, 1))

    def refuse_angle_gradients(cos, sin):
        required("cos", cos)
        required("sin", sin)
        if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
            name = "cos" if cos.requires_grad else "sin"
            raise ValueError(f"argument {name}: brrr.rotary gives no gradient for cos and sin (they require grad "
                             "here; brrr.registry sends such inputs to PyTorch)")

    def rotary(x, cos, sin, interleaved=False, rotary_dim=0):
        check_torch((cos, sin), ("cos", "sin"))
        refuse_angle_gradients(cos, sin)
        return rotary_op(x, cos, sin, False, interleaved, rotary_dim)

    def rotary_qk(q, k, cos, sin, interleaved=False, rotary_dim=0):
        check_torch((k, cos, sin), ("k", "cos", "sin"))
        refuse_angle_gradients(cos, sin)
        if q.requires_grad == k.requires_grad:  # else each output requires grad as its input does
            return named(PAIR_NAMES, pair_op, q, k, cos, sin, False, interleaved, rotary_dim)
        return (named(Q_NAMES, rotary_op, q, cos, sin, False, interleaved, rotary_dim),
                named(K_NAMES, rotary_op, k, cos, sin, False, interleaved, rotary_dim))

    # ---- the registry
    def rotated(x, cos, rotary_dim):
        """The features rotary rotates (rotary_dim, or cos's last dim), or None where they do not fit x."""
        r = (cos.shape[-1] if cos.dim() else 0) if rotary_dim is None else rotary_dim
        return r if type(r) is int and r % 2 == 0 and 2 <= r <= x.shape[-1] else None

    def rotary_ok(x, cos, sin, *, interleaved=False, rotary_dim=None):
        if not tensor_ok(x) or not same_kind(x, cos, sin) or x.dim() == 0 or type(interleaved) is not bool:
            return False
        r = rotated(x, cos, rotary_dim)
        if r is None:
            return False
        if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
            return False  # brrr gives cos and sin no gradient
        return angles_fit(cos, sin, x.shape, r)

    def rotary_qk_ok(q, k, cos, sin, *, interleaved=False, rotary_dim=None):
        return (rotary_ok(q, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim) and tensor_ok(k) and
                k.dtype == q.dtype and k.device == q.device and
                (k.shape == q.shape or (k.dim() == q.dim() and k.shape[-1] == q.shape[-1] and
                                        angles_fit(cos, sin, k.shape, rotated(q, cos, rotary_dim)))))

    def angles_fit(cos, sin, shape, rotated):
        """cos and sin broadcast to x's shape with last dim `rotated` (an angle per feature) or half
        of it (one per pair), both alike."""
        last = cos.shape[-1] if cos.dim() and cos.shape[-1] in (rotated, rotated // 2) else rotated
        return angle_fits(cos, shape, last) and (sin.shape == cos.shape or angle_fits(sin, shape, last))

    def angle_fits(angle, shape, last):
        """Whether cos or sin broadcasts to x's shape with last dim `last` (NumPy's rules, from the
        right). Written out: torch.broadcast_shapes took 20 us of the 24 this check cost per call
        (CPU, torch 2.13), twice per attention layer."""
        n = angle.dim()
        if n == 0 or n > len(shape) or angle.shape[-1] != last:
            return False
        return all(a == b or a == 1 for a, b in zip(angle.shape[:-1], shape[len(shape) - n:-1]))

    def rotary_entry(x, cos, sin, *, interleaved=False, rotary_dim=None):
        return rotary(x, cos, sin, interleaved, rotary_dim or 0)

    def rotary_qk_entry(q, k, cos, sin, *, interleaved=False, rotary_dim=None):
        return rotary_qk(q, k, cos, sin, interleaved, rotary_dim or 0)

    def reference(x, cos, sin, *, interleaved=False, rotary_dim=None):
        """brrr.rotary in PyTorch ops: transformers' rotate_half forms, the angles per pair repeated."""
        r = cos.shape[-1] if rotary_dim is None else rotary_dim
        if rotary_dim is None and r == 1:  # one angle broadcast over the features, as transformers' formula takes it
            r = x.shape[-1]
        if cos.shape[-1] == r // 2:  # an angle per pair: per feature, as the pairs lie
            cos, sin = ((a.repeat_interleave(2, dim=-1) if interleaved else torch.cat((a, a), dim=-1))
                        for a in (cos, sin))
        rot = x[..., :r]
        if interleaved:
            turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        else:
            turned = torch.cat((-rot[..., r // 2:], rot[..., :r // 2]), dim=-1)
        out = rot * cos + turned * sin
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)

    def qk_reference(q, k, cos, sin, *, interleaved=False, rotary_dim=None):
        return (reference(q, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim),
                reference(k, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim))

    registry.register("rotary", reference, rotary_entry, rotary_ok, compiled="inductor", cpu="pytorch")
    registry.register("rotary_qk", qk_reference, rotary_qk_entry, rotary_qk_ok, compiled="inductor", cpu="pytorch")
    return SimpleNamespace(rotary=rotary, rotary_qk=rotary_qk, modules=[], functional={})
