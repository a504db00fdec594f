/* Rotary position embedding: the glue and the CPU twin (formulas: brrr_cuda.h).
 *
 * _C.rotary(x, cos, sin, out=None, backward, interleaved=False, rotary_dim=0) -> (out,) and
 * _C.rotary_pair(x, cos, sin, out=None, x2, out2, backward, interleaved=False, rotary_dim=0) -> (out, out2):
 * see the specs at the end.
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
        for (int64_t p = 0; p < h; p++) {
            const int64_t e0 = L->interleaved ? 2 * p : p, e1 = L->interleaved ? 2 * p + 1 : p + h;
            const int64_t a0 = L->pair_angles ? p : e0, a1 = L->pair_angles ? p : e1;
            const double a = brrr_load_f64(dt, L->x.data, ox + e0 * cs[0]), b = brrr_load_f64(dt, L->x.data, ox + e1 * cs[0]);
            const double c0 = brrr_load_f64(dt, L->cos.data, oc + a0 * cs[2]), c1 = brrr_load_f64(dt, L->cos.data, oc + a1 * cs[2]);
            const double s0 = brrr_load_f64(dt, L->sin.data, os + a0 * cs[3]), s1 = brrr_load_f64(dt, L->sin.data, os + a1 * cs[3]);
            double lo, hi;
            if (dt == BRRR_F64) {
                lo = L->backward ? a * c0 + b * s1 : a * c0 - b * s0;
                hi = L->backward ? b * c1 - a * s0 : b * c1 + a * s1;
            } else { /* float32 products and sums, as the kernels */
                const float fa = (float)a, fb = (float)b;
                lo = L->backward ? (double)(fa * (float)c0 + fb * (float)s1) : (double)(fa * (float)c0 - fb * (float)s0);
                hi = L->backward ? (double)(fb * (float)c1 - fa * (float)s0) : (double)(fb * (float)c1 + fa * (float)s1);
            }
            brrr_store_f64(dt, L->out.data, oo + e0 * cs[1], lo);
            brrr_store_f64(dt, L->out.data, oo + e1 * cs[1], hi);
        }
        for (int64_t j = 2 * h; j < 2 * h + L->pass; j++) /* exact: every dtype round-trips through double */
            brrr_store_f64(dt, L->out.data, oo + j * cs[1], brrr_load_f64(dt, L->x.data, ox + j * cs[0]));
    }
}

/* The pair's second tensor as a launch of its own. */
static brrr_rotary_launch second_of(const brrr_rotary_launch *L) {
    brrr_rotary_launch S = *L;
    S.pair = 0;
    S.row_ndim = L->row_ndim2;
    S.rows = L->rows2;
    memcpy(S.row_shape, L->row_shape2, sizeof S.row_shape);
    S.x = L->x2;
    S.out = L->out2;
    S.cos = L->cos2;
    S.sin = L->sin2;
    memcpy(S.col_stride, L->col_stride2, sizeof S.col_stride);
    return S;
}

/* Rows on the call's threads; the pair's second tensor after the first. */
static void cpu_rotary(const brrr_rotary_launch *L) {
    brrr_cpu_parallel_for(L->rows, 2 * L->half + L->pass, rotary_rows, (void *)L);
    if (L->pair) {
        brrr_rotary_launch S = second_of(L);
        brrr_cpu_parallel_for(S.rows, 2 * S.half + S.pass, rotary_rows, &S);
    }
}

/* rotary_pair's slots extend rotary's: x2 and out2 after the four they share. */
enum { S_X, S_COS, S_SIN, S_OUT, S_X2, S_OUT2 };
enum { A_BACKWARD, A_INTERLEAVED, A_ROTARY_DIM };

/* The rotated features of x's last dim: rotary_dim, or (0) cos's last dim (an angle per feature). */
static int64_t rotary_dim(const brrr_op_call *c) {
    const brrr_tensor *cos = &c->t[S_COS];
    return c->arg[A_ROTARY_DIM].i ? c->arg[A_ROTARY_DIM].i : cos->shape[cos->ndim - 1];
}

