// Softmax and log-softmax over the last dim, forward and backward: the launch (plain C, shared with
// csrc/softmax.c) and, for nvcc, the kernels.
//
//   forward   y = exp(x - max) / sum(exp(x - max))      (log: y = x - max - log(sum(exp(x - max))))
//   backward  grad_x = y * (grad_y - sum(grad_y * y))   (log: grad_x = grad_y - exp(y) * sum(grad_y))
//
// Rows are every dim but the last (coalesced by the glue into row_shape, each view with its row
// strides); columns the last dim, at each view's column stride. Math in float32 (float64 for
// float64); y may have a wider dtype than x (torch's dtype= argument: float32 for float16/bfloat16
// x), and the backward's grad_y has y's, its grad_x x's.
//
// softmax_tile_kernel    contiguous rows of more than 1024 columns whose inputs take up to 32 KB:
//                        1 to 4 rows per block of 128 threads, each row's inputs in shared memory
//                        (cp.async), each thread reading back only the packs it copied; one read
//                        and one write per element.
// softmax_rows_kernel    one block of at most 512 threads per row, the row in registers (PACKS
//                        16-byte packs per thread, see max_packs): one read and one write per
//                        element. Rows of up to 1024 columns (up to 32 KB of inputs where
//                        BRRR_SOFTMAX_KERNEL=rows).
// softmax_smem_kernel    longer contiguous rows: the row in shared memory, split over a cluster
//                        of up to 8 blocks (sm_90), loaded once with cp.async; one read and one
//                        write per element (see the kernel).
// softmax_stream_kernel  one block per row, two passes: an online max and sum (forward) or the dot
//                        product (backward), then the outputs, reading the row again (from L2
//                        where it is still there); 16-byte packs where the views allow, else
//                        element by element at any column stride. Any row length.
// softmax_flat_kernel    (BRRR_SOFTMAX_KERNEL=flat) rows at one row stride of float32, float16 and
//                        bfloat16, a group of 32-1024 threads a row, the row in registers; one exp
//                        an element and unrolled reductions (see the kernel). Up to 32768 columns
//                        (a float32 backward 16384).
#pragma once

#include <stdint.h>

#include "brrr_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { BRRR_SOFTMAX_IN0, BRRR_SOFTMAX_IN1, BRRR_SOFTMAX_OUT };

typedef struct {
    int32_t x_dtype;  /* brrr_dtype of x (forward input, backward output) */
    int32_t y_dtype;  /* of y and grad_y */
    int32_t log;      /* log_softmax */
    int32_t backward;
    int32_t row_ndim; /* >= 1 */
    int64_t rows, cols;
    int64_t row_shape[BRRR_MAX_DIMS];
    /* forward: in0 = x, out = y; backward: in0 = y, in1 = grad_y, out = grad_x */
    const void *in[2];
    void *out;
    int64_t row_strides[3][BRRR_MAX_DIMS]; /* in0, in1, out, in elements */
    int64_t col_stride[3];
} brrr_softmax_launch;

int brrr_cuda_softmax(const brrr_softmax_launch *launch, int device, void *stream);

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
#include <atomic>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#include "common.cuh"

namespace brrr {
namespace softmax {

__device__ __forceinline__ int64_t row_off(const brrr_softmax_launch &L, int k, int64_t r) {
    if (L.row_ndim == 1) return r * L.row_strides[k][0];
    int64_t off = 0;
#pragma unroll
    for (int d = BRRR_MAX_DIMS - 1; d >= 0; --d) {
        if (d >= L.row_ndim) continue;
        off += (r % L.row_shape[d]) * L.row_strides[k][d];
        r /= L.row_shape[d];
    }
    return off;
}

// exp for a result stored as TO: where TO is float16 or bfloat16, whose rounding hides a few
// float32 ulp, the MUFU op alone (ex2.approx.ftz, cuda/elementary.cuh: two instructions with the
// scaling), where __expf adds a check of the subnormal range (four more an element, the busiest
// part of a bfloat16 forward past 16384 columns); results below 2^-126 become 0, beside a row's
// largest, which is 1. expf (about ten, under an ulp) for a float32 result, exp for float64. The
// half kernels' instruction count is what keeps them near the memory floor: the forward's one or
// two exps an element cost more than the bytes of a bfloat16 row.
template <typename TO> __device__ __forceinline__ float exp_(float v) {
    return std::is_same<TO, float>::value ? expf(v) : exp_ftz(v);
}
template <typename TO> __device__ __forceinline__ double exp_(double v) { return exp(v); }
template <typename A> __device__ __forceinline__ A log_(A v) { return log(v); }
template <> __device__ __forceinline__ float log_(float v) { return logf(v); }

// -inf would give exp(-inf - -inf) = NaN for rows of -inf: start from the lowest finite value.
template <typename A> __device__ __forceinline__ A lowest() { return sizeof(A) == 8 ? A(-1.7976931348623157e308) : A(-3.402823466e38f); }

// The block's reduction of v (sum, or max when kMax); every thread gets it. Holds barriers.
template <bool kMax, typename A>
__device__ __forceinline__ A block_reduce(A v, A *scratch) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        const A o = __shfl_xor_sync(0xffffffffu, v, m);
        v = kMax ? fmax(v, o) : v + o;
    }
    const int warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();  // scratch may still be read from the previous reduction
    if ((threadIdx.x & 31) == 0) scratch[warp] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < warps; ++w) v = kMax ? fmax(v, scratch[w]) : v + scratch[w];
    return v;
}

// Online softmax state: running max m and sum of exp(v - m).
template <typename A> struct Online { A m, s; };

template <typename TO, typename A>
__device__ __forceinline__ void absorb(Online<A> &o, A v) {
    if (v > o.m) {
        o.s *= exp_<TO>(o.m - v);
        o.m = v;
    }
    o.s += exp_<TO>(v - o.m);
}

// Elements per 16-byte access of the wider of the two dtypes.
template <typename TX, typename TY> constexpr int pack_elems() { return 16 / (sizeof(TX) > sizeof(TY) ? sizeof(TX) : sizeof(TY)); }

// Packs per thread that the row kernel keeps in registers: 32 registers of values forward, twice
// 16 backward (y and grad_y), which hold the 32 KB rows it takes (launch_typed) at 512 threads.
// At twice that, bfloat16's forward spilled (ptxas, sm_90).
template <typename TX, typename TY, bool kBackward> constexpr int max_packs() {
    constexpr int n = 32 / (kBackward ? 2 : 1) / (int)(sizeof(typename Compute<TX>::type) / 4) / pack_elems<TX, TY>();
    return sizeof(TX) == 8 && n > 4 ? 4 : n;  // float64's address arithmetic spills beyond
}

// The row held in registers. Forward reads TX and writes TY; backward reads TY twice and writes TX.
template <typename TX, typename TY, bool kBackward, int PACKS>
__global__ void __launch_bounds__(512) softmax_rows_kernel(const brrr_softmax_launch L) {
    using A = typename Compute<TX>::type;
    constexpr int P = pack_elems<TX, TY>();
    __shared__ A scratch[32];
    const int64_t r = blockIdx.x, packs = L.cols / P;
    A a[PACKS * P];
    bool have[PACKS];
#pragma unroll
    for (int k = 0; k < PACKS; ++k) have[k] = threadIdx.x + (int64_t)k * blockDim.x < packs;
    if (!kBackward) {
        const TX *x = static_cast<const TX *>(L.in[0]) + row_off(L, 0, r);
        A m = lowest<A>();
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if (have[k]) load_pack<TX, P>(x + (threadIdx.x + (int64_t)k * blockDim.x) * P, a + k * P);
#pragma unroll
            for (int j = 0; j < P; ++j) {
                if (!have[k]) a[k * P + j] = lowest<A>();
                m = fmax(m, a[k * P + j]);
            }
        }
        m = block_reduce<true>(m, scratch);
        // The padding is left out of the sum: where the whole row is -inf, m stays lowest and
        // exp(lowest - m) would be 1; the sum must be 0 then, for NaN results as torch gives.
        A s = A(0);
#pragma unroll
        for (int k = 0; k < PACKS; ++k)
#pragma unroll
            for (int j = 0; j < P; ++j)
                if (have[k]) s += exp_<TY>(a[k * P + j] - m);
        s = block_reduce<false>(s, scratch);
        const A log_s = log_(s), inv = A(1) / s;
        TY *y = static_cast<TY *>(L.out) + row_off(L, 2, r);
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if (!have[k]) continue;
            A v[P];
#pragma unroll
            for (int j = 0; j < P; ++j) v[j] = L.log ? (a[k * P + j] - m) - log_s : exp_<TY>(a[k * P + j] - m) * inv;
            store_pack<TY, P>(y + (threadIdx.x + (int64_t)k * blockDim.x) * P, v);
        }
        return;
    }
    const TY *y = static_cast<const TY *>(L.in[0]) + row_off(L, 0, r);
    const TY *gy = static_cast<const TY *>(L.in[1]) + row_off(L, 1, r);
    A b[PACKS * P];
    A dot = A(0);
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        if (!have[k]) continue;
        const int64_t pk = threadIdx.x + (int64_t)k * blockDim.x;
        load_pack<TY, P>(y + pk * P, a + k * P);
        load_pack<TY, P>(gy + pk * P, b + k * P);
