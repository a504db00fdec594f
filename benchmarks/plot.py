"""PNG plots from the benchmark suite's JSON results ({"env": {...}, "rows": [...]}, harness.Recorder).

    python benchmarks/plot.py [RESULTS ...] [--out DIR]

RESULTS are JSON files or folders of them (default: benchmarks/results/local); the plots go to
--out (default: a plots/ folder beside the first result). Three kinds of plot:

speedup-<family>.png  brrr's speedup over each peer (eager, compile, ...) per op and size, from rows
                      with family, op, dtype, shape, pass_, impl and ms.
repeat-sweep.png      FLOP/s and bandwidth against the repeat count of `x * c` repeated (rows with
                      `repeats`, GFLOPs and GBps): flat time and bandwidth at the copy ceiling while
                      memory-bound, then falling bandwidth and FLOP/s levelling off once compute-bound.
host-overhead.png     host time per call against size (rows with host_us): the overhead regime, one
                      line per implementation (eager, compile, graph, brrr, ...).
step-sweep.png        a training step's time against tokens per step (rows with tokens and ms, from
                      test_bench_graphs.py), one line per variant (eager, compile, compile
                      reduce-overhead, brrr, brrr captured, ...), a row of panels per model: the
                      step time (flat while the host sets the pace) and the time per 1000 tokens
                      (flat once the GPU does). These rows are left out of the speedup plots.

Missing rows or peers skip that plot (or panel) with a message saying why.
"""

import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.ticker import FuncFormatter, LogFormatter  # noqa: E402

PLAIN_NUMBERS = FuncFormatter(lambda value, _: f"{value:g}")

BRRR = "brrr"
REPEAT_KEYS = ("repeats", "repeat")
# Legend order for the implementations the suite knows; others follow alphabetically.
IMPL_ORDER = ("eager", "eager cos", "compile", "compile reduce-overhead", "graph", "captured", "liger", "brrr",
              "brrr cos", "brrr out=", "brrr graph", "brrr captured", "brrr captured unpadded")


def load_results(paths):
    """(rows, env by source, messages): every row of every readable results file, tagged with its file."""
    rows, envs, messages = [], {}, []
    for path in _json_files(paths, messages):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            messages.append(f"skip {path}: not readable JSON ({e})")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            messages.append(f"skip {path}: no 'rows' list (not a benchmark results file)")
            continue
        source = os.path.splitext(os.path.basename(path))[0]
        envs[source] = data.get("env") if isinstance(data.get("env"), dict) else {}
        rows.extend(dict(row, _source=source) for row in data["rows"] if isinstance(row, dict))
    return rows, envs, messages


def _json_files(paths, messages):
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".json"))
            if not found:
                messages.append(f"no .json results in {path}")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"no such results file or folder: {path}")
    return files


