/* Softmax cross-entropy over the last dim: the glue and the CPU twin.
 *
 * logits (..., C) are rows by classes; target (...) holds a class index per row (int64, int32
 * or uint8). The forward saves one log-sum-exp per row (relative to the target's logit); the
 * backward rematerialises the softmax from logits and lse instead of keeping log-probabilities
 * (formulas: brrr_cuda.h). The CPU twin computes the same function, rows on threads, in float
 * math with double sums (float64 for float64 logits): xent_cpu.inc.
 * Every entry takes softcap (None, or c: the loss sees c * tanh(logits / c)) and z_loss (the
 * coefficient of each counted row's squared log-sum-exp added to its loss; 0: none).
 *
 * The three ops of cross-entropy (specs at the end) take and return tensors by name. The forward
 * writes per row its log-sum-exp less the target's logit where that is finite (lse) and its loss
 * (0 for both where ignored), and where asked for the loss summed over rows in a fixed order
 * (total; divided by count for reduction "mean") and the rows whose target is not ignore_index
 * (count). The backward takes grad_loss of the target's shape (any strides) or 0-d (every row's),
 * and count to divide by for reduction "mean"; its grad_logits must not share memory with logits:
 * every element of a row depends on the row's target logit, which other threads of the row read.
 * cross_entropy_fwd_bwd is both in one pass over each row (no lse kept; grad_loss None: 1 for
 * every row), and its grad_logits may be logits itself (the same view), the gradient then
 * replacing the logits.
 *
 * A fourth op, linear_cross_entropy_scale, is linear_cross_entropy's backward: the gradients its
 * forward computed (float32 accumulators, or in the parameters' dtype) times the loss's upstream
 * gradient, rounded once into the parameters' dtype (brrr_cuda.h), elementwise over contiguous
 * tensors, in place or into a narrower dtype.
 *
 * A target outside [0, C) that is not ignore_index raises ValueError on the CPU; on CUDA, where
 * checking would mean a device-to-host sync, that row's loss and gradient are NaN.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "op.h"

#include <float.h>
#include <math.h>
#include <numpy/arrayobject.h>
#include <string.h>

#include "cpu.h"
#include "cpu_math.h"

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
 * Rows are shared out between threads (xent_cpu.inc: float math for every dtype but float64, sums
 * in double); the total adds the rows' losses in row order afterwards, so every result is
 * bitwise the same whatever the thread count. */

/* The logit the loss sees (brrr_cuda.h): softcap * tanh(v / softcap), or v without a softcap. */
static double capped(const brrr_xent_launch *L, double v) { return L->softcap != 0.0 ? L->softcap * tanh(v / L->softcap) : v; }

static double shift_of(double z_t) { return isfinite(z_t) ? z_t : 0.0; }

static double grad_scale(const brrr_xent_launch *L, int64_t r, double divisor) {
    const int32_t acc = acc_dtype(L->dtype);
    return (L->grad_loss ? brrr_load_f64(acc, L->grad_loss, row_offset(L, L->grad_loss_rows, r)) : 1.0) / divisor;
}

typedef struct {
    const brrr_xent_launch *L;
    int forward; /* lse and loss (and the gradient with grad_logits); else the backward alone */
} xent_work;

#define XENT_LANES 16

#include "cpu_real_f32.h"
#include "xent_cpu.inc"
#include "cpu_real_end.h"
#include "cpu_real_f64.h"
#include "xent_cpu.inc"
#include "cpu_real_end.h"

