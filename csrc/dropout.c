/* Fused bias + dropout + residual add: the glue and the CPU twin.
 *
 *     out = residual + keep * (x + bias) / (1 - p)
 *
 * The mask is never stored. Element i, its logical row-major index in x's shape (not its memory
 * offset, so a strided view gets the mask of its contiguous copy), is kept iff word i % 4 of
 * Philox4x32-10 with counter (i / 4, offset) and key seed is >= floor(p * 2^32) (cuda/philox.h,
 * shared with the CUDA kernels: both keep the same elements). The backward regenerates the mask
 * from (p, seed, offset). A dropped element contributes (x + bias) * 0, as torch's x * mask *
 * scale does: NaN where x + bias is inf or NaN (also for p = 1, as torch's dropout), else +-0;
 * the backward likewise gives grad_out * 0. Math in float32 (float64 for float64), each step
 * rounded on its own (no FMA: the CUDA kernels round the same way).
 *
 * _C.dropout_fwd(x, bias, residual, out, p, seed, offset, stream) -> out
 * _C.dropout_bwd(grad_out, grad_x, grad_bias, partials, p, seed, offset, stream) -> grad_x
 *     grad_x = keep * grad_out / (1 - p); grad_bias (optional): grad_x summed over all but the
 *     last dim, in a fixed order (bitwise reproducible)
 *
 * bias, grad_bias: None or shape x.shape[-1:]; residual: None or x's shape; out and grad_x may be
 * None for NumPy arrays and frameworks with DLPack's C exchange table (allocated here,
 * contiguous). seed and offset: ints in [0, 2^64). partials (CUDA, with grad_bias): a contiguous
 * 1-D float32 tensor (float64 for float64) of at least chain_partial_rows(rows) * cols elements.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "brrr.h"
#include "cpu.h"

#include <numpy/arrayobject.h>
#include <stdlib.h>
#include <string.h>

#include "philox.h"

/* ---- CPU twin: logical order, an odometer over the merged dims --------------------------------
 * Threads take ranges of logical elements; with a bias gradient a range is a fixed chunk of rows
 * (brrr_cpu_chunk_rows) with a partial row sum of its own, added in chunk order at the end: the
 * same sums whatever the thread count. */

typedef struct {
    const brrr_dropout_launch *L;
    int64_t chunk;    /* elements per item */
    double *partials; /* grad_bias: [item][cols], else NULL */
} dropout_work;

static void dropout_items(void *ctx, int64_t begin, int64_t end) {
    const dropout_work *w = ctx;
    const brrr_dropout_launch *L = w->L;
    const int draws = brrr_dropout_draws(L->threshold), f64 = L->dtype == BRRR_F64;
    const int32_t dt = L->dtype;
    const void *x = L->x.data, *res = L->residual.data, *bias = L->bias;
    void *out = L->out.data;
    for (int64_t item = begin; item < end; item++) {
        const int64_t i0 = item * w->chunk, i1 = i0 + w->chunk < L->numel ? i0 + w->chunk : L->numel;
        double *acc = w->partials ? w->partials + item * L->cols : NULL;
        int64_t idx[BRRR_MAX_DIMS], rest = i0;
        for (int d = L->ndim - 1; d >= 0; d--) {
            idx[d] = rest % L->shape[d];
            rest /= L->shape[d];
        }
        int64_t ox = brrr_unravel(L->ndim, L->shape, L->x.strides, i0);
        int64_t ores = res ? brrr_unravel(L->ndim, L->shape, L->residual.strides, i0) : 0;
        int64_t oout = brrr_unravel(L->ndim, L->shape, L->out.strides, i0), c = i0 % L->cols;
        brrr_philox4 words = {{0, 0, 0, 0}};
        if (draws) words = brrr_dropout_randoms(L->seed, L->offset, (uint64_t)i0 >> 2);
        for (int64_t i = i0; i < i1; i++) {
            if (draws && (i & 3) == 0) words = brrr_dropout_randoms(L->seed, L->offset, (uint64_t)i >> 2);
            const int keep = (uint64_t)words.v[i & 3] >= L->threshold;
            if (f64) {
                double v = ((const double *)x)[ox];
                if (bias) v += ((const double *)bias)[c * L->bias_stride];
                const double d = v * (keep ? L->scale : 0.0);
                ((double *)out)[oout] = res ? ((const double *)res)[ores] + d : d;
                if (acc) acc[c] += d;
            } else {
                float v = brrr_load_f32(dt, x, ox);
                if (bias) v += brrr_load_f32(dt, bias, c * L->bias_stride);
                const float d = v * (keep ? (float)L->scale : 0.0f);
                brrr_store_f32(dt, out, oout, res ? brrr_load_f32(dt, res, ores) + d : d);
                if (acc) acc[c] += d;
            }
            if (++c == L->cols) c = 0;
            for (int d = L->ndim - 1; d >= 0; d--) {
                ox += L->x.strides[d];
                ores += L->residual.strides[d];
                oout += L->out.strides[d];
                if (++idx[d] < L->shape[d]) break;
                ox -= L->x.strides[d] * L->shape[d];
                ores -= L->residual.strides[d] * L->shape[d];
                oout -= L->out.strides[d] * L->shape[d];
                idx[d] = 0;
            }
        }
    }
}