#pragma unroll
        for (int j = 0; j < P; ++j) dot += L.log ? b[k * P + j] : b[k * P + j] * a[k * P + j];
    }
    dot = block_reduce<false>(dot, scratch);
    TX *gx = static_cast<TX *>(L.out) + row_off(L, 2, r);
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        if (!have[k]) continue;
        A v[P];
#pragma unroll
        for (int j = 0; j < P; ++j)
            v[j] = L.log ? b[k * P + j] - exp_<TX>(a[k * P + j]) * dot : a[k * P + j] * (b[k * P + j] - dot);
        store_pack<TX, P>(gx + (threadIdx.x + (int64_t)k * blockDim.x) * P, v);
    }
}

// Element c of a view with column stride cs, in packs of P (P > 1: contiguous and aligned) or one
// by one.
template <typename T, int P, typename A>
__device__ __forceinline__ void load_at(const T *p, int64_t c, int64_t cs, A *v) {
    if constexpr (P > 1) load_pack<T, P>(p + c, v);
    else v[0] = to_float(p[c * cs]);
}
template <typename T, int P, typename A>
__device__ __forceinline__ void store_at(T *p, int64_t c, int64_t cs, const A *v) {
    if constexpr (P > 1) store_pack<T, P>(p + c, v);
    else p[c * cs] = to_storage<T, A>(v[0]);
}

// Two passes over any row, P elements at a time (P = 1: any column stride).
template <typename TX, typename TY, int P>
__global__ void __launch_bounds__(1024) softmax_stream_kernel(const brrr_softmax_launch L) {
    using A = typename Compute<TX>::type;
    __shared__ A scratch[32];
    const int64_t r = blockIdx.x, n = L.cols, step = (int64_t)blockDim.x * P;
    if (!L.backward) {
        const TX *x = static_cast<const TX *>(L.in[0]) + row_off(L, 0, r);
        const int64_t cx = L.col_stride[0], cy = L.col_stride[2];
        Online<A> o = {lowest<A>(), A(0)};
        for (int64_t c = threadIdx.x * P; c < n; c += step) {
            A v[P];
            load_at<TX, P>(x, c, cx, v);
#pragma unroll
            for (int j = 0; j < P; ++j) absorb<TY>(o, v[j]);
        }
        const A m = block_reduce<true>(o.m, scratch);
        const A s = block_reduce<false>(o.s * exp_<TY>(o.m - m), scratch);
        const A log_s = log_(s), inv = A(1) / s;
        TY *y = static_cast<TY *>(L.out) + row_off(L, 2, r);
        for (int64_t c = threadIdx.x * P; c < n; c += step) {
            A v[P];
            load_at<TX, P>(x, c, cx, v);
#pragma unroll
            for (int j = 0; j < P; ++j) v[j] = L.log ? (v[j] - m) - log_s : exp_<TY>(v[j] - m) * inv;
            store_at<TY, P>(y, c, cy, v);
        }
        return;
    }
    const TY *y = static_cast<const TY *>(L.in[0]) + row_off(L, 0, r);
    const TY *gy = static_cast<const TY *>(L.in[1]) + row_off(L, 1, r);
    const int64_t cy = L.col_stride[0], cg = L.col_stride[1], cx = L.col_stride[2];
    A dot = A(0);
    for (int64_t c = threadIdx.x * P; c < n; c += step) {
        A v[P], g[P];
        load_at<TY, P>(gy, c, cg, g);
        if (!L.log) load_at<TY, P>(y, c, cy, v);
#pragma unroll
        for (int j = 0; j < P; ++j) dot += L.log ? g[j] : g[j] * v[j];
    }
    dot = block_reduce<false>(dot, scratch);
    TX *gx = static_cast<TX *>(L.out) + row_off(L, 2, r);
    for (int64_t c = threadIdx.x * P; c < n; c += step) {
        A v[P], g[P];
        load_at<TY, P>(y, c, cy, v);
        load_at<TY, P>(gy, c, cg, g);
#pragma unroll
        for (int j = 0; j < P; ++j) v[j] = L.log ? g[j] - exp_<TX>(v[j]) * dot : v[j] * (g[j] - dot);
        store_at<TX, P>(gx, c, cx, v);
    }
}

// ---- a row in shared memory, over a cluster of blocks -------------------------------------------

constexpr int kSmemThreads = 512, kMaxCluster = 8;
constexpr int64_t kSliceAlign = 16;  // elements: every slice starts 16-byte aligned in every dtype

// BYTES (4, 8 or 16) from global to shared memory with cp.async; see copy_async_wait.
template <int BYTES> __device__ __forceinline__ void copy_async_bytes(void *smem, const void *gmem) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(gmem), "n"(BYTES) : "memory");
}

// The row held in shared memory, loaded once (cp.async), read from there by every pass: one read
// and one write per element. A row is split over a cluster of `cluster` blocks (sm_90; one block
// elsewhere), block `rank` holding columns [rank * slice, (rank + 1) * slice) (forward: x;
// backward: y and grad_y), so that its share fits beside other blocks in an SM and rows overlap.
// Each block reduces its slice (forward: the max, then the sum of exp(x - max); backward: the dot
// product), stores its partial into every block of the cluster (distributed shared memory) and,
// after one cluster barrier, merges the cluster's partials in rank order: the same bits in every
// block. Then it writes its slice's outputs. A block's first cluster barrier (arrive early, wait
// before the first remote store) makes sure that every block of the cluster runs; after the
// second, nothing touches another block's memory, so each may exit. Assumes packable(L).
// The forward copies the slice in kLoadGroups column ranges, each its own cp.async group, and each
// thread folds its packs of a range into a running (max, sum of exp(x - max)) as soon as that
// range has landed, while the later ranges load; the block then merges its threads' pairs. On an
// H200 (bf16, 16384 rows) that ran the forward 4-5% faster at 65536 and 131072 columns than
// waiting for the whole slice, level at 32768. The backward waits for its slice of y and grad_y.
constexpr int kLoadGroups = 4;
// Three blocks an SM (kSmemBlocks) need at most 42 registers a thread: unbounded, ptxas gave the
// bfloat16 forward 32 at one commit and 54 at the next (two blocks an SM, and 20% slower at 131072
// columns on an H200) for the same arithmetic. float64 takes what it needs.
constexpr int kSmemBlocks = 3;
template <typename TX, typename TY, bool kBackward>
__global__ void __launch_bounds__(kSmemThreads, sizeof(typename Compute<TX>::type) == 8 ? 1 : kSmemBlocks)
    softmax_smem_kernel(const brrr_softmax_launch L, const int cluster, const int64_t slice) {
    using A = typename Compute<TX>::type;
    using TI = typename std::conditional<kBackward, TY, TX>::type;  // what is read: x, or y and grad_y
    using TO = typename std::conditional<kBackward, TX, TY>::type;
    constexpr int P = pack_elems<TX, TY>();
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ A scratch[32];
    __shared__ A parts[kMaxCluster][2];
    const int rank = (int)(blockIdx.x % (unsigned)cluster);
    const int64_t r = blockIdx.x / (unsigned)cluster, begin = (int64_t)rank * slice;
    const int64_t n = begin >= L.cols ? 0 : (L.cols - begin < slice ? L.cols - begin : slice);
    const int64_t step = (int64_t)blockDim.x * P;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster > 1) cluster_arrive_relaxed();
