/* What the CPU twins share: how many threads a call may use, the parallel loop that runs them,
 * the vector-width attribute of the hot loops, and block loads and stores of any dtype.
 *
 * Threads. The glue imports a call's first CPU tensor with the GIL held; brrr_cpu_choose_threads
 * (called from there) fixes the call's thread count, in this order: brrr.set_num_threads (or
 * BRRR_NUM_THREADS at import), torch.get_num_threads() for a torch tensor, OMP_NUM_THREADS, then
 * os.cpu_count(). The kernels run later on the same OS thread without the GIL and read that
 * count through brrr_cpu_parallel_for, which also runs one thread where running more would
 * oversubscribe the machine (another brrr call is in its parallel loop already) or could hang
 * (a child process after fork: GNU OpenMP's thread pool does not survive fork).
 *
 * Determinism. brrr_cpu_parallel_for hands out items, and a kernel's result never depends on
 * which thread ran an item: reductions write one partial per item (or per fixed chunk of rows)
 * and combine the partials in item order afterwards, so they are bitwise identical whatever the
 * thread count.
 *
 * Vector width. BRRR_SIMD compiles a function for AVX-512, AVX2 (both with FMA) and baseline
 * x86-64 and picks one when the module loads (GCC's function multiversioning), so one binary runs
 * on any x86-64; elsewhere (aarch64: NEON is baseline) it compiles once. These functions contract
 * a * b + c into fused multiply-adds where the CPU has them (the polynomials of cpu_math.h cost
 * half as many instructions): a result may differ by a rounding between CPU generations, never
 * between thread counts. The rest of the C code keeps -std=c11's no-contraction rule. */
#ifndef BRRR_CPU_H
#define BRRR_CPU_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "brrr.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BRRR_SIMD __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
#else
#define BRRR_SIMD
#endif

/* A helper of BRRR_SIMD functions: GCC inlines a function into a target clone of another
 * architecture only when told to always inline it, and so compiles its loops for that clone's
 * vector width; otherwise they would run at baseline width through a call. */
#if defined(__GNUC__)
#define BRRR_INLINE static inline __attribute__((always_inline))
#else
#define BRRR_INLINE static inline
#endif

/* Ask for [p, p + bytes) to be brought into the cache: a row kernel asks for its next row while
 * it writes the current one, since the hardware prefetchers stop at each 4 KiB page (a row of
 * 1024 floats) and would leave the next row's first reads waiting on memory. */
BRRR_INLINE void brrr_cpu_prefetch(const void *p, int64_t bytes) {
    for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch((const char *)p + k);
}

/* The same, for lines about to be written (fetched for ownership: the stores do not wait). */
BRRR_INLINE void brrr_cpu_prefetch_write(void *p, int64_t bytes) {
    for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch((char *)p + k, 1);
}

/* brrr_f32_to_bf16 (round to nearest even, a NaN kept quiet) with its NaN found by an unordered
 * compare, one vector operation where the test of the magnitude's bits takes two, and the quiet
 * bit set before the one shift (the same bits as the shifted value with 0x40 set, for every one
 * of the 2^32 floats): about 15% and then 28% fewer operations in a store loop. */
BRRR_INLINE uint16_t brrr_cpu_f32_to_bf16(float f) {
    const union {
        float f;
        uint32_t u;
    } v = {f};
    return (uint16_t)((f == f ? v.u + 0x7FFFu + ((v.u >> 16) & 1u) : v.u | 0x400000u) >> 16);
}

/* Elements a kernel processes per step of its inner loops: small enough for the L1 cache. */
#define BRRR_CPU_BLOCK 512

/* With the GIL: fix the thread count of the current call from its first CPU tensor `obj`. */
void brrr_cpu_choose_threads(brrr_state *st, PyObject *obj);

/* Run task(ctx, begin, end) over [0, n_items) in contiguous ranges, on at most the call's thread
 * count, and giving each thread at least the module's grain of work (elements touched, counting
 * item_work per item: small work stays on one thread, where starting threads would cost more). */
typedef void (*brrr_cpu_task)(void *ctx, int64_t begin, int64_t end);
void brrr_cpu_parallel_for(int64_t n_items, int64_t item_work, brrr_cpu_task task, void *ctx);

/* Rows per chunk of a reduction over `rows` (a function of the shape alone: at most 64 chunks). */
static inline int64_t brrr_cpu_chunk_rows(int64_t rows) { return rows > 64 ? (rows + 63) / 64 : 1; }

/* Ask the kernel to back [data, data + bytes) with transparent huge pages, for a new output of at
 * least 32 MiB that brrr allocated and its kernel writes first. glibc's malloc (torch's CPU
 * allocator uses it) maps every allocation of that size anew and unmaps it when freed, so each
 * call pays one page fault per 4 KiB on its first write, which takes longer than the kernel
 * itself; NumPy advises its own large arrays the same way. Smaller allocations come from malloc's
 * heap, reused between calls, and are left alone. A no-op where the advice does not exist. */
void brrr_cpu_advise_huge_pages(void *data, int64_t bytes);

/* n elements from base + i * stride into dst (float), or from dst into base. */
void brrr_cpu_load_f32(int32_t dtype, const void *base, int64_t stride, int64_t n, float *dst);
void brrr_cpu_store_f32(int32_t dtype, void *base, int64_t stride, int64_t n, const float *src);
void brrr_cpu_load_f64(int32_t dtype, const void *base, int64_t stride, int64_t n, double *dst);
void brrr_cpu_store_f64(int32_t dtype, void *base, int64_t stride, int64_t n, const double *src);

/* Python: _C.set_num_threads(n) (0: automatic) -> the previous setting, _C.get_num_threads(),
 * _C.num_threads_for(x) (the count a call with first argument x runs on), and
 * _C.set_thread_grain(elements) -> the previous grain (the least work per thread; the tests set 1
 * to split small inputs between threads). */
PyObject *brrr_py_set_num_threads(PyObject *module, PyObject *arg);
PyObject *brrr_py_get_num_threads(PyObject *module, PyObject *unused);
PyObject *brrr_py_num_threads_for(PyObject *module, PyObject *obj);
PyObject *brrr_py_set_thread_grain(PyObject *module, PyObject *arg);
/* Module init: the settings (BRRR_NUM_THREADS), and the fork handler (once per process). */
int brrr_cpu_init(brrr_state *st);

#endif
