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
 * The four ops (specs at the end) take and return tensors by name; the backward's x is the
 * normalised input: for the fused residual forms, the forward's residual_out. Their CUDA
 * backward with a weight or bias gradient takes a `partials` scratch (allocated here on the
 * framework's current stream unless the caller passes one): n_grads * norm_partial_rows(rows,
 * cols) * cols elements of the accumulation dtype.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "op.h"
#include "cpu.h"

#include <float.h>
#include <math.h>
#include <numpy/arrayobject.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* What a slot is to the launch, whichever op it belongs to. */
enum {
    R_X, R_RESIDUAL, R_WEIGHT, R_BIAS, R_GRAD_OUT, R_GRAD_RESIDUAL, R_MEAN, R_RSTD,
    R_OUT, R_RESIDUAL_OUT, R_GRAD_X, R_GRAD_WEIGHT, R_GRAD_BIAS, R_PARTIALS,
    R_COUNT
};

/* How a role is indexed: rows by columns, rows only, columns only, or flat scratch. */
enum { K_DATA, K_ROW, K_COL, K_FLAT };
static const int ROLE_KIND[R_COUNT] = {K_DATA, K_DATA, K_COL, K_COL, K_DATA, K_DATA, K_ROW, K_ROW,
                                       K_DATA, K_DATA, K_DATA, K_COL, K_COL, K_FLAT};

/* A norm op: its spec, and the role of each of its slots. */
typedef struct {
    brrr_op_spec spec;
    int backward, rms;
    int8_t role[BRRR_OP_MAX_SLOTS];
} norm_op;

static brrr_norm_view *role_view(brrr_norm_launch *L, int r) {
    switch (r) {
    case R_X: return &L->x;
    case R_RESIDUAL: return &L->residual;
    case R_WEIGHT: return &L->weight;
    case R_BIAS: return &L->bias;
    case R_GRAD_OUT: return &L->grad_out;
    case R_GRAD_RESIDUAL: return &L->grad_residual;
    case R_MEAN: return &L->mean;
    case R_RSTD: return &L->rstd;
    case R_OUT: return &L->out;
    case R_RESIDUAL_OUT: return &L->residual_out;
    case R_GRAD_X: return &L->grad_x;
    case R_GRAD_WEIGHT: return &L->grad_weight;
    case R_GRAD_BIAS: return &L->grad_bias;
    default: return NULL;
    }
}

static int acc_dtype(int32_t dtype) { return dtype == BRRR_F64 ? BRRR_F64 : BRRR_F32; }

/* ---- CPU twin --------------------------------------------------------------------------------
 * Rows are shared out between threads. A row is walked in blocks of BRRR_CPU_BLOCK columns, the
 * elementwise math in float (double for float64), its sums in NORM_LANES fixed lanes so that the
 * compiler vectorises them (a block's in float, the row's in double): one pass for the mean and
 * the mean square, one for the output (and a second for the variance where the first would
 * cancel); the row stays in the cache between passes. The backward's weight and bias
 * gradients sum each chunk of rows (brrr_cpu_chunk_rows) into a partial row of their own, added
 * in chunk order at the end: the same sums whatever the thread count. */

#define NORM_LANES 16
#define NORM_GROUP 8 /* rows whose weight and bias gradients the backward sums in REAL first */

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

/* Row r + 1 of view v (elements of `size` bytes), to be fetched while row r is written, where it
 * is one of the rows before `end` and its columns are dense; else NULL. */
static const char *next_row(const brrr_norm_launch *L, const brrr_norm_view *v, int64_t r, int64_t end, int64_t size) {
    if (r + 1 >= end || L->col_ndim != 1 || v->col_strides[0] != 1) return NULL;
    return (const char *)v->data + row_off(L, v, r + 1) * size;
}

static double norm_sum_lanes(const double *lanes) {
    double s = 0.0;
    for (int l = 0; l < NORM_LANES; l++) s += lanes[l];
    return s;
}

