/* Tensor import and argument checks.
 *
 * Three ways in, cheapest first:
 *  1. the producer type's C exchange table (`__dlpack_c_exchange_api__`, DLPack 1.2+: PyTorch
 *     2.10+): a borrowed DLTensor filled in place, no capsule, no allocation, no sync; the
 *     framework also tells us its current stream;
 *  2. NumPy arrays, read through the NumPy C API;
 *  3. any other `__dlpack__` producer: versioned capsules first (max_version=(1, 3)), legacy
 *     ones when the producer does not take max_version. The capsule is renamed to its used_
 *     name, so its own destructor leaves the tensor to us, and we call the deleter exactly once
 *     in brrr_tensor_release.
 *
 * Everything read from a foreign object is checked before it is used: the exchange table only
 * from a capsule of its name and major version (anything else on that attribute is ignored, and
 * the object taken through `__dlpack__`), `__dlpack_device__` for a pair of ints that the
 * exported tensor agrees with, capsules by name and version, and every DLTensor for a shape, a
 * dtype, a device and strides whose byte extent fits int64. PyTorch tensors whose memory is not
 * their values (views with the negative bit set, the `.imag` of a conjugated tensor; ZeroTensors,
 * which have none) are read through a materialised copy, and refused as outputs; tensors DLPack
 * cannot carry (sparse, nested, quantized, meta) get a one-line error naming the argument.
 * Exception types follow docs/errors.md. */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "brrr.h"
#include "cpu.h"

#include <numpy/arrayobject.h>
#include <string.h>

size_t brrr_dtype_size(int32_t dtype) {
    switch (dtype) {
    case BRRR_F16:
    case BRRR_BF16: return 2;
    case BRRR_F64:
    case BRRR_I64: return 8;
    case BRRR_U8: return 1;
    default: return 4;
    }
}

const char *brrr_dtype_name(int32_t dtype) {
    switch (dtype) {
    case BRRR_F16: return "float16";
    case BRRR_BF16: return "bfloat16";
    case BRRR_F64: return "float64";
    case BRRR_I64: return "int64";
    case BRRR_I32: return "int32";
    case BRRR_U8: return "uint8";
    default: return "float32";
    }
}

static void format_shape(const int64_t *shape, int ndim, char *buf, size_t size) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int d = 0; d < ndim && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d == 0 ? "%lld" : ", %lld", (long long)shape[d]);
    if (used < size) snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
}

static void format_device(const brrr_tensor *t, char *buf, size_t size) {
    if (t->device_type == kDLCUDA)
        snprintf(buf, size, "cuda:%d", (int)t->device_id);
    else
        snprintf(buf, size, "cpu");
}

/* A DLPack dtype by the name the frameworks give it (int64, complex64, bool, float32x4), so that
 * a refusal reads like the user's own code. */
static void format_dlpack_dtype(DLDataType dt, char *buf, size_t size) {
    static const char *const kinds[] = {"int", "uint", "float", "opaque handle ", "bfloat", "complex"};
    int used;
    if (dt.code == kDLBool && dt.bits == 8)
        used = snprintf(buf, size, "bool");
    else if (dt.code < sizeof kinds / sizeof kinds[0])
        used = snprintf(buf, size, "%s%d", kinds[dt.code], (int)dt.bits);
    else
        used = snprintf(buf, size, "DLPack type code %d of %d bits", (int)dt.code, (int)dt.bits);
    if (dt.lanes != 1 && used > 0 && (size_t)used < size) snprintf(buf + used, size - (size_t)used, "x%d", (int)dt.lanes);
}

/* index: the tensor holds class indices (int64, int32 or uint8), else floats. */
static int dtype_from_dlpack(DLDataType dt, const char *name, int index, int32_t *out) {
    if (dt.lanes == 1) {
        if (index) {
            if (dt.code == kDLInt && dt.bits == 64) { *out = BRRR_I64; return 0; }
            if (dt.code == kDLInt && dt.bits == 32) { *out = BRRR_I32; return 0; }
            if (dt.code == kDLUInt && dt.bits == 8) { *out = BRRR_U8; return 0; }
        } else {
            if (dt.code == kDLFloat && dt.bits == 32) { *out = BRRR_F32; return 0; }
            if (dt.code == kDLFloat && dt.bits == 16) { *out = BRRR_F16; return 0; }
            if (dt.code == kDLFloat && dt.bits == 64) { *out = BRRR_F64; return 0; }
            if (dt.code == kDLBfloat && dt.bits == 16) { *out = BRRR_BF16; return 0; }
        }
    }
    char dtype[64];
    format_dlpack_dtype(dt, dtype, sizeof dtype);
    PyErr_Format(PyExc_TypeError, "argument %s: dtype %s is not supported; expected %s", name, dtype,
                 index ? "class indices of int64, int32 or uint8" : "float32, float16, bfloat16 or float64");
    return -1;
}

/* A view whose every element offset, in bytes from its first element, fits int64: the bound
 * that the overlap checks and the kernels' offset arithmetic rely on. Hostile producers (and
 * NumPy's as_strided) can describe views that are not. */
static int check_extent(brrr_tensor *t) {
    if (t->numel == 0) return 0;
    const int64_t size = (int64_t)brrr_dtype_size(t->dtype);
    int64_t span = 0;
    for (int d = 0; d < t->ndim; d++) {
        const int64_t steps = t->shape[d] - 1, stride = t->strides[d];
        if (stride == INT64_MIN || (steps > 0 && (stride < 0 ? -stride : stride) > (INT64_MAX / size - span) / steps)) {
            PyErr_Format(PyExc_BufferError, "argument %s: strides that reach beyond 2**63 bytes (dim %d: stride %lld, "
                         "size %lld)", t->name, d, (long long)stride, (long long)t->shape[d]);
            return -1;
        }
        span += steps * (stride < 0 ? -stride : stride);
    }
    return 0;
}

