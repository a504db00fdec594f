import pytest

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
