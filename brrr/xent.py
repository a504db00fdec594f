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
from ._frameworks import array_namespace, as_float_dtype, astype, check_torch, empty, torch_if_tensor
from ._integration import torch_integration

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


def check_chunking(logits_budget, accumulation):
    """linear_cross_entropy's logits_budget (None or a positive int of bytes) and accumulation."""
    if logits_budget is not None and (isinstance(logits_budget, bool) or not isinstance(logits_budget, numbers.Integral)
                                      or logits_budget <= 0):
        raise ValueError(f"argument logits_budget: expected None or a positive int (bytes), got {logits_budget!r}")
    if not isinstance(accumulation, str) or accumulation not in ACCUMULATIONS:
        raise bad_choice("accumulation", accumulation, ACCUMULATIONS)


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
    if torch_if_tensor(input) is not None:
        try:
            return torch_layer().cross_entropy(input, target, ignore_index, reduction, label_smoothing, dtype, softcap,
                                          z_loss)
        except RuntimeError:
            refuse_kinds(("input", input), index=("target", target))
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
    return astype(xp, result, input.dtype) if dtype is None else as_float_dtype(xp, result, dtype)


# A budget of logits that linear_cross_entropy's chunks by rows never go below (128 MiB: at 16384 x
# 4096 and 128256 words in bf16, 512 rows, no more than the input, Liger-Kernel's chunk), and
# the budget that tests and benchmarks pass to get that chunk.
LOGITS_BUDGET = 2**27
# How its weight gradient accumulates over the chunks: in the weight's dtype, in place (no buffer
# beyond the gradient itself), or in float32 (float64 for float64), rounded once in the backward.
ACCUMULATIONS = ("weight", "float32")
# The chunks' rows are a multiple of it where the budget fits that many (chunk_rows).
GEMM_TILE_ROWS = 128
# On CUDA, run each chunk's input-gradient GEMM on a second stream, beside its weight-gradient GEMM
# (both only read the chunk's logit gradient): the input's GEMM (rows x hidden, few output tiles
# for a GPU's SMs) and the weight's (whose read and write of the accumulator cuBLAS does not hide)
# may fill each other's idle SMs. Off by default until measured: the "two streams" rows of
# benchmarks/test_bench_linear_xent.py time it. The results are the same bits either way.
INPUT_GRAD_STREAM = False
# Run the chunks over the rows whose target is not ignore_index only (a chunk's rows gathered into
# the rows of grad_input that its gradient then fills, packed, placed at the end; ignored rows'
# gradients are zero and their logits unused), which saves the ignored share of all three GEMMs and
# of the accumulator's round trips, in no more memory. The kept rows' count takes a host sync, so
# off by default, and off under CUDA-graph capture; the weight's gradient sums the same rows in
# another grouping (deterministic still).
SKIP_IGNORED_ROWS = False


def linear_cross_entropy(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, softcap=None, z_loss=0.0, dtype=None, logits_budget=None,
                         accumulation="float32"):
    """cross_entropy(input @ weight.T + bias, target) (the arguments as cross_entropy's) without ever
    holding more than one chunk of rows' logits: `logits_budget` bytes of them, or, by default
    (None), the rows that auto_chunk_rows chooses (1024 rows of bf16 logits with a bf16 accumulator,
    2048 with a float32 one, at most half the accumulator's bytes). Each chunk's logits are turned
    into its loss and, in place, its gradient by brrr's kernel; the GEMMs run in PyTorch. input
    (..., H), weight (V, H), bias None or (V,), all of one floating dtype on one device; target
    input.shape[:-1] of class indices; the loss in `dtype` (default: the input's). With autograd
    recording and reduction "mean" or "sum" the forward computes the gradients too (the backward
    only scales them, in place). The chunks sum into the weight's gradient in a fixed order: with
    accumulation "float32" (the default) in float32 (float64 for float64), rounded once at the end
    (a buffer of twice a half-precision weight's bytes); with "weight" in the weight's dtype, in
    place (each chunk's GEMM accumulates in float32 and rounds the sum once to the weight's dtype;
    no buffer beyond the gradient: Liger-Kernel's choice, at a few times the rounding error). The
    bias's in float32. PyTorch tensors only."""
    check_args(None, ignore_index, reduction, label_smoothing, softcap, z_loss)
    torch = torch_if_tensor(input)
    if torch is None:
        raise TypeError(f"argument input: brrr.linear_cross_entropy takes PyTorch tensors (its GEMMs run in "
                        f"PyTorch), got {type(input).__name__}")
    _check_linear(torch, input, weight, target, bias)
    _check_targets_on_cpu(torch, target, weight.shape[0], int(ignore_index))
    check_chunking(logits_budget, accumulation)
    return torch_layer().linear_cross_entropy(input, weight, target, bias, int(ignore_index), reduction,
                                         float(label_smoothing), None if softcap is None else float(softcap),
                                         float(z_loss), dtype, None if logits_budget is None else int(logits_budget),
                                         accumulation)


