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


# ---- everything read from a foreign object is checked before use --------------------------------

class RaisingDescriptor:
    def __get__(self, instance, owner):
        raise RuntimeError("no table here")


FORGED_TABLES = {
    "int": 12345,  # the pre-capsule spelling (a pointer as an int): taken as one, it crashed
    "negative int": -1,
    "huge int": 2**70,
    "str": "dlpack_exchange_api",
    "None": None,
    "float": 1.5,
    "object": object(),
    "raising descriptor": RaisingDescriptor(),
}


def forged_producer(table, array, base=Producer):
    """An instance of a new producer type whose __dlpack_c_exchange_api__ is `table`."""
    return type("Forged", (base,), {"__dlpack_c_exchange_api__": table})(array)


@pytest.mark.parametrize("table", FORGED_TABLES.values(), ids=FORGED_TABLES.keys())
def test_forged_exchange_attribute_is_ignored(table):
    x = np.linspace(-2, 2, 7, dtype=np.float32)
    producer = forged_producer(table, x)
    out = COS(producer, out=np.empty(7, np.float32))
    np.testing.assert_allclose(out, cos64(x), rtol=2e-6, atol=1e-7)
    assert len(producer.calls) == 1  # read through __dlpack__


def test_exchange_tables_that_do_not_check_out_are_ignored():
    from dlpack_producers import ExchangeTable

    x = np.linspace(-2, 2, 7, dtype=np.float32)
    tables = [ExchangeTable(name=b"not_a_tensor"), ExchangeTable(major=2), ExchangeTable(major=0),
              ExchangeTable(complete=False)]
    for table in tables:
        producer = forged_producer(table.capsule, x)
        np.testing.assert_allclose(COS(producer, out=np.empty(7, np.float32)), cos64(x), rtol=2e-6, atol=1e-7)
        assert len(producer.calls) == 1 and table.exported == 0


class NoProtocol:
    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        raise AssertionError("a usable exchange table must be taken first")

    def __dlpack_device__(self):
        return (1, 0)


def test_an_exchange_table_that_checks_out_is_used():
    from dlpack_producers import ExchangeTable

    x = np.linspace(-2, 2, 7, dtype=np.float32)
    table = ExchangeTable()
    out = COS(forged_producer(table.capsule, x, NoProtocol), out=np.empty(7, np.float32))
    np.testing.assert_allclose(out, cos64(x), rtol=2e-6, atol=1e-7)
    assert table.exported == 1
    failing = ExchangeTable(export_fails=True)
    with pytest.raises(BufferError, match="^argument x: the producer could not export it$"):
        COS(forged_producer(failing.capsule, x, NoProtocol), out=np.empty(7, np.float32))


def test_a_framework_that_cannot_say_its_stream_gets_an_error_naming_the_argument():
    """A CUDA tensor from a table whose current_work_stream fails: a RuntimeError, where brrr._C
    returned NULL without an exception (a SystemError)."""
    from dlpack_producers import ExchangeTable

    table = ExchangeTable(device_type=2, stream_fails=True)
    x = np.linspace(-2, 2, 7, dtype=np.float32)
    with pytest.raises(RuntimeError, match="^argument x: its framework could not say its current CUDA stream"):
        COS(forged_producer(table.capsule, x, NoProtocol), out=np.empty(7, np.float32))


