#include "norm_kernels.cuh"

template cudaError_t brrr::norm::norm_fwd_typed<float>(const brrr_norm_launch &, int, cudaStream_t);
