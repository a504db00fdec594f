/* Softmax cross-entropy over the last dim: the glue and the CPU twin.
 *
 * logits (..., C) are rows by classes; target (...) holds a class index per row (int64, int32
 * or uint8). The forward saves one log-sum-exp per row (relative to the target's logit); the
 * backward rematerialises the softmax from logits and lse instead of keeping log-probabilities
 * (formulas: brrr_cuda.h). The CPU twin computes the same function, in float32 for all but
 * float64 logits (as the CUDA kernels), its sums in float64.
 *
 * _C.cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, lse, loss, total,
 *                      count, stream) -> None, or (lse, loss, total, count) when any of them is True:
 *     True allocates that output here, by the logits' framework (DLPack's C exchange table).
 *     lse, loss: the target's shape, contiguous, in the accumulation dtype (float32, float64 for
 *     float64 logits): per row its log-sum-exp less the target's logit where that is finite, and
 *     its loss (0 for both where ignored).
 *     total, count: None or 0-d, accumulation dtype: the loss summed over rows in a fixed order
 *     (divided by count for reduction "mean"), and the rows whose target is not ignore_index.
 * _C.cross_entropy_bwd(logits, target, ignore_index, label_smoothing, lse, grad_loss, count,
 *                      grad_logits, stream) -> grad_logits
 *     grad_loss: accumulation dtype, the target's shape (any strides) or 0-d (every row's);
 *     count: None, or the forward's count to divide by (reduction "mean"). grad_logits must not
 *     share memory with logits (every element of a row depends on the row's target logit, which
 *     other threads of the row read), or is None for NumPy arrays and tensors of frameworks with
 *     DLPack's C exchange table (allocated here, contiguous).
 *
 * A target outside [0, C) that is not ignore_index raises ValueError on the CPU; on CUDA, where
 * checking would mean a device-to-host sync, that row's loss and gradient are NaN.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "brrr.h"
#include "cpu.h"
#include "cpu_math.h"

#include <math.h>
#include <numpy/arrayobject.h>
#include <string.h>

static int32_t acc_dtype(int32_t dtype) { return dtype == BRRR_F64 ? BRRR_F64 : BRRR_F32; }

static int64_t load_index(int32_t dtype, const void *base, int64_t i) {
    switch (dtype) {
    case BRRR_I32: return ((const int32_t *)base)[i];
    case BRRR_U8: return ((const uint8_t *)base)[i];
    default: return ((const int64_t *)base)[i];
    }
}

/* Offset of row r in a row-strided view (over the merged row shape). */
static int64_t row_offset(const brrr_xent_launch *L, const int64_t *strides, int64_t r) {
    return brrr_unravel(L->row_ndim, L->row_shape, strides, r);
}

/* ---- CPU twin ----------------------------------------------------------------------------------
 * Rows are shared out between threads (xent_cpu.inc, float math for every dtype but float64);
 * the total sums the rows' losses in row order afterwards, so it is bitwise the same whatever
 * the thread count. */

#define XENT_LANES 16

#define REAL float
#define REAL_DTYPE BRRR_F32
#define FN(name) name##_f32
#define CPU_LOAD brrr_cpu_load_f32
#define CPU_STORE brrr_cpu_store_f32
#define EXP brrr_expf
#include "xent_cpu.inc"
#undef REAL
#undef REAL_DTYPE
#undef FN
#undef CPU_LOAD
#undef CPU_STORE
#undef EXP
#define REAL double
#define REAL_DTYPE BRRR_F64
#define FN(name) name##_f64
#define CPU_LOAD brrr_cpu_load_f64
#define CPU_STORE brrr_cpu_store_f64
#define EXP exp
#include "xent_cpu.inc"
#undef REAL
#undef REAL_DTYPE
#undef FN
#undef CPU_LOAD
#undef CPU_STORE
#undef EXP