class StaysNegated(torch.Tensor):
    """A subclass that says it is negated and whose resolve_neg() returns itself."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.is_neg:
            return True
        return super().__torch_function__(func, types, args, kwargs or {})

    def resolve_neg(self):
        return self


def test_a_tensor_whose_resolve_neg_stays_negated_is_refused():
    """brrr reads a negated view through its resolve_neg(); one that returns a negated view again
    was resolved again and again, in C, until the stack overflowed (a segfault)."""
    x = torch.randn(4).as_subclass(StaysNegated)
    with pytest.raises(ValueError, match=r"^argument x: its resolve_neg\(\) returned a view with its negative bit"):
        COS(x, out=torch.empty(4))
    # brrr's public functions hand such a subclass the op through its __torch_function__, which
    # runs it with the overrides off (is_neg() then False), as torch.relu does
    torch.testing.assert_close(brrr.relu(x).as_subclass(torch.Tensor), torch.relu(x).as_subclass(torch.Tensor))
    # a type that only takes torch's base class's C name, without torch
    fake = type("torch._C.TensorBase", (), {"is_neg": lambda self: True, "resolve_neg": lambda self: self,
                                             "_is_zerotensor": lambda self: False})
    with pytest.raises(ValueError, match=r"^argument x: its resolve_neg\(\) returned"):
        COS(fake(), out=np.empty(4, np.float32))


class Device:
    """A producer whose __dlpack_device__ returns `device` (or raises it, when it is an exception)."""

    def __init__(self, device):
        self.device = device

    def __dlpack__(self, **kwargs):
        return np.ones(3, np.float32).__dlpack__(**kwargs)

    def __dlpack_device__(self):
        if isinstance(self.device, Exception):
            raise self.device
        return self.device


@pytest.mark.parametrize("device", [(1, 2**80), (1, -2**31 - 1), (2**40, 0), (-2**63, 0)], ids=str)
def test_dlpack_device_that_does_not_fit_int32_is_refused(device):
    out = np.zeros(3, np.float32)
    which = "device type" if device[0] != 1 else "device id"
    with pytest.raises(ValueError, match=f"^argument x: __dlpack_device__\\(\\) returned {which} {device[device[0] == 1]},"
                                         " which does not fit int32$"):
        COS(Device(device), out=out)
    assert not out.any()


@pytest.mark.parametrize("device", [(1,), (1, 0, 0), [1, 0], ("1", 0), (1.0, 0), (1, None), (True, 0), None, "cpu"],
                         ids=repr)
def test_dlpack_device_of_the_wrong_type_is_refused(device):
    with pytest.raises(TypeError, match=r"^argument x: __dlpack_device__\(\) must return a \(device_type, device_id\) "
                                        "tuple of ints, got "):
        COS(Device(device), out=np.zeros(3, np.float32))


def test_dlpack_device_errors_name_the_argument():
    with pytest.raises(KeyError, match="argument out: 'broken'"):
        COS(np.ones(3, np.float32), out=Device(KeyError("broken")))

    class NoDevice:
        def __dlpack__(self, **kwargs):
            return np.ones(3, np.float32).__dlpack__(**kwargs)

    with pytest.raises(TypeError, match=r"^argument x: __dlpack_device__\(\) must return .* got no such method$"):
        COS(NoDevice(), out=np.zeros(3, np.float32))


@pytest.mark.parametrize("claimed,actual", [((2, 0), (1, 0)), ((1, 0), (2, 0)), ((2, 1), (2, 0)), ((13, 0), (2, 0))])
def test_a_device_that_disagrees_with_the_capsule_is_refused(claimed, actual):
    out = np.zeros(4, np.float32)
    producer = RawProducer(np.ones(4, np.float32), device_type=actual[0], device_id=actual[1], claimed_device=claimed)
    with pytest.raises(BufferError, match=rf"^argument x: __dlpack_device__\(\) says device \({claimed[0]}, "
                                          rf"{claimed[1]}\) but __dlpack__ exported a tensor on device "
                                          rf"\({actual[0]}, {actual[1]}\)$"):
        COS(producer, out=out)
    assert producer.deleted == 1 and not out.any()


def test_an_output_the_producer_copied_is_refused():
    out = np.zeros(4, np.float32)
    producer = RawProducer(out, flags=2)  # DLPACK_FLAG_BITMASK_IS_COPIED
    with pytest.raises(ValueError, match="^argument out: the producer exported a copy"):
        COS(np.ones(4, np.float32), out=producer)
    assert producer.deleted == 1
    src = RawProducer(np.full(4, 0.5, np.float32), flags=2)  # an input may be a copy
    np.testing.assert_allclose(COS(src, out=np.empty(4, np.float32)), np.cos(0.5), rtol=1e-6)


def test_hostile_layouts_from_a_capsule():
    for kwargs, message in [(dict(null_shape=True), "^argument x: DLPack tensor of rank 1 without a shape$"),
                            (dict(shape=(3, 4), strides=(2**62, 1)), "^argument x: strides that reach beyond 2\\*\\*63 "
                                                                     "bytes \\(dim 0: stride 4611686018427387904"),
                            (dict(shape=(2,), strides=(-2**63,)), "^argument x: strides that reach beyond"),
                            (dict(device_type=2, device_id=-1), "^argument x: negative CUDA device id -1$")]:
        producer = RawProducer(np.ones(12, np.float32), **kwargs)
        with pytest.raises(BufferError, match=message):
            COS(producer, out=np.empty(producer.shape or 12, np.float32))
        assert producer.deleted == 1
    shifted = RawProducer(np.arange(5, dtype=np.float32), shape=(4,), byte_offset=4)  # elements 1..4
    np.testing.assert_allclose(COS(shifted, out=np.empty(4, np.float32)), cos64(np.arange(1, 5)), rtol=2e-6)


@pytest.mark.parametrize("dtype,name", [((0, 64, 1), "int64"), ((1, 8, 1), "uint8"), ((5, 64, 1), "complex64"),
                                        ((6, 8, 1), "bool"), ((2, 32, 4), "float32x4"), ((4, 16, 2), "bfloat16x2"),
                                        ((2, 8, 1), "float8"), ((3, 64, 1), "opaque handle 64"),
                                        ((99, 8, 1), "DLPack type code 99 of 8 bits")], ids=str)
def test_unsupported_dtypes_are_named(dtype, name):
    producer = RawProducer(np.ones(4, np.float32), dtype=dtype)
    with pytest.raises(TypeError, match=f"^argument x: dtype {name} is not supported; expected float32, float16, "
                                        "bfloat16 or float64$"):
        COS(producer, out=np.empty(4, np.float32))
    with pytest.raises(TypeError, match="^argument out: dtype int64 is not supported"):
        COS(np.ones(4, np.float32), out=np.empty(4, np.int64))
    with pytest.raises(TypeError, match="^argument x: dtype bool is not supported"):
        COS(torch.ones(4, dtype=torch.bool))


@pytest.mark.parametrize("stream,exc,message", [
    (2**80, ValueError, "^argument stream: 1208925819614629174706176 does not fit int64$"),
    (-2, ValueError, r"^argument stream: expected a cudaStream_t \(>= 0\) or -1 for the current one, got -2$"),
    (True, TypeError, "^argument stream: expected an int"),
    (1.0, TypeError, "^argument stream: expected an int"),
])
def test_stream_argument(stream, exc, message):
    out = np.zeros(3, np.float32)
    with pytest.raises(exc, match=message):
        _C.chain_fwd(np.ones(3, np.float32), out, COS.program, (), stream)
    assert not out.any()


def test_an_argument_changed_by_python_that_another_one_runs_is_refused():
    """brrr reads a torch tensor through the exchange table as a borrowed view of its memory; a
    later argument's __torch_function__ (run by brrr's is_neg() query) that gives the first one
    other memory (set_) left brrr reading the freed memory. Read again once all are imported: a
    RuntimeError naming it."""
    x = torch.randn(1 << 16)

    class Meddling(torch.Tensor):
        armed = True

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.is_neg and Meddling.armed:
                Meddling.armed = False
                x.set_(torch.zeros(3))
            return super().__torch_function__(func, types, args, kwargs or {})

    operand = torch.randn(1 << 16).as_subclass(Meddling)
    with pytest.raises(RuntimeError, match="^argument x: its memory or shape changed while brrr read the other"):
        _C.chain_fwd(x, torch.empty(1 << 16), brrr.chain("mul_tensor").program, (operand,))
    Meddling.armed = False  # nothing changes: the same call runs
    y = torch.randn(1 << 16)
    out = _C.chain_fwd(y, torch.empty(1 << 16), brrr.chain("mul_tensor").program, (operand,))[0]
    assert torch.equal(out, y * operand.as_subclass(torch.Tensor))
