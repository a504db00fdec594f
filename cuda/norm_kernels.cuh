// LayerNorm and RMSNorm kernels, forward and backward (the "norm" family).
//
// Per row of N = cols elements, h = x, or h = round(x + residual) for the fused residual forms
// (which store h as the new residual stream); all math in fp32 (fp64 for float64 storage):
//   LayerNorm  K = h[0]; m = mean(h - K); var = mean((h - K - m)^2); rstd = 1 / sqrt(var + eps)
//              xhat = (h - K - m) * rstd;  out = xhat * w + b
//   RMSNorm    rstd = 1 / sqrt(mean(h^2) + eps);  xhat = h * rstd
//              out = xhat * w (torch's order) or round(round(xhat) * w) (Llama's order)
//   w is weight + weight_offset wherever the weight is read (Gemma's 1 + weight, added in fp32)
//   Backward   g = dy * w;  dx = rstd * (g - xhat * mean(g * xhat) - mean(g)) [+ grad_residual]
//              (RMSNorm: no mean(g) term);  dw = sum over rows of dy * xhat;  db = sum of dy
// The shift K, the row's first element, makes h - K exact for inputs with a large common offset
// (Sterbenz), so the two-pass statistics keep full precision; whatever the data, it costs at most
// eps * |K - mean| / std <= eps * sqrt(N). Saved per row: m (relative to K) and rstd; the
// backward reloads K from x and rematerialises xhat instead of saving it.
//
// norm_fwd_kernel     fast path: the normalised dims are one contiguous column dim in every
//                     tensor (rows at any strides). A group of tpr threads (a power of two up to
//                     512) owns a row, held in registers as PACKS packs of VEC elements per thread
//                     (16-byte accesses when every row is aligned, VEC = 1 otherwise); pack k of
//                     thread t holds columns (k * tpr + t) * VEC + [0, VEC). A block has
//                     max(tpr, 256) threads, so narrow rows share a block. Group sums: warp
//                     butterflies, then one over the group's warps through shared memory; one
//                     per row (LayerNorm: two, the mean and then the squares about it).
//                     Assumes: N <= 512 * PACKS * VEC, N % VEC == 0.
// norm_fwd_bulk_kernel  the float16 and bfloat16 default for launches of 16-byte packs on sm_90
//                     in groups of whole warps (BRRR_NORM_FWD_KERNEL=bulk|rows): the same layout
//                     and arithmetic (rows of 5 packs a thread at twice the threads and 3 packs),
//                     a block per group walking rows, its weight and bias held in registers, its
//                     rows copied into a ring in shared memory by cp.async.bulk (see the kernel).
// norm_fwd_flat_kernel  2-d launches of 16-byte packs in float32, float16 and bfloat16, the
//                     float32 default up to 2048 columns (BRRR_NORM_FWD_KERNEL=flat|rows): the
//                     same arithmetic in a layout of up to 4 packs a thread over 32-1024 threads
//                     (flat_config), with less bookkeeping an element (see the kernel).
// norm_bwd_kernel     the same row layout (up to 16 elements a thread), a block of
//                     brrr_norm_lanes(cols) such groups within 512 threads (128 registers each;
//                     the widest rows split over a cluster of two such blocks on sm_90, else
//                     1024 threads at 64 registers), each streaming its rows through a
//                     cp.async ring in shared memory (up to 3 rows in flight per group), the
//                     weight and bias gradients summed in registers in the order of brrr_cuda.h
//                     (see the kernel).
// norm_bwd_bulk_kernel  the same launches on sm_90, the float16 and bfloat16 default
//                     (BRRR_NORM_BWD_KERNEL=bulk|ring): the same layout, ring and order, a row
//                     copied into the ring by one cp.async.bulk a tensor, completing on an
//                     mbarrier; and half rows of 8193-16384 columns at 4 packs a thread within
//                     512 threads, recomputing xhat and g in the second pass (see the kernel).
// norm_fwd_generic_kernel, norm_bwd_dx_generic_kernel
//                     any strides, or rows too long for registers: a 256-thread block per row,
//                     reading the row twice (the second time mostly from L2). Forward statistics:
//                     per-thread shifted sums, merged with Chan's formula in a fixed tree.
// norm_bwd_dwdb_generic_kernel  dw/db for the generic path: a block owns 32 columns of a chunk of
//                     rows, its lanes summed in order through shared memory (the same order).
// norm_finalize_kernel  grad_weight/grad_bias[c] = sum over p, in order, of partials[p][c].
// Every sum has a fixed order, so results are bitwise identical run to run; the weight and bias
// gradients' order is a function of the shape alone (brrr_cuda.h), the same for every kernel,
// block count and GPU. Nothing is allocated; no atomics.
#pragma once

#include <mutex>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#include "brrr_cuda.h"
#include "common.cuh"

namespace brrr {
namespace norm {

// Kernels take the launch by value: 4 KB is the parameter space every CUDA version gives.
static_assert(sizeof(brrr_norm_launch) <= 4096, "brrr_norm_launch must fit the 4 KB kernel parameter space");

constexpr int kMaxRowThreads = 512;  // threads per row, and per block
constexpr int kMinBlockThreads = 256;
constexpr int kMaxWarps = kMaxRowThreads / 32;
constexpr int kGenericThreads = 256;
constexpr int kGenericWarps = kGenericThreads / 32;
constexpr int kFinalCols = 32, kFinalLanes = 16;  // finalize

template <typename T>
constexpr bool is_half = std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;

__device__ __forceinline__ float rsqrt_of(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_of(double v) { return rsqrt(v); }

template <typename T, typename A> __device__ __forceinline__ A round_to(A v) { return to_float(to_storage<T, A>(v)); }

// VEC elements of S from p, in 16-byte pieces (p aligned to min(16, VEC * sizeof(S))).
template <typename S, int VEC, typename A>
__device__ __forceinline__ void load_vec(const S *p, A *out) {
    constexpr int kChunk = VEC * (int)sizeof(S) > 16 ? 16 / (int)sizeof(S) : VEC;
#pragma unroll
    for (int c = 0; c < VEC; c += kChunk) load_pack<S, kChunk>(p + c, out + c);
}

template <typename S, int VEC, typename A>
__device__ __forceinline__ void store_vec(S *p, const A *in) {
    constexpr int kChunk = VEC * (int)sizeof(S) > 16 ? 16 / (int)sizeof(S) : VEC;
#pragma unroll
    for (int c = 0; c < VEC; c += kChunk) store_pack<S, kChunk>(p + c, in + c);
}

// VEC weight or bias values from element `at` of `p` (weight_dtype: T, or float32 for halves);
// `fill` where the parameter is absent.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void load_param(const brrr_norm_launch &L, const void *p, int64_t at, A fill, A *out) {
    if (p == nullptr) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = fill;
        return;
    }
    if constexpr (is_half<T>) {
        if (L.weight_dtype == BRRR_F32) {
            load_vec<float, VEC>(static_cast<const float *>(p) + at, out);
            return;
        }
    }
    load_vec<T, VEC>(static_cast<const T *>(p) + at, out);
}

// VEC weight values from element `at`, plus L.weight_offset (Gemma's 1 + weight, in A): the one
// place the kernels read the weight. 1 where it is absent (the glue refuses an offset without one).
template <typename T, int VEC, typename A>
__device__ __forceinline__ void load_weight(const brrr_norm_launch &L, int64_t at, A *out) {
    load_param<T, VEC>(L, L.weight.data, at, A(1), out);
    const A offset = static_cast<A>(L.weight_offset);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] += offset;
}

template <typename T, typename A>
__device__ __forceinline__ void store_param(const brrr_norm_launch &L, void *p, int64_t at, A v) {
    if constexpr (is_half<T>) {
        if (L.weight_dtype == BRRR_F32) {
            static_cast<float *>(p)[at] = static_cast<float>(v);
            return;
        }
    }
    static_cast<T *>(p)[at] = to_storage<T, A>(v);
}

// Offset of row (kRows) or column i of a view, from the coalesced shape and the view's strides.
template <bool kRows>
__device__ __forceinline__ int64_t dims_offset(const brrr_norm_launch &L, const brrr_norm_view &v, int64_t i) {
    const int ndim = kRows ? L.row_ndim : L.col_ndim;
    if (ndim == 1) return i * (kRows ? v.row_strides[0] : v.col_strides[0]);
    int64_t off = 0;
#pragma unroll
    for (int d = BRRR_MAX_DIMS - 1; d >= 0; --d) {
        if (d < ndim) {
            const int64_t n = kRows ? L.row_shape[d] : L.col_shape[d];
            off += (i % n) * (kRows ? v.row_strides[d] : v.col_strides[d]);
            i /= n;
        }
    }
    return off;
}
__device__ __forceinline__ int64_t row_offset(const brrr_norm_launch &L, const brrr_norm_view &v, int64_t r) {
    return dims_offset<true>(L, v, r);
}
__device__ __forceinline__ int64_t col_offset(const brrr_norm_launch &L, const brrr_norm_view &v, int64_t c) {
    return dims_offset<false>(L, v, c);
}

// Offsets of row r in N views at once, for the row kernels, decomposed in 32 bits (row_config
// sends more rows than that, in several dims, elsewhere).
template <int N>
__device__ __forceinline__ void row_offsets(const brrr_norm_launch &L, int64_t r, const brrr_norm_view *const (&v)[N],
                                            int64_t (&off)[N]) {
    const int64_t *strides[N];
#pragma unroll
    for (int i = 0; i < N; ++i) strides[i] = v[i]->row_strides;
    unravel_offsets<uint32_t, BRRR_MAX_DIMS>(L.row_ndim, L.row_shape, r, strides, off);
}

// Element `col` (in the fast path's contiguous columns; 0 elsewhere) of row r, NULL when absent.
template <typename T>
__device__ __forceinline__ const T *row_in(const brrr_norm_launch &L, const brrr_norm_view &v, int64_t r, int col = 0) {
    return v.data ? static_cast<const T *>(v.data) + row_offset(L, v, r) + col : nullptr;
}
template <typename T>
__device__ __forceinline__ T *row_out(const brrr_norm_launch &L, const brrr_norm_view &v, int64_t r, int col = 0) {
    return v.data ? static_cast<T *>(v.data) + row_offset(L, v, r) + col : nullptr;
}

// Sums v over the tpr threads of the calling thread's group (a power of two; all threads of the
// block call it together): a butterfly within each warp, then one over the group's warp results,
// which every warp of the group runs alike (lane l taking the result of warp l % warps). So every
// thread of a group gets the same bits, both lanes of a butterfly step adding the same pair.
// `buf` (one slot per warp and value) must differ from the buffer of the previous call, whose
// readers may still be at it.
template <typename A, int kN> __device__ __forceinline__ void group_sum(A (&v)[kN], int tpr, A (*buf)[kMaxWarps]) {
    auto butterfly = [&](int width) {
        for (int off = width / 2; off > 0; off /= 2) {
#pragma unroll
            for (int i = 0; i < kN; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
        }
    };
    butterfly(tpr < 32 ? tpr : 32);
    if (tpr <= 32) return;
    const int warps = tpr / 32, lane = threadIdx.x & 31;
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < kN; ++i) buf[i][threadIdx.x / 32] = v[i];
    }
    __syncthreads();
    const int slot = (threadIdx.x / tpr) * warps + (lane & (warps - 1));
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = buf[i][slot];
    butterfly(warps);
}

// Bulk copies (sm_90): a row from global into shared memory by one cp.async.bulk a tensor,
// completing on an mbarrier (norm_fwd_bulk_kernel, norm_bwd_bulk_kernel).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_addr(const void *p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// The producer's arrival on the stage's barrier, announcing `bytes` of copies that complete on it.
__device__ __forceinline__ void mbar_expect(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory,
// completing on `bar`.
__device__ __forceinline__ void bulk_copy(void *smem, const void *gmem, unsigned bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_addr(smem)),
                 "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
// Waits until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
#endif

// ---- fast path: a row in registers --------------------------------------------------------
// Column arithmetic is 32-bit here (a row has at most 512 * 32 elements): thread t's pack k
// starts at column t * VEC + k * tpr * VEC and is in the row when k < its count of packs.

__device__ __forceinline__ int packs_in_row(bool active, int cols, int first, int stride) {
    return active && cols > first ? (cols - first + stride - 1) / stride : 0;
}

// Minimum blocks per SM for the forward's launch bounds: 2 (a 64-register cap) when a thread's
// share of the row is at most 128 bytes (fp32 rows of 8 packs: 61 registers, no spills); left at
// 128 registers ptxas spends them on scheduling freedom and cuts the warps that keep loads in
// flight (the fp32 two-pass LayerNorm took 72: 3 blocks of 256 per SM instead of 4). The
// residual forms hold a second row and keep 128. The half types' 5 packs (kHalfFivePacks) run in
// blocks of 256 threads: 3 of them per SM, 80 registers (70 used), or 2 for the residual forms
// (80 spilled).
template <typename T> constexpr int fwd_min_blocks(int packs, int elements, bool residual) {
    return packs == 5 ? (residual ? 2 : 3) : !residual && elements * (int)sizeof(T) <= 128 ? 2 : 1;
}
constexpr int fwd_max_threads(int packs) { return packs == 5 ? kMinBlockThreads : kMaxRowThreads; }

// A row's statistics in every forward kernel, in one order (their common bits), from the
// thread's packs v (those past the row zero): LayerNorm subtracts the shift from the packs in the
// row and sums them (first_sum: the group's sum), subtracts the mean (kept: the output's v - mean)
// and sums the squares (then_sum); RMSNorm sums the squares of every pack (first_sum). Flags are
// uniform and pack bounds per thread: branches around whole packs, no selects per element.
template <typename A, int PACKS, int VEC, typename First, typename Then>
__device__ __forceinline__ void fwd_row_stats(A (&v)[PACKS][VEC], int mine, bool layer, A shift, A inv_n, A eps, A &mean,
                                              A &rstd, First first_sum, Then then_sum) {
    mean = A(0);
    if (layer) {
        A sum[1] = {A(0)};
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if (k >= mine) continue;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                v[k][j] -= shift;
                sum[0] += v[k][j];
            }
        }
        first_sum(sum);
        mean = sum[0] * inv_n;
        A squares[1] = {A(0)};
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if (k >= mine) continue;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                v[k][j] -= mean;
                squares[0] += v[k][j] * v[k][j];
            }
        }
        then_sum(squares);
        rstd = rsqrt_of(squares[0] * inv_n + eps);
    } else {
        A q[1] = {A(0)};
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) q[0] += v[k][j] * v[k][j];
        }
        first_sum(q);
        rstd = rsqrt_of(q[0] * inv_n + eps);
    }
}