static void cpu_xent_fwd(const brrr_xent_launch *L) {
    const int32_t acc = acc_dtype(L->dtype);
    brrr_cpu_parallel_for(L->rows, L->classes, L->dtype == BRRR_F64 ? xent_fwd_rows_f64 : xent_fwd_rows_f32, (void *)L);
    double sum = 0.0;
    int64_t counted = 0;
    for (int64_t r = 0; r < L->rows; r++) {
        sum += brrr_load_f64(acc, L->loss, r);
        counted += load_index(L->target_dtype, L->target, row_offset(L, L->target_rows, r)) != L->ignore_index;
    }
    if (L->total) brrr_store_f64(acc, L->total, 0, L->mean ? sum / (double)counted : sum);
    if (L->count_out) brrr_store_f64(acc, L->count_out, 0, (double)counted);
}

static void cpu_xent_bwd(const brrr_xent_launch *L) {
    brrr_cpu_parallel_for(L->rows, L->classes, L->dtype == BRRR_F64 ? xent_bwd_rows_f64 : xent_bwd_rows_f32, (void *)L);
}

/* ---- checks and layout ------------------------------------------------------------------------- */

/* A row-indexed tensor of the target's shape: accumulation dtype, same device; `contiguous`
 * for the per-row outputs, which the kernels index by the logical row. */
static int check_row_tensor(const brrr_tensor *t, const brrr_tensor *target, const brrr_tensor *logits,
                            int contiguous) {
    if (brrr_check_same_device(t, logits) < 0) return -1;
    if (t->dtype != acc_dtype(logits->dtype)) {
        PyErr_Format(PyExc_TypeError, "argument %s: expected dtype %s (the accumulation dtype for logits of dtype %s), "
                     "got %s", t->name, brrr_dtype_name(acc_dtype(logits->dtype)), brrr_dtype_name(logits->dtype),
                     brrr_dtype_name(t->dtype));
        return -1;
    }
    if (brrr_check_same_shape(t, target) < 0) return -1;
    if (contiguous && t->numel > 0) {
        int64_t expect = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] != 1 && t->strides[d] != expect) {
                PyErr_Format(PyExc_ValueError, "argument %s: must be contiguous", t->name);
                return -1;
            }
            expect *= t->shape[d];
        }
    }
    return 0;
}

static int check_scalar(const brrr_tensor *t, const brrr_tensor *logits) {
    if (brrr_check_same_device(t, logits) < 0) return -1;
    if (t->dtype != acc_dtype(logits->dtype) || t->ndim != 0) {
        PyErr_Format(t->dtype != acc_dtype(logits->dtype) ? PyExc_TypeError : PyExc_ValueError,
                     "argument %s: expected a 0-d %s tensor, got a %d-d %s one", t->name,
                     brrr_dtype_name(acc_dtype(logits->dtype)), (int)t->ndim, brrr_dtype_name(t->dtype));
        return -1;
    }
    return 0;
}

/* Merge the row dims of the row-strided tensors (in order, so the merged row index is the
 * logical one the contiguous per-row tensors use). views[k] NULL: all strides 0 (a 0-d
 * grad_loss broadcast over the rows). */
static int xent_layout(brrr_xent_launch *L, const brrr_tensor *target, const brrr_tensor *const *views,
                       int64_t *const *out_strides, int count) {
    const int rank = target->ndim;
    int64_t shape[BRRR_MAX_RANK], strides[4][BRRR_MAX_RANK];
    memcpy(shape, target->shape, sizeof(int64_t) * (size_t)rank);
    for (int k = 0; k < count; k++)
        for (int d = 0; d < rank; d++) strides[k][d] = views[k] ? views[k]->strides[d] : 0;
    int n = brrr_merge_in_order(rank, shape, count, strides);
    if (n == 0) { /* one row (or a 0-d target) */
        shape[0] = 1;
        for (int k = 0; k < count; k++) strides[k][0] = 0;
        n = 1;
    }
    if (n > BRRR_XENT_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "arguments logits, target (and grad_logits, grad_loss): views whose rows have "
                     "more than %d non-mergeable dims together are not supported (got %d)", BRRR_XENT_MAX_DIMS, n);
        return -1;
    }
    L->row_ndim = n;
    memcpy(L->row_shape, shape, sizeof(int64_t) * (size_t)n);
    for (int k = 0; k < count; k++) memcpy(out_strides[k], strides[k], sizeof(int64_t) * (size_t)n);
    return 0;
}

