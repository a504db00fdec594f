"""Run the whole benchmark suite, then plot it: one command.

    python benchmarks/run.py [--out DIR] [--quick] [--plot-only] [-- PYTEST_ARGS ...]

Runs `python -m pytest benchmarks -q` with BRRR_BENCH_OUT=DIR (default benchmarks/results/local),
which leaves one <module>.json and .md per benchmark module there, then benchmarks/plot.py over
every JSON file in DIR (PNGs in DIR/plots). Without a GPU the suite runs its quick version;
--quick asks for it on a GPU too, through BRRR_BENCH_QUICK=1. --plot-only re-plots DIR as it is.
Exit status: the suite's when it failed, else the plotting's.
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYTEST_NO_TESTS_COLLECTED = 5


def _has_gpu():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def run_suite(out_dir, quick, pytest_args):
    env = dict(os.environ, BRRR_BENCH_OUT=out_dir)
    if quick:
        env["BRRR_BENCH_QUICK"] = "1"
    command = [sys.executable, "-m", "pytest", "benchmarks", "-q", *pytest_args]
    print(f"run.py: {' '.join(command)}  (BRRR_BENCH_OUT={out_dir}{', quick' if quick else ''})", flush=True)
    status = subprocess.run(command, cwd=REPO, env=env).returncode
    if status == PYTEST_NO_TESTS_COLLECTED:
        print("run.py: the suite collected no benchmarks; plotting whatever results are in the folder")
        return 0
    if status != 0:
        print(f"run.py: the suite exited with status {status}; plotting the results it left")
    return status


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "local"),
                        help="folder for the results and plots (default: benchmarks/results/local)")
    parser.add_argument("--quick", action="store_true", help="the quick version even on a GPU (always so without one)")
    parser.add_argument("--plot-only", action="store_true", help="do not run the suite; plot the results in --out")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest after `--`, e.g. -- -k repeat")
    options = parser.parse_args(argv)
    out_dir = os.path.abspath(options.out)
    os.makedirs(out_dir, exist_ok=True)

    suite_status = 0
    if not options.plot_only:
        quick = options.quick or not _has_gpu()
        suite_status = run_suite(out_dir, quick, options.pytest_args)

    sys.path.insert(0, HERE)
    import plot

    plot_status = plot.main([out_dir, "--out", os.path.join(out_dir, "plots")])
    return suite_status or plot_status


if __name__ == "__main__":
    sys.exit(main())
