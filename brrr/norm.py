"""LayerNorm and RMSNorm, alone or fused with the residual add of pre-norm transformer blocks.

    y = brrr.layer_norm(x, (hidden,), weight, bias)           # torch.nn.functional.layer_norm
    y = brrr.rms_norm(x, (hidden,), weight)                    # torch.nn.functional.rms_norm
    y = brrr.rms_norm(x, (hidden,), weight, cast_order="llama")  # Llama's RMSNorm
    y = brrr.rms_norm(x, (hidden,), weight, offset=1.0)         # Gemma's: x * rstd * (1 + weight)
    y, h = brrr.add_layer_norm(x, residual, (hidden,), weight, bias)  # h = x + residual, y = LN(h)
    y, h = brrr.add_rms_norm(x, residual, (hidden,), weight)

Each is one pass over memory forward and one backward. Math runs in fp32 (fp64 for float64) with
the output in x's dtype; weight and bias have x's dtype, or float32 for float16/bfloat16 x (as
autocast leaves them). The forward saves x (for the fused forms: the new residual h) and two
numbers per row, in fp32; the backward rematerialises the normalised input from them. Weight
and bias gradients are reduced in a fixed order: bitwise identical from run to run.

cast_order (RMSNorm): "torch" computes x * rstd * weight in fp32 and rounds once, as
torch.nn.functional.rms_norm does; "llama" rounds x * rstd to x's dtype before multiplying by
the weight, as Hugging Face's LlamaRMSNorm does (`weight * hidden.to(input_dtype)`), with the
result in x's dtype.

offset (RMSNorm): a number added to the weight where the kernels read it, in fp32: Gemma's
RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + weight) computed in float32 and cast once, is
offset=1.0 with the torch cast order. The weight's gradient is the same as without it.
"""

import numbers

from . import _C
from ._args import as_float, bad_choice, refuse_kinds, required, shape_of
from ._frameworks import check_torch, empty_like, torch_if_tensor
from ._integration import torch_integration

CAST_ORDERS = ("torch", "llama")


def normalized_ndim(shape, normalized_shape):
    """len(normalized_shape), after checking that it is an int or a sequence of ints, the trailing
    part of `shape`."""
    if normalized_shape.__class__ in (list, tuple) and len(normalized_shape) == 1 and \
            normalized_shape[0].__class__ is int and shape and shape[-1] == normalized_shape[0]:
        return 1  # the usual argument (torch.nn.LayerNorm's tuple, the custom ops' list): half the general check's time
    ns = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else (normalized_shape,)
    for n in ns:
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, numbers.Integral)):
            raise TypeError(f"argument normalized_shape: expected an int or a sequence of ints, got "
                            f"{normalized_shape!r:.80}")
    shape = tuple(shape)
    if not ns or len(ns) > len(shape) or shape[len(shape) - len(ns):] != ns:
        raise ValueError(f"argument normalized_shape: {list(ns)} must be non-empty and the trailing dims of the "
                         f"input's shape {list(shape)}")
    return len(ns)


def llama_order(cast_order):
    if not isinstance(cast_order, str) or cast_order not in CAST_ORDERS:
        raise bad_choice("cast_order", cast_order, CAST_ORDERS)
    return cast_order == "llama"


def rms_eps(x, eps):
    """rms_norm's eps as a float. None: as torch computes it, the machine epsilon of the compute
    dtype, float32 for float16/bfloat16/float32 and float64 for float64 (torch's documentation says
    torch.finfo(x.dtype).eps; its kernels and decompositions use the compute dtype's)."""
    if eps is None:
        return 2.0**-52 if x.dtype.itemsize == 8 else 2.0**-23
    return as_float("eps", eps)


