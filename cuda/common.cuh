// Device-side helpers shared by the kernels: storage <-> compute conversions, 16-byte vector
// access, the fast elementary functions used for half-precision storage, and a device guard.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "brrr_cuda.h"
#include "trig_reduce.h"

namespace brrr {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double to_float(double v) { return v; }

template <typename T> struct Compute { using type = float; };
template <> struct Compute<double> { using type = double; };

template <typename T, typename A> __device__ __forceinline__ T to_storage(A v);
template <> __device__ __forceinline__ float to_storage<float, float>(float v) { return v; }
template <> __device__ __forceinline__ __half to_storage<__half, float>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 to_storage<__nv_bfloat16, float>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ double to_storage<double, double>(double v) { return v; }

// N elements of T that fill 16 bytes, moved with one 128-bit access (the pointer must be aligned).
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

template <typename T, int N, typename A>
__device__ __forceinline__ void load_pack(const T *p, A *out) {
    Pack<T, N> pk = *reinterpret_cast<const Pack<T, N> *>(p);
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(pk.v[j]);
}

template <typename T, int N, typename A>
__device__ __forceinline__ void store_pack(T *p, const A *in) {
    Pack<T, N> pk;
#pragma unroll
    for (int j = 0; j < N; ++j) pk.v[j] = to_storage<T, A>(in[j]);
    *reinterpret_cast<Pack<T, N> *>(p) = pk;
}

// Block shape of the row kernels (chains, dropout, norms' generic weight gradients): a column
// tile of kTileCols threads (VEC columns each) across, kRowLanes warps down, each its own rows.
constexpr int kRowLanes = 8;
constexpr int kTileCols = 32;

// Offset of row r (the leading dims of a row layout: every dim of L.shape but the last) in a view
// with strides s. Launch is any launch struct with ndim and shape.
template <typename Launch>
__device__ __forceinline__ int64_t row_offset(const Launch &L, const int64_t *s, int64_t r) {
    if (L.ndim == 2) return r * s[0];
    int64_t off = 0;
#pragma unroll
    for (int d = BRRR_MAX_DIMS - 2; d >= 0; --d) {
        if (d >= L.ndim - 1) continue;
        off += (r % L.shape[d]) * s[d];
        r /= L.shape[d];
    }
    return off;
}

// Offsets of row r in N views at once (strides[i] over a row shape of ndim dims, innermost
// last): r is decomposed once, in Index arithmetic. Kernels pass uint32_t where the host checked
// that the rows fit: 64-bit divisions are subroutine calls, which cost registers wherever they appear.
template <typename Index, int MAX_DIMS, int N>
__device__ __forceinline__ void unravel_offsets(int ndim, const int64_t *shape, int64_t r,
                                                const int64_t *const (&strides)[N], int64_t (&off)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) off[i] = r * strides[i][0];
    if (ndim == 1) return;
#pragma unroll
    for (int i = 0; i < N; ++i) off[i] = 0;
    Index rest = (Index)r;
#pragma unroll
    for (int d = MAX_DIMS - 1; d >= 0; --d) {
        if (d < ndim) {
            const Index n = (Index)shape[d], q = rest / n, at = rest - q * n;
#pragma unroll
            for (int i = 0; i < N; ++i) off[i] += (int64_t)at * strides[i][d];
            rest = q;
        }
    }
}

// A row kernel's per-slice partial of a column sum: each warp's sums `acc` (its rows, in order)
// go through shared memory and warp 0 adds them up in warp order into part[col .. col + VEC), so
// the result is bitwise reproducible. The whole block calls it (it holds a barrier).
template <int VEC, typename A>
__device__ __forceinline__ void store_block_column_sums(A (&lanes)[kRowLanes][kTileCols * VEC], const A (&acc)[VEC], A *part,
                                                        int64_t col, bool active) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) lanes[threadIdx.y][threadIdx.x * VEC + j] = acc[j];
    __syncthreads();
    if (threadIdx.y == 0 && active) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            A s = A(0);
#pragma unroll
            for (int lane = 0; lane < kRowLanes; ++lane) s += lanes[lane][threadIdx.x * VEC + j];
            part[col + j] = s;
        }
    }
}

