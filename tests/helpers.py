"""Shared test helpers: devices, dtypes, tolerances and float64 comparisons."""

import numpy as np
import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
HALF_DTYPES = [torch.float16, torch.bfloat16]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

# Relative error bounds (||out - ref|| / ||ref|| and per element) that fit each storage type:
# fp32 math rounded to the storage type, against a float64 reference of the same inputs.
TOLERANCE = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=2e-5, atol=2e-6),
    torch.float16: dict(rtol=2e-3, atol=2e-4),
    torch.bfloat16: dict(rtol=1.6e-2, atol=2e-3),
}


def assert_close(actual, expected, dtype=None, scale=1.0):
    """Compare against a float64 reference elementwise with the storage dtype's tolerance."""
    dtype = dtype or actual.dtype
    tol = TOLERANCE[dtype]
    actual64 = actual.detach().to("cpu", torch.float64)
    expected64 = expected.detach().to("cpu", torch.float64)
    assert actual64.shape == expected64.shape, (actual64.shape, expected64.shape)
    assert not torch.isnan(actual64).any() or torch.isnan(expected64).any(), "NaN in output"
    torch.testing.assert_close(actual64, expected64, rtol=tol["rtol"] * scale, atol=tol["atol"] * scale, equal_nan=True)


def poisoned_like(x):
    """An output buffer full of NaN, so unwritten elements cannot pass a comparison."""
    return torch.full_like(x, float("nan"))


def random(shape, dtype, device, low=-3.0, high=3.0, generator=None):
    """Fresh uniform random values (never zeros), drawn in float64 and rounded to dtype."""
    x = torch.rand(shape, dtype=torch.float64, generator=generator) * (high - low) + low
    return x.to(device=device, dtype=dtype)


def as_numpy64(x):
    return np.asarray(x.detach().to("cpu", torch.float64))


def cpu_kernels(names=None):
    """brrr's CPU code for CPU tensors in the registry (the suite's setting, see conftest; the
    registry's default there is PyTorch's function)."""
    from brrr import registry

    for name in names or registry.names():
        registry.on_cpu(name, "kernel")


def reset_registry(name=None):
    """registry.reset, with the suite's CPU setting after it."""
    from brrr import registry

    registry.reset(name)
    cpu_kernels([name] if name else None)


def captured_in_a_graph(fn):
    """fn warmed up on a side stream, then captured in a CUDA graph: (the graph, fn's outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
