// Runtime queries for build_info() and cuda_available(), and the wait at the end of a call on an
// unknown stream (csrc/brrr.h: wait_for_kernels); nothing here launches work.
#include <cuda_runtime.h>

#include "brrr_cuda.h"

extern "C" int brrr_cuda_device_count(int *count) {
    cudaError_t err = cudaGetDeviceCount(count);
    if (err != cudaSuccess) {
        *count = 0;
        cudaGetLastError();  // no driver or no device is an answer, not an error to keep
    }
    return (int)err;
}

extern "C" int brrr_cuda_runtime_version(int *version) { return (int)cudaRuntimeGetVersion(version); }

extern "C" int brrr_cuda_driver_version(int *version) { return (int)cudaDriverGetVersion(version); }

extern "C" const char *brrr_cuda_error_string(int error) { return cudaGetErrorString((cudaError_t)error); }

extern "C" int brrr_cuda_stream_synchronize(void *stream) {
    return (int)cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
}