// kResidual: L.residual is given (a template argument, so the plain forward keeps no registers for it).
// LayerNorm's statistics are two passes over the row in registers, a group sum each: the mean,
// then the squares about it. Merging per-thread (count, sum, squared deviations) in one reduction
// instead (Chan et al.) saves a barrier but costs ~17 instructions per butterfly step; at 16384 x
// 4096 bf16 on the H200 it ran 0.098 ms, two group sums 0.092 ms.
// What holds that shape at 54% of DRAM bandwidth is latency: a thread loads its share of a row,
// then waits through the reductions with nothing in flight.
template <typename T, int VEC, int PACKS, bool kResidual>
__global__ void __launch_bounds__(fwd_max_threads(PACKS), fwd_min_blocks<T>(PACKS, PACKS * VEC, kResidual))
    norm_fwd_kernel(const __grid_constant__ brrr_norm_launch L, const int tpr) {
    using A = typename Compute<T>::type;
    constexpr int kAdd = kResidual ? PACKS : 1;
    __shared__ A buf[2][1][kMaxWarps];
    const int groups = blockDim.x / tpr, t = threadIdx.x % tpr;
    const int cols = (int)L.cols, first = t * VEC, stride = tpr * VEC;
    const A inv_n = A(1) / static_cast<A>(cols), eps = static_cast<A>(L.eps);
    const bool layer = !L.rms;
    int parity = 0;
    for (int64_t base = (int64_t)blockIdx.x * groups; base < L.rows; base += (int64_t)gridDim.x * groups) {
        const int64_t row = base + threadIdx.x / tpr;
        const bool active = row < L.rows;
        const int mine = packs_in_row(active, cols, first, stride);
        const brrr_norm_view *const views[6] = {&L.x, &L.residual, &L.residual_out, &L.out, &L.mean, &L.rstd};
        int64_t off[6];
        row_offsets(L, active ? row : base, views, off);  // an in-range row for the address arithmetic
        const T *x = static_cast<const T *>(L.x.data) + off[0] + first;
        const T *res = kResidual ? static_cast<const T *>(L.residual.data) + off[1] + first : nullptr;
        A v[PACKS][VEC], add[kAdd][VEC];
        // Every load is issued before anything is stored.
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] = A(0);
            if (k < mine) load_vec<T, VEC>(x + k * stride, v[k]);
            if constexpr (kResidual) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) add[k][j] = A(0);
                if (k < mine) load_vec<T, VEC>(res + k * stride, add[k]);
            }
        }
        A shift = A(0);
        if (layer && active) shift = kResidual ? round_to<T>(to_float(x[-first]) + to_float(res[-first])) : to_float(x[-first]);
        if constexpr (kResidual) {
            T *res_out = static_cast<T *>(L.residual_out.data) + off[2] + first;
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[k][j] = round_to<T>(v[k][j] + add[k][j]);
                if (k < mine) store_vec<T, VEC>(res_out + k * stride, v[k]);
            }
        }
        A mean, rstd;
        auto sum = [&](A(&total)[1]) {
            group_sum(total, tpr, buf[parity]);
            parity ^= 1;
        };
        fwd_row_stats(v, mine, layer, shift, inv_n, eps, mean, rstd, sum, sum);
        if (!active) continue;
        if (t == 0) {
            if (L.mean.data) static_cast<A *>(L.mean.data)[off[4]] = mean;
            if (L.rstd.data) static_cast<A *>(L.rstd.data)[off[5]] = rstd;
        }
        T *out = static_cast<T *>(L.out.data) + off[3] + first;
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if (k >= mine) continue;
            A w[VEC], b[VEC], y[VEC];
            load_weight<T, VEC>(L, first + k * stride, w);
            if (L.llama) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) y[j] = round_to<T>(v[k][j] * rstd) * w[j];
            } else {
                load_param<T, VEC>(L, L.bias.data, first + k * stride, A(-0.0), b);
#pragma unroll
                for (int j = 0; j < VEC; ++j) y[j] = v[k][j] * rstd * w[j] + b[j];
            }
            store_vec<T, VEC>(out + k * stride, y);
        }
    }
}

// group_sum's additions in its order for a group of `warps` whole warps (a power of two up to
// kSlots), its butterflies unrolled: the same bits. slot() gives the thread's slot of the warps'
// results in buf (called past the barrier). group_sum's are loops of runtime width, with their
// counter and branch at every level, in norm_fwd_kernel, which issues ~32 instructions an element
// at 4096 bfloat16 columns (H200 ncu: issue slots 73% busy, the integer pipe the busiest).
template <int kSlots, typename A, int kN, typename Slot>
__device__ __forceinline__ void warps_group_sum(A (&v)[kN], int warps, Slot slot, A (*buf)[kSlots]) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
#pragma unroll
        for (int i = 0; i < kN; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
    }
    if (warps == 1) return;
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int i = 0; i < kN; ++i) buf[i][threadIdx.x / 32] = v[i];
    }
    __syncthreads();
    const int at = slot();
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = buf[i][at];
#pragma unroll
    for (int off = kSlots / 2; off > 0; off /= 2) {
        if (off >= warps) continue;  // (uniform) group_sum's levels: warps / 2, ..., 1
#pragma unroll
        for (int i = 0; i < kN; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
    }
}

// A float16 and bfloat16 forward on sm_90 (BRRR_NORM_FWD_KERNEL=bulk; unset, the plain forms' and,
// past 8192 columns, the fused residual forms' but at the five-pack widths: norm_fwd_typed):
// norm_fwd_kernel's arithmetic and sums in their order for a row layout of tpr threads and PACKS
// packs a thread (the same bits as norm_fwd_kernel at that layout), with less bookkeeping an
// element. Rows that norm_fwd_kernel gives 5 packs a thread run here at twice
// the threads and 3 packs (fwd_bulk_launch): their sums group the elements otherwise, so their
// bits are those of BRRR_NORM_FWD_PACKS=pow2's layout, not the default's. norm_fwd_kernel issues 23-51 instructions an element (H200 ncu), its
// issue slots the busiest unit: every row reloads its weight and bias, converts them and adds the
// weight offset, each thread loads the row's shift from global memory, unravels six views'
// offsets, and sums in loops of runtime width; and nothing loads while a row is reduced. Here a
// block is one group (tpr threads, whole warps) on a grid of waves of the blocks that fit at once
// (fwd_bulk_launch), walking rows blockIdx.x, + gridDim.x, ...: a thread holds its packs' weight
// and bias in registers,
// converted once (the offset added); the block's first thread copies each row of x (and the
// residual) into a ring of `stages` rows in shared memory by one cp.async.bulk a tensor,
// completing on the stage's mbarrier, so that `stages` rows are in flight; a thread reads its
// packs back with 16-byte loads (the ring's layout is the row's) and the shift from the ring;
// a row's addresses are row * stride; warps_group_sum's sums. The stage of a row is refilled
// (the row `stages` later) past the barrier of its first group sum, which every thread reaches
// after its last read of the stage. kBias: the bias held (a template argument, so that rows
// without one keep no registers for it). Assumes: sm_90, 16-byte packs, 2-d launch (row_ndim 1),
// 16-byte aligned rows, tpr = blockDim.x a multiple of 32 up to 512, 1 <= stages <= 32 (phases).
// kFull: cols == tpr * PACKS * VEC (768, 1024, 2048, 4096, 8192, 16384 columns of halves...), every
// thread's packs all in the row: no zero fill and no branch around a pack (at 4096 bfloat16
// columns they were about 60 of a row's ~550 instructions a thread, ptxas's SASS).
template <typename T, int PACKS, bool kResidual, bool kBias, bool kFull>
__global__ void __launch_bounds__(kMaxRowThreads, 1)
    norm_fwd_bulk_kernel(const __grid_constant__ brrr_norm_launch L, const int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using A = typename Compute<T>::type;
    constexpr int VEC = 16 / (int)sizeof(T), kTensors = kResidual ? 2 : 1;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ A buf[2][1][kMaxWarps];
    const int tpr = blockDim.x, t = threadIdx.x;
    const int cols = (int)L.cols, first = t * VEC, stride = tpr * VEC;
    const int mine = kFull ? PACKS : packs_in_row(true, cols, first, stride);
    // The thread's slot of the warps' results in a group sum, once: the block is the group.
    const int warps = tpr / 32, slot = (int)(threadIdx.x & 31) & (warps - 1);
    const A inv_n = A(1) / static_cast<A>(cols), eps = static_cast<A>(L.eps);
    const bool layer = !L.rms, llama = L.llama != 0;
    const unsigned row_bytes = (unsigned)cols * (unsigned)sizeof(T);  // a multiple of 16
    T *const ring = reinterpret_cast<T *>(smem);                       // [stage][tensor][cols]
    uint64_t *const full = reinterpret_cast<uint64_t *>(smem + (size_t)stages * kTensors * row_bytes);
    if (t == 0) {
        for (int s = 0; s < stages; ++s) mbar_init(full + s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    // The producer's cursor: the next row to copy, into stage s; every thread keeps it alike.
    int64_t prow = blockIdx.x;
    auto issue = [&](int s) {
        if (prow >= L.rows) return;
        if (t == 0) {
            T *dst = ring + (size_t)s * kTensors * cols;
            mbar_expect(full + s, row_bytes * (unsigned)kTensors);
            bulk_copy(dst, static_cast<const T *>(L.x.data) + prow * L.x.row_strides[0], row_bytes, full + s);
            if constexpr (kResidual)
                bulk_copy(dst + cols, static_cast<const T *>(L.residual.data) + prow * L.residual.row_strides[0], row_bytes,
                          full + s);
        }
        prow += gridDim.x;
    };
    for (int s = 0; s < stages; ++s) issue(s);

    A w[PACKS][VEC], b[kBias ? PACKS : 1][VEC];
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) w[k][j] = b[kBias ? k : 0][j] = A(0);
        if (k >= mine) continue;
        load_weight<T, VEC>(L, first + k * stride, w[k]);
        if constexpr (kBias) load_param<T, VEC>(L, L.bias.data, first + k * stride, A(-0.0), b[k]);
    }

    int s = 0, parity = 0;
    unsigned phases = 0;  // bit s: the parity of stage s's next phase
    for (int64_t row = blockIdx.x; row < L.rows; row += gridDim.x) {
        mbar_wait(full + s, (phases >> s) & 1u);
        phases ^= 1u << s;
        const T *xs = ring + (size_t)s * kTensors * cols;
        A v[PACKS][VEC];
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if constexpr (!kFull) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[k][j] = A(0);
            }
            if (k < mine) load_vec<T, VEC>(xs + first + k * stride, v[k]);
        }
        A shift = A(0);
        if (layer) shift = kResidual ? round_to<T>(to_float(xs[0]) + to_float(xs[cols])) : to_float(xs[0]);
        if constexpr (kResidual) {
            T *res_out = static_cast<T *>(L.residual_out.data) + row * L.residual_out.row_strides[0] + first;
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
                A add[VEC];
#pragma unroll
                for (int j = 0; j < VEC; ++j) add[j] = A(0);
                if (k < mine) load_vec<T, VEC>(xs + cols + first + k * stride, add);
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[k][j] = round_to<T>(v[k][j] + add[j]);
                if (k < mine) store_vec<T, VEC>(res_out + k * stride, v[k]);
            }
        }
        // The row's first group sum, then its stage refilled: every thread is past its reads.
        auto first_sum = [&](A (&sum)[1]) {
            warps_group_sum(sum, warps, [&] { return slot; }, buf[parity]);
            parity ^= 1;
            if (tpr == 32) __syncwarp();
            issue(s);
            s = s + 1 == stages ? 0 : s + 1;
        };
        auto then_sum = [&](A(&total)[1]) {
            warps_group_sum(total, warps, [&] { return slot; }, buf[parity]);
            parity ^= 1;
        };
        A mean, rstd;
        fwd_row_stats(v, mine, layer, shift, inv_n, eps, mean, rstd, first_sum, then_sum);
        if (t == 0) {
            if (L.mean.data) static_cast<A *>(L.mean.data)[row * L.mean.row_strides[0]] = mean;
            if (L.rstd.data) static_cast<A *>(L.rstd.data)[row * L.rstd.row_strides[0]] = rstd;
        }
        T *out = static_cast<T *>(L.out.data) + row * L.out.row_strides[0] + first;
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if (k >= mine) continue;
            A y[VEC];
            if (llama) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) y[j] = round_to<T>(v[k][j] * rstd) * w[k][j];
            } else {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    // + -0 without a bias: norm_fwd_kernel's v * rstd * w + b with b = -0, the same bits
                    // (x + -0 is x, -0 included)
                    if constexpr (kBias) y[j] = v[k][j] * rstd * w[k][j] + b[k][j];
                    else y[j] = v[k][j] * rstd * w[k][j] + A(-0.0);
                }
            }
            store_vec<T, VEC>(out + k * stride, y);
        }
    }
#else
    (void)L, (void)stages;
    __trap();  // launched only on sm_90 and later (norm_fwd_typed)
#endif
}

// ---- the flat forward: one row a group, lean ------------------------------------------------

constexpr int kFlatMaxThreads = 1024, kFlatMaxWarps = kFlatMaxThreads / 32, kFlatMinBlock = 128;