def _number(value):
    """value as a positive finite float, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _elements(row):
    if _number(row.get("size")):
        return row["size"]
    shape = row.get("shape")
    if isinstance(shape, (list, tuple)) and shape and all(isinstance(d, int) for d in shape):
        return math.prod(shape)
    return None


def _shape_label(row):
    shape = row.get("shape")
    if isinstance(shape, (list, tuple)) and len(shape) > 1:
        return "x".join(map(str, shape))
    elements = _elements(row)
    return _power_of_two(elements) if elements else "?"


def _power_of_two(n):
    exponent = math.log2(n)
    return f"2^{exponent:.0f}" if exponent.is_integer() else str(n)


def _impl_key(impl):
    return (IMPL_ORDER.index(impl), "") if impl in IMPL_ORDER else (len(IMPL_ORDER), impl)


def _is_repeat_row(row):
    return any(key in row for key in REPEAT_KEYS)


def _repeats(row):
    return next(row[key] for key in REPEAT_KEYS if key in row)


def _save(fig, out_dir, name, written):
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)


def _grid(panels, width=5.0, height=3.6, columns=3):
    columns = min(columns, panels)
    rows = math.ceil(panels / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:panels])


def plot_speedups(rows, out_dir, written, messages):
    """One PNG per family: a panel per (op, dtype, pass), bars of peer ms / brrr ms per size."""
    timing = [r for r in rows if _number(r.get("ms")) and "impl" in r and "op" in r
              and "host_us" not in r and "tokens" not in r and not _is_repeat_row(r)]
    if not timing:
        messages.append("skip speedup plots: no timing rows (family, op, impl, ms)")
        return
    families = {}
    for r in timing:
        key = (str(r.get("op")), str(r.get("dtype", "")), str(r.get("pass_", "")))
        families.setdefault(str(r.get("family", r["_source"])), {}).setdefault(key, []).append(r)
    for family, groups in sorted(families.items()):
        panels = []
        for key, group in sorted(groups.items()):
            ours = {_shape_label(r): r["ms"] for r in group if r["impl"] == BRRR}
            peers = sorted({r["impl"] for r in group if r["impl"] != BRRR}, key=_impl_key)
            label = " ".join(k for k in key if k)
            if not ours:
                messages.append(f"skip speedup panel {family}/{label}: no brrr rows")
            elif not peers:
                messages.append(f"skip speedup panel {family}/{label}: brrr has no peer to compare with")
            else:
                panels.append((label, group, ours, peers))
        if not panels:
            messages.append(f"skip speedup-{family}.png: no panel has both brrr and a peer")
            continue
        fig, axes = _grid(len(panels))
        for ax, (label, group, ours, peers) in zip(axes, panels):
            _speedup_panel(ax, label, group, ours, peers)
        fig.suptitle(f"{family}: brrr speedup over each peer (peer time / brrr time; above 1: brrr faster)")
        _save(fig, out_dir, f"speedup-{_file_safe(family)}.png", written)


def _speedup_panel(ax, label, group, ours, peers):
    sizes = sorted(ours, key=lambda s: next(_elements(r) or 0 for r in group if _shape_label(r) == s))
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        theirs = {_shape_label(r): r["ms"] for r in group if r["impl"] == peer}
        xs = [j + (i - (len(peers) - 1) / 2) * width for j, s in enumerate(sizes) if s in theirs]
        ys = [theirs[s] / ours[s] for s in sizes if s in theirs]
        ax.bar(xs, ys, width, label=f"vs {peer}")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(sizes)), sizes, rotation=45 if len(sizes) > 4 else 0)
    ax.set_xlabel("size (elements or shape)")
    ax.set_ylabel("speedup")
    ax.set_title(label)
    ax.legend(fontsize="small")


def plot_repeat_sweep(rows, envs, out_dir, written, messages):
    """FLOP/s and GB/s against repeat count, per dtype, one line per impl at the largest size."""
    sweep = [r for r in rows if _is_repeat_row(r) and _number(_repeats(r)) and _number(r.get("GFLOPs"))
             and _number(r.get("GBps")) and "impl" in r]
    if not sweep:
        messages.append("skip repeat-sweep.png: no repeat rows (repeats, GFLOPs, GBps)")
        return
    by_dtype = {}
    for r in sweep:
        by_dtype.setdefault(str(r.get("dtype", "")), []).append(r)
    fig, axes = plt.subplots(len(by_dtype), 2, figsize=(11, 3.8 * len(by_dtype)), squeeze=False,
                             layout="constrained")
    for (dtype, group), (flops_ax, bandwidth_ax) in zip(sorted(by_dtype.items()), axes):
        largest = max(_elements(r) or 0 for r in group)
        at_largest = [r for r in group if (_elements(r) or 0) == largest]
        for impl in sorted({r["impl"] for r in at_largest}, key=_impl_key):
            points = sorted((_repeats(r), r["GFLOPs"], r["GBps"]) for r in at_largest if r["impl"] == impl)
            repeats = [p[0] for p in points]
            flops_ax.plot(repeats, [p[1] for p in points], marker="o", label=impl)
            bandwidth_ax.plot(repeats, [p[2] for p in points], marker="o", label=impl)
        copy = _copy_ceiling(at_largest, envs)
        if copy:
            bandwidth_ax.axhline(copy, color="black", linestyle="--", linewidth=0.8, label="copy bandwidth")
        size = _power_of_two(largest) if largest else "?"
        for ax, what in ((flops_ax, "GFLOP/s"), (bandwidth_ax, "GB/s")):
            _log_axes(ax)
            ax.set_xlabel("repeat count (FLOPs per element)")
            ax.set_ylabel(what)
            ax.set_title(f"x * c repeated, {dtype} {size}: {what}")
            ax.legend(fontsize="small")
    fig.suptitle("repeat sweep: bandwidth holds and FLOP/s grow while memory-bound; "
                 "once compute-bound FLOP/s level off and bandwidth falls")
    _save(fig, out_dir, "repeat-sweep.png", written)


def _copy_ceiling(rows, envs):
    ceilings = [_number(envs.get(r["_source"], {}).get("copy_GBps")) for r in rows]
    ceilings = [c for c in ceilings if c]
    return max(ceilings) if ceilings else None


def plot_host_overhead(rows, out_dir, written, messages):
    """Host µs per call against size, log-log, one line per impl, a panel per op."""
    overhead = [r for r in rows if _number(r.get("host_us")) and _elements(r) and "impl" in r]
    if not overhead:
        messages.append("skip host-overhead.png: no overhead rows (host_us with size or shape)")
        return
    by_op = {}
    for r in overhead:
        by_op.setdefault(str(r.get("op", "")), []).append(r)
    fig, axes = _grid(len(by_op), width=6.0, height=4.2, columns=2)
    for ax, (op, group) in zip(axes, sorted(by_op.items())):
        for impl in sorted({r["impl"] for r in group}, key=_impl_key):
            points = sorted((_elements(r), r["host_us"]) for r in group if r["impl"] == impl)
            style = "-" if impl.startswith(BRRR) else "--"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=impl)
        _log_axes(ax)
        ax.set_xlabel("elements")
        ax.set_ylabel("host µs per call")
        ax.set_title(f"{op}: host time per call (flat = overhead-bound)")
        ax.legend(fontsize="small")
    _save(fig, out_dir, "host-overhead.png", written)


def plot_step_sweep(rows, out_dir, written, messages):
    """Step ms and ms per 1000 tokens against tokens per step, log-log, a line per variant, a row
    of two panels per model."""
    sweep = [r for r in rows if _number(r.get("tokens")) and _number(r.get("ms")) and "impl" in r]
    if not sweep:
        messages.append("skip step-sweep.png: no training-step rows (tokens, ms)")
        return
    by_model = {}
    for r in sweep:
        by_model.setdefault(str(r.get("op", "")), []).append(r)
    fig, axes = plt.subplots(len(by_model), 2, figsize=(12, 4.4 * len(by_model)), squeeze=False,
                             layout="constrained")
    for (model, group), (step_ax, token_ax) in zip(sorted(by_model.items()), axes):
        for impl in sorted({r["impl"] for r in group}, key=_impl_key):
            points = sorted((r["tokens"], r["ms"]) for r in group if r["impl"] == impl)
            tokens = [p[0] for p in points]
            style = "-" if impl.startswith(BRRR) else "--"
            step_ax.plot(tokens, [p[1] for p in points], style, marker="o", label=impl)
            token_ax.plot(tokens, [p[1] * 1000 / p[0] for p in points], style, marker="o", label=impl)
        dtype = group[0].get("dtype", "")
        for ax, what in ((step_ax, "ms per step"), (token_ax, "ms per 1000 tokens")):
            _log_axes(ax)
            ax.set_xlabel("tokens per step")
            ax.set_ylabel(what)
            ax.legend(fontsize="small")
        step_ax.set_title(f"{model} {dtype}: training step (flat: the host sets the pace)")
        token_ax.set_title(f"{model} {dtype}: time per token (flat: the GPU sets the pace)")
    fig.suptitle("training step against tokens per step: overhead-bound where the step time is flat")
    _save(fig, out_dir, "step-sweep.png", written)


def _log_axes(ax, x_base=2):
    """Log-log axes whose y ticks read as plain numbers (4000, not 4 x 10^3); minor ticks are
    labelled only when the range spans too few decades to show major ones."""
    ax.set_xscale("log", base=x_base)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PLAIN_NUMBERS)
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def _file_safe(name):
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def plot_results(paths, out_dir):
    """Write every plot the results allow into out_dir; returns (PNG paths written, messages)."""
    rows, envs, messages = load_results(paths)
    written = []
    if not rows:
        messages.append("nothing to plot: no benchmark rows found")
        return written, messages
    os.makedirs(out_dir, exist_ok=True)
    plot_speedups(rows, out_dir, written, messages)
    plot_repeat_sweep(rows, envs, out_dir, written, messages)
    plot_host_overhead(rows, out_dir, written, messages)
    plot_step_sweep(rows, out_dir, written, messages)
    return written, messages


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", default=[os.path.join(here, "results", "local")],
                        help="JSON results files or folders of them (default: benchmarks/results/local)")
    parser.add_argument("--out", help="folder for the PNGs (default: plots/ beside the first result)")
    options = parser.parse_args(argv)
    first = options.results[0]
    out_dir = options.out or os.path.join(first if os.path.isdir(first) else os.path.dirname(first) or ".", "plots")
    try:
        written, messages = plot_results(options.results, out_dir)
    except FileNotFoundError as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 2
    for message in messages:
        print(f"plot.py: {message}")
    for path in written:
        print(f"plot.py: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
