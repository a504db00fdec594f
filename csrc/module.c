/* brrr._C: module definition (multi-phase init, per-module state, no mutable globals). */
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "brrr.h"
#include "cpu.h"

#include <numpy/arrayobject.h>

PyObject *brrr_py_chain_op_names(PyObject *module, PyObject *unused);
PyObject *brrr_py_chain_program(PyObject *module, PyObject *steps);
PyObject *brrr_py_chain_partial_rows(PyObject *module, PyObject *rows);
PyObject *brrr_py_chain_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_chain_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_layer_norm_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_layer_norm_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_rms_norm_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_rms_norm_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_norm_partial_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_dropout_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_dropout_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_xent_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_xent_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *brrr_py_rotary(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

brrr_state *brrr_get_state(PyObject *module) { return (brrr_state *)PyModule_GetState(module); }

static int cuda_device_count(void) {
#if BRRR_WITH_CUDA
    int count = 0;
    return brrr_cuda_device_count(&count) == 0 ? count : 0;
#else
    return 0;
#endif
}

static PyObject *py_cuda_available(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyBool_FromLong(cuda_device_count() > 0);
}

static PyObject *py_build_info(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    int runtime = 0, driver = 0;
#if BRRR_WITH_CUDA
    brrr_cuda_runtime_version(&runtime);
    if (brrr_cuda_driver_version(&driver) != 0) driver = 0;
#endif
    return Py_BuildValue("{s:O,s:s,s:i,s:i,s:i,s:s,s:i,s:i}", "cuda_compiled", BRRR_WITH_CUDA ? Py_True : Py_False,
                         "cuda_archs", BRRR_BUILD_CUDA_ARCHS, "cuda_runtime_version", runtime, "cuda_driver_version",
                         driver, "cuda_device_count", cuda_device_count(), "dlpack_version", "1.3", "max_dims",
                         BRRR_MAX_DIMS, "max_chain_steps", BRRR_MAX_CHAIN_STEPS);
}

static PyMethodDef methods[] = {
    {"cuda_available", py_cuda_available, METH_NOARGS, "True when CUDA kernels are compiled in and a GPU is visible."},
    {"build_info", py_build_info, METH_NOARGS, "What was compiled in and what the runtime found."},
    {"chain_op_names", brrr_py_chain_op_names, METH_NOARGS, "Names of the ops a chain step may use."},
    {"chain_program", brrr_py_chain_program, METH_O, "chain_program(steps) -> bytes: validate and pack a chain."},
    {"chain_partial_rows", brrr_py_chain_partial_rows, METH_O,
     "chain_partial_rows(rows) -> int: rows of the fp32 scratch a CUDA bias gradient needs per operand."},
    {"chain_fwd", (PyCFunction)(void (*)(void))brrr_py_chain_fwd, METH_FASTCALL,
     "chain_fwd(program, x, out, operands, stream) -> out"},
    {"chain_bwd", (PyCFunction)(void (*)(void))brrr_py_chain_bwd, METH_FASTCALL,
     "chain_bwd(program, x, grad_out, grad_x, operands, grad_operands, partials, stream) -> grad_x"},
    {"layer_norm_fwd", (PyCFunction)(void (*)(void))brrr_py_layer_norm_fwd, METH_FASTCALL,
     "layer_norm_fwd(x, norm_ndim, weight, bias, eps, out, mean, rstd, residual, residual_out, stream) -> out, "
     "or (out, residual_out), then mean and rstd where they were True (allocated here)"},
    {"layer_norm_bwd", (PyCFunction)(void (*)(void))brrr_py_layer_norm_bwd, METH_FASTCALL,
     "layer_norm_bwd(x, norm_ndim, grad_out, grad_residual, weight, mean, rstd, grad_x, grad_weight, grad_bias, "
     "partials, stream) -> grad_x, then grad_weight and grad_bias where they were True (allocated here)"},
    {"rms_norm_fwd", (PyCFunction)(void (*)(void))brrr_py_rms_norm_fwd, METH_FASTCALL,
     "rms_norm_fwd(x, norm_ndim, weight, eps, llama, out, rstd, residual, residual_out, stream) -> out, "
     "or (out, residual_out), then rstd where it was True (allocated here)"},
    {"rms_norm_bwd", (PyCFunction)(void (*)(void))brrr_py_rms_norm_bwd, METH_FASTCALL,
     "rms_norm_bwd(x, norm_ndim, grad_out, grad_residual, weight, rstd, llama, grad_x, grad_weight, partials, "
     "stream) -> grad_x, then grad_weight where it was True (allocated here)"},
    {"norm_partial_rows", (PyCFunction)(void (*)(void))brrr_py_norm_partial_rows, METH_FASTCALL,
     "norm_partial_rows(rows, cols) -> int: rows of the CUDA backward's partials scratch per weight/bias gradient."},
    {"dropout_fwd", (PyCFunction)(void (*)(void))brrr_py_dropout_fwd, METH_FASTCALL,
     "dropout_fwd(x, bias, residual, out, p, seed, offset, stream) -> out = residual + dropout(x + bias, p)"},
    {"dropout_bwd", (PyCFunction)(void (*)(void))brrr_py_dropout_bwd, METH_FASTCALL,
     "dropout_bwd(grad_out, grad_x, grad_bias, partials, p, seed, offset, stream) -> grad_x"},
    {"cross_entropy_fwd", (PyCFunction)(void (*)(void))brrr_py_xent_fwd, METH_FASTCALL,
     "cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, lse, loss, total, count, stream) "
     "-> None, or (lse, loss, total, count) when any of them is True (allocated here)"},
    {"cross_entropy_bwd", (PyCFunction)(void (*)(void))brrr_py_xent_bwd, METH_FASTCALL,
     "cross_entropy_bwd(logits, target, ignore_index, label_smoothing, lse, grad_loss, count, grad_logits, stream) "
     "-> grad_logits"},
    {"set_num_threads", brrr_py_set_num_threads, METH_O,
     "set_num_threads(n) -> previous setting: threads of the CPU kernels (0: torch.get_num_threads() for torch tensors, else "
     "OMP_NUM_THREADS or os.cpu_count())."},
    {"get_num_threads", brrr_py_get_num_threads, METH_NOARGS,
     "get_num_threads() -> int: the set count, else the automatic one for inputs other than torch tensors."},
    {"set_thread_grain", brrr_py_set_thread_grain, METH_O,
     "set_thread_grain(elements) -> previous: the least work per CPU thread (default 32768; tests set 1)."},
    {"num_threads_for", brrr_py_num_threads_for, METH_O,
     "num_threads_for(x) -> int: the threads a CPU call whose first argument is x runs on (at most)."},
    {"rotary", (PyCFunction)(void (*)(void))brrr_py_rotary, METH_FASTCALL,
     "rotary(x, cos, sin, out, backward, stream) -> out: x * cos + rotate_half(x) * sin (or its transpose)"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module) {
    import_array1(-1);
    brrr_state *st = brrr_get_state(module);
    st->api_cache_len = 0;
    st->str_dlpack = PyUnicode_InternFromString("__dlpack__");
    st->str_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    st->str_exchange_api = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
    st->max_version = Py_BuildValue("(ii)", BRRR_DLPACK_MAJOR, BRRR_DLPACK_MINOR);
    if (!st->str_dlpack || !st->str_dlpack_device || !st->str_exchange_api || !st->max_version) return -1;
    if (brrr_cpu_init(st) < 0) return -1;
    if (PyModule_AddIntConstant(module, "MAX_DIMS", BRRR_MAX_DIMS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_CHAIN_STEPS", BRRR_MAX_CHAIN_STEPS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_CHAIN_OPERANDS", BRRR_MAX_CHAIN_OPERANDS) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    brrr_state *st = brrr_get_state(module);
    if (st == NULL) return 0;
    for (int i = 0; i < st->api_cache_len; i++) Py_VISIT(st->api_cache[i].type);
    Py_VISIT(st->torch_tensor_type);
    Py_VISIT(st->torch_get_num_threads);
    return 0;
}

static int module_clear(PyObject *module) {
    brrr_state *st = brrr_get_state(module);
    if (st == NULL) return 0;
    for (int i = 0; i < st->api_cache_len; i++) Py_CLEAR(st->api_cache[i].type);
    st->api_cache_len = 0;
    Py_CLEAR(st->str_dlpack);
    Py_CLEAR(st->str_dlpack_device);
    Py_CLEAR(st->str_exchange_api);
    Py_CLEAR(st->max_version);
    Py_CLEAR(st->torch_tensor_type);
    Py_CLEAR(st->torch_get_num_threads);
    return 0;
}

static void module_free(void *module) { module_clear((PyObject *)module); }

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "brrr._C",
    .m_doc = "brrr's C extension: fused kernels and the DLPack bridge.",
    .m_size = sizeof(brrr_state),
    .m_methods = methods,
    .m_slots = slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
