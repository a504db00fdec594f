"""Hand-made DLPack producers for the bridge tests: wrappers that hide a framework's fast paths,
and raw capsules built with ctypes whose fields (version, flags, strides, dtype) we control."""

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
                 capsule_name=b"dltensor_versioned", reuse_capsule=False, shape=None):
        self.array = np.ascontiguousarray(array, dtype=np.float32)
        self.major, self.flags, self.null_strides = major, flags, null_strides
        self.device_type, self.dtype, self.capsule_name = device_type, dtype, capsule_name
        self.reuse_capsule, self.capsule = reuse_capsule, None
        self.shape = shape  # a claimed shape instead of the array's (for hostile producers)
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
        strides = (ctypes.c_int64 * max(len(dims), 1))(*element_strides)
        m = DLManagedTensorVersioned()
        m.major, m.minor, m.flags, m.deleter = self.major, 0, self.flags, self._deleter
        t = m.dl_tensor
        t.data = a.ctypes.data
        t.device = DLDevice(self.device_type, 0)
        t.ndim = len(dims)
        t.dtype = DLDataType(*self.dtype)
        t.shape = shape
        t.strides = None if self.null_strides else strides
        self._keep.append((m, shape, strides))
        self.exported += 1
        self.capsule = _PyCapsule_New(ctypes.addressof(m), CAPSULE_NAMES[self.capsule_name], None)
        return self.capsule

    def __dlpack_device__(self):
        return (self.device_type, 0)
