/* The generic call path of every op (op.h says what a call does, in order). */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL brrr_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "op.h"

#include "cpu.h"

#include <math.h>
#include <numpy/arrayobject.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>

#define MAX_PARAMS (BRRR_OP_MAX_SLOTS + BRRR_OP_MAX_ARGS + 1) /* slots, scalars, stream */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    const brrr_op_spec *spec;
    PyObject *module;             /* strong: its state holds the DLPack exchange-table cache */
    PyObject *names[MAX_PARAMS];  /* interned parameter names, for keyword matching */
    PyObject *doc;
    char rows_name[48], cols_name[48]; /* "x.shape[:-1]", "x.shape[-1:]": the names of x's rows and columns */
} op_object;

static int n_params(const brrr_op_spec *spec) { return spec->n_slots + spec->n_args + 1; }

static const char *param_name(const brrr_op_spec *spec, int i) {
    if (i < spec->n_slots) return spec->slots[i].name;
    if (i < spec->n_slots + spec->n_args) return spec->args[i - spec->n_slots].name;
    return "stream";
}

/* ---- arguments ----------------------------------------------------------------------------------- */

static int parse_arg(const brrr_arg_spec *a, PyObject *v, brrr_arg *out) {
    switch (a->type) {
    case BRRR_ARG_OPTIONAL_FLOAT:
        if (v == Py_None) {
            out->f = 0.0;
            return 0;
        }
        /* fall through */
    case BRRR_ARG_FLOAT:
        if (!PyFloat_Check(v) && !(PyLong_Check(v) && !PyBool_Check(v))) {
            PyErr_Format(PyExc_TypeError, "argument %s: expected %s, got %.200s", a->name, a->expect,
                         Py_TYPE(v)->tp_name);
            return -1;
        }
        out->f = PyFloat_AsDouble(v);
        if (out->f == -1.0 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "argument %s: expected %s, got %R", a->name, a->expect, v);
            return -1;
        }
        if (!(out->f >= a->lo && out->f <= a->hi)) { /* NaN fails too */
            PyErr_Format(PyExc_ValueError, "argument %s: expected %s, got %R", a->name, a->expect, v);
            return -1;
        }
        return 0;
    case BRRR_ARG_INT:
    case BRRR_ARG_UINT64:
        if (!PyLong_Check(v) || PyBool_Check(v)) {
            PyErr_Format(PyExc_TypeError, "argument %s: expected %s, got %.200s", a->name, a->expect,
                         Py_TYPE(v)->tp_name);
            return -1;
        }
        if (a->type == BRRR_ARG_UINT64) {
            out->u = PyLong_AsUnsignedLongLong(v);
            if (out->u == (unsigned long long)-1 && PyErr_Occurred()) goto range;
            return 0;
        }
        out->i = PyLong_AsLongLong(v);
        if ((out->i == -1 && PyErr_Occurred()) || (double)out->i < a->lo || (double)out->i > a->hi) goto range;
        return 0;
    case BRRR_ARG_BOOL:
        if (!PyBool_Check(v)) {
            PyErr_Format(PyExc_TypeError, "argument %s: expected a bool, got %.200s", a->name, Py_TYPE(v)->tp_name);
            return -1;
        }
        out->i = v == Py_True;
        return 0;
    case BRRR_ARG_CHOICE:
        if (PyUnicode_Check(v))
            for (int k = 0; a->choices[k]; k++)
                if (PyUnicode_CompareWithASCIIString(v, a->choices[k]) == 0) {
                    out->i = k;
                    return 0;
                }
        PyErr_Format(PyUnicode_Check(v) ? PyExc_ValueError : PyExc_TypeError, "argument %s: expected %s, got %R",
                     a->name, a->expect, v);
        return -1;
    default:
        out->o = v;
        return 0;
    }
range:
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "argument %s: expected %s, got %R", a->name, a->expect, v);
    return -1;
}

/* Bind positional and keyword arguments to the op's parameters: values[i] borrowed, NULL where
 * not passed. */