def _out_like(x):
    if type(x).__module__ == "numpy":
        return None  # brrr._C allocates NumPy outputs
    out = empty_like(x)
    if out is None:
        raise TypeError(f"argument x: brrr cannot allocate outputs for {type(x).__name__} (it has no "
                        "__array_namespace__)")
    return out


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.layer_norm: (x - mean) / sqrt(var + eps) * weight + bias over the
    trailing dims `normalized_shape` (biased variance)."""
    if torch_if_tensor(x) is not None:
        try:
            return torch_layer().layer_norm(x, normalized_shape, weight, bias, eps)
        except RuntimeError:
            refuse_kinds(("x", x), ("weight", weight), ("bias", bias))
            raise
    k = normalized_ndim(shape_of("x", x), normalized_shape)
    return _C.layer_norm_fwd(x, weight, bias, out=_out_like(x), norm_ndim=k, eps=as_float("eps", eps))[0]


def rms_norm(x, normalized_shape, weight=None, eps=None, *, cast_order="torch", offset=0.0):
    """torch.nn.functional.rms_norm: x / sqrt(mean(x^2) + eps) * weight over the trailing dims
    `normalized_shape`; eps=None: see rms_eps. cast_order, offset (weight + offset in
    place of weight): see the module."""
    llama = llama_order(cast_order)
    if torch_if_tensor(x) is not None:
        try:
            return torch_layer().rms_norm(x, normalized_shape, weight, eps, llama, offset)
        except RuntimeError:
            refuse_kinds(("x", x), ("weight", weight))
            raise
    k = normalized_ndim(shape_of("x", x), normalized_shape)
    return _C.rms_norm_fwd(x, weight, out=_out_like(x), norm_ndim=k, eps=rms_eps(x, eps), llama=llama,
                           offset=as_float("offset", offset))[0]


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """(layer_norm(h), h) with h = x + residual (rounded to x's dtype), in one pass: the pre-norm
    block's residual add and norm. Gradients flow into x and residual through both outputs."""
    required("residual", residual)  # brrr._C's norm ops take None for the plain norms
    if torch_if_tensor(x) is not None:
        try:
            return torch_layer().add_layer_norm(x, residual, normalized_shape, weight, bias, eps)
        except RuntimeError:
            refuse_kinds(("x", x), ("residual", residual), ("weight", weight), ("bias", bias))
            raise
    k = normalized_ndim(shape_of("x", x), normalized_shape)
    return _C.layer_norm_fwd(x, weight, bias, residual, _out_like(x), _out_like(x), norm_ndim=k,
                             eps=as_float("eps", eps))[:2]


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, *, cast_order="torch", offset=0.0):
    """(rms_norm(h), h) with h = x + residual (rounded to x's dtype), in one pass."""
    required("residual", residual)
    llama = llama_order(cast_order)
    if torch_if_tensor(x) is not None:
        try:
            return torch_layer().add_rms_norm(x, residual, normalized_shape, weight, eps, llama, offset)
        except RuntimeError:
            refuse_kinds(("x", x), ("residual", residual), ("weight", weight))
            raise
    k = normalized_ndim(shape_of("x", x), normalized_shape)
    return _C.rms_norm_fwd(x, weight, residual, _out_like(x), _out_like(x), norm_ndim=k, eps=rms_eps(x, eps),
                           llama=llama, offset=as_float("offset", offset))[:2]


# ---- PyTorch: the custom ops brrr::layer_norm, add_layer_norm, rms_norm, add_rms_norm and
# norm_backward. The forward ops return, besides their results, what the backward needs per row
# (mean relative to the row's first element, and rstd; float32, float64 for float64 x) as
# non-differentiable outputs. norm_backward takes the saved normalised input (x, or the new
# residual h of the fused forms) and returns [grad_x, grad_weight (if asked), grad_bias (if
# asked)]; the fused forms' backward adds the gradient of h and hands the sum to x and residual.

