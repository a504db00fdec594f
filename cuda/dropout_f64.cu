#include "dropout_kernels.cuh"

template cudaError_t brrr::dropout::dropout_typed<double>(const brrr_dropout_launch &, int, cudaStream_t);