/* acc: NULL, or cols zeroed accumulators for the bias gradient. */
static void cpu_dropout(const brrr_dropout_launch *L, double *acc) {
    const int64_t rows = L->cols ? L->numel / L->cols : 0;
    dropout_work w = {L, 16384, NULL};
    if (acc) {
        w.chunk = brrr_cpu_chunk_rows(rows) * L->cols;
        const int64_t items = w.chunk ? (L->numel + w.chunk - 1) / w.chunk : 0;
        w.partials = calloc((size_t)(items * L->cols), sizeof(double));
        if (w.partials == NULL) { /* no room: one chunk, summed in order straight into acc */
            w.chunk = L->numel;
            w.partials = acc;
        }
    }
    const int64_t items = w.chunk ? (L->numel + w.chunk - 1) / w.chunk : 0;
    brrr_cpu_parallel_for(items, w.chunk, dropout_items, &w);
    if (w.partials && w.partials != acc) {
        for (int64_t k = 0; k < items; k++)
            for (int64_t c = 0; c < L->cols; c++) acc[c] += w.partials[k * L->cols + c];
        free(w.partials);
    }
}

/* ---- layout ------------------------------------------------------------------------------------ */

/* Fill L's shape and the strides of x, residual and out. With row_layout the last dim stays a
 * dim of its own (the rows kernel of the bias gradient needs it); else everything merges. */
static int dropout_layout(brrr_dropout_launch *L, const brrr_tensor *x, const brrr_tensor *res, const brrr_tensor *out) {
    const brrr_tensor *t[3] = {x, out, res};
    const int count = res->name ? 3 : 2, rank = x->ndim;
    int64_t shape[BRRR_MAX_RANK], strides[3][BRRR_MAX_RANK];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)rank);
    for (int k = 0; k < count; k++) memcpy(strides[k], t[k]->strides, sizeof(int64_t) * (size_t)rank);
    int n;
    if (L->row_layout) {
        n = brrr_merge_in_order(rank - 1, shape, count, strides);
        shape[n] = x->shape[rank - 1];
        for (int k = 0; k < count; k++) strides[k][n] = t[k]->strides[rank - 1];
        n++;
    } else {
        n = brrr_merge_in_order(rank, shape, count, strides);
        if (n == 0) { /* one element */
            shape[0] = 1;
            for (int k = 0; k < count; k++) strides[k][0] = 1;
            n = 1;
        }
    }
    if (n > BRRR_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "argument %s: views with more than %d non-mergeable dims are not supported "
                     "(got %d)", x->name, BRRR_MAX_DIMS, n);
        return -1;
    }
    L->ndim = n;
    memcpy(L->shape, shape, sizeof(int64_t) * (size_t)n);
    brrr_view *v[3] = {&L->x, &L->out, &L->residual};
    L->contiguous = n == 1;
    for (int k = 0; k < count; k++) {
        memcpy(v[k]->strides, strides[k], sizeof(int64_t) * (size_t)n);
        L->contiguous &= strides[k][0] == 1;
    }
    return 0;
}

/* ---- the shared body --------------------------------------------------------------------------- */

typedef struct {
    int backward;
    PyObject *x, *bias, *residual, *out, *grad_bias, *partials; /* borrowed; Py_None: absent */
    double p;
    unsigned long long seed, offset;
    long long stream;
} dropout_request;

/* bias or grad_bias: x's device and dtype, shape x.shape[-1:]. */
static int import_column_vector(brrr_call *call, PyObject *obj, const char *name, int writable, const brrr_tensor *x,
                                brrr_tensor *t) {
    if (brrr_tensor_import(call, obj, name, writable, t) < 0 || brrr_check_same_device(t, x) < 0 ||
        brrr_check_same_dtype(t, x) < 0)
        return -1;
    if (x->ndim == 0) {
        PyErr_Format(PyExc_ValueError, "argument %s: %s is 0-d, so it has no last dim to broadcast along", name, x->name);
        return -1;
    }
    brrr_tensor last;
    memset(&last, 0, sizeof last);
    last.name = strcmp(x->name, "x") == 0 ? "x.shape[-1:]" : "grad_out.shape[-1:]";
    last.ndim = 1;
    last.shape[0] = x->shape[x->ndim - 1];
    if (brrr_check_same_shape(t, &last) < 0) return -1;
    return writable ? brrr_check_no_internal_overlap(t) : 0;
}