#endif
    TI *in0 = reinterpret_cast<TI *>(smem), *in1 = in0 + slice;
    const TI *src0 = static_cast<const TI *>(L.in[0]) + row_off(L, 0, r) + begin;
    const TI *src1 = kBackward ? static_cast<const TI *>(L.in[1]) + row_off(L, 1, r) + begin : nullptr;
    // This block's partial: (max, sum of exp(x - max)) forward, (dot, unused) backward. Each thread
    // reads back only the packs it copied: no barrier between the copies and the passes.
    A part0, part1 = A(0);
    if constexpr (!kBackward) {
        const int64_t per = ((n + kLoadGroups - 1) / kLoadGroups + step - 1) / step * step;  // whole steps a range
#pragma unroll
        for (int g = 0; g < kLoadGroups; ++g) {
            const int64_t end = (g + 1) * per < n ? (g + 1) * per : n;
            for (int64_t c = g * per + threadIdx.x * P; c < end; c += step)
                copy_async_bytes<P * (int)sizeof(TI)>(in0 + c, src0 + c);
            copy_async_commit();  // an empty group past the end keeps the wait counts in step
        }
        A m = lowest<A>(), s = A(0);
#pragma unroll
        for (int g = 0; g < kLoadGroups; ++g) {
            static_assert(kLoadGroups == 4, "the waits below count four groups");
            switch (kLoadGroups - 1 - g) {  // this thread's copies of range g have landed
            case 3: copy_async_wait<3>(); break;
            case 2: copy_async_wait<2>(); break;
            case 1: copy_async_wait<1>(); break;
            default: copy_async_wait<0>(); break;
            }
            const int64_t end = (g + 1) * per < n ? (g + 1) * per : n;
            A gm = m, gs = A(0);
            for (int64_t c = g * per + threadIdx.x * P; c < end; c += step) {
                A v[P];
                load_pack<TI, P>(in0 + c, v);
#pragma unroll
                for (int j = 0; j < P; ++j) gm = fmax(gm, v[j]);
            }
            for (int64_t c = g * per + threadIdx.x * P; c < end; c += step) {
                A v[P];
                load_pack<TI, P>(in0 + c, v);
#pragma unroll
                for (int j = 0; j < P; ++j) gs += exp_<TO>(v[j] - gm);
            }
            s = s * exp_<TO>(m - gm) + gs;
            m = gm;
        }
        part0 = block_reduce<true>(m, scratch);
        part1 = block_reduce<false>(s * exp_<TO>(m - part0), scratch);
    } else {
        for (int64_t c = threadIdx.x * P; c < n; c += step) {
            copy_async_bytes<P * (int)sizeof(TI)>(in0 + c, src0 + c);
            copy_async_bytes<P * (int)sizeof(TI)>(in1 + c, src1 + c);
        }
        copy_async_commit();
        copy_async_wait<0>();
        __syncthreads();
        A dot = A(0);
        for (int64_t c = threadIdx.x * P; c < n; c += step) {
            A y[P], g[P];
            load_pack<TI, P>(in0 + c, y);
            load_pack<TI, P>(in1 + c, g);
#pragma unroll
            for (int j = 0; j < P; ++j) dot += L.log ? g[j] : g[j] * y[j];
        }
        part0 = block_reduce<false>(dot, scratch);
    }
    // The row's: the cluster's partials merged in rank order.
    A total0 = part0, total1 = part1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster > 1) {
        cluster_wait();
        if (threadIdx.x < (unsigned)cluster) {
            const unsigned remote = cluster_map(&parts[rank][0], threadIdx.x);
            cluster_store(remote, part0);
            cluster_store(remote + sizeof(A), part1);
        }
        cluster_sync();
        if (!kBackward) {
            total0 = parts[0][0];
            for (int k = 1; k < cluster; ++k) total0 = fmax(total0, parts[k][0]);
            total1 = A(0);
            for (int k = 0; k < cluster; ++k) total1 += parts[k][1] * exp_<TO>(parts[k][0] - total0);
        } else {
            total0 = parts[0][0];
            for (int k = 1; k < cluster; ++k) total0 += parts[k][0];
        }
    }
#endif
    TO *out = static_cast<TO *>(L.out) + row_off(L, 2, r) + begin;
    if (!kBackward) {
        const A m = total0, log_s = log_(total1), inv = A(1) / total1;
        for (int64_t c = threadIdx.x * P; c < n; c += step) {
            A v[P];
            load_pack<TI, P>(in0 + c, v);
#pragma unroll
            for (int j = 0; j < P; ++j) v[j] = L.log ? (v[j] - m) - log_s : exp_<TO>(v[j] - m) * inv;
            store_pack<TO, P>(out + c, v);
        }
    } else {
        const A dot = total0;
        for (int64_t c = threadIdx.x * P; c < n; c += step) {
            A y[P], g[P];
            load_pack<TI, P>(in0 + c, y);
            load_pack<TI, P>(in1 + c, g);
#pragma unroll
            for (int j = 0; j < P; ++j) y[j] = L.log ? g[j] - exp_<TO>(y[j]) * dot : y[j] * (g[j] - dot);
            store_pack<TO, P>(out + c, y);
        }
    }
}

// ---- rows in shared memory, several per block ------------------------------------------------

// The tile kernel's block: kTileThreads threads, split into 1 to 4 row groups (threadIdx.y) of
// blockDim.x threads, whose rows' inputs take up to kTileBlockBytes of shared memory together.
// Staging the rows in shared memory rather than registers is what keeps enough bytes in flight:
// the register kernel's 93 registers a thread (bfloat16, 4096 columns) left 5 rows of 8 KB per SM
// loading at a time, and it ran at 41% of the memory floor on an H200 (Liger-Kernel's Triton
// kernel at 95%). At 32 KB a block, 6 blocks share an SM's 228 KB: 6 to 24 rows and up to 192 KB
// in flight per SM. The split follows QuACK's (Dao-AILab/quack): one warp on each row up to a few
// thousand columns, more only where a row outgrows what 4 rows may take.
constexpr int kTileThreads = 128, kTileMaxRows = 4;
constexpr int64_t kTileBlockBytes = 32 << 10;

// The reduction of v over the `warps` warps of this thread's row group (threadIdx.y); every thread
// of the group gets it, in the same order in every group. One warp: shuffles only; more: through
// scratch, with two barriers, which the whole block reaches (warps is the same in every group).
template <bool kMax, typename A>
__device__ __forceinline__ A group_reduce(A v, A *scratch, int warps) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        const A o = __shfl_xor_sync(0xffffffffu, v, m);
        v = kMax ? fmax(v, o) : v + o;
    }
    if (warps == 1) return v;
    A *mine = scratch + threadIdx.y * warps;
    __syncthreads();  // scratch may still be read from the previous reduction
    if ((threadIdx.x & 31) == 0) mine[threadIdx.x >> 5] = v;
    __syncthreads();
    v = mine[0];
    for (int w = 1; w < warps; ++w) v = kMax ? fmax(v, mine[w]) : v + mine[w];
    return v;
}

