/* Elementwise chains: the glue and the CPU twin.
 *
 * A chain is a program of steps applied to every element in one pass: unary functions, scalar
 * ops, and add/mul by an operand tensor that has either the input's shape or the shape of its
 * last dim (a bias, broadcast over the other dims). The backward recomputes the program per
 * element from x (nothing else is saved) and applies the chain rule in registers; a bias
 * gradient is a reduction over rows, summed in a fixed order.
 *
 * On CUDA a chain runs as a kernel compiled for its exact steps (chain_jit.c) where NVRTC is
 * found; otherwise the precompiled kernels interpret it, up to BRRR_MAX_CHAIN_STEPS steps.
 *
 * _C.chain_program(steps) -> bytes           validate and pack a program: a chain_header, then
 *                                            n_steps brrr_chain_step
 * _C.chain_partial_rows(rows) -> P           rows of the fp32 scratch a bias gradient needs on CUDA
 * _C.chain_fwd, _C.chain_bwd                 the ops (specs at the end); the operands come as a
 *                                            tuple, one per tensor step, and so do their gradients
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "chain_jit.h"

#include <math.h>
#include <numpy/arrayobject.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "cpu_math.h"

/* float32 math (also for float16 and bfloat16 storage) with cpu_math.h's vectorisable functions;
 * sin and cos of arguments beyond BRRR_TRIG_REDUCED_MAX are redone with libm (block_step_f32). */
#define QUAL static inline
#define FN(name) name##_f32
#define REAL float
#define EXP brrr_expf
#define TANH brrr_tanhf
#define ONE_PLUS_ERF(z) brrr_erfcf(-(z)) /* 1 + erf(z) = erfc(-z): no cancellation in the left tail */
#define ONE_PLUS_ERF_GAUSS(z, g) brrr_erfcf_gauss(-(z), g)
#define COS brrr_cosf_reduced
#define SIN brrr_sinf_reduced
#define SINCOS(x, s, c) brrr_sincosf_reduced(x, s, c)
#define DIV(a, b) ((a) / (b))
#define LOG logf
#define LOG1P log1pf
#define EXPM1 expm1f
#define SQRT sqrtf
#define RSQRT(y) (1.0f / sqrtf(y))
#define POW powf
#define FABS fabsf
#include "chain_math.inc"
#include "chain_math_end.inc"
#undef FN
#define FN(name) name##_f64
#define REAL double
#define EXP exp
#define TANH tanh
#define ONE_PLUS_ERF(z) (1.0 + erf(z))
#define COS cos
#define SIN sin
#define SINCOS(x, s, c) (*(s) = sin(x), *(c) = cos(x))
#define DIV(a, b) ((a) / (b))
#define LOG log
#define LOG1P log1p
#define EXPM1 expm1
#define SQRT sqrt
#define RSQRT(y) (1.0 / sqrt(y))
#define POW pow
#define FABS fabs
#include "chain_math.inc"
#include "chain_math_end.inc"

/* The erf GELU for float16 and bfloat16 storage, whose 11 and 8 bits do not need float32's
 * accuracy: cpu_math.h's erfc and exponential for half storage, about half the float32 cost. */
static inline float gelu_half_fwd_f32(float y) { return 0.5f * y * brrr_erfcf_half(-0.70710678f * y); }
static inline float gelu_half_fwd_grad_f32(float y, float *d) {
    const float cdf = 0.5f * brrr_erfcf_half(-0.70710678f * y);
    *d = cdf + y * 0.39894228f * (brrr_exp_tail_scaled_half(-0.5f * y * y) * 0x1p-64f);
    return y * cdf;
}

static const struct {
    const char *name;
    int op;
    int takes_scalar;
} CHAIN_OPS[] = {
    {"relu", BRRR_OP_RELU, 0},       {"gelu", BRRR_OP_GELU, 0},         {"gelu_tanh", BRRR_OP_GELU_TANH, 0},
    {"silu", BRRR_OP_SILU, 0},       {"sigmoid", BRRR_OP_SIGMOID, 0},   {"tanh", BRRR_OP_TANH, 0},
    {"exp", BRRR_OP_EXP, 0},         {"cos", BRRR_OP_COS, 0},           {"sin", BRRR_OP_SIN, 0},
    {"add", BRRR_OP_ADD_SCALAR, 1},  {"mul", BRRR_OP_MUL_SCALAR, 1},    {"add_tensor", BRRR_OP_ADD_TENSOR, 0},
    {"mul_tensor", BRRR_OP_MUL_TENSOR, 0},
    {"abs", BRRR_OP_ABS, 0},         {"neg", BRRR_OP_NEG, 0},           {"square", BRRR_OP_SQUARE, 0},
    {"sqrt", BRRR_OP_SQRT, 0},       {"rsqrt", BRRR_OP_RSQRT, 0},       {"log", BRRR_OP_LOG, 0},
    {"log1p", BRRR_OP_LOG1P, 0},     {"expm1", BRRR_OP_EXPM1, 0},       {"reciprocal", BRRR_OP_RECIPROCAL, 0},
    {"pow", BRRR_OP_POW, 1},         {"clamp_min", BRRR_OP_CLAMP_MIN, 1}, {"clamp_max", BRRR_OP_CLAMP_MAX, 1},
    {"softplus", BRRR_OP_SOFTPLUS, 0}, {"mish", BRRR_OP_MISH, 0},       {"hardswish", BRRR_OP_HARDSWISH, 0},
    {"leaky_relu", BRRR_OP_LEAKY_RELU, 1},
};
#define N_CHAIN_OPS ((int)(sizeof CHAIN_OPS / sizeof CHAIN_OPS[0]))

static int is_tensor_op(int op) { return op == BRRR_OP_ADD_TENSOR || op == BRRR_OP_MUL_TENSOR; }

/* The head of a program's bytes, followed by n_steps brrr_chain_step. */
typedef struct {
    int32_t n_steps, n_operands;
} chain_header;

PyObject *brrr_py_chain_op_names(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    PyObject *names = PyTuple_New(N_CHAIN_OPS);
    for (int i = 0; names && i < N_CHAIN_OPS; i++) {
        PyObject *s = PyUnicode_FromString(CHAIN_OPS[i].name);
        if (s == NULL) { Py_CLEAR(names); break; }
        PyTuple_SET_ITEM(names, i, s);
    }
    return names;
}

