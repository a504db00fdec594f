/* Rotary position embedding: the glue and the CPU twin (formulas: brrr_cuda.h).
 *
 * _C.rotary(x, cos, sin, out, backward, stream) -> out
 *     x (..., D), D even; cos and sin of x's dtype, broadcastable to x's shape (as NumPy
 *     broadcasts, from the last dim) and with D as their last dim; out: x's shape and dtype, or
 *     None for NumPy arrays and tensors of frameworks with DLPack's C exchange table (allocated
 *     here, contiguous). out may be x itself (each pair is read before it is written).
 *     backward: the transposed rotation (the gradient with respect to x, given x = grad_out).
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "brrr.h"
#include "cpu.h"

#include <numpy/arrayobject.h>
#include <string.h>


/* Offset of row r in a row-strided view (over the merged row shape). */
static int64_t row_offset(const brrr_rotary_launch *L, const int64_t *strides, int64_t r) {
    return brrr_unravel(L->row_ndim, L->row_shape, strides, r);
}

/* In float32 for every dtype but float64, as the kernels compute; each pair read before written. */
static void rotary_rows(void *ctx, int64_t begin, int64_t end) {
    const brrr_rotary_launch *L = ctx;
    const int32_t dt = L->dtype;
    const int64_t *cs = L->col_stride, h = L->half;
    for (int64_t r = begin; r < end; r++) {
        const int64_t ox = row_offset(L, L->x.strides, r), oo = row_offset(L, L->out.strides, r);
        const int64_t oc = row_offset(L, L->cos.strides, r), os = row_offset(L, L->sin.strides, r);
        for (int64_t j = 0; j < h; j++) {
            const double a = brrr_load_f64(dt, L->x.data, ox + j * cs[0]), b = brrr_load_f64(dt, L->x.data, ox + (j + h) * cs[0]);
            const double c_lo = brrr_load_f64(dt, L->cos.data, oc + j * cs[2]), c_hi = brrr_load_f64(dt, L->cos.data, oc + (j + h) * cs[2]);
            const double s_lo = brrr_load_f64(dt, L->sin.data, os + j * cs[3]), s_hi = brrr_load_f64(dt, L->sin.data, os + (j + h) * cs[3]);
            double lo, hi;
            if (dt == BRRR_F64) {
                lo = L->backward ? a * c_lo + b * s_hi : a * c_lo - b * s_lo;
                hi = L->backward ? b * c_hi - a * s_lo : b * c_hi + a * s_hi;
            } else { /* float32 products and sums, as the kernels */
                const float fa = (float)a, fb = (float)b;
                lo = L->backward ? (double)(fa * (float)c_lo + fb * (float)s_hi) : (double)(fa * (float)c_lo - fb * (float)s_lo);
                hi = L->backward ? (double)(fb * (float)c_hi - fa * (float)s_lo) : (double)(fb * (float)c_hi + fa * (float)s_hi);
            }
            brrr_store_f64(dt, L->out.data, oo + j * cs[1], lo);
            brrr_store_f64(dt, L->out.data, oo + (j + h) * cs[1], hi);
        }
    }
}

/* Rows on the call's threads. */
static void cpu_rotary(const brrr_rotary_launch *L) {
    brrr_cpu_parallel_for(L->rows, 2 * L->half, rotary_rows, (void *)L);
}

/* cos or sin: x's device and dtype, broadcastable to x's shape, D as its last dim. */
static int check_angle(const brrr_tensor *t, const brrr_tensor *x) {
    if (brrr_check_same_device(t, x) < 0 || brrr_check_same_dtype(t, x) < 0) return -1;
    int ok = t->ndim >= 1 && t->ndim <= x->ndim && t->shape[t->ndim - 1] == x->shape[x->ndim - 1];
    for (int d = 1; ok && d < t->ndim; d++) {
        const int64_t size = t->shape[t->ndim - 1 - d], want = x->shape[x->ndim - 1 - d];
        ok = size == want || size == 1;
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "argument %s: shape must broadcast to x's shape with the same last dim "
                     "(%lld)", t->name, (long long)x->shape[x->ndim - 1]);
        return -1;
    }
    return 0;
}