typedef struct {
    const brrr_norm_launch *L;
    int64_t chunk_rows;
    double *partial_w, *partial_b; /* [chunk][cols], or NULL */
    /* The task that starts at chunk 0 adds its chunks' partial rows into acc_w and acc_b (unless
     * NULL) as it finishes each, in chunk order, reusing partial row 0 for all of them; it sets
     * first_end to the chunk after its last. The other tasks keep theirs, added in order after. */
    double *acc_w, *acc_b;
    int64_t first_end;
    atomic_int out_of_memory; /* set by a task without room for its sums */
} norm_bwd_work;

#include "cpu_real_f32.h"
#include "norm_cpu.inc"
#include "cpu_real_end.h"
#include "cpu_real_f64.h"
#include "norm_cpu.inc"
#include "cpu_real_end.h"

static void cpu_norm_fwd(const brrr_norm_launch *L) {
    brrr_cpu_parallel_for(L->rows, L->cols,
                          L->dtype == BRRR_F64 ? norm_fwd_rows_f64 : norm_fwd_rows_f32, (void *)L);
}

/* acc_w / acc_b: cols zeroed accumulators each, for the gradients asked for (else NULL). 0, or -1
 * without room for the sums (no error set: this runs without the GIL). */
static int cpu_norm_bwd(const brrr_norm_launch *L, double *acc_w, double *acc_b) {
    const int64_t n = L->cols, chunk_rows = brrr_cpu_chunk_rows(L->rows), chunks = (L->rows + chunk_rows - 1) / chunk_rows;
    norm_bwd_work work = {L, chunk_rows, NULL, NULL, NULL, NULL, 0, 0};
    double *partials = NULL;
    if (acc_w || acc_b) {
        /* not zeroed: each chunk's first group sets its row (the first task's chunks leave all
         * but row 0 untouched) */
        partials = malloc((size_t)(2 * chunks * n) * sizeof(double));
        if (partials == NULL) { /* no room: one chunk, summed in row order straight into acc */
            work.chunk_rows = L->rows > 0 ? L->rows : 1;
            work.partial_w = acc_w;
            work.partial_b = acc_b;
        } else {
            work.partial_w = acc_w ? partials : NULL;
            work.partial_b = acc_b ? partials + chunks * n : NULL;
            work.acc_w = acc_w;
            work.acc_b = acc_b;
        }
    }
    const int64_t items = (L->rows + work.chunk_rows - 1) / work.chunk_rows, per_item = work.chunk_rows * n;
    brrr_cpu_parallel_for(items, per_item,
                          L->dtype == BRRR_F64 ? norm_bwd_chunks_f64 : norm_bwd_chunks_f32, &work);
    if (atomic_load(&work.out_of_memory)) {
        free(partials);
        return -1;
    }
    for (int64_t k = work.first_end; partials && k < chunks; k++) {
        for (int64_t j = 0; acc_w && j < n; j++) acc_w[j] += work.partial_w[k * n + j];
        for (int64_t j = 0; acc_b && j < n; j++) acc_b[j] += work.partial_b[k * n + j];
    }
    free(partials);
    for (int64_t j = 0; j < n; j++) {
        if (acc_w) brrr_store_f64(L->weight_dtype, L->grad_weight.data, col_off(L, &L->grad_weight, j), acc_w[j]);
        if (acc_b) brrr_store_f64(L->weight_dtype, L->grad_bias.data, col_off(L, &L->grad_bias, j), acc_b[j]);
    }
    return 0;
}

/* ---- layout and launch ------------------------------------------------------------------------- */

/* Coalesce the row dims (or column dims) of every given tensor of the matching kinds into L.
 * t[r]: the tensor in role r, or NULL. */
static int coalesce_into(brrr_norm_launch *L, const brrr_tensor *const *t, int rows, int lead, int k) {
    int64_t shape[BRRR_MAX_RANK], strides[R_COUNT][BRRR_MAX_RANK];
    int ids[R_COUNT], count = 0, ndim = rows ? lead : k;
    const int other = rows ? K_ROW : K_COL;
    memcpy(shape, t[R_X]->shape + (rows ? 0 : lead), sizeof(int64_t) * (size_t)ndim);
    for (int r = 0; r < R_COUNT; r++) { /* R_X first: its strides order the dims */
        if (t[r] == NULL || (ROLE_KIND[r] != K_DATA && ROLE_KIND[r] != other)) continue;
        const int64_t *src = t[r]->strides + (ROLE_KIND[r] == K_DATA && !rows ? lead : 0);
        memcpy(strides[count], src, sizeof(int64_t) * (size_t)ndim);
        ids[count++] = r;
    }
    int nd = brrr_coalesce("x", ndim, shape, count, strides);
    if (nd < 0) return -1;
    if (rows) {
        L->row_ndim = nd;
        memcpy(L->row_shape, shape, sizeof(int64_t) * (size_t)nd);
    } else {
        L->col_ndim = nd;
        memcpy(L->col_shape, shape, sizeof(int64_t) * (size_t)nd);
    }
    for (int i = 0; i < count; i++)
        memcpy(rows ? role_view(L, ids[i])->row_strides : role_view(L, ids[i])->col_strides, strides[i],
               sizeof(int64_t) * (size_t)nd);
    return 0;
}