// Row blockIdx.x * blockDim.y + threadIdx.y, its inputs (forward: x; backward: y and grad_y) at
// `slice` elements each in this group's part of shared memory. Each thread copies its packs
// (columns threadIdx.x * P, then every blockDim.x * P) with cp.async and, once its own copies
// have landed, reads back only those: no barrier between the copy and the passes. Forward: the
// max, the sum of exp(x - max), the outputs; backward: the dot product, the outputs. Rows past
// L.rows copy and write nothing but take part in the reductions' barriers. Assumes packable(L)
// and cols * sizeof(input) <= kTileBlockBytes (int columns).
template <typename TX, typename TY, bool kBackward>
__global__ void __launch_bounds__(kTileThreads) softmax_tile_kernel(const brrr_softmax_launch L, const int slice) {
    using A = typename Compute<TX>::type;
    using TI = typename std::conditional<kBackward, TY, TX>::type;
    using TO = typename std::conditional<kBackward, TX, TY>::type;
    constexpr int P = pack_elems<TX, TY>();
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ A scratch[kTileThreads / 32];
    const int64_t r = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    const int n = r < L.rows ? (int)L.cols : 0, step = (int)blockDim.x * P, warps = (int)blockDim.x >> 5;
    TI *in0 = reinterpret_cast<TI *>(smem) + (int64_t)threadIdx.y * (kBackward ? 2 : 1) * slice, *in1 = in0 + slice;
    if (n > 0) {
        const TI *src0 = static_cast<const TI *>(L.in[0]) + row_off(L, 0, r);
        const TI *src1 = kBackward ? static_cast<const TI *>(L.in[1]) + row_off(L, 1, r) : nullptr;
        for (int c = threadIdx.x * P; c < n; c += step) {
            copy_async_bytes<P * (int)sizeof(TI)>(in0 + c, src0 + c);
            if (kBackward) copy_async_bytes<P * (int)sizeof(TI)>(in1 + c, src1 + c);
        }
    }
    copy_async_commit();
    copy_async_wait<0>();
    TO *out = n > 0 ? static_cast<TO *>(L.out) + row_off(L, 2, r) : nullptr;
    if (!kBackward) {
        A m = lowest<A>();
        for (int c = threadIdx.x * P; c < n; c += step) {
            A v[P];
            load_pack<TI, P>(in0 + c, v);
#pragma unroll
            for (int j = 0; j < P; ++j) m = fmax(m, v[j]);
        }
        m = group_reduce<true>(m, scratch, warps);
        A s = A(0);
        for (int c = threadIdx.x * P; c < n; c += step) {
            A v[P];
            load_pack<TI, P>(in0 + c, v);
#pragma unroll
            for (int j = 0; j < P; ++j) s += exp_<TO>(v[j] - m);
        }
        s = group_reduce<false>(s, scratch, warps);
        const A log_s = log_(s), inv = A(1) / s;
        for (int c = threadIdx.x * P; c < n; c += step) {
            A v[P];
            load_pack<TI, P>(in0 + c, v);
#pragma unroll
            for (int j = 0; j < P; ++j) v[j] = L.log ? (v[j] - m) - log_s : exp_<TO>(v[j] - m) * inv;
            store_pack<TO, P>(out + c, v);
        }
        return;
    }
    A dot = A(0);
    for (int c = threadIdx.x * P; c < n; c += step) {
        A y[P], g[P];
        load_pack<TI, P>(in0 + c, y);
        load_pack<TI, P>(in1 + c, g);
#pragma unroll
        for (int j = 0; j < P; ++j) dot += L.log ? g[j] : g[j] * y[j];
    }
    dot = group_reduce<false>(dot, scratch, warps);
    for (int c = threadIdx.x * P; c < n; c += step) {
        A y[P], g[P];
        load_pack<TI, P>(in0 + c, y);
        load_pack<TI, P>(in1 + c, g);
#pragma unroll
        for (int j = 0; j < P; ++j) y[j] = L.log ? g[j] - exp_<TO>(y[j]) * dot : y[j] * (g[j] - dot);
        store_pack<TO, P>(out + c, y);
    }
}

// ---- rows in registers, one group of warps per row, one reduction ----------------------------

// The group kernel: each row on a group of blockDim.x threads (whole warps, up to
// kGroupMaxThreads), blockDim.y rows a block, or on a cluster of such blocks (sm_90, one row a
// block), each thread holding N 16-byte packs of the row in registers. Every load of a thread is
// issued before any is used, and a row takes one reduction (forward: the pair max, sum of
// exp(x - max), merged as online softmax merges; backward: the dot product) with at most one
// barrier: what the tile kernel spends on the shared-memory round trip and its three reductions
// goes to keeping more bytes in flight. Liger-Kernel's Triton
// softmax (one program per row, the row in registers, a single pass) runs at the memory floor
// this way at 4096 columns on an H200. A cluster's blocks merge their partials through each
// other's shared memory, as softmax_smem_kernel's do.
constexpr int kGroupMaxThreads = 1024, kGroupBlockThreads = 256, kGroupClusterThreads = 512;

// Packs per thread the group kernel may hold: as many as take 128 bytes of registers in the
// compute type (forward x, whose exp(x - the thread's max) softmax keeps to scale once the row's
// max and sum are known; backward y and grad_y), 64 bytes for float64. One more doubling spilled
// (ptxas, sm_90, at the 64 registers a thread that 1024-thread blocks leave).
template <typename TX, typename TY, bool kBackward> constexpr int group_max_packs() {
    using A = typename Compute<TX>::type;
    return (sizeof(A) == 8 ? 64 : 128) / ((kBackward ? 2 : 1) * pack_elems<TX, TY>() * (int)sizeof(A));
}

// Products rounded on their own: a * b + c * d contracted to fma(a, b, c * d) would not be
// symmetric in its two sides.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// Blocks of kGroupMaxThreads an SM the group kernel's registers must leave room for: 2 (32
// registers a thread, a full SM) for a float forward of up to 2 packs a thread, which took 32
// without clusters and 41 with them unbounded (ptxas, sm_90, bfloat16 at 2 packs), and spilled
// at 4 packs or float64; else 1 (64).
template <typename TX, typename TY, bool kBackward, int N> constexpr int group_min_blocks() {
    return !kBackward && N <= 2 && sizeof(typename Compute<TX>::type) == 4 ? 2 : 1;
}

// (m, s) and (om, os), each a max and a sum of exp(v - max), merged into (m, s). Symmetric in
// its two sides, so that both lanes of a shuffle get the same bits.
template <typename TO, typename A>
__device__ __forceinline__ void merge_max_sum(A &m, A &s, A om, A os) {
    const A nm = fmax(m, om);
    s = mul_rn(s, exp_<TO>(m - nm)) + mul_rn(os, exp_<TO>(om - nm));
    m = nm;
}

// The reduction over this thread's row group of (m, s) (kPair: max-sum pairs) or of m alone (a
// sum); every thread of the group gets the same bits. Past one warp, through `scratch` with one
// barrier, which every thread of the block reaches (blockDim.x is the same in every group).
template <bool kPair, typename TO, typename A>
__device__ __forceinline__ void group_reduce_once(A &m, A &s, A (*scratch)[kGroupMaxThreads / 32]) {
#pragma unroll
    for (int k = 16; k > 0; k >>= 1) {
        const A om = __shfl_xor_sync(0xffffffffu, m, k);
        if (kPair) merge_max_sum<TO>(m, s, om, __shfl_xor_sync(0xffffffffu, s, k));
        else m += om;
    }
    const int warps = (int)blockDim.x >> 5;
    if (warps == 1) return;
    const int first = (int)threadIdx.y * warps;
    if ((threadIdx.x & 31) == 0) {
        scratch[0][first + (threadIdx.x >> 5)] = m;
        if (kPair) scratch[1][first + (threadIdx.x >> 5)] = s;
    }
    __syncthreads();
    m = scratch[0][first];
    if (kPair) s = scratch[1][first];
    for (int w = 1; w < warps; ++w) {
        if (kPair) merge_max_sum<TO>(m, s, scratch[0][first + w], scratch[1][first + w]);
        else m += scratch[0][first + w];
    }
}

// The cluster's reduction of the block's (m, s) (kPair) or m (a sum), which every thread of the
// block holds: each block's stored into every block's `parts` at its rank, then merged in rank
// order, so that every block gets the same bits. The kernel arrived at the cluster barrier as it
// began (relaxed): the wait below makes sure that every block has started, so that its shared
// memory exists, before the stores into it.
template <bool kPair, typename TO, typename A>
__device__ __forceinline__ void cluster_reduce(A &m, A &s, A (*parts)[2], int cluster, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster == 1) return;
    cluster_wait();
    if (threadIdx.x < (unsigned)cluster) {
        const unsigned remote = cluster_map(&parts[rank][0], threadIdx.x);
        cluster_store(remote, m);
        cluster_store(remote + sizeof(A), s);
    }
    cluster_sync();
    m = parts[0][0];
    s = parts[0][1];
    for (int k = 1; k < cluster; ++k) {
        if (kPair) merge_max_sum<TO>(m, s, parts[k][0], parts[k][1]);
        else m += parts[k][0];
    }
#else
    (void)m, (void)s, (void)parts, (void)cluster, (void)rank;
#endif
}