// The forward of 2-d launches (rows at one stride) of 16-byte packs, float32, float16 and
// bfloat16 (the float32 default up to 2048 columns; BRRR_NORM_FWD_KERNEL=flat): norm_fwd_kernel's
// arithmetic in its order (fwd_row_stats, group_sum's order), in a layout chosen for registers
// rather than for the fewest threads: a group of 2^tpr_log2 threads (32 to 1024) holds a row in at
// most 4 packs a thread (flat_config), 16 values or fewer at the common widths. The bookkeeping of
// norm_fwd_kernel (ncu: 33 instructions an element at 4096 bfloat16 columns) is gone: a row's
// addresses are row * stride (no unravelling of several row dims), the group sums unrolled with
// their slot computed once, no integer division. Block: max(group, 128) threads, the rows of a
// block consecutive; the grid walks row groups a grid apart past 2^30 blocks.
template <typename T, int PACKS, bool kResidual>
__global__ void __launch_bounds__(kFlatMaxThreads)
    norm_fwd_flat_kernel(const __grid_constant__ brrr_norm_launch L, const int tpr_log2) {
    using A = typename Compute<T>::type;
    constexpr int VEC = 16 / (int)sizeof(T);
    __shared__ A buf[2][1][kFlatMaxWarps];
    const int tpr = 1 << tpr_log2, groups = (int)blockDim.x >> tpr_log2, t = threadIdx.x & (tpr - 1);
    const int warps = tpr >= 32 ? tpr / 32 : 1, lane = threadIdx.x & 31;
    const int slot = (int)(threadIdx.x >> tpr_log2) * warps + (lane & (warps - 1));
    const int cols = (int)L.cols, first = t * VEC, stride = tpr * VEC;
    // 1 / cols rounded once, as A(1) / A(cols) is (without the division's slow path), and the
    // thread's packs in a row by comparisons: a block may hold one row, so this runs per row.
    const A inv_n = __frcp_rn(static_cast<A>(cols)), eps = static_cast<A>(L.eps);
    int packs_here = 0;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) packs_here += first + k * stride < cols ? 1 : 0;
    const bool layer = !L.rms;
    int parity = 0;
    for (int64_t base = (int64_t)blockIdx.x * groups; base < L.rows; base += (int64_t)gridDim.x * groups) {
        const int64_t row = base + (threadIdx.x >> tpr_log2);
        const bool active = row < L.rows;
        const int64_t at = active ? row : base;  // an in-range row for the address arithmetic
        const int mine = active ? packs_here : 0;
        const T *x = static_cast<const T *>(L.x.data) + at * L.x.row_strides[0] + first;
        const T *res = kResidual ? static_cast<const T *>(L.residual.data) + at * L.residual.row_strides[0] + first : nullptr;
        A v[PACKS][VEC];
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] = A(0);
            if (k < mine) load_vec<T, VEC>(x + k * stride, v[k]);
        }
        A shift = A(0);
        if (layer && active) shift = kResidual ? round_to<T>(to_float(x[-first]) + to_float(res[-first])) : to_float(x[-first]);
        if constexpr (kResidual) {
            T *res_out = static_cast<T *>(L.residual_out.data) + at * L.residual_out.row_strides[0] + first;
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
                A add[VEC];
#pragma unroll
                for (int j = 0; j < VEC; ++j) add[j] = A(0);
                if (k < mine) load_vec<T, VEC>(res + k * stride, add);
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[k][j] = round_to<T>(v[k][j] + add[j]);
                if (k < mine) store_vec<T, VEC>(res_out + k * stride, v[k]);
            }
        }
        A mean, rstd;
        auto sum = [&](A(&total)[1]) {
            warps_group_sum(total, warps, [&] { return slot; }, buf[parity]);
            parity ^= 1;
        };
        fwd_row_stats(v, mine, layer, shift, inv_n, eps, mean, rstd, sum, sum);
        if (!active) continue;
        if (t == 0) {
            if (L.mean.data) static_cast<A *>(L.mean.data)[row * L.mean.row_strides[0]] = mean;
            if (L.rstd.data) static_cast<A *>(L.rstd.data)[row * L.rstd.row_strides[0]] = rstd;
        }
        T *out = static_cast<T *>(L.out.data) + row * L.out.row_strides[0] + first;
        // A pack's weight and bias loaded before either is used (their latencies overlap), a
        // pack at a time (all of them at once spill at 64 registers).
        const bool llama = L.llama != 0;
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if (k >= mine) continue;
            A w[VEC], b[VEC];
            load_weight<T, VEC>(L, first + k * stride, w);
            load_param<T, VEC>(L, llama ? nullptr : L.bias.data, first + k * stride, A(-0.0), b);
            if (llama) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[k][j] = round_to<T>(v[k][j] * rstd) * w[j];
            } else {
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[k][j] = v[k][j] * rstd * w[j] + b[j];
            }
            store_vec<T, VEC>(out + k * stride, v[k]);  // the output in the pack's registers
        }
    }
}

// ---- backward: the terms every kernel shares ------------------------------------------------

__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// What the backward keeps of a row to rematerialise xhat = fma(x - shift, rstd, -mean * rstd)
// (RMSNorm: shift = mean = 0). Every backward kernel computes xhat and the weight and bias
// gradients' terms with these functions, written with explicit fma and no contractible
// products, so that those gradients' bits follow from the order of brrr_cuda.h alone.
template <typename A> struct RowStats {
    A shift, rstd, mean_rstd;
};
template <typename A> __device__ __forceinline__ RowStats<A> row_stats(bool layer, A shift, A mean, A rstd) {
    return {layer ? shift : A(0), rstd, layer ? mean * rstd : A(0)};
}
template <typename A> __device__ __forceinline__ A xhat_of(const RowStats<A> &s, A x) {
    return fma_rn(x - s.shift, s.rstd, -s.mean_rstd);
}
// grad_weight's running sum: acc + dy * xhat (Llama's order: xhat rounded to T first, as the
// forward multiplies it); grad_bias's is acc + dy.
template <typename T, typename A> __device__ __forceinline__ A add_dw(A acc, A dy, A xhat, bool llama) {
    return fma_rn(dy, llama ? round_to<T>(xhat) : xhat, acc);
}

// ---- backward: the fast path ----------------------------------------------------------------

constexpr int kBwdMaxThreads = 1024, kBwdMaxLanes = 8, kBwdMaxStages = 4;
// Elements a thread of the backward keeps xhat and g for between its passes (128 registers).
template <typename T> constexpr int bwd_max_elements(int vec) {
    return sizeof(typename Compute<T>::type) == 8 || vec == 1 ? 8 : 16;
}
// norm_bwd_bulk_kernel's wide rows: 4 packs of 8 halves a thread, nothing kept between the passes.
constexpr int kBwdWideElements = 32;
// A row's scalars in the ring, one slot per warp of a group: the saved mean and rstd, and x's
// first element (the shift, as T).
enum { kSlotMean, kSlotRstd, kSlotShift, kSlotSize = 4 };

// BYTES from global to shared memory: cp.async (4, 8 or 16 bytes; see copy_async_wait_for), or
// for 2 bytes a load and a store.
template <int BYTES> __device__ __forceinline__ void stage_copy(void *smem, const void *gmem) {
    if constexpr (BYTES == 16) {
        copy_async16(smem, gmem);
    } else if constexpr (BYTES == 8 || BYTES == 4) {
        const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(gmem), "n"(BYTES) : "memory");
    } else {
        static_assert(BYTES == 2, "stage_copy: 2, 4, 8 or 16 bytes");
        *static_cast<unsigned short *>(smem) = *static_cast<const unsigned short *>(gmem);
    }
}

// Waits until at most n (0..3) of this thread's committed copy groups are still in flight.
__device__ __forceinline__ void copy_async_wait_for(int n) {
    switch (n) {
    case 0: copy_async_wait<0>(); break;
    case 1: copy_async_wait<1>(); break;
    case 2: copy_async_wait<2>(); break;
    default: copy_async_wait<3>(); break;
    }
}

__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Sums v over the tpr threads of group g of the block (tpr a power of two up to 32, or a multiple
// of 32; the group's threads consecutive): a butterfly in each warp, then for more than one warp
// each warp's result through `slots` (per value, one per warp), the group's own barrier (1 + g:
// groups never wait for each other) and a second butterfly over the slots, zero-padded, that
// every warp runs alike. Every thread of the group gets the same bits. `slots` must differ from
// the previous call's, whose readers may still be at it.
template <typename A, int kN>
__device__ __forceinline__ void lane_group_sum(A (&v)[kN], int tpr, int g, A (*slots)[32]) {
    const int lane = threadIdx.x & 31;
    const unsigned mask = tpr >= 32 ? 0xffffffffu : ((1u << tpr) - 1u) << (lane & ~(tpr - 1));
    auto butterfly = [&](int width) {
        for (int off = width / 2; off > 0; off /= 2) {
#pragma unroll
            for (int i = 0; i < kN; ++i) v[i] += __shfl_xor_sync(mask, v[i], off);
        }
    };
    butterfly(tpr < 32 ? tpr : 32);
    if (tpr <= 32) return;
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < kN; ++i) slots[i][(threadIdx.x % tpr) / 32] = v[i];
    }
    named_barrier(1 + g, tpr);
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = lane < tpr / 32 ? slots[i][lane] : A(0);
    butterfly(32);
}

// The backward's shared memory, per group (lane) of the block: a ring of `stages` rows, each the
// group's x, dy (and grad_residual) packs, [tensors][PACKS][tpr][VEC] so that a thread's packs
// are 16-byte chunks next to its neighbours', then the rows' scalar slots; after every group's
// ring, the buffer where the lanes' weight/bias sums meet at a chunk's end, [n_grads][lanes][cols],
// and the weight in the compute type, unless weight_at is -1 (the kernel reads it from global
// memory: rows whose ring and weight copy do not fit together, see bwd_config).
// With it, the launch's chunk_rows (brrr_norm_chunk_rows: plain C, host only).
struct BwdLayout {
    int tpr, lanes, stages, tensors, slots_per_group;
    int slots_at, combine_at, weight_at, bytes;  // byte offsets in the block's shared memory, and its size
    int shift_word;                              // LayerNorm's shift copied as a 4-byte word (see issue)
    int split, split_cols;                       // blocks per row (a cluster), and rank 0's columns
    int64_t chunk_rows;
    template <typename T, typename A>
    static BwdLayout make(int tpr, int elements, int lanes, int stages, int tensors, int n_grads, int64_t cols,
                          bool weight_copy) {
        BwdLayout b{tpr, lanes, stages, tensors, tpr < 32 ? 1 : tpr / 32, 0, 0, 0, 0, 1, 1, (int)cols, 0};
        const int64_t ring = ((int64_t)lanes * stages * tensors * tpr * elements * (int64_t)sizeof(T) + 15) / 16 * 16;
        const int64_t slots = (int64_t)lanes * stages * b.slots_per_group * kSlotSize * (int64_t)sizeof(A);
        const int64_t combine = lanes > 1 ? ((int64_t)n_grads * lanes * cols * (int64_t)sizeof(A) + 15) / 16 * 16 : 0;
        const int64_t weight = weight_copy ? ((int64_t)tpr * elements * (int64_t)sizeof(A) + 15) / 16 * 16 : 0;  // the row's, padded
        const int64_t total = ring + slots + combine + weight;
        if (total > INT32_MAX) return b;  // bytes 0: does not fit
        b.slots_at = (int)ring;
        b.combine_at = (int)(ring + slots);
        b.weight_at = weight_copy ? (int)(ring + slots + combine) : -1;
        b.bytes = (int)total;
        return b;
    }
};

// The row sums (v: sum of g * xhat and of g) of a row split over the kSplit blocks of a cluster
// (sm_90), from each block's sums over its columns: each block stores its pair into every block
// of the cluster (xch: [rank][pair], this row's parity of a double buffer), and after one cluster
// barrier adds the pairs in rank order, the same bits in every block. The next row's stores go
// to the other buffer; the one after reuses this one only past the next barrier, which every
// block reaches after reading this row's pairs. The whole cluster calls it, every thread.
template <int kSplit, typename A> __device__ __forceinline__ void split_sum(A (&v)[2], A (*xch)[2], int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x < (unsigned)kSplit) {
        const unsigned remote = cluster_map(&xch[rank][0], threadIdx.x);
        cluster_store(remote, v[0]);
        cluster_store(remote + sizeof(A), v[1]);
    }
    cluster_sync();
    v[0] = xch[0][0];
    v[1] = xch[0][1];
#pragma unroll
    for (int r = 1; r < kSplit; ++r) {
        v[0] += xch[r][0];
        v[1] += xch[r][1];
    }
#else
    (void)v, (void)xch, (void)rank;
    __trap();  // never launched before sm_90 (bwd_config)
#endif
}

// The end of chunk c for a group of the backward's fast path: its threads' weight and bias
// gradient sums (dw, db: a thread's packs' columns, from col0 of the block's) go into the
// chunk's partial row, the lanes' sums added in lane order through `combine` (one lane: straight
// from registers), and start again from zero. The whole block calls it (barriers, lanes > 1).
template <int VEC, int PACKS, bool kBias, typename A>
__device__ __forceinline__ void flush_chunk_sums(A *part, bool want_dw, A (&dw)[PACKS * VEC], A (&db)[kBias ? PACKS * VEC : 1],
                                                 int c, int chunks, int cols, int col0, int lanes, int g, int mine,
                                                 int first, int stride, A *combine) {
    constexpr int E = PACKS * VEC;
    if (!want_dw && !kBias) return;
    const int n_grads = (int)want_dw + (int)kBias;
    auto put = [&](int q, const A *acc) {
        A *dst = lanes == 1 ? part + ((int64_t)q * chunks + c) * cols + col0 : combine + (q * lanes + g) * cols;
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if (k >= mine) continue;
#pragma unroll
            for (int j = 0; j < VEC; ++j) dst[first + k * stride + j] = acc[k * VEC + j];
        }
    };
    if (want_dw) put(0, dw);
    if constexpr (kBias) put(want_dw ? 1 : 0, db);
    if (lanes > 1) {
        __syncthreads();
        for (int i = threadIdx.x; i < n_grads * cols; i += blockDim.x) {
            const int q = i / cols, col = i - q * cols;
            const A *lane_sums = combine + (size_t)q * lanes * cols + col;
            A total = lane_sums[0];
            for (int l = 1; l < lanes; ++l) total += lane_sums[(size_t)l * cols];
            part[((int64_t)q * chunks + c) * cols + col] = total;
        }
        __syncthreads();  // the buffer is the next chunk's
    }
#pragma unroll
    for (int i = 0; i < E; ++i) dw[i] = A(0);
#pragma unroll
    for (int i = 0; i < (kBias ? E : 1); ++i) db[i] = A(0);
}