static int bind(op_object *self, PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject **values) {
    const brrr_op_spec *spec = self->spec;
    const int n = n_params(spec);
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "brrr._C.%s() takes at most %d arguments (%zd given)", spec->name, n, nargs);
        return -1;
    }
    for (int i = 0; i < n; i++) values[i] = i < nargs ? args[i] : NULL;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < n && key != self->names[i]) i++;
        for (int j = 0; i == n && j < n; j++) /* not interned by the caller: compare the text */
            if (PyUnicode_Compare(key, self->names[j]) == 0) i = j;
        if (PyErr_Occurred()) return -1;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "brrr._C.%s() got an unexpected keyword argument %R", spec->name, key);
            return -1;
        }
        if (values[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "brrr._C.%s() got multiple values for argument '%s'", spec->name,
                         param_name(spec, i));
            return -1;
        }
        values[i] = args[nargs + k];
    }
    if (values[0] == NULL) {
        PyErr_Format(PyExc_TypeError, "brrr._C.%s() missing argument '%s'", spec->name, spec->slots[0].name);
        return -1;
    }
    for (int a = 0; a < spec->n_args; a++)
        if (values[spec->n_slots + a] == NULL && !spec->args[a].has_default) {
            PyErr_Format(PyExc_TypeError, "brrr._C.%s() missing argument '%s'", spec->name, spec->args[a].name);
            return -1;
        }
    return 0;
}

/* ---- slots --------------------------------------------------------------------------------------- */

static int is_half(int32_t dtype) { return dtype == BRRR_F16 || dtype == BRRR_BF16; }
static int32_t acc_dtype(int32_t dtype) { return dtype == BRRR_F64 ? BRRR_F64 : BRRR_F32; }

/* The slot's shape reference: x, its rows, its columns; NULL for the other rules. */
static const brrr_tensor *shape_ref(const brrr_op_call *c, int rule) {
    switch (rule) {
    case BRRR_SHAPE_X: return &c->t[0];
    case BRRR_SHAPE_ROWS: return &c->rows;
    case BRRR_SHAPE_COLS: return &c->cols;
    default: return NULL;
    }
}

/* The dtype of the parameters (BRRR_DTYPE_PARAM slots) among the given ones, or -1. */
static int32_t param_dtype(const brrr_op_call *c) {
    for (int s = 0; s < c->spec->n_slots; s++)
        if (c->spec->slots[s].dtype == BRRR_DTYPE_PARAM && brrr_has(c, s)) return c->t[s].dtype;
    return -1;
}

static int check_dtype(const brrr_op_call *c, int s) {
    const brrr_tensor *t = &c->t[s], *x = &c->t[0];
    switch (c->spec->slots[s].dtype) {
    case BRRR_DTYPE_X: return brrr_check_same_dtype(t, x);
    case BRRR_DTYPE_ACC:
        if (t->dtype == acc_dtype(x->dtype)) return 0;
        PyErr_Format(PyExc_ValueError, "argument %s: expected dtype %s (the accumulation dtype for %s of dtype %s), "
                     "got %s", t->name, brrr_dtype_name(acc_dtype(x->dtype)), x->name, brrr_dtype_name(x->dtype),
                     brrr_dtype_name(t->dtype));
        return -1;
    case BRRR_DTYPE_PARAM: {
        if (t->dtype != x->dtype && !(t->dtype == BRRR_F32 && is_half(x->dtype))) {
            PyErr_Format(PyExc_ValueError, "argument %s: dtype %s does not go with %s of dtype %s (expected %s%s)",
                         t->name, brrr_dtype_name(t->dtype), x->name, brrr_dtype_name(x->dtype),
                         brrr_dtype_name(x->dtype), is_half(x->dtype) ? " or float32" : "");
            return -1;
        }
        for (int p = 0; p < s; p++) /* the parameters share one dtype */
            if (c->spec->slots[p].dtype == BRRR_DTYPE_PARAM && brrr_has(c, p))
                return brrr_check_same_dtype(t, &c->t[p]);
        return 0;
    }
    default: return 0; /* indices: checked on import; BRRR_DTYPE_ANY: by the family */
    }
}

static int check_contiguous(const brrr_tensor *t) {
    int64_t expect = 1;
    for (int d = t->ndim - 1; d >= 0 && t->numel > 1; d--) {
        if (t->shape[d] != 1 && t->strides[d] != expect) {
            PyErr_Format(PyExc_ValueError, "argument %s: must be contiguous", t->name);
            return -1;
        }
        expect *= t->shape[d];
    }
    return 0;
}