// Row blockIdx.x * blockDim.y + threadIdx.y (blockIdx.x / cluster with clusters, of one row a
// block); its thread threadIdx.x holds packs first + threadIdx.x + k * blockDim.x (k < N), where
// first = N * blockDim.x * the block's rank in its cluster, so that each load of a warp reads 32
// adjacent packs. Forward: each thread's max m and sum s of exp(x - m) over its own values,
// merged over the group (and the cluster) into the row's M and S; then y = exp(x - m) *
// (exp(m - M) / S), or x - M - log(S): one exp an element. Backward: the dot product, then the
// outputs. Packs past the row and rows past L.rows are loaded and
// stored nowhere and count nothing, but their threads reach the barriers. Assumes packable(L),
// cols / P <= N * blockDim.x * cluster, and blockDim.y = 1 where cluster > 1.
template <typename TX, typename TY, bool kBackward, int N>
__global__ void __launch_bounds__(kGroupMaxThreads, group_min_blocks<TX, TY, kBackward, N>())
    softmax_group_kernel(const brrr_softmax_launch L, const int cluster) {
    using A = typename Compute<TX>::type;
    using TI = typename std::conditional<kBackward, TY, TX>::type;
    using TO = typename std::conditional<kBackward, TX, TY>::type;
    constexpr int P = pack_elems<TX, TY>();
    __shared__ A scratch[2][kGroupMaxThreads / 32];
    __shared__ A parts[kMaxCluster][2];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster > 1) cluster_arrive_relaxed();
#endif
    const int rank = (int)(blockIdx.x % (unsigned)cluster);
    const int64_t r =
        cluster > 1 ? (int64_t)(blockIdx.x / (unsigned)cluster) : (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    const int packs = r < L.rows ? (int)(L.cols / P) : 0, first = rank * N * (int)blockDim.x;
    bool have[N];
#pragma unroll
    for (int k = 0; k < N; ++k) have[k] = first + (int)threadIdx.x + k * (int)blockDim.x < packs;
    const int64_t off0 = packs > 0 ? row_off(L, 0, r) : 0, off2 = packs > 0 ? row_off(L, 2, r) : 0;
    Pack<TI, P> in0[N];
    const TI *src0 = static_cast<const TI *>(L.in[0]) + off0;
#pragma unroll
    for (int k = 0; k < N; ++k)
        if (have[k]) in0[k] = *reinterpret_cast<const Pack<TI, P> *>(src0 + (first + threadIdx.x + k * blockDim.x) * P);
    TO *dst = static_cast<TO *>(L.out) + off2;
    if (!kBackward) {
        A a[N * P];
        A m = lowest<A>();
#pragma unroll
        for (int k = 0; k < N; ++k)
#pragma unroll
            for (int j = 0; j < P; ++j) {
                a[k * P + j] = have[k] ? to_float(in0[k].v[j]) : lowest<A>();
                m = fmax(m, a[k * P + j]);
            }
        // exp(lowest - m) is 1 where m is lowest too (a thread with no pack): the sum skips them.
        A s = A(0);
#pragma unroll
        for (int k = 0; k < N; ++k)
#pragma unroll
            for (int j = 0; j < P; ++j) {
                const A e = exp_<TO>(a[k * P + j] - m);
                if (!L.log) a[k * P + j] = e;
                if (have[k]) s += e;
            }
        A row_m = m, row_s = s;
        group_reduce_once<true, TO>(row_m, row_s, scratch);
        cluster_reduce<true, TO>(row_m, row_s, parts, cluster, rank);
        // A row of -inf: row_s = 0, and NaN results (0 * inf, -inf - -inf), as torch gives.
        const A scale = exp_<TO>(m - row_m) / row_s, log_s = log_(row_s);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            if (!have[k]) continue;
            A v[P];
#pragma unroll
            for (int j = 0; j < P; ++j) v[j] = L.log ? (a[k * P + j] - row_m) - log_s : a[k * P + j] * scale;
            store_pack<TO, P>(dst + (first + threadIdx.x + k * blockDim.x) * P, v);
        }
        return;
    }
    Pack<TI, P> in1[N];
    const TI *src1 = static_cast<const TI *>(L.in[1]) + (packs > 0 ? row_off(L, 1, r) : 0);
#pragma unroll
    for (int k = 0; k < N; ++k)
        if (have[k]) in1[k] = *reinterpret_cast<const Pack<TI, P> *>(src1 + (first + threadIdx.x + k * blockDim.x) * P);
    A dot = A(0), unused = A(0);
#pragma unroll
    for (int k = 0; k < N; ++k) {
        if (!have[k]) continue;
#pragma unroll
        for (int j = 0; j < P; ++j) {
            const A g = to_float(in1[k].v[j]);
            dot += L.log ? g : g * to_float(in0[k].v[j]);
        }
    }
    group_reduce_once<false, TO>(dot, unused, scratch);
    cluster_reduce<false, TO>(dot, unused, parts, cluster, rank);
#pragma unroll
    for (int k = 0; k < N; ++k) {
        if (!have[k]) continue;
        A v[P];
#pragma unroll
        for (int j = 0; j < P; ++j) {
            const A y = to_float(in0[k].v[j]), g = to_float(in1[k].v[j]);
            v[j] = L.log ? g - exp_<TO>(y) * dot : y * (g - dot);
        }
        store_pack<TO, P>(dst + (first + threadIdx.x + k * blockDim.x) * P, v);
    }
}

// ---- rows in registers, lean: the flat kernel ---------------------------------------------------

// The flat kernel's largest group, and its smallest block (groups of fewer threads share one).
constexpr int kFlatMaxThreads = 1024, kFlatMinBlock = 128;

// Packs per thread the flat kernel may hold: forward 32 values in float32 (x, converted), as
// the group kernel's widest instances hold; backward 4 packs each of y and grad_y, kept as stored
// (32 registers: 32 values each in float16 and bfloat16, 16 in float32). The float32 backward at
// 8 packs spilled 184 bytes a thread (ptxas, sm_90, 64 registers). 0 for float64, which it does
// not take.
template <typename TX, typename TY, bool kBackward> constexpr int flat_max_packs() {
    return sizeof(typename Compute<TX>::type) == 8 ? 0 : kBackward ? 4 : 32 / pack_elems<TX, TY>();
}
// The max (kMax) or sum of v over this thread's group of `warps` whole warps (a power of two up to
// 32); every thread of the group gets the same bits. Warp butterflies, then, past one warp, one
// barrier: each warp's result stored at its slot of buf, read back by lane i of every warp of the
// group from the group's i-th slot (`slot`, computed once per kernel), and combined by butterflies
// unrolled over at most 5 levels of uniform branches. The group kernel's pair reduction takes
// two exps a level and a serial merge over the warps; this one takes none and log2(warps) levels.
template <bool kMax>
__device__ __forceinline__ float flat_group_reduce(float v, int warps, int slot, float *buf) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v, off);
        v = kMax ? fmaxf(v, o) : v + o;
    }
    if (warps == 1) return v;
    if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = v;
    __syncthreads();
    v = buf[slot];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        if (off >= warps) continue;
        const float o = __shfl_xor_sync(0xffffffffu, v, off);
        v = kMax ? fmaxf(v, o) : v + o;
    }
    return v;
}

// Blocks of kFlatMaxThreads an SM softmax_flat_kernel's registers must leave room for: 2 (32
// registers a thread, 8 rows of 256 threads an SM, as Liger-Kernel's 4096-column softmax runs)
// for a float16 or bfloat16 forward of up to 16 values a thread, which took 40 unbounded (ptxas,
// sm_90, bfloat16 at 2 packs) and none spilled at 32; else 1 (64). A float32 y (expf) spilled
// 16 bytes at 32 (float32 at 4 packs).
template <typename TX, typename TY, bool kBackward, int N> constexpr int flat_min_blocks() {
    return !kBackward && sizeof(TY) == 2 && N * pack_elems<TX, TY>() <= 16 ? 2 : 1;
}

// A pack of P values of TI held as 32-bit words, and its value j: float16 and bfloat16 pairs
// taken from their word (for bfloat16 a shift or a mask), so that packs are loaded, kept and
// copied as whole registers (as Pack<TI, P>, ptxas moved 16-bit halves: a PRMT a value).
template <typename TI, int P> using Words = Pack<uint32_t, P * (int)sizeof(TI) / 4>;
template <typename TI> __device__ __forceinline__ float word_value(const uint32_t *w, int j) {
    if constexpr (std::is_same<TI, float>::value) return __uint_as_float(w[j]);
    else if constexpr (std::is_same<TI, __nv_bfloat16>::value)
        return __uint_as_float(j % 2 ? w[j / 2] & 0xffff0000u : w[j / 2] << 16);
    else return __half2float(__ushort_as_half((unsigned short)(j % 2 ? w[j / 2] >> 16 : w[j / 2] & 0xffffu)));
}