// The fast path: the forward's row layout (pack k of thread t of a group holds columns
// (k * tpr + t) * VEC + [0, VEC)), a block of `lanes` groups of tpr threads, group g being lane
// g of the summation order (brrr_cuda.h). The block walks the chunks c, c + n, ... (c: its
// cluster's index, n: the clusters; a block is a cluster of one without a split);
// a group takes its lane's rows of each in turn. They stream through the group's ring: each
// thread copies its own packs (cp.async) and reads back only those, so the ring needs no barrier
// (a warp's first thread copies the row's scalars, shared in the warp after a __syncwarp; the
// warp's next shuffle orders its reads before the slot is written again), and stages - 1 rows
// are in flight while the group works on one; with one stage it waits for each. The weight and
// bias gradients' sums of a thread's columns stay in registers; at a chunk's end the lanes meet
// in shared memory, added in lane order into the chunk's partial row (one lane: straight from
// registers). Per row: pass 1 converts x and dy, sums g * xhat and g (g = dy * w, w from a copy
// in shared memory in the compute type, or from global memory where that does not fit) and adds the thread's dw/db terms; one group sum; pass 2
// writes dx from xhat and g kept in registers (kThreads 512), or converted again from the ring
// (1024: kept, they spilled at 64 registers; ptxas, sm_90).
// kSplit 2 (sm_90, rows past 8192 columns, one lane): a cluster of two 512-thread blocks shares
// each row, block `rank` holding columns [col0, col0 + ncols) (rank 0: lay.split_cols), the row
// sums joined by split_sum; the weight and bias gradients' order is unchanged (each column is one
// block's). At 1024 threads a block, 64 registers, the float32 and bfloat16 kernels with a bias
// gradient spilled 168-188 bytes (ptxas, sm_90); these run at 512, with xhat and g kept.
// Assumes: cols % VEC == 0, ncols <= tpr * PACKS * VEC, rows and their offsets within 32 bits.
template <typename T, int VEC, int PACKS, bool kBias, int kThreads, int kSplit>
__global__ void __launch_bounds__(kThreads, 1)
    norm_bwd_kernel(const __grid_constant__ brrr_norm_launch L, const BwdLayout lay) {
    using A = typename Compute<T>::type;
    constexpr int E = PACKS * VEC;
    // 128 registers: xhat and g kept between the passes (not float64's in the split kernel, whose
    // cluster state spilled 8 bytes beside them; ptxas, sm_90)
    constexpr bool kKeep = kThreads <= 512 && !(kSplit > 1 && sizeof(A) == 8);
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ A red[2][kBwdMaxLanes][2][32];
    __shared__ A xch[2][kSplit][2];  // split_sum's buffers
    const int tpr = lay.tpr, lanes = lay.lanes, stages = lay.stages, tensors = lay.tensors;
    const int g = threadIdx.x / tpr, t = threadIdx.x % tpr, lane = threadIdx.x & 31;
    const int rank = kSplit > 1 ? (int)(blockIdx.x % kSplit) : 0, cluster = (int)(blockIdx.x / kSplit),
              clusters = (int)(gridDim.x / kSplit);
    const int cols = (int)L.cols, first = t * VEC, stride = tpr * VEC, row_elems = tpr * E;
    const int col0 = rank * lay.split_cols, ncols = kSplit > 1 && rank > 0 ? cols - col0 : (kSplit > 1 ? lay.split_cols : cols);
    const int mine = packs_in_row(true, ncols, first, stride);
    if constexpr (kSplit > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        cluster_sync();  // every block of the cluster runs before the first store into its memory
#endif
    }
    const bool layer = !L.rms, llama = L.llama != 0, want_dw = L.grad_weight.data != nullptr, has_gres = tensors == 3;
    const A inv_n = A(1) / static_cast<A>(cols);
    const int rows = (int)L.rows, chunk_rows = (int)lay.chunk_rows, chunks = (rows + chunk_rows - 1) / chunk_rows;
    T *const ring = reinterpret_cast<T *>(smem) + g * stages * tensors * row_elems;
    const bool leader = tpr >= 32 ? lane == 0 : t == 0;
    const unsigned warp_mask = tpr >= 32 ? 0xffffffffu : ((1u << tpr) - 1u) << (lane & ~(tpr - 1));
    A *const slots = reinterpret_cast<A *>(smem + lay.slots_at) +
                     (g * stages * lay.slots_per_group + (tpr >= 32 ? t / 32 : 0)) * kSlotSize;
    A *const combine = reinterpret_cast<A *>(smem + lay.combine_at);

    // The weight, in the compute type, for the whole block, where it fits beside the ring; else
    // each pass reads it from global memory (L2), the same values.
    const bool weight_copy = lay.weight_at >= 0;
    A *const wsh = reinterpret_cast<A *>(smem + (weight_copy ? lay.weight_at : 0));
    if (weight_copy) {
        for (int i = threadIdx.x; i < ncols; i += blockDim.x) load_weight<T, 1>(L, col0 + i, wsh + i);
        __syncthreads();
    }
    auto weight = [&](int at, A *w) {
        if constexpr (is_half<T>) load_vec<A, VEC>(wsh + at, w);  // the copy always fits (bwd_config)
        else if (weight_copy) load_vec<A, VEC>(wsh + at, w);
        else load_weight<T, VEC>(L, col0 + at, w);
    };

    // This group's rows, in order: lane g of the chunks `cluster`, + clusters, ... (a cluster of
    // one block without a split)
    int next_chunk = cluster, next = cluster * chunk_rows + g;
    auto chunk_end = [&](int c) { return c < chunks - 1 ? (c + 1) * chunk_rows : rows; };
    auto settle = [&]() {
        while (next_chunk < chunks && next >= chunk_end(next_chunk)) {
            next_chunk += clusters;
            next = next_chunk * chunk_rows + g;
        }
    };
    settle();
    // Copies the next row of the group (if any is left) into stage s, and commits a copy group.
    auto issue = [&](int s) {
        if (next_chunk < chunks) {
            const brrr_norm_view *const views[5] = {&L.x, &L.grad_out, &L.grad_residual, &L.rstd, &L.mean};
            int64_t off[5];
            row_offsets(L, next, views, off);
            T *dst = ring + s * tensors * row_elems + first;
#pragma unroll
            for (int q = 0; q < 3; ++q) {
                if (q == tensors) break;
                const T *src = static_cast<const T *>(views[q]->data) + off[q] + col0 + first;
#pragma unroll
                for (int k = 0; k < PACKS; ++k)
                    if (k < mine) stage_copy<(int)(VEC * sizeof(T))>(dst + k * stride, src + k * stride);
                dst += row_elems;
            }
            if (leader) {
                A *slot = slots + s * lay.slots_per_group * kSlotSize;
                stage_copy<(int)sizeof(A)>(slot + kSlotRstd, static_cast<const A *>(L.rstd.data) + off[3]);
                if (layer) {
                    stage_copy<(int)sizeof(A)>(slot + kSlotMean, static_cast<const A *>(L.mean.data) + off[4]);
                    // x's first element. A half's 2-byte copy is a load that the leader's warp
                    // waits for, a memory latency on every LayerNorm row: with 16-byte rows
                    // (VEC > 1) its 4-byte word goes by cp.async instead, the shift its first half
                    // (lay.shift_word, unless BRRR_NORM_BWD_SHIFT=load).
                    T *shift = reinterpret_cast<T *>(slot + kSlotShift);
                    const T *x0 = static_cast<const T *>(L.x.data) + off[0];
                    if constexpr (VEC > 1 && sizeof(T) == 2) {
                        if (lay.shift_word) stage_copy<4>(shift, x0);
                        else stage_copy<2>(shift, x0);
                    } else {
                        stage_copy<(int)sizeof(T)>(shift, x0);
                    }
                }
            }
            next += lanes;
            settle();
        }
        copy_async_commit();
    };

    A dw[E], db[kBias ? E : 1];
#pragma unroll
    for (int i = 0; i < E; ++i) dw[i] = A(0);
#pragma unroll
    for (int i = 0; i < (kBias ? E : 1); ++i) db[i] = A(0);
    for (int s = 0; s + 1 < stages; ++s) issue(s);
    int in = stages - 1, out = 0, parity = 0;
    for (int c = cluster; c < chunks; c += clusters) {
        for (int row = c * chunk_rows + g; row < chunk_end(c); row += lanes) {
            issue(in);
            in = in + 1 == stages ? 0 : in + 1;
            copy_async_wait_for(stages - 1);
            if (tpr >= 32) __syncwarp();  // the leader's copies of the scalars, for its warp
            else __syncwarp(warp_mask);
            const T *xs = ring + out * tensors * row_elems, *dys = xs + row_elems, *gs = dys + row_elems;
            const A *slot = slots + out * lay.slots_per_group * kSlotSize;
            out = out + 1 == stages ? 0 : out + 1;
            const RowStats<A> st = row_stats(layer, layer ? to_float(*reinterpret_cast<const T *>(slot + kSlotShift)) : A(0),
                                             layer ? slot[kSlotMean] : A(0), slot[kSlotRstd]);
            A sums[2] = {A(0), A(0)};  // of g * xhat and of g
            A xh[kKeep ? E : 1], gk[kKeep ? E : 1];
            // Pack k of the row's x and dy (from the ring) and of the weight, in the compute type.
            auto load_pack = [&](int k, A *xv, A *dv, A *w) {
                load_vec<T, VEC>(xs + first + k * stride, xv);
                load_vec<T, VEC>(dys + first + k * stride, dv);
                weight(first + k * stride, w);
            };
            // Pass 1, with Llama's rounding a template argument: as a runtime select the rounding
            // ran for every element, used or not.
            auto pass1 = [&](auto kLlama) {
#pragma unroll
                for (int k = 0; k < PACKS; ++k) {
                    if (k >= mine) continue;
                    A xv[VEC], dv[VEC], w[VEC];
                    load_pack(k, xv, dv, w);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const A xhat = xhat_of(st, xv[j]), gj = dv[j] * w[j];
                        sums[0] += gj * xhat;
                        sums[1] += gj;
                        if (want_dw) dw[k * VEC + j] = add_dw<T>(dw[k * VEC + j], dv[j], xhat, decltype(kLlama)::value);
                        if constexpr (kBias) db[k * VEC + j] += dv[j];
                        if constexpr (kKeep) {
                            xh[k * VEC + j] = xhat;
                            gk[k * VEC + j] = gj;
                        }
                    }
                }
            };
            if (llama) pass1(std::true_type());
            else pass1(std::false_type());
            lane_group_sum(sums, tpr, g, red[parity][g]);
            if constexpr (kSplit > 1) split_sum<kSplit>(sums, xch[parity], rank);
            parity ^= 1;
            // dx = rstd * (g - xhat * c1 - c2) [+ grad_residual], c1 = mean(g * xhat), c2 = mean(g) (LayerNorm)
            const A b1 = -(sums[0] * inv_n) * st.rstd, b2 = layer ? -(sums[1] * inv_n) * st.rstd : A(0);
            const brrr_norm_view *const dx_view[1] = {&L.grad_x};
            int64_t dx_off[1];
            row_offsets(L, row, dx_view, dx_off);
            T *dx = static_cast<T *>(L.grad_x.data) + dx_off[0] + col0 + first;
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
                if (k >= mine) continue;
                A xv[VEC], dv[VEC], extra[VEC], d[VEC];
                if constexpr (kKeep) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        xv[j] = xh[k * VEC + j];
                        dv[j] = gk[k * VEC + j];
                    }
                } else {
                    A w[VEC];
                    load_pack(k, xv, dv, w);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        xv[j] = xhat_of(st, xv[j]);
                        dv[j] *= w[j];
                    }
                }
#pragma unroll
                for (int j = 0; j < VEC; ++j) extra[j] = A(0);
                if (has_gres) load_vec<T, VEC>(gs + first + k * stride, extra);
#pragma unroll
                for (int j = 0; j < VEC; ++j) d[j] = fma_rn(dv[j], st.rstd, fma_rn(xv[j], b1, b2)) + extra[j];
                store_vec<T, VEC>(dx + k * stride, d);
            }
        }
        flush_chunk_sums<VEC, PACKS, kBias>(static_cast<A *>(L.partials), want_dw, dw, db, c, chunks, cols, col0, lanes, g, mine,
                                            first, stride, combine);
    }
}

// ---- backward: the bulk-copy kernel (BRRR_NORM_BWD_KERNEL=bulk, sm_90; the half default) ---
// norm_bwd_kernel spends more instructions a row on its bookkeeping than on the row's arithmetic
// (H200 ncu, bfloat16 layer_norm, 16384 x 4096: ~645 warp instructions a warp per row, 40 an
// element, of which the two passes are ~240 in the sm_90 SASS; 51 an element at 768 columns):
// every thread issues its own 16-byte cp.async per pack and tensor (each with three
// predicated-off LDS that ptxas puts beside an LDGSTS), the warp leaders copy the row's scalars
// with three more, and the group sum runs a second 5-level butterfly over the warps' partial
// sums, in loops of runtime width. norm_bwd_bulk_kernel keeps the row layout, the ring, the
// lanes and the order of the weight and bias gradients (the same bits as norm_bwd_kernel), and
// cuts the rest: a group's first thread copies each tensor's row with one cp.async.bulk
// (the row is contiguous, 16-byte aligned: the ring's layout is the row's), completing on an
// mbarrier per stage that the group's threads wait on; the row's rstd and mean are loaded into
// registers one row ahead, its shift read from the ring; the group sum is one unrolled butterfly
// a warp and, across the group's warps, every thread adding the warps' pairs in warp order.
// A stage is refilled only after the group's barrier in the next row's sum, which every thread
// of the group reaches after its last read of that stage (the previous row's grad_residual in
// pass 2), so the ring needs no release barrier. Assumes: sm_90, 2-d launch (row_ndim 1),
// 16-byte aligned rows, tpr a multiple of 32 (at most 512 with the lanes), stages >= 2, no split.
// Wide rows (kBwdWideElements a thread: half rows of 8193-16384 columns, one lane, whose two packs
// a thread would need 1024 threads) keep nothing between the passes: pass 2 reads x and dy back
// from the ring and recomputes xhat and g (the same bits); the weight's copy is made where it
// fits beside two stages of the ring, else the weight is read from global memory (L2).

// The row sums v (of g * xhat and of g) over a group of `warps` whole warps (group g of the
// block): a butterfly in each warp, each warp's pair into `slots` ([warp][2]), the group's
// barrier, then every thread adds the pairs in warp order (the same bits in every thread).
// `slots` must differ from the previous call's, whose readers may still be at it.
template <typename A>
__device__ __forceinline__ void warps_row_sum(A (&v)[2], int warps, int warp, int g, A *slots) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
        v[1] += __shfl_xor_sync(0xffffffffu, v[1], off);
    }
    if (warps == 1) return;
    if ((threadIdx.x & 31) == 0) {
        slots[2 * warp] = v[0];
        slots[2 * warp + 1] = v[1];
    }
    named_barrier(1 + g, warps * 32);
    v[0] = slots[0];
    v[1] = slots[1];
    for (int w = 1; w < warps; ++w) {
        v[0] += slots[2 * w];
        v[1] += slots[2 * w + 1];
    }
}