/* Copy a DLTensor's description into t; strides NULL means compact row-major (legacy only). */
static int fill_from_dltensor(const DLTensor *dl, int allow_null_strides, int index, brrr_tensor *t) {
    if (dl->ndim < 0 || dl->ndim > BRRR_MAX_RANK) {
        PyErr_Format(PyExc_BufferError, "argument %s: rank %d is not supported (at most %d)", t->name,
                     (int)dl->ndim, BRRR_MAX_RANK);
        return -1;
    }
    if (dl->ndim > 0 && dl->shape == NULL) {
        PyErr_Format(PyExc_BufferError, "argument %s: DLPack tensor of rank %d without a shape", t->name, (int)dl->ndim);
        return -1;
    }
    if (dtype_from_dlpack(dl->dtype, t->name, index, &t->dtype) < 0) return -1;
    switch (dl->device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: t->device_type = kDLCPU; t->device_id = 0; break;
    case kDLCUDA:
    case kDLCUDAManaged: t->device_type = kDLCUDA; t->device_id = dl->device.device_id; break;
    default:
        PyErr_Format(PyExc_ValueError, "argument %s: DLPack device type %d is not supported (expected CPU or CUDA)",
                     t->name, (int)dl->device.device_type);
        return -1;
    }
    if (t->device_id < 0) {
        PyErr_Format(PyExc_BufferError, "argument %s: negative CUDA device id %d", t->name, (int)t->device_id);
        return -1;
    }
    t->ndim = dl->ndim;
    int64_t numel = 1;
    for (int d = 0; d < t->ndim; d++) {
        int64_t size = dl->shape[d];
        if (size < 0) {
            PyErr_Format(PyExc_BufferError, "argument %s: negative size %lld in dim %d", t->name, (long long)size, d);
            return -1;
        }
        if (size != 0 && numel > INT64_MAX / size) {
            PyErr_Format(PyExc_ValueError, "argument %s: number of elements overflows int64", t->name);
            return -1;
        }
        numel *= size;
        t->shape[d] = size;
    }
    t->numel = numel;
    if (t->ndim > 0 && dl->strides == NULL && !allow_null_strides) {
        PyErr_Format(PyExc_BufferError, "argument %s: DLPack 1.x tensor without strides", t->name);
        return -1;
    }
    int64_t running = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        t->strides[d] = dl->strides ? dl->strides[d] : running;
        if (numel > 0) running *= t->shape[d]; /* an empty tensor's product may overflow; its strides are unused */
    }
    /* In integers: a hostile byte_offset must not make pointer arithmetic undefined. */
    t->data = (void *)((uintptr_t)dl->data + (uintptr_t)dl->byte_offset);
    if (numel > 0 && t->data == NULL) {
        PyErr_Format(PyExc_BufferError, "argument %s: NULL data pointer for a non-empty tensor", t->name);
        return -1;
    }
    return check_extent(t);
}

void brrr_type_info_clear(brrr_type_info *info) {
    Py_CLEAR(info->type);
    Py_CLEAR(info->capsule);
    Py_CLEAR(info->is_neg);
    Py_CLEAR(info->is_zerotensor);
    info->api = NULL;
}

/* PyTorch's tensor base class, found by its C name in the type's MRO (brrr does not import
 * torch): its tensors may carry the lazy negative bit, or be ZeroTensors, which DLPack does not
 * describe. */
static PyTypeObject *torch_tensor_base(PyTypeObject *type) {
    PyObject *mro = type->tp_mro;
    for (Py_ssize_t i = 0; mro && PyTuple_Check(mro) && i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if (strcmp(base->tp_name, "torch._C.TensorBase") == 0 || strcmp(base->tp_name, "torch._C._TensorBase") == 0)
            return base;
    }
    return NULL;
}

/* Read what brrr needs to know about `type` into *info (new references). A foreign attribute
 * is trusted only as far as it is checked: the exchange table must come in a capsule of its
 * name, with our major version and the entries we call; anything else is ignored. */
static void read_type_info(brrr_state *st, PyTypeObject *type, brrr_type_info *info) {
    memset(info, 0, sizeof *info);
    info->type = (PyTypeObject *)Py_NewRef((PyObject *)type);
    PyObject *attr = PyObject_GetAttr((PyObject *)type, st->str_exchange_api);
    if (attr != NULL && PyCapsule_IsValid(attr, "dlpack_exchange_api")) {
        const DLPackExchangeAPI *api = PyCapsule_GetPointer(attr, "dlpack_exchange_api");
        if (api && api->header.version.major == BRRR_DLPACK_MAJOR && api->dltensor_from_py_object_no_sync != NULL &&
            api->current_work_stream != NULL) {
            info->api = api;
            info->capsule = Py_NewRef(attr);
        }
    }
    Py_XDECREF(attr);
    PyErr_Clear();
    PyTypeObject *torch_base = torch_tensor_base(type);
    info->is_torch = torch_base != NULL;
    if (torch_base != NULL) {
        info->is_neg = PyObject_GetAttr((PyObject *)torch_base, st->str_is_neg);
        info->is_zerotensor = PyObject_GetAttrString((PyObject *)torch_base, "_is_zerotensor");
        PyErr_Clear();
    }
}

/* What brrr knows about `type`: a cache entry, or *scratch (filled with new references, which
 * the caller releases with brrr_type_info_clear) once the cache is full. */
static const brrr_type_info *type_info(brrr_state *st, PyTypeObject *type, brrr_type_info *scratch) {
    for (int i = 0; i < st->api_cache_len; i++)
        if (st->api_cache[i].type == type) return &st->api_cache[i];
    read_type_info(st, type, scratch);
    if (st->api_cache_len == BRRR_API_CACHE_SIZE) return scratch;
    st->api_cache[st->api_cache_len] = *scratch; /* the cache takes the references over */
    memset(scratch, 0, sizeof *scratch);
    return &st->api_cache[st->api_cache_len++];
}

static void set_allocation_error(void *context, const char *kind, const char *message) {
    (void)context;
    PyErr_Format(PyExc_RuntimeError, "the framework could not allocate an output (%s: %s)", kind, message);
}

