#include "dropout_kernels.cuh"

template cudaError_t brrr::dropout::dropout_typed<__half>(const brrr_dropout_launch &, int, cudaStream_t);