@torch_integration
def torch_layer():
    import math
    from types import SimpleNamespace
    from typing import Optional

    import torch
    import torch.nn.functional as F

    from . import _op
    from ._op import TorchOp, out_like, stream
    from ._registry import cuda_autocast_upcasts, dispatch, readable, registry, same_kind, tensor_ok

    Tensor = torch.Tensor

    def stats(x, k):
        """A per-row statistic: float32, float64 for float64 x."""
        lead, dtype = x.shape[:x.dim() - k], torch.float64 if x.dtype == torch.float64 else torch.float32
        return x.new_empty(lead, dtype=dtype)

    def stat_args(x, k, n):
        """The statistics arguments of a forward: True (brrr._C allocates and returns them: each
        torch.empty is a few microseconds of Python), or new tensors where it cannot (no exchange
        table: torch before 2.10)."""
        return (True,) * n if _op.EXCHANGE_API else tuple(stats(x, k) for _ in range(n))

    def out_of(x):
        """The norm's output: contiguous whatever x's layout, as PyTorch's layer_norm and rms_norm
        return it (None: brrr._C allocates it so)."""
        return None if _op.EXCHANGE_API else torch.empty(x.shape, dtype=x.dtype, device=x.device)

    def layer_norm_fwd(x, k, weight, bias, eps, residual):
        """(out, h or None, mean, rstd): LayerNorm of x (of h = x + residual) over its last k dims."""
        if _op.EXCHANGE_API and x.is_contiguous():  # the usual call: brrr._C allocates every output, finds the stream
            return _C.layer_norm_fwd(x, weight, bias, residual, None, None, True, True, norm_ndim=k, eps=eps)
        h = None if residual is None else out_like(x)
        return _C.layer_norm_fwd(x, weight, bias, residual, out_of(x), h, *stat_args(x, k, 2), norm_ndim=k, eps=eps,
                                 stream=stream(x))

    def rms_norm_fwd(x, k, weight, eps, llama, offset, residual):
        """(out, h or None, rstd): RMSNorm of x (of h = x + residual) over its last k dims."""
        if _op.EXCHANGE_API and x.is_contiguous():  # as layer_norm_fwd
            return _C.rms_norm_fwd(x, weight, residual, None, None, True, norm_ndim=k, eps=eps, llama=llama,
                                   offset=offset)
        h = None if residual is None else out_like(x)
        return _C.rms_norm_fwd(x, weight, residual, out_of(x), h, *stat_args(x, k, 1), norm_ndim=k, eps=eps,
                               llama=llama, offset=offset, stream=stream(x))

    # The forwards where the eager Function records the op: called only by the entries below, which
    # checked normalized_shape against x (about 0.3 us a call).
    def layer_norm_eager(x, normalized_shape, weight, bias, eps):
        out, _, mean, rstd = layer_norm_fwd(x, len(normalized_shape), weight, bias, eps, None)
        return out, mean, rstd

    def add_layer_norm_eager(x, residual, normalized_shape, weight, bias, eps):
        return layer_norm_fwd(x, len(normalized_shape), weight, bias, eps, residual)

    def rms_norm_eager(x, normalized_shape, weight, eps, llama, offset):
        out, _, rstd = rms_norm_fwd(x, len(normalized_shape), weight, eps, llama, offset, None)
        return out, rstd

    def add_rms_norm_eager(x, residual, normalized_shape, weight, eps, llama, offset):
        return rms_norm_fwd(x, len(normalized_shape), weight, eps, llama, offset, residual)

    # The operators' forwards, which anyone may call through torch.ops.brrr: normalized_shape checked.
    def layer_norm(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], bias: Optional[Tensor],
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
        normalized_ndim(x.shape, normalized_shape)
        return layer_norm_eager(x, normalized_shape, weight, bias, eps)

    def add_layer_norm(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                       bias: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        normalized_ndim(x.shape, normalized_shape)
        return add_layer_norm_eager(x, residual, normalized_shape, weight, bias, eps)

    def rms_norm(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], eps: float,
                 llama: bool, offset: float) -> tuple[Tensor, Tensor]:
        normalized_ndim(x.shape, normalized_shape)
        return rms_norm_eager(x, normalized_shape, weight, eps, llama, offset)

    def add_rms_norm(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor], eps: float,
                     llama: bool, offset: float) -> tuple[Tensor, Tensor, Tensor]:
        normalized_ndim(x.shape, normalized_shape)
        return add_rms_norm_eager(x, residual, normalized_shape, weight, eps, llama, offset)

    # Without gradients: no statistics. Called only by the entries below, which checked normalized_shape.
    # The usual call (contiguous x, the exchange table) goes straight to brrr._C, which allocates the
    # output and finds the stream: out_like's and stream's frames were about 0.2 us of a tiny LayerNorm.
    def layer_norm_inference(x, normalized_shape, weight, bias, eps):
        if _op.EXCHANGE_API and x.is_contiguous():
            return _C.layer_norm_fwd(x, weight, bias, None, None, norm_ndim=len(normalized_shape), eps=eps)[0]
        return _C.layer_norm_fwd(x, weight, bias, out=out_of(x), norm_ndim=len(normalized_shape),
                                 eps=eps, stream=stream(x))[0]

    def add_layer_norm_inference(x, residual, normalized_shape, weight, bias, eps):
        return _C.layer_norm_fwd(x, weight, bias, residual, out_of(x), out_like(x),
                                 norm_ndim=len(normalized_shape), eps=eps, stream=stream(x))[:2]

    def rms_norm_inference(x, normalized_shape, weight, eps, llama, offset):
        if _op.EXCHANGE_API and x.is_contiguous():
            return _C.rms_norm_fwd(x, weight, None, None, norm_ndim=len(normalized_shape), eps=eps, llama=llama,
                                   offset=offset)[0]
        return _C.rms_norm_fwd(x, weight, out=out_of(x), norm_ndim=len(normalized_shape),
                               eps=eps, llama=llama, offset=offset, stream=stream(x))[0]

    def add_rms_norm_inference(x, residual, normalized_shape, weight, eps, llama, offset):
        return _C.rms_norm_fwd(x, weight, residual, out_of(x), out_like(x),
                               norm_ndim=len(normalized_shape), eps=eps, llama=llama, offset=offset,
                               stream=stream(x))[:2]

    def fake(*outputs):
        """A fake kernel: the forward's outputs: the norm's ("out", contiguous), the residual stream
        ("h", like x) and the statistics ("stat")."""
        def fake_kernel(x, *args):
            k = len(next(a for a in args if isinstance(a, (list, tuple))))
            made = {"out": lambda: x.new_empty(x.shape), "h": lambda: torch.empty_like(x), "stat": lambda: stats(x, k)}
            return tuple(made[o]() for o in outputs)
        return fake_kernel

    # ---- backward
    def partials(x, k, n_grads, dtype):
        """The CUDA backward's scratch for n_grads weight/bias gradients, where brrr._C cannot allocate
        it (no exchange table: torch before 2.10); None elsewhere."""
        if not n_grads or not x.is_cuda:
            return None
        cols = math.prod(x.shape[x.dim() - k:])
        rows = x.numel() // cols if cols else 0
        return torch.empty(n_grads * _C.norm_partial_rows(rows, cols) * cols, dtype=dtype, device=x.device)

    def norm_backward(x: Tensor, grad_out: Tensor, grad_residual: Optional[Tensor], weight: Optional[Tensor],
                      bias: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor, norm_ndim: int, llama: bool,
                      offset: float, weight_grad: bool, bias_grad: bool) -> list[Tensor]:
        """[grad of the normalised input, grad_weight (if asked), grad_bias (if asked)] in one launch;
        mean None: RMSNorm. x: the normalised input the forward saved (h for the fused forms)."""
        k = norm_ndim
        if _op.EXCHANGE_API:
            # True: brrr._C allocates it (like weight, so a bias gradient only where there is a weight), and the
            # CUDA scratch, and finds the stream.
            grad_weight = True if weight_grad else None
            grad_bias = (True if weight is not None else torch.empty_like(bias)) if bias_grad else None
            grad_x, scratch, cuda_stream = out_like(x), None, -1
        else:
            grad_weight = torch.empty_like(weight) if weight_grad else None
            grad_bias = torch.empty_like(bias) if bias_grad else None
            grad_x, scratch = out_like(x), partials(x, k, weight_grad + bias_grad, rstd.dtype)
            cuda_stream = stream(x)
        if mean is None:
            grads = _C.rms_norm_bwd(x, grad_out, grad_residual, weight, rstd, grad_x, grad_weight, scratch,
                                    norm_ndim=k, llama=llama, offset=offset, stream=cuda_stream)
        else:
            grads = _C.layer_norm_bwd(x, grad_out, grad_residual, weight, mean, rstd, grad_x, grad_weight,
                                      grad_bias, scratch, norm_ndim=k, stream=cuda_stream)
        # grad_x, then the parameter gradients asked for (no comprehension: a frame of its own)
        if bias_grad:
            return [grads[0], grads[1], grads[2]] if weight_grad else [grads[0], grads[2]]
        return [grads[0], grads[1]] if weight_grad else [grads[0]]

    def norm_backward_fake(x, grad_out, grad_residual, weight, bias, mean, rstd, norm_ndim, llama, offset, weight_grad,
                           bias_grad):
        return [torch.empty_like(x)] + [torch.empty_like(t) for t, need in ((weight, weight_grad), (bias, bias_grad))
                                        if need]

    backward_op = TorchOp("norm_backward", norm_backward, norm_backward_fake)

    def save(fused, rms):
        """Save the normalised input (x, or h), the parameters and the statistics; ctx.norm: the
        backward's (norm_ndim, llama, offset). The positions are fixed per op, read once here."""
        shape_at, weight_at, stats_at = (2, 3, 2) if fused else (1, 2, 1)
        h_of = (lambda args, results: results[1]) if fused else (lambda args, results: args[0])

        if rms:
            def save_for_backward(ctx, args, results):
                ctx.norm = (len(args[shape_at]), bool(args[-2]), args[-1])
                ctx.save_for_backward(h_of(args, results), args[weight_at], None, None, results[stats_at])
        else:
            def save_for_backward(ctx, args, results):
                ctx.norm = (len(args[shape_at]), False, 0.0)
                ctx.save_for_backward(h_of(args, results), args[weight_at], args[weight_at + 1], results[stats_at],
                                      results[stats_at + 1])
        return save_for_backward

    def formula(fused, rms):
        weight_at = 3 if fused else 2
        # The gradients of the arguments after the parameters (eps; llama and offset): none.
        tail = (None, None, None) if rms else (None,)

        def backward(ctx, grads, run):
            h, weight, bias, mean, rstd = ctx.saved_tensors
            grad_out, grad_h = grads if fused else (grads[0], None)
            needs = ctx.needs_input_grad
            need_weight, need_bias = needs[weight_at], not rms and needs[weight_at + 1]
            if grad_out is None:
                grad_x = grad_h
                grad_weight = grad_bias = None
            else:
                k, llama, offset = ctx.norm
                got = run(backward_op)(h, grad_out, grad_h, weight, bias, mean, rstd, k, llama, offset, need_weight,
                          need_bias)
                grad_x = got[0]
                grad_weight = got[1] if need_weight else None
                grad_bias = got[-1] if need_bias else None
            head = (grad_x, grad_x, None) if fused else (grad_x, None)
            return head + ((grad_weight,) if rms else (grad_weight, grad_bias)) + tail
        return backward

    ops = SimpleNamespace()
    for name, forward, eager, inference, outputs, fused, rms, grad_args in [
        ("layer_norm", layer_norm, layer_norm_eager, layer_norm_inference, ("out", "stat", "stat"), False, False,
         (0, 2, 3)),
        ("add_layer_norm", add_layer_norm, add_layer_norm_eager, add_layer_norm_inference, ("out", "h", "stat", "stat"),
         True, False, (0, 1, 3, 4)),
        ("rms_norm", rms_norm, rms_norm_eager, rms_norm_inference, ("out", "stat"), False, True, (0, 2)),
        ("add_rms_norm", add_rms_norm, add_rms_norm_eager, add_rms_norm_inference, ("out", "h", "stat"), True, True,
         (0, 1, 3)),
    ]:
        setattr(ops, name, TorchOp(name, forward, fake(*outputs), save=save(fused, rms), backward=formula(fused, rms),
                                   outputs=2 if fused else 1, grad_args=grad_args, eager=eager, inference=inference))

    def shape_list(x, normalized_shape):
        """normalized_shape as the custom ops' schema takes it (a list or tuple of ints), checked
        against x (TypeError or ValueError naming it). A list or tuple is passed on as it is: a
        copy was about 0.05 us of a tiny LayerNorm's call on this project's CPU machine."""
        normalized_ndim(x.shape, normalized_shape)
        return normalized_shape if isinstance(normalized_shape, (list, tuple)) else [normalized_shape]

    # The entries brrr's public functions and the registry call with torch tensors.
    def layer_norm_entry(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        check_torch((weight, bias), ("weight", "bias"))
        return ops.layer_norm(x, shape_list(x, normalized_shape), weight, bias,
                              eps if eps.__class__ is float else as_float("eps", eps))

    def add_layer_norm_entry(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
        check_torch((residual, weight, bias), ("residual", "weight", "bias"))
        return ops.add_layer_norm(x, residual, shape_list(x, normalized_shape), weight, bias, as_float("eps", eps))

    def rms_norm_entry(x, normalized_shape, weight=None, eps=None, llama=False, offset=0.0):
        check_torch((weight,), ("weight",))
        return ops.rms_norm(x, shape_list(x, normalized_shape), weight, rms_eps(x, eps), llama,
                            offset if offset.__class__ is float else as_float("offset", offset))

    def add_rms_norm_entry(x, residual, normalized_shape, weight=None, eps=None, llama=False, offset=0.0):
        check_torch((residual, weight), ("residual", "weight"))
        return ops.add_rms_norm(x, residual, shape_list(x, normalized_shape), weight, rms_eps(x, eps), llama,
                                as_float("offset", offset))

    # ---- the registry
    def rms_norm_(x, normalized_shape, weight=None, eps=None, *, cast_order="torch", offset=0.0):
        return rms_norm_entry(x, normalized_shape, weight, eps, llama_order(cast_order), offset)

    def add_rms_norm_(x, residual, normalized_shape, weight=None, eps=None, *, cast_order="torch", offset=0.0):
        return add_rms_norm_entry(x, residual, normalized_shape, weight, eps, llama_order(cast_order), offset)

    halves = (torch.float16, torch.bfloat16)

    def params_ok(x, *params):
        """Weight and bias in x's dtype, or float32 for half inputs (as autocast leaves them), on x's device."""
        for p in params:
            if p is None:
                continue
            if not isinstance(p, torch.Tensor) or not (p.dtype == x.dtype or (p.dtype == torch.float32 and
                                                                              x.dtype in halves)):
                return False
            if p.device != x.device or not readable(p):
                return False
        return True

    def shape_and_eps_ok(normalized_shape, eps):
        """What torch's functions take and brrr's refuse goes to torch's: eps a tensor or negative
        (torch computes, NaN for a negative one), dims that are not ints."""
        dims = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        return (isinstance(dims, (tuple, list, torch.Size)) and all(type(d) is int for d in dims)
                and (eps is None or (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0)))

    def llama_keeps_dtype(x, weight, cast_order="torch", offset=0.0, **kwargs):
        """Llama's order without an offset scales the normalised x, rounded to x's dtype, by the weight
        in its own dtype: a float32 weight makes the result float32 (as the model's own module
        returns it), where brrr's kernels write x's dtype."""
        return cast_order != "llama" or bool(offset) or weight is None or weight.dtype == x.dtype

    # Under CUDA autocast torch's layer_norm runs in float32 and returns float32: half inputs then go to it.
    def layer_norm_ok(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        return (tensor_ok(x) and params_ok(x, weight, bias) and shape_and_eps_ok(normalized_shape, eps)
                and not cuda_autocast_upcasts(x))

    def rms_norm_ok(x, normalized_shape, weight=None, eps=None, **kwargs):
        return (tensor_ok(x) and params_ok(x, weight) and shape_and_eps_ok(normalized_shape, eps)
                and llama_keeps_dtype(x, weight, **kwargs))

    def add_layer_norm_ok(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
        return (tensor_ok(x) and same_kind(x, residual) and residual.shape == x.shape and params_ok(x, weight, bias)
                and shape_and_eps_ok(normalized_shape, eps) and not cuda_autocast_upcasts(x))

    def add_rms_norm_ok(x, residual, normalized_shape, weight=None, eps=None, **kwargs):
        return (tensor_ok(x) and same_kind(x, residual) and residual.shape == x.shape and params_ok(x, weight)
                and shape_and_eps_ok(normalized_shape, eps) and llama_keeps_dtype(x, weight, **kwargs))

    # torch's, bound before brrr.use_fused can route these names of F here
    torch_layer_norm, torch_rms_norm = F.layer_norm, F.rms_norm

    def rms_norm_reference(input, normalized_shape, weight=None, eps=None, *, cast_order="torch", offset=0.0):
        # `input`, as F.rms_norm names it: registry calls by torch's keywords end here
        x = input
        if cast_order == "torch" and not offset:
            return torch_rms_norm(x, normalized_shape, weight, eps)
        dims = tuple(range(-(1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape))), 0))
        if offset:
            # Gemma's form: normalised in fp32 (fp64 for float64), scaled by offset + weight in that
            # dtype, one cast at the end (Llama's order: the normalised input rounded to x's dtype first).
            if weight is None:
                raise ValueError("argument offset: nonzero without weight (it is added to the weight)")
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            h = x.to(acc)
            h = h * torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + (torch.finfo(acc).eps if eps is None else eps))
            if cast_order == "llama":
                h = h.to(x.dtype).to(acc)
            return (h * (weight.to(acc) + offset)).to(x.dtype)
        # Llama's order: normalise in fp32, round to x's dtype, then scale.
        h = x.float()
        eps = torch.finfo(torch.float32).eps if eps is None else eps
        h = (h * torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + eps)).to(x.dtype)
        return h if weight is None else weight * h

    def add_layer_norm_reference(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
        h = x + residual
        return torch_layer_norm(h, normalized_shape, weight, bias, eps), h

    def add_rms_norm_reference(x, residual, normalized_shape, weight=None, eps=None, *, cast_order="torch",
                               offset=0.0):
        h = x + residual
        return rms_norm_reference(h, normalized_shape, weight, eps, cast_order=cast_order, offset=offset), h

    # On CPU tensors PyTorch's LayerNorm measured as fast as brrr's, its RMSNorm slower (brrr/_registry.py).
    for name, reference, implementation, supports, cpu in [
        ("layer_norm", torch_layer_norm, layer_norm_entry, layer_norm_ok, "pytorch"),
        ("rms_norm", rms_norm_reference, rms_norm_, rms_norm_ok, "kernel"),
        ("add_layer_norm", add_layer_norm_reference, add_layer_norm_entry, add_layer_norm_ok, "pytorch"),
        ("add_rms_norm", add_rms_norm_reference, add_rms_norm_, add_rms_norm_ok, "pytorch"),
    ]:
        registry.register(name, reference, implementation, supports, compiled="inductor", cpu=cpu)

    class LayerNorm(torch.nn.LayerNorm):
        def forward(self, input):  # torch.nn.LayerNorm's argument name: module(input=x) works alike
            return dispatch("layer_norm", input, self.normalized_shape, self.weight, self.bias, self.eps)

        def residual_forward(self, x, residual):
            """(self(residual + x), residual + x) in one pass: brrr.add_layer_norm."""
            return dispatch("add_layer_norm", x, residual, self.normalized_shape, self.weight, self.bias, self.eps)

    class RMSNorm(torch.nn.RMSNorm):
        """torch.nn.RMSNorm (the same constructor). Two class attributes, set on an instance to
        change them: cast_order="llama" rounds the normalised input before scaling, as Llama-style
        models do, and offset=1.0 scales by (1 + weight) in float32, as Gemma's RMSNorm does (see
        brrr.rms_norm)."""

        cast_order = "torch"
        offset = 0.0

        def forward(self, x):
            return dispatch("rms_norm", x, self.normalized_shape, self.weight, self.eps, cast_order=self.cast_order,
                            offset=self.offset)

        def residual_forward(self, x, residual):
            """(self(residual + x), residual + x) in one pass: brrr.add_rms_norm."""
            return dispatch("add_rms_norm", x, residual, self.normalized_shape, self.weight, self.eps,
                            cast_order=self.cast_order, offset=self.offset)

    def layer_norm_route(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        return dispatch("layer_norm", input, normalized_shape, weight, bias, eps)

    def rms_norm_route(input, normalized_shape, weight=None, eps=None):
        return dispatch("rms_norm", input, normalized_shape, weight, eps)

    return SimpleNamespace(layer_norm=layer_norm_entry, add_layer_norm=add_layer_norm_entry, rms_norm=rms_norm_entry,
                           add_rms_norm=add_rms_norm_entry, backward=backward_op, modules=[LayerNorm, RMSNorm],
                           functional={"layer_norm": layer_norm_route, "rms_norm": rms_norm_route})
