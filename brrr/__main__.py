"""Command line: `python -m brrr diagnose ...` (or `brrr diagnose ...`) and `python -m brrr ceilings`.

    python -m brrr diagnose overhead             # a built-in example: many tiny ops
    python -m brrr diagnose memory --json -      # a large elementwise add, JSON on stdout
    python -m brrr diagnose compute              # a large matmul
    python -m brrr diagnose mypkg.bench:make     # your own: make() returns fn, (fn, args) or (fn, args, kwargs)
    python -m brrr ceilings --refresh            # measure this device's ceilings again
    python -m brrr --version                     # the version, and whether CUDA kernels are compiled in

A malformed option gets argparse's usage and its error (exit status 2); a target, device or file
that cannot be used gets one line naming it (exit status 1); never a traceback.
"""

import argparse
import importlib
import os
import sys


def _torch():
    """torch, or one line saying that the commands need it (brrr itself does not)."""
    try:
        import torch
    except ImportError as e:
        raise SystemExit(f"brrr: diagnose and ceilings need PyTorch (pip install torch): {e}") from None
    return torch


def _default_device(torch):
    return "cuda" if torch.cuda.is_available() else "cpu"


def _overhead_example(device, size, dtype):
    """Many tiny ops in a Python loop: each launch costs more than the work it carries."""
    torch = _torch()
    x = torch.randn(size or 1024, device=device, dtype=dtype or torch.float32)

    def tiny_ops(x):
        for _ in range(32):
            x = x + 1.0
        return x

    return tiny_ops, (x,)


def _memory_example(device, size, dtype):
    """One large elementwise add: 3 bytes moved per 1/4 FLOP (fp32), far below any ridge point; by
    default its arrays hold several times the last-level cache, so memory, not cache, serves them."""
    from .diagnose import past_cache_elements

    torch = _torch()
    dtype = dtype or torch.float32
    elements = size or past_cache_elements(device, arrays=3, itemsize=dtype.itemsize)
    x = torch.randn(elements, device=device, dtype=dtype)
    y = torch.randn_like(x)

    def add(x, y):
        return x + y

    return add, (x, y)


def _compute_example(device, size, dtype):
    """One large square matmul: 2 n^3 FLOPs over 3 n^2 elements moved."""
    torch = _torch()
    on_gpu = device.startswith("cuda")
    side = size or (8192 if on_gpu else 1024)
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    a = torch.randn(side, side, device=device).to(dtype)
    b = torch.randn(side, side, device=device).to(dtype)

    def matmul(a, b):
        return a @ b

    return matmul, (a, b)


EXAMPLES = {
    "overhead": _overhead_example,
    "memory": _memory_example,
    "compute": _compute_example,
}