static PyObject *dropout_call(PyObject *module, const dropout_request *q) {
    brrr_call call = {brrr_get_state(module), q->stream, 0, NULL, 0};
    brrr_tensor x, bias, res, out, grad_bias, partials;
    memset(&x, 0, sizeof x);
    memset(&bias, 0, sizeof bias);
    memset(&res, 0, sizeof res);
    memset(&out, 0, sizeof out);
    memset(&grad_bias, 0, sizeof grad_bias);
    memset(&partials, 0, sizeof partials);
    PyObject *result = NULL, *out_obj = q->out;
    double *acc = NULL;
    const char *out_name = q->backward ? "grad_x" : "out";

    if (brrr_tensor_import(&call, q->x, q->backward ? "grad_out" : "x", 0, &x) < 0) goto done;
    if (q->bias != Py_None && import_column_vector(&call, q->bias, "bias", 0, &x, &bias) < 0) goto done;
    if (q->residual != Py_None &&
        (brrr_tensor_import(&call, q->residual, "residual", 0, &res) < 0 || brrr_check_same_device(&res, &x) < 0 ||
         brrr_check_same_dtype(&res, &x) < 0 || brrr_check_same_shape(&res, &x) < 0))
        goto done;
    if (out_obj == Py_None) {
        out_obj = PyArray_Check(q->x) ? PyArray_NewLikeArray((PyArrayObject *)q->x, NPY_KEEPORDER, NULL, 0)
                                      : brrr_new_like(&call, q->x, &x);
        if (out_obj == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "argument %s: required for inputs of type %.200s (brrr._C allocates "
                             "NumPy arrays and tensors of frameworks with DLPack's C exchange table)", out_name,
                             Py_TYPE(q->x)->tp_name);
            goto done;
        }
    } else {
        Py_INCREF(out_obj);
    }
    result = out_obj;
    /* Each output element is written from the same element of x and residual only: an
     * identical view of either may be written in place. */
    if (brrr_tensor_import(&call, out_obj, out_name, 1, &out) < 0 || brrr_check_same_device(&out, &x) < 0 ||
        brrr_check_same_dtype(&out, &x) < 0 || brrr_check_same_shape(&out, &x) < 0 ||
        brrr_check_no_internal_overlap(&out) < 0 || brrr_check_no_overlap(&out, &x, 1) < 0 ||
        brrr_check_no_overlap(&out, &res, 1) < 0 || brrr_check_no_overlap(&out, &bias, 0) < 0)
        goto fail;
    if (q->grad_bias != Py_None &&
        (import_column_vector(&call, q->grad_bias, "grad_bias", 1, &x, &grad_bias) < 0 ||
         brrr_check_no_overlap(&grad_bias, &x, 0) < 0 || brrr_check_no_overlap(&grad_bias, &out, 0) < 0))
        goto fail;

    brrr_dropout_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = x.dtype;
    L.numel = x.numel;
    L.cols = x.ndim ? x.shape[x.ndim - 1] : 1;
    L.seed = q->seed;
    L.offset = q->offset;
    L.threshold = q->p >= 1.0 ? (uint64_t)1 << 32 : (uint64_t)(q->p * 4294967296.0); /* exact, then floor */
    L.scale = q->p >= 1.0 ? 0.0 : 1.0 / (1.0 - q->p);
    L.x.data = x.data;
    L.out.data = out.data;
    L.residual.data = res.data;
    L.bias = bias.data;
    L.bias_stride = bias.name ? bias.strides[0] : 0;
    L.grad_bias = grad_bias.data;
    L.grad_bias_stride = grad_bias.name ? grad_bias.strides[0] : 0;
    L.row_layout = grad_bias.name != NULL;
    const int64_t rows = L.cols ? L.numel / L.cols : 0;
    if (L.numel > 0 && dropout_layout(&L, &x, &res, &out) < 0) goto fail;
    if (L.numel == 0 && (!grad_bias.name || L.cols == 0)) goto done; /* nothing to write */

    if (x.device_type == kDLCPU) {
        if (grad_bias.name && (acc = PyMem_RawCalloc((size_t)L.cols, sizeof(double))) == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        Py_BEGIN_ALLOW_THREADS
        cpu_dropout(&L, acc);
        for (int64_t c = 0; acc && c < L.cols; c++) {
            if (L.dtype == BRRR_F64) ((double *)L.grad_bias)[c * L.grad_bias_stride] = acc[c];
            else brrr_store_f32(L.dtype, L.grad_bias, c * L.grad_bias_stride, (float)acc[c]);
        }
        Py_END_ALLOW_THREADS
        goto done;
    }
#if BRRR_WITH_CUDA
    if (grad_bias.name) {
        L.partial_rows = rows ? brrr_bias_partial_rows(rows) : 0;
        const int64_t want = L.partial_rows * L.cols;
        const int32_t acc_dtype = L.dtype == BRRR_F64 ? BRRR_F64 : BRRR_F32;
        if (q->partials == Py_None) {
            PyErr_Format(PyExc_TypeError, "argument partials: required on CUDA with grad_bias (a contiguous 1-D %s "
                         "tensor of at least %lld elements)", brrr_dtype_name(acc_dtype), (long long)want);
            goto fail;
        }
        if (brrr_tensor_import(&call, q->partials, "partials", 1, &partials) < 0 ||
            brrr_check_same_device(&partials, &x) < 0)
            goto fail;
        if (partials.dtype != acc_dtype || partials.ndim != 1 || partials.numel < want ||
            (partials.numel > 1 && partials.strides[0] != 1)) {
            PyErr_Format(PyExc_ValueError, "argument partials: expected a contiguous 1-D %s tensor of at least %lld "
                         "elements (chain_partial_rows(rows) * cols)", brrr_dtype_name(acc_dtype), (long long)want);
            goto fail;
        }
        if (brrr_check_no_overlap(&partials, &x, 0) < 0 || brrr_check_no_overlap(&partials, &out, 0) < 0 ||
            brrr_check_no_overlap(&partials, &grad_bias, 0) < 0)
            goto fail;
        L.partials = partials.data;
    }
    {
        void *stream = brrr_call_stream(&call);
        int err;
        Py_BEGIN_ALLOW_THREADS
        err = brrr_cuda_dropout(&L, x.device_id, stream);
        Py_END_ALLOW_THREADS
        if (brrr_cuda_result(err, q->backward ? "dropout_bwd" : "dropout_fwd") < 0) goto fail;
    }
#else
    (void)rows;
#endif
    goto done;
fail:
    Py_CLEAR(result);
done:
    PyMem_RawFree(acc);
    brrr_tensor_release(&x);
    brrr_tensor_release(&bias);
    brrr_tensor_release(&res);
    brrr_tensor_release(&out);
    brrr_tensor_release(&grad_bias);
    brrr_tensor_release(&partials);
    return result;
}

