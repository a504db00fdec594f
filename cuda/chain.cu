// Chain launchers: pick the device and the dtype; the kernels live in chain_kernels.cuh.
#include "brrr_cuda.h"
#include "common.cuh"

namespace brrr {
template <typename T> void chain_fwd_typed(const brrr_chain_launch &L, int device, cudaStream_t stream);
template <typename T> void chain_bwd_typed(const brrr_chain_launch &L, int device, cudaStream_t stream);
template <typename T> void chain_vector_grad_typed(const brrr_chain_launch &L, cudaStream_t stream);

template <typename T>
static void chain_typed(const brrr_chain_launch &L, bool backward, int device, cudaStream_t stream) {
    backward ? chain_bwd_typed<T>(L, device, stream) : chain_fwd_typed<T>(L, device, stream);
}

static int launch(const brrr_chain_launch *L, bool backward, int device, void *stream_ptr) {
    DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return (int)guard.error;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    switch (L->dtype) {
    case BRRR_F32: chain_typed<float>(*L, backward, device, stream); break;
    case BRRR_F16: chain_typed<__half>(*L, backward, device, stream); break;
    case BRRR_BF16: chain_typed<__nv_bfloat16>(*L, backward, device, stream); break;
    case BRRR_F64: chain_typed<double>(*L, backward, device, stream); break;
    default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}

}  // namespace brrr

extern "C" int brrr_cuda_chain_fwd(const brrr_chain_launch *L, int device, void *stream) {
    return brrr::launch(L, false, device, stream);
}

extern "C" int brrr_cuda_chain_bwd(const brrr_chain_launch *L, int device, void *stream) {
    return brrr::launch(L, true, device, stream);
}

extern "C" int brrr_cuda_chain_vector_grad(const brrr_chain_launch *L, int device, void *stream_ptr) {
    brrr::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return (int)guard.error;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    switch (L->dtype) {
    case BRRR_F32: brrr::chain_vector_grad_typed<float>(*L, stream); break;
    case BRRR_F16: brrr::chain_vector_grad_typed<__half>(*L, stream); break;
    case BRRR_BF16: brrr::chain_vector_grad_typed<__nv_bfloat16>(*L, stream); break;
    case BRRR_F64: brrr::chain_vector_grad_typed<double>(*L, stream); break;
    default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}