static const norm_op *as_norm(const brrr_op_call *c) { return (const norm_op *)c->spec; }

/* The tensors of the call by role (NULL where absent). */
static void by_role(const brrr_op_call *c, const brrr_tensor **t) {
    for (int r = 0; r < R_COUNT; r++) t[r] = NULL;
    for (int s = 0; s < c->spec->n_slots; s++)
        if (brrr_has(c, s)) t[as_norm(c)->role[s]] = &c->t[s];
}

static int n_grads(const brrr_op_call *c) {
    const brrr_tensor *t[R_COUNT];
    by_role(c, t);
    return (t[R_GRAD_WEIGHT] != NULL) + (t[R_GRAD_BIAS] != NULL);
}

/* RMSNorm's weight offset (0 for LayerNorm). */
static double weight_offset(const brrr_op_call *c) {
    const norm_op *op = as_norm(c);
    return op->rms ? c->arg[op->backward ? 2 : 3].f : 0.0;
}

static int norm_check(brrr_op_call *c) {
    const brrr_tensor *t[R_COUNT];
    by_role(c, t);
    if (weight_offset(c) != 0.0 && t[R_WEIGHT] == NULL) {
        PyErr_SetString(PyExc_ValueError, "argument offset: nonzero without weight (it is added to the weight)");
        return -1;
    }
    for (int s = 0; s < c->spec->n_slots; s++) /* grad_weight takes weight's place */
        if (as_norm(c)->role[s] == R_GRAD_WEIGHT && c->obj[s] && c->obj[s] != Py_None && t[R_WEIGHT] == NULL) {
            PyErr_SetString(PyExc_ValueError, "argument grad_weight: given without weight");
            return -1;
        }
    return 0;
}

static int64_t norm_scratch(const brrr_op_call *c) {
    return n_grads(c) * brrr_norm_partial_rows(c->n_rows, c->n_cols) * c->n_cols;
}