/* steps: a sequence of op names or (name, scalar) pairs. */
PyObject *brrr_py_chain_program(PyObject *module, PyObject *steps) {
    (void)module;
    /* A tuple of its own, holding every step: a list's items are borrowed, and a scalar's __float__
     * (Python code) could empty the list under the loop. */
    PyObject *fast = PySequence_Fast(steps, "argument steps: expected a sequence of steps");
    PyObject *seq = fast ? PySequence_Tuple(fast) : NULL;
    Py_XDECREF(fast);
    if (seq == NULL) return NULL;
    const Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject *bytes = NULL;
    if (n > INT32_MAX / (Py_ssize_t)sizeof(brrr_chain_step)) {
        PyErr_Format(PyExc_ValueError, "argument steps: too many steps (%zd)", n);
        goto fail;
    }
    bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(chain_header) + n * (Py_ssize_t)sizeof(brrr_chain_step));
    if (bytes == NULL) goto fail;
    chain_header h = {(int32_t)n, 0};
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *step = PyTuple_GET_ITEM(seq, k), *name = step, *scalar = NULL;
        if (PyTuple_Check(step)) {
            if (PyTuple_GET_SIZE(step) != 2) {
                PyErr_Format(PyExc_ValueError, "argument steps[%zd]: expected a name or a (name, scalar) pair", k);
                goto fail;
            }
            name = PyTuple_GET_ITEM(step, 0);
            scalar = PyTuple_GET_ITEM(step, 1);
        }
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError, "argument steps[%zd]: expected an op name (str), got %.200s", k,
                         Py_TYPE(name)->tp_name);
            goto fail;
        }
        const char *s = PyUnicode_AsUTF8(name);
        if (s == NULL) goto fail;
        int found = -1;
        for (int i = 0; i < N_CHAIN_OPS; i++)
            if (strcmp(s, CHAIN_OPS[i].name) == 0) found = i;
        if (found < 0) {
            PyErr_Format(PyExc_ValueError, "argument steps[%zd]: unknown op '%s'", k, s);
            goto fail;
        }
        brrr_chain_step st;
        memset(&st, 0, sizeof st);
        st.op = CHAIN_OPS[found].op;
        if (CHAIN_OPS[found].takes_scalar) {
            char arg[48];
            snprintf(arg, sizeof arg, "steps[%zd]", k);
            if (scalar == NULL || brrr_parse_double(scalar, arg, &st.scalar) < 0) {
                if (scalar == NULL || PyErr_ExceptionMatches(PyExc_TypeError)) {
                    PyErr_Clear();
                    PyErr_Format(PyExc_TypeError, "argument %s: '%s' needs a real scalar: ('%s', value)%s", arg, s, s,
                                 scalar && PyBool_Check(scalar) ? ", not a bool" : "");
                }
                goto fail;
            }
        } else if (scalar != NULL) {
            PyErr_Format(PyExc_ValueError, "argument steps[%zd]: '%s' takes no scalar", k, s);
            goto fail;
        }
        if (is_tensor_op(st.op)) {
            if (h.n_operands == BRRR_MAX_CHAIN_OPERANDS) {
                PyErr_Format(PyExc_ValueError, "argument steps: a chain has at most %d tensor steps",
                             BRRR_MAX_CHAIN_OPERANDS);
                goto fail;
            }
            st.operand = h.n_operands++;
        }
        memcpy(PyBytes_AS_STRING(bytes) + sizeof h + (size_t)k * sizeof st, &st, sizeof st);
    }
    memcpy(PyBytes_AS_STRING(bytes), &h, sizeof h);
    Py_DECREF(seq);
    return bytes;
fail:
    Py_XDECREF(bytes);
    Py_DECREF(seq);
    return NULL;
}