static int check_slot(brrr_op_call *c, int s) {
    const brrr_slot_spec *spec = &c->spec->slots[s];
    const brrr_tensor *t = &c->t[s], *ref = shape_ref(c, spec->shape);
    if (s > 0 && (brrr_check_same_device(t, &c->t[0]) < 0 || check_dtype(c, s) < 0)) return -1;
    if (ref && s > 0 && brrr_check_same_shape(t, ref) < 0) return -1;
    if (spec->shape == BRRR_SHAPE_SCALAR && t->ndim != 0) {
        PyErr_Format(PyExc_ValueError, "argument %s: expected a 0-d tensor, got a %d-d one", t->name, (int)t->ndim);
        return -1;
    }
    if ((spec->flags & BRRR_CONTIG) && check_contiguous(t) < 0) return -1;
    return (spec->flags & BRRR_WRITE) ? brrr_check_no_internal_overlap(t) : 0;
}

static int import_slot(brrr_op_call *c, int s, PyObject *obj) {
    const brrr_slot_spec *spec = &c->spec->slots[s];
    c->written[s] = (spec->flags & BRRR_WRITE) != 0;
    if (c->owned[s] == obj && brrr_has(c, s)) return 0; /* described by brrr_new_like */
    const int status = spec->dtype == BRRR_DTYPE_INDEX ? brrr_index_import(&c->call, obj, spec->name, &c->t[s])
                                                       : brrr_tensor_import(&c->call, obj, spec->name, c->written[s], &c->t[s]);
    return status < 0 || s == 0 ? status : brrr_check_same_framework(&c->t[s], obj, &c->t[0], c->obj[0]);
}

/* A new output for slot s by x's framework: contiguous, with the shape and dtype its rules give. */
static PyObject *allocate(brrr_op_call *c, int s) {
    const brrr_slot_spec *spec = &c->spec->slots[s];
    const brrr_tensor *x = &c->t[0], *ref = shape_ref(c, spec->shape);
    PyObject *x_obj = c->obj[0];
    int32_t dtype = x->dtype;
    if (spec->dtype == BRRR_DTYPE_ACC) dtype = acc_dtype(x->dtype);
    if (spec->dtype == BRRR_DTYPE_PARAM && (dtype = param_dtype(c)) < 0) {
        PyErr_Format(PyExc_ValueError, "argument %s: cannot be allocated here without a parameter (weight or bias) "
                     "to take its dtype from", spec->name);
        return NULL;
    }
    const int ndim = ref ? ref->ndim : 0;
    const int64_t none = 0, *shape = ref ? ref->shape : &none;
    if (PyArray_Check(x_obj) && spec->shape == BRRR_SHAPE_X && spec->dtype == BRRR_DTYPE_X)
        /* elementwise outputs keep x's memory order, as NumPy's own ufuncs do */
        return PyArray_NewLikeArray((PyArrayObject *)x_obj, (spec->flags & BRRR_INPLACE) ? NPY_KEEPORDER : NPY_CORDER,
                                    NULL, 0);
    if (PyArray_Check(x_obj)) {
        npy_intp dims[BRRR_MAX_RANK];
        for (int d = 0; d < ndim; d++) dims[d] = (npy_intp)shape[d];
        const int typenum = dtype == BRRR_F64 ? NPY_FLOAT64 : dtype == BRRR_F16 ? NPY_FLOAT16 : NPY_FLOAT32;
        return PyArray_SimpleNew(ndim, dims, typenum);
    }
    c->t[s].name = spec->name; /* described by the allocation: import_slot takes it as it is */
    PyObject *obj = brrr_new_shaped(&c->call, x_obj, x, ndim, shape, dtype, &c->t[s]);
    if (obj && c->t[s].device_type == kDLCPU)
        brrr_cpu_advise_huge_pages(c->t[s].data, c->t[s].numel * (int64_t)brrr_dtype_size(dtype));
    if (obj == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "argument %s: brrr._C allocates outputs only for NumPy arrays and tensors of "
                     "frameworks with DLPack's C exchange table; pass one for %s of type %.200s", spec->name, x->name,
                     Py_TYPE(x_obj)->tp_name);
    return obj;
}

/* The CUDA scratch slot s: given, or allocated on the framework's current stream, of at least
 * `want` elements. */
