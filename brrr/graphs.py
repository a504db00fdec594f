"""A whole training step as one CUDA graph: forward, backward and, optionally, the optimizer step.

    step = brrr.capture_step(lambda tokens: model(input_ids=tokens, labels=tokens).loss, model)
    for tokens in batches:
        loss = step(tokens)      # this step's gradients in each p.grad; loss is a tensor on the GPU
        optimizer.step()         # or capture_step(..., optimizer=optimizer): inside the graph

A small model's step is overhead-bound: the GPU waits while Python, autograd and the dispatcher
issue hundreds of small launches. Replaying the step as one CUDA graph removes that host work
(docs/graphs.md has the numbers). This is PyTorch's own recipe (torch.cuda.graph, "whole network
capture") with its chores done:

- the first `warmup` calls of each input signature (shapes, dtypes, devices, and the non-tensor
  arguments) run eagerly on a side stream, each a real step on its own inputs; the next call
  captures the step and replays it; later calls copy their tensors into the graph's static input
  buffers and replay;
- each graph owns the gradient tensors its backward writes (autograd hands the fresh gradients
  over, as it does when p.grad is None: no zeroing and no accumulating kernels), and each call
  sets every p.grad to those of the graph it replays: each call's gradients are that step's alone
  (as `zero_grad()` and then `backward()`), also after an `optimizer.zero_grad()` that set them
  to None between calls; a parameter the warm-up gave a gradient and the captured step does not
  reach gets zeros;
- SDPA's attention captures with its default backends (cuDNN first on recent GPUs); if that
  capture fails, the step warns, runs eagerly without the cuDNN backend and captures so next;
- a new signature gets its own graph, up to `max_graphs`; past that it runs eagerly with a warning.
  On the CPU (or with CPU tensors) every call runs eagerly, with a warning.

What a graph replays is what ran when it was captured: a module's train/eval mode, brrr.patch or
unpatch, a learning rate held as a Python float (torch.optim's capturable optimizers take a tensor
lr), any Python-side decision. Make a new capture_step after changing them. The returned loss (and
any other returned tensors) are the graph's output buffers: the next call of the same signature
overwrites them, so take `.item()` or `.clone()` to keep one. Random numbers drawn by PyTorch
(dropout) are fresh on each replay: torch.cuda.graph registers the default CUDA generator, and
`generators=` registers others.
"""

import contextlib
import gc
import sys
import warnings

import torch

# Enough eager steps for lazy initialisation (cuBLAS workspaces, autograd streams, optimizer state)
# to happen before the capture; torch.cuda.make_graphed_callables uses 3 too.
DEFAULT_WARMUP = 3
DEFAULT_MAX_GRAPHS = 8


def capture_step(loss_fn, parameters, optimizer=None, *, warmup=DEFAULT_WARMUP, max_graphs=DEFAULT_MAX_GRAPHS,
                 generators=(), unpadded=False):
    """A callable that runs loss_fn(*args, **kwargs), backward and optimizer.step() as a CUDA graph.

    loss_fn: returns the loss (a one-element tensor), or a tuple or list of tensors whose first is
        the loss (the others, logits say, are returned too).
    parameters: a torch.nn.Module or an iterable of the tensors whose gradients the step fills.
    optimizer: a torch.optim optimizer stepped inside the graph after backward, or None. Adam,
        AdamW and the others with a `capturable` option need capturable=True for CUDA parameters
        (CPU ones, stepped eagerly, need it False: torch refuses capturable=True there).
    warmup: eager steps per input signature before it is captured (at least 1).
    max_graphs: input signatures captured at most (each graph holds its own activation memory);
        0 runs every step eagerly.
    generators: CUDA torch.Generator objects, besides the default one, that the step draws from.
    unpadded: True promises that no call's sequences are padded or packed (no attention_mask, and
        position_ids, if given, counting 0, 1, 2, ... in every row). transformers models then get
        SDPA's is_causal inside the graph as they do eagerly, where by default the graph builds the
        full causal mask and attends through it (transformers cannot look at a mask's values while
        a graph is being captured, so it builds one that serves any). Padded or packed inputs
        under unpadded=True would attend across padding and sequences: leave it False for those.
    """
    return CapturedStep(loss_fn, parameters, optimizer, warmup, max_graphs, generators, unpadded)


