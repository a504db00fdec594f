/* LayerNorm and RMSNorm: the glue and the CPU twin.
 *
 * Rows are x's leading dims, columns its last norm_ndim dims (normalized_shape). Every tensor is
 * seen as rows by columns: row dims and column dims are coalesced separately, mean and rstd being
 * row-indexed and weight, bias and their gradients column-indexed, so any strided view is used in
 * place (the CUDA fast path needs only the columns to be contiguous). The formulas, and the
 * convention that `mean` is saved relative to the row's first element, are in
 * cuda/norm_kernels.cuh and brrr_cuda.h; the CPU twin computes the same function (float math,
 * float64 sums and float64 throughout for float64 inputs).
 *
 * _C.layer_norm_fwd(x, norm_ndim, weight, bias, eps, out, mean, rstd, residual, residual_out, stream)
 * _C.rms_norm_fwd(x, norm_ndim, weight, eps, llama, out, rstd, residual, residual_out, stream)
 *     -> out, or (out, residual_out) when a residual is given
 * _C.layer_norm_bwd(x, norm_ndim, grad_out, grad_residual, weight, mean, rstd, grad_x, grad_weight,
 *                   grad_bias, partials, stream) -> grad_x
 * _C.rms_norm_bwd(x, norm_ndim, grad_out, grad_residual, weight, rstd, llama, grad_x, grad_weight,
 *                 partials, stream) -> grad_x
 * _C.norm_partial_rows(rows, cols) -> P
 *
 * Optional tensors are None: weight, bias, residual; mean and rstd in the forward (not saved);
 * grad_residual, grad_weight, grad_bias in the backward. True for mean and rstd (forward) or
 * grad_weight and grad_bias (backward, with weight given) allocates them here, by x's framework
 * (DLPack's C exchange table), and the call returns them after its usual result, in that order:
 * (out, [residual_out,] mean, rstd) or (grad_x, grad_weight, grad_bias), less what was not asked. For the fused residual forms the
 * backward's x is the forward's residual_out. partials (CUDA only, when a weight or bias gradient
 * is asked for): a 1-D float32 tensor (float64 for float64 x) of at least
 * n_grads * norm_partial_rows(rows, cols) * cols elements. out, residual_out and grad_x may be
 * None for NumPy arrays and for tensors of frameworks with DLPack's C exchange table (PyTorch
 * 2.10+): they are then allocated here, contiguous, by x's framework. So may partials, for such
 * tensors on the framework's current stream (stream -1): scratch, given back when the call
 * returns, which the framework's stream-ordered allocator reuses only for work queued after it.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "brrr.h"
#include "cpu.h"

#include <math.h>
#include <numpy/arrayobject.h>
#include <stdlib.h>
#include <string.h>

/* Every tensor argument of the family, inputs first. */
enum {
    S_X, S_RESIDUAL, S_WEIGHT, S_BIAS, S_GRAD_OUT, S_GRAD_RESIDUAL, S_MEAN, S_RSTD, /* inputs (stats: bwd) */
    S_OUT, S_RESIDUAL_OUT, S_GRAD_X, S_GRAD_WEIGHT, S_GRAD_BIAS, S_PARTIALS,         /* outputs */
    S_COUNT
};
#define S_FIRST_OUTPUT S_OUT

/* How a slot is indexed: rows by columns, rows only, columns only, or flat scratch. */
enum { K_DATA, K_ROW, K_COL, K_FLAT };
static const int SLOT_KIND[S_COUNT] = {K_DATA, K_DATA, K_COL, K_COL, K_DATA, K_DATA, K_ROW, K_ROW,
                                       K_DATA, K_DATA, K_DATA, K_COL, K_COL, K_FLAT};
static const char *const SLOT_NAME[S_COUNT] = {"x", "residual", "weight", "bias", "grad_out", "grad_residual",
                                               "mean", "rstd", "out", "residual_out", "grad_x", "grad_weight",
                                               "grad_bias", "partials"};