def _load_target(target):
    """fn, args, kwargs from 'module:factory', where factory() returns fn, (fn, args) or (fn, args, kwargs)."""
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise SystemExit(f"brrr diagnose: expected one of {', '.join(EXAMPLES)} or MODULE:FACTORY, got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"brrr diagnose: cannot import {module_name!r}: {e}") from e
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise SystemExit(f"brrr diagnose: {module_name!r} has no callable {factory_name!r}")
    made = factory()
    if callable(made):
        return made, (), {}
    if isinstance(made, tuple) and len(made) in (2, 3) and callable(made[0]):
        fn, args = made[0], tuple(made[1])
        kwargs = dict(made[2]) if len(made) == 3 else {}
        return fn, args, kwargs
    raise SystemExit(f"brrr diagnose: {target}() must return fn, (fn, args) or (fn, args, kwargs), "
                     f"got {type(made).__name__}")


def _dtype(name):
    torch = _torch()
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise argparse.ArgumentTypeError(f"expected a floating-point torch dtype such as float32 or bfloat16, got {name!r}")
    return dtype


def _device(text):
    torch = _torch()
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _positive(convert, what, expected):
    """An argparse type: text as convert(text) > 0 (finite), else an error that says what it is not
    (`what`) or what was expected."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive {expected}, got {text!r}")
        return value
    return parse


_positive_int, _positive_float = _positive(int, "a whole number", "size"), _positive(float, "a number", "count")


def _json_destination(path):
    folder = os.path.dirname(path) or "."
    if path != "-" and not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no such folder for the JSON file: {folder!r}")
    return path


def _write_json(text, destination):
    if destination == "-":
        print(text)
        return
    try:
        with open(destination, "w") as f:
            f.write(text + "\n")
    except OSError as e:
        raise SystemExit(f"brrr: cannot write the JSON report to {destination!r}: {e.strerror}") from None


def _run_diagnose(options):
    from .diagnose import device_ceilings, diagnose
    from .diagnose.common import device_of

    torch = _torch()
    if options.target in EXAMPLES:
        device = options.device or _default_device(torch)
        index = torch.device(device).index or 0
        if device.startswith("cuda") and index >= torch.cuda.device_count():
            raise SystemExit(f"brrr diagnose: --device {device} asked for, but torch sees "
                             f"{torch.cuda.device_count()} CUDA GPU(s)")
        fn, args = EXAMPLES[options.target](device, options.size, options.dtype)
        kwargs = {}
    else:
        if options.size is not None or options.dtype is not None or options.device is not None:
            raise SystemExit("brrr diagnose: --size, --dtype and --device apply to the built-in examples only")
        fn, args, kwargs = _load_target(options.target)
    if options.refresh_ceilings:
        device_ceilings(device_of(args, kwargs), refresh=True)
    report = diagnose(fn, *args, flops=options.flops, bytes=options.bytes,
                      scale=False if options.no_scale else None, **kwargs)
    if options.json != "-":
        print(report.report())
    if options.json:
        _write_json(report.to_json(), options.json)
    return 0


def _run_ceilings(options):
    import json

    from .diagnose import device_ceilings

    _torch()
    try:
        ceilings = device_ceilings(options.device, refresh=options.refresh)
    except ValueError as e:  # a device this machine does not have
        raise SystemExit(f"brrr ceilings: {e}") from None
    if options.json:
        _write_json(json.dumps(ceilings.to_dict(), indent=2), options.json)
        if options.json == "-":
            return 0
    print(f"{ceilings.device_name}, torch {ceilings.torch_version} (measured {ceilings.measured_at} "
          f"in {ceilings.measure_s:.1f} s)")
    print(f"  copy bandwidth (read + write)  {ceilings.copy_GBps:10.1f} GB/s")
    for dtype, rate in ceilings.matmul_GFLOPs.items():
        print(f"  matmul {dtype:<23} {rate:10.1f} GFLOP/s")
    print(f"  host time per launch           {ceilings.launch_us:10.2f} µs")
    for note in ceilings.notes:
        print(f"  note: {note}")
    return 0


def _version():
    from . import __version__, build_info

    info = build_info()
    archs = ", ".join(f"sm_{arch}" for arch in info["cuda_archs"].split(";"))
    kernels = f"CUDA kernels for {archs}" if info["cuda_compiled"] else "CPU only: built without CUDA"
    return f"brrr {__version__} ({kernels})"


def _parser():
    parser = argparse.ArgumentParser(prog="brrr", description="brrr: fused GPU operators, and which regime your code is in.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    diagnose = commands.add_parser(
        "diagnose", help="time a function and say whether it is overhead-, memory- or compute-bound",
        description="Time a function, compare its FLOP/s and bandwidth with the device's ceilings, scale its "
                    "input x2/x4/x8 to find fixed (overhead) cost, and give a verdict with remedies.")
    diagnose.add_argument("target", metavar="TARGET",
                          help=f"a built-in example ({', '.join(EXAMPLES)}) or MODULE:FACTORY, where FACTORY() "
                               "returns fn, (fn, args) or (fn, args, kwargs)")
    diagnose.add_argument("--device", type=_device, help="examples only: cpu or cuda[:N] (default: the GPU if there is one)")
    diagnose.add_argument("--size", type=_positive_int, help="examples only: elements (overhead, memory) or matrix side (compute)")
    diagnose.add_argument("--dtype", type=_dtype, help="examples only: a torch dtype name such as bfloat16")
    diagnose.add_argument("--flops", type=_positive_float, help="FLOPs one call does (default: the profiler's count)")
    diagnose.add_argument("--bytes", type=_positive_float, help="bytes one call moves (default: arguments read + outputs written)")
    diagnose.add_argument("--no-scale", action="store_true", help="skip the input-scaling (overhead) test")
    diagnose.add_argument("--json", metavar="PATH", type=_json_destination, help="also write the report as JSON to PATH ('-': JSON alone on stdout)")
    diagnose.add_argument("--refresh-ceilings", action="store_true", help="measure the device's ceilings again first")
    diagnose.set_defaults(run=_run_diagnose)

    ceilings = commands.add_parser("ceilings", help="show (measuring once, then cached) this device's ceilings")
    ceilings.add_argument("--device", type=_device, help="cpu or cuda[:N] (default: the GPU if there is one)")
    ceilings.add_argument("--refresh", action="store_true", help="measure again and overwrite the cache")
    ceilings.add_argument("--json", metavar="PATH", type=_json_destination, help="also write them as JSON to PATH ('-': JSON alone on stdout)")
    ceilings.set_defaults(run=_run_ceilings)
    return parser


def main(argv=None):
    options = _parser().parse_args(argv)
    return options.run(options)


if __name__ == "__main__":
    sys.exit(main())