// kRefillOwn (bulk_bwd_kernel: rings of two stages of two rows): a stage is refilled with the
// row `stages` on as soon as the group is past its last read of it (past the row's sum where
// pass 2 reads only registers, else past a barrier after pass 2), where otherwise the previous
// row's stage is refilled past the next row's sum: with two stages the next row is in flight
// through a whole row's work instead of through pass 2 only. The same bits either way.
template <typename T, int VEC, int PACKS, bool kBias, bool kRefillOwn>
__global__ void __launch_bounds__(512, 1)
    norm_bwd_bulk_kernel(const __grid_constant__ brrr_norm_launch L, const BwdLayout lay) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using A = typename Compute<T>::type;
    constexpr int E = PACKS * VEC;
    constexpr bool kWide = E > bwd_max_elements<T>(VEC);  // xhat and g not kept between the passes
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ A red[2][kBwdMaxLanes][32];  // per group: [warp][2], warps <= 16
    const int tpr = lay.tpr, lanes = lay.lanes, stages = lay.stages, tensors = lay.tensors;
    const int g = threadIdx.x / tpr, t = threadIdx.x % tpr, warps = tpr / 32;
    const int cols = (int)L.cols, first = t * VEC, stride = tpr * VEC, row_elems = tpr * E;
    const int mine = packs_in_row(true, cols, first, stride);
    const bool layer = !L.rms, llama = L.llama != 0, want_dw = L.grad_weight.data != nullptr, has_gres = tensors == 3;
    const A inv_n = A(1) / static_cast<A>(cols);
    const int rows = (int)L.rows, chunk_rows = (int)lay.chunk_rows, chunks = (rows + chunk_rows - 1) / chunk_rows;
    const unsigned row_bytes = (unsigned)cols * (unsigned)sizeof(T);
    T *const ring = reinterpret_cast<T *>(smem) + g * stages * tensors * row_elems;
    uint64_t *const full = reinterpret_cast<uint64_t *>(smem + lay.slots_at) + g * stages;  // in the slots' room
    A *const combine = reinterpret_cast<A *>(smem + lay.combine_at);
    const bool producer = t == 0;
    if (producer) {
        for (int s = 0; s < stages; ++s) mbar_init(full + s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // A group's rows in order: lane g of the chunks blockIdx.x, + gridDim.x, ...; settle moves
    // (c, r) past the chunks where the lane has no row left.
    auto chunk_end = [&](int c) { return c < chunks - 1 ? (c + 1) * chunk_rows : rows; };
    auto settle = [&](int &c, int &r) {
        while (c < chunks && r >= chunk_end(c)) {
            c += gridDim.x;
            r = c * chunk_rows + g;
        }
    };
    // The producer's cursor: the next row to copy, into stage s (one copy a tensor, completing
    // on the stage's barrier); every thread of the group keeps it alike.
    int pc = blockIdx.x, prow = pc * chunk_rows + g;
    settle(pc, prow);
    auto issue = [&](int s) {
        if (pc >= chunks) return;
        if (producer) {
            T *dst = ring + s * tensors * row_elems;
            mbar_expect(full + s, row_bytes * (unsigned)tensors);
            bulk_copy(dst, static_cast<const T *>(L.x.data) + (int64_t)prow * L.x.row_strides[0], row_bytes, full + s);
            bulk_copy(dst + row_elems, static_cast<const T *>(L.grad_out.data) + (int64_t)prow * L.grad_out.row_strides[0],
                      row_bytes, full + s);
            if (has_gres)
                bulk_copy(dst + 2 * row_elems,
                          static_cast<const T *>(L.grad_residual.data) + (int64_t)prow * L.grad_residual.row_strides[0],
                          row_bytes, full + s);
        }
        prow += lanes;
        settle(pc, prow);
    };
    for (int s = 0; s + (kRefillOwn ? 0 : 1) < stages; ++s) issue(s);

    // The weight, in the compute type, for the whole block (copied while the first rows load),
    // where it fits beside the ring; else each pass reads it from global memory (L2).
    const bool weight_copy = lay.weight_at >= 0;
    A *const wsh = reinterpret_cast<A *>(smem + (weight_copy ? lay.weight_at : 0));
    if (weight_copy) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) load_weight<T, 1>(L, i, wsh + i);
        __syncthreads();
    }
    auto weight = [&](int at, A *w) {
        if constexpr (is_half<T> && !kWide) load_vec<A, VEC>(wsh + at, w);  // the copy always fits (bwd_config)
        else if (weight_copy) load_vec<A, VEC>(wsh + at, w);
        else load_weight<T, VEC>(L, at, w);
    };

    // rstd and mean of the group's rows, loaded one row ahead.
    const A *const rstd_p = static_cast<const A *>(L.rstd.data), *const mean_p = static_cast<const A *>(L.mean.data);
    const int64_t rstd_s = L.rstd.row_strides[0], mean_s = layer ? L.mean.row_strides[0] : 0;
    A rstd_next = A(0), mean_next = A(0);
    auto prefetch = [&](int c, int r) {
        settle(c, r);
        if (c >= chunks) return;
        rstd_next = rstd_p[(int64_t)r * rstd_s];
        if (layer) mean_next = mean_p[(int64_t)r * mean_s];
    };
    prefetch(blockIdx.x, (int)blockIdx.x * chunk_rows + g);

    A dw[E], db[kBias ? E : 1];
#pragma unroll
    for (int i = 0; i < E; ++i) dw[i] = A(0);
#pragma unroll
    for (int i = 0; i < (kBias ? E : 1); ++i) db[i] = A(0);
    int in = kRefillOwn ? 0 : stages - 1, out = 0, parity = 0;
    const bool late_reads = kWide || has_gres;  // pass 2 reads the row's stage
    auto refill = [&]() {
        issue(in);
        in = in + 1 == stages ? 0 : in + 1;
    };
    unsigned phases = 0;  // bit s: the parity of stage s's next phase
    for (int c = blockIdx.x; c < chunks; c += gridDim.x) {
        for (int row = c * chunk_rows + g; row < chunk_end(c); row += lanes) {
            const A rstd = rstd_next, mean = mean_next;
            prefetch(c, row + lanes);
            mbar_wait(full + out, (phases >> out) & 1u);
            phases ^= 1u << out;
            const T *xs = ring + out * tensors * row_elems, *dys = xs + row_elems, *gs = dys + row_elems;
            out = out + 1 == stages ? 0 : out + 1;
            const RowStats<A> st = row_stats(layer, layer ? to_float(xs[0]) : A(0), mean, rstd);
            A sums[2] = {A(0), A(0)};  // of g * xhat and of g (LayerNorm)
            A xh[kWide ? 1 : E], gk[kWide ? 1 : E];
            auto load_pack = [&](int k, A *xv, A *dv, A *w) {  // as norm_bwd_kernel's
                load_vec<T, VEC>(xs + first + k * stride, xv);
                load_vec<T, VEC>(dys + first + k * stride, dv);
                weight(first + k * stride, w);
            };
            // Pass 1 in three forms (runtime selects of per-element work cost instructions): Llama's
            // rounding, and RMSNorm's xhat = x * rstd, the bits of xhat_of with no shift and no
            // mean (x - 0 = x, fma(x, rstd, -0) = x * rstd rounded), without the sum of g.
            auto pass1 = [&](auto kLlama, auto kLayer) {
                constexpr bool kLayerNorm = decltype(kLayer)::value;
#pragma unroll
                for (int k = 0; k < PACKS; ++k) {
                    if (k >= mine) continue;
                    A xv[VEC], dv[VEC], w[VEC];
                    load_pack(k, xv, dv, w);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const A xhat = kLayerNorm ? xhat_of(st, xv[j]) : mul_rn(xv[j], st.rstd), gj = dv[j] * w[j];
                        sums[0] += gj * xhat;
                        if constexpr (kLayerNorm) sums[1] += gj;
                        if (want_dw) dw[k * VEC + j] = add_dw<T>(dw[k * VEC + j], dv[j], xhat, decltype(kLlama)::value);
                        if constexpr (kBias) db[k * VEC + j] += dv[j];
                        if constexpr (!kWide) {
                            xh[k * VEC + j] = xhat;
                            gk[k * VEC + j] = gj;
                        }
                    }
                }
            };
            if (layer) pass1(std::false_type(), std::true_type());
            else if (llama) pass1(std::true_type(), std::false_type());
            else pass1(std::false_type(), std::false_type());
            warps_row_sum(sums, warps, t / 32, g, red[parity][g]);
            parity ^= 1;
            // Every thread of the group is past its reads of the previous row's stage (kRefillOwn:
            // of this row's, unless pass 2 reads it): refill it.
            if (!kRefillOwn || !late_reads) {
                if (warps == 1) __syncwarp();
                refill();
            }
            // dx = rstd * (g - xhat * c1 - c2) [+ grad_residual], c1 = mean(g * xhat), c2 = mean(g) (LayerNorm)
            const A b1 = -(sums[0] * inv_n) * st.rstd, b2 = layer ? -(sums[1] * inv_n) * st.rstd : A(0);
            T *dx = static_cast<T *>(L.grad_x.data) + (int64_t)row * L.grad_x.row_strides[0] + first;
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
                if (k >= mine) continue;
                A d[VEC];
                if constexpr (kWide) {
                    A xv[VEC], dv[VEC], w[VEC];
                    load_pack(k, xv, dv, w);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const A xhat = layer ? xhat_of(st, xv[j]) : mul_rn(xv[j], st.rstd);
                        d[j] = fma_rn(dv[j] * w[j], st.rstd, fma_rn(xhat, b1, b2));
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) d[j] = fma_rn(gk[k * VEC + j], st.rstd, fma_rn(xh[k * VEC + j], b1, b2));
                }
                if (has_gres) {
                    A extra[VEC];
                    load_vec<T, VEC>(gs + first + k * stride, extra);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) d[j] += extra[j];
                }
                store_vec<T, VEC>(dx + k * stride, d);
            }
            if (kRefillOwn && late_reads) {  // the group past its pass 2 reads of this row's stage
                if (warps == 1) __syncwarp();
                else named_barrier(1 + g, warps * 32);
                refill();
            }
        }
        flush_chunk_sums<VEC, PACKS, kBias>(static_cast<A *>(L.partials), want_dw, dw, db, c, chunks, cols, 0, lanes, g, mine, first,
                                            stride, combine);
    }
#else
    (void)L, (void)lay;
    __trap();  // launched only on sm_90 and later (norm_bwd_typed)
#endif
}

// ---- generic path: any strides, any row length ---------------------------------------------

template <typename A> struct Moments {
    A n, mean, m2;  // count, mean, sum of squared deviations
};

template <typename A> __device__ __forceinline__ Moments<A> merge(const Moments<A> &a, const Moments<A> &b) {
    if (b.n == A(0)) return a;
    if (a.n == A(0)) return b;
    const A n = a.n + b.n, delta = b.mean - a.mean, fb = b.n / n;
    return {n, a.mean + delta * fb, a.m2 + b.m2 + delta * delta * a.n * fb};
}

// Chan's merge over the block in a fixed tree; every thread gets thread 0's result.
template <typename A>
__device__ __forceinline__ Moments<A> block_moments(Moments<A> m, Moments<A> *buf, Moments<A> *result) {
    const int lane = threadIdx.x & 31;
    for (int off = 16; off > 0; off /= 2) {
        const Moments<A> o = {__shfl_down_sync(0xffffffffu, m.n, off), __shfl_down_sync(0xffffffffu, m.mean, off),
                              __shfl_down_sync(0xffffffffu, m.m2, off)};
        if (lane + off < 32) m = merge(m, o);
    }
    if (lane == 0) buf[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        Moments<A> total = buf[0];
        for (int w = 1; w < (int)(blockDim.x / 32); ++w) total = merge(total, buf[w]);
        *result = total;
    }
    __syncthreads();
    return *result;
}

template <typename T>
__global__ void __launch_bounds__(kGenericThreads) norm_fwd_generic_kernel(const __grid_constant__ brrr_norm_launch L) {
    using A = typename Compute<T>::type;
    __shared__ Moments<A> buf[kGenericWarps];
    __shared__ Moments<A> result;
    __shared__ A sum_buf[2][1][kMaxWarps];
    const int64_t cols = L.cols;
    const A n = static_cast<A>(cols), eps = static_cast<A>(L.eps);
    const bool layer = !L.rms;
    int parity = 0;
    for (int64_t row = blockIdx.x; row < L.rows; row += gridDim.x) {
        const T *x = row_in<T>(L, L.x, row), *res = row_in<T>(L, L.residual, row);
        T *res_out = row_out<T>(L, L.residual_out, row), *out = row_out<T>(L, L.out, row);
        A shift = A(0);
        if (layer) shift = res ? round_to<T>(to_float(x[0]) + to_float(res[0])) : to_float(x[0]);
        // Pass 1: the residual sum is stored; per-thread sums of (h - shift), themselves shifted by
        // the thread's first value, then merged (LayerNorm), or the sum of squares (RMSNorm).
        A count = A(0), first = A(0), s1 = A(0), s2 = A(0);
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
            A h = to_float(x[col_offset(L, L.x, j)]);
            if (res) {
                h = round_to<T>(h + to_float(res[col_offset(L, L.residual, j)]));
                res_out[col_offset(L, L.residual_out, j)] = to_storage<T, A>(h);
            }
            if (layer) {
                const A d = h - shift;
                if (count == A(0)) first = d;
                s1 += d - first;
                s2 += (d - first) * (d - first);
            } else {
                s1 += h * h;
            }
            count += A(1);
        }
        A mean = A(0), rstd;
        if (layer) {
            Moments<A> m = {count, A(0), A(0)};
            if (count > A(0)) {
                m.mean = first + s1 / count;
                const A m2 = s2 - s1 * (s1 / count);
                m.m2 = m2 > A(0) ? m2 : A(0);
            }
            m = block_moments(m, buf, &result);
            mean = m.mean;
            rstd = rsqrt_of(m.m2 / n + eps);
        } else {
            A s[1] = {s1};
            group_sum(s, blockDim.x, sum_buf[parity]);
            parity ^= 1;
            rstd = rsqrt_of(s[0] / n + eps);
        }
        if (threadIdx.x == 0) {
            if (L.mean.data) static_cast<A *>(L.mean.data)[row_offset(L, L.mean, row)] = mean;
            if (L.rstd.data) static_cast<A *>(L.rstd.data)[row_offset(L, L.rstd, row)] = rstd;
        }
        // Pass 2 (the same thread reads back the residual sum it stored).
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
            const A h = res ? to_float(res_out[col_offset(L, L.residual_out, j)]) : to_float(x[col_offset(L, L.x, j)]);
            A w, b;
            load_weight<T, 1>(L, col_offset(L, L.weight, j), &w);
            load_param<T, 1>(L, L.bias.data, col_offset(L, L.bias, j), A(-0.0), &b);
            const A xhat = (layer ? h - shift - mean : h) * rstd;
            out[col_offset(L, L.out, j)] = to_storage<T, A>(L.llama ? round_to<T>(xhat) * w : xhat * w + b);
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(kGenericThreads) norm_bwd_dx_generic_kernel(const __grid_constant__ brrr_norm_launch L) {
    using A = typename Compute<T>::type;
    __shared__ A buf[2][2][kMaxWarps];
    const int64_t cols = L.cols;
    const A n = static_cast<A>(cols);
    const bool layer = !L.rms;
    int parity = 0;
    for (int64_t row = blockIdx.x; row < L.rows; row += gridDim.x) {
        const T *x = row_in<T>(L, L.x, row), *dy = row_in<T>(L, L.grad_out, row), *gres = row_in<T>(L, L.grad_residual, row);
        T *dx = row_out<T>(L, L.grad_x, row);
        const A rstd = static_cast<const A *>(L.rstd.data)[row_offset(L, L.rstd, row)];
        const RowStats<A> st = row_stats(layer, layer ? to_float(x[0]) : A(0),
                                         layer ? static_cast<const A *>(L.mean.data)[row_offset(L, L.mean, row)] : A(0), rstd);
        auto element = [&](int64_t j, A *xhat, A *g) {
            A w;
            load_weight<T, 1>(L, col_offset(L, L.weight, j), &w);
            *xhat = xhat_of(st, to_float(x[col_offset(L, L.x, j)]));
            *g = to_float(dy[col_offset(L, L.grad_out, j)]) * w;
        };
        A s[2] = {A(0), A(0)};
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
            A xhat, g;
            element(j, &xhat, &g);
            s[0] += g * xhat;
            s[1] += g;
        }
        group_sum(s, blockDim.x, buf[parity]);
        parity ^= 1;
        const A c1 = s[0] / n, c2 = layer ? s[1] / n : A(0);
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
            A xhat, g;
            element(j, &xhat, &g);
            const A extra = gres ? to_float(gres[col_offset(L, L.grad_residual, j)]) : A(0);
            dx[col_offset(L, L.grad_x, j)] = to_storage<T, A>(rstd * (g - xhat * c1 - c2) + extra);
        }
    }
}

