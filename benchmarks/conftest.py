"""pytest-driven benchmarks: `python -m pytest benchmarks` (GPU: full sizes; CPU: a quick smoke run).

Each benchmark module records rows through the `recorder` fixture; after each benchmark
they are written to $BRRR_BENCH_OUT/<module>.json and .md (default: benchmarks/results/local/).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import harness  # noqa: E402

_RECORDERS = {}


@pytest.fixture(scope="module")
def recorder(request):
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_bench_")
    return _RECORDERS.setdefault(name, harness.Recorder())


def _write_all():
    out = os.environ.get("BRRR_BENCH_OUT", os.path.join(os.path.dirname(__file__), "results", "local"))
    for name, rec in _RECORDERS.items():
        if rec.rows:
            rec.write(os.path.join(out, name))


def pytest_runtest_teardown(item, nextitem):
    # After every benchmark, so that a run cut short by a time limit keeps what it measured.
    _write_all()
