// Kernels compiled at run time (csrc/chain_jit.c compiles them with NVRTC): loaded from their
// cubin with the runtime's library API, which the static cudart provides, so brrr links neither
// libcuda nor libnvrtc. A library is context-independent: its kernels load into each device's
// context on first use.
#include <cuda_runtime.h>

#include "brrr_cuda.h"
#include "common.cuh"

extern "C" int brrr_cuda_library_load(const void *image, int n, const char *const *kernel_names, void **kernels) {
    cudaLibrary_t lib;
    cudaError_t err = cudaLibraryLoadData(&lib, image, nullptr, nullptr, 0, nullptr, nullptr, 0);
    if (err != cudaSuccess) return (int)err;
    for (int i = 0; i < n && err == cudaSuccess; i++) {
        cudaKernel_t k;
        err = cudaLibraryGetKernel(&k, lib, kernel_names[i]);
        kernels[i] = reinterpret_cast<void *>(k);
    }
    if (err != cudaSuccess) cudaLibraryUnload(lib);
    return (int)err;
}

// cudaLaunchKernel takes a cudaKernel_t cast to the function pointer it otherwise expects.
extern "C" int brrr_cuda_kernel_launch(void *kernel, const unsigned grid[3], const unsigned block[3], const void *param,
                                       int device, void *stream) {
    brrr::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return (int)guard.error;
    void *args[] = {const_cast<void *>(param)};
    return (int)cudaLaunchKernel(static_cast<const void *>(kernel), dim3(grid[0], grid[1], grid[2]),
                                 dim3(block[0], block[1], block[2]), args, 0, static_cast<cudaStream_t>(stream));
}

extern "C" int brrr_cuda_device_arch(int device, int *arch) {
    int major = 0, minor = 0;
    cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    *arch = 10 * major + minor;
    return (int)err;
}

extern "C" int brrr_cuda_multiprocessors(int device, int *count) {
    *count = brrr::sm_count(device);
    return 0;
}

extern "C" int brrr_cuda_stream_capturing(void *stream, int *capturing) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t err = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status);
    *capturing = status != cudaStreamCaptureStatusNone;
    return (int)err;
}