PyObject *brrr_new_like(brrr_call *call, PyObject *like_obj, const brrr_tensor *like, brrr_tensor *t) {
    brrr_type_info scratch = {0};
    const DLPackExchangeAPI *api = type_info(call->state, Py_TYPE(like_obj), &scratch)->api;
    PyObject *result = NULL;
    if (api == NULL || api->managed_tensor_allocator == NULL || api->managed_tensor_to_py_object_no_sync == NULL)
        goto done;
    static const DLDataType dtypes[] = {{kDLFloat, 32, 1}, {kDLFloat, 16, 1}, {kDLBfloat, 16, 1}, {kDLFloat, 64, 1}};
    int64_t shape[BRRR_MAX_RANK];
    memcpy(shape, like->shape, sizeof(int64_t) * (size_t)like->ndim);
    DLTensor prototype;
    memset(&prototype, 0, sizeof prototype);
    prototype.device.device_type = like->device_type;
    prototype.device.device_id = like->device_id;
    prototype.ndim = like->ndim;
    prototype.dtype = dtypes[like->dtype];
    prototype.shape = shape;
    DLManagedTensorVersioned *managed = NULL;
    if (api->managed_tensor_allocator(&prototype, &managed, NULL, set_allocation_error) != 0 || managed == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "the framework could not allocate an output");
        goto done;
    }
    /* Described before the object takes the tensor over, which wraps its memory as it is. */
    if (t != NULL && fill_from_dltensor(&managed->dl_tensor, 0, 0, t) < 0) {
        if (managed->deleter) managed->deleter(managed);
        goto done;
    }
    void *obj = NULL;
    if (api->managed_tensor_to_py_object_no_sync(managed, &obj) != 0 || obj == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "the framework could not wrap an output");
        goto done;
    }
    result = (PyObject *)obj;
done:
    if (result == NULL && t != NULL) memset(t, 0, BRRR_TENSOR_HEAD);
    brrr_type_info_clear(&scratch);
    return result;
}

PyObject *brrr_new_shaped(brrr_call *call, PyObject *like_obj, const brrr_tensor *on, int ndim, const int64_t *shape,
                          int32_t dtype, brrr_tensor *t) {
    brrr_tensor like;
    memset(&like, 0, BRRR_TENSOR_HEAD);
    like.ndim = ndim;
    memcpy(like.shape, shape, sizeof(int64_t) * (size_t)ndim);
    like.dtype = dtype;
    like.device_type = on->device_type;
    like.device_id = on->device_id;
    return brrr_new_like(call, like_obj, &like, t);
}

static int import_numpy(PyArrayObject *arr, int index, brrr_tensor *t) {
    int type_num = PyArray_TYPE(arr);
    if (!PyArray_ISNBO(PyArray_DESCR(arr)->byteorder)) {
        PyErr_Format(PyExc_TypeError, "argument %s: non-native byte order is not supported", t->name);
        return -1;
    }
    if (index) {
        /* Signed integers by their size: NumPy's int64 is NPY_LONG or NPY_LONGLONG (array.array('q'),
         * frombuffer(..., 'q')) by how the array was made, int32 NPY_INT or NPY_LONG by platform. */
        const npy_intp size = PyArray_ITEMSIZE(arr);
        if (PyTypeNum_ISSIGNED(type_num) && size == 8) {
            t->dtype = BRRR_I64;
        } else if (PyTypeNum_ISSIGNED(type_num) && size == 4) {
            t->dtype = BRRR_I32;
        } else if (type_num == NPY_UINT8) {
            t->dtype = BRRR_U8;
        } else {
            PyErr_Format(PyExc_TypeError, "argument %s: dtype %S is not supported; expected class indices of int64, "
                         "int32 or uint8", t->name, (PyObject *)PyArray_DESCR(arr));
            return -1;
        }
    } else switch (type_num) {
    case NPY_FLOAT32: t->dtype = BRRR_F32; break;
    case NPY_FLOAT16: t->dtype = BRRR_F16; break;
    case NPY_FLOAT64: t->dtype = BRRR_F64; break;
    default:
        PyErr_Format(PyExc_TypeError, "argument %s: dtype %S is not supported; expected float32, float16 or float64",
                     t->name, (PyObject *)PyArray_DESCR(arr));
        return -1;
    }
    int ndim = PyArray_NDIM(arr);
    if (ndim > BRRR_MAX_RANK) {
        PyErr_Format(PyExc_ValueError, "argument %s: rank %d is not supported (at most %d)", t->name, ndim,
                     BRRR_MAX_RANK);
        return -1;
    }
    npy_intp itemsize = PyArray_ITEMSIZE(arr);
    t->ndim = ndim;
    t->numel = (int64_t)PyArray_SIZE(arr);
    for (int d = 0; d < ndim; d++) {
        npy_intp stride = PyArray_STRIDE(arr, d);
        if (stride % itemsize != 0) {
            PyErr_Format(PyExc_BufferError, "argument %s: stride %lld bytes in dim %d is not a multiple of the item size",
                         t->name, (long long)stride, d);
            return -1;
        }
        t->shape[d] = PyArray_DIM(arr, d);
        t->strides[d] = stride / itemsize;
    }
    t->data = PyArray_DATA(arr);
    t->device_type = kDLCPU;
    t->device_id = 0;
    t->readonly = !PyArray_ISWRITEABLE(arr);
    if (check_extent(t) < 0) return -1;
    Py_INCREF(arr);
    t->owner = (PyObject *)arr;
    return 0;
}

/* Re-raise the pending exception (a producer's) with the argument's name in front, keeping its
 * type; first_line: only the message's first line (PyTorch's go on with a C++ stack trace).
 * An exception type that cannot be made from one message is left as it was. */
static void prefix_error(const char *name, int first_line) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (type == NULL) {
        PyErr_Format(PyExc_BufferError, "argument %s: the producer could not export it", name);
        return;
    }
    PyErr_NormalizeException(&type, &value, &traceback);
    PyObject *text = value ? PyObject_Str(value) : NULL, *renamed = NULL;
    if (text && first_line) {
        Py_ssize_t end = PyUnicode_FindChar(text, '\n', 0, PyUnicode_GET_LENGTH(text), 1);
        if (end >= 0) Py_SETREF(text, PyUnicode_Substring(text, 0, end));
    }
    PyObject *message = text ? PyUnicode_FromFormat("argument %s: %U", name, text) : NULL;
    if (message) renamed = PyObject_CallOneArg(type, message);
    Py_XDECREF(text);
    Py_XDECREF(message);
    if (renamed && PyExceptionInstance_Check(renamed)) {
        PyErr_SetObject((PyObject *)Py_TYPE(renamed), renamed);
        Py_DECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
    } else {
        PyErr_Restore(type, value, traceback);
    }
    Py_XDECREF(renamed);
}

/* A PyTorch tensor that DLPack cannot carry, refused in one line naming the argument; 0 (the
 * pending error kept) when obj is none of those kinds. Only read after an export failed. */