/* Programs arrive as bytes from Python; check them as if they were hostile. */
int brrr_chain_parse_program(PyObject *obj, brrr_chain_steps *p) {
    chain_header h;
    const Py_ssize_t size = PyBytes_Check(obj) ? PyBytes_GET_SIZE(obj) : -1;
    if (size < (Py_ssize_t)sizeof h || (size - (Py_ssize_t)sizeof h) % (Py_ssize_t)sizeof(brrr_chain_step) != 0) {
        PyErr_SetString(PyExc_TypeError, "argument program: expected the bytes returned by chain_program()");
        return -1;
    }
    memcpy(&h, PyBytes_AS_STRING(obj), sizeof h);
    p->n_steps = h.n_steps;
    p->n_operands = h.n_operands;
    p->steps = NULL;
    int operands = 0, ok = (Py_ssize_t)h.n_steps == (size - (Py_ssize_t)sizeof h) / (Py_ssize_t)sizeof(brrr_chain_step) &&
                           h.n_operands >= 0 && h.n_operands <= BRRR_MAX_CHAIN_OPERANDS;
    if (ok && h.n_steps > 0) {
        p->steps = PyMem_Malloc((size_t)h.n_steps * sizeof(brrr_chain_step));
        if (p->steps == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(p->steps, PyBytes_AS_STRING(obj) + sizeof h, (size_t)h.n_steps * sizeof(brrr_chain_step));
    }
    for (int k = 0; ok && k < p->n_steps; k++) {
        ok = p->steps[k].op >= 0 && p->steps[k].op < BRRR_OP_COUNT;
        if (ok && is_tensor_op(p->steps[k].op)) ok = p->steps[k].operand == operands++;
    }
    if (!ok || operands != p->n_operands) {
        PyMem_Free(p->steps);
        p->steps = NULL;
        PyErr_SetString(PyExc_ValueError, "argument program: malformed chain program");
        return -1;
    }
    return 0;
}

/* ---- CPU twin -------------------------------------------------------------------------------
 * Rows are x's leading dims, columns its last dim; every tensor is addressed through its own
 * strides over x's shape, so any view works without a copy (a fully dense call is one row).
 * The work is cut into tiles, a chunk of rows (brrr_cpu_chunk_rows) by a block of at most
 * BRRR_CPU_BLOCK columns, shared out between threads. A tile's rows are loaded one block at a
 * time into float buffers (double for float64), the program runs over the block step by step,
 * each step one loop the compiler vectorises, and the block is stored. A bias gradient sums each
 * chunk of rows into its own partial row, and the partials are added in chunk order at the end:
 * the same sums whatever the thread count. */

typedef struct {
    const brrr_chain_launch *launch;
    const brrr_chain_steps *prog;
    int rank;                       /* x's rank, at least 1 */
    const int64_t *shape;           /* x's shape */
    int64_t (*strides)[BRRR_MAX_RANK]; /* per tensor: x, out, grad_out, operands..., grad_operands... */
    int vector_operand[BRRR_MAX_CHAIN_OPERANDS];
    double *vector_grad_acc;        /* per vector operand with a gradient: row_length accumulators */
} cpu_chain;

enum { T_X, T_OUT, T_GRAD_OUT, T_OPERANDS, T_GRAD_OPERANDS = T_OPERANDS + BRRR_MAX_CHAIN_OPERANDS, T_COUNT = T_GRAD_OPERANDS + BRRR_MAX_CHAIN_OPERANDS };

/* One unary or scalar step over a block: out = step(in), and d = its derivative unless NULL.
 * half: the results are stored as float16 or bfloat16 (the erf GELU takes its cheaper form). */
BRRR_SIMD static void block_step_f32(int op, int half, float c, const float *restrict in, float *restrict out,
                                     float *restrict d, int64_t n) {
#define UNARY(name)                                                                                   \
    if (d) {                                                                                          \
        for (int64_t i = 0; i < n; i++) out[i] = name##_fwd_grad_f32(in[i], &d[i]);                   \
    } else {                                                                                          \
        for (int64_t i = 0; i < n; i++) out[i] = name##_fwd_f32(in[i]);                               \
    }                                                                                                 \
    break;
#define SCALAR(name)                                                                                  \
    if (d) {                                                                                          \
        for (int64_t i = 0; i < n; i++) out[i] = name##_fwd_grad_f32(in[i], c, &d[i]);                \
    } else {                                                                                          \
        for (int64_t i = 0; i < n; i++) out[i] = name##_fwd_f32(in[i], c);                            \
    }                                                                                                 \
    break;
    switch (op) {
    case BRRR_OP_RELU: UNARY(relu)
    case BRRR_OP_GELU:
        if (half) {
            UNARY(gelu_half)
        }
        UNARY(gelu)
    case BRRR_OP_GELU_TANH: UNARY(gelu_tanh)
    case BRRR_OP_SILU: UNARY(silu)
    case BRRR_OP_SIGMOID: UNARY(sigmoid)
    case BRRR_OP_TANH: UNARY(tanh)
    case BRRR_OP_EXP: UNARY(exp)
    case BRRR_OP_COS: UNARY(cos)
    case BRRR_OP_SIN: UNARY(sin)
    case BRRR_OP_ABS: UNARY(abs)
    case BRRR_OP_NEG: UNARY(neg)
    case BRRR_OP_SQUARE: UNARY(square)
    case BRRR_OP_SQRT: UNARY(sqrt)
    case BRRR_OP_RSQRT: UNARY(rsqrt)
    case BRRR_OP_LOG: UNARY(log)
    case BRRR_OP_LOG1P: UNARY(log1p)
    case BRRR_OP_EXPM1: UNARY(expm1)
    case BRRR_OP_RECIPROCAL: UNARY(reciprocal)
    case BRRR_OP_SOFTPLUS: UNARY(softplus)
    case BRRR_OP_MISH: UNARY(mish)
    case BRRR_OP_HARDSWISH: UNARY(hardswish)
    case BRRR_OP_POW: SCALAR(pow)
    case BRRR_OP_CLAMP_MIN: SCALAR(clamp_min)
    case BRRR_OP_CLAMP_MAX: SCALAR(clamp_max)
    case BRRR_OP_LEAKY_RELU: SCALAR(leaky_relu)
    case BRRR_OP_ADD_SCALAR:
        for (int64_t i = 0; i < n; i++) out[i] = in[i] + c;
        if (d) {
            for (int64_t i = 0; i < n; i++) d[i] = 1.0f;
        }
        break;
    default: /* BRRR_OP_MUL_SCALAR */
        for (int64_t i = 0; i < n; i++) out[i] = in[i] * c;
        if (d) {
            for (int64_t i = 0; i < n; i++) d[i] = c;
        }
        break;
    }
#undef UNARY
#undef SCALAR
    if (op != BRRR_OP_COS && op != BRRR_OP_SIN) return;
    int large = 0;
    for (int64_t i = 0; i < n; i++) large |= brrr_trig_needs_libm(in[i]);
    for (int64_t i = 0; large && i < n; i++) {
        if (!brrr_trig_needs_libm(in[i])) continue;
        const float s = sinf(in[i]), co = cosf(in[i]);
        out[i] = op == BRRR_OP_COS ? co : s;
        if (d) d[i] = op == BRRR_OP_COS ? -s : co;
    }
}

/* The program over a block. src holds x's values and is never written: each step writes into
 * scratch buffer a or b (whichever does not hold its input), the last one into dst when dst is
 * non-NULL, so that x and out can be read and written in place. vals[k] is operand k's block.
 * Backward (total non-NULL): total receives d out / d x and grads[k] d out / d operand k, d
 * being scratch. half: as in block_step_f32. Returns where the result is. */
BRRR_SIMD static const float *block_program_f32(const brrr_chain_steps *p, int half, const float *src, float *a, float *b,
                                                float *dst, const float *const *vals, float *d, float *total,
                                                float *const *grads, int64_t n) {
    int active = 0; /* operands whose step has been passed: their gradient takes every later factor */
    const float *cur = src;
    if (total) {
        for (int64_t i = 0; i < n; i++) total[i] = 1.0f;
    }
    for (int k = 0; k < p->n_steps; k++) {
        const int op = p->steps[k].op, slot = p->steps[k].operand;
        const float *v = is_tensor_op(op) ? vals[slot] : NULL;
        float *out = dst && k == p->n_steps - 1 ? dst : cur == a ? b : a;
        if (op == BRRR_OP_ADD_TENSOR) {
            for (int64_t i = 0; i < n; i++) out[i] = cur[i] + v[i];
            if (total) {
                for (int64_t i = 0; i < n; i++) grads[slot][i] = 1.0f;
            }
        } else if (op == BRRR_OP_MUL_TENSOR) {
            for (int j = 0; total && j < p->n_operands; j++) {
                if (active >> j & 1) {
                    for (int64_t i = 0; i < n; i++) grads[j][i] *= v[i];
                }
            }
            if (total) {
                for (int64_t i = 0; i < n; i++) {
                    grads[slot][i] = cur[i];
                    total[i] *= v[i];
                }
            }
            for (int64_t i = 0; i < n; i++) out[i] = cur[i] * v[i];
        } else {
            block_step_f32(op, half, (float)p->steps[k].scalar, cur, out, total ? d : NULL, n);
            if (total) {
                for (int64_t i = 0; i < n; i++) total[i] *= d[i];
            }
            for (int j = 0; total && j < p->n_operands; j++) {
                if (active >> j & 1) {
                    for (int64_t i = 0; i < n; i++) grads[j][i] *= d[i];
                }
            }
        }
        if (is_tensor_op(op)) active |= 1 << slot;
        cur = out;
    }
    return cur;
}

/* Is the program a gated unit, act(x) * operand 0, with an activation block_glu_bwd_f32 fuses? */
static int glu_program(const brrr_chain_steps *p) {
    if (p->n_steps != 2 || p->steps[1].op != BRRR_OP_MUL_TENSOR) return 0;
    const int op = p->steps[0].op;
    return op == BRRR_OP_SILU || op == BRRR_OP_GELU || op == BRRR_OP_GELU_TANH;
}

/* A gated unit's backward over a block in one loop (block_program_f32 takes nine): gx = act'(x) *
 * v * g and gv = act(x) * g, multiplied in block_program_f32's order (the same bits). half: as in
 * block_step_f32. */
BRRR_SIMD static void block_glu_bwd_f32(int op, int half, const float *restrict x, const float *restrict v,
                                        const float *restrict g, float *restrict gx, float *restrict gv, int64_t n) {
#define GLU(name)                                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                                 \
        float d;                                                                                      \
        const float s = name##_fwd_grad_f32(x[i], &d);                                                \
        gx[i] = d * v[i] * g[i];                                                                      \
        gv[i] = s * g[i];                                                                             \
    }                                                                                                 \
    return;
    if (op == BRRR_OP_SILU) {
        GLU(silu)
    }
    if (op == BRRR_OP_GELU_TANH) {
        GLU(gelu_tanh)
    }
    if (half) {
        GLU(gelu_half)
    }
    GLU(gelu)
#undef GLU
}