/* On the CPU: every target is a class or ignore_index. */
static int check_targets(const brrr_xent_launch *L) {
    for (int64_t r = 0; r < L->rows; r++) {
        const int64_t t = load_index(L->target_dtype, L->target, row_offset(L, L->target_rows, r));
        if (t != L->ignore_index && (t < 0 || t >= L->classes)) {
            PyErr_Format(PyExc_ValueError, "argument target: class index %lld (row %lld) is out of range for %lld "
                         "classes (and is not ignore_index %lld)", (long long)t, (long long)r,
                         (long long)L->classes, (long long)L->ignore_index);
            return -1;
        }
    }
    return 0;
}

/* ---- the shared body --------------------------------------------------------------------------- */

typedef struct {
    int backward, mean;
    PyObject *logits, *target, *lse, *loss, *total, *count, *grad_loss, *grad_logits; /* borrowed */
    long long ignore_index, stream;
    double smoothing;
} xent_request;

static PyObject *xent_call(PyObject *module, const xent_request *q) {
    brrr_call call = {brrr_get_state(module), q->stream, 0, NULL, 0};
    enum { T_LOGITS, T_TARGET, T_LSE, T_LOSS, T_TOTAL, T_COUNT, T_GRAD_LOSS, T_GRAD, T_N };
    brrr_tensor t[T_N];
    memset(t, 0, sizeof t);
    PyObject *result = NULL, *grad_obj = NULL; /* grad_obj: a new reference */
    PyObject *owned[4] = {NULL, NULL, NULL, NULL}; /* the forward's outputs allocated here */
    brrr_tensor *logits = &t[T_LOGITS], *target = &t[T_TARGET];

    if (brrr_tensor_import(&call, q->logits, "logits", 0, logits) < 0) goto done;
    if (logits->ndim == 0 || logits->shape[logits->ndim - 1] == 0) {
        PyErr_SetString(PyExc_ValueError, "argument logits: expected a tensor of shape (..., classes) with at least "
                        "one class");
        goto done;
    }
    if (brrr_index_import(&call, q->target, "target", target) < 0 || brrr_check_same_device(target, logits) < 0)
        goto done;
    {
        brrr_tensor rows;
        memset(&rows, 0, sizeof rows);
        rows.name = "logits.shape[:-1]";
        rows.ndim = logits->ndim - 1;
        memcpy(rows.shape, logits->shape, sizeof(int64_t) * (size_t)rows.ndim);
        if (brrr_check_same_shape(target, &rows) < 0) goto done;
    }
    /* The forward's outputs; True asks for one to be allocated here. */
    PyObject *outs[4] = {q->lse, q->loss, q->total, q->count};
    int allocated = 0;
    if (!q->backward) {
        static const char *const names[4] = {"lse", "loss", "total", "count"};
        for (int k = 0; k < 4; k++) {
            if (outs[k] != Py_True) continue;
            outs[k] = owned[k] = brrr_new_shaped(&call, q->logits, logits, k < 2 ? target->ndim : 0, target->shape,
                                                 acc_dtype(logits->dtype));
            if (outs[k] == NULL) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_TypeError, "argument %s: True (allocate it here) is taken only for tensors of "
                                 "frameworks with DLPack's C exchange table", names[k]);
                goto done;
            }
            allocated = 1;
        }
    }
    if (brrr_tensor_import(&call, outs[0], "lse", !q->backward, &t[T_LSE]) < 0 ||
        check_row_tensor(&t[T_LSE], target, logits, 1) < 0)
        goto done;
    if (!q->backward) {
        if (brrr_tensor_import(&call, outs[1], "loss", 1, &t[T_LOSS]) < 0 ||
            check_row_tensor(&t[T_LOSS], target, logits, 1) < 0)
            goto done;
        const char *names[2] = {"total", "count"};
        for (int k = 0; k < 2; k++)
            if (outs[2 + k] != Py_None && (brrr_tensor_import(&call, outs[2 + k], names[k], 1, &t[T_TOTAL + k]) < 0 ||
                                           check_scalar(&t[T_TOTAL + k], logits) < 0))
                goto done;
        /* Outputs must not share memory with each other or with the inputs. */
        for (int a = T_LSE; a <= T_COUNT; a++)
            for (int b = 0; b < a; b++)
                if (t[a].name && t[b].name && brrr_check_no_overlap(&t[a], &t[b], 0) < 0) goto done;
    } else {
        if (brrr_tensor_import(&call, q->grad_loss, "grad_loss", 0, &t[T_GRAD_LOSS]) < 0) goto done;
        if (t[T_GRAD_LOSS].ndim != 0 && check_row_tensor(&t[T_GRAD_LOSS], target, logits, 0) < 0) goto done;
        if (t[T_GRAD_LOSS].ndim == 0 && check_scalar(&t[T_GRAD_LOSS], logits) < 0) goto done;
        if (q->count != Py_None && (brrr_tensor_import(&call, q->count, "count", 0, &t[T_COUNT]) < 0 ||
                                    check_scalar(&t[T_COUNT], logits) < 0))
            goto done;
        grad_obj = q->grad_logits;
        if (grad_obj == Py_None) {
            grad_obj = PyArray_Check(q->logits) ? PyArray_NewLikeArray((PyArrayObject *)q->logits, NPY_CORDER, NULL, 0)
                                                : brrr_new_like(&call, q->logits, logits);
            if (grad_obj == NULL) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_TypeError, "argument grad_logits: required for logits of type %.200s (brrr._C "
                                 "allocates NumPy arrays and tensors of frameworks with DLPack's C exchange table)",
                                 Py_TYPE(q->logits)->tp_name);
                goto done;
            }
        } else {
            Py_INCREF(grad_obj);
        }
        if (brrr_tensor_import(&call, grad_obj, "grad_logits", 1, &t[T_GRAD]) < 0 ||
            brrr_check_same_device(&t[T_GRAD], logits) < 0 || brrr_check_same_dtype(&t[T_GRAD], logits) < 0 ||
            brrr_check_same_shape(&t[T_GRAD], logits) < 0 || brrr_check_no_internal_overlap(&t[T_GRAD]) < 0 ||
            brrr_check_no_overlap(&t[T_GRAD], logits, 0) < 0)
            goto done;
        for (int a = T_TARGET; a < T_GRAD; a++)
            if (t[a].name && brrr_check_no_overlap(&t[T_GRAD], &t[a], 0) < 0) goto done;
    }

    brrr_xent_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = logits->dtype;
    L.target_dtype = target->dtype;
    L.mean = q->mean;
    L.classes = logits->shape[logits->ndim - 1];
    L.rows = target->numel;
    L.ignore_index = q->ignore_index;
    L.smoothing = q->smoothing;
    L.logits = logits->data;
    L.target = target->data;
    L.logits_class_stride = logits->strides[logits->ndim - 1];
    L.lse = t[T_LSE].data;
    L.loss = t[T_LOSS].data;
    L.total = t[T_TOTAL].data;
    L.count_out = q->backward ? NULL : t[T_COUNT].data;
    L.count = q->backward ? t[T_COUNT].data : NULL;
    L.grad_loss = t[T_GRAD_LOSS].data;
    L.grad_logits = t[T_GRAD].data;
    L.grad_class_stride = q->backward ? t[T_GRAD].strides[logits->ndim - 1] : 0;
    {
        const brrr_tensor *views[4] = {logits, target, q->backward ? &t[T_GRAD] : NULL,
                                       q->backward && t[T_GRAD_LOSS].ndim ? &t[T_GRAD_LOSS] : NULL};
        int64_t *strides[4] = {L.logits_rows, L.target_rows, L.grad_rows, L.grad_loss_rows};
        if (xent_layout(&L, target, views, strides, 4) < 0) goto done;
    }
    if (q->backward || !allocated) {
        result = Py_NewRef(q->backward ? grad_obj : Py_None);
    } else if ((result = PyTuple_New(4)) != NULL) {
        for (int k = 0; k < 4; k++) PyTuple_SET_ITEM(result, k, Py_NewRef(outs[k]));
    } else {
        goto done;
    }

    if (logits->device_type == kDLCPU) {
        if (check_targets(&L) < 0) goto fail;
        Py_BEGIN_ALLOW_THREADS
        if (q->backward) cpu_xent_bwd(&L);
        else cpu_xent_fwd(&L);
        Py_END_ALLOW_THREADS
        goto done;
    }