static void cpu_xent(const brrr_xent_launch *L, int forward) {
    const xent_work w = {L, forward};
    const int64_t passes = L->grad_logits ? (forward ? 2 : 1) + 1 : 1; /* reads of the row, plus the write */
    brrr_cpu_parallel_for(L->rows, passes * L->classes, L->dtype == BRRR_F64 ? xent_rows_f64 : xent_rows_f32, (void *)&w);
    if (!forward || (L->total == NULL && L->count_out == NULL)) return;
    const int32_t acc = acc_dtype(L->dtype);
    double sum = 0.0;
    int64_t counted = 0;
    for (int64_t r = 0; r < L->rows; r++) {
        sum += brrr_load_f64(acc, L->loss, r);
        counted += load_index(L->target_dtype, L->target, row_offset(L, L->target_rows, r)) != L->ignore_index;
    }
    if (L->total) brrr_store_f64(acc, L->total, 0, L->mean ? sum / (double)counted : sum);
    if (L->count_out) brrr_store_f64(acc, L->count_out, 0, (double)counted);
}

/* ---- layout and launch ------------------------------------------------------------------------- */

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
    if (brrr_check_view_dims("logits", n) < 0) return -1;
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

enum { F_LOGITS, F_TARGET, F_LSE, F_LOSS, F_TOTAL, F_COUNT };             /* forward slots */
enum { B_LOGITS, B_TARGET, B_LSE, B_GRAD_LOSS, B_COUNT, B_GRAD_LOGITS };  /* backward slots */
enum { FB_LOGITS, FB_TARGET, FB_LOSS, FB_GRAD_LOSS, FB_COUNT, FB_GRAD_LOGITS }; /* forward + backward slots */
enum { A_IGNORE_INDEX, A_SMOOTHING, A_SOFTCAP, A_Z_LOSS, A_REDUCTION };
typedef enum { XENT_FWD, XENT_BWD, XENT_FWD_BWD } xent_mode;

static int xent_check(brrr_op_call *c) {
    const brrr_tensor *logits = &c->t[0];
    if (logits->ndim == 0 || logits->shape[logits->ndim - 1] == 0) {
        PyErr_SetString(PyExc_ValueError, "argument logits: expected a tensor of shape (..., classes) with at least "
                        "one class");
        return -1;
    }
    return 0;
}

/* grad_loss: the target's shape, or 0-d (the same for every row). */
static int check_grad_loss(const brrr_op_call *c, int slot) {
    const brrr_tensor *g = &c->t[slot];
    return g->name == NULL || g->ndim == 0 ? 0 : brrr_check_same_shape(g, &c->t[1]);
}

static int xent_bwd_check(brrr_op_call *c) { return xent_check(c) < 0 ? -1 : check_grad_loss(c, B_GRAD_LOSS); }
static int xent_fwd_bwd_check(brrr_op_call *c) { return xent_check(c) < 0 ? -1 : check_grad_loss(c, FB_GRAD_LOSS); }

static int xent_run(brrr_op_call *c, xent_mode mode) {
    const brrr_tensor *logits = &c->t[0], *target = &c->t[1];
    brrr_xent_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = logits->dtype;
    L.target_dtype = target->dtype;
    L.classes = logits->shape[logits->ndim - 1];
    L.rows = target->numel;
    L.ignore_index = c->arg[A_IGNORE_INDEX].i;
    L.smoothing = c->arg[A_SMOOTHING].f;
    L.softcap = c->arg[A_SOFTCAP].f;
    L.z_loss = c->arg[A_Z_LOSS].f;
    L.logits = logits->data;
    L.target = target->data;
    L.logits_class_stride = logits->strides[logits->ndim - 1];
    const brrr_tensor *grad = NULL, *grad_loss = NULL;
    if (mode == XENT_FWD) {
        L.mean = c->arg[A_REDUCTION].i == 0;
        L.lse = c->t[F_LSE].data;
        L.loss = c->t[F_LOSS].data;
        L.total = c->t[F_TOTAL].data;
        L.count_out = c->t[F_COUNT].data;
    } else {
        const int g = mode == XENT_BWD ? B_GRAD_LOGITS : FB_GRAD_LOGITS;
        grad = &c->t[g];
        grad_loss = &c->t[mode == XENT_BWD ? B_GRAD_LOSS : FB_GRAD_LOSS];
        L.lse = mode == XENT_BWD ? c->t[B_LSE].data : NULL;
        L.loss = mode == XENT_BWD ? NULL : c->t[FB_LOSS].data;
        L.count = c->t[mode == XENT_BWD ? B_COUNT : FB_COUNT].data;
        L.grad_loss = grad_loss->data;
        L.grad_logits = grad->data;
        L.grad_class_stride = grad->strides[logits->ndim - 1];
    }
    const brrr_tensor *views[4] = {logits, target, grad, grad_loss && grad_loss->ndim ? grad_loss : NULL};
    int64_t *strides[4] = {L.logits_rows, L.target_rows, L.grad_rows, L.grad_loss_rows};
    if (xent_layout(&L, target, views, strides, 4) < 0) return -1;
    if (brrr_on_cpu(c)) {
        if (check_targets(&L) < 0) return -1;
        BRRR_CPU_BEGIN(c) cpu_xent(&L, mode != XENT_BWD); /* with grad_logits: the gradient too */
        BRRR_CPU_END
        return 0;
    }
    if (mode == XENT_BWD) BRRR_RETURN_CUDA(c, brrr_cuda_xent_bwd, &L);
    BRRR_RETURN_CUDA(c, brrr_cuda_xent_fwd, &L);
}

