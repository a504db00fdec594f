#include "dropout_kernels.cuh"

template cudaError_t brrr::dropout::dropout_typed<float>(const brrr_dropout_launch &, int, cudaStream_t);
