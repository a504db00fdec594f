/* Internal declarations of the C glue: module state, tensor import (DLPack / NumPy), argument
 * checks, and the elementwise layout helpers shared by every op family.
 *
 * Conventions: functions that can fail return -1 (or NULL) with a Python exception set and 0 on
 * success; every message names the argument it is about. */
#ifndef BRRR_H
#define BRRR_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "brrr_build_config.h"
#include "brrr_cuda.h"
#include "dlpack.h"

/* Largest rank a tensor may have on import; launches coalesce it down to BRRR_MAX_DIMS. */
#define BRRR_MAX_RANK 64
#define BRRR_API_CACHE_SIZE 8

/* What brrr knows about a producer type, read once per type (the first BRRR_API_CACHE_SIZE
 * types are cached). */
typedef struct {
    PyTypeObject *type;            /* strong reference */
    PyObject *capsule;             /* strong reference to the capsule that holds `api`, or NULL */
    const DLPackExchangeAPI *api;  /* NULL: the type publishes no usable table */
    /* torch.Tensor types: the unbound is_neg and _is_zerotensor methods (strong references); NULL
     * for other types (and _is_zerotensor for a PyTorch without it) */
    PyObject *is_neg, *is_zerotensor;
    int is_torch; /* a torch.Tensor type (its base class found in the MRO) */
} brrr_type_info;

typedef struct {
    brrr_type_info api_cache[BRRR_API_CACHE_SIZE];
    int api_cache_len;
    PyObject *str_dlpack;          /* "__dlpack__" */
    PyObject *str_dlpack_device;   /* "__dlpack_device__" */
    PyObject *str_exchange_api;    /* "__dlpack_c_exchange_api__" */
    PyObject *str_is_neg;          /* "is_neg" */
    PyObject *max_version;         /* (1, BRRR_DLPACK_MINOR) */
    /* CPU threads (csrc/cpu.c): the set count (0: automatic), the automatic one for inputs
     * other than torch tensors, the grain, and torch's tensor type and get_num_threads once torch is
     * imported (strong references, NULL before). */
    int num_threads;
    int default_threads;
    int64_t thread_grain;         /* the least work (elements) worth a thread of its own */
    PyObject *torch_tensor_type;
    PyObject *torch_get_num_threads;
} brrr_state;

/* Release the references an entry holds (module teardown, or an entry that was not cached). */
void brrr_type_info_clear(brrr_type_info *info);

/* One call's stream: what the caller passed (-1 = let the framework of the first argument say),
 * resolved once from the first imported tensor; likewise its CPU thread count. */
typedef struct {
    brrr_state *state;
    long long stream_arg;
    int resolved;
    void *stream;
    /* The stream came from neither the caller nor the framework (CuPy, JAX, any other DLPack
     * producer): the call waits for its kernels before returning, since DLPack can make our
     * stream wait for a producer's work but cannot make the producer's later reads wait for ours. */
    int wait_for_kernels;
    int cpu_threads_chosen; /* the CPU thread count was fixed by the first CPU tensor (csrc/cpu.h) */
    /* Calls into Python that an argument's import made (its is_neg(), __dlpack__, ...), which may
     * run code of the caller's (__torch_function__, a mode) that changes another argument. */
    int python_calls;
} brrr_call;

/* A tensor argument, imported for the duration of one call. */
typedef struct {
    const char *name;
    void *data;         /* element (0, ..., 0), byte_offset applied */
    int32_t device_type; /* kDLCPU or kDLCUDA after import */
    int32_t device_id;
    int32_t dtype;      /* brrr_dtype */
    int32_t ndim;
    int64_t numel;
    int readonly;
    int from_torch; /* imported from a torch.Tensor */
    /* What must be released: a NumPy array or a resolved torch view we hold, or a DLPack managed
     * tensor we own. */
    PyObject *owner;
    DLManagedTensorVersioned *managed_versioned;
    DLManagedTensor *managed_legacy;
    /* A view borrowed through a framework's exchange table (no reference to its memory): the
     * object and table it came from, whether it was read as indices, and the call's python_calls
     * once it was read (brrr_tensor_check_borrowed). */
    PyObject *borrowed_from;
    const DLPackExchangeAPI *borrowed_api;
    int borrowed_index;
    int borrowed_at;
    /* Last, and valid up to ndim only: an import zeroes the fields above (BRRR_TENSOR_HEAD
     * bytes), not these 1 KiB, which cost a tiny call more than its kernel. */
    int64_t shape[BRRR_MAX_RANK];
    int64_t strides[BRRR_MAX_RANK]; /* in elements */
} brrr_tensor;

