"""PyTorch integration of linear_cross_entropy: cross_entropy(input @ weight.T + bias, target)
without ever holding more than one chunk of rows' logits.

Per chunk of rows, in order:
    logits      = input[rows] @ weight.T + bias              torch.addmm / torch.mm (cuBLAS on CUDA)
    loss[rows], logits <- its gradient                       brrr's fused cross-entropy kernel, in place
    grad_input[rows]  = grad_logits @ weight                 torch.mm into the result's rows
    grad_weight      += grad_logits.T @ input[rows]          float32 accumulator (float64 for float64)
    grad_bias        += grad_logits summed over rows         float32 accumulator
so the chunk's logits buffer is the only vocabulary-sized activation, and the chunks run in a fixed
order (deterministic). With reduction "mean" or "sum" this is the forward, when autograd records
it: the backward only scales the three gradients by the loss's upstream gradient (rounding the
accumulators to the parameters' dtype then). With reduction "none" each row's upstream gradient is
needed inside the kernel, so the forward computes only the loss and the backward runs the chunks
again. Without autograd only the loss is computed.

brrr::linear_cross_entropy(input (N, H), weight (V, H), target (N,), bias, ..., chunk_rows, needs)
returns [loss, grad_input, grad_weight, grad_bias]: the loss in the accumulation dtype (float32,
float64 for float64; 0-d, or (N,) for reduction "none"), and, for the inputs `needs` marks (with
"mean" or "sum"), their unscaled gradients (the weight's and bias's in the accumulation dtype);
empty tensors for the others. The chunk size is a Python int fixed by the vocabulary and the
memory budget, and the count of "mean" stays on the device: no host sync, no allocation that
depends on data, so the op is CUDA-graph capturable; torch.compile sees it through its fake kernel.
"""

from typing import Optional

import torch

from . import _C
from ._op import define, stream

Tensor = torch.Tensor

# Bytes of float32 the backward's scaling of a half-precision gradient holds at a time.
_SCALE_SLICE_BYTES = 2**26


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows(vocab, itemsize, budget):
    """Rows per chunk: as many as fit `budget` bytes of logits, at least one."""
    return max(1, budget // max(1, vocab * itemsize))


def _count(target, ignore_index, dtype):
    """The rows "mean" divides by: over the whole input, not a chunk; on the device (compared in
    int64, as the kernel compares: a uint8 target would wrap -100)."""
    return (target.to(torch.int64) != ignore_index).sum().to(dtype)


def _accumulate_weight_grad(grad_weight, grad_logits, x):
    """grad_weight (accumulation dtype) += grad_logits.T @ x, summed in the accumulation dtype."""
    if grad_logits.is_cuda and grad_logits.dtype != grad_weight.dtype:
        # cuBLAS accumulates in float32 and writes float32: the chunks' sum is never rounded to bf16.
        torch.addmm(grad_weight, grad_logits.t(), x, out_dtype=grad_weight.dtype, out=grad_weight)
    else:
        grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), x.to(grad_weight.dtype))


def _run_chunks(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, rows_per_chunk, needs,
                loss_rows, grad_loss=None, count=None):
    """The chunks (the module's loop): every row's loss into loss_rows and, where `needs` asks,
    the gradients scaled by grad_loss (None: 1 for every row) over count (None: 1). Returns
    (grad_input, grad_weight, grad_bias), None where not needed, the last two in the accumulation
    dtype."""
    acc = loss_rows.dtype
    grad_input = torch.empty_like(x) if needs[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
    grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if needs[2] else None
    gradient = any(needs)
    lse = None if gradient else torch.empty_like(loss_rows)
    cuda_stream = stream(x)
    # One chunk's logits, the only vocabulary-sized buffer, reused by every chunk.
    buffer = x.new_empty((min(rows_per_chunk, x.shape[0]), weight.shape[0]))
    for start in range(0, x.shape[0], rows_per_chunk):
        end = min(start + rows_per_chunk, x.shape[0])
        xs, ts, logits = x[start:end], target[start:end], buffer[:end - start]
        if bias is None:
            torch.mm(xs, weight.t(), out=logits)
        else:
            torch.addmm(bias, xs, weight.t(), out=logits)
        if not gradient:
            _C.cross_entropy_fwd(logits, ts, lse[start:end], loss_rows[start:end], ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss, reduction="none",
                                 stream=cuda_stream)
            continue
        rows_grad = None if grad_loss is None else grad_loss[start:end]
        # In place: from here on `logits` holds their gradient.
        _C.cross_entropy_fwd_bwd(logits, ts, loss_rows[start:end], rows_grad, count, logits, ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss, stream=cuda_stream)
        if grad_input is not None:
            torch.mm(logits, weight, out=grad_input[start:end])
        if grad_weight is not None:
            _accumulate_weight_grad(grad_weight, logits, xs)
        if grad_bias is not None:
            grad_bias += logits.sum(0, dtype=acc)
    return grad_input, grad_weight, grad_bias


def _reduce(loss_rows, reduction, count):
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    return total / count if reduction == "mean" else total


def _empty(like):
    return like.new_empty(0)


def _forward_impl(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int,
                  label_smoothing: float, softcap: Optional[float], z_loss: float, reduction: str, rows_per_chunk: int,
                  needs: list[bool]) -> list[Tensor]:
    acc = _acc(x.dtype)
    loss_rows = torch.empty(x.shape[0], dtype=acc, device=x.device)
    count = _count(target, ignore_index, acc) if reduction == "mean" else None
    grads = (None, None, None)
    if reduction == "none" or not any(needs):
        _run_chunks(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, rows_per_chunk,
                    (False, False, False), loss_rows)
    else:
        grads = _run_chunks(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, rows_per_chunk,
                            needs, loss_rows, count=count)
    loss = _reduce(loss_rows, reduction, count)
    return [loss] + [_empty(loss) if g is None else g for g in grads]


def _forward_fake(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, reduction, rows_per_chunk,
                  needs):
    acc = _acc(x.dtype)
    loss = x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=acc)
    computed = reduction != "none"
    shapes = [(x.shape, x.dtype), (weight.shape, acc), (None if bias is None else bias.shape, acc)]
    return [loss] + [x.new_empty(shape, dtype=dtype) if computed and need else x.new_empty(0, dtype=acc)
                     for need, (shape, dtype) in zip(needs, shapes)]