static int xent_fwd_run(brrr_op_call *c) { return xent_run(c, XENT_FWD); }
static int xent_bwd_run(brrr_op_call *c) { return xent_run(c, XENT_BWD); }
static int xent_fwd_bwd_run(brrr_op_call *c) { return xent_run(c, XENT_FWD_BWD); }

static const char *const REDUCTIONS[] = {"mean", "sum", "none", NULL};
#define ROW_STAT(name) {name, BRRR_WRITE | BRRR_ALLOC | BRRR_CONTIG, BRRR_SHAPE_ROWS, BRRR_DTYPE_ACC, -1}
#define SUM(name) {name, BRRR_WRITE | BRRR_OPTIONAL | BRRR_ALLOC, BRRR_SHAPE_SCALAR, BRRR_DTYPE_ACC, -1}
#define IGNORE_INDEX {"ignore_index", BRRR_ARG_INT, -0x1p63, 0x1p63, NULL, "an int64"} /* every int64 */
#define SMOOTHING {"label_smoothing", BRRR_ARG_FLOAT, 0, 1, NULL, "a float in [0, 1]"}
#define SOFTCAP {"softcap", BRRR_ARG_OPTIONAL_FLOAT, DBL_MIN, DBL_MAX, NULL, "None or a finite float > 0", 1, 0.0}
#define Z_LOSS {"z_loss", BRRR_ARG_FLOAT, 0, DBL_MAX, NULL, "a finite float >= 0", 1, 0.0}

static const brrr_op_spec FORWARD = {
    .name = "cross_entropy_fwd",
    .doc = "Softmax cross-entropy over the last dim of logits (..., C) with a class index per row in target: per "
           "row lse and loss, and where asked for (True allocates them) the loss summed over rows (total) and "
           "the rows not ignored (count).",
    .n_slots = 6,
    .slots = {{"logits", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"target", 0, BRRR_SHAPE_ROWS, BRRR_DTYPE_INDEX, -1},
              ROW_STAT("lse"), ROW_STAT("loss"), SUM("total"), SUM("count")},
    .n_args = 5,
    .args = {IGNORE_INDEX, SMOOTHING, SOFTCAP, Z_LOSS,
             {"reduction", BRRR_ARG_CHOICE, 0, 0, REDUCTIONS, "'mean', 'sum' or 'none'"}},
    .split_arg = -1,
    .check = xent_check,
    .run = xent_fwd_run,
};