static int refuse_torch_kind(PyObject *obj, const char *name) {
    static const struct { const char *flag, *what; } kinds[] = {
        {"is_nested", "nested tensors are not supported (brrr takes dense, strided tensors)"},
        {"is_quantized", "quantized tensors are not supported (brrr takes float32, float16, bfloat16 and float64 ones)"},
        {"is_meta", "tensors on the meta device are not supported (they hold no data)"},
    };
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    int found = 0;
    for (size_t k = 0; !found && k < sizeof kinds / sizeof kinds[0]; k++) {
        PyObject *flag = PyObject_GetAttrString(obj, kinds[k].flag);
        if (flag != NULL && PyObject_IsTrue(flag) == 1) {
            PyErr_Format(k == 2 ? PyExc_ValueError : PyExc_TypeError, "argument %s: %s", name, kinds[k].what);
            found = 1;
        }
        Py_XDECREF(flag);
        if (!found) PyErr_Clear();
    }
    PyObject *layout = found ? NULL : PyObject_GetAttrString(obj, "layout");
    PyObject *layout_name = layout ? PyObject_Str(layout) : NULL;
    if (layout_name && PyUnicode_CompareWithASCIIString(layout_name, "torch.strided") != 0) {
        PyErr_Format(PyExc_TypeError, "argument %s: tensors of layout %U are not supported (brrr takes dense, strided "
                     "tensors)", name, layout_name);
        found = 1;
    } else if (!found) {
        PyErr_Clear();
    }
    Py_XDECREF(layout);
    Py_XDECREF(layout_name);
    /* A subclass whose import failed (a wrapper subclass, a fake tensor, an uninitialised parameter):
     * its memory is not its values, or it has none. */
    const char *kind = Py_TYPE(obj)->tp_name;
    if (!found && strcmp(kind, "Tensor") != 0 && strcmp(kind, "Parameter") != 0) {
        PyErr_Format(PyExc_TypeError, "argument %s: tensors of subclass %s are not supported (it holds no memory brrr "
                     "can read as its values; brrr takes dense, strided tensors)", name, kind);
        found = 1;
    }
    if (found) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
    } else {
        PyErr_Restore(type, value, traceback);
    }
    return found;
}

/* repr(obj) cut to 40 characters, for messages about values that do not fit (an int of 2**2000
 * has 603 digits, and CPython refuses to print those of 4300 or more). */
static PyObject *short_repr(PyObject *obj) {
    PyObject *text = PyObject_Repr(obj);
    if (text == NULL) {
        PyErr_Clear();
        return PyUnicode_FromString(PyLong_Check(obj) ? "an int too long to print" : "a value that cannot be printed");
    }
    if (PyUnicode_GET_LENGTH(text) <= 40) return text;
    PyObject *head = PyUnicode_Substring(text, 0, 37);
    Py_DECREF(text);
    if (head == NULL) return NULL;
    PyObject *cut = PyUnicode_FromFormat("%U...", head);
    Py_DECREF(head);
    return cut;
}

/* __dlpack_device__() as DLPack's (device_type, device_id) pair of int32. */
static int read_dlpack_device(brrr_state *st, PyObject *obj, const char *name, DLDevice *device) {
    PyObject *pair = PyObject_CallMethodNoArgs(obj, st->str_dlpack_device);
    if (pair == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            prefix_error(name, 0);
            return -1;
        }
        PyErr_Clear();
    }
    int32_t values[2] = {0, 0};
    int ok = pair && PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2;
    for (int k = 0; ok && k < 2; k++) {
        PyObject *item = PyTuple_GET_ITEM(pair, k);
        ok = PyLong_Check(item) && !PyBool_Check(item);
        int overflow = 0;
        long long v = ok ? PyLong_AsLongLongAndOverflow(item, &overflow) : 0;
        if (ok && (overflow || v < INT32_MIN || v > INT32_MAX)) {
            PyObject *shown = short_repr(item);
            if (shown)
                PyErr_Format(PyExc_ValueError, "argument %s: __dlpack_device__() returned %s %U, which does not fit "
                             "int32", name, k == 0 ? "device type" : "device id", shown);
            Py_XDECREF(shown);
            Py_DECREF(pair);
            return -1;
        }
        values[k] = (int32_t)v;
    }
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "argument %s: __dlpack_device__() must return a (device_type, device_id) tuple of "
                     "ints, got %.200s", name, pair ? Py_TYPE(pair)->tp_name : "no such method");
        Py_XDECREF(pair);
        return -1;
    }
    Py_DECREF(pair);
    device->device_type = values[0];
    device->device_id = values[1];
    return 0;
}

