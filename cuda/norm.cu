// Norm launchers: pick the device and the dtype; the kernels live in norm_kernels.cuh.
#include "brrr_cuda.h"
#include "common.cuh"

namespace brrr {
namespace norm {
template <typename T> cudaError_t norm_fwd_typed(const brrr_norm_launch &L, int device, cudaStream_t stream);
template <typename T> cudaError_t norm_bwd_typed(const brrr_norm_launch &L, int device, cudaStream_t stream);

template <typename T>
static cudaError_t typed(const brrr_norm_launch &L, bool backward, int device, cudaStream_t stream) {
    return backward ? norm_bwd_typed<T>(L, device, stream) : norm_fwd_typed<T>(L, device, stream);
}

static int launch(const brrr_norm_launch *L, bool backward, int device, void *stream_ptr) {
    DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return (int)guard.error;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    cudaError_t err;
    switch (L->dtype) {
    case BRRR_F32: err = typed<float>(*L, backward, device, stream); break;
    case BRRR_F16: err = typed<__half>(*L, backward, device, stream); break;
    case BRRR_BF16: err = typed<__nv_bfloat16>(*L, backward, device, stream); break;
    case BRRR_F64: err = typed<double>(*L, backward, device, stream); break;
    default: return (int)cudaErrorInvalidValue;
    }
    if (err != cudaSuccess) return (int)err;
    return (int)cudaGetLastError();
}

}  // namespace norm
}  // namespace brrr

extern "C" int brrr_cuda_norm_fwd(const brrr_norm_launch *L, int device, void *stream) {
    return brrr::norm::launch(L, false, device, stream);
}

extern "C" int brrr_cuda_norm_bwd(const brrr_norm_launch *L, int device, void *stream) {
    return brrr::norm::launch(L, true, device, stream);
}