// Column c of the per-slice partials part[0 .. slices)[0 .. cols) (as store_block_column_sums
// writes them), summed in a fixed order by a (kTileCols, kRowLanes) block that owns kTileCols
// columns: lane threadIdx.y sums slices threadIdx.y, threadIdx.y + kRowLanes, ... in turn, then
// the lanes are added up in lane order. The total is valid in the threadIdx.y == 0 threads with
// c < cols (0 without slices). Bitwise reproducible, no atomics; the whole block calls it (it
// holds barriers, and `lanes` may be reused once it returns). One thread per column walking
// every slice took 31 us for 4096 columns on an H200 (16 blocks, 256 dependent loads each);
// this took 5.8 us in the chain's bias gradient.
template <typename A>
__device__ __forceinline__ A block_sum_column_partials(A (&lanes)[kRowLanes][kTileCols], const A *part, int64_t slices,
                                                       int64_t cols, int64_t c) {
    A s = A(0);
    if (c < cols)
        for (int64_t p = threadIdx.y; p < slices; p += kRowLanes) s += part[p * cols + c];
    lanes[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    A total = A(0);
    if (threadIdx.y == 0) {
#pragma unroll
        for (int lane = 0; lane < kRowLanes; ++lane) total += lanes[lane][threadIdx.x];
    }
    __syncthreads();
    return total;
}

// 16 bytes global -> shared without passing through registers (cp.async, sm_80+; .cg skips L1).
// Both addresses must be 16-byte aligned. Completes asynchronously: see copy_async_wait.
__device__ __forceinline__ void copy_async16(void *smem, const void *gmem) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N> __device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Elementary functions. Two things keep elementwise kernels memory-bound on Hopper: no work on
// the conversion/MUFU pipe beyond one op per function (it runs at 1/8 of the FMA rate: F2I, I2F
// and FRND in a range reduction cost as much as the memory traffic of a bf16 element), and, for
// float16/bfloat16 storage, hardware approximations whose error (MUFU.SIN ~2^-21 absolute after
// an exact reduction, tanh.approx ~2^-11 relative) vanishes in the 8-11 bit result.
__device__ __forceinline__ float fast_exp(float x) { return __expf(x); }
// 1 + erf(z) for half-precision storage, in two MUFU ops and ~14 FMA-pipe instructions (erff is
// ~35, which made bf16 gelu compute-bound): erfc(|z|) = t Q(t) exp(-z^2) with t = 1 / (1 + |z|/2)
// and Q a degree-8 fit of erfc(z) exp(z^2) / t on [0, 10]; then 1 + erf(z) = 2 - erfc(z) for
// z >= 0 and erfc(-z) below, so the left tail keeps its relative accuracy (fp32 1 + erff cancels
// to 0 there). Relative error 4e-6 in a float32 simulation against mpmath (with an exact exp; __expf
// adds its own few ulp); on the H200 every float16/bfloat16 gelu from -12 to 8 is within one ulp (a test).
__device__ __forceinline__ float fast_one_plus_erf(float z) {
    const float a = fabsf(z);
    const float t = __fdividef(1.0f, fmaf(0.5f, a, 1.0f));
    float q = -5.902037854e-02f;
    q = fmaf(q, t, 2.843514223e-01f);
    q = fmaf(q, t, -4.867668635e-01f);
    q = fmaf(q, t, 2.776079514e-01f);
    q = fmaf(q, t, -2.633550840e-02f);
    q = fmaf(q, t, 2.025755606e-01f);
    q = fmaf(q, t, 2.431289602e-01f);
    q = fmaf(q, t, 2.823722423e-01f);
    q = fmaf(q, t, 2.820865712e-01f);
    const float erfc_a = t * q * __expf(-a * a);
    return z >= 0.0f ? 2.0f - erfc_a : erfc_a;
}
__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// x = k * pi/2 + r with |r| <= pi/4 (+ rounding), k's low bits in q. Rounding uses the 1.5 * 2^23
// trick (FMA pipe only); the three-part pi/2 (libdevice's) keeps r exact for |x| <= kTrigLimit.
constexpr float kTrigLimit = 105615.0f;
struct Reduced {
    float r;
    int q;
};
__device__ __forceinline__ Reduced reduce_half_pi(float x) {
    const float t = fmaf(x, 0.636619772367581343f, 12582912.0f);
    const float k = t - 12582912.0f;
    float r = fmaf(k, -1.57079625129699707031f, x);
    r = fmaf(k, -7.54978941586159635335e-08f, r);
    r = fmaf(k, -5.39030252995776476554e-15f, r);
    return {r, __float_as_int(t)};  // the integer k sits in the low mantissa bits: q & 3 == k & 3
}

// sin and cos of a reduced argument, |r| <= pi/4: minimax polynomials (Cephes), ~1 ulp.
__device__ __forceinline__ void sincos_poly(float r, float &s, float &c) {
    const float z = r * r;
    s = fmaf(fmaf(fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f), z * r, r);
    c = fmaf(fmaf(fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f), z, 4.166664568298827e-2f), z * z,
             fmaf(-0.5f, z, 1.0f));
}