// -inf in every value of a word of TI: the forward's padding, which adds nothing to a row's max
// or to its sum of exp(x - max) (the max starts at the lowest finite value).
template <typename TI> constexpr uint32_t minus_inf_word() {
    return std::is_same<TI, float>::value ? 0xff800000u : std::is_same<TI, __half>::value ? 0xfc00fc00u : 0xff80ff80u;
}

// The flat kernels' packs of one row: pack k of this thread (k < mine) from p + k * stride, the
// others `pad` in every word (-inf forward, zeros backward), so that a float16 or bfloat16
// forward's passes before the stores need no test of k < mine: a branch around each pack in
// each pass, with its convergence barrier and `mine` recomputed each pass (ptxas, sm_90,
// bfloat16 at 2 packs: 720 instructions in the kernel with the tests, 648 without).
template <typename TI, int P, int N>
__device__ __forceinline__ void flat_load(Words<TI, P> (&a)[N], const TI *p, int stride, int mine, uint32_t pad) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
#pragma unroll
        for (int i = 0; i < P * (int)sizeof(TI) / 4; ++i) a[k].v[i] = pad;
        if (k < mine) a[k] = *reinterpret_cast<const Words<TI, P> *>(p + k * stride);
    }
}

// The rest of a row of the flat kernels once its packs are loaded (a: x forward, y backward; b:
// grad_y), this thread's `mine` of them: the reductions and the outputs, at out + k * stride.
// Forward as Liger-Kernel's Triton softmax computes it: the row's max M, then e = exp(x - M) in
// place and its sum S, then y = e * (1 / S), or x - M - log(S): one exp an element and none in
// the reductions (buf[0], then buf[1]). Backward: the dot product (buf[0]), then the
// outputs. log_softmax and softmax are two branches (a select between them kept both values
// alive). Rows of -inf: M stays the lowest finite value, S = 0, and the outputs NaN (0 * inf,
// -inf - -inf), as torch gives.
template <typename TX, typename TY, bool kBackward, int N, typename TI = typename std::conditional<kBackward, TY, TX>::type,
          int P = pack_elems<TX, TY>(), typename TO = typename std::conditional<kBackward, TX, TY>::type>
__device__ __forceinline__ void flat_row(const brrr_softmax_launch &L, const Words<TI, P> (&a)[N],
                                         const Words<TI, P> (&b)[N], int mine, TO *out, int stride, int warps,
                                         int slot, float (*buf)[kFlatMaxThreads / 32]) {
    if constexpr (!kBackward) {
        // Past the padding (-inf), which adds nothing, for float32 results alone: their expf
        // (about ten instructions) interleaved over all of a thread's values took more registers
        // (ptxas, sm_90, float32 at 4 packs: 62 against 44).
        constexpr bool kSkip = std::is_same<TO, float>::value;
        auto forward = [&](auto log) {
            float v[N][P];
            float m = lowest<float>();
#pragma unroll
            for (int k = 0; k < N; ++k) {
                if (kSkip && k >= mine) continue;
#pragma unroll
                for (int j = 0; j < P; ++j) {
                    v[k][j] = word_value<TI>(a[k].v, j);
                    m = fmaxf(m, v[k][j]);
                }
            }
            m = flat_group_reduce<true>(m, warps, slot, buf[0]);
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                if (kSkip && k >= mine) continue;
#pragma unroll
                for (int j = 0; j < P; ++j) {
                    const float e = exp_<TO>(v[k][j] - m);
                    s += e;
                    if (!log) v[k][j] = e;
                }
            }
            s = flat_group_reduce<false>(s, warps, slot, buf[1]);
            const float log_s = logf(s), inv = __frcp_rn(s);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                if (k >= mine) continue;
#pragma unroll
                for (int j = 0; j < P; ++j) v[k][j] = log ? (v[k][j] - m) - log_s : v[k][j] * inv;
                store_pack<TO, P>(out + k * stride, v[k]);
            }
        };
        if (L.log) forward(std::true_type());
        else forward(std::false_type());
    } else {
        auto backward = [&](auto log) {
            // The padding (zeros) would add nothing, but without the test ptxas took more
            // registers (bfloat16 at 4 packs: 64 and 96 bytes of spills, against 56 and none).
            float dot = 0.f;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                if (k >= mine) continue;
#pragma unroll
                for (int j = 0; j < P; ++j) {
                    const float g = word_value<TI>(b[k].v, j);
                    dot += log ? g : g * word_value<TI>(a[k].v, j);
                }
            }
            dot = flat_group_reduce<false>(dot, warps, slot, buf[0]);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                if (k >= mine) continue;
                float v[P];
#pragma unroll
                for (int j = 0; j < P; ++j) {
                    const float y = word_value<TI>(a[k].v, j), g = word_value<TI>(b[k].v, j);
                    v[j] = log ? g - exp_<TO>(y) * dot : y * (g - dot);
                }
                store_pack<TO, P>(out + k * stride, v);
            }
        };
        if (L.log) backward(std::true_type());
        else backward(std::false_type());
    }
}

// Contiguous rows at one row stride (2-d launches) of float32, float16 and bfloat16, each on a
// group of 2^tpr_log2 threads (whole warps, up to kFlatMaxThreads) holding N 16-byte packs a
// thread in registers: thread t of a group holds packs t + k * group (k < N), so that each load
// of a warp reads 32 adjacent packs; flat_row does the rest. The bookkeeping is what
// norm_fwd_flat_kernel's is: a row's addresses are row * stride (no unravelling of row dims), the
// group reductions unrolled with their slot computed once, no integer division; every load of a
// row issued before any is used. Block: max(group, 128) threads, its rows consecutive. Packs past
// the row and rows past L.rows load, count and store nothing, but their threads reach the
// barriers. Assumes packable(L), L.row_ndim == 1 and cols / P <= N << tpr_log2.
template <typename TX, typename TY, bool kBackward, int N>
__global__ void __launch_bounds__(kFlatMaxThreads, flat_min_blocks<TX, TY, kBackward, N>())
    softmax_flat_kernel(const __grid_constant__ brrr_softmax_launch L, const int tpr_log2) {
    using TI = typename std::conditional<kBackward, TY, TX>::type;  // what is read: x, or y and grad_y
    using TO = typename std::conditional<kBackward, TX, TY>::type;
    constexpr int P = pack_elems<TX, TY>();
    constexpr uint32_t pad = kBackward ? 0u : minus_inf_word<TI>();
    __shared__ float buf[2][kFlatMaxThreads / 32];
    const int tpr = 1 << tpr_log2, t = (int)threadIdx.x & (tpr - 1), warps = tpr >> 5, lane = (int)threadIdx.x & 31;
    const int slot = (int)(threadIdx.x >> tpr_log2) * warps + (lane & (warps - 1));
    const int64_t row = (int64_t)blockIdx.x * ((int)blockDim.x >> tpr_log2) + (threadIdx.x >> tpr_log2);
    const int first = t * P, stride = tpr * P;
    int mine = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) mine += row < L.rows && first + k * stride < L.cols ? 1 : 0;
    Words<TI, P> a[N], b[N];
    flat_load<TI, P>(a, static_cast<const TI *>(L.in[0]) + row * L.row_strides[0][0] + first, stride, mine, pad);
    if (kBackward) flat_load<TI, P>(b, static_cast<const TI *>(L.in[1]) + row * L.row_strides[1][0] + first, stride, mine, 0u);
    TO *out = static_cast<TO *>(L.out) + row * L.row_strides[2][0] + first;
    flat_row<TX, TY, kBackward, N>(L, a, b, mine, out, stride, warps, slot, buf);
}

// Is every view of the launch contiguous along its columns, its rows 16-byte aligned for packs of P?
template <typename TX, typename TY>
inline bool packable(const brrr_softmax_launch &L) {
    constexpr int P = pack_elems<TX, TY>();
    if (L.cols % P != 0) return false;
    const int n = L.backward ? 3 : 2;
    const size_t sizes[3] = {L.backward ? sizeof(TY) : sizeof(TX), sizeof(TY), L.backward ? sizeof(TX) : sizeof(TY)};
    for (int i = 0; i < n; ++i) {
        const int k = i == n - 1 ? 2 : i;
        const void *p = k == 2 ? L.out : L.in[k];
        if (L.col_stride[k] != 1 || reinterpret_cast<uintptr_t>(p) % (P * sizes[k]) != 0) return false;
        for (int d = 0; d < L.row_ndim; ++d)
            if ((L.row_strides[k][d] * (int64_t)sizes[k]) % (int64_t)(P * sizes[k]) != 0) return false;
    }
    return true;
}

