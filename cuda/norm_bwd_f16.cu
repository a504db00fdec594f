#include "norm_kernels.cuh"

template cudaError_t brrr::norm::norm_bwd_typed<__half>(const brrr_norm_launch &, int, cudaStream_t);
