// Bias + dropout + residual add launcher: pick the device and the dtype; the kernels live in
// dropout_kernels.cuh.
#include "brrr_cuda.h"
#include "common.cuh"

namespace brrr {
namespace dropout {
template <typename T> cudaError_t dropout_typed(const brrr_dropout_launch &L, int device, cudaStream_t stream);
}  // namespace dropout
}  // namespace brrr

extern "C" int brrr_cuda_dropout(const brrr_dropout_launch *L, int device, void *stream_ptr) {
    using namespace brrr::dropout;
    brrr::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return (int)guard.error;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    switch (L->dtype) {
    case BRRR_F32: return (int)dropout_typed<float>(*L, device, stream);
    case BRRR_F16: return (int)dropout_typed<__half>(*L, device, stream);
    case BRRR_BF16: return (int)dropout_typed<__nv_bfloat16>(*L, device, stream);
    case BRRR_F64: return (int)dropout_typed<double>(*L, device, stream);
    default: return (int)cudaErrorInvalidValue;
    }
}
