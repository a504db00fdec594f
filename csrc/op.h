/* The one call path of every op: a declarative spec per op, and the generic code that runs it.
 *
 * An op is a brrr_op_spec: its tensor slots and its scalar arguments, as data, plus three
 * functions of its family (csrc/<family>.c): `check` (what the rules below cannot say), `scratch`
 * (the size of a CUDA scratch slot) and `run` (lay the tensors out for the kernels, then launch
 * the CPU twin or the CUDA launcher). brrr._C exposes every spec as a callable object of the same
 * name. A call
 *
 *   1. parses its arguments: slots first, then the scalars, then `stream`, by position or by
 *      keyword (optional slots default to None, stream to -1, scalars to their spec's default
 *      where it has one);
 *   2. imports each tensor through DLPack (csrc/tensor.c) and checks it against the first slot,
 *      `x`: same device, the slot's dtype rule and shape rule;
 *   3. allocates the outputs the caller left to it, with the framework of x (see BRRR_ALLOC),
 *      then calls the family's check;
 *   4. refuses any written tensor that overlaps another argument (BRRR_INPLACE excepted);
 *   5. calls the family's run, without the GIL around the kernels;
 *   6. returns a tuple of the written slots (scratch excepted) in spec order, None where absent.
 *
 * Errors follow one rule (docs/errors.md): TypeError for a wrong type or dtype, ValueError for a
 * bad value or a mismatch between arguments, BufferError for memory the import cannot use. */
#ifndef BRRR_OP_H
#define BRRR_OP_H

#include "brrr.h"

#define BRRR_OP_MAX_SLOTS 16
#define BRRR_OP_MAX_ARGS 8

/* Slot flags. */
enum {
    BRRR_WRITE = 1,    /* an output: the op writes it */
    BRRR_OPTIONAL = 2, /* may be None (absent); an optional output is written only when given */
    BRRR_ALLOC = 4,    /* an output brrr._C may allocate: a required one passed as None, an optional
                          one passed as True (a new contiguous tensor by x's framework) */
    BRRR_INPLACE = 8,  /* an output that may be exactly an input (the same view): elementwise ops
                          read each element before they write it */
    BRRR_CONTIG = 16,  /* must be contiguous (per-row outputs that the kernels index by the row) */
};

/* Shape rules. The columns of x are its last `split` dims (spec->split_arg; 1 by default), its rows
 * the dims before them. */
typedef enum {
    BRRR_SHAPE_X,       /* x's shape */
    BRRR_SHAPE_ROWS,    /* x's leading dims */
    BRRR_SHAPE_COLS,    /* x's last `split` dims */
    BRRR_SHAPE_SCALAR,  /* 0-d */
    BRRR_SHAPE_SCRATCH, /* CUDA scratch: 1-D, contiguous, at least spec->scratch() elements */
    BRRR_SHAPE_FAMILY,  /* checked by the family */
} brrr_shape_rule;

/* Dtype rules. */
typedef enum {
    BRRR_DTYPE_X,      /* x's dtype */
    BRRR_DTYPE_PARAM,  /* x's dtype, or float32 for float16/bfloat16 x; one dtype for all such slots */
    BRRR_DTYPE_ACC,    /* the accumulation dtype: float32, float64 for float64 x */
    BRRR_DTYPE_INDEX,  /* class indices: int64, int32 or uint8 */
    BRRR_DTYPE_ANY,    /* a float dtype the family checks; allocated in x's */
} brrr_dtype_rule;

typedef struct {
    const char *name;
    uint8_t flags;
    uint8_t shape; /* brrr_shape_rule */
    uint8_t dtype; /* brrr_dtype_rule */
    int8_t when;   /* an optional output required exactly when slot `when` is given (allocated when
                      None); -1: none */
} brrr_slot_spec;

typedef enum {
    BRRR_ARG_FLOAT,  /* a real number in [lo, hi] (NaN refused where lo <= hi are finite) */
    BRRR_ARG_OPTIONAL_FLOAT, /* None (the value 0: none), or a real number in [lo, hi] */
    BRRR_ARG_INT,    /* an int in [lo, hi] */
    BRRR_ARG_UINT64, /* an int in [0, 2**64) */
    BRRR_ARG_BOOL,
    BRRR_ARG_CHOICE, /* one of `choices` (str); the value is its index */
    BRRR_ARG_OBJECT, /* any object, read by the family */
} brrr_arg_type;

typedef struct {
    const char *name;
    uint8_t type; /* brrr_arg_type */
    double lo, hi;
    const char *const *choices; /* BRRR_ARG_CHOICE: NULL-terminated */
    const char *expect;         /* what the value should be, for errors ("a float in [0, 1]") */
    uint8_t has_default;        /* may be left out: then `default_value` (BRRR_ARG_OPTIONAL_FLOAT: None) */
    double default_value;
} brrr_arg_spec;