def _backward_impl(grad: Tensor, x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int,
                   label_smoothing: float, softcap: Optional[float], z_loss: float, rows_per_chunk: int,
                   needs: list[bool]) -> list[Tensor]:
    """Reduction "none": the chunks again, each row's gradient scaled by its grad[row]."""
    loss_rows = torch.empty(x.shape[0], dtype=grad.dtype, device=x.device)
    grads = _run_chunks(x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, rows_per_chunk,
                        needs, loss_rows, grad_loss=grad)
    return [_empty(x) if g is None else g.to(p.dtype) for g, p in zip(grads, (x, weight, bias))]


def _backward_fake(grad, x, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, rows_per_chunk,
                   needs):
    return [p.new_empty(p.shape) if need else x.new_empty(0) for need, p in zip(needs, (x, weight, bias))]


backward_op = define("linear_cross_entropy_backward", _backward_impl, _backward_fake)


def _setup_context(ctx, inputs, output):
    x, weight, target, bias, *options = inputs
    ctx.options, ctx.reduction, ctx.computed = options, options[4], options[6]
    ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.mark_non_differentiable(*output[1:])
    if ctx.reduction == "none":
        ctx.save_for_backward(x, weight, target, bias)
    else:
        ctx.save_for_backward(*output[1:])


def _scaled_in_torch_ops(grad_acc, g, dtype):
    return (grad_acc.to(g.dtype) * g).to(dtype)


def _scaled_by_slices(grad_acc, g, dtype):
    """grad_acc * g rounded once to `dtype`, a slice of rows at a time: no whole float32 copy of a
    gradient (and on CUDA a half-precision tensor times a float32 0-d one rounds the factor to
    half precision first). A new tensor: a second backward (retain_graph) finds grad_acc as saved."""
    if grad_acc.dtype == dtype == g.dtype:
        return grad_acc * g
    out = torch.empty(grad_acc.shape, dtype=dtype, device=grad_acc.device)
    row_elements = grad_acc[0].numel() if grad_acc.dim() > 1 else 1
    rows = chunk_rows(row_elements, g.element_size(), _SCALE_SLICE_BYTES)
    for start in range(0, grad_acc.shape[0], rows):
        out[start:start + rows] = grad_acc[start:start + rows].to(g.dtype) * g
    return out


def _backward(ctx, grad, *_unused):
    options = (None,) * 7
    needs = [ctx.needs_input_grad[i] for i in (0, 1, 3)]
    if grad is None or not any(needs):
        return (None, None, None, None) + options
    if ctx.reduction == "none":
        x, weight, target, bias = ctx.saved_tensors
        grads = backward_op(grad, x, weight, target, bias, *ctx.options[:4], ctx.options[5], needs)
    else:
        for name, need, computed in zip(("input", "weight", "bias"), needs, ctx.computed):
            if need and not computed:
                raise RuntimeError(f"brrr::linear_cross_entropy: autograd needs the gradient of {name}, which the "
                                   "forward was not asked for (its `needs` argument)")
        # Traced by torch.compile: PyTorch ops, which inductor fuses into one pass each.
        traced = torch.compiler.is_compiling() or type(grad) is not torch.Tensor
        scale = _scaled_in_torch_ops if traced else _scaled_by_slices
        grads = [scale(g, grad, dtype) if need else None for need, g, dtype in zip(needs, ctx.saved_tensors, ctx.dtypes)]
    grad_input, grad_weight, grad_bias = (g if need else None for g, need in zip(grads, needs))
    return (grad_input, grad_weight, None, grad_bias) + options


linear_cross_entropy_op = define("linear_cross_entropy", _forward_impl, _forward_fake, _backward, _setup_context)


def linear_cross_entropy(input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, z_loss, dtype,
                         budget):
    """brrr.linear_cross_entropy on torch tensors (arguments checked by brrr.xent)."""
    hidden = input.shape[-1]
    needs = [torch.is_grad_enabled() and p is not None and p.requires_grad for p in (input, weight, bias)]
    rows = chunk_rows(weight.shape[0], input.element_size(), budget)
    loss = linear_cross_entropy_op(input.reshape(-1, hidden), weight, target.reshape(-1), bias, ignore_index,
                                   label_smoothing, softcap, z_loss, reduction, rows, needs)[0]
    if reduction == "none":
        loss = loss.view(target.shape)
    dtype = input.dtype if dtype is None else dtype
    return loss if loss.dtype == dtype else loss.to(dtype)