// dw/db of one chunk (blockIdx.y) for 32 columns (blockIdx.x), in the order of brrr_cuda.h:
// thread (x, y) sums column x's terms over the rows of lane y (blockDim.y = the lanes), then the
// lanes are added in lane order, the same bits as norm_bwd_kernel's.
template <typename T>
__global__ void __launch_bounds__(kTileCols *kBwdMaxLanes)
    norm_bwd_dwdb_generic_kernel(const __grid_constant__ brrr_norm_launch L, const int64_t chunk_rows) {
    using A = typename Compute<T>::type;
    __shared__ A lane_sums[2][kBwdMaxLanes][kTileCols];
    const int lanes = blockDim.y;
    const int64_t col = (int64_t)blockIdx.x * kTileCols + threadIdx.x, chunk = blockIdx.y;
    const int64_t chunks = (L.rows + chunk_rows - 1) / chunk_rows;
    const int64_t begin = chunk * chunk_rows, end = begin + chunk_rows < L.rows ? begin + chunk_rows : L.rows;
    const bool active = col < L.cols, layer = !L.rms;
    A dw = A(0), db = A(0);
    for (int64_t r = begin + threadIdx.y; active && r < end; r += lanes) {
        const T *x = row_in<T>(L, L.x, r), *dy = row_in<T>(L, L.grad_out, r);
        const RowStats<A> st = row_stats(layer, layer ? to_float(x[0]) : A(0),
                                         layer ? static_cast<const A *>(L.mean.data)[row_offset(L, L.mean, r)] : A(0),
                                         static_cast<const A *>(L.rstd.data)[row_offset(L, L.rstd, r)]);
        const A xhat = xhat_of(st, to_float(x[col_offset(L, L.x, col)]));
        const A d = to_float(dy[col_offset(L, L.grad_out, col)]);
        dw = add_dw<T>(dw, d, xhat, L.llama != 0);
        db += d;
    }
    lane_sums[0][threadIdx.y][threadIdx.x] = dw;
    lane_sums[1][threadIdx.y][threadIdx.x] = db;
    __syncthreads();
    if (threadIdx.y != 0 || !active) return;
    dw = lane_sums[0][0][threadIdx.x];
    db = lane_sums[1][0][threadIdx.x];
    for (int lane = 1; lane < lanes; ++lane) {
        dw += lane_sums[0][lane][threadIdx.x];
        db += lane_sums[1][lane][threadIdx.x];
    }
    A *part = static_cast<A *>(L.partials);
    int q = 0;
    if (L.grad_weight.data) part[((int64_t)q++ * chunks + chunk) * L.cols + col] = dw;
    if (L.grad_bias.data) part[((int64_t)q * chunks + chunk) * L.cols + col] = db;
}

// grad[c] = sum over the partial rows p < parts, in order, of partials[q][p][c]; blockIdx.y
// picks grad_weight (0) or grad_bias (1). parts == 0 (no rows) writes zeros. Thread (x, y) adds
// partial rows y, y + kFinalLanes, ... in turn. (Loading 8 partial rows before adding them made no
// difference on an H200 at 768-16384 columns.)
template <typename T>
__global__ void __launch_bounds__(kFinalCols *kFinalLanes)
    norm_finalize_kernel(const __grid_constant__ brrr_norm_launch L, const int64_t parts) {
    using A = typename Compute<T>::type;
    __shared__ A lanes[kFinalLanes][kFinalCols];
    const bool bias = blockIdx.y == 1;
    const brrr_norm_view &grad = bias ? L.grad_bias : L.grad_weight;
    if (grad.data == nullptr) return;
    const int q = bias && L.grad_weight.data ? 1 : 0;
    const int64_t col = (int64_t)blockIdx.x * kFinalCols + threadIdx.x;
    const A *part = static_cast<const A *>(L.partials) + (int64_t)q * parts * L.cols;
    A s = A(0);
    for (int64_t p = threadIdx.y; col < L.cols && p < parts; p += kFinalLanes) s += part[p * L.cols + col];
    lanes[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y != 0 || col >= L.cols) return;
    A total = lanes[0][threadIdx.x];
    for (int lane = 1; lane < kFinalLanes; ++lane) total += lanes[lane][threadIdx.x];
    store_param<T>(L, grad.data, col_offset(L, grad, col), total);
}

// ---- launchers ------------------------------------------------------------------------------

struct RowConfig {
    int vec, tpr, packs, block;
};

template <typename T> constexpr int vec_width() { return 16 / (int)sizeof(T); }
// Row elements a thread holds in registers (per tensor it keeps): 32 floats with 16-byte packs,
// half that with single-element accesses (each needing its own address); 8 doubles.
template <typename T> constexpr int max_elements(int vec) {
    return sizeof(typename Compute<T>::type) == 8 ? 8 : (vec > 1 ? 32 : 16);
}

// The PACKS compiled for (T, VEC): for 16-byte packs 1, 2, 3, 4, 6, 8 (rows of 3 * 2^k packs
// fill their threads), for single elements the powers of two; at most max_elements per thread.
template <typename T, int VEC> constexpr bool packs_compiled(int p) {
    if (p == 5) return VEC == 8;  // 2-byte types only: see kHalfFivePacks
    if (p * VEC > max_elements<T>(VEC)) return false;
    if (VEC > 1) return p == 1 || p == 2 || p == 3 || p == 4 || p == 6 || p == 8;
    return (p & (p - 1)) == 0;
}

static inline int round_packs(int p, bool vector) {
    if (vector) return p <= 4 ? p : (p <= 6 ? 6 : 8);
    int q = 1;
    while (q < p) q *= 2;
    return q;
}

static inline bool rows_aligned(const brrr_norm_launch &L, const brrr_norm_view &v, int64_t element_size) {
    if (v.data == nullptr) return true;
    if (!aligned16(v.data)) return false;
    for (int d = 0; d < L.row_ndim; ++d)
        if (v.row_strides[d] * element_size % 16 != 0) return false;
    return true;
}

// kHalfFivePacks: float16 and bfloat16 rows of 513-640 packs of 8 (4104-5120 columns; likewise
// 65-80 packs from 520 columns, 129-160 from 1032, 257-320 from 2056, 1025-1280 from 8200) fall
// just past the 4 packs a thread of a power-of-two group holds at most: the group doubles and
// each thread holds 2 or 3 packs
// (40 bytes of a 5120-column row, against 64 at 4096 and 8192 columns), with twice the warps in
// each row's two reductions; bf16 layer_norm's forward ran at 59% of the floor at 5120 columns
// against 71-72% at 4096 and 8192 (H200). BRRR_NORM_FWD_PACKS=five (unset) takes 5 packs a thread
// over half the group instead; =pow2 keeps the doubled group. norm_fwd_bulk_kernel, where it runs,
// takes the doubled group either way (fwd_bulk_launch).
static bool half_five_packs() {
    const char *v = getenv("BRRR_NORM_FWD_PACKS");
    return !(v && strcmp(v, "pow2") == 0);
}

// BRRR_NORM_FWD_VALUES=16 (docs/kernel-switches.md), for measuring: float16 and bfloat16 rows of
// 16-byte packs at 2 packs (16 values) a thread where 512 threads hold them, twice the threads
// of the default's 4 packs (32 values): fewer registers a thread (in norm_fwd_bulk_kernel the
// weight and bias held for 32 values take 127 registers, 25% occupancy on an H100 at 4096
// columns, where Liger-Kernel's 16 values a thread run at 59%), more warps in a row's sums.
// Unset or 32: the default. The same function; the sums group the elements otherwise.
static int half_fwd_values() {
    const char *v = getenv("BRRR_NORM_FWD_VALUES");
    return v && strcmp(v, "16") == 0 ? 16 : 32;
}

// Whether the forward's rows go in 16-byte packs: whole packs a row, every row and parameter aligned.
template <typename T>
static bool packs_fit(const brrr_norm_launch &L) {
    const brrr_norm_view *const views[] = {&L.x, &L.residual, &L.out, &L.residual_out};
    bool vector = L.cols % vec_width<T>() == 0 && (L.weight.data == nullptr || aligned16(L.weight.data)) &&
                  (L.bias.data == nullptr || aligned16(L.bias.data));
    for (int i = 0; i < 4; ++i) vector = vector && rows_aligned(L, *views[i], (int64_t)sizeof(T));
    return vector;
}

// The forward's fast path for this launch, or false when it does not apply (strided columns, or
// a row longer than 512 threads can hold): a row gets the fewest threads (32 and up) that hold it.
template <typename T>
static bool row_config(const brrr_norm_launch &L, RowConfig *cfg) {
    if (!L.contiguous_cols || (L.row_ndim > 1 && L.rows > INT32_MAX)) return false;  // see row_offsets
    const bool vector = packs_fit<T>(L);
    const int vec = vector ? vec_width<T>() : 1;
    const int64_t packs_total = (L.cols + vec - 1) / vec;
    int max_packs = max_elements<T>(vec) / vec;
    if (vec == 8 && packs_total <= 2 * kMaxRowThreads && half_fwd_values() == 16) max_packs = 2;
    int tpr = 1, packs = 1;
    if (packs_total <= 32) {
        while (tpr < packs_total) tpr *= 2;
    } else {
        tpr = 32;
        while ((int64_t)tpr * max_packs < packs_total && tpr < kMaxRowThreads) tpr *= 2;
        if ((int64_t)tpr * max_packs < packs_total) return false;
        packs = round_packs((int)((packs_total + tpr - 1) / tpr), vector);
    }
    if (vec == 8 && packs == 3 && (int64_t)(tpr / 2) * 5 >= packs_total && half_five_packs()) {
        tpr /= 2;  // 5 packs a thread over half the threads (kHalfFivePacks); tpr <= 256, so blocks of 256
        packs = 5;
    }
    *cfg = {vec, tpr, packs, tpr > kMinBlockThreads ? tpr : kMinBlockThreads};
    return true;
}

template <typename T, int VEC, int P, typename F> static cudaError_t call_compiled(F &f) {
    if constexpr (packs_compiled<T, VEC>(P))
        return f(std::integral_constant<int, VEC>(), std::integral_constant<int, P>());
    else
        return cudaErrorInvalidValue;
}

template <typename T, int VEC, typename F> static cudaError_t with_packs(int packs, F &f) {
    switch (packs) {
    case 1: return call_compiled<T, VEC, 1>(f);
    case 2: return call_compiled<T, VEC, 2>(f);
    case 3: return call_compiled<T, VEC, 3>(f);
    case 4: return call_compiled<T, VEC, 4>(f);
    case 5: return call_compiled<T, VEC, 5>(f);
    case 6: return call_compiled<T, VEC, 6>(f);
    case 8: return call_compiled<T, VEC, 8>(f);
    case 16: return call_compiled<T, VEC, 16>(f);
    case 32: return call_compiled<T, VEC, 32>(f);
    default: return cudaErrorInvalidValue;
    }
}

// Calls f(integral_constant VEC, integral_constant PACKS) for the compiled instance of cfg.
template <typename T, typename F> static cudaError_t with_row_config(const RowConfig &cfg, F f) {
    return cfg.vec > 1 ? with_packs<T, vec_width<T>()>(cfg.packs, f) : with_packs<T, 1>(cfg.packs, f);
}

// Calls go(integral_constant PACKS) for packs from 1 to 4 (the bulk and flat forwards' instances);
// `otherwise` for any other count.
template <typename F> static cudaError_t with_packs_up_to_4(int packs, F go, cudaError_t otherwise) {
    switch (packs) {
    case 1: return go(std::integral_constant<int, 1>());
    case 2: return go(std::integral_constant<int, 2>());
    case 3: return go(std::integral_constant<int, 3>());
    case 4: return go(std::integral_constant<int, 4>());
    default: return otherwise;
    }
}

static inline unsigned generic_grid(int64_t rows, int device) {
    const int64_t cap = (int64_t)sm_count(device) * 16;
    return (unsigned)(rows < cap ? rows : cap);
}

constexpr int64_t kMaxGrid = (int64_t)1 << 30;

// Resident blocks per SM of a row kernel at this block size and dynamic shared memory, with its
// dynamic shared-memory limit raised to match. Both runtime calls cost host time on every launch
// (a transformer's norms are host-bound), and their answer depends only on these four values, so
// it is kept (in one table for all the kernels: they share a type), guarded for the threads that
// call brrr._C with the GIL released.
template <typename Kernel>
static cudaError_t blocks_per_sm(Kernel kernel, int block, size_t smem, int device, int *per_sm) {
    struct Entry {
        const void *kernel;
        int block, device;
        size_t smem;
        int per_sm;
    };
    static std::mutex mutex;
    static Entry table[64];
    static int used = 0;
    std::lock_guard<std::mutex> lock(mutex);
    size_t limit = smem;  // the kernel's limit only grows: a launch found here may need more than this one
    for (int i = 0; i < used; ++i) {
        if (table[i].kernel != (const void *)kernel || table[i].device != device) continue;
        if (table[i].block == block && table[i].smem == smem) {
            *per_sm = table[i].per_sm;
            return cudaSuccess;
        }
        if (table[i].smem > limit) limit = table[i].smem;
    }
    // Always raise the dynamic limit: the kernel's static shared memory counts against the
    // default 48 KB too, so a test on smem alone let 48 KB of dynamic memory fail to launch.
    cudaError_t e = cudaSuccess;
    if (limit > 0) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)limit);
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, block, smem);
    if (e == cudaSuccess && used < 64) table[used++] = {(const void *)kernel, block, device, smem, *per_sm};
    return e;
}