static const brrr_op_spec BACKWARD = {
    .name = "cross_entropy_bwd",
    .doc = "The gradient of cross_entropy_fwd's loss with respect to logits, rematerialising the softmax from "
           "logits and the saved lse; grad_loss per row or 0-d, count to divide by for reduction 'mean'.",
    .n_slots = 6,
    .slots = {{"logits", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"target", 0, BRRR_SHAPE_ROWS, BRRR_DTYPE_INDEX, -1},
              {"lse", BRRR_CONTIG, BRRR_SHAPE_ROWS, BRRR_DTYPE_ACC, -1},
              {"grad_loss", 0, BRRR_SHAPE_FAMILY, BRRR_DTYPE_ACC, -1},
              {"count", BRRR_OPTIONAL, BRRR_SHAPE_SCALAR, BRRR_DTYPE_ACC, -1},
              {"grad_logits", BRRR_WRITE | BRRR_ALLOC, BRRR_SHAPE_X, BRRR_DTYPE_X, -1}},
    .n_args = 4,
    .args = {IGNORE_INDEX, SMOOTHING, SOFTCAP, Z_LOSS},
    .split_arg = -1,
    .check = xent_bwd_check,
    .run = xent_bwd_run,
};

static const brrr_op_spec FORWARD_BACKWARD = {
    .name = "cross_entropy_fwd_bwd",
    .doc = "cross_entropy_fwd's per-row loss and cross_entropy_bwd's gradient in one pass over each row (no lse "
           "kept); grad_loss None: 1 for every row. grad_logits may be logits itself: the gradient replaces them.",
    .n_slots = 6,
    .slots = {{"logits", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"target", 0, BRRR_SHAPE_ROWS, BRRR_DTYPE_INDEX, -1},
              ROW_STAT("loss"),
              {"grad_loss", BRRR_OPTIONAL, BRRR_SHAPE_FAMILY, BRRR_DTYPE_ACC, -1},
              {"count", BRRR_OPTIONAL, BRRR_SHAPE_SCALAR, BRRR_DTYPE_ACC, -1},
              {"grad_logits", BRRR_WRITE | BRRR_ALLOC | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_X, -1}},
    .n_args = 4,
    .args = {IGNORE_INDEX, SMOOTHING, SOFTCAP, Z_LOSS},
    .split_arg = -1,
    .check = xent_fwd_bwd_check,
    .run = xent_fwd_bwd_run,
};

/* ---- linear_cross_entropy's backward: out = acc * factor, rounded once (brrr_cuda.h) ----------- */

enum { S_ACC, S_FACTOR, S_OUT };

/* The CPU twin over blocks [begin, end) of BRRR_CPU_BLOCK elements: the product in float (double
 * for a float64 acc), stored through brrr_cpu_store_*, which rounds to nearest even (double into a
 * half type through float, as PyTorch converts). Each block is read whole before it is written, so
 * out may be acc itself. */
BRRR_SIMD static void scale_blocks(void *ctx, int64_t begin, int64_t end) {
    const brrr_xent_scale_launch *L = ctx;
    const int64_t in_size = (int64_t)brrr_dtype_size(L->dtype), out_size = (int64_t)brrr_dtype_size(L->out_dtype);
    const int wide = L->dtype == BRRR_F64;
    const double g64 = L->factor ? brrr_load_f64(L->factor_dtype, L->factor, 0) : 1.0;
    const float g32 = (float)g64; /* exact: a float64 factor comes only with a float64 acc */
    _Alignas(64) double v64[BRRR_CPU_BLOCK];
    _Alignas(64) float v32[BRRR_CPU_BLOCK];
    for (int64_t b = begin; b < end; b++) {
        const int64_t i0 = b * BRRR_CPU_BLOCK, n = L->n - i0 < BRRR_CPU_BLOCK ? L->n - i0 : BRRR_CPU_BLOCK;
        const char *src = (const char *)L->acc + i0 * in_size;
        char *dst = (char *)L->out + i0 * out_size;
        if (wide) {
            brrr_cpu_load_f64(L->dtype, src, 1, n, v64);
            for (int64_t i = 0; i < n; i++) v64[i] *= g64;
            brrr_cpu_store_f64(L->out_dtype, dst, 1, n, v64);
        } else {
            brrr_cpu_load_f32(L->dtype, src, 1, n, v32);
            for (int64_t i = 0; i < n; i++) v32[i] *= g32;
            brrr_cpu_store_f32(L->out_dtype, dst, 1, n, v32);
        }
    }
}