template <typename TX, typename TY, bool kBackward, int PACKS>
void launch_rows(const brrr_softmax_launch &L, int threads, cudaStream_t stream) {
    if constexpr (PACKS <= max_packs<TX, TY, kBackward>())
        softmax_rows_kernel<TX, TY, kBackward, PACKS><<<L.rows, threads, 0, stream>>>(L);
}

// softmax_smem_kernel for this launch, or false when the row does not fit: a cluster of the
// fewest blocks (a power of two, up to kMaxCluster; one without clusters, before sm_90) that
// hold it at up to 64 KB each, so that three share an SM; past kMaxCluster, as much as one
// block may hold.
template <typename TX, typename TY, bool kBackward>
bool launch_smem(const brrr_softmax_launch &L, int device, cudaStream_t stream, cudaError_t *err) {
    using A = typename Compute<TX>::type;
    using TI = typename std::conditional<kBackward, TY, TX>::type;
    const int64_t per_col = (kBackward ? 2 : 1) * (int64_t)sizeof(TI);
    const int max_cluster = device_attribute<cudaDevAttrComputeCapabilityMajor>(device, 0) >= 9 ? kMaxCluster : 1;
    auto slice_of = [&](int c) { return ((L.cols + c - 1) / c + kSliceAlign - 1) / kSliceAlign * kSliceAlign; };
    int cluster = 1;
    while (cluster < max_cluster && slice_of(cluster) * per_col > (64 << 10)) cluster *= 2;
    const int64_t slice = slice_of(cluster), bytes = slice * per_col;
    const int64_t limit = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device, 0) -
                          (int64_t)(sizeof(A) * (32 + 2 * kMaxCluster));
    if (bytes > limit || L.rows * cluster > INT32_MAX) return false;
    auto kernel = softmax_smem_kernel<TX, TY, kBackward>;
    static std::atomic<int64_t> allowed{0};  // the kernel's dynamic shared-memory limit, raised as needed
    if (bytes > 48 * 1024 && bytes > allowed.load(std::memory_order_relaxed)) {
        *err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)limit);
        if (*err != cudaSuccess) return true;
        allowed.store(limit, std::memory_order_relaxed);
    }
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr;
    cluster_launch_config(cfg, attr, dim3(kSmemThreads), (size_t)bytes, stream, cluster);
    cfg.gridDim = dim3((unsigned)(L.rows * cluster));
    *err = cudaLaunchKernelEx(&cfg, kernel, L, cluster, slice);
    return true;
}