static int overlap(const void *a, const void *b, int64_t bytes) {
    return (const char *)a < (const char *)b + bytes && (const char *)b < (const char *)a + bytes;
}

/* Where a tile's rows are: [row_begin, row_end) by [col, col + n). */
typedef struct {
    const cpu_chain *c;
    int backward, flat;       /* flat: every tensor dense, seen as one row of numel */
    int64_t rows, cols, chunk_rows, col_blocks;
    double *partials;         /* bias gradients: [chunk][operand][cols] */
} chain_work;

/* Element (r, 0) of tensor k, in elements. */
static int64_t row_base(const chain_work *w, int k, int64_t r) {
    const cpu_chain *c = w->c;
    return w->flat || c->rank == 1 ? 0 : brrr_unravel(c->rank - 1, c->shape, c->strides[k], r);
}
static int64_t col_stride(const chain_work *w, int k) { return w->flat ? 1 : w->c->strides[k][w->c->rank - 1]; }

static void *at(const void *data, int32_t dtype, int64_t offset) {
    return (char *)data + offset * (int64_t)brrr_dtype_size(dtype);
}

BRRR_SIMD static void chain_tiles(void *ctx, int64_t begin, int64_t end) {
    const chain_work *w = ctx;
    const cpu_chain *c = w->c;
    const brrr_chain_launch *L = c->launch;
    const brrr_chain_steps *p = c->prog;
    const int32_t dt = L->dtype;
    const int nops = p->n_operands, f64 = dt == BRRR_F64, bwd = w->backward, glu = glu_program(p);
    /* Block buffers: x (y for float64), two for the steps, d, total, grad_out, operands, their
     * gradients (float or double). */
    enum { B_Y, B_A, B_B, B_D, B_TOTAL, B_G, B_VALS, B_GRADS = B_VALS + BRRR_MAX_CHAIN_OPERANDS, B_COUNT = B_GRADS + BRRR_MAX_CHAIN_OPERANDS };
    _Alignas(64) double storage[B_COUNT][BRRR_CPU_BLOCK];
    float *fb[B_COUNT];
    double *db[B_COUNT];
    for (int k = 0; k < B_COUNT; k++) {
        fb[k] = (float *)storage[k];
        db[k] = storage[k];
    }
    for (int64_t item = begin; item < end; item++) {
        const int64_t chunk = item / w->col_blocks, j0 = (item % w->col_blocks) * BRRR_CPU_BLOCK;
        const int64_t n = w->cols - j0 < BRRR_CPU_BLOCK ? w->cols - j0 : BRRR_CPU_BLOCK;
        const int64_t r_end = (chunk + 1) * w->chunk_rows < w->rows ? (chunk + 1) * w->chunk_rows : w->rows;
        double *partial = w->partials ? w->partials + chunk * nops * w->cols : NULL;
        for (int64_t r = chunk * w->chunk_rows; r < r_end; r++) {
#define TILE(k, data) at((data), dt, row_base(w, (k), r) + j0 * col_stride(w, (k)))
            const float *operand_f32[BRRR_MAX_CHAIN_OPERANDS]; /* float32 at stride 1: in place */
            for (int b = 0; b < nops; b++) {
                const void *v = TILE(T_OPERANDS + b, L->operands[b].data);
                const int64_t s = col_stride(w, T_OPERANDS + b);
                operand_f32[b] = dt == BRRR_F32 && s == 1 ? v : fb[B_VALS + b];
                if (f64) brrr_cpu_load_f64(dt, v, s, n, db[B_VALS + b]);
                else if (operand_f32[b] != v) brrr_cpu_load_f32(dt, v, s, n, fb[B_VALS + b]);
            }
            void *out = TILE(T_OUT, L->out.data);
            int direct = 0; /* bit 0: grad_x, bit 1: operand 0's gradient, written in place */
            if (f64) {
                double *y = db[B_Y], *g = db[B_G];
                brrr_cpu_load_f64(dt, TILE(T_X, L->x.data), col_stride(w, T_X), n, y);
                if (bwd) brrr_cpu_load_f64(dt, TILE(T_GRAD_OUT, L->grad_out.data), col_stride(w, T_GRAD_OUT), n, g);
                for (int64_t i = 0; i < n; i++) {
                    double vals[BRRR_MAX_CHAIN_OPERANDS] = {0}, grads[BRRR_MAX_CHAIN_OPERANDS];
                    for (int b = 0; b < nops; b++) vals[b] = db[B_VALS + b][i];
                    if (!bwd) {
                        y[i] = program_fwd_f64(p->steps, p->n_steps, y[i], vals);
                        continue;
                    }
                    y[i] = g[i] * program_grad_f64(p->steps, p->n_steps, y[i], vals, grads);
                    for (int b = 0; b < nops; b++) db[B_GRADS + b][i] = g[i] * grads[b];
                }
                brrr_cpu_store_f64(dt, out, col_stride(w, T_OUT), n, y);
            } else {
                /* float32 at stride 1 is read and written in place (out may be x itself: then
                 * through the buffers, as the steps read their input after writing) */
                float *const *grads = &fb[B_GRADS];
                const float *x = TILE(T_X, L->x.data);
                if (dt != BRRR_F32 || col_stride(w, T_X) != 1) {
                    brrr_cpu_load_f32(dt, x, col_stride(w, T_X), n, fb[B_Y]);
                    x = fb[B_Y];
                }
                const int in_place = !bwd && dt == BRRR_F32 && col_stride(w, T_OUT) == 1 && L->out.data != L->x.data;
                float *dst = in_place ? out : NULL;
                const float *g = bwd ? TILE(T_GRAD_OUT, L->grad_out.data) : NULL; /* grad_out, as float */
                if (bwd && (dt != BRRR_F32 || col_stride(w, T_GRAD_OUT) != 1)) {
                    brrr_cpu_load_f32(dt, g, col_stride(w, T_GRAD_OUT), n, fb[B_G]);
                    g = fb[B_G];
                }
                if (bwd && glu) { /* one loop, writing float32 outputs at stride 1 in place where
                                     they overlap no input nor each other */
                    const int64_t bytes = n * (int64_t)sizeof(float);
                    void *go = L->grad_operands[0].data && !c->vector_operand[0]
                                   ? TILE(T_GRAD_OPERANDS, L->grad_operands[0].data) : NULL;
                    float *gx = fb[B_TOTAL], *gv = grads[0];
                    if (dt == BRRR_F32 && col_stride(w, T_OUT) == 1 && !overlap(out, x, bytes) &&
                        !overlap(out, operand_f32[0], bytes) && !overlap(out, g, bytes))
                        gx = out;
                    if (dt == BRRR_F32 && go && col_stride(w, T_GRAD_OPERANDS) == 1 && !overlap(go, x, bytes) &&
                        !overlap(go, operand_f32[0], bytes) && !overlap(go, g, bytes) && !overlap(go, gx, bytes))
                        gv = go;
                    block_glu_bwd_f32(p->steps[0].op, dt != BRRR_F32, x, operand_f32[0], g, gx, gv, n);
                    direct = (gx == out) | (gv == go) << 1;
                    if (!(direct & 1)) brrr_cpu_store_f32(dt, out, col_stride(w, T_OUT), n, gx);
                } else {
                    const float *y = block_program_f32(p, dt != BRRR_F32, x, fb[B_A], fb[B_B], dst, operand_f32, fb[B_D],
                                                       bwd ? fb[B_TOTAL] : NULL, grads, n);
                    if (bwd) { /* grad_x = grad_out * total, grad operand k = grad_out * grads[k] */
                        float *total = fb[B_TOTAL];
                        for (int64_t i = 0; i < n; i++) total[i] *= g[i];
                        for (int b = 0; b < nops; b++)
                            for (int64_t i = 0; i < n; i++) grads[b][i] *= g[i];
                        y = total;
                    }
                    if (y != dst) brrr_cpu_store_f32(dt, out, col_stride(w, T_OUT), n, y);
                }
            }
            for (int b = 0; bwd && b < nops; b++) {
                if (c->vector_operand[b] && partial) {
                    double *acc = partial + b * w->cols + j0;
                    if (f64) for (int64_t i = 0; i < n; i++) acc[i] += db[B_GRADS + b][i];
                    else for (int64_t i = 0; i < n; i++) acc[i] += (double)fb[B_GRADS + b][i];
                } else if (L->grad_operands[b].data && !(direct >> (b + 1) & 1)) {
                    void *go = TILE(T_GRAD_OPERANDS + b, L->grad_operands[b].data);
                    if (f64) brrr_cpu_store_f64(dt, go, col_stride(w, T_GRAD_OPERANDS + b), n, db[B_GRADS + b]);
                    else brrr_cpu_store_f32(dt, go, col_stride(w, T_GRAD_OPERANDS + b), n, fb[B_GRADS + b]);
                }
            }
#undef TILE
        }
    }
}