typedef struct {
    int backward, rms, llama;
    long long norm_ndim, stream;
    double eps;
    PyObject *obj[S_COUNT]; /* borrowed; NULL or Py_None: absent */
} norm_request;

static brrr_norm_view *slot_view(brrr_norm_launch *L, int s) {
    switch (s) {
    case S_X: return &L->x;
    case S_RESIDUAL: return &L->residual;
    case S_WEIGHT: return &L->weight;
    case S_BIAS: return &L->bias;
    case S_GRAD_OUT: return &L->grad_out;
    case S_GRAD_RESIDUAL: return &L->grad_residual;
    case S_MEAN: return &L->mean;
    case S_RSTD: return &L->rstd;
    case S_OUT: return &L->out;
    case S_RESIDUAL_OUT: return &L->residual_out;
    case S_GRAD_X: return &L->grad_x;
    case S_GRAD_WEIGHT: return &L->grad_weight;
    case S_GRAD_BIAS: return &L->grad_bias;
    default: return NULL;
    }
}

static int acc_dtype(int32_t dtype) { return dtype == BRRR_F64 ? BRRR_F64 : BRRR_F32; }
static int is_half(int32_t dtype) { return dtype == BRRR_F16 || dtype == BRRR_BF16; }

/* ---- CPU twin --------------------------------------------------------------------------------
 * Rows are shared out between threads. A row is walked in blocks of BRRR_CPU_BLOCK columns, the
 * elementwise math in float (double for float64), its sums in double, kept in NORM_LANES fixed
 * lanes so that the compiler vectorises them: one pass for the mean and the mean square, one for
 * the output (and a second for the variance where the first would cancel); the row stays in the
 * cache between passes. The backward's weight and bias
 * gradients sum each chunk of rows (brrr_cpu_chunk_rows) into a partial row of their own, added
 * in chunk order at the end: the same sums whatever the thread count. */

#define NORM_LANES 8

/* v rounded to dtype (as a store and a load would). */
static double round_d(int32_t dtype, double v) {
    if (dtype == BRRR_F64) return v;
    uint32_t bits = 0;
    brrr_store_f32(dtype, &bits, 0, (float)v);
    return (double)brrr_load_f32(dtype, &bits, 0);
}

/* Offset of row (rows != 0) or column i of a view, from the coalesced shape and its strides. */
static int64_t dims_off(const brrr_norm_launch *L, const brrr_norm_view *v, int64_t i, int rows) {
    const int ndim = rows ? L->row_ndim : L->col_ndim;
    const int64_t *shape = rows ? L->row_shape : L->col_shape, *strides = rows ? v->row_strides : v->col_strides;
    return ndim == 1 ? i * strides[0] : brrr_unravel(ndim, shape, strides, i);
}
static int64_t row_off(const brrr_norm_launch *L, const brrr_norm_view *v, int64_t r) { return dims_off(L, v, r, 1); }
static int64_t col_off(const brrr_norm_launch *L, const brrr_norm_view *v, int64_t c) { return dims_off(L, v, c, 0); }

static double norm_sum_lanes(const double *lanes) {
    double s = 0.0;
    for (int l = 0; l < NORM_LANES; l++) s += lanes[l];
    return s;
}

typedef struct {
    const brrr_norm_launch *L;
    int64_t chunk_rows;
    double *partial_w, *partial_b; /* [chunk][cols], or NULL */
} norm_bwd_work;

#define REAL float
#define REAL_DTYPE BRRR_F32
#define FN(name) name##_f32
#define CPU_LOAD brrr_cpu_load_f32
#define CPU_STORE brrr_cpu_store_f32
#include "norm_cpu.inc"
#undef REAL
#undef REAL_DTYPE
#undef FN
#undef CPU_LOAD
#undef CPU_STORE
#define REAL double
#define REAL_DTYPE BRRR_F64
#define FN(name) name##_f64
#define CPU_LOAD brrr_cpu_load_f64
#define CPU_STORE brrr_cpu_store_f64
#include "norm_cpu.inc"
#undef REAL
#undef REAL_DTYPE
#undef FN
#undef CPU_LOAD
#undef CPU_STORE