/* The protocol path: obj.__dlpack__(stream=..., max_version=(1, 3)), legacy on TypeError. */
static int import_capsule(brrr_call *call, PyObject *obj, int index, int writable, brrr_tensor *t) {
    brrr_state *st = call->state;
    PyObject *method = PyObject_GetAttr(obj, st->str_dlpack);
    if (method == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "argument %s: expected a tensor or array implementing __dlpack__, got %.200s",
                     t->name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    DLDevice device;
    if (read_dlpack_device(st, obj, t->name, &device) < 0) {
        Py_DECREF(method);
        return -1;
    }
    /* CUDA producers make our stream wait for their work; DLPack spells the legacy default
     * stream 1, since 0 is ambiguous. CPU producers take stream=None. */
    PyObject *stream;
    if (device.device_type == kDLCUDA || device.device_type == kDLCUDAManaged) {
        uintptr_t s = (uintptr_t)brrr_call_stream(call);
        stream = PyLong_FromUnsignedLongLong(s == 0 ? 1 : s);
    } else {
        stream = Py_NewRef(Py_None);
    }
    if (stream == NULL) { Py_DECREF(method); return -1; }
    PyObject *kwargs = Py_BuildValue("{sOsO}", "stream", stream, "max_version", st->max_version);
    PyObject *empty = PyTuple_New(0);
    PyObject *capsule = (kwargs && empty) ? PyObject_Call(method, empty, kwargs) : NULL;
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear(); /* a pre-1.0 producer: no max_version keyword */
        Py_DECREF(kwargs);
        kwargs = Py_BuildValue("{sO}", "stream", stream);
        capsule = kwargs ? PyObject_Call(method, empty, kwargs) : NULL;
    }
    Py_XDECREF(kwargs);
    Py_XDECREF(empty);
    Py_DECREF(stream);
    Py_DECREF(method);
    if (capsule == NULL) {
        prefix_error(t->name, 0);
        return -1;
    }

    int status = -1;
    const DLTensor *dl = NULL;
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (m == NULL || PyCapsule_SetName(capsule, "used_dltensor_versioned") < 0) goto done;
        t->managed_versioned = m; /* ours from here on: release calls the deleter */
        if (m->version.major != BRRR_DLPACK_MAJOR) {
            PyErr_Format(PyExc_BufferError, "argument %s: DLPack major version %u is not supported (expected %d)",
                         t->name, (unsigned)m->version.major, BRRR_DLPACK_MAJOR);
            goto done;
        }
        if (writable && (m->flags & DLPACK_FLAG_BITMASK_IS_COPIED)) {
            PyErr_Format(PyExc_ValueError, "argument %s: the producer exported a copy (DLPack's is_copied flag), which "
                         "an output written here would not reach", t->name);
            goto done;
        }
        t->readonly = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
        dl = &m->dl_tensor;
        status = fill_from_dltensor(dl, 0, index, t);
    } else if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, "dltensor");
        if (m == NULL || PyCapsule_SetName(capsule, "used_dltensor") < 0) goto done;
        t->managed_legacy = m;
        dl = &m->dl_tensor;
        status = fill_from_dltensor(dl, 1, index, t);
    } else {
        const char *cname = PyCapsule_CheckExact(capsule) ? PyCapsule_GetName(capsule) : NULL;
        PyErr_Clear();
        if (cname && strncmp(cname, "used_", 5) == 0)
            PyErr_Format(PyExc_BufferError, "argument %s: __dlpack__ returned an already consumed capsule (%s)",
                         t->name, cname);
        else
            PyErr_Format(PyExc_BufferError,
                         "argument %s: __dlpack__ must return a capsule named 'dltensor_versioned' or 'dltensor', "
                         "got %.200s%s%s",
                         t->name, Py_TYPE(capsule)->tp_name, cname ? " named " : "", cname ? cname : "");
    }
    /* The stream argument was chosen for the device __dlpack_device__ named: a tensor elsewhere
     * was exported without the synchronisation its device needs. */
    if (status == 0 && (dl->device.device_type != device.device_type ||
                        (device.device_type != kDLCPU && dl->device.device_id != device.device_id))) {
        PyErr_Format(PyExc_BufferError, "argument %s: __dlpack_device__() says device (%d, %d) but __dlpack__ exported "
                     "a tensor on device (%d, %d)", t->name, (int)device.device_type, (int)device.device_id,
                     (int)dl->device.device_type, (int)dl->device.device_id);
        status = -1;
    }
done:
    Py_DECREF(capsule);
    return status;
}

static int tensor_import(brrr_call *call, PyObject *obj, const char *name, int writable, int index, int materialised,
                         brrr_tensor *t);

/* unbound_method(obj) is true: 1, false or no such method: 0, -1 with an exception. A call into
 * Python, counted in call->python_calls. */
static int flag(brrr_call *call, PyObject *unbound_method, PyObject *obj) {
    if (unbound_method == NULL) return 0;
    call->python_calls++;
    PyObject *result = PyObject_CallOneArg(unbound_method, obj);
    int truth = result ? PyObject_IsTrue(result) : -1;
    Py_XDECREF(result);
    return truth;
}

/* A PyTorch tensor whose memory is not its values (`what`): an input is read through the copy
 * that obj.method() materialises, kept alive by t until released; an output is refused, as
 * brrr's writes would not reach its values. */
static int import_materialised(brrr_call *call, PyObject *obj, const char *name, int writable, int index,
                               brrr_tensor *t, const char *method, const char *what) {
    if (writable) {
        PyErr_Format(PyExc_ValueError, "argument %s: %s cannot be written in place; pass a tensor without it", name,
                     what);
        return -1;
    }
    call->python_calls++;
    PyObject *materialised = PyObject_CallMethod(obj, method, NULL);
    int status = materialised ? tensor_import(call, materialised, name, writable, index, 1, t) : -1;
    if (status == 0 && t->owner == NULL) t->owner = Py_NewRef(materialised);
    Py_XDECREF(materialised);
    return status;
}

/* A subclass's resolve_neg() or clone() may return what it was called on: refused, where it
 * would be materialised again and again (the C stack, not Python's recursion limit, overflows). */
static int refuse_unmaterialised(const char *name, const char *method, const char *what) {
    PyErr_Format(PyExc_ValueError, "argument %s: its %s() returned %s again; pass a tensor without it", name, method,
                 what);
    return -1;
}

static int tensor_import(brrr_call *call, PyObject *obj, const char *name, int writable, int index, int materialised,
                         brrr_tensor *t) {
    memset(t, 0, BRRR_TENSOR_HEAD);
    t->name = name;
    if (obj == Py_None) {
        PyErr_Format(PyExc_TypeError, "argument %s: expected a tensor or array, got None", name);
        return -1;
    }
    brrr_type_info scratch = {0};
    const brrr_type_info *info = PyArray_Check(obj) ? NULL : type_info(call->state, Py_TYPE(obj), &scratch);
    /* PyTorch's lazy negation: the memory holds -x. Asked of every torch tensor, before its import. */
    int negated = info ? flag(call, info->is_neg, obj) : 0;
    int status;
    if (negated) {
        const char *what = "a view with its negative bit set (is_neg(), e.g. the .imag of a conjugated tensor)";
        status = negated < 0          ? -1
                 : materialised ? refuse_unmaterialised(name, "resolve_neg", what)
                                : import_materialised(call, obj, name, writable, index, t, "resolve_neg", what);
        if (negated < 0) prefix_error(name, 1);
    } else if (info && info->api) {
        DLTensor dl;
        status = info->api->dltensor_from_py_object_no_sync(obj, &dl);
        if (status != 0) prefix_error(name, info->is_neg != NULL);
        if (status == 0) status = fill_from_dltensor(&dl, 0, index, t);
        if (status == 0) {
            t->borrowed_from = obj;
            t->borrowed_api = info->api;
            t->borrowed_index = index;
            t->borrowed_at = call->python_calls;
        }
        if (status == 0 && !call->resolved && call->stream_arg < 0 && t->device_type == kDLCUDA) {
            /* The framework's current stream on this tensor's device: where its own ops run. */
            if (info->api->current_work_stream(kDLCUDA, t->device_id, &call->stream) != 0) {
                PyErr_Format(PyExc_RuntimeError, "argument %s: its framework could not say its current CUDA stream "
                             "(pass the stream)", name);
                status = -1;
            }
            call->resolved = status == 0;
        }
    } else if (info == NULL) {
        status = import_numpy((PyArrayObject *)obj, index, t);
    } else {
        call->python_calls++;
        status = import_capsule(call, obj, index, writable, t);
    }
    /* PyTorch's efficient zeros (autograd may hand a backward one) have no memory: their data
     * pointer is NULL plus the view's offset. Asked where the pointer lies in the first 4 GiB
     * (where no allocation of a 64-bit process is but for some small heaps, which pay one more
     * call): a view of one cannot escape short of an offset of 4 GiB. */
    if (info && info->is_neg && !negated && (status < 0 || (t->numel > 0 && (uintptr_t)t->data < ((uintptr_t)1 << 32)))) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback); /* the import's error, if it failed */
        int zero = flag(call, info->is_zerotensor, obj);
        if (zero == 0) {
            PyErr_Restore(type, value, traceback);
            if (status < 0) refuse_torch_kind(obj, name);
        } else {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            brrr_tensor_release(t);
            if (zero < 0) prefix_error(name, 1);
            const char *what = "a ZeroTensor (_is_zerotensor(), lazy zeros with no memory)";
            status = zero < 0       ? -1
                     : materialised ? refuse_unmaterialised(name, "clone", what)
                                    : import_materialised(call, obj, name, writable, index, t, "clone", what);
        }
    }
    brrr_type_info_clear(&scratch);
    if (status == 0 && t->numel > 0 && (uintptr_t)t->data % brrr_dtype_size(t->dtype) != 0) {
        /* Typed loads from such a pointer are undefined in C and faults on the GPU. */
        PyErr_Format(PyExc_ValueError, "argument %s: data pointer is not aligned to its %d-byte elements", name,
                     (int)brrr_dtype_size(t->dtype));
        status = -1;
    }
    if (status == 0 && writable && t->readonly) {
        PyErr_Format(PyExc_ValueError, "argument %s: output is read-only", name);
        status = -1;
    }
    if (status == 0) status = brrr_check_device_supported(t);
    if (status == 0) t->from_torch = info && info->is_torch;
    if (status == 0 && t->device_type == kDLCPU && !call->cpu_threads_chosen) {
        brrr_cpu_choose_threads(call->state, obj);
        call->cpu_threads_chosen = 1;
    }
    if (status < 0) brrr_tensor_release(t);
    return status;
}