#define BRRR_TENSOR_HEAD offsetof(brrr_tensor, shape)

brrr_state *brrr_get_state(PyObject *module);

/* Import `obj` as argument `name`. `writable` refuses read-only data. The tensor must be
 * released with brrr_tensor_release, also when a later step fails (release of a zeroed struct is
 * a no-op). */
int brrr_tensor_import(brrr_call *call, PyObject *obj, const char *name, int writable, brrr_tensor *t);
void brrr_tensor_release(brrr_tensor *t);
/* The same for a read-only tensor of class indices (int64, int32 or uint8). */
int brrr_index_import(brrr_call *call, PyObject *obj, const char *name, brrr_tensor *t);
/* A view borrowed through an exchange table is valid while its tensor keeps its memory; an import
 * after it may have run the caller's Python, which can give the tensor other memory (set_,
 * resize_). Once every argument is imported: the same view read again, or a RuntimeError. */
int brrr_tensor_check_borrowed(const brrr_call *call, const brrr_tensor *t);

/* A new contiguous tensor with like's dtype, shape and device, allocated by the framework of
 * like_obj through its C exchange table (for PyTorch: its caching allocator, on the current
 * stream). NULL with an exception on failure; NULL without one when the framework has no table.
 * t: NULL, or a tensor with its head zeroed and its name set, which is then described as an
 * import of the new one would describe it, and need not be imported (on this project's CPU
 * machine about 0.17 us per output of a tiny op); on failure its head is zeroed again. */
PyObject *brrr_new_like(brrr_call *call, PyObject *like_obj, const brrr_tensor *like, brrr_tensor *t);
/* The same for a tensor of ndim dims `shape` and brrr dtype `dtype`, on the device of `on`. */
PyObject *brrr_new_shaped(brrr_call *call, PyObject *like_obj, const brrr_tensor *on, int ndim, const int64_t *shape,
                          int32_t dtype, brrr_tensor *t);

/* A call's `stream` argument: an int, a cudaStream_t or -1 for the framework's current one. */
int brrr_parse_stream(PyObject *obj, long long *stream);

/* Scalar arguments, by the rule of docs/errors.md: TypeError naming the argument for a value of
 * the wrong type (a bool is not taken for a number), ValueError for one that does not fit. */
int brrr_parse_int64(PyObject *obj, const char *name, long long *value);
int brrr_parse_double(PyObject *obj, const char *name, double *value);
int brrr_parse_bool(PyObject *obj, const char *name, int *value);

/* The stream this call's CUDA work runs on: the `stream` argument if one was given (0 = legacy
 * default), else the current stream of the first argument's framework when it publishes the C
 * exchange table, else the legacy default stream. */
void *brrr_call_stream(brrr_call *call);

size_t brrr_dtype_size(int32_t dtype);
const char *brrr_dtype_name(int32_t dtype);

/* Argument checks against a reference argument; each raises ValueError naming both (a mismatch
 * between arguments, docs/errors.md). */
int brrr_check_same_device(const brrr_tensor *t, const brrr_tensor *ref);
/* TypeError unless t (argument obj) and x (argument x_obj, the call's first tensor) both come
 * from PyTorch or both from elsewhere: the tensors of one call come from one framework. A torch
 * tensor beside a NumPy x would skip what brrr's PyTorch layer does for the calls it takes (a
 * written tensor's version bump, the refusal of one that requires grad). */
int brrr_check_same_framework(const brrr_tensor *t, PyObject *obj, const brrr_tensor *x, PyObject *x_obj);
int brrr_check_same_dtype(const brrr_tensor *t, const brrr_tensor *ref);
int brrr_check_same_shape(const brrr_tensor *t, const brrr_tensor *ref);
/* Raise if an output could write one address twice (stride 0, or interleaved dims). */
int brrr_check_no_internal_overlap(const brrr_tensor *out);
/* Raise if `out` and `in` share memory; an exactly identical view passes when allow_same. */
int brrr_check_no_overlap(const brrr_tensor *out, const brrr_tensor *in, int allow_same);
/* RuntimeError for CUDA tensors when CUDA is not compiled in; ValueError for other devices. */
int brrr_check_device_supported(const brrr_tensor *t);

/* Turn a launcher's cudaError_t into RuntimeError naming the op. */
int brrr_cuda_result(int error, const char *op);