static int check_contiguous(const brrr_tensor *t) {
    int64_t expect = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->strides[d] != expect) {
            PyErr_Format(PyExc_ValueError, "argument %s: must be contiguous", t->name);
            return -1;
        }
        expect *= t->shape[d];
    }
    return 0;
}

static int scale_check(brrr_op_call *c) {
    const brrr_tensor *acc = &c->t[S_ACC], *out = &c->t[S_OUT], *factor = &c->t[S_FACTOR];
    if (out->dtype != acc->dtype && acc->dtype != BRRR_F64 &&
        !(acc->dtype == BRRR_F32 && (out->dtype == BRRR_BF16 || out->dtype == BRRR_F16))) {
        PyErr_Format(PyExc_ValueError, "argument out: dtype %s does not go with acc of dtype %s (expected %s%s)",
                     brrr_dtype_name(out->dtype), brrr_dtype_name(acc->dtype), brrr_dtype_name(acc->dtype),
                     acc->dtype == BRRR_F32 ? ", bfloat16 or float16" : "");
        return -1;
    }
    if (acc->numel > 1 && (check_contiguous(acc) < 0 || check_contiguous(out) < 0)) return -1;
    if (!brrr_has(c, S_FACTOR)) return 0;
    if (factor->numel != 1) {
        PyErr_Format(PyExc_ValueError, "argument factor: expected a tensor of one element, got %lld",
                     (long long)factor->numel);
        return -1;
    }
    if (factor->dtype == BRRR_F64 && acc->dtype != BRRR_F64) {
        PyErr_Format(PyExc_ValueError, "argument factor: dtype float64 goes only with a float64 acc (the product "
                     "is taken in float32 for acc of dtype %s)", brrr_dtype_name(acc->dtype));
        return -1;
    }
    return 0;
}

static int scale_run(brrr_op_call *c) {
    const brrr_tensor *acc = &c->t[S_ACC], *out = &c->t[S_OUT], *factor = &c->t[S_FACTOR];
    brrr_xent_scale_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = acc->dtype;
    L.out_dtype = out->dtype;
    L.n = acc->numel;
    L.acc = acc->data;
    L.out = out->data;
    if (brrr_has(c, S_FACTOR)) {
        L.factor = factor->data;
        L.factor_dtype = factor->dtype;
    }
    if (brrr_on_cpu(c)) {
        BRRR_CPU_BEGIN(c)
        brrr_cpu_parallel_for((L.n + BRRR_CPU_BLOCK - 1) / BRRR_CPU_BLOCK, 2 * BRRR_CPU_BLOCK, scale_blocks, &L);
        BRRR_CPU_END
        return 0;
    }
    BRRR_RETURN_CUDA(c, brrr_cuda_xent_scale, &L);
}

static const brrr_op_spec SCALE = {
    .name = "linear_cross_entropy_scale",
    .doc = "out = acc * factor (factor None: 1), the product in float32 (float64 for a float64 acc) rounded once "
           "into out's dtype: the bits of torch.mul(acc, factor.reshape(1)).to(out.dtype). acc and out "
           "contiguous, of one shape; out in acc's dtype (it may be acc itself) or, for a float32 or float64 acc, "
           "a narrower one; factor one element, float64 only with a float64 acc. linear_cross_entropy's backward, "
           "which scales the gradients its forward computed.",
    .n_slots = 3,
    .slots = {{"acc", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"factor", BRRR_OPTIONAL, BRRR_SHAPE_FAMILY, BRRR_DTYPE_ANY, -1},
              {"out", BRRR_WRITE | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_ANY, -1}},
    .split_arg = -1,
    .check = scale_check,
    .run = scale_run,
};

const brrr_op_spec *const brrr_xent_ops[] = {&FORWARD, &BACKWARD, &FORWARD_BACKWARD, &SCALE, NULL};