static int import_scratch(brrr_op_call *c, int s, int64_t want) {
    const char *name = c->spec->slots[s].name;
    const brrr_tensor *x = &c->t[0];
    PyObject *obj = c->obj[s];
    if (obj == NULL || obj == Py_None) {
        if (c->call.stream_arg >= 0) { /* brrr._C allocates on the framework's current stream only */
            PyErr_Format(PyExc_TypeError, "argument %s: required on CUDA with an explicit stream (a contiguous 1-D %s "
                         "tensor of at least %lld elements)", name, brrr_dtype_name(acc_dtype(x->dtype)),
                         (long long)want);
            return -1;
        }
        c->t[s].name = name;
        obj = c->owned[s] = brrr_new_shaped(&c->call, c->obj[0], x, 1, &want, acc_dtype(x->dtype), &c->t[s]);
        if (obj == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "argument %s: required on CUDA (a contiguous 1-D %s tensor of at least "
                             "%lld elements) for inputs without DLPack's C exchange table", name,
                             brrr_dtype_name(acc_dtype(x->dtype)), (long long)want);
            return -1;
        }
    }
    c->written[s] = 1;
    brrr_tensor *t = &c->t[s];
    if (!(c->owned[s] == obj && brrr_has(c, s)) && brrr_tensor_import(&c->call, obj, name, 1, t) < 0) return -1;
    if (brrr_check_same_device(t, x) < 0 || check_dtype(c, s) < 0) return -1;
    if (t->ndim != 1 || t->numel < want || (t->numel > 1 && t->strides[0] != 1)) {
        PyErr_Format(PyExc_ValueError, "argument %s: expected a contiguous 1-D tensor of at least %lld elements", name,
                     (long long)want);
        return -1;
    }
    return 0;
}

int brrr_op_import_extra(brrr_op_call *c, int slot, PyObject *obj, const char *name, int writable) {
    c->written[slot] = (uint8_t)writable;
    if (brrr_tensor_import(&c->call, obj, name, writable, &c->t[slot]) < 0 ||
        brrr_check_same_framework(&c->t[slot], obj, &c->t[0], c->obj[0]) < 0)
        return -1;
    return brrr_check_same_device(&c->t[slot], &c->t[0]);
}

/* x's rows and columns, for the shape rules. */
static int split_x(brrr_op_call *c) {
    const brrr_op_spec *spec = c->spec;
    const brrr_tensor *x = &c->t[0];
    long long k = 1;
    if (spec->split_arg >= 0) {
        const char *k_name = spec->args[spec->split_arg].name;
        k = c->arg[spec->split_arg].i;
        if (k < 1 || k > x->ndim) {
            PyErr_Format(PyExc_ValueError, "argument %s: expected 1 <= %s <= %s.ndim (%d), got %lld", k_name, k_name,
                         x->name, (int)x->ndim, k);
            return -1;
        }
    }
    c->split = (int)(k < x->ndim ? k : x->ndim);
    const int lead = x->ndim - c->split;
    c->rows.ndim = lead;
    memcpy(c->rows.shape, x->shape, sizeof(int64_t) * (size_t)lead);
    c->cols.ndim = c->split;
    memcpy(c->cols.shape, x->shape + lead, sizeof(int64_t) * (size_t)c->split);
    c->n_rows = c->n_cols = 1;
    for (int d = 0; d < lead; d++) c->n_rows *= x->shape[d];
    for (int d = lead; d < x->ndim; d++) c->n_cols *= x->shape[d];
    return 0;
}

/* Is the output slot s needed, and may brrr._C allocate it? */
static int output_wanted(const brrr_op_call *c, int s, PyObject *obj) {
    const brrr_slot_spec *spec = &c->spec->slots[s];
    if (obj == Py_True) return 1;
    if (obj != NULL && obj != Py_None) return 1;
    if (!(spec->flags & BRRR_OPTIONAL)) return 1;
    return spec->when >= 0 && brrr_has(c, spec->when);
}

