import pytest

try:
    import torch
except ImportError:  # the C-level tests need only NumPy
    torch = None

import brrr  # after torch: torch.ops.brrr.* exist from here on, whichever test runs first

HAVE_CUDA = torch is not None and brrr.cuda_available() and torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of brrr")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
