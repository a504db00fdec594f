"""brrr's torch.library operators: a schema, CPU and CUDA kernels, a fake kernel and autograd.

What torch.library.custom_op builds, with a leaner autograd kernel. torch.compile's generated code
calls each op through the dispatcher, and custom_op's autograd layer costs a second trip from the
dispatcher into Python (the redispatch below autograd) on every call, also when nothing records
a gradient: measured on this project's CPU machine with no gradient, about 29 us per call above
the kernel's own Python, against about 11 us for this module's one trip. That is host time a
compiled model pays per brrr op, and on the H200's host a 2-layer model's compiled training step
of 4096 tokens is host-bound.

The autograd kernel, registered at the Autograd key:
- when autograd records (grad mode on, a tensor argument requiring grad), it applies an
  autograd.Function whose forward runs the op below autograd and whose backward is the op's
  formula; for an op with no formula (the backward ops), a second backward raises;
- otherwise, when nothing between autograd and the CPU/CUDA kernel would see the call (no
  functionalization, fake tensors or Python dispatch modes, as in compiled code at run time), it
  calls the kernel directly; else it redispatches below autograd, as custom_op does.
"""

import torch

_LIB = torch.library.Library("brrr", "DEF")
_BELOW_AUTOGRAD = torch._C._after_autograd_keyset - torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
_BACKENDS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)


def _requires_grad(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in a):
            return True
    return False


def _flatten(args):
    """autograd.Function tracks only tensor arguments: lists of tensors are spread out, with the
    list lengths (None for any other argument) to rebuild them."""
    flat, lengths = [], []
    for a in args:
        if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            flat.extend(a)
            lengths.append(len(a))
        else:
            flat.append(a)
            lengths.append(None)
    return flat, lengths


def _unflatten(flat, lengths):
    args, i = [], 0
    for n in lengths:
        args.append(flat[i] if n is None else list(flat[i:i + n]))
        i += 1 if n is None else n
    return args


def _no_formula(name):
    def backward(ctx, *grads):
        raise RuntimeError(f"brrr::{name} has no derivative: brrr's ops support one backward, not double backward")
    return backward


def define(name, impl, fake, backward=None, setup_context=None):
    """Define brrr::name from impl's annotations (as custom_op does); returns its default overload.
    backward(ctx, *grads) and setup_context(ctx, inputs, output) as torch.library.register_autograd
    takes them; without them the op has no derivative."""
    _LIB.define(name + torch.library.infer_schema(impl, mutates_args=()))
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, impl, key)
    torch.library.register_fake("brrr::" + name, fake, lib=_LIB)
    op = getattr(torch.ops.brrr, name).default
    returns_list = str(op._schema.returns[0].type) == "List[Tensor]"

    def below_autograd(keyset, args):
        below = keyset & _BELOW_AUTOGRAD
        if below.highestPriorityTypeId() in _BACKENDS:
            return impl(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(below, *args)

    formula = backward or _no_formula(name)

    def forward(ctx, *flat_and_meta):
        *flat, lengths, keyset = flat_and_meta
        args = _unflatten(flat, lengths)
        output = below_autograd(keyset, args)
        if setup_context is not None:
            setup_context(ctx, args, output)
        ctx.brrr_lengths = lengths
        # A list would leave autograd's view: its tensors would not record this function.
        return tuple(output) if isinstance(output, list) else output

    def function_backward(ctx, *grads):
        # As the formula sees the op's own arguments: one entry per argument, a list's any of its own.
        needs, i = [], 0
        for n in ctx.brrr_lengths:
            needs.append(ctx.needs_input_grad[i] if n is None else any(ctx.needs_input_grad[i:i + n]))
            i += 1 if n is None else n
        ctx.needs_input_grad = tuple(needs)
        grads_in = formula(ctx, *grads)
        if not isinstance(grads_in, tuple):
            grads_in = (grads_in,)
        flat = []
        for g, n in zip(grads_in, ctx.brrr_lengths):
            if n is None:
                flat.append(g if isinstance(g, torch.Tensor) else None)  # e.g. [] for an empty tensor list
            else:
                flat.extend(g if g is not None else [None] * n)
        return (*flat, None, None)

    function = type(f"brrr_{name}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(function_backward)})

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and _requires_grad(args):
            flat, lengths = _flatten(args)
            output = function.apply(*flat, lengths, keyset)
            return list(output) if returns_list else output
        return below_autograd(keyset, args)

    _LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return op
