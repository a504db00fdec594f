/* Chains compiled for their exact steps with NVRTC (chain_jit.c); used by chain.c. */
#ifndef BRRR_CHAIN_JIT_H
#define BRRR_CHAIN_JIT_H

#include "op.h"

/* A parsed chain program: n_steps steps, n_operands of them tensor steps. */
typedef struct {
    int32_t n_steps, n_operands;
    brrr_chain_step *steps;
} brrr_chain_steps;

/* The steps of a program (the bytes of _C.chain_program), checked: 0, or -1 with a Python
 * exception naming the argument `program`. p->steps is a copy to PyMem_Free (NULL for no steps). */
int brrr_chain_parse_program(PyObject *obj, brrr_chain_steps *p);

/* The layout classes a kernel is compiled for. */
enum {
    BRRR_JIT_CONTIGUOUS, /* every tensor dense and 16-byte aligned; vectors by i % row_length */
    BRRR_JIT_STRIDED,    /* any strides over the launch's ndim dims */
    BRRR_JIT_ROWS,       /* backward with a bias gradient: rows (ndim - 1 dims) by a last dim of columns */
    BRRR_JIT_LAYOUTS
};

/* What a compiled kernel is specialised for (with its steps, scalars included). */
typedef struct {
    int32_t backward, dtype, layout, ndim; /* ndim: 1 for contiguous */
    int32_t vector_mask;                   /* bit b: operand b is a vector along the last dim */
    int32_t grad_mask;                     /* backward, bit b: operand b's gradient is written */
    int32_t index32;                       /* indices fit 32 bits (strided, rows: cheaper divisions; contiguous:
                                              fewer instructions, in the lean form) */
} brrr_chain_kernel;

/* Run launch L (laid out by chain.c) through a kernel compiled for its exact steps. Returns 1
 * when it ran (or failed: then -1 with a Python exception), 0 when the caller should run the
 * interpreted kernels instead (no NVRTC, compiling disabled, or a new chain under CUDA-graph
 * capture; each said once with a warning). */
int brrr_chain_jit_run(brrr_op_call *c, brrr_chain_launch *L, const brrr_chain_steps *prog, int backward);

PyObject *brrr_py_chain_jit_compile(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *brrr_py_chain_jit_info(PyObject *module, PyObject *unused);
PyObject *brrr_py_chain_jit_with_backward(PyObject *module, PyObject *program);
PyObject *brrr_py_chain_jit_enable(PyObject *module, PyObject *flag);
/* Module init: the fork handler that gives a fork child fresh locks (once per process). */
void brrr_chain_jit_init(void);

#endif