def _check_linear(torch, input, weight, target, bias):
    """linear_cross_entropy's tensors, by the rule of docs/errors.md: each a torch tensor of a kind
    brrr takes (brrr._C's error for a sparse, nested, quantized or meta one, or a dtype it does not
    take), then their shapes, dtypes and devices against the input's."""
    for name, t in (("weight", weight), ("target", target)) + ((("bias", bias),) if bias is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument {name}: expected a torch.Tensor, got {type(t).__name__}")
    if not torch.compiler.is_compiling():  # brrr._C's checks: a graph break under torch.compile, which has its own
        refuse_kinds(("input", input), ("weight", weight), ("bias", bias), index=("target", target))
    if input.dim() == 0:
        raise ValueError("argument input: expected a tensor of shape (..., hidden), got a 0-d one")
    if weight.dim() != 2 or weight.shape[1] != input.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"argument weight: expected shape (classes >= 1, {input.shape[-1]}) for an input of shape "
                         f"{tuple(input.shape)}, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"argument bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != input.dtype or t.device != input.device):
            raise ValueError(f"argument {name}: expected {input.dtype} on {input.device} (the input's), got "
                             f"{t.dtype} on {t.device}")
    if target.shape != input.shape[:-1] or target.device != input.device:
        raise ValueError(f"argument target: expected shape {tuple(input.shape[:-1])} on {input.device} (the input's "
                         f"without its last dim), got {tuple(target.shape)} on {target.device}")


def _check_targets_on_cpu(torch, target, classes, ignore_index):
    """On the CPU (no sync to pay), every target a class or ignore_index, the first other one named
    by its row in target: brrr._C's check sees one chunk of rows at a time, and would count the row
    within it. (On CUDA such a row's loss is NaN, as cross_entropy's.) Compared in int64, as the
    kernel compares: in uint8, -100 and a class count of 256 or more would wrap."""
    if target.device.type != "cpu" or torch.compiler.is_compiling():
        return
    flat = target.reshape(-1).to(torch.int64)
    bad = ((flat != ignore_index) & ((flat < 0) | (flat >= classes))).nonzero()
    if len(bad):
        row = int(bad[0, 0])
        raise ValueError(f"argument target: class index {int(flat[row])} (row {row}) is out of range for {classes} "
                         f"classes (and is not ignore_index {ignore_index})")


