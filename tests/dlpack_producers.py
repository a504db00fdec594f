"""Hand-made DLPack producers for the bridge tests: wrappers that hide a framework's fast paths,
raw capsules built with ctypes whose fields (version, flags, strides, dtype, device) we control,
and forged C exchange tables."""

import ctypes

import numpy as np


class Producer:
    """Exposes only the DLPack protocol of `array`, so brrr must take the capsule path.

    legacy=True behaves like a pre-1.0 producer: it rejects max_version and returns an
    unversioned capsule. Each call's keyword arguments are recorded in `calls`."""

    def __init__(self, array, legacy=False):
        self.array, self.legacy, self.calls = array, legacy, []

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        if self.legacy and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        self.calls.append({"stream": stream, "max_version": max_version})
        if self.legacy:
            return self.array.__dlpack__(stream=stream)
        return self.array.__dlpack__(stream=stream, max_version=max_version)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                                     ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER),
                                     ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# PyCapsule keeps the name pointer, not a copy: these bytes must outlive every capsule.
CAPSULE_NAMES = {name: ctypes.create_string_buffer(name) for name in (b"dltensor_versioned", b"dltensor", b"not_a_tensor")}


class RawProducer:
    """A versioned DLPack producer over a NumPy float32 array, with every field overridable.

    `deleted` counts deleter calls; the DLPack contract is exactly one per exported capsule."""

    def __init__(self, array, major=1, flags=0, null_strides=False, device_type=1, dtype=(2, 32, 1),
                 capsule_name=b"dltensor_versioned", reuse_capsule=False, shape=None, strides=None, device_id=0,
                 claimed_device=None, null_shape=False, byte_offset=0):
        self.array = np.ascontiguousarray(array, dtype=np.float32)
        self.major, self.flags, self.null_strides = major, flags, null_strides
        self.device_type, self.dtype, self.capsule_name = device_type, dtype, capsule_name
        self.reuse_capsule, self.capsule = reuse_capsule, None
        self.shape = shape  # a claimed shape instead of the array's (for hostile producers)
        self.strides = strides  # claimed element strides
        self.device_id, self.null_shape, self.byte_offset = device_id, null_shape, byte_offset
        # what __dlpack_device__ says, when it is not where the tensor is (a lying producer)
        self.claimed_device = claimed_device
        self.deleted = 0
        self.exported = 0
        self._keep = []
        self._deleter = DELETER(self._on_delete)

    def _on_delete(self, _):
        self.deleted += 1

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        if self.reuse_capsule and self.capsule is not None:
            return self.capsule
        a = self.array
        dims = self.shape if self.shape is not None else a.shape
        shape = (ctypes.c_int64 * max(len(dims), 1))(*dims)
        element_strides = [s // a.itemsize for s in a.strides] if self.shape is None else \
            [1] * len(dims)  # a claimed shape gets as many strides as it has dims
        if self.strides is not None:
            element_strides = self.strides
        strides = (ctypes.c_int64 * max(len(dims), 1))(*element_strides)
        m = DLManagedTensorVersioned()
        m.major, m.minor, m.flags, m.deleter = self.major, 0, self.flags, self._deleter
        t = m.dl_tensor
        t.data = a.ctypes.data
        t.byte_offset = self.byte_offset
        t.device = DLDevice(self.device_type, self.device_id)
        t.ndim = len(dims)
        t.dtype = DLDataType(*self.dtype)
        t.shape = None if self.null_shape else shape
        t.strides = None if self.null_strides else strides
        self._keep.append((m, shape, strides))
        self.exported += 1
        self.capsule = _PyCapsule_New(ctypes.addressof(m), CAPSULE_NAMES[self.capsule_name], None)
        return self.capsule

    def __dlpack_device__(self):
        return self.claimed_device if self.claimed_device is not None else (self.device_type, self.device_id)


# ---- DLPack's C exchange table (`__dlpack_c_exchange_api__`), forged --------------------------

class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class ExchangeAPI(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev_api", ctypes.c_void_p),
                ("managed_tensor_allocator", ctypes.c_void_p), ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
                ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
                ("dltensor_from_py_object_no_sync", ctypes.c_void_p), ("current_work_stream", ctypes.c_void_p)]


DLTENSOR_FROM_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(DLTensor))
CURRENT_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))
CAPSULE_NAMES[b"dlpack_exchange_api"] = ctypes.create_string_buffer(b"dlpack_exchange_api")


class ExchangeTable:
    """A C exchange table whose export entry reads the NumPy array `obj.array` (or fails, returning
    -1, when export_fails) as on DLPack device `device_type`, in a capsule named `name`; `major`
    and `complete` (NULL entries) make it one brrr must not use; its stream entry fails with
    stream_fails. Keep the object alive as long as its capsule."""

    def __init__(self, major=1, complete=True, export_fails=False, name=b"dlpack_exchange_api", device_type=1,
                 stream_fails=False):
        self.exported = 0
        self._keep = []

        def export(obj, out):
            if export_fails:
                return -1
            a = obj.array
            shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
            strides = (ctypes.c_int64 * max(a.ndim, 1))(*[s // a.itemsize for s in a.strides])
            self._keep.append((shape, strides))
            t = out.contents
            t.data, t.device, t.ndim, t.dtype = a.ctypes.data, DLDevice(device_type, 0), a.ndim, DLDataType(2, 32, 1)
            t.shape, t.strides, t.byte_offset = shape, strides, 0
            self.exported += 1
            return 0

        def stream(device_type, device_id, out):
            out[0] = None
            return -1 if stream_fails else 0

        self._export, self._stream = DLTENSOR_FROM_PY(export), CURRENT_STREAM(stream)
        self.table = ExchangeAPI(major, 3, None, None, None, None,
                                 ctypes.cast(self._export, ctypes.c_void_p).value if complete else None,
                                 ctypes.cast(self._stream, ctypes.c_void_p).value)
        if name not in CAPSULE_NAMES:
            CAPSULE_NAMES[name] = ctypes.create_string_buffer(name)
        self.capsule = _PyCapsule_New(ctypes.addressof(self.table), CAPSULE_NAMES[name], None)
