// Softmax cross-entropy launchers: pick the device and the dtype; the kernels live in
// xent_kernels.cuh.
#include "brrr_cuda.h"
#include "common.cuh"

namespace brrr {
namespace xent {
template <typename T> cudaError_t xent_fwd_typed(const brrr_xent_launch &L, cudaStream_t stream);
template <typename T> cudaError_t xent_bwd_typed(const brrr_xent_launch &L, cudaStream_t stream);
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