/* cos or sin: broadcastable to x's shape, with last dim `last`. */
static int check_angle(const brrr_tensor *t, const brrr_tensor *x, int64_t last, const char *what) {
    int ok = t->ndim >= 1 && t->ndim <= x->ndim && t->shape[t->ndim - 1] == last;
    for (int d = 1; ok && d < t->ndim; d++) {
        const int64_t size = t->shape[t->ndim - 1 - d], want = x->shape[x->ndim - 1 - d];
        ok = size == want || size == 1;
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "argument %s: shape must broadcast to %s's shape with last dim %s (%lld)", t->name,
                     x->name, what, (long long)last);
        return -1;
    }
    return 0;
}

/* rotary_pair's x2 and out2: x2 with x's last dim, the angles broadcast to it as to x, out2 of
 * x2's shape. Each output may be its own input (in place), not the other's, which a thread of the
 * other tensor would read after this one's write. */
static int check_second(const brrr_op_call *c, int64_t last) {
    const brrr_tensor *x = &c->t[S_X], *x2 = &c->t[S_X2], *out2 = &c->t[S_OUT2];
    if (x2->ndim == 0 || x2->shape[x2->ndim - 1] != x->shape[x->ndim - 1]) {
        PyErr_Format(PyExc_ValueError, "argument x2: expected a tensor of shape (..., %lld), x's last dim",
                     (long long)x->shape[x->ndim - 1]);
        return -1;
    }
    if (check_angle(&c->t[S_COS], x2, last, "as for x") < 0 || check_angle(&c->t[S_SIN], x2, last, "as for x") < 0)
        return -1;
    int same = out2->ndim == x2->ndim;
    for (int d = 0; same && d < x2->ndim; d++) same = out2->shape[d] == x2->shape[d];
    if (!same) {
        PyErr_Format(PyExc_ValueError, "argument out2: expected x2's shape");
        return -1;
    }
    /* The second pass reads cos and sin again: neither output may be one of them, even exactly. */
    const int outputs[] = {S_OUT, S_OUT2}, angles[] = {S_COS, S_SIN};
    for (int o = 0; o < 2; o++)
        for (int a = 0; a < 2; a++)
            if (brrr_check_no_overlap(&c->t[outputs[o]], &c->t[angles[a]], 0) < 0) return -1;
    if (x->numel && x2->numel && (c->t[S_OUT].data == x2->data || out2->data == x->data)) {
        PyErr_Format(PyExc_ValueError, "argument %s: may be %s itself (in place), not %s",
                     c->t[S_OUT].data == x2->data ? "out" : "out2", c->t[S_OUT].data == x2->data ? "x" : "x2",
                     c->t[S_OUT].data == x2->data ? "x2" : "x");
        return -1;
    }
    return 0;
}

static int rotary_check(brrr_op_call *c) {
    const brrr_tensor *x = &c->t[S_X], *cos = &c->t[S_COS];
    if (x->ndim == 0 || cos->ndim == 0) {
        PyErr_Format(PyExc_ValueError, "argument %s: expected a tensor of shape (..., D)", x->ndim ? "cos" : "x");
        return -1;
    }
    const int64_t d = x->shape[x->ndim - 1], r = rotary_dim(c);
    if (c->arg[A_ROTARY_DIM].i && (r % 2 != 0 || r > d)) {
        PyErr_Format(PyExc_ValueError, "argument rotary_dim: expected an even int <= x's last dim (%lld), got %lld",
                     (long long)d, (long long)r);
        return -1;
    }
    if (r > d || (r == d && d % 2 != 0)) {
        PyErr_Format(PyExc_ValueError, "argument x: expected a tensor of shape (..., D) with D even and at least cos's "
                     "last dim (%lld)", (long long)r);
        return -1;
    }
    if (r % 2 != 0) {
        PyErr_Format(PyExc_ValueError, "argument cos: its last dim (the features rotated) must be even, got %lld",
                     (long long)r);
        return -1;
    }
    /* cos decides: one angle per rotated feature, or one per pair; sin must be alike */
    const int pairs = cos->ndim >= 1 && cos->shape[cos->ndim - 1] == r / 2;
    if (check_angle(cos, x, pairs ? r / 2 : r, pairs ? "rotary_dim / 2" : "rotary_dim (or rotary_dim / 2)") < 0) return -1;
    if (check_angle(&c->t[S_SIN], x, pairs ? r / 2 : r, pairs ? "rotary_dim / 2, as cos" : "rotary_dim, as cos") < 0)
        return -1;
    if (c->spec->n_slots > S_X2) return check_second(c, pairs ? r / 2 : r);
    return 0;
}