PyObject *brrr_py_rotary(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "rotary(x, cos, sin, out, backward, stream) takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    long long stream_arg;
    const int backward = PyObject_IsTrue(args[4]);
    if (backward < 0 || brrr_parse_stream(args[5], &stream_arg) < 0) return NULL;
    brrr_call call = {brrr_get_state(module), stream_arg, 0, NULL, 0};
    brrr_tensor x, c, s, out;
    memset(&x, 0, sizeof x);
    memset(&c, 0, sizeof c);
    memset(&s, 0, sizeof s);
    memset(&out, 0, sizeof out);
    PyObject *result = NULL, *out_obj = args[3];

    if (brrr_tensor_import(&call, args[0], "x", 0, &x) < 0) goto done;
    if (x.ndim == 0 || x.shape[x.ndim - 1] % 2 != 0) {
        PyErr_SetString(PyExc_ValueError, "argument x: expected a tensor of shape (..., D) with D even");
        goto done;
    }
    if (brrr_tensor_import(&call, args[1], "cos", 0, &c) < 0 || check_angle(&c, &x) < 0 ||
        brrr_tensor_import(&call, args[2], "sin", 0, &s) < 0 || check_angle(&s, &x) < 0)
        goto done;
    if (out_obj == Py_None) {
        out_obj = PyArray_Check(args[0]) ? PyArray_NewLikeArray((PyArrayObject *)args[0], NPY_CORDER, NULL, 0)
                                         : brrr_new_like(&call, args[0], &x);
        if (out_obj == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "argument out: required for inputs of type %.200s (brrr._C allocates "
                             "NumPy arrays and tensors of frameworks with DLPack's C exchange table)",
                             Py_TYPE(args[0])->tp_name);
            goto done;
        }
    } else {
        Py_INCREF(out_obj);
    }
    result = out_obj;
    if (brrr_tensor_import(&call, out_obj, "out", 1, &out) < 0 || brrr_check_same_device(&out, &x) < 0 ||
        brrr_check_same_dtype(&out, &x) < 0 || brrr_check_same_shape(&out, &x) < 0 ||
        brrr_check_no_internal_overlap(&out) < 0 || brrr_check_no_overlap(&out, &x, 1) < 0 ||
        brrr_check_no_overlap(&out, &c, 0) < 0 || brrr_check_no_overlap(&out, &s, 0) < 0)
        goto fail;
    if (x.numel == 0) goto done;

    brrr_rotary_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = x.dtype;
    L.backward = backward;
    L.half = x.shape[x.ndim - 1] / 2;
    L.rows = x.numel / (2 * L.half);
    {
        /* Leading dims: x's, with cos and sin broadcast (stride 0) where they lack or have size 1. */
        const int lead = x.ndim - 1;
        const brrr_tensor *views[4] = {&x, &out, &c, &s};
        int64_t shape[BRRR_MAX_RANK], strides[4][BRRR_MAX_RANK];
        memcpy(shape, x.shape, sizeof(int64_t) * (size_t)lead);
        for (int k = 0; k < 4; k++) {
            const brrr_tensor *t = views[k];
            for (int d = 0; d < lead; d++) {
                const int td = d - (x.ndim - t->ndim); /* t's dim aligned with x's dim d, from the right */
                strides[k][d] = td >= 0 && t->shape[td] != 1 ? t->strides[td] : 0;
            }
            L.col_stride[k] = t->strides[t->ndim - 1];
        }
        int n = lead ? brrr_coalesce(lead, shape, 4, strides) : 0;
        if (n < 0) goto fail;
        if (n == 0) {
            shape[0] = 1;
            for (int k = 0; k < 4; k++) strides[k][0] = 0;
            n = 1;
        }
        L.row_ndim = n;
        memcpy(L.row_shape, shape, sizeof(int64_t) * (size_t)n);
        brrr_view *v[4] = {&L.x, &L.out, &L.cos, &L.sin};
        for (int k = 0; k < 4; k++) {
            v[k]->data = views[k]->data;
            memcpy(v[k]->strides, strides[k], sizeof(int64_t) * (size_t)n);
        }
    }
    if (x.device_type == kDLCPU) {
        Py_BEGIN_ALLOW_THREADS
        cpu_rotary(&L);
        Py_END_ALLOW_THREADS
        goto done;
    }
#if BRRR_WITH_CUDA
    {
        void *stream = brrr_call_stream(&call);
        int err;
        Py_BEGIN_ALLOW_THREADS
        err = brrr_cuda_rotary(&L, x.device_id, stream);
        Py_END_ALLOW_THREADS
        if (brrr_cuda_result(err, "rotary") < 0) goto fail;
    }
#endif
    goto done;
fail:
    Py_CLEAR(result);
done:
    brrr_tensor_release(&x);
    brrr_tensor_release(&c);
    brrr_tensor_release(&s);
    brrr_tensor_release(&out);
    return result;
}