/* Is every tensor the call touches dense row-major over x's shape (so the call is one flat row)? */
static int chain_is_flat(const cpu_chain *c, int backward) {
    const brrr_chain_launch *L = c->launch;
    for (int k = 0; k < T_COUNT; k++) {
        const int b = k >= T_GRAD_OPERANDS ? k - T_GRAD_OPERANDS : k - T_OPERANDS;
        int used = k == T_X || k == T_OUT || (k == T_GRAD_OUT && backward);
        if (k >= T_OPERANDS && k < T_GRAD_OPERANDS) used = b < L->program.n_operands;
        if (k >= T_GRAD_OPERANDS) used = backward && b < L->program.n_operands && L->grad_operands[b].data;
        if (!used) continue;
        if (k >= T_OPERANDS && c->vector_operand[b]) return 0;
        int64_t expect = 1;
        for (int d = c->rank - 1; d >= 0; d--) {
            if (c->shape[d] != 1 && c->strides[k][d] != expect) return 0;
            expect *= c->shape[d];
        }
    }
    return 1;
}

static void cpu_chain_run(const cpu_chain *c, int backward) {
    const brrr_chain_launch *L = c->launch;
    const int nops = L->program.n_operands;
    chain_work w = {c, backward, chain_is_flat(c, backward), 0, 0, 0, 0, NULL};
    w.cols = w.flat ? L->numel : c->shape[c->rank - 1];
    w.rows = w.flat ? 1 : L->numel / w.cols;
    w.chunk_rows = brrr_cpu_chunk_rows(w.rows);
    w.col_blocks = (w.cols + BRRR_CPU_BLOCK - 1) / BRRR_CPU_BLOCK;
    const int64_t chunks = (w.rows + w.chunk_rows - 1) / w.chunk_rows;
    if (backward && c->vector_grad_acc) {
        w.partials = calloc((size_t)(chunks * nops * w.cols), sizeof(double));
        if (w.partials == NULL) { /* no room for the partials: one chunk, summed in row order */
            w.chunk_rows = w.rows;
            w.partials = c->vector_grad_acc;
        }
    }
    const int64_t n_items = (w.rows + w.chunk_rows - 1) / w.chunk_rows * w.col_blocks;
    const int64_t tile = w.chunk_rows * (w.cols < BRRR_CPU_BLOCK ? w.cols : BRRR_CPU_BLOCK);
    brrr_cpu_parallel_for(n_items, tile, chain_tiles, &w);
    if (w.partials && w.partials != c->vector_grad_acc) {
        for (int64_t k = 0; k < chunks; k++)
            for (int64_t j = 0; j < nops * w.cols; j++) c->vector_grad_acc[j] += w.partials[k * nops * w.cols + j];
        free(w.partials);
    }
}