/* ---- argument parsing -------------------------------------------------------------------------- */

static int parse_scalars(PyObject *p, PyObject *seed, PyObject *offset, PyObject *stream, dropout_request *q) {
    q->p = PyFloat_AsDouble(p);
    if (q->p == -1.0 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "argument p: expected a float");
        return -1;
    }
    if (!(q->p >= 0.0 && q->p <= 1.0)) { /* NaN too */
        PyErr_Format(PyExc_ValueError, "argument p: dropout probability has to be between 0 and 1, got %R", p);
        return -1;
    }
    PyObject *ints[2] = {seed, offset};
    const char *names[2] = {"seed", "offset"};
    unsigned long long *values[2] = {&q->seed, &q->offset};
    for (int k = 0; k < 2; k++) {
        if (!PyLong_Check(ints[k])) {
            PyErr_Format(PyExc_TypeError, "argument %s: expected an int, got %.200s", names[k], Py_TYPE(ints[k])->tp_name);
            return -1;
        }
        *values[k] = PyLong_AsUnsignedLongLong(ints[k]);
        if (*values[k] == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "argument %s: expected an int in [0, 2**64), got %R", names[k], ints[k]);
            return -1;
        }
    }
    return brrr_parse_stream(stream, &q->stream);
}

PyObject *brrr_py_dropout_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "dropout_fwd(x, bias, residual, out, p, seed, offset, stream) takes 8 arguments "
                     "(%zd given)", nargs);
        return NULL;
    }
    dropout_request q = {0, args[0], args[1], args[2], args[3], Py_None, Py_None, 0.0, 0, 0, 0};
    if (parse_scalars(args[4], args[5], args[6], args[7], &q) < 0) return NULL;
    return dropout_call(module, &q);
}

PyObject *brrr_py_dropout_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "dropout_bwd(grad_out, grad_x, grad_bias, partials, p, seed, offset, stream) "
                     "takes 8 arguments (%zd given)", nargs);
        return NULL;
    }
    dropout_request q = {1, args[0], Py_None, Py_None, args[1], args[2], args[3], 0.0, 0, 0, 0};
    if (parse_scalars(args[4], args[5], args[6], args[7], &q) < 0) return NULL;
    return dropout_call(module, &q);
}
