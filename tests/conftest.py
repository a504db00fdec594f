import os
import random
import zlib

import numpy as np
import pytest

# JAX takes 75% of a GPU's memory when it first touches one; the CUDA tests share it with torch
# (and, under pytest-xdist, with other test processes), so JAX allocates as it goes here.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import torch
except ImportError:  # the C-level tests need only NumPy
    torch = None

import brrr  # after torch: torch.ops.brrr.* exist from here on, whichever test runs first

HAVE_CUDA = torch is not None and brrr.cuda_available() and torch.cuda.is_available()


NO_CUDA = "needs a CUDA GPU and a CUDA build of brrr"


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Why most tests skip here, in one line (-rs gives a line per test function)."""
    skipped = terminalreporter.stats.get("skipped", [])
    cuda = sum(NO_CUDA in str(report.longrepr) for report in skipped)
    if cuda:
        terminalreporter.write_line(f"{cuda} of the {len(skipped)} skipped tests are CUDA tests: {NO_CUDA} "
                                    "(on a GPU machine: python -m pytest tests -m cuda)")


@pytest.fixture(autouse=True)
def brrr_cpu_kernels():
    """The registry runs brrr's CPU code on CPU tensors in these tests (its default there is
    PyTorch's function): CI has no GPU, so the CPU twins are what its tests of brrr.nn, brrr.patch
    and the registry exercise. test_registry checks the default itself."""
    if torch is None:
        yield
        return
    from helpers import cpu_kernels

    cpu_kernels()
    yield
    brrr.registry.reset()


@pytest.fixture(autouse=True)
def random_inputs_of_its_own(request):
    """Each test's random draws (torch's generators, NumPy's and Python's global ones) from a seed
    of its own id: the same every run, and independent of which tests ran before. Left to torch's
    default seed they were the same every run too, but a function of every earlier test's draws,
    so that adding a test changed the inputs of every later one (a float32 gradient test failed
    on its new draw that way). BRRR_TEST_SEED (default 0) draws another set."""
    seed = zlib.crc32(f"{os.environ.get('BRRR_TEST_SEED', '0')}:{request.node.nodeid}".encode())
    random.seed(seed)
    np.random.seed(seed)
    if torch is not None:
        torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def brrr_cpu_threads(request):
    """Every test runs brrr's CPU kernels on 1, 2 or 3 threads (fixed by its name), with the work
    split even for small inputs: the float64-reference tests then check every thread count and
    the split of work between threads, at their odd sizes. test_cpu_threads runs each op at all
    three counts and compares them bitwise."""
    threads = brrr.set_num_threads(1 + zlib.crc32(request.node.nodeid.encode()) % 3)
    grain = brrr._C.set_thread_grain(1)
    yield
    brrr.set_num_threads(threads)
    brrr._C.set_thread_grain(grain)


@pytest.fixture(autouse=True)
def cuda_state_after_a_failed_capture(request):
    """A CUDA graph capture that fails inside a test leaves PyTorch's default CUDA generator in
    capture mode and the capture stream current; without this every later random draw in the
    process fails ("Offset increment outside graph capture"), and one failure reads as dozens.
    Put both right after a CUDA test (brrr.capture_step does the same after its own failures)."""
    yield
    if "cuda" not in request.keywords or not HAVE_CUDA:
        return
    try:
        torch.empty(1, device="cuda").uniform_()
    except RuntimeError:
        from brrr.graphs import _recover_from_failed_capture

        _recover_from_failed_capture(torch.cuda.default_stream(), ())
