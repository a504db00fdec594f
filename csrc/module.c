/* brrr._C: module definition (multi-phase init, per-module state, no mutable globals). */
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "op.h"
#include "chain_jit.h"
#include "cpu.h"

#include <numpy/arrayobject.h>

PyObject *brrr_py_chain_op_names(PyObject *module, PyObject *unused);
PyObject *brrr_py_chain_program(PyObject *module, PyObject *steps);
PyObject *brrr_py_chain_partial_rows(PyObject *module, PyObject *rows);
PyObject *brrr_py_norm_partial_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* Every family's ops (BRRR_FAMILIES: written by setup.py from csrc's file names). */
#define DECLARE_FAMILY(name) extern const brrr_op_spec *const brrr_##name##_ops[];
BRRR_FAMILIES(DECLARE_FAMILY)
#define FAMILY_ENTRY(name) brrr_##name##_ops,
static const brrr_op_spec *const *const FAMILIES[] = {BRRR_FAMILIES(FAMILY_ENTRY)};

brrr_state *brrr_get_state(PyObject *module) { return (brrr_state *)PyModule_GetState(module); }

/* check_tensor(obj, name, index=False): the error brrr's import raises for obj as input `name` (a
 * tensor of class indices where index is true, else of floats), or None. For the Python layer,
 * which reshapes some tensors before they get here. */
static PyObject *py_check_tensor(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3 || !PyUnicode_Check(args[1]) || (nargs == 3 && !PyBool_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError,
                        "check_tensor(obj, name, index=False) takes a tensor, its argument name (str) and a bool");
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(args[1]);
    if (name == NULL) return NULL;
    brrr_call call = {.state = brrr_get_state(module), .stream_arg = -1};
    brrr_tensor t;
    const int status = nargs == 3 && args[2] == Py_True ? brrr_index_import(&call, args[0], name, &t)
                                                         : brrr_tensor_import(&call, args[0], name, 0, &t);
    if (status < 0) return NULL;
    brrr_tensor_release(&t);
    Py_RETURN_NONE;
}

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
    /* Chains have no step limit (the CPU twin, and on CUDA the kernels compiled for each chain);
     * without NVRTC (chain_jit_info() says), CUDA chains run in the interpreted kernels, which
     * take at most max_interpreted_chain_steps. */
    return Py_BuildValue("{s:O,s:s,s:i,s:i,s:i,s:s,s:i,s:O,s:i}", "cuda_compiled", BRRR_WITH_CUDA ? Py_True : Py_False,
                         "cuda_archs", BRRR_BUILD_CUDA_ARCHS, "cuda_runtime_version", runtime, "cuda_driver_version",
                         driver, "cuda_device_count", cuda_device_count(), "dlpack_version", "1.3", "max_dims",
                         BRRR_MAX_DIMS, "max_chain_steps", Py_None, "max_interpreted_chain_steps", BRRR_MAX_CHAIN_STEPS);
}