static int run_call(brrr_op_call *c, PyObject **values) {
    const brrr_op_spec *spec = c->spec;
    for (int a = 0; a < spec->n_args; a++) {
        const brrr_arg_spec *arg = &spec->args[a];
        PyObject *v = values[spec->n_slots + a];
        if (v == NULL && arg->type == BRRR_ARG_FLOAT) c->arg[a].f = arg->default_value;
        else if (v == NULL) c->arg[a].i = (long long)arg->default_value; /* OPTIONAL_FLOAT: None is 0 */
        else if (parse_arg(arg, v, &c->arg[a]) < 0) return -1;
    }
    PyObject *stream = values[spec->n_slots + spec->n_args];
    if (stream != NULL && brrr_parse_stream(stream, &c->call.stream_arg) < 0) return -1;
    for (int s = 0; s < spec->n_slots; s++) c->obj[s] = values[s];

    if (import_slot(c, 0, c->obj[0]) < 0 || split_x(c) < 0) return -1;
    for (int s = 1; s < spec->n_slots; s++) {
        const brrr_slot_spec *slot = &spec->slots[s];
        PyObject *obj = c->obj[s];
        if ((slot->flags & BRRR_WRITE) || obj == NULL || obj == Py_None) {
            if (!(slot->flags & (BRRR_WRITE | BRRR_OPTIONAL))) {
                PyErr_Format(PyExc_TypeError, "argument %s: expected a tensor or array, got None", slot->name);
                return -1;
            }
            continue;
        }
        if (import_slot(c, s, obj) < 0 || check_slot(c, s) < 0) return -1;
    }

    int scratch_slot = -1;
    for (int s = 1; s < spec->n_slots; s++) {
        const brrr_slot_spec *slot = &spec->slots[s];
        PyObject *obj = c->obj[s];
        if (!(slot->flags & BRRR_WRITE)) continue;
        if (slot->shape == BRRR_SHAPE_SCRATCH) {
            scratch_slot = s;
            continue;
        }
        if (!output_wanted(c, s, obj)) continue;
        if (obj == Py_True && !((slot->flags & BRRR_OPTIONAL) && (slot->flags & BRRR_ALLOC))) {
            PyErr_Format(PyExc_TypeError, "argument %s: True (allocate it here) is not taken for this argument",
                         slot->name);
            return -1;
        }
        if (slot->when >= 0 && obj != NULL && obj != Py_None && !brrr_has(c, slot->when)) {
            PyErr_Format(PyExc_ValueError, "argument %s: given without %s", slot->name, spec->slots[slot->when].name);
            return -1;
        }
        if (obj == NULL || obj == Py_None || obj == Py_True) {
            if (!(slot->flags & BRRR_ALLOC)) {
                PyErr_Format(PyExc_TypeError, "argument %s: required", slot->name);
                return -1;
            }
            obj = c->owned[s] = allocate(c, s);
            if (obj == NULL) return -1;
        }
        if (import_slot(c, s, obj) < 0 || check_slot(c, s) < 0) return -1;
    }
    if (spec->check && spec->check(c) < 0) return -1;
    if (scratch_slot >= 0 && !brrr_on_cpu(c)) {
        const int64_t want = spec->scratch ? spec->scratch(c) : 0;
        if (want > 0 && import_scratch(c, scratch_slot, want) < 0) return -1;
    }
    for (int s = 0; s < BRRR_OP_MAX_SLOTS; s++) /* every argument imported: none changed meanwhile */
        if (c->t[s].name && brrr_tensor_check_borrowed(&c->call, &c->t[s]) < 0) return -1;
    /* No written tensor may share memory with another argument; an in-place output may be x. An
     * output allocated here is new memory, which shares none. */
    for (int o = 0; o < BRRR_OP_MAX_SLOTS; o++) {
        if (!c->written[o] || c->t[o].name == NULL || c->owned[o]) continue;
        const int inplace = o < spec->n_slots && (spec->slots[o].flags & BRRR_INPLACE);
        for (int i = 0; i < BRRR_OP_MAX_SLOTS; i++)
            if (i != o && c->t[i].name && !c->owned[i] &&
                brrr_check_no_overlap(&c->t[o], &c->t[i], inplace && !c->written[i]) < 0)
                return -1;
    }
    return spec->run(c);
}