#if BRRR_WITH_CUDA
    {
        void *stream = brrr_call_stream(&call);
        int err;
        Py_BEGIN_ALLOW_THREADS
        err = q->backward ? brrr_cuda_xent_bwd(&L, logits->device_id, stream)
                          : brrr_cuda_xent_fwd(&L, logits->device_id, stream);
        Py_END_ALLOW_THREADS
        if (brrr_cuda_result(err, q->backward ? "cross_entropy_bwd" : "cross_entropy_fwd") < 0) goto fail;
    }
#endif
    goto done;
fail:
    Py_CLEAR(result);
done:
    for (int k = 0; k < T_N; k++) brrr_tensor_release(&t[k]);
    for (int k = 0; k < 4; k++) Py_XDECREF(owned[k]);
    Py_XDECREF(grad_obj);
    return result;
}

/* ---- argument parsing -------------------------------------------------------------------------- */

static int parse_common(PyObject *ignore_index, PyObject *smoothing, PyObject *stream, xent_request *q) {
    if (!PyLong_Check(ignore_index) || PyBool_Check(ignore_index)) {
        PyErr_Format(PyExc_TypeError, "argument ignore_index: expected an int, got %.200s",
                     Py_TYPE(ignore_index)->tp_name);
        return -1;
    }
    q->ignore_index = PyLong_AsLongLong(ignore_index);
    if (q->ignore_index == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "argument ignore_index: expected an int64, got %R", ignore_index);
        return -1;
    }
    q->smoothing = PyFloat_AsDouble(smoothing);
    if (q->smoothing == -1.0 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "argument label_smoothing: expected a float");
        return -1;
    }
    if (!(q->smoothing >= 0.0 && q->smoothing <= 1.0)) { /* NaN too */
        PyErr_Format(PyExc_ValueError, "argument label_smoothing: expected a float in [0, 1], got %R", smoothing);
        return -1;
    }
    return brrr_parse_stream(stream, &q->stream);
}