static void cpu_norm_fwd(const brrr_norm_launch *L) {
    brrr_cpu_parallel_for(L->rows, L->cols,
                          L->dtype == BRRR_F64 ? norm_fwd_rows_f64 : norm_fwd_rows_f32, (void *)L);
}

/* acc_w / acc_b: cols zeroed accumulators each, for the gradients asked for (else NULL). */
static void cpu_norm_bwd(const brrr_norm_launch *L, double *acc_w, double *acc_b) {
    const int64_t n = L->cols, chunk_rows = brrr_cpu_chunk_rows(L->rows), chunks = (L->rows + chunk_rows - 1) / chunk_rows;
    norm_bwd_work work = {L, chunk_rows, NULL, NULL};
    double *partials = NULL;
    if (acc_w || acc_b) {
        partials = calloc((size_t)(2 * chunks * n), sizeof(double));
        if (partials == NULL) { /* no room: one chunk, summed in row order straight into acc */
            work.chunk_rows = L->rows > 0 ? L->rows : 1;
            work.partial_w = acc_w;
            work.partial_b = acc_b;
        } else {
            work.partial_w = acc_w ? partials : NULL;
            work.partial_b = acc_b ? partials + chunks * n : NULL;
        }
    }
    const int64_t items = (L->rows + work.chunk_rows - 1) / work.chunk_rows, per_item = work.chunk_rows * n;
    brrr_cpu_parallel_for(items, per_item,
                          L->dtype == BRRR_F64 ? norm_bwd_chunks_f64 : norm_bwd_chunks_f32, &work);
    for (int64_t k = 0; partials && k < chunks; k++) {
        for (int64_t j = 0; acc_w && j < n; j++) acc_w[j] += work.partial_w[k * n + j];
        for (int64_t j = 0; acc_b && j < n; j++) acc_b[j] += work.partial_b[k * n + j];
    }
    free(partials);
    for (int64_t j = 0; j < n; j++) {
        if (acc_w) brrr_store_f64(L->weight_dtype, L->grad_weight.data, col_off(L, &L->grad_weight, j), acc_w[j]);
        if (acc_b) brrr_store_f64(L->weight_dtype, L->grad_bias.data, col_off(L, &L->grad_bias, j), acc_b[j]);
    }
}

/* ---- checks and layout ----------------------------------------------------------------------- */

/* weight, bias and their gradients: x's dtype, or float32 for float16/bfloat16 x. */
static int check_param_dtype(const brrr_tensor *t, const brrr_tensor *x) {
    if (t->dtype == x->dtype || (t->dtype == BRRR_F32 && is_half(x->dtype))) return 0;
    PyErr_Format(PyExc_TypeError, "argument %s: dtype %s does not go with x of dtype %s (expected %s%s)", t->name,
                 brrr_dtype_name(t->dtype), brrr_dtype_name(x->dtype), brrr_dtype_name(x->dtype),
                 is_half(x->dtype) ? " or float32" : "");
    return -1;
}

static int check_acc_dtype(const brrr_tensor *t, const brrr_tensor *x) {
    if (t->dtype == acc_dtype(x->dtype)) return 0;
    PyErr_Format(PyExc_TypeError, "argument %s: expected dtype %s (the accumulation dtype for x of dtype %s), got %s",
                 t->name, brrr_dtype_name(acc_dtype(x->dtype)), brrr_dtype_name(x->dtype), brrr_dtype_name(t->dtype));
    return -1;
}

