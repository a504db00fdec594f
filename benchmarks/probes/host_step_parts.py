"""Which of brrr.patch's swaps costs a host-bound training step time: the graphs benchmark's GPT-2 or
BERT step (test_bench_graphs.py's models: 2 layers, hidden 1024, 16 heads, vocabulary 32000,
2 x 512 tokens, bfloat16, dropout off), eager, unpatched against patched and against patched models
with one kind of swap undone:

  unpatched                     transformers' model
  patched                       brrr.patch
  patched, ln_2's add left      (GPT-2) without the fusion of the add before ln_2 across the
                                cross-attention's branch
  patched, no fused linear CE   brrr.patch(fused_linear_cross_entropy=False): the logits, then brrr's
                                cross_entropy (GPT-2)
  patched, norms torch's        the swapped LayerNorms back to torch's, the residual adds unfused
  patched, activations torch's  the swapped GELUs back to transformers'

For each: the step time (steps back to back, CUDA events) and the host time (one call, the GPU
drained first), medians of rounds taken in turn over the variants, so that a drift of the host
reaches each alike.

    PYTHONPATH=. python3 benchmarks/probes/host_step_parts.py                 # gpt2, about 40 s on an H200
    PYTHONPATH=. python3 benchmarks/probes/host_step_parts.py --model bert
    PYTHONPATH=. python3 benchmarks/probes/host_step_parts.py --device cpu --tiny   # the code paths
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import brrr  # noqa: E402
from brrr import _patch  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("gpt2", "bert"), default="gpt2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, vocabulary 256, 2 x 32 tokens, float32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.tiny:
        os.environ["BRRR_BENCH_QUICK"] = "1"
    import test_bench_graphs as bench  # noqa: E402 - after BRRR_BENCH_QUICK, which sets its sizes

    device = torch.device(args.device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if device.type == "cpu":
        for name in brrr.registry.names():  # brrr's CPU kernels: the path a GPU takes, not torch's fallback
            brrr.registry.on_cpu(name, "kernel")
    torch.manual_seed(0)
    base = bench.without_dropout(bench.MODELS[args.model]().to(device, dtype).train())

    def patched(**kwargs):
        model = copy.deepcopy(base)
        brrr.patch(model, **kwargs)
        return model

    def undone(model, kind):
        """model with its swapped modules of `kind` back to their classes, and the rewritten layers too
        where the norms go (their fused adds call the norms' residual forms)."""
        for m in model.modules():
            original = m.__dict__.get(_patch._ORIGINAL)
            if original is None:
                continue
            if (kind == "norm" and (issubclass(original, torch.nn.LayerNorm) or original.__name__.endswith(
                    ("Block", "Output")))) \
                    or (kind == "activation" and "Activation" in original.__name__):
                m.__class__ = m.__dict__.pop(_patch._ORIGINAL)
                m.__dict__.pop(_patch._NEXT_NORM, None)
        return model

    def ln_2_add_left():
        fused = _patch._residual_norm_site
        _patch._residual_norm_site = _patch._adjacent_residual_norm_site
        try:
            return patched()
        finally:
            _patch._residual_norm_site = fused

    variants = {"unpatched": base, "patched": patched()}
    if args.model == "gpt2":
        variants["patched, ln_2's add left"] = ln_2_add_left()
        variants["patched, no fused linear CE"] = patched(fused_linear_cross_entropy=False)
    variants["patched, norms torch's"] = undone(patched(), "norm")
    variants["patched, activations torch's"] = undone(patched(), "activation")

    tokens = torch.randint(0, bench.VOCAB, (bench.BASE_BATCH, bench.SEQ), device=device)
    steps = {name: bench.eager_step(model, tokens) for name, model in variants.items()}
    losses = {name: step().item() for name, step in steps.items()}
    step_ms = {name: [] for name in steps}
    host_ms = {name: [] for name in steps}
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for name, step in steps.items():
        for _ in range(3):
            step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            sync()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.steps):
                    step()
                end.record()
                end.synchronize()
                step_ms[name].append(start.elapsed_time(end) / args.steps)
            else:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                step_ms[name].append((time.perf_counter() - t0) * 1e3 / args.steps)
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                step()
                host_ms[name].append((time.perf_counter() - t0) * 1e3)
            sync()
    print(f"{args.model} {bench.BASE_BATCH}x{bench.SEQ} {str(dtype).removeprefix('torch.')} on {device}, torch "
          f"{torch.__version__}; medians of {args.rounds} rounds ({args.steps} steps back to back; 3 host calls)")
    reference = statistics.median(step_ms["unpatched"])
    for name in steps:
        ms, host = statistics.median(step_ms[name]), statistics.median(host_ms[name])
        print(f"  {name:30s} step {ms:7.3f} ms ({ms - reference:+.3f})  host {host:7.3f} ms  loss {losses[name]:.5f}")


if __name__ == "__main__":
    main()