PyObject *brrr_py_xent_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, "
                     "lse, loss, total, count, stream) takes 10 arguments (%zd given)", nargs);
        return NULL;
    }
    xent_request q = {0, 0, args[0], args[1], args[5], args[6], args[7], args[8], Py_None, Py_None, 0, 0, 0.0};
    if (parse_common(args[2], args[3], args[9], &q) < 0) return NULL;
    PyObject *reduction = args[4];
    if (!PyUnicode_Check(reduction) || (PyUnicode_CompareWithASCIIString(reduction, "mean") != 0 &&
                                        PyUnicode_CompareWithASCIIString(reduction, "sum") != 0 &&
                                        PyUnicode_CompareWithASCIIString(reduction, "none") != 0)) {
        PyErr_Format(PyExc_ValueError, "argument reduction: expected 'mean', 'sum' or 'none', got %R", reduction);
        return NULL;
    }
    q.mean = PyUnicode_CompareWithASCIIString(reduction, "mean") == 0;
    return xent_call(module, &q);
}

PyObject *brrr_py_xent_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "cross_entropy_bwd(logits, target, ignore_index, label_smoothing, lse, "
                     "grad_loss, count, grad_logits, stream) takes 9 arguments (%zd given)", nargs);
        return NULL;
    }
    xent_request q = {1, 0, args[0], args[1], args[4], Py_None, Py_None, args[6], args[5], args[7], 0, 0, 0.0};
    if (parse_common(args[2], args[3], args[8], &q) < 0) return NULL;
    return xent_call(module, &q);
}
