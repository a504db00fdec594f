"""brrr's PyTorch integration, built once for every op: the factory a family module calls.

    op = TorchOp("softmax", forward, fake, save=save, backward=backward, grad_args=(0,))
    y = op(x, dim, dtype, log)

From one forward (a brrr._C call, returning the op's results and then what only its backward
needs), its fake (the same, as empty tensors) and its backward formula, TorchOp builds:
- the torch.library operator brrr::<name> with its fake kernel and registered autograd, which
  torch.compile traces without a graph break (`define` below);
- an eager autograd.Function from the same pieces, for training outside torch.compile;
- the entry that picks one per call: the operator under torch.compile, under a Python dispatch mode
  that traces or fakes tensors (make_fx, FakeTensorMode: they see the operator, where a brrr._C
  call would be a constant to them) and at a forward-mode AD level (whose tangents the operator
  refuses), the Function when autograd records, else the forward itself or the op's cheaper
  inference (the overhead regime's hot path: no dispatcher, no autograd).
A backward formula calls its backward ops through `run(op)`, which is the op's forward in eager mode
and the operator under torch.compile, so that the compiled backward sees opaque nodes too.

This module imports torch. Loading it builds every family's integration (declared with
brrr._integration.torch_integration): brrr loads it when it first sees a torch tensor
(brrr._frameworks), or at `import brrr` when torch is imported already.
"""

import operator

import torch
import torch.autograd.forward_ad as forward_ad

from ._integration import declared
from ._registry import PLAIN_TENSORS, dispatch_modes, traced_by_a_mode

# torch 2.10+ publishes DLPack's C exchange table, from which brrr._C reads tensors and the
# current stream without Python, and through which it allocates outputs with torch's allocator;
# older releases need the stream passed and the outputs allocated here.
EXCHANGE_API = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


def stream(x):
    """The stream argument of a brrr._C call on x: -1 (the framework's current stream, read by
    brrr._C) where it can, else torch's current CUDA stream."""
    if EXCHANGE_API or not x.is_cuda:
        return -1
    return torch.cuda.current_stream(x.device).cuda_stream


def out_like(x):
    """None where brrr._C can allocate an output like x itself (contiguous x, exchange table)."""
    return None if EXCHANGE_API and x.is_contiguous() else torch.empty_like(x)


_C_FUNCTION_APPLY = torch._C._FunctionBase.__dict__.get("apply")
_functorch = getattr(torch._C, "_functorch", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_functorch_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None)


def _lean_apply(function):
    """function.apply less torch's Python wrapper around its C entry (signature binding, and
    functorch's dead-wrapper unwrapping run over every argument by a generator): about 3 us of the
    ~25 of a norm module's eager forward on this project's CPU machine. Calls inside functorch transforms
    take function.apply. So do tensors leaked from a finished transform (dead functorch wrappers,
    which the wrapper unwraps): brrr._C cannot read one, and its import fails before anything runs,
    so they are looked for only when the direct call raised."""
    if _C_FUNCTION_APPLY is None or _functorch_active is None or _functorch_wrapped is None:
        return function.apply
    direct, wrapped_apply = _C_FUNCTION_APPLY.__get__(None, function), function.apply

    def apply(*args):
        if _functorch_active():
            return wrapped_apply(*args)
        try:
            return direct(*args)
        except RuntimeError:
            if any(isinstance(a, torch.Tensor) and _functorch_wrapped(a) for a in args):
                return wrapped_apply(*args)
            raise
    return apply


def _eager_backward(formula, lists):
    """The backward of an eager Function: the op's formula, its backward ops run by their
    forwards, and its gradients for lists of tensors spread out (lists: the _Lists of an op whose
    Function spreads them, else None). Once differentiable, as torch's decorator makes it, for
    brrr's kernels record no graph: where autograd records the backward (create_graph=True), the
    gradients it returns carry an error node whenever an incoming gradient or a saved tensor
    requires grad, so that a second derivative raises instead of coming out zero (torch's
    decorator looks at the incoming gradients only: the Hessian of layer_norm(x).sum() was
    silently 0). An op whose backward reads no saved tensor that requires grad (dropout, rotary)
    is linear in x: its second derivative with respect to x is 0 indeed. Grad mode off, the usual
    backward, skips all of this (and the no_grad block); one frame between autograd and the
    formula, where a decorator's wrapper and the Function's own backward made two."""

    def backward(ctx, *grads):
        if not _grad_enabled():
            outputs = formula(ctx, grads, _run_eager)
            return outputs if lists is None else lists.gradients(ctx, outputs)
        with torch.no_grad():
            outputs = formula(ctx, grads, _run_eager)
            if lists is not None:
                outputs = lists.gradients(ctx, outputs)
        recorded = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        return _refuse_second_derivative(ctx, outputs, recorded) if recorded else outputs
    return backward


