"""Softmax cross-entropy, the loss at the end of every language model:

    loss = brrr.cross_entropy(logits, target)          # torch.nn.functional.cross_entropy
    loss = brrr.cross_entropy(logits, target, dtype=torch.float32)   # as F.cross_entropy(logits.float(), target)

One pass forward (reads the logits once, keeps one log-sum-exp per row) and one backward (reads
the logits, writes their gradient). PyTorch's eager path writes the log-probabilities, and a
model that upcasts its bf16 logits first (Hugging Face's causal-LM loss) writes a float32 copy
too: at 16384 tokens of a 32000-word vocabulary that is 2 GiB per copy. The backward
rematerialises the softmax from the logits and the saved log-sum-exp.

Arguments as torch.nn.functional.cross_entropy's with class-index targets: input (C,), (N, C) or
(N, C, d1, ...), target (), (N,) or (N, d1, ...) of int64 (int32 and uint8 too), ignore_index,
reduction "mean" (over the rows whose target is not ignore_index; NaN when there are none, as
in torch), "sum" or "none", label_smoothing in [0, 1]. Per-class weights and probability targets
are not supported (the registry sends them to PyTorch). Math in float32 (float64 for float64);
the loss comes in `dtype`, by default the input's. Sums over rows run in a fixed order: bitwise
reproducible. Inputs with rank 3 or more are read in place through a view with the class dim
last, whose classes are strided (slower than a class dim of stride 1).

A target outside [0, C) that is not ignore_index raises ValueError on the CPU; on CUDA, where the
check would cost a device-to-host sync, that row's loss (and so a mean or sum) and its gradient
are NaN.
"""

import numbers

from . import _C
from ._frameworks import array_namespace, astype, empty, torch_if_tensor

REDUCTIONS = ("mean", "sum", "none")


def check_args(weight, ignore_index, reduction, label_smoothing):
    """The arguments brrr's kernels take, checked; raises naming the argument."""
    if weight is not None:
        raise ValueError("argument weight: per-class weights are not supported by brrr.cross_entropy (use "
                         "torch.nn.functional.cross_entropy; brrr.registry falls back to it)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"argument ignore_index: expected an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"argument reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"argument label_smoothing: expected a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:  # NaN too
        raise ValueError(f"argument label_smoothing: expected a float in [0, 1], got {label_smoothing}")


def check_rank(ndim):
    if ndim == 0:
        raise ValueError("argument input: expected a tensor of shape (C,), (N, C) or (N, C, d1, ...), got a 0-d one")


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                  dtype=None):
    """torch.nn.functional.cross_entropy for class-index targets, fused; `dtype` is the loss's
    dtype (default: the input's). See the module for what is supported."""
    check_args(weight, ignore_index, reduction, label_smoothing)
    torch = torch_if_tensor(input)
    if torch is not None:
        from . import _torch_xent

        return _torch_xent.cross_entropy(input, target, int(ignore_index), reduction, float(label_smoothing), dtype)
    xp = array_namespace(input)
    check_rank(input.ndim)
    logits = input if input.ndim <= 2 else xp.moveaxis(input, 1, -1)
    shape = logits.shape[:-1]
    acc = xp.float64 if input.dtype == xp.float64 else xp.float32
    lse, loss = empty(xp, shape, acc, input), empty(xp, shape, acc, input)
    total = None if reduction == "none" else empty(xp, (), acc, input)
    _C.cross_entropy_fwd(logits, target, int(ignore_index), float(label_smoothing), reduction, lse, loss, total,
                         None, -1)
    result = loss if total is None else total
    return astype(xp, result, input.dtype if dtype is None else dtype)
