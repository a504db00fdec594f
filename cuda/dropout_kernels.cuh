// Bias + dropout + residual add kernels (the launch and the mask: brrr_cuda.h, philox.h).
//
// dropout_contig_kernel    memory order = logical order. One chunk of kChunk consecutive elements
//                          per thread (one 16-byte pack; two for double), whole Philox groups of
//                          4, so one Philox call serves 4 elements. kVector: 16-byte accesses
//                          (aligned pointers); the chunk that runs past the end goes element by
//                          element. A bias is read as a pack where its columns line up with the
//                          chunk, else element by element at logical index % cols.
// dropout_strided_kernel   any strides over the merged shape: one Philox group per thread per
//                          grid-stride step, each element's offsets unravelled from its logical
//                          index.
// dropout_bwd_rows_kernel  backward with a bias gradient: the last dim is a row of columns. A
//                          block owns a column tile (32 threads x VEC columns) and a fixed slice
//                          of rows that its 8 warps walk; each thread sums its rows in order, the
//                          warps are summed in order through shared memory into the slice's
//                          partial row, and dropout_bias_grad_kernel sums the slices in a fixed
//                          order (block_sum_column_partials, common.cuh).
//                          No atomics: bitwise reproducible, on any GPU.
// The forward and the backward without a bias gradient are the same elementwise launch.
#pragma once

#include "brrr_cuda.h"
#include "common.cuh"
#include "philox.h"

namespace brrr {
namespace dropout {

// Elements per thread in the vectorised kernels: a 16-byte pack, at least one Philox group.
template <typename T> constexpr int chunk() { return 16 / (int)sizeof(T) > 4 ? 16 / (int)sizeof(T) : 4; }

template <typename T> __device__ __forceinline__ const T *in(const void *p) { return static_cast<const T *>(p); }
template <typename T> __device__ __forceinline__ T *out(void *p) { return static_cast<T *>(p); }

// E consecutive elements from a 16-byte aligned pointer, as E * sizeof(T) / 16 packs.
template <typename T, int E, typename A>
__device__ __forceinline__ void load_chunk(const T *p, A (&v)[E]) {
    constexpr int P = 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < E / P; ++k) load_pack<T, P>(p + k * P, v + k * P);
}
template <typename T, int E, typename A>
__device__ __forceinline__ void store_chunk(T *p, const A (&v)[E]) {
    constexpr int P = 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < E / P; ++k) store_pack<T, P>(p + k * P, v + k * P);
}

// The randoms of the E logical elements from `first`, a multiple of 4 (E / 4 Philox calls).
template <int E>
__device__ __forceinline__ void draw(const brrr_dropout_launch &L, uint64_t first, uint32_t (&r)[E]) {
#pragma unroll
    for (int g = 0; g < E / 4; ++g) {
        const brrr_philox4 w = brrr_dropout_randoms(L.seed, L.offset, first / 4 + g);
#pragma unroll
        for (int k = 0; k < 4; ++k) r[4 * g + k] = w.v[k];
    }
}

// The random of logical element i alone (word i % 4 of its group), by selects: an indexed
// register array would go to local memory.
__device__ __forceinline__ uint32_t draw_one(const brrr_dropout_launch &L, uint64_t i) {
    const brrr_philox4 w = brrr_dropout_randoms(L.seed, L.offset, i / 4);
    const int k = (int)(i & 3);
    return k == 0 ? w.v[0] : k == 1 ? w.v[1] : k == 2 ? w.v[2] : w.v[3];
}