// sin(k pi/2 + r) from sin r and cos r.
__device__ __forceinline__ float quadrant_sin(int q, float s, float c) {
    const float v = (q & 1) ? c : s;
    return (q & 2) ? -v : v;
}

// Exact float32 sin/cos (float32 storage) for |x| <= kTrigLimit; callers check the range once
// per pack and send the rest (large, inf, NaN) to large_sincos below.
__device__ __forceinline__ void precise_sincos_in_range(float x, float *s, float *c) {
    const Reduced a = reduce_half_pi(x);
    float ps, pc;
    sincos_poly(a.r, ps, pc);
    *s = quadrant_sin(a.q, ps, pc);
    *c = quadrant_sin(a.q + 1, ps, pc);
}
__device__ __forceinline__ float precise_sin_in_range(float x) {
    const Reduced a = reduce_half_pi(x);
    float s, c;
    sincos_poly(a.r, s, c);
    return quadrant_sin(a.q, s, c);
}
__device__ __forceinline__ float precise_cos_in_range(float x) {
    const Reduced a = reduce_half_pi(x);
    float s, c;
    sincos_poly(a.r, s, c);
    return quadrant_sin(a.q + 1, s, c);
}

// Half-storage sin/cos: the same exact reduction, then one MUFU.SIN on r or r + pi/2.
__device__ __forceinline__ float fast_sin_turns_in_range(float x, int turns) {
    const Reduced a = reduce_half_pi(x);
    const int q = a.q + turns;
    const float v = __sinf(a.r + ((q & 1) ? 1.57079632679489662f : 0.0f));
    return (q & 2) ? -v : v;
}
__device__ __forceinline__ float fast_sin_in_range(float x) { return fast_sin_turns_in_range(x, 0); }
__device__ __forceinline__ float fast_cos_in_range(float x) { return fast_sin_turns_in_range(x, 1); }
__device__ __forceinline__ void fast_sincos_in_range(float x, float *s, float *c) {
    const Reduced a = reduce_half_pi(x);
    const float ps = __sinf(a.r), pc = __cosf(a.r);
    *s = quadrant_sin(a.q, ps, pc);
    *c = quadrant_sin(a.q + 1, ps, pc);
}

// Beyond kTrigLimit: the exact Payne-Hanek reduction (trig_reduce.h), then the polynomials.
__device__ __forceinline__ void large_sincos(float x, float *s, float *c) {
    if (!isfinite(x)) {
        *s = *c = x - x;  // NaN for inf and NaN
        return;
    }
    int q;
    const float r = (float)brrr_reduce_large(x, &q);
    float ps, pc;
    sincos_poly(r, ps, pc);
    *s = quadrant_sin(q, ps, pc);
    *c = quadrant_sin(q + 1, ps, pc);
}
__device__ __forceinline__ float large_sin(float x) {
    float s, c;
    large_sincos(x, &s, &c);
    return s;
}
__device__ __forceinline__ float large_cos(float x) {
    float s, c;
    large_sincos(x, &s, &c);
    return c;
}

// The same with the range check, for code that handles one element at a time.
__device__ __forceinline__ bool trig_in_range(float x) { return fabsf(x) <= kTrigLimit; }
__device__ __forceinline__ float precise_sin(float x) { return trig_in_range(x) ? precise_sin_in_range(x) : large_sin(x); }
__device__ __forceinline__ float precise_cos(float x) { return trig_in_range(x) ? precise_cos_in_range(x) : large_cos(x); }
__device__ __forceinline__ float fast_sin(float x) { return trig_in_range(x) ? fast_sin_in_range(x) : large_sin(x); }
__device__ __forceinline__ float fast_cos(float x) { return trig_in_range(x) ? fast_cos_in_range(x) : large_cos(x); }
__device__ __forceinline__ void precise_sincos(float x, float *s, float *c) {
    if (trig_in_range(x)) precise_sincos_in_range(x, s, c);
    else large_sincos(x, s, c);
}
__device__ __forceinline__ void fast_sincos(float x, float *s, float *c) {
    if (trig_in_range(x)) fast_sincos_in_range(x, s, c);
    else large_sincos(x, s, c);
}

__device__ __forceinline__ void sincos_f64(double x, double *s, double *c) { sincos(x, s, c); }

// Run on `device`, restoring the caller's current device afterwards.
struct DeviceGuard {
    int previous = -1, device;
    cudaError_t error;
    explicit DeviceGuard(int dev) : device(dev) {
        error = cudaGetDevice(&previous);
        if (error == cudaSuccess && previous != device) error = cudaSetDevice(device);
    }
    ~DeviceGuard() {
        if (previous >= 0 && previous != device) cudaSetDevice(previous);
    }
};

inline int sm_count(int device) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 1;
    return n;
}

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace brrr