/* Views reach the CUDA launchers with at most BRRR_MAX_DIMS dims after merging, every op alike
 * (the CPU twins hold themselves to the same limit, but for the chain's, which walks any rank):
 * ValueError naming the argument above it. */
int brrr_check_view_dims(const char *name, int ndim);

/* Merge the dims of `count` tensors that share the iteration shape: drops size-1 dims, orders
 * dims by the first tensor's strides (outermost first), and merges dims that are contiguous in
 * every tensor (brrr_merge_in_order over the reordered dims). strides[k] holds tensor k's
 * strides over `shape` (0 for broadcast dims) and is rewritten; returns the new rank, or -1
 * (brrr_check_view_dims for argument `name`) above BRRR_MAX_DIMS. */
int brrr_coalesce(const char *name, int ndim, int64_t *shape, int count, int64_t (*strides)[BRRR_MAX_RANK]);

/* Merge each dim into the previous one where every tensor steps over the previous dim exactly as
 * over the whole of this one, dropping size-1 dims (strides as in brrr_coalesce). Unlike
 * brrr_coalesce the dims keep their order, so the row-major index over the merged shape is still
 * the logical one. Returns the new rank (0 for a single element). */
int brrr_merge_in_order(int ndim, int64_t *shape, int count, int64_t (*strides)[BRRR_MAX_RANK]);

/* Rows of the scratch of a CUDA bias gradient (float32, float64 for float64), per bias: fixed by
 * the row count alone, so that the gradient is bitwise identical on every GPU. */
static inline int64_t brrr_bias_partial_rows(int64_t rows) {
    int64_t p = (rows + 63) / 64;
    return p < 1 ? 1 : (p > 512 ? 512 : p);
}

/* Half-type conversions for the CPU kernels (round to nearest even, NaN kept quiet). */
static inline float brrr_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
static inline uint16_t brrr_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}
static inline float brrr_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    union { uint32_t u; float f; } v;
    if (exponent == 0x1F) {
        v.u = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        v.u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else {
        v.f = (float)mantissa * 5.9604644775390625e-8f; /* subnormal: mantissa * 2^-24, exact */
        v.u |= sign;
    }
    return v.f;
}
static inline uint16_t brrr_f32_to_f16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint16_t sign = (uint16_t)((v.u >> 16) & 0x8000u);
    uint32_t a = v.u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to infinity */
    if (a >= 0x38800000u) /* normal half: rebias the exponent, round at bit 13 */
        return (uint16_t)(sign | ((a + 0xFFFu + ((a >> 13) & 1u) - 0x38000000u) >> 13));
    int shift = 126 - (int)(a >> 23); /* value = m * 2^-shift in units of 2^-24 */
    if (shift > 24) return sign;
    uint32_t m = (a & 0x7FFFFFu) | 0x800000u, q = m >> shift, r = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (r > half || (r == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

/* Load / store element `i` (in elements from `base`) of a tensor of `dtype` as float or double. */
static inline float brrr_load_f32(int32_t dtype, const void *base, int64_t i) {
    switch (dtype) {
    case BRRR_F16: return brrr_f16_to_f32(((const uint16_t *)base)[i]);
    case BRRR_BF16: return brrr_bf16_to_f32(((const uint16_t *)base)[i]);
    case BRRR_F64: return (float)((const double *)base)[i];
    default: return ((const float *)base)[i];
    }
}
static inline void brrr_store_f32(int32_t dtype, void *base, int64_t i, float value) {
    switch (dtype) {
    case BRRR_F16: ((uint16_t *)base)[i] = brrr_f32_to_f16(value); break;
    case BRRR_BF16: ((uint16_t *)base)[i] = brrr_f32_to_bf16(value); break;
    case BRRR_F64: ((double *)base)[i] = value; break;
    default: ((float *)base)[i] = value; break;
    }
}

/* The same as double (float64 exactly; the others through float32). */
static inline double brrr_load_f64(int32_t dtype, const void *base, int64_t i) {
    return dtype == BRRR_F64 ? ((const double *)base)[i] : (double)brrr_load_f32(dtype, base, i);
}
static inline void brrr_store_f64(int32_t dtype, void *base, int64_t i, double value) {
    if (dtype == BRRR_F64) ((double *)base)[i] = value;
    else brrr_store_f32(dtype, base, i, (float)value);
}

/* Offset of row-major index r over shape[0 .. ndim) in a view with the given strides. */
static inline int64_t brrr_unravel(int ndim, const int64_t *shape, const int64_t *strides, int64_t r) {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        off += (r % shape[d]) * strides[d];
        r /= shape[d];
    }
    return off;
}

#endif
