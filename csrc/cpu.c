/* The CPU twins' threads and block loads (see cpu.h). */
#include "cpu.h"

#include <errno.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

/* The thread count fixed for the call this OS thread is making: set with the GIL by the call's
 * first CPU tensor import, read by its kernels after the GIL is released (same OS thread). */
static _Thread_local int call_threads = 1;
static _Thread_local int64_t call_grain = 1;

/* Process-wide facts, so not module state: brrr calls inside a parallel loop right now (a second
 * one from another Python thread runs on its own thread only, so several callers never add up
 * to more threads than one call's count plus the callers themselves), and whether this process
 * is a fork child. */
static atomic_int active_loops;
static atomic_int forked_child;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void on_fork_child(void) { atomic_store(&forked_child, 1); }
static void register_atfork(void) { pthread_atfork(NULL, NULL, on_fork_child); }

/* A positive count from an environment variable (OMP_NUM_THREADS may be a list: its first entry),
 * else 0. */
static int env_threads(const char *name) {
    const char *s = getenv(name);
    if (s == NULL) return 0;
    char *end;
    long n = strtol(s, &end, 10);
    return end != s && n > 0 && n <= 4096 ? (int)n : 0;
}

/* BRRR_NUM_THREADS, as set_num_threads takes a count: 0 (automatic) to 4096. Anything else is
 * warned about by name and left automatic: an import must not fail over it (a RuntimeWarning
 * made an error by the warnings filter does fail it). */
static int env_num_threads(int *count) {
    const char *s = getenv("BRRR_NUM_THREADS");
    *count = 0;
    if (s == NULL || *s == '\0') return 0; /* unset, or set empty */
    char *end;
    errno = 0;
    const long n = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0 || n < 0 || n > 4096)
        return PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                                "BRRR_NUM_THREADS: expected a count of threads from 0 (automatic) to 4096, got "
                                "'%.40s': brrr uses the automatic count",
                                s);
    *count = (int)n;
    return 0;
}

int brrr_cpu_init(brrr_state *st) {
    pthread_once(&atfork_once, register_atfork);
    if (env_num_threads(&st->num_threads) < 0) return -1;
    st->thread_grain = 32768; /* elements: tens of microseconds, against a few to wake a thread */
    st->default_threads = env_threads("OMP_NUM_THREADS");
    if (st->default_threads == 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN); /* what os.cpu_count() reports */
        st->default_threads = cpus > 0 && cpus <= 4096 ? (int)cpus : 1;
    }
    st->torch_tensor_type = NULL;
    st->torch_get_num_threads = NULL;
    return 0;
}

void brrr_cpu_advise_huge_pages(void *data, int64_t bytes) {
#ifdef MADV_HUGEPAGE
    if (bytes < ((int64_t)1 << 25)) return;
    const uintptr_t page = 4096, begin = ((uintptr_t)data + page - 1) & ~(page - 1);
    const uintptr_t end = ((uintptr_t)data + (uintptr_t)bytes) & ~(page - 1);
    (void)madvise((void *)begin, end - begin, MADV_HUGEPAGE); /* advice: its failure changes nothing */
#else
    (void)data;
    (void)bytes;
#endif
}

/* torch.Tensor and torch.get_num_threads, once torch has been imported (by anyone). */
static int find_torch(brrr_state *st) {
    if (st->torch_get_num_threads) return 1;
    PyObject *torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch"); /* borrowed */
    if (torch == NULL) return 0;
    PyObject *type = PyObject_GetAttrString(torch, "Tensor"), *fn = PyObject_GetAttrString(torch, "get_num_threads");
    if (type && fn && PyType_Check(type)) {
        st->torch_tensor_type = type;
        st->torch_get_num_threads = fn;
        return 1;
    }
    PyErr_Clear(); /* torch only half imported: ask again next call */
    Py_XDECREF(type);
    Py_XDECREF(fn);
    return 0;
}

