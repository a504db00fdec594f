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
 * The two ops (specs at the end): the forward as above, the backward grad_x = keep * grad_out /
 * (1 - p) and, where asked for, grad_bias: grad_x summed over all but the last dim in a fixed
 * order (bitwise reproducible; on CUDA through a `partials` scratch of
 * brrr_bias_partial_rows(rows) * cols elements, allocated here unless the caller passes one).
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "op.h"
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

/* ---- layout and launch ------------------------------------------------------------------------- */

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
    if (brrr_check_view_dims(x->name, n) < 0) return -1;
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

enum { F_X, F_BIAS, F_RESIDUAL, F_OUT };          /* forward slots */
enum { B_GRAD_OUT, B_GRAD_X, B_GRAD_BIAS, B_PARTIALS }; /* backward slots */
enum { A_P, A_SEED, A_OFFSET };

/* A bias, or its gradient, runs along x's last dim: a 0-d x has none. */
static int dropout_check(brrr_op_call *c) {
    const int bias = c->spec->slots[1].flags & BRRR_WRITE ? B_GRAD_BIAS : F_BIAS;
    const brrr_tensor *x = &c->t[0];
    PyObject *given = c->obj[bias];
    if (given == NULL || given == Py_None) return 0;
    if (x->ndim == 0) {
        PyErr_Format(PyExc_ValueError, "argument %s: %s is 0-d, so it has no last dim to broadcast along",
                     c->spec->slots[bias].name, x->name);
        return -1;
    }
    return bias == F_BIAS ? brrr_check_same_shape(&c->t[F_BIAS], &c->cols) : 0;
}

static int64_t dropout_scratch(const brrr_op_call *c) {
    return brrr_has(c, B_GRAD_BIAS) && c->n_rows ? brrr_bias_partial_rows(c->n_rows) * c->n_cols : 0;
}

static int dropout_run(brrr_op_call *c, int backward) {
    const brrr_tensor *x = &c->t[0], *out = &c->t[backward ? B_GRAD_X : F_OUT];
    const brrr_tensor *bias = backward ? NULL : &c->t[F_BIAS], *res = backward ? NULL : &c->t[F_RESIDUAL];
    const brrr_tensor *grad_bias = backward ? &c->t[B_GRAD_BIAS] : NULL;
    const double p = c->arg[A_P].f;
    brrr_tensor none;
    memset(&none, 0, sizeof none);
    brrr_dropout_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = x->dtype;
    L.numel = x->numel;
    L.cols = x->ndim ? x->shape[x->ndim - 1] : 1;
    L.seed = c->arg[A_SEED].u;
    L.offset = c->arg[A_OFFSET].u;
    L.threshold = p >= 1.0 ? (uint64_t)1 << 32 : (uint64_t)(p * 4294967296.0); /* exact, then floor */
    L.scale = p >= 1.0 ? 0.0 : 1.0 / (1.0 - p);
    L.x.data = x->data;
    L.out.data = out->data;
    if (bias && bias->name) {
        L.bias = bias->data;
        L.bias_stride = bias->strides[0];
    }
    if (grad_bias && grad_bias->name) {
        L.grad_bias = grad_bias->data;
        L.grad_bias_stride = grad_bias->strides[0];
        L.row_layout = 1;
        L.partials = c->t[B_PARTIALS].data;
        L.partial_rows = c->n_rows ? brrr_bias_partial_rows(c->n_rows) : 0;
    }
    if (res) L.residual.data = res->data;
    if (L.numel > 0 && dropout_layout(&L, x, res ? res : &none, out) < 0) return -1;
    if (L.numel == 0 && (!L.grad_bias || L.cols == 0)) return 0; /* nothing to write */
    if (!brrr_on_cpu(c)) BRRR_RETURN_CUDA(c, brrr_cuda_dropout, &L);
    double *acc = L.grad_bias ? PyMem_RawCalloc((size_t)L.cols, sizeof(double)) : NULL;
    if (L.grad_bias && acc == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    BRRR_CPU_BEGIN(c)
    cpu_dropout(&L, acc);
    for (int64_t j = 0; acc && j < L.cols; j++) {
        if (L.dtype == BRRR_F64) ((double *)L.grad_bias)[j * L.grad_bias_stride] = acc[j];
        else brrr_store_f32(L.dtype, L.grad_bias, j * L.grad_bias_stride, (float)acc[j]);
    }
    BRRR_CPU_END
    PyMem_RawFree(acc);
    return 0;
}

static int dropout_fwd_run(brrr_op_call *c) { return dropout_run(c, 0); }
static int dropout_bwd_run(brrr_op_call *c) { return dropout_run(c, 1); }

#define DROPOUT_ARGS                                                                                                 \
    {{"p", BRRR_ARG_FLOAT, 0, 1, NULL, "a dropout probability between 0 and 1"},                                     \
     {"seed", BRRR_ARG_UINT64, 0, 0, NULL, "an int in [0, 2**64)"},                                                  \
     {"offset", BRRR_ARG_UINT64, 0, 0, NULL, "an int in [0, 2**64)"}}

static const brrr_op_spec DROPOUT_FWD = {
    .name = "dropout_fwd",
    .doc = "out = residual + dropout(x + bias, p): bias along x's last dim and residual optional; the mask from "
           "Philox4x32-10 keyed by seed at the element's row-major index and offset. out may be x or residual.",
    .n_slots = 4,
    .slots = {{"x", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"bias", BRRR_OPTIONAL, BRRR_SHAPE_FAMILY, BRRR_DTYPE_X, -1},
              {"residual", BRRR_OPTIONAL, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"out", BRRR_WRITE | BRRR_ALLOC | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_X, -1}},
    .n_args = 3,
    .args = DROPOUT_ARGS,
    .split_arg = -1,
    .check = dropout_check,
    .run = dropout_fwd_run,
};

static const brrr_op_spec DROPOUT_BWD = {
    .name = "dropout_bwd",
    .doc = "grad_x = keep * grad_out / (1 - p) with dropout_fwd's mask, and where asked for (True allocates it) "
           "grad_bias, grad_x summed over all but the last dim in a fixed order.",
    .n_slots = 4,
    .slots = {{"grad_out", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"grad_x", BRRR_WRITE | BRRR_ALLOC | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"grad_bias", BRRR_WRITE | BRRR_OPTIONAL | BRRR_ALLOC, BRRR_SHAPE_COLS, BRRR_DTYPE_X, -1},
              {"partials", BRRR_WRITE, BRRR_SHAPE_SCRATCH, BRRR_DTYPE_ACC, -1}},
    .n_args = 3,
    .args = DROPOUT_ARGS,
    .split_arg = -1,
    .check = dropout_check,
    .scratch = dropout_scratch,
    .run = dropout_bwd_run,
};

const brrr_op_spec *const brrr_dropout_ops[] = {&DROPOUT_FWD, &DROPOUT_BWD, NULL};
