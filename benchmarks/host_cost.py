"""Host cost of brrr's eager path against torch's native op of the same kind, as a ratio.

On tiny tensors the kernels take next to nothing, so the time of a call is the host's: Python,
the dispatcher, autograd, allocation, the launch. Each case runs brrr's public function and
torch's own op on the same inputs in one process, interleaved round by round, forward alone (no
input requires grad) and forward+backward (torch.autograd.grad of every input). Targets (issue 20):
forward <= 1.0x, forward+backward <= 1.15x.

    PYTHONPATH=$PWD python benchmarks/host_cost.py    # CPU, float32
    PYTHONPATH=$PWD python benchmarks/host_cost.py --device cuda --dtype bfloat16
    PYTHONPATH=$PWD python benchmarks/host_cost.py --profile rms_norm   # cProfile of brrr's forward+backward
    PYTHONPATH=$PWD python benchmarks/host_cost.py --floor   # the forward's brrr._C call alone, beside both
    PYTHONPATH=$PWD python benchmarks/host_cost.py --record  # also the recording forward alone (no backward)

Each number is the fastest round's mean time per call (µs): on a shared machine the other rounds
carry other processes' time. On the CPU it is this process's CPU time, and both libraries run
their kernels on one thread (--threads): tiny tensors gain nothing from more, and a busy
machine's waits for other threads are not host cost. On CUDA it is wall time, the GPU synchronised
after each round.
"""

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import brrr

TARGETS = {"forward": 1.0, "forward+backward": 1.15}


def cases(device, dtype, rows, hidden):
    """name -> (brrr's function, torch's, the inputs' shapes)."""
    return {
        "rms_norm": (lambda x, w: brrr.rms_norm(x, (hidden,), w), lambda x, w: F.rms_norm(x, (hidden,), w),
                     [(rows, hidden), (hidden,)]),
        "layer_norm": (lambda x, w, b: brrr.layer_norm(x, (hidden,), w, b),
                       lambda x, w, b: F.layer_norm(x, (hidden,), w, b), [(rows, hidden), (hidden,), (hidden,)]),
        "gelu": (brrr.gelu, F.gelu, [(rows, hidden)]),
        "swiglu": (brrr.swiglu, lambda a, b: F.silu(a) * b, [(rows, hidden), (rows, hidden)]),
        "softmax": (lambda x: brrr.softmax(x, -1), lambda x: torch.softmax(x, -1), [(rows, hidden)]),
    }


def c_calls():
    """name -> brrr's forward as its one brrr._C call, the output allocated by brrr._C: what the
    forward costs below brrr's Python (the same inputs as cases())."""
    from brrr import _C

    gelu, glu = _C.chain_program(["gelu"]), _C.chain_program(["silu", "mul_tensor"])
    return {
        "rms_norm": lambda x, w: _C.rms_norm_fwd(x, w, norm_ndim=1, eps=2.0**-23, llama=False),
        "layer_norm": lambda x, w, b: _C.layer_norm_fwd(x, w, b, norm_ndim=1, eps=1e-5),
        "gelu": lambda x: _C.chain_fwd(x, None, gelu, ()),
        "swiglu": lambda a, b: _C.chain_fwd(a, None, glu, (b,)),
        "softmax": lambda x: _C.softmax_fwd(x, None, log=False),
    }


def inputs(shapes, device, dtype, grad):
    return [torch.randn(s, device=device, dtype=dtype).requires_grad_(grad) for s in shapes]


def forward_step(fn, tensors):
    return lambda: fn(*tensors)


