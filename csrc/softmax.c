/* Softmax and log-softmax over the last dim: the ops and the CPU twin (formulas: cuda/softmax.cuh).
 *
 * y may be float32 for a float16/bfloat16 x (torch's dtype=float32): the forward writes it so
 * from x in one pass, and the backward reads y and grad_y of that dtype and writes grad_x in x's.
 * The CPU twin computes in float (double for float64) with double sums, rows on threads.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "op.h"

#include "cpu.h"
#include "cpu_math.h"

#include <math.h>
#include <string.h>

#include "softmax.cuh"

static int64_t row_off(const brrr_softmax_launch *L, int k, int64_t r) {
    return brrr_unravel(L->row_ndim, L->row_shape, L->row_strides[k], r);
}

/* ---- CPU twin: rows on threads (softmax_cpu.inc: float math for every dtype but float64, sums
 * in double, in an order fixed by the row length: the same at any thread count) ---- */

#define SOFTMAX_LANES 16
#define SOFTMAX_ROW_KEEP 4096 /* columns: a row's exponentials kept on the stack, 16 or 32 KiB */

#include "cpu_real_f32.h"
#include "softmax_cpu.inc"
#include "cpu_real_end.h"
#include "cpu_real_f64.h"
#include "softmax_cpu.inc"
#include "cpu_real_end.h"

static void cpu_softmax(const brrr_softmax_launch *L) {
    const int f64 = L->x_dtype == BRRR_F64; /* then y is float64 too */
    brrr_cpu_parallel_for(L->rows, L->cols, f64 ? softmax_rows_f64 : softmax_rows_f32, (void *)L);
}

/* Slots: forward x, out; backward y, grad_y, grad_x. */
static int is_backward(const brrr_op_call *c) { return c->spec->n_slots == 3; }

/* y (and grad_y): x's dtype, or float32 for float16/bfloat16 x. */
static int softmax_check(brrr_op_call *c) {
    const int backward = is_backward(c);
    const brrr_tensor *x = &c->t[backward ? 2 : 0], *y = &c->t[backward ? 0 : 1];
    const int half = x->dtype == BRRR_F16 || x->dtype == BRRR_BF16;
    if (y->dtype == x->dtype || (half && y->dtype == BRRR_F32)) return 0;
    const brrr_tensor *out = &c->t[backward ? 2 : 1];
    PyErr_Format(PyExc_ValueError, "argument %s: dtype %s does not go with %s of dtype %s (expected %s)", out->name,
                 brrr_dtype_name(out->dtype), c->t[0].name, brrr_dtype_name(c->t[0].dtype),
                 backward ? (c->t[0].dtype == BRRR_F32 ? "float32, float16 or bfloat16" : brrr_dtype_name(c->t[0].dtype))
                          : (half ? "its dtype or float32" : brrr_dtype_name(c->t[0].dtype)));
    return -1;
}

static int softmax_run(brrr_op_call *c) {
    const int backward = is_backward(c), n = backward ? 3 : 2;
    const brrr_tensor *views[3] = {&c->t[0], backward ? &c->t[1] : NULL, &c->t[n - 1]};
    const brrr_tensor *x = &c->t[0];
    if (x->numel == 0) return 0;
    brrr_softmax_launch L;
    memset(&L, 0, sizeof L);
    L.backward = backward;
    L.log = (int32_t)c->arg[0].i;
    L.x_dtype = views[backward ? 2 : 0]->dtype;
    L.y_dtype = views[backward ? 0 : 2]->dtype;
    L.rows = c->n_rows;
    L.cols = c->n_cols;
    /* Rows merged in order (the kernels index rows logically), columns at each view's stride. */
    const int lead = x->ndim - c->split;
    int64_t shape[BRRR_MAX_RANK], strides[3][BRRR_MAX_RANK];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)lead);
    for (int k = 0; k < 3; k++) {
        const brrr_tensor *t = views[k] ? views[k] : x;
        memcpy(strides[k], t->strides, sizeof(int64_t) * (size_t)lead);
        L.col_stride[k] = c->split ? t->strides[x->ndim - 1] : 1;
    }
    int rows = brrr_merge_in_order(lead, shape, 3, strides);
    if (rows == 0) {
        shape[0] = 1;
        for (int k = 0; k < 3; k++) strides[k][0] = 0;
        rows = 1;
    }
    if (brrr_check_view_dims(x->name, rows) < 0) return -1;
    L.row_ndim = rows;
    memcpy(L.row_shape, shape, sizeof(int64_t) * (size_t)rows);
    for (int k = 0; k < 3; k++) memcpy(L.row_strides[k], strides[k], sizeof(int64_t) * (size_t)rows);
    L.in[0] = views[0]->data;
    L.in[1] = views[1] ? views[1]->data : NULL;
    L.out = views[2]->data;
    if (brrr_on_cpu(c)) {
        BRRR_RUN_CPU(c, cpu_softmax, &L);
        return 0;
    }
    BRRR_RETURN_CUDA(c, brrr_cuda_softmax, &L);
}

#define LOG_ARG {"log", BRRR_ARG_BOOL, 0, 0, NULL, "a bool"}

static const brrr_op_spec SOFTMAX_FWD = {
    .name = "softmax_fwd",
    .doc = "y = softmax(x) over the last dim (log: log_softmax), in one pass; y may be float32 for float16/bfloat16 x.",
    .n_slots = 2,
    .slots = {{"x", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"out", BRRR_WRITE | BRRR_ALLOC | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_ANY, -1}},
    .n_args = 1,
    .args = {LOG_ARG},
    .split_arg = -1,
    .check = softmax_check,
    .run = softmax_run,
};

static const brrr_op_spec SOFTMAX_BWD = {
    .name = "softmax_bwd",
    .doc = "grad_x of softmax_fwd (log: of log_softmax) from its output y and grad_y, in one pass; grad_x may be "
           "float16/bfloat16 for float32 y.",
    .n_slots = 3,
    .slots = {{"y", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"grad_y", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"grad_x", BRRR_WRITE | BRRR_ALLOC | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_ANY, -1}},
    .n_args = 1,
    .args = {LOG_ARG},
    .split_arg = -1,
    .check = softmax_check,
    .run = softmax_run,
};

const brrr_op_spec *const brrr_softmax_ops[] = {&SOFTMAX_FWD, &SOFTMAX_BWD, NULL};
