/* Rotary position embedding: the glue and the CPU twin (formulas: brrr_cuda.h).
 *
 * _C.rotary(x, cos, sin, out=None, backward) -> (out,): see the spec at the end.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "op.h"
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

/* cos or sin: broadcastable to x's shape, D as its last dim. */
static int check_angle(const brrr_tensor *t, const brrr_tensor *x) {
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

enum { S_X, S_COS, S_SIN, S_OUT };

static int rotary_check(brrr_op_call *c) {
    const brrr_tensor *x = &c->t[S_X];
    if (x->ndim == 0 || x->shape[x->ndim - 1] % 2 != 0) {
        PyErr_SetString(PyExc_ValueError, "argument x: expected a tensor of shape (..., D) with D even");
        return -1;
    }
    return check_angle(&c->t[S_COS], x) < 0 || check_angle(&c->t[S_SIN], x) < 0 ? -1 : 0;
}

static int rotary_run(brrr_op_call *c) {
    const brrr_tensor *x = &c->t[S_X];
    if (x->numel == 0) return 0;
    brrr_rotary_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = x->dtype;
    L.backward = (int32_t)c->arg[0].i;
    L.half = x->shape[x->ndim - 1] / 2;
    L.rows = x->numel / (2 * L.half);
    /* Leading dims: x's, with cos and sin broadcast (stride 0) where they lack or have size 1. */
    const int lead = x->ndim - 1, slots[4] = {S_X, S_OUT, S_COS, S_SIN};
    int64_t shape[BRRR_MAX_RANK], strides[4][BRRR_MAX_RANK];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)lead);
    for (int k = 0; k < 4; k++) {
        const brrr_tensor *t = &c->t[slots[k]];
        for (int d = 0; d < lead; d++) {
            const int td = d - (x->ndim - t->ndim); /* t's dim aligned with x's dim d, from the right */
            strides[k][d] = td >= 0 && t->shape[td] != 1 ? t->strides[td] : 0;
        }
        L.col_stride[k] = t->strides[t->ndim - 1];
    }
    int n = lead ? brrr_coalesce("x", lead, shape, 4, strides) : 0;
    if (n < 0) return -1;
    if (n == 0) {
        shape[0] = 1;
        for (int k = 0; k < 4; k++) strides[k][0] = 0;
        n = 1;
    }
    L.row_ndim = n;
    memcpy(L.row_shape, shape, sizeof(int64_t) * (size_t)n);
    brrr_view *v[4] = {&L.x, &L.out, &L.cos, &L.sin};
    for (int k = 0; k < 4; k++) {
        v[k]->data = c->t[slots[k]].data;
        memcpy(v[k]->strides, strides[k], sizeof(int64_t) * (size_t)n);
    }
    if (brrr_on_cpu(c)) {
        BRRR_RUN_CPU(cpu_rotary, &L);
        return 0;
    }
    BRRR_RETURN_CUDA(c, brrr_cuda_rotary, &L);
}

static const brrr_op_spec ROTARY = {
    .name = "rotary",
    .doc = "x * cos + rotate_half(x) * sin over x's last dim D (even); cos and sin broadcast to x's shape with D as "
           "their last dim. backward: the transposed rotation (the gradient with respect to x, given x = grad_out). "
           "out may be x itself.",
    .n_slots = 4,
    .slots = {{"x", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"cos", 0, BRRR_SHAPE_FAMILY, BRRR_DTYPE_X, -1},
              {"sin", 0, BRRR_SHAPE_FAMILY, BRRR_DTYPE_X, -1},
              {"out", BRRR_WRITE | BRRR_ALLOC | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_X, -1}},
    .n_args = 1,
    .args = {{"backward", BRRR_ARG_BOOL, 0, 0, NULL, "a bool"}},
    .split_arg = -1,
    .check = rotary_check,
    .run = rotary_run,
};

const brrr_op_spec *const brrr_rotary_ops[] = {&ROTARY, NULL};
