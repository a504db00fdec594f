// Softmax launcher: picks the device and the (x, y) dtype pair; the kernels are in softmax.cuh.
#include "softmax.cuh"

template <typename TX, typename TY>
static cudaError_t launch(const brrr_softmax_launch *L, int device, cudaStream_t stream) {
    return brrr::softmax::launch<TX, TY>(*L, device, stream);
}

extern "C" int brrr_cuda_softmax(const brrr_softmax_launch *L, int device, void *stream_ptr) {
    brrr::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return (int)guard.error;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    const bool wide = L->y_dtype != L->x_dtype;  // float32 y for float16/bfloat16 x
    switch (L->x_dtype) {
    case BRRR_F32: return (int)launch<float, float>(L, device, stream);
    case BRRR_F64: return (int)launch<double, double>(L, device, stream);
    case BRRR_F16: return (int)(wide ? launch<__half, float>(L, device, stream) : launch<__half, __half>(L, device, stream));
    case BRRR_BF16:
        return (int)(wide ? launch<__nv_bfloat16, float>(L, device, stream) : launch<__nv_bfloat16, __nv_bfloat16>(L, device, stream));
    default: return (int)cudaErrorInvalidValue;
    }
}