def backward_step(fn, tensors):
    grad = torch.ones_like(fn(*tensors))
    return lambda: torch.autograd.grad(fn(*tensors), tensors, grad)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_pair(steps, device, calls, rounds):
    """{name: µs per call} of each step (a dict of callables), the fastest of `rounds` rounds of
    `calls` calls each, the steps interleaved round by round."""
    clock = time.process_time if device == "cpu" else time.perf_counter
    best = dict.fromkeys(steps, float("inf"))
    for step in steps.values():
        for _ in range(max(10, calls // 10)):
            step()
    _sync(device)
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = clock()
            for _ in range(calls):
                step()
            _sync(device)
            best[name] = min(best[name], (clock() - t0) * 1e6 / calls)
    return best


MODES = (("forward", forward_step, False), ("forward+backward", backward_step, True))
RECORD = ("record", forward_step, True)  # the forward where autograd records it, its graph dropped unrun


def run(device="cpu", dtype=torch.float32, rows=2, hidden=16, calls=500, rounds=7, threads=1, modes=MODES):
    """[(case, mode, brrr µs, torch µs, ratio)] for every case; on the CPU with both libraries'
    kernels on `threads` threads (0: as they are), their settings restored after."""
    previous = torch.get_num_threads(), brrr.set_num_threads(threads) if device == "cpu" and threads else None
    if previous[1] is not None:
        torch.set_num_threads(threads)
    try:
        results = []
        for name, (ours, theirs, shapes) in cases(device, dtype, rows, hidden).items():
            for mode, make, grad in modes:
                tensors = inputs(shapes, device, dtype, grad)
                times = time_pair({"brrr": make(ours, tensors), "torch": make(theirs, tensors)}, device, calls, rounds)
                results.append((name, mode, times["brrr"], times["torch"], times["brrr"] / times["torch"]))
        return results
    finally:
        if previous[1] is not None:
            torch.set_num_threads(previous[0])
            brrr.set_num_threads(previous[1])


class _BareSoftmax(torch.autograd.Function):
    """torch.softmax as a Python autograd.Function over torch's own kernels: what a Python node
    costs on this host against torch's C++ one, with no brrr code in it."""

    @staticmethod
    def forward(ctx, x):
        y = torch.softmax(x, -1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, y, -1, y.dtype)


def node_floor(device="cpu", dtype=torch.float32, rows=2, hidden=16, calls=500, rounds=7, threads=1):
    """(bare Function µs, torch.softmax µs) forward+backward: a Python autograd node's own cost
    (on CUDA its backward runs on autograd's device thread, which must take the GIL)."""
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    tensors = inputs([(rows, hidden)], device, dtype, True)
    times = time_pair({"bare": backward_step(_BareSoftmax.apply, tensors),
                       "torch": backward_step(lambda x: torch.softmax(x, -1), tensors)}, device, calls, rounds)
    return times["bare"], times["torch"]


def floor(device="cpu", dtype=torch.float32, rows=2, hidden=16, calls=500, rounds=7, threads=1):
    """[(case, brrr µs, brrr._C µs, torch µs)] of the forward, no input requiring grad: how much of
    brrr's forward is its Python above the one brrr._C call."""
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
        brrr.set_num_threads(threads)
    results, below = [], c_calls()
    for name, (ours, theirs, shapes) in cases(device, dtype, rows, hidden).items():
        tensors = inputs(shapes, device, dtype, False)
        steps = {"brrr": ours, "brrr._C": below[name], "torch": theirs}
        times = time_pair({k: forward_step(f, tensors) for k, f in steps.items()}, device, calls, rounds)
        results.append((name, times["brrr"], times["brrr._C"], times["torch"]))
    return results


def profile(name, device, dtype, rows, hidden, calls, threads):
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
        brrr.set_num_threads(threads)
    ours, _, shapes = cases(device, dtype, rows, hidden)[name]
    step = backward_step(ours, inputs(shapes, device, dtype, True))
    for _ in range(100):
        step()
    profiler = cProfile.Profile(time.process_time if device == "cpu" else time.perf_counter)
    profiler.enable()
    for _ in range(calls):
        step()
    _sync(device)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if device == "cuda":
        print("On CUDA autograd runs the backward of CUDA tensors on its own device thread, which cProfile does not "
              "see: the profile above holds the forward and torch.autograd.grad's own Python only.")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"))
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--calls", type=int, default=500, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of torch and brrr (0: their defaults)")
    parser.add_argument("--profile", metavar="CASE", help="cProfile brrr's forward+backward of one case instead")
    parser.add_argument("--floor", action="store_true",
                        help="the forward's one brrr._C call alone beside brrr's and torch's forward instead, and a "
                             "bare Python autograd.Function's forward+backward against torch's op")
    parser.add_argument("--record", action="store_true",
                        help="also time the recording forward alone (inputs requiring grad, no backward)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.profile:
        profile(args.profile, args.device, dtype, args.rows, args.hidden, args.calls * args.rounds, args.threads)
        return
    clock = "CPU time" if args.device == "cpu" else "wall time"
    if args.floor:
        print(f"forward host cost, {args.device} {args.dtype} ({args.rows}, {args.hidden}): µs of {clock} per call; "
              "brrr._C: its one C call, the output allocated by it")
        print(f"{'op':12s} {'brrr':>8s} {'brrr._C':>8s} {'torch':>8s} {'ratio':>6s} {'_C ratio':>9s}")
        for name, ours, below, theirs in floor(args.device, dtype, args.rows, args.hidden, args.calls, args.rounds,
                                               args.threads):
            print(f"{name:12s} {ours:8.2f} {below:8.2f} {theirs:8.2f} {ours / theirs:6.2f} {below / theirs:9.2f}")
        bare, theirs = node_floor(args.device, dtype, args.rows, args.hidden, args.calls, args.rounds, args.threads)
        print(f"forward+backward of softmax as a bare Python autograd.Function over torch's kernels: {bare:.2f} µs, "
              f"torch.softmax {theirs:.2f} µs, ratio {bare / theirs:.2f} (a Python node's own cost)")
        return
    print(f"host cost, {args.device} {args.dtype} ({args.rows}, {args.hidden}), torch {torch.__version__}, "
          f"brrr {brrr.__version__}: µs of {clock} per call, fastest of {args.rounds} rounds of {args.calls}")
    print(f"{'op':12s} {'mode':18s} {'brrr':>8s} {'torch':>8s} {'ratio':>6s} {'target':>7s}")
    modes = (*MODES, RECORD) if args.record else MODES
    for name, mode, ours, theirs, ratio in run(args.device, dtype, args.rows, args.hidden, args.calls, args.rounds,
                                               args.threads, modes):
        target = TARGETS.get(mode)
        mark = "" if target is None or ratio <= target else "  over"
        shown = "-" if target is None else f"{target:.2f}"
        print(f"{name:12s} {mode:18s} {ours:8.2f} {theirs:8.2f} {ratio:6.2f} {shown:>7s}{mark}")


if __name__ == "__main__":
    main()