// Clusters of a launch's cluster size that run at once: the blocks of a cluster share a GPC, so
// this can be fewer than blocks_per_sm * SMs / size (a wave of clusters past it doubles a
// kernel's time). Kept like blocks_per_sm, for the same reason, by cluster size too (a kernel
// launched on clusters of two sizes would otherwise read the other size's answer).
template <typename Kernel>
static cudaError_t clusters_resident(Kernel kernel, cudaLaunchConfig_t cfg, int device, int *clusters) {
    struct Entry {
        const void *kernel;
        int block, device, size;
        size_t smem;
        int clusters;
    };
    static std::mutex mutex;
    static Entry table[32];
    static int used = 0;
    std::lock_guard<std::mutex> lock(mutex);
    const int block = (int)cfg.blockDim.x, size = (int)cfg.attrs[0].val.clusterDim.x;
    for (int i = 0; i < used; ++i) {
        if (table[i].kernel == (const void *)kernel && table[i].device == device && table[i].block == block &&
            table[i].size == size && table[i].smem == cfg.dynamicSmemBytes) {
            *clusters = table[i].clusters;
            return cudaSuccess;
        }
    }
    cfg.gridDim = dim3((unsigned)size);  // one cluster: the query reads its shape
    const cudaError_t e = cudaOccupancyMaxActiveClusters(clusters, kernel, &cfg);
    if (e == cudaSuccess && used < 32) table[used++] = {(const void *)kernel, block, device, size, cfg.dynamicSmemBytes, *clusters};
    return e;
}

// Dynamic shared memory a block may have on `device` beside `static_bytes` of its own.
static size_t dynamic_smem_limit(int device, size_t static_bytes) {
    const int v = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device, 48 << 10);
    return (size_t)v > static_bytes ? (size_t)v - static_bytes : 0;
}


// The device's compute capability major (0 where the query fails).
static int compute_major(int device) { return device_attribute<cudaDevAttrComputeCapabilityMajor>(device, 0); }

constexpr int kFwdBulkStages = 4;  // at most, in norm_fwd_bulk_kernel's ring (BRRR_NORM_FWD_STAGES unset)

// A count from 1 to hi in the environment variable `name`, or 0 where it is unset or another value.
static int env_count(const char *name, int hi) {
    const char *v = getenv(name);
    const int n = v ? atoi(v) : 0;
    return n >= 1 && n <= hi ? n : 0;
}

// BRRR_NORM_FWD_WAVES (docs/kernel-switches.md): norm_fwd_bulk_kernel's grid, in waves of the
// blocks that fit at once (1 to 64; unset, 1: every block walks rows / grid rows a grid apart).
// BRRR_NORM_FWD_STAGES: its ring's stages (1 to 8), fewer only where the device's shared memory
// holds fewer; unset, see fwd_bulk_launch. Neither changes a row's arithmetic, so neither changes
// the bits.
static int fwd_bulk_waves() {
    const int n = env_count("BRRR_NORM_FWD_WAVES", 64);
    return n ? n : 1;
}

// Launches norm_fwd_bulk_kernel for the forward's row layout cfg, setting *launched, where it
// applies: float16 and bfloat16 rows of 16-byte packs on whole warps, a 2-d launch, sm_90, one
// row of each tensor in shared memory. The five-pack rows (kHalfFivePacks) run at twice the
// threads and three packs a thread (BRRR_NORM_FWD_PACKS=pow2's layout, and its bits): five packs
// of the row, the weight and the bias take more than the 128 registers a thread of 512 has. A
// launch this leaves to norm_fwd_kernel (rows in several dims, before sm_90) gets the five. The
// ring holds the most rows up to kFwdBulkStages that leave an SM as many blocks as 2 would (at
// 768-2048 columns with a residual, 4 stages left 17 of 23, 13 of 18 and 6 of 9 in bfloat16, the
// residual forms' shared memory and not their registers the limit), or BRRR_NORM_FWD_STAGES'
// count; the grid, fwd_bulk_waves() waves of the blocks that fit at once.
template <typename T>
static cudaError_t fwd_bulk_launch(const brrr_norm_launch &L, RowConfig cfg, int device, cudaStream_t stream,
                                   bool *launched) {
    *launched = false;
    if (cfg.packs == 5) {
        cfg.tpr *= 2;
        cfg.packs = 3;
    }
    if (cfg.vec == 1 || cfg.tpr < 32 || L.row_ndim != 1 || compute_major(device) < 9) return cudaSuccess;
    // a stage: a row of each tensor (16-byte multiples), then its barrier
    const size_t stage = (size_t)L.cols * sizeof(T) * (L.residual.data ? 2 : 1) + sizeof(uint64_t);
    const size_t limit = dynamic_smem_limit(device, sizeof(float) * 2 * kMaxWarps);
    const int forced = env_count("BRRR_NORM_FWD_STAGES", 8);
    int stages = forced ? forced : kFwdBulkStages;
    while (stages > 0 && stages * stage > limit) --stages;
    if (stages == 0) return cudaSuccess;
    auto go = [&](auto packs) {
        constexpr int P = decltype(packs)::value;
        const bool bias = L.bias.data != nullptr;
        const bool full = L.cols == (int64_t)cfg.tpr * P * vec_width<T>();
        auto pick = [&](auto full_) {
            constexpr bool F = decltype(full_)::value;
            return L.residual.data ? (bias ? norm_fwd_bulk_kernel<T, P, true, true, F> : norm_fwd_bulk_kernel<T, P, true, false, F>)
                                   : (bias ? norm_fwd_bulk_kernel<T, P, false, true, F> : norm_fwd_bulk_kernel<T, P, false, false, F>);
        };
        auto kernel = full ? pick(std::true_type()) : pick(std::false_type());
        int per_sm = 0, most = 0;  // most: the blocks an SM at 2 stages
        cudaError_t e = forced ? cudaSuccess : blocks_per_sm(kernel, cfg.tpr, (stages < 2 ? stages : 2) * stage, device, &most);
        for (; e == cudaSuccess; --stages) {
            e = blocks_per_sm(kernel, cfg.tpr, stages * stage, device, &per_sm);
            if (forced || stages <= 2 || per_sm >= most) break;
        }
        if (e != cudaSuccess) return e;
        const int64_t grid = (int64_t)(per_sm > 0 ? per_sm : 1) * sm_count(device) * fwd_bulk_waves();
        kernel<<<(unsigned)(L.rows < grid ? L.rows : grid), cfg.tpr, stages * stage, stream>>>(L, stages);
        *launched = true;
        return cudaSuccess;
    };
    return with_packs_up_to_4(cfg.packs, go, cudaSuccess);
}

// norm_fwd_flat_kernel's row layout for launch L, or false where it does not apply (single
// elements, float64, rows in several dims): 2^tpr_log2 threads (32 to 1024) of
// `packs` packs (1 to 4), the fewest pack slots that hold the row, and among those the packs
// nearest 16 values a thread (ties to fewer): fewer leave the group sums' shuffles and barriers
// to few values, more cost registers (bfloat16 4096 columns: 256 threads of 2 packs, where
// norm_fwd_kernel takes 128 of 4; float32 4096: 256 of 4).
template <typename T>
static bool flat_config(const brrr_norm_launch &L, int *tpr_log2, int *packs) {
    constexpr int kVec = vec_width<T>();
    if (sizeof(T) == 8 || !L.contiguous_cols || L.row_ndim != 1 || !packs_fit<T>(L)) return false;
    const int64_t total = L.cols / kVec;
    int64_t best = 0;
    int best_gap = 0;
    for (int p = 1; p <= 4; ++p) {
        int lg = 5;
        while (((int64_t)1 << lg) * p < total && lg < 10) ++lg;
        const int64_t slots = ((int64_t)1 << lg) * p;
        const int gap = abs(p * kVec - 16);
        if (slots < total || (best != 0 && (slots > best || (slots == best && gap >= best_gap)))) continue;
        best = slots;
        best_gap = gap;
        *tpr_log2 = lg;
        *packs = p;
    }
    return best != 0;
}

template <typename T>
static cudaError_t fwd_flat_launch(const brrr_norm_launch &L, int tpr_log2, int packs, cudaStream_t stream) {
    const int tpr = 1 << tpr_log2, block = tpr > kFlatMinBlock ? tpr : kFlatMinBlock, groups = block / tpr;
    const int64_t blocks = (L.rows + groups - 1) / groups;
    const unsigned grid = (unsigned)(blocks < kMaxGrid ? blocks : kMaxGrid);
    auto go = [&](auto p) {
        constexpr int P = decltype(p)::value;
        auto kernel = L.residual.data ? norm_fwd_flat_kernel<T, P, true> : norm_fwd_flat_kernel<T, P, false>;
        kernel<<<grid, block, 0, stream>>>(L, tpr_log2);
        return cudaSuccess;
    };
    return with_packs_up_to_4(packs, go, cudaErrorInvalidValue);
}

template <typename T>
cudaError_t norm_fwd_typed(const brrr_norm_launch &L, int device, cudaStream_t stream) {
    if (L.rows == 0 || L.cols == 0) return cudaSuccess;
    // BRRR_NORM_FWD_KERNEL (docs/kernel-switches.md), read at every launch so that one process can
    // time every value. flat: norm_fwd_flat_kernel wherever flat_config applies; unset, for float32
    // rows of groups up to 128 threads (up to 2048 columns), where it ran 1-15% faster than
    // norm_fwd_kernel on an H200 in two runs but for one row in one of them; at 4096 the residual
    // forms ran up to 4% slower in one run, at 5120 and 16384 every form slower. bulk:
    // norm_fwd_bulk_kernel for float16 and bfloat16 where fwd_bulk_launch applies; unset, for their
    // plain forms, and for the fused residual forms past 8192 columns, but at the five-pack widths:
    // on an H200 (39a9ca5, a0f7714, b284e06's runs) it ran the plain norms 0-24% faster than
    // norm_fwd_kernel at 1024-16384 columns but the fused residual forms 1-7% slower at 2048-8192,
    // and 11-23% faster at 12288 and 16384 (bf16 add_layer_norm 12288 forward 0.423 against 0.550
    // ms, at 3da342c); and a fused norm's output must have the plain norm's bits on its sum (remat's
    // recompute relies on it), which the two kernels share but where bulk takes another row layout
    // (the five-pack rows). Otherwise (the fused forms up to 8192 columns, the five-pack widths,
    // and rows) norm_fwd_kernel.
    const char *choice = getenv("BRRR_NORM_FWD_KERNEL");
    if constexpr (!std::is_same<T, double>::value) {
        int tpr_log2 = 0, packs = 0;
        const bool flat = choice ? strcmp(choice, "flat") == 0 : std::is_same<T, float>::value;
        if (flat && flat_config<T>(L, &tpr_log2, &packs) && (choice || tpr_log2 <= 7))
            return fwd_flat_launch<T>(L, tpr_log2, packs, stream);
    }
    RowConfig cfg;
    if (!row_config<T>(L, &cfg)) {
        norm_fwd_generic_kernel<T><<<generic_grid(L.rows, device), kGenericThreads, 0, stream>>>(L);
        return cudaSuccess;
    }
    if constexpr (is_half<T>) {
        // Unset: bulk where its row layout is rows' (every width but the five-pack rows) for the
        // plain forms, and for the fused residual forms past 8192 columns; rows for the others: the
        // same bits (a fused form's output is the plain form's on its sum), each at its faster kernel.
        const bool bulk_default = cfg.packs != 5 && (!L.residual.data || L.cols > 8192);
        if (choice ? strcmp(choice, "bulk") == 0 : bulk_default) {
            bool launched = false;
            const cudaError_t e = fwd_bulk_launch<T>(L, cfg, device, stream, &launched);
            if (e != cudaSuccess || launched) return e;
        }
    }
    return with_row_config<T>(cfg, [&](auto vec, auto packs) {
        constexpr int VEC = decltype(vec)::value, PACKS = decltype(packs)::value;
        auto kernel = L.residual.data ? norm_fwd_kernel<T, VEC, PACKS, true> : norm_fwd_kernel<T, VEC, PACKS, false>;
        const int groups = cfg.block / cfg.tpr;
        const int64_t blocks = (L.rows + groups - 1) / groups;
        const unsigned grid = (unsigned)(blocks < kMaxGrid ? blocks : kMaxGrid);
        kernel<<<grid, cfg.block, 0, stream>>>(L, cfg.tpr);
        return cudaSuccess;
    });
}

// Elements a backward thread holds per tensor: 16 with 16-byte packs, 8 with single elements
// (each taking its own address) or float64. The PACKS compiled are the powers of two up to that.
struct BwdConfig {
    int vec, packs, threads;  // threads: the kernel's bound, 512 (128 registers) or 1024 (64)
    BwdLayout lay;
};

// Where the backward's fast path keeps the weight: unset or auto, a copy in shared memory, or
// global memory where the copy leaves no room for one stage of the ring; smem, the copy or the
// generic kernels; global, global memory at every width (docs/kernel-switches.md).
enum class WeightPlace { kCopyOrGlobal, kCopy, kGlobal };
static WeightPlace weight_place() {
    const char *v = getenv("BRRR_NORM_BWD_WEIGHT");
    if (v == nullptr) return WeightPlace::kCopyOrGlobal;
    return strcmp(v, "global") == 0 ? WeightPlace::kGlobal : strcmp(v, "smem") == 0 ? WeightPlace::kCopy : WeightPlace::kCopyOrGlobal;
}

// BRRR_NORM_BWD_KERNEL (docs/kernel-switches.md): bulk, norm_bwd_bulk_kernel where it applies
// (bulk_applies), else norm_bwd_kernel; ring, norm_bwd_kernel; unset, bulk for float16 and
// bfloat16 (measured faster on an H200 at every width) and ring for float32 and float64 (slower
// at 8192 columns, the same elsewhere).
// wide: bulk, with its wide rows wherever they apply (half rows of one lane), for measuring.
template <typename T> static bool bwd_bulk_wanted() {
    const char *v = getenv("BRRR_NORM_BWD_KERNEL");
    return v == nullptr ? is_half<T> : strcmp(v, "bulk") == 0 || strcmp(v, "wide") == 0;
}
static bool bwd_wide_first() {
    const char *v = getenv("BRRR_NORM_BWD_KERNEL");
    return v != nullptr && strcmp(v, "wide") == 0;
}

// norm_bwd_bulk_kernel's assumptions, for a launch that bwd_config gave the fast path.
static bool bulk_applies(const brrr_norm_launch &L, const BwdConfig &cfg, int device) {
    return cfg.vec > 1 && cfg.threads == 512 && cfg.lay.split == 1 && cfg.lay.tpr % 32 == 0 && cfg.lay.stages >= 2 &&
           L.row_ndim == 1 && compute_major(device) >= 9;
}