// Each step rounded on its own, never fused into an FMA: the CPU twin rounds each step too, so
// the two agree bitwise.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// v * scale where kept, v * 0 where dropped: NaN where v is inf or NaN, as torch's x * mask *
// scale (also for p == 1), and -0 for a negative v. One multiply either way, as the CPU twin.
template <typename A>
__device__ __forceinline__ A dropped(const brrr_dropout_launch &L, uint32_t random, A v, A scale) {
    return mul_rn(v, (uint64_t)random >= L.threshold ? scale : A(0));
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) dropout_contig_kernel(const __grid_constant__ brrr_dropout_launch L,
                                                                  bool bias_packed) {
    using A = typename Compute<T>::type;
    constexpr int E = chunk<T>();
    const int64_t first = ((int64_t)blockIdx.x * kThreads + threadIdx.x) * E;
    if (first >= L.numel) return;
    const int n = L.numel - first < E ? (int)(L.numel - first) : E;
    const bool packed = kVector && n == E;
    const T *x = in<T>(L.x.data), *res = in<T>(L.residual.data), *bias = in<T>(L.bias);

    A v[E] = {}, r[E] = {};
    if (packed) {
        load_chunk<T, E>(x + first, v);
        if (res) load_chunk<T, E>(res + first, r);
    } else {
#pragma unroll
        for (int j = 0; j < E; ++j) {
            if (j >= n) continue;
            v[j] = to_float(x[first + j]);
            if (res) r[j] = to_float(res[first + j]);
        }
    }
    if (bias) {
        int64_t c = first % L.cols;
        if (packed && bias_packed) {  // cols % E == 0: the chunk's columns are c .. c + E - 1
            A b[E];
            load_chunk<T, E>(bias + c, b);
#pragma unroll
            for (int j = 0; j < E; ++j) v[j] = add_rn(v[j], b[j]);
        } else {
#pragma unroll
            for (int j = 0; j < E; ++j) {
                if (j >= n) continue;
                v[j] = add_rn(v[j], to_float(bias[c * L.bias_stride]));
                if (++c == L.cols) c = 0;
            }
        }
    }
    uint32_t rnd[E] = {};
    if (brrr_dropout_draws(L.threshold)) draw<E>(L, (uint64_t)first, rnd);
    const A scale = static_cast<A>(L.scale);
    A y[E];
#pragma unroll
    for (int j = 0; j < E; ++j) {
        const A d = dropped(L, rnd[j], v[j], scale);
        y[j] = res ? add_rn(r[j], d) : d;
    }
    T *o = out<T>(L.out.data);
    if (packed) {
        store_chunk<T, E>(o + first, y);
    } else {
#pragma unroll
        for (int j = 0; j < E; ++j)
            if (j < n) o[first + j] = to_storage<T, A>(y[j]);
    }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) dropout_strided_kernel(const __grid_constant__ brrr_dropout_launch L) {
    using A = typename Compute<T>::type;
    const T *x = in<T>(L.x.data), *res = in<T>(L.residual.data), *bias = in<T>(L.bias);
    T *o = out<T>(L.out.data);
    const A scale = static_cast<A>(L.scale);
    const int64_t groups = (L.numel + 3) / 4;
    for (int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x; g < groups; g += (int64_t)gridDim.x * kThreads) {
        uint32_t rnd[4] = {};
        if (brrr_dropout_draws(L.threshold)) draw<4>(L, 4 * (uint64_t)g, rnd);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int64_t i = 4 * g + k;
            if (i >= L.numel) break;
            int64_t ox = 0, ores = 0, oout = 0, rest = i;
#pragma unroll
            for (int d = BRRR_MAX_DIMS - 1; d >= 0; --d) {
                if (d >= L.ndim) continue;
                const int64_t c = rest % L.shape[d];
                rest /= L.shape[d];
                ox += c * L.x.strides[d];
                ores += c * L.residual.strides[d];
                oout += c * L.out.strides[d];
            }
            A v = to_float(x[ox]);
            if (bias) v = add_rn(v, to_float(bias[(i % L.cols) * L.bias_stride]));
            const A d = dropped(L, rnd[k], v, scale);
            o[oout] = to_storage<T, A>(res ? add_rn(to_float(res[ores]), d) : d);
        }
    }
}

// VEC = chunk<T>() (columns with stride 1, 16-byte aligned rows, cols % VEC == 0) or 1 (any).
template <typename T, int VEC>
__global__ void __launch_bounds__(kTileCols *kRowLanes) dropout_bwd_rows_kernel(const __grid_constant__ brrr_dropout_launch L) {
    using A = typename Compute<T>::type;
    __shared__ A lanes[kRowLanes][kTileCols * VEC];
    const int64_t cols = L.cols, rows = L.numel / cols;
    const int64_t per_slice = (rows + gridDim.y - 1) / gridDim.y;
    const int64_t begin = (int64_t)blockIdx.y * per_slice, end = min(rows, begin + per_slice);
    const int64_t col = ((int64_t)blockIdx.x * kTileCols + threadIdx.x) * VEC;
    const bool active = col < cols;
    const int last = L.ndim - 1;
    const A scale = static_cast<A>(L.scale);

    A acc[VEC] = {};
    for (int64_t r = begin + threadIdx.y; active && r < end; r += kRowLanes) {
        const T *g = in<T>(L.x.data) + row_offset(L, L.x.strides, r) + col * L.x.strides[last];
        T *o = out<T>(L.out.data) + row_offset(L, L.out.strides, r) + col * L.out.strides[last];
        const uint64_t i = (uint64_t)(r * cols + col);  // logical index: a multiple of 4 when VEC > 1
        A gv[VEC], d[VEC];
        uint32_t rnd[VEC] = {};
        if constexpr (VEC > 1) {
            load_chunk<T, VEC>(g, gv);
            if (brrr_dropout_draws(L.threshold)) draw<VEC>(L, i, rnd);
        } else {
            gv[0] = to_float(g[0]);
            if (brrr_dropout_draws(L.threshold)) rnd[0] = draw_one(L, i);
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            d[j] = dropped(L, rnd[j], gv[j], scale);
            acc[j] += d[j];
        }
        if constexpr (VEC > 1) {
            store_chunk<T, VEC>(o, d);
        } else {
            o[0] = to_storage<T, A>(d[0]);
        }
    }
    store_block_column_sums<VEC>(lanes, acc, static_cast<A *>(L.partials) + (int64_t)blockIdx.y * cols, col, active);
}

