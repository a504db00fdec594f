// Device-side helpers shared by the kernels: storage <-> compute conversions, 16-byte vector
// access, the fast elementary functions used for half-precision storage, and a device guard.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

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

// Fast elementary functions for float16/bfloat16 storage, whose 8-11 bit mantissas make the
// hardware approximations (MUFU, relative error ~2^-21 after an exact range reduction; tanh
// ~2^-11) invisible after rounding, and which would otherwise make bf16 chains compute-bound.
__device__ __forceinline__ float fast_exp(float x) { return __expf(x); }
__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// sin(x + quarter_turns * pi/2): reduce x by pi/2 in two FMA steps (Cody-Waite), then one MUFU.SIN
// on |r| <= 3pi/4. Arguments beyond 1e5 take the exact libdevice path.
__device__ __forceinline__ float fast_sin_quadrant(float x, int quarter_turns) {
    if (fabsf(x) > 1.0e5f) return quarter_turns ? cosf(x) : sinf(x);
    float k = rintf(x * 0.636619772367581343f);
    float r = fmaf(k, -1.57079637050628662109375f, x);
    r = fmaf(k, 4.37113882867379290e-08f, r);
    int q = (int)k + quarter_turns;
    float v = __sinf(r + (float)(q & 1) * 1.57079632679489662f);
    return (q & 2) ? -v : v;
}
__device__ __forceinline__ float fast_sin(float x) { return fast_sin_quadrant(x, 0); }
__device__ __forceinline__ float fast_cos(float x) { return fast_sin_quadrant(x, 1); }

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
