#include "dropout_kernels.cuh"

template cudaError_t brrr::dropout::dropout_typed<__nv_bfloat16>(const brrr_dropout_launch &, int, cudaStream_t);