// grad_bias[c] = the per-slice partials[p][c] summed in a fixed order (block_sum_column_partials:
// lane l of a block sums slices l, l + kRowLanes, ... in turn, then the lanes are added in
// order; 0 without rows). A block per kTileCols columns.
template <typename T>
__global__ void __launch_bounds__(kTileCols *kRowLanes) dropout_bias_grad_kernel(const __grid_constant__ brrr_dropout_launch L) {
    using A = typename Compute<T>::type;
    __shared__ A lanes[kRowLanes][kTileCols];
    const int64_t c = (int64_t)blockIdx.x * kTileCols + threadIdx.x;
    const A total = block_sum_column_partials(lanes, static_cast<const A *>(L.partials), L.partial_rows, L.cols, c);
    if (threadIdx.y == 0 && c < L.cols) out<T>(L.grad_bias)[c * L.grad_bias_stride] = to_storage<T, A>(total);
}

// ---- launchers ------------------------------------------------------------------------------

// Rows can move 16-byte packs: stride-1 columns, cols % VEC == 0, every row start aligned.
template <typename T>
static bool rows_vectorizable(const brrr_dropout_launch &L) {
    constexpr int VEC = chunk<T>(), P = 16 / sizeof(T);
    if (L.cols % VEC != 0 || !aligned16(L.x.data) || !aligned16(L.out.data)) return false;
    const brrr_view *views[2] = {&L.x, &L.out};
    for (const brrr_view *v : views) {
        if (v->strides[L.ndim - 1] != 1) return false;
        for (int d = 0; d < L.ndim - 1; ++d)
            if (v->strides[d] % P != 0) return false;
    }
    return true;
}

template <typename T>
static cudaError_t launch_rows(const brrr_dropout_launch &L, cudaStream_t stream) {
    constexpr int VEC = chunk<T>();
    const bool vector = rows_vectorizable<T>(L);
    const int64_t cols_per_block = (int64_t)kTileCols * (vector ? VEC : 1);
    // Exactly partial_rows slices, whatever the GPU, so the summation order never changes.
    const dim3 grid((unsigned)((L.cols + cols_per_block - 1) / cols_per_block), (unsigned)L.partial_rows);
    const dim3 block(kTileCols, kRowLanes);
    if (vector) dropout_bwd_rows_kernel<T, VEC><<<grid, block, 0, stream>>>(L);
    else dropout_bwd_rows_kernel<T, 1><<<grid, block, 0, stream>>>(L);
    return cudaGetLastError();
}

// Defined here, instantiated once per dtype by the BRRR_INSTANTIATE block at the end.
template <typename T>
cudaError_t dropout_typed(const brrr_dropout_launch &L, int device, cudaStream_t stream) {
    constexpr int E = chunk<T>();
    if (L.grad_bias) {
        if (L.numel > 0) {
            const cudaError_t err = launch_rows<T>(L, stream);
            if (err != cudaSuccess) return err;
        }
        const dim3 block(kTileCols, kRowLanes);
        dropout_bias_grad_kernel<T><<<(unsigned)((L.cols + kTileCols - 1) / kTileCols), block, 0, stream>>>(L);
        return cudaGetLastError();
    }
    if (L.contiguous) {
        const unsigned blocks = (unsigned)((L.numel + (int64_t)E * kThreads - 1) / ((int64_t)E * kThreads));
        const bool aligned = aligned16(L.x.data) && aligned16(L.out.data) && aligned16(L.residual.data);
        const bool bias_packed = L.bias && L.bias_stride == 1 && L.cols % E == 0 && aligned16(L.bias);
        if (aligned) dropout_contig_kernel<T, true><<<blocks, kThreads, 0, stream>>>(L, bias_packed);
        else dropout_contig_kernel<T, false><<<blocks, kThreads, 0, stream>>>(L, false);
    } else {
        const int64_t blocks = ((L.numel + 3) / 4 + kThreads - 1) / kThreads, cap = (int64_t)sm_count(device) * 16;
        dropout_strided_kernel<T><<<(unsigned)(blocks < cap ? blocks : cap), kThreads, 0, stream>>>(L);
    }
    return cudaGetLastError();
}

}  // namespace dropout
}  // namespace brrr

// setup.py compiles this header once per dtype, naming it BRRR_INSTANTIATE, each in a translation
// unit of its own so that the dtypes compile in parallel.
#ifdef BRRR_INSTANTIATE
template cudaError_t brrr::dropout::dropout_typed<BRRR_INSTANTIATE>(const brrr_dropout_launch &, int, cudaStream_t);
#endif
