"""The DLPack bridge: every way in, the capsule contract, and refusals."""

import sys

import numpy as np
import pytest
import torch

import brrr
from brrr import _C
from dlpack_producers import Producer, RawProducer

COS = brrr.chain("cos")


def cos64(a):
    return np.cos(np.asarray(a, dtype=np.float64))


def test_torch_cpu_round_trip_through_the_exchange_api():
    assert hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    x = torch.randn(7, 9)
    y = COS(x)
    assert isinstance(y, torch.Tensor)
    np.testing.assert_allclose(y.numpy(), cos64(x.numpy()), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_capsule_path(framework, legacy):
    base = torch.randn(5, 6) if framework == "torch" else np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    if framework == "numpy" and legacy:
        base = np.ascontiguousarray(base)
    out = np.full((5, 6), np.nan, dtype=np.float32)
    x = Producer(base, legacy=legacy)
    o = Producer(out, legacy=legacy)
    result = COS(x, out=o)
    assert result is o
    np.testing.assert_allclose(out, cos64(np.asarray(base)), rtol=2e-6, atol=1e-7)
    # CPU producers are asked with stream=None; versioned ones with max_version=(1, 3).
    assert x.calls[-1]["stream"] is None
    assert x.calls[-1]["max_version"] == (None if legacy else (1, 3))


def test_numpy_output_is_allocated_with_numpy():
    x = np.linspace(-3, 3, 101, dtype=np.float32)
    y = COS(x)
    assert type(y) is np.ndarray and y.dtype == np.float32 and y.flags.c_contiguous
    np.testing.assert_allclose(y, cos64(x), rtol=2e-6, atol=1e-7)
    f = np.asfortranarray(np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32))
    assert COS(f).flags.f_contiguous  # NPY_KEEPORDER


def test_read_only_numpy_output_is_refused():
    x = np.ones(10, np.float32)
    out = np.zeros(10, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="argument out: output is read-only"):
        COS(x, out=out)
    assert not out.any()


def test_read_only_flag_of_a_versioned_capsule_is_honoured():
    out = np.zeros(10, np.float32)
    producer = RawProducer(out, flags=1)  # DLPACK_FLAG_BITMASK_READ_ONLY
    with pytest.raises(ValueError, match="read-only"):
        COS(np.ones(10, np.float32), out=producer)
    assert not out.any()
    assert producer.deleted == 1
    # And as an input a read-only tensor is fine.
    src = RawProducer(np.full(10, 0.5, np.float32), flags=1)
    np.testing.assert_allclose(COS(src, out=np.empty(10, np.float32)), np.cos(0.5), rtol=1e-6)
    assert src.deleted == 1