/* The written slots in spec order (scratch excepted), None where absent. */
static PyObject *results(const brrr_op_call *c) {
    const brrr_op_spec *spec = c->spec;
    int n = 0;
    for (int s = 0; s < spec->n_slots; s++)
        n += (spec->slots[s].flags & BRRR_WRITE) && spec->slots[s].shape != BRRR_SHAPE_SCRATCH;
    PyObject *tuple = PyTuple_New(n);
    if (tuple == NULL) return NULL;
    for (int s = 0, k = 0; s < spec->n_slots; s++) {
        if (!(spec->slots[s].flags & BRRR_WRITE) || spec->slots[s].shape == BRRR_SHAPE_SCRATCH) continue;
        PyObject *v = !brrr_has(c, s) ? Py_None : c->owned[s] ? c->owned[s] : c->obj[s];
        PyTuple_SET_ITEM(tuple, k++, Py_NewRef(v));
    }
    return tuple;
}

/* A CUDA call on a stream nobody named waits for its kernels (csrc/brrr.h: wait_for_kernels). */
static int wait_for_kernels(brrr_op_call *c) {
#if BRRR_WITH_CUDA
    if (c->call.wait_for_kernels) {
        int err;
        Py_BEGIN_ALLOW_THREADS err = brrr_cuda_stream_synchronize(c->call.stream);
        Py_END_ALLOW_THREADS
        return brrr_cuda_result(err, c->spec->name);
    }
#else
    (void)c;
#endif
    return 0;
}

static PyObject *op_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    op_object *self = (op_object *)callable;
    PyObject *values[MAX_PARAMS];
    if (bind(self, args, nargsf, kwnames, values) < 0) return NULL;
    brrr_op_call c;
    memset(&c, 0, offsetof(brrr_op_call, rows));
    memset(&c.rows, 0, BRRR_TENSOR_HEAD);
    memset(&c.cols, 0, BRRR_TENSOR_HEAD);
    for (int s = 0; s < BRRR_OP_MAX_SLOTS; s++) memset(&c.t[s], 0, BRRR_TENSOR_HEAD);
    c.rows.name = self->rows_name;
    c.cols.name = self->cols_name;
    c.spec = self->spec;
    c.call.state = brrr_get_state(self->module);
    c.call.stream_arg = -1;
    PyObject *result = run_call(&c, values) < 0 || wait_for_kernels(&c) < 0 ? NULL : results(&c);
    for (int s = 0; s < BRRR_OP_MAX_SLOTS; s++) {
        brrr_tensor_release(&c.t[s]);
        Py_XDECREF(c.owned[s]);
    }
    return result;
}

/* ---- the op objects ------------------------------------------------------------------------------ */

static PyObject *names_tuple(const brrr_op_spec *spec, int outputs) {
    PyObject *list = PyList_New(0);
    for (int s = 0; list && s < spec->n_slots; s++) {
        const int written = (spec->slots[s].flags & BRRR_WRITE) != 0;
        if (written != outputs || (outputs && spec->slots[s].shape == BRRR_SHAPE_SCRATCH)) continue;
        PyObject *name = PyUnicode_FromString(spec->slots[s].name);
        if (name == NULL || PyList_Append(list, name) < 0) Py_CLEAR(list);
        Py_XDECREF(name);
    }
    PyObject *tuple = list ? PyList_AsTuple(list) : NULL;
    Py_XDECREF(list);
    return tuple;
}

static PyObject *op_get_outputs(PyObject *self, void *closure) {
    (void)closure;
    return names_tuple(((op_object *)self)->spec, 1);
}

static PyObject *op_get_name(PyObject *self, void *closure) {
    (void)closure;
    return PyUnicode_FromString(((op_object *)self)->spec->name);
}

static PyObject *op_get_doc(PyObject *self, void *closure) {
    (void)closure;
    return Py_NewRef(((op_object *)self)->doc);
}

static PyObject *op_repr(PyObject *self) {
    return PyUnicode_FromFormat("<brrr._C op %s>", ((op_object *)self)->spec->name);
}

static int op_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(((op_object *)self)->module);
    return 0;
}

static int op_clear(PyObject *self) {
    Py_CLEAR(((op_object *)self)->module);
    return 0;
}

