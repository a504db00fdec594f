// Softmax cross-entropy launchers: pick the device and the dtype; the kernels live in
// xent_kernels.cuh. Here too the kernel of linear_cross_entropy's backward, which scales the
// gradients its forward computed (brrr_xent_scale_launch), instantiated per pair of dtypes.
#include <type_traits>

#include "brrr_cuda.h"
#include "common.cuh"

namespace brrr {
namespace xent {
template <typename T> cudaError_t xent_fwd_typed(const brrr_xent_launch &L, cudaStream_t stream);
template <typename T> cudaError_t xent_bwd_typed(const brrr_xent_launch &L, cudaStream_t stream);

// ---- scaling: out[i] = round(acc[i] * factor) ----------------------------------------------------

// A rounded once into Out; float64 into a half type through float32, as PyTorch converts it.
template <typename Out> __device__ __forceinline__ Out round_to(float v) { return to_storage<Out, float>(v); }
template <typename Out> __device__ __forceinline__ Out round_to(double v) {
    if constexpr (std::is_same<Out, double>::value) return v;
    else return to_storage<Out, float>((float)v);
}

// The factor in the compute dtype A, exactly (the glue takes a float64 factor only for A double).
template <typename A> __device__ __forceinline__ A load_factor(const brrr_xent_scale_launch &L) {
    if (L.factor == nullptr) return A(1);
    switch (L.factor_dtype) {
    case BRRR_F64: return A(*static_cast<const double *>(L.factor));
    case BRRR_F16: return A(__half2float(*static_cast<const __half *>(L.factor)));
    case BRRR_BF16: return A(__bfloat162float(*static_cast<const __nv_bfloat16 *>(L.factor)));
    default: return A(*static_cast<const float *>(L.factor));
    }
}

// round(v[j] * g) for the 16 / sizeof(Out) elements at p (16-byte aligned), in one 16-byte store:
// written as a Pack (common.cuh's store_pack), nvcc 13 split most of these stores into 2- and
// 4-byte ones.
template <typename Out, typename A, int P>
__device__ __forceinline__ void store_scaled(Out *p, const A (&v)[P], A g) {
    Pack<Out, P> pk;
#pragma unroll
    for (int j = 0; j < P; ++j) pk.v[j] = round_to<Out>(v[j] * g);
    uint4 w;
    memcpy(&w, &pk, 16);
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(__cvta_generic_to_global(p)), "r"(w.x), "r"(w.y),
                 "r"(w.z), "r"(w.w)
                 : "memory");
}

// Packs of acc needing 4 16-byte loads per thread in flight to keep the memory busy.
template <typename In, typename Out> constexpr int scale_unroll() {
    return sizeof(In) / sizeof(Out) >= 4 ? 1 : 4 / (int)(sizeof(In) / sizeof(Out));
}

// out[i] = round(acc[i] * g) (brrr_cuda.h) over packs of P = 16 / sizeof(Out) elements: one
// 16-byte store of out and W = sizeof(In) / sizeof(Out) 16-byte loads of acc each. The grid's
// threads take U packs a step, at a stride of the grid's threads (coalesced), all loaded before
// any is stored: where out is acc itself, each element is read, then written, by one thread. Then
// the packs left one at a time, and the `scalars` one by one: the elements before the packs
// (`head`, up to out's first 16-byte boundary; all of them when acc and out are not 16-byte
// aligned at the same element) and after the last whole pack.
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads) xent_scale_kernel(const __grid_constant__ brrr_xent_scale_launch L,
                                                              int64_t head, int64_t packs) {
    using A = typename Compute<In>::type;
    constexpr int P = 16 / sizeof(Out), Q = 16 / sizeof(In), W = P / Q, U = scale_unroll<In, Out>();
    const A g = load_factor<A>(L);
    const In *x = static_cast<const In *>(L.acc), *xb = x + head;
    Out *y = static_cast<Out *>(L.out), *yb = y + head;
    const int64_t threads = (int64_t)gridDim.x * kThreads;
    int64_t k = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    for (; k + (U - 1) * threads < packs; k += U * threads) {
        A v[U][P];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int w = 0; w < W; ++w) load_pack<In, Q>(xb + (k + u * threads) * P + w * Q, v[u] + w * Q);
#pragma unroll
        for (int u = 0; u < U; ++u) store_scaled(yb + (k + u * threads) * P, v[u], g);
    }
    for (; k < packs; k += threads) {
        A v[P];
#pragma unroll
        for (int w = 0; w < W; ++w) load_pack<In, Q>(xb + k * P + w * Q, v + w * Q);
        store_scaled(yb + k * P, v, g);
    }
    const int64_t body_end = head + packs * P, scalars = head + (L.n - body_end);
    for (int64_t s = (int64_t)blockIdx.x * kThreads + threadIdx.x; s < scalars; s += (int64_t)gridDim.x * kThreads) {
        const int64_t i = s < head ? s : body_end + (s - head);
        y[i] = round_to<Out>(A(to_float(x[i])) * g);
    }
}