/* The rows of x (slot sx) and out (slot so) with the angles, coalesced: their count, shape and
 * each view's row strides (cos and sin broadcast, stride 0, where they lack a dim or have size 1)
 * and last dim's stride. */
static int lay_out(const brrr_op_call *c, int sx, int so, int32_t *row_ndim, int64_t *rows, int64_t *row_shape,
                   brrr_view *views[4], int64_t *col_stride) {
    const brrr_tensor *x = &c->t[sx];
    const int lead = x->ndim - 1, slots[4] = {sx, so, S_COS, S_SIN};
    int64_t shape[BRRR_MAX_RANK], strides[4][BRRR_MAX_RANK];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)lead);
    for (int k = 0; k < 4; k++) {
        const brrr_tensor *t = &c->t[slots[k]];
        for (int dim = 0; dim < lead; dim++) {
            const int td = dim - (x->ndim - t->ndim); /* t's dim aligned with x's dim `dim`, from the right */
            strides[k][dim] = td >= 0 && t->shape[td] != 1 ? t->strides[td] : 0;
        }
        col_stride[k] = t->strides[t->ndim - 1];
    }
    int n = lead ? brrr_coalesce(x->name, lead, shape, 4, strides) : 0;
    if (n < 0) return -1;
    if (n == 0) {
        shape[0] = 1;
        for (int k = 0; k < 4; k++) strides[k][0] = 0;
        n = 1;
    }
    *row_ndim = n;
    *rows = x->numel / x->shape[lead];
    memcpy(row_shape, shape, sizeof(int64_t) * (size_t)n);
    for (int k = 0; k < 4; k++) {
        views[k]->data = c->t[slots[k]].data;
        memcpy(views[k]->strides, strides[k], sizeof(int64_t) * (size_t)n);
    }
    return 0;
}

static int rotary_run(brrr_op_call *c) {
    const brrr_tensor *x = &c->t[S_X], *cos = &c->t[S_COS];
    const int pair = c->spec->n_slots > S_X2 && c->t[S_X2].numel > 0;
    if (x->numel == 0 && !pair) return 0;
    const int64_t d = x->shape[x->ndim - 1], r = rotary_dim(c);
    brrr_rotary_launch L;
    memset(&L, 0, sizeof L);
    L.dtype = x->dtype;
    L.backward = (int32_t)c->arg[A_BACKWARD].i;
    L.interleaved = (int32_t)c->arg[A_INTERLEAVED].i;
    L.pair_angles = cos->shape[cos->ndim - 1] != r;
    L.half = r / 2;
    /* out is x itself (the only overlap allowed): in place, nothing to copy; a pair copies unless
     * both are in place (a copy onto itself changes nothing) */
    int in_place = c->t[S_OUT].data == x->data;
    if (pair) in_place = in_place && c->t[S_OUT2].data == c->t[S_X2].data;
    L.pass = in_place ? 0 : d - r;
    if (x->numel == 0) { /* the second alone */
        brrr_view *v[4] = {&L.x, &L.out, &L.cos, &L.sin};
        if (lay_out(c, S_X2, S_OUT2, &L.row_ndim, &L.rows, L.row_shape, v, L.col_stride) < 0) return -1;
    } else {
        brrr_view *v[4] = {&L.x, &L.out, &L.cos, &L.sin};
        if (lay_out(c, S_X, S_OUT, &L.row_ndim, &L.rows, L.row_shape, v, L.col_stride) < 0) return -1;
        if (pair) {
            brrr_view *v2[4] = {&L.x2, &L.out2, &L.cos2, &L.sin2};
            L.pair = 1;
            if (lay_out(c, S_X2, S_OUT2, &L.row_ndim2, &L.rows2, L.row_shape2, v2, L.col_stride2) < 0) return -1;
        }
    }
    if (brrr_on_cpu(c)) {
        BRRR_RUN_CPU(c, cpu_rotary, &L);
        return 0;
    }
    BRRR_RETURN_CUDA(c, brrr_cuda_rotary, &L);
}