/* The checks of one slot against x; lead_ref and norm_ref carry x's leading and normalised shapes. */
static int check_slot(int s, const brrr_tensor *t, const brrr_tensor *x, const brrr_tensor *lead_ref,
                      const brrr_tensor *norm_ref, int written) {
    if (brrr_check_same_device(t, x) < 0) return -1;
    switch (SLOT_KIND[s]) {
    case K_DATA:
        if (brrr_check_same_dtype(t, x) < 0 || brrr_check_same_shape(t, x) < 0) return -1;
        break;
    case K_ROW:
        if (check_acc_dtype(t, x) < 0 || brrr_check_same_shape(t, lead_ref) < 0) return -1;
        break;
    case K_COL:
        if (check_param_dtype(t, x) < 0 || brrr_check_same_shape(t, norm_ref) < 0) return -1;
        break;
    default: break;
    }
    return written ? brrr_check_no_internal_overlap(t) : 0;
}

/* Coalesce the row dims (or column dims) of every present slot of the given kinds into L. */
static int coalesce_into(brrr_norm_launch *L, brrr_tensor *t, int rows, int lead, int k) {
    int64_t shape[BRRR_MAX_RANK], strides[S_COUNT][BRRR_MAX_RANK];
    int ids[S_COUNT], count = 0, ndim = rows ? lead : k;
    const int other = rows ? K_ROW : K_COL;
    memcpy(shape, t[S_X].shape + (rows ? 0 : lead), sizeof(int64_t) * (size_t)ndim);
    for (int s = 0; s < S_COUNT; s++) { /* S_X first: its strides order the dims */
        if (t[s].name == NULL || (SLOT_KIND[s] != K_DATA && SLOT_KIND[s] != other)) continue;
        const int64_t *src = t[s].strides + (SLOT_KIND[s] == K_DATA && !rows ? lead : 0);
        memcpy(strides[count], src, sizeof(int64_t) * (size_t)ndim);
        ids[count++] = s;
    }
    int nd = brrr_coalesce(ndim, shape, count, strides);
    if (nd < 0) return -1;
    if (nd > BRRR_NORM_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "argument x: views with more than %d non-mergeable %s dims are not supported "
                     "(got %d)", BRRR_NORM_MAX_DIMS, rows ? "leading" : "normalised", nd);
        return -1;
    }
    if (rows) {
        L->row_ndim = nd;
        memcpy(L->row_shape, shape, sizeof(int64_t) * (size_t)nd);
    } else {
        L->col_ndim = nd;
        memcpy(L->col_shape, shape, sizeof(int64_t) * (size_t)nd);
    }
    for (int i = 0; i < count; i++)
        memcpy(rows ? slot_view(L, ids[i])->row_strides : slot_view(L, ids[i])->col_strides, strides[i],
               sizeof(int64_t) * (size_t)nd);
    return 0;
}

/* ---- the shared body --------------------------------------------------------------------------- */

static int present(const norm_request *q, int s) { return q->obj[s] != NULL && q->obj[s] != Py_None; }

/* Written by the op: the output slots, and the statistics in the forward. */
static int writes(const norm_request *q, int s) {
    return s >= S_FIRST_OUTPUT || (!q->backward && (s == S_MEAN || s == S_RSTD));
}

/* The slots that True asks this call to allocate: the forward's statistics, the backward's
 * parameter gradients (which the caller would otherwise allocate with a framework call each). */
static int allocatable(const norm_request *q, int s) {
    return q->backward ? (s == S_GRAD_WEIGHT || s == S_GRAD_BIAS) : (s == S_MEAN || s == S_RSTD);
}

/* A new tensor for slot s, by x's framework: a row statistic in the accumulation dtype, or a
 * parameter gradient like weight (which must be given: it fixes the parameters' dtype). */
static PyObject *new_slot(brrr_call *call, PyObject *x_obj, int s, const brrr_tensor *x, const brrr_tensor *lead_ref,
                          const brrr_tensor *norm_ref, const brrr_tensor *weight) {
    const int row = SLOT_KIND[s] == K_ROW;
    if (!row && weight->name == NULL) {
        PyErr_Format(PyExc_ValueError, "argument %s: True (allocate it here) needs weight, whose dtype it takes",
                     SLOT_NAME[s]);
        return NULL;
    }
    const brrr_tensor *shape = row ? lead_ref : norm_ref;
    PyObject *obj = brrr_new_shaped(call, x_obj, x, shape->ndim, shape->shape,
                                    row ? acc_dtype(x->dtype) : weight->dtype);
    if (obj == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "argument %s: True (allocate it here) is taken only for tensors of frameworks "
                     "with DLPack's C exchange table", SLOT_NAME[s]);
    return obj;
}

