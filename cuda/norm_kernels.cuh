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
// norm_bwd_kernel     the same row layout, with more threads per row (see row_config). A block
//                     owns a contiguous slice of rows, walked by its groups, each thread loading
//                     its share of the next row while it works on the current one; each thread
//                     adds its columns' dw/db terms, row by row in order, in registers or shared
//                     memory (BwdPlan); at the end the groups' sums are added in group order
//                     into the block's partial row.
// norm_fwd_generic_kernel, norm_bwd_dx_generic_kernel
//                     any strides, or rows too long for registers: a 256-thread block per row,
//                     reading the row twice (the second time mostly from L2). Forward statistics:
//                     per-thread shifted sums, merged with Chan's formula in a fixed tree.
// norm_bwd_dwdb_generic_kernel  dw/db for the generic path: a block owns 32 columns of a slice
//                     of rows, 8 row lanes summed in order through shared memory.
// norm_finalize_kernel  grad_weight/grad_bias[c] = sum over p, in order, of partials[p][c].
// Every sum has a fixed order, so results are bitwise identical run to run on one GPU (the
// number of partial rows follows its occupancy). Nothing is allocated; no atomics.
#pragma once

#include <mutex>
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
// residual forms hold a second row and keep 128.
template <typename T> constexpr int fwd_min_blocks(int elements, bool residual) {
    return !residual && elements * (int)sizeof(T) <= 128 ? 2 : 1;
}

// kResidual: L.residual is given (a template argument, so the plain forward keeps no registers for it).
// LayerNorm's statistics are two passes over the row in registers, a group sum each: the mean,
// then the squares about it. Merging per-thread (count, sum, squared deviations) in one reduction
// instead (Chan et al.) saves a barrier but costs ~17 instructions per butterfly step; at 16384 x
// 4096 bf16 on the H200 it ran 0.098 ms, two group sums 0.092 ms.
// What holds that shape at 54% of DRAM bandwidth is latency: a thread loads its share of a row,
// then waits through the reductions with nothing in flight.
template <typename T, int VEC, int PACKS, bool kResidual>
__global__ void __launch_bounds__(kMaxRowThreads, fwd_min_blocks<T>(PACKS * VEC, kResidual))
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
        // Flags are uniform and pack bounds per thread: branches around whole packs, no selects per
        // element (packs past the row stay zero).
        A mean = A(0), rstd;
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
            group_sum(sum, tpr, buf[parity]);
            parity ^= 1;
            mean = sum[0] * inv_n;
            A squares[1] = {A(0)};
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
                if (k >= mine) continue;
#pragma unroll
                for (int j = 0; j < VEC; ++j) squares[0] += (v[k][j] - mean) * (v[k][j] - mean);
            }
            group_sum(squares, tpr, buf[parity]);
            rstd = rsqrt_of(squares[0] * inv_n + eps);
        } else {
            A q[1] = {A(0)};
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) q[0] += v[k][j] * v[k][j];
            }
            group_sum(q, tpr, buf[parity]);
            rstd = rsqrt_of(q[0] * inv_n + eps);
        }
        parity ^= 1;
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
                load_param<T, VEC>(L, L.bias.data, first + k * stride, A(0), b);
#pragma unroll
                for (int j = 0; j < VEC; ++j) y[j] = (v[k][j] - mean) * rstd * w[j] + b[j];
            }
            store_vec<T, VEC>(out + k * stride, y);
        }
    }
}

// Shared memory of norm_bwd_kernel: per group, per gradient (dw, then db), the sums of every
// thread's columns, laid out so that consecutive threads touch consecutive chunks of up to 16
// bytes, each read and written as one access (conflict-free).
template <typename A, int VEC, int PACKS> struct BwdSums {
    static constexpr int kChunk = VEC * (int)sizeof(A) > 16 ? 16 / (int)sizeof(A) : VEC;  // elements
    static constexpr int kChunks = VEC / kChunk;
    using Chunk = Pack<A, kChunk>;  // aligned to its size, which `at` offsets are multiples of
    // Element offset, within one gradient of one group, of chunk c of pack k of thread t.
    static __device__ __forceinline__ int at(int k, int c, int t, int tpr) { return ((k * kChunks + c) * tpr + t) * kChunk; }
    // The column of element i of one gradient of one group (the inverse of `at`).
    static __device__ __forceinline__ int column(int i, int tpr) {
        const int e = i % kChunk;
        i /= kChunk;
        const int t = i % tpr;
        i /= tpr;
        return ((i / kChunks) * tpr + t) * VEC + (i % kChunks) * kChunk + e;
    }
};