template <typename In, typename Out>
cudaError_t xent_scale_typed(const brrr_xent_scale_launch &L, cudaStream_t stream) {
    constexpr int P = 16 / sizeof(Out), U = scale_unroll<In, Out>();
    const In *x = static_cast<const In *>(L.acc);
    const Out *y = static_cast<const Out *>(L.out);
    int64_t head = (int64_t)(((16u - (reinterpret_cast<uintptr_t>(y) & 15u)) & 15u) / sizeof(Out));
    if (head > L.n || !aligned16(x + head)) head = L.n;  // no packs: every element one by one
    const int64_t packs = (L.n - head) / P, scalars = L.n - packs * P;
    // One step of U packs per thread, or one scalar per thread where there are more of those.
    const int64_t steps = (packs + (int64_t)U * kThreads - 1) / ((int64_t)U * kThreads);
    int64_t blocks = (scalars + kThreads - 1) / kThreads;
    blocks = steps > blocks ? steps : blocks;
    const int64_t cap = ((int64_t)1 << 31) - 1;
    xent_scale_kernel<In, Out><<<(unsigned)(blocks < cap ? blocks : cap), kThreads, 0, stream>>>(L, head, packs);
    return cudaGetLastError();
}

// The pairs of dtypes brrr_cuda.h takes: out in acc's dtype, or narrower than a float32 or float64 acc.
static cudaError_t xent_scale_dispatch(const brrr_xent_scale_launch &L, cudaStream_t stream) {
    const int32_t in = L.dtype, out = L.out_dtype;
    if (in == BRRR_F64) {
        switch (out) {
        case BRRR_F64: return xent_scale_typed<double, double>(L, stream);
        case BRRR_F32: return xent_scale_typed<double, float>(L, stream);
        case BRRR_BF16: return xent_scale_typed<double, __nv_bfloat16>(L, stream);
        case BRRR_F16: return xent_scale_typed<double, __half>(L, stream);
        default: return cudaErrorInvalidValue;
        }
    }
    if (in == BRRR_F32) {
        switch (out) {
        case BRRR_F32: return xent_scale_typed<float, float>(L, stream);
        case BRRR_BF16: return xent_scale_typed<float, __nv_bfloat16>(L, stream);
        case BRRR_F16: return xent_scale_typed<float, __half>(L, stream);
        default: return cudaErrorInvalidValue;
        }
    }
    if (in != out) return cudaErrorInvalidValue;
    if (in == BRRR_BF16) return xent_scale_typed<__nv_bfloat16, __nv_bfloat16>(L, stream);
    if (in == BRRR_F16) return xent_scale_typed<__half, __half>(L, stream);
    return cudaErrorInvalidValue;
}

}  // namespace xent
}  // namespace brrr

template <bool kBackward>
static int xent_dispatch(const brrr_xent_launch *L, int device, void *stream_ptr) {
    using namespace brrr::xent;
    brrr::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return (int)guard.error;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    switch (L->dtype) {
    case BRRR_F32: return (int)(kBackward ? xent_bwd_typed<float>(*L, stream) : xent_fwd_typed<float>(*L, stream));
    case BRRR_F16: return (int)(kBackward ? xent_bwd_typed<__half>(*L, stream) : xent_fwd_typed<__half>(*L, stream));
    case BRRR_BF16:
        return (int)(kBackward ? xent_bwd_typed<__nv_bfloat16>(*L, stream) : xent_fwd_typed<__nv_bfloat16>(*L, stream));
    case BRRR_F64: return (int)(kBackward ? xent_bwd_typed<double>(*L, stream) : xent_fwd_typed<double>(*L, stream));
    default: return (int)cudaErrorInvalidValue;
    }
}

extern "C" int brrr_cuda_xent_fwd(const brrr_xent_launch *L, int device, void *stream) {
    return xent_dispatch<false>(L, device, stream);
}
extern "C" int brrr_cuda_xent_bwd(const brrr_xent_launch *L, int device, void *stream) {
    return xent_dispatch<true>(L, device, stream);
}
extern "C" int brrr_cuda_xent_scale(const brrr_xent_scale_launch *L, int device, void *stream) {
    if (L->n == 0) return 0;
    brrr::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return (int)guard.error;
    return (int)brrr::xent::xent_scale_dispatch(*L, static_cast<cudaStream_t>(stream));
}