def chunk_rows(vocab, itemsize, budget, multiple=1):
    """Rows per chunk of linear_cross_entropy: as many as fit `budget` bytes of logits, at least one,
    rounded down to a multiple of `multiple` where at least that many fit (whole GEMM tiles: at 523
    rows a 128-row tile would run 11 rows of its fifth)."""
    rows = max(1, budget // max(1, vocab * itemsize))
    return rows - rows % multiple if rows >= multiple else rows


def auto_chunk_rows(vocab, hidden, itemsize, acc_itemsize):
    """Rows per chunk of linear_cross_entropy without a logits_budget: `itemsize` the logits',
    `acc_itemsize` the weight gradient's accumulator's. Each chunk's GEMM into the accumulator
    reads and writes all of it (2 * acc_itemsize bytes per weight element; cuBLAS does not hide
    that behind its arithmetic: on an H200 at 16384 x 4096 x 128256 in bf16, halving the chunks
    saved 16 ms with a float32 accumulator and 7 ms with a bf16 one, about those bytes at 4 TB/s),
    while the chunk's three GEMMs do 6 * rows FLOPs per weight element. At an H200's ~175 bf16
    FLOPs per byte (cuBLAS's ~700 TFLOP/s against 4 TB/s) the round trips cost 58 *
    acc_itemsize / rows of the GEMMs' time, whatever the vocabulary and hidden sizes: 1024 rows of
    half-precision logits per 2 bytes of accumulator (1024 for bf16, 2048 for float32) hold that
    to 11% (float32 and float64 logits, whose GEMMs run several times slower, take 1024). The
    logits held are capped at half the accumulator's bytes, never below LOGITS_BUDGET (with
    half-precision logits and hidden sizes under 2048 that gives fewer rows: hidden / 2 with a
    bf16 accumulator, hidden with a float32 one, where 128 MiB does not hold more)."""
    rows = 1024 * acc_itemsize // itemsize
    cap = max(LOGITS_BUDGET, vocab * hidden * acc_itemsize // 2)
    return chunk_rows(vocab, itemsize, min(rows * vocab * itemsize, cap), GEMM_TILE_ROWS)


# ---- PyTorch: the custom ops brrr::cross_entropy and brrr::linear_cross_entropy, their backward
# ops, the registry's entries and brrr.nn modules.
#
# brrr::cross_entropy takes logits with the class dim last (and softcap, None for none, and z_loss)
# and returns [loss, lse, count]: the loss (float32, float64 for float64 logits; 0-d for mean and
# sum, per row for none), and, as non-differentiable outputs for the backward, each row's
# log-sum-exp (less the target's logit where that is finite: brrr_cuda.h) and the number of rows
# counted. brrr::cross_entropy_backward rematerialises the softmax from logits and lse. Under
# torch.compile the forward is brrr's kernel (one read of the logits; inductor's reads them more
# than once) and the backward the same formula in PyTorch ops, which inductor fuses.
#
# brrr::linear_cross_entropy: cross_entropy(input @ weight.T + bias, target) without ever holding
# more than one chunk of rows' logits. Per chunk of rows, in order:
#     logits      = input[rows] @ weight.T + bias              torch.addmm / torch.mm (cuBLAS on CUDA)
#     loss[rows], logits <- its gradient                       brrr's fused cross-entropy kernel, in place
#     grad_input[rows]  = grad_logits @ weight                 torch.mm into the result's rows
#     grad_weight      += grad_logits.T @ input[rows]          in place, in the weight's dtype or float32
#     grad_bias        += grad_logits summed over rows         float32 accumulator
# so the chunk's logits buffer is the only vocabulary-sized activation, and the chunks run in a
# fixed order (deterministic). With reduction "mean" or "sum" this is the forward, when autograd
# records it: the backward only scales the three gradients by the loss's upstream gradient, in
# their own memory (a float32 accumulator rounded to the parameter's dtype into the start of its
# storage), so a second backward through the graph raises. With reduction "none" each row's
# upstream gradient is needed inside the kernel, so the forward computes only the loss and the
# backward runs the chunks again. Without autograd only the loss is computed.
#
# It takes input (N, H), weight (V, H), target (N,), bias, ..., chunk_rows, accumulation, needs and
# returns [loss, grad_input, grad_weight, grad_bias]: the loss in the accumulation dtype (float32,
# float64 for float64; 0-d, or (N,) for reduction "none"), and, for the inputs `needs` marks (with
# "mean" or "sum"), their unscaled gradients (the input's in its dtype; the weight's in its dtype
# with accumulation "weight", else in the accumulation dtype, as the bias's); empty tensors for
# the others. The chunk size is a Python int fixed by the vocabulary and the memory budget, and
# the count of "mean" stays on the device: no host sync, no allocation that depends on data, so
# the op is CUDA-graph capturable; torch.compile sees it through its fake kernel.

@torch_integration
def torch_layer():
    from types import SimpleNamespace
    from typing import Optional

    import torch
    import torch.nn.functional as F

    from . import _op
    from ._op import TorchOp, restored_gradients, saved_gradients, stream
    from ._registry import dispatch, float_dtype, registry, same_kind, tensor_ok, traced_by_a_mode

    Tensor = torch.Tensor

    def acc_dtype(dtype):
        return torch.float64 if dtype == torch.float64 else torch.float32

    # ---- cross_entropy
    def forward(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, softcap: Optional[float],
                z_loss: float, reduction: str) -> list[Tensor]:
        total = None if reduction == "none" else True
        if _op.EXCHANGE_API:  # brrr._C allocates the outputs (None, True): no torch.empty per output
            lse = rows = None
            count = True
        else:
            acc, shape, device = acc_dtype(logits.dtype), target.shape, logits.device
            lse, rows = torch.empty(shape, dtype=acc, device=device), torch.empty(shape, dtype=acc, device=device)
            total = None if total is None else torch.empty((), dtype=acc, device=device)
            count = torch.empty((), dtype=acc, device=device)
        lse, rows, total, count = _C.cross_entropy_fwd(logits, target, lse, rows, total, count,
                                                       ignore_index=ignore_index, label_smoothing=label_smoothing,
                                                       softcap=softcap, z_loss=z_loss, reduction=reduction,
                                                       stream=stream(logits))
        return [rows if total is None else total, lse, count]

    def fake(logits, target, ignore_index, label_smoothing, softcap, z_loss, reduction):
        acc = acc_dtype(logits.dtype)
        loss = logits.new_empty(target.shape if reduction == "none" else (), dtype=acc)
        return [loss, logits.new_empty(target.shape, dtype=acc), logits.new_empty((), dtype=acc)]

    def backward_forward(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Optional[Tensor],
                         ignore_index: int, label_smoothing: float, softcap: Optional[float], z_loss: float) -> Tensor:
        grad_logits = None if _op.EXCHANGE_API and logits.is_contiguous() else torch.empty_like(logits)
        return _C.cross_entropy_bwd(logits, target, lse, grad, count, grad_logits, ignore_index=ignore_index,
                                    label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                                    stream=stream(logits))[0]

    def backward_fake(grad, logits, target, lse, count, ignore_index, label_smoothing, softcap, z_loss):
        return torch.empty_like(logits)

    backward_op = TorchOp("cross_entropy_backward", backward_forward, backward_fake)

    def backward_in_torch_ops(grad, logits, target, lse, count, ignore_index, label_smoothing, softcap, z_loss):
        """cross_entropy_backward's formula (brrr_cuda.h) in PyTorch ops, for compiled graphs:
        inductor fuses it with its neighbours (in a model, with the gradient that flows into the
        logits from elsewhere, at least a zero tangent: as an opaque op, that add took another pass
        over the logits)."""
        classes = logits.shape[-1]
        target = target.long()  # compared in int64, as the kernel does (a uint8 target would wrap -100)
        counted = target != ignore_index
        index = torch.where(counted & (target >= 0) & (target < classes), target, 0)  # lse is NaN where invalid
        z = logits.to(lse.dtype)
        if softcap is not None:
            th = torch.tanh(z / softcap)
            z = softcap * th
        z_t = z.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        shift = torch.where(torch.isfinite(z_t), z_t, 0.0)
        p = torch.exp((z - shift.unsqueeze(-1)) - lse.unsqueeze(-1))
        if z_loss != 0.0:
            p = p * (1.0 + 2.0 * z_loss * (lse + shift)).unsqueeze(-1)
        scale = torch.where(counted, grad if count is None else grad / count, 0.0).unsqueeze(-1)
        hot = (torch.arange(classes, device=logits.device) == index.unsqueeze(-1)).to(z.dtype)  # a bool times a
        # float would be of the default dtype: float32 rounding in a float64 gradient
        grad = scale * (p - label_smoothing / classes - (1.0 - label_smoothing) * hot)
        if softcap is not None:
            grad = grad * (1.0 - th * th)
        # Ignored rows exactly 0, as the kernel writes them (their p may overflow: 0 * inf is NaN).
        return torch.where(counted.unsqueeze(-1), grad, 0.0).to(logits.dtype)

    def save(ctx, args, results):
        logits, target, ctx.ignore_index, ctx.label_smoothing, ctx.softcap, ctx.z_loss, ctx.reduction = args
        ctx.save_for_backward(logits, target, results[1], results[2])

    def formula(ctx, grads, run):
        (grad,), nones = grads, (None,) * 6
        if grad is None or not ctx.needs_input_grad[0]:
            return (None, *nones)
        logits, target, lse, count = ctx.saved_tensors
        args = (grad, logits, target, lse, count if ctx.reduction == "mean" else None, ctx.ignore_index,
                ctx.label_smoothing, ctx.softcap, ctx.z_loss)
        # Traced by torch.compile (AOTAutograd traces this formula under its tracing modes; torch 2.11
        # does not report that as compiling): PyTorch ops, for inductor; elsewhere brrr's kernel, a
        # tensor subclass's too (the PyTorch ops' second derivative would leave out lse's, silently).
        traced = (torch.compiler.is_compiling() or
                  (type(grad) is not torch.Tensor or type(logits) is not torch.Tensor) and traced_by_a_mode())
        return (backward_in_torch_ops(*args) if traced else run(backward_op)(*args), *nones)

    cross_entropy_op = TorchOp("cross_entropy", forward, fake, save=save, backward=formula)

    def cross_entropy_(input, target, ignore_index, reduction, label_smoothing, dtype, softcap, z_loss):
        """brrr.cross_entropy on torch tensors (arguments checked)."""
        check_rank(input.dim())
        check_torch((target,), ("target",))
        if dtype is None and input.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(
                input.device.type):
            dtype = torch.float32  # autocast runs torch's cross_entropy in float32: its loss is float32
        dtype = float_dtype("dtype", dtype, input.dtype)
        logits = input if input.dim() <= 2 else input.movedim(1, -1)
        loss = cross_entropy_op(logits, target, ignore_index, label_smoothing, softcap, z_loss, reduction)
        return loss if loss.dtype == dtype else loss.to(dtype)

    # ---- linear_cross_entropy
    scale_slice_bytes = 2**26  # blocks of the input gradient moved through a copy: 8M elements (2**26 bytes of float64)

    def count_rows(target, ignore_index, dtype):
        """The rows "mean" divides by: over the whole input, not a chunk; on the device (compared in
        int64, as the kernel compares: a uint8 target would wrap -100)."""
        return (target.to(torch.int64) != ignore_index).sum().to(dtype)

    def weight_grad_dtype(weight, accumulation):
        return weight.dtype if accumulation == "weight" else acc_dtype(weight.dtype)

    def accumulate_weight_grad(grad_weight, grad_logits, x, first):
        """grad_weight += grad_logits.T @ x, each chunk's product summed in float32 (cuBLAS's
        compute type for half precision) and added to grad_weight, rounded once to its dtype. In
        the logits' dtype, and on CUDA in a float32 accumulator, the first chunk writes
        grad_weight without reading it (allocated empty: no zero fill, one read of the
        accumulator fewer); a CPU accumulator of another dtype starts as zeros."""
        if grad_logits.dtype == grad_weight.dtype:
            grad_weight.addmm_(grad_logits.t(), x, beta=0 if first else 1)
        elif grad_logits.is_cuda:
            # cuBLAS accumulates in float32 and writes float32: the chunks' sum is never rounded to bf16.
            torch.addmm(grad_weight, grad_logits.t(), x, out_dtype=grad_weight.dtype, beta=0 if first else 1,
                        out=grad_weight)
        else:
            grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), x.to(grad_weight.dtype))

    def run_chunks(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, rows_per_chunk,
                   accumulation, needs, loss_rows, grad_loss=None, count=None):
        """The chunks (see above): every row's loss into loss_rows and, where `needs` asks, the
        gradients scaled by grad_loss (None: 1 for every row) over count (None: 1). Returns
        (grad_input, grad_weight, grad_bias), None where not needed: the input's in its dtype, the
        weight's in weight_grad_dtype, the bias's in the accumulation dtype. With
        SKIP_IGNORED_ROWS (outside CUDA-graph capture) the chunks run over the counted rows only,
        gathered a chunk at a time."""
        acc = loss_rows.dtype
        kept = None
        if SKIP_IGNORED_ROWS and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            kept = (target.to(torch.int64) != ignore_index).nonzero().squeeze(1)  # a host sync: its length
            loss_rows.zero_()  # an ignored row's loss
        rows = x.shape[0] if kept is None else kept.numel()
        grad_input = torch.empty_like(x) if needs[0] else None
        weight_dtype = weight_grad_dtype(weight, accumulation)
        written = (weight_dtype == x.dtype or x.is_cuda) and rows  # by the first chunk: accumulate_weight_grad
        new = torch.empty if written else torch.zeros
        grad_weight = new(weight.shape, dtype=weight_dtype, device=weight.device) if needs[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if needs[2] else None
        gradient = any(needs)
        lse = None if gradient else torch.empty_like(loss_rows)
        cuda_stream = stream(x)
        side = (side_stream(x.device) if INPUT_GRAD_STREAM and x.is_cuda and needs[0] and needs[1] and kept is None
                else None)
        main = None if side is None else torch.cuda.current_stream(x.device)
        # One chunk's logits, the only vocabulary-sized buffer, reused by every chunk.
        buffer = x.new_empty((min(rows_per_chunk, x.shape[0]), weight.shape[0]))
        if kept is not None:
            # A chunk's kept rows of x are gathered into the rows of grad_input that its input
            # gradient fills next (grad_input holds the kept rows' gradients packed, in order,
            # until the end: no buffer of the chunk's rows at the peak), else into a buffer.
            gathered = x.new_empty((buffer.shape[0], x.shape[1])) if grad_input is None else None
            chunk_loss = torch.empty(buffer.shape[0], dtype=acc, device=x.device)
        for start in range(0, rows, rows_per_chunk):
            end = min(start + rows_per_chunk, rows)
            logits = buffer[:end - start]
            if kept is None:
                xs, ts, losses = x[start:end], target[start:end], loss_rows[start:end]
                rows_grad = None if grad_loss is None else grad_loss[start:end]
            else:
                picked = kept[start:end]
                into = gathered[:end - start] if grad_input is None else grad_input[start:end]
                xs = torch.index_select(x, 0, picked, out=into)
                ts, losses = target.index_select(0, picked), chunk_loss[:end - start]
                rows_grad = None if grad_loss is None else grad_loss.index_select(0, picked)
            if bias is None:
                torch.mm(xs, weight.t(), out=logits)
            else:
                torch.addmm(bias, xs, weight.t(), out=logits)
            if not gradient:
                _C.cross_entropy_fwd(logits, ts, lse[:end - start], losses, ignore_index=ignore_index,
                                     label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                                     reduction="none", stream=cuda_stream)
            else:
                # In place: from here on `logits` holds their gradient.
                _C.cross_entropy_fwd_bwd(logits, ts, losses, rows_grad, count, logits, ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                                         stream=cuda_stream)
            if kept is not None:
                loss_rows.index_copy_(0, picked, losses)
            if not gradient:
                continue
            if side is not None:
                side.wait_stream(main)  # the chunk's logit gradient is written
                with torch.cuda.stream(side):
                    torch.mm(logits, weight, out=grad_input[start:end])
            elif grad_input is not None and kept is None:
                torch.mm(logits, weight, out=grad_input[start:end])
            if grad_weight is not None:
                accumulate_weight_grad(grad_weight, logits, xs, start == 0)
            if grad_input is not None and kept is not None:  # over xs, after the weight's GEMM read it
                torch.mm(logits, weight, out=xs)
            if grad_bias is not None:
                grad_bias += logits.sum(0, dtype=acc)
            if side is not None:
                # Before the next chunk overwrites the buffer, and before anything on the caller's
                # stream reads grad_input or frees what the side stream used.
                main.wait_stream(side)
        if grad_input is not None and kept is not None and rows < x.shape[0]:
            # Each kept row's gradient to its place, then the ignored rows' zeros. kept[j] >= j:
            # moving blocks of packed rows from the last, each through a copy of itself (at most
            # scale_slice_bytes of float64, made once the logits' buffer is free), writes only
            # over rows moved already.
            buffer = logits = None
            block = chunk_rows(x.shape[1], 8, scale_slice_bytes)
            for end in range(rows, 0, -block):
                start = max(0, end - block)
                grad_input.index_copy_(0, kept[start:end], grad_input[start:end].clone())
            grad_input.masked_fill_((target.to(torch.int64) == ignore_index).unsqueeze(1), 0)
        return grad_input, grad_weight, grad_bias

    side_streams = {}

    def side_stream(device):
        """One second stream per device (INPUT_GRAD_STREAM), made on first use."""
        if device not in side_streams:
            side_streams[device] = torch.cuda.Stream(device)
        return side_streams[device]

    def linear_forward(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int,
                       label_smoothing: float, softcap: Optional[float], z_loss: float, reduction: str,
                       rows_per_chunk: int, accumulation: str, needs: list[bool]) -> list[Tensor]:
        acc = acc_dtype(x.dtype)
        loss_rows = torch.empty(x.shape[0], dtype=acc, device=x.device)
        count = count_rows(target, ignore_index, acc) if reduction == "mean" else None
        grads = (None, None, None)
        if reduction == "none" or not any(needs):
            run_chunks(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, rows_per_chunk,
                       accumulation, (False, False, False), loss_rows)
        else:
            grads = run_chunks(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, rows_per_chunk,
                               accumulation, needs, loss_rows, count=count)
        if reduction == "none":
            loss = loss_rows
        else:
            loss = loss_rows.sum()
            loss = loss / count if reduction == "mean" else loss
        return [loss] + [loss.new_empty(0) if g is None else g for g in grads]

    def linear_fake(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, reduction, rows_per_chunk,
                    accumulation, needs):
        acc = acc_dtype(x.dtype)
        loss = x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=acc)
        computed = reduction != "none"
        shapes = [(x.shape, x.dtype), (weight.shape, weight_grad_dtype(weight, accumulation)),
                  (None if bias is None else bias.shape, acc)]
        return [loss] + [x.new_empty(shape, dtype=dtype) if computed and need else x.new_empty(0, dtype=acc)
                         for need, (shape, dtype) in zip(needs, shapes)]

    def linear_backward_forward(grad: Tensor, x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                                ignore_index: int, label_smoothing: float, softcap: Optional[float], z_loss: float,
                                rows_per_chunk: int, accumulation: str, needs: list[bool]) -> list[Tensor]:
        """Reduction "none": the chunks again, each row's gradient scaled by its grad[row]."""
        loss_rows = torch.empty(x.shape[0], dtype=grad.dtype, device=x.device)
        grads = run_chunks(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, rows_per_chunk,
                           accumulation, needs, loss_rows, grad_loss=grad)
        return [x.new_empty(0) if g is None else scaled_in_place(g, None, p.dtype) for g, p in
                zip(grads, (x, weight, bias))]

    def linear_backward_fake(grad, x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss,
                             rows_per_chunk, accumulation, needs):
        return [p.new_empty(p.shape) if need else x.new_empty(0) for need, p in zip(needs, (x, weight, bias))]

    linear_backward_op = TorchOp("linear_cross_entropy_backward", linear_backward_forward, linear_backward_fake)

    def linear_save(ctx, args, results):
        x, weight, target, bias, *options = args
        ctx.options, ctx.reduction, ctx.computed = options, options[4], options[7]
        ctx.consumed = False
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        if ctx.reduction == "none":
            ctx.save_for_backward(x, weight, target, bias)
        else:
            ctx.save_for_backward(*saved_gradients("linear_cross_entropy", results[1:], (x, weight, bias)))

    def scaled_in_torch_ops(grad_acc, g, dtype):
        return (grad_acc.to(g.dtype) * g).to(dtype)

    def scaled_in_place(grad_acc, g, dtype):
        """grad_acc * g (g None: 1) rounded once to `dtype`, in grad_acc's memory: no second tensor of
        a weight's size. brrr's kernel (_C.linear_cross_entropy_scale, 16 bytes a load and a store):
        the product in float32 (float64 for float64) rounded as it is stored, the bits of
        torch.mul(grad_acc, g.reshape(1)).to(dtype) (g a 1-element tensor: converted exactly, not
        rounded to a half-precision grad_acc's dtype first). In grad_acc's own dtype: in place, one
        call (grad_acc dense, read in memory order: the input's gradient is empty_like(input),
        whose dims may be permuted). Into a narrower dtype (a float32 accumulator of a bf16
        weight's gradient) the result is written over the start of grad_acc's storage, and is a
        view of it (which stays allocated until the view is freed): its element i lands in the
        bytes of grad_acc's element i / ratio (ratio = acc_size / out_size), and the threads of a
        call run in no set order, so each call writes only over elements that earlier calls read:
        slices [start, end) with end <= ratio * start, from a first slice of 1M elements, whose
        destination overlaps its source and which is read into a copy first."""
        if g is None and grad_acc.dtype == dtype:
            return grad_acc
        cuda_stream = stream(grad_acc)
        if grad_acc.dtype == dtype:
            memory = grad_acc.permute(sorted(range(grad_acc.dim()), key=grad_acc.stride, reverse=True))
            _C.linear_cross_entropy_scale(memory, g, memory, stream=cuda_stream)
            return grad_acc
        acc = grad_acc.view(-1)  # the accumulator: contiguous
        out = acc.view(dtype)[:acc.numel()]
        ratio = grad_acc.element_size() // out.element_size()
        end = min(acc.numel(), 2**20)
        _C.linear_cross_entropy_scale(acc[:end].clone(), g, out[:end], stream=cuda_stream)
        while end < acc.numel():
            start, end = end, min(acc.numel(), end * ratio)
            _C.linear_cross_entropy_scale(acc[start:end], g, out[start:end], stream=cuda_stream)
        return out.view(grad_acc.shape)

    def linear_formula(ctx, grads, run):
        (grad,), options = grads, (None,) * 8
        needs = [ctx.needs_input_grad[i] for i in (0, 1, 3)]
        if grad is None or not any(needs):
            return (None, None, None, None) + options
        if ctx.reduction == "none":
            x, weight, target, bias = ctx.saved_tensors
            got = run(linear_backward_op)(grad, x, weight, target, bias, *ctx.options[:4], *ctx.options[5:7], needs)
        else:
            for name, need, computed in zip(("input", "weight", "bias"), needs, ctx.computed):
                if need and not computed:
                    raise RuntimeError(f"brrr::linear_cross_entropy: autograd needs the gradient of {name}, which the "
                                       "forward was not asked for (its `needs` argument)")
            # Traced by torch.compile: PyTorch ops, which inductor fuses into one pass each. The same where
            # the operator itself records (torch.ops.brrr.linear_cross_entropy called directly, run is
            # the operator's): its saved gradients are its outputs, the caller's, not to be scaled in place.
            traced = torch.compiler.is_compiling() or type(grad) is not torch.Tensor or run(linear_op) is linear_op.op
            if ctx.consumed:
                raise RuntimeError("brrr::linear_cross_entropy: a second backward through the same graph "
                                   "(retain_graph) is not supported: the first scaled the gradients the forward "
                                   "computed in place; run the forward again")
            saved = restored_gradients(ctx.saved_tensors)
            ctx.consumed = not traced  # outside torch.compile, in the saved gradients' memory
            scale = scaled_in_torch_ops if traced else scaled_in_place
            got = [scale(g, grad, dtype) if need else None for need, g, dtype in zip(needs, saved, ctx.dtypes)]
        grad_input, grad_weight, grad_bias = (g if need else None for g, need in zip(got, needs))
        return (grad_input, grad_weight, None, grad_bias) + options

    linear_op = TorchOp("linear_cross_entropy", linear_forward, linear_fake, save=linear_save,
                        backward=linear_formula, grad_args=(0, 1, 3))

    def linear_cross_entropy_(input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, z_loss,
                              dtype, budget, accumulation):
        """brrr.linear_cross_entropy on torch tensors (arguments checked)."""
        hidden, dtype = input.shape[-1], float_dtype("dtype", dtype, input.dtype)
        needs = [torch.is_grad_enabled() and p is not None and p.requires_grad for p in (input, weight, bias)]
        if budget is None and needs[1]:
            acc_itemsize = weight_grad_dtype(weight, accumulation).itemsize
            rows = auto_chunk_rows(*weight.shape, input.element_size(), acc_itemsize)
        else:
            # No weight-gradient accumulator to amortise (a frozen head, no_grad, reduction="none"
            # without grad): the default budget's chunk is as fast and holds far fewer logits.
            budget = LOGITS_BUDGET if budget is None else budget
            rows = chunk_rows(weight.shape[0], input.element_size(), budget, GEMM_TILE_ROWS)
        loss = linear_op(input.reshape(-1, hidden), weight, target.reshape(-1), bias, ignore_index, label_smoothing,
                         softcap, z_loss, reduction, rows, accumulation, needs)
        if reduction == "none":
            loss = loss.view(target.shape)
        return loss if loss.dtype == dtype else loss.to(dtype)

    # ---- the registry
    class_indices = (torch.int64, torch.int32, torch.uint8)
    loss_dtypes = (None, torch.float32, torch.float64)

    def targets_ok(input, target, rows):
        return (isinstance(target, torch.Tensor) and target.dtype in class_indices and target.device == input.device
                and target.shape == rows)

    def cross_entropy_ok(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                         dtype=None, **options):
        if not tensor_ok(input) or input.dim() == 0 or weight is not None or reduction not in REDUCTIONS:
            return False
        if input.shape[1 if input.dim() >= 2 else 0] == 0:  # no classes: PyTorch's (a NaN mean, or its error)
            return False
        rows = input.shape[:1] + input.shape[2:] if input.dim() >= 2 else ()
        return targets_ok(input, target, rows) and (dtype in loss_dtypes or dtype == input.dtype)

    def linear_cross_entropy_ok(input, weight, target, bias=None, *, reduction="mean", dtype=None, **options):
        return (tensor_ok(input) and input.dim() >= 1 and isinstance(weight, torch.Tensor) and
                same_kind(input, weight, bias) and weight.dim() == 2 and weight.shape[1] == input.shape[-1] and
                weight.shape[0] > 0 and (bias is None or bias.shape == weight.shape[:1]) and reduction in REDUCTIONS
                and targets_ok(input, target, input.shape[:-1]) and (dtype in loss_dtypes or dtype == input.dtype))

    torch_cross_entropy = F.cross_entropy  # torch's, bound before brrr.use_fused can route F.cross_entropy here

    def reference(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                  softcap=None, z_loss=0.0, dtype=None):
        """dtype: the loss's dtype, as brrr.cross_entropy takes it (the input is cast to it first);
        softcap and z_loss as brrr.cross_entropy defines them (the z-loss's mean over the counted
        rows, also with per-class weights)."""
        x = input if dtype is None else input.to(dtype)
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        loss = torch_cross_entropy(x, target, weight, ignore_index=ignore_index,
                                   reduction="none" if z_loss else reduction, label_smoothing=label_smoothing)
        if not z_loss:
            return loss
        counted = target.long() != ignore_index  # in int64: a uint8 target would wrap a negative ignore_index
        loss = loss + torch.where(counted, z_loss * torch.logsumexp(x, dim=1 if x.dim() >= 2 else 0) ** 2, 0.0)
        if reduction == "none":
            return loss
        return loss.sum() / counted.sum() if reduction == "mean" else loss.sum()

    def linear_reference(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, softcap=None, z_loss=0.0, dtype=None, logits_budget=None,
                         accumulation=None):
        """The logits in full (logits_budget and accumulation are brrr's alone); class indices of
        int32 and uint8 in int64, which F.cross_entropy takes (it refuses int32)."""
        logits = F.linear(input, weight, bias)
        flat = target.reshape(-1)
        loss = reference(logits.reshape(-1, weight.shape[0]), flat.long() if flat.dtype in class_indices else flat,
                         ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                         softcap=softcap, z_loss=z_loss, dtype=dtype)
        return loss.reshape(target.shape) if reduction == "none" else loss

    # Under torch.compile brrr's kernels: the forward reads the logits once (inductor's twice), and
    # inductor's linear cross-entropy would hold the logits whole. On CPU tensors brrr's cross-entropy
    # measured faster than PyTorch's (brrr/_registry.py); its linear cross-entropy is not measured there.
    registry.register("cross_entropy", reference, cross_entropy, cross_entropy_ok, compiled="kernel", cpu="kernel")
    registry.register("linear_cross_entropy", linear_reference, linear_cross_entropy, linear_cross_entropy_ok,
                      compiled="kernel", cpu="pytorch")

    class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
        """torch.nn.CrossEntropyLoss; inputs brrr does not take (per-class weights, probability
        targets) go to PyTorch's."""

        def forward(self, input, target):
            return dispatch("cross_entropy", input, target, self.weight, ignore_index=self.ignore_index,
                            reduction=self.reduction, label_smoothing=self.label_smoothing)

    class LinearCrossEntropyLoss(torch.nn.Module):
        """The cross-entropy of a linear layer's output, brrr.linear_cross_entropy: forward(input,
        weight, target, bias=None) never holds the logits whole (no torch.nn twin)."""

        def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0):
            super().__init__()
            self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
            self.softcap, self.z_loss = softcap, z_loss

        def extra_repr(self):
            return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                    f"label_smoothing={self.label_smoothing}, softcap={self.softcap}, z_loss={self.z_loss}")

        def forward(self, input, weight, target, bias=None):
            return dispatch("linear_cross_entropy", input, weight, target, bias, ignore_index=self.ignore_index,
                            reduction=self.reduction, label_smoothing=self.label_smoothing, softcap=self.softcap,
                            z_loss=self.z_loss)

    def cross_entropy_route(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                            reduction="mean", label_smoothing=0.0):
        if size_average is not None or reduce is not None:  # the deprecated pair: torch's own
            return torch_cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction,
                                       label_smoothing)
        return dispatch("cross_entropy", input, target, weight, ignore_index=ignore_index, reduction=reduction,
                        label_smoothing=label_smoothing)

    return SimpleNamespace(cross_entropy=cross_entropy_, linear_cross_entropy=linear_cross_entropy_,
                           backward=backward_op, linear_backward=linear_backward_op,
                           scaled_in_place=scaled_in_place,
                           modules=[CrossEntropyLoss, LinearCrossEntropyLoss],
                           functional={"cross_entropy": cross_entropy_route})