def test_deleter_is_called_exactly_once_per_capsule():
    x = RawProducer(np.arange(12, dtype=np.float32).reshape(3, 4))
    out = np.empty((3, 4), np.float32)
    for _ in range(100):
        COS(x, out=out)
    assert x.exported == 100 and x.deleted == 100
    np.testing.assert_allclose(out, cos64(x.array), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_no_leak_over_ten_thousand_calls(legacy):
    # Each capsule holds a reference to its array until its deleter runs: a missing deleter
    # call shows up as a growing refcount, a double one as a shrinking one (or a crash).
    base = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    out = np.empty(64, np.float32)
    x, o = Producer(base, legacy=legacy), Producer(out, legacy=legacy)
    t = torch.randn(64)
    before = (sys.getrefcount(base), sys.getrefcount(out), sys.getrefcount(t))
    for _ in range(10_000):
        COS(x, out=o)
        COS(t, out=t)
    assert (sys.getrefcount(base), sys.getrefcount(out), sys.getrefcount(t)) == before


def test_unknown_major_version_is_refused_and_still_deleted():
    producer = RawProducer(np.ones(4, np.float32), major=2)
    with pytest.raises(BufferError, match="major version 2 is not supported"):
        COS(producer, out=np.empty(4, np.float32))
    assert producer.deleted == 1


def test_capsule_reuse_is_refused():
    producer = RawProducer(np.ones(4, np.float32), reuse_capsule=True)
    COS(producer, out=np.empty(4, np.float32))
    with pytest.raises(BufferError, match="already consumed"):
        COS(producer, out=np.empty(4, np.float32))
    assert producer.deleted == 1


def test_wrongly_named_capsule_is_refused():
    producer = RawProducer(np.ones(4, np.float32), capsule_name=b"not_a_tensor")
    with pytest.raises(BufferError, match="named 'dltensor_versioned' or 'dltensor'"):
        COS(producer, out=np.empty(4, np.float32))
    assert producer.deleted == 0  # not ours to delete: we never took it


def test_versioned_tensor_without_strides_is_refused():
    producer = RawProducer(np.ones((2, 3), np.float32), null_strides=True)
    with pytest.raises(BufferError, match="without strides"):
        COS(producer, out=np.empty((2, 3), np.float32))
    assert producer.deleted == 1


def test_unsupported_device_and_dtype_from_a_capsule():
    producer = RawProducer(np.ones(4, np.float32), device_type=4)  # OpenCL
    with pytest.raises(ValueError, match="device type 4 is not supported"):
        COS(producer, out=np.empty(4, np.float32))
    assert producer.deleted == 1
    producer = RawProducer(np.ones(4, np.float32), dtype=(0, 32, 1))  # int32
    with pytest.raises(TypeError, match="is not supported; expected float32"):
        COS(producer, out=np.empty(4, np.float32))
    assert producer.deleted == 1


def test_hostile_shapes_from_a_capsule():
    for shape, exc, message in [((2**62, 8), ValueError, "number of elements overflows int64"),
                                ((-3,), BufferError, "negative size -3 in dim 0")]:
        producer = RawProducer(np.ones(8, np.float32), shape=shape)
        with pytest.raises(exc, match=message):
            COS(producer, out=np.empty(8, np.float32))
        assert producer.deleted == 1


class Raising:
    def __dlpack__(self, **kwargs):
        raise RuntimeError("producer failed")

    def __dlpack_device__(self):
        return (1, 0)


class ReturnsGarbage:
    def __dlpack__(self, **kwargs):
        return 42

    def __dlpack_device__(self):
        return (1, 0)


class BadDevice:
    def __dlpack__(self, **kwargs):
        raise AssertionError("must not be reached")

    def __dlpack_device__(self):
        return "cpu"


def test_hostile_producers():
    out = np.zeros(3, np.float32)
    with pytest.raises(RuntimeError, match="producer failed"):
        COS(Raising(), out=out)
    with pytest.raises(BufferError, match="got int"):
        COS(ReturnsGarbage(), out=out)
    with pytest.raises(TypeError, match="__dlpack_device__"):
        COS(BadDevice(), out=out)
    assert not out.any()


def test_torch_tensor_that_requires_grad_is_taken_by_the_custom_op():
    x = torch.randn(8, requires_grad=True)
    y = COS(x)
    assert y.requires_grad and y.grad_fn is not None


def test_producer_refusal_names_the_argument():
    sparse = torch.randn(3, 3).to_sparse()
    with pytest.raises(Exception, match="argument x: "):
        _C.chain_fwd(sparse, torch.empty(3, 3), COS.program, ())


def test_gil_is_released_during_cpu_work():
    import threading
    import time

    x = np.random.default_rng(0).standard_normal(1 << 24).astype(np.float32)
    out = np.empty_like(x)
    ticks = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.01)
    start = time.perf_counter()
    brrr.chain("cos", "sin", "gelu")(x, out=out)
    end = time.perf_counter()
    done.set()
    t.join()
    inside = [s for s in ticks if start < s < end]
    assert end - start > 0.02, "the op was too quick to tell"
    assert len(inside) >= 3, "another thread could not run while the op worked"