def _op_name(ctx):
    """The op a Function's ctx belongs to: layer_norm for brrr_layer_norm_eager."""
    name = getattr(getattr(ctx, "_forward_cls", None), "__name__", "brrr_op")
    return name.removeprefix("brrr_").removesuffix("_eager")


def _error_node(op_name, n_inputs):
    """An autograd node of n_inputs inputs (and as many outputs, their aliases) that raises when it
    is differentiated, as torch's once_differentiable builds it."""
    return torch._C._functions.DelayedError(
        f"trying to differentiate twice brrr's {op_name}, whose backward is marked once_differentiable: "
        "brrr's kernels have no second derivative (call PyTorch's function where one is needed, e.g. by "
        "brrr.registry.override)".encode(), n_inputs)


def _refuse_second_derivative(ctx, outputs, recorded):
    """outputs behind an autograd node that raises when it is differentiated, whose inputs are
    also the tensors `recorded` that the gradients depend on: autograd.grad with respect to one of
    them (a Hessian) must run the node to reach it, where torch's node, with the outputs' detached
    aliases for inputs only, was left out of the graph and the result was a silent 0."""
    outputs_ = outputs if isinstance(outputs, tuple) else (outputs,)
    aliases = [None if o is None else o.detach().requires_grad_() for o in outputs_]
    guarded = _error_node(_op_name(ctx), len(outputs_) + len(recorded))(*aliases, *recorded)[:len(outputs_)]
    return guarded if isinstance(outputs, tuple) else guarded[0]


def saved_gradients(op_name, gradients, inputs):
    """Gradients that an op computed in its forward, to save for its backward: where an input
    requires grad, aliases of them that depend on the inputs through a node that raises when it is
    differentiated, so that a second derivative through the backward that returns them raises
    instead of coming out 0 (the backward's gradients then carry its error node, as those of an
    op that saves its inputs do). The same memory; as they are under torch.compile, which traces
    no second derivative here. The backward takes them back through restored_gradients."""
    inputs = [t for t in inputs if t is not None and t.requires_grad]
    if not inputs or torch.compiler.is_compiling():
        return gradients
    with torch.enable_grad():
        return _error_node(op_name, len(gradients) + len(inputs))(*gradients, *inputs)[:len(gradients)]


def restored_gradients(saved):
    """The tensors saved_gradients made, as a backward returns them: as they are where it makes a
    graph (create_graph=True: a second derivative meets the error node), else detached, as
    PyTorch's own gradients come. Through the error node they would hold the inputs' nodes (the
    forward graph up to them) as long as the caller holds the gradients, and a CUDA graph captured
    later would meet a leaf's AccumulateGrad node made on the stream of that earlier call (a
    capture error on the legacy stream)."""
    return saved if torch.is_grad_enabled() else [g.detach() for g in saved]


# ---- torch.library operators ----------------------------------------------------------------------
# What torch.library.custom_op builds, with a leaner autograd kernel. torch.compile's generated code
# calls each op through the dispatcher, and custom_op's autograd layer costs a second trip from the
# dispatcher into Python (the redispatch below autograd) on every call, also when nothing records
# a gradient: measured on this project's CPU machine with no gradient, about 29 us per call above
# the kernel's own Python, against about 11 us for this module's one trip. That is host time a
# compiled model pays per brrr op, and on the H200's host a 2-layer model's compiled training step
# of 4096 tokens is host-bound. The public pieces (infer_schema, register_fake) are used as they are.
#
# The autograd kernel, registered at the Autograd key:
# - when autograd records (grad mode on, a tensor argument requiring grad), it applies an
#   autograd.Function whose forward runs the op below autograd and whose backward is the op's
#   formula; for an op with no formula (the backward ops), a second backward raises;
# - otherwise, when nothing between autograd and the CPU/CUDA kernel would see the call (no
#   functionalization, fake tensors or Python dispatch modes, as in compiled code at run time), it
#   calls the kernel directly; else it redispatches below autograd, as custom_op does.

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