// The backward's fast path for this launch, or false when it does not apply (strided columns,
// rows too long for 1024 threads / lanes at bwd_max_elements each, or shared memory too small
// for one stage). A row gets the most threads, up to 512 / lanes, at the fewest elements a
// thread; past that, half rows norm_bwd_bulk_kernel's wide rows (sm_90, up to 16384 columns),
// other rows two such blocks of a cluster (sm_90) or one of 1024 threads; the ring as
// many stages, up to 4, as the device's shared memory holds beside the weight's copy, or without
// the copy (the weight read from global memory) where that is the only way to hold one stage.
// Without it, float32 add_layer_norm at 16384 columns (three rows of 64 KB and the weight's 64 KB,
// past the 227 KB of an H200) took the generic kernels, at 35% of the memory floor.
template <typename T>
static bool bwd_config(const brrr_norm_launch &L, int n_grads, int device, BwdConfig *cfg) {
    using A = typename Compute<T>::type;
    if (!L.contiguous_cols || L.cols > (1 << 30) || L.rows > (1 << 30)) return false;  // 32-bit row indices
    constexpr int kVec = vec_width<T>();
    const brrr_norm_view *const views[] = {&L.x, &L.grad_out, &L.grad_residual, &L.grad_x};
    bool vector = L.cols % kVec == 0;  // (the weight's copy is made element by element)
    for (int i = 0; i < 4; ++i) vector = vector && rows_aligned(L, *views[i], (int64_t)sizeof(T));
    const int vec = vector ? kVec : 1, lanes = brrr_norm_lanes(L.cols), tensors = L.grad_residual.data ? 3 : 2;
    const int64_t packs_total = (L.cols + vec - 1) / vec;
    const size_t limit = dynamic_smem_limit(device, sizeof(A) * 2 * kBwdMaxLanes * 2 * 32);
    // Reading the weight from global memory takes 16-byte loads where vec > 1.
    const WeightPlace place = weight_place();
    // Half rows never need it: their widest ring (three rows of 16384 columns, 96 KB) and the
    // float32 copy (64 KB) fit together, and its second dtype branch cost the 1024-thread
    // kernels spills.
    const bool global_ok = !is_half<T> && place != WeightPlace::kCopy &&
                           (vec == 1 || L.weight.data == nullptr || aligned16(L.weight.data));
    // The layout of a row of tpr threads a group (ncols columns a block) with the most stages that
    // fit beside the weight's copy; without the copy (global_ok) only where the copy leaves no room
    // for one stage. Measured on an H200 (float32, 16384 rows): add_rms_norm at 8192 columns took
    // 1.06 ms with the copy and one stage, 1.22 ms reading the weight from global memory with two;
    // at 16384 columns, where the copy does not fit, 2.35 ms from global memory against 6.27 ms in
    // the generic kernels.
    // wide: norm_bwd_bulk_kernel's wide rows, two stages or more, the weight's copy where it fits
    // beside them (unless BRRR_NORM_BWD_WEIGHT=global), else global memory.
    auto fit = [&](int64_t tpr, int packs, int threads, int split, int64_t ncols, bool wide = false) {
        BwdLayout best[2] = {};  // [copy]
        for (int copy = 0; copy < 2; ++copy) {
            if (wide ? copy == 1 && place == WeightPlace::kGlobal
                     : copy == 0 ? !global_ok : place == WeightPlace::kGlobal && global_ok)
                continue;
            for (int stages = kBwdMaxStages; stages >= (wide ? 2 : 1) && best[copy].bytes == 0; --stages) {
                BwdLayout lay = BwdLayout::make<T, A>((int)tpr, packs * vec, lanes, stages, tensors, n_grads, ncols, copy == 1);
                if (lay.bytes > 0 && (size_t)lay.bytes <= limit) best[copy] = lay;
            }
        }
        const bool global = best[0].bytes > 0 && best[1].bytes == 0;
        const BwdLayout &lay = best[global ? 0 : 1];
        if (lay.bytes == 0) return false;
        *cfg = {vec, packs, threads, lay};
        cfg->lay.chunk_rows = brrr_norm_chunk_rows(L.rows);
        cfg->lay.split = split;
        cfg->lay.split_cols = (int)ncols;
        const char *shift = getenv("BRRR_NORM_BWD_SHIFT");
        cfg->lay.shift_word = shift == nullptr || strcmp(shift, "load") != 0;
        return true;
    };
    auto threads_for = [](int64_t packs_total, int packs) {
        int64_t tpr = (packs_total + packs - 1) / packs;
        if (tpr <= 32) {
            int p2 = 1;
            while (p2 < tpr) p2 *= 2;
            return (int64_t)p2;
        }
        return (tpr + 31) / 32 * 32;
    };
    // The fewest elements a thread that leave a block within 512 threads (128 registers: room for
    // 16 elements a thread with xhat and g kept); else, on sm_90, the row split over a cluster of
    // two such blocks, else one block of 1024 (64 registers). The split is the default for float32
    // rows with a bias gradient, whose 1024-thread kernel spills the most: on an H200 (16384 rows
    // of 16384) it took layer_norm from 1.73 to 1.50 ms and add_layer_norm from 2.82 to 2.54 ms,
    // where it made float32 rms_norm (1.38 to 1.46 ms) and every bfloat16 row slower.
    // BRRR_NORM_BWD_SPLIT=1 or 0 forces it on or off.
    // norm_bwd_bulk_kernel's wide rows (half rows of one lane, the bulk kernel wanted), 4 packs a
    // thread within 512 threads, where the bulk kernel applies to their layout and the weight,
    // read from global memory where its copy does not fit, is 16-byte aligned: past the 2-pack
    // layout's 512 threads (8193-16384 columns), or wherever they apply with BRRR_NORM_BWD_KERNEL=wide.
    auto wide_rows = [&]() {
        if constexpr (is_half<T>) {
            const int64_t tpr = threads_for(packs_total, kBwdWideElements / kVec);
            return lanes == 1 && tpr <= 512 && bwd_bulk_wanted<T>() && (L.weight.data == nullptr || aligned16(L.weight.data)) &&
                   fit(tpr, kBwdWideElements / kVec, 512, 1, L.cols, true) && bulk_applies(L, *cfg, device);
        }
        return false;
    };
    if (bwd_wide_first() && wide_rows()) return true;
    for (int packs = 1; packs * vec <= bwd_max_elements<T>(vec); packs *= 2) {
        const int64_t tpr = threads_for(packs_total, packs);
        if (tpr * lanes <= 512) return fit(tpr, packs, 512, 1, L.cols);
    }
    if (wide_rows()) return true;
    const int packs = bwd_max_elements<T>(vec) / vec;
    const char *split = getenv("BRRR_NORM_BWD_SPLIT");
    const bool want_split = split ? strcmp(split, "1") == 0 : std::is_same<T, float>::value && L.grad_bias.data != nullptr;
    if (lanes == 1 && compute_major(device) >= 9 && want_split) {
        const int64_t half = ((L.cols + 1) / 2 + vec - 1) / vec * vec, tpr = threads_for((half + vec - 1) / vec, packs);
        if (tpr <= 512 && fit(tpr, packs, 512, 2, half)) return true;
    }
    const int64_t tpr = threads_for(packs_total, packs);
    return tpr * lanes <= kBwdMaxThreads && fit(tpr, packs, kBwdMaxThreads, 1, L.cols);
}

// norm_bwd_bulk_kernel's instance for grad_bias (or not) and its refill order,
// BRRR_NORM_BWD_REFILL `sum` or `own` (kRefillOwn; docs/kernel-switches.md). Unset: `own` for rings
// of two stages of two rows (x and dy: the wide rows at 16384 columns), where the next row
// otherwise loads through the second pass only (H200, bf16 16384 x 16384: rms_norm 0.767 -> 0.737
// ms, layer_norm level), `sum` elsewhere (`own` 1-5% slower with three stages or a third row).
template <typename T, int VEC, int PACKS> static auto bulk_bwd_kernel(bool bias, const BwdLayout &lay) {
    const char *v = getenv("BRRR_NORM_BWD_REFILL");
    if (v != nullptr ? strcmp(v, "own") == 0 : lay.stages == 2 && lay.tensors == 2)
        return bias ? norm_bwd_bulk_kernel<T, VEC, PACKS, true, true> : norm_bwd_bulk_kernel<T, VEC, PACKS, false, true>;
    return bias ? norm_bwd_bulk_kernel<T, VEC, PACKS, true, false> : norm_bwd_bulk_kernel<T, VEC, PACKS, false, false>;
}

// The instance for grad_bias (or not) and the block bound: 1024 threads only at the most
// elements a thread (the widest rows), the only rows that need them.
template <typename T, int VEC, int PACKS>
static auto pick_bwd_kernel(bool bias, int threads, int split, const BwdLayout &lay) {
    if constexpr (PACKS * VEC > bwd_max_elements<T>(VEC)) {  // wide rows: the bulk kernel only
        (void)threads, (void)split;
        return bulk_bwd_kernel<T, VEC, PACKS>(bias, lay);
    }
    if constexpr (PACKS * VEC == bwd_max_elements<T>(VEC)) {
        if (threads > 512) return bias ? norm_bwd_kernel<T, VEC, PACKS, true, 1024, 1> : norm_bwd_kernel<T, VEC, PACKS, false, 1024, 1>;
        if (split > 1) return bias ? norm_bwd_kernel<T, VEC, PACKS, true, 512, 2> : norm_bwd_kernel<T, VEC, PACKS, false, 512, 2>;
    }
    return bias ? norm_bwd_kernel<T, VEC, PACKS, true, 512, 1> : norm_bwd_kernel<T, VEC, PACKS, false, 512, 1>;
}

template <typename T, int VEC, int P, typename F> static cudaError_t call_bwd(F &f) {
    if constexpr (P * VEC <= bwd_max_elements<T>(VEC) || (is_half<T> && VEC == vec_width<T>() && P * VEC == kBwdWideElements))
        return f(std::integral_constant<int, VEC>(), std::integral_constant<int, P>());
    else
        return cudaErrorInvalidValue;
}

template <typename T, int VEC, typename F> static cudaError_t with_bwd_packs(int packs, F &f) {
    switch (packs) {
    case 1: return call_bwd<T, VEC, 1>(f);
    case 2: return call_bwd<T, VEC, 2>(f);
    case 4: return call_bwd<T, VEC, 4>(f);
    case 8: return call_bwd<T, VEC, 8>(f);
    default: return cudaErrorInvalidValue;
    }
}

template <typename T>
cudaError_t norm_bwd_typed(const brrr_norm_launch &L, int device, cudaStream_t stream) {
    if (L.cols == 0) return cudaSuccess;
    const int n_grads = (L.grad_weight.data != nullptr) + (L.grad_bias.data != nullptr);
    const int64_t chunks = brrr_norm_partial_rows(L.rows, L.cols);
    BwdConfig cfg;
    if (L.rows == 0) {
        // nothing but the (zero) weight and bias gradients
    } else if (bwd_config<T>(L, n_grads, device, &cfg)) {
        auto launch = [&](auto vec, auto packs) {
            constexpr int VEC = decltype(vec)::value, PACKS = decltype(packs)::value;
            const int split = cfg.lay.split;
            const bool bias = L.grad_bias.data != nullptr;
            auto kernel = pick_bwd_kernel<T, VEC, PACKS>(bias, cfg.threads, split, cfg.lay);
            if constexpr (VEC > 1) {  // (bulk_applies: 16-byte packs only)
                if (bwd_bulk_wanted<T>() && bulk_applies(L, cfg, device))
                    kernel = bulk_bwd_kernel<T, VEC, PACKS>(bias, cfg.lay);
            }
            const int block = cfg.lay.lanes * cfg.lay.tpr;
            int per_sm = 0;
            const cudaError_t e = blocks_per_sm(kernel, block, (size_t)cfg.lay.bytes, device, &per_sm);
            if (e != cudaSuccess) return e;
            // As many blocks (clusters of `split`) as run at once, walking the chunks: the order
            // of the sums is the chunks', whatever the grid.
            const int64_t resident = (int64_t)(per_sm > 0 ? per_sm : 1) * sm_count(device);
            if (split == 1) {
                kernel<<<(unsigned)(chunks < resident ? chunks : resident), block, (size_t)cfg.lay.bytes, stream>>>(L, cfg.lay);
                return cudaSuccess;
            }
            cudaLaunchConfig_t launch_cfg;
            cudaLaunchAttribute attr;
            cluster_launch_config(launch_cfg, attr, dim3((unsigned)block), (size_t)cfg.lay.bytes, stream, split);
            int clusters = 0;
            const cudaError_t ce = clusters_resident(kernel, launch_cfg, device, &clusters);
            if (ce != cudaSuccess) return ce;
            const int64_t fit = clusters > 0 ? clusters : 1;
            launch_cfg.gridDim = dim3((unsigned)((chunks < fit ? chunks : fit) * split));
            return cudaLaunchKernelEx(&launch_cfg, kernel, L, cfg.lay);
        };
        const cudaError_t err = cfg.vec > 1 ? with_bwd_packs<T, vec_width<T>()>(cfg.packs, launch)
                                            : with_bwd_packs<T, 1>(cfg.packs, launch);
        if (err != cudaSuccess) return err;
    } else {
        norm_bwd_dx_generic_kernel<T><<<generic_grid(L.rows, device), kGenericThreads, 0, stream>>>(L);
        if (n_grads > 0) {
            const dim3 grid((unsigned)((L.cols + kTileCols - 1) / kTileCols), (unsigned)chunks);
            norm_bwd_dwdb_generic_kernel<T><<<grid, dim3(kTileCols, brrr_norm_lanes(L.cols)), 0, stream>>>(
                L, brrr_norm_chunk_rows(L.rows));
        }
    }
    if (n_grads > 0) {
        const dim3 grid((unsigned)((L.cols + kFinalCols - 1) / kFinalCols), 2);
        norm_finalize_kernel<T><<<grid, dim3(kFinalCols, kFinalLanes), 0, stream>>>(L, chunks);
    }
    return cudaSuccess;
}

}  // namespace norm
}  // namespace brrr

// setup.py compiles this header once per dtype, naming it BRRR_INSTANTIATE, each in a translation
// unit of its own so that the dtypes compile in parallel.
#ifdef BRRR_INSTANTIATE
// The forward (part 0) and the backward (part 1) in translation units of their own: the
// longest units of a parallel build, each of them alone compiles in about half the time.
#if BRRR_INSTANTIATE_PART == 0
template cudaError_t brrr::norm::norm_fwd_typed<BRRR_INSTANTIATE>(const brrr_norm_launch &, int, cudaStream_t);
#else
template cudaError_t brrr::norm::norm_bwd_typed<BRRR_INSTANTIATE>(const brrr_norm_launch &, int, cudaStream_t);
#endif
#endif
