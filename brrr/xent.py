"""Softmax cross-entropy, the loss at the end of every language model:

    loss = brrr.cross_entropy(logits, target)          # torch.nn.functional.cross_entropy
    loss = brrr.cross_entropy(logits, target, dtype=torch.float32)   # as F.cross_entropy(logits.float(), target)
    loss = brrr.linear_cross_entropy(hidden, weight, target)         # of hidden @ weight.T, never held whole

One pass forward (reads the logits once, keeps one log-sum-exp per row) and one backward (reads
the logits, writes their gradient). PyTorch's eager path writes the log-probabilities, and a
model that upcasts its bf16 logits first (Hugging Face's causal-LM loss) writes a float32 copy
too: at 16384 tokens of a 32000-word vocabulary that is 2 GiB per copy. The backward
rematerialises the softmax from the logits and the saved log-sum-exp.

Arguments as torch.nn.functional.cross_entropy's with class-index targets: input (C,), (N, C) or
(N, C, d1, ...), target (), (N,) or (N, d1, ...) of int64 (int32 and uint8 too), ignore_index,
reduction "mean" (over the rows whose target is not ignore_index; NaN when there are none, as
in torch), "sum" or "none", label_smoothing in [0, 1]. Per-class weights and probability targets
are not supported (the registry sends them to PyTorch). Two more, keyword only, in the same
pass: softcap c (Gemma 2's final-logit softcap: the loss of c * tanh(input / c), its gradient
taken through the tanh) and z_loss z (PaLM's auxiliary loss: z * logsumexp(row)^2 added to each
counted row's loss, logsumexp taken after the softcap). Math in float32 (float64 for float64);
the loss comes in `dtype`, by default the input's. Sums over rows run in a fixed order: bitwise
reproducible. Inputs with rank 3 or more are read in place through a view with the class dim
last, whose classes are strided (slower than a class dim of stride 1).

A target outside [0, C) that is not ignore_index raises ValueError on the CPU; on CUDA, where the
check would cost a device-to-host sync, that row's loss (and so a mean or sum) and its gradient
are NaN.
"""

import math
import numbers

from . import _C
from ._args import as_float, as_int, bad_choice, named, refuse_kinds
from ._frameworks import array_namespace, astype, empty, torch_if_tensor

REDUCTIONS = ("mean", "sum", "none")


def check_args(weight, ignore_index, reduction, label_smoothing, softcap=None, z_loss=0.0):
    """The arguments brrr's kernels take, checked; raises naming the argument."""
    if weight is not None:
        raise ValueError("argument weight: per-class weights are not supported by brrr.cross_entropy (use "
                         "torch.nn.functional.cross_entropy; brrr.registry falls back to it)")
    as_int("ignore_index", ignore_index)
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise bad_choice("reduction", reduction, REDUCTIONS)
    if not 0.0 <= as_float("label_smoothing", label_smoothing) <= 1.0:  # NaN too
        raise ValueError(f"argument label_smoothing: expected a float in [0, 1], got {label_smoothing}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"argument softcap: expected None or a float, got {type(softcap).__name__}")
        if not 0.0 < softcap < math.inf:  # NaN too
            raise ValueError(f"argument softcap: expected None or a finite float > 0, got {softcap}")
    if isinstance(z_loss, bool) or not isinstance(z_loss, numbers.Real):
        raise TypeError(f"argument z_loss: expected a float, got {type(z_loss).__name__}")
    if not 0.0 <= z_loss < math.inf:
        raise ValueError(f"argument z_loss: expected a finite float >= 0, got {z_loss}")


def check_rank(ndim):
    if ndim == 0:
        raise ValueError("argument input: expected a tensor of shape (C,), (N, C) or (N, C, d1, ...), got a 0-d one")


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                  softcap=None, z_loss=0.0, dtype=None):
    """torch.nn.functional.cross_entropy for class-index targets, fused; softcap and z_loss as the
    module says; `dtype` is the loss's dtype (default: the input's). See the module for what is
    supported."""
    check_args(weight, ignore_index, reduction, label_smoothing, softcap, z_loss)
    return named(_NAMES, _cross_entropy, input, target, int(ignore_index), reduction, float(label_smoothing), dtype,
                 None if softcap is None else float(softcap), float(z_loss))


_NAMES = {"logits": "input"}  # brrr._C's name for it (the input with its class dim last)