void brrr_cpu_choose_threads(brrr_state *st, PyObject *obj) {
    int n = st->num_threads;
    if (n == 0 && find_torch(st) && PyObject_TypeCheck(obj, (PyTypeObject *)st->torch_tensor_type)) {
        PyObject *r = PyObject_CallNoArgs(st->torch_get_num_threads);
        long v = r ? PyLong_AsLong(r) : -1;
        Py_XDECREF(r);
        if (v > 0 && v <= 4096) n = (int)v;
        PyErr_Clear();
    }
    call_threads = n > 0 ? n : st->default_threads;
    call_grain = st->thread_grain;
}

void brrr_cpu_parallel_for(int64_t n_items, int64_t item_work, brrr_cpu_task task, void *ctx) {
    if (n_items <= 0) return;
    const int64_t min_items = item_work >= call_grain ? 1 : call_grain / (item_work > 0 ? item_work : 1);
    const int64_t by_work = n_items / min_items;
    int threads = call_threads < by_work ? call_threads : (int)(by_work > 0 ? by_work : 1);
    if (threads > 1 && (atomic_load(&forked_child) || omp_in_parallel())) threads = 1;
    if (threads > 1 && atomic_fetch_add(&active_loops, 1) != 0) {
        atomic_fetch_sub(&active_loops, 1);
        threads = 1;
    }
    if (threads == 1) {
        task(ctx, 0, n_items);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t begin = n_items * t / count, end = n_items * (t + 1) / count;
        if (begin < end) task(ctx, begin, end);
    }
    atomic_fetch_sub(&active_loops, 1);
}

/* ---- block loads and stores ---------------------------------------------------------------- */

BRRR_SIMD void brrr_cpu_load_f32(int32_t dtype, const void *base, int64_t stride, int64_t n, float *dst) {
    switch (dtype) {
    case BRRR_F32:
        if (stride == 1) {
            for (int64_t i = 0; i < n; i++) dst[i] = ((const float *)base)[i];
        } else {
            for (int64_t i = 0; i < n; i++) dst[i] = ((const float *)base)[i * stride];
        }
        break;
    case BRRR_BF16:
        if (stride == 1) {
            for (int64_t i = 0; i < n; i++) dst[i] = brrr_bf16_to_f32(((const uint16_t *)base)[i]);
        } else {
            for (int64_t i = 0; i < n; i++) dst[i] = brrr_bf16_to_f32(((const uint16_t *)base)[i * stride]);
        }
        break;
    default:
        for (int64_t i = 0; i < n; i++) dst[i] = brrr_load_f32(dtype, base, i * stride);
        break;
    }
}

BRRR_SIMD void brrr_cpu_store_f32(int32_t dtype, void *base, int64_t stride, int64_t n, const float *src) {
    switch (dtype) {
    case BRRR_F32:
        if (stride == 1) {
            for (int64_t i = 0; i < n; i++) ((float *)base)[i] = src[i];
        } else {
            for (int64_t i = 0; i < n; i++) ((float *)base)[i * stride] = src[i];
        }
        break;
    case BRRR_BF16:
        if (stride == 1) {
            for (int64_t i = 0; i < n; i++) ((uint16_t *)base)[i] = brrr_cpu_f32_to_bf16(src[i]);
        } else {
            for (int64_t i = 0; i < n; i++) ((uint16_t *)base)[i * stride] = brrr_cpu_f32_to_bf16(src[i]);
        }
        break;
    default:
        for (int64_t i = 0; i < n; i++) brrr_store_f32(dtype, base, i * stride, src[i]);
        break;
    }
}