static PyObject *norm_call(PyObject *module, norm_request *q) {
    brrr_call call = {brrr_get_state(module), q->stream, 0, NULL, 0};
    brrr_tensor t[S_COUNT];
    memset(t, 0, sizeof t);
    PyObject *owned[S_COUNT] = {NULL}; /* allocated here: outputs, the partials scratch */
    PyObject *result = NULL;
    double *acc = NULL;
    brrr_tensor *x = &t[S_X];

    if (brrr_tensor_import(&call, q->obj[S_X], "x", 0, x) < 0) goto done;
    if (q->norm_ndim < 1 || q->norm_ndim > x->ndim) {
        PyErr_Format(PyExc_ValueError, "argument norm_ndim: expected 1 <= norm_ndim <= x.ndim (%d), got %lld",
                     (int)x->ndim, q->norm_ndim);
        goto done;
    }
    const int k = (int)q->norm_ndim, lead = x->ndim - k;
    brrr_tensor lead_ref, norm_ref;
    memset(&lead_ref, 0, sizeof lead_ref);
    memset(&norm_ref, 0, sizeof norm_ref);
    lead_ref.name = "x.shape[:-norm_ndim]";
    lead_ref.ndim = lead;
    memcpy(lead_ref.shape, x->shape, sizeof(int64_t) * (size_t)lead);
    norm_ref.name = "x.shape[-norm_ndim:] (the normalised shape)";
    norm_ref.ndim = k;
    memcpy(norm_ref.shape, x->shape + lead, sizeof(int64_t) * (size_t)k);
    int64_t rows = 1, cols = 1;
    for (int d = 0; d < lead; d++) rows *= x->shape[d];
    for (int d = lead; d < x->ndim; d++) cols *= x->shape[d];

    /* Which slots this op takes, and which of them it requires. */
    int takes[S_COUNT] = {0}, needs[S_COUNT] = {0};
    if (q->backward) {
        takes[S_GRAD_OUT] = needs[S_GRAD_OUT] = takes[S_RSTD] = needs[S_RSTD] = takes[S_GRAD_X] = needs[S_GRAD_X] = 1;
        takes[S_GRAD_RESIDUAL] = takes[S_WEIGHT] = takes[S_GRAD_WEIGHT] = 1;
        takes[S_MEAN] = needs[S_MEAN] = takes[S_GRAD_BIAS] = !q->rms;
    } else {
        takes[S_RESIDUAL] = takes[S_WEIGHT] = takes[S_RSTD] = takes[S_OUT] = needs[S_OUT] = 1;
        takes[S_BIAS] = takes[S_MEAN] = !q->rms;
        takes[S_RESIDUAL_OUT] = needs[S_RESIDUAL_OUT] = present(q, S_RESIDUAL);
        if (present(q, S_RESIDUAL_OUT) && !present(q, S_RESIDUAL)) {
            PyErr_SetString(PyExc_ValueError, "argument residual_out: given without residual");
            goto done;
        }
    }
    for (int s = S_RESIDUAL; s < S_PARTIALS; s++) {
        if (!takes[s]) continue;
        PyObject *obj = q->obj[s];
        if (obj == Py_True) {
            if (!allocatable(q, s)) {
                PyErr_Format(PyExc_TypeError, "argument %s: True (allocate it here) is taken only for mean and rstd "
                             "in the forward and grad_weight and grad_bias in the backward", SLOT_NAME[s]);
                goto done;
            }
            obj = owned[s] = new_slot(&call, q->obj[S_X], s, x, &lead_ref, &norm_ref, &t[S_WEIGHT]);
            if (obj == NULL) goto done;
        } else if (!present(q, s)) {
            if (!needs[s]) continue;
            if (SLOT_KIND[s] == K_DATA && writes(q, s))
                obj = owned[s] = PyArray_Check(q->obj[S_X])
                    ? PyArray_NewLikeArray((PyArrayObject *)q->obj[S_X], NPY_KEEPORDER, NULL, 0)
                    : brrr_new_like(&call, q->obj[S_X], x);
            if (obj == NULL || obj == Py_None) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_TypeError, "argument %s: required%s", SLOT_NAME[s],
                                 writes(q, s) ? " for inputs of this type (brrr._C allocates NumPy arrays and tensors "
                                                "of frameworks with DLPack's C exchange table)" : "");
                goto done;
            }
        }
        if (brrr_tensor_import(&call, obj, SLOT_NAME[s], writes(q, s), &t[s]) < 0 ||
            check_slot(s, &t[s], x, &lead_ref, &norm_ref, writes(q, s)) < 0)
            goto done;
    }
    /* Parameters and their gradients share one dtype. */
    const brrr_tensor *param = t[S_WEIGHT].name ? &t[S_WEIGHT] : t[S_BIAS].name ? &t[S_BIAS] : t[S_GRAD_BIAS].name ? &t[S_GRAD_BIAS] : NULL;
    for (int s = S_WEIGHT; param && s <= S_GRAD_BIAS; s++)
        if (SLOT_KIND[s] == K_COL && t[s].name && brrr_check_same_dtype(&t[s], param) < 0) goto done;
    if (t[S_GRAD_WEIGHT].name && !t[S_WEIGHT].name) {
        PyErr_SetString(PyExc_ValueError, "argument grad_weight: given without weight");
        goto done;
    }
    const int n_grads = (t[S_GRAD_WEIGHT].name != NULL) + (t[S_GRAD_BIAS].name != NULL);
    const int64_t partial_rows = brrr_norm_partial_rows(rows, cols);
    if (x->device_type == kDLCUDA && n_grads > 0) {
        const int64_t want = n_grads * partial_rows * cols;
        brrr_tensor *p = &t[S_PARTIALS];
        PyObject *obj = q->obj[S_PARTIALS];
        if (!present(q, S_PARTIALS)) {
            if (q->stream < 0)
                obj = owned[S_PARTIALS] = brrr_new_shaped(&call, q->obj[S_X], x, 1, &want, acc_dtype(x->dtype));
            if (obj == NULL || obj == Py_None) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_TypeError, "argument partials: required on CUDA for a weight or bias gradient "
                                 "(a 1-D tensor of at least %lld elements) unless brrr._C can allocate it: x from a "
                                 "framework with DLPack's C exchange table, on its current stream", (long long)want);
                goto done;
            }
        }
        if (brrr_tensor_import(&call, obj, "partials", 1, p) < 0 || brrr_check_same_device(p, x) < 0 ||
            check_acc_dtype(p, x) < 0)
            goto done;
        if (p->ndim != 1 || p->numel < want || (p->numel > 1 && p->strides[0] != 1)) {
            PyErr_Format(PyExc_ValueError, "argument partials: expected a contiguous 1-D tensor of at least %lld "
                         "elements (n_grads * norm_partial_rows(rows, cols) * cols)", (long long)want);
            goto done;
        }
    }
    /* No written tensor may share memory with any other argument. */
    for (int o = 0; o < S_COUNT; o++) {
        if (t[o].name == NULL || !writes(q, o)) continue;
        for (int i = 0; i < S_COUNT; i++)
            if (i != o && t[i].name && brrr_check_no_overlap(&t[o], &t[i], 0) < 0) goto done;
    }

    brrr_norm_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = x->dtype;
    L.weight_dtype = param ? param->dtype : x->dtype;
    L.rms = q->rms;
    L.llama = q->rms && q->llama;
    L.rows = rows;
    L.cols = cols;
    L.eps = q->eps;
    L.partial_rows_max = partial_rows;
    L.partials = t[S_PARTIALS].data;
    if (coalesce_into(&L, t, 1, lead, k) < 0 || coalesce_into(&L, t, 0, lead, k) < 0) goto done;
    for (int s = 0; s < S_COUNT; s++)
        if (t[s].name && slot_view(&L, s)) slot_view(&L, s)->data = t[s].data;
    L.contiguous_cols = L.col_ndim == 1;
    for (int s = 0; s < S_COUNT; s++) /* the gradients of weight and bias are written at any stride */
        if (t[s].name && (SLOT_KIND[s] == K_DATA || s == S_WEIGHT || s == S_BIAS) && slot_view(&L, s)->col_strides[0] != 1)
            L.contiguous_cols = 0;

    if (cols > 0 && (rows > 0 || n_grads > 0)) {
        if (x->device_type == kDLCPU) {
            if (q->backward && n_grads > 0) {
                acc = PyMem_RawCalloc((size_t)(2 * cols), sizeof(double));
                if (acc == NULL) {
                    PyErr_NoMemory();
                    goto done;
                }
            }
            double *acc_w = acc && t[S_GRAD_WEIGHT].name ? acc : NULL, *acc_b = acc && t[S_GRAD_BIAS].name ? acc + cols : NULL;
            Py_BEGIN_ALLOW_THREADS
            if (q->backward) cpu_norm_bwd(&L, acc_w, acc_b);
            else cpu_norm_fwd(&L);
            Py_END_ALLOW_THREADS
        } else {
#if BRRR_WITH_CUDA
            void *stream = brrr_call_stream(&call);
            int err;
            Py_BEGIN_ALLOW_THREADS
            err = q->backward ? brrr_cuda_norm_bwd(&L, x->device_id, stream) : brrr_cuda_norm_fwd(&L, x->device_id, stream);
            Py_END_ALLOW_THREADS
            const char *op = q->backward ? (q->rms ? "rms_norm_bwd" : "layer_norm_bwd")
                                         : (q->rms ? "rms_norm_fwd" : "layer_norm_fwd");
            if (brrr_cuda_result(err, op) < 0) goto done;
#endif
        }
    }

    {
        /* out (or grad_x), residual_out when a residual was given, then what True asked for. */
        PyObject *items[5];
        int n = 0;
        const int first = q->backward ? S_GRAD_X : S_OUT;
        items[n++] = owned[first] ? owned[first] : q->obj[first];
        if (!q->backward && t[S_RESIDUAL].name)
            items[n++] = owned[S_RESIDUAL_OUT] ? owned[S_RESIDUAL_OUT] : q->obj[S_RESIDUAL_OUT];
        for (int s = S_MEAN; s <= S_GRAD_BIAS; s++)
            if (takes[s] && q->obj[s] == Py_True) items[n++] = owned[s];
        if (n == 1) {
            result = Py_NewRef(items[0]);
        } else if ((result = PyTuple_New(n)) != NULL) {
            for (int i = 0; i < n; i++) PyTuple_SET_ITEM(result, i, Py_NewRef(items[i]));
        }
    }