typedef union {
    double f;
    long long i;
    unsigned long long u;
    PyObject *o; /* borrowed */
} brrr_arg;

struct brrr_op_spec;

/* One call in progress. The tensors come last: a call zeroes the fields before them and each
 * tensor's head only (BRRR_TENSOR_HEAD), not its shape and strides. */
typedef struct {
    const struct brrr_op_spec *spec;
    brrr_call call;
    PyObject *obj[BRRR_OP_MAX_SLOTS];   /* what the caller passed (borrowed); NULL: not passed */
    PyObject *owned[BRRR_OP_MAX_SLOTS]; /* allocated here */
    uint8_t written[BRRR_OP_MAX_SLOTS]; /* the op writes t[s] */
    brrr_arg arg[BRRR_OP_MAX_ARGS];
    int split;                          /* the column dims of x */
    int64_t n_rows, n_cols;
    brrr_tensor rows, cols;             /* x's row and column shapes, as references for errors */
    brrr_tensor t[BRRR_OP_MAX_SLOTS];   /* imported; t[s].name NULL: absent */
} brrr_op_call;

typedef struct brrr_op_spec {
    const char *name; /* brrr._C.<name>; also names the op in CUDA errors */
    const char *doc;
    int n_slots, n_args;
    brrr_slot_spec slots[BRRR_OP_MAX_SLOTS]; /* slot 0 is x: a required input */
    brrr_arg_spec args[BRRR_OP_MAX_ARGS];
    int split_arg; /* the BRRR_ARG_INT argument that gives the column dims, or -1 (one) */
    /* Checks beyond the rules, once every slot is imported (outputs allocated). */
    int (*check)(brrr_op_call *c);
    /* Elements of the scratch slot this CUDA call needs (0: none); NULL when the op has none. */
    int64_t (*scratch)(const brrr_op_call *c);
    /* Lay out and launch; called with the GIL held (release it around the kernels). */
    int (*run)(brrr_op_call *c);
} brrr_op_spec;

/* Add the ops of a family (a NULL-terminated list of specs, brrr_<family>_ops) to `module` as
 * callable objects under their names. */
int brrr_add_ops(PyObject *module, const brrr_op_spec *const *specs);

/* Is slot s given (imported)? */
static inline int brrr_has(const brrr_op_call *c, int s) { return c->t[s].name != NULL; }

static inline int brrr_on_cpu(const brrr_op_call *c) { return c->t[0].device_type == kDLCPU; }

/* CPU work of a call on fewer elements of x than this runs with the GIL held: releasing and
 * taking it back costs about 0.1 us (two mutex round trips and a condition signal), as much as a
 * kernel over a few thousand elements, and a kernel that short keeps no other thread waiting. */
#define BRRR_GIL_FREE_NUMEL 16384

/* Bracket a family's CPU work: the GIL released around it unless the call is small (above). */
#define BRRR_CPU_BEGIN(c)                                                                                            \
    {                                                                                                                \
        PyThreadState *brrr_thread_ = (c)->t[0].numel < BRRR_GIL_FREE_NUMEL ? NULL : PyEval_SaveThread();
#define BRRR_CPU_END                                                                                                 \
    if (brrr_thread_) PyEval_RestoreThread(brrr_thread_);                                                            \
    }

/* Run the CPU twin `fn(launch)` of call c (without the GIL unless it is small). */
#define BRRR_RUN_CPU(c, fn, launch)                                                                                  \
    do {                                                                                                             \
        BRRR_CPU_BEGIN(c) fn(launch);                                                                                \
        BRRR_CPU_END                                                                                                 \
    } while (0)

/* Return from a family's run through the CUDA launcher `fn(launch, device, stream)`, called
 * without the GIL on the call's stream: 0, or -1 with RuntimeError naming the op. Without CUDA
 * compiled in, CUDA tensors never get this far (the import refuses them). */
#if BRRR_WITH_CUDA
#define BRRR_RETURN_CUDA(c, fn, launch)                                                                              \
    do {                                                                                                             \
        void *stream_ = brrr_call_stream(&(c)->call);                                                                \
        int err_;                                                                                                    \
        Py_BEGIN_ALLOW_THREADS err_ = fn((launch), (c)->t[0].device_id, stream_);                                    \
        Py_END_ALLOW_THREADS                                                                                         \
        return brrr_cuda_result(err_, (c)->spec->name);                                                              \
    } while (0)
#else
#define BRRR_RETURN_CUDA(c, fn, launch) return 0
#endif

/* Import `obj` into the free slot index `slot` (>= spec->n_slots) as argument `name`: a tensor
 * on x's device (an operand a family takes as a list). Written ones join the overlap checks;
 * all are released with the call. */
int brrr_op_import_extra(brrr_op_call *c, int slot, PyObject *obj, const char *name, int writable);

#endif
