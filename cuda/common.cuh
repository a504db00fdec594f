// Device-side helpers shared by the kernels: storage <-> compute conversions, 16-byte vector
// access, and a device guard; the elementary functions are in elementary.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "brrr_cuda.h"
#include "elementary.cuh"

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

// A bfloat16 is the upper half of its float32: a pair's floats are its 32-bit word shifted up and
// masked, one instruction each, where ptxas makes the upper half's __bfloat162float two (PRMT,
// then a multiply by 2^16). The pairs are read as a Pack of words of the same bytes and alignment.
template <typename T, int N, typename A>
__device__ __forceinline__ void load_pack(const T *p, A *out) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value && std::is_same<A, float>::value && N % 2 == 0) {
        const Pack<unsigned, N / 2> words = *reinterpret_cast<const Pack<unsigned, N / 2> *>(p);
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {
            out[2 * j] = __uint_as_float(words.v[j] << 16);
            out[2 * j + 1] = __uint_as_float(words.v[j] & 0xffff0000u);
        }
    } else {
        Pack<T, N> pk = *reinterpret_cast<const Pack<T, N> *>(p);
#pragma unroll
        for (int j = 0; j < N; ++j) out[j] = to_float(pk.v[j]);
    }
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

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// (sm_90: thread block clusters; the softmax row kernel and the widest norm backward.)
// Cluster barriers (every thread of every block of the cluster), and a store into the shared
// memory of block `rank` of the cluster at the address `local` has in this block.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_map(const void *local, unsigned rank) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
                 : "=r"(remote)
                 : "r"(static_cast<unsigned>(__cvta_generic_to_shared(local))), "r"(rank));
    return remote;
}
__device__ __forceinline__ void cluster_store(unsigned remote, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(remote), "f"(v) : "memory");
}
__device__ __forceinline__ void cluster_store(unsigned remote, double v) {
    asm volatile("st.shared::cluster.f64 [%0], %1;\n" ::"r"(remote), "d"(v) : "memory");
}
#endif

// The launch configuration of blocks of `block` threads with `bytes` of dynamic shared memory on
// `stream`, in clusters of `cluster` blocks along x (the attribute only where cluster > 1); the
// caller sets gridDim. cfg points at attr, so attr must live as long as cfg is used.
inline void cluster_launch_config(cudaLaunchConfig_t &cfg, cudaLaunchAttribute &attr, dim3 block, size_t bytes,
                                  cudaStream_t stream, int cluster) {
    cfg = {};
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = bytes;
    cfg.stream = stream;
    attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = (unsigned)cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = cluster > 1 ? 1 : 0;
}

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

// Device attribute A of `device`, kept per device after the first successful query (the runtime
// call costs host time on every launch); `fallback` where the query fails.
template <cudaDeviceAttr A>
inline int device_attribute(int device, int fallback) {
    static std::atomic<int> kept[64];
    int v = device >= 0 && device < 64 ? kept[device].load(std::memory_order_relaxed) : 0;
    if (v > 0) return v;
    if (cudaDeviceGetAttribute(&v, A, device) != cudaSuccess || v <= 0) return fallback;
    if (device >= 0 && device < 64) kept[device].store(v, std::memory_order_relaxed);
    return v;
}

inline int sm_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device, 1); }

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace brrr