// VEC elements of T in storage form, as 32-bit words: a pack of 8 bfloat16 takes 4 registers (as
// Pack<T, 8> the compiler gives every element its own). p aligned to min(16, VEC * sizeof(T)).
template <typename T, int VEC> struct Raw {
    static constexpr int kBytes = VEC * (int)sizeof(T), kWords = kBytes < 4 ? 1 : kBytes / 4;
    uint32_t w[kWords];
};

template <typename T, int VEC> __device__ __forceinline__ Raw<T, VEC> load_raw(const T *p) {
    using R = Raw<T, VEC>;
    R r;
    if constexpr (R::kBytes < 4) {
        r.w[0] = *reinterpret_cast<const unsigned short *>(p);
    } else {
        const Pack<uint32_t, R::kWords> pk = *reinterpret_cast<const Pack<uint32_t, R::kWords> *>(p);
#pragma unroll
        for (int i = 0; i < R::kWords; ++i) r.w[i] = pk.v[i];
    }
    return r;
}

// Element j of r, converted to the compute type.
template <typename T, int VEC>
__device__ __forceinline__ typename Compute<T>::type raw_at(const Raw<T, VEC> &r, int j) {
    if constexpr (sizeof(T) == 2) {
        const unsigned short h = (unsigned short)(j % 2 ? r.w[j / 2] >> 16 : r.w[j / 2] & 0xffffu);
        if constexpr (std::is_same<T, __half>::value) return __half2float(__ushort_as_half(h));
        else return __bfloat162float(__ushort_as_bfloat16(h));
    } else if constexpr (sizeof(T) == 4) {
        return __uint_as_float(r.w[j]);
    } else {
        return __hiloint2double((int)r.w[2 * j + 1], (int)r.w[2 * j]);
    }
}

// One row as the backward reads it, in storage form (converted where used, so that a thread's
// registers hold its share of two rows at once): x and dy packs, x's first element (the shift),
// the saved statistics, and the count of the thread's packs in the row (0: no row).
template <typename T, int VEC, int PACKS> struct BwdRow {
    using A = typename Compute<T>::type;
    Raw<T, VEC> x[PACKS], dy[PACKS];
    T x0;
    A mean, rstd;
    int mine;
};

template <typename T, int VEC, int PACKS>
__device__ __forceinline__ BwdRow<T, VEC, PACKS> bwd_load(const brrr_norm_launch &L, int64_t row, bool active,
                                                         int first, int stride) {
    using A = typename Compute<T>::type;
    BwdRow<T, VEC, PACKS> R;
    R.mine = packs_in_row(active, (int)L.cols, first, stride);
    R.x0 = to_storage<T, A>(A(0));
    R.mean = R.rstd = A(0);
    if (!active) return R;
    const brrr_norm_view *const views[4] = {&L.x, &L.grad_out, &L.rstd, &L.mean};
    int64_t off[4];
    row_offsets(L, row, views, off);
    const T *x = static_cast<const T *>(L.x.data) + off[0] + first, *dy = static_cast<const T *>(L.grad_out.data) + off[1] + first;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
        if (k >= R.mine) continue;
        R.x[k] = load_raw<T, VEC>(x + k * stride);
        R.dy[k] = load_raw<T, VEC>(dy + k * stride);
    }
    R.rstd = static_cast<const A *>(L.rstd.data)[off[2]];
    if (!L.rms) {
        R.mean = static_cast<const A *>(L.mean.data)[off[3]];
        R.x0 = x[-first];
    }
    return R;
}

// Registers of one tensor's share of a row in storage form.
template <typename T, int VEC> constexpr int raw_registers(int packs) { return packs * ((VEC * (int)sizeof(T) + 3) / 4); }