def _cross_entropy(input, target, ignore_index, reduction, label_smoothing, dtype, softcap, z_loss):
    torch = torch_if_tensor(input)
    if torch is not None:
        from . import _torch_xent

        try:
            return _torch_xent.cross_entropy(input, target, ignore_index, reduction, label_smoothing, dtype, softcap,
                                             z_loss)
        except RuntimeError:
            refuse_kinds(("input", input), ("target", target))
            raise
    xp = array_namespace(input)
    check_rank(input.ndim)
    logits = input if input.ndim <= 2 else xp.moveaxis(input, 1, -1)
    shape = logits.shape[:-1]
    acc = xp.float64 if input.dtype == xp.float64 else xp.float32
    lse, loss = empty(xp, shape, acc, input), empty(xp, shape, acc, input)
    total = None if reduction == "none" else empty(xp, (), acc, input)
    _C.cross_entropy_fwd(logits, target, lse, loss, total, ignore_index=ignore_index, label_smoothing=label_smoothing,
                         softcap=softcap, z_loss=z_loss, reduction=reduction)
    result = loss if total is None else total
    return astype(xp, result, input.dtype if dtype is None else dtype)


# Bytes of logits linear_cross_entropy holds at once by default: one chunk of rows.
LOGITS_BUDGET = 2**28
_INDEX_DTYPES = ("torch.int64", "torch.int32", "torch.uint8")


def linear_cross_entropy(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, softcap=None, z_loss=0.0, dtype=None, logits_budget=LOGITS_BUDGET):
    """cross_entropy(input @ weight.T + bias, target) (the arguments as cross_entropy's) without
    ever holding more than `logits_budget` bytes of logits: the rows go in chunks of that size,
    each chunk's logits turned into its loss and, in place, its gradient by brrr's kernel, the
    GEMMs run by PyTorch. input (..., H), weight (V, H), bias None or (V,), all of one floating
    dtype on one device; target input.shape[:-1] of class indices; the loss in `dtype` (default:
    the input's). With autograd recording and reduction "mean" or "sum" the forward computes the
    gradients too (the backward only scales them); the weight's and bias's accumulate over the
    chunks in float32 (float64 for float64), in a fixed order. PyTorch tensors only."""
    check_args(None, ignore_index, reduction, label_smoothing, softcap, z_loss)
    torch = torch_if_tensor(input)
    if torch is None:
        raise TypeError(f"argument input: brrr.linear_cross_entropy takes PyTorch tensors (its GEMMs run in "
                        f"PyTorch), got {type(input).__name__}")
    _check_linear(torch, input, weight, target, bias)
    if isinstance(logits_budget, bool) or not isinstance(logits_budget, numbers.Integral) or logits_budget <= 0:
        raise ValueError(f"argument logits_budget: expected a positive int (bytes), got {logits_budget!r}")
    from . import _torch_linear_xent

    return _torch_linear_xent.linear_cross_entropy(input, weight, target, bias, int(ignore_index), reduction,
                                                   float(label_smoothing), None if softcap is None else float(softcap),
                                                   float(z_loss), dtype, int(logits_budget))


def _check_linear(torch, input, weight, target, bias):
    floats = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    for name, t in (("weight", weight), ("target", target)) + ((("bias", bias),) if bias is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument {name}: expected a torch.Tensor, got {type(t).__name__}")
    if input.dtype not in floats:
        raise TypeError(f"argument input: expected a float32, float16, bfloat16 or float64 tensor, got {input.dtype}")
    if input.dim() == 0:
        raise ValueError("argument input: expected a tensor of shape (..., hidden), got a 0-d one")
    if weight.dim() != 2 or weight.shape[1] != input.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"argument weight: expected shape (classes >= 1, {input.shape[-1]}) for an input of shape "
                         f"{tuple(input.shape)}, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"argument bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != input.dtype or t.device != input.device):
            raise TypeError(f"argument {name}: expected {input.dtype} on {input.device} (the input's), got {t.dtype} "
                            f"on {t.device}")
    if str(target.dtype) not in _INDEX_DTYPES:
        raise TypeError(f"argument target: expected class indices (int64, int32 or uint8), got {target.dtype}")
    if target.shape != input.shape[:-1] or target.device != input.device:
        raise ValueError(f"argument target: expected shape {tuple(input.shape[:-1])} on {input.device} (the input's "
                         f"without its last dim), got {tuple(target.shape)} on {target.device}")