/* The slots and arguments rotary and rotary_pair share (rotary_pair adds x2 and out2). */
#define ROTARY_SLOTS                                                                                               \
    {"x", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},                                                                      \
    {"cos", 0, BRRR_SHAPE_FAMILY, BRRR_DTYPE_X, -1},                                                               \
    {"sin", 0, BRRR_SHAPE_FAMILY, BRRR_DTYPE_X, -1},                                                               \
    {"out", BRRR_WRITE | BRRR_ALLOC | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_X, -1}
#define ROTARY_ARGS                                                                                                \
    {{"backward", BRRR_ARG_BOOL, 0, 0, NULL, "a bool"},                                                            \
     {"interleaved", BRRR_ARG_BOOL, 0, 0, NULL, "a bool", 1, 0},                                                   \
     {"rotary_dim", BRRR_ARG_INT, 0, 4611686018427387904.0, NULL, "an int >= 0 (0: cos's last dim)", 1, 0}}

static const brrr_op_spec ROTARY = {
    .name = "rotary",
    .doc = "x * cos + rotate_half(x) * sin over the first rotary_dim features of x's last dim (the rest copied from "
           "x), pairing feature j with j + rotary_dim / 2, or 2p with 2p + 1 when interleaved. cos and sin broadcast "
           "to x's shape with last dim rotary_dim (an angle per feature) or rotary_dim / 2 (one per pair); rotary_dim "
           "0: cos's last dim, an angle per feature. backward: the transposed rotation (the gradient with respect to "
           "x, given x = grad_out). out may be x itself.",
    .n_slots = 4,
    .slots = {ROTARY_SLOTS},
    .n_args = 3,
    .args = ROTARY_ARGS,
    .split_arg = -1,
    .check = rotary_check,
    .run = rotary_run,
};

static const brrr_op_spec ROTARY_PAIR = {
    .name = "rotary_pair",
    .doc = "rotary of x into out and of x2 into out2 on the same cos and sin, in one launch where the layouts "
           "allow (q and k: a position's heads of both on the angles read once): x2 has x's last dim and any "
           "leading dims the angles broadcast to (k's heads may be fewer than q's). out may be x itself, out2 x2 "
           "itself.",
    .n_slots = 6,
    .slots = {ROTARY_SLOTS,
              {"x2", 0, BRRR_SHAPE_FAMILY, BRRR_DTYPE_X, -1},
              {"out2", BRRR_WRITE | BRRR_INPLACE, BRRR_SHAPE_FAMILY, BRRR_DTYPE_X, -1}},
    .n_args = 3,
    .args = ROTARY_ARGS,
    .split_arg = -1,
    .check = rotary_check,
    .run = rotary_run,
};

const brrr_op_spec *const brrr_rotary_ops[] = {&ROTARY, &ROTARY_PAIR, NULL};