// Rows a backward thread holds ahead of the one it works on. The backward keeps a thread's share
// of a row small (see row_config) so that when it fits 8 registers per tensor the thread can hold
// the x and dy of the next two rows (one with single-element accesses, which take an address
// each), loaded before this row's sums: loads stay in flight through the reduction and the stores
// (a warp of the kernel this replaced sat idle from its last load to its next one, at 45% of the
// bandwidth floor). Larger shares put more bytes in flight per load instead.
template <typename T, int VEC, int PACKS> constexpr int bwd_rows_ahead() {
    return raw_registers<T, VEC>(PACKS) > 8 ? 0 : (VEC > 1 ? 2 : 1);
}

// __maxnreg__ rather than __launch_bounds__(512): with the latter ptxas caps some instances at 64
// registers and spills; this way none spills (checked with -Xptxas -v for every instance).
template <typename T, int VEC, int PACKS>
__global__ void __maxnreg__(128)
    norm_bwd_kernel(const __grid_constant__ brrr_norm_launch L, const int tpr, const int64_t rows_per_block) {
    using A = typename Compute<T>::type;
    using Sums = BwdSums<A, VEC, PACKS>;
    using Chunk = typename Sums::Chunk;
    constexpr int kChunk = Sums::kChunk, kAhead = bwd_rows_ahead<T, VEC, PACKS>();
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ A buf[2][2][kMaxWarps];
    const int groups = blockDim.x / tpr, g = threadIdx.x / tpr, t = threadIdx.x % tpr;
    const int cols = (int)L.cols, first = t * VEC, stride = tpr * VEC;
    const A inv_n = A(1) / static_cast<A>(cols);
    const bool layer = !L.rms, want_dw = L.grad_weight.data != nullptr, want_db = L.grad_bias.data != nullptr;
    const int n_grads = (int)want_dw + (int)want_db, per_grad = PACKS * VEC * tpr;  // one gradient of one group
    A *const sums = reinterpret_cast<A *>(smem);
    A *const dw_sums = sums + g * n_grads * per_grad, *const db_sums = dw_sums + (want_dw ? per_grad : 0);
    Chunk zero;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) zero.v[e] = A(0);
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
#pragma unroll
        for (int c = 0; c < Sums::kChunks; ++c) {
            if (want_dw) *reinterpret_cast<Chunk *>(dw_sums + Sums::at(k, c, t, tpr)) = zero;
            if (want_db) *reinterpret_cast<Chunk *>(db_sums + Sums::at(k, c, t, tpr)) = zero;
        }
    }
    const int64_t begin = (int64_t)blockIdx.x * rows_per_block;
    const int64_t end = begin + rows_per_block < L.rows ? begin + rows_per_block : L.rows;
    const int64_t iters = (rows_per_block + groups - 1) / groups;
    int parity = 0;
    int64_t row = begin + g;
    auto load = [&](int64_t r) { return bwd_load<T, VEC, PACKS>(L, r, r < end, first, stride); };
    BwdRow<T, VEC, PACKS> cur, ahead[kAhead > 0 ? kAhead : 1];
    if constexpr (kAhead > 0) cur = load(row);