done:
    PyMem_RawFree(acc);
    for (int s = 0; s < S_COUNT; s++) {
        brrr_tensor_release(&t[s]);
        Py_XDECREF(owned[s]);
    }
    return result;
}

/* ---- argument parsing ---------------------------------------------------------------------------- */

/* Non-tensor positional arguments, by the negative codes that stand for them in an entry's list. */
enum { A_NORM_NDIM = -1, A_EPS = -2, A_LLAMA = -3, A_STREAM = -4 };

typedef struct {
    const char *signature;
    int backward, rms, nargs;
    int arg[12]; /* per positional argument: its slot, or an A_ code */
} norm_entry;

static const norm_entry LAYER_NORM_FWD = {
    "layer_norm_fwd(x, norm_ndim, weight, bias, eps, out, mean, rstd, residual, residual_out, stream)", 0, 0, 11,
    {S_X, A_NORM_NDIM, S_WEIGHT, S_BIAS, A_EPS, S_OUT, S_MEAN, S_RSTD, S_RESIDUAL, S_RESIDUAL_OUT, A_STREAM}};
static const norm_entry RMS_NORM_FWD = {
    "rms_norm_fwd(x, norm_ndim, weight, eps, llama, out, rstd, residual, residual_out, stream)", 0, 1, 10,
    {S_X, A_NORM_NDIM, S_WEIGHT, A_EPS, A_LLAMA, S_OUT, S_RSTD, S_RESIDUAL, S_RESIDUAL_OUT, A_STREAM}};