BRRR_SIMD void brrr_cpu_load_f64(int32_t dtype, const void *base, int64_t stride, int64_t n, double *dst) {
    switch (dtype) {
    case BRRR_F64:
        for (int64_t i = 0; i < n; i++) dst[i] = ((const double *)base)[i * stride];
        break;
    case BRRR_F32:
        if (stride == 1) {
            for (int64_t i = 0; i < n; i++) dst[i] = ((const float *)base)[i];
        } else {
            for (int64_t i = 0; i < n; i++) dst[i] = ((const float *)base)[i * stride];
        }
        break;
    case BRRR_BF16:
        if (stride == 1) {
            for (int64_t i = 0; i < n; i++) dst[i] = brrr_bf16_to_f32(((const uint16_t *)base)[i]);
        } else {
            for (int64_t i = 0; i < n; i++) dst[i] = brrr_bf16_to_f32(((const uint16_t *)base)[i * stride]);
        }
        break;
    default:
        for (int64_t i = 0; i < n; i++) dst[i] = brrr_load_f64(dtype, base, i * stride);
        break;
    }
}

BRRR_SIMD void brrr_cpu_store_f64(int32_t dtype, void *base, int64_t stride, int64_t n, const double *src) {
    switch (dtype) {
    case BRRR_F64:
        for (int64_t i = 0; i < n; i++) ((double *)base)[i * stride] = src[i];
        break;
    case BRRR_F32:
        if (stride == 1) {
            for (int64_t i = 0; i < n; i++) ((float *)base)[i] = (float)src[i];
        } else {
            for (int64_t i = 0; i < n; i++) ((float *)base)[i * stride] = (float)src[i];
        }
        break;
    case BRRR_BF16:
        if (stride == 1) {
            for (int64_t i = 0; i < n; i++) ((uint16_t *)base)[i] = brrr_cpu_f32_to_bf16((float)src[i]);
        } else {
            for (int64_t i = 0; i < n; i++) ((uint16_t *)base)[i * stride] = brrr_cpu_f32_to_bf16((float)src[i]);
        }
        break;
    default:
        for (int64_t i = 0; i < n; i++) brrr_store_f64(dtype, base, i * stride, src[i]);
        break;
    }
}

/* ---- Python ---------------------------------------------------------------------------------- */

/* arg as an int into *n, 0; else -1 with TypeError naming it (a bool is not taken for a number). */
static int int_argument(PyObject *arg, const char *name, long long *n) {
    *n = PyBool_Check(arg) ? -1 : PyLong_AsLongLong(arg);
    if (*n == -1 && (PyBool_Check(arg) || PyErr_Occurred())) {
        PyErr_Format(PyExc_TypeError, "argument %s: expected an int", name);
        return -1;
    }
    return 0;
}

PyObject *brrr_py_set_num_threads(PyObject *module, PyObject *arg) {
    long long n;
    if (int_argument(arg, "n", &n) < 0) return NULL;
    if (n < 0 || n > 4096) {
        PyErr_Format(PyExc_ValueError, "argument n: expected 0 (automatic) to 4096 threads, got %lld", n);
        return NULL;
    }
    brrr_state *st = brrr_get_state(module);
    const int previous = st->num_threads;
    st->num_threads = (int)n;
    return PyLong_FromLong(previous);
}

PyObject *brrr_py_set_thread_grain(PyObject *module, PyObject *arg) {
    long long n;
    if (int_argument(arg, "elements", &n) < 0) return NULL;
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "argument elements: expected at least 1, got %lld", n);
        return NULL;
    }
    brrr_state *st = brrr_get_state(module);
    const long long previous = st->thread_grain;
    st->thread_grain = n;
    return PyLong_FromLongLong(previous);
}

PyObject *brrr_py_num_threads_for(PyObject *module, PyObject *obj) {
    brrr_cpu_choose_threads(brrr_get_state(module), obj);
    return PyLong_FromLong(atomic_load(&forked_child) ? 1 : call_threads); /* a forked child runs on one */
}

PyObject *brrr_py_get_num_threads(PyObject *module, PyObject *unused) {
    (void)unused;
    const brrr_state *st = brrr_get_state(module);
    return PyLong_FromLong(st->num_threads ? st->num_threads : st->default_threads);
}
