"""How many instructions a value of a chain costs on the GPU, brrr's compiled kernel against
torch.compile's: the count that says whether a chain can reach the memory floor at all.

An SM issues at most one warp instruction a cycle on each of its 4 schedulers: 128 thread
instructions a cycle. So a kernel over n values that executes I thread instructions takes at least
I / (128 * SMs * clock) seconds whatever its bytes, and it can only run at the floor (bytes over
the copy bandwidth) if that bound is below the floor's time.

    ncu --clock-control none --csv --page raw --metrics METRICS -k regex:"brrr_chain|triton" \
        python3 benchmarks/probes/chain_instructions.py --dtype float32 > ncu.csv
    python3 benchmarks/probes/chain_instructions.py --parse ncu.csv --elements 16777216

METRICS (printed by --metrics): thread instructions executed, kernel duration, SM clock.
The run times each chain's forward, then its forward and backward (autograd), brrr's then
torch.compile's, on 2^24 values; ncu sees every launch, warm-up included, so --parse reports
the median of each kernel's launches.
"""

import argparse
import csv
import statistics
import sys

METRICS = "sm__sass_thread_inst_executed.sum,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__inst_executed_pipe_xu.sum"
CHAINS = {
    "cos.cos": ["cos", "cos"],
    "mixed12": ["sin", ("mul", 1.5), "tanh", ("add", 0.5), "exp", "log1p", ("mul", 0.7), "cos", "sigmoid", ("pow", 2.0),
                "softplus", "gelu"],
}


def eager(name):
    import torch
    import torch.nn.functional as F

    if name == "cos.cos":
        return lambda x: x.cos().cos()

    def mixed12(x):
        y = torch.exp(torch.tanh(torch.sin(x) * 1.5) + 0.5)
        y = torch.sigmoid(torch.cos(torch.log1p(y) * 0.7)) ** 2.0
        return F.gelu(F.softplus(y))
    return mixed12


def run(dtype_name, n):
    import torch

    import brrr

    dtype = getattr(torch, dtype_name)
    x = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    for name, steps in CHAINS.items():
        for impl, fn in (("brrr", brrr.chain(*steps)), ("compile", torch.compile(eager(name)))):
            for _ in range(3):
                with torch.no_grad():
                    fn(x)
                torch.autograd.grad(fn(x), x, grad)
            torch.cuda.synchronize()
            print(f"ran {name} {impl}", file=sys.stderr)


def parse(path, elements, sms):
    rows = {}
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    reader = csv.DictReader(lines)
    for row in reader:
        name = row.get("Kernel Name") or row.get("Function Name") or ""
        try:
            inst = float(row["sm__sass_thread_inst_executed.sum"].replace(",", ""))
            ns = float(row["gpu__time_duration.sum"].replace(",", ""))
            hz = float(row["sm__cycles_elapsed.avg.per_second"].replace(",", ""))
            xu = float(row["sm__inst_executed_pipe_xu.sum"].replace(",", ""))
        except (KeyError, ValueError):
            continue  # the units row
        rows.setdefault(name, []).append((inst, ns, hz, xu))
    print(f"{'kernel':60s} {'launches':>8s} {'ms':>8s} {'inst/value':>10s} {'XU warp inst/value':>18s} {'issue-bound ms':>14s}")
    for name, samples in rows.items():
        inst = statistics.median(s[0] for s in samples)
        ms = statistics.median(s[1] for s in samples) / 1e6
        hz = statistics.median(s[2] for s in samples)
        xu = statistics.median(s[3] for s in samples)
        bound_ms = inst / (128 * sms * hz) * 1e3
        print(f"{name[:60]:60s} {len(samples):8d} {ms:8.4f} {inst / elements:10.1f} {xu * 32 / elements:18.2f} {bound_ms:14.4f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--elements", type=int, default=1 << 24)
    p.add_argument("--parse", metavar="CSV")
    p.add_argument("--sms", type=int, default=132, help="the GPU's SMs (an H200's 132)")
    p.add_argument("--metrics", action="store_true", help="print the ncu metrics to collect")
    args = p.parse_args()
    if args.metrics:
        print(METRICS)
    elif args.parse:
        parse(args.parse, args.elements, args.sms)
    else:
        run(args.dtype, args.elements)


if __name__ == "__main__":
    main()