int brrr_tensor_import(brrr_call *call, PyObject *obj, const char *name, int writable, brrr_tensor *t) {
    return tensor_import(call, obj, name, writable, 0, 0, t);
}

int brrr_index_import(brrr_call *call, PyObject *obj, const char *name, brrr_tensor *t) {
    return tensor_import(call, obj, name, 0, 1, 0, t);
}

int brrr_tensor_check_borrowed(const brrr_call *call, const brrr_tensor *t) {
    if (t->borrowed_from == NULL || t->borrowed_at == call->python_calls) return 0;
    DLTensor dl;
    brrr_tensor now;
    memset(&now, 0, BRRR_TENSOR_HEAD);
    now.name = t->name;
    if (t->borrowed_api->dltensor_from_py_object_no_sync(t->borrowed_from, &dl) != 0) {
        prefix_error(t->name, 0);
        return -1;
    }
    if (fill_from_dltensor(&dl, 0, t->borrowed_index, &now) < 0) return -1;
    int same = now.data == t->data && now.dtype == t->dtype && now.ndim == t->ndim &&
               now.device_type == t->device_type && now.device_id == t->device_id;
    for (int d = 0; same && d < t->ndim; d++) same = now.shape[d] == t->shape[d] && now.strides[d] == t->strides[d];
    if (same) return 0;
    PyErr_Format(PyExc_RuntimeError, "argument %s: its memory or shape changed while brrr read the other arguments "
                 "(Python code that reading them ran: a __torch_function__, __dlpack__ or mode)", t->name);
    return -1;
}

void brrr_tensor_release(brrr_tensor *t) {
    if (!t->managed_versioned && !t->managed_legacy && !t->owner) return;
    /* Deleters and decrefs may run Python code (finalizers, Python-level deleters), which must
     * not see the exception this call may be about to raise: park it meanwhile. */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (t->managed_versioned && t->managed_versioned->deleter) t->managed_versioned->deleter(t->managed_versioned);
    if (t->managed_legacy && t->managed_legacy->deleter) t->managed_legacy->deleter(t->managed_legacy);
    t->managed_versioned = NULL;
    t->managed_legacy = NULL;
    Py_CLEAR(t->owner);
    PyErr_Restore(type, value, traceback);
}

int brrr_parse_int64(PyObject *obj, const char *name, long long *value) {
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "argument %s: expected an int, got %.200s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *index = PyNumber_Index(obj);
    if (index == NULL) return -1;
    int overflow = 0;
    *value = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (overflow) {
        PyObject *shown = short_repr(obj);
        if (shown) PyErr_Format(PyExc_ValueError, "argument %s: %U does not fit int64", name, shown);
        Py_XDECREF(shown);
        return -1;
    }
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

/* 1 if obj is a complex number that is not real by numbers' ABCs (NumPy's complex scalars, one
 * of them a subclass of Python's complex, whose float() drops the imaginary part) or by its own
 * is_complex() (a complex torch tensor, of any imaginary part), 0 if not, -1 on error. */
static int is_complex_scalar(PyObject *obj) {
    if (PyComplex_Check(obj)) return 1;
    PyObject *asked = PyObject_HasAttrString(obj, "is_complex") ? PyObject_CallMethod(obj, "is_complex", NULL) : NULL;
    if (asked) {
        int truth = PyObject_IsTrue(asked);
        Py_DECREF(asked);
        if (truth != 0) return truth;
    } else if (PyErr_Occurred()) {
        PyErr_Clear();  /* an is_complex that is not a method of no arguments: numbers' ABCs decide */
    }
    PyObject *numbers = PyImport_ImportModule("numbers");
    if (numbers == NULL) return -1;
    PyObject *complex_abc = PyObject_GetAttrString(numbers, "Complex"), *real_abc = PyObject_GetAttrString(numbers, "Real");
    Py_DECREF(numbers);
    int is_complex = complex_abc && real_abc ? PyObject_IsInstance(obj, complex_abc) : -1;
    if (is_complex == 1) is_complex = PyObject_IsInstance(obj, real_abc) == 0 ? 1 : (PyErr_Occurred() ? -1 : 0);
    Py_XDECREF(complex_abc);
    Py_XDECREF(real_abc);
    return is_complex;
}

int brrr_parse_double(PyObject *obj, const char *name, double *value) {
    PyNumberMethods *number = Py_TYPE(obj)->tp_as_number;
    if (PyBool_Check(obj) || !(PyFloat_Check(obj) || PyLong_Check(obj) || (number && number->nb_float))) {
        PyErr_Format(PyExc_TypeError, "argument %s: expected a float, got %.200s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!PyFloat_Check(obj) && !PyLong_Check(obj)) {
        int complex_number = is_complex_scalar(obj);
        if (complex_number < 0) return -1;
        if (complex_number) {
            PyErr_Format(PyExc_TypeError, "argument %s: expected a real number, got %.200s", name, Py_TYPE(obj)->tp_name);
            return -1;
        }
    }
    *value = PyLong_Check(obj) ? PyLong_AsDouble(obj) : PyFloat_AsDouble(obj);
    if (*value == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            prefix_error(name, 1);  /* __float__'s own error, such as a tensor's of several elements */
            return -1;
        }
        PyErr_Clear();
        PyObject *shown = short_repr(obj);
        if (shown) PyErr_Format(PyExc_ValueError, "argument %s: %U does not fit a float64", name, shown);
        Py_XDECREF(shown);
        return -1;
    }
    return 0;
}

int brrr_parse_bool(PyObject *obj, const char *name, int *value) {
    if (!PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "argument %s: expected a bool, got %.200s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *value = obj == Py_True;
    return 0;
}

int brrr_parse_stream(PyObject *obj, long long *stream) {
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "argument stream: expected an int (a cudaStream_t, or -1 for the current one)");
        return -1;
    }
    if (brrr_parse_int64(obj, "stream", stream) < 0) return -1;
    if (*stream < -1) {
        PyErr_Format(PyExc_ValueError, "argument stream: expected a cudaStream_t (>= 0) or -1 for the current one, got "
                     "%lld", *stream);
        return -1;
    }
    return 0;
}