/* ---- the ops ---------------------------------------------------------------------------------- */

static const char *const OPERAND_NAMES[] = {"operands[0]", "operands[1]", "operands[2]", "operands[3]"};
static const char *const GRAD_OPERAND_NAMES[] = {"grad_operands[0]", "grad_operands[1]", "grad_operands[2]",
                                                 "grad_operands[3]"};

/* Is operand b a vector along x's last dim (and not simply x-shaped)? -1 on a shape error. */
static int operand_kind(const brrr_tensor *op, const brrr_tensor *x) {
    int same = op->ndim == x->ndim;
    for (int d = 0; same && d < x->ndim; d++) same = op->shape[d] == x->shape[d];
    if (same) return 0;
    if (x->ndim >= 1 && op->ndim == 1 && op->shape[0] == x->shape[x->ndim - 1]) return 1;
    char msg[64];
    if (x->ndim == 0) /* no last dim to broadcast along */
        snprintf(msg, sizeof msg, "x's shape () (x is 0-d)");
    else
        snprintf(msg, sizeof msg, "x's shape or (%lld,) (its last dim)", (long long)x->shape[x->ndim - 1]);
    PyErr_Format(PyExc_ValueError, "argument %s: shape must be %s", op->name, msg);
    return -1;
}

/* Strides of `t` over x's shape (rank >= 1): vectors broadcast over the leading dims. */
static void strides_over_x(const brrr_tensor *t, int vector, int rank, int64_t *strides) {
    if (vector) {
        for (int d = 0; d < rank - 1; d++) strides[d] = 0;
        strides[rank - 1] = t->strides[0];
    } else if (t->ndim == 0) {
        strides[0] = 1;
    } else {
        memcpy(strides, t->strides, sizeof(int64_t) * (size_t)rank);
    }
}

PyObject *brrr_py_chain_partial_rows(PyObject *module, PyObject *arg) {
    (void)module;
    long long rows;
    if (brrr_parse_int64(arg, "rows", &rows) < 0) return NULL;
    if (rows < 0) {
        PyErr_SetString(PyExc_ValueError, "argument rows: must be >= 0");
        return NULL;
    }
    return PyLong_FromLongLong(brrr_bias_partial_rows(rows));
}

enum { F_X, F_OUT };                            /* forward slots */
enum { B_X, B_GRAD_OUT, B_GRAD_X, B_PARTIALS }; /* backward slots */
enum { A_PROGRAM, A_OPERANDS, A_GRAD_OPERANDS };

static int is_backward(const brrr_op_call *c) { return c->spec->n_args == 3; }
/* The operands, then their gradients, take the slots after the spec's own. */
static int operand_slot(const brrr_op_call *c, int b) { return c->spec->n_slots + b; }
static int grad_operand_slot(const brrr_op_call *c, int b) { return c->spec->n_slots + BRRR_MAX_CHAIN_OPERANDS + b; }

static int chain_check(brrr_op_call *c) {
    brrr_chain_steps prog;
    if (brrr_chain_parse_program(c->arg[A_PROGRAM].o, &prog) < 0) return -1;
    PyMem_Free(prog.steps);
    PyObject *operands = c->arg[A_OPERANDS].o, *grads = is_backward(c) ? c->arg[A_GRAD_OPERANDS].o : NULL;
    if (!PyTuple_Check(operands) || PyTuple_GET_SIZE(operands) != prog.n_operands) {
        PyErr_Format(PyExc_ValueError, "argument operands: expected a tuple of %d tensors (one per tensor step)",
                     (int)prog.n_operands);
        return -1;
    }
    if (grads && (!PyTuple_Check(grads) || PyTuple_GET_SIZE(grads) != prog.n_operands)) {
        PyErr_Format(PyExc_ValueError, "argument grad_operands: expected a tuple of %d tensors or None",
                     (int)prog.n_operands);
        return -1;
    }
    const brrr_tensor *x = &c->t[0];
    for (int b = 0; b < prog.n_operands; b++) {
        brrr_tensor *op = &c->t[operand_slot(c, b)];
        if (brrr_op_import_extra(c, operand_slot(c, b), PyTuple_GET_ITEM(operands, b), OPERAND_NAMES[b], 0) < 0 ||
            brrr_check_same_dtype(op, x) < 0 || operand_kind(op, x) < 0)
            return -1;
        PyObject *g = grads ? PyTuple_GET_ITEM(grads, b) : Py_None;
        if (g == Py_None) continue;
        brrr_tensor *gt = &c->t[grad_operand_slot(c, b)];
        if (brrr_op_import_extra(c, grad_operand_slot(c, b), g, GRAD_OPERAND_NAMES[b], 1) < 0 ||
            brrr_check_same_dtype(gt, op) < 0 || brrr_check_same_shape(gt, op) < 0 ||
            brrr_check_no_internal_overlap(gt) < 0)
            return -1;
    }
    return 0;
}