class _Lists:
    """The lists of tensors among an op's arguments (by its schema). autograd.Function tracks only
    the tensors among its own arguments: a Function applied to the op's arguments gets each list
    as it is (a plain object to autograd) and its tensors again after all of them, one by one."""

    def __init__(self, op):
        arguments = op._schema.arguments
        self.n = len(arguments)
        self.positions = tuple(i for i, a in enumerate(arguments) if str(a.type) == "List[Tensor]")

    def spread(self, args):
        """The Function's arguments for the op's."""
        return (*args, *[t for i in self.positions for t in args[i]])

    def enter(self, ctx, args):
        """In the Function's forward: ctx.needs_input_grad as a formula reads it, one entry per
        argument of the op (for a list, a tuple of one per tensor), and the lists' lengths."""
        needs, k = list(ctx.needs_input_grad[:self.n]), self.n
        for i in self.positions:
            needs[i] = ctx.needs_input_grad[k:k + len(args[i])]
            k += len(args[i])
        ctx.needs_input_grad = tuple(needs)
        ctx.brrr_lengths = [len(args[i]) for i in self.positions]

    def gradients(self, ctx, grads):
        """A formula's gradients (for a list: a list of them, or None) as the Function returns them."""
        flat = [None if i in self.positions else g for i, g in enumerate(grads)]
        for i, n in zip(self.positions, ctx.brrr_lengths):
            flat.extend([None] * n if grads[i] is None else grads[i])
        return tuple(flat)


def _no_formula(name):
    def backward(ctx, *grads):
        raise RuntimeError(f"brrr::{name} has no derivative: brrr's ops support one backward, not double backward")
    return backward