void *brrr_call_stream(brrr_call *call) {
    if (!call->resolved) {
        call->stream = call->stream_arg > 0 ? (void *)(uintptr_t)call->stream_arg : NULL;
        call->wait_for_kernels = call->stream_arg < 0;
        call->resolved = 1;
    }
    return call->stream;
}

int brrr_check_device_supported(const brrr_tensor *t) {
    if (t->device_type == kDLCUDA && !BRRR_WITH_CUDA) {
        PyErr_Format(PyExc_RuntimeError, "argument %s is on cuda:%d but this build of brrr has no CUDA kernels "
                     "(rebuild with nvcc available)", t->name, (int)t->device_id);
        return -1;
    }
    if (t->device_type == kDLCPU || t->device_type == kDLCUDA) return 0;
    PyErr_Format(PyExc_ValueError, "argument %s: device is not supported", t->name);
    return -1;
}

int brrr_check_same_framework(const brrr_tensor *t, PyObject *obj, const brrr_tensor *x, PyObject *x_obj) {
    if (t->from_torch == x->from_torch) return 0;
    if (t->from_torch)
        PyErr_Format(PyExc_TypeError, "argument %s: got a torch.Tensor where %s is a %.200s (the tensors of one call "
                     "come from one framework)", t->name, x->name, Py_TYPE(x_obj)->tp_name);
    else
        PyErr_Format(PyExc_TypeError, "argument %s: expected a torch.Tensor like %s (the tensors of one call come from "
                     "one framework), got %.200s", t->name, x->name, Py_TYPE(obj)->tp_name);
    return -1;
}

int brrr_check_same_device(const brrr_tensor *t, const brrr_tensor *ref) {
    if (t->device_type == ref->device_type && t->device_id == ref->device_id) return 0;
    char a[32], b[32];
    format_device(t, a, sizeof a);
    format_device(ref, b, sizeof b);
    PyErr_Format(PyExc_ValueError, "argument %s is on %s but %s is on %s", t->name, a, ref->name, b);
    return -1;
}

int brrr_check_same_dtype(const brrr_tensor *t, const brrr_tensor *ref) {
    if (t->dtype == ref->dtype) return 0;
    PyErr_Format(PyExc_ValueError, "argument %s has dtype %s but %s has dtype %s", t->name, brrr_dtype_name(t->dtype),
                 ref->name, brrr_dtype_name(ref->dtype));
    return -1;
}

int brrr_check_same_shape(const brrr_tensor *t, const brrr_tensor *ref) {
    int same = t->ndim == ref->ndim;
    for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == ref->shape[d];
    if (same) return 0;
    char a[256], b[256];
    format_shape(t->shape, t->ndim, a, sizeof a);
    format_shape(ref->shape, ref->ndim, b, sizeof b);
    PyErr_Format(PyExc_ValueError, "argument %s has shape %s but %s has shape %s", t->name, a, ref->name, b);
    return -1;
}

/* Byte range [lo, hi) that a view can touch. */
static void extent(const brrr_tensor *t, uintptr_t *lo, uintptr_t *hi) {
    int64_t low = 0, high = 0;
    for (int d = 0; d < t->ndim; d++) {
        int64_t span = (t->shape[d] - 1) * t->strides[d];
        if (span < 0) low += span; else high += span;
    }
    int64_t size = (int64_t)brrr_dtype_size(t->dtype);
    *lo = (uintptr_t)t->data + (uintptr_t)(low * size);
    *hi = (uintptr_t)t->data + (uintptr_t)((high + 1) * size);
}

int brrr_check_no_internal_overlap(const brrr_tensor *out) {
    if (out->numel <= 1) return 0;
    /* Sufficient for no overlap: with dims ordered by |stride|, each stride exceeds the span of
     * all smaller dims. Views that fail it (broadcast, interleaved) are refused, not guessed at. */
    int64_t sizes[BRRR_MAX_RANK], strides[BRRR_MAX_RANK];
    int n = 0;
    for (int d = 0; d < out->ndim; d++) {
        if (out->shape[d] == 1) continue;
        int64_t s = out->strides[d] < 0 ? -out->strides[d] : out->strides[d];
        int i = n++;
        while (i > 0 && strides[i - 1] > s) { strides[i] = strides[i - 1]; sizes[i] = sizes[i - 1]; i--; }
        strides[i] = s;
        sizes[i] = out->shape[d];
    }
    int64_t span = 0;
    for (int i = 0; i < n; i++) {
        if (strides[i] <= span) {
            PyErr_Format(PyExc_ValueError, "argument %s: output has overlapping elements (a broadcast or "
                         "self-overlapping view); pass a tensor whose elements are distinct", out->name);
            return -1;
        }
        span += (sizes[i] - 1) * strides[i];
    }
    return 0;
}