static int norm_run(brrr_op_call *c) {
    const norm_op *op = as_norm(c);
    const brrr_tensor *t[R_COUNT];
    by_role(c, t);
    const int k = c->split, lead = t[R_X]->ndim - k, grads = n_grads(c);
    const int32_t param_dtype = t[R_WEIGHT] ? t[R_WEIGHT]->dtype : t[R_BIAS] ? t[R_BIAS]->dtype
                              : t[R_GRAD_WEIGHT] ? t[R_GRAD_WEIGHT]->dtype : t[R_GRAD_BIAS] ? t[R_GRAD_BIAS]->dtype
                                                                                          : t[R_X]->dtype;
    brrr_norm_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = t[R_X]->dtype;
    L.weight_dtype = param_dtype;
    L.rms = op->rms;
    L.llama = op->rms && c->arg[op->backward ? 1 : 2].i;
    L.rows = c->n_rows;
    L.cols = c->n_cols;
    L.eps = op->backward ? 0.0 : c->arg[1].f;
    L.weight_offset = weight_offset(c);
    L.partials = t[R_PARTIALS] ? t[R_PARTIALS]->data : NULL;
    if (coalesce_into(&L, t, 1, lead, k) < 0 || coalesce_into(&L, t, 0, lead, k) < 0) return -1;
    for (int r = 0; r < R_COUNT; r++)
        if (t[r] && role_view(&L, r)) role_view(&L, r)->data = t[r]->data;
    L.contiguous_cols = L.col_ndim == 1;
    for (int r = 0; r < R_COUNT; r++) /* the gradients of weight and bias are written at any stride */
        if (t[r] && (ROLE_KIND[r] == K_DATA || r == R_WEIGHT || r == R_BIAS) && role_view(&L, r)->col_strides[0] != 1)
            L.contiguous_cols = 0;
    if (L.cols == 0 || (L.rows == 0 && grads == 0)) return 0;
    if (!brrr_on_cpu(c)) {
        if (op->backward) BRRR_RETURN_CUDA(c, brrr_cuda_norm_bwd, &L);
        BRRR_RETURN_CUDA(c, brrr_cuda_norm_fwd, &L);
    }
    if (!op->backward) {
        BRRR_RUN_CPU(c, cpu_norm_fwd, &L);
        return 0;
    }
    double *acc = grads ? PyMem_RawCalloc((size_t)(2 * L.cols), sizeof(double)) : NULL;
    if (grads && acc == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    double *acc_w = t[R_GRAD_WEIGHT] ? acc : NULL, *acc_b = t[R_GRAD_BIAS] ? acc + L.cols : NULL;
    int status;
    BRRR_CPU_BEGIN(c)
    status = cpu_norm_bwd(&L, acc_w, acc_b);
    BRRR_CPU_END
    PyMem_RawFree(acc);
    if (status < 0) PyErr_NoMemory();
    return status;
}

/* ---- the ops ------------------------------------------------------------------------------------- */

#define SLOT(name, flags, shape, dtype) {name, flags, BRRR_SHAPE_##shape, BRRR_DTYPE_##dtype, -1}
#define OUT_WHEN(name, when) {name, BRRR_WRITE | BRRR_OPTIONAL | BRRR_ALLOC, BRRR_SHAPE_X, BRRR_DTYPE_X, when}
#define NORM_NDIM {"norm_ndim", BRRR_ARG_INT, -9e18, 9e18, NULL, "an int (len(normalized_shape))"}
#define EPS {"eps", BRRR_ARG_FLOAT, 0, INFINITY, NULL, "a float >= 0"}
#define LLAMA {"llama", BRRR_ARG_BOOL, 0, 0, NULL, "a bool"}
#define OFFSET {"offset", BRRR_ARG_FLOAT, -DBL_MAX, DBL_MAX, NULL, "a finite float", 1, 0.0}
#define STAT(name) SLOT(name, BRRR_WRITE | BRRR_OPTIONAL | BRRR_ALLOC, ROWS, ACC)
#define PARAM_GRAD(name) SLOT(name, BRRR_WRITE | BRRR_OPTIONAL | BRRR_ALLOC, COLS, PARAM)

static const norm_op LAYER_NORM_FWD = {
    {.name = "layer_norm_fwd",
     .doc = "LayerNorm of x (of h = x + residual, written to residual_out) over its last norm_ndim dims: out = (h - "
            "mean) * rstd * weight + bias. mean (less the row's first element) and rstd per row where asked for "
            "(True allocates them).",
     .n_slots = 8,
     .slots = {SLOT("x", 0, X, X), SLOT("weight", BRRR_OPTIONAL, COLS, PARAM), SLOT("bias", BRRR_OPTIONAL, COLS, PARAM),
               SLOT("residual", BRRR_OPTIONAL, X, X), SLOT("out", BRRR_WRITE | BRRR_ALLOC, X, X),
               OUT_WHEN("residual_out", 3), STAT("mean"), STAT("rstd")},
     .n_args = 2, .args = {NORM_NDIM, EPS}, .split_arg = 0,
     .check = norm_check, .scratch = norm_scratch, .run = norm_run},
    0, 0, {R_X, R_WEIGHT, R_BIAS, R_RESIDUAL, R_OUT, R_RESIDUAL_OUT, R_MEAN, R_RSTD},
};

static const norm_op RMS_NORM_FWD = {
    {.name = "rms_norm_fwd",
     .doc = "RMSNorm of x (of h = x + residual, written to residual_out) over its last norm_ndim dims: out = h * rstd "
            "* w, or with llama round(round(h * rstd) * w), where w = weight + offset (Gemma's offset 1, added in "
            "float32). rstd per row where asked for (True allocates it).",
     .n_slots = 6,
     .slots = {SLOT("x", 0, X, X), SLOT("weight", BRRR_OPTIONAL, COLS, PARAM), SLOT("residual", BRRR_OPTIONAL, X, X),
               SLOT("out", BRRR_WRITE | BRRR_ALLOC, X, X), OUT_WHEN("residual_out", 2), STAT("rstd")},
     .n_args = 4, .args = {NORM_NDIM, EPS, LLAMA, OFFSET}, .split_arg = 0,
     .check = norm_check, .scratch = norm_scratch, .run = norm_run},
    0, 1, {R_X, R_WEIGHT, R_RESIDUAL, R_OUT, R_RESIDUAL_OUT, R_RSTD},
};

static const norm_op LAYER_NORM_BWD = {
    {.name = "layer_norm_bwd",
     .doc = "The gradients of layer_norm_fwd from the normalised input x (the forward's residual_out for the fused "
            "form) and its mean and rstd: grad_x (plus grad_residual where given), and the weight and bias "
            "gradients where asked for (True allocates them), summed over rows in a fixed order.",
     .n_slots = 10,
     .slots = {SLOT("x", 0, X, X), SLOT("grad_out", 0, X, X), SLOT("grad_residual", BRRR_OPTIONAL, X, X),
               SLOT("weight", BRRR_OPTIONAL, COLS, PARAM), SLOT("mean", 0, ROWS, ACC), SLOT("rstd", 0, ROWS, ACC),
               SLOT("grad_x", BRRR_WRITE | BRRR_ALLOC, X, X), PARAM_GRAD("grad_weight"), PARAM_GRAD("grad_bias"),
               SLOT("partials", BRRR_WRITE, SCRATCH, ACC)},
     .n_args = 1, .args = {NORM_NDIM}, .split_arg = 0,
     .check = norm_check, .scratch = norm_scratch, .run = norm_run},
    1, 0, {R_X, R_GRAD_OUT, R_GRAD_RESIDUAL, R_WEIGHT, R_MEAN, R_RSTD, R_GRAD_X, R_GRAD_WEIGHT, R_GRAD_BIAS, R_PARTIALS},
};

static const norm_op RMS_NORM_BWD = {
    {.name = "rms_norm_bwd",
     .doc = "The gradients of rms_norm_fwd from the normalised input x (the forward's residual_out for the fused "
            "form) and its rstd: grad_x (plus grad_residual where given), and the weight gradient where asked for "
            "(True allocates it), summed over rows in a fixed order. offset: the forward's (the weight gradient "
            "does not depend on it).",
     .n_slots = 8,
     .slots = {SLOT("x", 0, X, X), SLOT("grad_out", 0, X, X), SLOT("grad_residual", BRRR_OPTIONAL, X, X),
               SLOT("weight", BRRR_OPTIONAL, COLS, PARAM), SLOT("rstd", 0, ROWS, ACC),
               SLOT("grad_x", BRRR_WRITE | BRRR_ALLOC, X, X), PARAM_GRAD("grad_weight"),
               SLOT("partials", BRRR_WRITE, SCRATCH, ACC)},
     .n_args = 3, .args = {NORM_NDIM, LLAMA, OFFSET}, .split_arg = 0,
     .check = norm_check, .scratch = norm_scratch, .run = norm_run},
    1, 1, {R_X, R_GRAD_OUT, R_GRAD_RESIDUAL, R_WEIGHT, R_RSTD, R_GRAD_X, R_GRAD_WEIGHT, R_PARTIALS},
};

const brrr_op_spec *const brrr_norm_ops[] = {&LAYER_NORM_FWD.spec, &RMS_NORM_FWD.spec, &LAYER_NORM_BWD.spec,
                                             &RMS_NORM_BWD.spec, NULL};

PyObject *brrr_py_norm_partial_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "norm_partial_rows(rows, cols) takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    long long rows, cols;
    if (brrr_parse_int64(args[0], "rows", &rows) < 0 || brrr_parse_int64(args[1], "cols", &cols) < 0) return NULL;
    if (rows < 0 || cols < 0) {
        PyErr_SetString(PyExc_ValueError, "arguments rows and cols: must be >= 0");
        return NULL;
    }
    return PyLong_FromLongLong(brrr_norm_partial_rows(rows, cols));
}