def _refuse_tangents(name, args):
    """NotImplementedError where an argument carries a forward-mode AD tangent (at the current
    level), as torch raises for its ops without a forward derivative: below autograd the tangent
    would be dropped, a silent zero JVP."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None:
                raise NotImplementedError(f"Trying to use forward AD with brrr's {name}, which has no forward-mode "
                                          "derivative (jvp): call PyTorch's function there (e.g. by "
                                          "brrr.registry.override)")


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

    lists = _Lists(op)

    def forward(ctx, *spread_and_keyset):
        args, keyset = spread_and_keyset[:lists.n], spread_and_keyset[-1]
        lists.enter(ctx, args)
        output = below_autograd(keyset, args)
        if setup_context is not None:
            setup_context(ctx, args, output)
        # A list would leave autograd's view: its tensors would not record this function.
        return tuple(output) if isinstance(output, list) else output

    def function_backward(ctx, *grads):
        grads_in = formula(ctx, *grads)
        return (*lists.gradients(ctx, grads_in if isinstance(grads_in, tuple) else (grads_in,)), None)

    function = type(f"brrr_{name}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(function_backward)})

    def autograd_kernel(keyset, *args):
        if forward_ad._current_level >= 0:
            _refuse_tangents(name, args)
        if torch.is_grad_enabled() and _requires_grad(args):
            output = function.apply(*lists.spread(args), keyset)
            return list(output) if returns_list else output
        return below_autograd(keyset, args)

    _LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return op


# ---- the factory ------------------------------------------------------------------------------------

class TorchOp:
    """One op's PyTorch paths, from its forward, fake and backward formula.

    forward(*args) -> tensor or tuple: the op on torch tensors through brrr._C; the first `outputs`
        results are the op's, the rest (non-differentiable) only what its backward needs.
    fake(*args): the same results as empty tensors (shape, dtype, device and strides).
    save(ctx, args, results): ctx.save_for_backward(...) and any attributes of ctx the formula reads.
    backward(ctx, grads, run) -> one gradient (or None) per argument, for a list of tensors a list
        of them (None where the list is empty): grads holds one entry per differentiable result
        (None where nothing flows); run(op)(*args) runs a backward TorchOp; ctx.needs_input_grad
        has one entry per argument, for a list a tuple of one per tensor (False where it is empty).
    grad_args: the positions of the arguments that may require grad (the entry checks only those).
    eager(*args): the forward the eager Function records, where the op's entry has checked what the
        forward checks again (the operator's forward may be called by anyone); default: the forward.
    inference(*args): the op's results where nothing records a gradient, when that is cheaper than
        the forward (no statistics for a backward); default: the forward.
    Without backward the op has no derivative (the backward ops themselves).
    """

    def __init__(self, name, forward, fake, *, save=None, backward=None, outputs=1, grad_args=(0,), eager=None,
                 inference=None):
        self.name, self.forward, self.outputs, self.grad_args = name, forward, outputs, grad_args
        self.eager, self.inference = eager or forward, inference
        self._save, self._formula = save, backward
        self.op = define(name, forward, fake, self._compiled_backward if backward else None,
                         self._compiled_setup if backward else None)
        returns = self.op._schema.returns
        self._single = len(returns) == 1 and str(returns[0].type) == "Tensor"  # the forward returns one tensor
        self._apply = self._eager_apply() if backward else None
        # Where nothing records: the inference, or the forward's results as the op's.
        if inference is None and not self._single:
            self._direct = lambda *args: _outputs(forward(*args), outputs)
        else:
            self._direct = forward if inference is None else inference
        self.__class__ = type(f"TorchOp_{name}", (TorchOp,), {"__call__": self._entry()})

    # torch.compile: the operator returns every result; the extra ones are marked non-differentiable.
    def _compiled_setup(self, ctx, args, output):
        results = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        self._save(ctx, args, results)
        ctx.mark_non_differentiable(*results[self.outputs:])
        ctx.set_materialize_grads(False)

    def _compiled_backward(self, ctx, *grads):
        return self._formula(ctx, grads[:self.outputs], _run_compiled)

    def _eager_apply(self):
        """The eager autograd.Function's apply: its forward is the op's, its backward the formula's
        (once differentiable). An op with lists of tensors among its arguments has two: one for
        calls where a list holds tensors (see _Lists), one for calls where none does."""
        lists = _Lists(self.op)
        op_forward, save, outputs = self.eager, self._save, self.outputs

        # The forward, chosen once for the op's results (no per-call tests of what never changes).
        if self._single:  # one result, which autograd always hands a gradient for
            def forward(ctx, *args):
                result = op_forward(*args)
                save(ctx, args, (result,))
                return result
        elif outputs == 1:  # one output (the others only for the backward) is always given a gradient
            def forward(ctx, *args):
                results = op_forward(*args)
                save(ctx, args, results)
                return results[0]
        else:
            def forward(ctx, *args):
                results = op_forward(*args)
                save(ctx, args, results)
                ctx.set_materialize_grads(False)
                return tuple(results[:outputs])

        def spread_forward(ctx, *spread):
            args = spread[:lists.n]
            lists.enter(ctx, args)
            return forward(ctx, *args)

        def function(spread):
            backward = _eager_backward(self._formula, lists if spread else None)
            cls = type(f"brrr_{self.name}_eager", (torch.autograd.Function,),
                       {"forward": staticmethod(spread_forward if spread else forward),
                        "backward": staticmethod(backward)})
            # autograd runs a Python Function's node by calling its ctx's `apply`, which torch's
            # BackwardCFunction defines as a lookup of the Function's backward on every call (two
            # frames, five attribute reads and a boxed-gradients test: about 0.6 us of a backward
            # on this project's CPU machine). The backward itself is that method here.
            cls._backward_cls.apply = backward
            return _lean_apply(cls)

        plain = function(False)
        if not lists.positions:
            return plain
        spreading = function(True)

        def apply(*args):
            for i in lists.positions:
                if args[i]:
                    return spreading(*lists.spread(args))
            return plain(*args)
        return apply

    def runs_forward(self, args):
        """Whether a call on these arguments runs the forward itself (outside torch.compile, with
        nothing recorded): the only path on which a caller may give an output to write."""
        if _compiling():
            return False
        if self._apply is None or not _grad_enabled():
            return True
        tensors, lists = _grad_positions(self.op, self.grad_args)
        return not (any(args[i] is not None and args[i].requires_grad for i in tensors) or
                    _lists_require_grad(args, lists))

    def write(self, args, out, forward, refused):
        """forward() into the caller's `out`, on the path that runs the forward itself: ValueError
        `refused` where autograd records the op (runs_forward) or out requires grad (a write
        autograd would record, as torch refuses out= then); after the write out's version is
        bumped, as torch's in-place writes bump it, so that a backward that saved out before
        raises instead of reading the new values."""
        if not self.runs_forward(args) or (out.requires_grad and _grad_enabled()):
            raise ValueError(refused)
        if out.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError("argument out: an inference tensor, which may be written only under torch.inference_mode "
                             "(as torch refuses in-place updates of one outside it)")
        result = forward()
        torch.autograd.graph.increment_version(out)
        return result

    def _entry(self):
        """The op's call, which returns its results (the first `outputs`): the operator under
        torch.compile, the eager Function when autograd records, else the forward (or the
        inference). A closure over the op's pieces, made the __call__ of a class of the op's own:
        on the eager hot path, looking them up on the instance cost about 0.1 us a call, and a
        frame for the requires_grad test about as much. By the op's schema each argument at
        grad_args is a tensor or None, asked requires_grad with no isinstance, or a list of
        tensors, tested in a frame of its own where the op has one (an empty loop in the call cost
        ops without lists about 200 instructions); an op without a backward tests none."""
        op, outputs, apply, direct = self.op, self.outputs, self._apply, self._direct
        tensors, lists = _grad_positions(op, self.grad_args) if apply is not None else ((), ())

        def call(self, *args):
            # (the mode stack's length asked here first: no frame of traced_by_a_mode's on the usual path)
            # The operator also takes a first argument of a tensor subclass with __torch_function__,
            # which then sees the op (and, as for torch's ops, gets results of its own class); its
            # class is asked first: under a TorchFunctionMode (torch.set_default_device) the C test
            # says True of every tensor.
            if _compiling() or (dispatch_modes() and traced_by_a_mode()) or forward_ad._current_level >= 0 or \
                    (args[0].__class__ not in PLAIN_TENSORS and _has_torch_function(args[0])):
                return _outputs(op(*args), outputs)
            if _grad_enabled():
                for i in tensors:
                    a = args[i]
                    if a is not None and a.requires_grad:
                        return apply(*args)
                if lists and _lists_require_grad(args, lists):
                    return apply(*args)
            return direct(*args)
        return call


def _lists_require_grad(args, lists):
    """Whether a tensor in the lists of tensors at positions `lists` of args requires grad."""
    for i in lists:
        for t in args[i] or ():  # loops, not any() over a generator: a frame of its own
            if t is not None and t.requires_grad:  # None: refused by name in brrr._C
                return True
    return False


def _grad_positions(op, grad_args):
    """(tensors, lists): the positions among grad_args of the op's tensor arguments and of its lists
    of tensors, by its schema."""
    arguments = op._schema.arguments
    lists = tuple(i for i in grad_args if str(arguments[i].type) == "List[Tensor]")
    return tuple(i for i in grad_args if i not in lists), lists


_compiling, _grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled
_has_torch_function = torch.overrides.has_torch_function_unary  # C


def _outputs(results, n):
    """An op's first n results (the rest are what its backward needs); one tensor for n == 1."""
    if not isinstance(results, (tuple, list)):
        return results
    return results[0] if n == 1 else tuple(results[:n])


# A formula's `run`: run(op) is what runs a backward TorchOp, its forward in eager mode, its operator
# under torch.compile. attrgetter is C: no Python frame between a formula and its backward op.
_run_eager, _run_compiled = operator.attrgetter("forward"), operator.attrgetter("op")


# Every family's integration, built now that torch is in use (see the module): its namespace, with
# the brrr.nn modules (`modules`) and torch.nn.functional routes (`functional`) it declares.
INTEGRATIONS = [get() for get in declared()]