/* Can sum_k c_k * strides[k], |c_k| < sizes[k], equal delta? Dims sorted by stride, largest
 * first; spans[k] bounds what dims k.. can reach, so at most two c_0 survive at each level. */
static int offset_reachable(int64_t delta, const int64_t *sizes, const int64_t *strides, const int64_t *spans, int n) {
    if (n == 0) return delta == 0;
    int64_t q = delta / strides[0], rest = n > 1 ? spans[1] : 0;
    for (int64_t c = q - 1; c <= q + 1; c++) {
        int64_t r = delta - c * strides[0];
        if (c <= -sizes[0] || c >= sizes[0] || r > rest || r < -rest) continue;
        if (offset_reachable(r, sizes + 1, strides + 1, spans + 1, n - 1)) return 1;
    }
    return 0;
}

/* Two views with the same shape and strides, data pointers `delta` elements apart, whose layout
 * has no internal overlap: they share an element only if delta is a difference of two indices.
 * This is what tells the halves of a GLU input, or interleaved columns, apart. */
static int same_layout_disjoint(const brrr_tensor *a, const brrr_tensor *b) {
    if (a->dtype != b->dtype || a->ndim != b->ndim) return 0;
    int64_t size = (int64_t)brrr_dtype_size(a->dtype), sizes[BRRR_MAX_RANK], strides[BRRR_MAX_RANK];
    int64_t bytes = (int64_t)((uintptr_t)b->data - (uintptr_t)a->data);
    if (bytes % size != 0) return 0;
    int n = 0;
    for (int d = 0; d < a->ndim; d++) {
        if (a->shape[d] != b->shape[d] || (a->shape[d] > 1 && a->strides[d] != b->strides[d])) return 0;
        if (a->shape[d] == 1) continue;
        int64_t st = a->strides[d] < 0 ? -a->strides[d] : a->strides[d];
        int i = n++;
        while (i > 0 && strides[i - 1] < st) { strides[i] = strides[i - 1]; sizes[i] = sizes[i - 1]; i--; }
        strides[i] = st;
        sizes[i] = a->shape[d];
    }
    int64_t spans[BRRR_MAX_RANK], span = 0;
    for (int i = n - 1; i >= 0; i--) { /* no internal overlap: each stride clears the dims below */
        if (strides[i] <= span) return 0;
        span += (sizes[i] - 1) * strides[i];
        spans[i] = span;
    }
    return !offset_reachable(bytes / size, sizes, strides, spans, n);
}

int brrr_check_no_overlap(const brrr_tensor *out, const brrr_tensor *in, int allow_same) {
    if (out->numel == 0 || in->numel == 0 || out->device_type != in->device_type || out->device_id != in->device_id)
        return 0;
    uintptr_t a0, a1, b0, b1;
    extent(out, &a0, &a1);
    extent(in, &b0, &b1);
    if (a1 <= b0 || b1 <= a0 || same_layout_disjoint(out, in)) return 0;
    if (allow_same && out->data == in->data && out->dtype == in->dtype && out->ndim == in->ndim) {
        int same = 1;
        for (int d = 0; same && d < out->ndim; d++)
            same = out->shape[d] == in->shape[d] && (out->strides[d] == in->strides[d] || out->shape[d] == 1);
        if (same) return 0;
    }
    PyErr_Format(PyExc_ValueError, "argument %s overlaps input %s in memory%s", out->name, in->name,
                 allow_same ? " (only an exactly identical view may be written in place)" : "");
    return -1;
}

int brrr_cuda_result(int error, const char *op) {
    if (error == 0) return 0;
#if BRRR_WITH_CUDA
    PyErr_Format(PyExc_RuntimeError, "brrr.%s: CUDA error %d (%s)", op, error, brrr_cuda_error_string(error));
#else
    PyErr_Format(PyExc_RuntimeError, "brrr.%s: CUDA error %d", op, error);
#endif
    return -1;
}

int brrr_check_view_dims(const char *name, int ndim) {
    if (ndim <= BRRR_MAX_DIMS) return 0;
    PyErr_Format(PyExc_ValueError, "argument %s: views with more than %d non-mergeable dims are not supported (got %d; "
                 "a contiguous copy has one)", name, BRRR_MAX_DIMS, ndim);
    return -1;
}

int brrr_coalesce(const char *name, int ndim, int64_t *shape, int count, int64_t (*strides)[BRRR_MAX_RANK]) {
    /* Drop size-1 dims; order the rest by the first tensor's |stride|, largest first (stable). */
    int order[BRRR_MAX_RANK], n = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1) continue;
        int64_t s = strides[0][d] < 0 ? -strides[0][d] : strides[0][d];
        int i = n++;
        while (i > 0) {
            int64_t p = strides[0][order[i - 1]];
            if ((p < 0 ? -p : p) >= s) break;
            order[i] = order[i - 1];
            i--;
        }
        order[i] = d;
    }
    int64_t new_shape[BRRR_MAX_RANK], tmp[BRRR_MAX_RANK];
    for (int i = 0; i < n; i++) new_shape[i] = shape[order[i]];
    for (int k = 0; k < count; k++) {
        for (int i = 0; i < n; i++) tmp[i] = strides[k][order[i]];
        memcpy(strides[k], tmp, sizeof(int64_t) * (size_t)n);
    }
    int out = brrr_merge_in_order(n, new_shape, count, strides);
    if (out == 0) { /* a single element (or every dim of size 1) */
        new_shape[0] = 1;
        for (int k = 0; k < count; k++) strides[k][0] = 1;
        out = 1;
    }
    if (brrr_check_view_dims(name, out) < 0) return -1;
    memcpy(shape, new_shape, sizeof(int64_t) * (size_t)out);
    return out;
}

int brrr_merge_in_order(int ndim, int64_t *shape, int count, int64_t (*strides)[BRRR_MAX_RANK]) {
    int n = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1) continue;
        int merge = n > 0;
        for (int k = 0; merge && k < count; k++) merge = strides[k][n - 1] == strides[k][d] * shape[d];
        if (merge) {
            shape[n - 1] *= shape[d];
            for (int k = 0; k < count; k++) strides[k][n - 1] = strides[k][d];
        } else {
            shape[n] = shape[d];
            for (int k = 0; k < count; k++) strides[k][n] = strides[k][d];
            n++;
        }
    }
    return n;
}