static void op_dealloc(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    op_object *op = (op_object *)self;
    PyObject_GC_UnTrack(self);
    op_clear(self);
    for (int i = 0; i < MAX_PARAMS; i++) Py_XDECREF(op->names[i]);
    Py_XDECREF(op->doc);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyGetSetDef op_getset[] = {
    {"__name__", op_get_name, NULL, "the op's name", NULL},
    {"__doc__", op_get_doc, NULL, "the op's signature and description", NULL},
    {"outputs", op_get_outputs, NULL, "names of the outputs, in the order the call returns them", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef op_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(op_object, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot op_type_slots[] = {
    {Py_tp_repr, op_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_traverse, op_traverse},
    {Py_tp_clear, op_clear},
    {Py_tp_dealloc, op_dealloc},
    {Py_tp_getset, op_getset},
    {Py_tp_members, op_members},
    {0, NULL},
};

static PyType_Spec op_type_spec = {
    .name = "brrr._C.Op",
    .basicsize = sizeof(op_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = op_type_slots,
};

/* "name(x, weight=None, ..., *, stream=-1) -> (out, ...)\n\n" + the spec's doc. */
static PyObject *make_doc(const brrr_op_spec *spec) {
    PyObject *parts = PyList_New(0), *s = NULL;
    if (parts == NULL) return NULL;
#define ADD(obj)                                                                                                     \
    do {                                                                                                             \
        PyObject *item_ = (obj);                                                                                     \
        if (item_ == NULL || PyList_Append(parts, item_) < 0) { Py_XDECREF(item_); goto done; }                      \
        Py_DECREF(item_);                                                                                            \
    } while (0)
    ADD(PyUnicode_FromFormat("%s(", spec->name));
    for (int i = 0; i < n_params(spec); i++) {
        char dflt[48] = "";
        const brrr_arg_spec *arg = i >= spec->n_slots && i < spec->n_slots + spec->n_args ? &spec->args[i - spec->n_slots]
                                                                                          : NULL;
        if (i < spec->n_slots && (spec->slots[i].flags & (BRRR_OPTIONAL | BRRR_WRITE)))
            snprintf(dflt, sizeof dflt, "=None");
        else if (arg && arg->has_default)
            snprintf(dflt, sizeof dflt, arg->type == BRRR_ARG_OPTIONAL_FLOAT ? "=None" : "=%g", arg->default_value);
        else if (i == n_params(spec) - 1)
            snprintf(dflt, sizeof dflt, "=-1");
        ADD(PyUnicode_FromFormat("%s%s%s", i ? ", " : "", param_name(spec, i), dflt));
    }
    ADD(PyUnicode_FromString(") -> ("));
    PyObject *outs = names_tuple(spec, 1);
    if (outs == NULL) goto done;
    PyObject *sep = PyUnicode_FromString(", ");
    PyObject *joined = sep ? PyUnicode_Join(sep, outs) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(outs);
    ADD(joined);
    ADD(PyUnicode_FromFormat(")\n\n%s", spec->doc));
#undef ADD
    PyObject *empty = PyUnicode_FromString("");
    if (empty) s = PyUnicode_Join(empty, parts);
    Py_XDECREF(empty);
done:
    Py_DECREF(parts);
    return s;
}

int brrr_add_ops(PyObject *module, const brrr_op_spec *const *specs) {
    PyTypeObject *type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &op_type_spec, NULL);
    if (type == NULL) return -1;
    int status = 0;
    for (int k = 0; status == 0 && specs[k]; k++) {
        const brrr_op_spec *spec = specs[k];
        op_object *op = PyObject_GC_New(op_object, type);
        if (op == NULL) { status = -1; break; }
        Py_INCREF(type); /* each instance of a heap type holds its type */
        op->vectorcall = op_vectorcall;
        op->spec = spec;
        op->module = Py_NewRef(module);
        memset(op->names, 0, sizeof op->names);
        op->doc = make_doc(spec);
        const char *k_name = spec->split_arg >= 0 ? spec->args[spec->split_arg].name : "1";
        snprintf(op->rows_name, sizeof op->rows_name, "%s.shape[:-%s]", spec->slots[0].name, k_name);
        snprintf(op->cols_name, sizeof op->cols_name, "%s.shape[-%s:]", spec->slots[0].name, k_name);
        for (int i = 0; op->doc && i < n_params(spec); i++)
            if ((op->names[i] = PyUnicode_InternFromString(param_name(spec, i))) == NULL) Py_CLEAR(op->doc);
        PyObject_GC_Track((PyObject *)op);
        if (op->doc == NULL || PyModule_AddObjectRef(module, spec->name, (PyObject *)op) < 0) status = -1;
        Py_DECREF(op);
    }
    Py_DECREF(type);
    return status;
}