#pragma unroll
    for (int d = 0; d < kAhead; ++d) ahead[d] = load(row + (d + 1) * groups);
    for (int64_t it = 0; it < iters; ++it, row += groups) {
        const bool active = row < end;
        BwdRow<T, VEC, PACKS> incoming;
        if constexpr (kAhead > 0) incoming = load(row + (kAhead + 1) * groups);
        else cur = load(row);
        const int mine = cur.mine;
        const A shift = to_float(cur.x0), mean = cur.mean, rstd = cur.rstd;
        auto xhat_of = [&](A x) { return layer ? (x - shift - mean) * rstd : x * rstd; };
        // Pass 1: the row's sums of g = dy * w, and this thread's dw/db terms. Pass 2 converts x and
        // dy again and rereads w (from L1) rather than keep g in registers through the reduction.
        A s[2] = {A(0), A(0)};  // sum of g * xhat, sum of g
#pragma unroll
        for (int k = 0; k < PACKS; ++k) {
            if (k >= mine) continue;
            A w[VEC], dwk[VEC];
            load_weight<T, VEC>(L, first + k * stride, w);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const A xhat = xhat_of(raw_at(cur.x[k], j)), g = raw_at(cur.dy[k], j) * w[j];
                dwk[j] = raw_at(cur.dy[k], j) * (L.llama ? round_to<T>(xhat) : xhat);
                s[0] += g * xhat;
                s[1] += g;
            }
#pragma unroll
            for (int ch = 0; ch < Sums::kChunks; ++ch) {
                const int at = Sums::at(k, ch, t, tpr);
                if (want_dw) {
                    Chunk *p = reinterpret_cast<Chunk *>(dw_sums + at);
                    Chunk acc = *p;
#pragma unroll
                    for (int e = 0; e < kChunk; ++e) acc.v[e] += dwk[ch * kChunk + e];
                    *p = acc;
                }
                if (want_db) {
                    Chunk *p = reinterpret_cast<Chunk *>(db_sums + at);
                    Chunk acc = *p;
#pragma unroll
                    for (int e = 0; e < kChunk; ++e) acc.v[e] += raw_at(cur.dy[k], ch * kChunk + e);
                    *p = acc;
                }
            }
        }
        group_sum(s, tpr, buf[parity]);
        parity ^= 1;
        if (active) {
            // Pass 2: dx = rstd * (g - xhat * c1 - c2) [+ grad_residual], xhat recomputed from x.
            const A c1 = s[0] * inv_n, c2 = layer ? s[1] * inv_n : A(0);
            const brrr_norm_view *const views[2] = {&L.grad_residual, &L.grad_x};
            int64_t off[2];
            row_offsets(L, row, views, off);
            const T *gres = L.grad_residual.data ? static_cast<const T *>(L.grad_residual.data) + off[0] + first : nullptr;
            T *dx = static_cast<T *>(L.grad_x.data) + off[1] + first;
#pragma unroll
            for (int k = 0; k < PACKS; ++k) {
                if (k >= mine) continue;
                A w[VEC], d[VEC], extra[VEC];
                load_weight<T, VEC>(L, first + k * stride, w);
#pragma unroll
                for (int j = 0; j < VEC; ++j) extra[j] = A(0);
                if (gres) load_vec<T, VEC>(gres + k * stride, extra);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const A g = raw_at(cur.dy[k], j) * w[j];
                    d[j] = rstd * (g - xhat_of(raw_at(cur.x[k], j)) * c1 - c2) + extra[j];
                }
                store_vec<T, VEC>(dx + k * stride, d);
            }
        }
        if constexpr (kAhead > 0) {
            cur = ahead[0];
#pragma unroll
            for (int d = 0; d + 1 < kAhead; ++d) ahead[d] = ahead[d + 1];
            ahead[kAhead - 1] = incoming;
        }
    }
    if (n_grads == 0) return;
    // This block's partial rows: the groups' sums, added in group order.
    __syncthreads();
    const int span = n_grads * per_grad;
    for (int i = threadIdx.x; i < span; i += blockDim.x) {
        const int q = i / per_grad, col = Sums::column(i % per_grad, tpr);
        if (col >= cols) continue;
        A total = sums[i];
        for (int gg = 1; gg < groups; ++gg) total += sums[gg * span + i];
        static_cast<A *>(L.partials)[((int64_t)q * gridDim.x + blockIdx.x) * cols + col] = total;
    }
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
            load_param<T, 1>(L, L.bias.data, col_offset(L, L.bias, j), A(0), &b);
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
        const A shift = layer ? to_float(x[0]) : A(0);
        const A mean = layer ? static_cast<const A *>(L.mean.data)[row_offset(L, L.mean, row)] : A(0);
        auto element = [&](int64_t j, A *xhat, A *g) {
            A w;
            load_weight<T, 1>(L, col_offset(L, L.weight, j), &w);
            *xhat = (to_float(x[col_offset(L, L.x, j)]) - shift - mean) * rstd;
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

template <typename T>
__global__ void __launch_bounds__(kTileCols *kRowLanes)
    norm_bwd_dwdb_generic_kernel(const __grid_constant__ brrr_norm_launch L, const int64_t rows_per_part) {
    using A = typename Compute<T>::type;
    __shared__ A lanes[2][kRowLanes][kTileCols];
    const int64_t col = (int64_t)blockIdx.x * kTileCols + threadIdx.x;
    const bool active = col < L.cols, layer = !L.rms;
    const int64_t begin = (int64_t)blockIdx.y * rows_per_part;
    const int64_t end = begin + rows_per_part < L.rows ? begin + rows_per_part : L.rows;
    A dw = A(0), db = A(0);
    for (int64_t r = begin + threadIdx.y; active && r < end; r += kRowLanes) {
        const T *x = row_in<T>(L, L.x, r), *dy = row_in<T>(L, L.grad_out, r);
        A xhat = to_float(x[col_offset(L, L.x, col)]);
        if (layer) xhat = xhat - to_float(x[0]) - static_cast<const A *>(L.mean.data)[row_offset(L, L.mean, r)];
        xhat *= static_cast<const A *>(L.rstd.data)[row_offset(L, L.rstd, r)];
        const A g = to_float(dy[col_offset(L, L.grad_out, col)]);
        dw += g * (L.llama ? round_to<T>(xhat) : xhat);
        db += g;
    }
    lanes[0][threadIdx.y][threadIdx.x] = dw;
    lanes[1][threadIdx.y][threadIdx.x] = db;
    __syncthreads();
    if (threadIdx.y != 0 || !active) return;
    dw = lanes[0][0][threadIdx.x];
    db = lanes[1][0][threadIdx.x];
    for (int lane = 1; lane < kRowLanes; ++lane) {
        dw += lanes[0][lane][threadIdx.x];
        db += lanes[1][lane][threadIdx.x];
    }
    A *part = static_cast<A *>(L.partials);
    int q = 0;
    if (L.grad_weight.data) part[((int64_t)q++ * gridDim.y + blockIdx.y) * L.cols + col] = dw;
    if (L.grad_bias.data) part[((int64_t)q * gridDim.y + blockIdx.y) * L.cols + col] = db;
}

// grad[c] = sum over the partial rows p < parts, in order, of partials[q][p][c]; blockIdx.y
// picks grad_weight (0) or grad_bias (1). parts == 0 (no rows) writes zeros.
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

// The fast path's shape for this launch, or false when it does not apply (strided columns, or
// a row longer than 512 threads can hold). A row gets the fewest threads (32 and up) that hold
// it; in the backward, enough for a share of 8 registers per tensor where 512 threads allow (see
// BwdPlan).
template <typename T>
static bool row_config(const brrr_norm_launch &L, bool backward, RowConfig *cfg) {
    if (!L.contiguous_cols || (L.row_ndim > 1 && L.rows > INT32_MAX)) return false;  // see row_offsets
    constexpr int kVec = vec_width<T>();
    const brrr_norm_view *const fwd[] = {&L.x, &L.residual, &L.out, &L.residual_out};
    const brrr_norm_view *const bwd[] = {&L.x, &L.grad_out, &L.grad_residual, &L.grad_x};
    const brrr_norm_view *const *views = backward ? bwd : fwd;
    bool vector = L.cols % kVec == 0 && (L.weight.data == nullptr || aligned16(L.weight.data)) &&
                  (L.bias.data == nullptr || aligned16(L.bias.data));
    for (int i = 0; i < 4; ++i) vector = vector && rows_aligned(L, *views[i], (int64_t)sizeof(T));
    const int vec = vector ? kVec : 1, max_packs = max_elements<T>(vec) / vec;
    const int want_packs = backward ? 8 / ((vec * (int)sizeof(T) + 3) / 4) : max_packs;
    const int64_t packs_total = (L.cols + vec - 1) / vec;
    int tpr = 1, packs = 1;
    if (packs_total <= 32) {
        while (tpr < packs_total) tpr *= 2;
    } else {
        tpr = 32;
        while ((int64_t)tpr * want_packs < packs_total && tpr < kMaxRowThreads) tpr *= 2;
        if ((int64_t)tpr * max_packs < packs_total) return false;
        packs = round_packs((int)((packs_total + tpr - 1) / tpr), vector);
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

static inline unsigned generic_grid(int64_t rows, int device) {
    const int64_t cap = (int64_t)sm_count(device) * 16;
    return (unsigned)(rows < cap ? rows : cap);
}

struct RowSplit {
    int64_t parts, rows_per_part;
};

// `rows` split into at most `target` equal slices (and at most `cap`), none empty.
static inline RowSplit split_rows(int64_t rows, int64_t target, int64_t cap) {
    int64_t parts = target < cap ? target : cap;
    if (parts > rows) parts = rows;
    if (parts < 1) parts = 1;
    const int64_t per = (rows + parts - 1) / parts;
    return {(rows + per - 1) / per, per};
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

template <typename T>
cudaError_t norm_fwd_typed(const brrr_norm_launch &L, int device, cudaStream_t stream) {
    if (L.rows == 0 || L.cols == 0) return cudaSuccess;
    RowConfig cfg;
    if (!row_config<T>(L, false, &cfg)) {
        norm_fwd_generic_kernel<T><<<generic_grid(L.rows, device), kGenericThreads, 0, stream>>>(L);
        return cudaSuccess;
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

template <typename T>
cudaError_t norm_bwd_typed(const brrr_norm_launch &L, int device, cudaStream_t stream) {
    using A = typename Compute<T>::type;
    if (L.cols == 0) return cudaSuccess;
    const int n_grads = (L.grad_weight.data != nullptr) + (L.grad_bias.data != nullptr);
    const int64_t cap = n_grads > 0 ? L.partial_rows_max : L.rows;
    int64_t parts = 0;
    RowConfig cfg;
    if (L.rows == 0) {
        // nothing but the (zero) weight and bias gradients
    } else if (row_config<T>(L, true, &cfg)) {
        const cudaError_t err = with_row_config<T>(cfg, [&](auto vec, auto packs) {
            constexpr int VEC = decltype(vec)::value, PACKS = decltype(packs)::value;
            auto kernel = norm_bwd_kernel<T, VEC, PACKS>;
            const int groups = cfg.block / cfg.tpr;
            const size_t smem = (size_t)groups * n_grads * PACKS * VEC * cfg.tpr * sizeof(A);
            int per_sm = 0;
            const cudaError_t e = blocks_per_sm(kernel, cfg.block, smem, device, &per_sm);
            if (e != cudaSuccess) return e;
            // One wave of blocks, each owning an equal slice of rows (and a partial row), no
            // more blocks than groups of rows.
            const int64_t resident = (int64_t)(per_sm > 0 ? per_sm : 1) * sm_count(device);
            const int64_t row_groups = (L.rows + groups - 1) / groups;
            const RowSplit split = split_rows(L.rows, resident, cap < row_groups ? cap : row_groups);
            parts = split.parts;
            kernel<<<(unsigned)parts, cfg.block, smem, stream>>>(L, cfg.tpr, split.rows_per_part);
            return cudaSuccess;
        });
        if (err != cudaSuccess) return err;
    } else {
        norm_bwd_dx_generic_kernel<T><<<generic_grid(L.rows, device), kGenericThreads, 0, stream>>>(L);
        if (n_grads > 0) {
            const int64_t tiles = (L.cols + kTileCols - 1) / kTileCols, want = (int64_t)sm_count(device) * 8;
            const RowSplit split = split_rows(L.rows, (want + tiles - 1) / tiles, cap);
            parts = split.parts;
            norm_bwd_dwdb_generic_kernel<T><<<dim3((unsigned)tiles, (unsigned)parts), dim3(kTileCols, kRowLanes), 0, stream>>>(
                L, split.rows_per_part);
        }
    }
    if (n_grads > 0) {
        const dim3 grid((unsigned)((L.cols + kFinalCols - 1) / kFinalCols), 2);
        norm_finalize_kernel<T><<<grid, dim3(kFinalCols, kFinalLanes), 0, stream>>>(L, parts);
    }
    return cudaSuccess;
}

}  // namespace norm
}  // namespace brrr

// setup.py compiles this header once per dtype, naming it BRRR_INSTANTIATE, each in a translation
// unit of its own so that the dtypes compile in parallel.
#ifdef BRRR_INSTANTIATE
template cudaError_t brrr::norm::norm_fwd_typed<BRRR_INSTANTIATE>(const brrr_norm_launch &, int, cudaStream_t);
template cudaError_t brrr::norm::norm_bwd_typed<BRRR_INSTANTIATE>(const brrr_norm_launch &, int, cudaStream_t);
#endif