class CapturedStep:
    """The step capture_step returns; `graphs` counts the signatures captured so far."""

    def __init__(self, loss_fn, parameters, optimizer, warmup, max_graphs, generators, unpadded):
        if not callable(loss_fn):
            raise TypeError(f"argument loss_fn: expected a callable returning the loss, got {type(loss_fn).__name__}")
        if not isinstance(unpadded, bool):
            raise TypeError(f"argument unpadded: expected True or False, got {type(unpadded).__name__}")
        self._unpadded = unpadded
        self._loss_fn = loss_fn
        self._optimizer = _checked_optimizer(optimizer)
        self._params = _checked_parameters(parameters, self._optimizer)
        self._warmup = _checked_count("warmup", warmup, minimum=1)
        self._max_graphs = _checked_count("max_graphs", max_graphs, minimum=0)
        self._generators = _checked_generators(generators)
        self._entries = {}      # signature -> _Entry
        self._with_grad = []    # the parameters the last eager step gave a gradient
        self._cudnn_attention = True    # False after a capture with it failed
        self._pool = None       # one memory pool for all of this step's graphs
        self._stream = None     # the side stream of the warm-up steps
        self._warned_device = False

    @property
    def graphs(self):
        return sum(entry.graph is not None for entry in self._entries.values())

    def __repr__(self):
        return (f"CapturedStep({_name_of(self._loss_fn)}, {len(self._params)} parameters, graphs={self.graphs}, "
                f"max_graphs={self._max_graphs})")

    def __call__(self, *args, **kwargs):
        signature = _signature(args, kwargs)
        entry = self._entries.get(signature)
        if entry is not None and entry.graph is not None:
            for static, value in zip(entry.static_tensors, _tensors_of(args, kwargs)):
                if static is not value:
                    static.copy_(value)
            for p, grad in entry.grads:
                if p.grad is not grad:
                    p.grad = grad
            # Parameters this graph does not reach but another signature's did: zeros, as the eager
            # step leaves them (an optimizer stepped outside read the other graph's last gradient).
            stale = [p.grad for p in entry.unreached if p.grad is not None]
            if stale:
                torch._foreach_zero_(stale)
            entry.graph.replay()
            return entry.outputs
        if not self._on_cuda(args, kwargs):
            return self._run(args, kwargs)
        if entry is None:
            if len(self._entries) >= self._max_graphs:
                warnings.warn(f"brrr.capture_step: a new input signature ({_describe(signature)}) past "
                              f"max_graphs={self._max_graphs}: running it eagerly", stacklevel=2)
                return self._run(args, kwargs)
            entry = self._entries[signature] = _Entry()
        if entry.eager_steps < self._warmup:
            entry.eager_steps += 1
            return self._run_on_side_stream(args, kwargs)
        _checked_optimizer(self._optimizer)  # its parameters may have moved to the GPU since
        try:
            self._capture(entry, args, kwargs)
        except RuntimeError as e:
            if not self._cudnn_attention or _STALE_GRAPH in str(e):
                raise
            # Perhaps a torch version whose cuDNN attention does not capture (2.11's backward failed
            # so once, docs/graphs.md; its error names no culprit): warm up again and capture without
            # that backend. A failure of another cause fails that capture too, and is raised then.
            self._cudnn_attention = False
            for uncaptured in self._entries.values():
                if uncaptured.graph is None:
                    uncaptured.eager_steps = min(uncaptured.eager_steps, self._warmup - 1)
            entry.eager_steps += 1
            warnings.warn(f"brrr.capture_step: {e}. Retrying without SDPA's cuDNN attention backend: this call "
                          f"runs eagerly, the next one captures", stacklevel=2)
            return self._run_on_side_stream(args, kwargs)
        entry.graph.replay()
        return entry.outputs

    # -- the eager step ------------------------------------------------------------------------

    def _run(self, args, kwargs, unreached=()):
        """One step: this step's gradients in place of the previous ones (zeros for those of
        `unreached` that backward leaves None), then the optimizer."""
        grads = [p.grad for p in self._params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        outputs = self._loss_fn(*args, **kwargs)
        _loss_of(outputs).backward()
        for p in unreached:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._optimizer is not None:
            self._optimizer.step()
        return _detached(outputs)

    def _run_on_side_stream(self, args, kwargs):
        # PyTorch's rule for a step about to be captured: warm it up on a side stream.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream), _attention_backends(self._cudnn_attention):
            outputs = self._run(args, kwargs)
        torch.cuda.current_stream().wait_stream(self._stream)
        self._with_grad = [p for p in self._params if p.grad is not None]
        return outputs

    def _on_cuda(self, args, kwargs):
        devices = {t.device.type for t in _tensors_of(args, kwargs)} | {p.device.type for p in self._params}
        if devices == {"cuda"} and torch.cuda.is_available():
            return True
        if not self._warned_device:
            self._warned_device = True
            warnings.warn("brrr.capture_step: CUDA graphs need the parameters and the tensor arguments on a CUDA "
                          f"device (found {sorted(devices)}): running the step eagerly", stacklevel=3)
        return False

    # -- the captured step ---------------------------------------------------------------------

    def _capture(self, entry, args, kwargs):
        # With every p.grad None the captured backward allocates the gradients in the graph's pool
        # and autograd keeps them as they are, where into existing gradients it would add them (one
        # add kernel per parameter, after a zeroing kernel). The graph then owns them: each replay
        # writes them afresh, and a call sets p.grad to those of the graph it replays.
        for p in self._params:
            p.grad = None
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static_args = tuple(_static_copy(a) for a in args)
        static_kwargs = {k: _static_copy(v) for k, v in kwargs.items()}
        try:
            with _attention_backends(self._cudnn_attention), _unpadded_causal_masks(self._unpadded):
                graph, outputs = capture(lambda: self._run(static_args, static_kwargs, self._with_grad), self._pool,
                                         self._generators, self._stream)
        except RuntimeError:
            for p in self._params:  # not the failed graph's tensors
                p.grad = None
            raise
        entry.grads = [(p, p.grad) for p in self._params if p.grad is not None]
        entry.unreached = [p for p in self._params if p.grad is None]
        entry.outputs = outputs
        entry.graph = graph
        entry.static_tensors = list(_tensors_of(static_args, static_kwargs))


def _attention_backends(cudnn):
    """scaled_dot_product_attention's default backends, or all but cuDNN's, for the warm-up and the
    capture alike. cuDNN's attention backward once failed inside a capture on PyTorch 2.11
    ("mha_graph.execute(...).is_good()"); it captures on 2.11 now, and is the fastest on the H200
    (docs/graphs.md), so it goes first and the step falls back only where its capture fails."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if cudnn:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@contextlib.contextmanager
def _unpadded_causal_masks(unpadded):
    """For capture_step(unpadded=True), while a step is captured: transformers' causal masks for
    SDPA as its eager path makes them for unpadded, unpacked sequences (None: SDPA's is_causal).
    Eagerly transformers looks at the position ids (packed sequences?) and the padding mask on the
    host and skips the mask when neither needs one; under capture it cannot, and builds the full
    mask (masking_utils, `is_tracing`). Here its SDPA mask function returns None for a plain causal
    mask of equal query and key lengths with no padding mask, and the packed-sequence search finds
    none: what the caller promised. Anything else goes to transformers' own functions."""
    masking = sys.modules.get("transformers.masking_utils") if unpadded else None
    if masking is None or not all(hasattr(masking, name) for name in (
            "AttentionMaskInterface", "ALL_MASK_ATTENTION_FUNCTIONS", "find_packed_sequence_indices",
            "causal_mask_function")):
        yield
        return
    interface = masking.AttentionMaskInterface
    sdpa_mask, find_packed = masking.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"], masking.find_packed_sequence_indices
    causal = masking.causal_mask_function

    def unpadded_sdpa_mask(*args, **kwargs):
        if (not args and kwargs.get("attention_mask") is None and kwargs.get("mask_function") is causal
                and kwargs.get("allow_is_causal_skip", True) and kwargs.get("local_size") is None
                and kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0
                and kwargs.get("q_length") == kwargs.get("kv_length")):
            return None
        return sdpa_mask(*args, **kwargs)

    interface.register("sdpa", unpadded_sdpa_mask)
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        interface.register("sdpa", sdpa_mask)
        masking.find_packed_sequence_indices = find_packed


def capture(fn, pool=None, generators=(), stream=None):
    """(graph, fn's return value): fn() captured in a new torch.cuda.CUDAGraph (not run: replay it).

    fn must have run eagerly before, on a side stream (lazy initialisation cannot be captured). If
    the capture fails, the process is left usable (see _recover_from_failed_capture) and a
    RuntimeError says what kind of code cannot be captured. `stream`: the stream to capture on
    (that of the warm-up, so that autograd's gradient-accumulation nodes made there and still
    alive need no wait on another stream; by default torch.cuda.graph's own)."""
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        graph.register_generator_state(generator)
    current = torch.cuda.current_stream()
    # cuBLAS keeps a workspace per stream, allocated by the first GEMM outside any graph's pool. A
    # graph captured with it writes there on every replay, yet PyTorch frees it whenever the
    # workspaces are cleared (torch.compile's mode="reduce-overhead" clears them around each
    # recording; torch/_inductor/cudagraph_trees.py says why) and hands the memory to other tensors:
    # on the H200 a captured step's first replay after reduce-overhead steps failed with "unspecified
    # launch failure". Cleared before the capture, the captured GEMMs allocate their workspace in the
    # graph's own pool; cleared after it, eager GEMMs stop using memory that lives as long as the
    # graph. PyTorch has no public call for this.
    torch._C._cuda_clearCublasWorkspaces()
    # Autograd graphs held only by reference cycles (an earlier failed capture's exception and its
    # frames) would lend the capture their gradient-accumulation nodes (see _STALE_GRAPH).
    gc.collect()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outputs = fn()
    except Exception as e:
        _recover_from_failed_capture(current, generators)
        # torch.cuda.graph's exit raises "operation failed due to a previous error during
        # capture" over the error that broke the capture: name that one.
        chain = [e]
        while len(chain) < 8 and (earlier := chain[-1].__cause__ or chain[-1].__context__) is not None:
            chain.append(earlier)
        first = chain[-1]
        first_line = str(first).splitlines()[0] if str(first) else ""
        cause = (_STALE_GRAPH if any("legacy stream" in str(err) for err in chain) else
                 "Something in it cannot be captured: a host sync (.item(), .cpu(), printing a tensor, a "
                 "data-dependent shape), or a library call that synchronises")
        raise RuntimeError(f"brrr: capturing the step in a CUDA graph failed ({type(first).__name__}: {first_line}). "
                           f"{cause}; docs/graphs.md lists the known cases") from e
    finally:
        torch._C._cuda_clearCublasWorkspaces()
    return graph, outputs


# Autograd accumulates a parameter's gradient on the stream its accumulation node was made on, and
# keeps one node per parameter while any graph refers to it: a graph made on the default stream and
# still alive makes the capture's backward join the legacy stream.
_STALE_GRAPH = ("An autograd graph of these parameters made on the default stream is still alive (a loss or "
                "output of an earlier step kept without .detach(), or the outputs torch.compile's "
                "mode=\"reduce-overhead\" keeps): the capture's backward would make the legacy stream wait on it. "
                "Drop those references (del, .detach()) before the first captured call")


def _recover_from_failed_capture(stream, generators):
    """A capture that CUDA aborted (a host sync inside it, say) leaves torch.cuda.graph's capture
    stream current and the generators it registered in capture mode: the next random draw outside a
    graph raises "Offset increment outside graph capture encountered unexpectedly". Give each
    generator a fresh state with its seed and offset (PyTorch's graph-safe state API), and the
    caller its stream back."""
    torch.cuda.set_stream(stream)
    for generator in [torch.cuda.default_generators[stream.device.index], *generators]:
        fresh = torch.Generator(device=generator.device)
        fresh.set_state(generator.get_state())
        generator.graphsafe_set_state(fresh.graphsafe_get_state())


class _Entry:
    """One input signature: its eager warm-up count, then its graph and static buffers."""

    def __init__(self):
        self.eager_steps = 0
        self.graph = None
        self.static_tensors = None
        self.outputs = None
        self.grads = None       # [(parameter, the gradient tensor the graph writes)]
        self.unreached = None   # the parameters it leaves without one


# ---------------------------------------------------------------------------------------------
# Arguments


def _checked_optimizer(optimizer):
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"argument optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    # On the CPU the step runs eagerly, where torch's optimizers refuse capturable=True instead.
    if any(group.get("capturable") is False and any(p.is_cuda for p in group["params"])
           for group in optimizer.param_groups):
        raise ValueError(f"argument optimizer: this {type(optimizer).__name__} was made with capturable=False; "
                         f"stepping it inside a CUDA graph needs capturable=True "
                         f"(torch.optim.{type(optimizer).__name__}(..., capturable=True))")
    return optimizer


def _checked_parameters(parameters, optimizer):
    """The distinct tensors whose gradients the step fills: the given ones, then the optimizer's."""
    if isinstance(parameters, torch.nn.Module):
        given = [p for p in parameters.parameters() if p.requires_grad]
    elif isinstance(parameters, torch.Tensor) or not hasattr(parameters, "__iter__"):
        raise TypeError(f"argument parameters: expected a torch.nn.Module or an iterable of tensors, "
                        f"got {type(parameters).__name__}")
    else:
        given = list(parameters)
        for i, p in enumerate(given):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"argument parameters: item {i} is a {type(p).__name__}, not a tensor")
            if not p.requires_grad:
                raise ValueError(f"argument parameters: item {i} does not require grad")
    if optimizer is not None:
        given += [p for group in optimizer.param_groups for p in group["params"]]
    seen, params = set(), []
    for p in given:
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def _checked_count(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"argument {name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"argument {name}: expected an int >= {minimum}, got {value}")
    return value


def _checked_generators(generators):
    if isinstance(generators, torch.Generator) or not hasattr(generators, "__iter__"):
        raise TypeError(f"argument generators: expected an iterable of torch.Generator, "
                        f"got {type(generators).__name__}")
    checked = list(generators)
    for i, generator in enumerate(checked):
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"argument generators: item {i} is a {type(generator).__name__}, not a torch.Generator")
        if generator.device.type != "cuda":
            raise ValueError(f"argument generators: item {i} is a {generator.device.type} generator; "
                             f"a CUDA graph registers CUDA generators only")
    return checked


def _signature(args, kwargs):
    """What a graph is specific to: each tensor's shape, dtype and device, every other argument's
    value (it is baked into the graph, so it must compare equal to be replayed)."""
    parts = []
    for where, value in [(i, a) for i, a in enumerate(args)] + sorted(kwargs.items()):
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                raise ValueError(f"argument {where}: a captured step takes data, not tensors that require grad "
                                 f"(the graph's copy of it would get no gradient)")
            parts.append((where, "tensor", tuple(value.shape), value.dtype, value.device))
            continue
        try:
            hash(value)
        except TypeError:
            raise TypeError(f"argument {where}: a {type(value).__name__}; a captured step takes tensors and "
                            f"hashable constants (ints, floats, strings, None)") from None
        parts.append((where, "value", value, type(value)))  # the type: True == 1 == 1.0, but a step may branch on it
    return tuple(parts)


def _describe(signature):
    """'0: bfloat16 (2, 512) cuda:0, scale=2.0' from a signature."""
    return ", ".join(f"{where}: {str(rest[1]).removeprefix('torch.')} {rest[0]} {rest[2]}" if kind == "tensor"
                     else f"{where}={rest[0]!r}" for where, kind, *rest in signature)


def _tensors_of(args, kwargs):
    return [v for v in list(args) + [kwargs[k] for k in sorted(kwargs)] if isinstance(v, torch.Tensor)]


def _static_copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _loss_of(outputs):
    loss = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
               else f"a {type(loss).__name__}")
        raise TypeError(f"argument loss_fn: must return the loss (a one-element tensor) or a tuple of tensors whose "
                        f"first is the loss; got {got}")
    if not loss.requires_grad:
        raise ValueError("argument loss_fn: the loss it returned does not require grad (no parameter reached it)")
    return loss


def _detached(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    for i, value in enumerate(outputs):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"argument loss_fn: output {i} is a {type(value).__name__}; a captured step returns "
                            f"tensors only (a replay cannot recompute Python values)")
    detached = [value.detach() for value in outputs]
    return tuple(detached) if isinstance(outputs, tuple) else detached


def _name_of(fn):
    return getattr(fn, "__qualname__", None) or type(fn).__name__