// softmax_tile_kernel for this launch: as many rows a block (up to kTileMaxRows) as take up to
// kTileBlockBytes of inputs, the block's 128 threads split evenly among them. False where the
// rows' inputs take more or the grid would be too large.
template <typename TX, typename TY, bool kBackward>
bool launch_tile(const brrr_softmax_launch &L, cudaStream_t stream) {
    using TI = typename std::conditional<kBackward, TY, TX>::type;
    const int64_t slice = (L.cols + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
    const int64_t row_bytes = slice * (kBackward ? 2 : 1) * (int64_t)sizeof(TI);
    if (row_bytes > kTileBlockBytes) return false;
    int rows = kTileMaxRows;
    while (rows > 1 && rows * row_bytes > kTileBlockBytes) rows /= 2;
    const int64_t blocks = (L.rows + rows - 1) / rows;
    if (blocks > INT32_MAX) return false;
    softmax_tile_kernel<TX, TY, kBackward>
        <<<(unsigned)blocks, dim3(kTileThreads / rows, rows), (size_t)(rows * row_bytes), stream>>>(L, (int)slice);
    return true;
}

// softmax_group_kernel with N packs a thread for this launch: a row on one block of as many
// threads (whole warps) as hold it, with more rows a block up to kGroupBlockThreads, so that rows
// of a warp or two still fill an SM within its block limit; past kGroupClusterThreads, on a
// cluster of the fewest blocks (a power of two up to max_cluster) that hold it at up to that many
// threads each, or at up to kGroupMaxThreads in max_cluster blocks. False where N is past
// group_max_packs or the row does not fit.
template <typename TX, typename TY, bool kBackward, int N>
bool launch_group_n(const brrr_softmax_launch &L, int max_cluster, cudaStream_t stream, cudaError_t *err) {
    if constexpr (N > group_max_packs<TX, TY, kBackward>()) {
        return false;
    } else {
        const int64_t packs = L.cols / pack_elems<TX, TY>();
        auto threads_of = [&](int c) { return ((packs + (int64_t)N * c - 1) / ((int64_t)N * c) + 31) / 32 * 32; };
        int cluster = 1;
        while (cluster < max_cluster && threads_of(cluster) > kGroupClusterThreads) cluster *= 2;
        const int64_t threads = threads_of(cluster);
        if (threads > kGroupMaxThreads) return false;
        const int rows = cluster > 1 || threads >= kGroupBlockThreads ? 1 : kGroupBlockThreads / (int)threads;
        const int64_t blocks = cluster > 1 ? L.rows * cluster : (L.rows + rows - 1) / rows;
        if (blocks > INT32_MAX) return false;
        cudaLaunchConfig_t cfg;
        cudaLaunchAttribute attr;
        cluster_launch_config(cfg, attr, dim3((unsigned)threads, (unsigned)rows), 0, stream, cluster);
        cfg.gridDim = dim3((unsigned)blocks);
        *err = cudaLaunchKernelEx(&cfg, softmax_group_kernel<TX, TY, kBackward, N>, L, cluster);
        return true;
    }
}

// softmax_group_kernel for this launch with `per` packs a thread (1, 2, 4 or 8), or where per is 0
// the fewest (up to group_max_packs) that keep a row within kGroupBlockThreads threads, as
// Liger-Kernel's Triton softmax gives a row 4 to 8 warps at 1024 to 4096 columns; clusters (sm_90)
// past kGroupClusterThreads.
template <typename TX, typename TY, bool kBackward>
bool launch_group(const brrr_softmax_launch &L, int per, int device, cudaStream_t stream, cudaError_t *err) {
    if (per == 0) {
        const int64_t packs = L.cols / pack_elems<TX, TY>();
        per = 1;
        while (per < group_max_packs<TX, TY, kBackward>() && (packs + per - 1) / per > kGroupBlockThreads) per *= 2;
    }
    const int max_cluster = device_attribute<cudaDevAttrComputeCapabilityMajor>(device, 0) >= 9 ? kMaxCluster : 1;
    switch (per) {
    case 1: return launch_group_n<TX, TY, kBackward, 1>(L, max_cluster, stream, err);
    case 2: return launch_group_n<TX, TY, kBackward, 2>(L, max_cluster, stream, err);
    case 4: return launch_group_n<TX, TY, kBackward, 4>(L, max_cluster, stream, err);
    case 8: return launch_group_n<TX, TY, kBackward, 8>(L, max_cluster, stream, err);
    default: return false;
    }
}

// The flat kernels' layout for this launch, or false where it does not apply (float64, rows over
// several dims, views packable() refuses, rows past kFlatMaxThreads threads of `most` packs a
// thread): 2^tpr_log2 threads (32 to 1024) of `packs` packs a thread, `per` of them where per
// is 1, 2, 4 or 8, else (per = 0) the fewest pack slots that hold the row and among those the
// packs nearest 16 values a thread (ties to fewer): Liger-Kernel's Triton softmax gives a row 16
// values a thread from 2048 to 8192 columns (bfloat16 4096: 256 threads of 2 packs; float32
// 4096: 256 of 4; 32768: 1024 threads of 4 packs bfloat16, 8 float32).
template <typename TX, typename TY>
bool flat_config(const brrr_softmax_launch &L, int per, int most, int *tpr_log2, int *packs) {
    constexpr int P = pack_elems<TX, TY>();
    if (most == 0 || L.row_ndim != 1 || L.cols > (int64_t)kFlatMaxThreads * most * P || !packable<TX, TY>(L))
        return false;
    const int64_t total = L.cols / P;
    int64_t best = 0;
    int best_gap = 0;
    for (int p = 1; p <= most; p *= 2) {
        if (per != 0 && p != per) continue;
        int lg = 5;
        while (((int64_t)1 << lg) * p < total && lg < 10) ++lg;
        const int64_t slots = ((int64_t)1 << lg) * p;
        const int gap = abs(p * P - 16);
        if (slots < total || (best != 0 && (slots > best || (slots == best && gap >= best_gap)))) continue;
        best = slots;
        best_gap = gap;
        *tpr_log2 = lg;
        *packs = p;
    }
    return best != 0;
}

// softmax_flat_kernel at N packs a thread.
template <typename TX, typename TY, bool kBackward, int N>
cudaError_t launch_flat_n(const brrr_softmax_launch &L, int64_t blocks, int block, int tpr_log2, cudaStream_t stream) {
    if constexpr (N <= flat_max_packs<TX, TY, kBackward>())
        softmax_flat_kernel<TX, TY, kBackward, N><<<(unsigned)blocks, block, 0, stream>>>(L, tpr_log2);
    return cudaGetLastError();
}

// softmax_flat_kernel for this launch with `per` packs
// a thread (1, 2, 4 or 8; 0: flat_config's choice); false where it does not apply or the grid
// would be too large.
template <typename TX, typename TY, bool kBackward>
bool launch_flat(const brrr_softmax_launch &L, int per, cudaStream_t stream, cudaError_t *err) {
    const int most = flat_max_packs<TX, TY, kBackward>();
    int tpr_log2 = 0, packs = 0;
    if (!flat_config<TX, TY>(L, per, most, &tpr_log2, &packs)) return false;
    const int tpr = 1 << tpr_log2, block = tpr > kFlatMinBlock ? tpr : kFlatMinBlock, groups = block / tpr;
    const int64_t blocks = (L.rows + groups - 1) / groups;
    if (blocks > INT32_MAX) return false;
    switch (packs) {
    case 1: *err = launch_flat_n<TX, TY, kBackward, 1>(L, blocks, block, tpr_log2, stream); break;
    case 2: *err = launch_flat_n<TX, TY, kBackward, 2>(L, blocks, block, tpr_log2, stream); break;
    case 4: *err = launch_flat_n<TX, TY, kBackward, 4>(L, blocks, block, tpr_log2, stream); break;
    default: *err = launch_flat_n<TX, TY, kBackward, 8>(L, blocks, block, tpr_log2, stream); break;
    }
    return true;
}

// Rows whose inputs take up to 32 KB go to the tile kernel past 1024 columns and to the register
// kernel up to 1024, longer ones to the shared-memory (cluster) kernel, unaligned or strided ones
// to the streaming kernel. On an H200 (16384 rows, device time) the tile kernel took a bfloat16
// softmax forward of 4096 columns from 0.153 to 0.082 ms and a float32 one from 0.204 to 0.140,
// where at 1024 columns it was 10-17% slower than the register kernel. BRRR_SOFTMAX_KERNEL=tile,
// rows, smem, stream, group or group1/2/4/8 picks one where it applies, else the streaming kernel;
// flat or flat1/2/4/8 the flat kernel where it applies, else the default choice; auto the default choice
// (for measurements; docs/kernel-switches.md). Unset, the flat kernel first (below), then these.
template <typename TX, typename TY, bool kBackward>
cudaError_t launch_typed(const brrr_softmax_launch &L, int device, cudaStream_t stream) {
    constexpr int P = pack_elems<TX, TY>(), kMax = max_packs<TX, TY, kBackward>();
    using TI = typename std::conditional<kBackward, TY, TX>::type;
    const int64_t packs = L.cols / P, held = L.cols * (kBackward ? 2 : 1) * (int64_t)sizeof(TI);
    const char *force = getenv("BRRR_SOFTMAX_KERNEL");
    if (force && strcmp(force, "auto") == 0) force = nullptr;
    // Unset, the flat kernel wherever it applies but for 16-bit inputs past 16384 columns and 32-bit
    // inputs of 4097-16384. On an H200 (2026-12-04, 16384 rows, device time, docs/kernel-switches.md)
    // it ran the bfloat16 softmax forward at 1024, 4096, 8192 and 16384 columns at 92%, 98%, 96% and
    // 89% of the memory floor (the choice below: 73%, 69-86%, 82%, 86%), float32 at 4096 and 32768
    // at 97% and 93% (89%, 88%), float32 at 1024 within 2%; but bfloat16 at 32768 at 73% against
    // the shared-memory kernel's 82%, and float32 at 8192 and 16384 at 89% and 76% against the group
    // kernel's 97% and 98%.
    const bool flat_default = !force && !(sizeof(TI) == 2 && L.cols > 16384) &&
                              !(sizeof(TI) == 4 && L.cols > 4096 && L.cols <= 16384);
    if (flat_default || (force && strncmp(force, "flat", 4) == 0)) {
        const char *per = force ? force + 4 : "";
        cudaError_t err = cudaSuccess;
        if (launch_flat<TX, TY, kBackward>(L, *per ? atoi(per) : 0, stream, &err)) return err;
        force = nullptr;
    }
    const bool pack = packable<TX, TY>(L);
    const bool rows_fit = pack && packs <= 512 * kMax;
    const bool want_smem = force ? strcmp(force, "smem") == 0 : held > (32 << 10);
    const bool want_tile = force ? strcmp(force, "tile") == 0 : L.cols > 1024;
    const bool want_rows = force ? strcmp(force, "rows") == 0 : true;
    // group: the group kernel's own packs a thread; group1, group2, group4, group8: that many.
    // Unset, the group kernel where it measured faster (H200, 16384 rows, device time,
    // docs/kernel-switches.md): float32 past 1024 columns (backward 9-11% faster at 4096 and
    // 32768, 5% at 131072; forward 6% at 32768, the same at 4096 and 131072), and half-precision
    // forwards of 1025-4096 columns at 4 packs a thread (bfloat16 4096: 0.073 ms against the tile
    // kernel's 0.082).
    int group = -1;
    if (force && strncmp(force, "group", 5) == 0) group = force[5] ? atoi(force + 5) : 0;
    else if (!force && sizeof(TX) == 4 && sizeof(TY) == 4 && L.cols > 1024) group = 0;
    else if (!force && sizeof(TX) == 2 && sizeof(TY) == 2 && !kBackward && L.cols > 1024 && L.cols <= 4096) group = 4;
    if (pack && group >= 0) {
        cudaError_t err = cudaSuccess;
        if (launch_group<TX, TY, kBackward>(L, group, device, stream, &err))
            return err != cudaSuccess ? err : cudaGetLastError();
    }
    if (pack && want_smem) {
        cudaError_t err = cudaSuccess;
        if (launch_smem<TX, TY, kBackward>(L, device, stream, &err)) return err != cudaSuccess ? err : cudaGetLastError();
    }
    if (pack && want_tile && launch_tile<TX, TY, kBackward>(L, stream)) return cudaGetLastError();
    // One row a block from here: more rows than a grid's blocks must not wrap (a silent partial result).
    if (L.rows > INT32_MAX) return cudaErrorInvalidConfiguration;
    if (rows_fit && want_rows) {
        // As many packs per thread as keep 64 threads or more on the row: several 16-byte loads in
        // flight per thread, and small blocks, so that several rows share an SM and one row's
        // reductions overlap another's loads.
        int per = kMax;
        while (per > 1 && packs < 64 * per) per /= 2;
        const int threads = (int)((packs + per - 1) / per + 31) / 32 * 32;
        switch (per) {
        case 1: launch_rows<TX, TY, kBackward, 1>(L, threads, stream); break;
        case 2: launch_rows<TX, TY, kBackward, 2>(L, threads, stream); break;
        case 4: launch_rows<TX, TY, kBackward, 4>(L, threads, stream); break;
        case 8: launch_rows<TX, TY, kBackward, 8>(L, threads, stream); break;
        default: launch_rows<TX, TY, kBackward, 16>(L, threads, stream); break;
        }
    } else {
        const int threads = L.cols >= 1024 * 4 ? 1024 : L.cols >= 256 * 4 ? 256 : 128;
        if (pack) softmax_stream_kernel<TX, TY, P><<<L.rows, threads, 0, stream>>>(L);
        else softmax_stream_kernel<TX, TY, 1><<<L.rows, threads, 0, stream>>>(L);
    }
    return cudaGetLastError();
}

template <typename TX, typename TY>
cudaError_t launch(const brrr_softmax_launch &L, int device, cudaStream_t stream) {
    return L.backward ? launch_typed<TX, TY, true>(L, device, stream) : launch_typed<TX, TY, false>(L, device, stream);
}

}  // namespace softmax
}  // namespace brrr
#endif