static const norm_entry LAYER_NORM_BWD = {
    "layer_norm_bwd(x, norm_ndim, grad_out, grad_residual, weight, mean, rstd, grad_x, grad_weight, grad_bias, "
    "partials, stream)", 1, 0, 12,
    {S_X, A_NORM_NDIM, S_GRAD_OUT, S_GRAD_RESIDUAL, S_WEIGHT, S_MEAN, S_RSTD, S_GRAD_X, S_GRAD_WEIGHT, S_GRAD_BIAS,
     S_PARTIALS, A_STREAM}};
static const norm_entry RMS_NORM_BWD = {
    "rms_norm_bwd(x, norm_ndim, grad_out, grad_residual, weight, rstd, llama, grad_x, grad_weight, partials, stream)",
    1, 1, 11,
    {S_X, A_NORM_NDIM, S_GRAD_OUT, S_GRAD_RESIDUAL, S_WEIGHT, S_RSTD, A_LLAMA, S_GRAD_X, S_GRAD_WEIGHT, S_PARTIALS,
     A_STREAM}};

static PyObject *norm_entry_call(PyObject *module, const norm_entry *e, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != e->nargs) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments (%zd given)", e->signature, e->nargs, nargs);
        return NULL;
    }
    norm_request q;
    memset(&q, 0, sizeof q);
    q.backward = e->backward;
    q.rms = e->rms;
    for (int i = 0; i < e->nargs; i++) {
        PyObject *a = args[i];
        switch (e->arg[i]) {
        case A_NORM_NDIM:
            q.norm_ndim = PyLong_AsLongLong(a);
            if (q.norm_ndim == -1 && PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "argument norm_ndim: expected an int (len(normalized_shape))");
                return NULL;
            }
            break;
        case A_EPS:
            q.eps = PyFloat_AsDouble(a);
            if (q.eps == -1.0 && PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "argument eps: expected a float");
                return NULL;
            }
            break;
        case A_LLAMA:
            if ((q.llama = PyObject_IsTrue(a)) < 0) return NULL;
            break;
        case A_STREAM:
            if (brrr_parse_stream(a, &q.stream) < 0) return NULL;
            break;
        default: q.obj[e->arg[i]] = a; break;
        }
    }
    return norm_call(module, &q);
}

PyObject *brrr_py_layer_norm_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return norm_entry_call(module, &LAYER_NORM_FWD, args, nargs);
}
PyObject *brrr_py_rms_norm_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return norm_entry_call(module, &RMS_NORM_FWD, args, nargs);
}
PyObject *brrr_py_layer_norm_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return norm_entry_call(module, &LAYER_NORM_BWD, args, nargs);
}
PyObject *brrr_py_rms_norm_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return norm_entry_call(module, &RMS_NORM_BWD, args, nargs);
}

PyObject *brrr_py_norm_partial_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "norm_partial_rows(rows, cols) takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    long long rows = PyLong_AsLongLong(args[0]), cols = PyLong_AsLongLong(args[1]);
    if ((rows == -1 || cols == -1) && PyErr_Occurred()) return NULL;
    if (rows < 0 || cols < 0) {
        PyErr_SetString(PyExc_ValueError, "arguments rows and cols: must be >= 0");
        return NULL;
    }
    return PyLong_FromLongLong(brrr_norm_partial_rows(rows, cols));
}
