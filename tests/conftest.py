import pytest

import brrr

try:
    import torch

    HAVE_CUDA = brrr.cuda_available() and torch.cuda.is_available()
except ImportError:  # the C-level tests need only NumPy
    HAVE_CUDA = False


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of brrr")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