/* Does operand b get a gradient that is a column sum (a vector operand)? */
static int vector_grad(const brrr_op_call *c, int b) {
    const brrr_tensor *op = &c->t[operand_slot(c, b)];
    return is_backward(c) && brrr_has(c, grad_operand_slot(c, b)) && !(op->ndim == c->t[0].ndim);
}

static int64_t chain_scratch(const brrr_op_call *c) {
    int n_operands = 0, any = 0;
    for (int b = 0; b < BRRR_MAX_CHAIN_OPERANDS; b++) {
        n_operands += brrr_has(c, operand_slot(c, b));
        any |= vector_grad(c, b);
    }
    const int64_t last = c->t[0].ndim ? c->t[0].shape[c->t[0].ndim - 1] : 1;
    return any && c->t[0].numel > 0 ? brrr_bias_partial_rows(c->t[0].numel / last) * last * n_operands : 0;
}

static int chain_cuda(brrr_op_call *c, brrr_chain_launch *L, const brrr_chain_steps *prog, int rank, int64_t *shape,
                      int64_t (*strides)[BRRR_MAX_RANK], const int *vector, int any_vector_grad);

static int chain_run_program(brrr_op_call *c, const brrr_chain_steps *prog) {
    const int backward = is_backward(c);
    brrr_chain_launch L;
    memset(&L, 0, sizeof L);
    L.program.n_operands = prog->n_operands;
    if (prog->n_steps <= BRRR_MAX_CHAIN_STEPS) { /* what the interpreted kernels take */
        L.program.n_steps = prog->n_steps;
        if (prog->n_steps) memcpy(L.program.steps, prog->steps, sizeof(brrr_chain_step) * (size_t)prog->n_steps);
    }
    const brrr_tensor *x = &c->t[0], *out = &c->t[backward ? B_GRAD_X : F_OUT];
    int vector[BRRR_MAX_CHAIN_OPERANDS] = {0}, any_vector_grad = 0;
    L.dtype = x->dtype;
    L.numel = x->numel;
    L.x.data = x->data;
    L.out.data = out->data;
    L.grad_out.data = backward ? c->t[B_GRAD_OUT].data : NULL;
    for (int b = 0; b < prog->n_operands; b++) {
        const brrr_tensor *op = &c->t[operand_slot(c, b)];
        vector[b] = op->ndim != x->ndim;
        any_vector_grad |= vector_grad(c, b);
        L.operands[b].data = op->data;
        L.grad_operands[b].data = c->t[grad_operand_slot(c, b)].data;
    }
    if (L.numel == 0) return 0;

    int rank = x->ndim > 0 ? x->ndim : 1;
    int64_t shape[BRRR_MAX_RANK] = {1};
    int64_t strides[T_COUNT][BRRR_MAX_RANK];
    memset(strides, 0, sizeof strides);
    if (x->ndim > 0) memcpy(shape, x->shape, sizeof(int64_t) * (size_t)rank);
    strides_over_x(x, 0, rank, strides[T_X]);
    strides_over_x(out, 0, rank, strides[T_OUT]);
    if (backward) strides_over_x(&c->t[B_GRAD_OUT], 0, rank, strides[T_GRAD_OUT]);
    for (int b = 0; b < prog->n_operands; b++) {
        strides_over_x(&c->t[operand_slot(c, b)], vector[b], rank, strides[T_OPERANDS + b]);
        if (L.grad_operands[b].data)
            strides_over_x(&c->t[grad_operand_slot(c, b)], vector[b], rank, strides[T_GRAD_OPERANDS + b]);
    }
    if (!brrr_on_cpu(c)) return chain_cuda(c, &L, prog, rank, shape, strides, vector, any_vector_grad);

    const int64_t cols = shape[rank - 1];
    double *acc = NULL;
    if (any_vector_grad && (acc = PyMem_RawCalloc((size_t)(prog->n_operands * cols), sizeof(double))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    cpu_chain run = {&L, prog, rank, shape, strides, {0}, acc};
    memcpy(run.vector_operand, vector, sizeof vector);
    BRRR_CPU_BEGIN(c)
    cpu_chain_run(&run, backward);
    for (int b = 0; acc && b < prog->n_operands; b++) {
        if (!vector[b] || !L.grad_operands[b].data) continue;
        const int64_t stride = c->t[grad_operand_slot(c, b)].strides[0];
        for (int64_t j = 0; j < cols; j++) {
            if (L.dtype == BRRR_F64) ((double *)L.grad_operands[b].data)[j * stride] = acc[b * cols + j];
            else brrr_store_f32(L.dtype, L.grad_operands[b].data, j * stride, (float)acc[b * cols + j]);
        }
    }
    BRRR_CPU_END
    PyMem_RawFree(acc);
    return 0;
}

static int chain_run(brrr_op_call *c) {
    brrr_chain_steps prog;
    if (brrr_chain_parse_program(c->arg[A_PROGRAM].o, &prog) < 0) return -1;
    const int rc = chain_run_program(c, &prog);
    PyMem_Free(prog.steps);
    return rc;
}

/* CUDA: the glue chooses the layout. A bias gradient needs rows intact (the last dim stays last,
 * the leading dims coalesce among themselves); everything else coalesces freely, ordered by the
 * output's strides so that writes stay coalesced. */
static int chain_cuda(brrr_op_call *c, brrr_chain_launch *L, const brrr_chain_steps *prog, int rank, int64_t *shape,
                      int64_t (*strides)[BRRR_MAX_RANK], const int *vector, int any_vector_grad) {
    const int backward = is_backward(c), n_operands = L->program.n_operands;
    int tensor_ids[T_COUNT], count = 0;
    tensor_ids[count++] = T_OUT;
    tensor_ids[count++] = T_X;
    if (backward) tensor_ids[count++] = T_GRAD_OUT;
    for (int b = 0; b < n_operands; b++) tensor_ids[count++] = T_OPERANDS + b;
    for (int b = 0; b < n_operands; b++)
        if (L->grad_operands[b].data && !vector[b]) tensor_ids[count++] = T_GRAD_OPERANDS + b;
    int64_t packed[T_COUNT][BRRR_MAX_RANK];
    for (int i = 0; i < count; i++) memcpy(packed[i], strides[tensor_ids[i]], sizeof packed[i]);
    int nd;
    if (any_vector_grad) {
        const int64_t last = shape[rank - 1];
        nd = brrr_coalesce("x", rank - 1, shape, count, packed);
        if (nd < 0 || brrr_check_view_dims("x", nd + 1) < 0) return -1;
        shape[nd] = last;
        for (int i = 0; i < count; i++) packed[i][nd] = strides[tensor_ids[i]][rank - 1];
        nd += 1;
        L->partials = c->t[B_PARTIALS].data;
        L->partial_rows = brrr_bias_partial_rows(L->numel / last);
        L->row_layout = 1;
    } else {
        nd = brrr_coalesce("x", rank, shape, count, packed);
        if (nd < 0) return -1;
    }
    L->ndim = nd;
    memcpy(L->shape, shape, sizeof(int64_t) * (size_t)nd);
    for (int i = 0; i < count; i++) {
        brrr_view *v = tensor_ids[i] == T_OUT ? &L->out : tensor_ids[i] == T_X ? &L->x
                     : tensor_ids[i] == T_GRAD_OUT ? &L->grad_out
                     : tensor_ids[i] < T_GRAD_OPERANDS ? &L->operands[tensor_ids[i] - T_OPERANDS]
                                                       : &L->grad_operands[tensor_ids[i] - T_GRAD_OPERANDS];
        memcpy(v->strides, packed[i], sizeof v->strides);
    }
    for (int b = 0; b < n_operands; b++) {
        L->operand_is_vector[b] = vector[b];
        if (vector[b] && L->grad_operands[b].data) L->grad_operands[b].strides[0] = c->t[grad_operand_slot(c, b)].strides[0];
    }
    /* Dense row-major over the launch shape (vectors: stride 1 along the last dim only). */
    int contiguous = 1;
    for (int i = 0; contiguous && i < count; i++) {
        int64_t expect = 1;
        const int is_vec = tensor_ids[i] >= T_OPERANDS && tensor_ids[i] < T_GRAD_OPERANDS &&
                           vector[tensor_ids[i] - T_OPERANDS];
        for (int d = nd - 1; contiguous && d >= 0; d--) {
            const int64_t want = is_vec && d < nd - 1 ? 0 : expect;
            if (packed[i][d] != want && L->shape[d] != 1) contiguous = 0;
            expect *= L->shape[d];
        }
    }
    L->contiguous = contiguous;
    L->row_length = L->shape[nd - 1];
    /* Rows of dense columns (a bias, halves of a GLU input, sliced rows) take the row kernels: no
     * index division, and a bias is read once per thread. */
    if (!L->row_layout && nd == 2 && L->row_length >= 64) {
        int dense_columns = 1;
        for (int i = 0; i < count; i++) dense_columns &= packed[i][1] == 1;
        L->row_layout = dense_columns;
    }
#if BRRR_WITH_CUDA
    const int compiled = brrr_chain_jit_run(c, L, prog, backward);
    if (compiled) return compiled < 0 ? -1 : 0;
#endif
    if (prog->n_steps > BRRR_MAX_CHAIN_STEPS) {
        PyErr_Format(PyExc_ValueError, "argument program: a chain of %d steps needs NVRTC on CUDA (the interpreted kernels "
                     "take at most %d steps; docs/chains.md says where brrr looks for NVRTC)", (int)prog->n_steps,
                     BRRR_MAX_CHAIN_STEPS);
        return -1;
    }
    if (backward) BRRR_RETURN_CUDA(c, brrr_cuda_chain_bwd, L);
    BRRR_RETURN_CUDA(c, brrr_cuda_chain_fwd, L);
}

#define PROGRAM {"program", BRRR_ARG_OBJECT, 0, 0, NULL, "the bytes returned by chain_program()"}
#define OPERANDS {"operands", BRRR_ARG_OBJECT, 0, 0, NULL, "a tuple of tensors"}

static const brrr_op_spec CHAIN_FWD = {
    .name = "chain_fwd",
    .doc = "out = the chain `program` applied to every element of x, its tensor steps taking `operands` (x's "
           "shape, or a vector along its last dim) in order. out may be x or an x-shaped operand.",
    .n_slots = 2,
    .slots = {{"x", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"out", BRRR_WRITE | BRRR_ALLOC | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_X, -1}},
    .n_args = 2,
    .args = {PROGRAM, OPERANDS},
    .split_arg = -1,
    .check = chain_check,
    .run = chain_run,
};

static const brrr_op_spec CHAIN_BWD = {
    .name = "chain_bwd",
    .doc = "grad_x = grad_out * d chain / dx, recomputing the chain from x; and for every operand whose entry of "
           "grad_operands is a tensor, its gradient (a vector operand's summed over rows in a fixed order).",
    .n_slots = 4,
    .slots = {{"x", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"grad_out", 0, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"grad_x", BRRR_WRITE | BRRR_ALLOC | BRRR_INPLACE, BRRR_SHAPE_X, BRRR_DTYPE_X, -1},
              {"partials", BRRR_WRITE, BRRR_SHAPE_SCRATCH, BRRR_DTYPE_ACC, -1}},
    .n_args = 3,
    .args = {PROGRAM, OPERANDS, {"grad_operands", BRRR_ARG_OBJECT, 0, 0, NULL, "a tuple of tensors or None"}},
    .split_arg = -1,
    .check = chain_check,
    .scratch = chain_scratch,
    .run = chain_run,
};

const brrr_op_spec *const brrr_chain_ops[] = {&CHAIN_FWD, &CHAIN_BWD, NULL};