static PyMethodDef methods[] = {
    {"cuda_available", py_cuda_available, METH_NOARGS, "True when CUDA kernels are compiled in and a GPU is visible."},
    {"build_info", py_build_info, METH_NOARGS, "What was compiled in and what the runtime found."},
    {"check_tensor", (PyCFunction)(void (*)(void))py_check_tensor, METH_FASTCALL,
     "check_tensor(obj, name, index=False) -> None: raise the error brrr raises for obj as the input `name` (of class "
     "indices where index is True), if any."},
    {"chain_op_names", brrr_py_chain_op_names, METH_NOARGS, "Names of the ops a chain step may use."},
    {"chain_program", brrr_py_chain_program, METH_O, "chain_program(steps) -> bytes: validate and pack a chain."},
    {"chain_jit_compile", (PyCFunction)(void (*)(void))brrr_py_chain_jit_compile, METH_VARARGS | METH_KEYWORDS,
     "chain_jit_compile(steps, dtype, backward=False, layout='contiguous', ndim=1, vector_mask=0, grad_mask=0, arch=90, "
     "index32=False, with_backward=False) -> "
     "(source, cubin, origin): the program a CUDA call compiles for these steps (with_backward: the forward with its "
     "backward), through the disk cache ('disk' or 'compiled'); needs NVRTC, not a GPU."},
    {"chain_jit_with_backward", brrr_py_chain_jit_with_backward, METH_O,
     "chain_jit_with_backward(program): the chain's backward is wanted; its contiguous forward kernels are compiled "
     "from now on in one program with their backward."},
    {"chain_jit_info", brrr_py_chain_jit_info, METH_NOARGS,
     "chain_jit_info() -> dict: NVRTC (path, version, or why it is missing), the cache folder, whether CUDA chains are "
     "compiled, and how many programs (of one or two kernels) were compiled and read from the cache."},
    {"chain_jit_enable", brrr_py_chain_jit_enable, METH_O,
     "chain_jit_enable(flag) -> previous: run CUDA chains as compiled kernels (True, the default) or interpreted."},
    {"chain_partial_rows", brrr_py_chain_partial_rows, METH_O,
     "chain_partial_rows(rows) -> int: rows of the fp32 scratch a CUDA bias gradient needs per operand."},
    {"norm_partial_rows", (PyCFunction)(void (*)(void))brrr_py_norm_partial_rows, METH_FASTCALL,
     "norm_partial_rows(rows, cols) -> int: rows of the CUDA backward's partials scratch per weight/bias gradient."},
    {"set_num_threads", brrr_py_set_num_threads, METH_O,
     "set_num_threads(n) -> previous setting: threads of the CPU kernels (0: torch.get_num_threads() for torch tensors, else "
     "OMP_NUM_THREADS or os.cpu_count())."},
    {"get_num_threads", brrr_py_get_num_threads, METH_NOARGS,
     "get_num_threads() -> int: the set count, else the automatic one for inputs other than torch tensors."},
    {"set_thread_grain", brrr_py_set_thread_grain, METH_O,
     "set_thread_grain(elements) -> previous: the least work per CPU thread (default 32768; tests set 1)."},
    {"num_threads_for", brrr_py_num_threads_for, METH_O,
     "num_threads_for(x) -> int: the threads a CPU call whose first argument is x runs on (at most)."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module) {
    import_array1(-1);
    brrr_state *st = brrr_get_state(module);
    st->api_cache_len = 0;
    st->str_dlpack = PyUnicode_InternFromString("__dlpack__");
    st->str_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    st->str_exchange_api = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
    st->str_is_neg = PyUnicode_InternFromString("is_neg");
    st->max_version = Py_BuildValue("(ii)", BRRR_DLPACK_MAJOR, BRRR_DLPACK_MINOR);
    if (!st->str_dlpack || !st->str_dlpack_device || !st->str_exchange_api || !st->str_is_neg || !st->max_version)
        return -1;
    if (brrr_cpu_init(st) < 0) return -1;
    brrr_chain_jit_init();
    if (PyModule_AddIntConstant(module, "MAX_DIMS", BRRR_MAX_DIMS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_CHAIN_STEPS", BRRR_MAX_CHAIN_STEPS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_CHAIN_OPERANDS", BRRR_MAX_CHAIN_OPERANDS) < 0)
        return -1;
    for (size_t f = 0; f < sizeof FAMILIES / sizeof FAMILIES[0]; f++)
        if (brrr_add_ops(module, FAMILIES[f]) < 0) return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    brrr_state *st = brrr_get_state(module);
    if (st == NULL) return 0;
    for (int i = 0; i < st->api_cache_len; i++) {
        Py_VISIT(st->api_cache[i].type);
        Py_VISIT(st->api_cache[i].capsule);
        Py_VISIT(st->api_cache[i].is_neg);
        Py_VISIT(st->api_cache[i].is_zerotensor);
    }
    Py_VISIT(st->torch_tensor_type);
    Py_VISIT(st->torch_get_num_threads);
    return 0;
}

static int module_clear(PyObject *module) {
    brrr_state *st = brrr_get_state(module);
    if (st == NULL) return 0;
    for (int i = 0; i < st->api_cache_len; i++) brrr_type_info_clear(&st->api_cache[i]);
    st->api_cache_len = 0;
    Py_CLEAR(st->str_dlpack);
    Py_CLEAR(st->str_dlpack_device);
    Py_CLEAR(st->str_exchange_api);
    Py_CLEAR(st->str_is_neg);
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
